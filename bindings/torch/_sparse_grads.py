"""Sparse gradients in the gradient allreduce (`DistributedOptimizer`; Horovod 0.28
`horovod/torch/optimizer.py`): a parameter whose gradient is a sparse COO tensor (e.g.
`nn.Embedding(sparse=True)`) is reduced

* without `sparse_as_dense`: by Horovod's sparse allreduce (shoal/_sparse.py: allgather of
  indices and values, values divided by size() for Average); the gradient stays sparse,
  holding every rank's entries (uncoalesced);
* with `sparse_as_dense`: densified, averaged with the dense gradients, and turned back
  into a sparse tensor afterwards (so optimizers that need sparse gradients, such as
  torch.optim.SparseAdam, still get them).

A rank whose parameter got no gradient takes part with an empty sparse gradient once this
rank has seen that parameter's gradient sparse (Horovod sends dense zeros, which cannot
pair with the other ranks' allgathers, and leaves a dense gradient); before that, it sends
dense zeros as for any parameter, so every rank must produce the sparse gradient at the
first step.
"""
import torch

from ._horovod import _sparse_handle


class SparseGradients:
    def __init__(self, as_dense, process_set=None):
        self.as_dense = bool(as_dense)
        self.process_set = process_set  # the optimizer's: the sparse allreduces run there
        self._sparse_dims = {}  # parameter -> sparse_dim of its sparse gradients so far
        self._densified = {}  # parameter -> sparse_dim, for the gradients densified this step

    def goes_sparse(self, p):
        """True when p's gradient is reduced by the sparse allreduce."""
        g = p.grad
        if g is None or g.layout != torch.sparse_coo:
            return False
        self._sparse_dims[p] = g.sparse_dim()
        return not self.as_dense

    def dense(self, p, name):
        """p's gradient as a dense tensor (densified in place of p.grad with as_dense)."""
        g = p.grad
        if g.layout == torch.strided:
            return g
        if not self.as_dense:
            raise ValueError(f"the gradient of {name!r} is {g.layout}: Shoal reduces dense or sparse COO "
                             "gradients; pass sparse_as_dense=True to densify it")
        self._densified[p] = g.sparse_dim()
        p.grad = g.to_dense()
        return p.grad

    def empty(self, p):
        """The gradient p takes part with when it has none here: an empty sparse one once
        its gradients were seen sparse (densified with as_dense), else None."""
        dims = self._sparse_dims.get(p)
        if dims is None:
            return None
        return torch.sparse_coo_tensor(torch.empty(dims, 0, dtype=torch.int64, device=p.device),
                                       p.new_empty((0,) + tuple(p.shape[dims:])), p.shape, check_invariants=False)

    def start(self, p, name, op):
        """Start the sparse allreduce of p's gradient; returns the function finishing it."""
        return _sparse_handle(p.grad, name, op, self.process_set)

    @staticmethod
    def install(g, result):
        """The reduced sparse gradient into g (Horovod's `p.grad.zero_().add_(result)`: the
        same tensor object)."""
        g.zero_().add_(result)

    def restore(self):
        """Densified gradients back to sparse tensors (after their average is in)."""
        densified, self._densified = self._densified, {}
        for p, dims in densified.items():
            if p.grad is not None and p.grad.layout == torch.strided:
                p.grad = p.grad.to_sparse(dims)
