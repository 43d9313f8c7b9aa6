"""Machine-local ops (is_hierarchical_local=True: machine scope) complete per machine
(docs/design.md §19): machines with names and numbers of rounds of their own finish while
the other machines have not submitted anything (each machine starts only once the one
before it in a chain has finished: a machine-local op that waited for another machine would
hang the job, and the test's timeout fails it), in two chain orders; world ops pair up
after them; within a machine a grouped allreduce (one fused batch) and a mismatch (the same
error on every rank of that machine, the others complete) behave as before. Exact values.
Run by tests/test_machine_local.py on 2 and on 4 simulated machines (SHOAL_RANKS_PER_MACHINE)."""
import hashlib
import os
import shutil
import sys
import tempfile
import time

import numpy as np

import shoal
from checks import check, run_all

shoal.init()
R, N = shoal.rank(), shoal.size()
L, LR = shoal.local_size(), shoal.local_rank()
M, MR = shoal.machine_size(), shoal.machine_rank()
MINE = [MR * L + q for q in range(L)]  # this machine's ranks (placed contiguously)
# A folder every rank of the job agrees on (rank 0's, broadcast), for the machines' flags.
_token = shoal.broadcast(np.frombuffer(os.urandom(8), np.uint8).copy(), root_rank=0, name="ml.token")
FLAGS = os.path.join(tempfile.gettempdir(), "shoal-ml-" + _token.tobytes().hex())
os.makedirs(FLAGS, exist_ok=True)


def x(r, k, n=5):
    """Rank r's k-th input: small integers (sums stay exact)."""
    return (np.arange(n) % 7 + 10.0 * r + 1000.0 * k).astype("float64")


def machine_sum(k, n=5):
    return sum(x(q, k, n) for q in MINE)


def flag(stage, machine):
    return os.path.join(FLAGS, f"{stage}.m{machine}.l")


def finished(stage):
    """This rank's machine-local ops of `stage` are done: its flag."""
    open(flag(stage, MR) + str(LR), "w").close()


def wait_for(stage, machine, timeout=120):
    """Until every rank of `machine` finished `stage` (polling its flags; no op of Shoal)."""
    deadline = time.time() + timeout
    while not all(os.path.exists(flag(stage, machine) + str(q)) for q in range(L)):
        assert time.time() < deadline, f"machine {machine} never finished {stage}"
        time.sleep(0.01)


def rounds(stage, order):
    """Machine m runs 1 + 2m rounds of a name of its own and of a shared name, and 1 + m
    unnamed ones, only once the machine before it in `order` finished: exact sums."""
    at = order.index(MR)
    if at > 0:
        wait_for(stage, order[at - 1])
    for k in range(1 + 2 * MR):
        handles = [shoal.allreduce_nonblocking(x(R, k), op=shoal.Sum, is_hierarchical_local=True,
                                               name=f"{stage}.m{MR}.{k}"),
                   shoal.allreduce_nonblocking(x(R, 50 + k), op=shoal.Sum, is_hierarchical_local=True,
                                               name=f"{stage}.shared")]
        for h, want in zip(handles[::-1], [machine_sum(50 + k), machine_sum(k)]):  # waited in the other order
            got = shoal.synchronize(h)
            assert np.array_equal(got, want), (stage, k, got, want)
    for k in range(1 + MR):
        got = shoal.allreduce(x(R, 90 + k), op=shoal.Sum, is_hierarchical_local=True)
        assert np.array_equal(got, machine_sum(90 + k)), (stage, "unnamed", k, got)
    finished(stage)
    for m in range(M):  # world ops only after every machine finished
        wait_for(stage, m)
    want = sum(x(q, 7) for q in range(N))
    for name in (f"{stage}.world", None):  # named, then unnamed: every rank's names pair up
        got = shoal.allreduce(x(R, 7), op=shoal.Sum, name=name)
        assert np.array_equal(got, want), (stage, name, got, want)


@check
def machines_finish_on_their_own_first_to_last():
    rounds("up", list(range(M)))


@check
def machines_finish_on_their_own_last_to_first():
    rounds("down", list(range(M))[::-1])


@check
def grouped_allreduce_per_machine_is_one_fused_batch():
    before = shoal.stats()
    got = shoal.grouped_allreduce([x(R, 4, 2), x(R, 5, 3), x(R, 6, 1)], op=shoal.Sum, is_hierarchical_local=True,
                                  name="ml.group")
    for g, k, n in zip(got, (4, 5, 6), (2, 3, 1)):
        assert np.array_equal(g, machine_sum(k, n)), (k, g)
    assert shoal.stats()["fused_batches"] - before["fused_batches"] == 1, (before, shoal.stats())


@check
def mismatch_fails_its_machine_alike():
    odd = L * (M - 1)  # the last machine's first rank submits another shape
    try:
        got = shoal.allreduce(x(R, 8, 6 if R == odd else 5), op=shoal.Sum, is_hierarchical_local=True, name="ml.mm")
        err = ""
    except shoal.ShoalError as ex:
        err = str(ex)
    if MR == M - 1:
        assert "ml.mm" in err and "shape" in err, err
    else:
        assert not err and np.array_equal(got, machine_sum(8)), err
    digest = np.frombuffer(hashlib.sha256(err.encode()).digest(), np.uint8)
    every = shoal.allgather(digest[None, :], name="ml.mm.digests")
    assert all(np.array_equal(every[q], every[MINE[0]]) for q in MINE), "ranks of one machine saw different errors"
    got = shoal.allreduce(x(R, 9), op=shoal.Sum, is_hierarchical_local=True, name="ml.mm")  # usable again
    assert np.array_equal(got, machine_sum(9)), got


failed = run_all(R)
shoal.allreduce(np.zeros(1), name="ml.end")  # every rank is done with the flags
if R == 0:
    shutil.rmtree(FLAGS, ignore_errors=True)
sys.exit(1 if failed else 0)
