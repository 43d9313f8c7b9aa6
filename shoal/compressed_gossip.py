"""Compressed gossip with error feedback: CHOCO-SGD's gossip step (Koloskova, Stich and
Jaggi, ICML 2019, Algorithm 1), kept consistent on schedules that change every step.

Every edge i -> k has a public copy x̂_ik that both ends hold identically: the sender sends
only q = Q(x_i − x̂_ik) (a `shoal.compression` payload) and both ends add Q's value to
their copy. Rank i then mixes on the public copies,

    x_i ← x_i + γ (Σ_j w_ij x̂_ji − (1 − w_ii) x̂_ik),

with W the step's mixing matrix (receiver weights: `self_weight` w_ii, `src_weights`
{j: w_ij}). Each edge's copy enters the sum once with + (at its receiver) and once with −
(at its sender), so when W is doubly stochastic (1 − w_ii is the total weight i's
receivers give it) the average of x over ranks is preserved exactly, whatever Q does; and
since x̂ tracks x, what Q drops at one step is sent at the next (error feedback) instead of
accumulating. With a lossless Q and γ = 1 the step is plain neighbor averaging
(w_ii x_i + Σ_j w_ij x_j): one-peer exponential schedules still average exactly in log2(n)
steps. Copies are per edge because a one-peer schedule reaches each peer only every few
steps; one payload per step goes to all of the step's destinations, so their copies must
have seen the same updates (a static topology, or one destination per step), else
ValueError. Memory: one copy of x per edge in use (one-peer exponential: 2·log2(n)).
One implementation for numpy arrays (shoal, shoal.keras) and torch tensors (shoal.torch, on
the tensor's device): the payloads travel by the framework's `neighbor_allgather`.
docs/design.md §21.
"""
import numpy as np

from shoal import _ops
from shoal.compression import Cast, Identity, _Quantized, arrays_of, by_name  # noqa: F401  (by_name: the optimizers')


def _adapter_of(x):
    """The op layer's adapter of `x`'s framework (numpy arrays, else torch tensors)."""
    if isinstance(x, np.ndarray):
        from shoal._numpy import ADAPTER
    else:
        from shoal.torch._adapter import ADAPTER
    return ADAPTER


def default_step(compressor, step=None):
    """The consensus step γ: `step` if given, else 1 without compression loss (none, fp16,
    bf16: plain averaging), 0.5 for int8/int4, 0.2 otherwise (sparse: CHOCO's γ shrinks
    with the fraction kept). None for no compressor."""
    if compressor is None:
        return None
    if step is not None:
        return step
    if isinstance(compressor, (Identity, Cast)):
        return 1.0
    return 0.5 if isinstance(compressor, _Quantized) else 0.2


class GossipRound:
    """A started gossip step: `finish()` waits for the neighbors' payloads and returns
    the mixed tensor."""

    def __init__(self, gossip, state):
        self._gossip, self._state = gossip, state

    def finish(self):
        return self._gossip.finish(self._state)


class CompressedGossip:
    """The public copies of one tensor's edges, and its gossip steps.

    Args:
        compressor: a `shoal.compression.Compressor` or its name ("int8", "topk:0.1", ...).
        gamma: the consensus step size γ in (0, 1] (CHOCO's; 1 with a lossless compressor is
            plain averaging; lossy compressors need smaller, e.g. 0.5 for int8, 0.1 for top-1 %).
        name: the ops' name prefix (distinct per tensor).
    Attributes: bytes_sent (payload bytes this rank sent), steps.
    """

    def __init__(self, compressor, gamma=1.0, name="gossip"):
        if not (isinstance(gamma, (int, float)) and 0 < gamma <= 1):
            raise ValueError(f"CompressedGossip: gamma must be in (0, 1], got {gamma!r}")
        self.compressor = by_name(compressor)
        self.gamma = float(gamma)
        self.name = name
        self.bytes_sent = 0
        self.steps = 0
        self._sent = {}      # destination rank -> x̂ of that edge (one tensor shared by edges updated together)
        self._received = {}  # source rank -> x̂ of that edge

    def start(self, x, self_weight, src_weights, dst_ranks):
        """Send this step's payload of `x` (a floating numpy array or torch tensor; its
        shape is kept) to
        `dst_ranks`; returns the round for `finish`. `src_weights` {rank: w_ij} and
        `self_weight` w_ii are this rank's row of W. Raises ValueError for weights or ranks
        that are not valid (as neighbor_allreduce) or destinations whose copies differ."""
        a = arrays_of(x)
        if not a.is_floating(x):
            raise ValueError(f"compressed gossip '{self.name}': needs a floating tensor, got {x.dtype}")
        dst = sorted(set(int(k) for k in dst_ranks))
        src = sorted(int(j) for j in src_weights)
        flat = a.flat(x)
        if not a.all_finite(flat):
            raise ValueError(f"compressed gossip '{self.name}': the tensor has inf or nan")
        copy = self._copy_for(dst, flat)
        payload = self.compressor.encode(flat - copy)
        handle = _ops.neighbor_allgather(_adapter_of(x), payload, src, dst, True, f"{self.name}.choco")
        self.bytes_sent += payload.shape[0] * len(dst)
        # The sender's copy takes the update once the exchange completes (finish), as the
        # receivers' copies do.
        sent = self.compressor.decode(payload, flat.shape[0], flat.dtype) if dst else None
        return (x, float(self_weight), {j: float(src_weights[j]) for j in src}, copy, sent, handle)

    def start_with(self, x, self_weight=None, src_weights=None, dst_weights=None):
        """`start` with neighbor_allreduce's arguments (the static topology when all are
        None, as `neighbor_allreduce`); returns a GossipRound."""
        a = _ops.neighbor_args(self_weight, src_weights, dst_weights, False, remember=False)
        recv = list(a["recv_ranks"])
        if a["uniform"]:
            w = 1.0 / (len(recv) + 1)
            sw, src = w, {j: w for j in recv}
        else:
            sw, src = a["self_weight"], dict(zip(recv, a["recv_weights"]))
        if a["send_weights"]:
            raise ValueError(f"compressed gossip '{self.name}': scaled sends (dst_weights values other than 1) "
                             "have no meaning here; each edge's weight is its receiver's")
        return GossipRound(self, self.start(x, sw, src, a["send_ranks"]))

    def finish(self, round_):
        """The mixed tensor of a round `start` returned (x's shape and dtype)."""
        x, self_weight, src_weights, copy, sent, handle = round_
        gathered = _ops.synchronize(handle)
        a = arrays_of(x)
        flat = a.flat(x)
        numel = flat.shape[0]
        size = self.compressor.payload_bytes(numel, flat.dtype)
        if gathered.shape[0] != size * len(src_weights):
            raise ValueError(f"compressed gossip '{self.name}': received {gathered.shape[0]} bytes from ranks "
                             f"{sorted(src_weights)}, expected {size} each (their tensors differ from this rank's "
                             f"{numel} x {flat.dtype})")
        if sent is not None:
            copy += sent
        # In place where it can be: each line is a pass over a model's worth of values.
        mixed = a.scaled(copy, -(1.0 - self_weight))
        for n, j in enumerate(sorted(src_weights)):
            update = self.compressor.decode(gathered[n * size:(n + 1) * size], numel, flat.dtype)
            theirs = self._received.get(j)
            if theirs is None:
                theirs = self._received[j] = update
            else:
                theirs += update
            a.add_scaled(mixed, theirs, src_weights[j])
        self.steps += 1
        return a.lerp(flat, mixed, self.gamma).reshape(x.shape)

    def _copy_for(self, dst, flat):
        """The public copy that this step's destinations share (made if none has one)."""
        a = arrays_of(flat)
        if not dst:
            return a.zeros_like(flat)
        copies = {id(self._sent[k]): self._sent[k] for k in dst if k in self._sent}
        fresh = [k for k in dst if k not in self._sent]
        if len(copies) > 1 or (copies and fresh):
            raise ValueError(f"compressed gossip '{self.name}': destinations {dst} were sent different updates "
                             "before (one payload goes to all of a step's destinations: use a static topology or "
                             "one destination per step)")
        copy = next(iter(copies.values())) if copies else a.zeros_like(flat)
        if any(self._sent[k] is copy for k in self._sent if k not in dst):
            copy = a.copy(copy)  # edges outside this step keep their own
        for k in dst:
            self._sent[k] = copy
        return copy
