"""The machinery every Shoal torch optimizer shares (shoal.torch.optimizers and
win_optimizers): delegation to the wrapped optimizer, parameter names, communication
handles, hooks and the errors; see shoal.torch.optimizers for the semantics."""
import contextlib
import enum
import os
import warnings

import torch

from shoal import _fault, _ops, basics
from shoal._process import STATE


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
        self._prefix = STATE.unnamed("opt")
        self._handles = {}       # parameter -> handle of its parameter communication
        self._grad_handles = {}  # gradient allreduce: parameter or bucket -> its op (optimizers.py)
        self._passes = {}        # parameter -> backward passes since the last communication
        self._hooks = []
        self._timeline_hooks = []
        self._should_synchronize = True
        self._synchronized = False
        # Fault-tolerant mode (shoal._fault): step() calls made, the step whose
        # communication started last, and the first step that communicates after a loss.
        self._calls, self._sent_for, self._quiet_until = 0, -1, 0
        _fault.register(self)
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
        returns the closure's loss (None without a closure). Fault-tolerant mode: a step
        whose communication a lost rank ended, and those every survivor then agreed to
        skip, take the local step only (`_quiet_step`)."""
        self._stepped = False
        try:
            if not self._communicating():
                return self._quiet_step(closure)
            return self._step(closure)
        except _fault.RankLostError:
            if STATE.elastic_depth:  # hvd.elastic.run restores the last commit on every survivor
                self._drop_communication()
                raise
            return None if self._stepped else self._quiet_step(closure)
        except BaseException:
            # GradScaler removes its grad_scale/found_inf only after a step that returns.
            self.__dict__.pop("grad_scale", None)
            self.__dict__.pop("found_inf", None)
            raise
        finally:
            self._calls += 1

    # Fault tolerance (shoal._fault, docs/design.md §16).
    def _communicating(self, ahead=0):
        """False for the step calls after a loss that every survivor takes without
        communicating (`ahead`: for the call that many after the current one)."""
        return self._calls + ahead >= self._quiet_until

    def _sending(self, launch, ahead=0):
        """Run `launch()` (start this step's communication) unless the step is a quiet
        one; a lost rank (RankLostError: recovered already) makes the step quiet."""
        if not self._communicating(ahead):
            return
        self._sent_for = self._calls + ahead
        try:
            launch()
        except _fault.RankLostError:
            self._drop_communication()
            if STATE.elastic_depth:
                raise

    def fault_position(self):
        """The first step call that can communicate again if the job shrank now."""
        return max(self._calls, self._sent_for + 1)  # a step whose exchange was lost stays quiet

    def fault_align(self, step):
        self._quiet_until = max(self._quiet_until, step)
        self._drop_communication()

    def fault_resync(self):
        """After the alignment: what every survivor must agree on again (nothing here)."""

    def fault_restart(self):
        """hvd.elastic.run restored the last commit on every survivor: no step to skip."""
        self._drop_communication()
        self._quiet_until = self._calls

    def _lost_exchange(self):
        """A loss surfaced while waiting for this step's exchange (synchronize()): the
        exchange is dropped and the step taken without it (the alignment, run by the
        recovery, already covers this step); in hvd.elastic.run it propagates."""
        self._drop_communication()
        if STATE.elastic_depth:
            raise  # the RankLostError being handled (called from an except clause)
        self._quiet_until = max(self._quiet_until, self._calls + 1)

    def _drop_communication(self):
        """Forget the communication in flight (a lost runtime's ops: they fail)."""
        for h in list(self._handles.values()) + [v[0] for v in self._grad_handles.values()]:
            try:
                h.finish() if hasattr(h, "finish") else h() if callable(h) else _ops.synchronize(h)
            except (basics.ShoalError, ValueError):
                pass  # failed with the lost rank, or synchronized by the frame the loss surfaced in
        self._handles.clear()
        self._grad_handles.clear()

    def _quiet_step(self, closure):
        """A step without communication: the wrapped optimizer's own update."""
        self._drop_communication()
        self._passes.clear()
        return self._local_step(closure)

    def _step(self, closure):
        raise NotImplementedError

    def _local_step(self, closure=None):
        """The wrapped optimizer's step; with GradScaler's scale and overflow flag (see
        `_step_supports_amp_scaling`): skipped after an overflow, else on unscaled gradients."""
        self._stepped = True
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
        in_flight = bool(self._handles) or self._gradients_pending()
        if not self._should_synchronize:
            if in_flight:  # the local step would race with (and be undone by) the communication
                raise (GradientsInFlightError if self._gradients_pending() else RuntimeError)(
                    "step() inside skip_synchronize() while communication is in flight; "
                    "call synchronize() first")
        elif self._synchronized:
            warnings.warn(_STEP_AFTER_SYNCHRONIZE, stacklevel=4)
            if in_flight:
                self.synchronize()
        else:
            self.synchronize()
        self._synchronized = False

    def _gradients_pending(self):
        """True while gradients are being averaged (DistributedGradientAllreduceOptimizer)."""
        return bool(self._grad_handles)

    def zero_grad(self, set_to_none=True):
        """The wrapped optimizer's zero_grad. Fine while parameters are in flight; raises
        GradientsInFlightError while gradients are being averaged (after backward and
        before step()/synchronize() of DistributedGradientAllreduceOptimizer)."""
        if self._gradients_pending():
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
