"""Cost of writing the timeline: step time of decentralized training with
SHOAL_TIMELINE off and on, measured in one run (alternating blocks, same model).

    shoalrun -np 4 python benchmarks/timeline_overhead.py [--steps 40 --blocks 4]

Each block re-initialises Shoal with or without SHOAL_TIMELINE (the setting is read at
init) and times AWC steps (one-peer exponential) of an MLP; the table gives the median
step time of each setting and their ratio.
"""
import argparse
import os
import statistics
import tempfile
import time

import torch

import shoal.torch as bf
from shoal import topology


def block(steps, model, x, y):
    bf.init()
    opt = bf.DistributedAdaptWithCombineOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model)
    sched = topology.one_peer_exponential_schedule(bf.size(), bf.rank())
    times = []
    for _ in range(steps):
        send, recv = next(sched)
        opt.self_weight, opt.src_weights, opt.dst_weights = 0.5, {j: 0.5 for j in recv}, send
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    opt.remove_hooks()
    bf.barrier()
    bf.shutdown()
    return times[2:]  # first steps negotiate names


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--blocks", type=int, default=4, help="blocks per setting, alternating")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(8) for m in (torch.nn.Linear(256, 256), torch.nn.ReLU())],
                                torch.nn.Linear(256, 10))
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    prefix = os.path.join(tempfile.mkdtemp(prefix="shoal-timeline-"), "trace")
    results = {"off": [], "on": []}
    for b in range(2 * args.blocks):
        setting = "off" if b % 2 == 0 else "on"
        if setting == "on":
            os.environ["SHOAL_TIMELINE"] = prefix
        else:
            os.environ.pop("SHOAL_TIMELINE", None)
        results[setting] += block(args.steps, model, x, y)
    bf.init()
    off, on = statistics.median(results["off"]), statistics.median(results["on"])
    slowest = bf.allgather(torch.tensor([[off, on]], dtype=torch.float64), name="times").max(0).values
    if bf.rank() == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"{bf.size()} ranks, MLP {params:,} parameters in {len(list(model.parameters()))} tensors, "
              f"{len(results['off'])} timed steps per setting")
        print(f"median step time  timeline off {slowest[0] * 1e3:.2f} ms   on {slowest[1] * 1e3:.2f} ms   "
              f"ratio on/off {slowest[1] / slowest[0]:.3f}")
    bf.shutdown()


if __name__ == "__main__":
    main()
