"""Horovod's `hvd.elastic` for a Shoal job: what the torch and Keras forms
(shoal.torch.elastic, shoal.keras.elastic) share. Horovod elastic scripts run unchanged and
behave as Horovod's do when no rank joins or leaves. In fault-tolerant mode (shoalrun
--fault-tolerant) a lost rank is Horovod's HorovodInternalError: every survivor restores
the last commit, runs the reset callbacks, syncs from the (new) rank 0 and calls the
function again, on the shrunk job. Otherwise a failed or leaving rank ends the job (the
ShoalError propagates). No rank ever joins: Shoal has no elastic driver. Semantics:
Horovod 0.28, horovod/common/elastic.py (run_fn).
"""
import functools

from ._fault import RankLostError
from ._process import STATE


def run(func):
    """Horovod's `hvd.elastic.run` decorator: `func(state, *args, **kwargs)` after
    `state.sync()`; its result is returned. Fault-tolerant mode: after a lost rank
    (RankLostError, raised on every survivor: the optimizers raise it here instead of
    skipping the step) `state.restore()`, the reset callbacks, then sync and call again.
    Any other ShoalError propagates."""
    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        STATE.elastic_depth += 1
        try:
            while True:
                state.sync()
                try:
                    return func(state, *args, **kwargs)
                except RankLostError:
                    state.restore()
                    for _, ref in STATE.fault_participants:  # back at the commit: nothing to skip
                        if ref() is not None:
                            ref().fault_restart()
                    state.on_reset()
        finally:
            STATE.elastic_depth -= 1
    return wrapper


class State:
    """Horovod's base of elastic states: save/restore/sync are the framework's; commit() is
    save() (there are no host updates to check); reset callbacks are kept, never called."""

    def __init__(self):
        self._reset_callbacks = []

    def register_reset_callbacks(self, callbacks):
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        for callback in self._reset_callbacks:
            callback()

    def commit(self):
        self.save()

    def check_host_updates(self):
        """Horovod's: nothing to check (the set of ranks is fixed)."""

    def save(self):
        raise NotImplementedError

    def restore(self):
        raise NotImplementedError

    def sync(self):
        raise NotImplementedError
