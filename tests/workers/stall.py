"""Stall scenarios. argv[1] = "late": rank 1 submits a named allreduce 5 s late (the
others must see a warning naming the tensor and rank 1). "missing": rank 1 never submits,
first on a fresh name and then after the schedule is cached; every other rank must get
ShoalError naming rank 1 within 10 s."""
import sys
import time

import numpy as np

import shoal

shoal.init()
R, N = shoal.rank(), shoal.size()
mode = sys.argv[1]


def expect_stall(fn, what):
    t0 = time.monotonic()
    try:
        fn()
    except shoal.ShoalError as e:
        took = time.monotonic() - t0
        assert "missing ranks 1" in str(e) or "for ranks 1" in str(e), str(e)
        assert took < 10, took
        print(f"[rank {R}] {what}: ShoalError after {took:.1f} s: {e}", flush=True)
        return
    raise AssertionError(f"{what}: no ShoalError")


if mode == "late":
    if R == 1:
        time.sleep(5)
    shoal.allreduce(np.ones(2), name="late_tensor")
    print(f"[rank {R}] late ok", flush=True)
else:
    def barrier_at(start, after=8.0):
        # Meet only once every rank is done waiting out the stall (else the barrier stalls too).
        time.sleep(max(0.0, start + after - time.monotonic()))
        shoal.barrier()

    # 1. first sight: rank 1 never submits "fresh"
    t0 = time.monotonic()
    if R != 1:
        expect_stall(lambda: shoal.allreduce(np.ones(2), name="fresh"), "fresh")
    barrier_at(t0)
    # 2. cached: three good rounds, then rank 1 skips one
    for _ in range(3):
        shoal.allreduce(np.ones(2), name="cached")
        shoal.neighbor_allreduce(np.ones(2), name="cached_nbr")
    t0 = time.monotonic()
    if R != 1:
        expect_stall(lambda: shoal.allreduce(np.ones(2), name="cached"), "cached allreduce")
        nbr = lambda: shoal.neighbor_allreduce(np.ones(2), name="cached_nbr")  # noqa: E731
        if 1 in shoal.in_neighbor_ranks():  # only ranks that receive from rank 1 wait for it
            expect_stall(nbr, "cached neighbor")
        else:
            nbr()
    barrier_at(t0)
    print(f"[rank {R}] missing ok", flush=True)
