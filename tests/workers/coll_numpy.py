"""Horovod's collectives in the numpy API with exact expected values: allreduce with
op=Min/Max/Product (every numeric dtype, machine scope, fused batches, errors),
reducescatter (even and uneven first dimensions, every dtype, Sum and Average, errors) and
repeated broadcasts, which skip the coordinator once cached (docs/design.md §20).
Run at 2 and 4 ranks (4: two simulated machines) by tests/test_collectives.py."""
import functools
import hashlib
import sys

import numpy as np

import shoal
from checks import Skip, check, raises, run_all

shoal.init()
R, N = shoal.rank(), shoal.size()
DTYPES = ["int8", "uint8", "int16", "int32", "int64", "float16", "float32", "float64"]
FOLDS = {"Min": np.minimum, "Max": np.maximum, "Product": np.multiply}


def value(r, dtype, n=6):
    """Rank r's input: small integers in [-2, 4] (exact in every dtype; uint8 wraps the
    negative ones), so products over 4 ranks overflow int8 and wrap."""
    return ((np.arange(n) % 4 - 1) * (1 + r % 2) + (np.arange(n) == n - 1) * r).astype(dtype)


def expected(op, dtype, ranks, n=6):
    """The element-wise fold of `op` over `ranks`' inputs, in the dtype (wrapping as MPI)."""
    with np.errstate(over="ignore"):
        return functools.reduce(FOLDS[op], [value(r, dtype, n) for r in ranks])


def same_everywhere(msg):
    """Every rank got the very same text."""
    digest = np.frombuffer(hashlib.sha256(msg.encode()).digest(), np.uint8)
    every = shoal.allgather(digest[None, :], name=f"same.{hashlib.sha1(msg.encode()).hexdigest()[:12]}")
    assert all(np.array_equal(row, every[0]) for row in every), f"ranks saw different errors; here: {msg}"


@check
def min_max_product_every_dtype():
    for op in FOLDS:
        for dt in DTYPES:
            got = shoal.allreduce(value(R, dt), op=getattr(shoal, op), name=f"rop.{op}.{dt}")
            want = expected(op, dt, range(N))
            assert got.dtype == np.dtype(dt) and got.shape == want.shape, (op, dt, got.dtype, got.shape)
            assert np.array_equal(got, want), (op, dt, got, want)


@check
def product_of_int8_wraps_and_float16_rounds_once():
    # int8: 5^N wraps as two's complement; float16: the product computes in float32 and
    # rounds once (1.5^N is exact in float32 up to N=8, rounded to float16 once).
    got = shoal.allreduce(np.full(3, 5, "int8"), op=shoal.Product, name="rop.wrap")
    assert np.array_equal(got, np.full(3, np.int64(5 ** N) % 256, "uint8").view("int8")), got
    got = shoal.allreduce(np.full(2, 1.5, "float16"), op=shoal.Product, name="rop.half")
    assert np.array_equal(got, np.full(2, np.float32(1.5) ** N, "float32").astype("float16")), got


@check
def min_max_of_floats_keep_extremes():
    x = np.array([-np.inf, 1e300, -0.5 * R, 2.0 ** -1074 * (R + 1)])
    got = shoal.allreduce(x, op=shoal.Min, name="rop.fmin")
    assert np.array_equal(got, [-np.inf, 1e300, -0.5 * (N - 1), 2.0 ** -1074]), got
    got = shoal.allreduce(x, op=shoal.Max, name="rop.fmax")
    assert np.array_equal(got, [-np.inf, 1e300, 0.0, 2.0 ** -1074 * N]), got


@check
def nonblocking_inplace_and_fused_batches():
    # Many small ops of one dtype in flight at once: fused per reduce op, never mixed.
    handles = []
    for i in range(24):
        op = ["Sum", "Min", "Max", "Product"][i % 4]
        handles.append((op, i, shoal.allreduce_nonblocking(value(R, "int32") + i, op=getattr(shoal, op),
                                                          name=f"rop.fuse.{i}")))
    for op, i, h in handles:
        got = shoal.synchronize(h)
        if op == "Sum":
            want = sum(value(r, "int32") + i for r in range(N))
        else:
            want = functools.reduce(FOLDS[op], [value(r, "int32") + i for r in range(N)])
        assert np.array_equal(got, want), (op, i, got, want)
    y = value(R, "float64")
    assert shoal.allreduce_(y, op=shoal.Max, name="rop.inplace") is y
    assert np.array_equal(y, expected("Max", "float64", range(N))), y


@check
def machine_scope():
    ranks = [R - shoal.local_rank() + q for q in range(shoal.local_size())]
    for op in FOLDS:
        got = shoal.allreduce(value(R, "float32"), op=getattr(shoal, op), is_hierarchical_local=True,
                              name=f"rop.local.{op}")
        assert np.array_equal(got, expected(op, "float32", ranks)), (op, got)


@check
def empty_and_scalar():
    assert shoal.allreduce(np.zeros((0, 3), "int16"), op=shoal.Min, name="rop.empty").shape == (0, 3)
    got = shoal.allreduce(np.array(float(R + 1)), op=shoal.Product, name="rop.scalar")
    assert got.shape == () and got == float(np.prod(np.arange(1, N + 1))), got


@check
def bad_arguments_raise_at_the_call():
    raises(ValueError, shoal.allreduce, np.ones(2), average=True, op=shoal.Max, name="rop.avg")
    raises(ValueError, shoal.allreduce, np.ones(2), average=False, op=shoal.Min, name="rop.avg2")
    raises(ValueError, shoal.allreduce, np.ones(2, bool), op=shoal.Max, name="rop.bool")
    raises(ValueError, shoal.allreduce, np.ones(2), op="max", name="rop.str")
    from shoal._horovod import Adasum
    raises(NotImplementedError, shoal.allreduce, np.ones(2), op=Adasum, name="rop.adasum")
    assert np.array_equal(shoal.allreduce(np.ones(2), op=shoal.Max, name="rop.after"), np.ones(2))


@check
def mismatched_ops_fail_on_every_rank():
    if N == 1:
        raise Skip("needs 2 or more ranks")
    try:
        shoal.allreduce(np.ones(3), op=shoal.Min if R % 2 else shoal.Max, name="rop.mismatch")
    except shoal.ShoalError as e:
        msg = str(e)
    else:
        raise AssertionError("mismatched reduce ops accepted")
    assert "allreduce 'rop.mismatch': mismatched reduce ops across ranks" in msg, msg
    assert "op=Max on rank" in msg and "op=Min on rank" in msg, msg
    same_everywhere(msg)
    assert np.array_equal(shoal.allreduce(np.full(3, float(R)), op=shoal.Min, name="rop.mismatch"), np.zeros(3))


def rows_of(r, d0):
    """Horovod's split: (first row, rows) of rank r."""
    return r * (d0 // N) + min(r, d0 % N), d0 // N + (1 if r < d0 % N else 0)


def scatter_base(d0, dtype):
    return (np.arange(d0 * 3) % 7).reshape(d0, 3).astype(dtype)


@check
def reducescatter_sum_every_dtype_even_and_uneven():
    for d0 in (2 * N, 2 * N + N - 1, 1, 0):
        start, n = rows_of(R, d0)
        for dt in DTYPES:
            got = shoal.reducescatter(scatter_base(d0, dt) * np.asarray(R + 1, dt), op=shoal.Sum,
                                      name=f"rs.sum.{d0}.{dt}")
            want = (scatter_base(d0, "int64") * (N * (N + 1) // 2)).astype(dt)[start:start + n]
            assert got.dtype == np.dtype(dt) and got.shape == (n, 3), (d0, dt, got.dtype, got.shape)
            assert np.array_equal(got, want), (d0, dt, got, want)


@check
def reducescatter_average_is_sum_then_divide():
    d0 = 3 * N + 1
    start, n = rows_of(R, d0)
    for dt in ("float16", "float32", "float64"):
        acc = "float32" if dt == "float16" else dt
        want = (scatter_base(d0, acc) * np.asarray(N * (N + 1) // 2, acc) / np.asarray(N, acc)).astype(dt)
        got = shoal.reducescatter(scatter_base(d0, dt) * np.asarray(R + 1, dt), name=f"rs.avg.{dt}")  # default
        assert np.array_equal(got, want[start:start + n]), (dt, got, want)
    h = shoal.reducescatter_nonblocking(np.full((N, 2, 2), float(R)), op=shoal.Average, name="rs.nb")
    assert np.array_equal(shoal.synchronize(h), np.full((1, 2, 2), (N - 1) / 2)), "nonblocking"


@check
def reducescatter_bad_arguments_raise_at_the_call():
    raises(ValueError, shoal.reducescatter, np.array(1.0), name="rs.0d")
    raises(ValueError, shoal.reducescatter, np.ones((2, 2)), op=shoal.Max, name="rs.max")
    raises(ValueError, shoal.reducescatter, np.ones((2, 2), "int32"), op=shoal.Average, name="rs.intavg")
    raises(ValueError, shoal.reducescatter, np.ones((2, 2), bool), op=shoal.Sum, name="rs.bool")
    got = shoal.reducescatter(np.ones((N, 2), "int32"), op=shoal.Sum, name="rs.after")
    assert np.array_equal(got, np.full((1, 2), N, "int32")), got


@check
def reducescatter_shape_mismatch_fails_on_every_rank():
    if N == 1:
        raise Skip("needs 2 or more ranks")
    try:
        shoal.reducescatter(np.ones((N + R % 2, 2)), name="rs.mismatch")
    except shoal.ShoalError as e:
        msg = str(e)
    else:
        raise AssertionError("mismatched shapes accepted")
    assert f"reducescatter 'rs.mismatch': mismatched shapes across ranks: [{N}, 2] on rank" in msg, msg
    assert f"[{N + 1}, 2] on rank" in msg, msg
    same_everywhere(msg)


def rounds():
    return shoal.stats()["coordinator_rounds"]


@check
def repeated_broadcasts_skip_the_coordinator():
    """4 KiB broadcasts of several dtypes, each name from its own root, ten steps: exact,
    and steps 3 to 9 ask the coordinator nothing; then every root moves on (those calls
    are negotiated once more) and the names are cached again."""
    names = [("bc.f32", "float32", 1024), ("bc.u8", "uint8", 4096), ("bc.f16", "float16", 2048)]
    for phase in range(2):
        for step in range(10):
            before = rounds()
            for k, (name, dt, n) in enumerate(names):
                root = (k + phase) % N
                got = shoal.broadcast((np.arange(n) % 97 + R * 3 + step).astype(dt), root, name=name)
                want = (np.arange(n) % 97 + root * 3 + step).astype(dt)
                assert got.dtype == want.dtype and np.array_equal(got, want), (name, phase, step)
            if step >= 3:
                assert rounds() == before, f"phase {phase} step {step}: {rounds() - before} coordinator rounds"


@check
def broadcast_in_a_process_set_is_cached_on_its_channels():
    if N < 3:
        raise Skip("needs a set smaller than the world: 3 or more ranks")
    ps = shoal.add_process_set([0, N - 1])
    try:
        for step in range(8):
            before = rounds()
            if ps.included():
                got = shoal.broadcast(np.full(16, float(R + step)), N - 1, name="bc.set", process_set=ps)
                assert np.array_equal(got, np.full(16, float(N - 1 + step))), got
            got = shoal.broadcast(np.full(4, float(R + step)), 0, name="bc.set")  # the world's, same name
            assert np.array_equal(got, np.full(4, float(step))), got
            if step >= 3:
                assert rounds() == before, f"step {step}: coordinator rounds"
    finally:
        shoal.remove_process_set(ps)


@check
def broadcast_changed_on_a_non_root_fails_there_only():
    if N < 2:
        raise Skip("needs 2 or more ranks")
    for step in range(3):
        shoal.broadcast(np.full(8, float(R)), 0, name="bc.peer")
    try:
        got = shoal.broadcast(np.full(9 if R == N - 1 else 8, float(R)), 0, name="bc.peer")
    except shoal.ShoalError as e:
        assert R == N - 1, f"rank {R} raised: {e}"
        assert f"rank {R} called it with float64[9]" in str(e) and "the root ran, float64[8]" in str(e), str(e)
    else:
        assert R != N - 1, "the changed call did not raise"
        assert np.array_equal(got, np.zeros(8)), got
    shoal.barrier()  # the refusal reaches the root: its next call is negotiated
    before = rounds()
    for step in range(1, 5):
        got = shoal.broadcast(np.full(8, float(R + step)), 0, name="bc.peer")
        assert np.array_equal(got, np.full(8, float(step))), got
    assert rounds() > before, "the name did not go back to the coordinator"


@check
def broadcast_changed_on_the_root_fails_on_every_rank():
    if N < 2:
        raise Skip("needs 2 or more ranks")
    for step in range(3):
        shoal.broadcast(np.full(8, float(R)), 0, name="bc.root")
    try:
        shoal.broadcast(np.full(9 if R == 0 else 8, float(R)), 0, name="bc.root")
    except shoal.ShoalError as e:
        msg = str(e)
    else:
        raise AssertionError("a changed root's call was accepted")
    assert "broadcast 'bc.root': mismatched shapes across ranks" in msg, msg
    same_everywhere(msg)


sys.exit(1 if run_all(R) else 0)
