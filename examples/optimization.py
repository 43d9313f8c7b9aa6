"""Decentralized optimization: which algorithms reach the global minimizer, and which stop short.

Every rank i holds a private smooth, strongly convex loss F_i and all ranks together minimize
F(x) = (1/n) sum_i F_i(x), talking only to their graph neighbors.  Two problems:

* least squares: F_i(x) = ||A_i x - b_i||^2 / (2 m), synthetic A_i, b_i from a per-rank seed,
  each rank's b_i generated from its own "true" x, so the local minimizers disagree;
* logistic regression on scikit-learn's breast-cancer data (standardized, plus an intercept,
  L2-regularized with 0.3 so the minimizer is unique and 300 iterations suffice), sorted by
  label before being split across ranks, so some ranks see only one class.

Algorithms (docs/reference/algorithms.md §2.6), all with full local gradients g_i = grad F_i:

* diffusion             ATC D-SGD, x+ = W(x - lr g(x)).  Its fixed point is NOT the minimizer
                        when the F_i differ: it stalls at a bias that grows with lr.
* exact-diffusion       adapt psi+ = x - lr g(x), correct phi = psi+ + x - psi, combine
                        x+ = Wbar phi with Wbar = (I + W)/2.  Exact: linear convergence to x*.
* gradient-tracking     DIGing in ATC form, x+ = W(x - lr y), y+ = W(y + g(x+) - g(x)).  Exact.
* push-sum              SGP: column-stochastic weights (each rank splits its mass evenly over
                        itself and its out-neighbors, sent with dst_weights), plus the scalar
                        push-sum weight w carried in the same message; the model is de-biased
                        as z = x / w.  Works on directed graphs whose mixing is not doubly
                        stochastic, but like diffusion it keeps a bias (on exp2 and one-peer,
                        where push weights are doubly stochastic, w stays 1 and it IS diffusion).
* push-diging           push-sum gradient tracking (Push-DIGing, Nedic-Olshevsky-Shi 2017):
                        u+ = P(u - lr y), v+ = P v, z = u / v, y+ = P y + g(z+) - g(z), with
                        [u - lr y, y, v] in one message.  Exact on directed graphs.

All use the same step size, lr = 1/L (L = the largest local smoothness constant) unless --lr.
Topologies: exp2 (the static exponential-2 graph, doubly stochastic but not symmetric), one-peer
(the one-peer exponential schedule, a different partner every step), and directed (a directed
ring plus rank 0 sending to everyone: out-degrees differ, so uniform receive weights are only
row-stochastic and push weights only column-stochastic).  On directed (n >= 3), the three pull
methods converge to the wrong point; only the push-sum pair handles it, only push-diging exactly.

The global minimizer x* is computed on every rank by Newton's method on the allreduced gradients
and Hessians (one step for least squares).  All runs advance in lockstep with nonblocking
neighbor ops, so their messages share one communication cycle; each rank records ||z_i - x*||
locally and one allgather at the end gives the max over ranks, which is what is printed (every
few iterations, then a summary table) and plotted.

    shoalrun -np 4 python examples/optimization.py [--problem both] [--iters 300] [--plot out.png]
"""
import argparse
import itertools
import time

import numpy as np

import shoal
from shoal import topology

EXACT, BIAS = 1e-8, 1e-3  # what counts as "reached x*" and as a visible bias


# -- problems: local gradient and Hessian of F_i; x* by Newton on the allreduced sums -------------
class LeastSquares:
    def __init__(self, rank, seed, m=40, d=10):
        common = np.random.default_rng(seed).standard_normal(d)
        rng = np.random.default_rng([seed, rank])  # one stream per rank
        self.A = rng.standard_normal((m, d))
        # A private "true" x per rank: the local minimizers disagree (data heterogeneity).
        self.b = self.A @ (common + rng.standard_normal(d)) + 0.1 * rng.standard_normal(m)
        self.dim = d

    def grad(self, x):
        return self.A.T @ (self.A @ x - self.b) / len(self.b)

    def hess(self, x):
        return self.A.T @ self.A / len(self.b)

    def smoothness(self):
        return np.linalg.eigvalsh(self.hess(None))[-1]


class Logistic:
    def __init__(self, rank, size, reg=0.3):
        from sklearn.datasets import load_breast_cancer
        a, y = load_breast_cancer(return_X_y=True)
        a = (a - a.mean(0)) / a.std(0)
        a = np.hstack([a, np.ones((len(a), 1))])  # intercept
        order = np.argsort(y, kind="stable")      # sorted by label: heterogeneous shards
        mine = np.array_split(order, size)[rank]
        # F_i = (n/N) sum_own loss + reg/2 ||x||^2, so (1/n) sum_i F_i is the centralized loss.
        self.A, self.y, self.scale, self.reg = a[mine], 2.0 * y[mine] - 1, size / len(y), reg
        self.dim = a.shape[1]

    def grad(self, x):
        s = 0.5 * (1 - np.tanh(0.5 * self.y * (self.A @ x)))  # sigmoid(-y a.x), overflow-free
        return self.scale * self.A.T @ (-self.y * s) + self.reg * x

    def hess(self, x):
        p = 0.5 * (1 + np.tanh(0.5 * (self.A @ x)))
        return self.scale * (self.A.T * (p * (1 - p))) @ self.A + self.reg * np.eye(self.dim)

    def smoothness(self):  # sigmoid' <= 1/4 everywhere
        return self.scale * np.linalg.eigvalsh(self.A.T @ self.A)[-1] / 4 + self.reg


def global_minimizer(p, name):
    """Newton on sum_i F_i with allreduced gradient and Hessian: x* to machine precision."""
    x = np.zeros(p.dim)
    for _ in range(50):
        gh = shoal.allreduce(np.vstack([p.grad(x), p.hess(x)]), op=shoal.Sum, name=f"{name}/newton")
        step = np.linalg.solve(gh[1:], gh[0])
        x -= step
        if np.linalg.norm(step) < 1e-14 * (1 + np.linalg.norm(x)):
            break
    return x


def smoothness(p, name):
    """Largest local smoothness constant over the ranks (the default lr is 1/L)."""
    return float(shoal.allgather(np.array([p.smoothness()]), name=f"{name}/L").max())


# -- topologies: the adjacency (self loops included) of every step of one period ----------------
def topologies(n):
    exp2 = topology.mixing_matrix(topology.exponential_two_graph(n)) > 0
    sched = [topology.one_peer_exponential_schedule(n, r) for r in range(n)]
    period = max(1, (n - 1).bit_length())
    one_peer = [m > 0 for m in topology.schedule_matrices(sched, period)]
    directed = np.eye(n, dtype=bool)
    for r in range(n):
        directed[r, (r + 1) % n] = directed[0, r] = True
    return {"exp2": [exp2], "one-peer": one_peer, "directed": [directed]}


class Mixer:
    """One gossip step over step t of a topology, in one of three weightings:
    'W'     receiver averages itself and its in-neighbors uniformly (BlueFog's default);
    'Wbar'  (I + W)/2, exact diffusion's combine;
    'push'  sender splits its value evenly over itself and its out-neighbors (column-stochastic),
            given to neighbor_allreduce as dst_weights: a receiver needs no sender's degree.
    The static exp2 graph with 'W' uses the static op (shoal's default topology); the rest use
    the dynamic form with explicit weights."""

    def __init__(self, name, steps, static):
        self.name, self.steps, self.static, self.r = name, steps, static, shoal.rank()

    def __call__(self, t, x, kind, tag):
        a, r = self.steps[t % len(self.steps)], self.r
        name = f"{self.name}/{tag}"
        if kind == "W" and self.static:
            return shoal.neighbor_allreduce_nonblocking(x, name=name)
        src = [int(s) for s in np.flatnonzero(a[:, r]) if s != r]
        dst = [int(d) for d in np.flatnonzero(a[r]) if d != r]
        if kind == "push":
            w = 1.0 / (len(dst) + 1)
            args = dict(self_weight=w, src_weights={s: 1.0 for s in src},
                        dst_weights={d: w for d in dst})
        else:
            w = 1.0 / (len(src) + 1)
            self_w, nbr_w = (w, w) if kind == "W" else ((1 + w) / 2, w / 2)
            args = dict(self_weight=self_w, src_weights={s: nbr_w for s in src}, dst_weights=dst)
        return shoal.neighbor_allreduce_nonblocking(x, enable_topo_check=False, name=name, **args)


# -- algorithms: generators that yield a handle to wait for (and get its result back), or the
#    de-biased iterate at the end of each iteration, so that the driver can run them all in step.
def diffusion(p, mix, lr, x):
    for t in itertools.count():
        yield x
        x = yield mix(t, x - lr * p.grad(x), "W", "x")


def exact_diffusion(p, mix, lr, x):
    psi = x
    for t in itertools.count():
        yield x
        psi_new = x - lr * p.grad(x)
        x = yield mix(t, psi_new + x - psi, "Wbar", "x")
        psi = psi_new


def gradient_tracking(p, mix, lr, x):
    g = y = p.grad(x)
    for t in itertools.count():
        yield x
        x = yield mix(t, x - lr * y, "W", "x")
        g_new = p.grad(x)
        y = yield mix(t, y + g_new - g, "W", "y")
        g = g_new


def push_sum(p, mix, lr, x):
    w = 1.0
    for t in itertools.count():
        yield x / w
        xw = yield mix(t, np.append(x - lr * p.grad(x / w), w), "push", "xw")  # w rides along
        x, w = xw[:-1], xw[-1]


def push_diging(p, mix, lr, u):
    v, d = 1.0, len(u)
    g = y = p.grad(u)
    for t in itertools.count():
        yield u / v
        m = yield mix(t, np.concatenate([u - lr * y, y, [v]]), "push", "uyv")
        u, y, v = m[:d], m[d:2 * d], m[-1]
        g_new = p.grad(u / v)
        y, g = y + g_new - g, g_new


ALGORITHMS = {"diffusion": diffusion, "exact-diffusion": exact_diffusion,
              "gradient-tracking": gradient_tracking, "push-sum": push_sum,
              "push-diging": push_diging}


def run_lockstep(runs, iters):
    """Advance every run one iteration at a time; within an iteration, submit all pending
    neighbor ops before waiting on any, so they travel together.  Returns the local distance
    history, shape (runs, iters + 1)."""
    gens = [gen for gen, _ in runs]
    hist = np.zeros((len(runs), iters + 1))
    items = [next(g) for g in gens]
    for t in range(iters + 1):
        hist[:, t] = [np.linalg.norm(z - xstar) for z, (_, xstar) in zip(items, runs)]
        if t == iters:
            break
        items = [next(g) for g in gens]
        while not all(isinstance(i, np.ndarray) for i in items):
            items = [i if isinstance(i, np.ndarray) else g.send(shoal.synchronize(i))
                     for g, i in zip(gens, items)]
    return hist


def verdict(h):
    """(kind, detail) of one distance history."""
    final, half = h[-1], h[len(h) // 2]
    if not np.isfinite(final) or final > 10 * h[0]:
        return "diverges", ""
    if final < EXACT:
        return "reaches x*", f"(< {EXACT:.0e} from iteration {int(np.argmax(h < EXACT))})"
    if final > 0.9 * half:  # no progress over the second half: a fixed point that is not x*
        return "stalls at a bias", f"(visible, > {BIAS:.0e})" if final > BIAS else ""
    return "still converging", ""


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--problem", choices=["least-squares", "logistic", "both"], default="both",
                    help="which problem(s) to solve")
    ap.add_argument("--iters", type=int, default=300, help="iterations of every algorithm")
    ap.add_argument("--lr", type=float, default=None,
                    help="step size for every algorithm (None: 1/L of each problem)")
    ap.add_argument("--seed", type=int, default=0, help="least-squares data")
    out = ap.add_argument_group("output")
    out.add_argument("--every", type=int, default=50, help="print the distance every k iterations")
    out.add_argument("--plot", default="optimization.png", help="PNG path ('' to skip)")
    args = ap.parse_args()
    start = time.perf_counter()

    shoal.init()  # default topology: exponential-2 graph
    r, n = shoal.rank(), shoal.size()
    names = ["least-squares", "logistic"] if args.problem == "both" else [args.problem]
    problems = {"least-squares": lambda: LeastSquares(r, args.seed),
                "logistic": lambda: Logistic(r, n)}
    topos = topologies(n)
    runs, labels, lrs = [], [], {}
    for pname in names:
        p = problems[pname]()
        xstar = global_minimizer(p, pname)
        lrs[pname] = args.lr or 1.0 / smoothness(p, pname)
        for (aname, algo), (tname, steps) in itertools.product(ALGORITHMS.items(), topos.items()):
            mix = Mixer(f"{pname}/{aname}/{tname}", steps, static=tname == "exp2")
            runs.append((algo(p, mix, lrs[pname], np.zeros(p.dim)), xstar))
            labels.append((pname, aname, tname))

    local = run_lockstep(runs, args.iters)
    # Max over ranks (there is no Max reduce op: gather every rank's history instead).
    hist = shoal.allgather(local, name="history").reshape(n, *local.shape).max(axis=0)

    if r == 0:
        marks = sorted(set(range(0, args.iters, max(1, args.every))) | {args.iters})
        for pname in names:
            print(f"\n{pname}: max over {n} ranks of ||z_i - x*||, lr = {lrs[pname]:.3g}")
            its = "".join(f"{'it %d' % t:>10s}" for t in marks)
            print(f"{'algorithm':18s} {'topology':9s}{its}")
            for (pn, an, tn), h in zip(labels, hist):
                if pn == pname:
                    print(f"{an:18s} {tn:9s}" + "".join(f"{h[t]:10.2e}" for t in marks))
        print(f"\nSummary after {args.iters} iterations ({n} ranks)")
        print(f"{'problem':14s} {'algorithm':18s} {'topology':9s} {'distance':>10s}  verdict")
        for (pn, an, tn), h in zip(labels, hist):
            print(f"{pn:14s} {an:18s} {tn:9s} {h[-1]:10.2e}  {' '.join(verdict(h)).strip()}")
        for pname in names:  # the same, grouped: who reaches x*, who stalls at a bias
            groups = {}
            for (pn, an, tn), h in zip(labels, hist):
                if pn == pname:
                    groups.setdefault(verdict(h)[0], {}).setdefault(an, []).append(tn)
            for v, algos in groups.items():
                print(f"{pname}: {v}: "
                      + "; ".join(f"{a} ({', '.join(t)})" for a, t in algos.items()))
        if args.plot:
            plot(args.plot, names, labels, hist)
        kinds = [verdict(h)[0] for h in hist]
        counts = " ".join(f"{k.replace(' ', '_')}={kinds.count(k)}" for k in dict.fromkeys(kinds))
        print(f"summary: problems={','.join(names)} ranks={n} iters={args.iters} runs={len(kinds)} {counts} "
              f"time={time.perf_counter() - start:.1f}s", flush=True)
    shoal.shutdown()


def plot(path, names, labels, hist):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, axes = plt.subplots(1, len(names), figsize=(7 * len(names), 5), squeeze=False)
    colors = dict(zip(ALGORITHMS, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    styles = {"exp2": "-", "one-peer": "--", "directed": ":"}
    for ax, pname in zip(axes[0], names):
        for (pn, an, tn), h in zip(labels, hist):
            if pn == pname:
                ax.semilogy(np.maximum(h, 1e-16), styles[tn], color=colors[an],
                            label=f"{an} / {tn}")
        ax.set(title=pname, xlabel="iteration", ylabel="max_i ||z_i - x*||")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot saved to {path}")


if __name__ == "__main__":
    main()
