"""Tiny check runner for worker scripts: each rank runs every check, prints one line
per failure, and exits non-zero if any failed (the pytest side asserts exit 0)."""
import sys
import time
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


class Skip(Exception):
    """Raised by a check that cannot run here; its message says why."""


def run_all(rank, only=None, report=False):
    """Run the checks (those named in `only`, if given); `report` prints a PASS line per
    passed check too, for pytest ids per check."""
    failed = skipped = 0
    for fn in _checks:
        if only and fn.__name__ not in only:
            continue
        start = time.monotonic()
        try:
            fn()
        except Skip as why:
            skipped += 1
            print(f"[rank {rank}] SKIP {fn.__name__}: {why}", flush=True)
        except Exception:  # noqa: BLE001 - report every failure, keep going
            failed += 1
            print(f"[rank {rank}] FAIL {fn.__name__}:\n{traceback.format_exc()}", flush=True)
        else:
            if report:
                print(f"[rank {rank}] PASS {fn.__name__} ({time.monotonic() - start:.2f} s)", flush=True)
    tail = f", {skipped} skipped" if skipped else ""
    print(f"[rank {rank}] {len(_checks) - failed - skipped} checks passed, {failed} failed{tail}", flush=True)
    sys.stdout.flush()
    return failed
