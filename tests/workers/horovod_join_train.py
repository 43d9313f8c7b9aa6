"""A Horovod-style PyTorch training script with uneven data per rank, ending each epoch in
hvd.join() (our own; only the import differs from a Horovod script: `import shoal.torch
as hvd`). Rank r has 1 + r batches in the first epoch and 1 + (N - 1 - r) in the second
(so rank N - 1, then rank 0, joins last): the ranks that run out join, and their zeros count in the others' averaged gradients (Horovod's Average
divides by size()). After join every rank takes the last joiner's model (the rank join
returns), so all models are identical; each rank also replays the whole job locally with
every rank's data and checks that its model equals that replay exactly.

The model is a linear regression in float64 on data in {-1, 0, 1} with a learning rate of
1/2: every weight, gradient and sum of gradients stays a dyadic number of at most ~48
significant bits (checked with exact rationals at 4 ranks: weights need 42), so the
averaged gradient is exact in any summation order."""
import torch
import torch.nn.functional as F

import shoal.torch as hvd

hvd.init()
R, N = hvd.rank(), hvd.size()
LR, BATCH = 1 / 2, 4
torch.set_default_dtype(torch.float64)


def batches_of(rank, epoch):
    return 1 + rank if epoch == 0 else 1 + (N - 1 - rank)


def data(rank, epoch, i):
    """Batch i of `rank` in `epoch`: any rank can make anyone's."""
    g = torch.Generator().manual_seed(10000 * epoch + 100 * rank + i)
    x = torch.randint(-1, 2, (BATCH, 4), generator=g).double()
    y = torch.randint(-2, 3, (BATCH, 2), generator=g).double()
    return x, y


def new_model():
    model = torch.nn.Linear(4, 2)
    with torch.no_grad():  # dyadic starting weights (the same on every rank, then broadcast)
        model.weight.copy_(torch.arange(8.0).reshape(2, 4) / 8 - 0.5)
        model.bias.zero_()
    return model


model = new_model()
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                     named_parameters=model.named_parameters(), op=hvd.Average)

replay = new_model()
for epoch in range(2):
    for i in range(batches_of(R, epoch)):
        x, y = data(R, epoch, i)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    last = hvd.join()
    assert last == max(range(N), key=lambda r: batches_of(r, epoch)), (epoch, last)
    hvd.broadcast_parameters(model.state_dict(), root_rank=last)

    # The replay: at step i, the sum of the gradients of the ranks that still have a
    # batch, divided by N.
    for i in range(max(batches_of(r, epoch) for r in range(N))):
        total = {n: torch.zeros_like(p) for n, p in replay.named_parameters()}
        for r in range(N):
            if i < batches_of(r, epoch):
                replay.zero_grad()
                x, y = data(r, epoch, i)
                F.mse_loss(replay(x), y).backward()
                for n, p in replay.named_parameters():
                    total[n] += p.grad
        with torch.no_grad():
            for n, p in replay.named_parameters():
                p -= LR * (total[n] / N)
    for (n, p), (_, q) in zip(model.named_parameters(), replay.named_parameters()):
        assert torch.equal(p, q), f"epoch {epoch}: {n} is {p} here, {q} in the replay"
    every = hvd.allgather(torch.cat([p.detach().reshape(1, -1) for p in model.parameters()], 1), name=f"same.{epoch}")
    assert torch.equal(every, every[:1].expand_as(every)), f"epoch {epoch}: the models differ between ranks"

print(f"[rank {R}] models identical and exact after {epoch + 1} epochs with join", flush=True)
hvd.shutdown()
