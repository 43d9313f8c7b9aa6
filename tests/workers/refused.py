"""A call refused at the call on rank 1 only (bad arguments there, good ones elsewhere):
every rank prints what it raised, as `<case> <rank>: <type>: <message>`."""
import numpy as np

import shoal

shoal.init()
r = shoal.rank()


def attempt(case, fn):
    try:
        fn()
        print(f"{case} {r}: no error", flush=True)
    except (ValueError, TypeError, shoal.ShoalError) as exc:
        print(f"{case} {r}: {type(exc).__name__}: {exc}", flush=True)


# Refused by the core (unnamed: the name is used up on every rank alike).
attempt("allreduce-int-average",
        lambda: shoal.allreduce(np.ones(3, np.int32) if r == 1 else np.ones(3), average=True))
# A neighbor op already negotiated: in steady state no coordinator is involved.
shoal.neighbor_allreduce(np.ones(3), name="n")
attempt("neighbor-int", lambda: shoal.neighbor_allreduce(np.ones(3, np.int64) if r == 1 else np.ones(3), name="n"))
# Refused by the Python layer, before the core sees the call.
attempt("python-check", lambda: shoal.broadcast(np.ones(3), "0" if r == 1 else 0, name="b"))
print(f"rank {r} after", shoal.allreduce(np.ones(2), average=False)[0], flush=True)
