"""`hvd.elastic` of Horovod's PyTorch API (horovod/torch/elastic, Horovod 0.28) for a Shoal
job, whose set of ranks is fixed: Horovod elastic scripts run unchanged and behave as
Horovod's do when no rank joins or leaves (the Keras form: shoal.keras.elastic).

* `run(func)`: `func(state, ...)` after `state.sync()` (shoal/_elastic.py: a failed or
  leaving rank ends the job; reset callbacks are kept but never called).
* `TorchState(model=None, optimizer=None, **kwargs)`: `save()`/`restore()` (in-memory copies
  of the model's and the optimizer's state_dict and of the attributes given as kwargs,
  e.g. epoch=0, batch=0, another module or optimizer, an `ElasticSampler`), `commit()`
  (= save: there are no host updates to check), `sync()` (rank 0's parameters, buffers,
  optimizer state and attributes on every rank, modules and optimizers in place; samplers
  take the union of every rank's processed indices, as Horovod's; then save),
  `register_reset_callbacks`, `on_reset`. `ObjectState(**kwargs)`: the same without the
  two named arguments.
* `ElasticSampler(dataset, shuffle=True, seed=0)`: this rank's share of the dataset's
  indices not processed yet in the epoch (`record_batch`/`record_indices` mark them; the
  share is recomputed by `set_epoch` and `reset`), padded so every rank has as many; the
  order is shuffled with `seed + epoch`, alike on every rank.
"""
import copy
import math
import random

import torch

from shoal import basics
from shoal._elastic import State, run

from . import utility

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler"]


def _kind(value):
    """How an attribute is saved, restored and synced: in place for what holds state others
    refer to (modules, optimizers, samplers), by value for the rest (as Horovod's handlers)."""
    if isinstance(value, torch.nn.Module):
        return "module"
    if isinstance(value, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(value, ElasticSampler):
        return "sampler"
    return "value"


class ObjectState(State):
    """Attributes given as keyword arguments. Modules, optimizers (Shoal's distributed ones
    too) and `ElasticSampler`s keep their identity: saved as state_dict copies, restored
    into, synced in place (broadcast_parameters, broadcast_optimizer_state, the samplers'
    union of processed indices); other values are copied, restored by assignment and
    synced with broadcast_object from rank 0 (they must pickle)."""

    def __init__(self, **kwargs):
        super().__init__()
        self._attrs = sorted(kwargs)
        for k, v in kwargs.items():
            setattr(self, k, v)
        self.save()

    def _items(self):
        return [(k, getattr(self, k)) for k in self._attrs if getattr(self, k) is not None]

    def save(self):
        self._saved = {k: copy.deepcopy(v.state_dict() if _kind(v) != "value" else v) for k, v in self._items()}

    def restore(self):
        for k, v in self._items():
            if k in self._saved:
                saved = copy.deepcopy(self._saved[k])
                if _kind(v) == "value":
                    setattr(self, k, saved)
                else:
                    v.load_state_dict(saved)

    def sync(self):
        values = {}
        for k, v in self._items():  # in the same order on every rank
            kind = _kind(v)
            if kind == "module":
                utility.broadcast_parameters(v.state_dict(), root_rank=0)
            elif kind == "optimizer":
                utility.broadcast_optimizer_state(v, root_rank=0)
            elif kind == "sampler":
                v.sync(name=f"elastic.sampler.{k}")
            else:
                values[k] = v
        for k, v in utility.broadcast_object(values, 0, name="elastic.state").items():
            setattr(self, k, v)
        self.save()


class TorchState(ObjectState):
    """A model's and an optimizer's state (either may be None) and attributes; see the
    module docstring and `ObjectState`."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        super().__init__(model=model, optimizer=optimizer, **kwargs)


class ElasticSampler(torch.utils.data.Sampler):
    """Horovod's elastic sampler (see the module docstring). `len()` is this rank's number
    of samples in what remains of the epoch."""

    def __init__(self, dataset, shuffle=True, seed=0):
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch, self.processed_indices = 0, set()
        self.indices = []
        self.reset()

    def set_epoch(self, epoch):
        """A new epoch: nothing processed yet, a new order."""
        self.epoch, self.processed_indices = epoch, set()
        self.reset()

    def record_batch(self, batch_idx, batch_size):
        """Mark batch `batch_idx` (of `batch_size`) of this rank's share as processed."""
        self.record_indices(self.get_indices(batch_idx, batch_size))

    def record_indices(self, indices):
        self.processed_indices.update(indices)

    def get_indices(self, batch_idx, batch_size):
        """The dataset indices of batch `batch_idx` of this rank's current share."""
        return self.indices[batch_idx * batch_size:(batch_idx + 1) * batch_size]

    def state_dict(self):
        return {"epoch": self.epoch, "processed_indices": set(self.processed_indices)}

    def load_state_dict(self, state_dict):
        self.epoch, self.processed_indices = state_dict["epoch"], set(state_dict["processed_indices"])
        self.reset()

    def sync(self, name="elastic.sampler"):
        """Collective: every rank takes the union of all ranks' processed indices (and rank
        0's epoch), then recomputes its share."""
        every = utility.allgather_object(self.state_dict(), name=name)
        self.epoch = every[0]["epoch"]
        self.processed_indices = set().union(*(s["processed_indices"] for s in every))
        self.reset()

    def reset(self):
        """Recompute this rank's share of the indices not processed yet."""
        n, r = basics.size(), basics.rank()
        remaining = [i for i in range(len(self.dataset)) if i not in self.processed_indices]
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(remaining)
        self.num_samples = math.ceil(len(remaining) / n)
        pad = self.num_samples * n - len(remaining)  # repeat from the start: every rank as many
        padded = remaining + [remaining[k % len(remaining)] for k in range(pad)]
        self.indices = padded[r::n]

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return self.num_samples
