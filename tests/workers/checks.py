"""Tiny check runner for worker scripts: each rank runs every check, prints one line
per failure, and exits non-zero if any failed (the pytest side asserts exit 0)."""
import sys
import traceback

_checks = []


def check(fn):
    _checks.append(fn)
    return fn


def raises(exc, fn, *args, **kwargs):
    """Call fn(*args, **kwargs) and fail unless it raises `exc`."""
    try:
        fn(*args, **kwargs)
    except exc:
        return
    raise AssertionError(f"{getattr(fn, '__name__', fn)}{args} {kwargs} did not raise {exc.__name__}")


def run_all(rank, only=None):
    failed = 0
    for fn in _checks:
        if only and fn.__name__ not in only:
            continue
        try:
            fn()
        except Exception:  # noqa: BLE001 - report every failure, keep going
            failed += 1
            print(f"[rank {rank}] FAIL {fn.__name__}:\n{traceback.format_exc()}", flush=True)
    print(f"[rank {rank}] {len(_checks) - failed} checks passed, {failed} failed", flush=True)
    sys.stdout.flush()
    return failed
