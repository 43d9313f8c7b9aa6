"""Consensus distance and consensus control (Kong et al., "Consensus Control for
Decentralized Deep Learning", ICML 2021).

Consensus distance Ξ = sqrt((1/n) Σ_i ‖x_i − x̄‖²) measures how far the ranks' models
have drifted apart. Decentralized training matches centralized training while Ξ stays
below a critical value, and it matters most in the first phase of training (before the
first learning-rate decay); `ConsensusControl` keeps Ξ at or below a target there.
"""
import torch

from shoal import _metrics
from shoal._consensus import ConsensusControl  # noqa: F401  (shoal.torch.ConsensusControl)

from ._adapter import ADAPTER


def _flat_params(model_or_tensors):
    if isinstance(model_or_tensors, torch.nn.Module):
        tensors = [p for p in model_or_tensors.parameters()]
    elif torch.is_tensor(model_or_tensors):
        tensors = [model_or_tensors]
    else:
        tensors = list(model_or_tensors)
    if not tensors:
        raise ValueError("consensus_distance: no tensors given")
    return torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])


def consensus_distance(model_or_tensors, name="consensus_distance"):
    """Ξ = sqrt((1/n) Σ_i ‖x_i − x̄‖²) over all ranks, as a Python float.

    Args: a module (its parameters), a tensor, or a list of tensors; every rank passes
        the same shapes. Computed in float64: x̄ with one allreduce of the flattened
        parameters, then one scalar allreduce of ‖x_i − x̄‖² (exact up to float64
        rounding, no cancellation). Collective.
    """
    return _metrics.consensus_distance(_flat_params(model_or_tensors), name, ADAPTER)
