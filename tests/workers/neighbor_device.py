"""tests/workers/neighbor.py's checks on fake-device torch tensors (issue 16): every numpy
neighbor op that neighbor.py calls through `shoal.<op>` is routed through `shoal.torch`
instead, on CPU torch tensors that the torch adapter describes as CUDA tensors of fake
devices (SHOAL_CUDA_PLUGIN=fake SHOAL_FAKE_DEVICE=1), so each check exercises the GPU path
(staging or direct MPI or NCCL, per SHOAL_GPU_BACKEND) with its own arguments, names and
weights, and compares with numpy as before. The checks are not copied: neighbor.py runs
as is, after the routing below (tests/gpu/test_fake_device.py).

Routing: arrays (and lists, numpy scalars) go in as torch tensors sharing the array's
memory where torch can (C-contiguous, native byte order), so "overwrite the input once the
op completed" still writes the op's own tensor; results come back as numpy arrays of the
input's ndarray subclass. Handles of the nonblocking forms are the torch binding's;
`shoal.synchronize`/`wait` turn their results into numpy too. Every other name of `shoal`
(topology, stats, barrier, ...) is shared by both bindings and left alone.

Two checks of this file run after neighbor.py's (each its own pytest item, as theirs):
ranks submitting the same neighbor ops in different orders, which neighbor.py does not do
and NCCL makes matter; then that the neighbor data of the whole run went over the backend
SHOAL_GPU_BACKEND names (`shoal.stats()` counters per backend)."""
import functools
import inspect
import os
import runpy
import sys
from pathlib import Path

import numpy as np
import torch

import checks
from checks import check
import shoal
import shoal.torch as bf
from shoal import _gpu

if os.environ.get("SHOAL_FAKE_DEVICE") != "1" or not _gpu.is_fake(_gpu.plugin().build):
    sys.exit("neighbor_device.py needs SHOAL_CUDA_PLUGIN=fake and SHOAL_FAKE_DEVICE=1")
shoal.init()
R = shoal.rank()

from shoal.torch._adapter import ADAPTER  # noqa: E402

# A CPU tensor must reach the core as a device tensor, or this file tests the host path.
_kind = ADAPTER.device(torch.zeros(1))
assert _kind[0] == 1, f"a CPU tensor is not described as a fake-device tensor: {_kind}"

_like = {}  # handle of a routed nonblocking op -> the input its result should look like
_routed = {"ops": 0}


def to_torch(x):
    a = np.asarray(x)  # lists and numpy scalars too; a subclass is viewed as ndarray
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)
    return torch.from_numpy(a)  # shares the array's memory


def to_numpy(t, like):
    out = t.numpy()
    if isinstance(like, np.ndarray) and type(like) is not np.ndarray:
        out = out.view(type(like))
    return out


def blocking(torch_fn):
    @functools.wraps(torch_fn)
    def call(tensor, *args, **kwargs):
        _routed["ops"] += 1
        return to_numpy(torch_fn(to_torch(tensor), *args, **kwargs), tensor)
    return call


def nonblocking(torch_fn):
    @functools.wraps(torch_fn)
    def call(tensor, *args, **kwargs):
        _routed["ops"] += 1
        h = torch_fn(to_torch(tensor), *args, **kwargs)
        _like[h] = tensor
        return h
    return call


def synchronize(handle):
    try:
        out = bf.synchronize(handle)
    except KeyboardInterrupt:  # the op runs on and its handle stays valid
        raise
    except BaseException:
        _like.pop(handle, None)
        raise
    like = _like.pop(handle, None)
    return to_numpy(out, like) if isinstance(out, torch.Tensor) else out


for _op in ("neighbor_allreduce", "neighbor_allgather", "hierarchical_neighbor_allreduce", "pair_gossip"):
    setattr(shoal, _op, blocking(getattr(bf, _op)))
    setattr(shoal, _op + "_nonblocking", nonblocking(getattr(bf, _op + "_nonblocking")))
shoal.synchronize = shoal.wait = synchronize

# neighbor.py's stats check resets the counters; keep what the per-backend counters had.
_carried = {}
_reset_stats = shoal.reset_stats


def _backend_counters():
    return {k: v for k, v in shoal.stats().items() if k.startswith("neighbor_bytes_sent_")}


def reset_stats():
    for k, v in _backend_counters().items():
        _carried[k] = _carried.get(k, 0) + v
    _reset_stats()


shoal.reset_stats = reset_stats


@check
def neighbor_ops_submitted_in_different_orders():
    # neighbor.py's ranks submit their ops in one order. Here each rank submits the same
    # named neighbor ops (static, dynamic, dst_weights, allgather, pair_gossip, a tensor
    # sent from its own memory, float32 and float64) in its own order and synchronizes
    # them in another; twice, so the second round runs on the negotiated (cached) path.
    # NCCL needs one order per communicator: the core must choose it (issue 16).
    # Exact: small integers and power-of-two weights.
    n = shoal.size()
    if n == 1:
        raise checks.Skip("needs 2 or more ranks")
    from shoal import topology as T
    shoal.set_topology(T.exponential_two_graph(n))
    ins, nxt, prv = shoal.in_neighbor_ranks(), (R + 1) % n, (R - 1) % n
    x = lambda r, k, dt="float64": ((np.arange(12) + 5 * r + k) % 9 - 4).astype(dt)
    big = lambda r: ((np.arange(20_000) * (r + 1)) % 13).astype("float64")  # 160 KB
    rows = lambda r: np.full((r % 3 + 1, 2), r, "int32")
    ops = []  # (name, submit, expected)
    for k, dt in enumerate(("float32", "float64", "float32", "float64")):
        ops.append((f"order.static.{k}", lambda k=k, dt=dt: shoal.neighbor_allreduce_nonblocking(
            x(R, k, dt), name=f"order.static.{k}"),
            (x(R, k, dt) + sum(x(j, k, dt) for j in ins)) / np.asarray(len(ins) + 1, dt)))
    ops.append(("order.dyn", lambda: shoal.neighbor_allreduce_nonblocking(
        x(R, 7), self_weight=0.5, src_weights={prv: 0.5}, dst_weights=[nxt], name="order.dyn"),
        0.5 * x(R, 7) + 0.5 * x(prv, 7)))
    ops.append(("order.dstw", lambda: shoal.neighbor_allreduce_nonblocking(
        x(R, 8), self_weight=0.5, src_weights={prv: 0.5}, dst_weights={nxt: 0.25}, name="order.dstw"),
        0.5 * x(R, 8) + 0.125 * x(prv, 8)))
    ops.append(("order.big", lambda: shoal.neighbor_allreduce_nonblocking(
        big(R), self_weight=0.5, src_weights={prv: 0.5}, dst_weights=[nxt], name="order.big"),
        0.5 * big(R) + 0.5 * big(prv)))
    ops.append(("order.gather", lambda: shoal.neighbor_allgather_nonblocking(
        rows(R), src_ranks=[prv], dst_ranks=[nxt], name="order.gather"), rows(prv)))
    if n % 2 == 0:
        ops.append(("order.pair", lambda: shoal.pair_gossip_nonblocking(x(R, 9), R ^ 1, name="order.pair"),
                    (x(R, 9) + x(R ^ 1, 9)) / 2))
    for step in range(2):
        turn = (R + step) % len(ops)
        order = ops[turn:] + ops[:turn]
        if R % 2:
            order.reverse()  # neighbours never share an order
        handles = {name: submit() for name, submit, _ in order}
        for name, _, want in sorted(ops, key=lambda op: op[0], reverse=R % 2 == 0):
            got = shoal.synchronize(handles[name])
            assert got.dtype == want.dtype and np.array_equal(got, want), (step, name, got, want)
    shoal.barrier()


@check
def device_path_carried_the_neighbor_data():
    # Runs last (see run_all below), over the whole run's counters. Counter names are the
    # core's per-backend counters (issue 16): bytes of neighbor ops sent by NCCL, given to
    # a CUDA-aware MPI from device memory, and staged through host memory into MPI.
    assert _routed["ops"] > 0, "no neighbor op was routed through shoal.torch"
    if shoal.size() == 1:
        raise checks.Skip("one rank sends nothing")
    got = _backend_counters()
    for k, v in got.items():
        got[k] = v + _carried.get(k, 0)
    names = ("neighbor_bytes_sent_nccl", "neighbor_bytes_sent_mpi", "neighbor_bytes_sent_staged")
    missing = [k for k in names if k not in got]
    assert not missing, f"shoal.stats() has no {missing} (per-backend neighbor counters): {sorted(got)}"
    backend = os.environ.get("SHOAL_GPU_BACKEND", "mpi")
    direct = os.environ.get("SHOAL_FAKE_CUDA_AWARE_MPI") == "1"
    want = "nccl" if backend == "nccl" else "mpi" if direct else "staged"
    assert got[f"neighbor_bytes_sent_{want}"] > 0, (backend, direct, got)
    for other in {"nccl", "mpi", "staged"} - {want}:
        assert got[f"neighbor_bytes_sent_{other}"] == 0, (backend, direct, other, got)


# neighbor.py's checks register after these, so they move to the end at run time.
_mine = [fn for fn in checks._checks if fn.__module__ == __name__]
_run_all = checks.run_all


def run_all(*args, **kwargs):
    """neighbor.py's run_all, with a PASS line per check (one pytest id each) and this
    file's checks last."""
    checks._checks[:] = [fn for fn in checks._checks if fn not in _mine] + _mine
    if "report" in inspect.signature(_run_all).parameters:
        kwargs["report"] = True
    failed = _run_all(*args, **kwargs)
    shoal.barrier()  # leave together: staged work of a peer's last op may still be routing
    return failed


checks.run_all = run_all
runpy.run_path(str(Path(__file__).with_name("neighbor.py")), run_name="__main__")
