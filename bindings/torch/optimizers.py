"""Decentralized optimizers: wrap ANY torch.optim.Optimizer (SGD, Adam, AdamW, ...)
without re-implementing its update rule. Semantics follow BlueFog's optimizers
(reference/bluefog-semantics.md §3; update rules in algorithms.md §2.6):

* Adapt-with-combine (AWC, D-PSGD): x⁺ = Σ_j w_ij x_j − γ g_i(x_i). The parameters are
  sent as soon as the forward pass ends, so communication overlaps the backward pass.
* Adapt-then-combine (ATC): x⁺ = Σ_j w_ij (x_j − γ g_j). The local step runs first,
  then all parameters are combined in one fused exchange.
* Gradient allreduce (Horovod): gradients averaged over all ranks as each one is ready
  during backward, then the local step.

The wrapper shares the wrapped optimizer's param_groups and state, so LR schedulers,
`state_dict`/`load_state_dict` and `zero_grad` behave as for the wrapped optimizer.
Per-step attributes (`self_weight`, `src_weights`, `dst_weights`, `src_machine_weights`,
`dst_machine_weights`, `enable_topo_check`, `communication_type`) are read at every
communication, so a dynamic schedule just sets them before `step()`/forward.
"""
import contextlib
import enum
import itertools
import os

import torch

from shoal import _hierarchical, _ops, basics

from ._adapter import ADAPTER
from .consensus import ConsensusControl, consensus_distance

_instances = itertools.count()


class CommunicationType(enum.Enum):
    neighbor_allreduce = "neighbor.allreduce"
    hierarchical_neighbor_allreduce = "hierarchical.neighbor.allreduce"
    allreduce = "allreduce"
    empty = "empty"


def _named_parameters(model, optimizer):
    modules = model if isinstance(model, (list, tuple)) else [model]
    if not all(isinstance(m, torch.nn.Module) for m in modules):
        raise TypeError("model must be a torch.nn.Module or a list of modules")
    names = {}
    for i, m in enumerate(modules):
        for n, p in m.named_parameters():
            names.setdefault(p, f"{i}.{n}" if len(modules) > 1 else n)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p not in names:
                raise ValueError("the optimizer has a parameter that is not in the model")
    return modules, names


class _Distributed(torch.optim.Optimizer):
    """Shared machinery: delegation to the wrapped optimizer, parameter names, handles."""

    def __init__(self, optimizer, model, num_steps_per_communication=1):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, _Distributed):
            raise TypeError("the optimizer is already a Shoal distributed optimizer")
        if int(num_steps_per_communication) < 1:
            raise ValueError("num_steps_per_communication must be >= 1")
        self._modules, self._names = _named_parameters(model, optimizer)
        super().__init__(optimizer.param_groups, optimizer.defaults)  # sets up torch's hook tables
        self._opt = optimizer  # from here on param_groups and state are the wrapped optimizer's
        self.num_steps_per_communication = int(num_steps_per_communication)
        self._prefix = f"opt{next(_instances)}"
        self._handles = {}
        self._hooks = []
        if os.environ.get("SHOAL_TIMELINE"):  # framework events on the "model" track
            def begin(*_):
                basics.timeline_start_activity("model", "FORWARD")

            def end(*_):
                basics.timeline_end_activity("model")
            for m in self._modules:
                self._hooks.append(m.register_forward_pre_hook(begin))
                self._hooks.append(m.register_forward_hook(end))

    # Delegated (not copied), also after the wrapped optimizer's load_state_dict replaces them.
    def _delegated(field):
        def get(self):
            return getattr(self._opt, field) if "_opt" in self.__dict__ else self.__dict__.get("_" + field)

        def set(self, value):
            if "_opt" in self.__dict__:
                setattr(self._opt, field, value)
            else:
                self.__dict__["_" + field] = value
        return property(get, set)

    param_groups = _delegated("param_groups")
    state = _delegated("state")
    defaults = _delegated("defaults")
    del _delegated

    def _params(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    yield p

    def zero_grad(self, set_to_none=True):
        if self._handles:
            raise RuntimeError("zero_grad() was called while gradients/parameters are still being "
                               "communicated; call step() (or synchronize()) first")
        self._opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self._opt.state_dict()

    def load_state_dict(self, state_dict):
        self._opt.load_state_dict(state_dict)

    def add_param_group(self, param_group):
        if "_opt" not in self.__dict__:  # during torch.optim.Optimizer.__init__
            return super().add_param_group(param_group)
        self._opt.add_param_group(param_group)

    def __repr__(self):
        return f"{type(self).__name__}({self._opt!r})"

    def remove_hooks(self):
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


class _ParameterMixing(_Distributed):
    """AWC and ATC: combine parameters with neighbors, with optional consensus control."""

    def __init__(self, optimizer, model, communication_type, num_steps_per_communication,
                 consensus_control):
        super().__init__(optimizer, model, num_steps_per_communication)
        if not isinstance(communication_type, CommunicationType):
            raise TypeError("communication_type must be a shoal.torch.CommunicationType")
        if consensus_control is not None and not isinstance(consensus_control, ConsensusControl):
            raise TypeError("consensus_control must be a shoal.torch.ConsensusControl")
        self.communication_type = communication_type
        self.consensus_control = consensus_control
        self.self_weight = self.src_weights = self.dst_weights = None
        self.src_machine_weights = self.dst_machine_weights = None
        self.enable_topo_check = False
        self.steps = 0            # optimizer steps taken
        self.communications = 0   # combine steps taken
        self.extra_rounds = 0     # consensus control: added gossip rounds
        self.exact_averages = 0   # consensus control: allreduce fallbacks
        self.last_consensus_distance = None
        self._spare = {}  # parameter -> output buffer of its next neighbor_allreduce

    def _launch(self, p, suffix=""):
        name = f"{self._prefix}.{self._names[p]}{suffix}"
        t = p.data
        kind = self.communication_type
        if kind is CommunicationType.neighbor_allreduce:
            # The result lands in a buffer kept per parameter: no allocation (page
            # faults) per step.
            out = self._spare.get(p)
            if out is None or out.shape != t.shape or out.dtype != t.dtype:
                out = self._spare[p] = torch.empty_like(t)
            return _ops.neighbor_allreduce(ADAPTER, t, self.self_weight, self.src_weights,
                                                       self.dst_weights, self.enable_topo_check, name, out=out)
        if kind is CommunicationType.hierarchical_neighbor_allreduce:
            return _hierarchical.hierarchical_neighbor_allreduce_nonblocking(
                ADAPTER, t, self.self_weight, self.src_machine_weights, self.dst_machine_weights,
                self.enable_topo_check, name)
        if kind is CommunicationType.allreduce:
            return _ops.allreduce(ADAPTER, t, True, name)
        return None

    def _launch_all(self, params=None):
        for p in self._params() if params is None else params:
            if p in self._handles:
                raise RuntimeError("a second communication was started before step(); each forward "
                                   "(AWC) or step (ATC) communicates once")
            h = self._launch(p)
            if h is not None:
                self._handles[p] = h

    def _finish_all(self):
        handles, self._handles = self._handles, {}
        with torch.no_grad():
            for p, h in handles.items():
                # Copied, not swapped in: views of the parameter (state_dict, p.detach())
                # must keep seeing it.
                p.copy_(_ops.synchronize(h))
        if handles:
            self.communications += 1

    def _control(self):
        cc = self.consensus_control
        if cc is None or not cc.active(self.steps, self.communications):
            return
        params = list(self._params())
        target = cc.target_at(self.steps)
        xi = consensus_distance(params, name=f"{self._prefix}.xi")
        rounds = 0
        while cc.method == "gossip" and xi > target and rounds < cc.max_extra_rounds:
            handles = [(p, _ops.neighbor_allreduce(ADAPTER, p.data,
                                                               name=f"{self._prefix}.cc.{self._names[p]}"))
                       for p in params]
            with torch.no_grad():
                for p, h in handles:
                    p.copy_(_ops.synchronize(h))
            rounds += 1
            xi = consensus_distance(params, name=f"{self._prefix}.xi")
        if xi > target:  # gossip could not get there (or method="allreduce"): average exactly
            handles = [(p, _ops.allreduce(ADAPTER, p.data, True, f"{self._prefix}.avg.{self._names[p]}"))
                       for p in params]
            with torch.no_grad():
                for p, h in handles:
                    p.copy_(_ops.synchronize(h))
            self.exact_averages += 1
            xi = 0.0
        self.extra_rounds += rounds
        self.last_consensus_distance = xi


class DistributedAdaptWithCombineOptimizer(_ParameterMixing):
    """AWC: x⁺ = Σ_j w_ij x_j − γ·update(g_i(x_i)) (D-PSGD; BlueFog's
    `DistributedAdaptWithCombineOptimizer`).

    The parameters are sent from a forward hook on `model` (training mode, grad enabled)
    every `num_steps_per_communication` forward passes, so the exchange overlaps the
    backward pass; `step()` waits for it, installs the combined parameters, and applies
    the wrapped optimizer's update with the gradients computed at the old parameters.

    Args:
        optimizer: any torch.optim.Optimizer over (a subset of) model's parameters.
        model: the module (or list of modules) whose forward triggers communication.
        communication_type: CommunicationType (default neighbor_allreduce).
        num_steps_per_communication: communicate every k-th forward pass (local steps between).
        consensus_control: optional ConsensusControl.
    Raises: TypeError/ValueError for bad arguments; RuntimeError for zero_grad() with
        communication in flight or two forward passes that both communicate before step().
    """

    def __init__(self, optimizer, model, communication_type=CommunicationType.neighbor_allreduce,
                 num_steps_per_communication=1, consensus_control=None):
        super().__init__(optimizer, model, communication_type, num_steps_per_communication,
                         consensus_control)
        # Each module's forward sends the parameters it owns (a parameter shared by several
        # modules belongs to the first), counted per module.
        mine, owned = set(self._params()), set()
        self._forwards = {}
        for m in self._modules:
            params = [p for p in m.parameters() if p in mine and p not in owned]
            owned.update(params)
            self._forwards[m] = 0
            self._hooks.append(m.register_forward_hook(
                lambda module, inputs, output, params=params: self._on_forward(module, params)))

    def _on_forward(self, module, params):
        if not (module.training and torch.is_grad_enabled()):
            return
        self._forwards[module] += 1
        if self._forwards[module] % self.num_steps_per_communication == 0:
            self._launch_all(params)

    def step(self, closure=None):
        self._finish_all()
        loss = self._opt.step(closure)
        self.steps += 1
        self._control()
        return loss


class DistributedAdaptThenCombineOptimizer(_ParameterMixing):
    """ATC: x⁺ = Σ_j w_ij (x_j − γ·update(g_j)) (BlueFog's
    `DistributedAdaptThenCombineOptimizer`; the exp-graph paper's D-SGD).

    `step()` applies the wrapped optimizer's update, then (every
    `num_steps_per_communication` steps) combines all parameters with the neighbors in one
    fused exchange. Arguments as for `DistributedAdaptWithCombineOptimizer`.
    """

    def __init__(self, optimizer, model, communication_type=CommunicationType.neighbor_allreduce,
                 num_steps_per_communication=1, consensus_control=None):
        super().__init__(optimizer, model, communication_type, num_steps_per_communication,
                         consensus_control)

    def step(self, closure=None):
        loss = self._opt.step(closure)
        self.steps += 1
        if self.steps % self.num_steps_per_communication == 0:
            self._launch_all()
            self._finish_all()
        self._control()
        return loss


class DistributedGradientAllreduceOptimizer(_Distributed):
    """Horovod-style data parallelism: every gradient is averaged over all ranks as soon
    as backward produces it (overlapping the rest of backward), then the wrapped
    optimizer steps. With `num_steps_per_communication=k`, gradients accumulate locally
    over k backward passes and are averaged once; a (k+1)-th backward pass before
    `step()` raises RuntimeError. Parameters without a gradient on some rank are averaged
    with zeros. `synchronize()` + `with skip_synchronize(): step()` allow gradient
    clipping between averaging and the update.
    """

    def __init__(self, optimizer, model, num_steps_per_communication=1):
        super().__init__(optimizer, model, num_steps_per_communication)
        self._passes = {}
        self._skip = False
        self.communications = 0
        for p in self._params():
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _name(self, p):
        return f"{self._prefix}.grad.{self._names[p]}"

    def _on_grad(self, p):
        n = self._passes.get(p, 0) + 1
        if n > self.num_steps_per_communication:
            raise RuntimeError(f"more than num_steps_per_communication={self.num_steps_per_communication} "
                               "backward passes before step()")
        self._passes[p] = n
        if n == self.num_steps_per_communication:
            self._handles[p] = _ops.allreduce(ADAPTER, p.grad, True, self._name(p), inplace=True)

    def synchronize(self):
        """Wait for every gradient's average (launching, with zeros, those never produced)."""
        for p in self._params():
            if p not in self._handles:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self._handles[p] = _ops.allreduce(ADAPTER, p.grad, True, self._name(p), inplace=True)
        handles, self._handles = self._handles, {}
        for h in handles.values():
            _ops.synchronize(h)
        self._passes.clear()
        self.communications += 1

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside this context, step() does not synchronize (call synchronize() first)."""
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    def step(self, closure=None):
        if not self._skip:
            self.synchronize()
        return self._opt.step(closure)


DistributedOptimizer = DistributedGradientAllreduceOptimizer
