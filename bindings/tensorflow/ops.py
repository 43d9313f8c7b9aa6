"""TensorFlow wrappers of the Shoal kernels, their gradients, and training helpers."""
import re

import tensorflow as tf

import shoal
from shoal import _gradients, _hierarchical, _metrics, _ops
from shoal._gradients import grad_name
from shoal._process import STATE

from . import _build

_lib = _build.load()


def _name(op, name):
    # Unnamed ops: eagerly, a process-wide count (ranks run eager ops in one order); in a
    # traced function, the function's name and a count that restarts for every trace, so a
    # retrace on one rank only (e.g. an uneven last batch) yields the same names.
    if name:
        return _ops.op_name(name)
    if tf.executing_eagerly():
        return STATE.unnamed(f"tf.{op}")  # bounded, like the core's unnamed ops
    graph = tf.compat.v1.get_default_graph()
    with STATE.lock:
        k = STATE.traced.get(graph, 0)  # ops named in this traced graph so far
        STATE.traced[graph] = k + 1
    fn = re.sub(r"^__inference_|_\d+$", "", getattr(graph, "name", "graph"))
    return f"tf.{fn}.{op}.{k}"


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
    """Run a kernel; eagerly, turn the runtime's Aborted error into ShoalError."""
    _no_xla(op)
    try:
        return fn()
    except tf.errors.AbortedError as e:
        if tf.executing_eagerly() and "ShoalError" in e.message:
            raise shoal.ShoalError(e.message.split("ShoalError: ", 1)[-1]) from None
        raise
    except tf.errors.InvalidArgumentError as e:
        if tf.executing_eagerly():
            raise ValueError(e.message) from None
        raise


def allreduce(tensor, average=None, is_hierarchical_local=False, name=None, op=None):
    """Sum or average of `tensor` over all ranks (or this machine's ranks); semantics of
    `shoal.allreduce` (sum then divide; half types accumulate in float32)."""
    rop = _ops.reduce_op(average, op)  # an average of integers: the core's ValueError
    tensor = tf.convert_to_tensor(tensor)
    return _run("allreduce", lambda: _lib.shoal_allreduce(
        tensor, op_name=_name("allreduce", name), reduce_op=rop.code, scope=int(bool(is_hierarchical_local))))


def broadcast(tensor, root_rank, name=None, is_hierarchical_local=False):
    """`root_rank`'s tensor on every rank; semantics of `shoal.broadcast`."""
    return _run("broadcast", lambda: _lib.shoal_broadcast(
        tf.convert_to_tensor(tensor), op_name=_name("broadcast", name), root_rank=int(root_rank),
        scope=int(bool(is_hierarchical_local))))


def allgather(tensor, name=None):
    """Concatenation along dim 0 of every rank's tensor (first dims may differ)."""
    return _run("allgather", lambda: _lib.shoal_allgather(tf.convert_to_tensor(tensor),
                                                          op_name=_name("allgather", name)))


def _neighbor(tensor, a, name):
    return _lib.shoal_neighbor_allreduce(
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
    divide by local_size(); semantics of `shoal.hierarchical_neighbor_allreduce`
    (shoal/_hierarchical.py, run here with the TensorFlow kernels)."""
    op = "hierarchical_neighbor_allreduce"
    name, peers = _hierarchical.resolve(self_weight, src_machine_weights, dst_machine_weights,
                                        enable_topo_check, _name(op, name))
    total = allreduce(tensor, op=Sum, is_hierarchical_local=True, name=name + ".machine_sum")
    return _hierarchical.run(
        total, name, peers, lambda x, stage, a: _run(op, lambda: _neighbor(x, a, stage)),
        lambda x, stage: broadcast(x, 0, name=stage, is_hierarchical_local=True),
        lambda x, n: x / tf.cast(n, x.dtype))


Sum, Average = _ops.Sum, _ops.Average


# ---- gradients: shoal/_gradients.py's formulas, run with the TensorFlow kernels ----
def _grad_name(op):
    name = op.get_attr("op_name")
    return grad_name(name.decode() if isinstance(name, bytes) else name)


@tf.RegisterGradient("ShoalAllreduce")
def _allreduce_grad(op, grad):
    return _lib.shoal_allreduce(grad, op_name=_grad_name(op), reduce_op=op.get_attr("reduce_op"),
                                scope=op.get_attr("scope"))


@tf.RegisterGradient("ShoalBroadcast")
def _broadcast_grad(op, grad):
    total = _lib.shoal_allreduce(grad, op_name=_grad_name(op), reduce_op=Sum.code, scope=op.get_attr("scope"))
    keeps = _gradients.broadcast_keeps(op.get_attr("root_rank"), op.get_attr("scope"))
    return total if keeps else tf.zeros_like(total)


@tf.RegisterGradient("ShoalAllgather")
def _allgather_grad(op, grad):
    total = _lib.shoal_allreduce(grad, op_name=_grad_name(op), reduce_op=Sum.code, scope=_ops.WORLD)
    rows = tf.shape(op.inputs[0], out_type=tf.int64)[:1]
    every = _lib.shoal_allgather(rows, op_name=_grad_name(op) + ".rows")
    start = _gradients.allgather_start(every, tf.reduce_sum)
    return total[start:start + rows[0]]


@tf.RegisterGradient("ShoalNeighborAllreduce")
def _neighbor_grad(op, grad):
    # The lists are constants `_neighbor` made from resolved Python values.
    lists = [tf.get_static_value(t) for t in op.inputs[1:]]
    if any(v is None for v in lists):
        raise ValueError("the gradient of shoal.tensorflow.neighbor_allreduce needs constant weights and ranks")
    self_w, recv, recv_w, send, send_w = lists
    p = _gradients.neighbor_peers(self_w, recv, recv_w, send, send_w, op.get_attr("uniform"))
    return [_neighbor(grad, p, _grad_name(op)), None, None, None, None, None]


# ---- training helpers ----
def broadcast_variables(variables, root_rank):
    """Assign `root_rank`'s values to every variable (sorted by name), on every rank."""
    for i, v in enumerate(sorted(variables, key=lambda v: v.name)):
        v.assign(broadcast(v, root_rank, name=f"broadcast_variables.{i}.{v.name}"))


def consensus_distance(variables, name="consensus_distance"):
    """Ξ = sqrt((1/n) Σ_i ‖x_i − x̄‖²) over the given variables, in float64, as a float
    (eager; collective). See `shoal.torch.consensus_distance`."""
    return _metrics.consensus_distance(_metrics.flat_float64(v.numpy() for v in variables), name)


class DistributedGradientTape:
    """Wraps a `tf.GradientTape`: `gradient()` returns gradients averaged over all ranks
    (Horovod's DistributedGradientTape), or, with `communication="neighbor"`, averaged
    with the in-neighbors of the current topology (decentralized gradient averaging).

    Works eagerly and inside tf.function. A gradient that is None on a rank is reduced
    as zeros (every rank must take part in every reduction), so the result is never None.
    """

    def __init__(self, tape, communication="allreduce", name=None):
        if communication not in ("allreduce", "neighbor"):
            raise ValueError("communication must be 'allreduce' or 'neighbor'")
        self._tape, self._communication, self._name = tape, communication, name

    def __getattr__(self, attr):
        return getattr(self._tape, attr)

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    def gradient(self, target, sources, output_gradients=None):
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients)
        # Every rank must take part in every reduction: a gradient that is None here (the
        # variable did not affect this rank's loss) is reduced as zeros, as in Horovod.
        prefix = self._name or _name("grad", None)
        out = []
        for i, (g, v) in enumerate(zip(tf.nest.flatten(grads), tf.nest.flatten(sources))):
            if g is None:
                g = tf.zeros_like(v)
            elif isinstance(g, tf.IndexedSlices):
                g = tf.convert_to_tensor(g)
            out.append(self._reduce(g, f"{prefix}.{i}"))
        return tf.nest.pack_sequence_as(grads, out)

    def _reduce(self, g, name):
        if self._communication == "allreduce":
            return allreduce(g, name=name)
        return neighbor_allreduce(g, name=name)
