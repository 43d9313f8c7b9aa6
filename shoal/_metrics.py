"""Consensus distance (Kong et al., "Consensus Control for Decentralized Deep Learning",
ICML 2021), written once for every binding: shoal.torch, shoal.tensorflow and
shoal.keras flatten their tensors and call `consensus_distance` with their adapter."""
import math

import numpy as np

from . import _ops
from ._numpy import ADAPTER as NUMPY


def consensus_distance(x, name, adapter=NUMPY):
    """Ξ = sqrt((1/n) Σ_i ‖x_i − x̄‖²) over all ranks, as a Python float (collective).

    `x`: this rank's parameters flattened into one float64 vector of `adapter`'s tensor
    type (numpy by default), the same length on every rank. x̄ takes one allreduce of
    `x`, then one scalar allreduce of ‖x_i − x̄‖² (exact up to float64 rounding, no
    cancellation). Ops are named `name + ".mean"` and `name + ".sq"`.
    """
    mean = _ops.allreduce(adapter, x, True, name + ".mean", block=True)
    local = ((x - mean) ** 2).sum().reshape(1)
    return math.sqrt(float(_ops.allreduce(adapter, local, True, name + ".sq", block=True)[0]))


def flat_float64(arrays):
    """One float64 vector of the given host arrays, each flattened, in order."""
    return np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays])
