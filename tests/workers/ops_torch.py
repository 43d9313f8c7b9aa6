"""shoal.torch: every op and dtype on torch tensors (bfloat16 included), torch.compile,
and a BlueFog-style script run through `import shoal.torch as bf`."""
import sys

import numpy as np
import torch

import shoal
import shoal.torch as bf
from checks import Skip, check, raises, run_all

bf.init()
R, N = bf.rank(), bf.size()
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
          torch.int32, torch.int64]


def base(dtype):
    return (torch.arange(6) % 3).reshape(2, 3).to(dtype)


@check
def allreduce_every_dtype():
    for dt in DTYPES:
        got = bf.allreduce(base(dt) * (R + 1), average=False, name=f"t.sum.{dt}")
        assert got.dtype == dt and torch.equal(got, (base(torch.int64) * (N * (N + 1) // 2)).to(dt)), (dt, got)
        if dt.is_floating_point:
            acc = torch.float32 if dt in (torch.float16, torch.bfloat16) else dt
            want = (base(acc) * (N * (N + 1) // 2) / N).to(dt)
            got = bf.allreduce(base(dt) * (R + 1), name=f"t.avg.{dt}")
            assert torch.equal(got, want), (dt, got, want)


@check
def inplace_and_nonblocking():
    x = torch.full((3,), float(R))
    h = bf.allreduce_nonblocking_(x, average=False, name="t.inplace")
    assert bf.synchronize(h) is x and torch.equal(x, torch.full((3,), N * (N - 1) / 2))
    h = bf.allreduce_nonblocking(torch.ones(2), name="t.nb")
    assert torch.equal(bf.wait(h), torch.ones(2))


@check
def nonblocking_and_inplace_every_dtype_exact():
    # The C entries (plain tensors) and the Python path (a non-contiguous view, a tensor
    # that requires grad) give the same exact sums; what they refuse raises as before.
    for dt in DTYPES:
        want = (base(torch.int64) * (N * (N + 1) // 2)).to(dt)
        x = base(dt) * (R + 1)
        strided = torch.stack([x, x], dim=-1)[..., 0]  # x's values, not contiguous
        for t in (x, strided):
            got = bf.synchronize(bf.allreduce_nonblocking(t, average=False, name=f"t.nb.{dt}"))
            assert got.dtype == dt and torch.equal(got, want), (dt, t.is_contiguous(), got)
        y = x.clone()
        assert bf.synchronize(bf.allreduce_nonblocking_(y, False, False, f"t.nb_.{dt}")) is y and torch.equal(y, want)
        y = x.clone()
        assert bf.allreduce_(y, average=False, name=f"t.ar_.{dt}") is y and torch.equal(y, want), (dt, y)
        if dt.is_floating_point:
            g = x.clone().requires_grad_()
            got = bf.synchronize(bf.allreduce_nonblocking(g, average=False, name=f"t.nb.g.{dt}"))
            assert torch.equal(got, want), (dt, got)
            try:
                bf.allreduce_nonblocking_(g, average=False, name=f"t.nb_.g.{dt}")
            except ValueError as e:
                assert "autograd" in str(e), e
            else:
                raise AssertionError("an in-place allreduce of a tensor autograd records was accepted")
        else:
            try:
                bf.allreduce_nonblocking(x, name=f"t.nb.avg.{dt}")
            except ValueError as e:
                assert "average" in str(e), e
            else:
                raise AssertionError(f"an average of {dt} was accepted")
    h = bf.neighbor_allreduce_nonblocking(torch.full((3,), float(R)), name="t.nar.nb")
    got = bf.synchronize(h)
    assert torch.equal(got, bf.neighbor_allreduce(torch.full((3,), float(R)).requires_grad_(), name="t.nar.ref")), got
    try:
        bf.synchronize(h)
    except ValueError as e:
        assert "unknown handle" in str(e), e
    else:
        raise AssertionError("a handle was synchronized twice")


@check
def broadcast_and_allgather_every_dtype():
    for dt in DTYPES + [torch.bool]:
        x = torch.full((2,), R % 2 == 1) if dt == torch.bool else base(dt) + R
        root = N - 1
        want = torch.full((2,), root % 2 == 1) if dt == torch.bool else base(dt) + root
        assert torch.equal(bf.broadcast(x, root, name=f"t.bc.{dt}"), want), dt
        assert torch.equal(bf.broadcast_(x, root, name=f"t.bc_.{dt}"), want) and torch.equal(x, want), dt
        y = torch.full((R % 3, 2), R).to(dt)
        got = bf.allgather(y, name=f"t.ag.{dt}")
        want = torch.cat([torch.full((r % 3, 2), r).to(dt) for r in range(N)])
        assert got.dtype == dt and torch.equal(got, want), (dt, got)


@check
def neighbor_allreduce_float_dtypes():
    ins = bf.in_neighbor_ranks()
    for dt in [torch.float16, torch.bfloat16, torch.float32, torch.float64]:
        acc = torch.float32 if dt in (torch.float16, torch.bfloat16) else dt
        total = sum((base(acc) * (j + 1) for j in ins), base(acc) * (R + 1))
        want = (total / (len(ins) + 1)).to(dt)
        got = bf.neighbor_allreduce(base(dt) * (R + 1), name=f"t.nbr.{dt}")
        assert got.dtype == dt and torch.equal(got, want), (dt, got, want)


@check
def neighbor_allreduce_weighted_graph_bfloat16():
    import numpy as np
    rng = np.random.default_rng(5)  # same graph on every rank
    w = rng.random((N, N)) * (rng.random((N, N)) < 0.6) + np.eye(N)
    w /= w.sum(axis=0, keepdims=True)
    bf.set_topology(bf.topology.from_mixing_matrix(w), is_weighted=True)
    x_all = torch.stack([base(torch.float32).flatten() * (j + 1) for j in range(N)])
    want = torch.from_numpy(w.T @ x_all.double().numpy())[R].float()
    for dt, tol in [(torch.float32, 1e-6), (torch.float64, 1e-6), (torch.bfloat16, 2e-2)]:
        got = bf.neighbor_allreduce(x_all[R].to(dt), name=f"t.nbr.w.{dt}")
        assert got.dtype == dt and torch.allclose(got.float(), want, rtol=tol, atol=tol), (dt, got, want)
    bf.set_topology(bf.topology.exponential_two_graph(N))


@check
def compiled_fullgraph():
    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(x):
        b = bf.broadcast(x + 1, N - 1, name="t.compiled.bc")  # N on every rank
        y = bf.allreduce(x * 2 + b, average=False, name="t.compiled.ar")
        return bf.neighbor_allreduce(y + 1, name="t.compiled.nbr")

    out = step(torch.full((4,), float(R)))
    assert torch.equal(out, torch.full((4,), float(N * (N - 1) + N * N + 1))), out


@check
def compiled_graph_reaches_the_core_in_c():
    # A compiled graph calls the registered ops' kernels at every step: for a plain tensor
    # the C kernels (bindings/python/registered_kernels.cc), none of the Python op layer,
    # whose frames cost a compiled call several times the eager call's CPU.
    from shoal import _ops as op_layer
    from shoal.torch import _ops as torch_ops

    # aot_eager: the traced graph as it is (inductor would need a C++ compiler for `x + b`,
    # and test_ops.py also runs this worker without one).
    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(x):
        b = bf.broadcast(x, N - 1, name="t.kernel.bc")
        y = bf.allreduce(x + b, name="t.kernel.ar")
        return bf.neighbor_allreduce(y, name="t.kernel.nbr")

    x = torch.full((4,), float(R + 1))
    want = torch.full((4,), (N * (N + 1) / 2 + N * N) / N)  # every rank's y: mean(R + 1) + N
    assert torch.equal(step(x), want)  # traced and compiled here
    python_layer = {f.__code__ for f in (op_layer._submit, op_layer.allreduce, op_layer.broadcast,
                                         op_layer.neighbor_allreduce_submit, torch_ops._allreduce_impl,
                                         torch_ops._broadcast_impl, torch_ops._neighbor_impl)}
    called = set()
    sys.setprofile(lambda frame, event, arg: called.add(frame.f_code) if event == "call" else None)
    try:
        out = step(x)
    finally:
        sys.setprofile(None)
    assert torch.equal(out, want), out
    assert not called & python_layer, sorted(c.co_name for c in called & python_layer)


@check
def compiled_allgather_and_reducescatter_exact():
    # Both stay in the graph (fullgraph): the floating reducescatter asks nothing of the
    # core at trace time; values exact, as eagerly. torch 2.4's dynamo cannot trace the op
    # layer's thread-local flag (shoal/_ops.py), 2.13 and 2.14 can (the versions CI runs):
    # below 2.13 a graph break is allowed.
    whole = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)

    @torch.compile(fullgraph=whole, backend="aot_eager")  # no C++ compiler needed (see above)
    def step(x):
        return bf.allgather(x, name="t.compiled.ag"), bf.reducescatter(x * 2, name="t.compiled.rs")

    x = torch.arange(2.0 * N) + R
    gathered, scattered = step(x)
    assert torch.equal(gathered, torch.cat([torch.arange(2.0 * N) + r for r in range(N)])), gathered
    # rows 2R and 2R + 1 of the average of 2 * (arange + r): 2 * (row + mean(r))
    assert torch.equal(scattered, 2 * (torch.arange(2.0 * R, 2.0 * R + 2) + (N - 1) / 2)), scattered


@check
def compiled_one_peer_schedule_one_graph_per_peer():
    # A one-peer schedule (BlueFog's dynamic topology) through torch.compile: the resolved
    # peers are the graph's constants, so one graph per distinct peer (log2(n) of them),
    # none again after the first round, no graph break (fullgraph), exact values.
    if N == 1:
        raise Skip("one rank has no peer")
    from torch._dynamo.utils import counters
    tau = (N - 1).bit_length()
    for dynamic in (False, None):
        step = torch.compile(lambda x, s, d: bf.neighbor_allreduce(
            x, self_weight=0.5, src_weights={s: 0.5}, dst_weights=[d], enable_topo_check=False,
            name="t.compiled.onepeer"), fullgraph=True, dynamic=dynamic)
        x = torch.full((3,), float(R + 1))
        graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
        for t in range(3 * tau):
            if t == tau:
                assert counters["stats"]["unique_graphs"] - graphs == tau, (dynamic, counters["stats"])
            k = 2 ** (t % tau)
            got = step(x, (R - k) % N, (R + k) % N)
            assert torch.equal(got, torch.full((3,), (R + 1 + (R - k) % N + 1) * 0.5)), (dynamic, t, got)
        assert counters["stats"]["unique_graphs"] - graphs == tau, (dynamic, counters["stats"])
        assert sum(counters["graph_break"].values()) == breaks, counters["graph_break"]


@check
def integer_average_per_api():
    # README, Dtypes: which calls truncate an integer average toward zero (Horovod's, exact:
    # the sum, then integer division) and which refuse it with ValueError; inside
    # torch.compile as eagerly.
    x = torch.tensor([3 * R + 1, -(3 * R + 1)], dtype=torch.int32)
    s = sum(3 * r + 1 for r in range(N))  # 22 on 4 ranks: 5.5 -> [5, -5]; 5 on 2: [2, -2]
    want = torch.tensor([s // N, -(s // N)], dtype=torch.int32)
    assert torch.equal(bf.allreduce(x, name="t.intavg.a"), want)
    assert torch.equal(bf.allreduce(x, op=bf.Average, name="t.intavg.b"), want)
    assert torch.equal(bf.synchronize(bf.allreduce_async(x, name="t.intavg.c")), want)
    assert torch.equal(bf.grouped_allreduce([x], name="t.intavg.d")[0], want)
    raises(ValueError, bf.allreduce_nonblocking, x, name="t.intavg.e")
    for backend in ("aot_eager", "inductor"):
        compiled = torch.compile(lambda t: bf.allreduce(t, name="t.intavg.f"), fullgraph=True, backend=backend)
        got = compiled(x)
        assert got.dtype == torch.int32 and torch.equal(got, want), (backend, got)
    local = torch.compile(lambda t: bf.allreduce(t, is_hierarchical_local=True, name="t.intavg.l"), fullgraph=True)
    ls, ln = bf.local_size(), bf.local_rank()
    s_local = sum(3 * (R - ln + j) + 1 for j in range(ls))  # this machine's ranks
    assert torch.equal(local(x), torch.tensor([s_local // ls, -(s_local // ls)], dtype=torch.int32))
    raises(ValueError, shoal.allreduce, x.numpy(), name="t.intavg.g")
    raises(ValueError, bf.neighbor_allreduce, x, name="t.intavg.h")
    assert torch.equal(bf.allreduce(x, op=bf.Sum, name="t.intavg.i"), torch.tensor([s, -s], dtype=torch.int32))


@check
def bluefog_script():
    # The body of a BlueFog average-consensus script, unchanged but for the import.
    bf.set_topology(bf.topology.ExponentialTwoGraph(bf.size()))
    x = torch.full((3,), float(bf.rank()))
    for _ in range(10):
        x = bf.neighbor_allreduce(x)
    mean = bf.allreduce(torch.full((3,), float(bf.rank())))
    assert torch.allclose(x, mean, atol=1e-2), (x, mean)


@check
def lazily_negated_tensors_give_their_values():
    # A _neg_view's memory holds -x: every path reads the values, not the memory.
    x = torch._neg_view(torch.full((3,), float(R + 1)))
    want = torch.full((3,), -float(N))
    assert torch.equal(bf.broadcast(x, N - 1, name="t.neg.bc"), want)
    assert torch.equal(bf.synchronize(bf.broadcast_nonblocking(x, N - 1, name="t.neg.bc.nb")), want)
    total = -float(N * (N + 1) // 2)
    assert torch.equal(bf.allreduce(x, average=False, name="t.neg.ar"), torch.full((3,), total))
    assert torch.equal(bf.synchronize(bf.allreduce_nonblocking(x, average=False, name="t.neg.ar.nb")),
                       torch.full((3,), total))


@check
def outputs_are_reused_only_when_unobservable():
    """With the compiled tensor access (bindings/torch/torch_tensors.cc) a small output that
    nothing refers to any more is handed out again; anything that can still see one (a
    reference, a view, a weak reference, a numpy array, a parameter's .data) keeps its
    values through later ops, memory a user swapped in is never written, and no output
    carries an earlier user's attribute, requires_grad, class, size of memory or inference
    mode. Without it (no C++ compiler) every output is new. vmap's tensors (no storage of
    their own) take the Python path."""
    import weakref
    compiled = bf._adapter.TorchAdapter.torch_api.compiled is not None
    x = torch.arange(6, dtype=torch.float64) + R
    total = float(N * (N - 1) // 2)

    def expected(k):
        xk = x + 10 * k
        return xk, [N * (xk - R) + total, xk, xk - R + (N - 1)][k % 3]

    def op(k):  # rotates the entry points; each result is exact, and differs from the others
        fn = [lambda t: bf.allreduce(t, average=False, name="t.reuse.ar"),
              lambda t: bf.neighbor_allreduce(t, self_weight=1.0, src_weights={}, dst_weights=[],
                                              enable_topo_check=False, name="t.reuse.nar"),
              lambda t: bf.broadcast(t, N - 1, name="t.reuse.bc")][k % 3]
        xk, want = expected(k)
        out = fn(xk)
        assert torch.equal(out, want), (k, out, want)
        return out

    out = op(0)
    out.add_(0)  # version 1: a new tensor has version 0
    del out
    assert (op(3)._version > 0) == compiled, "an unobserved output is handed out again exactly when compiled"

    class Marked(torch.Tensor):
        pass

    def grow(t):
        if compiled:  # (torch.from_numpy's outputs cannot grow)
            t.resize_(1 << 16)
            t.resize_(6)

    # Changed by its user, then dropped: the next output of the same shape shows no trace.
    for change in (lambda t: setattr(t, "mark", 1), lambda t: t.requires_grad_(),
                   lambda t: setattr(t, "__class__", Marked), grow):
        out = op(0)
        change(out)
        del out
        out = op(3)
        assert not hasattr(out, "mark") and not out.requires_grad and type(out) is torch.Tensor, \
            "an output carries an earlier user's state"
        assert out.untyped_storage().nbytes() == 6 * 8, "a grown tensor was kept"
        del out
    y = torch.ones(1, 6, dtype=torch.float64)
    out = bf.allreduce(y, average=False, name="t.reuse.strided")
    out.as_strided_((1, 6), (100, 1))  # a size-1 dimension's stride: still "contiguous"
    del out
    assert bf.allreduce(y, average=False, name="t.reuse.strided").stride() == (6, 1), "an earlier user's strides"

    # A finalizer that runs while the pool lets a changed tensor go, and calls an op of the
    # same shape, gets a tensor of its own.
    inner = []

    class Again:
        def __del__(self):
            inner.append(op(6))  # noqa: F821  (runs before the `del inner` below)

    out = op(0)
    out.mark = Again()
    del out
    outer = op(3)
    assert len(inner) == 1 and inner[0] is not outer, "one tensor handed to two callers"
    assert torch.equal(inner[0], expected(6)[1]) and torch.equal(outer, expected(3)[1])
    del inner, outer
    with torch.inference_mode():
        out = op(0)
    del out
    assert not op(3).is_inference(), "an inference tensor outside inference mode"
    out = op(0)
    del out
    with torch.inference_mode():
        assert op(3).is_inference(), "a normal tensor inside inference mode"

    # Still seen from elsewhere: its values stay through every later op.
    seen = []  # (what the keeper still sees, or None once nothing does; the values it must see)
    for k in range(6):
        out = op(k)
        values = out.detach().clone()
        if k == 0:
            seen.append((lambda o=out: o, values))
        elif k == 1:
            seen.append((lambda v=out[1:]: v, values[1:]))
        elif k == 2:
            seen.append((weakref.ref(out), values))
        elif k == 3:
            seen.append((lambda a=out.numpy(): torch.from_numpy(a), values))
        elif k == 4:
            p = torch.nn.Parameter(torch.empty(0, dtype=torch.float64))
            p.data = out
            seen.append((lambda p=p: p.detach(), values))
        else:  # its memory replaced by the user's: never written again
            mine = np.zeros(6)
            out.data = torch.from_numpy(mine)
            seen.append((lambda a=mine: torch.from_numpy(a), torch.zeros(6, dtype=torch.float64)))
        del out
    for k in range(12):  # every entry point, again and again
        op(k)
    for k, (read, values) in enumerate(seen):
        now = read()
        assert now is None or torch.equal(now, values), f"keeper {k}: an output it still sees was overwritten"
    batched = torch.vmap(lambda v: bf.allreduce(v, average=False, name="t.reuse.vmap"))(torch.ones(3, 4))
    assert torch.equal(batched, torch.full((3, 4), float(N))), batched


@check
def rejects_bad_input():
    for bad, exc in [(lambda: bf.allreduce([1.0, 2.0]), TypeError),
                     (lambda: bf.neighbor_allreduce(torch.ones(2, dtype=torch.int32)), ValueError),
                     (lambda: bf.allreduce_(torch.ones(4, 4).t()), ValueError),
                     (lambda: bf.broadcast(torch.ones(2), N), ValueError),
                     (lambda: bf.broadcast(torch.ones(2), True), TypeError),
                     (lambda: bf.broadcast(torch.ones(2), 2**70), ValueError),
                     (lambda: bf.broadcast(torch.ones(2, requires_grad=True), True), TypeError),
                     (lambda: bf.broadcast_(torch.ones(2), -1), ValueError),
                     (lambda: bf.neighbor_allreduce(torch.ones(2), self_weight=0.5), ValueError)]:
        try:
            bad()
        except exc:
            continue
        raise AssertionError(f"{bad} did not raise {exc}")


sys.exit(1 if run_all(R) else 0)
