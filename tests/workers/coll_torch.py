"""Horovod's collectives in shoal.torch with exact expected values: allreduce with
op=Min/Max/Product (every dtype incl. bfloat16, Horovod's names, gradients, torch.compile)
reducescatter (uneven splits, Horovod's names and extras, gradients) and repeated
broadcasts, which skip the coordinator once cached (docs/design.md §20).
Run at 2 and 4 ranks by tests/test_collectives.py."""
import functools
import math
import sys

import torch

import shoal.torch as hvd
from checks import check, raises, run_all

hvd.init()
R, N = hvd.rank(), hvd.size()
DTYPES = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64]
FOLDS = {"Min": torch.minimum, "Max": torch.maximum, "Product": torch.mul}


def value(r, dtype, n=6):
    """Rank r's input: small integers in [-2, 4] (exact in every dtype; uint8 wraps the
    negative ones, as numpy's astype does), so products over 4 ranks overflow int8."""
    v = (torch.arange(n) % 4 - 1) * (1 + r % 2) + (torch.arange(n) == n - 1) * r
    return (v % 256 if dtype == torch.uint8 else v).to(dtype)


def expected(op, dtype, ranks):
    return functools.reduce(FOLDS[op], [value(r, dtype) for r in ranks])


@check
def min_max_product_every_dtype():
    for op in FOLDS:
        for dt in DTYPES:
            got = hvd.allreduce(value(R, dt), op=getattr(hvd, op), name=f"t.rop.{op}.{dt}")
            want = expected(op, dt, range(N))
            assert got.dtype == dt and torch.equal(got, want), (op, dt, got, want)


@check
def horovod_forms():
    # Horovod's positional order (str name third), the async names, an integer tensor
    # with prescale (Horovod's ScaleBuffer path), in place.
    got = hvd.allreduce(value(R, torch.float32), None, "t.rop.hvd", op=hvd.Max)
    assert torch.equal(got, expected("Max", torch.float32, range(N))), got
    h = hvd.allreduce_async(value(R, torch.int32), name="t.rop.async", op=hvd.Product, prescale_factor=2)
    want = functools.reduce(torch.mul, [value(r, torch.int32) * 2 for r in range(N)])
    assert torch.equal(hvd.synchronize(h), want)
    x = value(R, torch.float64)
    assert hvd.synchronize(hvd.allreduce_async_(x, name="t.rop.async_", op=hvd.Min)) is x
    assert torch.equal(x, expected("Min", torch.float64, range(N))), x
    h = hvd.allreduce_nonblocking(value(R, torch.bfloat16), op=hvd.Max, name="t.rop.nb")
    assert torch.equal(hvd.synchronize(h), expected("Max", torch.bfloat16, range(N)))


@check
def gradients_of_min_and_max_share_ties():
    # x_r = [r, 5, -r]: the max is rank N-1's, a tie of all ranks, rank 0's (the min: the
    # reverse). Each rank's loss weighs the result by r + 1, so Σ_k g_k = N(N+1)/2.
    total = N * (N + 1) / 2
    for op, first, last in (("Max", N - 1, 0), ("Min", 0, N - 1)):
        x = torch.tensor([float(R), 5.0, -float(R)], dtype=torch.float64, requires_grad=True)
        y = hvd.allreduce(x, op=getattr(hvd, op), name=f"t.rop.grad.{op}")
        (y * (R + 1)).sum().backward()
        want = torch.tensor([total * (R == first), total / N, total * (R == last)], dtype=torch.float64)
        assert torch.equal(x.grad, want), (op, x.grad, want)


@check
def gradient_of_product_without_division():
    # x_r = [r+1, 2, 0 on rank 0 else 1]: dy/dx_r = product of the other ranks' x (exact,
    # also where rank 0's zero makes y 0).
    x = torch.tensor([R + 1.0, 2.0, 0.0 if R == 0 else 1.0], dtype=torch.float64, requires_grad=True)
    y = hvd.allreduce(x, op=hvd.Product, name="t.rop.grad.prod")
    assert torch.equal(y.detach(), torch.tensor([math.factorial(N), 2.0 ** N, 0.0], dtype=torch.float64)), y
    (y * (R + 1)).sum().backward()
    total = N * (N + 1) / 2
    want = torch.tensor([total * math.factorial(N) / (R + 1), total * 2.0 ** (N - 1),
                         total * (1.0 if R == 0 or N == 1 else 0.0)], dtype=torch.float64)
    assert torch.equal(x.grad, want), (x.grad, want)
    x = torch.ones(2, requires_grad=True)
    y = hvd.allreduce(x, op=hvd.Product, is_hierarchical_local=True, name="t.rop.grad.local")
    raises(NotImplementedError, y.sum().backward)


@check
def compiled_max():
    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(x):
        return hvd.allreduce(x + 1, op=hvd.Max, name="t.rop.compiled")

    out = step(torch.full((4,), float(R)))
    assert torch.equal(out, torch.full((4,), float(N))), out


@check
def bad_arguments():
    raises(ValueError, hvd.allreduce, torch.ones(2), average=True, op=hvd.Min, name="t.rop.avg")
    raises(ValueError, hvd.allreduce, torch.ones(2, dtype=torch.bool), op=hvd.Max, name="t.rop.bool")
    raises(NotImplementedError, hvd.allreduce, torch.ones(2), op=hvd.Adasum, name="t.rop.adasum")
    assert torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Min, name="t.rop.after"), torch.ones(2))


def rows_of(r, d0):
    """Horovod's split: (first row, rows) of rank r."""
    return r * (d0 // N) + min(r, d0 % N), d0 // N + (1 if r < d0 % N else 0)


def scatter_base(d0, dtype):
    return (torch.arange(d0 * 3) % 7).reshape(d0, 3).to(dtype)


@check
def reducescatter_every_dtype_and_horovod_forms():
    d0 = 2 * N + N - 1
    start, n = rows_of(R, d0)
    for dt in DTYPES:
        got = hvd.reducescatter(scatter_base(d0, dt) * (R + 1), f"t.rs.{dt}", op=hvd.Sum)  # name second
        want = (scatter_base(d0, torch.int64) * (N * (N + 1) // 2)).to(dt)[start:start + n]
        assert got.dtype == dt and torch.equal(got, want), (dt, got, want)
    for dt in (torch.float16, torch.bfloat16, torch.float32):
        got = hvd.reducescatter(scatter_base(d0, dt) * (R + 1), name=f"t.rs.avg.{dt}")  # Average by default
        want = (scatter_base(d0, torch.float32) * (N * (N + 1) // 2) / N).to(dt)[start:start + n]
        assert torch.equal(got, want), (dt, got, want)
    # The integer average truncates toward zero; the scale factors (Horovod's extras).
    got = hvd.synchronize(hvd.reducescatter_async(torch.full((N, 2), R, dtype=torch.int32), name="t.rs.intavg",
                                                  op=hvd.Average))
    assert torch.equal(got, torch.full((1, 2), (N * (N - 1) // 2) // N, dtype=torch.int32)), got
    got = hvd.reducescatter(torch.full((N, 2), float(R)), name="t.rs.scaled", op=hvd.Sum, prescale_factor=2.0,
                            postscale_factor=0.5)
    assert torch.equal(got, torch.full((1, 2), N * (N - 1) / 2)), got
    got = hvd.reducescatter_nonblocking(torch.ones(N + 1, 2), hvd.Sum, "t.rs.nb")
    assert torch.equal(hvd.synchronize(got), torch.full((rows_of(R, N + 1)[1], 2), float(N)))


@check
def reducescatter_gradient_is_allgather():
    # Rank r weighs its rows by r + 1: every rank's gradient is the rows' weights of
    # their owners, times size() for Sum (Horovod's).
    d0 = 2 * N + 1
    owner = torch.tensor([next(q for q in range(N) if rows_of(q, d0)[0] <= i < sum(rows_of(q, d0)))
                          for i in range(d0)], dtype=torch.float64)
    for op, scale in ((hvd.Average, 1.0), (hvd.Sum, float(N))):
        x = torch.ones(d0, 2, dtype=torch.float64, requires_grad=True)
        y = hvd.reducescatter(x, name=f"t.rs.grad.{op.name}", op=op)
        (y * (R + 1)).sum().backward()
        want = ((owner + 1) * scale)[:, None].expand(d0, 2)
        assert torch.equal(x.grad, want), (op, x.grad, want)


@check
def reducescatter_bad_arguments():
    raises(ValueError, hvd.reducescatter, torch.tensor(1.0), name="t.rs.0d")
    raises(ValueError, hvd.reducescatter, torch.ones(2, 2), name="t.rs.max", op=hvd.Max)
    raises(NotImplementedError, hvd.reducescatter, torch.ones(2, 2), name="t.rs.adasum", op=hvd.Adasum)
    assert torch.equal(hvd.reducescatter(torch.ones(N, 1), name="t.rs.after", op=hvd.Sum), torch.full((1, 1), 1.0 * N))


@check
def repeated_broadcasts_skip_the_coordinator():
    """Eager 4 KiB broadcasts (float32 and bfloat16), ten steps: exact, and steps 3 to 9
    ask the coordinator nothing."""
    import shoal
    for step in range(10):
        before = shoal.stats()["coordinator_rounds"]
        for k, dt in enumerate([torch.float32, torch.bfloat16]):
            root = k % N
            got = hvd.broadcast((torch.arange(1024) % 97 + R * 3 + step).to(dt), root, name=f"t.bc.{k}")
            assert torch.equal(got, (torch.arange(1024) % 97 + root * 3 + step).to(dt)), (k, step)
        if step >= 3:
            assert shoal.stats()["coordinator_rounds"] == before, f"step {step}: coordinator rounds"


sys.exit(1 if run_all(R) else 0)
