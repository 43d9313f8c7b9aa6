"""Decentralized optimizers: wrap ANY torch.optim.Optimizer (SGD, Adam, AdamW, ...)
without re-implementing its update rule. Semantics follow BlueFog's optimizers
(docs/reference/bluefog-semantics.md §3; update rules in algorithms.md §2.6):

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
import functools
import warnings

import torch

from shoal import _consensus, _fault, _hierarchical, _ops, basics, process_sets

from . import _buckets
from ._sparse_grads import SparseGradients
from ._adapter import ADAPTER
from ._horovod import TORCH_API, Average, Compression, Sum, _check_op, _in_set, check_compression, global_process_set
from ._optimizer_base import (CommunicationType, CommunicationTypeError, GradientsInFlightError,  # noqa: F401
                              _Distributed)
from . import compressed_gossip
from .compressed_gossip import CompressedGossip
from .consensus import ConsensusControl, consensus_distance


class _ParameterMixing(_Distributed):
    """AWC and ATC: combine parameters with neighbors, with optional consensus control."""

    def __init__(self, optimizer, model, communication_type, num_steps_per_communication,
                 consensus_control, compression=None, compression_step=None):
        super().__init__(optimizer, model, num_steps_per_communication)
        if consensus_control is not None and not isinstance(consensus_control, ConsensusControl):
            raise TypeError("consensus_control must be a shoal.torch.ConsensusControl")
        self.compression = None if compression is None else compressed_gossip.by_name(compression)
        self.compression_step = compressed_gossip.default_step(self.compression, compression_step)
        self._gossip = {}  # (name, numel, dtype, device) -> CompressedGossip (its edges' public copies)
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
        self._plans = {}  # tuple of parameters -> their buckets (_plan)
        self._layouts = 0  # plans made (each checked across ranks once)

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

    def _launch(self, t, name, out=None, flat=False):
        """Start this step's communication of `t` (a parameter's data, or a bucket's flat
        buffer with `flat`); `out`: where a neighbor_allreduce's result goes."""
        kind = self.communication_type
        if kind is CommunicationType.neighbor_allreduce and self.compression is not None:
            key = (name, t.numel(), t.dtype, t.device)  # a changed tensor starts new copies
            gossip = self._gossip.get(key)
            if gossip is None:
                gossip = self._gossip[key] = CompressedGossip(self.compression, self.compression_step, name)
            return gossip.start_with(t, self.self_weight, self.src_weights, self.dst_weights)
        if kind is CommunicationType.neighbor_allreduce:
            return _ops.neighbor_allreduce(ADAPTER, t, self.self_weight, self.src_weights,
                                           self.dst_weights, self.enable_topo_check, name, out=out)
        if kind is CommunicationType.hierarchical_neighbor_allreduce:
            return _hierarchical.hierarchical_neighbor_allreduce_nonblocking(
                ADAPTER, t, self.self_weight, self.src_machine_weights, self.dst_machine_weights,
                self.enable_topo_check, name)
        if kind is CommunicationType.allreduce:
            return _ops.allreduce(ADAPTER, t, True, name, inplace=flat)
        return None

    def fault_resync(self):
        """After a loss (shoal._fault): compressed gossip's public copies belonged to the
        old graph's edges; every survivor starts them again. `communications` (consensus
        control's step count) becomes the survivors' largest: a survivor whose exchange the
        loss cut counted one fewer, and would check Ξ at other steps than the others."""
        self._gossip.clear()
        counts = torch.tensor([self.communications], dtype=torch.int64)
        self.communications = int(_ops.synchronize(_ops.allreduce(
            ADAPTER, counts, name=f"{self._prefix}.communications", op=_ops.Max))[0])

    def _plan(self, params):
        """The buckets of `params` (shoal.torch._buckets), made once per parameter list and
        again if a parameter changed shape, dtype or device."""
        key = tuple(map(id, params))  # the plan holds the parameters: their ids stay theirs
        plan = self._plans.get(key)
        if plan is None or not all(b.still_fits() for _, b in plan if b is not None):
            plan = self._plans[key] = _buckets.plan(params, self._names, self._prefix)
            self._layouts += 1
            _buckets.check_layout(plan, f"{self._prefix}.layout.{self._layouts}")
        return plan

    def _launch_all(self, params=None):
        for p, bucket in self._plan(list(self._params()) if params is None else params):
            key = bucket or p
            if key in self._handles:
                raise RuntimeError("a second communication was started before step(); each forward "
                                   "(AWC) or step (ATC) communicates once")
            if bucket is not None:
                h = self._launch(bucket.gather(), bucket.name, bucket.out, flat=True)
            else:
                # The result lands in a buffer kept per parameter: no allocation (page
                # faults) per step.
                t = p.data
                out = self._spare.get(p)
                if out is None or out.shape != t.shape or out.dtype != t.dtype:
                    out = self._spare[p] = torch.empty_like(t)
                h = self._launch(t, f"{self._prefix}.{self._names[p]}", out)
            if h is not None:
                self._handles[key] = h

    def _finish_all(self, install=True):
        """Wait for the exchanges in flight and (with `install`) copy their results in."""
        handles, self._handles = self._handles, {}
        if not install:
            for key, h in handles.items():
                h.finish() if isinstance(h, compressed_gossip.GossipRound) else _ops.synchronize(h)
            return
        with torch.no_grad():
            for key, h in handles.items():
                # Copied, not swapped in: views of the parameter (state_dict, p.detach())
                # must keep seeing it.
                if isinstance(h, compressed_gossip.GossipRound):
                    result = h.finish()
                    key.scatter(result) if isinstance(key, _buckets.Bucket) else key.copy_(result)
                elif isinstance(key, _buckets.Bucket):
                    key.scatter(_buckets.synchronize(key, h))
                else:
                    key.copy_(_ops.synchronize(h))
        if handles:
            self.communications += 1

    def _gossip_round(self, p):
        """Start one extra consensus-control round of `p`: neighbor averaging over the static
        topology, or, for hierarchical AWC/ATC with a machine topology set, the hierarchical
        op over it (machines average inside at once, and fewer bytes cross the links). After a
        lost rank the machine topology is unset (fault tolerance rebuilds only the rank
        graph), so the rounds go back to the ranks' graph."""
        name = f"{self._prefix}.cc.{self._names[p]}"
        if (self.communication_type is CommunicationType.hierarchical_neighbor_allreduce
                and basics.load_machine_topology() is not None):
            return _hierarchical.hierarchical_neighbor_allreduce_nonblocking(ADAPTER, p.data, name=name)
        return _ops.neighbor_allreduce(ADAPTER, p.data, name=name)

    def _control(self):
        if not self._communicating():  # a loss cut this step's exchange: no check (every survivor skips it)
            return

        def mix(start):
            handles = [(p, start(p)) for p in self._params()]
            with torch.no_grad():
                for p, h in handles:
                    p.copy_(_ops.synchronize(h))

        checked = _consensus.control(
            self.consensus_control, self.steps, self.communications,
            lambda: consensus_distance(list(self._params()), name=f"{self._prefix}.xi"),
            lambda: mix(self._gossip_round),
            lambda: mix(lambda p: _ops.allreduce(ADAPTER, p.data, True, f"{self._prefix}.avg.{self._names[p]}")))
        if checked is not None:
            self.last_consensus_distance, rounds, exact = checked
            self.extra_rounds += rounds
            self.exact_averages += int(exact)


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
        compression: a gossip compressor or its name (`shoal.torch.compression`: "int8",
            "int4", "fp16", "bf16", "topk:R", "randomk:R", or Compression.int8, ...): the
            neighbor_allreduce exchange becomes CHOCO-SGD's compressed gossip with error
            feedback (`CompressedGossip`, docs/design.md §21); W must be doubly stochastic.
        compression_step: its consensus step γ (default: `compressed_gossip.default_step`).
        overlap: "backward" (default): the parameters x_t are sent at the end of the
            forward pass, so the exchange overlaps the backward pass. "delayed": x_{t+1}
            is sent at the end of step() t (after the local update and consensus
            control), so the exchange runs during the whole next forward and backward
            pass; step() t+1 waits for it, installs Σ_j w_ij x_j(t+1) and then applies
            the update computed at x_{t+1}. The update rule is AWC's either way
            (docs/design.md §22); the exchange starting at the end of step() t uses the
            weights set for step t (a dynamic schedule's weights apply one step later;
            the first exchange starts at the first forward pass), and with
            num_steps_per_communication=k it starts early only when the next forward
            pass is a communicating one (k=1, or the step before the k-th of k local
            steps; gradient accumulation over k passes sends at the k-th forward). The
            wrapped optimizer, clip_grad_norm_, GradScaler and accumulation see whole
            gradients as before. The parameters must not be changed in place between
            step() and the next step() (RuntimeError at the next step() or
            synchronize(): the mix would overwrite the change); `synchronize()`
            installs the exchange in flight at once (after the last step, or before
            evaluating), and the step after it then only applies the local update.
    Raises: TypeError/ValueError for bad arguments (CommunicationTypeError for
        communication_type); RuntimeError for two forward passes that both communicate
        before step().
    """

    def __init__(self, optimizer, model, communication_type=CommunicationType.neighbor_allreduce,
                 num_steps_per_communication=1, consensus_control=None, *, compression=None,
                 compression_step=None, overlap="backward"):
        if overlap not in ("backward", "delayed"):
            raise ValueError(f'overlap must be "backward" or "delayed", got {overlap!r}')
        super().__init__(optimizer, model, communication_type, num_steps_per_communication,
                         consensus_control, compression, compression_step)
        self.overlap = overlap
        self._early = set()  # delayed: modules whose next forward's exchange started at step()
        self._sent_versions = {}  # delayed: parameter -> its _version when its exchange started
        # Each module's forward sends the parameters it owns (a parameter shared by several
        # modules belongs to the first), counted per module.
        mine, owned = set(self._params()), set()
        self._forwards, self._owned = {}, {}
        for m in self._modules:
            params = [p for p in m.parameters() if p in mine and p not in owned]
            owned.update(params)
            self._forwards[m], self._owned[m] = 0, params
            self._hooks.append(m.register_forward_hook(lambda module, inputs, output: self._on_forward(module)))

    def _on_forward(self, module):
        if not (module.training and torch.is_grad_enabled()):
            return
        self._forwards[module] += 1
        self._synchronized = False  # a synchronize() before this forward pass was the last step's
        if self._forwards[module] % self.num_steps_per_communication == 0 and module not in self._early:
            self._sending(lambda: self._launch_all(self._owned[module]))
        self._early.discard(module)

    def _drop_communication(self):
        super()._drop_communication()
        self._sent_versions.clear()  # a lost early exchange: the next communicating forward sends
        self._early.clear()

    def _launch_early(self):
        """Delayed mixing: start now the exchange of every module whose next forward
        pass communicates (docs/design.md §22)."""
        for m, params in self._owned.items():
            if (self._forwards[m] + 1) % self.num_steps_per_communication == 0 and params:
                self._sending(lambda: self._launch_all(params), ahead=1)
                self._early.add(m)
                self._sent_versions.update((p, p._version) for p in params)

    def synchronize(self):
        """Wait for the parameters in flight (sent at the last communicating forward pass,
        or at the end of the last step() with overlap="delayed") and install their
        combination (nothing if none is in flight). Raises RuntimeError if a parameter
        sent at the end of step() was changed in place since (its change would be lost)."""
        sent, self._sent_versions = self._sent_versions, {}
        changed = [self._names[p] for p, v in sent.items() if p._version != v]
        if changed:
            self._finish_all(install=False)  # every rank completes the exchange; this one drops it
            self._early.clear()
            raise RuntimeError(
                f"parameters {changed} were changed in place while their exchange (started at the end of "
                "step(), overlap='delayed') was in flight; change parameters only through step(), or call "
                "opt.synchronize() before changing them")
        try:
            self._finish_all()  # the next forward pass still starts nothing: its exchange was this one
        except _fault.RankLostError:
            self._lost_exchange()
        super().synchronize()

    def _step(self, closure):
        self._synchronize_for_step()
        loss = self._local_step(closure)
        self.steps += 1
        self._control()
        if self.overlap == "delayed":
            self._launch_early()
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
                 num_steps_per_communication=1, consensus_control=None, *, compression=None,
                 compression_step=None):
        super().__init__(optimizer, model, communication_type, num_steps_per_communication,
                         consensus_control, compression, compression_step)
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
        try:
            self._finish_all()
        except _fault.RankLostError:
            self._lost_exchange()
        super().synchronize()

    def _step(self, closure):
        self._synchronized = False
        loss = self._local_step(closure)
        self.steps += 1
        if self._communication_due():
            self._sent_for = self._calls  # fault-tolerant mode: this step's exchange started
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
    """Horovod-style data parallelism: every gradient is averaged over all ranks while
    the rest of backward runs, then the wrapped optimizer steps. Gradients of parameters
    over 64 KiB go as soon as backward produces them; smaller ones are copied into flat
    buckets (by dtype and device, up to 4 MiB, in name order) averaged as one op once all
    their members are in (shoal.torch._buckets; the values are the same, elementwise). With `num_steps_per_communication=k`, gradients accumulate locally
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

    Horovod's options (keyword-only here; `DistributedOptimizer` takes them in Horovod's
    order): `compression` (Compression.fp16/bf16: each gradient travels cast to that
    dtype and is cast back), `op` (Average, or Sum: gradients summed, not averaged),
    `gradient_predivide_factor` f (Average only: each gradient times 1/f before the sum,
    the average times f after it, as Horovod splits the average), `sparse_as_dense`
    (sparse COO gradients, e.g. of nn.Embedding(sparse=True), are densified, averaged
    and made sparse again; without it they are reduced by Horovod's sparse allreduce,
    an allgather of indices and values: bindings/torch/_sparse_grads.py), `process_set`
    (a `ProcessSet`: gradients are averaged over its members only; on a rank outside it
    the optimizer takes local steps and communicates nothing, as Horovod's).
    """

    def __init__(self, optimizer, model, num_steps_per_communication=1, *, compression=Compression.none,
                 op=Average, gradient_predivide_factor=1.0, sparse_as_dense=False, process_set=global_process_set):
        compression = check_compression(compression, type(self).__name__)
        _check_op(op, type(self).__name__)
        if op is not Average and op is not Sum:
            raise ValueError(f"op must be shoal.torch.Average or Sum, got {op!r}")
        f = float(gradient_predivide_factor)
        if f != 1.0 and op is not Average:
            raise ValueError("gradient_predivide_factor is only supported with op=Average (as in Horovod)")
        if not f > 0.0:
            raise ValueError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor!r}")
        process_sets.id_of(process_set, type(self).__name__)  # TypeError/ValueError for a bad one
        super().__init__(optimizer, model, num_steps_per_communication)
        self._in_set = _in_set(process_set)
        self._process_set = global_process_set if process_set is None else process_set
        self._member = process_set is None or process_set.included()
        self._compression = compression
        # Horovod's split of the average: each gradient times 1/f before the sum, the
        # average times f after it.
        self._op, self._prescale, self._postscale = op, 1.0 / f, f
        self._sparse = SparseGradients(sparse_as_dense, process_set)
        # Small gradients travel in buckets (shoal.torch._buckets): a bucket's op starts
        # once all its members' gradients are in; the others go alone, as soon as backward
        # produces them. _grad_handles: parameter or Bucket -> (handle, [(parameter,
        # gradient, its _version)], tensor sent, compression ctx).
        self._bucket_of = {}
        plan = _buckets.plan(list(self._params()), self._names, f"{self._prefix}.grad")
        for p, bucket in plan:
            for q in bucket.params if bucket is not None else ():
                self._bucket_of[q] = bucket
        self._ready = {}  # Bucket -> {parameter: (gradient, _version)} of members whose gradient is in
        self.communications = 0
        if not self._member:
            return  # outside its process set: local steps (no hooks, nothing to average)
        _buckets.check_layout(plan, f"{self._prefix}.grad.layout",
                              None if process_set is None or process_set is global_process_set else process_set)
        self._count_passes(self._on_grad)
        for p in self._params():  # before accumulation: an in-flight gradient stays untouched
            self._hooks.append(p.register_hook(lambda grad, p=p: self._before_accumulation(p)))

    # Horovod's attributes of its DistributedOptimizer (horovod/torch/optimizer.py), read-only
    # but backward_passes_per_step (see set_backward_passes_per_step).
    op = property(lambda self: self._op, doc="The reduce op of the gradients: Average or Sum.")
    gradient_predivide_factor = property(lambda self: self._postscale, doc="Horovod's predivide factor f (float).")
    sparse_as_dense = property(lambda self: self._sparse.as_dense, doc="Whether sparse gradients are densified.")
    process_set = property(lambda self: self._process_set, doc="The ProcessSet the gradients are averaged over.")

    @property
    def backward_passes_per_step(self):
        """Horovod's name of num_steps_per_communication (int >= 1); assigning it is
        `set_backward_passes_per_step`."""
        return self.num_steps_per_communication

    @backward_passes_per_step.setter
    def backward_passes_per_step(self, passes):
        self.set_backward_passes_per_step(passes)

    def set_backward_passes_per_step(self, passes):
        """Horovod's `set_backward_passes_per_step`: average every `passes` backward passes
        from now on; the count restarts (passes already made are forgotten, as in Horovod).
        Raises ValueError for passes < 1 (TypeError for a non-integer) and
        GradientsInFlightError while gradients are being averaged (call it after step())."""
        if isinstance(passes, bool) or not isinstance(passes, int):
            raise TypeError(f"set_backward_passes_per_step: passes must be an int, got {passes!r}")
        if passes < 1:
            raise ValueError(f"set_backward_passes_per_step: passes must be >= 1, got {passes}")
        if self._gradients_pending():
            raise GradientsInFlightError("set_backward_passes_per_step while gradients are being averaged: "
                                         "call it after step() or synchronize()")
        self.num_steps_per_communication = passes
        self._passes.clear()

    def _gradients_pending(self):
        return bool(self._grad_handles) or any(self._ready.values())

    def _in_flight(self, p):
        bucket = self._bucket_of.get(p)
        return p in self._grad_handles or (bucket is not None and (
            bucket in self._grad_handles or p in self._ready.get(bucket, ())))

    def _before_accumulation(self, p):
        if self._in_flight(p):  # a RuntimeError, and the AssertionError Horovod raises here
            raise GradientsInFlightError(
                f"more than num_steps_per_communication={self.num_steps_per_communication} (Horovod's "
                f"backward_passes_per_step) backward passes before step() (the gradient of {self._names[p]!r} "
                "is being averaged)")

    def _on_grad(self, p, n):
        if n == self.num_steps_per_communication:
            self._sending(lambda: self._launch_grad(p))

    def _launch_grad(self, p):
        bucket = self._bucket_of.get(p)
        if self._sparse.goes_sparse(p):
            self._launch_sparse(p, bucket)
            return
        if bucket is None:
            self._launch(p)
            return
        ready = self._ready.setdefault(bucket, {})
        ready[p] = (self._dense_grad(p), p.grad._version)
        if len(ready) == len(bucket.params):
            self._launch_bucket(bucket)

    def _dense_grad(self, p):
        return self._sparse.dense(p, self._names[p])

    def _launch_sparse(self, p, bucket):
        """Horovod's sparse allreduce of p's gradient; in p's bucket its slot sends zeros."""
        g = p.grad
        finish = self._sparse.start(p, f"{self._prefix}.grad.{self._names[p]}", self._op)
        self._grad_handles[p] = (finish, [(p, g, g._version)], None, None)
        if bucket is not None:
            ready = self._ready.setdefault(bucket, {})
            ready[p] = (torch.zeros_like(p), -1)
            if len(ready) == len(bucket.params):
                self._launch_bucket(bucket)

    def _start(self, key, t, name, grads):
        """Start the allreduce of `t` (a gradient, or a bucket's flat buffer)."""
        sent, ctx = self._compression.compress(t)
        if self._prescale != 1.0:
            with torch.no_grad():
                sent.mul_(self._prescale)
        # allreduce_nonblocking_: a plain gradient goes to the core from C (the hook runs
        # once per parameter, on the backward pass's critical path).
        h = TORCH_API["allreduce_nonblocking_"](sent, self._op is Average, False, name, **self._in_set)
        self._grad_handles[key] = (h, grads, sent, ctx)

    def _launch(self, p):
        g = self._dense_grad(p)
        self._start(p, g, f"{self._prefix}.grad.{self._names[p]}", [(p, g, None)])
        h, grads, sent, ctx = self._grad_handles[p]  # its version after a prescale in place
        self._grad_handles[p] = (h, [(p, g, g._version)], sent, ctx)

    def _launch_bucket(self, bucket):
        ready = self._ready.pop(bucket)
        # A member frozen since the plan was made (requires_grad off) sends zeros.
        grads = [(p, *ready[p]) if p in ready else (p, torch.zeros_like(p), -1) for p in bucket.params]
        with torch.no_grad():
            _buckets._copy_all(bucket.flat_views, [g for _, g, _ in grads])
        self._start(bucket, bucket.flat, bucket.name, grads)

    def synchronize(self):
        """Wait for every gradient's average (launching, with zeros, those never produced).
        Raises GradientsInFlightError (after all averages are in) if a gradient was zeroed,
        replaced or modified in place while it was being averaged."""
        if not self._member or not self._communicating():
            return super().synchronize()
        for p in self._params():
            if not self._in_flight(p):
                if p.grad is None:
                    p.grad = self._sparse.empty(p)
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                bucket = self._bucket_of.get(p)
                if self._sparse.goes_sparse(p):
                    self._launch_sparse(p, bucket)
                elif bucket is None:
                    self._launch(p)
                else:
                    self._ready.setdefault(bucket, {})[p] = (self._dense_grad(p), p.grad._version)
                    if len(self._ready[bucket]) == len(bucket.params):
                        self._launch_bucket(bucket)
        for bucket in [b for b, ready in self._ready.items() if ready]:
            self._launch_bucket(bucket)  # members frozen after the plan: the others still go
        try:
            touched = self._wait_gradients()
        except _fault.RankLostError:  # the averages are lost: the step takes no update
            self._lost_exchange()
            return super().synchronize()
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
        self._ready.clear()
        touched, sparse = [], {}
        for key, (h, grads, _, _) in handles.items():
            if isinstance(key, _buckets.Bucket):
                _buckets.synchronize(key, h)
            elif callable(h):  # a sparse allreduce
                sparse[key] = h()
            else:
                _ops.synchronize(h)
            touched += [self._names[p] for p, g, version in grads
                        if version != -1 and (p.grad is not g or g._version != version)]
        self._passes.clear()
        if not touched:  # the average back into the gradient (unless it was averaged in place)
            with torch.no_grad():
                for key, (_, grads, sent, ctx) in handles.items():
                    if key in sparse:
                        self._sparse.install(grads[0][1], sparse[key])
                        continue
                    out = self._compression.decompress(sent, ctx)
                    if self._postscale != 1.0:
                        out = out * self._postscale
                    if isinstance(key, _buckets.Bucket):
                        _buckets._copy_all([g for _, g, _ in grads], key.flat_views if out is key.flat
                                           else key._views(out))
                    elif out is not grads[0][1]:
                        grads[0][1].copy_(out)
            self._sparse.restore()
        return touched

    def _quiet_step(self, closure):
        """Fault-tolerant mode: no update at all (the replicas stay equal: the survivors
        took the model of the new rank 0 at the loss, `fault_resync`)."""
        self._drop_communication()
        self._ready.clear()
        self._passes.clear()
        return None

    def fault_resync(self):
        """After a loss: every survivor takes the new rank 0's parameters and optimizer
        state (a rank may have applied the last step, another not)."""
        from .utility import broadcast_optimizer_state, broadcast_parameters
        params = {name: p for p, name in self._names.items()}
        broadcast_parameters(params, root_rank=0)
        broadcast_optimizer_state(self._opt, root_rank=0)

    def _step(self, closure):
        if self._gradients_pending() and getattr(self, "found_inf", None) is not None:
            # GradScaler checked or unscaled the gradients (its kernel leaves no version
            # trace) while they were still being averaged: its overflow verdict differs
            # between ranks and the averages are spoiled.
            self._wait_gradients()
            raise GradientsInFlightError(
                "torch.amp.GradScaler looked at the gradients while they were being averaged; "
                "use opt.synchronize(); scaler.unscale_(opt); with opt.skip_synchronize(): "
                "scaler.step(opt) (Horovod's form)")
        self._synchronize_for_step()
        if not self._communicating():  # a loss surfaced in synchronize(): no update (fault_resync)
            return self._quiet_step(closure)
        return self._local_step(closure)
