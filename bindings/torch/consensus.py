"""Consensus distance and consensus control (Kong et al., "Consensus Control for
Decentralized Deep Learning", ICML 2021).

Consensus distance Ξ = sqrt((1/n) Σ_i ‖x_i − x̄‖²) measures how far the ranks' models
have drifted apart. Decentralized training matches centralized training while Ξ stays
below a critical value, and it matters most in the first phase of training (before the
first learning-rate decay); `ConsensusControl` keeps Ξ at or below a target there.
"""
import torch

from shoal import _metrics

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


class ConsensusControl:
    """Keep the consensus distance at or below a target during the first phase of training.

    Args:
        target: Ξ bound in parameter units — a float, or `callable(step) -> float` for a
            schedule (e.g. a bound that grows after warm-up).
        until_step: stop controlling after this many optimizer steps (the paper's
            guideline: control matters in the first phase, before the first learning-rate
            decay); None controls throughout.
        check_every: measure Ξ every k communication steps (each check costs one
            allreduce of the model).
        max_extra_rounds: extra gossip rounds allowed per check before falling back.
        method: "gossip" (extra neighbor-averaging rounds until Ξ ≤ target, then exact
            averaging if still above after max_extra_rounds) or "allreduce" (exact
            averaging whenever Ξ > target).
    The controlled optimizer reports `extra_rounds` (gossip rounds added),
    `exact_averages` (allreduce fallbacks) and `last_consensus_distance`.
    """

    def __init__(self, target, until_step=None, check_every=1, max_extra_rounds=8, method="gossip"):
        if method not in ("gossip", "allreduce"):
            raise ValueError(f"method must be 'gossip' or 'allreduce', got {method!r}")
        if check_every < 1 or max_extra_rounds < 0:
            raise ValueError("check_every must be >= 1 and max_extra_rounds >= 0")
        self.target, self.until_step = target, until_step
        self.check_every, self.max_extra_rounds, self.method = check_every, max_extra_rounds, method

    def target_at(self, step):
        return float(self.target(step) if callable(self.target) else self.target)

    def active(self, step, comm_step):
        return (self.until_step is None or step < self.until_step) and comm_step % self.check_every == 0
