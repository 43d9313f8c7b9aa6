"""shoal.keras.callbacks: Keras 3 callbacks for data-parallel and decentralized training
(`hvd.callbacks.X` in Horovod scripts; also `shoal.keras.X`).

Horovod's (0.28 `horovod/_keras/callbacks.py`, with its signatures and positional order):
`BroadcastGlobalVariablesCallback(root_rank, device='', local_variables=None)`,
`MetricAverageCallback(device='')`, `LearningRateScheduleCallback(initial_lr, multiplier,
start_epoch=0, end_epoch=None, staircase=True, momentum_correction=True,
steps_per_epoch=None)`, `LearningRateWarmupCallback(initial_lr, warmup_epochs=5,
momentum_correction=True, steps_per_epoch=None, verbose=0)`, `BestModelCheckpoint(monitor,
verbose, mode, save_freq)`; and two decentralized ones:
`NeighborAveragingCallback` (average the model's weights with neighbors every k batches,
over a static graph or a per-step schedule such as one-peer exponential) and
`ConsensusDistanceCallback` (log Ξ). They use only Keras 3's public surface
(`model.variables`, `optimizer.variables`, `optimizer.learning_rate`, `logs`) and move
weights through Shoal's numpy API, so they run with any backend whose variables are
host-readable (tensorflow, torch on CPU). `device` arguments are accepted and change
nothing (Shoal places by the tensor's device).
"""
import keras
import numpy as np

import shoal
from shoal import _metrics

from ._neighbor import Mixer

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "BestModelCheckpoint", "NeighborAveragingCallback",
           "ConsensusDistanceCallback", "consensus_distance"]


def _arrays(variables):
    return [np.asarray(keras.ops.convert_to_numpy(v)) for v in variables]


def consensus_distance(variables, name="keras.consensus_distance"):
    """Ξ = sqrt((1/n) Σ_i ‖x_i − x̄‖²) of the given variables over all ranks (float64)."""
    return _metrics.consensus_distance(_metrics.host_flat(_arrays(variables)), name)


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Make every rank continue from `root_rank`'s state: after the first batch (when
    Keras has created the optimizer's variables) broadcast the model's variables (less
    `local_variables`) and the optimizer's variables, as Horovod does.

    Difference from Horovod: the model's variables are also broadcast at the start of
    training, so the first step's gradients are computed at root's weights on every rank
    (in Horovod each rank takes its first step from its own initial weights; after the
    first batch both hold root's state). `device` changes nothing.
    """

    def __init__(self, root_rank, device="", local_variables=None):
        super().__init__()
        self.root_rank, self.device = root_rank, device
        if local_variables is None:
            local_variables = []
        elif not isinstance(local_variables, (list, tuple, set)):
            local_variables = [local_variables]
        self._local = {id(v) for v in local_variables}
        self.broadcast_done = False

    def _broadcast(self, variables, tag):
        variables = [v for v in variables if id(v) not in self._local]
        for i, (v, a) in enumerate(zip(variables, _arrays(variables))):
            v.assign(shoal.broadcast(a, self.root_rank, name=f"keras.bcast.{tag}.{i}"))

    def on_train_begin(self, logs=None):
        self._broadcast(self.model.variables, "model")

    def on_train_batch_end(self, batch, logs=None):
        if self.broadcast_done:
            return
        self._broadcast(self.model.variables, "model.after_first_batch")
        if self.model.optimizer is not None:
            self._broadcast(self.model.optimizer.variables, "optimizer")
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Average every numeric entry of `logs` over ranks at the end of each epoch (sorted
    by name, in place), so later callbacks (checkpoints, LR plateau, History) see global
    values. Put it before them. Difference from Horovod: the average is taken in float64
    (Horovod's in float32) and written back as a Python float. `device` changes nothing."""

    def __init__(self, device=""):
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.isscalar(v) or np.ndim(v) == 0)
        vals = shoal.allreduce(np.array([float(logs[k]) for k in keys], np.float64),
                               name=f"keras.metrics.{epoch}")
        logs.update({k: float(v) for k, v in zip(keys, vals)})


def _get_lr(optimizer):
    return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


def _momentum_buffers(optimizer):
    """The momentum buffers of an optimizer with a nonzero `momentum` (Keras 3 SGD's
    `momentums`, RMSprop's `_momentums`), else []."""
    m = getattr(optimizer, "momentum", None)
    if isinstance(m, bool) or not isinstance(m, (int, float)) or m == 0:
        return []
    bufs = getattr(optimizer, "momentums", None)
    if bufs is None:
        bufs = getattr(optimizer, "_momentums", None)
    return list(bufs or [])


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Horovod's LearningRateScheduleCallback: between `start_epoch` and `end_epoch`
    (exclusive) the learning rate is `initial_lr * multiplier(epoch)` (a constant
    `multiplier` means `multiplier ** (epoch - start_epoch)`). With `staircase` it is set
    at the first batch of each epoch (integer epoch), else before every batch with
    `epoch + batch / steps_per_epoch` (steps_per_epoch from Keras' `params["steps"]` when
    not given). At each epoch end `logs["lr"]` is the current learning rate.

    momentum_correction (Goyal et al. 2017, §2.1): when the learning rate changes from
    old to new, the momentum term of that step is scaled by new/old. Difference from
    Horovod, for Keras 3: Keras 3 compiles `optimizer.momentum` (a Python float) into the
    train function, so Horovod's way (set momentum·new/old for one batch, then restore)
    would change nothing; instead the optimizer's momentum buffers are multiplied by
    new/old before the batch. For SGD and RMSprop (whose buffers carry the learning
    rate, v ← m·v − lr·g) that is the same update, m·(r·v) = (m·r)·v; with SGD's Nesterov
    look-ahead it differs in that term (m·v' instead of m·r·v').
    """

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr, self.start_epoch, self.end_epoch = initial_lr, start_epoch, end_epoch
        self.staircase, self.momentum_correction = staircase, momentum_correction
        self.steps_per_epoch, self.current_epoch = steps_per_epoch, None
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            self.multiplier = lambda epoch: multiplier ** (epoch - start_epoch)

    def _autodetect_steps_per_epoch(self):
        params = self.params or {}
        if params.get("steps"):
            return params["steps"]
        if params.get("samples") and params.get("batch_size"):
            return params["samples"] // params["batch_size"]
        raise ValueError("Could not autodetect the number of steps per epoch. Please specify the "
                         f"steps_per_epoch parameter to the {type(self).__name__}().")

    def _adjust_learning_rate(self, epoch):
        optimizer = self.model.optimizer
        old_lr = _get_lr(optimizer)
        new_lr = self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate = new_lr
        if self.momentum_correction and old_lr != 0:
            ratio = new_lr / old_lr
            if ratio != 1.0:
                for m in _momentum_buffers(optimizer):
                    m.assign(m * keras.ops.cast(ratio, m.dtype))

    def on_train_begin(self, logs=None):
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.current_epoch < self.start_epoch or (self.end_epoch is not None
                                                     and self.current_epoch >= self.end_epoch):
            return
        if self.staircase and batch == 0:
            self._adjust_learning_rate(self.current_epoch)
        elif not self.staircase:
            self._adjust_learning_rate(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = _get_lr(self.model.optimizer)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Horovod's gradual warm-up (Goyal et al. 2017): before every batch of the first
    `warmup_epochs` epochs, lr = initial_lr / size() · (e · (size() − 1) / warmup_epochs + 1)
    with e = epoch + (batch + 1) / steps_per_epoch, so the last warm-up batch runs at
    initial_lr; later epochs keep it. Momentum correction as in
    LearningRateScheduleCallback. verbose=1: rank 0 prints when the warm-up ends."""

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None, verbose=0):
        def multiplier(epoch):
            epoch += 1.0 / self.steps_per_epoch  # round numbers at each epoch's end, as Horovod
            n = shoal.size()
            return 1.0 / n * (epoch * (n - 1) / warmup_epochs + 1)
        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.warmup_epochs, self.verbose = warmup_epochs, verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and shoal.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {_get_lr(self.model.optimizer):g}.")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Horovod's BestModelCheckpoint(monitor, verbose, mode, save_freq): a ModelCheckpoint
    that keeps only the best model (save_best_only=True, the whole model). Keras 3 needs
    the path when the callback is made: `filepath` (keyword, ending in `.keras`; default
    "best_model.keras"; Horovod's Spark estimator sets it afterwards). Add it on rank 0
    only, as any checkpoint."""

    def __init__(self, monitor="val_loss", verbose=0, mode="auto", save_freq="epoch", *,
                 filepath="best_model.keras"):
        super().__init__(filepath=filepath, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=False, mode=mode, save_freq=save_freq)


class NeighborAveragingCallback(keras.callbacks.Callback):
    """Average the model's weights with the neighbors every `every_k_batches` batches.

    Args:
        every_k_batches: communicate after every k-th batch (local steps in between).
        schedule: None — static topology of `shoal.set_topology` (default exp-2 graph),
            uniform or its weights; "one-peer-exp" — the one-peer exponential schedule
            (exact average after log2(n) rounds for n a power of 2); or a callable
            `round -> (self_weight, src_weights, dst_weights)` for any dynamic schedule.
    The rank's model after a round is Σ_j w_ij x_j (Keras' optimizer step first: ATC;
    `shoal.keras.DistributedAdaptThenCombineOptimizer` does the same inside the optimizer,
    with consensus control).
    """

    def __init__(self, every_k_batches=1, schedule=None):
        super().__init__()
        self.every_k_batches, self._batches = every_k_batches, 0
        self._mixer = Mixer(schedule, "keras.nbr")

    @property
    def rounds(self):
        """Averaging rounds so far."""
        return self._mixer.rounds

    def average_now(self):
        """One averaging round of all trainable weights (fused into one exchange)."""
        variables = self.model.trainable_weights
        for v, a in zip(variables, self._mixer.combine(_arrays(variables))):
            v.assign(a)

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
