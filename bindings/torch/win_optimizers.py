"""Asynchronous decentralized optimizers on one-sided window ops (shoal/_win.py).

Neither waits for its neighbours: parameters travel by puts or accumulates into the
neighbours' windows (messages their delivery threads write there), and each rank combines
whatever has arrived when it is ready, so a slow rank slows only itself.

* `DistributedWinPutOptimizer` (BlueFog's): after the local step, put the parameters
  into every out-neighbour's buffer (nonblocking, overlapping the next forward and
  backward); before the next step, combine x ← (x + Σ_j buf_j)/(d+1) with the latest
  values received (uniform, or the topology's weights when it is weighted).
* `DistributedPushSumOptimizer` (SGP, Assran et al. 2019; algorithms.md §2.6): the
  parameters hold the de-biased model z = x/p; each step takes the local step at z,
  collects what was pushed to it, then pushes shares of (x, p) = (z·p, p) to itself and
  its out-neighbours (column-stochastic: 1/(out-degree + 1) each) with a nonblocking
  win_accumulate that travels during the next forward and backward, and sets z = x/p.
  Works on directed, non-regular graphs; Σ p stays n.

Both create one window per parameter at construction (collective), named as BlueFog
names them: `<window_prefix>.<parameter name>`, or the parameter name without a prefix,
and free them in `close()` / `unregister_window()` (collective; never from `__del__`,
which runs at a different moment on each rank). The topology cannot change while they
exist. Both communicate every `num_steps_per_communication` backward passes (gradient
accumulation or local steps, as the other optimizers), and skip only the local update
on a step where GradScaler found an overflow (see optimizers.py). Fault-tolerant mode
(docs/design.md §16): after a loss the recovery recreates their windows and each rank goes
on from its own step with the default weights over the new topology.
"""
import torch

from shoal import _fault, _ops, _win, basics

from ._adapter import ADAPTER
from ._optimizer_base import _Distributed

_WIN = _win.build_win_api(ADAPTER)


class _WindowOptimizer(_Distributed):
    def __init__(self, optimizer, model, num_steps_per_communication=1, window_prefix=None,
                 zero_init=False):
        super().__init__(optimizer, model, num_steps_per_communication)
        if window_prefix is not None and (not isinstance(window_prefix, str) or not window_prefix):
            raise TypeError(f"window_prefix must be a non-empty str or None, got {window_prefix!r}")
        self.window_prefix = window_prefix + "." if window_prefix is not None else ""  # BlueFog's
        self.force_barrier = False  # BlueFog: a barrier at the start of every step()
        self.steps = 0
        self.communications = 0
        self._windows = {}
        self._puts = {}  # parameter -> handle of its put in flight (reads p only: zero_grad is fine)
        names = {p: self.window_prefix + self._names[p] for p in self._params()}
        bad = [n for p, n in names.items() if not p.data.is_contiguous()]
        if bad:  # checked before any (collective) window exists
            raise ValueError(f"parameters {bad} are not contiguous")
        taken = sorted(set(names.values()) & set(_win.get_current_created_window_names()))
        if taken:  # every rank has the same windows: the same error everywhere, before any collective
            raise ValueError(f"windows {taken} exist already (another window optimizer on this model?); "
                             "close() it or pass window_prefix=")
        self._count_passes()
        for p, name in names.items():
            _WIN["win_create"](p.data, name, zero_init=zero_init)
            self._windows[p] = name

    def close(self):
        """Wait for pending puts and free this optimizer's windows (collective)."""
        self._wait_all()
        _ops.barrier()  # nobody frees while a neighbour may still put
        self._absorb()
        for name in self._windows.values():
            _WIN["win_free"](name)
        self._windows = {}

    def unregister_window(self):
        """BlueFog's name for `close()`."""
        self.close()

    def _absorb(self):
        """Last use of what neighbours sent, once every rank has stopped."""

    def _wait_all(self):
        puts, self._puts = self._puts, {}
        for h in puts.values():
            _win.win_wait(h)

    def fault_align(self, step):
        """After a loss (shoal._fault): the recovery recreated the windows; the puts in
        flight were the lost runtime's. No step to agree on: the ranks are asynchronous
        (one may be many steps ahead), so each goes on from its own step; only the step
        the loss surfaced in goes without communication."""
        self._puts = {}
        self._drop_communication()

    def _begin_step(self):
        self._wait_all()  # always: the local step must not change what a put still reads
        if self.force_barrier:  # after the wait: every put of the last step has landed
            _ops.barrier()


class DistributedWinPutOptimizer(_WindowOptimizer):
    """Asynchronous neighbour averaging by window puts (BlueFog's
    `DistributedWinPutOptimizer`).

    step(): wait for this rank's previous puts, combine the parameters with the latest
    received neighbour values (win_update: uniform, or topology weights) if a put was made
    since the last combine (= `synchronize()`), take the wrapped optimizer's step, and,
    once `num_steps_per_communication` backward passes have been made, start putting the
    new parameters to every out-neighbour. Per-step `self_weight`/`dst_weights`
    attributes override the put weights (BlueFog semantics of win_put); `force_barrier`
    adds a barrier at the start of each step, once this rank's puts have landed (then
    every combine sees the values of the step before: synchronous win-put).

    Args: optimizer (any torch.optim.Optimizer), model (module or list),
        num_steps_per_communication, window_prefix (windows are named
        `<window_prefix>.<parameter name>`; default the parameter name).
    Raises TypeError/ValueError for bad arguments or windows that exist already.
    """

    def __init__(self, optimizer, model, num_steps_per_communication=1, window_prefix=None):
        super().__init__(optimizer, model, num_steps_per_communication, window_prefix)
        self.self_weight = None
        self.dst_weights = None
        self._sent = False  # puts made since the last combine

    def synchronize(self):
        """Wait for this rank's puts; combine with the latest neighbour values if a put was
        made since the last combine."""
        self._wait_all()
        if self._sent:
            for name in self._windows.values():
                _WIN["win_update"](name)
            self._sent = False
            self.communications += 1
        super().synchronize()

    def fault_align(self, step):
        super().fault_align(step)
        self._sent = False  # the recreated windows' buffers hold this rank's own value
        self.self_weight = self.dst_weights = None  # ranks were renumbered: the defaults again

    def _step(self, closure):
        self._begin_step()
        self._synchronize_for_step()
        loss = self._local_step(closure)
        self.steps += 1
        if self._communication_due():
            for p, name in self._windows.items():
                self._puts[p] = _WIN["win_put_nonblocking"](p.data, name, self.self_weight,
                                                           self.dst_weights)
            self._sent = True
        return loss


class DistributedPushSumOptimizer(_WindowOptimizer):
    """Asynchronous push-sum SGD (SGP; BlueFog's `DistributedPushSumOptimizer`).

    step(): the wrapped optimizer's step at the de-biased parameters z; then (once
    `num_steps_per_communication` backward passes have been made) x = z·p; collect
    (x += Σ buffers, p += Σ p buffers, buffers zeroed); wait for this rank's pushes of the
    last step, which travelled meanwhile; start win_accumulate of x and p with weights
    `dst_weights` to the out-neighbours,
    keeping `self_weight` of them (default 1/(out-degree + 1) each: column-stochastic),
    nonblocking, so the pushes travel during the next forward and backward passes (SGP's
    overlap, Assran et al. 2019 §4: a push reaches its receivers a step later); z = x / p.
    Turns associated p on for all window ops. `p` is this rank's weight. `synchronize()`
    waits for the pushes in flight. `force_barrier` (default False: push-sum's point is
    not to wait; BlueFog's default is True) adds a barrier at the start of each step,
    after this rank's pushes have landed. A rank whose p has fallen below
    sqrt(smallest normal number of the parameter dtype) (it ran far ahead of its
    neighbours) keeps its mass instead of pushing until pushes reach it.

    Usage (every rank; the constructor and `close()` are collective)::

        opt = bf.DistributedPushSumOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model)
        for x, y in batches:
            opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
        opt.close()  # collects what is still in flight (then Σ p = n) and frees the windows

    Raises ValueError for non-contiguous parameters (before any window is created).
    """

    def __init__(self, optimizer, model, num_steps_per_communication=1, window_prefix=None):
        _win.turn_on_win_ops_with_associated_p()
        super().__init__(optimizer, model, num_steps_per_communication, window_prefix, zero_init=True)
        self._default_weights()
        # x = z·p stays a normal number for |z| and p above sqrt(smallest normal).
        self._p_floor = {name: torch.finfo(p.dtype).tiny ** 0.5 for p, name in self._windows.items()}

    def _default_weights(self):
        outs = basics.out_neighbor_ranks()
        self.self_weight = 1.0 / (len(outs) + 1)
        self.dst_weights = {d: self.self_weight for d in outs}

    def fault_align(self, step):
        """After a loss: the windows start again with p = 1 and the parameters holding z;
        the push weights are the defaults over the new out-neighbours."""
        super().fault_align(step)
        self._default_weights()

    @property
    def p(self):
        """This rank's push-sum weight (of the first parameter's window; all move alike)."""
        if self._windows:
            self._last_p = _win.win_associated_p(next(iter(self._windows.values())))
        return getattr(self, "_last_p", 1.0)

    def _absorb(self):
        # Collect the mass still in the buffers: afterwards sum over ranks of p is n.
        with torch.no_grad():
            for p, name in self._windows.items():
                p.data.mul_(_win.win_associated_p(name))
                _WIN["win_update_then_collect"](name, require_mutex=False)
                p.data.div_(_win.win_associated_p(name))
        self.p  # noqa: B018 - remember p before the windows go

    def synchronize(self):
        """Wait for this rank's pushes in flight (what they carry is collected by the
        receivers' next step)."""
        self._wait_all()
        super().synchronize()

    def _step(self, closure):
        if self.force_barrier:
            self._begin_step()  # this rank's pushes of the last step have landed, then a barrier
        # Else the last step's pushes still travel through the local step and the collect
        # (they read copies; the window thread starts the collects beside them) and are
        # waited for just before this step's: one step's pushes in flight at a time.
        self._synchronized = False
        loss = self._local_step(closure)
        self.steps += 1
        if not self._communication_due():
            return loss
        items = list(self._windows.items())
        keep = _fault.enabled()  # a loss mid-round restores z (the recreated window's p is 1)
        with torch.no_grad():
            saved = [p.data.clone() for p, _ in items] if keep else None
            weights = {}
            try:
                # Every collect before any push: the window thread runs them in order.
                for p, name in items:
                    p.data.mul_(_win.win_associated_p(name))  # z -> x
                    _WIN["win_update_then_collect"](name, require_mutex=False)
                    weights[name] = _win.win_associated_p(name)
            except _fault.RankLostError:
                for (p, _), z in zip(items, saved):
                    p.data.copy_(z)
                raise
            # A rank that ran many steps ahead has pushed most of its mass away and received
            # none: p shrinks by self_weight per step, and x = z·p would underflow (z lost,
            # then NaN). Below the floor it keeps its mass (self weight 1: still
            # column-stochastic) until its neighbours' pushes arrive.
            push = all(w >= self._p_floor[name] for name, w in weights.items())
            xs = [p.data.clone() if push else None for p, _ in items]
            for p, name in items:
                p.data.div_(weights[name])  # x -> z, before any push: a loss there finds z
            self._wait_all()
            if push:
                for (p, name), x in zip(items, xs):
                    # Nonblocking, from a copy: the shares travel during the next forward and
                    # backward passes, the window keeping self_weight of x and p (z = x/p
                    # does not change). No mutexes: a value and its p arrive in one message.
                    self._puts[p] = _WIN["win_accumulate_nonblocking"](
                        x, name, self_weight=self.self_weight, dst_weights=self.dst_weights)
        self.communications += 1
        return loss
