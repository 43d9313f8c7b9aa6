"""TensorFlow wrappers of the Shoal kernels, their gradients, and training helpers."""
import re

import numpy as np
import tensorflow as tf

import shoal
from shoal import _fault, _gradients, _hierarchical, _metrics, _ops, _sparse, process_sets
from shoal._gradients import grad_name
from shoal._horovod import factor, scaling
from shoal._process import STATE

from . import _build, _horovod

_lib = _build.load()


def _name(op, name, process_set=0):
    # Unnamed ops: eagerly, a process-wide count (ranks run eager ops in one order); in a
    # traced function, the function's name and a count that restarts for every trace, so a
    # retrace on one rank only (e.g. an uneven last batch) yields the same names. One count
    # per process set: only its members run its ops.
    if name:
        return _ops.op_name(name)
    in_set = f".ps{process_set}" if process_set else ""
    if tf.executing_eagerly():
        return STATE.unnamed(f"tf.{op}{in_set}")  # bounded, like the core's unnamed ops
    graph = tf.compat.v1.get_default_graph()
    with STATE.lock:
        counts = STATE.traced.setdefault(graph, {})  # ops named in this traced graph so far, by set
        k = counts.get(process_set, 0)
        counts[process_set] = k + 1
    fn = re.sub(r"^__inference_|_\d+$", "", getattr(graph, "name", "graph"))
    return f"tf.{fn}.{op}{in_set}.{k}"


def _no_xla(op):
    try:
        from tensorflow.python.ops import control_flow_util
        in_xla = control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())
    except Exception:  # noqa: BLE001 - internal API; if it moves, let TF's own error speak
        in_xla = False
    if in_xla:
        raise ValueError(f"shoal.tensorflow.{op} cannot run inside an XLA-compiled function "
                         "(jit_compile=True): XLA has no Shoal kernels. Call it outside the "
                         "compiled function, or compile with jit_compile=False.")


def _run(op, fn):
    """Run a kernel; eagerly, turn the runtime's Aborted error into ShoalError (a
    NeighborPatternError, also a ValueError, for send and receive ranks that disagree; a
    RankLostError after the recovery, fault-tolerant mode)."""
    _no_xla(op)
    try:
        return fn()
    except tf.errors.AbortedError as e:
        if tf.executing_eagerly() and "ShoalError: " in e.message:
            raise shoal_error(e) from None
        raise
    except tf.errors.InvalidArgumentError as e:
        if tf.executing_eagerly():
            raise ValueError(e.message) from None
        raise


def _reported(message, marker):
    """The text after `marker` in a TensorFlow error's message, less what TensorFlow
    appends: an eager op's " [Op:...] name: ...", a graph's node list."""
    return message.split(marker, 1)[1].split("\n\t [[", 1)[0].split(" [Op:", 1)[0]


def rank_lost(error):
    """The RankLostError of a TensorFlow error that reports a lost rank (fault-tolerant mode,
    docs/design.md §16): a kernel's "ShoalError: RankLostError: ...", or the RankLostError a
    host function of a traced step raised. Runs the recovery first (collective over the
    survivors, each of which reaches it through its own failed op; nothing when the numpy
    path recovered already). None for any other error."""
    if not isinstance(error, tf.errors.OpError) or "RankLostError: " not in error.message:
        return None
    return _fault.on_rank_lost(_reported(error.message, "RankLostError: ").split("\n", 1)[0],
                               shoal.basics.set_topology)


def shoal_error(error):
    """The ShoalError that a kernel's `tf.errors.AbortedError` "ShoalError: ..." reports, or
    None for another error; a lost rank gives `rank_lost`'s RankLostError."""
    if not isinstance(error, tf.errors.AbortedError) or "ShoalError: " not in error.message:
        return None
    lost = rank_lost(error)
    if lost is not None:
        return lost
    msg = _reported(error.message, "ShoalError: ")
    if msg.startswith("NeighborPatternError: "):
        return shoal.NeighborPatternError(msg[len("NeighborPatternError: "):])
    return shoal.ShoalError(msg)


def scaling_attrs(tensors, prescale_factor, postscale_factor):
    """The kernel attributes of Horovod's scaling of an op on `tensors` (a grouped op's
    members), done by the core (shoal._horovod.scaling): the factors, and for integer
    tensors (bool is none here: the core refuses it) Horovod's truncation, its integer
    average included."""
    integers = any(not (t.dtype.is_floating or t.dtype.is_complex) and t.dtype != tf.bool for t in tensors)
    return _attrs(scaling(prescale_factor, postscale_factor, integers))


def _attrs(scaling):
    """The kernel attributes of a (prescale, postscale) pair, or of None (no scaling): each
    factor as the text of its double (exact; TensorFlow's float attributes are 32-bit)."""
    if scaling is None:
        return {}
    return {"horovod_scaling": True, "prescale": repr(scaling[0]), "postscale": repr(scaling[1])}


def _sparse_allreduce(slices, rop, name, pre, post, process_set):
    """Horovod's allreduce of a tf.IndexedSlices (shoal/_sparse.py): two allgathers
    (values, indices), the values divided by the number of ranks for Average: the
    IndexedSlices of the sum or average (in `process_set`, of its members)."""
    _sparse.check_op(rop, "allreduce")
    if pre != 1.0 or post != 1.0:
        raise NotImplementedError("allreduce: prescale_factor/postscale_factor are not supported with "
                                  "tf.IndexedSlices (as in Horovod); use sparse_as_dense=True")
    ps = process_sets.id_of(process_set, "allreduce")
    indices_name, values_name = _sparse.names(_ops.op_name(name) or _name("allreduce.sparse", None, ps))
    values = allgather(slices.values, name=values_name, process_set=ps)
    indices = allgather(slices.indices, name=indices_name, process_set=ps)
    return tf.IndexedSlices(_sparse.scale(values, rop, process_sets.layout(ps)[0]), indices,
                            dense_shape=slices.dense_shape)


def allreduce(tensor, average=None, is_hierarchical_local=False, name=None, op=None, *,
              compression=_horovod.Compression.none, prescale_factor=1.0, postscale_factor=1.0,
              process_set=_horovod.global_process_set, device_dense="", device_sparse="", ignore_name_scope=False):
    """Sum, average, minimum, maximum or product (op=Sum/Average/Min/Max/Product) of
    `tensor` over all ranks (or this machine's ranks); semantics of `shoal.allreduce` (sum
    then divide; half types compute in float32). Differentiable (shoal/_gradients.py;
    op=Product with is_hierarchical_local has no gradient: NotImplementedError).

    Horovod's keywords (keyword-only here; the positional order is BlueFog's):
    compression (hvd.Compression.fp16/bf16: floating tensors travel in 16 bits, the
    result comes back in the input's dtype), prescale_factor/postscale_factor (multiply
    each rank's tensor before and the result after the reduction; integers truncate
    toward zero), process_set (a `ProcessSet`: over its members, whose size divides the
    Average; only they call it), op=Adasum (NotImplementedError). op=Average of an integer
    tensor is Horovod's: the sum divided by size() and truncated toward zero. A
    tf.IndexedSlices is reduced as in Horovod: an allgather of its values and indices
    (values divided by size() for Average). `device_dense`, `device_sparse` and
    `ignore_name_scope` (Horovod's) are accepted and change nothing: the op runs where the
    tensor is, and Shoal's op names never include TensorFlow's name scope.
    """
    _horovod.check_op(op, "allreduce")
    compression = _horovod.check_compression(compression, "allreduce")
    rop = _ops.reduce_op(average, op)
    if isinstance(tensor, tf.IndexedSlices):
        return _sparse_allreduce(tensor, rop, name, factor(prescale_factor, "prescale_factor"),
                                 factor(postscale_factor, "postscale_factor"), process_set)
    ps = process_sets.id_of(process_set, "allreduce")
    sent, ctx = compression.compress(tf.convert_to_tensor(tensor))
    attrs = scaling_attrs([sent], prescale_factor, postscale_factor)
    out = _run("allreduce", lambda: _lib.shoal_allreduce(
        sent, op_name=_name("allreduce", name, ps), reduce_op=rop.code, scope=int(bool(is_hierarchical_local)),
        process_set=ps, **attrs))
    return compression.decompress(out, ctx)


def broadcast(tensor, root_rank, name=None, is_hierarchical_local=False, *,
              process_set=_horovod.global_process_set, ignore_name_scope=False):
    """`root_rank`'s tensor on every rank; semantics of `shoal.broadcast`. `process_set`
    (Horovod's keyword, a `ProcessSet`): only its members call it; root_rank is a world
    rank of the set. `ignore_name_scope` (Horovod's, keyword-only here: the fourth
    positional argument is BlueFog's is_hierarchical_local) changes nothing (see
    `allreduce`). Differentiable, as Horovod's (BlueFog's sums): the root's gradient is
    the average of the ranks' gradients (over the set, or this machine's ranks), the
    others' zero (shoal/_gradients.py)."""
    ps = process_sets.id_of(process_set, "broadcast")
    return _run("broadcast", lambda: _lib.shoal_broadcast(
        tf.convert_to_tensor(tensor), op_name=_name("broadcast", name, ps), root_rank=int(root_rank),
        scope=int(bool(is_hierarchical_local)), process_set=ps))


def allgather(tensor, name=None, ignore_name_scope=False, process_set=_horovod.global_process_set):
    """Concatenation along dim 0 of every rank's tensor (first dims may differ); Horovod's
    positional order. `process_set` (a `ProcessSet`): its members' tensors, in their rank
    order; `ignore_name_scope` changes nothing (see `allreduce`). Differentiable, as Horovod's (BlueFog's sums): the gradient is this rank's
    rows of the average of the ranks' gradients (over the set; shoal/_gradients.py)."""
    ps = process_sets.id_of(process_set, "allgather")
    return _run("allgather", lambda: _lib.shoal_allgather(tf.convert_to_tensor(tensor),
                                                          op_name=_name("allgather", name, ps), process_set=ps))


def reducescatter(tensor, device_dense="", compression=_horovod.Compression.none, op=None, name=None,
                  process_set=_horovod.global_process_set, ignore_name_scope=False, prescale_factor=1.0,
                  postscale_factor=1.0):
    """Horovod's `reducescatter` (its positional order): every rank's [d0, ...] tensor (same
    shape and dtype everywhere) reduced element-wise, op=Average (default) or Sum, and
    split along dim 0: rank r gets rows [start_r, start_r + n_r), n_r = d0 // size() plus
    one for the first d0 % size() ranks (semantics of `shoal.reducescatter`).
    Differentiable, as Horovod's: the gradient is the allgather of the gradients (times the
    set's size for Sum, times the scaling factors). compression,
    prescale_factor/postscale_factor and the integer average (truncated toward zero) as in
    `allreduce`; device_dense and ignore_name_scope change nothing; process_set (a
    `ProcessSet`): over its members (size(): the set's). Raises ValueError for a 0-d
    tensor, bool tensors or an op other than Average/Sum; NotImplementedError for Adasum;
    ShoalError (eagerly) when ranks disagree on shape, dtype or op."""
    ps = process_sets.id_of(process_set, "reducescatter")
    _horovod.check_op(op, "reducescatter")
    compression = _horovod.check_compression(compression, "reducescatter")
    rop = Average if op is None else _ops.reduce_op(None, op)
    if rop is not Average and rop is not Sum:
        raise ValueError(f"reducescatter: op must be Average or Sum (as in Horovod), got {rop!r}")
    sent, ctx = compression.compress(tf.convert_to_tensor(tensor))
    attrs = scaling_attrs([sent], prescale_factor, postscale_factor)
    out = _run("reducescatter", lambda: _lib.shoal_reducescatter(
        sent, op_name=_name("reducescatter", name, ps), reduce_op=rop.code, process_set=ps, **attrs))
    return compression.decompress(out, ctx)


def _neighbor(tensor, a, name, kernel=None):
    return (kernel or _lib.shoal_neighbor_allreduce)(
        tensor, tf.constant(a["self_weight"], tf.float64), tf.constant(a["recv_ranks"], tf.int32),
        tf.constant(a["recv_weights"], tf.float64), tf.constant(a["send_ranks"], tf.int32),
        tf.constant(a["send_weights"], tf.float64), op_name=name, uniform=a["uniform"],
        topo_check=a["topo_check"])


def neighbor_allreduce(tensor, self_weight=None, src_weights=None, dst_weights=None,
                       enable_topo_check=True, name=None):
    """One neighbor-averaging step; semantics of `shoal.neighbor_allreduce` (static mode
    over `set_topology`'s graph, dynamic mode with dst_weights). Floating dtypes."""
    a = _ops.neighbor_args(self_weight, src_weights, dst_weights, enable_topo_check)
    tensor = tf.convert_to_tensor(tensor)
    return _run("neighbor_allreduce", lambda: _neighbor(tensor, a, _name("neighbor_allreduce", name)))


def neighbor_allgather(tensor, src_ranks=None, dst_ranks=None, enable_topo_check=True, name=None):
    """In-neighbors' tensors concatenated along dim 0; semantics of `shoal.neighbor_allgather`."""
    recv, send, check = _ops.neighbor_allgather_args(src_ranks, dst_ranks, enable_topo_check)
    return _run("neighbor_allgather", lambda: _lib.shoal_neighbor_allgather(
        tf.convert_to_tensor(tensor), tf.constant(recv, tf.int32), tf.constant(send, tf.int32),
        op_name=_name("neighbor_allgather", name), topo_check=check))


def hierarchical_neighbor_allreduce(tensor, self_weight=None, src_machine_weights=None,
                                    dst_machine_weights=None, enable_topo_check=False, name=None):
    """Sum within each machine, gossip between machine leaders, share within the machine,
    divide by local_size(); semantics of `shoal.hierarchical_neighbor_allreduce` (one op of
    the core; the machine weights resolved by shoal/_hierarchical.py). Floating dtypes."""
    op = "hierarchical_neighbor_allreduce"
    a = _hierarchical.machine_args(self_weight, src_machine_weights, dst_machine_weights, enable_topo_check)
    tensor = tf.convert_to_tensor(tensor)
    return _run(op, lambda: _neighbor(tensor, a, _name(op, name), _lib.shoal_hierarchical_neighbor_allreduce))


Sum, Average, Min, Max, Product = _ops.Sum, _ops.Average, _ops.Min, _ops.Max, _ops.Product


# ---- gradients: shoal/_gradients.py's formulas, run with the TensorFlow kernels ----
def _grad_name(op):
    name = op.get_attr("op_name")
    return grad_name(name.decode() if isinstance(name, bytes) else name)


def factors(op):
    """(prescale, postscale) of a Shoal op node (1.0 each without Horovod's scaling)."""
    if not op.get_attr("horovod_scaling"):
        return 1.0, 1.0
    return float(op.get_attr("prescale")), float(op.get_attr("postscale"))


def _times(t, f):
    return t * tf.cast(f, t.dtype) if f != 1.0 else t


@tf.RegisterGradient("ShoalAllreduce")
def _allreduce_grad(op, grad):
    return allreduce_grad(op.inputs[0], grad, op.get_attr("reduce_op"), op.get_attr("scope"),
                          _grad_name(op), op.get_attr("process_set"), *factors(op))


def allreduce_grad(x, grad, forward, scope, name, ps=0, pre=1.0, post=1.0):
    """The gradient of y = post * allreduce(pre * x) with reduce op code `forward` (a grouped
    allreduce's members too), its backward ops named `name` and suffixes, in process set
    `ps` (core id), as bindings/torch/_ops.py's: Sum and Average the same allreduce with the
    factors swapped; Min, Max, Product the derivative at the scaled input, times pre."""
    rop = _gradients.reduce_op_grad(forward)
    if forward in (Sum.code, Average.code):
        return _lib.shoal_allreduce(grad, op_name=name, reduce_op=rop, scope=scope, process_set=ps,
                                    **_attrs((post, pre) if (pre, post) != (1.0, 1.0) else None))

    def allreduce_sum(t, suffix):
        return _lib.shoal_allreduce(t, op_name=name + suffix if name else "", reduce_op=rop, scope=scope,
                                    process_set=ps)

    x, grad = _times(x, pre), _times(grad, post)
    if forward in (Min.code, Max.code):
        # Who holds the extremum of the scaled inputs: reduced again, as the forward's output
        # is postscaled and factors may differ by rank, so every rank runs this.
        y = _lib.shoal_allreduce(x, op_name=name + ".extremum" if name else "", reduce_op=forward, scope=scope,
                                 process_set=ps)
        g = _gradients.extremum_grad(x, y, grad, allreduce_sum, lambda a, b, like: tf.cast(tf.equal(a, b), like.dtype))
        return _times(g, pre)
    if scope != _ops.WORLD:
        raise NotImplementedError("allreduce: the gradient of op=Product with is_hierarchical_local=True is "
                                  "not implemented (it needs a machine-local allgather)")

    def others_product(t, suffix):
        every = _lib.shoal_allgather(tf.expand_dims(t, 0), op_name=name + suffix if name else "", process_set=ps)
        r = process_sets.layout(ps)[1]
        return tf.reduce_prod(tf.concat([every[:r], every[r + 1:]], 0), 0)
    return _times(_gradients.product_grad(x, grad, allreduce_sum, others_product), pre)


@tf.RegisterGradient("ShoalBroadcast")
def _broadcast_grad(op, grad):
    total = _lib.shoal_allreduce(grad, op_name=_grad_name(op), reduce_op=_gradients.GATHER_GRAD_OP,
                                 scope=op.get_attr("scope"), process_set=op.get_attr("process_set"))
    keeps = _gradients.broadcast_keeps(op.get_attr("root_rank"), op.get_attr("scope"))
    return total if keeps else tf.zeros_like(total)


@tf.RegisterGradient("ShoalAllgather")
def _allgather_grad(op, grad):
    ps = op.get_attr("process_set")
    total = _lib.shoal_allreduce(grad, op_name=_grad_name(op), reduce_op=_gradients.GATHER_GRAD_OP, scope=_ops.WORLD,
                                 process_set=ps)
    rows = tf.shape(op.inputs[0], out_type=tf.int64)[:1]
    every = _lib.shoal_allgather(rows, op_name=_grad_name(op) + ".rows", process_set=ps)
    start = _gradients.allgather_start(every, tf.reduce_sum, process_sets.layout(ps)[1])
    return total[start:start + rows[0]]


@tf.RegisterGradient("ShoalReducescatter")
def _reducescatter_grad(op, grad):
    # y = post * RS(pre * x): each rank's gradient times its postscale, gathered; times pre.
    ps, (pre, post) = op.get_attr("process_set"), factors(op)
    gathered = _lib.shoal_allgather(_times(grad, post), op_name=_grad_name(op), process_set=ps)
    return _times(_gradients.reducescatter_grad(gathered, op.get_attr("reduce_op"), process_sets.layout(ps)[0]), pre)


@tf.RegisterGradient("ShoalNeighborAllreduce")
def _neighbor_grad(op, grad):
    # The lists are constants `_neighbor` made from resolved Python values.
    lists = [tf.get_static_value(t) for t in op.inputs[1:]]
    if any(v is None for v in lists):
        raise ValueError(f"the gradient of shoal.tensorflow.{op.type} needs constant weights and ranks")
    self_w, recv, recv_w, send, send_w = lists
    p = _gradients.neighbor_peers(self_w, recv, recv_w, send, send_w, op.get_attr("uniform"))
    kernel = _lib.shoal_hierarchical_neighbor_allreduce if op.type == "ShoalHierarchicalNeighborAllreduce" else None
    return [_neighbor(grad, p, _grad_name(op), kernel), None, None, None, None, None]


# Linear in the machine sums: the gradient is the op with the transposed machine lists.
tf.RegisterGradient("ShoalHierarchicalNeighborAllreduce")(_neighbor_grad)


# ---- training helpers ----
def _assign_broadcast(variables, root_rank, name, process_set):
    for i, v in enumerate(variables):
        v.assign(broadcast(v, root_rank, name=f"{name}.{i}.{v.name}", process_set=process_set))


def broadcast_variables(variables, root_rank, process_set=_horovod.global_process_set, inplace=False):
    """Assign `root_rank`'s values to every variable (sorted by name), on every rank
    (Horovod's `broadcast_variables`; `inplace` changes nothing: the values are assigned;
    `process_set` (a ProcessSet): on its members, root_rank one of them)."""
    _assign_broadcast(sorted(variables, key=lambda v: v.name), root_rank, "broadcast_variables", process_set)


def broadcast_(variables, root_rank, name=None, process_set=_horovod.global_process_set):
    """Horovod's in-place `broadcast_`: assign `root_rank`'s values to `variables` (a list of
    tf.Variable, same shapes and dtypes on every rank, in the same order) and return their
    new values, a list of tensors. `process_set` (a ProcessSet): on its members, root_rank
    one of them. Errors as `broadcast`'s."""
    variables = list(variables)
    _assign_broadcast(variables, root_rank, _ops.op_name(name) or "broadcast_", process_set)
    return [v.read_value() for v in variables]


def consensus_distance(variables, name="consensus_distance"):
    """Ξ = sqrt((1/n) Σ_i ‖x_i − x̄‖²) over the given variables, in float64, as a float
    (eager; collective). See `shoal.torch.consensus_distance`."""
    return _metrics.consensus_distance(_metrics.host_flat(v.numpy() for v in variables), name)


def reduce_gradients(grads, variables, prefix, compression=_horovod.Compression.none, op=Average,
                     gradient_predivide_factor=1.0, sparse_as_dense=False, none_as_zeros=False,
                     what="DistributedOptimizer", process_set=_horovod.global_process_set):
    """Horovod's gradient allreduce (`_make_allreduce_grads_fn`): each gradient through
    `allreduce` named `<prefix>.<i>`, op Average or Sum; for Average the division is split
    around the sum (each gradient times 1/gradient_predivide_factor before, the average
    times gradient_predivide_factor after). A tf.IndexedSlices is densified with
    sparse_as_dense, else reduced by allgather. A None gradient stays None (Horovod's
    optimizer), or with `none_as_zeros` is reduced as zeros (every rank takes part). In
    `process_set` (a ProcessSet) over its members; on a rank outside it the gradients are
    returned as they are (Horovod's optimizers skip the reduction there)."""
    _horovod.check_op(op, what)
    process_sets.id_of(process_set, what)
    if isinstance(process_set, process_sets.ProcessSet) and not process_set.included():
        return list(grads)
    if op is not Average and op is not Sum:
        raise ValueError(f"{what}: op must be hvd.Average or hvd.Sum, got {op!r}")
    f = float(gradient_predivide_factor)
    if f <= 0:
        raise ValueError(f"{what}: gradient_predivide_factor must be > 0, got {gradient_predivide_factor!r}")
    pre, post = (1.0 / f, f) if op is Average else (1.0, 1.0)
    out = []
    for i, (g, v) in enumerate(zip(grads, variables)):
        if g is None:
            if not none_as_zeros:
                out.append(None)
                continue
            g = tf.zeros_like(v)
        if sparse_as_dense and isinstance(g, tf.IndexedSlices):
            g = tf.convert_to_tensor(g)
        out.append(allreduce(g, op=op, name=f"{prefix}.{i}", compression=compression,
                             prescale_factor=pre, postscale_factor=post, process_set=process_set))
    return out


class DistributedGradientTape:
    """Wraps a `tf.GradientTape`: `gradient()` returns gradients averaged over all ranks
    (Horovod's DistributedGradientTape), or, with `communication="neighbor"`, averaged
    with the in-neighbors of the current topology (decentralized gradient averaging).

    Works eagerly and inside tf.function. A gradient that is None on a rank is reduced
    as zeros (every rank must take part in every reduction), so the result is never None
    (Horovod leaves it None, and a rank that has it and one that does not then wait).

    Horovod's keywords (keyword-only: Horovod's second positional argument is
    device_dense, Shoal's is `communication`): compression (Compression.none/fp16/bf16),
    op (Average or Sum), gradient_predivide_factor, sparse_as_dense (a tf.IndexedSlices
    gradient is densified; else reduced by allgather of values and indices, as Horovod
    does), process_set (a `ProcessSet`: averaged over its members; a rank outside it gets
    its own gradients); device_dense,
    device_sparse, num_groups, groups are accepted and change nothing (Shoal places by
    the tensor's device and fuses whatever is ready in one cycle). With
    communication="neighbor" only the defaults of these are accepted, and sparse
    gradients are densified (neighbor averaging has no sparse form).

    `register_local_source(variable)` (Horovod's; `PartialDistributedGradientTape` calls
    it for local layers): that variable's gradient is not reduced, and is divided by
    size() with scale_local_gradients=True (as in Horovod).
    """

    def __init__(self, tape, communication="allreduce", name=None, *, device_dense="", device_sparse="",
                 compression=_horovod.Compression.none, sparse_as_dense=False, op=Average,
                 gradient_predivide_factor=1.0, num_groups=0, groups=None,
                 process_set=_horovod.global_process_set, scale_local_gradients=True):
        if communication not in ("allreduce", "neighbor"):
            raise ValueError("communication must be 'allreduce' or 'neighbor'")
        _horovod.check_op(op, "DistributedGradientTape")
        process_sets.id_of(process_set, "DistributedGradientTape")
        _horovod.check_compression(compression, "DistributedGradientTape")
        if op is not Average and op is not Sum:
            raise ValueError(f"DistributedGradientTape: op must be hvd.Average or hvd.Sum, got {op!r}")
        if communication == "neighbor" and (compression is not _horovod.Compression.none or op is not Average
                                            or gradient_predivide_factor != 1.0
                                            or process_sets.id_of(process_set, "DistributedGradientTape")):
            raise ValueError("DistributedGradientTape: compression, op, gradient_predivide_factor and process_set "
                             "apply to communication='allreduce' only")
        self._tape, self._communication, self._name = tape, communication, name
        self._local, self._scale_local = set(), bool(scale_local_gradients)
        self._reduce_kw = dict(compression=compression, op=op, gradient_predivide_factor=gradient_predivide_factor,
                               sparse_as_dense=sparse_as_dense, process_set=process_set)

    def __getattr__(self, attr):
        return getattr(self._tape, attr)

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    def register_local_source(self, source):
        """Horovod's: `source`'s gradient stays this rank's (see the class docstring)."""
        self._local.add(_ref(source))

    def gradient(self, target, sources, output_gradients=None):
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients)
        # Every rank must take part in every reduction: a gradient that is None here (the
        # variable did not affect this rank's loss) is reduced as zeros.
        prefix = self._name or _name("grad", None)
        flat, variables = list(tf.nest.flatten(grads)), tf.nest.flatten(sources)
        picked = [i for i, v in enumerate(variables) if _ref(v) not in self._local]
        if self._communication == "allreduce":
            out = reduce_gradients([flat[i] for i in picked], [variables[i] for i in picked], prefix,
                                   none_as_zeros=True, what="DistributedGradientTape", **self._reduce_kw)
        else:
            out = [neighbor_allreduce(tf.zeros_like(variables[i]) if flat[i] is None else
                                      tf.convert_to_tensor(flat[i]), name=f"{prefix}.{i}") for i in picked]
        n = process_sets.layout(process_sets.id_of(self._reduce_kw["process_set"], "DistributedGradientTape"))[0]
        for i, v in enumerate(variables):
            if _ref(v) in self._local:
                flat[i] = local_gradient(flat[i], self._scale_local, n)
        for i, g in zip(picked, out):
            flat[i] = g
        return tf.nest.pack_sequence_as(grads, flat)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None):
        """Horovod's: ([(local source, gradient)], [(other source, reduced gradient)])."""
        grads = self.gradient(target, sources, output_gradients)
        pairs = list(zip(sources, grads))
        return ([(s, g) for s, g in pairs if _ref(s) in self._local],
                [(s, g) for s, g in pairs if _ref(s) not in self._local])


def _ref(variable):
    """A hashable key of a tf.Variable (its ref()) or a Keras 3 Variable (its id)."""
    return variable.ref() if hasattr(variable, "ref") else id(variable)


def local_gradient(grad, scale, n=None):
    """A local variable's gradient (Horovod's scale_local_gradients): divided by the number
    of ranks `n` (default size(); a process set's size) when `scale`, else as it is; None
    stays None."""
    if grad is None or not scale:
        return grad
    n = n or shoal.size()
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values / n, grad.indices, grad.dense_shape)
    return grad / tf.cast(n, grad.dtype)


def _local_layers_variables(local_layers):
    import keras
    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    elif not all(isinstance(layer, keras.layers.Layer) for layer in local_layers):
        raise ValueError("All local layers must be of tf.keras.layers.Layer type.")
    return [v for layer in local_layers for v in layer.trainable_weights]


def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="",  # noqa: N802
                                   compression=_horovod.Compression.none, sparse_as_dense=False, op=Average,
                                   gradient_predivide_factor=1.0, num_groups=0, groups=None,
                                   process_set=_horovod.global_process_set, local_layers=None,
                                   scale_local_gradients=True):
    """Horovod's `PartialDistributedGradientTape` (its positional order): a
    DistributedGradientTape whose `local_layers` (Keras layers) keep their gradients
    local (not reduced; divided by size() with scale_local_gradients). ValueError for a
    local layer that is not a Keras layer."""
    local = _local_layers_variables(local_layers)
    tape = DistributedGradientTape(gradtape, device_dense=device_dense, device_sparse=device_sparse,
                                   compression=compression, sparse_as_dense=sparse_as_dense, op=op,
                                   gradient_predivide_factor=gradient_predivide_factor, num_groups=num_groups,
                                   groups=groups, process_set=process_set,
                                   scale_local_gradients=scale_local_gradients)
    for v in local:
        tape.register_local_source(v)
    return tape


# ---- Python objects (Horovod's horovod/tensorflow/functions.py) ----
def _pickle(obj):
    try:
        import cloudpickle as pickler  # Horovod's choice: lambdas and local classes travel too
    except ImportError:
        import pickle as pickler
    return np.frombuffer(pickler.dumps(obj), dtype=np.uint8)


def broadcast_object(obj, root_rank=0, session=None, name=None, process_set=_horovod.global_process_set):
    """Horovod's `broadcast_object`: root_rank's `obj` (pickled there, cloudpickle when
    installed) unpickled on every rank, root too. Eager only (`session`, TF1's, must be
    None); `process_set` (a ProcessSet): among its members, root_rank one of them. Two
    broadcasts (`<name>.sz`, `<name>.t`); the default name is "broadcast_object" (Horovod's
    is the object's type name, which can differ between root and the others)."""
    import pickle
    if session is not None:
        raise NotImplementedError("broadcast_object: TF1 sessions are not supported; call it eagerly")
    name = name or "broadcast_object"
    root = shoal.rank() == root_rank
    data = _pickle(obj) if root else np.zeros(0, np.uint8)
    size = broadcast(tf.constant([data.size], tf.int64), root_rank, name=name + ".sz", process_set=process_set)
    buf = data if root else np.zeros(int(size.numpy()[0]), np.uint8)
    buf = broadcast(tf.constant(buf), root_rank, name=name + ".t", process_set=process_set)
    return pickle.loads(buf.numpy().tobytes())


def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=_horovod.global_process_set):
    """Horovod's `broadcast_object_fn`: a function obj -> `broadcast_object(obj, root_rank,
    session, name, process_set)`."""
    return lambda obj: broadcast_object(obj, root_rank, session, name, process_set)


def allgather_object(obj, session=None, name=None, process_set=_horovod.global_process_set):
    """Horovod's `allgather_object` (its positional order): the list of every rank's
    (picklable) `obj`, in rank order (of `process_set`'s members if given). Eager only
    (`session`, TF1's, must be None)."""
    import pickle
    if session is not None:
        raise NotImplementedError("allgather_object: TF1 sessions are not supported; call it eagerly")
    name = name or "allgather_object"
    data = _pickle(obj)
    sizes = allgather(tf.constant([data.size], tf.int64), name=name + ".sz", process_set=process_set).numpy().tolist()
    flat = allgather(tf.constant(data), name=name + ".t", process_set=process_set).numpy()
    out, at = [], 0
    for s in sizes:
        out.append(pickle.loads(flat[at:at + s].tobytes()))
        at += s
    return out
