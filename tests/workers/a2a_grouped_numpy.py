"""Horovod's alltoall and grouped ops in the numpy API with exact expected values: alltoall
with even and uneven splits (every dtype, the received splits, empty rows, nonblocking),
bad splits refused on every rank, mismatched trailing dims or dtypes; grouped allreduce
(every reduce op, mixed dtypes, in place, machine scope, fused, one negotiation), grouped
allgather and reducescatter, and groups that fail as a whole (a member that mismatches,
numbers of tensors that differ, a member refused at the call on one rank).
Run at 2 and 4 ranks (4: two simulated machines) by tests/test_alltoall_grouped.py."""
import functools
import hashlib
import sys

import numpy as np

import a2a_expect
import shoal
from a2a_expect import rows, split
from checks import Skip, check, raises, run_all

shoal.init()
R, N = shoal.rank(), shoal.size()
DTYPES = ["int8", "uint8", "int16", "int32", "int64", "float16", "float32", "float64"]
FOLDS = {"Min": np.minimum, "Max": np.maximum, "Product": np.multiply}


def received(r, splits_of, d0_of, width=3):
    return a2a_expect.received(r, N, splits_of, d0_of, width)


def same_everywhere(msg, strip=""):
    """Every rank got the very same text (after removing `strip`)."""
    msg = msg.replace(strip, "") if strip else msg
    digest = np.frombuffer(hashlib.sha256(msg.encode()).digest(), np.uint8)
    every = shoal.allgather(digest[None, :], name=f"same.{hashlib.sha1(msg.encode()).hexdigest()[:12]}")
    assert all(np.array_equal(row, every[0]) for row in every), f"ranks saw different errors; here: {msg}"


def error_of(exc_type, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc_type as e:
        return str(e)
    raise AssertionError(f"{fn.__name__} did not raise {exc_type.__name__}")


@check
def alltoall_even_every_dtype():
    for dt in DTYPES + ["bool"]:
        x = rows(R, 2 * N).astype(dt) if dt != "bool" else rows(R, 2 * N) % 2 == 1
        got = shoal.alltoall(x, name=f"a2a.even.{dt}")
        want = received(R, lambda q, k: 2, lambda q: 2 * N)
        want = want.astype(dt) if dt != "bool" else want % 2 == 1
        assert isinstance(got, np.ndarray) and got.dtype == np.dtype(dt) and got.shape == (2 * N, 3), \
            (dt, type(got), getattr(got, "shape", None))
        assert np.array_equal(got, want), (dt, got, want)


@check
def alltoall_uneven_splits_and_received_splits():
    d0 = sum(split(R, q) for q in range(N))
    for kind in ("list", "tuple", "array"):
        s = [split(R, q) for q in range(N)]
        s = tuple(s) if kind == "tuple" else np.array(s, "int64") if kind == "array" else s
        for dt in ("float64", "int32", "float16"):
            got, rsplits = shoal.alltoall(rows(R, d0).astype(dt), splits=s, name=f"a2a.uneven.{kind}.{dt}")
            want = received(R, split, lambda q: sum(split(q, k) for k in range(N))).astype(dt)
            assert got.dtype == np.dtype(dt) and np.array_equal(got, want), (kind, dt, got, want)
            assert rsplits.dtype == np.int32 and rsplits.tolist() == [split(q, R) for q in range(N)], rsplits


@check
def alltoall_empty_rows_and_everything_to_one_rank():
    # Rank r sends r + 1 rows to rank 0, none elsewhere; then nobody sends anything.
    s = [R + 1 if q == 0 else 0 for q in range(N)]
    got, rsplits = shoal.alltoall(rows(R, R + 1, 2).astype("float32"), splits=s, name="a2a.to0")
    want = np.concatenate([rows(q, q + 1, 2) for q in range(N)]) if R == 0 else np.zeros((0, 2))
    assert got.shape == want.shape and np.array_equal(got, want.astype("float32")), (got, want)
    assert rsplits.tolist() == ([q + 1 for q in range(N)] if R == 0 else [0] * N), rsplits
    got, rsplits = shoal.alltoall(np.zeros((0, 4, 2), "int16"), splits=[0] * N, name="a2a.none")
    assert got.shape == (0, 4, 2) and got.dtype == np.int16 and rsplits.tolist() == [0] * N, (got.shape, rsplits)


@check
def alltoall_nonblocking_gives_output_and_received_splits():
    h = shoal.alltoall_nonblocking(np.full((N, 2), float(R)), name="a2a.nb")
    out, rsplits = shoal.synchronize(h)
    assert np.array_equal(out, np.repeat(np.arange(N, dtype=float), 2).reshape(N, 2)), out
    assert rsplits.tolist() == [1] * N, rsplits
    x = rows(R, 2 * N)
    x_before = x.copy()
    shoal.alltoall(x, name="a2a.untouched")
    assert np.array_equal(x, x_before), "the input was modified"


@check
def alltoall_bad_splits_raise_the_same_error_everywhere():
    if N == 1:
        raise Skip("needs 2 or more ranks")
    # Rank 1's splits sum to one more row than its dim 0: refused there, the same on its peers.
    s = [1] * N
    if R == 1:
        s[0] = 2
    msg = error_of(ValueError, shoal.alltoall, np.ones((N, 2)), splits=s, name="a2a.badsum")
    assert msg.startswith(f"alltoall: splits sum to {N + 1} rows, but dim 0 is {N}"), msg
    assert R == 1 or msg.endswith("(raised at the call on rank 1)"), msg
    same_everywhere(msg, " (raised at the call on rank 1)")
    for bad, want, exc in ((list(range(N + 1)), "splits for", ValueError), ([-1] + [1] * (N - 1), "outside", ValueError),
                           ([0.5] * N, "splits must be ints", TypeError), ([True] * N, "got bool", TypeError),
                           ("ab", "1-d sequence of ints", TypeError), (5, "1-d sequence of ints", TypeError)):
        msg = error_of(exc, shoal.alltoall, np.ones((N, 2)), splits=bad, name="a2a.bad")
        assert want in msg, (bad, msg)
    msg = error_of(ValueError, shoal.alltoall, np.ones((N + 1, 2)), name="a2a.odd")
    assert f"dim 0 ({N + 1}) is not divisible by the number of ranks ({N})" in msg, msg
    raises(ValueError, shoal.alltoall, np.array(1.0), name="a2a.0d")
    got = shoal.alltoall(np.full((N, 1), R), name="a2a.badsum")  # the name works again
    assert np.array_equal(got, np.arange(N)[:, None]), got


@check
def alltoall_mismatched_trailing_dims_and_dtypes_fail_on_every_rank():
    if N == 1:
        raise Skip("needs 2 or more ranks")
    msg = error_of(shoal.ShoalError, shoal.alltoall, np.ones((N, 2 + R % 2)), name="a2a.trailing")
    assert "alltoall 'a2a.trailing': mismatched trailing dimensions across ranks: [2] on rank" in msg, msg
    assert "[3] on rank" in msg, msg
    same_everywhere(msg)
    msg = error_of(shoal.ShoalError, shoal.alltoall, np.ones((N, 2), "float32" if R else "float64"),
                   name="a2a.dtype")
    assert "alltoall 'a2a.dtype': mismatched dtypes across ranks: float64 on rank 0; float32 on rank" in msg, msg
    same_everywhere(msg)


def member(r, k, dt, shape):
    return ((r * 5 + k * 7 + np.arange(int(np.prod(shape)))) % 9 - 3).reshape(shape).astype(dt)


SHAPES = [("float64", (3,)), ("float64", (2, 2)), ("int32", (5,)), ("float16", (4,)), ("float32", (0, 2)),
          ("int8", (3,))]


@check
def grouped_allreduce_every_op_mixed_dtypes():
    for op in ("Sum", "Min", "Max", "Product"):
        xs = [member(R, k, dt, shape) for k, (dt, shape) in enumerate(SHAPES)]
        got = shoal.grouped_allreduce(xs, op=getattr(shoal, op), name=f"g.ar.{op}")
        assert isinstance(got, list) and len(got) == len(xs)
        for k, (dt, shape) in enumerate(SHAPES):
            every = [member(q, k, dt, shape) for q in range(N)]
            with np.errstate(over="ignore"):
                want = sum(every[1:], every[0]) if op == "Sum" else functools.reduce(FOLDS[op], every)
            if dt == "float16":  # computed in float32, rounded once
                acc = [e.astype("float32") for e in every]
                want = (sum(acc[1:], acc[0]) if op == "Sum" else functools.reduce(FOLDS[op], acc)).astype(dt)
            assert got[k].dtype == np.dtype(dt) and got[k].shape == shape, (op, k, got[k].dtype, got[k].shape)
            assert np.array_equal(got[k], want), (op, k, got[k], want)
    floats = [(k, dt, shape) for k, (dt, shape) in enumerate(SHAPES) if dt.startswith("float")]
    got = shoal.grouped_allreduce([member(R, k, dt, shape) for k, dt, shape in floats], name="g.ar.avg")  # Average
    for g, (k, dt, shape) in zip(got, floats):
        acc = "float32" if dt == "float16" else dt  # the sum, then divided by size(), rounded once
        every = [member(q, k, dt, shape).astype(acc) for q in range(N)]
        want = (sum(every[1:], every[0]) / np.asarray(N, acc)).astype(dt)
        assert g.dtype == np.dtype(dt) and np.array_equal(g, want), (k, g, want)


@check
def grouped_allreduce_nonblocking_inplace_and_machine_scope():
    xs = [np.full(3, float(R + k)) for k in range(4)]
    h = shoal.grouped_allreduce_nonblocking(xs, op=shoal.Sum, name="g.nb")
    got = shoal.synchronize(h)
    assert all(np.array_equal(g, np.full(3, float(N * (N - 1) // 2 + N * k))) for k, g in enumerate(got)), got
    ys = [np.full(2, R + k, "int64") for k in range(3)]
    out = shoal.grouped_allreduce_(ys, op=shoal.Max, name="g.inplace")
    assert all(o is y for o, y in zip(out, ys)) and all(np.array_equal(y, np.full(2, N - 1 + k)) for k, y in enumerate(ys)), ys
    ranks = [R - shoal.local_rank() + q for q in range(shoal.local_size())]
    got = shoal.grouped_allreduce([np.full(2, float(R)), np.full(1, R, "int32")], op=shoal.Sum,
                                  is_hierarchical_local=True, name="g.local")
    assert np.array_equal(got[0], np.full(2, float(sum(ranks)))) and got[1][0] == sum(ranks), got


@check
def grouped_allreduce_is_one_negotiation_and_fused():
    before = shoal.stats()
    xs = [np.full(4, float(R + k)) for k in range(6)]
    got = shoal.grouped_allreduce(xs, op=shoal.Sum, name="g.fused")
    after = shoal.stats()
    assert all(np.array_equal(g, np.full(4, float(N * (N - 1) // 2 + N * k))) for k, g in enumerate(got))
    assert after["fused_batches"] - before["fused_batches"] == 1, (before, after)  # six float64 members, one batch
    if R == 0:  # the coordinator's count
        assert after["negotiations"] - before["negotiations"] == 1, (before["negotiations"], after["negotiations"])


@check
def grouped_allgather_and_reducescatter():
    xs = [member(R, 0, "float32", (R + 1, 2)), member(R, 1, "int64", (2 - R % 2,)), np.array([R % 2 == 0] * (R + 1))]
    got = shoal.grouped_allgather(xs, name="g.ag")
    want = [np.concatenate([member(q, 0, "float32", (q + 1, 2)) for q in range(N)]),
            np.concatenate([member(q, 1, "int64", (2 - q % 2,)) for q in range(N)]),
            np.concatenate([np.array([q % 2 == 0] * (q + 1)) for q in range(N)])]
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and np.array_equal(g, w), (g, w)
    d0 = 2 * N + 1
    start, n = R * (d0 // N) + min(R, d0 % N), d0 // N + (1 if R < d0 % N else 0)
    for op, name in ((shoal.Sum, "sum"), (None, "avg")):
        xs = [member(R, 2, "float64", (d0, 2)), member(R, 3, "float32", (N,))]
        got = shoal.grouped_reducescatter(xs, op=op, name=f"g.rs.{name}")
        for k, (g, x) in enumerate(zip(got, xs)):
            total = sum(member(q, 2 + k, x.dtype, x.shape) for q in range(N))
            if op is None:
                total = total / np.asarray(N, x.dtype)
            lo, cnt = (start, n) if k == 0 else (R, 1)
            assert g.dtype == x.dtype and np.array_equal(g, total[lo:lo + cnt]), (name, k, g, total)
    h = shoal.grouped_allgather_nonblocking([np.full((1, 2), R)], name="g.ag.nb")
    assert np.array_equal(shoal.synchronize(h)[0], np.repeat(np.arange(N), 2).reshape(N, 2))


@check
def a_group_fails_as_a_whole_with_one_error():
    if N == 1:
        raise Skip("needs 2 or more ranks")
    xs = [np.ones(3), np.ones(4 if R == 1 else 3), np.ones(2)]
    msg = error_of(shoal.ShoalError, shoal.grouped_allreduce, xs, name="g.bad")
    assert "grouped_allreduce 'g.bad': allreduce 'g.bad[1]': mismatched shapes across ranks: [3] on rank" in msg, msg
    assert "[4] on rank 1" in msg and "no tensor of the group ran" in msg, msg
    same_everywhere(msg)
    msg = error_of(shoal.ShoalError, shoal.grouped_allgather, [np.ones((1, 2))] * (2 if R == 0 else 3),
                   name="g.count")
    assert "grouped_allgather 'g.count': mismatched numbers of tensors across ranks: 2 tensors on rank 0; " \
           "3 tensors on rank" in msg, msg
    same_everywhere(msg)
    # The last rank's second member cannot be summed: refused there, and on every peer.
    xs = [np.ones(2), np.ones(2, bool) if R == N - 1 else np.ones(2)]
    msg = error_of(ValueError, shoal.grouped_allreduce, xs, op=shoal.Sum, name="g.refused")
    assert msg.startswith("grouped_allreduce: tensor 1: allreduce: bool tensors cannot be reduced"), msg
    same_everywhere(msg, f" (raised at the call on rank {N - 1})")
    raises(TypeError, shoal.grouped_allreduce, np.ones(2), name="g.notalist")
    raises(ValueError, shoal.grouped_allreduce, [], name="g.empty")
    raises(ValueError, shoal.grouped_reducescatter, [np.ones((2, 2))], op=shoal.Max, name="g.rsmax")
    got = shoal.grouped_allreduce([np.ones(3), np.ones(3), np.ones(2)], op=shoal.Sum, name="g.bad")  # works again
    assert all(np.array_equal(g, np.full(g.shape, float(N))) for g in got), got


sys.exit(1 if run_all(R) else 0)
