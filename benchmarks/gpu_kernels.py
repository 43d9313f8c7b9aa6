"""Weighted-combine kernel bandwidth against a device-to-device copy, in one run.

    python benchmarks/gpu_kernels.py [--mib 512] [--sources 2] [--iters 20]

Effective bandwidth counts the bytes the kernel must move: (sources + 1) inputs read and
one output written. The copy moves the same number of bytes (half read, half written), so
the ratio says how close the combine gets to the memory system's copy speed (target
>= 0.80). Needs a GPU and a build with the CUDA plugin.
"""
import argparse

import torch

from shoal import _gpu

CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}


def timed(fn, iters):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512, help="size of each input tensor")
    ap.add_argument("--sources", type=int, default=2, help="received buffers combined")
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    table = _gpu.plugin()
    stream = torch.cuda.current_stream().cuda_stream
    print(f"{torch.cuda.get_device_name()}; plugin: {table.build.decode()}")
    worst = None
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        n = a.mib * 2**20 // torch.tensor([], dtype=dtype).element_size()
        x = torch.randn(n, device="cuda").to(dtype)
        srcs = [torch.randn(n, device="cuda").to(dtype) for _ in range(a.sources)]
        out = torch.empty_like(x)
        w = [1.0 / (a.sources + 1)] * a.sources
        moved = (a.sources + 2) * x.numel() * x.element_size()
        # (noqa: each lambda runs inside timed(), before the names are deleted at the end of the loop)
        t_comb = timed(lambda: _gpu.combine(table, out, x, srcs, w, False, w[0] if w else 1.0,  # noqa: F821
                                            CODES[dtype], stream), a.iters)
        src = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        t_copy = timed(lambda: dst.copy_(src), a.iters)  # noqa: F821
        ratio = t_copy / t_comb  # same bytes: bandwidth ratio = time ratio
        worst = ratio if worst is None else min(worst, ratio)
        print(f"{str(dtype):15s} combine {moved / t_comb / 1e12:6.2f} TB/s   copy {moved / t_copy / 1e12:6.2f} TB/s"
              f"   ratio {ratio:.2f}")
        del x, srcs, out, src, dst
        torch.cuda.empty_cache()
    print(f"combine/copy bandwidth ratio (worst dtype): {worst:.2f} (target >= 0.80)")


if __name__ == "__main__":
    main()
