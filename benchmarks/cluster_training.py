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
  AWC delayed     the same with overlap="delayed": the exchange of x_{t+1} starts at the end
                  of step() and runs during the next forward and backward
  AWC delayed pairs  the same over Decent-DP's pairs (topology.one_peer_hypercube_schedule: j
                  with j XOR 2^(t mod log2 n); the same bytes on the same links as Decent-DP)
  AWC int8        AWC one-peer with compression="int8" (CHOCO-SGD's compressed gossip: int8
                  with a float32 scale per 256 values, 260/1024 of float32's bytes)
  AWC int8 delayed  both
  AWC exp2        the same on the static exponential-2 graph (the default topology)
  hierarchical    AWC with CommunicationType.hierarchical_neighbor_allreduce on the machines'
                  static exponential-2 graph (within a machine by shared memory)
  hier. one-peer  the same with one peer machine per step (one-peer exp2 over machines)
  hier. delayed   hier. one-peer with overlap="delayed"
  ATC one-peer    DistributedAdaptThenCombineOptimizer, one peer per step
  push-sum        DistributedPushSumOptimizer (window ops, asynchronous), one peer per step
  grad allreduce  DistributedGradientAllreduceOptimizer (Horovod's algorithm, through Shoal)
  DDP gloo        torch DistributedDataParallel over gloo, rendezvous at MASTER_ADDR (machine 0)
  DDP torchrun    the same launched by torchrun, one per machine in the same namespaces (a
                  job of its own after the setting's job: shoalrun starts one rank per
                  machine, which runs torchrun with the machine's ranks as its workers)
  Decent-DP       the decent-dp package's DecentralizedDataParallel (`pip install decent-dp`),
                  topology "one-peer-exp", over the same gloo process group: its update and
                  the launch of the next exchange run in backward hooks, the exchange in
                  flight until the same point of the next backward (delayed mixing too)
  comm only       AWC one-peer's exchange alone (same weights, same buckets), no compute
  comm only pairs the same over Decent-DP's pairs: AWC delayed pairs' exchange alone
  compute only    the same SGD step without communication: the floor

A configuration whose exchange is still in flight after a round's last step (AWC delayed,
Decent-DP) waits for it inside the round's timing, so no exchange runs during another
configuration's round and the pipeline's drain is counted: AWC delayed's drain is
synchronize(), which installs the exchange in flight; the round's next step then only
updates and starts the next exchange (docs/design.md §22), so a round of S steps makes S
exchanges; Decent-DP's drain waits on its pending ops. Its first step only traces the
backward order and its second takes the first update with a blocking exchange, so it runs
at least 2 warm-up steps. After the table, a line per delayed configuration compares it with
its bound max(compute only, its exchange alone: comm only or comm only pairs) and with
Decent-DP and AWC one-peer (s/step ratios of the same run).

Rate = batch x timed steps of all ranks / summed round times, each round timed on the slowest
rank. A synchronous configuration's round is --steps steps on every rank; an asynchronous
one's (push-sum: no rank waits for another, so with a straggler the others take more steps)
is as many steps as each rank takes in --async-seconds (then its drain); s/step is the
round time over the mean steps per rank. Link bytes: each machine's first rank reads its `eth0` counters (/proc/net/dev)
around every timed round; the table gives the mean MiB each machine link sent per step and
the prediction from the algorithm (the sends that cross machines, per step, in model sizes).
"""
import argparse
import gc
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

ASYNCHRONOUS = {"push-sum"}  # no rank waits for another: timed over a duration, not a step count
CONFIGS = ["AWC one-peer", "AWC delayed", "AWC delayed pairs", "AWC int8", "AWC int8 delayed", "AWC exp2",
           "hierarchical", "hier. one-peer", "hier. delayed", "ATC one-peer", "push-sum", "grad allreduce",
           "DDP gloo", "DDP torchrun", "Decent-DP", "comm only", "comm only pairs", "compute only"]
BASELINES = {"grad allreduce", "DDP gloo", "DDP torchrun", "Decent-DP", "comm only", "comm only pairs",
             "compute only"}  # not Shoal's


def eth0_sent():
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "eth0":
                return int(rest.split()[8])
    return 0  # not on an emulated machine


def predicted_models_per_machine(config, size, per_machine):
    """Model copies a machine link sends per step, from the algorithm and the placement: the
    mean over a schedule's cycle (exact when the timed steps are a multiple of it)."""
    import math
    machine = lambda r: r // per_machine  # noqa: E731  (blocks, as shoalrun places them)
    machines = size // per_machine
    if config in ("AWC int8", "AWC int8 delayed"):  # the packed payloads: int8 and a scale per 256
        return predicted_models_per_machine("AWC one-peer", size, per_machine) * 260 / 1024
    if config in ("AWC one-peer", "AWC delayed", "comm only", "ATC one-peer", "push-sum"):
        # step t of one-peer exp2 sends to rank + 2^(t mod the number of powers of 2 below
        # size); AWC delayed's exchange started at the end of step t uses step t's weights
        hops = [2 ** k for k in range((size - 1).bit_length())] or [0]
        return sum(sum(machine(r) != machine((r + h) % size) for r in range(size)) for h in hops) / len(hops) / machines
    if config == "AWC exp2":
        hops = [2 ** k for k in range(int(math.log2(size - 1)) + 1)] if size > 1 else []
        return sum(machine(r) != machine((r + h) % size) for h in hops for r in range(size)) / machines
    if config == "hierarchical":  # one model per out-neighbour machine (exp2 over machines)
        return len([2 ** k for k in range(int(math.log2(machines - 1)) + 1)]) if machines > 1 else 0
    if config in ("hier. one-peer", "hier. delayed"):
        return 1.0 if machines > 1 else 0.0
    if config == "grad allreduce":  # MPICH's node-aware allreduce: 2(M-1)/M among machine leaders
        return 2 * (machines - 1) / machines
    if config in ("DDP gloo", "DDP torchrun"):  # gloo's ring over ranks in blocks: one crossing edge per machine
        return 2 * (size - 1) / size if machines > 1 else 0.0
    if config in ("Decent-DP", "AWC delayed pairs", "comm only pairs"):
        # one-peer-exp round k pairs j with j + 2^k, greedily from rank 0; each pair's gloo
        # allreduce (reduce-scatter, then allgather: half a model each) sends one model per rank.
        rounds = max(1, round(math.log2(size)))
        crossing = 0
        for k in range(rounds):
            used = set()
            for j in range(size):
                if j not in used:
                    used.update((j, (j + 2 ** k) % size))
                    crossing += 2 * (machine(j) != machine((j + 2 ** k) % size))
        return crossing / rounds / machines
    return 0.0


class ParameterExchange:
    """One AWC step's exchange of `model`'s parameters, without the step: the same buckets
    (shoal.torch._buckets.plan: parameters under 64 KiB share a flat buffer) and weights
    (set `self_weight`, `src_weights`, `dst_weights` before each call, as on the optimizer),
    each piece a public `neighbor_allreduce_nonblocking` (no topology check, as AWC), then
    the combination copied into the parameters. Unlike AWC, each result is a new tensor
    (the public op takes no output buffer): one allocation of the model's size per call."""

    def __init__(self, model, prefix):
        from shoal.torch import _buckets
        names = {p: n for n, p in model.named_parameters()}
        self.pieces = [(p, b, b.name if b else f"{prefix}.{names[p]}")
                       for p, b in _buckets.plan(list(names), names, prefix)]
        self.self_weight = self.src_weights = self.dst_weights = None

    def __call__(self):
        import torch

        import shoal.torch as bf
        handles = [bf.neighbor_allreduce_nonblocking(b.gather() if b else p.data, self.self_weight, self.src_weights,
                                                     self.dst_weights, enable_topo_check=False, name=name)
                   for p, b, name in self.pieces]
        with torch.no_grad():
            for (p, b, _), h in zip(self.pieces, handles):
                result = bf.synchronize(h)
                b.scatter(result) if b else p.copy_(result)


def decent_dp(model, data, target, lr):
    """Decent-DP's train step (forward and backward: the update runs in its backward hooks)
    and its drain, over the initialised default process group."""
    import torch
    import torch.nn.functional as F
    try:
        from decent_dp.ddp import DecentralizedDataParallel
    except ImportError as exc:
        raise SystemExit(f"the 'Decent-DP' configuration needs the decent-dp package: "
                         f"pip install decent-dp ({exc})") from None
    ddp = DecentralizedDataParallel(
        model, optim_fn=lambda named: torch.optim.SGD([p for _, p in named], lr=lr, momentum=0.9),
        topology="one-peer-exp")

    def step():  # its hooks zero the gradients after each bucket's update
        F.cross_entropy(ddp(data), target).backward()

    def drain():
        # No public call waits without changing the algorithm (global_avg averages): wait for
        # its per-bucket works and leave them in place, so the next backward still mixes.
        for work in ddp._comm_ops:
            if work is not None:
                work.wait()
    return step, drain


def workload(args, rank):
    """This rank's fixed batch, the model's constructor (the same initial weights on every
    rank) and the optimizer every configuration wraps."""
    import torch
    sys.path.insert(0, HERE)
    from torch_training import MODELS

    torch.set_num_threads(1)
    ctor, shape, classes = MODELS[args.model]
    g = torch.Generator().manual_seed(rank)
    data = torch.randn(args.batch_size, *shape, generator=g)
    target = torch.randint(0, classes, (args.batch_size,), generator=g)

    def fresh():
        torch.manual_seed(0)
        return ctor()

    def sgd(m):
        return torch.optim.SGD(m.parameters(), lr=args.lr, momentum=0.9)
    return data, target, fresh, sgd


def torchrun_node(args):
    """In a shoalrun job of one rank per machine: this machine's torchrun, whose workers are
    the machine's ranks (node-major global ranks, the blocks shoalrun places), meeting at
    machine 0 (MASTER_ADDR, which shoalrun sets). Replaces this process."""
    node = int(os.environ["PMI_RANK"])  # one shoalrun rank per machine: the machine's index
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, f"--nnodes={args.machines}", f"--nproc-per-node={args.np // args.machines}",
           f"--node-rank={node}", f"--master-addr={os.environ['MASTER_ADDR']}", "--master-port=29531",
           os.path.abspath(__file__), "--ddp-worker", "--json", args.json, *job_args(args)]
    os.execv(torchrun, cmd)


def ddp_worker(args):
    """A torchrun worker: "DDP torchrun", timed as the job's configurations are."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    sys.path.insert(0, HERE)
    from torch_training import train_step

    dist.init_process_group("gloo")  # torchrun's environment
    rank, size = dist.get_rank(), dist.get_world_size()
    per_machine_ranks = int(os.environ["LOCAL_WORLD_SIZE"])
    leader = int(os.environ["LOCAL_RANK"]) == 0
    data, target, fresh, sgd = workload(args, rank)
    ddp = nn.parallel.DistributedDataParallel(fresh())
    steps = {"DDP torchrun": train_step(ddp, sgd(ddp), data, target)}

    def gather(t):
        out = [torch.zeros_like(t) for _ in range(size)]
        dist.all_gather(out, t)
        return torch.stack(out)
    secs, taken, sent = time_rounds(args, steps, {}, dist.barrier, gather, leader)
    per_machine = {name: gather(torch.tensor([float(sent[name] if leader else -1)], dtype=torch.float64))[:, 0].tolist()
                   for name in steps}
    if rank == 0:
        result = summary(args, fresh, steps, secs, taken, per_machine, size, per_machine_ranks,
                         size // per_machine_ranks)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    dist.destroy_process_group()


def run_in_job(args):
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    import shoal.torch as bf
    sys.path.insert(0, HERE)
    from torch_training import train_step

    bf.init()
    rank, size = bf.rank(), bf.size()
    data, target, fresh, sgd = workload(args, rank)

    def one_peer(opt, push=False, then=None, pairs=False):
        if pairs and size & (size - 1):  # a rank without a partner would halve its model
            raise SystemExit("the configurations over Decent-DP's pairs need a power-of-two number of ranks")
        schedule = (bf.topology.one_peer_hypercube_schedule if pairs  # Decent-DP's pairs
                    else bf.topology.one_peer_exponential_schedule)(size, rank)

        def set_weights():
            send, recv = next(schedule)
            if push:
                opt.self_weight, opt.dst_weights = 0.5, {d: 0.5 for d in send}
            else:
                opt.self_weight, opt.src_weights, opt.dst_weights = 0.5, {r: 0.5 for r in recv}, send
            if then is not None:
                then()
        return set_weights

    def machine_one_peer(opt):
        schedule = bf.topology.one_peer_exponential_schedule(bf.machine_size(), bf.machine_rank())

        def set_weights():
            send, recv = next(schedule)
            opt.self_weight, opt.src_machine_weights, opt.dst_machine_weights = 0.5, {r: 0.5 for r in recv}, send
        return set_weights

    def gloo():  # one process group for DDP gloo and Decent-DP
        if not dist.is_initialized():
            addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
            port = int(os.environ.get("SHOAL_BENCH_DDP_PORT", "29517"))
            dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=size)

    def build(name):
        """Configuration `name` on a fresh copy of the model: its step, drain and close."""
        m = fresh()
        drain = close = None
        if name == "AWC one-peer":
            opt = bf.DistributedAdaptWithCombineOptimizer(sgd(m), m)
            step = train_step(m, opt, data, target, one_peer(opt))
        elif name in ("AWC delayed", "AWC delayed pairs", "AWC int8", "AWC int8 delayed"):
            opt = bf.DistributedAdaptWithCombineOptimizer(
                sgd(m), m, overlap="delayed" if "delayed" in name else "backward",
                compression="int8" if "int8" in name else None)
            schedule = one_peer(opt, pairs=name.endswith("pairs"))
            step, drain = train_step(m, opt, data, target, schedule), opt.synchronize
        elif name == "AWC exp2":
            step = train_step(m, bf.DistributedAdaptWithCombineOptimizer(sgd(m), m), data, target)
        elif name == "hierarchical":
            bf.set_machine_topology(bf.topology.exponential_two_graph(bf.machine_size()))
            opt = bf.DistributedAdaptWithCombineOptimizer(
                sgd(m), m, communication_type=bf.CommunicationType.hierarchical_neighbor_allreduce)
            step = train_step(m, opt, data, target)
        elif name in ("hier. one-peer", "hier. delayed"):
            opt = bf.DistributedAdaptWithCombineOptimizer(
                sgd(m), m, communication_type=bf.CommunicationType.hierarchical_neighbor_allreduce,
                overlap="delayed" if name == "hier. delayed" else "backward")
            step = train_step(m, opt, data, target, machine_one_peer(opt))
            drain = opt.synchronize if name == "hier. delayed" else None
        elif name == "ATC one-peer":
            opt = bf.DistributedAdaptThenCombineOptimizer(sgd(m), m)
            step = train_step(m, opt, data, target, one_peer(opt))
        elif name == "push-sum":
            opt = bf.DistributedPushSumOptimizer(sgd(m), m)
            close = opt.close
            step, drain = train_step(m, opt, data, target, one_peer(opt, push=True)), opt.synchronize
        elif name == "grad allreduce":
            bf.broadcast_parameters(m.state_dict(), 0)
            step = train_step(m, bf.DistributedGradientAllreduceOptimizer(sgd(m), m), data, target)
        elif name == "DDP gloo":
            gloo()
            ddp = nn.parallel.DistributedDataParallel(m)
            step = train_step(ddp, sgd(ddp), data, target)
        elif name == "Decent-DP":
            gloo()
            step, drain = decent_dp(m, data, target, args.lr)
        elif name in ("comm only", "comm only pairs"):
            exchange = ParameterExchange(m, name.replace(" ", "_"))
            step = one_peer(exchange, then=exchange, pairs=name.endswith("pairs"))
        elif name == "compute only":
            step = train_step(m, sgd(m), data, target)
        else:
            raise SystemExit(f"unknown configuration {name!r}; known: {', '.join(CONFIGS)}")
        return step, drain, close

    wanted = args.configs.split(",") if args.configs else [c for c in CONFIGS if c != "DDP torchrun"]
    leader = bf.local_rank() == 0
    secs, taken, sent, versus = {}, {}, {}, {}
    for group in groups(wanted, args.group):
        # Each group's configurations live together (interleaved rounds); then freed.
        built = {name: build(name) for name in group}
        steps = {name: b[0] for name, b in built.items()}
        drains = {name: b[1] for name, b in built.items() if b[1]}
        g_secs, g_taken, g_sent = time_rounds(args, steps, drains, bf.barrier,
                                              lambda t: bf.allgather(t.view(1, -1)), leader)
        for name in group:
            secs.setdefault(name, []).extend(g_secs[name])
            taken[name] = taken.get(name, 0) + g_taken[name]
            sent[name] = sent.get(name, 0) + g_sent[name]
        rate = {name: g_taken[name] / sum(g_secs[name]) for name in group}
        for name in group:  # against the baselines timed beside it
            if name not in ("grad allreduce", "DDP gloo"):
                versus[name] = {b: rate[name] / rate[b] for b in ("grad allreduce", "DDP gloo") if b in rate}
        for close in (b[2] for b in built.values() if b[2]):
            close()
        del built, steps, drains
        gc.collect()
    per_machine = {name: bf.allgather(torch.tensor([float(sent[name] if leader else -1)])).tolist()
                   for name in secs}
    if dist.is_initialized():
        dist.destroy_process_group()
    if rank == 0:
        result = summary(args, fresh, wanted, secs, taken, per_machine, size, bf.local_size(), bf.machine_size())
        for row in result["rows"]:
            if row["config"] in versus:
                row["versus"] = versus[row["config"]]
        print_table(result)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    bf.shutdown()


def groups(wanted, size):
    """`wanted` in groups of at most `size` configurations (each rank holds a group's models,
    optimizers and buffers at once: 15 took 22 of 23 GiB at 8 ranks), the baselines (grad
    allreduce, DDP gloo) timed in every group, so each ratio is against rounds beside it."""
    base = [c for c in wanted if c in ("grad allreduce", "DDP gloo")]
    rest = [c for c in wanted if c not in base]
    per = max(1, size - len(base))
    return [base + rest[i:i + per] for i in range(0, len(rest), per)] or [base]


def time_rounds(args, steps, drains, barrier, gather, leader):
    """Warm-up, then --rounds interleaved rounds of every configuration (module docstring).
    `gather(t)` stacks every rank's 1-D float64 tensor `t`. Returns per configuration the
    round times (slowest rank), steps of all ranks, and the bytes this machine's link sent
    (counted by its `leader`)."""
    import torch
    for name, step in steps.items():
        # Decent-DP's first step only traces, its second starts the pipeline (module docstring).
        for _ in range(max(args.warmup, 2) if name == "Decent-DP" else args.warmup):
            step()
        if name in drains:
            drains[name]()
    secs = {name: [] for name in steps}
    taken = {name: 0 for name in steps}  # steps, all ranks together
    sent = {name: 0 for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            barrier()
            s0, t0 = eth0_sent() if leader else 0, time.perf_counter()
            n = 0
            if name in ASYNCHRONOUS:  # each rank its own number of steps (module docstring)
                while n == 0 or time.perf_counter() - t0 < args.async_seconds:
                    step()
                    n += 1
            else:
                for n in range(1, args.steps + 1):
                    step()
            if name in drains:  # the exchange still in flight is part of the round (module docstring)
                drains[name]()
            got = gather(torch.tensor([time.perf_counter() - t0, n], dtype=torch.float64))
            secs[name].append(got[:, 0].max().item())
            taken[name] += int(got[:, 1].sum().item())
            if leader:
                sent[name] += eth0_sent() - s0
    return secs, taken, sent


def summary(args, fresh, names, secs, taken, per_machine, size, per_machine_ranks, machines):
    """Rank 0's table rows: samples/s, s/step, link MiB per step and the prediction."""
    n_params = sum(p.numel() for p in fresh().parameters())
    rows = []
    for name in names:
        per_rank = taken[name] / size  # steps per rank, all rounds
        links = [b / per_rank for b in per_machine[name] if b >= 0]
        rows.append({"config": name, "samples_per_s": args.batch_size * taken[name] / sum(secs[name]),
                     "s_per_step": sum(secs[name]) / per_rank,
                     "rounds": secs[name], "link_mib_per_step": [b / 2**20 for b in links],
                     "predicted_models_per_step": predicted_models_per_machine(name, size, per_machine_ranks)})
    return {"model": args.model, "parameters": n_params, "model_mib": n_params * 4 / 2**20,
            "ranks": size, "machines": machines, "batch": args.batch_size,
            "steps": args.steps, "rounds": args.rounds, "rows": rows}


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
        def ratio(b):
            if not b:
                return "-"
            return f"{r.get('versus', {}).get(b['config'], r['samples_per_s'] / b['samples_per_s']):.2f}"
        print(f"{r['config']:<15} {r['samples_per_s']:9.1f} {r['s_per_step']:7.3f} {ratio(base):>12} "
              f"{ratio(ddp):>7} {link:13.1f} {link / result['model_mib']:8.2f} "
              f"{r['predicted_models_per_step']:9.2f}", flush=True)
    rates = {r["config"]: r["samples_per_s"] for r in result["rows"]}
    fastest = max((c for c in rates if c not in BASELINES), key=rates.get, default=None)
    if fastest:
        against = [b for b in ("grad allreduce", "DDP gloo", "DDP torchrun") if b in rates]
        versus = next(r for r in result["rows"] if r["config"] == fastest).get("versus", {})
        print(f"Shoal's fastest decentralized: {fastest}, "
              + ", ".join(f"{versus.get(b, rates[fastest] / rates[b]):.2f}x {b}" for b in against), flush=True)
    line = delayed_line({r["config"]: r["s_per_step"] for r in result["rows"]})
    if line:
        print(line, flush=True)


def delayed_line(s_per_step):
    """Delayed mixing against its bound max(compute only, its exchange alone) and against
    Decent-DP and AWC one-peer: ratios of s/step from one run, a line for each of "AWC
    delayed" (bound: "comm only") and "AWC delayed pairs" (bound: "comm only pairs") that
    ran; None without either."""
    lines = []
    for delayed, comm in (("AWC delayed", "comm only"), ("AWC delayed pairs", "comm only pairs")):
        if delayed not in s_per_step:
            continue
        t = s_per_step[delayed]
        parts = []
        if "compute only" in s_per_step and comm in s_per_step:
            bound = max(s_per_step["compute only"], s_per_step[comm])
            parts.append(f"{t / bound:.2f}x its bound max(compute only, {comm}) = {bound:.3f} s/step")
        parts += [f"{t / s_per_step[c]:.2f}x {c}'s s/step" for c in ("Decent-DP", "AWC one-peer") if c in s_per_step]
        lines.append(f"{delayed}: {t:.3f} s/step" + ("; " if parts else "") + "; ".join(parts))
    return "\n".join(lines) or None


def drive(args):
    """One shoalrun job per link setting (and straggler), then the table and plot."""
    # c10d warns of every peer address without a host name (the emulated machines have none
    # outside their namespaces; /etc/hosts stays untouched).
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    settings = [(link, None) for link in args.links.split(",")]
    if args.straggler:
        settings += [(link, args.straggler) for link in args.links.split(",")]
    wanted = args.configs.split(",") if args.configs else CONFIGS
    in_job = [c for c in wanted if c != "DDP torchrun"]
    results = []
    for link, straggler in settings:
        name = f"cluster_training.{link}{'.straggler' if straggler else ''}"
        shoalrun = [os.path.join(os.path.dirname(sys.executable), "shoalrun"), "--machines", str(args.machines),
                    "--link", link, *(["--straggler", str(straggler)] if straggler else [])]
        result = None
        if in_job:
            out = os.path.abspath(f"{name}.json")
            run([*shoalrun[:1], "-np", str(args.np), *shoalrun[1:], sys.executable, os.path.abspath(__file__),
                 "--json", out, *job_args(args), "--configs", ",".join(in_job)])
            with open(out) as f:
                result = json.load(f)
        if "DDP torchrun" in wanted:
            out = os.path.abspath(f"{name}.torchrun.json")
            run([*shoalrun[:1], "-np", str(args.machines), *shoalrun[1:], sys.executable, os.path.abspath(__file__),
                 "--torchrun-node", "--np", str(args.np), "--machines", str(args.machines), "--json", out,
                 *job_args(args)])
            with open(out) as f:
                extra = json.load(f)
            if result is None:
                result = extra
            else:
                result["rows"] += extra["rows"]
            print_table(result, f"{link}{', straggler ' + str(straggler) if straggler else ''}: ")
            with open(f"{name}.json", "w") as f:  # the setting's table, both jobs' rows
                json.dump(result, f, indent=1)
        results.append((link, straggler, result))
    plot(results)


def run(cmd):
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def job_args(args):
    """The settings a job's ranks take from the driver."""
    return ["--model", args.model, "--batch-size", str(args.batch_size), "--steps", str(args.steps),
            "--rounds", str(args.rounds), "--warmup", str(args.warmup), "--async-seconds", str(args.async_seconds),
            "--lr", str(args.lr), "--group", str(args.group)]


def plot(results):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(11, 4.5))
    configs = [r["config"] for r in results[0][2]["rows"]]
    width = 0.8 / len(results)
    for i, (link, straggler, res) in enumerate(results):
        rates = {r["config"]: r["samples_per_s"] for r in res["rows"]}
        bars = ax.bar([k + i * width for k in range(len(configs))], [rates.get(c, 0) for c in configs], width,
                      label=f"{link}" + (f", straggler {straggler}" if straggler else ""))
        for delayed, comm in (("AWC delayed", "comm only"), ("AWC delayed pairs", "comm only pairs")):
            if all(c in rates for c in (delayed, "compute only", comm)):
                # delayed mixing's bound: the slower of compute and communication, fully overlapped
                ax.plot(configs.index(delayed) + i * width, min(rates["compute only"], rates[comm]), "v",
                        color=bars[0].get_facecolor(), markeredgecolor="black",
                        label="bound max(compute, comm)" if i == 0 and delayed == "AWC delayed" else None)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(configs))], configs, rotation=30, ha="right")
    ax.set_ylabel(f"samples/s ({results[0][2]['ranks']} ranks)")
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
    p.add_argument("--async-seconds", type=float, default=8.0,
                   help="an asynchronous configuration's round: each rank steps for this long")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--group", type=int, default=6,
                   help="configurations alive at once in a job (memory: ~0.2 GiB per configuration and rank "
                        "for mlp11m)")
    p.add_argument("--torchrun-node", action="store_true", help=argparse.SUPPRESS)  # the driver's
    p.add_argument("--ddp-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.links:
        drive(args)
    elif args.torchrun_node:
        torchrun_node(args)
    elif args.ddp_worker:
        ddp_worker(args)
    else:
        run_in_job(args)


if __name__ == "__main__":
    main()
