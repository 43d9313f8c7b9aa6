"""Horovod's `hvd.DistributedOptimizer` factory (Horovod 0.28 horovod/torch/optimizer.py:
names, positional order, checks) over Shoal's `DistributedGradientAllreduceOptimizer`
(optimizers.py), also taking Shoal's form `DistributedOptimizer(optimizer, model, k)`."""
import warnings

import torch

from ._horovod import Average, Compression, _check_op, global_process_set
from .optimizers import DistributedGradientAllreduceOptimizer


class _NamedParameters(torch.nn.Module):
    """Stands for the model in Horovod's form of DistributedOptimizer: its
    named_parameters() are the (name, parameter) pairs given. It never runs forward."""

    def __init__(self, pairs):
        super().__init__()
        self._pairs = pairs

    def named_parameters(self, *args, **kwargs):
        return iter(self._pairs)


def _is_model(obj):
    return isinstance(obj, torch.nn.Module) or (
        isinstance(obj, (list, tuple)) and obj and all(isinstance(m, torch.nn.Module) for m in obj))


def _horovod_names(optimizer, named_parameters):
    """Horovod's checks of `named_parameters` (None: the optimizer's parameters, named by
    their place in its param_groups)."""
    if named_parameters is None:
        groups = optimizer.param_groups if isinstance(optimizer, torch.optim.Optimizer) else []
        return [(f"noname.{i}.{j}", p) for i, g in enumerate(groups) for j, p in enumerate(g["params"])]
    pairs = list(named_parameters)
    if any(not (isinstance(t, tuple) and len(t) == 2 and isinstance(t[0], str) and torch.is_tensor(t[1]))
           for t in pairs):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually "
                         "produced by model.named_parameters()")
    names = [n for n, _ in pairs]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(dups)}")
    given = {p for _, p in pairs}
    groups = optimizer.param_groups if isinstance(optimizer, torch.optim.Optimizer) else []
    unnamed = sum(p not in given for g in groups for p in g["params"])
    if unnamed:
        raise ValueError(f"named_parameters was specified, but {unnamed} of the optimizer's parameters are not "
                         "named in it (pass model.named_parameters() of the whole model)")
    return pairs


def _check_groups(num_groups, groups):
    if num_groups:
        warnings.warn("num_groups is Horovod's former name of groups", DeprecationWarning, stacklevel=3)
        if groups is None:
            groups = num_groups
    if groups is None:
        return
    # Horovod's checks: a positive int (0 is refused, though its message says non-negative)
    # or a list of lists of tensors, each tensor in one group at most.
    if isinstance(groups, bool) or not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
        raise ValueError("groups should be a positive integer or a list of lists of torch.Tensor")
    if isinstance(groups, list):
        seen = set()
        for g in groups:
            if not (isinstance(g, (list, tuple)) and all(torch.is_tensor(t) for t in g)):
                raise ValueError("groups must consist of lists of torch.Tensor")
            if any(id(t) in seen or seen.add(id(t)) for t in g):
                raise ValueError("A parameter can only appear once in groups")


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,  # noqa: N802
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False, process_set=global_process_set, *,
                         model=None, num_steps_per_communication=None):
    """Horovod's `hvd.DistributedOptimizer` (gradient allreduce), also in Shoal's form
    `DistributedOptimizer(optimizer, model, num_steps_per_communication=1)`; returns a
    `DistributedGradientAllreduceOptimizer` wrapping `optimizer`.

    Horovod's arguments, in Horovod's positional order:
        named_parameters: iterable of (name, parameter), usually model.named_parameters():
            names key the exchange (unique; ValueError otherwise) and every optimizer
            parameter must be among them (ValueError). None: the optimizer's parameters,
            named by their place in its param_groups (as Horovod).
        compression: Compression.none / fp16 / bf16, or any compress/decompress object.
        backward_passes_per_step: k backward passes accumulate locally, then one average
            (Shoal's num_steps_per_communication).
        op: Average (default) or Sum; Adasum raises NotImplementedError.
        gradient_predivide_factor: f, with op=Average only: gradients times 1/f before the
            sum, times f after the average (Horovod's semantics; the value is the average
            up to rounding, f only moves where the scaling happens).
        num_groups / groups: Horovod's grouping of gradients into fused allreduces;
            accepted and checked as Horovod does (ValueError for groups=0, a non-tensor
            or a tensor in two groups; num_groups warns DeprecationWarning). Results do
            not depend on it: Shoal's fusion packs the gradients ready in one cycle anyway
            (SHOAL_FUSION_THRESHOLD).
        sparse_as_dense: densify sparse gradients before the exchange.
        process_set: a `ProcessSet` (add_process_set): gradients are averaged over its
            members (Average divides by its size); ranks outside it take local steps.
    Shoal's form: a torch.nn.Module (or list of modules) as the second argument (or
    model=) names the parameters by the model's named_parameters(); its third positional
    argument, an int, is num_steps_per_communication (= backward_passes_per_step).

    The result has Horovod's attributes `backward_passes_per_step` (with
    `set_backward_passes_per_step`), `op`, `gradient_predivide_factor`, `sparse_as_dense`,
    `process_set`, and `synchronize()`/`skip_synchronize()`; Horovod's AssertionErrors
    (a backward pass too many, zero_grad() while gradients are averaged) are
    GradientsInFlightError, a RuntimeError and an AssertionError.

    Differences from Horovod: the result wraps the optimizer (an instance of
    torch.optim.Optimizer sharing its param_groups and state, not of its class), so
    `isinstance(opt, torch.optim.SGD)` is False; LR schedulers, state_dict and
    zero_grad behave as for the wrapped optimizer.
    """
    if named_parameters is not None and _is_model(named_parameters):  # Shoal's positional form
        if model is not None:
            raise TypeError("DistributedOptimizer: model given twice (second argument and model=)")
        model, named_parameters = named_parameters, None
        if isinstance(compression, int) and not isinstance(compression, bool):
            if num_steps_per_communication is not None:
                raise TypeError("DistributedOptimizer: num_steps_per_communication given twice")
            num_steps_per_communication, compression = compression, Compression.none
    if model is not None and named_parameters is not None:
        raise TypeError("DistributedOptimizer: give model= (Shoal) or named_parameters= (Horovod), not both")
    k = backward_passes_per_step
    if num_steps_per_communication is not None:
        if backward_passes_per_step not in (1, num_steps_per_communication):
            raise ValueError("DistributedOptimizer: backward_passes_per_step and num_steps_per_communication "
                             "differ (they are the same setting)")
        k = num_steps_per_communication
    _check_op(op, "DistributedOptimizer")
    _check_groups(num_groups, groups)
    if model is None:
        model = _NamedParameters(_horovod_names(optimizer, named_parameters))
    return DistributedGradientAllreduceOptimizer(
        optimizer, model, k, compression=compression, op=op, gradient_predivide_factor=gradient_predivide_factor,
        sparse_as_dense=sparse_as_dense, process_set=process_set)
