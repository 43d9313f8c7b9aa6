"""A long run of fresh unnamed ops keeps the Python side's state and memory flat: the
helpers that generate names (hierarchical ops, rank inference, topology checks) reuse a
bounded set, and shutdown() resets every piece of per-process state (shoal._process)."""
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import gc, tracemalloc
    import numpy as np
    import shoal
    from shoal import topology
    from shoal._process import STATE, UNNAMED_LIMIT

    def rss_kib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4

    shoal.init()
    shoal.set_machine_topology(topology.fully_connected_graph(1))
    x = np.ones(8)

    def step(i):
        shoal.hierarchical_neighbor_allreduce(x)
        shoal.synchronize(shoal.hierarchical_neighbor_allreduce_nonblocking(x))
        shoal.synchronize(shoal.neighbor_allreduce_nonblocking(x))
        shoal.neighbor_allreduce(x, self_weight=0.5, src_weights={}, dst_weights=[])
        shoal.InferSourceFromDestinationRanks([])
        if i % 100 == 0:
            shoal.set_topology(topology.fully_connected_graph(1))

    for i in range(UNNAMED_LIMIT + 200):  # every generated name has been used once
        step(i)
    gc.collect()
    tracemalloc.start()
    before, rss_before = tracemalloc.take_snapshot(), rss_kib()
    for i in range(4 * UNNAMED_LIMIT):
        step(i)
    gc.collect()
    grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    rss_grown = rss_kib() - rss_before
    assert grown < 64 * 1024, f"Python memory grew by {grown} bytes"
    assert rss_grown < 8 * 1024, f"resident memory grew by {rss_grown} KiB"
    assert len(STATE.counters) <= 4, STATE.counters
    shoal.shutdown()
    assert STATE.plan is None and not STATE.counters
    print("flat", grown, rss_grown)
""")


def test_fresh_unnamed_ops_keep_memory_flat():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "flat" in out.stdout, out.stdout + out.stderr


NAMED = textwrap.dedent("""
    import os
    import numpy as np
    import shoal

    LIMIT = int(os.environ["SHOAL_NAME_LIMIT"])  # op names the core keeps before retiring idle ones

    def rss_kib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4

    shoal.init()
    x = np.ones(4)
    used = 0

    def run(count):  # ops of fresh names, as a script with a step number in each name would
        global used
        for _ in range(count):
            if used % 2:
                out = shoal.neighbor_allreduce(x, self_weight=1.0, src_weights={}, dst_weights=[],
                                               name=f"nar.step{used}")
            else:
                out = shoal.allreduce(x, name=f"ar.step{used}")
            assert (out == x).all()
            used += 1

    run(2 * LIMIT)
    rss_before = rss_kib()
    run(4 * LIMIT)
    kept = used - shoal.stats()["names_retired"]  # every name was fresh: the table's size
    assert kept <= LIMIT + LIMIT // 8, f"{kept} of {used} op names kept"
    rss_grown = rss_kib() - rss_before
    assert rss_grown < 8 * 1024, f"resident memory grew by {rss_grown} KiB"
    shoal.shutdown()
    print("bounded", used, kept, rss_grown)
""")


@pytest.mark.parametrize("limit", [1024, 16384])
def test_fresh_op_names_keep_the_name_tables_bounded(limit):
    """A script that names each op after its step (6 x SHOAL_NAME_LIMIT fresh names, at a
    small limit and at the default): the core retires idle names (core/src/negotiation/names.cc),
    so its per-name tables and memory stay flat."""
    env = dict(os.environ, SHOAL_NAME_LIMIT=str(limit))
    out = subprocess.run([sys.executable, "-c", NAMED], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0 and "bounded" in out.stdout, out.stdout + out.stderr
