"""Runtime control and the process's communication topology (framework-neutral).

Semantics follow BlueFog's `bluefog.common.basics` (see docs/reference/bluefog-semantics.md
§1.3): `init()` starts the runtime once and (re)sets the topology, by default the
exponential-2 graph; the topology is a weighted `networkx.DiGraph` where edge i→j with
weight w means rank j weights rank i's value by w.
"""
import atexit
import contextlib
import hashlib
import sys

import numpy as np

from . import _compat_env, _fault, _lifecycle, _ops, _win
from . import topology as _topo
from ._loader import _core
from ._numpy import ADAPTER
from .process_sets import check_init_comm as _check_init_comm, init_process_sets as _init_process_sets
from ._process import (STATE, in_neighbor_ranks, is_homogeneous, local_rank, local_size, machine_rank,
                       machine_size, out_neighbor_ranks, rank, require_init as _require_init, size)

ShoalError = _core.ShoalError
NeighborPatternError = _core.NeighborPatternError  # ShoalError and ValueError
RankLostError = _fault.RankLostError  # ShoalError: fault-tolerant mode, a rank died
losses = _fault.losses


class TopologySizeError(ValueError, TypeError):
    """A graph whose node count is not the number of ranks (or machines). A ValueError,
    like Shoal's other argument errors, and a TypeError, as BlueFog raised it."""

def init(topology_fn=None, is_weighted=False, *, process_sets=None, comm=None):
    """Start the runtime (idempotent, thread-safe) and set the topology.

    Args:
        topology_fn: callable ``size -> networkx.DiGraph`` (or mixing matrix); default
            the exponential-2 graph (BlueFog's default). Something not callable there is
            Horovod's first argument, `comm`.
        is_weighted: use the graph's edge weights in neighbor_allreduce (else uniform).
        process_sets: Horovod's keyword: "dynamic" or None (add sets later with
            `add_process_set`), or a list of `ProcessSet` to add now, in order (every rank
            gives the same list; errors as `add_process_set`).
        comm: Horovod's: None, or the job's ranks (a list of all of them, or an mpi4py
            communicator of every rank); fewer ranks raise NotImplementedError
            (`shoal.process_sets.check_init_comm`).

    Works whether or not MPI was initialised before (e.g. by mpi4py).
    Raises ShoalError if MPI cannot start, in a process forked after init(), or when a
    launcher's variables (PMI_*, OMPI_COMM_WORLD_*, SLURM_*) say the job is larger than
    what MPI reports (a Shoal built for another MPI); ValueError for a malformed SHOAL_*
    variable.
    """
    if topology_fn is not None and not callable(topology_fn):  # Horovod's init(comm)
        if comm is not None:
            raise TypeError("init: comm given twice (first argument and comm=)")
        topology_fn, comm = None, topology_fn
    with STATE.lock:
        _compat_env.apply_bluefog_env()  # BLUEFOG_* settings a migrated script sets
        child = None if _core.forked() else _lifecycle.started_by_a_rank()
        if child:
            raise ShoalError(child)
        _core.init()
        mismatch = _lifecycle.launcher_mismatch(_core.size())
        if mismatch:
            _core.shutdown()
            raise ShoalError(mismatch)
        _lifecycle.mark_rank(_core.size())
        _compat_env.link_horovod_timeline(_core.rank())
        if not STATE.atexit_registered:
            atexit.register(_lifecycle.at_exit)
            _lifecycle.install_excepthook()
            STATE.atexit_registered = True
    _check_init_comm(comm)
    topo = topology_fn(size()) if topology_fn is not None else _topo.exponential_two_graph(size())
    set_topology(topo, is_weighted)
    _init_process_sets(process_sets)


def shutdown():
    """Stop the runtime; pending ops fail with ShoalError. `init()` may be called again.
    Peers learn at once that this rank left: their ops that need it fail (ShoalError
    naming it). Windows still open are freed next, which is collective (every rank shuts
    down). Does nothing in a process forked after init(). Resets every piece of the Python
    side's per-process state (`shoal._process.STATE`)."""
    if _core.forked():
        return  # the runtime belongs to the parent
    _lifecycle.record_finish()
    _core.leave()  # first: peers waiting for this rank fail instead of waiting
    _win.free_all_at_exit()  # collective, like BlueFog's windows at shutdown
    with STATE.lock:
        _core.shutdown()
        _core.forget_neighbor_args()
        STATE.reset()


def is_initialized():
    return _core.is_initialized()


def mpi_threads_supported():
    """1 when MPI provides MPI_THREAD_MULTIPLE, else 0 (an int, as BlueFog returns it).
    Raises ValueError before init()."""
    _require_init()
    return 1 if _core.mpi_threads_supported() else 0


def unified_mpi_window_model_supported():
    """True: window ops behave as under MPI's unified memory model.

    BlueFog asked MPI (a collective that created and freed a dummy window) because its
    `win_update` read neighbor buffers straight from window memory. Shoal's window ops
    move data only inside passive-target lock epochs on its window thread, and the user
    never touches window memory, so completed puts are seen by `win_update` under either
    MPI model: the answer is the same on every MPI, and the call is local.
    Raises ValueError before init()."""
    _require_init()
    return True


def nccl_built():
    """True when this build's CUDA plugin includes the NCCL backend (BlueFog: built with
    NCCL). It is used for CUDA tensors only with SHOAL_GPU_BACKEND=nccl. Needs no init()."""
    built, what = _core.gpu_support()
    return bool(built) and "NCCL backend" in what and "no NCCL backend" not in what


def suspend():
    """BlueFog's `suspend` (meant for IPython): kept so scripts run; records the state only.

    BlueFog's switch slowed its background loop to one pass per 3 s and made every op
    fail while on (its guard meant to limit it to IPython never fired). Shoal's idle loop
    already sleeps between polls (at most SHOAL_CYCLE_TIME ms apart; peers' messages
    need those polls), so `suspend()`/`resume()` only set `is_suspended()`, and ops keep
    working in between. Returns None."""
    STATE.suspended = True


def resume():
    """End `suspend()`. Returns None."""
    STATE.suspended = False


def is_suspended():
    return STATE.suspended


def set_skip_negotiate_stage(value):
    """BlueFog's switch to skip its per-op negotiation; recorded, no effect on Shoal.

    BlueFog negotiated every op through rank 0 and needed the switch for pair_gossip and
    for windows on MPIs without MPI_THREAD_MULTIPLE. Shoal negotiates an op only the first
    time its (name, op, signature) is seen and runs pair_gossip and window ops without the
    switch, so mismatch checks stay on. As in BlueFog, a call before init() is ignored
    (with a message). Returns None."""
    if not _core.is_initialized():
        sys.stderr.write("[shoal] set_skip_negotiate_stage before init() is ignored\n")
        return
    STATE.skip_negotiate = bool(value)


def get_skip_negotiate_stage():
    """The value last given to `set_skip_negotiate_stage` (False by default)."""
    return STATE.skip_negotiate


def _give_core(graph, is_weighted, which):
    """Hands `graph` to the core, which keeps this rank's plan of it (neighbor lists and
    receive weights, per version: docs/design.md §7); returns the plan as the core sees it."""
    edges = list(graph.edges(data="weight", default=1.0))
    code = _core.GRAPHS[which]
    _core.set_topology(code, graph.number_of_nodes(), [int(i) for i, _, _ in edges], [int(j) for _, j, _ in edges],
                       [float(w) for _, _, w in edges], bool(is_weighted))
    return _core.topology_plan(code)


def _check_same_everywhere(graph, is_weighted, what):
    """Collective: every rank must pass the same graph (else each rank's neighbor lists
    would disagree with its neighbors'). Compares a digest with one allgather (under one
    name per `what`: the call is blocking and collective)."""
    w = np.ascontiguousarray(_topo.mixing_matrix(graph), dtype=np.float64)
    digest = np.frombuffer(hashlib.sha256(w.tobytes() + bytes([bool(is_weighted)])).digest(), np.uint8)
    every = _ops.synchronize(_ops.allgather(ADAPTER, digest[None, :], name=f"shoal.{what}"))
    differ = [r for r in range(every.shape[0]) if not np.array_equal(every[r], every[0])]
    if differ:
        raise ValueError(f"{what}: ranks {differ} passed a different graph (or is_weighted) than rank 0; "
                         "every rank must pass the same topology")


def _agreed_graph(what, make, nodes, unit):
    """The graph `make()` builds, with `nodes` nodes. An argument error here is also told
    to the peers, whose part of the call's collective check then raises it too (instead
    of waiting for this rank)."""
    try:
        graph = make()
        if graph.number_of_nodes() != nodes:
            raise TopologySizeError(f"{what}: topology has {graph.number_of_nodes()} nodes but there are "
                                    f"{nodes} {unit}")
        return graph
    except (TypeError, ValueError) as exc:
        _core.reject(_ops.ALLGATHER, f"shoal.{what}", isinstance(exc, TypeError), str(exc), process_set=0)
        raise


def set_topology(topology=None, is_weighted=False):
    """Set the static topology used by neighbor ops (BlueFog's `set_topology`).

    Collective: every rank calls it with the same graph (checked with one allgather of a
    digest, so neighbor lists agree across ranks and per-op checks are unnecessary).

    Args:
        topology: `networkx.DiGraph` over ranks 0..size()-1 or a size×size mixing matrix
            (W[i, j] = weight rank j gives rank i); None means the exponential-2 graph.
        is_weighted: combine with the graph's weights instead of uniform weights.
    Returns:
        True, or False (with a message on stderr) while windows exist: their buffers
        follow the topology they were created with.
    Raises:
        TypeError: not a graph or matrix. TopologySizeError (a ValueError and a TypeError,
        as in BlueFog): wrong number of nodes. ValueError: ranks passed different graphs.
    """
    _require_init()
    if _win.windows_exist():
        if local_rank() == 0:
            names = _win.get_current_created_window_names()
            shown = ", ".join(names[:5]) + (f", ... ({len(names)} in all)" if len(names) > 5 else "")
            sys.stderr.write(f"[shoal] set_topology refused: windows exist ({shown}); win_free() them first\n")
        return False
    graph = _agreed_graph("set_topology", lambda: _topo.exponential_two_graph(size()) if topology is None
                          else _topo.as_graph(topology), size(), "ranks")
    _check_same_everywhere(graph, is_weighted, "set_topology")  # always: it is collective
    with STATE.lock:
        STATE.topology, STATE.plan = graph, _give_core(graph, is_weighted, "ranks")
    return True


def set_machine_topology(topology, is_weighted=False):
    """Set the graph over machines used by `hierarchical_neighbor_allreduce`.

    Args: a `networkx.DiGraph` over 0..machine_size()-1 or a mixing matrix; is_weighted as
    in `set_topology`. Collective (checked like `set_topology`). Returns True.
    Raises: ValueError for None and for ranks not placed homogeneously; TopologySizeError
    (ValueError and TypeError) for a wrong node count; TypeError for other types. An
    argument error on one rank is raised on every rank (the peers learn it in the call).
    """
    _require_init()
    if not is_homogeneous():  # known alike on every rank: each raises it
        raise ValueError("set_machine_topology: needs the same number of ranks on every machine, placed "
                         "contiguously (see SHOAL_RANKS_PER_MACHINE)")
    def make():
        if topology is None:
            raise ValueError("set_machine_topology needs a graph over machines")
        return _topo.as_graph(topology)
    graph = _agreed_graph("set_machine_topology", make, machine_size(), "machines")
    _check_same_everywhere(graph, is_weighted, "set_machine_topology")
    with STATE.lock:
        STATE.machine_topology, STATE.machine_plan = graph, _give_core(graph, is_weighted, "machines")
    return True


def load_machine_topology():
    """The machine topology (`networkx.DiGraph`), or None if unset."""
    return STATE.machine_topology


def is_machine_topo_weighted():
    return bool(STATE.machine_plan and STATE.machine_plan["weighted"])


def in_neighbor_machine_ranks():
    """Machines this machine receives from in the machine topology ([] if unset)."""
    plan = STATE.machine_plan
    return list(plan["recv"]) if plan else []


def out_neighbor_machine_ranks():
    """Machines this machine sends to in the machine topology ([] if unset)."""
    plan = STATE.machine_plan
    return list(plan["send"]) if plan else []


def load_topology():
    """The current topology (`networkx.DiGraph`), or None before init()."""
    return STATE.topology


def is_topo_weighted():
    return bool(STATE.plan and STATE.plan["weighted"])


def stats():
    """Counters of this rank's runtime: ops by type, bytes_sent/bytes_received,
    fused_batches, negotiations, coordinator_rounds, cache_hits, global_collectives,
    stalls, errors, names_retired (idle op names forgotten on every rank, past
    SHOAL_NAME_LIMIT names) and held_calls (calls that waited for such a retirement). Values are integers
    since init() or reset_stats()."""
    _require_init()
    return _core.stats()


def reset_stats():
    """Set every counter of `stats()` to zero."""
    _core.reset_stats()


def timeline_start_activity(tensor_name, activity_name):
    """Start a user activity span named `activity_name` on the timeline track of
    `tensor_name` (SHOAL_TIMELINE). Returns False (and does nothing) when the timeline is off."""
    return _core.timeline_start_activity(str(tensor_name), str(activity_name))


def timeline_end_activity(tensor_name):
    """End the innermost activity on `tensor_name`'s track. False when the timeline is off."""
    return _core.timeline_end_activity(str(tensor_name))


@contextlib.contextmanager
def timeline_context(tensor_name, activity_name):
    """`with timeline_context("model", "FORWARD"): ...` records the block as an activity."""
    timeline_start_activity(tensor_name, activity_name)
    try:
        yield
    finally:
        timeline_end_activity(tensor_name)


def mpi_library_version():
    return _core.mpi_library_version()


__all__ = ["ShoalError", "NeighborPatternError", "RankLostError", "losses",
           "init", "shutdown", "is_initialized", "rank", "size", "local_rank",
           "local_size", "machine_rank", "machine_size", "is_homogeneous",
           "mpi_threads_supported", "unified_mpi_window_model_supported", "nccl_built",
           "suspend", "resume", "is_suspended", "set_skip_negotiate_stage",
           "get_skip_negotiate_stage", "TopologySizeError", "set_topology", "load_topology",
           "is_topo_weighted",
           "in_neighbor_ranks", "out_neighbor_ranks", "set_machine_topology",
           "load_machine_topology", "is_machine_topo_weighted", "in_neighbor_machine_ranks",
           "out_neighbor_machine_ranks", "stats", "reset_stats", "timeline_start_activity",
           "timeline_end_activity", "timeline_context",
           "mpi_library_version"]


_core.set_rank_lost_hook(lambda message: _fault.on_rank_lost(message, set_topology))
