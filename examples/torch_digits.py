"""Decentralized training of a small CNN on scikit-learn's handwritten digits.

    shoalrun -np 4 python examples/torch_digits.py
    shoalrun -np 4 python examples/torch_digits.py --topology exp2 --optimizer atc
    shoalrun -np 4 python examples/torch_digits.py --partition dirichlet --alpha 0.1 --consensus-target 0.05
    shoalrun --fault-tolerant -np 8 python examples/torch_digits.py --lose 3@5   # Open MPI: a rank dies
    shoalrun -np 8 --machines 4 --link 1gbit python examples/torch_digits.py --model mlp --topology hierarchical

Every rank keeps its own model and trains on its own shard of the 8x8 digits (1797
images shipped with scikit-learn: no download). Ranks average parameters with their
neighbors — one-peer exponential schedule by default, or a static exponential graph, a
ring, a Base-(k+1) schedule, or plain allreduce — through Shoal's decentralized
optimizers (AWC, ATC) or Horovod-style gradient allreduce. Each epoch prints the mean
training loss, the mean test accuracy of the ranks' models on a common held-out set,
the consensus distance Ξ (how far the models drifted apart) and samples/s. Each run's
history is saved as JSON in --out-dir and the plot there shows every run found (one
line per run): test accuracy and Ξ against the step.
"""
import argparse
import itertools
import json
import math
import os
import signal
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import shoal.torch as bf
from digits_data import split, summary
from shoal import topology

REFERENCE_BATCH = 64  # the global batch --lr is given for: 4 ranks x 16


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--topology", default="one-peer-exp",
                   choices=["exp2", "one-peer-exp", "ring", "base-k", "allreduce", "hierarchical"],
                   help="graph the models are averaged over (ignored by gradient-allreduce); hierarchical: "
                        "hierarchical_neighbor_allreduce, one peer machine a step (one-peer exponential over "
                        "machines), the machine's ranks averaged within it")
    p.add_argument("--model", default="cnn", choices=["cnn", "mlp"],
                   help="cnn: a small CNN (25k parameters); mlp: 64-3200-3200-10 (10.5M parameters, 40 MiB: "
                        "communication-heavy)")
    p.add_argument("--target-accuracy", type=float, default=95.0,
                   help="the summary gives the time to the first epoch whose test accuracy reaches this (%%)")
    p.add_argument("--base-k", type=int, default=1, help="max degree k of the Base-(k+1) schedule")
    p.add_argument("--optimizer", default="awc", choices=["awc", "atc", "gradient-allreduce"],
                   help="adapt-with-combine, adapt-then-combine, or Horovod-style gradient averaging")
    p.add_argument("--partition", default="iid", choices=["iid", "dirichlet"],
                   help="how the training set is split over the ranks")
    p.add_argument("--alpha", type=float, default=0.1, help="Dirichlet concentration (smaller: more skewed)")
    p.add_argument("--compression", default=None,
                   help="AWC/ATC: compressed gossip with error feedback (CHOCO-SGD): int8, int4, fp16, bf16, "
                        "topk:R, randomk:R (R: the fraction kept)")
    p.add_argument("--overlap", default="backward", choices=["backward", "delayed"],
                   help="AWC: send the parameters after the forward pass (backward) or at the end of the step "
                        "before, so the exchange runs during the whole next step (delayed)")
    p.add_argument("--consensus-target", type=float, default=None,
                   help="keep the consensus distance at or below this (first half of training)")
    p.add_argument("--epochs", type=int, default=15, help="passes over the shards")
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--lr", type=float, default=0.05,
                   help=f"SGD learning rate at a global batch of {REFERENCE_BATCH} (4 ranks x 16); scaled with the "
                        "global batch (--lr-scaling), cosine-annealed to 0")
    p.add_argument("--lr-scaling", default="linear", choices=["linear", "none"],
                   help="linear: the learning rate times global batch / 64 (Goyal et al.'s rule: n ranks take "
                        "n/4 times fewer steps per epoch), reached by a linear warm-up when it grows")
    p.add_argument("--warmup-epochs", type=float, default=3,
                   help="epochs of linear warm-up from --lr to the scaled rate (only when scaled up)")
    p.add_argument("--seed", type=int, default=0, help="model initialisation, split and batch order")
    p.add_argument("--out-dir", default="digits_runs", help="histories (JSON) and the plot (PNG)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (for logs)")
    p.add_argument("--lose", default="",
                   help="under shoalrun --fault-tolerant: RANK@EPOCH[,RANK@EPOCH...]: that rank (as launched) "
                        "kills itself with SIGKILL halfway through that epoch, and the survivors go on")
    return p.parse_args()


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = torch.nn.Linear(32 * 4 * 4, 64)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class MLP(torch.nn.Sequential):
    def __init__(self, width=3200):
        super().__init__(torch.nn.Flatten(), torch.nn.Linear(64, width), torch.nn.ReLU(),
                         torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 10))


class Schedule:
    """Sets the optimizer's per-step neighbor weights for time-varying topologies; made
    again for the survivors when a rank is lost (the job shrinks, the ranks renumber):
    one-peer exponential needs a power-of-2 size to average exactly, Base-(k+1) does not."""

    def __init__(self, name, k):
        self.name, self.k, self.size, self.steps = name, k, None, None

    def apply(self, opt, step):
        """The weights of `step` (counted from 0, the same on every rank)."""
        n, r = bf.size(), bf.rank()
        if n != self.size:  # positioned at `step`: survivors that noticed the loss at different steps agree
            self.size = n
            # one peer a step: half to itself, half from the peer (all to itself with no peer)
            halves = lambda schedule: ((s, rc, 1 / (1 + len(rc)), {j: 0.5 for j in rc}) for s, rc in schedule)
            if self.name == "one-peer-exp" and n & (n - 1) == 0:
                self.steps = halves(topology.one_peer_exponential_schedule(n, r))
            elif self.name in ("one-peer-exp", "base-k"):
                self.steps = topology.base_k_plus_1_schedule(n, self.k, r)
            elif self.name == "hierarchical":  # one peer machine a step
                self.steps = halves(topology.one_peer_exponential_schedule(bf.machine_size(), bf.machine_rank()))
            if self.steps is not None:
                self.steps = itertools.islice(self.steps, step, None)
        if self.steps is None:
            return
        send, _, self_w, src = next(self.steps)
        if self.name == "hierarchical":
            opt.self_weight, opt.src_machine_weights, opt.dst_machine_weights = self_w, src, send
        else:
            opt.self_weight, opt.src_weights, opt.dst_weights = self_w, src, send


def retried(op):
    """op() again after a lost rank (fault-tolerant mode): when RankLostError is raised the
    survivors have recovered, and every one of them calls op() next."""
    try:
        return op()
    except bf.RankLostError:
        return op()


def lr_schedule(args, opt, n, steps_per_epoch):
    """Cosine annealing to 0 over the run, of a rate scaled with the global batch (linear
    scaling rule, Goyal et al. 2017, "Accurate, Large Minibatch SGD"): a fixed number of
    epochs over n shards is n times fewer steps, each averaging n times more samples, so
    each step may move n times farther. A scaled-up rate is reached by a linear warm-up from
    --lr over --warmup-epochs. At the reference batch the schedule is the plain cosine."""
    total = steps_per_epoch * args.epochs
    scale = n * args.batch_size / REFERENCE_BATCH if args.lr_scaling == "linear" else 1.0
    if scale == 1.0:
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, total)
    warm = max(1, round(args.warmup_epochs * steps_per_epoch)) if scale > 1 else 0

    def factor(step):
        ramp = 1 + (scale - 1) * min(1.0, step / warm) if warm else scale
        return ramp * 0.5 * (1 + math.cos(math.pi * min(step, total) / total))
    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def make_optimizer(args, model, steps_total):
    base = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    if args.optimizer == "gradient-allreduce":
        return bf.DistributedGradientAllreduceOptimizer(base, model)
    ct = {"allreduce": bf.CommunicationType.allreduce,
          "hierarchical": bf.CommunicationType.hierarchical_neighbor_allreduce}.get(
              args.topology, bf.CommunicationType.neighbor_allreduce)
    control = None
    if args.consensus_target is not None:
        # The paper's guideline: control matters in the first phase of training.
        control = bf.ConsensusControl(args.consensus_target, until_step=steps_total // 2)
    if args.optimizer == "atc":
        return bf.DistributedAdaptThenCombineOptimizer(base, model, communication_type=ct, consensus_control=control,
                                                       compression=args.compression)
    return bf.DistributedAdaptWithCombineOptimizer(base, model, communication_type=ct, consensus_control=control,
                                                   compression=args.compression, overlap=args.overlap)


def evaluate(model, x, y):
    model.eval()
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).float().mean().item()
    model.train()
    return acc


def run_name(args, n):
    parts = [f"{n}ranks", args.optimizer]
    if args.optimizer != "gradient-allreduce":  # the topology plays no part there
        parts.append(args.topology + (str(args.base_k) if args.topology == "base-k" else ""))
    if args.model != "cnn":
        parts.append(args.model)
    parts += [args.partition + (f"{args.alpha:g}" if args.partition == "dirichlet" else ""), f"{args.epochs}ep"]
    if args.consensus_target is not None:
        parts.append(f"target{args.consensus_target:g}")
    if args.compression:
        parts.append(args.compression.replace(":", ""))
    if args.overlap != "backward":
        parts.append(args.overlap)
    return "-".join(parts) + f"-seed{args.seed}"


def plot(out_dir):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for f in sorted(Path(out_dir).glob("*.json")):
        h = json.loads(f.read_text())
        ax1.plot(h["step"], h["test_accuracy"], label=f.stem)
        # exact averaging gives Ξ = 0: floor it so the log scale can show it
        ax2.plot(h["step"], np.maximum(h["consensus_distance"], 1e-9), label=f.stem)
    ax1.set(xlabel="step", ylabel="test accuracy (mean over ranks)")
    ax2.set(xlabel="step", ylabel="consensus distance Ξ (floor 1e-9)", yscale="log")
    ax1.legend(fontsize=7)
    fig.tight_layout()
    path = Path(out_dir) / "digits.png"
    fig.savefig(path, dpi=120)
    return path


def main():
    args = parse_args()
    if args.overlap != "backward" and args.optimizer != "awc":
        raise SystemExit("--overlap delayed is AWC's (--optimizer awc)")
    bf.init()
    r, n = bf.rank(), bf.size()
    lose = {int(who): int(epoch) for who, _, epoch in (item.partition("@") for item in args.lose.split(",") if item)}
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    if args.topology == "ring":
        bf.set_topology(topology.ring_graph(n))
    if args.topology == "hierarchical" and bf.machine_size() > 1:  # consensus control's extra rounds use it
        bf.set_machine_topology(topology.exponential_two_graph(bf.machine_size()))
    images, labels, mine, test_idx = split(r, n, args.partition, args.alpha, args.seed)
    x, y = torch.from_numpy(images).unsqueeze(1), torch.from_numpy(labels)
    x_train, y_train, x_test, y_test = x[mine], y[mine], x[test_idx], y[test_idx]

    if args.topology == "hierarchical" and args.compression:
        raise SystemExit("--compression is neighbor_allreduce's gossip, not hierarchical's")
    model = Net() if args.model == "cnn" else MLP()
    bf.broadcast_parameters(model.state_dict(), root_rank=0)  # same starting point everywhere
    steps_per_epoch = int(bf.allreduce(torch.tensor([len(mine) // args.batch_size], dtype=torch.float64),
                                       op=bf.Average, name="steps_per_epoch").item())
    steps_per_epoch = max(1, steps_per_epoch)  # equal on every rank: the ops must line up
    opt = make_optimizer(args, model, steps_per_epoch * args.epochs)
    sched = lr_schedule(args, opt, n, steps_per_epoch)
    schedule = Schedule(args.topology, args.base_k)
    gen = torch.Generator().manual_seed(args.seed * 1000 + r)

    progress = None
    if r == 0 and not args.no_progress:
        from tqdm import tqdm
        progress = tqdm(total=steps_per_epoch * args.epochs, unit="step", leave=False)
    hist = {"step": [], "test_accuracy": [], "consensus_distance": [], "loss": [], "seconds_at": []}
    step = 0
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        t0, losses = time.perf_counter(), []
        order = torch.randperm(len(mine), generator=gen)
        for b in range(steps_per_epoch):
            if lose.get(r) == epoch and b == steps_per_epoch // 2:
                os.kill(os.getpid(), signal.SIGKILL)  # --lose: this rank dies here
            idx = order[(b * args.batch_size) % max(1, len(mine)):][:args.batch_size]
            if len(idx) == 0:
                idx = order[:args.batch_size]
            schedule.apply(opt, step)
            opt.zero_grad()
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
            step += 1
            if progress is not None:
                progress.update()
        xi = retried(lambda: bf.consensus_distance(model))
        stats = retried(lambda: bf.allreduce(torch.tensor([np.mean(losses), evaluate(model, x_test, y_test)],
                                                          dtype=torch.float64), op=bf.Average, name="epoch_stats"))
        n = bf.size()  # fewer after a lost rank
        rate = n * steps_per_epoch * args.batch_size / (time.perf_counter() - t0)
        hist["step"].append(step)
        hist["loss"].append(stats[0].item())
        hist["test_accuracy"].append(stats[1].item())
        hist["consensus_distance"].append(xi)
        hist["seconds_at"].append(time.perf_counter() - start)  # evaluation included, as for every run
        if bf.rank() == 0:
            msg = (f"epoch {epoch:3d}  loss {stats[0]:.4f}  test accuracy {100 * stats[1]:.2f}%  "
                   f"consensus distance {xi:.3e}  {rate:,.0f} samples/s")
            if getattr(opt, "consensus_control", None) is not None:
                msg += f"  extra gossip rounds {opt.extra_rounds}"
            (progress.write if progress is not None else print)(msg)
    if progress is not None:
        progress.close()
    if hasattr(opt, "overlap"):
        opt.synchronize()  # delayed: the exchange the last step started
    # Bytes each rank sent (mean over ranks): what compression saves.
    sent = retried(lambda: bf.allreduce(torch.tensor([float(bf.stats()["bytes_sent"])], dtype=torch.float64),
                                        op=bf.Average, name="bytes_sent").item())
    if bf.losses():
        hist["lost"] = [[when - time.time() + time.perf_counter() - start, ranks] for when, ranks in bf.losses()]
    if bf.rank() == 0:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        hist.update(args=vars(args), seconds=time.perf_counter() - start)
        (out / f"{run_name(args, n)}.json").write_text(json.dumps(hist))
        path = plot(out)
        print(f"final test accuracy {100 * hist['test_accuracy'][-1]:.2f}% (mean over {n} ranks), "
              f"consensus distance {hist['consensus_distance'][-1]:.3e}, {hist['seconds']:.1f} s"
              + (f"; plot: {path}" if path else ""))
        reached = [t for t, a in zip(hist["seconds_at"], hist["test_accuracy"]) if 100 * a >= args.target_accuracy]
        print(f"time to {args.target_accuracy:.2f}% test accuracy: "
              + (f"{reached[0]:.1f} s" if reached else "not reached"))
        topo = "allreduce" if args.optimizer == "gradient-allreduce" else args.topology
        setting = f"optimizer={args.optimizer} topology={topo} partition={args.partition} ranks={n}"
        if args.model != "cnn":
            setting += f" model={args.model}"
        if args.compression:
            setting += f" compression={args.compression}"
        if args.overlap != "backward":
            setting += f" overlap={args.overlap}"
        for at, ranks in hist.get("lost", []):
            setting += f" lost={','.join(map(str, ranks))}@{at:.1f}s"
        print(summary(setting,
                      args.epochs, hist["test_accuracy"][-1], hist["consensus_distance"][-1], hist["seconds"],
                      bytes_sent=sent),
              flush=True)
    bf.shutdown()


if __name__ == "__main__":
    main()
