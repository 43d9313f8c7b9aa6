"""Allreduces that repeat run cached, without the coordinator (core/src/negotiation/response_cache.cc):
exact results, no coordinator round in steady state, and every way the cache must give way
(a name reused with another shape, a mismatch, ranks submitting in different orders, a
wait on part of a fused batch, a call refused on one rank) ending as it does uncached."""
import os
import time

import numpy as np

import shoal
from checks import Skip, check, run_all

shoal.init()
R, N = shoal.rank(), shoal.size()


def rounds():
    return shoal.stats()["coordinator_rounds"]


def expect(got, want):
    assert got.dtype == want.dtype and np.array_equal(got, want), (got, want)


@check
def repeated_allreduces_skip_the_coordinator():
    cases = [("float32", False), ("float64", True), ("int32", False), ("int64", False), ("float16", True)]
    for step in range(24):
        if step == 4:
            before, hits = rounds(), shoal.stats()["cache_hits"]
        for dt, average in cases:
            x = (np.arange(6) + R + step).astype(dt)
            got = shoal.allreduce(x, average=average, name=f"rep.{dt}")
            total = (np.arange(6) * N + N * (N - 1) // 2 + N * step).astype("float64")
            expect(got, (total / N if average else total).astype(dt))
    assert rounds() == before, f"{rounds() - before} coordinator rounds in steady state"
    assert shoal.stats()["cache_hits"] - hits == 20 * len(cases), shoal.stats()["cache_hits"] - hits


@check
def a_name_reused_with_another_shape():
    for shape in [4, 4, 4, 6, 6, 4]:
        x = np.full(shape, float(R))
        expect(shoal.allreduce(x, average=False, name="reuse"), np.full(shape, float(N * (N - 1) // 2)))


@check
def a_mismatch_after_caching_is_the_same_error_everywhere():
    if N == 1:
        raise Skip("needs 2 ranks")
    for _ in range(3):
        shoal.allreduce(np.ones(4), name="mm")
    try:
        shoal.allreduce(np.ones(5 if R == N - 1 else 4), name="mm")
    except shoal.ShoalError as e:
        assert "mismatched shapes" in str(e) and f"[5] on rank {N - 1}" in str(e), str(e)
    else:
        raise AssertionError("no error")
    expect(shoal.allreduce(np.ones(4), average=False, name="mm"), np.full(4, float(N)))


@check
def ranks_submit_in_different_orders():
    names = [f"ord.{k}" for k in range(6)]
    order = list(np.random.default_rng(R).permutation(6))
    for step in range(10):
        if step == 6:
            before = rounds()
        handles = {k: shoal.allreduce_nonblocking(np.full(3 + k, float(R * 10 + k + step)), average=False,
                                                  name=names[k]) for k in order}
        for k in reversed(order):
            want = np.full(3 + k, float(10 * N * (N - 1) // 2 + N * (k + step)))
            expect(shoal.synchronize(handles[k]), want)
    assert rounds() == before, f"{rounds() - before} coordinator rounds in steady state"


@check
def waiting_on_part_of_a_fused_batch():
    # Cached together, then waited for one at a time before the other is submitted: the
    # cache gives way (after ~50 ms) instead of waiting for the rest. Whether the
    # coordinator fuses the pair depends on whether the last rank's two submissions reach
    # it in one cycle (rank 0 submits late to make that likely, not certain), so fresh
    # names are tried until the second sight (the one that is cached) ran fused.
    fusion = os.environ.get("SHOAL_FUSION_THRESHOLD") != "0" and N > 1
    for attempt in range(20):
        a, b = f"part.a.{attempt}", f"part.b.{attempt}"
        for sight in range(2):
            fused = shoal.stats()["fused_batches"]
            if R == 0:
                time.sleep(0.1)
            ha = shoal.allreduce_nonblocking(np.full(2, 1.0), average=False, name=a)
            hb = shoal.allreduce_nonblocking(np.full(2, 2.0), average=False, name=b)
            expect(shoal.synchronize(ha), np.full(2, float(N)))
            expect(shoal.synchronize(hb), np.full(2, 2.0 * N))
        # Every rank applies the same responses, so every rank sees the same count.
        if not fusion or shoal.stats()["fused_batches"] - fused == 1:
            break
    else:
        raise AssertionError("the coordinator never fused two allreduces submitted together in 20 tries")
    before = rounds()
    for step in range(3):  # cached as one batch: each step waits on a before b is submitted
        expect(shoal.allreduce(np.full(2, 1.0 + step), average=False, name=a), np.full(2, (1.0 + step) * N))
        expect(shoal.allreduce(np.full(2, 2.0), average=False, name=b), np.full(2, 2.0 * N))
    if fusion:
        assert rounds() > before, "the fused batch waited for its other half"


@check
def a_call_refused_on_one_rank_is_refused_everywhere():
    if N == 1:
        raise Skip("needs 2 ranks")
    for _ in range(3):
        shoal.allreduce(np.ones(3), name="ref")
    try:
        shoal.allreduce(np.ones(3, np.int32) if R == 1 else np.ones(3), name="ref")
    except ValueError as e:
        assert "op=Sum" in str(e) and ("raised at the call on rank 1" in str(e) or R == 1), str(e)
    else:
        raise AssertionError("no error")
    expect(shoal.allreduce(np.ones(3), average=False, name="ref"), np.full(3, float(N)))


@check
def torch_tensors_take_the_same_cache():
    try:
        import torch
    except ImportError:
        raise Skip("torch is not installed")
    import shoal.torch as bf
    for step in range(8):
        if step == 4:
            before = rounds()
        t = torch.full((5,), float(R + step))
        got = bf.allreduce(t, name="torch.c")
        assert torch.equal(got, torch.full((5,), (N * (N - 1) / 2 + N * step) / N)), got
    assert rounds() == before, f"{rounds() - before} coordinator rounds in steady state"


@check
def fresh_names_are_retired_alike_on_every_rank():
    """Past SHOAL_NAME_LIMIT names (a step number in each name; 512 in this job), idle names
    are retired on every rank at one agreed point (core/src/negotiation/names.cc): exact results
    throughout, names reused after their retirement pair up again, every rank retired as many."""
    x = np.arange(3.0) + R
    before = shoal.stats()["names_retired"]
    ring = {(R - 1) % N: 0.5}
    for i in range(2400):
        if i % 2:
            got = shoal.neighbor_allreduce(x, self_weight=0.5, src_weights=ring, dst_weights=[(R + 1) % N],
                                           name=f"fresh.nar.{i % 1000 if i >= 2000 else i}")
            expect(got, 0.5 * x + 0.5 * (np.arange(3.0) + (R - 1) % N))
        else:
            got = shoal.allreduce(x, average=False, name=f"fresh.ar.{i % 1000 if i >= 2000 else i}")
            expect(got, N * np.arange(3.0) + N * (N - 1) / 2)
    # A vote runs without user calls, so a rank may commit one after its last op returned:
    # compare until every rank has committed the same votes (the same answer on every rank).
    for _ in range(500):
        retired = shoal.stats()["names_retired"] - before
        everyone = shoal.allgather(np.array([retired]), name="fresh.count")
        if (everyone == everyone[0]).all():
            break
        time.sleep(0.01)
    assert retired > 0, "no name was retired"
    assert (everyone == retired).all(), f"names retired per rank: {everyone}"


raise SystemExit(run_all(R))
