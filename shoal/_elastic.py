"""Horovod's `hvd.elastic` for a Shoal job, whose set of ranks is fixed: what the torch and
Keras forms (shoal.torch.elastic, shoal.keras.elastic) share. Horovod elastic scripts run
unchanged and behave as Horovod's do when no rank joins or leaves. A failed or leaving
rank ends the job (the ShoalError, Horovod's HorovodInternalError, propagates) instead of
a restore and reset: Shoal has no elastic driver, so reset callbacks are kept but never
called. Semantics: Horovod 0.28, horovod/common/elastic.py.
"""
import functools


def run(func):
    """Horovod's `hvd.elastic.run` decorator: `func(state, *args, **kwargs)` runs once, after
    `state.sync()`; its result is returned. A ShoalError from a failed rank propagates."""
    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        state.sync()
        return func(state, *args, **kwargs)
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
