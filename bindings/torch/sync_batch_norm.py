"""`shoal.torch.SyncBatchNorm`: batch normalization over every rank's batch (Horovod's
`hvd.SyncBatchNorm`; the statistics and their gradient are shoal/_sync_batch_norm.py's)."""
import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from shoal import _ops, _process
from shoal import _sync_batch_norm as _math

from ._adapter import ADAPTER
from ._horovod import Sum, check_process_set, global_process_set


def _acc_dtype(dtype):
    """Statistics of half types are computed in float32 (as torch's BatchNorm does)."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _channel_shape(x):
    return (1, x.shape[1]) + (1,) * (x.dim() - 2)


class _GlobalMoments(torch.autograd.Function):
    """x [N, C, *] -> (mean [C], biased var [C], unbiased var [C]) of the global batch;
    the backward is `_math.input_grad` with one allreduce of the incoming gradients."""

    @staticmethod
    def forward(ctx, x, name, what):
        c = x.shape[1]
        acc = _acc_dtype(x.dtype)
        xs = x.detach().to(acc)
        dims = [0] + list(range(2, x.dim()))
        n_r = xs.numel() // c
        if n_r:
            mean_r = xs.mean(dims)
            m2_r = ((xs - mean_r.view(_channel_shape(xs))) ** 2).sum(dims)
        else:  # this rank has no samples: it contributes nothing
            mean_r = m2_r = xs.new_zeros(c)
        row = torch.cat([torch.tensor([float(n_r)], dtype=torch.float64),
                         mean_r.detach().to("cpu", torch.float64), m2_r.detach().to("cpu", torch.float64)])
        gathered = _ops.synchronize(_ops.allgather(ADAPTER, row.unsqueeze(0), name))
        n, mean, m2 = _math.combine(gathered, c, lambda t: t.sum(0))
        count = _math.check_count(n, what)
        ctx.save_for_backward(x)
        ctx.mean, ctx.count, ctx.name = mean, count, name
        out = (mean, m2 / count, m2 / (count - 1))
        unbiased = out[2].to(x.device, acc)
        ctx.mark_non_differentiable(unbiased)
        return out[0].to(x.device, acc), out[1].to(x.device, acc), unbiased

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_mean, g_var, _g_unbiased):
        (x,) = ctx.saved_tensors
        c = x.shape[1]
        packed = torch.cat([g_mean, g_var]).detach().to("cpu", torch.float64)
        summed = _ops.allreduce(ADAPTER, packed, None, ctx.name + ".grad", op=Sum, block=True)
        acc = _acc_dtype(x.dtype)
        shape = _channel_shape(x)
        g_mean_sum = summed[:c].to(x.device, acc).view(shape)
        g_var_sum = summed[c:].to(x.device, acc).view(shape)
        xmu = x.to(acc) - ctx.mean.to(x.device, acc).view(shape)
        return _math.input_grad(xmu, g_mean_sum, g_var_sum, ctx.count).to(x.dtype), None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalization whose statistics are those of the global batch: every rank's
    [N_r, C, *] batch together (Horovod's `hvd.SyncBatchNorm`, torch's
    `nn.SyncBatchNorm`; Ioffe & Szegedy 2015 over the concatenated batch).

    Args (torch's BatchNorm's): num_features C; eps; momentum (None: cumulative
    average); affine; track_running_stats; device, dtype; and process_set (Horovod's:
    the global one only, else NotImplementedError, until Shoal has process sets).

    Training (and eval without running stats): per channel, the mean and biased
    variance of all ranks' samples normalize each rank's input; N_r may differ between
    ranks (even be 0), each sample counts once. One allgather of [1 + 2C] float64 values
    per forward, one allreduce of 2C per backward (shoal/_sync_batch_norm.py). The
    input's gradient is that of the global loss Σ_r L_r, so a rank's input gradient is
    its slice of one process's gradient on the concatenated batch; the weight and bias
    gradients are this rank's part of it (the sum over ranks is one process's; a
    DistributedOptimizer averages them). running_mean/running_var are updated with the
    global mean and unbiased variance, as torch's BatchNorm would on the global batch,
    and agree on every rank. Eval with running stats normalizes locally, like
    BatchNorm. Half inputs compute in float32. On one rank it is torch's BatchNorm.

    Raises ValueError for an input with fewer than 2 dimensions or a global batch of at
    most one value per channel (on every rank); ShoalError when ranks disagree on C.
    Ops are named `sync_batch_norm.<C>` and `sync_batch_norm.<C>.grad`: every rank must
    run its SyncBatchNorm layers in the same order (as for any collective).
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 device=None, dtype=None, *, process_set=global_process_set, **kwargs):
        check_process_set(process_set, "SyncBatchNorm")
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype, **kwargs)
        self.process_set = process_set

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input):
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        if not use_batch_stats or _process.size() == 1:
            update = self.training and self.track_running_stats
            return F.batch_norm(input, self.running_mean if update or not self.training else None,
                                self.running_var if update or not self.training else None,
                                self.weight, self.bias, use_batch_stats, factor, self.eps)
        mean, var, unbiased = _GlobalMoments.apply(input, f"sync_batch_norm.{input.shape[1]}", "SyncBatchNorm")
        if self.training and self.track_running_stats:
            with torch.no_grad():
                self.running_mean.mul_(1.0 - factor).add_(factor * mean.to(self.running_mean.dtype))
                self.running_var.mul_(1.0 - factor).add_(factor * unbiased.to(self.running_var.dtype))
        shape = _channel_shape(input)
        acc = _acc_dtype(input.dtype)
        out = (input.to(acc) - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.weight is not None:
            out = out * self.weight.to(acc).view(shape)
        if self.bias is not None:
            out = out + self.bias.to(acc).view(shape)
        return out.to(input.dtype)

    @classmethod
    def convert_sync_batchnorm(cls, module, process_set=global_process_set):
        """torch's `nn.SyncBatchNorm.convert_sync_batchnorm`: `module` with every BatchNorm*d
        layer in it replaced by a SyncBatchNorm sharing its parameters and holding its
        buffers (the module itself if it is one). Returns the converted module."""
        out = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            out = cls(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats,
                      process_set=process_set)
            if module.affine:
                with torch.no_grad():
                    out.weight, out.bias = module.weight, module.bias
            out.running_mean, out.running_var = module.running_mean, module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.training = module.training
            if hasattr(module, "qconfig"):
                out.qconfig = module.qconfig
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child, process_set))
        return out
