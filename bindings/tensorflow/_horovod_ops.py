"""Horovod's alltoall and grouped ops in shoal.tensorflow (Horovod 0.28
horovod/tensorflow/mpi_ops.py and __init__.py: names, positional order, return conventions)
over the kernels ShoalAlltoall and ShoalGrouped{Allreduce,Allgather,Reducescatter}
(shoal_tf_ops.cc: one core op each; a grouped op is one negotiation whose members all run
or all fail with one error), with their gradients (shoal/_gradients.py's formulas).
Eager and inside tf.function.
"""
import tensorflow as tf

from shoal import _gradients, _ops, process_sets
from shoal._ops import Average, Sum

from . import _horovod
from .ops import _attrs, _grad_name, _lib, _name, _run, _times, allreduce_grad, factors, scaling_attrs


def alltoall(tensor, splits=None, name=None, ignore_name_scope=False, process_set=_horovod.global_process_set):
    """Horovod's `alltoall`: rank r sends splits[q] rows of its dim 0 (in order) to each rank
    q (without `splits`, dim 0 / size() rows each) and gets the rows every rank sent it,
    concatenated along dim 0 in rank order — the tensor alone, or (tensor, received_splits:
    int32, one per rank) when `splits` (a 1-d integer tensor or list) is given. Dims after
    the first and the dtype must agree across ranks. Semantics and errors:
    `shoal.alltoall_nonblocking` (eagerly ValueError for bad splits, ShoalError when ranks
    disagree). Differentiable: the gradient is the alltoall of the gradient with the
    received splits (Horovod's). `ignore_name_scope` changes nothing; `process_set` (a
    `ProcessSet`): among its members (ranks and splits are the set's, in ascending order)."""
    ps = process_sets.id_of(process_set, "alltoall")
    tensor = tf.convert_to_tensor(tensor)
    if splits is None:
        s = tf.constant([], tf.int64)
    else:
        s = tf.convert_to_tensor(splits)
        if not s.dtype.is_integer:
            raise TypeError(f"alltoall: splits must be integers, got {s.dtype.name}")
        s = tf.cast(tf.reshape(s, [-1]), tf.int64)
    out, received = _run("alltoall", lambda: _lib.shoal_alltoall(tensor, s, op_name=_name("alltoall", name, ps),
                                                                  process_set=ps))
    return out if splits is None else (out, received)


@tf.RegisterGradient("ShoalAlltoall")
def _alltoall_grad(op, grad, _received_grad):
    g, _ = _lib.shoal_alltoall(grad, tf.cast(op.outputs[1], tf.int64), op_name=_grad_name(op),
                               process_set=op.get_attr("process_set"))
    return g, None


def _tensors(tensors, what):
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{what}: tensors must be a list or tuple of tensors, got {type(tensors).__name__}")
    if not tensors:
        raise ValueError(f"{what}: no tensors to run")
    return [tf.convert_to_tensor(t) for t in tensors]


def _extras(tensors, rop, prescale_factor, postscale_factor, compression):
    """(compressed tensors, their contexts, the kernel's scaling attributes) of a grouped op
    with Horovod's arguments. One reduce op serves the group: with op=Average, integer
    members are averaged as Horovod's (truncated toward zero) by the core."""
    sent, ctxs = zip(*[compression.compress(t) for t in tensors])
    return list(sent), ctxs, scaling_attrs(sent, prescale_factor, postscale_factor)


def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="", compression=_horovod.Compression.none,
                      op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=_horovod.global_process_set,
                      ignore_name_scope=False, name=None, *, is_hierarchical_local=False):
    """Horovod's `grouped_allreduce` (its positional order): the allreduce of every tensor of
    the list, negotiated as one unit (every member runs, consecutive members of one dtype
    fused, or every member fails with the same error on every rank; semantics of
    `shoal.grouped_allreduce_nonblocking`), as a list. op (default Average), compression,
    prescale/postscale_factor and the integer average as in `allreduce`; device_* and
    ignore_name_scope change nothing; tf.IndexedSlices members are densified;
    `is_hierarchical_local` (keyword, Shoal's): this machine's ranks only. Differentiable:
    the gradient is the grouped allreduce of the gradients (Sum, Average), or allreduce's
    gradient member by member (Min, Max, Product). `process_set` (a `ProcessSet`): among its
    members (Average divides by its size)."""
    what = "grouped_allreduce"
    ps = process_sets.id_of(process_set, what)
    _horovod.check_op(op, what)
    compression = _horovod.check_compression(compression, what)
    rop = _ops.reduce_op(average, op)
    xs, ctxs, attrs = _extras(_tensors(tensors, what), rop, prescale_factor, postscale_factor, compression)
    scope = int(bool(is_hierarchical_local))
    outs = _run(what, lambda: _lib.shoal_grouped_allreduce(xs, op_name=_name(what, name, ps), reduce_op=rop.code,
                                                           scope=scope, process_set=ps, **attrs))
    return [compression.decompress(o, c) for o, c in zip(outs, ctxs)]


def grouped_allgather(tensors, name=None, ignore_name_scope=False, process_set=_horovod.global_process_set):
    """Horovod's `grouped_allgather`: every tensor of the list concatenated along dim 0 over
    the ranks (first dims may differ), negotiated as one unit, as a list. Differentiable,
    as Horovod's: each member's gradient is its rows of the average of the ranks' gradients
    (as `allgather`'s).
    `process_set` (a `ProcessSet`): over its members, in ascending order."""
    what = "grouped_allgather"
    ps = process_sets.id_of(process_set, what)
    xs = _tensors(tensors, what)
    return _run(what, lambda: _lib.shoal_grouped_allgather(xs, op_name=_name(what, name, ps), process_set=ps))


def grouped_reducescatter(tensors, device_dense="", compression=_horovod.Compression.none, op=Average,
                          process_set=_horovod.global_process_set, prescale_factor=1.0, postscale_factor=1.0,
                          name=None):
    """Horovod's `grouped_reducescatter` (its positional order; `name` is Shoal's): every
    tensor of the list reduced (op Average, the default, or Sum) and split along dim 0 as
    `reducescatter`, negotiated as one unit, as a list. compression, prescale/postscale
    and the integer average as in `reducescatter`. Differentiable, as Horovod's: each
    gradient is the allgather of the gradients (times the set's size for Sum). `process_set` (a
    `ProcessSet`): over its members (size(): the set's)."""
    what = "grouped_reducescatter"
    ps = process_sets.id_of(process_set, what)
    _horovod.check_op(op, what)
    compression = _horovod.check_compression(compression, what)
    rop = _ops.reducescatter_op(op)
    xs, ctxs, attrs = _extras(_tensors(tensors, what), rop, prescale_factor, postscale_factor, compression)
    outs = _run(what, lambda: _lib.shoal_grouped_reducescatter(xs, op_name=_name(what, name, ps), reduce_op=rop.code,
                                                               process_set=ps, **attrs))
    return [compression.decompress(o, c) for o, c in zip(outs, ctxs)]


def _filled(op, grads):
    # Every rank takes part in every member's backward op: an unused output's gradient is zeros.
    return [tf.zeros_like(y) if g is None else g for g, y in zip(grads, op.outputs)]


@tf.RegisterGradient("ShoalGroupedAllreduce")
def _grouped_allreduce_grad(op, *grads):
    forward, scope, name, ps = op.get_attr("reduce_op"), op.get_attr("scope"), _grad_name(op), op.get_attr("process_set")
    grads, (pre, post) = _filled(op, grads), factors(op)
    if forward in (Sum.code, Average.code):  # as allreduce's: the factors swapped
        return _lib.shoal_grouped_allreduce(grads, op_name=name, reduce_op=forward, scope=scope, process_set=ps,
                                            **_attrs((post, pre) if (pre, post) != (1.0, 1.0) else None))
    return [allreduce_grad(x, g, forward, scope, f"{name}.{i}" if name else "", ps, pre, post)
            for i, (x, g) in enumerate(zip(op.inputs, grads))]


@tf.RegisterGradient("ShoalGroupedAllgather")
def _grouped_allgather_grad(op, *grads):
    name, ps = _grad_name(op), op.get_attr("process_set")
    totals = _lib.shoal_grouped_allreduce(_filled(op, grads), op_name=name, reduce_op=_gradients.GATHER_GRAD_OP,
                                          scope=_ops.WORLD, process_set=ps)
    rows = [tf.shape(x, out_type=tf.int64)[:1] for x in op.inputs]
    every = _lib.shoal_grouped_allgather(rows, op_name=name + ".rows" if name else "", process_set=ps)
    me = process_sets.layout(ps)[1]
    out = []
    for total, r, e in zip(totals, rows, every):
        start = _gradients.allgather_start(e, tf.reduce_sum, me)
        out.append(total[start:start + r[0]])
    return out


@tf.RegisterGradient("ShoalGroupedReducescatter")
def _grouped_reducescatter_grad(op, *grads):
    ps, (pre, post) = op.get_attr("process_set"), factors(op)
    gathered = _lib.shoal_grouped_allgather([_times(g, post) for g in _filled(op, grads)], op_name=_grad_name(op),
                                            process_set=ps)
    n = process_sets.layout(ps)[0]
    return [_times(_gradients.reducescatter_grad(g, op.get_attr("reduce_op"), n), pre) for g in gathered]


__all__ = ["alltoall", "grouped_allreduce", "grouped_allgather", "grouped_reducescatter"]
