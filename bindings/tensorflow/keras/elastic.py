"""`hvd.elastic` of Horovod's Keras API (horovod/tensorflow/keras/elastic.py, Horovod 0.28),
for a Shoal job, whose set of ranks is fixed: Horovod elastic scripts run unchanged and
behave as Horovod's do when no rank joins or leaves.

* `run(func)`: `func(state, ...)` after `state.sync()` (rank 0's model, optimizer and
  attributes on every rank). In fault-tolerant mode (shoalrun --fault-tolerant) a lost
  rank is Horovod's HorovodInternalError, also when it surfaces in a traced step
  (`model.fit`: a `tf.errors.AbortedError` naming it): every survivor recovers, restores
  the last commit, runs the reset callbacks, syncs and calls `func` again on the shrunk
  job (shoal/_elastic.py). Otherwise a failed or leaving rank ends the job (the error
  propagates): Shoal has no elastic driver, so no rank ever joins.
* `KerasState(model, optimizer=None, **kwargs)`: `save()`/`restore()` (in-memory copies
  of the model's and optimizer's variables and of the attributes given as kwargs, e.g.
  epoch=0, batch=0), `commit()` (= save, Horovod's; no host updates to check), `sync()`
  (broadcast from rank 0, then save), `register_reset_callbacks`, `on_reset`.
* Callbacks with Horovod's signatures: `CommitStateCallback(state, batches_per_commit=1)`,
  `UpdateBatchStateCallback(state)`, `UpdateEpochStateCallback(state)`.
"""
import copy
import functools

import keras
import tensorflow as tf

from shoal import _elastic
from shoal._elastic import State
from shoal.tensorflow import ops as _tf_ops

__all__ = ["KerasState", "run", "CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback"]


def run(func):
    """Horovod's `hvd.elastic.run` (module docstring): `func(state, *args, **kwargs)`, called
    again on the survivors after a lost rank, also one reported by a traced step."""
    @functools.wraps(func)
    def call(state, *args, **kwargs):
        try:
            return func(state, *args, **kwargs)
        except tf.errors.OpError as e:
            lost = _tf_ops.rank_lost(e)
            if lost is None:
                raise
            raise lost from e
    return _elastic.run(call)


class KerasState(State):
    """The state of a Keras model (built), its optimizer (or `optimizer`) and the attributes
    given as keyword arguments; see the module docstring."""

    def __init__(self, model, optimizer=None, **kwargs):
        if not model.built:
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        super().__init__()
        self.model, self.optimizer = model, optimizer or model.optimizer
        self._attrs = sorted(kwargs)
        for k, v in kwargs.items():
            setattr(self, k, v)
        self.save()

    def _variables(self):
        return list(self.model.variables) + (list(self.optimizer.variables) if self.optimizer is not None else [])

    def save(self):
        """Keep a copy of the variables and attributes (restore() brings them back)."""
        self._saved = [keras.ops.convert_to_numpy(v).copy() for v in self._variables()]
        self._saved_attrs = {k: copy.deepcopy(getattr(self, k)) for k in self._attrs}

    def restore(self):
        """The variables and attributes as at the last save()/commit()/sync()."""
        for v, a in zip(self._variables(), self._saved):
            v.assign(a)
        for k, v in self._saved_attrs.items():
            setattr(self, k, copy.deepcopy(v))

    def sync(self):
        """Rank 0's variables and attributes on every rank (collective), then save()."""
        _tf_ops.broadcast_variables(self._variables(), 0)
        values = _tf_ops.broadcast_object({k: getattr(self, k) for k in self._attrs}, 0, name="elastic.state")
        for k, v in values.items():
            setattr(self, k, v)
        self.save()


class CommitStateCallback(keras.callbacks.Callback):
    """Horovod's: `state.commit()` every `batches_per_commit` batches and at each epoch's end."""

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        self.state, self.batches_per_commit = state, batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs=None):
        self.batches_remaining = self.batches_per_commit

    def on_train_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Horovod's: `state.batch` is the last finished batch of the epoch (0 at its end);
    an epoch that starts with state.batch > 0 runs the remaining steps only."""

    def __init__(self, state):
        super().__init__()
        self.state, self.steps_per_epoch = state, None

    def on_train_begin(self, logs=None):
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        if self.params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = self.params.get("steps")
            self.params["steps"] = self.steps_per_epoch - self.state.batch

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Horovod's: `state.epoch` counts finished epochs across fit() calls (Keras' epoch
    restarts at 0; the state's is offset by its value when training began)."""

    def __init__(self, state):
        super().__init__()
        self.state, self.initial_epoch = state, state.epoch

    def on_train_begin(self, logs=None):
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self.initial_epoch + epoch + 1
