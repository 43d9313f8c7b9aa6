"""Errors of the device data paths on fake devices (SHOAL_CUDA_PLUGIN=fake, SHOAL_FAKE_DEVICE=1,
SHOAL_GPU_BACKEND=nccl): a failure creating an NCCL id reaches every rank that needs it,
ranks that disagree on the GPU data path get one error, and a rank that leaves while its
peers' NCCL transfers wait for it ends them in an error, not a hang.

`split` as argument: rank 0 runs with SHOAL_GPU_BACKEND=nccl, the others with mpi.
`mixed`: rank 0 sends a device tensor to ranks that have never used one (no device bound);
`machines`: 2 ranks per machine; a failed exchange between machine leaders reaches the
machines' other ranks (hierarchical_neighbor_allreduce)."""
import os
import re
import sys
import time
import zlib

import numpy as np
import torch

import shoal
import shoal.torch as bf
from checks import check, run_all

SPLIT = "split" in sys.argv[1:]
MACHINES = "machines" in sys.argv[1:]
MIXED = "mixed" in sys.argv[1:]
if SPLIT:  # before init: the backend is read then
    from shoal.launcher.rank import rank_from_env
    os.environ["SHOAL_GPU_BACKEND"] = "nccl" if rank_from_env() == 0 else "mpi"
if MACHINES:
    os.environ["SHOAL_RANKS_PER_MACHINE"] = "2"
bf.init()
R, N = bf.rank(), bf.size()


def error_of(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        return f"{type(exc).__name__}: {exc}"
    return None


def same_on_every_rank(text, name):
    """The CRC of `text` on every rank (a CPU allgather): equal when every rank got it."""
    got = shoal.allgather(np.array([zlib.crc32(text.encode())], dtype=np.int64), name=name)
    return len(set(got.tolist())) == 1


if MIXED:
    @check
    def device_piece_for_a_rank_without_device_ops_fails_at_once():
        # The receivers cannot take NCCL data (no device, no communicator): both ends get
        # the mismatch error at once instead of waiting for a transfer that never starts.
        bf.set_topology(shoal.topology.ring_graph(N))
        x = np.arange(4, dtype=np.float32) + R
        shoal.neighbor_allreduce(x, name="m.mix")  # negotiated on host: later calls go straight to peers
        t0 = time.monotonic()
        err = error_of(lambda: bf.neighbor_allreduce(torch.from_numpy(x), name="m.mix") if R == 0
                       else shoal.neighbor_allreduce(x, name="m.mix"))
        assert err and "on cuda (NCCL" in err and time.monotonic() - t0 < 5, (err, time.monotonic() - t0)
elif MACHINES:
    @check
    def failed_machine_exchange_reaches_the_whole_machine():
        # Rank 0 (machine 0's leader) cannot create NCCL ids: machine 0's sum (its first
        # NCCL collective) fails there, and every later stage that waits for machine 0
        # (machine 1's exchange, then its share) fails with it instead of waiting.
        bf.set_machine_topology(shoal.topology.fully_connected_graph(bf.machine_size()))
        if R == 0:
            os.environ["SHOAL_FAKE_NCCL_FAIL_ID"] = "1"
        err = error_of(lambda: bf.hierarchical_neighbor_allreduce(torch.full((3,), float(R)), name="h.fail"))
        os.environ.pop("SHOAL_FAKE_NCCL_FAIL_ID", None)
        assert err, "no error"
        if bf.machine_rank() == 0:
            assert "rank 0 could not create the NCCL id" in err, err
        else:
            assert "an earlier stage failed on rank" in err, err
        # The edge is set up again with the next call: machine sums averaged exactly.
        got = bf.hierarchical_neighbor_allreduce(torch.full((3,), float(R)), name="h.fail")
        assert torch.equal(got, torch.full((3,), sum(range(N)) / N)), got
elif not SPLIT:
    @check
    def nccl_id_failure_on_rank_0_reaches_every_rank():
        # The first NCCL collective creates the world communicator: rank 0's id fails.
        if R == 0:
            os.environ["SHOAL_FAKE_NCCL_FAIL_ID"] = "1"
        err = error_of(lambda: bf.allreduce(torch.ones(4), name="e.id"))
        os.environ.pop("SHOAL_FAKE_NCCL_FAIL_ID", None)
        assert err and "rank 0 could not create the NCCL id" in err and "SHOAL_FAKE_NCCL_FAIL_ID" in err, err
        # The error names the op: the text differs only by name, so compare it whole.
        assert same_on_every_rank(err, "e.id.same"), err
        # Every rank heard of it at the same op, so the next one sets up afresh.
        assert torch.equal(bf.allreduce(torch.ones(4), average=False, name="e.id2"), torch.full((4,), float(N)))

    @check
    def edge_id_failure_fails_that_edge_only():
        # Rank 0 cannot create the id of its edges: it and its out-neighbors fail, naming
        # it; every other edge carries its data.
        bf.set_topology(shoal.topology.ring_graph(N))
        if R == 0:
            os.environ["SHOAL_FAKE_NCCL_FAIL_ID"] = "1"
        err = error_of(lambda: bf.neighbor_allreduce(torch.full((3,), float(R)), name="e.edge"))
        os.environ.pop("SHOAL_FAKE_NCCL_FAIL_ID", None)
        if R == 0:
            assert err and "ncclGetUniqueId" in err and "SHOAL_FAKE_NCCL_FAIL_ID" in err, err
        elif R in bf.out_neighbor_ranks() and 0 in bf.in_neighbor_ranks():
            assert err and "rank 0 could not set up NCCL" in err, err
        elif 0 not in bf.in_neighbor_ranks():
            assert err is None, err
        # A failed setup is retried with the next data: the edges work again.
        ins = bf.in_neighbor_ranks()
        got = bf.neighbor_allreduce(torch.full((3,), float(R)), name="e.edge")
        assert torch.equal(got, torch.full((3,), (R + sum(ins)) / (len(ins) + 1))), got

    @check
    def rank_leaving_ends_waiting_nccl_transfers():
        # Last. A star around rank 0 runs once (its edges' communicators are set up, the
        # name negotiated); then rank 0 leaves while the others send to it and wait for it.
        def star(name):
            if R == 0:
                return bf.neighbor_allreduce(torch.ones(1 << 16), self_weight=0.5,
                                             src_weights={r: 0.5 / (N - 1) for r in range(1, N)},
                                             dst_weights={r: 1.0 for r in range(1, N)}, name=name)
            return bf.neighbor_allreduce(torch.full((1 << 16,), 3.0), self_weight=0.5, src_weights={0: 0.5},
                                         dst_weights={0: 1.0}, name=name)
        got = star("e.left")
        assert torch.equal(got, torch.full_like(got, 2.0 if R == 0 else 2.0)), got[:4]
        shoal.barrier()
        if R == 0:
            bf.shutdown()
            return
        err = error_of(lambda: star("e.left"))
        # Ranks done with their checks may have left too: the error names them all.
        assert err and re.search(r"ranks? (\d+, )*0(, \d+)* left the job", err), err
else:
    @check
    def ranks_that_disagree_on_the_gpu_path_get_one_error():
        for name, fn in (("d.ar", lambda: bf.allreduce(torch.ones(3), name="d.ar")),
                         ("d.nar", lambda: bf.neighbor_allreduce(torch.ones(3), name="d.nar"))):
            err = error_of(fn)
            assert err and "mismatched GPU data paths" in err and "NCCL" in err, (name, err)
            assert same_on_every_rank(err, name + ".same"), err


sys.exit(1 if run_all(R, report=True) else 0)
