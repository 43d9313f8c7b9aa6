"""Decentralized Keras 3 optimizers: AWC and ATC over the static topology or a per-step
schedule, with consensus control (shoal.torch's `DistributedAdaptWithCombineOptimizer` /
`DistributedAdaptThenCombineOptimizer` for `model.fit`).

As `DistributedOptimizer` (`_optimizer.py`), each returns an instance of a class made on
the fly that derives from the wrapped optimizer's class and overrides Keras 3's `apply`:

* AWC: x⁺ = Σ_j w_ij x_j − γ·update(g_i(x_i)): the variables are combined with the
  neighbors first, then the wrapped optimizer applies the gradients taken at the old x.
* ATC: x⁺ = Σ_j w_ij (x_j − γ·update(g_j)): the wrapped optimizer's update first, then
  the combination.

The exchange runs every `num_steps_per_communication`-th apply (Keras' `iterations`),
through Shoal's numpy API (`shoal.neighbor_allreduce_nonblocking` of every variable, then
`synchronize`) in a `tf.numpy_function`, so it works eagerly and inside `model.fit`'s
tf.function, and a Python schedule advances once per executed exchange, not per trace.
Variables travel through host memory. Consensus control (shoal/_consensus.py) checks after
every apply, as in shoal.torch.
"""
import keras
import numpy as np
import tensorflow as tf

import shoal
from shoal import _consensus, _fault, _metrics, compressed_gossip, topology
from shoal._process import STATE

from ._optimizer import applied_variables


def schedule_of(schedule):
    """None (the static topology of `shoal.set_topology`), "one-peer-exp" (the one-peer
    exponential schedule: the exact average after log2(n) rounds for n a power of 2), or a
    callable `round -> (self_weight, src_weights, dst_weights)`; ValueError otherwise."""
    if schedule == "one-peer-exp":
        steps = topology.one_peer_exponential_schedule(shoal.size(), shoal.rank())

        def one_peer(_round):
            send, recv = next(steps)
            return 1.0 / (len(recv) + 1), {j: 1.0 / (len(recv) + 1) for j in recv}, send
        return one_peer
    if schedule is None or callable(schedule):
        return schedule
    raise ValueError(f"schedule must be None, 'one-peer-exp' or a callable, got {schedule!r}")


class Mixer:
    """The neighbor averaging of a list of host arrays (numpy), round after round, and
    the consensus control of one optimizer; counters as shoal.torch's optimizers. With a
    `compression`, each array's rounds are CHOCO-SGD's compressed gossip
    (`shoal.compressed_gossip`, docs/design.md §21)."""

    def __init__(self, schedule, prefix, consensus_control=None, compression=None, compression_step=None):
        if consensus_control is not None and not isinstance(consensus_control, _consensus.ConsensusControl):
            raise TypeError("consensus_control must be a shoal.keras.ConsensusControl")
        self.schedule, self.prefix, self.consensus_control = schedule_of(schedule), prefix, consensus_control
        self._schedule_given = schedule
        self.compression = None if compression is None else compressed_gossip.by_name(compression)
        self.compression_step = compressed_gossip.default_step(self.compression, compression_step)
        self._gossip = {}  # (array index, shape, dtype) -> CompressedGossip (its edges' public copies)
        self.rounds = self.steps = self.communications = self.extra_rounds = self.exact_averages = 0
        self.last_consensus_distance = None
        # Fault-tolerant mode (shoal._fault): rounds begun, the round whose exchange started
        # last, and the first round that mixes after a loss (shoal.torch's optimizers' rule).
        self._calls, self._sent_for, self._quiet_until, self._mixed = 0, -1, 0, True
        _fault.register(self)

    def combine(self, arrays):
        """One round: each array's weighted average with its in-neighbors (fused), or its
        compressed gossip step. Fault-tolerant mode: a round that a lost rank cut, and those
        every survivor then agreed to skip, leave the arrays as they are (a skipped gossip
        round); inside `shoal.keras.elastic.run` the RankLostError propagates instead."""
        call, self._calls = self._calls, self._calls + 1
        self._mixed = False  # this step's consensus control runs only after a round that mixed
        if call < self._quiet_until:
            return arrays
        self._sent_for = call
        try:
            out = self._mix(arrays, call)
        except _fault.RankLostError:
            if STATE.elastic_depth:
                raise
            return arrays
        self._mixed = True
        return out

    def _mix(self, arrays, call):
        kw = {}
        if self.schedule is not None:
            sw, src, dst = self.schedule(call)
            kw = dict(self_weight=sw, src_weights=src, dst_weights=dst)
        arrays = [np.ascontiguousarray(a) for a in arrays]
        if self.compression is not None:
            rounds = [self._gossip_of(i, a).start_with(a, **kw) for i, a in enumerate(arrays)]
            out = [r.finish() for r in rounds]
        else:
            handles = [shoal.neighbor_allreduce_nonblocking(a, name=f"{self.prefix}.{i}", enable_topo_check=False,
                                                            **kw) for i, a in enumerate(arrays)]
            out = [shoal.synchronize(h) for h in handles]
        self.rounds += 1
        self.communications += 1
        return out

    def fault_position(self):
        """The first round that can mix again if the job shrank now (shoal._fault)."""
        return max(self._calls, self._sent_for + 1)

    def fault_align(self, step):
        self._quiet_until = max(self._quiet_until, step)

    def fault_resync(self):
        """Over the survivors: the one-peer schedule made again for the new size, and the
        compressed gossip's public copies started afresh (their edges changed)."""
        if self._schedule_given == "one-peer-exp":
            self.schedule = schedule_of("one-peer-exp")
        self._gossip = {}

    def fault_restart(self):
        """hvd.elastic.run restored the last commit on every survivor: mix from the next round."""
        self._quiet_until = self._calls

    def _gossip_of(self, i, a):
        key = (i, a.shape, a.dtype)  # a changed variable starts new copies
        g = self._gossip.get(key)
        if g is None:
            g = self._gossip[key] = compressed_gossip.CompressedGossip(
                self.compression, self.compression_step, f"{self.prefix}.{i}")
        return g

    def control(self, arrays):
        """Count an optimizer step and run consensus control on `arrays` (updated in the
        list); returns the list. Fault-tolerant mode: a step whose round a lost rank cut or
        the survivors skipped runs no control (as in shoal.torch, where such a step is a
        local one), and a loss during the control ends it: after a loss every survivor's
        next op is the same, the next round's exchange."""
        self.steps += 1
        if not self._mixed:
            self._mixed = True
            return arrays
        try:
            return self._control(arrays)
        except _fault.RankLostError:
            if STATE.elastic_depth:
                raise
            return arrays

    def _control(self, arrays):

        def mix(op):
            handles = [op(np.ascontiguousarray(a), i) for i, a in enumerate(arrays)]
            arrays[:] = [shoal.synchronize(h) for h in handles]

        # The round index (rounds begun, skipped ones too) is the communication step: after
        # a loss it is the same on every survivor, where the count of rounds that mixed is not.
        checked = _consensus.control(
            self.consensus_control, self.steps, self._calls,
            lambda: _metrics.consensus_distance(_metrics.host_flat(arrays), f"{self.prefix}.xi"),
            lambda: mix(lambda a, i: shoal.neighbor_allreduce_nonblocking(a, name=f"{self.prefix}.cc.{i}")),
            lambda: mix(lambda a, i: shoal.allreduce_nonblocking(a, name=f"{self.prefix}.avg.{i}")))
        if checked is not None:
            self.last_consensus_distance, rounds, exact = checked
            self.extra_rounds += rounds
            self.exact_averages += int(exact)
        return arrays


def _run_on_host(fn, variables):
    """Assign fn(list of the variables' values as numpy arrays) to the variables, eagerly
    or inside a tf.function (tf.numpy_function: Python runs when the graph does)."""
    out = tf.numpy_function(lambda *a: [np.asarray(x, v.dtype) for x, v in zip(fn(list(a)), variables)],
                            [tf.convert_to_tensor(v) for v in variables],
                            [v.dtype for v in variables], stateful=True)
    for v, o in zip(variables, out):
        v.assign(tf.reshape(o, v.shape))


def _neighbor_class(base, mode, k):
    def mixer(self):
        return self.__dict__["_shoal_mixer"]

    def exchange(self, variables, due):
        def run():
            _run_on_host(mixer(self).combine, variables)
            return tf.constant(True)
        return tf.cond(due, run, lambda: tf.constant(False))

    def apply(self, grads, trainable_variables=None):
        variables = applied_variables(self, trainable_variables)
        if variables is None:
            return super(cls, self).apply(grads, trainable_variables)  # Keras' own error
        if not self.built:
            self.build(variables)
            self.built = True
        if mode == "awc":  # combine the variables the gradients were taken at, then update
            exchange(self, variables, tf.equal((self.iterations + 1) % k, 0))
        result = super(cls, self).apply(grads, trainable_variables)
        if mode == "atc":
            exchange(self, variables, tf.equal(self.iterations % k, 0))
        if mixer(self).consensus_control is not None:
            _run_on_host(mixer(self).control, variables)
        return result

    def counter(attr):
        return property(lambda self: getattr(mixer(self), attr), doc=f"The Mixer's `{attr}`.")

    what = "AdaptWithCombine" if mode == "awc" else "AdaptThenCombine"
    attrs = {"apply": apply, "__module__": base.__module__, "__qualname__": base.__qualname__,
             "__doc__": f"{base.__name__} with decentralized averaging ({what}; shoal.keras).",
             "_shoal_neighbor": mode}
    for attr in ("communications", "extra_rounds", "exact_averages", "last_consensus_distance", "consensus_control"):
        attrs[attr] = counter(attr)
    cls = type(base.__name__, (base,), attrs)
    return cls


def _wrap(optimizer, mode, schedule, num_steps_per_communication, consensus_control, name, compression=None,
          compression_step=None):
    what = "DistributedAdaptWithCombineOptimizer" if mode == "awc" else "DistributedAdaptThenCombineOptimizer"
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"{what}: expected a Keras 3 optimizer (keras.optimizers.Optimizer), got "
                        f"{type(optimizer).__name__}")
    k = num_steps_per_communication
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"{what}: num_steps_per_communication must be an int >= 1, got {k!r}")
    if keras.backend.backend() != "tensorflow":
        raise NotImplementedError(f"{what}: Keras backend {keras.backend.backend()!r}: use KERAS_BACKEND=tensorflow")
    mixer = Mixer(schedule, name or STATE.unnamed(f"keras.{mode}"), consensus_control, compression, compression_step)
    base = type(optimizer)
    base = getattr(base, "_shoal_base", base)
    cls = _neighbor_class(base, mode, k)
    cls._shoal_base = base
    opt = cls.from_config(optimizer.get_config())
    object.__setattr__(opt, "_shoal_mixer", mixer)  # not tracked by Keras
    return opt


def DistributedAdaptWithCombineOptimizer(optimizer, schedule=None, num_steps_per_communication=1,  # noqa: N802
                                         consensus_control=None, name=None, *, compression=None,
                                         compression_step=None):
    """Decentralized training with a Keras 3 optimizer, AWC (D-PSGD; BlueFog's and
    shoal.torch's `DistributedAdaptWithCombineOptimizer`): at every k-th apply,
    x⁺ = Σ_j w_ij x_j − γ·update(g_i(x_i)) — the trainable variables are averaged with the
    in-neighbors, then `optimizer`'s update with the gradients taken at the old values;
    the other applies update locally.

    Args:
        optimizer: a `keras.optimizers.Optimizer` (TensorFlow backend); a new instance of
            a subclass of its class is returned (from its config, as DistributedOptimizer).
        schedule: None (the static topology, `shoal.set_topology`; uniform or its
            weights), "one-peer-exp", or a callable `round -> (self_weight, src_weights,
            dst_weights)` (dynamic weights, as `shoal.neighbor_allreduce`'s).
        num_steps_per_communication: k (local steps in between).
        consensus_control: a `shoal.keras.ConsensusControl` (Kong et al. 2021), checked
            after every apply: extra gossip rounds or exact averaging keep Ξ ≤ target.
        name: prefix of the op names (default: generated, the same on ranks that create
            their optimizers in one order).
        compression: a gossip compressor or its name ("int8", "int4", "fp16", "bf16",
            "topk:R", "randomk:R"; `shoal.compression`): the exchange becomes CHOCO-SGD's
            compressed gossip with error feedback (as shoal.torch's `compression=`,
            docs/design.md §21); the mixing weights must be doubly stochastic.
        compression_step: its consensus step γ (default: `default_step`: 0.5 for int8/int4).
    The returned optimizer reports `communications`, `extra_rounds`, `exact_averages`,
    `last_consensus_distance`. Raises TypeError/ValueError for bad arguments,
    NotImplementedError for another Keras backend; ShoalError from the exchange.
    """
    return _wrap(optimizer, "awc", schedule, num_steps_per_communication, consensus_control, name, compression,
                 compression_step)


def DistributedAdaptThenCombineOptimizer(optimizer, schedule=None, num_steps_per_communication=1,  # noqa: N802
                                         consensus_control=None, name=None, *, compression=None,
                                         compression_step=None):
    """Decentralized training with a Keras 3 optimizer, ATC (BlueFog's and shoal.torch's
    `DistributedAdaptThenCombineOptimizer`): `optimizer`'s update, then at every k-th
    apply the trainable variables are averaged with the in-neighbors,
    x⁺ = Σ_j w_ij (x_j − γ·update(g_j)). Arguments and attributes as
    `DistributedAdaptWithCombineOptimizer`."""
    return _wrap(optimizer, "atc", schedule, num_steps_per_communication, consensus_control, name, compression,
                 compression_step)
