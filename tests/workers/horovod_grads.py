"""The gradients of shoal.torch's differentiable collectives used as Horovod's (`import
shoal.torch as hvd`), exact values, per op × process set (every rank, and the set of
ranks 1..N-1) × dtype (float32, float64).

The expected values come from Horovod's definitions (horovod/torch/mpi_ops.py, 0.28: the
autograd functions' backward), in closed form: rank k's loss is L_k = Σ c_k ⊙ y_k with
known coefficients c_k (`coef`), so the gradient arriving at rank k's output is c_k, and
for n ranks in the set:
  allreduce Sum/Average  -> the same allreduce of the c_k, times prescale and postscale
  allgather              -> rank i's rows of (1/n) Σ_k c_k
  broadcast              -> (1/n) Σ_k c_k at the root, 0 elsewhere
  reducescatter          -> the c_r concatenated in rank order, times n for Sum, times the
                            scaling factors
  alltoall               -> the rows of every c_q that came from this rank, in rank order
  grouped_*              -> the same, member by member.
Allreduce Min/Max/Product are Shoal's documented difference (the derivative of the op:
README, "Coming from Horovod"): Σ_k c_k at the rank holding the extremum; Σ_k c_k ·
Π_{j≠i} x_j. The c_k are multiples of n, so every value here is exact in float32.

Each check runs all its ops first and compares afterwards, so a wrong value on one rank
cannot leave the others waiting in an op it skipped."""
import sys

import torch

import shoal.torch as hvd
from checks import check, run_all

hvd.init()
R, N = hvd.rank(), hvd.size()
SUB = hvd.add_process_set(list(range(1, N)))  # not rank 0: its size and roots differ from the world's
SETS = [("world", hvd.global_process_set, list(range(N))), ("sub", SUB, list(range(1, N)))]
DTYPES = [torch.float32, torch.float64]
WIDTH = 3


def cases():
    """(label, process set, its world ranks, this rank's index in them, dtype) for each set
    this rank is in and each dtype."""
    for tag, ps, members in SETS:
        if R in members:
            for dt in DTYPES:
                yield f"{tag}.{str(dt)[6:]}", ps, members, members.index(R), dt


def coef(k, rows, n, salt=0):
    """Rank k's loss coefficients for an output of `rows` rows (float64; multiples of n)."""
    base = torch.arange(rows * WIDTH, dtype=torch.float64).reshape(rows, WIDTH) + 10 * (k + 1) + 100 * salt
    return n * base


def backward(outs, coefs):
    """Rank's loss Σ c ⊙ y over its outputs, differentiated."""
    sum((y * c.to(y.dtype)).sum() for y, c in zip(outs, coefs)).backward()


def leaf(t, dt):
    return t.to(dt).requires_grad_()


def compare(results):
    """Fail with every mismatch of [(what, got, want)] (want in float64, cast to got's dtype)."""
    bad = [f"{what}: got {got.tolist()}, want {want.tolist()}" for what, got, want in results
           if got is None or not torch.equal(got, want.to(got.dtype))]
    assert not bad, "\n".join(bad)


def rows_of(d0, n, me):
    """(start, rows) of member `me`'s part of a reducescatter of d0 rows over n ranks."""
    return me * (d0 // n) + min(me, d0 % n), d0 // n + (1 if me < d0 % n else 0)


@check
def allreduce_sum_and_average():
    """Horovod: allreduce(grad, op, prescale, postscale, process_set)."""
    results = []
    for label, ps, members, me, dt in cases():
        n = len(members)
        for op in (hvd.Sum, hvd.Average):
            for pre, post in ((1.0, 1.0), (2.0, 0.25)):
                x = leaf(torch.full((2, WIDTH), float(R + 1)), dt)
                y = hvd.allreduce(x, name=f"hg.ar.{label}.{op.name}.{pre}", op=op, prescale_factor=pre,
                                  postscale_factor=post, process_set=ps)
                backward([y], [coef(R, 2, n)])
                total = sum(coef(k, 2, n) for k in members)
                want = (total if op is hvd.Sum else total / n) * pre * post
                results.append((f"{label} {op.name} pre={pre} post={post}", x.grad, want))
    compare(results)


@check
def allreduce_factors_per_rank():
    """Factors that differ by rank: y_k = post_k · R(pre_j · x_j), so rank r's gradient is
    pre_r · R(post_k · c_k) (Horovod's formula, the same allreduce with the same factors,
    equals it only when every rank has the same factors); Max: pre_r · Σ_k post_k · c_k at
    the rank holding the maximum of pre_j · x_j (the last member: both grow with the rank)."""
    results = []
    for label, ps, members, me, dt in cases():
        n = len(members)
        pre, post = (1.0, 2.0), (1.0, 0.25)  # by rank parity: even ranks do not scale at all
        total = sum(coef(k, 2, n) * post[k % 2] for k in members)
        for op in (hvd.Sum, hvd.Average, hvd.Max):
            x = leaf(torch.full((2, WIDTH), float(R + 1)), dt)
            y = hvd.allreduce(x, name=f"hg.arf.{label}.{op.name}", op=op, prescale_factor=pre[R % 2],
                              postscale_factor=post[R % 2], process_set=ps)
            backward([y], [coef(R, 2, n)])
            want = total * pre[R % 2] / (n if op is hvd.Average else 1)
            if op is hvd.Max and R != members[-1]:
                want = torch.zeros_like(total)
            results.append((f"{label} {op.name}", x.grad, want))
    compare(results)


@check
def allreduce_min_max_product():
    """Shoal's (the derivative; Horovod reduces the gradients with the forward's op)."""
    results = []
    for label, ps, members, me, dt in cases():
        n = len(members)
        total = sum(coef(k, 1, n) for k in members)
        for op in (hvd.Min, hvd.Max):
            x = leaf(torch.full((1, WIDTH), float(R + 1)), dt)  # distinct: the extremum is one rank's
            y = hvd.allreduce(x, name=f"hg.ar.{label}.{op.name}", op=op, process_set=ps)
            backward([y], [coef(R, 1, n)])
            holder = members[0] if op is hvd.Min else members[-1]
            results.append((f"{label} {op.name}", x.grad, total if R == holder else torch.zeros_like(total)))
        x = leaf(torch.full((1, WIDTH), float(R + 2)), dt)
        y = hvd.allreduce(x, name=f"hg.ar.{label}.prod", op=hvd.Product, process_set=ps)
        backward([y], [coef(R, 1, n)])
        others = 1.0
        for k in members:
            others *= k + 2 if k != R else 1
        results.append((f"{label} Product", x.grad, total * others))
    compare(results)


@check
def allgather():
    """Horovod: allreduce(grad, Average, process_set), then this rank's rows."""
    results = []
    for label, ps, members, me, dt in cases():
        n = len(members)
        total_rows = sum(k + 1 for k in members)
        x = leaf(torch.full((R + 1, WIDTH), float(R)), dt)  # uneven first dims
        y = hvd.allgather(x, name=f"hg.ag.{label}", process_set=ps)
        backward([y], [coef(R, total_rows, n)])
        start = sum(k + 1 for k in members[:me])
        avg = sum(coef(k, total_rows, n) for k in members) / n
        results.append((label, x.grad, avg[start:start + R + 1]))
    compare(results)


@check
def broadcast():
    """Horovod: allreduce(grad, Average, process_set) at the root, zero elsewhere."""
    results = []
    for label, ps, members, me, dt in cases():
        n = len(members)
        root = members[-1] if ps is hvd.global_process_set else members[0]  # never rank 0's index alone
        x = leaf(torch.full((2, WIDTH), float(R)), dt)
        y = hvd.broadcast(x, root, name=f"hg.bc.{label}", process_set=ps)
        backward([y], [coef(R, 2, n)])
        avg = sum(coef(k, 2, n) for k in members) / n
        results.append((f"{label} root {root}", x.grad, avg if R == root else torch.zeros_like(avg)))
    compare(results)


@check
def reducescatter():
    """Horovod: allgather(grad × (n for Sum) × prescale × postscale, process_set)."""
    results = []
    for label, ps, members, me, dt in cases():
        n = len(members)
        d0 = 2 * n + 1  # uneven parts
        for op in (hvd.Sum, hvd.Average):
            for pre, post in ((1.0, 1.0), (0.5, 4.0)):
                x = leaf(torch.full((d0, WIDTH), float(R)), dt)
                y = hvd.reducescatter(x, name=f"hg.rs.{label}.{op.name}.{pre}", op=op, process_set=ps,
                                      prescale_factor=pre, postscale_factor=post)
                backward([y], [coef(R, rows_of(d0, n, me)[1], n)])
                gathered = torch.cat([coef(k, rows_of(d0, n, j)[1], n) for j, k in enumerate(members)])
                want = gathered * (n if op is hvd.Sum else 1) * pre * post
                results.append((f"{label} {op.name} pre={pre} post={post}", x.grad, want))
    compare(results)


def a2a_splits(sender, receiver):
    """Rows member `sender` sends member `receiver` (indices in the set)."""
    return (sender + 2 * receiver) % 3


@check
def alltoall():
    """Horovod: alltoall(grad, splits=the received splits, process_set)."""
    results = []
    for label, ps, members, me, dt in cases():
        n = len(members)
        splits = [a2a_splits(me, j) for j in range(n)]
        x = leaf(torch.full((sum(splits), WIDTH), float(R)), dt)
        y, received = hvd.alltoall(x, splits=splits, name=f"hg.a2a.{label}", process_set=ps)
        backward([y], [coef(R, sum(a2a_splits(j, me) for j in range(n)), n)])
        # What this rank sent member j comes back as the rows of j's coefficients that it
        # received from this rank: after those from the members before this one.
        parts = []
        for j, k in enumerate(members):
            at = sum(a2a_splits(i, j) for i in range(me))
            parts.append(coef(k, sum(a2a_splits(i, j) for i in range(n)), n)[at:at + splits[j]])
        results.append((label, x.grad, torch.cat(parts)))
        results.append((f"{label} received", received.double(),
                        torch.tensor([a2a_splits(j, me) for j in range(n)], dtype=torch.float64)))
    compare(results)


@check
def grouped_allreduce():
    """Horovod: grouped_allreduce(grads, op, prescale, postscale, process_set)."""
    results = []
    for label, ps, members, me, dt in cases():
        n = len(members)
        for op in (hvd.Sum, hvd.Average):
            pre, post = 4.0, 0.5
            a, b = leaf(torch.full((1, WIDTH), float(R)), dt), leaf(torch.full((2, WIDTH), float(R)), dt)
            ya, yb = hvd.grouped_allreduce([a, b], name=f"hg.gar.{label}.{op.name}", op=op, prescale_factor=pre,
                                           postscale_factor=post, process_set=ps)
            backward([ya, yb], [coef(R, 1, n), coef(R, 2, n, salt=1)])
            for what, got, rows, salt in (("a", a.grad, 1, 0), ("b", b.grad, 2, 1)):
                total = sum(coef(k, rows, n, salt) for k in members)
                results.append((f"{label} {op.name} {what}", got, (total if op is hvd.Sum else total / n) * pre * post))
    compare(results)


@check
def grouped_allgather():
    """Horovod: grouped_allreduce(grads, Average, process_set), then this rank's rows of each."""
    results = []
    for label, ps, members, me, dt in cases():
        n = len(members)
        a, b = leaf(torch.full((R + 1, WIDTH), float(R)), dt), leaf(torch.full((2, WIDTH), float(R)), dt)
        ga, gb = hvd.grouped_allgather([a, b], name=f"hg.gag.{label}", process_set=ps)
        rows_a, rows_b = sum(k + 1 for k in members), 2 * n
        backward([ga, gb], [coef(R, rows_a, n), coef(R, rows_b, n, salt=1)])
        avg_a = sum(coef(k, rows_a, n) for k in members) / n
        avg_b = sum(coef(k, rows_b, n, 1) for k in members) / n
        start = sum(k + 1 for k in members[:me])
        results.append((f"{label} a", a.grad, avg_a[start:start + R + 1]))
        results.append((f"{label} b", b.grad, avg_b[2 * me:2 * me + 2]))
    compare(results)


@check
def grouped_reducescatter():
    """Horovod: grouped_allgather(grads × (n for Sum) × prescale × postscale, process_set)."""
    results = []
    for label, ps, members, me, dt in cases():
        n = len(members)
        for op in (hvd.Sum, hvd.Average):
            pre, post = 2.0, 2.0
            sizes = (2 * n + 1, n)
            xs = [leaf(torch.full((d0, WIDTH), float(R)), dt) for d0 in sizes]
            ys = hvd.grouped_reducescatter(xs, name=f"hg.grs.{label}.{op.name}", op=op, process_set=ps,
                                           prescale_factor=pre, postscale_factor=post)
            backward(ys, [coef(R, rows_of(d0, n, me)[1], n, salt) for salt, d0 in enumerate(sizes)])
            for salt, (x, d0) in enumerate(zip(xs, sizes)):
                gathered = torch.cat([coef(k, rows_of(d0, n, j)[1], n, salt) for j, k in enumerate(members)])
                results.append((f"{label} {op.name} member {salt}", x.grad,
                                gathered * (n if op is hvd.Sum else 1) * pre * post))
    compare(results)


sys.exit(1 if run_all(R) else 0)
