"""Gradients of allreduce, neighbor_allreduce (transposed mixing), allgather and
broadcast match the manual formulas (allgather's and broadcast's: Horovod's, the ranks'
gradients averaged)."""
import torch, shoal.torch as bf
bf.init(); r, n = bf.rank(), bf.size()
x = torch.full((3,), float(r + 1), requires_grad=True)
y = bf.allreduce(x, average=False, name="ag1"); (y * (r + 1)).sum().backward()
# d/dx_r sum_k (k+1) * sum_j x_j = sum_k (k+1)
assert torch.equal(x.grad, torch.full((3,), n * (n + 1) / 2)), x.grad
x.grad = None
y = bf.neighbor_allreduce(x, name="ag2"); (y * (r + 1)).sum().backward()
import numpy as np
from shoal import topology as T
W = T.mixing_matrix(T.exponential_two_graph(n))  # uniform exp2 => W[i,k] weight k gives i
c = np.arange(1, n + 1.0)
want = W @ c  # dL/dx_i = sum_k W[i,k] c_k
assert torch.allclose(x.grad, torch.full((3,), want[r], dtype=torch.float32)), (x.grad, want[r])
x.grad = None
y = bf.allgather(x.view(1, 3).repeat(r + 1, 1), name="ag3"); (y * torch.arange(y.shape[0]).view(-1, 1)).sum().backward()
start = sum(k + 1 for k in range(r))
# Horovod's: the n ranks' (equal) gradients averaged
assert torch.equal(x.grad, torch.full((3,), float(sum(range(start, start + r + 1))))), x.grad
x.grad = None
y = bf.broadcast(x, 0, name="ag4"); (y * (r + 1)).sum().backward()
assert torch.equal(x.grad, torch.full((3,), (n + 1) / 2 if r == 0 else 0.0)), x.grad  # mean of the r + 1
print(r, "autograd ok")
