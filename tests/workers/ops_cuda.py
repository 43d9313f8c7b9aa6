"""Every op on CUDA tensors (float32, bfloat16; alltoall and grouped ops too) through the
host-staged MPI path or NCCL (SHOAL_GPU_BACKEND), exact
where the CPU tests are exact; the stream-race check runs 100 times. Several ranks may
share one GPU (SHOAL_GPU_BACKEND=mpi).

With SHOAL_FAKE_DEVICE=1 and SHOAL_CUDA_PLUGIN=fake the same checks run on CPU tensors
that the torch adapter marks as fake-device tensors (tests/gpu/test_fake_device.py)."""
import os
import sys

import torch

import shoal.torch as bf
from checks import Skip, check, run_all

FAKE = os.environ.get("SHOAL_FAKE_DEVICE") == "1"
bf.init()
R, N = bf.rank(), bf.size()
DEV = torch.device("cpu") if FAKE else torch.device("cuda", torch.cuda.current_device())
DTYPES = [torch.float32, torch.bfloat16]


def base(dtype, rows=2):
    return (torch.arange(3 * rows, device=DEV) % 3).reshape(rows, 3).to(dtype)


def divided(total, n, dt):
    """total / n as the kernels compute it: an exact division, rounded once to float32 (to
    float64 for float64), then to dt. (torch on CUDA divides by a Python number as a multiply
    by its reciprocal, which can be one ulp off: seen on an H200.)"""
    q = total.cpu().double() / n  # on the CPU: CUDA divides float64 by a multiply too
    return (q if dt == torch.float64 else q.float()).to(dt).to(total.device)


def on_device(t):
    assert t.device == DEV, t.device
    return t


@check
def allreduce_sum_and_average():
    for dt in DTYPES:
        got = on_device(bf.allreduce(base(dt) * (R + 1), average=False, name=f"g.sum.{dt}"))
        assert torch.equal(got, (base(torch.int64) * (N * (N + 1) // 2)).to(dt)), (dt, got)
        want = divided(base(torch.float32) * (N * (N + 1) // 2), N, dt)
        got = on_device(bf.allreduce(base(dt) * (R + 1), name=f"g.avg.{dt}"))
        assert torch.equal(got, want), (dt, got, want)


@check
def allreduce_min_max_product():
    # ncclMin/ncclMax/ncclProd on the NCCL backend; the host path's MPI_MIN/MAX/PROD staged.
    for dt in DTYPES + [torch.int32]:
        x = (base(dt) - 1) * (R % 2 + 1)  # products of |x| <= 2 over 8 ranks: exact in bfloat16
        xs = [(base(dt) - 1) * (r % 2 + 1) for r in range(N)]
        for op, fold in ((bf.Min, torch.minimum), (bf.Max, torch.maximum), (bf.Product, torch.mul)):
            got = on_device(bf.allreduce(x, op=op, name=f"g.{op.name}.{dt}"))
            want = xs[0]
            for y in xs[1:]:
                want = fold(want, y)
            assert got.dtype == dt and torch.equal(got, want), (op, dt, got, want)


@check
def horovod_scaling():
    # Prescale, postscale (scaled on the device on the NCCL path) and the integer average
    # (staged: the device kernels scale floating types only); exact in bfloat16 too.
    tri = N * (N + 1) // 2
    for dt in DTYPES:
        got = on_device(bf.allreduce(base(dt) * (R + 1), op=bf.Sum, name=f"g.hs.{dt}", prescale_factor=0.5,
                                     postscale_factor=4.0))
        assert torch.equal(got, (base(torch.float64) * tri * 2).to(dt)), (dt, got)
        got = on_device(bf.allreduce(base(dt) * (R + 1), op=bf.Average, name=f"g.hs.avg.{dt}", prescale_factor=0.5,
                                     postscale_factor=2.0))
        assert torch.equal(got, (base(torch.float64) * tri * 0.5 / N * 2).to(dt)), (dt, got)
        d0 = 2 * N + 1
        rows = d0 // N + (1 if R < d0 % N else 0)
        start = R * (d0 // N) + min(R, d0 % N)
        got = on_device(bf.reducescatter(base(dt, d0) * (R + 1), name=f"g.hs.rs.{dt}", op=bf.Sum, prescale_factor=0.5,
                                         postscale_factor=4.0))
        assert torch.equal(got, (base(torch.float64, d0) * tri * 2).to(dt)[start:start + rows]), (dt, got)
    x = (base(torch.int32) - 1) * (R + 1)  # negative values: truncated toward zero
    got = on_device(bf.allreduce(x, name="g.hs.int.avg"))
    assert torch.equal(got, torch.div((base(torch.int32) - 1) * tri, N, rounding_mode="trunc")), got
    # Factors that differ by rank, one of them 1.0: every rank takes the same (staged) path.
    got = on_device(bf.allreduce(x, op=bf.Sum, name="g.hs.int.pre", prescale_factor=0.5 if R % 2 else 1.0))
    want = sum(torch.trunc((base(torch.float64) - 1) * (r + 1) * (0.5 if r % 2 else 1.0)) for r in range(N))
    assert torch.equal(got, want.to(torch.int32)), (got, want)


@check
def reducescatter_uneven():
    # ncclReduceScatter / grouped ncclReduce, or MPI staged; the result comes back on the device.
    d0 = 2 * N + 1
    rows = d0 // N + (1 if R < d0 % N else 0)
    start = R * (d0 // N) + min(R, d0 % N)
    for dt in DTYPES:
        got = on_device(bf.reducescatter(base(dt, d0) * (R + 1), name=f"g.rs.{dt}", op=bf.Sum))
        assert torch.equal(got, (base(torch.int64, d0) * (N * (N + 1) // 2)).to(dt)[start:start + rows]), (dt, got)


@check
def alltoall_uneven_splits():
    # NCCL: grouped ncclSend/ncclRecv with every rank (this one too; empty rows skipped);
    # MPI: staged, MPI_Ialltoallv. Values < 256: exact in bfloat16.
    def split(r, q):
        return (r + 2 * q) % 3

    def x_of(r, dt):
        d0 = sum(split(r, q) for q in range(N))
        return (torch.arange(d0 * 2).reshape(d0, 2) + 30 * r).to(dt)

    for dt in DTYPES + [torch.int32]:
        got, received = bf.alltoall(x_of(R, dt).to(DEV), splits=[split(R, q) for q in range(N)], name=f"g.a2a.{dt}")
        want = []
        for q in range(N):
            start = sum(split(q, k) for k in range(R))
            want.append(x_of(q, dt)[start:start + split(q, R)])
        assert on_device(got).dtype == dt and torch.equal(got.cpu(), torch.cat(want)), (dt, got, want)
        assert received.tolist() == [split(q, R) for q in range(N)], received
    got = on_device(bf.alltoall(torch.full((N, 3), float(R), device=DEV), name="g.a2a.even"))
    assert torch.equal(got.cpu(), torch.arange(N, dtype=torch.float32).repeat_interleave(3).reshape(N, 3)), got


@check
def grouped_ops():
    # One negotiation per group; on NCCL each member is its own collective, on MPI the
    # allreduce members of one dtype are fused.
    xs = [torch.full((3,), float(R + k), device=DEV).to(dt) for k, dt in enumerate(DTYPES + [torch.float32])]
    got = bf.grouped_allreduce(xs, op=bf.Sum, name="g.grp.ar")
    for k, (g, x) in enumerate(zip(got, xs)):
        assert on_device(g).dtype == x.dtype and torch.equal(g.float().cpu(), torch.full((3,), N * (N - 1) / 2 + N * k))
    got = bf.grouped_allgather([torch.full((R % 2 + 1, 2), R, device=DEV), torch.full((1,), float(R), device=DEV)],
                               name="g.grp.ag")
    assert torch.equal(on_device(got[0]).cpu(), torch.cat([torch.full((r % 2 + 1, 2), r) for r in range(N)])), got
    assert torch.equal(on_device(got[1]).cpu(), torch.arange(N, dtype=torch.float32)), got
    d0 = 2 * N + 1
    rows, start = d0 // N + (1 if R < d0 % N else 0), R * (d0 // N) + min(R, d0 % N)
    got = bf.grouped_reducescatter([base(torch.float32, d0) * (R + 1)], op=bf.Sum, name="g.grp.rs")
    assert torch.equal(on_device(got[0]).cpu(), (base(torch.float32, d0).cpu() * (N * (N + 1) // 2))[start:start + rows])


@check
def inplace_nonblocking_and_fused():
    x = torch.full((3,), float(R), device=DEV)
    h = bf.allreduce_nonblocking_(x, average=False, name="g.inplace")
    assert bf.synchronize(h) is x and torch.equal(x, torch.full((3,), N * (N - 1) / 2, device=DEV))
    # Many small tensors in flight at once: fused on the host side, copied back per tensor.
    hs = [bf.allreduce_nonblocking(torch.full((5,), float(R + k), device=DEV), average=False, name=f"g.f{k}")
          for k in range(16)]
    for k, h in enumerate(hs):
        assert torch.equal(bf.synchronize(h), torch.full((5,), float(N * (N - 1) / 2 + N * k), device=DEV)), k


@check
def broadcast_and_allgather():
    for dt in DTYPES:
        root = N - 1
        got = on_device(bf.broadcast(base(dt) + R, root, name=f"g.bc.{dt}"))
        assert torch.equal(got, base(dt) + root), dt
        got = on_device(bf.allgather(torch.full((R % 3, 2), R, device=DEV).to(dt), name=f"g.ag.{dt}"))
        want = torch.cat([torch.full((r % 3, 2), r, device=DEV).to(dt) for r in range(N)])
        assert got.dtype == dt and torch.equal(got, want), (dt, got)


@check
def gpu_backend_carries_collectives():
    if not FAKE:
        raise Skip("counts the fake plugin's NCCL calls")
    import ctypes
    from shoal import _gpu
    calls = _gpu.library().shoal_fake_nccl_calls
    calls.restype = ctypes.c_int64
    before = calls()
    bf.allreduce(torch.ones(3), name="g.count.ar")
    bf.broadcast(torch.ones(3), 0, name="g.count.bc")
    bf.allgather(torch.ones(1, 2), name="g.count.ag")
    bf.alltoall(torch.ones(N, 2), name="g.count.a2a")  # one grouped send/recv
    want = 4 if os.environ.get("SHOAL_GPU_BACKEND") == "nccl" else 0
    assert calls() - before == want, (calls() - before, want)


@check
def neighbor_allreduce_uniform_and_weighted():
    ins = bf.in_neighbor_ranks()
    for dt in DTYPES:
        total = sum((base(torch.float32) * (j + 1) for j in ins), base(torch.float32) * (R + 1))
        want = divided(total, len(ins) + 1, dt)
        got = on_device(bf.neighbor_allreduce(base(dt) * (R + 1), name=f"g.nbr.{dt}"))
        assert torch.equal(got, want), (dt, got, want)
    # Dynamic: receive from the left neighbour, send to the right one with dst_weights.
    if N > 1:
        left, right = (R - 1) % N, (R + 1) % N
        x = torch.full((4,), float(R + 1), device=DEV)
        got = bf.neighbor_allreduce(x, self_weight=0.5, src_weights={left: 0.25}, dst_weights={right: 2.0},
                                    name="g.nbr.dyn")
        want = 0.5 * (R + 1) + 0.25 * 2.0 * (left + 1)
        assert torch.equal(got, torch.full((4,), want, device=DEV)), (got, want)


@check
def neighbor_bytes_counted_per_backend():
    # shoal.stats() says which backend carried the neighbor data (issue 16): bytes of
    # neighbor ops sent by NCCL, handed to a CUDA-aware MPI from device memory, or staged
    # through host memory into MPI. Only the backend in use counts, at least the payload.
    if N == 1:
        raise Skip("one rank has no neighbors")
    names = ("neighbor_bytes_sent_nccl", "neighbor_bytes_sent_mpi", "neighbor_bytes_sent_staged")
    bf.barrier()
    bf.reset_stats()
    x = torch.ones(1000, device=DEV)  # float32: 4000 bytes to each out-neighbor
    bf.neighbor_allreduce(x, name="g.nbr.bytes")
    st = bf.stats()
    missing = [k for k in names if k not in st]
    assert not missing, f"shoal.stats() has no {missing}: {sorted(st)}"
    backend = os.environ.get("SHOAL_GPU_BACKEND", "mpi")
    if backend == "nccl":
        want = {"nccl"}
    elif FAKE:
        want = {"mpi"} if os.environ.get("SHOAL_FAKE_CUDA_AWARE_MPI") == "1" else {"staged"}
    else:  # a real MPI: direct if it is CUDA-aware, staged otherwise
        want = {"mpi", "staged"}
    used = {k.rsplit("_", 1)[1] for k in names if st[k]}
    assert len(used) == 1 and used <= want, (backend, want, {k: st[k] for k in names})
    payload = 4000 * len(bf.out_neighbor_ranks())
    assert st[f"neighbor_bytes_sent_{used.pop()}"] >= payload, (payload, {k: st[k] for k in names})


@check
def neighbor_allgather_and_pair_gossip():
    ins = bf.in_neighbor_ranks()
    got = on_device(bf.neighbor_allgather(torch.full((1, 2), float(R), device=DEV), name="g.nag"))
    want = torch.cat([torch.full((1, 2), float(j), device=DEV) for j in ins]) if ins else got
    assert torch.equal(got, want), (got, want)
    if N > 1 and N % 2 == 0:
        peer = R ^ 1
        got = bf.pair_gossip(torch.full((3,), float(R), device=DEV), peer, name="g.gossip")
        assert torch.equal(got, torch.full((3,), (R + peer) / 2, device=DEV)), got


@check
def hierarchical_neighbor_allreduce():
    bf.set_machine_topology(bf.RingGraph(bf.machine_size()))
    x = torch.full((4,), float(R), device=DEV)
    got = on_device(bf.hierarchical_neighbor_allreduce(x, name="g.hier"))
    assert torch.isfinite(got).all()
    if bf.machine_size() == 1:  # one machine: the machine average
        assert torch.equal(got, torch.full((4,), (N - 1) / 2, device=DEV)), got


@check
def stream_race_100():
    # The producer kernel (a long matmul chain, then the fill) is still running on the
    # current stream when the op is enqueued: the core must wait for it, and the consumer
    # on the same stream must see the result. 100 rounds, every one must be exact. On the
    # fake, producer and consumer run on the host and the core's copies on a delayed
    # worker stream, so a missing wait shows up as a stale result.
    a = None if FAKE else torch.randn(2048, 2048, device=DEV)
    bad = 0
    for it in range(100):
        x = torch.empty(1 << 16, device=DEV)
        if FAKE:
            x.fill_(float(R + it))
        else:
            torch.cuda._sleep(2_000_000)  # ~1 ms of GPU time ahead of the host
            b = a @ a
            x.fill_(float(R + it)).add_(b[0, 0] * 0)  # depends on the matmul
        y = bf.allreduce(x, average=False, name="g.race")
        y.mul_(1)  # consumer on the same stream
        if not torch.equal(y, torch.full_like(y, float(N * it + N * (N - 1) / 2))):
            bad += 1
    print(f"[rank {R}] stream race: {100 - bad}/100 correct", flush=True)
    assert bad == 0, bad


@check
def other_stream():
    if FAKE:
        raise Skip("torch CPU tensors have no streams: fake-device tensors are on the legacy default stream")
    # A tensor produced on a side stream, op issued on that stream.
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(1_000_000)
        x = torch.full((8,), float(R), device=DEV)
        y = bf.allreduce(x, average=False, name="g.side")
        ok = torch.equal(y, torch.full((8,), N * (N - 1) / 2, device=DEV))
    assert ok, y


@check
def optimizer_awc_step():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).to(DEV)
    opt = bf.DistributedAdaptWithCombineOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    bf.broadcast_parameters(model.state_dict(), root_rank=0)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 4, device=DEV)).sum().backward()
        opt.step()
    assert all(p.device == DEV and torch.isfinite(p).all() for p in model.parameters())


@check
def window_ops_stage_through_host():
    if FAKE:
        raise Skip("window ops stage device tensors in Python (shoal/_win.py), not through the plugin; "
                   "the CPU suite covers them")
    for dt in DTYPES:
        x = base(dt) * (R + 1)
        bf.win_create(x, f"gw.{dt}", zero_init=True)
        bf.win_accumulate(x, f"gw.{dt}", self_weight=0.5)
        bf.barrier()
        got = on_device(bf.win_update_then_collect(f"gw.{dt}"))
        want = base(torch.float32) * (R + 1) * 0.5 + sum(base(torch.float32) * (j + 1)
                                                          for j in bf.in_neighbor_ranks())
        assert got is x and torch.equal(got, want.to(dt)), (dt, got, want)
        bf.barrier()
        bf.win_free(f"gw.{dt}")


failed = run_all(R, report=FAKE)
# Leave together: a rank that leaves fails a peer's neighbor op that still waits to route
# its last step (staged on a slower stream), even when the leaver's data already arrived.
bf.barrier()
sys.exit(1 if failed else 0)
