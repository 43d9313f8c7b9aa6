"""Every op and dtype of the framework-neutral API with exact expected values.

Run on 1, 2, 4, 8 ranks, with and without fusion (SHOAL_FUSION_THRESHOLD).
"""
import os
import random
import sys

import numpy as np

import shoal
from checks import Skip, check, run_all

shoal.init()
R, N = shoal.rank(), shoal.size()
INTS = ["int8", "uint8", "int16", "int32", "int64"]
FLOATS = ["float16", "float32", "float64"]


def base(dtype, shape=(2, 3)):
    return (np.arange(int(np.prod(shape))) % 3).reshape(shape).astype(dtype)


@check
def allreduce_sum_every_dtype():
    for dt in INTS + FLOATS:
        x = base(dt) * (R + 1)
        got = shoal.allreduce(x, average=False, name=f"sum.{dt}")
        want = (base("int64") * (N * (N + 1) // 2)).astype(dt)
        assert got.dtype == np.dtype(dt) and got.shape == x.shape, (got.dtype, got.shape)
        assert np.array_equal(got, want), (dt, got, want)
        assert np.array_equal(x, base(dt) * (R + 1)), "input modified"


@check
def allreduce_average_is_sum_then_divide():
    for dt in FLOATS:
        x = base(dt) * (R + 1)
        got = shoal.allreduce(x, op=shoal.Average, name=f"avg.{dt}")
        acc = "float32" if dt == "float16" else dt
        want = (base(acc) * np.asarray(N * (N + 1) // 2, acc) / np.asarray(N, acc)).astype(dt)
        assert np.array_equal(got, want), (dt, got, want)
    # 2^-256-scale values: exact only if summed before dividing.
    tiny = np.full(4, 2.0 ** -256) * (R + 1)
    got = shoal.allreduce(tiny, name="avg.tiny")
    assert np.array_equal(got, np.full(4, 2.0 ** -256 * (N + 1) / 2)), got


@check
def allreduce_inplace_and_nonblocking():
    x = np.full(5, float(R))
    h = shoal.allreduce_nonblocking_(x, average=False, name="inplace")
    out = shoal.synchronize(h)
    assert out is x and np.array_equal(x, np.full(5, N * (N - 1) / 2)), x
    h = shoal.allreduce_nonblocking(np.full(3, 1.0), average=False, name="poll")
    while not shoal.poll(h):
        pass
    assert np.array_equal(shoal.wait(h), np.full(3, float(N)))


@check
def average_of_integers_is_rejected():
    try:
        shoal.allreduce(np.ones(3, dtype="int32"), name="int.avg")
    except ValueError as e:
        assert "op=Sum" in str(e)
    else:
        raise AssertionError("average of int32 accepted")


@check
def broadcast_every_dtype_and_root():
    for root in sorted({0, N - 1}):
        for dt in INTS + FLOATS + ["bool"]:
            x = (base("int64") + R).astype(dt) if dt != "bool" else np.full(4, R % 2 == 1)
            got = shoal.broadcast(x, root, name=f"bc.{dt}.{root}")
            want = (base("int64") + root).astype(dt) if dt != "bool" else np.full(4, root % 2 == 1)
            assert got.dtype == x.dtype and np.array_equal(got, want), (dt, root, got)
    y = np.full(3, float(R))
    assert shoal.broadcast_(y, 0, name="bc.inplace") is y and np.array_equal(y, np.zeros(3))
    # The forms the one-call path leaves to Python: a numpy integer root, a strided view,
    # a nonblocking in-place op; the result is the same.
    z = np.arange(8.0).reshape(2, 4)[:, ::2] + R
    got = shoal.broadcast(z, np.int64(N - 1), name="bc.strided")
    assert np.array_equal(got, np.arange(8.0).reshape(2, 4)[:, ::2] + N - 1), got
    y = np.full(3, float(R))
    assert shoal.synchronize(shoal.broadcast_nonblocking_(y, N - 1, name="bc.nb_")) is y
    assert np.array_equal(y, np.full(3, float(N - 1))), y


@check
def allgather_variable_first_dim():
    for dt in INTS + FLOATS + ["bool"]:
        x = np.full((R % 3, 2), R).astype(dt)
        got = shoal.allgather(x, name=f"ag.{dt}")
        want = np.concatenate([np.full((r % 3, 2), r).astype(dt) for r in range(N)])
        assert got.dtype == x.dtype and got.shape == want.shape and np.array_equal(got, want), (dt, got)
    got = shoal.allgather(np.arange(R + 1, dtype="int64"), name="ag.1d")
    assert np.array_equal(got, np.concatenate([np.arange(r + 1) for r in range(N)])), got


@check
def allgather_of_0d_is_rejected():
    try:
        shoal.allgather(np.array(1.0), name="ag.0d")
    except ValueError as e:
        assert "0-d" in str(e)
    else:
        raise AssertionError("0-d allgather accepted")


def neighbor_expected(x_of, dt):
    ins = shoal.in_neighbor_ranks()
    acc = "float32" if dt == "float16" else dt
    total = x_of(R).astype(acc)
    for j in ins:
        total = total + x_of(j).astype(acc)
    return (total / np.asarray(len(ins) + 1, acc)).astype(dt)


@check
def neighbor_allreduce_uniform_exact():
    assert shoal.in_neighbor_ranks() == sorted({(R - 2 ** k) % N for k in range(N.bit_length()) if 2 ** k < N})
    for dt in FLOATS:
        x_of = lambda r: base(dt) * (r + 1)  # noqa: E731
        got = shoal.neighbor_allreduce(x_of(R), name=f"nbr.{dt}")
        assert got.dtype == np.dtype(dt) and np.array_equal(got, neighbor_expected(x_of, dt)), (dt, got)
    tiny = np.full(3, 2.0 ** -256)
    got = shoal.neighbor_allreduce(tiny * (R + 1), name="nbr.tiny")
    assert np.array_equal(got, neighbor_expected(lambda r: tiny * (r + 1), "float64"))
    # Weights given as 1/(n+1) take the same sum-then-divide path (BlueFog's uniform path),
    # statically and dynamically; values where w*x sums round differently from the average.
    ins, u = shoal.in_neighbor_ranks(), 1.0 / (len(shoal.in_neighbor_ranks()) + 1)
    x_of = lambda r: np.array([1 + 2.0 ** -23 * (r + 1), 0.1 * (r + 1), 1e-3 * 7 ** r], "float32")  # noqa: E731
    want = neighbor_expected(x_of, "float32")
    for how, kw in (("static", {}), ("dynamic", {"dst_weights": shoal.out_neighbor_ranks()})):
        got = shoal.neighbor_allreduce(x_of(R), self_weight=u, src_weights={j: u for j in ins}, name=f"nbr.u.{how}", **kw)
        assert np.array_equal(got, want), (how, got, want)


@check
def neighbor_allreduce_weighted_and_dynamic():
    ins = shoal.in_neighbor_ranks()
    x = np.full(4, float(R + 1))
    src = {j: 0.25 for j in ins}
    got = shoal.neighbor_allreduce(x, self_weight=0.5, src_weights=src, name="nbr.w")
    assert np.array_equal(got, np.full(4, 0.5 * (R + 1) + sum(0.25 * (j + 1) for j in ins))), got
    if N > 1:  # ring by hand: send to r+1 scaled by 2, receive from r-1
        got = shoal.neighbor_allreduce(x, self_weight=0.5, src_weights={(R - 1) % N: 0.25},
                                       dst_weights={(R + 1) % N: 2.0}, name="nbr.dyn")
        assert np.array_equal(got, np.full(4, 0.5 * (R + 1) + 0.25 * 2.0 * ((R - 1) % N + 1))), got


@check
def neighbor_allreduce_repeated_converges():
    x = np.full(2, float(R))
    for _ in range(3 * max(1, N.bit_length())):
        x = shoal.neighbor_allreduce(x, name="nbr.steps")
    assert np.allclose(x, (N - 1) / 2, atol=1e-3), x


@check
def empty_and_scalar_tensors():
    e = shoal.allreduce(np.zeros((3, 0), "float32"), name="empty.ar")
    assert e.shape == (3, 0)
    assert shoal.broadcast(np.zeros(0, "int32"), 0, name="empty.bc").shape == (0,)
    assert shoal.neighbor_allreduce(np.zeros(0), name="empty.nbr").shape == (0,)
    s = shoal.allreduce(np.array(float(R)), average=False, name="scalar")
    assert s.shape == () and s == N * (N - 1) / 2, s
    g = shoal.allgather(np.zeros((0, 3), "float64"), name="empty.ag")
    assert g.shape == (0, 3), g.shape


@check
def non_contiguous_inputs():
    m = np.arange(12.0).reshape(3, 4) * (R + 1)
    got = shoal.allreduce(m[:, ::2], average=False, name="noncontig")
    assert np.array_equal(got, np.arange(12.0).reshape(3, 4)[:, ::2] * (N * (N + 1) / 2))
    try:
        shoal.allreduce_(m[:, ::2], name="noncontig.inplace")
    except ValueError as e:
        assert "contiguous" in str(e)
    else:
        raise AssertionError("in-place on a non-contiguous view accepted")


@check
def fusion_mixed_dtypes_random_order():
    rng = random.Random(R)
    specs = [(f"fuse.{i}", ["float32", "float64", "int32", "float16"][i % 4], 1 + i % 7) for i in range(200)]
    order = specs[:]
    rng.shuffle(order)
    handles = {}
    for name, dt, n in order:
        op = shoal.Sum if dt == "int32" else shoal.Average
        if name.endswith("7"):
            handles[name] = shoal.neighbor_allreduce_nonblocking(np.full(n, R + 1.0, dt) if dt != "int32" else np.full(n, R + 1.0), name="n" + name)
        else:
            handles[name] = shoal.allreduce_nonblocking(np.full(n, R + 1, dt), op=op, name=name)
    for name, dt, n in specs:
        got = shoal.synchronize(handles[name])
        if name.endswith("7"):  # neighbor_allreduce of R + 1: sum over self and in-neighbours, then divide
            want = neighbor_expected(lambda r: np.full(n, r + 1.0, dt), dt)
        else:
            want = np.full(n, N * (N + 1) // 2 if dt == "int32" else (N + 1) / 2, dt)
        assert got.dtype == np.dtype(dt) and np.array_equal(got, want), (name, got, want)


@check
def duplicate_in_flight_name_raises():
    # An ordering, not a head start: the other ranks submit "dup" only after rank 0 has
    # tried the duplicate, so rank 0's first "dup" cannot have finished by then.
    if N == 1:
        raise Skip("needs 2 or more ranks (alone, the first op may finish before the second)")
    if R == 0:
        h = shoal.allreduce_nonblocking(np.ones(2), name="dup")
        try:
            shoal.allreduce_nonblocking(np.ones(2), name="dup")
        except ValueError as e:
            assert "already in flight" in str(e)
        else:
            raise AssertionError("duplicate name accepted")
        shoal.barrier()  # only now do the others submit "dup"
    else:
        shoal.barrier()
        h = shoal.allreduce_nonblocking(np.ones(2), name="dup")
    assert np.array_equal(shoal.synchronize(h), np.ones(2))
    shoal.barrier()


@check
def unnamed_ops_get_deterministic_names():
    for i in range(3):
        assert np.array_equal(shoal.allreduce(np.full(2, float(i)), average=False), np.full(2, float(i * N)))


@check
def several_threads_wait_at_once():
    # A waiting thread drives communication for every op, then hands over to the next.
    import threading
    ins = shoal.in_neighbor_ranks()
    errors = []

    def work(t):
        try:
            for i in range(20):
                got = shoal.neighbor_allreduce(np.full(4, float(R)), name=f"thread{t}.nar")
                assert np.allclose(got, (R + sum(ins)) / (len(ins) + 1)), (t, i, got)
                got = shoal.allreduce(np.full(3, float(R + t)), average=False, name=f"thread{t}.ar")
                assert np.array_equal(got, np.full(3, float(N * (N - 1) // 2 + N * t))), (t, i, got)
        except Exception as ex:  # reported below
            errors.append(repr(ex))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not errors and not any(th.is_alive() for th in threads), errors


@check
def world_queries():
    assert 0 <= R < N and shoal.local_size() * shoal.machine_size() == N
    per = int(os.environ.get("SHOAL_RANKS_PER_MACHINE", "0"))
    if per:
        assert shoal.local_size() == min(per, N) and shoal.local_rank() == R % per
        assert shoal.machine_rank() == R // per
    st = shoal.stats()
    assert st["allreduce"] > 0 and st["errors"] == 0, st


sys.exit(1 if run_all(R) else 0)
