"""Model/optimizer state utilities over Shoal's ops (BlueFog/Horovod semantics,
docs/reference/bluefog-semantics.md §3): broadcast and average parameters, broadcast any
optimizer's state, and move picklable objects between ranks.

Parameters are written in place through their memory, as BlueFog and Horovod write
`p.data`: leaf tensors that require grad and `nn.Parameter`s keep their identity,
`requires_grad` and `.grad`, and autograd records nothing.
"""
import collections.abc
import io
import pickle
import types

import numpy as np
import torch

import shoal
from shoal import _ops

from ._adapter import ADAPTER


def _named(params, what):
    """[(name, tensor)] of `params`: a dict such as `state_dict()` (sorted by key, as
    BlueFog/Horovod), a tensor, or any iterable (list, tuple, generator) of tensors
    (`parameters()`) or (name, tensor) pairs (`named_parameters()`)."""
    if isinstance(params, dict):
        items = sorted(params.items(), key=lambda kv: kv[0])
    elif torch.is_tensor(params):
        items = [("0", params)]
    elif isinstance(params, collections.abc.Iterable) and not isinstance(params, (str, bytes)):
        items = [tuple(p) if isinstance(p, tuple) and len(p) == 2 else (str(i), p)
                 for i, p in enumerate(params)]
    else:
        raise ValueError(f"{what}: params must be a dict (e.g. state_dict()), a list or generator of "
                         f"tensors or of (name, tensor) pairs, got {type(params).__name__}")
    for name, t in items:
        if not torch.is_tensor(t):
            raise ValueError(f"{what}: {name!r} is a {type(t).__name__}, not a tensor")
    return items


def _targets(params, what, keep=lambda t: True):
    """(op name, contiguous tensor the op writes, tensor to copy it back into or None) per
    distinct memory: a tensor listed twice (tied weights in a state_dict) is sent once."""
    seen, out = set(), []
    for i, (name, p) in enumerate(_named(params, what)):
        t = p.detach()  # the same memory, outside autograd
        if not keep(t):
            continue
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
               tuple(t.stride()), t.dtype)
        if key in seen:
            continue
        seen.add(key)
        work = t if t.is_contiguous() else t.contiguous()
        out.append((f"{i}.{name}", work, None if work is t else t))
    return out


def _run(targets, launch):
    """Launch every op, wait for all (also when a launch fails), copy back."""
    handles = []
    try:
        for name, work, back in targets:
            handles.append((launch(name, work), work, back))
    finally:
        for h, work, back in handles:
            _ops.synchronize(h)
            if back is not None:
                with torch.no_grad():
                    back.copy_(work)


def broadcast_parameters(params, root_rank):
    """Overwrite every rank's tensors with `root_rank`'s, in place and bit-exact.

    Args: params: `model.state_dict()` (sorted by key), `model.parameters()`,
        `model.named_parameters()` (lists or generators), a list/dict of tensors or
        (name, tensor) pairs, or one tensor: any dtype the ops take, leaf tensors that
        require grad included (autograd does not see the write). root_rank in [0, size()).
    Raises ValueError for other types, non-tensor entries or a bad root, and, the same on
    every rank, when the ranks' tensors differ (names, shapes, dtypes: checked first, with
    one allgather of their descriptions).
    """
    targets = _targets(params, "broadcast_parameters")
    agree([f"{name} {tuple(t.shape)} {t.dtype}" for name, t, _ in targets], "the tensors to broadcast",
          "broadcast_parameters.agree", "(name, shape, dtype)")
    _run(targets,
         lambda name, t: _ops.broadcast(ADAPTER, t, root_rank, name=f"broadcast.param.{name}",
                                        inplace=True))


def allreduce_parameters(params):
    """Replace every rank's floating-point tensors with their average over all ranks, in
    place (sum over ranks, then divided by size(): every rank gets the same bits).
    Integer and bool entries (e.g. BatchNorm's num_batches_tracked) are left alone.
    Arguments and errors as for `broadcast_parameters`."""
    _run(_targets(params, "allreduce_parameters", keep=lambda t: t.is_floating_point()),
         lambda name, t: _ops.allreduce(ADAPTER, t, True, f"allreduce.param.{name}", inplace=True))


try:
    from cloudpickle import Pickler as _BasePickler  # as Horovod: lambdas and local classes travel too
except ImportError:
    _BasePickler = pickle.Pickler


class _Pickler(_BasePickler):
    def reducer_override(self, obj):
        if isinstance(obj, types.GeneratorType):  # named_parameters(): travels as a list
            return list, (list(obj),)
        return super().reducer_override(obj) if hasattr(_BasePickler, "reducer_override") else NotImplemented


def _dumps(obj):
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return np.frombuffer(buf.getbuffer(), dtype=np.uint8)


def broadcast_object(obj, root_rank=0, name=None, process_set=None):
    """Pickle `obj` on root_rank and return the unpickled copy on every rank (root too)
    (Horovod's `broadcast_object`). Pickled with cloudpickle when it is installed (as
    Horovod: lambdas and local classes travel too), else pickle. Tensors keep dtype,
    requires_grad and Parameter-ness; a generator (also inside containers, e.g.
    named_parameters()) arrives as a list. `process_set` (a ProcessSet; None or
    `global_process_set`: every rank): only its members call it, root_rank a world rank
    among them. Raises what pickle raises for unpicklable objects (on root), the
    broadcast's errors otherwise (a root outside the set: ValueError)."""
    name = name or "broadcast_object"
    root = shoal.rank() == root_rank
    data = _dumps(obj) if root else np.zeros(0, np.uint8)
    size = shoal.broadcast(np.array([data.size], np.int64), root_rank, name=name + ".size", process_set=process_set)
    buf = data if root else np.zeros(int(size[0]), np.uint8)
    buf = shoal.broadcast(buf, root_rank, name=name + ".data", process_set=process_set)
    return pickle.loads(buf.tobytes())


def allgather_object(obj, name=None, process_set=None):
    """Return the list of every rank's `obj` (picklable; generators as lists, as in
    `broadcast_object`), in rank order (of the ranks of `process_set`, if given)."""
    name = name or "allgather_object"
    data = _dumps(obj)
    sizes = shoal.allgather(np.array([data.size], np.int64), name=name + ".sizes", process_set=process_set)
    flat = shoal.allgather(data, name=name + ".data", process_set=process_set)
    out, at = [], 0
    for s in sizes.tolist():
        out.append(pickle.loads(flat[at:at + s].tobytes()))
        at += s
    return out


def agree(items, what, name, fields="", process_set=None):
    """Collective: every rank (of `process_set`) must pass the same list of strings `items`.
    Raises ValueError, the same on every rank, naming the first item where the first rank
    that differs and the set's first rank disagree (`fields` says what an item holds)."""
    every = allgather_object(list(items), name=name, process_set=process_set)
    ranks = list(range(len(every))) if process_set is None else list(process_set.ranks)  # world ranks
    differ = [ranks[i] for i, theirs in enumerate(every) if theirs != every[0]]
    if not differ:
        return
    first, theirs = every[0], every[ranks.index(differ[0])]
    at = next((i for i, (a, b) in enumerate(zip(first, theirs)) if a != b), min(len(first), len(theirs)))
    show = lambda ls: repr(ls[at]) if at < len(ls) else "nothing more"
    raise ValueError(f"{what} differ across ranks: ranks {differ} differ from rank {ranks[0]}, which has "
                     f"{show(first)} where rank {differ[0]} has {show(theirs)}"
                     + (f" {fields}" if fields else ""))


def broadcast_optimizer_state(optimizer, root_rank):
    """Make every rank's optimizer state identical to `root_rank`'s, bit-exact: state
    tensors, scalar state (Adam's `step` as a tensor or a float, counters, lists) and
    hyper-parameters (lr, betas, ...). `optimizer`: any torch.optim.Optimizer or a Shoal
    distributed optimizer (its state is the wrapped optimizer's).

    The root's `state_dict()` travels whole (torch.save) and is loaded on the other
    ranks, so nothing needs a tensor form. A root that has not stepped yet makes every
    rank's state empty (BlueFog instead ran one step with zero gradients). Raises
    ValueError for LBFGS (as BlueFog) and TypeError for a non-optimizer, and ValueError when
    the ranks' optimizers are of different classes, each on every rank alike; ValueError
    from load_state_dict when the ranks' parameter groups differ.
    """
    # Checked on every rank together (one allgather), so a rank's refusal is every rank's.
    usable = isinstance(optimizer, torch.optim.Optimizer)
    inner = getattr(optimizer, "_opt", optimizer)
    agree([type(inner).__name__ if usable else "not an optimizer"], "broadcast_optimizer_state: the optimizers",
          "broadcast_optimizer_state.agree")
    if not usable:
        raise TypeError(f"broadcast_optimizer_state: expected a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if isinstance(inner, torch.optim.LBFGS):
        raise ValueError("broadcast_optimizer_state does not support LBFGS")
    blob = None
    if shoal.rank() == root_rank:
        buf = io.BytesIO()
        torch.save(optimizer.state_dict(), buf)
        blob = buf.getvalue()
    blob = broadcast_object(blob, root_rank, name="broadcast_optimizer_state")
    # The root loads it too: load_state_dict may normalise entries (Adam turns a float
    # step into a tensor), and every rank must end with the same representation.
    state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=False)
    optimizer.load_state_dict(state)  # moves state to each parameter's device
