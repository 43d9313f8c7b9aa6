"""This process's place in the job (rank, size, machine) and the one object that holds
every piece of per-process state of Shoal's Python side.

`STATE` is the only mutable module-level object of the package: `shutdown()` calls
`STATE.reset()`, so a later `init()` starts from nothing. Every other module reads and
writes its state through it (its `lock` guards compound updates). This module imports
nothing of Shoal but `_core`, so any module may use it without an import cycle.
"""
import threading
import weakref

from ._loader import _core

UNNAMED_LIMIT = 1024  # generated op names cycle through this many (like the core's own)


class ProcessState:
    """Per-process state of the Python side (see the module docstring).

    topology/plan: the static topology (the graph as given) and this rank's plan of it as
    the core keeps it (`_core.topology_plan`: {"version", "weighted", "recv", "send",
    "self_weight", "recv_weights"}), read here without a call into the core;
    machine_*: the same for the graph over machines (an op handle's objects are the core's:
    shoal_attach). windows: window name -> registered tensor; mirrors: name -> host copy of a device
    tensor; window_makers: name -> win_create again (a fault-tolerant recovery recreates
    each window); win_pending: window handle -> (kept objects, finish or None); with_p: window
    ops carry push-sum weights. suspended/skip_negotiate: BlueFog switches (recorded).
    counters: generated-name counters by prefix (bounded, see `unnamed`); traced: the
    same per traced TensorFlow graph (dropped with the graph).
    Fault-tolerant mode (shoal._fault): fault_participants ((serial, weak reference) of
    each object realigned after a loss), fault_serial (how many registered), fault_losses ((time, lost
    launch ranks) per loss), launch_ranks (each current rank's rank at launch; None
    before a loss); process_sets (id -> ProcessSet added, re-added over the survivors).
    `atexit_registered` survives reset (an at-exit hook is registered once per process),
    and so does `ended_below`: op handles below it belong to a runtime that `shutdown()`
    ended (the core numbers handles once per process, so no later op reuses one).
    """

    def __init__(self):
        self.lock = threading.RLock()
        self.atexit_registered = False
        self.ended_below = 0
        self.calls = threading.local()  # per thread: inside an op entry point (shoal._ops._told)
        # Fault-tolerant mode: the kept objects of window ops of runtimes a loss ended (one
        # may still be stuck in MPI on the lost rank, reading them): kept for good.
        self.abandoned = []
        self.reset()

    def reset(self):
        with self.lock:
            self.ended_below = _core.next_handle()
            self.topology, self.plan = None, None
            self.machine_topology, self.machine_plan = None, None
            self.windows, self.mirrors, self.win_pending = {}, {}, {}
            self.window_makers = {}
            self.with_p = False
            self.suspended = self.skip_negotiate = False
            self.counters = {}
            self.traced = weakref.WeakKeyDictionary()  # traced TF graph -> ops named in it
            self.fault_participants, self.fault_losses, self.launch_ranks = [], [], None
            self.fault_serial = 0
            self.elastic_depth = 0  # inside hvd.elastic.run: a lost rank restores the commit
            self.process_sets = {}  # id -> the ProcessSet added (shrunk after a loss)

    def restart(self):
        """After a loss (shoal._fault): the new runtime starts with no names, topology,
        machine topology or windows; handles of the lost runtime stay pending (they raise);
        its window ops' tensors are kept for good (`abandoned`)."""
        with self.lock:
            self.topology, self.plan = None, None
            self.machine_topology, self.machine_plan = None, None
            self.windows, self.mirrors = {}, {}
            self.abandoned.append(self.win_pending)
            self.win_pending = {}
            self.counters = {}

    def unnamed(self, prefix):
        """A generated op name "<prefix>.<k>", k cycling through UNNAMED_LIMIT values: ranks
        that issue unnamed ops in one order get the same names, and the names (and the
        core's per-name tables) stay bounded however long the run."""
        with self.lock:
            k = self.counters.get(prefix, 0)
            self.counters[prefix] = (k + 1) % UNNAMED_LIMIT
        return f"{prefix}.{k}"


STATE = ProcessState()


def require_init():
    if not _core.is_initialized():
        raise ValueError("Shoal is not initialized; call shoal.init() first")


def _accessor(name, doc):
    query = getattr(_core, name)

    def get():
        value = query()
        if value < 0:
            raise ValueError("Shoal is not initialized; call shoal.init() first")
        return value
    get.__name__ = get.__qualname__ = name
    get.__doc__ = doc
    return get


rank = _accessor("rank", "This process's rank in [0, size()).")
size = _accessor("size", "Number of processes in the job.")
local_rank = _accessor("local_rank", "Rank among the processes of this machine (see SHOAL_RANKS_PER_MACHINE).")
local_size = _accessor("local_size", "Number of processes on this machine (see SHOAL_RANKS_PER_MACHINE).")
machine_rank = _accessor("machine_rank", "Index of this process's machine: rank() // local_size() on a "
                                         "homogeneous job.")
machine_size = _accessor("machine_size", "Number of machines: size() // local_size() on a homogeneous job.")


def is_homogeneous():
    """True when every machine has the same number of ranks, placed contiguously."""
    require_init()
    return _core.is_homogeneous()


def static_plan():
    """(plan, weighted) of the static topology. Pure Python (no call into the core) so
    torch.compile can trace through it."""
    if STATE.plan is None:
        raise ValueError("Shoal is not initialized; call shoal.init() first")
    return STATE.plan, STATE.plan["weighted"]


def machine_plan():
    if STATE.machine_plan is None:
        raise RuntimeError("hierarchical_neighbor_allreduce in static mode needs "
                           "set_machine_topology(...) first")
    return STATE.machine_plan, STATE.machine_plan["weighted"]


def in_neighbor_ranks():
    """Ranks this rank receives from in the current topology (sorted, self excluded);
    [] when there is no topology (before init() or after shutdown(), as in BlueFog)."""
    plan = STATE.plan
    return list(plan["recv"]) if plan else []


def out_neighbor_ranks():
    """Ranks this rank sends to in the current topology (sorted, self excluded); [] when
    there is no topology."""
    plan = STATE.plan
    return list(plan["send"]) if plan else []
