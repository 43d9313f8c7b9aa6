"""Children forked after init() (DataLoader workers, multiprocessing) cannot communicate:
each call raises at once, saying why; the parent is unaffected."""
import multiprocessing
import time

import torch

import shoal.torch as bf

bf.init()


def try_collective(tag):
    t0 = time.monotonic()
    try:
        bf.allreduce(torch.ones(2), name=f"child.{tag}")
        return f"worker {tag}: no error"
    except Exception as exc:  # noqa: BLE001 - the test reads what it was
        return f"worker {tag}: {type(exc).__name__} after {time.monotonic() - t0:.3f}s: {exc} rank()={bf.rank()}"


class Items(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return try_collective(f"item{i}")


def child(queue):
    queue.put(try_collective("process"))


loader = torch.utils.data.DataLoader(Items(), batch_size=None, num_workers=2, multiprocessing_context="fork")
lines = []
for epoch in range(2):  # the parent trains between and after the workers' attempts
    got = list(loader)
    lines += got if epoch == 0 else []
    total = bf.allreduce(torch.full((3,), float(bf.rank() + epoch)), average=False, name=f"sum{epoch}")
    assert total.tolist() == [float(sum(range(bf.size())) + bf.size() * epoch)] * 3, total
ctx = multiprocessing.get_context("fork")
q = ctx.Queue()
p = ctx.Process(target=child, args=(q,))
p.start()
lines.append(q.get(timeout=30))
p.join(30)
assert p.exitcode == 0, p.exitcode
bf.barrier()
for line in lines:
    print(line, flush=True)
print("parent sums ok", flush=True)
