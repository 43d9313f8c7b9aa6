"""Asynchronous decentralized optimizers on one-sided window ops (shoal/_win.py).

Neither waits for its neighbours: parameters travel by MPI passive-target puts or
accumulates into the neighbours' windows, and each rank combines whatever has arrived
when it is ready, so a slow rank slows only itself.

* `DistributedWinPutOptimizer` (BlueFog's): after the local step, put the parameters
  into every out-neighbour's buffer (nonblocking, overlapping the next forward and
  backward); before the next step, combine x ← (x + Σ_j buf_j)/(d+1) with the latest
  values received (uniform, or the topology's weights when it is weighted).
* `DistributedPushSumOptimizer` (SGP, Assran et al. 2019; algorithms.md §2.6): the
  parameters hold the de-biased model z = x/p; each step takes the local step at z,
  then pushes shares of (x, p) = (z·p, p) to itself and its out-neighbours
  (column-stochastic: 1/(out-degree + 1) each) with win_accumulate, collects what was
  pushed to it, and sets z = x/p. Works on directed, non-regular graphs; Σ p stays n.

Both create one window per parameter at construction (collective) and free them in
`close()` (collective). The topology cannot change while they exist.
"""
import itertools

import torch

from shoal import _ops, _win, basics

from ._adapter import ADAPTER
from .optimizers import _Distributed

_instances = itertools.count()
_WIN = _win.build_win_api(ADAPTER)


class _WindowOptimizer(_Distributed):
    def __init__(self, optimizer, model, num_steps_per_communication=1, zero_init=False):
        super().__init__(optimizer, model, num_steps_per_communication)
        self._prefix = f"win{next(_instances)}"
        self.steps = 0
        self.communications = 0
        self._windows = {}
        self._puts = {}  # parameter -> handle of its put in flight (reads p only: zero_grad is fine)
        bad = [self._names[p] for p in self._params() if not p.data.is_contiguous()]
        if bad:  # checked before any (collective) window exists
            raise ValueError(f"parameters {bad} are not contiguous")
        for p in self._params():
            name = f"{self._prefix}.{self._names[p]}"
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

    def _absorb(self):
        """Last use of what neighbours sent, once every rank has stopped."""

    def _wait_all(self):
        puts, self._puts = self._puts, {}
        for h in puts.values():
            _win.win_wait(h)


class DistributedWinPutOptimizer(_WindowOptimizer):
    """Asynchronous neighbour averaging by window puts (BlueFog's
    `DistributedWinPutOptimizer`).

    step(): wait for this rank's previous puts, combine the parameters with the latest
    received neighbour values (win_update: uniform, or topology weights), take the wrapped
    optimizer's step, and start putting the new parameters to every out-neighbour (every
    `num_steps_per_communication` steps). Per-step `self_weight`/`dst_weights` attributes
    override the put weights (BlueFog semantics of win_put).

    Args: optimizer (any torch.optim.Optimizer), model (module or list), and
        num_steps_per_communication. Raises TypeError/ValueError for bad arguments.
    """

    def __init__(self, optimizer, model, num_steps_per_communication=1):
        super().__init__(optimizer, model, num_steps_per_communication)
        self.self_weight = None
        self.dst_weights = None

    def step(self, closure=None):
        self._wait_all()
        if self.steps % self.num_steps_per_communication == 0 and self.steps > 0:
            for p, name in self._windows.items():
                _WIN["win_update"](name)
            self.communications += 1
        loss = self._opt.step(closure)
        self.steps += 1
        if self.steps % self.num_steps_per_communication == 0:
            for p, name in self._windows.items():
                self._puts[p] = _WIN["win_put_nonblocking"](p.data, name, self.self_weight,
                                                               self.dst_weights)
        return loss


class DistributedPushSumOptimizer(_WindowOptimizer):
    """Asynchronous push-sum SGD (SGP; BlueFog's `DistributedPushSumOptimizer`).

    step(): wrapped optimizer's step at the de-biased parameters z, then
    x = z·p; win_accumulate x and p in shares 1/(out-degree + 1) to self and each
    out-neighbour; collect (x += Σ buffers, p += Σ p buffers, buffers zeroed);
    z = x / p. Turns associated p on for all window ops. `p` is this rank's weight.

    Usage (every rank; the constructor and `close()` are collective)::

        opt = bf.DistributedPushSumOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model)
        for x, y in batches:
            opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
        opt.close()  # collects what is still in flight (then Σ p = n) and frees the windows

    Raises ValueError for non-contiguous parameters (before any window is created).
    """

    def __init__(self, optimizer, model, num_steps_per_communication=1):
        _win.turn_on_win_ops_with_associated_p()
        super().__init__(optimizer, model, num_steps_per_communication, zero_init=True)
        outs = basics.out_neighbor_ranks()
        self._share = 1.0 / (len(outs) + 1)
        self._dst = {d: self._share for d in outs}

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

    def step(self, closure=None):
        loss = self._opt.step(closure)
        self.steps += 1
        if self.steps % self.num_steps_per_communication:
            return loss
        with torch.no_grad():
            for p, name in self._windows.items():
                pw = _win.win_associated_p(name)
                p.data.mul_(pw)  # z -> x
                # No mutexes needed: a value and its p arrive in one MPI access epoch, which
                # the owner's collect (an exclusive epoch) never splits.
                _WIN["win_accumulate"](p.data, name, self_weight=self._share, dst_weights=self._dst)
                _WIN["win_update_then_collect"](name, require_mutex=False)
                p.data.div_(_win.win_associated_p(name))  # x -> z
        self.communications += 1
        return loss
