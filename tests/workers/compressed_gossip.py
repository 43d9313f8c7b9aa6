"""Compressed gossip (CHOCO-SGD) against its math: lossless gossip is plain averaging
(exact over a one-peer schedule), lossy gossip keeps the average exactly and sends the
compressed bytes, and error feedback reaches the uncompressed optimum of a decentralized
least-squares problem where compressing x itself does not."""
import os

import torch

import shoal.torch as bf
from shoal import topology as T
from shoal.torch import CompressedGossip, compression
from checks import Skip, check, raises, run_all

bf.init()
R, N = bf.rank(), bf.size()
TAU = max(1, (N - 1).bit_length())


def one_peer(t):
    k = 2 ** (t % TAU)
    return [(R + k) % N], {(R - k) % N: 0.5}


@check
def lossless_gossip_averages_exactly_over_a_one_peer_schedule():
    if N < 2 or N & (N - 1):
        raise Skip("needs a power of two ranks >= 2 (exact averaging in log2(n) one-peer steps)")
    x = torch.arange(12, dtype=torch.float64) + 3 * R  # small integers: every step is exact
    g = CompressedGossip("none", gamma=1.0, name="cg.exact")
    for t in range(TAU):
        dst, src = one_peer(t)
        x = g.finish(g.start(x, 0.5, src, dst))
    mean = torch.arange(12, dtype=torch.float64) + 3 * (N - 1) / 2
    assert torch.equal(x, mean), (x, mean)


@check
def int8_gossip_keeps_the_average_and_sends_a_quarter_of_the_bytes():
    if N < 2:
        raise Skip("needs 2 or more ranks")
    x0 = torch.randn(4096, generator=torch.Generator().manual_seed(R), dtype=torch.float64)
    mean0 = bf.allreduce(x0, name="cg.mean0")
    g = CompressedGossip("int8", gamma=0.5, name="cg.int8")
    before = bf.stats()
    steps = 6 * TAU
    x = x0
    for t in range(steps):
        dst, src = one_peer(t)
        x = g.finish(g.start(x, 0.5, src, dst))
    after = bf.stats()
    sent = after["bytes_sent"] - before["bytes_sent"]
    assert g.bytes_sent == steps * compression.Int8().payload_bytes(4096, torch.float64), g.bytes_sent
    assert g.bytes_sent <= 0.3 * steps * 4096 * 4, g.bytes_sent  # <= 30 % of float32's bytes
    assert g.bytes_sent <= sent < 1.1 * g.bytes_sent, (sent, g.bytes_sent)  # the core's count adds headers
    if os.environ.get("SHOAL_FAKE_DEVICE") == "1":  # tensors described as CUDA: the payloads took the GPU path
        direct = os.environ.get("SHOAL_FAKE_CUDA_AWARE_MPI") == "1"
        path = "nccl" if os.environ.get("SHOAL_GPU_BACKEND") == "nccl" else "mpi" if direct else "staged"
        key = "neighbor_bytes_sent_" + path
        assert after[key] - before[key] == g.bytes_sent, (key, after[key] - before[key], g.bytes_sent)
    mean = bf.allreduce(x, name="cg.mean1")
    assert torch.allclose(mean, mean0, rtol=0, atol=1e-12), (mean - mean0).abs().max()
    spread = bf.allreduce((x - mean).norm() ** 2, name="cg.xi").item()
    start = bf.allreduce((x0 - mean0).norm() ** 2, name="cg.xi0").item()
    assert spread < 0.05 * start, (spread, start)  # the ranks agree far more than at the start


@check
def allreduce_refuses_gossip_compressors_and_the_optimizers_take_them():
    model = torch.nn.Linear(4, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    for c in (bf.Compression.int8, bf.Compression.int4, bf.Compression.topk(0.01), bf.Compression.randomk(0.1)):
        raises(ValueError, bf.DistributedOptimizer, sgd, named_parameters=model.named_parameters(), compression=c)
    opt = bf.DistributedAdaptWithCombineOptimizer(sgd, model, compression=bf.Compression.int8)
    assert isinstance(opt.compression, compression.Int8) and opt.compression_step == 0.5
    raises(ValueError, bf.DistributedAdaptWithCombineOptimizer, sgd, model, compression="int7")


def least_squares(steps=6000, direct_steps=500):
    """Decentralized SGD on sum_i ||A_i x - b_i||^2 / 2 over the exponential-2 graph, 1,024
    dimensions, A_i orthogonal (so the gradient A_i^T (A_i x - b_i) is x - A_i^T b_i),
    decaying step 1 / (t + 10): uncompressed (neighbor_allreduce), top-10 % with CHOCO's
    error feedback, and top-10 % of x itself (no error feedback; it stalls within a few
    hundred steps, so it runs `direct_steps`). Returns each run's x and the optimum."""
    d = 1024
    gen = torch.Generator().manual_seed(3000 + R)
    a = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))[0]
    c = a.T @ torch.randn(d, generator=gen, dtype=torch.float64)
    graph = T.exponential_two_graph(N)
    src_ranks = sorted(j for j in graph.predecessors(R) if j != R)
    w = 1.0 / (len(src_ranks) + 1)
    src, dst = {j: w for j in src_ranks}, [k for k in graph.successors(R) if k != R]
    top = compression.TopK(0.1)
    g = CompressedGossip(top, gamma=0.3, name="ls.ef")
    runs = {k: torch.zeros(d, dtype=torch.float64) for k in ("plain", "ef", "direct")}
    size = top.payload_bytes(d, torch.float64)
    for t in range(steps):
        lr = 1.0 / (t + 10)
        x = {k: v - lr * (v - c) for k, v in runs.items()}
        runs["plain"] = bf.neighbor_allreduce(x["plain"], self_weight=w, src_weights=src, dst_weights=dst,
                                              name="ls.plain")
        runs["ef"] = g.finish(g.start(x["ef"], w, src, dst))
        if t < direct_steps:
            q = top.decode(top.encode(x["direct"]), d, torch.float64)
            got = bf.neighbor_allgather(top.encode(x["direct"]), src_ranks=src_ranks, dst_ranks=dst,
                                        name="ls.direct")
            mixed = w * q + sum(w * top.decode(got[n * size:(n + 1) * size], d, torch.float64)
                                for n in range(len(src_ranks)))
            runs["direct"] = x["direct"] + 0.3 * (mixed - q)
    return runs, bf.allreduce(c, name="ls.optimum")


@check
def topk_with_error_feedback_reaches_the_uncompressed_run_and_without_does_not():
    if N != 2:
        raise Skip("runs at 2 ranks: 6,000 steps; at 4 ranks on 2 cores they take about a minute")
    runs, optimum = least_squares()
    scale = optimum.norm().item()
    plain_off = (runs["plain"] - optimum).norm().item() / scale
    ef_off = (runs["ef"] - runs["plain"]).norm().item() / scale
    direct_off = (runs["direct"] - optimum).norm().item() / scale
    if R == 0:
        print(f"least squares, top-10 %: uncompressed {plain_off:.1e} from the optimum; with error feedback "
              f"{ef_off:.1e} from the uncompressed run; without, {direct_off:.1e} from the optimum", flush=True)
    assert plain_off < 1e-2, plain_off
    assert ef_off < 1e-3, ef_off
    assert direct_off > 1e-1, direct_off


run_all(R)
bf.shutdown()
