"""Horovod PyTorch scripts with only the import changed (`import shoal.torch as hvd`; issue
17): a synthetic-benchmark-style training loop (small ResNet-style model,
broadcast_parameters / broadcast_optimizer_state, DistributedOptimizer with Horovod's
keywords) checked against a one-process reference computed here from every rank's data;
exact values of the Horovod op aliases; the clear refusals (bad process sets, Adasum).
Our own scripts, written the way Horovod's examples use the API (not copies)."""
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import shoal.torch as hvd
from checks import check, raises, run_all

torch.set_num_threads(1)  # deterministic CPU kernels: a rank's gradient equals the reference's
hvd.init()
R, N = hvd.rank(), hvd.size()
FP16_EPS = 2.0 ** -10  # spacing of float16 numbers in [1, 2): one rounding is at most half of it
FP16_TINY = 2.0 ** -24  # smallest float16 subnormal


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))


class TinyResNet(nn.Module):
    def __init__(self, classes=5):
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.block = Block(8)
        self.fc = nn.Linear(8, classes)

    def forward(self, x):
        x = self.block(F.relu(self.bn(self.stem(x))))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def batch(step, k, rank):
    """The synthetic batch of `rank` at (step, pass k): every rank can make anyone's."""
    g = torch.Generator().manual_seed(1000 * step + 10 * k + rank)
    return torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)


def model_of(rank):
    torch.manual_seed(rank)  # different on every rank until broadcast_parameters
    return TinyResNet()


def rank_gradients(model, step, rank, passes):
    """{name: gradient} of `rank`'s `passes` accumulated backward passes at `step`."""
    model.zero_grad(set_to_none=True)
    for k in range(passes):
        x, y = batch(step, k, rank)
        F.cross_entropy(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def same_on_all_ranks(model, what):
    for n, p in model.named_parameters():
        every = hvd.allgather(p.detach().reshape(1, -1), name=f"hvd.same.{what}.{n}")
        assert torch.equal(every, every[:1].expand_as(every)), f"{what}: {n} differs between ranks"


STEPS, PASSES, LR, MOMENTUM = 3, 2, 0.05, 0.9


@check
def synthetic_benchmark_fp16_average_backward_passes_2():
    model = model_of(R)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR * (1 + R), momentum=MOMENTUM)  # lr differs
    # Horovod's benchmark: broadcast state from rank 0, then wrap the optimizer.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    assert optimizer.param_groups[0]["lr"] == LR, optimizer.param_groups[0]["lr"]  # rank 0's
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=hvd.Compression.fp16, backward_passes_per_step=2,
                                         op=hvd.Average)
    ref, probe = model_of(0), model_of(0)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), f"broadcast_parameters: {n} is not rank 0's"
    # The reference: plain SGD with momentum on the fp16-compressed average, and a bound
    # on the parameter error that the fp16 rounding of the average allows (one rounding
    # per element per step, carried through momentum).
    ref_params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    buf = {n: torch.zeros_like(p) for n, p in ref_params.items()}
    buf_err = {n: torch.zeros_like(p) for n, p in ref_params.items()}
    bound = {n: torch.zeros_like(p) for n, p in ref_params.items()}
    for step in range(STEPS):
        optimizer.zero_grad()
        for k in range(PASSES):
            x, y = batch(step, k, R)
            F.cross_entropy(model(x), y).backward()
        optimizer.synchronize()
        # The reference's average: every rank's gradient at this step's parameters, each
        # cast to fp16, summed, divided by N and rounded to fp16 once (the core sums half
        # types in float32). The wrapper's may differ by one fp16 rounding. (Taken at the
        # wrapper's parameters, not along a path of its own: one rounding that differs
        # moves a path off by more than fp16 rounding after a few steps.)
        probe.load_state_dict(model.state_dict())
        per_rank = [rank_gradients(probe, step, r, PASSES) for r in range(N)]
        with torch.no_grad():
            for n, p in model.named_parameters():
                assert torch.equal(p.grad.half().float(), p.grad), f"{n}: the average did not travel as fp16"
                avg = (sum(g[n].half().float() for g in per_rank) / N).half().float()
                step_err = FP16_EPS * avg.abs() + FP16_TINY
                assert torch.all((p.grad - avg).abs() <= step_err), (n, (p.grad - avg).abs().max())
                buf[n].mul_(MOMENTUM).add_(avg)
                buf_err[n].mul_(MOMENTUM).add_(step_err)
                ref_params[n].sub_(LR * buf[n])
                bound[n].add_(LR * buf_err[n])
        with optimizer.skip_synchronize():
            optimizer.step()
    same_on_all_ranks(model, "fp16")
    for n, p in model.named_parameters():
        err = (p.detach() - ref_params[n]).abs()
        allowed = 2 * bound[n] + 1e-6 * ref_params[n].abs()  # float32 rounding of the update
        assert torch.all(err <= allowed), (n, err.max(), allowed.min())
    optimizer.remove_hooks()


@check
def compression_none_sum_predivide_and_shoal_form():
    """Compression.none: the gradients are the reference's up to float32 rounding of the sum."""
    for what, kwargs, scale in [("sum", {"op": hvd.Sum}, 1.0),
                                ("predivide", {"op": hvd.Average, "gradient_predivide_factor": 4.0}, 1.0 / N)]:
        model = model_of(0)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), model.named_parameters(),
                                       hvd.Compression.none, 1, **kwargs)  # Horovod's positional order
        x, y = batch(7, 0, R)
        F.cross_entropy(model(x), y).backward()
        opt.synchronize()
        ref, _probe = model_of(0), model_of(0)
        per_rank = [rank_gradients(ref, 7, r, 1) for r in range(N)]
        for n, p in model.named_parameters():
            want = sum(g[n].double() for g in per_rank) * scale
            tol = 4 * N * 2.0 ** -24 * sum(g[n].double().abs() for g in per_rank) + 1e-30
            assert torch.all((p.grad.double() - want).abs() <= tol), (what, n, (p.grad.double() - want).abs().max())
        with opt.skip_synchronize():
            opt.step()
        same_on_all_ranks(model, what)
        opt.remove_hooks()
    # sparse_as_dense: a sparse embedding gradient is densified, averaged, and sparse again
    # (Horovod's conversion back, so SparseAdam still gets a sparse gradient).
    emb = nn.Embedding(N, 2, sparse=True)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=LR), emb.named_parameters(),
                                   sparse_as_dense=True)
    emb(torch.tensor([R])).sum().backward()
    opt.synchronize()
    assert emb.weight.grad.layout == torch.sparse_coo, emb.weight.grad.layout
    assert torch.equal(emb.weight.grad.to_dense(), torch.full((N, 2), 1.0 / N))
    opt.remove_hooks()
    # Shoal's own form keeps working: (optimizer, model, num_steps_per_communication).
    model = model_of(0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), model, 2)
    assert isinstance(opt, hvd.DistributedGradientAllreduceOptimizer) and opt.num_steps_per_communication == 2
    opt.remove_hooks()
    raises(ValueError, hvd.DistributedOptimizer, torch.optim.SGD(model.parameters(), lr=LR),
           [("w", p) for p in model.parameters()])  # duplicate names
    try:  # some of the optimizer's parameters not named (Horovod's check and wording)
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), list(model.named_parameters())[:1])
    except ValueError as e:
        assert "named_parameters was specified, but" in str(e) and "not named" in str(e), e
    else:
        raise AssertionError("parameters missing from named_parameters were accepted")
    raises(ValueError, hvd.DistributedOptimizer, torch.optim.SGD(model.parameters(), lr=LR),
           op=hvd.Sum, gradient_predivide_factor=2.0)


def ones(dtype=torch.float32):
    return torch.ones(3, dtype=dtype)


@check
def alias_ops_exact_values():
    x = torch.arange(3, dtype=torch.float32) + R  # sum: 3i + N(N-1)/2 per element
    total = torch.arange(3, dtype=torch.float32) * N + N * (N - 1) / 2
    h = hvd.allreduce_async(x, name="hvd.async", op=hvd.Sum)
    assert torch.equal(hvd.synchronize(h), total) and torch.equal(x, torch.arange(3.0) + R)
    y = x.clone()
    assert torch.equal(hvd.synchronize(hvd.allreduce_async_(y, name="hvd.async_")), total / N)
    assert torch.equal(y, total / N)  # in place, averaged by default
    # prescale then sum then postscale (Horovod's allreduce docs: "multiplicative factor to
    # scale tensor before / after allreduce"); powers of two: exact.
    got = hvd.allreduce(x, name="hvd.scaled", op=hvd.Sum, prescale_factor=0.5, postscale_factor=4.0)
    assert torch.equal(got, total * 2), got
    got = hvd.synchronize(hvd.allreduce_async(x, name="hvd.scaled.avg", prescale_factor=2.0, postscale_factor=0.5))
    assert torch.equal(got, total / N), got
    # Horovod's positional order (tensor, average, name, compression, op) and BlueFog's.
    assert torch.equal(hvd.allreduce(x, None, "hvd.pos", hvd.Compression.none, hvd.Sum), total)
    assert torch.equal(hvd.allreduce(x, False, False, "hvd.bluefog.pos"), total)
    z = x.clone()
    assert hvd.allreduce_(z, None, "hvd.pos_", hvd.Sum, 2.0) is z and torch.equal(z, total * 2)
    # fp16 compression: travels as float16, comes back in the input's dtype.
    got = hvd.allreduce(x, name="hvd.fp16", compression=hvd.Compression.fp16, op=hvd.Sum)
    assert got.dtype == torch.float32 and torch.equal(got, total)
    t, ctx = hvd.Compression.fp16.compress(x)
    assert t.dtype == torch.float16 and hvd.Compression.fp16.decompress(t, ctx).dtype == torch.float32
    t, ctx = hvd.Compression.bf16.compress(x)
    assert t.dtype == torch.bfloat16 and torch.equal(hvd.Compression.bf16.decompress(t, ctx), x)
    # Integer average: Horovod's convention (sum times 1/size converted to the integer
    # type: truncated toward zero). x_r = -(r + 1): sum -N(N+1)/2, average -(N+1)/2.
    i = torch.full((2,), -(R + 1), dtype=torch.int32)
    want = int(-(N * (N + 1) / 2) / N)  # Python's int() truncates toward zero
    got = hvd.allreduce(i, name="hvd.int.avg")
    assert got.dtype == torch.int32 and got.tolist() == [want] * 2, (got, want)
    assert hvd.synchronize(hvd.allreduce_async(i, name="hvd.int.async")).tolist() == [want] * 2
    assert hvd.allreduce(i, name="hvd.int.sum", op=hvd.Sum).tolist() == [-(N * (N + 1) // 2)] * 2
    # Broadcast and allgather aliases.
    b, root_value = torch.full((2,), float(R)), torch.full((2,), N - 1.0)
    assert torch.equal(hvd.synchronize(hvd.broadcast_async(b, root_rank=N - 1, name="hvd.b")), root_value)
    assert torch.equal(b, torch.full((2,), float(R)))
    assert hvd.synchronize(hvd.broadcast_async_(b, N - 1, "hvd.b_")) is b and torch.equal(b, root_value)
    c = torch.full((2,), float(R))
    assert hvd.broadcast_(c, 0, name="hvd.b.blocking_") is c and torch.equal(c, torch.zeros(2))
    g = hvd.synchronize(hvd.allgather_async(torch.full((R + 1, 2), float(R)), name="hvd.ag"))
    assert torch.equal(g, torch.cat([torch.full((r + 1, 2), float(r)) for r in range(N)]))
    assert torch.equal(hvd.broadcast(b, 0, process_set=hvd.global_process_set), b)


@check
def runtime_failure_is_horovod_internal_error():
    try:
        hvd.allreduce(torch.ones(R + 1), name="hvd.mismatch")  # shapes differ between ranks
    except hvd.HorovodInternalError as e:
        assert "shape" in str(e).lower(), e
    else:
        raise AssertionError("a shape mismatch did not raise HorovodInternalError")
    assert hvd.HorovodInternalError is hvd.ShoalError and issubclass(hvd.HorovodInternalError, RuntimeError)


@check
def bad_process_sets_and_adasum_are_refused_clearly():
    # (Process sets themselves: tests/workers/psets.py.) Something that is not a ProcessSet
    # is a TypeError; a set never added (or removed), a ValueError.
    for other, exc in ((object(), TypeError), (hvd.ProcessSet([0]), ValueError)):
        for call in (lambda: hvd.allreduce(ones(), process_set=other),
                     lambda: hvd.allreduce_async(ones(), process_set=other),
                     lambda: hvd.allreduce_async_(ones(), process_set=other),
                     lambda: hvd.broadcast(ones(), 0, process_set=other),
                     lambda: hvd.allgather(ones(), process_set=other),
                     lambda: hvd.DistributedOptimizer(torch.optim.SGD([nn.Parameter(ones())], lr=1),
                                                      process_set=other)):
            try:
                call()
            except exc as e:
                assert "process_set" in str(e) or "ProcessSet" in str(e), e
            else:
                raise AssertionError(f"process_set={other!r} was accepted")
    for call in (lambda: hvd.allreduce(ones(), op=hvd.Adasum), lambda: hvd.allreduce_async_(ones(), op=hvd.Adasum),
                 lambda: hvd.DistributedOptimizer(torch.optim.SGD([nn.Parameter(ones())], lr=1), op=hvd.Adasum)):
        try:
            call()
        except NotImplementedError as e:
            assert "Adasum" in str(e), e
        else:
            raise AssertionError("op=Adasum was accepted")
    # The runtime is still usable (nothing was left half-submitted).
    assert torch.equal(hvd.allreduce(ones(), name="hvd.after.refusals"), ones())


@check
def job_layout_build_facts_and_timeline():
    assert (hvd.cross_rank(), hvd.cross_size()) == (hvd.machine_rank(), hvd.machine_size())
    assert hvd.cross_rank() == R // hvd.local_size() and hvd.cross_size() * hvd.local_size() == N
    assert hvd.mpi_built() and hvd.mpi_enabled() and not hvd.gloo_built() and not hvd.gloo_enabled()
    assert not (hvd.rocm_built() or hvd.ddl_built() or hvd.ccl_built()) and isinstance(hvd.cuda_built(), bool)
    assert hvd.is_homogeneous() and bool(hvd.nccl_built()) == hvd.nccl_built()
    if not os.environ.get("SHOAL_TIMELINE"):
        raises(ValueError, hvd.start_timeline, "/tmp/never")  # off: as Horovod without HOROVOD_TIMELINE
        hvd.stop_timeline()  # nothing recording: nothing to do
    names = set(hvd.__all__)
    for n in ("allreduce_async", "allreduce_async_", "allreduce_", "allgather_async", "broadcast_async",
              "broadcast_async_", "broadcast_", "cross_rank", "cross_size", "start_timeline", "stop_timeline",
              "HorovodInternalError", "Compression", "global_process_set", "Adasum", "DistributedOptimizer"):
        assert n in names, n


SIZES = [3, 0, 1, 4]  # uneven per-rank batches (rank 1 has none)


def close(got, want, what):
    """float64 batch norm in a different summation order: equal to ~1e-15 relative."""
    assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-10, atol=1e-12), \
        (what, (got - want).abs().max())


def bn_batch(step, rank, shape):
    g = torch.Generator().manual_seed(500 + 10 * step + rank)
    n = SIZES[rank % len(SIZES)]
    return torch.randn(n, *shape, generator=g, dtype=torch.float64) * 3 + 1, \
        torch.randn(n, *shape, generator=g, dtype=torch.float64)


def summed(t, name):
    return hvd.allreduce(t, name=name, op=hvd.Sum)


@check
def sync_batch_norm_equals_batch_norm_on_the_global_batch():
    """Forward, input/weight/bias gradients and running stats of hvd.SyncBatchNorm on uneven
    per-rank batches equal one process's BatchNorm on the concatenated batch (float64)."""
    for shape, momentum in [((3, 2, 2), 0.3), ((3,), None), ((3, 5), 0.1)]:
        c = shape[0]
        sync = hvd.SyncBatchNorm(c, momentum=momentum, dtype=torch.float64)
        ref = {1: nn.BatchNorm1d, 2: nn.BatchNorm1d, 3: nn.BatchNorm2d}[len(shape)](c, momentum=momentum,
                                                                                  dtype=torch.float64)
        with torch.no_grad():
            for m in (sync, ref):
                m.weight.copy_(torch.arange(1.0, c + 1) / 2)
                m.bias.copy_(torch.arange(c) - 1.0)
        for step in range(2):
            x, w = bn_batch(step, R, shape)
            x.requires_grad_(True)
            sync.zero_grad()
            out = sync(x)
            (out * w).sum().backward()
            every = [bn_batch(step, r, shape) for r in range(N)]
            xs = torch.cat([e[0] for e in every]).requires_grad_(True)
            ref.zero_grad()
            ref_out = ref(xs)
            (ref_out * torch.cat([e[1] for e in every])).sum().backward()
            at = sum(SIZES[r % len(SIZES)] for r in range(R))
            mine = slice(at, at + x.shape[0])
            close(out, ref_out[mine].detach(), ("output", shape, step))
            close(x.grad, xs.grad[mine], ("input grad", shape, step))
            close(summed(sync.weight.grad, f"sbn.w.{len(shape)}.{step}"), ref.weight.grad, ("weight grad", shape))
            close(summed(sync.bias.grad, f"sbn.b.{len(shape)}.{step}"), ref.bias.grad, ("bias grad", shape))
            close(sync.running_mean, ref.running_mean, ("running_mean", shape, step))
            close(sync.running_var, ref.running_var, ("running_var", shape, step))
            assert int(sync.num_batches_tracked) == int(ref.num_batches_tracked) == step + 1
        assert not torch.equal(sync.running_var, torch.ones(c)), "running stats were not updated"
        # Eval with running stats: local normalization, as BatchNorm.
        sync.eval(), ref.eval()
        x, _ = bn_batch(5, R, shape)
        close(sync(x), ref(x), ("eval", shape))


@check
def sync_batch_norm_without_running_stats_and_conversion():
    c, shape = 2, (2, 3)
    sync = hvd.SyncBatchNorm(c, track_running_stats=False, dtype=torch.float64).eval()  # batch stats in eval too
    ref = nn.BatchNorm1d(c, track_running_stats=False, dtype=torch.float64).eval()
    x, _ = bn_batch(9, R, shape)
    at = sum(SIZES[r % len(SIZES)] for r in range(R))
    close(sync(x), ref(torch.cat([bn_batch(9, r, shape)[0] for r in range(N)]))[at:at + x.shape[0]], "eval no stats")
    model = hvd.SyncBatchNorm.convert_sync_batchnorm(TinyResNet())
    kinds = [type(m) for m in model.modules()]
    assert nn.BatchNorm2d not in kinds and kinds.count(hvd.SyncBatchNorm) == 3, kinds
    plain = TinyResNet()
    assert hvd.SyncBatchNorm.convert_sync_batchnorm(plain).bn.weight is plain.bn.weight  # parameters shared
    # One value per channel over all ranks' batches: the same ValueError on every rank.
    one = torch.ones(1 if R == 0 else 0, 3, dtype=torch.float64)
    raises(ValueError, hvd.SyncBatchNorm(3, dtype=torch.float64), one)
    raises(ValueError, hvd.SyncBatchNorm(3), torch.ones(3))  # 1-D input
    raises(NotImplementedError, hvd.SyncBatchNorm, 3, process_set=object())


def sparse_of(rank, step=0):
    """Rank `rank`'s sparse [5, 3] tensor: nnz = (rank + step) % 3 entries (0 for some rank),
    a repeated index, small integer values (every sum and average by N = 2 or 4 is exact)."""
    nnz = (rank + step) % 3
    idx = torch.tensor([[(rank + j) % 5 for j in range(nnz)] + [rank % 5] * (nnz > 0)], dtype=torch.int64)
    vals = torch.arange(3.0 * (nnz + (nnz > 0)), dtype=torch.float64).reshape(-1, 3) + rank
    return torch.sparse_coo_tensor(idx, vals, (5, 3), check_invariants=True)


class EmbeddingBag(nn.Module):
    """An embedding with sparse gradients next to a dense layer (the two share a bucket)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(6, 2, sparse=True, dtype=torch.float64)
        self.head = nn.Linear(2, 1, dtype=torch.float64)
        with torch.no_grad():
            self.emb.weight.copy_(torch.arange(12.0).reshape(6, 2) / 4)
            self.head.weight.fill_(0.5), self.head.bias.zero_()

    def forward(self, idx):
        return self.head(self.emb(idx)).sum()


def lookups(step, rank):
    """Rank `rank`'s indices at `step` (rank 0 skips the embedding at step 1)."""
    return None if (step, rank) == (1, 0) else torch.tensor([rank % 6, (rank + step) % 6, 1])


@check
def sparse_gradients_allgathered_or_densified_equal_the_dense_average():
    # hvd.sparse_allreduce_async: the dense form is the sum / average of the dense forms.
    for op, div in [(hvd.Sum, 1), (hvd.Average, N)]:
        got = hvd.sparse_allreduce_async(sparse_of(R), f"sparse.{op.name}", op)()
        assert got.layout == torch.sparse_coo and got.shape == (5, 3)
        want = sum(sparse_of(r).to_dense() for r in range(N)) / div
        assert torch.equal(got.to_dense(), want), (op, got.to_dense(), want)
        assert got._nnz() == sum(sparse_of(r)._nnz() for r in range(N))  # every rank's entries
    raises(ValueError, hvd.sparse_allreduce_async, torch.ones(2), "dense", hvd.Sum)
    raises(NotImplementedError, hvd.sparse_allreduce_async, sparse_of(R), "min", hvd.Min)
    # Ranks that disagree on the values' row shape: the same error everywhere, and the
    # indices' allgather has ended too (the next op runs).
    cols = 2 + (R == 0)
    bad = torch.sparse_coo_tensor(torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, cols), (5, cols))
    raises(hvd.HorovodInternalError, hvd.sparse_allreduce_async(bad, "sparse.bad", hvd.Sum))
    assert torch.equal(hvd.sparse_allreduce_async(sparse_of(R), "sparse.after", hvd.Sum)().to_dense(),
                       sum(sparse_of(r).to_dense() for r in range(N)))
    # DistributedOptimizer on nn.Embedding(sparse=True): allgathered (default) or densified;
    # either way the update is the dense average's, exactly (a replay of every rank's step).
    for as_dense in (False, True):
        model, replay = EmbeddingBag(), EmbeddingBag()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), model.named_parameters(),
                                       sparse_as_dense=as_dense)
        for step in range(2):
            opt.zero_grad()
            idx = lookups(step, R)
            if idx is not None:
                model(idx).backward()
            else:  # no embedding lookup here: only the head has a gradient
                model.head(torch.zeros(1, 2, dtype=torch.float64)).sum().backward()
            opt.synchronize()
            assert model.emb.weight.grad.layout == torch.sparse_coo, (as_dense, step)
            total = {n: torch.zeros_like(p) for n, p in replay.named_parameters()}
            for r in range(N):
                replay.zero_grad()
                i = lookups(step, r)
                (replay(i) if i is not None else replay.head(torch.zeros(1, 2, dtype=torch.float64)).sum()).backward()
                for n, p in replay.named_parameters():
                    if p.grad is not None:
                        total[n] += p.grad.to_dense()
            for n, p in model.named_parameters():
                assert torch.equal(p.grad.to_dense(), total[n] / N), (as_dense, step, n)
            with opt.skip_synchronize():
                opt.step()
            with torch.no_grad():
                for n, p in replay.named_parameters():
                    p -= 0.5 * total[n] / N
        for (n, p), (_, q) in zip(model.named_parameters(), replay.named_parameters()):
            assert torch.equal(p, q), (as_dense, n)
        opt.remove_hooks()
    # SparseAdam needs sparse gradients: it runs with both forms.
    for as_dense in (False, True):
        model = EmbeddingBag()
        opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(model.emb.parameters()), lr=0.1),
                                       [("emb.weight", model.emb.weight)], sparse_as_dense=as_dense)
        model.emb(torch.tensor([R % 6])).sum().backward()
        opt.step()
        same_on_all_ranks(model.emb, f"sparse_adam.{as_dense}")
        opt.remove_hooks()


@check
def elastic_state_and_sampler_for_a_fixed_set_of_ranks():
    """hvd.elastic (torch): run() syncs rank 0's model, optimizer state and attributes and
    the union of the samplers' processed indices, then calls the function once;
    commit/restore keep and bring back state; ElasticSampler shares out what is left."""
    missing = [n for n in ("run", "State", "ObjectState", "TorchState", "ElasticSampler")
               if not hasattr(hvd.elastic, n)]
    assert not missing, missing
    model = model_of(R)  # differs per rank until sync
    optimizer = torch.optim.SGD(model.parameters(), lr=LR * (1 + R), momentum=MOMENTUM)
    data = list(range(10 * N + 3))
    sampler = hvd.elastic.ElasticSampler(data, shuffle=True, seed=5)
    sampler.record_indices([R])  # each rank processed one index: the union (0..N-1) is done
    torch.manual_seed(R)
    aux = torch.nn.Linear(2, 1)  # another module, given by keyword: synced in place (Horovod's handlers)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, aux=aux, batch=0, epoch=R)

    @hvd.elastic.run
    def train(state):
        return state.epoch, list(state.sampler)

    epoch, mine = train(state)
    assert epoch == 0 and optimizer.param_groups[0]["lr"] == LR, (epoch, optimizer.param_groups[0]["lr"])
    same_on_all_ranks(model, "elastic")
    assert state.aux is aux and state.model is model
    same_on_all_ranks(aux, "elastic.aux")
    left = [i for i in data if i >= N]
    every = hvd.allgather_object(mine, name="elastic.shares")
    assert all(len(s) == len(mine) == -(-len(left) // N) for s in every), [len(s) for s in every]
    assert sorted(set(sum(every, []))) == left  # every index left, to some rank (a few twice: padding)
    assert len(sampler) == len(mine) and sampler.get_indices(0, 2) == mine[:2]
    sampler.set_epoch(1)
    assert len(sampler) == -(-len(data) // N) and list(sampler) != mine
    state.commit()
    kept = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    state.epoch = 99
    state.sampler.record_batch(0, 4)
    state.restore()  # back to the commit
    assert state.epoch == 0 and state.sampler.processed_indices == set() and state.sampler.epoch == 1
    assert all(torch.equal(v, kept[k]) for k, v in model.state_dict().items())


sys.exit(1 if run_all(R) else 0)
