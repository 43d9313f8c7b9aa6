"""Consensus control (Kong et al., "Consensus Control for Decentralized Deep Learning",
ICML 2021), written once for every binding: `ConsensusControl` (the settings) and
`control` (one check: measure Ξ, gossip extra rounds, fall back to exact averaging). The
bindings (shoal.torch's AWC/ATC optimizers, shoal.keras's) pass how to measure Ξ, run
one gossip round and average exactly on their tensors.
"""


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
        method: "gossip" (extra neighbor-averaging rounds over the static topology until
            Ξ ≤ target, then exact averaging if still above after max_extra_rounds; for
            hierarchical AWC/ATC with a machine topology set, a round is the hierarchical op
            over it) or "allreduce" (exact averaging whenever Ξ > target).
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


def control(cc, step, comm_step, measure, gossip, average):
    """One consensus-control check after optimizer step `step` (`comm_step` combines so
    far), if `cc` (a ConsensusControl or None) is active then: Ξ = measure(); while Ξ >
    target and method is "gossip", gossip() (one neighbor-averaging round of the model)
    and measure again, at most max_extra_rounds times; if Ξ is still above the target,
    average() (exact averaging over all ranks) and Ξ = 0. Returns None when inactive,
    else (Ξ after the check, gossip rounds added, whether it averaged exactly): the same
    on every rank (Ξ comes from an allreduce)."""
    if cc is None or not cc.active(step, comm_step):
        return None
    target = cc.target_at(step)
    xi, rounds = measure(), 0
    while cc.method == "gossip" and xi > target and rounds < cc.max_extra_rounds:
        gossip()
        rounds += 1
        xi = measure()
    exact = xi > target  # gossip could not get there (or method="allreduce"): average exactly
    if exact:
        average()
        xi = 0.0
    return xi, rounds, exact
