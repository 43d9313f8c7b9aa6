"""Framework-neutral op machinery shared by every binding.

A binding supplies an adapter that turns its tensors into (address, dtype code,
shape) and back; this module validates arguments, enqueues into the core, keeps the
tensors alive until completion, and finishes the result in `synchronize`.
Semantics follow BlueFog's ops (docs/reference/bluefog-semantics.md §1.4–1.5).
"""
import functools
import inspect
import math
import numbers
import operator

from . import _process, process_sets
from ._loader import _core
from ._process import STATE

# Codes of the C ABI, as the core exports them (core/include/shoal/c_api.h).
OPS = dict(_core.OPS)
OP_NAMES = {code: name for name, code in OPS.items()}
ALLREDUCE, BROADCAST, ALLGATHER, BARRIER, NEIGHBOR_ALLREDUCE, NEIGHBOR_ALLGATHER, REDUCESCATTER, ALLTOALL = (
    _core.OPS[n] for n in ("allreduce", "broadcast", "allgather", "barrier", "neighbor_allreduce",
                           "neighbor_allgather", "reducescatter", "alltoall"))
GROUPED = _core.GROUPED  # or'ed into an op code: its grouped form (one negotiation for a list)
WORLD, MACHINE = _core.SCOPES["world"], _core.SCOPES["machine"]  # scope of allreduce/broadcast
DTYPE_CODES = dict(_core.DTYPES)


class ReduceOp:
    """Horovod-style reduction selector (`op=shoal.Sum`, `Average`, `Min`, `Max`, `Product`:
    Horovod's hvd.Sum, ...), element-wise over the ranks. `code` is the core's
    (shoal_reduce_op); None for an op Shoal does not implement (Horovod's Adasum)."""

    def __init__(self, name, code):
        self.name, self.code = name, code

    def __repr__(self):
        return f"shoal.{self.name}"


Sum = ReduceOp("Sum", _core.REDUCE_OPS["sum"])
Average = ReduceOp("Average", _core.REDUCE_OPS["average"])
Min = ReduceOp("Min", _core.REDUCE_OPS["min"])
Max = ReduceOp("Max", _core.REDUCE_OPS["max"])
Product = ReduceOp("Product", _core.REDUCE_OPS["product"])
REDUCE_OP_CODES = {o: o.code for o in (Sum, Average, Min, Max, Product)}  # the native entries read it
REDUCE_OPS_BY_CODE = {o.code: o for o in REDUCE_OP_CODES}
# The same ops as a tuple, for membership tests: torch.compile of torch 2.2 and 2.4 cannot trace
# a dict lookup keyed by a ReduceOp (torch.compile traces reduce_op below).
_REDUCE_OPS = tuple(REDUCE_OP_CODES)


def reduce_op(average, op):
    """Resolve BlueFog's `average=` and Horovod's `op=` (op wins; default Average).

    Raises ValueError for an `op` that is not one of Sum, Average, Min, Max, Product, for
    `average=` given with Min/Max/Product (it chooses between Sum and Average only), and
    for `average=` and `op=` that disagree; NotImplementedError for an op Shoal does not
    implement (Horovod's Adasum); TypeError for an `average=` that is not a truth value
    (bool, numpy bool or integer: a string such as 'no' would read as true)."""
    if average is not None and not (isinstance(average, numbers.Integral)
                                    or type(average).__name__ in ("bool", "bool_")):
        raise TypeError(f"average must be a bool, got {type(average).__name__}")
    if op is not None:
        if isinstance(op, ReduceOp) and op.code is None:
            raise NotImplementedError(f"op={op.name} is not implemented in Shoal; use Sum, Average, Min, Max "
                                      "or Product")
        if not isinstance(op, ReduceOp) or op not in _REDUCE_OPS:
            raise ValueError(f"op must be shoal.Sum, Average, Min, Max or Product, got {op!r}")
        if average is not None:
            if op is not Sum and op is not Average:
                raise ValueError(f"average= cannot be combined with op={op.name}: it chooses between Sum and "
                                 "Average only")
            if (op is Average) != bool(average):
                raise ValueError("average= and op= disagree")
        return op
    return Average if average is None or average else Sum


def _told(op):
    """Decorates an op entry point: an argument error raised before the call reaches the
    core (which tells its peers itself) is told to the core, so every rank that submits
    this call gets the same error instead of waiting for this rank (shoal_reject), in the
    call's process set (an argument error about the process set itself is nobody's to hear)."""
    def wrap(fn):
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            calls = STATE.calls  # per thread: inside an op entry point; reached the core
            if getattr(calls, "inside", False):
                return fn(*args, **kwargs)
            calls.inside, calls.reached = True, False
            try:
                return fn(*args, **kwargs)
            except (ValueError, TypeError) as exc:
                if not calls.reached and _core.is_initialized():
                    try:
                        bound = sig.bind(*args, **kwargs).arguments
                        name, pset = bound.get("name"), process_sets.id_of(bound.get("process_set"), "")
                    except (TypeError, ValueError):
                        name = 0  # not a call of this op at all, or not in a process set of this rank's
                    if name is None or (isinstance(name, str) and "\0" not in name):
                        _core.reject(op, name or None, isinstance(exc, TypeError), str(exc), process_set=pset)
                raise
            finally:
                calls.inside = False
        return call
    return wrap


def peers_of(a):
    """The core's described form of a neighbor op's lists (a dict as `neighbor_args` returns)."""
    native = a.get("native")
    if native is None:
        native = _core.NeighborArgs(a["recv_ranks"], a["send_ranks"], a["recv_weights"], a["send_weights"],
                                    a["self_weight"], a["uniform"], a["topo_check"])
    return native


def op_name(name):
    """The core's form of an op's `name` argument ("" for None: a generated name);
    TypeError for a non-str, ValueError for a NUL character."""
    if name is None:
        return ""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if "\0" in name:
        raise ValueError("op names cannot contain NUL characters")
    return name


def _submit(op, name, adapter, tensor, output, keep, finish, block=False, reduce_op=0, root=0,
            scope=WORLD, peers=None, splits=None, process_set=0, scaling=None):
    """Enqueue one op; returns its handle, or with `block` waits and returns finish().
    `peers`: a neighbor op's lists (`_core.NeighborArgs`, see `peers_of`); `splits`: an
    alltoall's rows per rank; `process_set`: the core's id of the set that runs it;
    `scaling`: Horovod's (shoal._horovod.scaling), for allreduce and reducescatter."""
    name = op_name(name)
    ptr, dtype, shape = adapter.describe(tensor)
    out_ptr = ptr if output is None or output is tensor else adapter.describe(output)[0]
    device_type, device_id, stream = adapter.device(tensor)
    STATE.calls.reached = True
    # Nonblocking: the core keeps (keep, finish) with the handle (shoal_attach) for synchronize.
    handle = _core.enqueue(op, name, ptr, dtype, shape, out_ptr, peers=peers, reduce_op=reduce_op, root=root,
                           scope=scope, device_type=device_type, device_id=device_id, stream=stream,
                           block=block, keep=keep, finish=None if block else finish, splits=splits,
                           process_set=process_set, scaling=scaling)
    return finish() if block else handle  # blocking: waited for and released by the core already


def _submit_gather(op, name, adapter, tensor, **kw):
    """Enqueue an op whose output the core allocates (allgather family)."""
    src, _ = adapter.prepare(tensor, False, OP_NAMES[op], need_output=False)
    holder = {}

    def finish():
        data, shape = _core.take_result(holder["h"])
        return adapter.from_bytes(data, shape, src)

    holder["h"] = _submit(op, name, adapter, src, None, (tensor, src), finish, **kw)
    return holder["h"]


# Each op below enqueues and returns a handle for `synchronize`, or with block=True waits
# and returns the result (one call into the core instead of two).
@_told(ALLREDUCE)
def allreduce(adapter, tensor, average=None, name=None, op=None, inplace=False, scope=WORLD,
              block=False, process_set=None, scaling=None):
    rop = reduce_op(average, op)
    pset = process_sets.id_of(process_set, "allreduce")
    src, out = adapter.prepare(tensor, inplace, "allreduce")
    return _submit(ALLREDUCE, name, adapter, src, out, (tensor, src, out), lambda: out, block,
                   reduce_op=rop.code, scope=scope, process_set=pset, scaling=scaling)


def root_int(root_rank):
    """`root_rank` as an int (numpy integers, 0-d int tensors); TypeError for a bool or a
    non-integer."""
    if isinstance(root_rank, bool):
        raise TypeError("root_rank must be an int, got bool")
    try:
        return operator.index(root_rank)
    except TypeError:
        raise TypeError(f"root_rank must be an int, got {type(root_rank).__name__}") from None


def root(root_rank, scope=WORLD):
    """`root_rank` as an int in [0, n) of the scope's n ranks: TypeError as `root_int`,
    ValueError outside the range (in a process set, a world rank: the core checks that it
    is in the set)."""
    root_rank = root_int(root_rank)
    n = _process.local_size() if scope == MACHINE else _process.size()
    if not 0 <= root_rank < n:
        raise ValueError(f"broadcast: root rank {root_rank} is outside [0, {n})")
    return root_rank


@_told(BROADCAST)
def broadcast(adapter, tensor, root_rank, name=None, inplace=False, scope=WORLD, block=False, process_set=None):
    root_rank = root(root_rank, scope)
    pset = process_sets.id_of(process_set, "broadcast")
    src, out = adapter.prepare(tensor, inplace, "broadcast")
    return _submit(BROADCAST, name, adapter, src, out, (tensor, src, out), lambda: out, block,
                   root=root_rank, scope=scope, process_set=pset)


@_told(ALLGATHER)
def allgather(adapter, tensor, name=None, process_set=None):
    pset = process_sets.id_of(process_set, "allgather")
    return _submit_gather(ALLGATHER, name, adapter, tensor, process_set=pset)


@_told(REDUCESCATTER)
def reducescatter(adapter, tensor, op=None, name=None, process_set=None, scaling=None):
    """See `shoal.reducescatter_nonblocking` for the semantics; `scaling`: Horovod's."""
    pset = process_sets.id_of(process_set, "reducescatter")
    return _submit_gather(REDUCESCATTER, name, adapter, tensor, reduce_op=reducescatter_op(op).code, process_set=pset,
                          scaling=scaling)


def split_list(splits):
    """An alltoall's `splits` (None, or a 1-d sequence, numpy array or tensor of integers) as
    None or a list of ints; TypeError for anything else. The core checks the values."""
    if splits is None:
        return None
    if hasattr(splits, "tolist"):  # numpy arrays, torch tensors (CUDA ones too)
        splits = splits.tolist()
    elif hasattr(splits, "numpy"):  # tf.Tensor
        splits = splits.numpy().tolist()
    if isinstance(splits, (str, bytes)) or not hasattr(splits, "__iter__"):
        raise TypeError(f"alltoall: splits must be a 1-d sequence of ints, got {type(splits).__name__}")
    out = []
    for v in splits:
        if isinstance(v, bool):
            raise TypeError("alltoall: splits must be ints, got bool")
        try:
            v = operator.index(v)
        except TypeError:
            raise TypeError(f"alltoall: splits must be ints, got {type(v).__name__}") from None
        if not -2**63 <= v < 2**63:
            raise ValueError(f"alltoall: split {v} is outside the range of int64")
        out.append(v)
    return out


@_told(ALLTOALL)
def alltoall(adapter, tensor, splits=None, name=None, process_set=None):
    """See `shoal.alltoall_nonblocking` for the semantics; synchronize gives (output,
    received splits)."""
    splits = split_list(splits)
    pset = process_sets.id_of(process_set, "alltoall")
    src, _ = adapter.prepare(tensor, False, "alltoall", need_output=False)
    holder = {}

    def finish():
        received = _core.received_splits(holder["h"])
        data, shape = _core.take_result(holder["h"])
        return adapter.from_bytes(data, shape, src), adapter.int32(received)

    holder["h"] = _submit(ALLTOALL, name, adapter, src, None, (tensor, src), finish, splits=splits, process_set=pset)
    return holder["h"]


def reducescatter_op(op):
    """reducescatter's reduce op: Average (the default) or Sum, as in Horovod."""
    rop = Average if op is None else reduce_op(None, op)
    if rop is not Sum and rop is not Average:
        raise ValueError(f"reducescatter: op must be Sum or Average (as in Horovod), got {rop!r}")
    return rop


def reducescatter_rows(rows, size, rank):
    """The rows of a dim 0 of `rows` that reducescatter leaves `rank` of `size` ranks:
    rows // size, one more for the first rows % size ranks (Horovod's split)."""
    return rows // size + (1 if rank < rows % size else 0)


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


def neighbor_args(self_weight=None, src_weights=None, dst_weights=None, enable_topo_check=True,
                  plan=None, weighted=None, remember=True):
    """Resolve BlueFog's neighbor_allreduce weights into explicit per-call lists: a dict
    {recv_ranks, recv_weights, self_weight, uniform, send_ranks, send_weights, topo_check}.
    Callers must not modify it (remembered results are reused across calls; their lists
    are tuples, and their "native" entry is the core's `NeighborArgs` of the lists).

    `plan`/`weighted` default to the static topology (`set_topology`); the hierarchical
    op passes the machine topology's plan instead. Runs every step: a one-peer schedule
    repeats a few argument sets, so results for plain int ranks and float weights are
    remembered, in the core's one cache (`_core.neighbor_args`, which the native
    neighbor_allreduce uses too); `remember=False` (code traced by torch.compile) and an
    explicit `plan` resolve afresh, in pure Python.
    """
    if remember and plan is None:
        return _core.neighbor_args(self_weight, src_weights, dst_weights, enable_topo_check)
    return _resolve(self_weight, src_weights, dst_weights, enable_topo_check, plan, weighted)


def _with_native(a, freeze):
    out = {k: tuple(v) if freeze and type(v) is list else v for k, v in a.items()}
    out["native"] = peers_of(a)
    return out


def _remembered(self_weight, src_weights, dst_weights, enable_topo_check, kept):
    """The core cache's resolver: `neighbor_args`' result with its "native" lists, frozen
    (tuples) when the cache keeps it; the static topology's is kept with its plan."""
    if self_weight is None and src_weights is None and dst_weights is None:
        plan, weighted = _process.static_plan()
        frozen = plan.get(("frozen", weighted))
        if frozen is None:
            frozen = plan[("frozen", weighted)] = _with_native(_resolve(None, None, None, False, plan, weighted), True)
        return frozen
    return _with_native(_resolve(self_weight, src_weights, dst_weights, enable_topo_check, None, None), kept)


_core.set_neighbor_resolver(_remembered)


def _uniform(self_weight, weights):
    """Whether the weights are all 1/(n+1), n the number of sources: then the average is
    computed as a sum divided by n+1, exactly as without weights (BlueFog's uniform path)."""
    weights = list(weights)
    u = 1.0 / (len(weights) + 1)
    return all(math.isclose(w, u, rel_tol=1e-9) for w in [self_weight, *weights])


def _resolve(self_weight, src_weights, dst_weights, enable_topo_check, plan, weighted):
    if self_weight is not None and not isinstance(self_weight, numbers.Real):
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
        uniform = not send_w and _uniform(self_weight, src.values())
        return {"recv_ranks": recv, "recv_weights": [] if uniform else [src[r] for r in recv],
                "self_weight": 1.0 if uniform else float(self_weight), "uniform": uniform, "send_ranks": send,
                "send_weights": send_w, "topo_check": bool(enable_topo_check)}
    # Static: receive from every in-neighbor, send to every out-neighbor. The graph was
    # checked across ranks by set_topology, so no per-call check is needed.
    if plan is None:
        plan, weighted = _process.static_plan()
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
        if len(src) < len(recv) or not _uniform(self_weight, src.values()):
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
                   lambda: out, block, peers=peers_of(peers))


@_told(NEIGHBOR_ALLREDUCE)
def neighbor_allreduce(adapter, tensor, self_weight=None, src_weights=None, dst_weights=None,
                       enable_topo_check=True, name=None, out=None, block=False):
    """See `shoal.neighbor_allreduce` for the semantics."""
    return neighbor_allreduce_submit(
        adapter, tensor, name, neighbor_args(self_weight, src_weights, dst_weights, enable_topo_check), out, block)


def neighbor_allgather_args(src_ranks=None, dst_ranks=None, enable_topo_check=True):
    """(recv_ranks, send_ranks, topo_check) of a neighbor_allgather: the static topology's
    neighbors, or the given lists (dynamic mode, checked if asked)."""
    if (src_ranks is None) != (dst_ranks is None):
        raise ValueError("neighbor_allgather: give both src_ranks and dst_ranks, or neither")
    if src_ranks is None:
        plan, _ = _process.static_plan()
        return plan["recv"], plan["send"], False
    return _rank_list(src_ranks, "src_ranks"), _rank_list(dst_ranks, "dst_ranks"), bool(enable_topo_check)


@_told(NEIGHBOR_ALLGATHER)
def neighbor_allgather(adapter, tensor, src_ranks=None, dst_ranks=None, enable_topo_check=True,
                       name=None):
    """See `shoal.neighbor_allgather` for the semantics."""
    recv, send, check = neighbor_allgather_args(src_ranks, dst_ranks, enable_topo_check)
    return _submit_gather(NEIGHBOR_ALLGATHER, name, adapter, tensor,
                          peers=_core.NeighborArgs(recv, send, [], [], 1.0, True, check))


@_told(NEIGHBOR_ALLREDUCE)
def pair_gossip(adapter, tensor, target_rank, self_weight=None, pair_weight=None, name=None,
                block=False):
    """See `shoal.pair_gossip` for the semantics."""
    if (self_weight is None) != (pair_weight is None):
        raise ValueError("pair_gossip: give both self_weight and pair_weight, or neither")
    if target_rank == _process.rank():
        raise ValueError("pair_gossip: target_rank is this rank")
    sw, pw = (0.5, 0.5) if self_weight is None else (float(self_weight), float(pair_weight))
    peers = {"recv_ranks": [target_rank], "recv_weights": [pw], "self_weight": sw,
             "uniform": self_weight is None, "send_ranks": [target_rank], "send_weights": [],
             "topo_check": False}
    return neighbor_allreduce_submit(adapter, tensor, name, peers, None, block)


def _handle(handle):
    """`handle` as an int the core can hold (numpy integers too); ValueError for anything
    else (a bool, a non-integer, one out of int64's range)."""
    try:
        h = operator.index(handle) if not isinstance(handle, bool) else None
    except TypeError:
        h = None
    if h is None or not 0 < h < 2**63:
        raise ValueError(f"unknown handle {handle!r}")
    return h


def poll(handle):
    """True when the op behind `handle` has completed (the handle stays valid)."""
    return _core.poll(_handle(handle))


def synchronize(handle):
    """Wait (GIL released) for `handle` and return the op's output.

    Raises ShoalError if the op failed on this rank (mismatch, stall, dead peer,
    shutdown, also for a handle that was still pending at `shutdown()`) and ValueError
    for an unknown handle. A KeyboardInterrupt leaves the op running and its handle valid
    (synchronize it again, or let shutdown fail it).
    """
    handle = _handle(handle)
    if _core.attached(handle) is None:
        if 0 < handle < STATE.ended_below:
            raise _core.ShoalError(f"handle {handle} belongs to a runtime that shutdown() ended; "
                                   "synchronize handles before shutdown()")
        raise ValueError(f"unknown handle {handle}")
    try:
        _core.wait(handle)
    except BaseException:
        if not _core.poll(handle):
            raise  # interrupted (Ctrl-C) while the op runs on: it keeps its tensors and handle
        if _core.in_use(handle):  # failed with a send from its memory in flight
            _core.linger(handle, None)  # released (its objects with it) when the send is done
        else:
            _core.release(handle)
        raise
    entry = _core.detach(handle)  # (objects kept alive, finish), taken: one thread finishes it
    if entry is None:  # another thread synchronized it meanwhile
        raise ValueError(f"handle {handle} was already synchronized")
    try:
        return entry[1]()
    finally:
        _core.release(handle)


def _native_synchronize():
    # The common case (a registered handle whose op completes without error) in C
    # (bindings/python/native_entry.cc); anything else takes the function above.
    doc = f"synchronize{inspect.signature(synchronize)}\n--\n\n{synchronize.__doc__}"
    return _core.native_synchronize(synchronize, doc, "shoal")


synchronize = _native_synchronize()  # noqa: F811  (the C form of the function above)


def barrier(process_set=None):
    """Block until every rank (of `process_set`, a ProcessSet: its members only call it)
    has called barrier(). ValueError on a rank outside the set."""
    h = _core.enqueue(BARRIER, "", 0, 0, [], 0, process_set=process_sets.id_of(process_set, "barrier"))
    try:
        _core.wait(h)
    finally:
        _core.release(h)


def join():
    """Horovod's `join()`: this rank has run out of data. Blocks until every rank has
    called join() and returns the rank that joined last (an int, the same on every rank).

    Until then this rank takes part in the other ranks' collectives without data of its
    own, so ranks may run different numbers of steps (uneven data per rank):

    * allreduce (CPU tensors; grouped ones too): this rank contributes the identity of the
      reduction in the other ranks' shape and dtype: zeros for Sum and Average (Average
      still divides by `size()`, Horovod's divisor, so it is the sum over the ranks still
      running / size()), the dtype's largest value (+inf) for Min, its lowest (-inf) for
      Max, ones for Product: the result is the reduction over the ranks still running;
    * reducescatter (CPU tensors): zeros, so each rank gets its rows of the sum over the
      ranks still running (/ size() for Average);
    * barrier: this rank takes part;
    * broadcast, allgather, alltoall (Horovod raises for each with joined ranks), allreduce
      and reducescatter of CUDA tensors and neighbor ops that need a joined rank fail on the
      ranks that submit them with `ShoalError` naming the joined ranks.

    Fused and cached allreduces are handed back to negotiation while a rank is joined, and
    the stall check does not count a joined rank as missing. After join() returns,
    everything runs as before (another epoch, another join). Ops this rank submits while
    its join is in flight raise `ValueError`; a second join() while one is in flight
    raises `ValueError`. A rank that leaves the job (exit, shutdown()) instead of joining
    makes every waiting join() raise `ShoalError` naming it. join() itself waits as long as
    the other ranks run: the stall check does not apply to it.

    Semantics: Horovod's `hvd.join()` (horovod/torch/mpi_ops.py), with the divisor of its
    Average kept.
    """
    return _core.join()
