"""Consensus distance (Kong et al., "Consensus Control for Decentralized Deep Learning",
ICML 2021), written once for every binding: shoal.torch, shoal.tensorflow and
shoal.keras flatten their tensors (`host_flat`) and call `consensus_distance`."""
import math

import numpy as np

from . import _ops
from ._loader import _core
from ._numpy import ADAPTER as NUMPY

_FLOATS = (np.float16, np.float32, np.float64)


def consensus_distance(x, name):
    """Ξ = sqrt((1/n) Σ_i ‖x_i − x̄‖²) over all ranks, as a Python float (collective).

    `x`: this rank's parameters as one flat numpy vector of float16, float32 or float64,
    of the same length and dtype on every rank. By shards: rank j receives shard j (1/n of
    the vector) of every rank's x in one alltoall in x's own dtype, computes x̄ over its
    shard and Σ_i ‖x_i − x̄‖² there in float64, and one allreduce of two float64 sums the
    shards' parts. Each rank sends and receives (n−1)/n of x, where an allreduce of x in
    float64 (x̄ everywhere) moves about 2(n−1)/n of it at 8 bytes an element. Exact up to
    float64 rounding, no cancellation. Ops are named `name + ".shards"` and `name + ".sq"`.
    Raises ValueError on every rank when the ranks' lengths differ; ShoalError when their
    dtypes differ.
    """
    n, rank = _core.size(), _core.rank()
    base, extra = divmod(len(x), n)
    splits = [base + (j < extra) for j in range(n)]
    shards, received = _ops.synchronize(_ops.alltoall(NUMPY, x, splits, name + ".shards"))
    # Every rank received its own shard's length from every rank only if all lengths agree.
    mismatch = any(int(k) != splits[rank] for k in received)
    sq = 0.0
    if not mismatch:
        rows = shards.reshape(n, splits[rank]).astype(np.float64)
        sq = float(((rows - rows.mean(axis=0)) ** 2).sum())
    total = _ops.allreduce(NUMPY, np.array([sq, float(mismatch)]), False, name + ".sq", block=True)
    if total[1] > 0:
        raise ValueError(f"consensus_distance: the ranks' parameters differ in length (this rank's: {len(x)}); "
                         "every rank must pass the same shapes")
    return math.sqrt(float(total[0]) / n)


def host_flat(arrays):
    """One flat numpy vector of the given host arrays, in their common floating dtype
    (float16, float32 or float64; anything else, bfloat16 included, as float32 or float64)."""
    arrays = [np.asarray(a) for a in arrays]
    if not arrays:
        raise ValueError("consensus_distance: no tensors given")
    dtype = np.result_type(*arrays)
    if dtype.type not in _FLOATS:
        dtype = np.float64 if dtype.itemsize > 4 or dtype.kind in "iu" else np.float32
    return np.concatenate([a.astype(dtype, copy=False).ravel() for a in arrays])
