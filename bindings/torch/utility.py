"""Model/optimizer state utilities over Shoal's ops (BlueFog/Horovod semantics,
reference/bluefog-semantics.md §3): broadcast and average parameters, broadcast any
optimizer's state, and move picklable objects between ranks."""
import io
import pickle

import numpy as np
import torch

import shoal
from shoal import _ops

from ._adapter import ADAPTER


def _named(params):
    if isinstance(params, dict):
        return sorted(params.items())
    if isinstance(params, (list, tuple)) or hasattr(params, "__iter__"):
        out = []
        for i, p in enumerate(params):
            out.append(p if isinstance(p, tuple) else (f"param.{i}", p))
        return out
    raise ValueError(f"params must be a dict (e.g. state_dict()) or a list of tensors, got {type(params)}")


def broadcast_parameters(params, root_rank):
    """Overwrite every rank's tensors with `root_rank`'s, in place.

    Args: a dict such as `model.state_dict()` (sorted by key) or a list of tensors or
    (name, tensor) pairs; root_rank in [0, size()). Raises ValueError for other types.
    """
    handles = []
    for name, p in _named(params):
        t = p.data if isinstance(p, torch.nn.Parameter) else p
        if not torch.is_tensor(t):
            raise ValueError(f"broadcast_parameters: {name} is not a tensor")
        handles.append(_ops.broadcast(ADAPTER, t, root_rank, name=f"broadcast.param.{name}",
                                                  inplace=True))
    for h in handles:
        _ops.synchronize(h)


def allreduce_parameters(params):
    """Replace every rank's tensors with their average over ranks, in place."""
    handles = []
    for name, p in _named(params):
        t = p.data if isinstance(p, torch.nn.Parameter) else p
        if t.is_floating_point():
            handles.append(_ops.allreduce(ADAPTER, t, True, f"allreduce.param.{name}",
                                                      inplace=True))
    for h in handles:
        _ops.synchronize(h)


def broadcast_object(obj, root_rank=0, name=None):
    """Pickle `obj` on root_rank and return the unpickled copy on every rank."""
    name = name or "broadcast_object"
    data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8) if shoal.rank() == root_rank else np.zeros(0, np.uint8)
    size = shoal.broadcast(np.array([data.size], np.int64), root_rank, name=name + ".size")
    buf = data if shoal.rank() == root_rank else np.zeros(int(size[0]), np.uint8)
    buf = shoal.broadcast(buf, root_rank, name=name + ".data")
    return pickle.loads(buf.tobytes())


def allgather_object(obj, name=None):
    """Return the list of every rank's `obj` (picklable), in rank order."""
    name = name or "allgather_object"
    data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    sizes = shoal.allgather(np.array([data.size], np.int64), name=name + ".sizes")
    flat = shoal.allgather(data, name=name + ".data")
    out, at = [], 0
    for s in sizes.tolist():
        out.append(pickle.loads(flat[at:at + s].tobytes()))
        at += s
    return out


def broadcast_optimizer_state(optimizer, root_rank):
    """Make every rank's optimizer state (tensors, step counters, hyper-parameters)
    identical to `root_rank`'s. Works for any torch optimizer (and Shoal's wrappers),
    including an empty state: the root's state is sent whole and loaded everywhere."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("broadcast_optimizer_state does not support LBFGS")
    state = optimizer.state_dict() if shoal.rank() == root_rank else None
    buf = io.BytesIO()
    if state is not None:
        torch.save(state, buf)
    blob = broadcast_object(buf.getvalue() if state is not None else None, root_rank,
                            name="broadcast_optimizer_state")
    optimizer.load_state_dict(torch.load(io.BytesIO(blob), weights_only=False))
