"""Runtime control and the process's communication topology (framework-neutral).

Semantics follow BlueFog's `bluefog.common.basics` (see reference/bluefog-semantics.md
§1.3): `init()` starts the runtime once and (re)sets the topology, by default the
exponential-2 graph; the topology is a weighted `networkx.DiGraph` where edge i→j with
weight w means rank j weights rank i's value by w.
"""
import atexit
import threading

import networkx as nx
import numpy as np

from . import topology as _topo
from ._loader import _core

ShoalError = _core.ShoalError

_lock = threading.Lock()
_state = {"topology": None, "weighted": False, "plan": None, "atexit": False}


def _require_init():
    if not _core.is_initialized():
        raise ValueError("Shoal is not initialized; call shoal.init() first")


def init(topology_fn=None, is_weighted=False):
    """Start the runtime (idempotent, thread-safe) and set the topology.

    Args:
        topology_fn: callable ``size -> networkx.DiGraph`` (or mixing matrix); default
            the exponential-2 graph (BlueFog's default).
        is_weighted: use the graph's edge weights in neighbor_allreduce (else uniform).

    Works whether or not MPI was initialised before (e.g. by mpi4py).
    Raises ShoalError if MPI cannot start; ValueError for a malformed SHOAL_* variable.
    """
    with _lock:
        _core.init()
        if not _state["atexit"]:
            atexit.register(_core.finalize_mpi)
            _state["atexit"] = True
    topo = topology_fn(size()) if topology_fn is not None else _topo.exponential_two_graph(size())
    set_topology(topo, is_weighted)


def shutdown():
    """Stop the runtime; pending ops fail with ShoalError. `init()` may be called again."""
    with _lock:
        _core.shutdown()
        _state.update(topology=None, weighted=False, plan=None)


def is_initialized():
    return _core.is_initialized()


def _checked(value):
    if value < 0:
        raise ValueError("Shoal is not initialized; call shoal.init() first")
    return value


def rank():
    """This process's rank in [0, size())."""
    return _checked(_core.rank())


def size():
    """Number of processes in the job."""
    return _checked(_core.size())


def local_rank():
    """Rank among the processes of this machine (see SHOAL_RANKS_PER_MACHINE)."""
    return _checked(_core.local_rank())


def local_size():
    """Number of processes on this machine (see SHOAL_RANKS_PER_MACHINE)."""
    return _checked(_core.local_size())


def machine_rank():
    """Index of this process's machine: rank() // local_size() on a homogeneous job."""
    return _checked(_core.machine_rank())


def machine_size():
    """Number of machines: size() // local_size() on a homogeneous job."""
    return _checked(_core.machine_size())


def is_homogeneous():
    """True when every machine has the same number of ranks, placed contiguously."""
    _require_init()
    return _core.is_homogeneous()


def mpi_threads_supported():
    """True when MPI provides MPI_THREAD_MULTIPLE."""
    _require_init()
    return _core.mpi_threads_supported()


def set_topology(topology=None, is_weighted=False):
    """Set the static topology used by neighbor ops (BlueFog's `set_topology`).

    Args:
        topology: `networkx.DiGraph` over ranks 0..size()-1 or a size×size mixing matrix
            (W[i, j] = weight rank j gives rank i); None means the exponential-2 graph.
        is_weighted: combine with the graph's weights instead of uniform weights.
    Returns:
        True (False is reserved for refusals, e.g. while windows exist).
    Raises:
        TypeError: not a graph or matrix. ValueError: wrong number of nodes.
    """
    _require_init()
    graph = _topo.exponential_two_graph(size()) if topology is None else _topo.as_graph(topology)
    if graph.number_of_nodes() != size():
        raise ValueError(f"topology has {graph.number_of_nodes()} nodes but there are {size()} ranks")
    with _lock:
        if _topo.is_topology_equivalent(graph, _state["topology"]) and is_weighted == _state["weighted"]:
            return True
        me = rank()
        self_w, src = _topo.recv_weights(graph, me)
        plan = {
            "recv": _topo.in_neighbors(graph, me),
            "send": _topo.out_neighbors(graph, me),
            "self_weight": float(self_w),
            "recv_weights": [float(src[r]) for r in _topo.in_neighbors(graph, me)],
        }
        _state.update(topology=graph, weighted=bool(is_weighted), plan=plan)
    return True


def load_topology():
    """The current topology (`networkx.DiGraph`), or None before init()."""
    return _state["topology"]


def is_topo_weighted():
    return _state["weighted"]


def in_neighbor_ranks():
    """Ranks this rank receives from in the current topology (sorted, self excluded)."""
    _require_init()
    return list(_state["plan"]["recv"])


def out_neighbor_ranks():
    """Ranks this rank sends to in the current topology (sorted, self excluded)."""
    _require_init()
    return list(_state["plan"]["send"])


def _static_plan():
    # Pure Python (no call into the core) so torch.compile can trace through it.
    if _state["plan"] is None:
        raise ValueError("Shoal is not initialized; call shoal.init() first")
    return _state["plan"], _state["weighted"]


def stats():
    """Counters of this rank's runtime: ops by type, bytes_sent/bytes_received,
    fused_batches, negotiations, coordinator_rounds, cache_hits, global_collectives,
    stalls, errors. Values are integers since init() or reset_stats()."""
    _require_init()
    return _core.stats()


def reset_stats():
    _core.reset_stats()


def mpi_library_version():
    return _core.mpi_library_version()


__all__ = ["ShoalError", "init", "shutdown", "is_initialized", "rank", "size", "local_rank",
           "local_size", "machine_rank", "machine_size", "is_homogeneous",
           "mpi_threads_supported", "set_topology", "load_topology", "is_topo_weighted",
           "in_neighbor_ranks", "out_neighbor_ranks", "stats", "reset_stats",
           "mpi_library_version"]
