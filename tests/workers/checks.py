"""Tiny check runner for worker scripts: each rank runs every check and prints one line per
check, `[rank R] PASS|SKIP|FAIL <name>` (a failure with its traceback, a skip with its
reason), then `[rank R] P checks passed, F failed[, S skipped]`; the worker exits non-zero
if any failed. tests/conftest.py (`Job`) makes each check its own pytest item from these
lines. A check that cannot run here raises Skip(reason): it never passes by returning."""
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


def run_all(rank, only=None, report=True):
    """Run the checks (only those named in `only`, if given: the others are neither run nor
    counted; a name in `only` that is no check fails); `report=False` leaves out the PASS
    lines. Returns the number of failed checks."""
    names = [fn.__name__ for fn in _checks]
    unknown = [name for name in only or () if name not in names]
    passed, failed, skipped = 0, len(unknown), 0
    for name in unknown:
        print(f"[rank {rank}] FAIL {name}:\nno check is named {name!r}", flush=True)
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
            passed += 1
            if report:
                print(f"[rank {rank}] PASS {fn.__name__} ({time.monotonic() - start:.2f} s)", flush=True)
    tail = f", {skipped} skipped" if skipped else ""
    print(f"[rank {rank}] {passed} checks passed, {failed} failed{tail}", flush=True)
    sys.stdout.flush()
    return failed
