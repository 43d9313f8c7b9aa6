"""Synthetic training throughput: Shoal's torch optimizers against PyTorch DDP (gloo), same run.

    shoalrun -np 4 python benchmarks/torch_training.py [--model mlp25m|resnet|tiny160]
        [--batch-size 32] [--steps 10] [--rounds 3] [--warmup 3]

Horovod-style: each rank trains on one fixed random batch (inputs and labels drawn once,
no data loading), momentum SGD with cross-entropy, one torch thread per rank. Five
configurations, each with its own copy of the same model (same initial weights), batch
and step counts:

  1. AWC, one-peer exponential schedule (`DistributedAdaptWithCombineOptimizer`; each step
     averages 0.5/0.5 with one peer from `topology.one_peer_exponential_schedule`);
  2. AWC, static exponential-2 graph (default topology and weights);
  3. gradient allreduce through Shoal (`DistributedGradientAllreduceOptimizer`);
  4. `torch.nn.parallel.DistributedDataParallel` on gloo (TCP rendezvous on 127.0.0.1,
     port $SHOAL_BENCH_DDP_PORT, default 29517);
  5. the same momentum SGD without any communication: the floor of a step on these cores.

Every configuration first runs --warmup steps (first-sight negotiation, buffers, DDP
buckets). Then, --rounds times, each configuration in turn runs --steps steps after a
barrier (interleaved, so load changes on a shared host hit all five alike). A step ends
only when its communication has (AWC and allreduce wait in step(), DDP in backward). Rate
= ranks x batch x timed steps / summed round times, each round timed on the slowest rank;
rank 0 prints it with the range over rounds and the ratio to DDP-gloo.

`--model mlp25m` (default): MLP 1024-4096-4096-1000, 25.1M parameters (96 MiB of float32
per model copy), so communication matters. `--model resnet`: a small CIFAR-style ResNet
(32x32 inputs, widths 16/32/64, 2 basic blocks per stage, 0.18M parameters), so compute
dominates. `--model tiny160`: 80 linear layers of 16x16 (160 parameter tensors, 21k
parameters): the per-tensor cost of the optimizers' hooks against DDP's buckets.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import shoal.torch as bf


def mlp25m():
    return nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                         nn.Linear(4096, 1000))


def mlp11m():  # 11.5M parameters (44 MiB): communication-heavy at a small compute cost
    return nn.Sequential(nn.Linear(1024, 3072), nn.ReLU(), nn.Linear(3072, 2048), nn.ReLU(),
                         nn.Linear(2048, 1000))


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.short = (nn.Sequential() if stride == 1 and cin == cout else
                      nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)))
        return F.relu(self.b2(self.c2(y)) + self.short(x))


class ResNet(nn.Module):
    def __init__(self, widths=(16, 32, 64), blocks=2, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU())
        layers, cin = [], widths[0]
        for i, w in enumerate(widths):
            for b in range(blocks):
                layers.append(Block(cin, w, 2 if (b == 0 and i > 0) else 1))
                cin = w
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def tiny160():
    # 80 tiny layers, 160 parameter tensors of 16x16 and 16 floats: communication (one
    # op per tensor) dominates, as the per-op cost of the optimizer hooks does on GPUs.
    layers = []
    for _ in range(79):
        layers += [nn.Linear(16, 16), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(16, 16))


MODELS = {"mlp25m": (mlp25m, (1024,), 1000), "mlp11m": (mlp11m, (1024,), 1000), "resnet": (ResNet, (3, 32, 32), 10),
          "tiny160": (tiny160, (16,), 16)}


def train_step(model, opt, data, target, before_forward=None):
    def step():
        if before_forward is not None:
            before_forward()  # per-step weights must be set before the forward hook sends
        opt.zero_grad()
        F.cross_entropy(model(data), target).backward()
        opt.step()
    return step


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=MODELS, default="mlp25m")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=10, help="timed steps per configuration per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.01)
    args = p.parse_args()

    torch.set_num_threads(1)  # 4 ranks share 2 cores: oversubscribed BLAS threads would dominate
    bf.init()
    rank, size = bf.rank(), bf.size()
    ctor, shape, classes = MODELS[args.model]
    g = torch.Generator().manual_seed(rank)  # each rank its own batch, as in data parallelism
    data = torch.randn(args.batch_size, *shape, generator=g)
    target = torch.randint(0, classes, (args.batch_size,), generator=g)

    def fresh_model():
        # Same initial weights everywhere and for every configuration; one module per
        # configuration so one optimizer's hooks never fire under another's.
        torch.manual_seed(0)
        return ctor()

    def sgd(m):
        return torch.optim.SGD(m.parameters(), lr=args.lr, momentum=0.9)

    configs = []
    # 1. AWC, one peer per step (weights 0.5/0.5, peer from the one-peer exponential schedule).
    m1 = fresh_model()
    awc1 = bf.DistributedAdaptWithCombineOptimizer(sgd(m1), m1)
    schedule = bf.topology.one_peer_exponential_schedule(size, rank)

    def one_peer():
        send, recv = next(schedule)
        awc1.self_weight, awc1.src_weights, awc1.dst_weights = 0.5, {r: 0.5 for r in recv}, send
    configs.append(("AWC one-peer exp2", train_step(m1, awc1, data, target, one_peer)))

    # 2. AWC on the static exponential-2 graph (init()'s default topology and weights).
    m2 = fresh_model()
    configs.append(("AWC static exp2",
                    train_step(m2, bf.DistributedAdaptWithCombineOptimizer(sgd(m2), m2), data, target)))

    # 3. Gradient allreduce through Shoal (weights already equal; broadcast as a real job would).
    m3 = fresh_model()
    bf.broadcast_parameters(m3.state_dict(), 0)
    configs.append(("Shoal grad allreduce",
                    train_step(m3, bf.DistributedGradientAllreduceOptimizer(sgd(m3), m3), data, target)))

    # 4. DDP over gloo, rendezvous over TCP on this host (DDP broadcasts rank 0's weights itself).
    port = int(os.environ.get("SHOAL_BENCH_DDP_PORT", "29517"))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    m4 = nn.parallel.DistributedDataParallel(fresh_model())
    configs.append(("DDP gloo", train_step(m4, sgd(m4), data, target)))

    # 5. The same local step without any communication: the floor the others approach.
    m5 = fresh_model()
    configs.append(("SGD alone (no comm.)", train_step(m5, sgd(m5), data, target)))

    for _, step in configs:  # first-sight negotiation, buffer allocation, DDP bucket setup
        for _ in range(args.warmup):
            step()
    # Rounds interleave the configurations so that a load change on the host (this box is
    # shared) hits all of them alike instead of whichever happened to run at that moment.
    secs = [[] for _ in configs]
    for _ in range(args.rounds):
        for i, (_, step) in enumerate(configs):
            bf.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()  # returns only once its communication is done (step()/backward wait for it)
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            secs[i].append(bf.allgather(elapsed).max().item())  # the job runs at its slowest rank's pace
    dist.destroy_process_group()

    if rank == 0:
        n_params = sum(p.numel() for p in m1.parameters())
        samples = size * args.batch_size * args.steps  # per round
        base = sum(secs[3])
        print(f"model {args.model}: {n_params / 1e6:.2f}M parameters ({n_params * 4 / 2**20:.1f} MiB fp32), "
              f"{size} ranks, batch {args.batch_size}/rank, {args.rounds}x{args.steps} timed steps "
              f"after {args.warmup} warm-up, {torch.get_num_threads()} thread/rank")
        print(f"{'configuration':<22} {'samples/s':>10} {'rounds min-max':>15} {'s/step':>7} {'vs DDP':>7}")
        for (label, _), t in zip(configs, secs):
            total = sum(t)
            spread = f"{samples / max(t):.0f}-{samples / min(t):.0f}"
            print(f"{label:<22} {samples * len(t) / total:10.1f} {spread:>15} "
                  f"{total / (len(t) * args.steps):7.3f} {base / total:7.2f}")
    bf.shutdown()


if __name__ == "__main__":
    main()
