"""Framework-neutral op machinery shared by every binding.

A binding supplies an adapter that turns its tensors into (address, dtype code,
shape) and back; this module validates arguments, enqueues into the core, keeps the
tensors alive until completion, and finishes the result in `synchronize`.
Semantics follow BlueFog's ops (reference/bluefog-semantics.md §1.4–1.5).
"""
import functools
import inspect
import math
import operator
import threading

from . import basics
from ._loader import _core

# Op and dtype codes of the C ABI (core/include/shoal/c_api.h).
ALLREDUCE, BROADCAST, ALLGATHER, BARRIER, NEIGHBOR_ALLREDUCE, NEIGHBOR_ALLGATHER = range(6)
WORLD, MACHINE = 0, 1  # scope of allreduce/broadcast
DTYPE_CODES = {"float16": 0, "bfloat16": 1, "float32": 2, "float64": 3, "int8": 4,
               "uint8": 5, "int16": 6, "int32": 7, "int64": 8, "bool": 9}


class ReduceOp:
    """Horovod-style reduction selector: `op=shoal.Sum` or `op=shoal.Average`."""

    def __init__(self, name, code):
        self.name, self.code = name, code

    def __repr__(self):
        return f"shoal.{self.name}"


Sum = ReduceOp("Sum", 0)
Average = ReduceOp("Average", 1)
OP_NAMES = ["allreduce", "broadcast", "allgather", "barrier", "neighbor_allreduce",
            "neighbor_allgather"]

_lock = threading.Lock()
_pending = {}  # handle -> (objects kept alive, finish() -> result)
_lingering = {}  # failed ops whose tensors the core may still read: handle -> objects
_composite = {"next": -1}  # handles of multi-stage ops are negative


def reduce_op(average, op):
    """Resolve BlueFog's `average=` and Horovod's `op=` (op wins; default Average)."""
    if op is not None:
        if op not in (Sum, Average):
            raise ValueError(f"op must be shoal.Sum or shoal.Average, got {op!r}")
        if average is not None and (op is Average) != bool(average):
            raise ValueError("average= and op= disagree")
        return op
    return Average if average is None or average else Sum


_calls = threading.local()  # per thread: inside an op entry point; reached the core


def _told(op):
    """Decorates an op entry point: an argument error raised before the call reaches the
    core (which tells its peers itself) is told to the core, so every rank that submits
    this call gets the same error instead of waiting for this rank (shoal_reject)."""
    def wrap(fn):
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if getattr(_calls, "inside", False):
                return fn(*args, **kwargs)
            _calls.inside, _calls.reached = True, False
            try:
                return fn(*args, **kwargs)
            except (ValueError, TypeError) as exc:
                if not _calls.reached and _core.is_initialized():
                    try:
                        name = sig.bind(*args, **kwargs).arguments.get("name")
                    except TypeError:
                        name = 0  # not a call of this op at all
                    if name is None or (isinstance(name, str) and "\0" not in name):
                        _core.reject(op, name or None, isinstance(exc, TypeError), str(exc))
                raise
            finally:
                _calls.inside = False
        return call
    return wrap


_NO_PEERS = {"recv_ranks": (), "recv_weights": (), "self_weight": 1.0, "uniform": True,
             "send_ranks": (), "send_weights": (), "topo_check": False}


def _submit(op, name, adapter, tensor, output, keep, finish, block=False, reduce_op=0, root=0,
            scope=WORLD, peers=_NO_PEERS):
    """Enqueue one op; returns its handle, or with `block` waits and returns finish().
    `peers`: the lists of a neighbor op, as `neighbor_args` returns them."""
    if name is None:
        name = ""
    elif not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    elif "\0" in name:
        raise ValueError("op names cannot contain NUL characters")
    if _lingering:
        _release_lingering()
    ptr, dtype, shape = adapter.describe(tensor)
    out_ptr = ptr if output is None or output is tensor else adapter.describe(output)[0]
    device_type, device_id, stream = adapter.device(tensor)
    _calls.reached = True
    # Positional: pybind11 matches keyword arguments far more slowly.
    handle = _core.enqueue(op, name, ptr, dtype, shape, out_ptr, reduce_op, root, peers["recv_ranks"],
                           peers["recv_weights"], peers["self_weight"], peers["uniform"],
                           peers["send_ranks"], peers["send_weights"], scope, peers["topo_check"],
                           device_type, device_id, stream, block, keep)
    if block:  # waited for and released by the core already
        return finish()
    with _lock:
        _pending[handle] = (keep, finish)
    return handle


def _submit_gather(op, name, adapter, tensor, **kw):
    """Enqueue an op whose output the core allocates (allgather family)."""
    src, _ = adapter.prepare(tensor, False, OP_NAMES[op], need_output=False)
    holder = {}

    def finish():
        data, shape = _core.take_result(holder["h"])
        return adapter.from_bytes(data, shape, src)

    holder["h"] = _submit(op, name, adapter, src, None, (tensor, src), finish, **kw)
    return holder["h"]


def composite(first, finish):
    """A handle for a multi-stage op: `first` is the handle of its first stage and
    `finish()` runs the remaining stages (at synchronize) and returns the result."""
    with _lock:
        h = _composite["next"]
        _composite["next"] -= 1
        _pending[h] = ((first,), finish)
    return h


# Each op below enqueues and returns a handle for `synchronize`, or with block=True waits
# and returns the result (one call into the core instead of two).
@_told(ALLREDUCE)
def allreduce(adapter, tensor, average=None, name=None, op=None, inplace=False, scope=WORLD,
              block=False):
    rop = reduce_op(average, op)
    src, out = adapter.prepare(tensor, inplace, "allreduce")
    return _submit(ALLREDUCE, name, adapter, src, out, (tensor, src, out), lambda: out, block,
                   reduce_op=rop.code, scope=scope)


@_told(BROADCAST)
def broadcast(adapter, tensor, root_rank, name=None, inplace=False, scope=WORLD, block=False):
    if isinstance(root_rank, bool):
        raise TypeError("root_rank must be an int, got bool")
    try:
        root_rank = operator.index(root_rank)  # int, numpy integers, 0-d int tensors
    except TypeError:
        raise TypeError(f"root_rank must be an int, got {type(root_rank).__name__}") from None
    n = basics.local_size() if scope == MACHINE else basics.size()
    if not 0 <= root_rank < n:
        raise ValueError(f"broadcast: root rank {root_rank} is outside [0, {n})")
    src, out = adapter.prepare(tensor, inplace, "broadcast")
    return _submit(BROADCAST, name, adapter, src, out, (tensor, src, out), lambda: out, block,
                   root=root_rank, scope=scope)


@_told(ALLGATHER)
def allgather(adapter, tensor, name=None):
    return _submit_gather(ALLGATHER, name, adapter, tensor)


def _in_int32(ranks, what):
    # The core checks ranks against the world size; one that does not even fit its int32
    # would fail the conversion with a TypeError instead.
    for r in ranks:
        if not -2**31 <= r < 2**31:
            raise ValueError(f"{what}: rank {r} is outside [0, {_core.size()})")
    return ranks


def _rank_list(ranks, what):
    try:
        out = list(map(int, ranks))
    except TypeError:
        raise TypeError(f"{what} must be a list of ranks") from None
    if len(set(out)) != len(out):
        raise ValueError(f"{what} has duplicate ranks: {out}")
    return _in_int32(out, what)


def _weights_dict(arg, what):
    if isinstance(arg, dict):
        out = {int(k): float(v) for k, v in arg.items()}
        _in_int32(out, what)
        return out
    if isinstance(arg, (list, tuple)):
        return dict.fromkeys(_rank_list(arg, what), 1.0)
    raise TypeError(f"{what} must be a dict {{rank: weight}} or a list of ranks")


_resolved = {}  # dynamic-mode arguments -> neighbor_args' result (schedules repeat)


def neighbor_args(self_weight=None, src_weights=None, dst_weights=None, enable_topo_check=True,
                  plan=None, weighted=None, remember=True):
    """Resolve BlueFog's neighbor_allreduce weights into explicit per-call lists: a dict
    {recv_ranks, recv_weights, self_weight, uniform, send_ranks, send_weights, topo_check}.
    Callers must not modify it (dynamic results are reused across calls; their lists are
    tuples).

    `plan`/`weighted` default to the static topology (`set_topology`); the hierarchical
    op passes the machine topology's plan instead. Runs every step: a one-peer schedule
    repeats a few argument sets, so dynamic results with plain int ranks and float weights
    are remembered (resolving them costs more than the rest of a small op's Python path);
    `remember=False` (code traced by torch.compile) skips that.
    """
    key = _dynamic_key(self_weight, src_weights, dst_weights, enable_topo_check) if remember else None
    if key is None:
        return _neighbor_args(self_weight, src_weights, dst_weights, enable_topo_check, plan, weighted)
    hit = _resolved.get(key)
    if hit is None:
        a = _neighbor_args(self_weight, src_weights, dst_weights, enable_topo_check, plan, weighted)
        hit = {k: tuple(v) if type(v) is list else v for k, v in a.items()}
        if len(_resolved) >= 1024:
            _resolved.clear()
        _resolved[key] = hit
    return hit


def _dynamic_key(self_weight, src_weights, dst_weights, enable_topo_check):
    """A key for dynamic-mode arguments made only of plain ints and floats, else None.
    Negative zero weights are not keyed: they compare equal to 0.0 but scale signs."""
    if dst_weights is None or type(self_weight) is not float or type(src_weights) is not dict:
        return None
    if self_weight == 0.0 and math.copysign(1.0, self_weight) < 0:
        return None
    src = tuple(src_weights.items())
    for r, w in src:
        if type(r) is not int or type(w) is not float or (w == 0.0 and math.copysign(1.0, w) < 0):
            return None
    kind = type(dst_weights)
    if kind is dict:
        dst = tuple(dst_weights.items())
        for r, w in dst:
            if type(r) is not int or type(w) is not float or (w == 0.0 and math.copysign(1.0, w) < 0):
                return None
    elif kind is list or kind is tuple:
        dst = tuple(dst_weights)
        for r in dst:
            if type(r) is not int:
                return None
    else:
        return None
    return self_weight, bool(enable_topo_check), src, kind is dict, dst


def _neighbor_args(self_weight, src_weights, dst_weights, enable_topo_check, plan, weighted):
    if self_weight is not None and not isinstance(self_weight, (int, float)):
        raise TypeError(f"self_weight must be a number, got {type(self_weight).__name__}")
    if dst_weights is not None:
        # Dynamic: this call's own send and receive lists.
        if self_weight is None or src_weights is None:
            raise ValueError("neighbor_allreduce with dst_weights needs self_weight and src_weights")
        src = _weights_dict(src_weights, "src_weights")
        recv = sorted(src)
        if isinstance(dst_weights, dict):
            dst = _weights_dict(dst_weights, "dst_weights")
            send = sorted(dst)
            send_w = [dst[r] for r in send]
            if send_w.count(1.0) == len(send_w):
                send_w = []  # unscaled sends
        else:
            send, send_w = sorted(_weights_dict(dst_weights, "dst_weights")), []
        return {"recv_ranks": recv, "recv_weights": [src[r] for r in recv],
                "self_weight": float(self_weight), "uniform": False, "send_ranks": send,
                "send_weights": send_w, "topo_check": bool(enable_topo_check)}
    # Static: receive from every in-neighbor, send to every out-neighbor. The graph was
    # checked across ranks by set_topology, so no per-call check is needed.
    if plan is None:
        plan, weighted = basics._static_plan()
    recv = plan["recv"]
    args = {"recv_ranks": list(recv), "recv_weights": [], "self_weight": 1.0, "uniform": True,
            "send_ranks": list(plan["send"]), "send_weights": [], "topo_check": False}
    if (self_weight is None) != (src_weights is None):
        raise ValueError("neighbor_allreduce: give both self_weight and src_weights, or neither")
    if self_weight is not None:
        src = _weights_dict(src_weights, "src_weights")
        extra = sorted(set(src) - set(recv))
        if extra:
            raise ValueError(f"neighbor_allreduce: src_weights ranks {extra} are not in-neighbors {recv}")
        args.update(uniform=False, self_weight=float(self_weight),
                    recv_weights=[src.get(r, 0.0) for r in recv])
    elif weighted:
        args.update(uniform=False, self_weight=plan["self_weight"], recv_weights=list(plan["recv_weights"]))
    return args


@_told(NEIGHBOR_ALLREDUCE)
def neighbor_allreduce_submit(adapter, tensor, name, peers, out=None, block=False):
    """Enqueue a neighbor_allreduce with explicit lists `peers` (see `neighbor_args`); the
    result goes to `out` (a contiguous tensor like `tensor`, e.g. reused across steps) if given."""
    src_t, fresh = adapter.prepare(tensor, False, "neighbor_allreduce", need_output=out is None)
    out = fresh if out is None else out
    return _submit(NEIGHBOR_ALLREDUCE, name, adapter, src_t, out, (tensor, src_t, out),
                   lambda: out, block, peers=peers)


@_told(NEIGHBOR_ALLREDUCE)
def neighbor_allreduce(adapter, tensor, self_weight=None, src_weights=None, dst_weights=None,
                       enable_topo_check=True, name=None, out=None, block=False):
    """See `shoal.neighbor_allreduce` for the semantics."""
    return neighbor_allreduce_submit(
        adapter, tensor, name, neighbor_args(self_weight, src_weights, dst_weights, enable_topo_check), out, block)


def _native_args(self_weight, src_weights, dst_weights, enable_topo_check):
    """`neighbor_args` as a core object for the numpy binding's native neighbor_allreduce,
    converted once: kept with the static plan (static mode) or the remembered dynamic result."""
    if dst_weights is None and self_weight is None and src_weights is None:
        plan, weighted = basics._static_plan()
        holder, key = plan, ("native", weighted)
    else:
        holder, key = neighbor_args(self_weight, src_weights, dst_weights, enable_topo_check), "native"
    native = holder.get(key)
    if native is None:
        a = holder if key == "native" else neighbor_args()
        native = holder[key] = _core.NeighborArgs(
            a["recv_ranks"], a["send_ranks"], a["recv_weights"], a["send_weights"], a["self_weight"],
            a["uniform"], a["topo_check"])
    return native


def neighbor_allgather_args(src_ranks=None, dst_ranks=None, enable_topo_check=True):
    """(recv_ranks, send_ranks, topo_check) of a neighbor_allgather: the static topology's
    neighbors, or the given lists (dynamic mode, checked if asked)."""
    if (src_ranks is None) != (dst_ranks is None):
        raise ValueError("neighbor_allgather: give both src_ranks and dst_ranks, or neither")
    if src_ranks is None:
        plan, _ = basics._static_plan()
        return plan["recv"], plan["send"], False
    return _rank_list(src_ranks, "src_ranks"), _rank_list(dst_ranks, "dst_ranks"), bool(enable_topo_check)


@_told(NEIGHBOR_ALLGATHER)
def neighbor_allgather(adapter, tensor, src_ranks=None, dst_ranks=None, enable_topo_check=True,
                       name=None):
    """See `shoal.neighbor_allgather` for the semantics."""
    recv, send, check = neighbor_allgather_args(src_ranks, dst_ranks, enable_topo_check)
    return _submit_gather(NEIGHBOR_ALLGATHER, name, adapter, tensor,
                          peers=dict(_NO_PEERS, recv_ranks=recv, send_ranks=send, topo_check=check))


@_told(NEIGHBOR_ALLREDUCE)
def pair_gossip(adapter, tensor, target_rank, self_weight=None, pair_weight=None, name=None,
                block=False):
    """See `shoal.pair_gossip` for the semantics."""
    if (self_weight is None) != (pair_weight is None):
        raise ValueError("pair_gossip: give both self_weight and pair_weight, or neither")
    if target_rank == basics.rank():
        raise ValueError("pair_gossip: target_rank is this rank")
    sw, pw = (0.5, 0.5) if self_weight is None else (float(self_weight), float(pair_weight))
    peers = {"recv_ranks": [target_rank], "recv_weights": [pw], "self_weight": sw,
             "uniform": self_weight is None, "send_ranks": [target_rank], "send_weights": [],
             "topo_check": False}
    return neighbor_allreduce_submit(adapter, tensor, name, peers, None, block)


def poll(handle):
    """True when the op behind `handle` has completed (the handle stays valid).
    For a multi-stage op (hierarchical), True once its first stage has completed."""
    with _lock:
        entry = _pending.get(handle)
    if handle < 0 and entry is not None:
        return _core.poll(entry[0][0])
    return _core.poll(handle)


def synchronize(handle):
    """Wait (GIL released) for `handle` and return the op's output.

    Raises ShoalError if the op failed on this rank (mismatch, stall, dead peer,
    shutdown) and ValueError for an unknown handle. A KeyboardInterrupt leaves the op
    running and its handle valid (synchronize it again, or let shutdown fail it).
    """
    with _lock:
        if handle not in _pending:
            raise ValueError(f"unknown handle {handle}")
    try:
        if handle >= 0:
            _core.wait(handle)
    except BaseException:
        if handle >= 0 and not _core.poll(handle):
            raise  # interrupted (Ctrl-C) while the op runs on: it keeps its tensors and handle
        if handle >= 0 and _core.in_use(handle):  # failed with a send from its memory in flight
            with _lock:
                _lingering[handle] = _pending.pop(handle, None)
            raise
        _forget(handle)
        raise
    try:
        with _lock:
            entry = _pending.get(handle)
        if entry is None:  # another thread synchronized it meanwhile
            raise ValueError(f"handle {handle} was already synchronized")
        return entry[1]()
    finally:
        _forget(handle)


def _release_lingering():
    with _lock:
        done = [h for h in _lingering if not _core.in_use(h)]
        for h in done:
            del _lingering[h]
    for h in done:
        _core.release(h)


def _forget(handle):
    with _lock:
        _pending.pop(handle, None)
    if handle >= 0:
        _core.release(handle)


def barrier():
    """Block until every rank has called barrier()."""
    h = _core.enqueue(BARRIER, "", 0, 0, [], 0)
    try:
        _core.wait(h)
    finally:
        _core.release(h)
