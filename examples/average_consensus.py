"""Average consensus by repeated neighbor averaging (decentralized gossip).

Every rank starts with a different random vector and repeats neighbor_allreduce over
the exponential-2 graph; each step prints the distance to the true average
(computed once with an allreduce), which shrinks geometrically at the graph's rate.

    shoalrun -np 8 python examples/average_consensus.py
"""
import argparse

import numpy as np

import shoal


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--dim", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    shoal.init()  # default topology: exponential-2 graph
    x = np.random.default_rng(args.seed + shoal.rank()).standard_normal(args.dim)
    mean = shoal.allreduce(x, name="true_average")
    for step in range(args.steps + 1):
        # Consensus distance: sqrt(mean over ranks of ||x_i - x_bar||^2).
        local = np.sum((x - mean) ** 2)
        dist = float(np.sqrt(shoal.allreduce(np.array(local), name="distance")))
        if shoal.rank() == 0:
            print(f"step {step:3d}  distance to average {dist:.3e}", flush=True)
        if step < args.steps:
            x = shoal.neighbor_allreduce(x, name="x")
    shoal.shutdown()


if __name__ == "__main__":
    main()
