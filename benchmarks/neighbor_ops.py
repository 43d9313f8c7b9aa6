"""Neighbor-op latency: Shoal against a hand-written mpi4py reference, same run.

    shoalrun -np 4 python benchmarks/neighbor_ops.py [--iters 100]

For each pattern (one-peer exponential, static exponential-2, allreduce) and message size
(4 KiB, 1 MiB, 16 MiB) both implementations do the same exchange on the same ranks: the
reference posts the sends and receives with mpi4py (Sendrecv / Isend+Irecv, or Allreduce)
into receive buffers it allocated once, and combines with numpy (sum then scale) into one
new output array per op, as Shoal returns one. Every iteration starts after a barrier. The
two are timed in alternating blocks of iterations (Shoal first, then the reference first,
and so on), so drift over the run (warm-up after start, other load) hits both alike. The
table gives the median seconds per op over the iterations (the slowest rank's) and
Shoal / reference. `--iters` applies to 1 MiB; 4 KiB runs 4x as many, 16 MiB a fifth.
"""
import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

import shoal

SIZES = {"4 KiB": 4 << 10, "1 MiB": 1 << 20, "16 MiB": 16 << 20}


def timed(mine, ref, iters, block, comm):
    """Median seconds per op of `mine` and of `ref` over `iters` iterations each, run in
    alternating blocks of `block`; the op is as slow as its slowest rank."""
    times = ([], [])
    for k in range(-(-iters // block)):
        for which in ((0, 1) if k % 2 == 0 else (1, 0)):
            fn = (mine, ref)[which]
            for _ in range(block):
                comm.Barrier()
                t0 = time.perf_counter()
                fn()
                times[which].append(time.perf_counter() - t0)
    return [comm.allreduce(statistics.median(t), op=MPI.MAX) for t in times]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=100)
    args = p.parse_args()
    shoal.init()
    comm = MPI.COMM_WORLD
    r, n = comm.Get_rank(), comm.Get_size()
    tau = max(1, (n - 1).bit_length())
    ins, outs = shoal.in_neighbor_ranks(), shoal.out_neighbor_ranks()
    rows = []
    for label, nbytes in SIZES.items():
        x = np.random.default_rng(r).standard_normal(nbytes // 8)
        iters = {4 << 10: 4 * args.iters, 1 << 20: args.iters}.get(nbytes, max(5, args.iters // 5))
        step = {"t": 0}

        def shoal_one_peer():
            k = 2 ** (step["t"] % tau)
            step["t"] += 1
            shoal.neighbor_allreduce(x, self_weight=0.5, src_weights={(r - k) % n: 0.5},
                                     dst_weights=[(r + k) % n], name="onepeer")

        buf = np.empty_like(x)
        bufs = [np.empty_like(x) for _ in ins]

        def ref_one_peer():
            k = 2 ** (step["t"] % tau)
            step["t"] += 1
            comm.Sendrecv(x, dest=(r + k) % n, recvbuf=buf, source=(r - k) % n)
            out = x + buf
            out *= 0.5

        def shoal_static():
            shoal.neighbor_allreduce(x, name="static")

        def ref_static():
            reqs = [comm.Irecv(b, source=j) for b, j in zip(bufs, ins)]
            reqs += [comm.Isend(x, dest=j) for j in outs]
            MPI.Request.Waitall(reqs)
            total = x.copy()
            for b in bufs:
                total += b
            total /= len(ins) + 1

        def shoal_allreduce():
            shoal.allreduce(x, name="allreduce")

        def ref_allreduce():
            out = np.empty_like(x)
            comm.Allreduce(x, out, op=MPI.SUM)
            out /= n

        for pattern, mine, ref in [("one-peer exp", shoal_one_peer, ref_one_peer),
                                   ("static exp-2", shoal_static, ref_static),
                                   ("allreduce", shoal_allreduce, ref_allreduce)]:
            for fn in (mine, ref):  # warm-up: first-sight negotiation, every peer, buffers
                for _ in range(tau):
                    fn()
            # Blocks of whole schedule periods, so both see every peer equally often.
            t_mine, t_ref = timed(mine, ref, iters, tau * max(1, 10 // tau), comm)
            rows.append((pattern, label, t_mine, t_ref))
    if r == 0:
        print(f"{n} ranks, median seconds per op (max over ranks)")
        print(f"{'pattern':<14} {'size':>7} {'shoal':>11} {'mpi4py ref':>11} {'ratio':>6}")
        for pattern, label, a, b in rows:
            print(f"{pattern:<14} {label:>7} {a:11.3e} {b:11.3e} {a / b:6.2f}")
    shoal.shutdown()


if __name__ == "__main__":
    main()
