"""A PyTorch synthetic benchmark written the way Horovod's examples are (our own script,
not a copy): a small ResNet-style model (residual blocks, BatchNorm) trained on one
synthetic batch per rank, `hvd.DistributedOptimizer(optimizer,
named_parameters=model.named_parameters(), compression=..., backward_passes_per_step=2,
op=hvd.Average)`, `broadcast_parameters`/`broadcast_optimizer_state` from rank 0, img/sec
per iteration and in total. Only the import differs from a Horovod script
(`import shoal.torch as hvd`). The last block checks the run (not part of a Horovod
script): every rank holds the same parameters, and the loss went down.

    shoalrun -np 4 python horovod_synthetic_benchmark.py --fp16-allreduce [--sync-bn]
"""
import argparse
import timeit

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

import shoal.torch as hvd

parser = argparse.ArgumentParser(description="PyTorch synthetic benchmark (Horovod style)",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--fp16-allreduce", action="store_true", help="use fp16 compression during allreduce")
parser.add_argument("--sync-bn", action="store_true", help="hvd.SyncBatchNorm in place of BatchNorm2d")
parser.add_argument("--batch-size", type=int, default=4, help="input batch size")
parser.add_argument("--image-size", type=int, default=16, help="input height and width")
parser.add_argument("--num-warmup-batches", type=int, default=1, help="number of warm-up batches")
parser.add_argument("--num-batches-per-iter", type=int, default=2, help="number of batches per benchmark iteration")
parser.add_argument("--num-iters", type=int, default=3, help="number of benchmark iterations")
args = parser.parse_args()

hvd.init()
torch.set_num_threads(1)
torch.manual_seed(hvd.rank())  # every rank starts elsewhere until broadcast_parameters


class BasicBlock(nn.Module):
    def __init__(self, c_in, c_out, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNetTiny(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.layers = nn.Sequential(BasicBlock(8, 8, 1), BasicBlock(8, 16, 2))
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        return self.fc(F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1).flatten(1))


model = ResNetTiny()
if args.sync_bn:
    model = hvd.SyncBatchNorm.convert_sync_batchnorm(model)

# Horovod's recipe: scale the learning rate by the number of ranks.
optimizer = optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=compression, backward_passes_per_step=2, op=hvd.Average)

hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
target = torch.randint(0, 10, (args.batch_size,))


def benchmark_step():
    optimizer.zero_grad()
    for _ in range(2):  # backward_passes_per_step
        loss = F.cross_entropy(model(data), target)
        loss.backward()
    optimizer.step()


def log(s):
    if hvd.rank() == 0:
        print(s, flush=True)


def mean_loss():
    with torch.no_grad():
        return hvd.allreduce(F.cross_entropy(model(data), target), name="check.loss").item()


before = mean_loss()
log(f"Model: ResNetTiny{' with SyncBatchNorm' if args.sync_bn else ''}")
log(f"Batch size: {args.batch_size}")
log(f"Number of ranks: {hvd.size()}")
log("Running warmup...")
timeit.timeit(benchmark_step, number=args.num_warmup_batches)
log("Running benchmark...")
img_secs = []
for x in range(args.num_iters):
    time = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    img_sec = args.batch_size * args.num_batches_per_iter / time
    log(f"Iter #{x}: {img_sec:.1f} img/sec per rank")
    img_secs.append(img_sec)
img_sec_mean = np.mean(img_secs)
img_sec_conf = 1.96 * np.std(img_secs)
log(f"Img/sec per rank: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
log(f"Total img/sec on {hvd.size()} rank(s): {hvd.size() * img_sec_mean:.1f} +-{hvd.size() * img_sec_conf:.1f}")

# ---- checks of this run (not part of a Horovod script) ----
after = mean_loss()
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
every = hvd.allgather(flat[None, :], name="check.params")
assert torch.equal(every, every[:1].expand_as(every)), "the ranks' parameters differ"
if args.sync_bn:  # global statistics: the running stats agree too
    stats = torch.cat([b.reshape(-1).float() for n, b in model.named_buffers() if "running" in n])
    every = hvd.allgather(stats[None, :], name="check.stats")
    assert torch.equal(every, every[:1].expand_as(every)), "the ranks' running statistics differ"
assert after < before, (before, after)
print(f"[rank {hvd.rank()}] models identical; mean loss {before:.4f} -> {after:.4f}", flush=True)
