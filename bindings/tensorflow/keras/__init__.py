"""shoal.keras: Keras 3 callbacks for data-parallel and decentralized training.

Horovod's three (`BroadcastGlobalVariablesCallback`, `MetricAverageCallback`,
`LearningRateWarmupCallback`) and two decentralized ones: `NeighborAveragingCallback`
(average the model's weights with neighbors every k batches, over a static graph or a
per-step schedule such as one-peer exponential) and `ConsensusDistanceCallback` (log Ξ).
They use only Keras 3's public surface (`model.weights`, `optimizer.variables`,
`optimizer.learning_rate`, `logs`) and move weights through Shoal's numpy API, so they
run with any backend whose variables are host-readable (tensorflow, torch on CPU).

A Keras `DistributedOptimizer` is deliberately not offered: Keras 3 has no stable hook
to reduce gradients inside `apply()` across backends; for gradient averaging use
`shoal.tensorflow.DistributedGradientTape` in a custom train step, and for
decentralized training these callbacks (weights averaged after the local step: ATC).
"""
import keras
import numpy as np

import shoal
from shoal import _metrics, topology

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateWarmupCallback",
           "NeighborAveragingCallback", "ConsensusDistanceCallback", "consensus_distance"]


def _arrays(variables):
    return [np.asarray(keras.ops.convert_to_numpy(v)) for v in variables]


def consensus_distance(variables, name="keras.consensus_distance"):
    """Ξ = sqrt((1/n) Σ_i ‖x_i − x̄‖²) of the given variables over all ranks (float64)."""
    return _metrics.consensus_distance(_metrics.flat_float64(_arrays(variables)), name)


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Make every rank start from `root_rank`'s model: broadcast the model's weights at
    the start of training, and the optimizer's variables after the first batch (when
    Keras has created them)."""

    def __init__(self, root_rank=0):
        super().__init__()
        self.root_rank = root_rank
        self._optimizer_done = False

    def _broadcast(self, variables, tag):
        for i, (v, a) in enumerate(zip(variables, _arrays(variables))):
            v.assign(shoal.broadcast(a, self.root_rank, name=f"keras.bcast.{tag}.{i}"))

    def on_train_begin(self, logs=None):
        self._broadcast(self.model.weights, "model")

    def on_train_batch_end(self, batch, logs=None):
        if not self._optimizer_done and self.model.optimizer is not None and self.model.optimizer.variables:
            self._broadcast(self.model.optimizer.variables, "optimizer")
            self._broadcast(self.model.weights, "model.after_first_batch")
            self._optimizer_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Average every numeric entry of `logs` over ranks at the end of each epoch, so later
    callbacks (checkpoints, LR plateau, History) see global values. Put it before them."""

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.isscalar(v) or np.ndim(v) == 0)
        vals = shoal.allreduce(np.array([float(logs[k]) for k in keys], np.float64),
                               name=f"keras.metrics.{epoch}")
        logs.update({k: float(v) for k, v in zip(keys, vals)})


class LearningRateWarmupCallback(keras.callbacks.Callback):
    """Goyal et al. warm-up: the learning rate grows linearly from initial_lr/size() to
    initial_lr over `warmup_epochs` (per batch when steps_per_epoch is known)."""

    def __init__(self, initial_lr, warmup_epochs=5, steps_per_epoch=None, verbose=0):
        super().__init__()
        self.initial_lr, self.warmup_epochs = float(initial_lr), warmup_epochs
        self.steps_per_epoch, self.verbose = steps_per_epoch, verbose
        self._epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        if self.steps_per_epoch is None:
            self.steps_per_epoch = self.params.get("steps") if self.params else None

    def on_train_batch_begin(self, batch, logs=None):
        if self._epoch >= self.warmup_epochs:
            return
        progress = self._epoch + (batch / self.steps_per_epoch if self.steps_per_epoch else 0)
        n = shoal.size()
        self.model.optimizer.learning_rate = self.initial_lr / n * (progress * (n - 1) / self.warmup_epochs + 1)

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.warmup_epochs - 1:
            self.model.optimizer.learning_rate = self.initial_lr
            if self.verbose and shoal.rank() == 0:
                print(f"\nEpoch {epoch + 1}: finished learning-rate warm-up to {self.initial_lr:g}")


class NeighborAveragingCallback(keras.callbacks.Callback):
    """Average the model's weights with the neighbors every `every_k_batches` batches.

    Args:
        every_k_batches: communicate after every k-th batch (local steps in between).
        schedule: None — static topology of `shoal.set_topology` (default exp-2 graph),
            uniform or its weights; "one-peer-exp" — the one-peer exponential schedule
            (exact average after log2(n) rounds for n a power of 2); or a callable
            `round -> (self_weight, src_weights, dst_weights)` for any dynamic schedule.
    The rank's model after a round is Σ_j w_ij x_j (Keras' optimizer step first: ATC).
    """

    def __init__(self, every_k_batches=1, schedule=None):
        super().__init__()
        self.every_k_batches, self.rounds, self._batches = every_k_batches, 0, 0
        if schedule == "one-peer-exp":
            steps = topology.one_peer_exponential_schedule(shoal.size(), shoal.rank())

            def one_peer(_round):
                send, recv = next(steps)
                return 1.0 / (len(recv) + 1), {j: 1.0 / (len(recv) + 1) for j in recv}, send
            self.schedule = one_peer
        elif schedule is None or callable(schedule):
            self.schedule = schedule
        else:
            raise ValueError(f"schedule must be None, 'one-peer-exp' or a callable, got {schedule!r}")

    def average_now(self):
        """One averaging round of all trainable weights (fused into one exchange)."""
        kw = {}
        if self.schedule is not None:
            sw, src, dst = self.schedule(self.rounds)
            kw = dict(self_weight=sw, src_weights=src, dst_weights=dst, enable_topo_check=False)
        variables = self.model.trainable_weights
        handles = [shoal.neighbor_allreduce_nonblocking(a, name=f"keras.nbr.{i}", **kw)
                   for i, a in enumerate(_arrays(variables))]
        for v, h in zip(variables, handles):
            v.assign(shoal.synchronize(h))
        self.rounds += 1

    def on_train_batch_end(self, batch, logs=None):
        self._batches += 1
        if self._batches % self.every_k_batches == 0:
            self.average_now()


class ConsensusDistanceCallback(keras.callbacks.Callback):
    """Log the consensus distance Ξ of the trainable weights as `logs["consensus_distance"]`
    at each epoch end (so History records it), and every `every_k_batches` batches if set."""

    def __init__(self, every_k_batches=None):
        super().__init__()
        self.every_k_batches, self.history = every_k_batches, []

    def _measure(self, logs):
        xi = consensus_distance(self.model.trainable_weights)
        self.history.append(xi)
        if logs is not None:
            logs["consensus_distance"] = xi

    def on_train_batch_end(self, batch, logs=None):
        if self.every_k_batches and (batch + 1) % self.every_k_batches == 0:
            self._measure(logs)

    def on_epoch_end(self, epoch, logs=None):
        self._measure(logs)
