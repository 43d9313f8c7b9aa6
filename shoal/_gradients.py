"""Gradients of the differentiable ops, written once for shoal.torch (torch.library
autograd) and shoal.tensorflow (tf.RegisterGradient); the bindings only run the ops.

- allreduce: d(Σ_j x_j)/dx_i = 1 on every rank, so the gradient is the same allreduce
  (same reduce op and scope) of the incoming gradients.
- broadcast: the root's value reaches every rank, so the root's gradient is the sum of
  every rank's gradient (allreduce Sum, same scope); the other ranks' is zero.
- allgather: rank r's rows are rows [start_r, start_r + n_r) of the result, so its
  gradient is that slice of the summed gradients (allreduce Sum), start_r = Σ_{q<r} n_q.
- neighbor_allreduce: y_k = sw_k x_k + Σ_{j∈recv_k} rw_kj d_jk x_j, so
  dL/dx_i = sw_i g_i + Σ_{k: i∈recv_k} rw_ki d_ik g_k: the transposed mixing step. Rank i
  receives g_k from its forward destinations, weighting by its own d_ik, and sends g_i to
  its forward sources, scaled by the weight each gave it (`neighbor_peers`).
Backward ops are named `grad_name(forward name)`.
"""
from . import _process
from ._ops import MACHINE


def grad_name(name):
    return name + ".grad" if name else ""


def broadcast_keeps(root, scope):
    """Whether this rank is the broadcast's root (in its scope): it keeps the summed gradient."""
    return (_process.local_rank() if scope == MACHINE else _process.rank()) == root


def allgather_start(rows_of_every_rank, reduce_sum=sum):
    """Where this rank's rows start in an allgather's result: `reduce_sum` (the framework's
    sum) of `rows_of_every_rank`[q < rank], the rows each lower rank contributed."""
    return reduce_sum(rows_of_every_rank[:_process.rank()])


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
