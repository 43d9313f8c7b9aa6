"""Horovod's alltoall and grouped ops in shoal.torch with exact expected values: alltoall
(every dtype incl. bfloat16 and bool, splits as a list or tensor, Horovod's return
convention, async, gradients, errors), grouped_allreduce (every reduce op, Horovod's
extras: integer average, prescale/postscale, fp16 compression, in place, async; gradients
of Sum/Average/Min), grouped_allgather and grouped_reducescatter (gradients, async), a
group that fails as a whole, and the registered ops under torch.compile.
Run at 2 and 4 ranks by tests/test_alltoall_grouped.py."""
import functools
import hashlib
import sys

import torch

import a2a_expect
import shoal.torch as hvd
from a2a_expect import split
from checks import Skip, check, raises, run_all

hvd.init()
R, N = hvd.rank(), hvd.size()
DTYPES = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.bool]
FOLDS = {"Sum": torch.add, "Min": torch.minimum, "Max": torch.maximum, "Product": torch.mul}


def rows(r, d0, width=3):
    return torch.from_numpy(a2a_expect.rows(r, d0, width))


def received(r, splits_of, d0_of, width=3):
    return torch.from_numpy(a2a_expect.received(r, N, splits_of, d0_of, width))


def as_dtype(t, dt):
    return t % 2 == 1 if dt == torch.bool else t.to(dt)


def same_everywhere(msg, strip=""):
    msg = msg.replace(strip, "") if strip else msg
    digest = torch.tensor(list(hashlib.sha256(msg.encode()).digest()), dtype=torch.uint8)
    every = hvd.allgather(digest[None, :], name=f"same.{hashlib.sha1(msg.encode()).hexdigest()[:12]}")
    assert all(torch.equal(row, every[0]) for row in every), f"ranks saw different errors; here: {msg}"


def error_of(exc_type, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc_type as e:
        return str(e)
    raise AssertionError(f"{fn.__name__} did not raise {exc_type.__name__}")


@check
def alltoall_every_dtype_and_horovod_returns():
    for dt in DTYPES:
        got = hvd.alltoall(as_dtype(rows(R, 2 * N), dt), name=f"t.a2a.even.{dt}")
        want = as_dtype(received(R, lambda q, k: 2, lambda q: 2 * N), dt)
        assert isinstance(got, torch.Tensor) and got.dtype == dt and torch.equal(got, want), (dt, got, want)
    d0 = sum(split(R, q) for q in range(N))
    for kind in ("list", "tensor"):
        s = [split(R, q) for q in range(N)]
        got, rsplits = hvd.alltoall(rows(R, d0).double(), splits=torch.tensor(s) if kind == "tensor" else s,
                                    name=f"t.a2a.uneven.{kind}")
        want = received(R, split, lambda q: sum(split(q, k) for k in range(N))).double()
        assert torch.equal(got, want), (kind, got, want)
        assert rsplits.dtype == torch.int32 and rsplits.device.type == "cpu" and \
            rsplits.tolist() == [split(q, R) for q in range(N)], rsplits
    out, rsplits = hvd.synchronize(hvd.alltoall_async(torch.full((N, 2), float(R)), name="t.a2a.async"))
    assert torch.equal(out, torch.arange(N, dtype=torch.float32).repeat_interleave(2).reshape(N, 2)), out
    assert rsplits.tolist() == [1] * N, rsplits
    h = hvd.alltoall_nonblocking(torch.zeros(0, 2), splits=[0] * N, name="t.a2a.empty")
    out, rsplits = hvd.synchronize(h)
    assert out.shape == (0, 2) and rsplits.tolist() == [0] * N, (out.shape, rsplits)


@check
def alltoall_gradient_goes_back_with_the_received_splits():
    # y_q = rows every rank sent q; loss = Σ_q Σ_j w_q[j] * y_q[j] with w_q[j] = 100 q + j, so
    # x_r[i]'s gradient is w of the row it became: on rank q, at its place among q's rows.
    d0 = sum(split(R, q) for q in range(N))
    x = rows(R, d0, 2).double().requires_grad_()
    y, _ = hvd.alltoall(x, splits=[split(R, q) for q in range(N)], name="t.a2a.grad")
    w = (100 * R + torch.arange(y.shape[0], dtype=torch.float64))[:, None].expand(-1, 2)
    (y * w).sum().backward()
    want = []
    for q in range(N):
        before = sum(split(k, q) for k in range(R))  # rows of lower ranks on rank q
        want += [100 * q + before + j for j in range(split(R, q))]
    want = torch.tensor(want, dtype=torch.float64)[:, None].expand(-1, 2)
    assert torch.equal(x.grad, want), (x.grad, want)


@check
def alltoall_errors_are_the_same_everywhere():
    if N == 1:
        raise Skip("needs 2 or more ranks")
    s = [1] * N
    if R == 1:
        s[0] = 2
    msg = error_of(ValueError, hvd.alltoall, torch.ones(N, 2), splits=s, name="t.a2a.badsum")
    assert msg.startswith(f"alltoall: splits sum to {N + 1} rows, but dim 0 is {N}"), msg
    same_everywhere(msg, " (raised at the call on rank 1)")
    raises(TypeError, hvd.alltoall, torch.ones(N, 2), splits=[0.5] * N, name="t.a2a.float")
    raises(TypeError, hvd.alltoall, [1.0] * N, name="t.a2a.list")
    msg = error_of(hvd.ShoalError, hvd.alltoall, torch.ones(N, 2, dtype=torch.float64 if R == 0 else torch.float32),
                   name="t.a2a.dtype")
    assert "alltoall 't.a2a.dtype': mismatched dtypes across ranks: float64 on rank 0; float32 on rank" in msg, msg
    same_everywhere(msg)


def member(r, k, dt, shape):
    n = 1
    for d in shape:
        n *= d
    return ((r * 5 + k * 7 + torch.arange(n)) % 9 - 3).reshape(shape).to(dt)


SHAPES = [(torch.float64, (3,)), (torch.float32, (2, 2)), (torch.int32, (5,)), (torch.bfloat16, (4,)),
          (torch.float16, (0, 2)), (torch.int8, (3,))]


def fold(op, k, dt, shape, ranks=None):
    every = [member(q, k, dt, shape) for q in (range(N) if ranks is None else ranks)]
    if dt in (torch.float16, torch.bfloat16):  # computed in float32, rounded once
        return functools.reduce(FOLDS[op], [e.float() for e in every]).to(dt)
    return functools.reduce(FOLDS[op], every)


@check
def grouped_allreduce_every_op_mixed_dtypes():
    for op in FOLDS:
        xs = [member(R, k, dt, shape) for k, (dt, shape) in enumerate(SHAPES)]
        got = hvd.grouped_allreduce(xs, op=getattr(hvd, op), name=f"t.g.{op}")
        assert isinstance(got, list) and len(got) == len(xs)
        for k, (dt, shape) in enumerate(SHAPES):
            assert got[k].dtype == dt and torch.equal(got[k], fold(op, k, dt, shape)), (op, k, got[k])


@check
def grouped_allreduce_horovod_extras():
    # op=Average with an integer member: the sum divided by size(), integers toward zero.
    xs = [member(R, 0, torch.float64, (3,)), member(R, 2, torch.int32, (5,))]
    got = hvd.grouped_allreduce(xs, op=hvd.Average, name="t.g.intavg")
    assert torch.equal(got[0], fold("Sum", 0, torch.float64, (3,)) / N), got[0]
    assert torch.equal(got[1], torch.div(fold("Sum", 2, torch.int32, (5,)), N, rounding_mode="trunc")), got[1]
    # prescale, postscale (Horovod's order: tensors, average, name, compression, op, ...).
    got = hvd.grouped_allreduce(xs, None, "t.g.scaled", hvd.Compression.none, hvd.Sum, 2.0, 0.5)
    assert torch.equal(got[0], fold("Sum", 0, torch.float64, (3,))), got[0]
    assert torch.equal(got[1], fold("Sum", 2, torch.int32, (5,))), got[1]
    # fp16 compression: floats travel as float16 and come back in their dtype.
    got = hvd.grouped_allreduce([member(R, 1, torch.float32, (2, 2))], op=hvd.Sum, name="t.g.fp16",
                                compression=hvd.Compression.fp16)
    assert got[0].dtype == torch.float32 and torch.equal(got[0], fold("Sum", 1, torch.float32, (2, 2))), got
    # async (not modified), async_ and grouped_allreduce_ (in place), machine scope.
    ys = [member(R, k, torch.float64, (2,)) for k in range(3)]
    got = hvd.synchronize(hvd.grouped_allreduce_async(ys, op=hvd.Max, name="t.g.async"))
    assert all(torch.equal(g, fold("Max", k, torch.float64, (2,))) for k, g in enumerate(got)), got
    assert all(torch.equal(y, member(R, k, torch.float64, (2,))) for k, y in enumerate(ys)), "input modified"
    out = hvd.synchronize(hvd.grouped_allreduce_async_(ys, op=hvd.Min, name="t.g.async_"))
    assert all(o is y for o, y in zip(out, ys))
    assert all(torch.equal(y, fold("Min", k, torch.float64, (2,))) for k, y in enumerate(ys)), ys
    zs = [member(R, k, torch.int64, (2,)) for k in range(2)]
    out = hvd.grouped_allreduce_(zs, op=hvd.Sum, name="t.g.inplace", prescale_factor=3)
    assert all(o is z for o, z in zip(out, zs))
    assert all(torch.equal(z, fold("Sum", k, torch.int64, (2,)) * 3) for k, z in enumerate(zs)), zs
    ranks = [R - hvd.local_rank() + q for q in range(hvd.local_size())]
    got = hvd.grouped_allreduce([member(R, 0, torch.float32, (2,))], op=hvd.Sum, name="t.g.local",
                                is_hierarchical_local=True)
    assert torch.equal(got[0], fold("Sum", 0, torch.float32, (2,), ranks)), got
    h = hvd.grouped_allreduce_nonblocking([torch.full((2,), float(R))], op=hvd.Sum, name="t.g.nb")
    assert torch.equal(hvd.synchronize(h)[0], torch.full((2,), float(N * (N - 1) // 2)))


@check
def grouped_allreduce_gradients():
    # Sum and Average: each member's gradient is the same grouped allreduce of the gradients.
    for op, scale in ((hvd.Sum, 1.0), (hvd.Average, 1.0 / N)):
        a = torch.full((3,), float(R), requires_grad=True)
        b = torch.full((2, 2), float(R), dtype=torch.float64, requires_grad=True)
        ya, yb = hvd.grouped_allreduce([a, b], op=op, name=f"t.g.grad.{op.name}")
        ((R + 1) * ya.sum() + 2 * (R + 1) * yb.sum()).backward()
        total = N * (N + 1) / 2
        assert torch.equal(a.grad, torch.full((3,), total * scale)), (op, a.grad)
        assert torch.equal(b.grad, torch.full((2, 2), 2 * total * scale, dtype=torch.float64)), (op, b.grad)
    # Min: the gradient goes to the rank holding the minimum (rank 0 here), the sum of all.
    a = torch.tensor([float(R), 5.0 + R], requires_grad=True)
    (ya,) = hvd.grouped_allreduce([a], op=hvd.Min, name="t.g.grad.min")
    assert torch.equal(ya.detach(), torch.tensor([0.0, 5.0])), ya
    ((R + 1) * ya.sum()).backward()
    want = torch.tensor([N * (N + 1) / 2, N * (N + 1) / 2]) if R == 0 else torch.zeros(2)
    assert torch.equal(a.grad, want), a.grad


@check
def grouped_allgather_and_reducescatter_with_gradients():
    a = (torch.arange((R + 1) * 2, dtype=torch.float64).reshape(R + 1, 2) + 10 * R).requires_grad_()
    b = torch.full((2 - R % 2,), float(R), requires_grad=True)
    ga, gb = hvd.grouped_allgather([a, b], name="t.g.ag")
    assert torch.equal(ga.detach(), torch.cat([torch.arange((q + 1) * 2, dtype=torch.float64).reshape(q + 1, 2) + 10 * q
                                                for q in range(N)])), ga
    assert torch.equal(gb.detach(), torch.cat([torch.full((2 - q % 2,), float(q)) for q in range(N)])), gb
    ((R + 1) * ga.sum() + (R + 1) * gb.sum()).backward()  # each row's gradient: the mean of the k + 1 (Horovod's)
    assert torch.equal(a.grad, torch.full_like(a, (N + 1) / 2)) and torch.equal(b.grad, torch.full_like(b, (N + 1) / 2))
    got = hvd.synchronize(hvd.grouped_allgather_async([torch.full((1,), R)], name="t.g.ag.async"))
    assert torch.equal(got[0], torch.arange(N)), got
    d0 = 2 * N + 1
    start, n = R * (d0 // N) + min(R, d0 % N), d0 // N + (1 if R < d0 % N else 0)
    x = (torch.arange(d0 * 2, dtype=torch.float64).reshape(d0, 2) * (R + 1)).requires_grad_()
    (y,) = hvd.grouped_reducescatter([x], name="t.g.rs")  # Average
    total = torch.arange(d0 * 2, dtype=torch.float64).reshape(d0, 2) * (N * (N + 1) / 2)
    assert torch.equal(y.detach(), (total / N)[start:start + n]), y
    y.sum().backward()  # the allgather of every rank's ones (Horovod's, for Average)
    assert torch.equal(x.grad, torch.ones_like(x)), x.grad
    got = hvd.grouped_reducescatter([torch.full((N, 2), R, dtype=torch.int32)], op=hvd.Average, name="t.g.rs.int")
    assert torch.equal(got[0], torch.full((1, 2), (N * (N - 1) // 2) // N, dtype=torch.int32)), got
    got = hvd.synchronize(hvd.grouped_reducescatter_async([torch.full((N,), float(R))], op=hvd.Sum,
                                                          name="t.g.rs.async"))
    assert torch.equal(got[0], torch.full((1,), float(N * (N - 1) // 2))), got


@check
def a_group_fails_as_a_whole():
    if N == 1:
        raise Skip("needs 2 or more ranks")
    xs = [torch.ones(3), torch.ones(4 if R == 1 else 3)]
    msg = error_of(hvd.ShoalError, hvd.grouped_allreduce, xs, name="t.g.bad")
    assert "grouped_allreduce 't.g.bad': allreduce 't.g.bad[1]': mismatched shapes across ranks" in msg, msg
    same_everywhere(msg)
    raises(TypeError, hvd.grouped_allreduce, torch.ones(2), name="t.g.notalist")
    raises(TypeError, hvd.grouped_allgather, [torch.ones(2), [1.0]], name="t.g.notatensor")
    got = hvd.grouped_allreduce(xs[:1], op=hvd.Sum, name="t.g.bad")  # the name works again (one tensor now)
    assert torch.equal(got[0], torch.full((3,), float(N))), got


@check
def registered_ops_under_torch_compile():
    @torch.compile(fullgraph=True)
    def step(a, b):
        ya, yb = torch.ops.shoal.grouped_allreduce([a * 2, b], hvd.Sum.code, False, "t.g.compiled", 0, 1.0, 1.0)
        return ya + 1, yb

    ya, yb = step(torch.full((2,), float(R)), torch.full((3,), 1.0))
    assert torch.equal(ya, torch.full((2,), float(N * (N - 1)) + 1)) and torch.equal(yb, torch.full((3,), float(N)))


sys.exit(1 if run_all(R) else 0)
