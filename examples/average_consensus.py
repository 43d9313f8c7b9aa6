"""Average consensus by gossip: synchronous neighbor averaging, or asynchronous push-sum.

Synchronous (default): every rank starts with a different random vector and repeats
neighbor_allreduce over the exponential-2 graph; each step prints the distance to the
true average (computed once with an allreduce), which shrinks geometrically at the
graph's rate.

Asynchronous (--asynchronous): push-sum (Kempe et al. 2003; algorithms.md §2.6) over one-sided
window ops on a directed, non-regular graph (a ring plus extra chords), with every rank
sleeping a random, rank-dependent time between iterations. Each iteration a rank splits
its (x, p) evenly over itself and its out-neighbours with win_accumulate and collects
what was pushed to it; nobody waits for anybody. Each rank prints the distance of its
de-biased estimate x/p to the true average and its weight p; at the end, once every rank
has stopped and collected, the estimates agree with the average and Σp = n.

    shoalrun -np 8 python examples/average_consensus.py
    shoalrun -np 8 python examples/average_consensus.py --asynchronous
"""
import argparse
import time

import networkx as nx
import numpy as np

import shoal


def synchronous(x, mean, steps):
    """Returns (first, last) consensus distance."""
    dists = []
    for step in range(steps + 1):
        # Consensus distance: sqrt(mean over ranks of ||x_i - x_bar||^2).
        local = np.sum((x - mean) ** 2)
        dist = float(np.sqrt(shoal.allreduce(np.array(local), name="distance")))
        dists.append(dist)
        if shoal.rank() == 0:
            print(f"step {step:3d}  distance to average {dist:.3e}", flush=True)
        if step < steps:
            x = shoal.neighbor_allreduce(x, name="x")
    return dists[0], dists[-1]


def directed_graph(n):
    """Ring i -> i+1 plus a chord i -> i+3 from every third rank: strongly connected,
    directed, out-degrees 1 or 2 (non-regular) for n >= 4."""
    g = nx.DiGraph()
    g.add_nodes_from(range(n))
    for i in range(n):
        if n > 1:
            g.add_edge(i, (i + 1) % n)
        if i % 3 == 0 and n >= 4:
            g.add_edge(i, (i + 3) % n)
    return g


def asynchronous(x, mean, seconds, seed, min_iterations=0):
    r = shoal.rank()
    shoal.set_topology(directed_graph(shoal.size()))
    shoal.turn_on_win_ops_with_associated_p()
    shoal.win_create(x, "x", zero_init=True)
    outs = shoal.out_neighbor_ranks()
    share = 1.0 / (len(outs) + 1)  # column-stochastic: split the mass evenly
    rng = np.random.default_rng(1000 + seed + r)
    scale = 1e-3 * (1 + r % 4)  # ranks differ in speed: mean sleep 0.5-2 ms
    shoal.barrier()
    start, last, it = time.monotonic(), 0.0, 0
    while time.monotonic() - start < seconds or it < min_iterations:
        shoal.win_accumulate(x, "x", self_weight=share, dst_weights={d: share for d in outs})
        shoal.win_update_then_collect("x")
        it += 1
        now = time.monotonic() - start
        if now - last >= seconds / 4:
            last = now
            p = shoal.win_associated_p("x")
            print(f"rank {r}  t {now:4.2f} s  iteration {it:5d}  distance "
                  f"{np.linalg.norm(x / p - mean) / np.linalg.norm(mean):.3e}  p {p:.4f}", flush=True)
        time.sleep(rng.exponential(scale))
    shoal.barrier()  # everyone has stopped: collect what is still in the buffers
    shoal.win_update_then_collect("x")
    p = shoal.win_associated_p("x")
    rel = np.linalg.norm(x / p - mean) / np.linalg.norm(mean)
    total = shoal.allreduce(np.array([p]), average=False, name="sum_p")[0]
    worst = shoal.allgather(np.array([rel]), name="worst").max()
    iters = shoal.allgather(np.array([it]), name="iterations")
    print(f"rank {r}  final after {it} iterations: relative distance {rel:.3e}  p {p:.6f}", flush=True)
    if r == 0:
        print(f"sum of p = {total:.12f} (n = {shoal.size()}); worst relative distance {worst:.3e}", flush=True)
    shoal.win_free()
    shoal.turn_off_win_ops_with_associated_p()
    return worst, total, int(iters.min()), int(iters.max())


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=12, help="synchronous steps")
    p.add_argument("--asynchronous", action="store_true", help="push-sum over window ops")
    p.add_argument("--seconds", type=float, default=2.0, help="asynchronous run time per rank")
    p.add_argument("--min-iterations", type=int, default=0,
                   help="asynchronous: each rank runs at least this many iterations, however long they take")
    p.add_argument("--dim", type=int, default=1000, help="length of each rank's vector")
    p.add_argument("--seed", type=int, default=0, help="the vectors' random seed (plus the rank)")
    args = p.parse_args()
    start = time.perf_counter()

    shoal.init()  # default topology: exponential-2 graph
    x = np.random.default_rng(args.seed + shoal.rank()).standard_normal(args.dim)
    mean = shoal.allreduce(x, name="true_average")
    if args.asynchronous:
        worst, total, fewest, most = asynchronous(x, mean, args.seconds, args.seed, args.min_iterations)
        line = (f"mode=asynchronous ranks={shoal.size()} seconds={args.seconds:g} iterations={fewest}-{most} "
                f"worst_relative_distance={worst:.3e} sum_p={total:.12f}")
    else:
        first, last = synchronous(x, mean, args.steps)
        line = (f"mode=synchronous ranks={shoal.size()} steps={args.steps} initial_distance={first:.3e} "
                f"final_distance={last:.3e}")
    if shoal.rank() == 0:
        print(f"summary: {line} time={time.perf_counter() - start:.2f}s", flush=True)
    shoal.shutdown()


if __name__ == "__main__":
    main()
