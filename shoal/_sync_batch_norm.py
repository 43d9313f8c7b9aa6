"""Synchronized batch normalization's statistics, written once for `shoal.torch.SyncBatchNorm`
and `shoal.tensorflow.SyncBatchNormalization` (semantics: Horovod's `hvd.SyncBatchNorm` and
`SyncBatchNormalization`, i.e. Ioffe & Szegedy's batch normalization over the global batch,
the concatenation of every rank's batch; the bindings add their framework's layer).

Per channel c, rank r holds n_r samples x (N·H·W values for an [N, C, H, W] batch; the
n_r may differ between ranks, and may be 0).

Forward: each rank sends (n_r, m_r, M2_r) — its count, mean and sum of squared deviations
from its own mean — in one allgather of a float64 row [1 + 2C]; every rank combines the
rows in rank order (Chan, Golub & LeVeque 1979; no cancellation of large sums of squares):
    n = Σ n_r,   mean = Σ n_r m_r / n,   M2 = Σ M2_r + Σ n_r (m_r − mean)²,
    var = M2 / n (biased: what the layer normalizes with), M2 / (n − 1) (unbiased: torch's
    running_var). The same float64 operations on the same rows give the same values on
every rank.

Backward of (mean, var) with respect to rank r's sample x_i (the gradient of the global
loss Σ_r L_r): ∂mean/∂x_i = 1/n and ∂var/∂x_i = 2 (x_i − mean)/n (the term through the
mean vanishes: Σ (x − mean) = 0), so with g_mean, g_var every rank's incoming gradients
summed by one allreduce:
    dx_i = (Σ_r g_mean_r + 2 (x_i − mean) Σ_r g_var_r) / n        (`input_grad`).
The layer's normalization, scale and shift are differentiated locally by the framework;
the scale and shift's gradients stay local (the optimizer's gradient allreduce averages
them, as in Horovod).

Op names: the allgather is `<name>`, the backward allreduce `<name>.grad`.
"""
import numpy as np



def row_length(channels):
    """The float64 row a rank sends: [n_r, m_r (C values), M2_r (C values)]."""
    return 1 + 2 * channels


def combine(gathered, channels, sum0):
    """(n [1], mean [C], M2 [C]) of the global batch from the allgathered rows
    (`gathered`: [size, 1 + 2C] float64, a numpy array or framework tensor; `sum0` sums
    over dim 0, keeping the framework's type). Ranks with n_r = 0 contribute nothing."""
    n_r = gathered[:, 0:1]
    m_r = gathered[:, 1:1 + channels]
    m2_r = gathered[:, 1 + channels:1 + 2 * channels]
    n = sum0(n_r)
    mean = sum0(n_r * m_r) / n
    m2 = sum0(m2_r) + sum0(n_r * (m_r - mean) ** 2)
    return n, mean, m2


def check_count(n, what):
    """ValueError unless the global batch has more than one value per channel (torch's
    BatchNorm rule; `n` is the same on every rank, so is the error)."""
    n = int(np.asarray(n).reshape(-1)[0])
    if n <= 1:
        raise ValueError(f"{what}: expected more than 1 value per channel over all ranks' batches "
                         f"when training, got {n}")
    return n


def input_grad(x_minus_mean, g_mean_sum, g_var_sum, n):
    """dx = (Σ_r g_mean_r + 2 (x − mean) Σ_r g_var_r) / n for one rank's samples;
    `g_*_sum` broadcast against `x_minus_mean` (the channel axis in place)."""
    return (g_mean_sum + 2.0 * x_minus_mean * g_var_sum) / n
