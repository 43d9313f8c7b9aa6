"""Checks that only an emulated cluster can make (tests/test_cluster.py): the machine layout
comes from the real hosts, and a link carries what its rate allows.

    shoalrun -np 8 --machines 4 --link 1gbit python cluster.py [--rate BITS]"""
import argparse
import os
import socket
import sys
import time

import numpy as np

import checks
from checks import check

import shoal

ARGS = argparse.ArgumentParser()
ARGS.add_argument("--rate", type=float, help="the link rate set with --link (bits/s)")
ARGS.add_argument("--machines", type=int, required=True)
OPTS = ARGS.parse_args()


def eth0_bytes():
    """(sent, received) bytes of this machine's link, as this namespace's kernel counts them."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "eth0":
                v = rest.split()
                return int(v[8]), int(v[0])
    raise AssertionError("no eth0 in this network namespace: not on an emulated machine")


@check
def layout_is_the_hosts():
    n, m = shoal.size(), OPTS.machines
    per = n // m
    assert n % m == 0, "this check places equal blocks"
    R = shoal.rank()
    assert socket.gethostname() == f"node{R // per}", socket.gethostname()
    assert (shoal.local_size(), shoal.local_rank()) == (per, R % per)
    assert (shoal.machine_size(), shoal.machine_rank()) == (m, R // per)
    assert "SHOAL_RANKS_PER_MACHINE" not in os.environ
    hosts = shoal.allgather(np.array([int(socket.gethostname()[len("node"):])]), name="hosts")
    assert hosts.tolist() == [r // per for r in range(n)], hosts


@check
def link_carries_its_rate():
    """Machine 0's first rank and machine 1's first rank swap 12 MiB both ways at once (a
    two-rank neighbor exchange): each direction's bytes arrive at the set rate, within 15 %,
    in the better of two exchanges (a rank starved of CPU by other jobs cannot fill its link)."""
    if OPTS.rate is None:
        raise checks.Skip("no --rate given")
    n, m = shoal.size(), OPTS.machines
    per = n // m
    pair = {0: per, per: 0}
    mine = pair.get(shoal.rank())
    x = np.full(3 << 19, float(shoal.rank()))  # 12 MiB of float64
    rates = []
    # Warm up the connection (TCP slow start, connection set-up) with a small exchange first.
    for size, name in ((1024, "link.warm"), (x.size, "link.timed"), (x.size, "link.timed")):
        shoal.barrier()
        t0, (s0, r0) = time.perf_counter(), eth0_bytes()
        if mine is None:
            got = shoal.neighbor_allreduce(x[:size], self_weight=1.0, src_weights={}, dst_weights=[], name=name)
        else:
            got = shoal.neighbor_allreduce(x[:size], self_weight=0.0, src_weights={mine: 1.0},
                                           dst_weights=[mine], name=name)
        seconds = time.perf_counter() - t0
        s1, r1 = eth0_bytes()
        if mine is not None and size == x.size:
            assert np.array_equal(got, np.full(x.size, float(mine)))
            rates.append(x.nbytes * 8 / seconds)
            # What crossed the link is the payload plus TCP/IP headers, not more. (Received: a
            # send completes once its last bytes are in the kernel, before they are counted.)
            assert x.nbytes <= r1 - r0 <= 1.1 * x.nbytes, (r1 - r0, x.nbytes)
            assert s1 - s0 <= 1.1 * x.nbytes, (s1 - s0, x.nbytes)
    if mine is not None:
        rate = max(rates)
        print(f"[rank {shoal.rank()}] link rate {rate / 1e6:.1f} Mbit/s (best of "
              f"{', '.join(f'{r / 1e6:.1f}' for r in rates)})", flush=True)
        assert abs(rate / OPTS.rate - 1) <= 0.15, f"{rate / 1e6:.1f} Mbit/s against {OPTS.rate / 1e6:.1f} set"


@check
def a_put_does_not_wait_for_its_owners_compute():
    """Rank 0 accumulates 4 MiB into the window of the first rank of machine 1, which
    meanwhile computes for 2 s without calling Shoal: the accumulate completes in a fraction
    of that (its owner's delivery thread takes it, docs/design.md §23), and the owner then
    reads it exactly."""
    owner = shoal.size() // OPTS.machines
    if owner not in shoal.out_neighbor_ranks() and shoal.rank() == 0:
        raise AssertionError(f"rank {owner} is not an out-neighbour of rank 0: {shoal.out_neighbor_ranks()}")
    x = np.full(1 << 19, float(shoal.rank()) + 0.5)  # 4 MiB of float64
    shoal.win_create(x, "busy.owner", zero_init=True)
    shoal.barrier()
    if shoal.rank() == 0:
        t0 = time.perf_counter()
        shoal.win_accumulate(x, "busy.owner", self_weight=1.0, dst_weights={owner: 1.0})
        took = time.perf_counter() - t0
        print(f"[rank 0] a 4 MiB accumulate to rank {owner} while it computed: {took:.3f} s", flush=True)
        assert took < 1.0, f"the accumulate waited {took:.2f} s for its owner's compute"
    elif shoal.rank() == owner:
        end = time.perf_counter() + 2.0
        while time.perf_counter() < end:  # compute: no Shoal, no MPI call
            np.dot(x[:4096], x[:4096])
    shoal.barrier()
    if shoal.rank() == owner:
        assert np.array_equal(shoal.win_update("busy.owner", 0.0, {0: 1.0}, clone=True), np.full(x.size, 0.5))
    shoal.win_free("busy.owner")


shoal.init()
failed = checks.run_all(shoal.rank())
shoal.shutdown()
sys.exit(1 if failed else 0)
