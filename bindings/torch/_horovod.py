"""Horovod's names in `shoal.torch`, so `import shoal.torch as hvd` runs Horovod PyTorch
scripts (issue 17; Horovod 0.28 `horovod/torch/mpi_ops.py`, `compression.py`,
`functions.py`, `horovod/common/basics.py`).

Every name here is an alias or a thin wrapper over Shoal's one implementation of each op
(shoal._ops through shoal._api / bindings/torch/_ops.py): the wrappers only translate
Horovod's arguments (prescale/postscale factors, compression, the integer average, the
process set) and never move data themselves.

What a script can observe follows Horovod, except (each said where it applies):
* `allreduce`/`allreduce_` keep BlueFog's positional order (tensor, average,
  is_hierarchical_local, name, op); a str third positional argument is Horovod's `name`,
  and the positional arguments after it are then read in Horovod's order.
* Process sets (`process_set=`, shoal.process_sets): as Horovod's; `broadcast_optimizer_state`
  runs over every rank only (NotImplementedError for another set).
* `Adasum` is not implemented (NotImplementedError naming it).
* The timeline is per rank (`<prefix><rank>.json`) and starts with `init()`; rank 0's file
  is also linked where Horovod writes its one file (shoal/_compat_env.py).
"""
import inspect

import torch

from shoal import _ops, _sparse
from shoal._ops import Average, Max, Min, Product, ReduceOp, Sum  # noqa: F401

from shoal._api import build_api
from shoal._process import STATE
from shoal._horovod import *  # noqa: F401,F403  (the framework-neutral names)
from shoal._horovod import (Compressor, NoneCompressor, check_compression, check_op, check_process_set, factor,
                            global_process_set)
from shoal._horovod import __all__ as _NEUTRAL

from . import _ops as _torch_ops
from . import compression as _gossip
from . import utility as _utility
from ._adapter import ADAPTER

# The collective API over torch tensors (shoal._api.build_api); bindings/torch/__init__.py
# exports it, with the Horovod wrappers below in place of the shared names they extend.
TORCH_API = build_api(ADAPTER)

# ---- Errors, reduce ops, process sets, compression's interface: shoal/_horovod.py ----
_check_op, _check_process_set = check_op, check_process_set


def _in_set(process_set):
    """The keyword of `process_set=` for Shoal's ops: none for the global set (the C
    entries' one-call path takes only plain calls)."""
    return {} if process_set is global_process_set or process_set is None else {"process_set": process_set}


def _cast_compressor(dtype, doc):
    class _Cast(Compressor):
        __doc__ = doc

        @staticmethod
        def compress(tensor):
            if tensor.dtype.is_floating_point and tensor.dtype != dtype:
                return tensor.to(dtype), tensor.dtype
            return tensor, None

        @staticmethod
        def decompress(tensor, ctx):
            return tensor if ctx is None else tensor.to(ctx)
    return _Cast


FP16Compressor = _cast_compressor(torch.float16, "Floating tensors travel as float16 and are cast "
                                                 "back to their dtype (Horovod's Compression.fp16).")
BF16Compressor = _cast_compressor(torch.bfloat16, "Floating tensors travel as bfloat16 and are cast "
                                                  "back to their dtype.")
FP16Compressor.__name__ = FP16Compressor.__qualname__ = "FP16Compressor"
BF16Compressor.__name__ = BF16Compressor.__qualname__ = "BF16Compressor"


class Compression:
    """`hvd.Compression.none`, `.fp16`, `.bf16` (Horovod's names), and the gossip
    compressors of `shoal.torch.compression` for the decentralized optimizers'
    `compression=`: `.int8`, `.int4`, `.topk(ratio)`, `.randomk(ratio)`. An allreduce
    cannot sum differently scaled int8 chunks or sparse payloads: those refuse allreduce
    (`check_compression`) with a ValueError."""
    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
    int8 = _gossip.Int8()
    int4 = _gossip.Int4()
    topk = staticmethod(_gossip.TopK)
    randomk = staticmethod(_gossip.RandomK)


# ---- Allreduce with Horovod's arguments (the factors and the integer average are the
# core's: shoal._horovod.scaling) ----

@_ops._told(_ops.ALLREDUCE)
def _allreduce_submit(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=None, is_hierarchical_local=False,
                      inplace=False, what="allreduce"):
    """Enqueue one allreduce with Horovod's extras; returns its handle."""
    ADAPTER._check(tensor, what)
    _check_op(op, what)
    rop = _ops.reduce_op(average, op)
    scope = _ops.MACHINE if is_hierarchical_local else _ops.WORLD
    return _ops.allreduce(ADAPTER, tensor, None, name, op=rop, inplace=inplace, scope=scope, process_set=process_set,
                          scaling=_torch_ops.scaling((tensor,), prescale_factor, postscale_factor))


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set):
    """Horovod's `allreduce_async`: start an allreduce of `tensor` (not modified); returns a
    handle for `synchronize`/`poll`. Same op as `allreduce_nonblocking`, with:

    * prescale_factor / postscale_factor: multiply each rank's tensor before the reduction
      and the result after it (Horovod's ScaleBuffer; integer tensors truncate toward zero).
      Average divides the sum by size() before the postscale (Horovod folds 1/size() into
      the postscale factor: the same value up to rounding).
    * op=Average on an integer tensor: the sum divided by size(), truncated toward zero
      (Horovod's integer average; Shoal's own names refuse it with ValueError).
    * process_set: a `ProcessSet` (add_process_set): over its members (size(): the set's).
    * op=Adasum: NotImplementedError.
    """
    return _allreduce_submit(tensor, average, name, op, prescale_factor, postscale_factor, process_set,
                             what="allreduce_async")


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set):
    """Horovod's `allreduce_async_`: in-place `allreduce_async` (contiguous tensor; the
    result overwrites it at `synchronize`)."""
    return _allreduce_submit(tensor, average, name, op, prescale_factor, postscale_factor, process_set,
                             inplace=True, what="allreduce_async_")


# Shared names (BlueFog and Horovod): BlueFog's positional order, Horovod's keywords; a
# str third positional argument (BlueFog's is_hierarchical_local is a bool) is Horovod's
# name, and the positional arguments are then read in Horovod's order.
_BLUEFOG_KEYS = frozenset(("average", "is_hierarchical_local", "name", "op"))


def _sig(text):
    ns = {"Compression": Compression, "global_process_set": global_process_set}
    exec(f"def f{text}: pass", ns)  # noqa: S102 - our own constant text
    return inspect.signature(ns["f"])


_EXTRAS = "prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set"
_SIGS = {
    "allreduce": (_sig(f"(tensor, average=None, is_hierarchical_local=False, name=None, op=None, *, "
                       f"compression=Compression.none, {_EXTRAS})"),
                  _sig(f"(tensor, average=None, name=None, compression=Compression.none, op=None, {_EXTRAS}, *, "
                       "is_hierarchical_local=False)")),
    "allreduce_": (_sig(f"(tensor, average=None, is_hierarchical_local=False, name=None, op=None, *, {_EXTRAS})"),
                   _sig(f"(tensor, average=None, name=None, op=None, {_EXTRAS}, *, is_hierarchical_local=False)")),
}


def _bind(what, tensor, args, kwargs):
    shoal_sig, horovod_sig = _SIGS[what]
    sig = horovod_sig if len(args) > 1 and isinstance(args[1], str) else shoal_sig
    try:
        bound = sig.bind(tensor, *args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"{what}{sig}: {exc}") from None
    bound.apply_defaults()
    return bound.arguments


def _plain(tensor, args, kwargs):
    """A call the BlueFog/Shoal op takes as it is (the torch.library path, differentiable)."""
    if not all(k in _BLUEFOG_KEYS for k in kwargs):
        return False
    if not isinstance(tensor, torch.Tensor):
        return True  # refused there (TypeError, told to the peers)
    return (tensor.is_floating_point() and not (len(args) > 1 and isinstance(args[1], str))
            and kwargs.get("op") is not Adasum and not (len(args) > 3 and args[3] is Adasum))


def allreduce(tensor, *args, **kwargs):
    if torch.compiler.is_compiling() or _plain(tensor, args, kwargs):
        return _torch_ops.allreduce(tensor, *args, **kwargs)
    a = _bind("allreduce", tensor, args, kwargs)
    ADAPTER._check(a["tensor"], "allreduce")
    compression = check_compression(a["compression"], "allreduce")
    _check_op(a["op"], "allreduce")
    sent, ctx = compression.compress(a["tensor"])
    # Factors of 1.0 are left out: a call without them can take the one-call C entry.
    factors = {k: f for k in ("prescale_factor", "postscale_factor") if (f := factor(a[k], k)) != 1.0}
    out = _torch_ops.allreduce(sent, a["average"], a["is_hierarchical_local"], a["name"], a["op"], **factors,
                               **_in_set(a["process_set"]))
    return compression.decompress(out, ctx)


allreduce.__signature__ = _SIGS["allreduce"][0]
allreduce.__doc__ = f"""Blocking allreduce; BlueFog's and Horovod's `allreduce`.

    Result: sum over ranks, or sum divided by size() (op=Average, the default; BlueFog's
    `average=`), or the element-wise minimum, maximum or product (op=Min/Max/Product),
    same shape and dtype; differentiable for floating tensors: for Sum and Average the
    gradient is the same allreduce (op, scaling factors, set) of the gradient, as Horovod's;
    for Min/Max/Product the derivative of the op (shoal/_gradients.py; Horovod reduces the
    gradients with the forward's op). Horovod's keywords: compression (hvd.Compression.fp16: floating
    tensors travel as float16), prescale_factor/postscale_factor, process_set (a
    `ProcessSet`: over its members), op=Adasum (NotImplementedError); op=Average on
    integers as in `allreduce_async`.

    Positional order: BlueFog's (tensor, average, is_hierarchical_local, name, op). A
    str third positional argument is Horovod's `name`; the positional arguments are then
    read in Horovod's order {_SIGS["allreduce"][1]}.
    """
# Plain calls (BlueFog's arguments, a plain tensor) go to the core from C; the rest here.
allreduce = _torch_ops.native(allreduce, _torch_ops.make_allreduce)


def allreduce_(tensor, *args, **kwargs):
    if torch.compiler.is_compiling() or _plain(tensor, args, kwargs):
        return TORCH_API["allreduce_"](tensor, *args, **kwargs)
    a = _bind("allreduce_", tensor, args, kwargs)
    return _ops.synchronize(_allreduce_submit(
        a["tensor"], a["average"], a["name"], a["op"], a["prescale_factor"], a["postscale_factor"],
        a["process_set"], a["is_hierarchical_local"], inplace=True, what="allreduce_"))


allreduce_.__signature__ = _SIGS["allreduce_"][0]
allreduce_.__doc__ = f"""Blocking in-place allreduce (returns `tensor`); BlueFog's and Horovod's
    `allreduce_`. Horovod's keywords as in `allreduce_async`. Positional order: BlueFog's;
    a str third positional argument is Horovod's `name`, and the positional arguments are
    then read in Horovod's order {_SIGS["allreduce_"][1]}."""


# ---- Broadcast / allgather: Horovod's names and its process_set keyword (a ProcessSet:
# only its members call it; root_rank is a world rank of the set) ----

def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Horovod's `broadcast_async` = `broadcast_nonblocking`: returns a handle; `tensor`
    is not modified."""
    return TORCH_API["broadcast_nonblocking"](tensor, root_rank, name, **_in_set(process_set))


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    """Horovod's `broadcast_async_` = `broadcast_nonblocking_` (in place)."""
    return TORCH_API["broadcast_nonblocking_"](tensor, root_rank, name, **_in_set(process_set))


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Blocking broadcast of `root_rank`'s tensor (BlueFog's and Horovod's). Differentiable,
    as Horovod's (BlueFog's torch op has no gradient): the root's gradient is the average of
    the ranks' gradients over `process_set`, the other ranks' zero."""
    return _torch_ops.broadcast(tensor, root_rank, name, **_in_set(process_set))


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Blocking in-place broadcast; returns `tensor` (BlueFog's and Horovod's)."""
    return TORCH_API["broadcast_"](tensor, root_rank, name, **_in_set(process_set))


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Horovod's `allgather_async` = `allgather_nonblocking`: returns a handle."""
    return TORCH_API["allgather_nonblocking"](tensor, name, **_in_set(process_set))


def allgather(tensor, name=None, process_set=global_process_set):
    """Blocking allgather along dim 0 (first dims may differ), in rank order (of the set's
    ranks in `process_set`); BlueFog's and Horovod's. Differentiable, as Horovod's (BlueFog's
    torch op has no gradient): the gradient is this rank's rows of the average of the ranks'
    gradients over `process_set`."""
    return _torch_ops.allgather(tensor, name, **_in_set(process_set))


# ---- Reducescatter: Horovod's names, positional order and extras ----

def _reducescatter_op(tensor, op, what):
    """Horovod's reducescatter op (Average or Sum), after the checks of its arguments."""
    ADAPTER._check(tensor, what)
    _check_op(op, what)
    rop = _ops.reduce_op(None, op)
    if rop is not Average and rop is not Sum:
        raise ValueError(f"{what}: op must be hvd.Average or hvd.Sum (as in Horovod), got {rop!r}")
    return rop


@_ops._told(_ops.REDUCESCATTER)
def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Horovod's `reducescatter` (its positional order): every rank's [d0, ...] tensor
    (same shape and dtype everywhere) reduced element-wise, op=Average (default) or Sum,
    and split along dim 0: rank r gets rows [start_r, start_r + n_r), n_r = d0 // size()
    plus one for the first d0 % size() ranks, as a new [n_r, ...] tensor (`shoal.reducescatter`).
    Differentiable for floating tensors, as Horovod's: the gradient is the allgather of the
    gradients (over `process_set`), times the set's size for Sum, times the scaling factors.
    compression
    (Compression.fp16/bf16), prescale_factor/postscale_factor and the integer average
    (truncated toward zero) as in `allreduce_async`. `process_set` (a ProcessSet): over
    its members (size(): the set's). Raises ValueError for a 0-d tensor, bool tensors or
    an op other than Average/Sum; NotImplementedError for Adasum; ShoalError when ranks
    disagree on shape, dtype or op."""
    compression = check_compression(compression, "reducescatter")
    rop = _reducescatter_op(tensor, op, "reducescatter")
    sent, ctx = compression.compress(tensor)
    out = _torch_ops.reducescatter(sent, rop, name, prescale_factor=prescale_factor,
                                   postscale_factor=postscale_factor, **_in_set(process_set))
    return compression.decompress(out, ctx)


@_ops._told(_ops.REDUCESCATTER)
def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0):
    """Horovod's `reducescatter_async`: start a `reducescatter` (same arguments, not
    differentiable); returns a handle for `synchronize`/`poll`."""
    rop = _reducescatter_op(tensor, op, "reducescatter_async")
    return _ops.reducescatter(ADAPTER, tensor, rop, name, process_set=process_set,
                              scaling=_torch_ops.scaling((tensor,), prescale_factor, postscale_factor))


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Horovod's `sparse_allreduce_async`: start the allreduce of a sparse COO tensor
    (any shape, same on every rank; nnz may differ) by two allgathers of its indices and
    values (`<name>.indices`, `<name>.values`; name None: a generated one); returns a
    function that waits and gives the sparse tensor of every rank's entries in rank order
    (uncoalesced), values divided by size() for op=Average (`shoal/_sparse.py`; in
    `process_set`, its members' and its size). Its dense form is the sum or average of the
    ranks' dense forms. Raises ValueError for a dense tensor; NotImplementedError for an op
    other than Sum/Average (as Horovod's TF); ShoalError (from the returned function) when
    ranks disagree."""
    _check_op(op, "sparse_allreduce_async")
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise ValueError(f"sparse_allreduce_async: expected a sparse COO tensor, got "
                         f"{getattr(tensor, 'layout', type(tensor).__name__)}")
    return _sparse_handle(tensor, name or STATE.unnamed("sparse_allreduce"), op, process_set)


def _sparse_handle(tensor, name, op, process_set=None):
    """Start the sparse allreduce of `tensor` (in `process_set`); the function that finishes it."""
    gathered = _sparse.sparse_allreduce(ADAPTER, tensor._indices().t().contiguous(), tensor._values().contiguous(),
                                        op, name, process_set)

    def result():
        indices, values = gathered()
        return torch.sparse_coo_tensor(indices.t(), values, tensor.shape, check_invariants=False)
    return result


def broadcast_optimizer_state(optimizer, root_rank, model=None, process_set=global_process_set):
    """`broadcast_optimizer_state(optimizer, root_rank)` (BlueFog's and Horovod's): every
    rank's optimizer state becomes root_rank's, bit-exact (see
    `shoal.torch.utility.broadcast_optimizer_state`). `model` (Horovod's form) is accepted
    and not needed: the root's whole state_dict travels. Over every rank only:
    NotImplementedError for another `process_set`."""
    _check_process_set(process_set, "broadcast_optimizer_state")
    return _utility.broadcast_optimizer_state(optimizer, root_rank)


def join(device=-1):
    """Horovod's `hvd.join(device=-1)`: this rank has run out of data; blocks until every
    rank has joined and returns the rank that joined last (int, the same everywhere).
    Meanwhile this rank contributes zeros to the others' allreduces (Average still divides
    by size(), as in Horovod) and reducescatters, the identity to their Min/Max/Product
    allreduces; semantics and errors: `shoal.join`. `device` (int) is
    Horovod's device for its zero tensors: Shoal's are in host memory whatever it is, so
    allreduces of CUDA tensors fail (ShoalError) while a rank is joined."""
    if isinstance(device, bool) or not isinstance(device, int):
        raise TypeError(f"join: device must be an int (a CUDA device index, or -1), got {device!r}")
    return _ops.join()


__all__ = sorted(set(_NEUTRAL) | {
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "allgather", "allgather_async", "broadcast_optimizer_state",
    "join", "reducescatter", "reducescatter_async", "sparse_allreduce_async",
    "Compression", "FP16Compressor", "BF16Compressor", "Sum", "Average", "Min", "Max", "Product", "ReduceOp"})
