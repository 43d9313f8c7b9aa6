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

Loop orders: `zero_grad()` (the wrapper's or `model.zero_grad()`, `set_to_none` either
way) may come anywhere outside backward..step, also while *parameters* are in flight
(AWC, window optimizers only read them). Only gradients being averaged (gradient
allreduce, between backward and step) must not be touched; touching them raises
`GradientsInFlightError`. `num_steps_per_communication=k` (BlueFog): communicate after k
forward passes (AWC) or k backward passes (the others), so both gradient accumulation
(k backward passes, one step) and local steps (k steps of one pass) work.
`torch.amp.GradScaler`: every wrapper takes GradScaler's scale and overflow flag itself
(`_step_supports_amp_scaling`), so a rank whose gradients overflowed skips only its local
update and still communicates (ranks overflow at different steps). Gradient allreduce
needs the averaged gradients before GradScaler looks at them: `opt.synchronize();
scaler.unscale_(opt); with opt.skip_synchronize(): scaler.step(opt)` (Horovod's form).
"""
import contextlib
import enum
import functools
import itertools
import os
import warnings

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


class GradientsInFlightError(RuntimeError, AssertionError):
    """Gradients were zeroed, replaced or changed while they were being averaged. A
    RuntimeError, and the AssertionError BlueFog's `zero_grad()` raised in that case."""


class CommunicationTypeError(TypeError, AssertionError):
    """communication_type is not a CommunicationType: a TypeError (Shoal's bad-argument
    error), and the AssertionError BlueFog's `assert isinstance(...)` raised."""


_STEP_AFTER_SYNCHRONIZE = (
    "optimizer.step() was called after optimizer.synchronize() outside "
    "`with optimizer.skip_synchronize():`; the communication is not repeated. Call step() "
    "inside skip_synchronize() after synchronize().")


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
    """Shared machinery: delegation to the wrapped optimizer, parameter names, handles,
    backward-pass counting, synchronize()/skip_synchronize(), GradScaler, timeline."""

    # torch.amp.GradScaler then sets `grad_scale` (None once unscale_() ran) and
    # `found_inf` on this object and calls step() even after an overflow: the wrapper
    # communicates (every rank must) and skips only the local update (_local_step).
    _step_supports_amp_scaling = True

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
        self._handles = {}       # parameter -> handle of its parameter communication
        self._grad_handles = {}  # parameter -> (handle, gradient, its _version): gradient allreduce
        self._passes = {}        # parameter -> backward passes since the last communication
        self._hooks = []
        self._timeline_hooks = []
        self._should_synchronize = True
        self._synchronized = False
        if os.environ.get("SHOAL_TIMELINE") or os.environ.get("BLUEFOG_TIMELINE"):
            self.turn_on_timeline()

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

    def _count_passes(self, then=None):
        """Count backward passes per parameter (after its gradient is accumulated), then
        call then(p, passes)."""
        def hook(p):
            n = self._passes[p] = self._passes.get(p, 0) + 1
            if then is not None:
                then(p, n)
        for p in self._params():
            self._hooks.append(p.register_post_accumulate_grad_hook(hook))

    def _communication_due(self):
        """True (and the count restarts) once k backward passes have been made: the same
        decision on every rank that runs the same loop."""
        if max(self._passes.values(), default=0) < self.num_steps_per_communication:
            return False
        self._passes.clear()
        return True

    def step(self, closure=None):
        """Communicate as the optimizer does and take the wrapped optimizer's step;
        returns the closure's loss (None without a closure)."""
        try:
            return self._step(closure)
        except BaseException:
            # GradScaler removes its grad_scale/found_inf only after a step that returns.
            self.__dict__.pop("grad_scale", None)
            self.__dict__.pop("found_inf", None)
            raise

    def _step(self, closure):
        raise NotImplementedError

    def _local_step(self, closure=None):
        """The wrapped optimizer's step; with GradScaler's scale and overflow flag (see
        `_step_supports_amp_scaling`): skipped after an overflow, else on unscaled gradients."""
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and bool(found_inf):
            return None
        scale = getattr(self, "grad_scale", None)
        if scale is not None:
            inv = scale.double().reciprocal().float()  # as GradScaler.unscale_ computes it
            with torch.no_grad():
                for p in self._params():
                    if p.grad is not None:
                        p.grad.mul_(inv.to(p.grad.device))
        return self._inner_step(closure)

    def _inner_step(self, closure):
        return self._opt.step(closure)

    def synchronize(self):
        """Finish the communication in flight (see each optimizer). After it, call step()
        inside `with opt.skip_synchronize():` (Horovod/BlueFog pattern, e.g. to clip or
        unscale gradients in between)."""
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside this block step() does not call synchronize() (call it before)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def _synchronize_for_step(self):
        in_flight = bool(self._handles or self._grad_handles)
        if not self._should_synchronize:
            if in_flight:  # the local step would race with (and be undone by) the communication
                raise (GradientsInFlightError if self._grad_handles else RuntimeError)(
                    "step() inside skip_synchronize() while communication is in flight; "
                    "call synchronize() first")
        elif self._synchronized:
            warnings.warn(_STEP_AFTER_SYNCHRONIZE, stacklevel=4)
            if in_flight:
                self.synchronize()
        else:
            self.synchronize()
        self._synchronized = False

    def zero_grad(self, set_to_none=True):
        """The wrapped optimizer's zero_grad. Fine while parameters are in flight; raises
        GradientsInFlightError while gradients are being averaged (after backward and
        before step()/synchronize() of DistributedGradientAllreduceOptimizer)."""
        if self._grad_handles:
            raise GradientsInFlightError(
                "zero_grad() was called while gradients are being averaged (after backward, "
                "before step() or synchronize()); zero them before the forward pass or after step()")
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

    def turn_on_timeline(self):
        """Record each forward pass of the model(s) as a FORWARD activity of the "model"
        track on the per-rank timeline (needs SHOAL_TIMELINE). On by default when
        SHOAL_TIMELINE (or BlueFog's BLUEFOG_TIMELINE) is set."""
        if self._timeline_hooks:
            return

        def begin(*_):
            basics.timeline_start_activity("model", "FORWARD")

        def end(*_):
            basics.timeline_end_activity("model")
        for m in self._modules:
            self._timeline_hooks.append(m.register_forward_pre_hook(begin))
            self._timeline_hooks.append(m.register_forward_hook(end))

    def turn_off_timeline(self):
        for h in self._timeline_hooks:
            h.remove()
        self._timeline_hooks.clear()

    def remove_hooks(self):
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.turn_off_timeline()


class _ParameterMixing(_Distributed):
    """AWC and ATC: combine parameters with neighbors, with optional consensus control."""

    def __init__(self, optimizer, model, communication_type, num_steps_per_communication,
                 consensus_control):
        super().__init__(optimizer, model, num_steps_per_communication)
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

    @property
    def communication_type(self):
        """CommunicationType of the next communication (settable between steps)."""
        return self._communication_type

    @communication_type.setter
    def communication_type(self, value):
        if not isinstance(value, CommunicationType):
            raise CommunicationTypeError("communication_type must be a shoal.torch.CommunicationType, "
                                         f"got {value!r}")
        self._communication_type = value

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
    backward pass; `step()` (or `synchronize()`) waits for it and installs the combined
    parameters, then step() applies the wrapped optimizer's update with the gradients
    computed at the old parameters. zero_grad() may come before or after the forward pass.

    Args:
        optimizer: any torch.optim.Optimizer over (a subset of) model's parameters.
        model: the module (or list of modules) whose forward triggers communication.
        communication_type: CommunicationType (default neighbor_allreduce).
        num_steps_per_communication: communicate every k-th forward pass (gradient
            accumulation over k passes, or k local steps between communications).
        consensus_control: optional ConsensusControl.
    Raises: TypeError/ValueError for bad arguments (CommunicationTypeError for
        communication_type); RuntimeError for two forward passes that both communicate
        before step().
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

    def synchronize(self):
        """Wait for the parameters sent at the last communicating forward pass and install
        their combination (nothing if none is in flight)."""
        self._finish_all()
        super().synchronize()

    def _step(self, closure):
        self._synchronize_for_step()
        loss = self._local_step(closure)
        self.steps += 1
        self._control()
        return loss


class DistributedAdaptThenCombineOptimizer(_ParameterMixing):
    """ATC: x⁺ = Σ_j w_ij (x_j − γ·update(g_j)) (BlueFog's
    `DistributedAdaptThenCombineOptimizer`; the exp-graph paper's D-SGD).

    `step()` applies the wrapped optimizer's update, then, once
    `num_steps_per_communication` backward passes have been made since the last combine
    (BlueFog counts backward passes), combines all parameters with the neighbors in one
    fused exchange. Nothing is in flight outside step(): `synchronize()` has nothing to
    wait for and `skip_synchronize()` changes nothing. Arguments as for
    `DistributedAdaptWithCombineOptimizer`.
    """

    def __init__(self, optimizer, model, communication_type=CommunicationType.neighbor_allreduce,
                 num_steps_per_communication=1, consensus_control=None):
        super().__init__(optimizer, model, communication_type, num_steps_per_communication,
                         consensus_control)
        self._step_func = None
        self._count_passes()

    def register_step_function(self, step_func):
        """BlueFog's per-parameter update for optimizers it could not run itself: once
        registered, step() calls `step_func(self, p, p.grad, group)` (under no_grad) for
        every parameter with a gradient instead of the wrapped optimizer's step."""
        if not callable(step_func):
            raise TypeError("step_func must be callable as step_func(optimizer, p, grad, group)")
        self._step_func = functools.partial(step_func, self)

    def _inner_step(self, closure):
        if self._step_func is None:
            return self._opt.step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self._step_func(p, p.grad, group)
        return loss

    def synchronize(self):
        """Wait for a combine still in flight (none: ATC combines inside step())."""
        self._finish_all()
        super().synchronize()

    def _step(self, closure):
        self._synchronized = False
        loss = self._local_step(closure)
        self.steps += 1
        if self._communication_due():
            self._launch_all()
            self._finish_all()
        self._control()
        return loss


def _deprecated_awc(communication_type, old):
    def factory(optimizer, model, num_steps_per_communication=1):
        warnings.warn(f"{old} is deprecated (BlueFog): use DistributedAdaptWithCombineOptimizer(opt, "
                      f"model, communication_type=CommunicationType.{communication_type.name})",
                      PendingDeprecationWarning, stacklevel=2)
        return DistributedAdaptWithCombineOptimizer(optimizer, model, communication_type,
                                                    num_steps_per_communication)
    factory.__name__ = factory.__qualname__ = old
    factory.__doc__ = (f"BlueFog's deprecated `{old}`: `DistributedAdaptWithCombineOptimizer` with "
                       f"`CommunicationType.{communication_type.name}` (PendingDeprecationWarning).")
    return factory


DistributedAllreduceOptimizer = _deprecated_awc(CommunicationType.allreduce, "DistributedAllreduceOptimizer")
DistributedNeighborAllreduceOptimizer = _deprecated_awc(
    CommunicationType.neighbor_allreduce, "DistributedNeighborAllreduceOptimizer")
DistributedHierarchicalNeighborAllreduceOptimizer = _deprecated_awc(
    CommunicationType.hierarchical_neighbor_allreduce, "DistributedHierarchicalNeighborAllreduceOptimizer")


class DistributedGradientAllreduceOptimizer(_Distributed):
    """Horovod-style data parallelism: every gradient is averaged over all ranks as soon
    as backward produces it (overlapping the rest of backward), then the wrapped
    optimizer steps. With `num_steps_per_communication=k`, gradients accumulate locally
    over k backward passes and are averaged once; a (k+1)-th backward pass before
    `step()` raises RuntimeError. Parameters without a gradient on some rank are averaged
    with zeros. `synchronize()` + `with skip_synchronize(): step()` allow gradient
    clipping or GradScaler's unscale_ between averaging and the update.

    Gradients being averaged must not change: zero_grad() then raises
    GradientsInFlightError, and a gradient zeroed, replaced or modified in place between
    backward and synchronize (model.zero_grad(), clipping) makes synchronize()/step()
    raise it once the averages are in; so does `scaler.step(opt)` of torch.amp.GradScaler
    without synchronize() first (GradScaler would judge overflow on unaveraged, racing
    gradients). With GradScaler use `opt.synchronize(); scaler.unscale_(opt);
    with opt.skip_synchronize(): scaler.step(opt)`; the overflow verdict is then the same
    on every rank.
    """

    def __init__(self, optimizer, model, num_steps_per_communication=1):
        super().__init__(optimizer, model, num_steps_per_communication)
        self.communications = 0
        self._count_passes(self._on_grad)
        for p in self._params():  # before accumulation: an in-flight gradient stays untouched
            self._hooks.append(p.register_hook(lambda grad, p=p: self._before_accumulation(p)))

    def _before_accumulation(self, p):
        if p in self._grad_handles:
            raise RuntimeError(f"more than num_steps_per_communication={self.num_steps_per_communication} "
                               f"backward passes before step() (the gradient of {self._names[p]!r} "
                               "is being averaged)")

    def _on_grad(self, p, n):
        if n == self.num_steps_per_communication:
            self._launch(p)

    def _launch(self, p):
        g = p.grad
        h = _ops.allreduce(ADAPTER, g, True, f"{self._prefix}.grad.{self._names[p]}", inplace=True)
        self._grad_handles[p] = (h, g, g._version)

    def synchronize(self):
        """Wait for every gradient's average (launching, with zeros, those never produced).
        Raises GradientsInFlightError (after all averages are in) if a gradient was zeroed,
        replaced or modified in place while it was being averaged."""
        for p in self._params():
            if p not in self._grad_handles:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self._launch(p)
        touched = self._wait_gradients()
        self.communications += 1
        if not touched:
            super().synchronize()
        else:
            raise GradientsInFlightError(
                f"the gradients of {touched} were zeroed, replaced or modified while being averaged "
                "(model.zero_grad(), clipping or GradScaler between backward and step); call "
                "opt.synchronize() first, then change them and call step() inside "
                "`with opt.skip_synchronize():`")

    def _wait_gradients(self):
        """Wait for the averages in flight; names of gradients changed meanwhile."""
        handles, self._grad_handles = self._grad_handles, {}
        touched = []
        for p, (h, g, version) in handles.items():
            _ops.synchronize(h)
            if p.grad is not g or g._version != version:
                touched.append(self._names[p])
        self._passes.clear()
        return touched

    def _step(self, closure):
        if self._grad_handles and getattr(self, "found_inf", None) is not None:
            # GradScaler checked or unscaled the gradients (its kernel leaves no version
            # trace) while they were still being averaged: its overflow verdict differs
            # between ranks and the averages are spoiled.
            self._wait_gradients()
            raise GradientsInFlightError(
                "torch.amp.GradScaler looked at the gradients while they were being averaged; "
                "use opt.synchronize(); scaler.unscale_(opt); with opt.skip_synchronize(): "
                "scaler.step(opt) (Horovod's form)")
        self._synchronize_for_step()
        return self._local_step(closure)


DistributedOptimizer = DistributedGradientAllreduceOptimizer
