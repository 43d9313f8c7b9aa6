"""Per-op cost of small ops by entry point: numpy, torch eager, torch compiled, against mpi4py.

    shoalrun -np 4 python benchmarks/small_ops.py [--iters 400] [--bytes 4096]

Three 4 KiB exchanges, each through every entry point and through a hand-written mpi4py
reference on the same ranks in the same run:

  * one-peer neighbor_allreduce: blocking, named, dynamic weights (0.5 self, 0.5 from
    rank r - 2^t, sent to r + 2^t, t cycling over log2(n)), with the default topology
    check (and, numpy only, without it); the reference is Sendrecv plus a numpy combine;
  * allreduce (average); the reference is Allreduce plus a divide; also as
    allreduce_nonblocking_ + synchronize (an optimizer hook's form);
  * broadcast from the last rank; the reference is Bcast into a new array.

Timing as in benchmarks/neighbor_ops.py (barrier before each iteration, alternating blocks,
median of the slowest rank). "cpu us" is this process's CPU time per op (time.process_time),
the cost a training step pays on its cores. The last line divides each "torch compiled" time
by the "torch eager" time of the same op in the same run, also less torch.compile's own
per-call cost (row "x * 2 (no op)": a compiled `x * 2` less the eager one, whose "mpi4py"
column is the eager `x * 2`), and against the floor of a compiled call on these cores: the
compiled `x * 2` followed by the eager allreduce (row "compiled no-op, eager op"; on shared
cores a rank busy in torch.compile's call delays the ranks waiting for it). The 160-tensor
optimizer step against DDP-gloo is `benchmarks/torch_training.py --model tiny160`.
"""
import argparse
import os
import sys
import time

import numpy as np
import torch
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from neighbor_ops import timed  # noqa: E402  (same timing method as the neighbor table)

import shoal  # noqa: E402
import shoal.torch as bf  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=400)
    p.add_argument("--bytes", type=int, default=4096)
    args = p.parse_args()
    torch.set_num_threads(1)
    bf.init()
    comm = MPI.COMM_WORLD
    r, n = comm.Get_rank(), comm.Get_size()
    tau = max(1, (n - 1).bit_length())
    x_np = np.random.default_rng(r).standard_normal(args.bytes // 8)
    x_t = torch.from_numpy(x_np.copy())
    recv = np.empty_like(x_np)
    t = {"step": 0}

    def peer():
        k = 2 ** (t["step"] % tau)
        t["step"] += 1
        return (r - k) % n, (r + k) % n

    def nar_numpy(**check):  # the default topology check, or `enable_topo_check=False`
        src, dst = peer()
        shoal.neighbor_allreduce(x_np, self_weight=0.5, src_weights={src: 0.5}, dst_weights=[dst],
                                 name="small.nar" + str(check), **check)

    def nar_torch(fn=bf.neighbor_allreduce):
        src, dst = peer()
        fn(x_t, self_weight=0.5, src_weights={src: 0.5}, dst_weights=[dst], name="small.nar")

    compiled_nar = torch.compile(lambda x, s, d: bf.neighbor_allreduce(
        x, self_weight=0.5, src_weights={s: 0.5}, dst_weights=[d], name="small.nar"), dynamic=False)

    def nar_compiled():
        src, dst = peer()
        compiled_nar(x_t, src, dst)

    def nar_ref():
        src, dst = peer()
        comm.Sendrecv(x_np, dest=dst, recvbuf=recv, source=src)
        out = x_np + recv
        out *= 0.5

    compiled_ar = torch.compile(lambda x: bf.allreduce(x, name="small.ar"), dynamic=False)

    def ar_ref():
        out = np.empty_like(x_np)
        comm.Allreduce(x_np, out, op=MPI.SUM)
        out /= n

    def bc_ref():
        out = x_np.copy() if r == n - 1 else np.empty_like(x_np)
        comm.Bcast(out, root=n - 1)

    cases = [
        ("neighbor_allreduce", "numpy", nar_numpy, nar_ref),
        ("neighbor_allreduce", "numpy, no check", lambda: nar_numpy(enable_topo_check=False), nar_ref),
        ("neighbor_allreduce", "torch eager", nar_torch, nar_ref),
        ("neighbor_allreduce", "torch compiled", nar_compiled, nar_ref),
        ("allreduce", "numpy", lambda: shoal.allreduce(x_np, name="small.ar"), ar_ref),
        ("allreduce", "torch eager", lambda: bf.allreduce(x_t, name="small.ar"), ar_ref),
        ("allreduce", "torch compiled", lambda: compiled_ar(x_t), ar_ref),
        # A gradient hook's form: start in place, synchronize later.
        ("allreduce_nb_", "numpy", lambda: shoal.synchronize(shoal.allreduce_nonblocking_(x_np, name="small.nb")),
         ar_ref),
        ("allreduce_nb_", "torch eager", lambda: bf.synchronize(bf.allreduce_nonblocking_(x_t, name="small.nb")),
         ar_ref),
        ("broadcast", "numpy", lambda: shoal.broadcast(x_np, n - 1, name="small.bc"), bc_ref),
        ("broadcast", "torch eager", lambda: bf.broadcast(x_t, n - 1, name="small.bc"), bc_ref),
    ]
    # torch.compile's own cost per call, whatever the graph holds: a compiled `x * 2`
    # against the eager one, timed the same way.
    compiled_mul = torch.compile(lambda x: x * 2, dynamic=False)
    cases.append(("x * 2 (no op)", "torch compiled", lambda: compiled_mul(x_t), lambda: x_t * 2))
    # The floor of a compiled allreduce on these cores: torch.compile's call with nothing of
    # Shoal's in it, then the eager op (busy ranks delay the ones they share cores with).
    cases.append(("allreduce", "compiled no-op, eager op",
                  lambda: (compiled_mul(x_t), bf.allreduce(x_t, name="small.ar")), ar_ref))
    rows = []
    for op, entry, mine, ref in cases:
        for fn in (mine, ref):  # warm-up: negotiation, compilation, every peer
            for _ in range(2 * tau + 2):
                fn()
        comm.Barrier()
        c0 = time.process_time()
        for _ in range(args.iters // 4):  # back to back: the ops pace the ranks themselves
            mine()
        cpu = (time.process_time() - c0) / (args.iters // 4)
        cpu = comm.allreduce(cpu, op=MPI.MAX)
        t_mine, t_ref = timed(mine, ref, args.iters, tau * max(1, 10 // tau), comm)
        rows.append((op, entry, t_mine, t_ref, cpu))
    if r == 0:
        print(f"{n} ranks, {args.bytes} bytes, median seconds per op (max over ranks)")
        print(f"{'op':<19} {'entry':<24} {'shoal':>10} {'mpi4py':>10} {'ratio':>6} {'cpu us':>7}")
        for op, entry, a, b, cpu in rows:
            print(f"{op:<19} {entry:<24} {a:10.3e} {b:10.3e} {a / b:6.2f} {cpu * 1e6:7.1f}")
        eager = {op: a for op, entry, a, _, _ in rows if entry == "torch eager"}
        floor = next(a - b for op, _, a, b, _ in rows if op.startswith("x * 2"))
        print("torch.compile entry vs eager (same run): " + ", ".join(
            f"{op} {a / eager[op]:.2f}× ({(a - floor) / eager[op]:.2f}× less torch.compile's own "
            f"{floor * 1e6:.0f} us per call)"
            for op, entry, a, _, _ in rows if op in eager and entry == "torch compiled"))
        compiled = {op: a for op, entry, a, _, _ in rows if entry == "torch compiled"}
        noop = next(a for op, entry, a, _, _ in rows if entry == "compiled no-op, eager op")
        print(f"compiled no-op then eager allreduce: {noop / eager['allreduce']:.2f}× the eager allreduce "
              f"(the floor of any compiled call here); the compiled allreduce is "
              f"{compiled['allreduce'] / noop:.2f}× that floor")
    bf.shutdown()


if __name__ == "__main__":
    main()
