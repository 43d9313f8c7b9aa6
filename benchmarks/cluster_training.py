"""Decentralized training against allreduce where the network is the bottleneck: synthetic
training throughput on an emulated cluster, with what each machine's link carried.

Driver (as root; runs one shoalrun job per setting, writes a table and cluster_training.png):

    python benchmarks/cluster_training.py --links 1gbit,200mbit [--straggler 0.25] [--np 8 --machines 4]

One setting by hand (inside a job, as the driver runs it):

    shoalrun -np 8 --machines 4 --link 200mbit python benchmarks/cluster_training.py --json out.json

Each configuration trains its own copy of the same model (same initial weights) on one fixed
random batch per rank (torch_training.py's set-up: momentum SGD, cross-entropy, one torch
thread per rank), interleaved over --rounds rounds of --steps steps after --warmup steps:

  AWC one-peer    DistributedAdaptWithCombineOptimizer, one peer per step (one-peer exp2)
  AWC exp2        the same on the static exponential-2 graph (the default topology)
  hierarchical    AWC with CommunicationType.hierarchical_neighbor_allreduce on the machines'
                  static exponential-2 graph (within a machine by shared memory)
  hier. one-peer  the same with one peer machine per step (one-peer exp2 over machines)
  ATC one-peer    DistributedAdaptThenCombineOptimizer, one peer per step
  push-sum        DistributedPushSumOptimizer (window ops, asynchronous), one peer per step
  grad allreduce  DistributedGradientAllreduceOptimizer (Horovod's algorithm, through Shoal)
  DDP gloo        torch DistributedDataParallel over gloo, rendezvous at MASTER_ADDR (machine 0)
  compute only    the same SGD step without communication: the floor

Rate = ranks x batch x timed steps / summed round times, each round timed on the slowest
rank. Link bytes: each machine's first rank reads its `eth0` counters (/proc/net/dev)
around every timed round; the table gives the mean MiB each machine link sent per step and
the prediction from the algorithm (the sends that cross machines, per step, in model sizes).
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

CONFIGS = ["AWC one-peer", "AWC exp2", "hierarchical", "hier. one-peer", "ATC one-peer", "push-sum", "grad allreduce",
           "DDP gloo", "compute only"]


def eth0_sent():
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "eth0":
                return int(rest.split()[8])
    return 0  # not on an emulated machine


def predicted_models_per_machine(config, size, per_machine):
    """Model copies a machine link sends per step, from the algorithm and the placement."""
    import math
    machine = lambda r: r // per_machine  # noqa: E731  (blocks, as shoalrun places them)
    machines = size // per_machine
    if config in ("AWC one-peer", "ATC one-peer", "push-sum"):
        hops = [2 ** k for k in range(max(1, int(math.log2(size))))]
        cross = sum(machine(r) != machine((r + h) % size) for h in hops for r in range(size))
        return cross / len(hops) / machines
    if config == "AWC exp2":
        hops = [2 ** k for k in range(int(math.log2(size - 1)) + 1)] if size > 1 else []
        return sum(machine(r) != machine((r + h) % size) for h in hops for r in range(size)) / machines
    if config == "hierarchical":  # one model per out-neighbour machine (exp2 over machines)
        return len([2 ** k for k in range(int(math.log2(machines - 1)) + 1)]) if machines > 1 else 0
    if config == "hier. one-peer":
        return 1.0 if machines > 1 else 0.0
    if config == "grad allreduce":  # MPICH's node-aware allreduce: 2(M-1)/M among machine leaders
        return 2 * (machines - 1) / machines
    if config == "DDP gloo":  # gloo's ring over ranks in blocks: one crossing edge per machine
        return 2 * (size - 1) / size if machines > 1 else 0.0
    return 0.0


def run_in_job(args):
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    import shoal.torch as bf
    sys.path.insert(0, HERE)
    from torch_training import MODELS, train_step

    torch.set_num_threads(1)
    bf.init()
    rank, size = bf.rank(), bf.size()
    ctor, shape, classes = MODELS[args.model]
    g = torch.Generator().manual_seed(rank)
    data = torch.randn(args.batch_size, *shape, generator=g)
    target = torch.randint(0, classes, (args.batch_size,), generator=g)

    def fresh():
        torch.manual_seed(0)
        return ctor()

    def sgd(m):
        return torch.optim.SGD(m.parameters(), lr=args.lr, momentum=0.9)

    def one_peer(opt, push=False):
        schedule = bf.topology.one_peer_exponential_schedule(size, rank)

        def set_weights():
            send, recv = next(schedule)
            if push:
                opt.self_weight, opt.dst_weights = 0.5, {d: 0.5 for d in send}
            else:
                opt.self_weight, opt.src_weights, opt.dst_weights = 0.5, {r: 0.5 for r in recv}, send
        return set_weights

    def machine_one_peer(opt):
        schedule = bf.topology.one_peer_exponential_schedule(bf.machine_size(), bf.machine_rank())

        def set_weights():
            send, recv = next(schedule)
            opt.self_weight, opt.src_machine_weights, opt.dst_machine_weights = 0.5, {r: 0.5 for r in recv}, send
        return set_weights

    wanted = args.configs.split(",") if args.configs else CONFIGS
    steps, closers = {}, []
    for name in wanted:
        m = fresh()
        if name == "AWC one-peer":
            opt = bf.DistributedAdaptWithCombineOptimizer(sgd(m), m)
            steps[name] = train_step(m, opt, data, target, one_peer(opt))
        elif name == "AWC exp2":
            steps[name] = train_step(m, bf.DistributedAdaptWithCombineOptimizer(sgd(m), m), data, target)
        elif name == "hierarchical":
            bf.set_machine_topology(bf.topology.exponential_two_graph(bf.machine_size()))
            opt = bf.DistributedAdaptWithCombineOptimizer(
                sgd(m), m, communication_type=bf.CommunicationType.hierarchical_neighbor_allreduce)
            steps[name] = train_step(m, opt, data, target)
        elif name == "hier. one-peer":
            opt = bf.DistributedAdaptWithCombineOptimizer(
                sgd(m), m, communication_type=bf.CommunicationType.hierarchical_neighbor_allreduce)
            steps[name] = train_step(m, opt, data, target, machine_one_peer(opt))
        elif name == "ATC one-peer":
            opt = bf.DistributedAdaptThenCombineOptimizer(sgd(m), m)
            steps[name] = train_step(m, opt, data, target, one_peer(opt))
        elif name == "push-sum":
            opt = bf.DistributedPushSumOptimizer(sgd(m), m)
            closers.append(opt.close)
            steps[name] = train_step(m, opt, data, target, one_peer(opt, push=True))
        elif name == "grad allreduce":
            bf.broadcast_parameters(m.state_dict(), 0)
            steps[name] = train_step(m, bf.DistributedGradientAllreduceOptimizer(sgd(m), m), data, target)
        elif name == "DDP gloo":
            addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
            port = int(os.environ.get("SHOAL_BENCH_DDP_PORT", "29517"))
            dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=size)
            ddp = nn.parallel.DistributedDataParallel(m)
            steps[name] = train_step(ddp, sgd(ddp), data, target)
        elif name == "compute only":
            steps[name] = train_step(m, sgd(m), data, target)
        else:
            raise SystemExit(f"unknown configuration {name!r}; known: {', '.join(CONFIGS)}")

    for step in steps.values():
        for _ in range(args.warmup):
            step()
    secs = {name: [] for name in steps}
    sent = {name: 0 for name in steps}
    leader = bf.local_rank() == 0
    for _ in range(args.rounds):
        for name, step in steps.items():
            bf.barrier()
            s0, t0 = eth0_sent() if leader else 0, time.perf_counter()
            for _ in range(args.steps):
                step()
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            secs[name].append(bf.allgather(elapsed).max().item())
            if leader:
                sent[name] += eth0_sent() - s0
    per_machine = {name: bf.allgather(torch.tensor([float(sent[name] if leader else -1)])).tolist()
                   for name in steps}
    for close in closers:
        close()
    if dist.is_initialized():
        dist.destroy_process_group()
    if rank == 0:
        n_params = sum(p.numel() for p in fresh().parameters())
        model_bytes = n_params * 4
        samples = size * args.batch_size * args.steps
        rows = []
        for name in steps:
            links = [b / (args.rounds * args.steps) for b in per_machine[name] if b >= 0]
            rows.append({"config": name, "samples_per_s": samples * len(secs[name]) / sum(secs[name]),
                         "s_per_step": sum(secs[name]) / (len(secs[name]) * args.steps),
                         "rounds": secs[name], "link_mib_per_step": [b / 2**20 for b in links],
                         "predicted_models_per_step": predicted_models_per_machine(name, size, bf.local_size())})
        result = {"model": args.model, "parameters": n_params, "model_mib": model_bytes / 2**20,
                  "ranks": size, "machines": bf.machine_size(), "batch": args.batch_size,
                  "steps": args.steps, "rounds": args.rounds, "rows": rows}
        print_table(result)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    bf.shutdown()


def print_table(result, title=""):
    base = next((r for r in result["rows"] if r["config"] == "grad allreduce"), None)
    ddp = next((r for r in result["rows"] if r["config"] == "DDP gloo"), None)
    print(f"{title}model {result['model']}: {result['parameters'] / 1e6:.1f}M parameters "
          f"({result['model_mib']:.1f} MiB), {result['ranks']} ranks on {result['machines']} machines, "
          f"batch {result['batch']}/rank, {result['rounds']}x{result['steps']} timed steps", flush=True)
    print(f"{'configuration':<15} {'samples/s':>9} {'s/step':>7} {'vs allreduce':>12} {'vs DDP':>7} "
          f"{'link MiB/step':>13} {'= models':>8} {'predicted':>9}")
    for r in result["rows"]:
        link = sum(r["link_mib_per_step"]) / max(1, len(r["link_mib_per_step"]))
        ratio = lambda b: f"{r['samples_per_s'] / b['samples_per_s']:.2f}" if b else "-"  # noqa: E731
        print(f"{r['config']:<15} {r['samples_per_s']:9.1f} {r['s_per_step']:7.3f} {ratio(base):>12} "
              f"{ratio(ddp):>7} {link:13.1f} {link / result['model_mib']:8.2f} "
              f"{r['predicted_models_per_step']:9.2f}", flush=True)


def drive(args):
    """One shoalrun job per link setting (and straggler), then the table and plot."""
    settings = [(link, None) for link in args.links.split(",")]
    if args.straggler:
        settings += [(link, args.straggler) for link in args.links.split(",")]
    results = []
    for link, straggler in settings:
        out = os.path.abspath(f"cluster_training.{link}{'.straggler' if straggler else ''}.json")
        cmd = [os.path.join(os.path.dirname(sys.executable), "shoalrun"), "-np", str(args.np),
               "--machines", str(args.machines), "--link", link,
               *(["--straggler", str(straggler)] if straggler else []),
               sys.executable, os.path.abspath(__file__), "--json", out, "--model", args.model,
               "--batch-size", str(args.batch_size), "--steps", str(args.steps), "--rounds", str(args.rounds),
               "--warmup", str(args.warmup), *(["--configs", args.configs] if args.configs else [])]
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        with open(out) as f:
            results.append((link, straggler, json.load(f)))
    plot(results)


def plot(results):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4.5))
    configs = [r["config"] for r in results[0][2]["rows"]]
    width = 0.8 / len(results)
    for i, (link, straggler, res) in enumerate(results):
        rates = {r["config"]: r["samples_per_s"] for r in res["rows"]}
        ax.bar([k + i * width for k in range(len(configs))], [rates.get(c, 0) for c in configs], width,
               label=f"{link}" + (f", straggler {straggler}" if straggler else ""))
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(configs))], configs, rotation=20)
    ax.set_ylabel("samples/s (8 ranks)")
    ax.set_title(f"{results[0][2]['model']} on {results[0][2]['machines']} emulated machines")
    ax.legend()
    fig.tight_layout()
    fig.savefig("cluster_training.png", dpi=110)
    print("wrote cluster_training.png")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--links", help="driver: comma-separated link rates, one job each (e.g. 1gbit,200mbit)")
    p.add_argument("--straggler", type=float, help="driver: also run each rate with this straggler")
    p.add_argument("--np", type=int, default=8)
    p.add_argument("--machines", type=int, default=4)
    p.add_argument("--json", help="in a job: write rank 0's results here")
    p.add_argument("--model", default="mlp11m")
    p.add_argument("--configs", help="comma-separated subset of: " + ", ".join(CONFIGS))
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.01)
    args = p.parse_args()
    if args.links:
        drive(args)
    else:
        run_in_job(args)


if __name__ == "__main__":
    main()
