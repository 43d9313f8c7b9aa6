"""One-sided window ops (BlueFog's `win_*`, docs/reference/bluefog-semantics.md §1.7).

A window is a named tensor plus, on this rank, one receive buffer per in-neighbour of
the topology at `win_create`. Neighbours write into those buffers with `win_put` /
`win_accumulate` (and this rank fetches into them with `win_get`) without the owner
taking part; `win_update` combines the buffers into the tensor when the owner chooses.
The core keeps two MPI windows per tensor (data and control), whatever the world size.

Progress model: window ops run in call order on a window thread of their own, with MPI
passive-target RMA on their own communicator; they never wait for the background
thread's collectives, nor it for them. `win_create`/`win_free` are collectives: every
rank calls them, in the same order (a disagreement is the same error on every rank).
`set_topology` refuses while windows exist.

Associated p follows BlueFog's arithmetic exactly: p starts at 1 and every p slot at 0
(with `zero_init` or not); put/accumulate set/add p·w in the destination's slot and then
multiply p by `self_weight`; `win_get` leaves p slots alone; `win_update` combines p and
the slots with the data's weights, and its `reset` zeroes the slots only while p is on.

Fault-tolerant mode: after a lost rank the recovery creates every window again over the
new topology (shoal/_fault.py); the lost runtime's window ops raise RankLostError.

Differences from BlueFog: `win_get` reads the owner's value as of its last window op on
that name (create, put, accumulate, update), not its live memory; errors raise instead of
returning False.
"""
import contextlib
import math
import operator
import warnings

from . import _process
from ._loader import _core
from ._process import STATE

# Window op codes, as the core exports them (shoal_win_op of core/include/shoal/c_api.h).
CREATE, FREE, PUT, ACCUMULATE, GET, UPDATE, LOCK, UNLOCK = (
    _core.WIN_OPS[n] for n in ("create", "free", "put", "accumulate", "get", "update", "lock", "unlock"))
# State (STATE): windows: name -> the tensor win_create registered (win_update writes into
# it); mirrors: name -> host copy the core works on, for a device (CUDA) tensor;
# win_pending: window handle -> (objects kept alive, finish() run by win_wait or None).


def _check_name(name):
    if not isinstance(name, str) or not name:
        raise ValueError(f"window name must be a non-empty str, got {name!r}")
    if any(ord(c) < 0x20 for c in name):
        raise ValueError(f"window names cannot contain control characters: {name!r}")
    return name


def _weights(arg, allowed, what, kind):
    """{rank: weight} from a dict, a list of ranks (weight 1.0) or None (all allowed)."""
    if arg is None:
        return {r: 1.0 for r in allowed}
    if isinstance(arg, dict):
        items = list(arg.items())
    elif isinstance(arg, (list, tuple)):
        items = [(r, 1.0) for r in arg]
    else:
        raise TypeError(f"{what} must be a dict {{rank: weight}} or a list of ranks")
    out = {}
    for k, v in items:
        try:
            k = operator.index(k)  # ints, numpy and 0-d torch integers; not 1.7
        except TypeError:
            raise TypeError(f"{what}: ranks must be integers, got {k!r}") from None
        if not math.isfinite(float(v)):
            raise ValueError(f"{what}: weight of rank {k} is {v}")
        out[k] = float(v)
    bad = sorted(set(out) - set(allowed))
    if bad:
        raise ValueError(f"{what}: ranks {bad} are not {kind} of rank {_process.rank()} "
                         f"({kind}: {sorted(allowed)})")
    return out


class UnknownWindowError(ValueError, KeyError):
    """No window of that name on this rank: a ValueError, like Shoal's other argument
    errors, and a KeyError, as BlueFog's window registry raised it."""
    __str__ = BaseException.__str__  # the message as written, not KeyError's repr of it


def _registered(name, op):
    with STATE.lock:
        if name not in STATE.windows:
            raise UnknownWindowError(f"{op}: no window named {name!r}; create it with win_create")
        return STATE.windows[name]


def _refuse_create(name, exc):
    """Tells the peers waiting in win_create(`name`) that this rank refused it at the call
    with `exc`: they raise the same error (the core's window record carries it)."""
    if not _core.is_initialized():
        return
    try:
        _wait(_submit(CREATE, name if isinstance(name, str) else repr(name), refused=str(exc),
                      refused_type=isinstance(exc, TypeError)))
    except (ValueError, TypeError, _core.ShoalError):
        pass  # this rank raises `exc` itself


def _wait(handle):
    try:
        _core.win_wait(handle)
    except KeyboardInterrupt:
        raise  # the op still runs: its tensors stay alive and the handle stays valid
    except _core.RankLostError:
        raise  # the lost runtime's window thread may still run it: its tensors stay alive
    except BaseException:
        _forget(handle)
        raise
    finish = _forget(handle)
    if finish is not None:
        finish()


def _forget(handle):
    _core.win_release(handle)
    with STATE.lock:
        return STATE.win_pending.pop(handle, ((), None))[1]


def _submit(op, name, keep=(), finish=None, **kw):
    h = _core.win_enqueue(op, name, with_p=STATE.with_p, **kw)
    with STATE.lock:
        STATE.win_pending[h] = (keep, finish)
    return h


def build_win_api(adapter):
    """Return {name: function} of the window API over `adapter`'s tensor type."""

    def tensor_args(t, op):  # the core checks the dtype (window ops support fewer)
        ptr, dtype, shape = adapter.describe(t)
        return dict(data=ptr, dtype=dtype, shape=list(shape))

    def win_create(tensor, name, zero_init=False):
        """Create window `name` for `tensor` (collective: every rank, same order).

        Allocates one receive buffer per in-neighbour of the current topology, holding a
        copy of the local `tensor` (or zeros with `zero_init`), and registers `tensor`
        itself: `win_update` later writes into it. Tensor: contiguous, any shape, dtype
        float16, bfloat16, float32, float64, int32 or int64. Returns True.
        Raises ValueError (bad tensor or name, name already exists on some rank) and
        ShoalError (ranks disagree on name, dtype or shape: the same error on every rank).
        """
        try:
            _check_name(name)
            adapter.check_window_tensor(tensor, "win_create")
        except (ValueError, TypeError) as exc:
            _refuse_create(name, exc)
            raise
        # Device tensors: the window lives in host memory (staged copies, as BlueFog does).
        host = adapter.to_host(tensor) if adapter.is_device(tensor) else tensor
        args = tensor_args(host, "win_create")
        h = _submit(CREATE, name, (tensor, host), ranks=_process.in_neighbor_ranks(),
                    send_ranks=_process.out_neighbor_ranks(), zero_init=bool(zero_init), **args)
        _wait(h)
        with STATE.lock:
            STATE.windows[name] = tensor
            STATE.window_makers[name] = lambda: win_create(tensor, name, zero_init)
            if host is not tensor:
                STATE.mirrors[name] = host
        return True

    def win_free(name=None):
        """Free window `name`, or every window when None (collective). Returns True.
        Raises UnknownWindowError (ValueError and KeyError) for a name unknown on this
        rank, ShoalError when ranks disagree."""
        if name is not None:
            _check_name(name)
        with STATE.lock:
            unknown = name is not None and name not in STATE.windows
        try:
            _wait(_submit(FREE, name or ""))  # submitted even then: the peers are in it too
        except ValueError as e:
            if unknown:
                raise UnknownWindowError(str(e)) from None
            raise
        with STATE.lock:
            if name is None:
                STATE.windows.clear()
                STATE.mirrors.clear()
                STATE.window_makers.clear()
            else:
                STATE.windows.pop(name, None)
                STATE.mirrors.pop(name, None)
                STATE.window_makers.pop(name, None)
        return True

    def _put(op, what, tensor, name, self_weight, dst_weights, require_mutex):
        _check_name(name)
        _registered(name, what)
        dst = _weights(dst_weights, _process.out_neighbor_ranks(), f"{what}: dst_weights", "out-neighbours")
        sw = 1.0 if self_weight is None else float(self_weight)
        finish = None
        if adapter.is_device(tensor):
            src = adapter.to_host(tensor)
            if sw != 1.0:
                adapter.check_window_tensor(tensor, what)
                finish = lambda: adapter.copy_into(tensor, src)  # noqa: E731 - scaled on the host
        elif sw != 1.0:
            adapter.check_window_tensor(tensor, what)  # scaled in place
            src = tensor
        else:
            src = adapter.contiguous(tensor, what)
        return _submit(op, name, (tensor, src), finish, ranks=list(dst), weights=list(dst.values()),
                       self_weight=sw, require_mutex=bool(require_mutex), **tensor_args(src, what))

    def win_put_nonblocking(tensor, name, self_weight=None, dst_weights=None, require_mutex=False):
        """Start writing `tensor`·w into each destination's buffer for this rank; returns a
        window handle for `win_wait`/`win_poll` (wait for every handle: until then the
        op keeps its tensors alive). Integer windows round scaled values to nearest.

        dst_weights: {rank: w} or [ranks] (w = 1.0) ⊆ out-neighbours; default every
        out-neighbour with 1.0. Each put bumps the destination's version for this rank and,
        with associated p on, sets its p slot to p·w. Afterwards the local `tensor` (and p)
        is multiplied in place by `self_weight` (default 1.0). require_mutex: hold the
        destination's mutex for this rank's buffer during the put.
        Raises ValueError for unknown names, non-neighbour ranks, or a tensor that does not
        match the window.
        """
        return _put(PUT, "win_put", tensor, name, self_weight, dst_weights, require_mutex)

    def win_accumulate_nonblocking(tensor, name, self_weight=None, dst_weights=None, require_mutex=False):
        """As `win_put_nonblocking`, but adds `tensor`·w to the destination's buffer
        (MPI_Accumulate SUM; half types read, add in float32, write back) and adds p·w to
        its p slot. Does not bump versions (BlueFog)."""
        return _put(ACCUMULATE, "win_accumulate", tensor, name, self_weight, dst_weights, require_mutex)

    def win_get_nonblocking(name, src_weights=None, require_mutex=False):
        """Start fetching each source's published value into this rank's buffer for it,
        scaled by its weight; bumps this rank's version for that source; p slots are left
        as they are (BlueFog: only put/accumulate move p). src_weights:
        {rank: w} or [ranks] ⊆ in-neighbours; default every in-neighbour with 1.0."""
        _check_name(name)
        _registered(name, "win_get")
        src = _weights(src_weights, _process.in_neighbor_ranks(), "win_get: src_weights", "in-neighbours")
        return _submit(GET, name, ranks=list(src), weights=list(src.values()),
                       require_mutex=bool(require_mutex))

    def win_put(tensor, name, self_weight=None, dst_weights=None, require_mutex=False):
        """Blocking `win_put_nonblocking`; returns True."""
        return win_wait(win_put_nonblocking(tensor, name, self_weight, dst_weights, require_mutex))

    def win_accumulate(tensor, name, self_weight=None, dst_weights=None, require_mutex=False):
        """Blocking `win_accumulate_nonblocking`; returns True."""
        return win_wait(win_accumulate_nonblocking(tensor, name, self_weight, dst_weights, require_mutex))

    def win_get(name, src_weights=None, require_mutex=False):
        """Blocking `win_get_nonblocking`; returns True."""
        return win_wait(win_get_nonblocking(name, src_weights, require_mutex))

    for blocking, nonblocking in ((win_put, win_put_nonblocking), (win_get, win_get_nonblocking),
                                  (win_accumulate, win_accumulate_nonblocking)):
        blocking.__doc__ += "\n\n" + nonblocking.__doc__

    def win_update(name, self_weight=None, neighbor_weights=None, reset=False, clone=False,
                   require_mutex=False):
        """Combine the receive buffers into the registered tensor and return it.

        With `self_weight` and `neighbor_weights` ({rank: w} ⊆ in-neighbours):
            x ← self_weight·x + Σ_j w_j·buf_j;
        with neither: the topology's weights if it is weighted, else uniform
            x ← (x + Σ_j buf_j) / (in_degree + 1)   (sum then divide).
        With associated p on, p follows the same weights. `reset` zeroes the combined
        buffers (and, with p on, their p slots); `clone` writes into a copy and leaves the registered tensor
        alone. Versions of the combined neighbours return to 0. require_mutex: hold this
        rank's mutexes for those buffers. Raises ValueError (one weight argument without
        the other, non-neighbour ranks, unknown name).
        """
        _check_name(name)
        t = _registered(name, "win_update")
        recv = _process.in_neighbor_ranks()
        if (self_weight is None) != (neighbor_weights is None):
            raise ValueError("win_update: give both self_weight and neighbor_weights, or neither")
        uniform = False
        if neighbor_weights is not None:
            nbr, sw = _weights(neighbor_weights, recv, "win_update: neighbor_weights", "in-neighbours"), float(self_weight)
        elif _process.static_plan()[1]:
            plan, _ = _process.static_plan()
            nbr, sw = dict(zip(plan["recv"], plan["recv_weights"])), plan["self_weight"]
        else:
            nbr, sw, uniform = {r: 1.0 for r in recv}, 1.0, True
        with STATE.lock:
            host = STATE.mirrors.get(name)
        if host is not None:
            adapter.copy_into(host, t)  # the device tensor may have changed since
        base = t if host is None else host
        out = adapter.clone(base) if clone else base
        _wait(_submit(UPDATE, name, (t, out), ranks=list(nbr), weights=list(nbr.values()),
                      self_weight=sw, uniform=uniform, reset=bool(reset), clone=bool(clone),
                      require_mutex=bool(require_mutex), **tensor_args(out, "win_update")))
        if host is None:
            return out
        if clone:
            return adapter.to_device_like(out, t)
        adapter.copy_into(t, host)
        return t

    def win_update_then_collect(name, require_mutex=True):
        """Push-sum "collect": x ← x + Σ_j buf_j over every in-neighbour, then zero the
        buffers (p likewise). Returns the registered tensor."""
        return win_update(name, 1.0, {r: 1.0 for r in _process.in_neighbor_ranks()}, reset=True,
                          require_mutex=require_mutex)

    api = {f.__name__: f for f in (
        win_create, win_free, win_put, win_put_nonblocking, win_accumulate,
        win_accumulate_nonblocking, win_get, win_get_nonblocking, win_update,
        win_update_then_collect)}
    for f in list(api.values()):
        f.__qualname__ = f.__name__
    for n in ("win_put", "win_put_nonblocking", "win_get", "win_get_nonblocking",
              "win_accumulate", "win_accumulate_nonblocking"):
        api["neighbor_" + n] = api[n]
    api.update(win_poll=win_poll, win_wait=win_wait, win_mutex=win_mutex, win_lock=win_lock,
               get_win_version=get_win_version,
               get_current_created_window_names=get_current_created_window_names,
               win_associated_p=win_associated_p,
               turn_on_win_ops_with_associated_p=turn_on_win_ops_with_associated_p,
               turn_off_win_ops_with_associated_p=turn_off_win_ops_with_associated_p)
    return api


def win_poll(handle):
    """True when the window op of `handle` has finished (then `win_wait` returns at once)."""
    return _core.win_poll(handle)


def win_wait(handle):
    """Wait for a window op; returns True or raises its error (ShoalError, ValueError).
    A handle that is unknown (or already waited for) gives a warning and False, as in
    BlueFog."""
    with STATE.lock:
        known = handle in STATE.win_pending
    if not known:
        warnings.warn(f"win_wait: unknown window handle {handle!r} (already waited for?)",
                      RuntimeWarning, stacklevel=2)
        return False
    _wait(handle)
    return True


@contextlib.contextmanager
def win_mutex(name, for_self=False, ranks=None):
    """Hold window mutexes for the block (a distributed spin lock per (owner, writer) pair).

    for_self=False: the mutex each rank in `ranks` (default: out-neighbours) keeps for this
    rank's buffer — what `win_put(require_mutex=True)` takes. for_self=True: this rank's
    own mutexes for the buffers of `ranks` (default: in-neighbours) — what
    `win_update(require_mutex=True)` takes. Mutexes are taken in one global order.
    """
    _check_name(name)
    _registered(name, "win_mutex")
    default = _process.in_neighbor_ranks() if for_self else _process.out_neighbor_ranks()
    rs = default if ranks is None else [int(r) for r in ranks]
    _wait(_submit(LOCK, name, ranks=rs, for_self=bool(for_self)))
    try:
        yield
    finally:
        _wait(_submit(UNLOCK, name, ranks=rs, for_self=bool(for_self)))


@contextlib.contextmanager
def win_lock(name):
    """BlueFog's `win_lock(name)` context manager (not exported by BlueFog; kept for scripts
    that import it). Raises UnknownWindowError for a name not created on this rank.

    BlueFog opened a passive MPI lock epoch (MPI_MODE_NOCHECK, so no exclusion) on its own
    windows, for the local load/store access its `win_update` needed. Shoal's window
    memory is touched only by its window thread, inside its own epochs, so there is
    nothing to open: the block runs as is. To keep writers out, use `win_mutex`."""
    _check_name(name)
    _registered(name, "win_lock")
    yield


def get_win_version(name):
    """{in-neighbour: puts and gets into its buffer since this rank's last win_update}."""
    _check_name(name)
    return _core.win_versions(name)


def get_current_created_window_names():
    """Sorted names of the windows that exist on this rank."""
    return sorted(_core.win_names())


def win_associated_p(name):
    """This rank's push-sum weight p for window `name` (1.0 at creation)."""
    _check_name(name)
    return _core.win_associated_p(name)


def turn_on_win_ops_with_associated_p():
    """From now on, put/accumulate/get/update also move and combine the weight p."""
    STATE.with_p = True


def turn_off_win_ops_with_associated_p():
    STATE.with_p = False


def free_all_at_exit():
    """Free every window (collective) before shutdown: a rank that finishes early keeps
    serving its neighbours' puts while it waits here for them to finish too (a rank
    inside MPI_Finalize would not, and they would hang)."""
    if windows_exist() and _core.is_initialized():
        try:
            _wait(_submit(FREE, ""))
        except Exception as e:  # noqa: BLE001 - shutting down: report, do not mask the exit
            import sys
            sys.stderr.write(f"[shoal] freeing windows at shutdown failed: {e}\n")
        forget_all()


def windows_exist():
    with STATE.lock:
        return bool(STATE.windows)


def forget_all():
    """Drop the registry (shutdown: the core's windows are gone with its runtime)."""
    with STATE.lock:
        STATE.windows.clear()
        STATE.mirrors.clear()
        STATE.win_pending.clear()
