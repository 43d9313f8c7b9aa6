"""Gradients of the differentiable ops, written once for shoal.torch (torch.library
autograd) and shoal.tensorflow (tf.RegisterGradient); the bindings only run the ops.

The collectives follow Horovod's definitions (horovod/torch/mpi_ops.py and
horovod/tensorflow/mpi_ops.py, 0.28: the autograd functions' `backward` and the registered
gradients). They are not the derivatives of one loss: with L_k rank k's loss, allreduce's
are those of Σ_k L_k, allgather's and broadcast's those of the mean (1/n) Σ_k L_k,
reducescatter's n times those of Σ_k L_k. With g_k the incoming gradient on rank k and n
the number of ranks the op ran on (a process set's size; local_size() for a machine-local op):

- allreduce, Sum and Average: the same allreduce (same op, scope and set) of the g_k.
  Min/Max/Product are Shoal's (Horovod runs the forward's op on the gradients, which is no
  derivative of it): Min/Max: y = min_j x_j reaches every rank, so rank i's gradient is
  Σ_k g_k where x_i equals y, shared evenly between the ranks that tie (as
  torch.amin/amax do), and 0 elsewhere (`extremum_grad`). Product: dy/dx_i = Π_{j≠i} x_j,
  so the gradient is Σ_k g_k · Π_{j≠i} x_j, from an allgather of the inputs (no division:
  exact with zeros; `product_grad`).
- allgather: rank r's rows are rows [start_r, start_r + n_r) of the result; its gradient
  is that slice of (1/n) Σ_k g_k (an Average allreduce, `GATHER_GRAD_OP`),
  start_r = Σ_{q<r} n_q.
- broadcast: the root's gradient is (1/n) Σ_k g_k (an Average allreduce, `GATHER_GRAD_OP`);
  the other ranks' is zero.
- reducescatter: rank i's gradient is the allgather of the g_r (in rank order), times n for
  Sum and as it is for Average (`reducescatter_grad`).
- alltoall: the alltoall of the gradient back, with the splits this rank received.
- grouped ops: the single op's gradient, member by member.
- neighbor_allreduce (Shoal's; BlueFog defines none): y_k = sw_k x_k + Σ_{j∈recv_k} rw_kj
  d_jk x_j, so dL/dx_i = sw_i g_i + Σ_{k: i∈recv_k} rw_ki d_ik g_k: the transposed mixing
  step. Rank i receives g_k from its forward destinations, weighting by its own d_ik, and
  sends g_i to its forward sources, scaled by the weight each gave it (`neighbor_peers`).

BlueFog's torch ops define no gradients; BlueFog's TensorFlow ops sum where Horovod
averages (allgather, broadcast). One op serves both APIs here, and it follows Horovod's.
Backward ops are named `grad_name(forward name)`.
"""
from . import _process
from ._ops import MACHINE, Average, Sum

# The reduce op of the allreduce in the backward of allgather and broadcast: Horovod's
# average over the op's ranks.
GATHER_GRAD_OP = Average.code


def grad_name(name):
    return name + ".grad" if name else ""


def reduce_op_grad(op):
    """The reduce op of the backward allreduce of a forward allreduce with `op`'s code:
    the same op for Sum and Average, Sum (of the incoming gradients) for the others."""
    return op if op in (Sum.code, Average.code) else Sum.code


def reducescatter_grad(gathered, op, size=None):
    """The gradient of a reducescatter with reduce op code `op` over `size` ranks (default
    size(); a process set's size), from the allgather of the incoming gradients: as it is
    for Average, times `size` for Sum (Horovod's)."""
    return gathered * (size or _process.size()) if op == Sum.code else gathered


def extremum_grad(x, y, grad, allreduce_sum, indicator):
    """The gradient of y = allreduce(x, op=Min or Max): Σ_k g_k where x == y, divided by the
    number of ranks whose x equals y there, else 0. `allreduce_sum(t, suffix)` sums `t` over
    the ranks (named after the forward op plus `suffix`); `indicator(x, y, like)` is
    x == y as 1/0 in like's dtype."""
    hit = indicator(x, y, grad)
    return allreduce_sum(grad, "") * hit / allreduce_sum(hit, ".ties")


def product_grad(x, grad, allreduce_sum, others_product):
    """The gradient of y = allreduce(x, op=Product): Σ_k g_k · Π_{j≠i} x_j, where
    `others_product(x, suffix)` is the product of the other ranks' x (from an allgather
    named after the forward op plus `suffix`)."""
    return allreduce_sum(grad, "") * others_product(x, ".inputs")


def broadcast_keeps(root, scope):
    """Whether this rank is the broadcast's root (in its scope): it keeps the averaged gradient."""
    return (_process.local_rank() if scope == MACHINE else _process.rank()) == root


def allgather_start(rows_of_every_rank, reduce_sum=sum, rank=None):
    """Where this rank's rows start in an allgather's result: `reduce_sum` (the framework's
    sum) of `rows_of_every_rank`[q < rank], the rows each lower rank contributed (`rank`:
    this rank's place in the gather's ranks, default rank(); a process set's rank())."""
    return reduce_sum(rows_of_every_rank[:_process.rank() if rank is None else rank])


def neighbor_peers(self_weight, recv_ranks, recv_weights, send_ranks, send_weights, uniform):
    """The lists (a dict as `shoal._ops.neighbor_args` returns) of the backward step of a
    neighbor_allreduce that had these forward lists."""
    n = len(recv_ranks)
    sw = 1.0 / (n + 1) if uniform else float(self_weight)
    rw = [1.0 / (n + 1)] * n if uniform else [float(w) for w in recv_weights]
    dw = [float(w) for w in send_weights] if len(send_weights) else [1.0] * len(send_ranks)
    return {"recv_ranks": [int(r) for r in send_ranks], "recv_weights": dw, "self_weight": sw,
            "uniform": False, "send_ranks": [int(r) for r in recv_ranks], "send_weights": rw,
            "topo_check": False}
