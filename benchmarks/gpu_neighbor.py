"""neighbor_allreduce of CUDA tensors: latency and bandwidth of this run's GPU data path.

    shoalrun -np 4 python benchmarks/gpu_neighbor.py [--iters 50]

Which path runs is the rank's setting: SHOAL_GPU_BACKEND=nccl (NCCL), else CUDA-aware MPI
from device memory where MPI reports CUDA support and SHOAL_CUDA_AWARE_MPI is not 0, else
staged through pinned host memory. tests/gpu/run_on_device.sh runs it once per path and
puts the rows side by side. Each iteration (after a barrier) is one blocking
neighbor_allreduce on the static exponential-2 graph, synchronised with the device; a row
gives the median over iterations of the slowest rank, and the algorithmic bandwidth (bytes
of the tensor sent to each out-neighbor, per second). With SHOAL_FAKE_DEVICE=1 it runs on
the fake device plugin (CPU tensors), which only shows that it runs.
"""
import argparse
import os
import statistics
import time

import numpy as np
import torch

import shoal
import shoal.torch as bf

SIZES = {"4 KiB": 4 << 10, "1 MiB": 1 << 20, "64 MiB": 64 << 20}


def path_name():
    if os.environ.get("SHOAL_GPU_BACKEND") == "nccl":
        return "nccl"
    st = shoal.stats()
    return "direct" if st["neighbor_bytes_sent_mpi"] > 0 else "staged"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    bf.init()
    fake = os.environ.get("SHOAL_FAKE_DEVICE") == "1"
    dev = torch.device("cpu") if fake else torch.device("cuda", bf.local_rank() % torch.cuda.device_count())
    sync = (lambda: None) if fake else torch.cuda.synchronize
    rows = []
    for label, nbytes in SIZES.items():
        x = torch.ones(nbytes // 4, device=dev)
        iters = max(5, args.iters * (4 if nbytes < (1 << 20) else 1) // (8 if nbytes > (16 << 20) else 1))
        bf.neighbor_allreduce(x, name=f"bench.{label}")  # warm-up: setup, negotiation
        sync()
        times = []
        for _ in range(iters):
            shoal.barrier()
            t0 = time.perf_counter()
            bf.neighbor_allreduce(x, name=f"bench.{label}")
            sync()
            times.append(time.perf_counter() - t0)
        worst = shoal.allgather(np.array([statistics.median(times)]), name=f"bench.t.{label}").max()
        rows.append((label, worst, nbytes / worst / 1e9))
    if bf.rank() == 0:
        name = path_name()
        for label, t, gbs in rows:
            print(f"path={name} size={label} median_us={t * 1e6:.1f} GB/s={gbs:.2f}", flush=True)


if __name__ == "__main__":
    main()
