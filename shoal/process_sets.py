"""Horovod's process sets: `ProcessSet`, `add_process_set`, `remove_process_set`,
`global_process_set` (semantics of Horovod 0.28 `horovod/common/process_sets.py`, dynamic
process sets), over the core's (core/src/process_sets/process_sets.h).

A process set is a sub-communicator over some of the ranks. Every rank calls
`add_process_set` and `remove_process_set` with the same arguments and in the same order
(non-members too, as in Horovod); the calls agree through one global exchange, so ranks
that disagree all raise the same error. Collectives take `process_set=`: only the set's
members call them, their names are scoped per set, and they negotiate with the set's own
coordinator (its first rank) and run on the set's own communicator, so ops in disjoint sets
never wait for each other. Unlike Horovod, no setting (HOROVOD_DYNAMIC_PROCESS_SETS) is
needed to add sets after `init()`.
"""
import operator

from . import _process
from ._loader import _core


def _as_ranks(ranks_or_comm):
    """(sorted int ranks, None), or (None, why they are not ranks)."""
    if type(ranks_or_comm).__module__.startswith("mpi4py"):
        return None, ("ProcessSet: a process set from an mpi4py communicator is not supported in Shoal; pass "
                      "the list of its world ranks")
    try:
        items = list(ranks_or_comm)
    except TypeError:
        return None, f"ProcessSet: expected a list of int ranks, got {type(ranks_or_comm).__name__}"
    ranks = []
    for r in items:
        try:
            if isinstance(r, bool):
                raise TypeError
            ranks.append(min(max(operator.index(r), -2**31), 2**31 - 1))  # the core's int32 (out of range there)
        except TypeError:
            return None, f"ProcessSet: ranks must be ints, got {r!r}"
    return sorted(ranks), None


class ProcessSet:
    """A set of ranks that run collectives together (Horovod's `hvd.ProcessSet`).

    `ProcessSet(ranks)`: world ranks (an iterable of ints, kept sorted in `ranks`). It can
    be used once `add_process_set` has added it on every rank: `process_set_id` is then an
    int > 0 (None before, and after `remove_process_set`). A list that is not ints is
    refused by `add_process_set` (TypeError on every rank, so no rank waits for it).
    `hvd.ProcessSet(mpi4py_comm)` is not supported (the same TypeError).
    """

    process_set_id = None

    def __init__(self, ranks_or_comm):
        self.ranks, self._refusal = _as_ranks(ranks_or_comm)

    def size(self):
        """The number of ranks in the set (None until it is added)."""
        if self.process_set_id is None:
            return None
        return len(_registered(self.process_set_id, "ProcessSet.size"))

    def rank(self):
        """This rank's index in the set's ranks (None until it is added); ValueError on a
        rank outside the set. Use it to read an allgather's result; ops take world ranks
        (broadcast's root_rank), as in Horovod."""
        if self.process_set_id is None:
            return None
        ranks, me = _registered(self.process_set_id, "ProcessSet.rank"), _process.rank()
        if me not in ranks:
            raise ValueError(f"ProcessSet.rank: rank {me} is not a member of {self}")
        return ranks.index(me)

    def included(self):
        """Whether this rank is in the set (None for a set without ranks)."""
        if self.ranks is None:
            return None
        return _process.rank() in self.ranks

    def __str__(self):
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm=None)"

    __repr__ = __str__


class _GlobalProcessSet(ProcessSet):
    """Every rank (Horovod's `hvd.global_process_set`, id 0); it cannot be removed."""

    process_set_id = 0

    def __init__(self):
        self._refusal = None

    @property
    def ranks(self):
        return list(range(_process.size())) if _core.is_initialized() else []


global_process_set = _GlobalProcessSet()


def _registered(process_set_id, what):
    ranks = _core.process_set_ranks(process_set_id)
    if ranks is None:
        _process.require_init()
        raise ValueError(f"{what}: process set {process_set_id} does not exist (removed on every rank?)")
    return ranks


def add_process_set(process_set):
    """Add a process set on every rank (Horovod's `hvd.add_process_set`) and return it.

    `process_set`: a `ProcessSet`, or its world ranks (any order). Every rank calls it, with
    the same ranks and in the same order relative to the other add/remove calls; the
    members make the set's communicator together. Returns the ProcessSet, its
    `process_set_id` set (the same int > 0 on every rank; ids are never reused).

    Raises, the same on every rank: ShoalError when ranks pass different lists, or one calls
    `remove_process_set` instead, or one never calls it (after SHOAL_STALL_CHECK_TIME,
    naming it); ValueError for an empty list, a rank outside [0, size()) or twice, the
    ranks of a set that exists (the global one included: Horovod refuses duplicates);
    TypeError for a list that is not ints on any rank.
    """
    _process.require_init()
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    ps.process_set_id = _core.add_process_set(ps.ranks or [], ps._refusal or "")
    _process.STATE.process_sets[ps.process_set_id] = ps
    return ps


def remove_process_set(process_set):
    """Remove a process set on every rank (Horovod's `hvd.remove_process_set`): True when
    removed; False for the global set or one not added (nothing is done, as in Horovod).
    Every rank calls it, in the same order as the other add/remove calls.

    Raises, the same on every rank: ShoalError when ranks name different sets or make
    another call; ValueError when ops of the set are in flight on some rank (naming the
    ranks: synchronize them first); TypeError for an argument that is not a ProcessSet.
    Afterwards `process_set_id` is None and ops in it raise ValueError.
    """
    _process.require_init()
    if not isinstance(process_set, ProcessSet):
        _core.remove_process_set(-1, f"remove_process_set: expected a ProcessSet, got {type(process_set).__name__}")
    if process_set.process_set_id in (None, 0):
        return False
    _core.remove_process_set(process_set.process_set_id)
    _process.STATE.process_sets.pop(process_set.process_set_id, None)
    process_set.process_set_id = None
    return True


def shrink_process_sets(survivors):
    """Fault-tolerant mode, after a loss (shoal._fault; every survivor, in the same order):
    add each set again over its surviving members, renumbered (`survivors`: the old rank of
    each new one); a set with none left gets process_set_id None. The ProcessSet objects
    keep their identity; their ids and ranks change."""
    new_rank = {old: new for new, old in enumerate(survivors)}
    sets, _process.STATE.process_sets = _process.STATE.process_sets, {}
    for _, ps in sorted(sets.items()):
        ps.ranks = [new_rank[r] for r in ps.ranks if r in new_rank]
        ps.process_set_id = None
        if ps.ranks:
            add_process_set(ps)


def id_of(process_set, what):
    """The core's id of a `process_set=` argument: 0 for None or the global set, a
    ProcessSet's id (ValueError for one not added or removed), or an id itself (int).
    TypeError for anything else. Membership is the core's to check (at the call)."""
    if process_set is None:
        return 0
    if isinstance(process_set, ProcessSet):
        if process_set.process_set_id is None:
            raise ValueError(f"{what}: {process_set} is not added (add_process_set on every rank) or was removed")
        return process_set.process_set_id
    if isinstance(process_set, int) and not isinstance(process_set, bool):
        return process_set
    raise TypeError(f"{what}: process_set must be a shoal.ProcessSet (from add_process_set), got "
                    f"{type(process_set).__name__}")


def layout(process_set_id):
    """(size, this rank's index) of the set with this id (the world's for 0)."""
    if not process_set_id:
        return _process.size(), _process.rank()
    ranks = _registered(process_set_id, "process_set")
    me = _process.rank()
    return len(ranks), (ranks.index(me) if me in ranks else -1)


def check_init_comm(comm):
    """Horovod's `init(comm=...)`: None, every rank of the job (a list of all its ranks, or
    an mpi4py communicator of the job's size) is what Shoal runs on; NotImplementedError
    for fewer ranks (Shoal runs on the whole job: use a process set), ValueError for
    anything else (as Horovod). Called once the runtime has started."""
    if comm is None:
        return
    size = _process.size()
    if type(comm).__module__.startswith("mpi4py"):
        if comm.Get_size() == size:
            return
        given = f"an mpi4py communicator of {comm.Get_size()} ranks"
    else:
        ranks, why = _as_ranks(comm)
        if ranks is None:
            raise ValueError(f"init: comm must be a list of rank integers or an mpi4py communicator ({why})")
        if ranks == list(range(size)):
            return
        given = f"ranks {ranks}"
    raise NotImplementedError(f"init: comm={given}: Shoal runs on every rank of the job ({size}); for "
                              "collectives among some ranks use a process set (hvd.add_process_set(ranks))")


def init_process_sets(process_sets):
    """Horovod's `init(process_sets=...)`: "dynamic" or None (sets are added later), or a
    list of ProcessSet objects (or rank lists) added now, in order, on every rank."""
    if process_sets is None or process_sets == "dynamic":
        return
    if isinstance(process_sets, (str, bytes)) or not hasattr(process_sets, "__iter__"):
        raise TypeError(f"init: process_sets must be 'dynamic' or a list of ProcessSet, got {process_sets!r}")
    for ps in process_sets:
        add_process_set(ps)


__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set"]
