"""Horovod's alltoall and grouped ops in `shoal.torch` (Horovod 0.28 horovod/torch/mpi_ops.py:
names, positional order, return conventions): `alltoall[_async]`, `grouped_allreduce[_]
[_async][_]`, `grouped_allgather[_async]`, `grouped_reducescatter[_async]`.

The ops are shoal._ops / shoal._grouped's (one core op each: shoal_enqueue_group makes a
group one negotiation, every member run or every member failed with one error); here they
are registered with torch.library (`torch.ops.shoal.alltoall`, `grouped_*`) with autograd
from shoal/_gradients.py's formulas; Horovod's compression wraps them as in `_horovod.py`,
and its prescale/postscale factors and integer average are the core's (shoal._horovod.scaling).
"""
import types

import torch

from shoal import _gradients, _grouped, _ops, process_sets
from shoal._gradients import grad_name
from shoal._horovod import check_compression, check_op, global_process_set
from shoal._ops import Average, Sum

from . import _ops as _torch_ops
from ._adapter import ADAPTER
from ._horovod import TORCH_API, Compression, _in_set


def _rop(code):
    return _ops.REDUCE_OPS_BY_CODE.get(code, code)


# ---- Registered ops (eager and torch.compile); `process_set`: the core's id (0: every rank).
# No defaults in the schemas: torch.library leaves out arguments equal to their defaults
# from what a tensor-list op's backward must mirror, so every argument is always given. ----

def _alltoall_impl(tensor, splits, name, process_set):
    return _ops.synchronize(_ops.alltoall(ADAPTER, tensor, splits, name or None, process_set=process_set))


def _alltoall_fake(tensor, splits, name, process_set):
    rows = torch.library.get_ctx().new_dynamic_size()
    return (tensor.new_empty((rows,) + tuple(tensor.shape[1:])),
            torch.empty((process_sets.layout(process_set)[0],), dtype=torch.int32))


def _grouped_allreduce_impl(tensors, reduce_op, local, name, process_set, prescale, postscale):
    rop = _rop(reduce_op)
    return _ops.synchronize(_grouped.grouped_allreduce(
        ADAPTER, list(tensors), None, name or None, op=rop, scope=_ops.MACHINE if local else _ops.WORLD,
        process_set=process_set, scaling=_torch_ops.scaling(tensors, prescale, postscale)))


def _grouped_allgather_impl(tensors, name, process_set):
    return _ops.synchronize(_grouped.grouped_allgather(ADAPTER, list(tensors), name or None, process_set))


def _grouped_allgather_fake(tensors, name, process_set):
    if process_sets.layout(process_set)[0] == 1:
        return [t.new_empty(t.shape) for t in tensors]
    ctx = torch.library.get_ctx()
    return [t.new_empty((ctx.new_dynamic_size(),) + tuple(t.shape[1:])) for t in tensors]


def _grouped_reducescatter_impl(tensors, reduce_op, name, process_set, prescale, postscale):
    rop = _rop(reduce_op)
    return _ops.synchronize(_grouped.grouped_reducescatter(
        ADAPTER, list(tensors), rop, name or None, process_set,
        scaling=_torch_ops.scaling(tensors, prescale, postscale)))


def _grouped_reducescatter_fake(tensors, reduce_op, name, process_set, prescale, postscale):
    size, rank = process_sets.layout(process_set)
    return [t.new_empty((_ops.reducescatter_rows(t.shape[0], size, rank) if t.dim() else 0,) + tuple(t.shape[1:]))
            for t in tensors]


_torch_ops._define("alltoall(Tensor tensor, int[]? splits, str name, int process_set) -> (Tensor, Tensor)",
                   _alltoall_impl, _alltoall_fake)
_torch_ops._define("grouped_allreduce(Tensor[] tensors, int reduce_op, bool local, str name, int process_set, "
                   "float prescale, float postscale) -> Tensor[]", _grouped_allreduce_impl,
                   lambda tensors, *args: [torch.empty_like(t) for t in tensors])
_torch_ops._define("grouped_allgather(Tensor[] tensors, str name, int process_set) -> Tensor[]",
                   _grouped_allgather_impl, _grouped_allgather_fake)
_torch_ops._define("grouped_reducescatter(Tensor[] tensors, int reduce_op, str name, int process_set, "
                   "float prescale, float postscale) -> Tensor[]", _grouped_reducescatter_impl,
                   _grouped_reducescatter_fake)


# ---- Autograd: shoal/_gradients.py's formulas, member by member ----

def _alltoall_setup(ctx, inputs, output):
    ctx.received, ctx.name, ctx.ps = output[1].tolist(), inputs[2], inputs[3]


def _alltoall_backward(ctx, grad, _received_grad):
    # Every row went from its sender to one receiver: the gradient goes back the same way,
    # an alltoall of the gradient with the splits this rank received.
    g, _ = torch.ops.shoal.alltoall(grad.contiguous(), ctx.received, grad_name(ctx.name), ctx.ps)
    return g, None, None, None


def _grouped_allreduce_setup(ctx, inputs, output):
    ctx.reduce_op, ctx.local, ctx.name, ctx.ps, ctx.pre, ctx.post = inputs[1:7]
    ctx.n = len(inputs[0])
    if ctx.reduce_op in (_ops.Min.code, _ops.Max.code, _ops.Product.code):
        ctx.save_for_backward(*inputs[0])


def _grouped_allreduce_backward(ctx, grads):
    grads, name, none = [g.contiguous() for g in grads], grad_name(ctx.name), (None,) * 6
    if ctx.reduce_op in (Sum.code, Average.code):  # the grouped allreduce of the gradients, factors swapped
        return (torch.ops.shoal.grouped_allreduce(grads, ctx.reduce_op, ctx.local, name, ctx.ps, ctx.post, ctx.pre),
                *none)
    # Min/Max/Product: each member as allreduce's gradient (bindings/torch/_ops.py).
    saved = ctx.saved_tensors
    out = []
    for i, g in enumerate(grads):
        one = types.SimpleNamespace(reduce_op=ctx.reduce_op, local=ctx.local, saved_tensors=(saved[i],),
                                    name=f"{ctx.name}.{i}" if ctx.name else "", process_set=ctx.ps, pre=ctx.pre,
                                    post=ctx.post)
        out.append(_torch_ops._allreduce_backward(one, g)[0])
    return (out, *none)


def _grouped_allgather_setup(ctx, inputs, output):
    ctx.rows, ctx.name, ctx.ps = [t.shape[0] for t in inputs[0]], inputs[1], inputs[2]


def _grouped_allgather_backward(ctx, grads):
    name = grad_name(ctx.name)
    totals = torch.ops.shoal.grouped_allreduce([g.contiguous() for g in grads], _gradients.GATHER_GRAD_OP, False,
                                               name, ctx.ps, 1.0, 1.0)
    every = torch.ops.shoal.grouped_allgather([torch.tensor([r], dtype=torch.int64) for r in ctx.rows],
                                              name + ".rows" if name else "", ctx.ps)
    me = process_sets.layout(ctx.ps)[1]
    starts = [int(_gradients.allgather_start(e, torch.sum, me)) for e in every]
    return [t[s:s + r] for t, s, r in zip(totals, starts, ctx.rows)], None, None


def _grouped_reducescatter_setup(ctx, inputs, output):
    ctx.reduce_op, ctx.name, ctx.ps, ctx.pre, ctx.post = inputs[1:6]


def _grouped_reducescatter_backward(ctx, grads):
    # As reducescatter's (bindings/torch/_ops.py), member by member.
    grads = [(g * ctx.post if ctx.post != 1.0 else g).contiguous() for g in grads]
    gathered = torch.ops.shoal.grouped_allgather(grads, grad_name(ctx.name), ctx.ps)
    n = process_sets.layout(ctx.ps)[0]
    out = [_gradients.reducescatter_grad(g, ctx.reduce_op, n) for g in gathered]
    return [g * ctx.pre if ctx.pre != 1.0 else g for g in out], None, None, None, None, None


if hasattr(torch.library, "register_autograd"):  # torch >= 2.4
    torch.library.register_autograd("shoal::alltoall", _alltoall_backward, setup_context=_alltoall_setup)
    torch.library.register_autograd("shoal::grouped_allreduce", _grouped_allreduce_backward,
                                    setup_context=_grouped_allreduce_setup)
    torch.library.register_autograd("shoal::grouped_allgather", _grouped_allgather_backward,
                                    setup_context=_grouped_allgather_setup)
    torch.library.register_autograd("shoal::grouped_reducescatter", _grouped_reducescatter_backward,
                                    setup_context=_grouped_reducescatter_setup)


# ---- Alltoall ----

@_ops._told(_ops.ALLTOALL)
def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Horovod's `alltoall`: rank r sends splits[q] rows of dim 0 (in order) to each rank q
    (without `splits`, dim 0 / size() rows each) and returns the rows every rank sent it,
    concatenated in rank order — the tensor alone, or (tensor, received_splits: int32 CPU
    tensor, one per rank) when `splits` (list or integer tensor) is given. Semantics and
    errors: `shoal.alltoall_nonblocking`. Differentiable: the gradient is the alltoall of
    the gradient with the received splits (Horovod's). `process_set` (a `ProcessSet`): among its
    ranks only, splits and received_splits indexed by position in the set."""
    ADAPTER._check(tensor, "alltoall")
    ps = process_sets.id_of(process_set, "alltoall")
    out, received = torch.ops.shoal.alltoall(tensor, _ops.split_list(splits), _ops.op_name(name), ps)
    return out if splits is None else (out, received)


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Horovod's `alltoall_async`: start an `alltoall`; `synchronize` gives (output,
    received_splits) whether or not `splits` was given."""
    return TORCH_API["alltoall_nonblocking"](tensor, splits, name, **_in_set(process_set))


# ---- Grouped ops with Horovod's extras ----

def _tensors(tensors, what):
    tensors = _grouped._tensor_list(tensors, what)
    for t in tensors:
        ADAPTER._check(t, what)
    return tensors


def _extras(tensors, average, op, prescale_factor, postscale_factor, process_set, what, scatter=False):
    """(reduce op, the core's scaling) of a grouped op with Horovod's arguments, after their
    checks. One reduce op serves the group: with op=Average, integer members are averaged
    as Horovod's (truncated toward zero) by the core, floating ones as usual."""
    process_sets.id_of(process_set, what)  # its TypeError/ValueError before anything runs
    check_op(op, what)
    rop = _ops.reducescatter_op(op) if scatter else _ops.reduce_op(average, op)
    return rop, _torch_ops.scaling(tensors, prescale_factor, postscale_factor)


def _differentiable(tensors):
    return all(t.is_floating_point() for t in tensors)


@_ops._told(_ops.GROUPED | _ops.ALLREDUCE)
def _grouped_allreduce_submit(tensors, average, name, op, prescale_factor, postscale_factor, process_set,
                              is_hierarchical_local=False, inplace=False, what="grouped_allreduce_async"):
    tensors = _tensors(tensors, what)
    rop, scaling = _extras(tensors, average, op, prescale_factor, postscale_factor, process_set, what)
    scope = _ops.MACHINE if is_hierarchical_local else _ops.WORLD
    return _grouped.grouped_allreduce(ADAPTER, tensors, None, name, op=rop, inplace=inplace, scope=scope,
                                      process_set=process_set, scaling=scaling)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                            process_set=global_process_set):
    """Horovod's `grouped_allreduce_async`: start a `grouped_allreduce` (tensors not
    modified); returns one handle, whose `synchronize` gives the list of results."""
    return _grouped_allreduce_submit(tensors, average, name, op, prescale_factor, postscale_factor, process_set)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set):
    """Horovod's `grouped_allreduce_async_`: in place (contiguous tensors, overwritten at
    `synchronize`)."""
    return _grouped_allreduce_submit(tensors, average, name, op, prescale_factor, postscale_factor, process_set,
                                     inplace=True, what="grouped_allreduce_async_")


@_ops._told(_ops.GROUPED | _ops.ALLREDUCE)
def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set, *,
                      is_hierarchical_local=False):
    """Horovod's `grouped_allreduce` (its positional order): the allreduce of every tensor of
    the list, negotiated as one unit under `name` (every member runs, consecutive members of
    one dtype fused, or every member fails with the same error on every rank; semantics of
    `shoal.grouped_allreduce_nonblocking`), as a list. op (default Average), compression,
    prescale/postscale_factor and the integer average as in `allreduce_async`;
    `is_hierarchical_local` (keyword, Shoal's): this machine's ranks only. Differentiable for
    floating tensors: the gradient is the grouped allreduce of the gradients (Sum, Average),
    or allreduce's gradient member by member (Min, Max, Product)."""
    what = "grouped_allreduce"
    tensors = _tensors(tensors, what)
    compression = check_compression(compression, what)
    sent, ctxs = zip(*[compression.compress(t) for t in tensors]) if tensors else ((), ())
    if _differentiable(sent):
        rop, scaling = _extras(sent, average, op, prescale_factor, postscale_factor, process_set, what)
        outs = torch.ops.shoal.grouped_allreduce(list(sent), rop.code, bool(is_hierarchical_local), _ops.op_name(name),
                                                 process_sets.id_of(process_set, what), *(scaling or (1.0, 1.0)))
    else:
        outs = _ops.synchronize(_grouped_allreduce_submit(list(sent), average, name, op, prescale_factor,
                                                          postscale_factor, process_set, is_hierarchical_local,
                                                          what=what))
    return [compression.decompress(o, c) for o, c in zip(outs, ctxs)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set, *, is_hierarchical_local=False):
    """Horovod's `grouped_allreduce_`: in-place `grouped_allreduce` (contiguous tensors);
    returns the list of the same tensors."""
    return _ops.synchronize(_grouped_allreduce_submit(tensors, average, name, op, prescale_factor, postscale_factor,
                                                      process_set, is_hierarchical_local, inplace=True,
                                                      what="grouped_allreduce_"))


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    """Horovod's `grouped_allgather_async`: returns one handle; `synchronize` gives the list."""
    return TORCH_API["grouped_allgather_nonblocking"](tensors, name, **_in_set(process_set))


@_ops._told(_ops.GROUPED | _ops.ALLGATHER)
def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """Horovod's `grouped_allgather`: every tensor of the list gathered along dim 0 (first
    dims may differ between ranks), negotiated as one unit (`shoal.grouped_allgather`), as a
    list. Differentiable, as Horovod's: each member's gradient is its rows of the average of
    the ranks' gradients (over `process_set`), as `allgather`'s."""
    tensors = _tensors(tensors, "grouped_allgather")
    ps = process_sets.id_of(process_set, "grouped_allgather")
    return torch.ops.shoal.grouped_allgather(tensors, _ops.op_name(name), ps)


@_ops._told(_ops.GROUPED | _ops.REDUCESCATTER)
def _grouped_reducescatter_submit(tensors, name, op, process_set, prescale_factor, postscale_factor,
                                  what="grouped_reducescatter_async"):
    tensors = _tensors(tensors, what)
    rop, scaling = _extras(tensors, None, op, prescale_factor, postscale_factor, process_set, what, scatter=True)
    return _grouped.grouped_reducescatter(ADAPTER, tensors, rop, name, process_set, scaling=scaling)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                                postscale_factor=1.0):
    """Horovod's `grouped_reducescatter_async`: start a `grouped_reducescatter`; returns one
    handle, whose `synchronize` gives the list."""
    return _grouped_reducescatter_submit(tensors, name, op, process_set, prescale_factor, postscale_factor)


@_ops._told(_ops.GROUPED | _ops.REDUCESCATTER)
def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Horovod's `grouped_reducescatter` (its positional order): every tensor of the list
    reduced (op Average, the default, or Sum) and split along dim 0 as `reducescatter`,
    negotiated as one unit (`shoal.grouped_reducescatter`), as a list. compression,
    prescale/postscale_factor and the integer average as in `reducescatter`.
    Differentiable for floating tensors, as Horovod's: each gradient is the allgather of the
    gradients (times the set's size for Sum), as `reducescatter`'s."""
    what = "grouped_reducescatter"
    tensors = _tensors(tensors, what)
    compression = check_compression(compression, what)
    sent, ctxs = zip(*[compression.compress(t) for t in tensors]) if tensors else ((), ())
    if _differentiable(sent):
        rop, scaling = _extras(sent, None, op, prescale_factor, postscale_factor, process_set, what, scatter=True)
        outs = torch.ops.shoal.grouped_reducescatter(list(sent), rop.code, _ops.op_name(name),
                                                     process_sets.id_of(process_set, what), *(scaling or (1.0, 1.0)))
    else:
        outs = _ops.synchronize(_grouped_reducescatter_submit(list(sent), name, op, process_set, prescale_factor,
                                                              postscale_factor, what=what))
    return [compression.decompress(o, c) for o, c in zip(outs, ctxs)]


__all__ = ["alltoall", "alltoall_async", "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
           "grouped_allreduce_async_", "grouped_allgather", "grouped_allgather_async", "grouped_reducescatter",
           "grouped_reducescatter_async"]
