"""Horovod's join (core/src/ops/join.cc) under shoalrun: ranks run different numbers of
steps; a joined rank contributes zeros to the others' allreduces (Average divides by
size(), Horovod's divisor) and reducescatters, the identity to their Min/Max/Product
allreduces; join returns the rank that joined last on every rank; the ops Horovod refuses
with joined ranks (broadcast, allgather, alltoall) fail the same way everywhere; after join
the job runs as before. numpy (shoal), torch (shoal.torch with Horovod's names) and
TensorFlow eagerly."""
import functools
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np  # noqa: E402
import torch  # noqa: E402  (imported before init: the ranks' import times do not count as stalls)

import shoal  # noqa: E402
import shoal.torch as hvd  # noqa: E402
from checks import Skip, check, raises, run_all  # noqa: E402

try:
    import tensorflow as tf

    import shoal.tensorflow as st
except ImportError as e:
    tf = st = None
    TF_MISSING = str(e)

shoal.init()
R, N = shoal.rank(), shoal.size()
DTYPES = [("float64", True), ("float32", True), ("float16", True), ("int32", False), ("int64", False)]


def value(r, step, dt, n=5):
    return (np.arange(n) % 3 + r * 4 + step).astype(dt)


def expect(got, want):
    assert got.dtype == want.dtype and np.array_equal(got, want), (got, want)


def steps_of(r):
    return 4 + 2 * ((r + 1) % N)  # all ranks run 4 steps (cached by then); rank N-2 the most


def last_rank():
    return max(range(N), key=steps_of)


def joined_last_among(half, name):
    """join() where ranks >= half joined first (their joins are what made the ops of ranks <
    half fail): the last rank to join, as join() returns it, is one of ranks < half, and every
    rank gets the same one. (Which of them is last is up to the scheduler: not asserted.)"""
    last = shoal.join()
    every = shoal.allgather(np.array([last]), name=f"{name}.last")
    assert last < half and (every == last).all(), (last, every)


def running_sum(step, dt):
    return sum(value(q, step, "float64") for q in range(N) if step < steps_of(q))


@check
def uneven_steps_allreduce_zeros_from_joined_ranks():
    for step in range(steps_of(R)):
        for dt, floating in DTYPES:
            got = shoal.allreduce(value(R, step, dt), average=False, name=f"ue.sum.{dt}")
            expect(got, running_sum(step, dt).astype(dt))
            if floating:  # Average: the running ranks' sum / size(), as Horovod divides
                got = shoal.allreduce(value(R, step, dt), average=True, name=f"ue.avg.{dt}")
                expect(got, (running_sum(step, dt) / N).astype(dt))
    assert shoal.join() == last_rank()


@check
def after_join_a_full_epoch_then_a_second_join():
    for step in range(3):
        got = shoal.allreduce(value(R, step, "float64"), average=False, name="ue.sum.float64")
        expect(got, sum(value(q, step, "float64") for q in range(N)))
    if R == 0:  # the others join at once: rank 0 alone, with a signature nobody else uses
        for step in range(3):
            x = value(R, step, "float64", n=7)
            expect(shoal.allreduce(x, average=False, name="alone"), x)
            expect(shoal.allreduce(x, average=True, name="alone.avg"), x / N)
        shoal.barrier()  # the joined ranks take part
    assert shoal.join() == 0


@check
def unnamed_ops_pair_up_after_a_join():
    # The joined ranks run the others' unnamed allreduces on zeros: their generated names
    # must advance too, or the first unnamed op after the join waits for a name nobody sends.
    for step in range(steps_of(R)):
        got = shoal.allreduce(value(R, step, "float64"), average=False)
        expect(got, running_sum(step, "float64"))
        got = hvd.allreduce(torch.from_numpy(value(R, step, "float64")), op=hvd.Sum)
        expect(got.numpy(), running_sum(step, "float64"))
    assert shoal.join() == last_rank()
    for step in range(2):
        got = shoal.allreduce(value(R, step, "float64"), average=False)
        expect(got, sum(value(q, step, "float64") for q in range(N)))


@check
def broadcast_and_allgather_fail_while_ranks_are_joined():
    if N == 1:
        raise Skip("needs 2 ranks")
    half, name = N // 2, "broadcast_and_allgather_fail_while_ranks_are_joined"
    if R >= half:
        return joined_last_among(half, name)
    joined = "rank 1 has joined" if half == 1 else f"ranks {', '.join(map(str, range(half, N)))} have joined"
    for fn in (lambda: shoal.broadcast(np.ones(3), 0, name="jb"), lambda: shoal.allgather(np.ones((1, 2)), name="jg")):
        try:
            fn()
        except shoal.ShoalError as e:
            assert joined in str(e) and "join()" in str(e), str(e)
        else:
            raise AssertionError("no error")
    joined_last_among(half, name)


@check
def neighbor_ops_with_a_joined_peer_fail_naming_it():
    if N == 1:
        raise Skip("needs 2 ranks")
    half, name = N // 2, "neighbor_ops_with_a_joined_peer_fail_naming_it"
    if R >= half:
        return joined_last_among(half, name)
    peer = R + half
    try:
        shoal.neighbor_allreduce(np.ones(3), self_weight=0.5, src_weights={peer: 0.5}, dst_weights={peer: 1.0},
                                 name="jn")
    except shoal.ShoalError as e:
        assert "joined (join())" in str(e) and str(peer) in str(e), str(e)
    else:
        raise AssertionError("no error")
    joined_last_among(half, name)


@check
def a_hierarchical_op_with_a_joined_peer_machine_fails_naming_it():
    """A hierarchical_neighbor_allreduce large enough to travel in pieces (the sharded
    exchange's parts, docs/design.md §24) whose peer machine's ranks joined fails naming
    them, not at the stall timeout, and the job goes on."""
    if shoal.machine_size() != 2 or shoal.local_size() != 2:
        raise Skip("needs 2 machines of 2 ranks (SHOAL_RANKS_PER_MACHINE=2 at 4 ranks)")
    half, name = N // 2, "a_hierarchical_op_with_a_joined_peer_machine_fails_naming_it"
    if R >= half:
        return joined_last_among(half, name)
    try:
        shoal.hierarchical_neighbor_allreduce(np.full(1 << 20, float(R)), self_weight=0.5,  # 8 MiB
                                              src_machine_weights={1: 0.5}, dst_machine_weights=[1], name="jh")
    except shoal.ShoalError as e:
        # local rank l's shard travels to local rank l of the peer machine: rank R + half
        # (a stall would be another error: SHOAL_STALL_SHUTDOWN_TIME=4 here)
        assert "joined (join())" in str(e) and f"rank {R + half} " in str(e), str(e)
    else:
        raise AssertionError("no error")
    joined_last_among(half, name)


@check
def a_joined_rank_is_not_stalled():
    # Rank 0 runs on past SHOAL_STALL_SHUTDOWN_TIME (4 s, set by tests/test_join.py) while
    # the others wait in join(): nobody is stalled, and its allreduce then runs.
    assert os.environ.get("SHOAL_STALL_SHUTDOWN_TIME") == "4", os.environ.get("SHOAL_STALL_SHUTDOWN_TIME")
    if R == 0:
        time.sleep(5)
        expect(shoal.allreduce(np.ones(3), average=False, name="late"), np.ones(3))
    assert shoal.join() == 0


FOLDS = {"Min": np.minimum, "Max": np.maximum, "Product": np.multiply}


def signed(r, step, dt, n=5):
    """Values in [-1, 2]: products over 4 ranks stay exact (float16 included)."""
    return ((np.arange(n) + r + step) % 4 - 1).astype(dt)


def running_fold(op, step, dt):
    return functools.reduce(FOLDS[op], [signed(q, step, dt) for q in range(N) if step < steps_of(q)])


@check
def min_max_product_and_reducescatter_with_joined_ranks():
    # A joined rank adds the identity (+inf / max, -inf / lowest, 1) to Min/Max/Product
    # allreduces and zeros to reducescatters: each result is over the ranks still running.
    d0 = 2 * N + 1
    start, rows = R * (d0 // N) + min(R, d0 % N), d0 // N + (1 if R < d0 % N else 0)
    for step in range(steps_of(R)):
        for dt, floating in DTYPES:
            for op in FOLDS:
                got = shoal.allreduce(signed(R, step, dt), op=getattr(shoal, op), name=f"id.{op}.{dt}")
                expect(got, running_fold(op, step, dt))
            x = (np.arange(d0 * 2).reshape(d0, 2) % 7 + R + step).astype(dt)
            total = sum((np.arange(d0 * 2).reshape(d0, 2) % 7 + q + step).astype("float64")
                        for q in range(N) if step < steps_of(q))
            expect(shoal.reducescatter(x, op=shoal.Sum, name=f"id.rs.{dt}"), total[start:start + rows].astype(dt))
            if floating:  # Average: / size() (Horovod's divisor), half types in float32, rounded once
                got = shoal.reducescatter(x, name=f"id.rs.avg.{dt}")
                expect(got, (total[start:start + rows] / N).astype(dt))
        got = shoal.grouped_allreduce([signed(R, step, "float64"), signed(R, step, "int32")], op=shoal.Min,
                                      name="id.group")
        expect(got[0], running_fold("Min", step, "float64"))
        expect(got[1], running_fold("Min", step, "int32"))
        got = hvd.allreduce(torch.from_numpy(signed(R, step, "float32")), op=hvd.Product, name="id.t.prod")
        expect(got.numpy(), running_fold("Product", step, "float32"))
        if st is not None:
            got = st.allreduce(tf.constant(signed(R, step, "int64")), op=st.Max, name="id.tf.max")
            expect(got.numpy(), running_fold("Max", step, "int64"))
    assert shoal.join() == last_rank()


@check
def alltoall_and_grouped_allgather_fail_while_ranks_are_joined():
    if N == 1:
        raise Skip("needs 2 ranks")
    half, name = N // 2, "alltoall_and_grouped_allgather_fail_while_ranks_are_joined"
    if R >= half:
        return joined_last_among(half, name)
    joined = "rank 1 has joined" if half == 1 else f"ranks {', '.join(map(str, range(half, N)))} have joined"
    for fn in (lambda: shoal.alltoall(np.ones((N, 2)), name="ja"),
               lambda: hvd.alltoall(torch.ones(N, 2), name="ja.t"),
               lambda: shoal.grouped_allgather([np.ones((1, 2)), np.ones(3)], name="jga")):
        try:
            fn()
        except shoal.ShoalError as e:
            assert joined in str(e) and "join()" in str(e), str(e)
            if "alltoall" in str(e):
                assert "Alltoall is not supported with Join" in str(e), str(e)
        else:
            raise AssertionError("no error")
    joined_last_among(half, name)


@check
def torch_horovod_names_uneven_steps():
    raises(TypeError, hvd.join, "cpu")
    for step in range(steps_of(R)):
        x = torch.from_numpy(value(R, step, "float32"))
        got = hvd.allreduce(x, name="t.avg", op=hvd.Average)
        assert torch.equal(got, torch.from_numpy((running_sum(step, "float32") / N).astype("float32"))), got
        got = hvd.allreduce(x.to(torch.int64), name="t.sum", op=hvd.Sum)
        assert torch.equal(got, torch.from_numpy(running_sum(step, "int64").astype("int64"))), got
    assert hvd.join(device=-1) == last_rank()


@check
def tensorflow_eager_uneven_steps():
    if st is None:
        raise Skip(f"TensorFlow not importable: {TF_MISSING}")
    for step in range(steps_of(R)):
        got = st.allreduce(tf.constant(value(R, step, "float64")), average=True, name="tf.avg")
        np.testing.assert_array_equal(got.numpy(), running_sum(step, "float64") / N)
    raises(RuntimeError, tf.function(st.join))
    assert st.join() == last_rank()


raise SystemExit(run_all(R))
