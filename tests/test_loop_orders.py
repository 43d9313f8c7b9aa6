"""Loop-order matrix: every distributed optimizer x every common training-loop order
converges on the shared linear regression (tests/workers/loop_orders.py, 4 ranks).

The whole matrix is one shoalrun job (its output cached for the module); each
(optimizer, order) pair is its own item that asserts its own result line: a missing
line fails the item, a pair that does not apply is a skip with the worker's reason."""
import importlib.util

import pytest

from conftest import WORKERS, run_ranks

pytest.importorskip("torch")

_spec = importlib.util.spec_from_file_location("loop_orders", WORKERS / "loop_orders.py")
SPEC = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(SPEC)  # the names only: the worker runs under __main__
PAIRS = [(o, r) for o in SPEC.OPTIMIZERS for r in SPEC.ORDERS]


@pytest.fixture(scope="module")
def matrix():
    """(exit status, output) of the one job that runs every pair."""
    rc, out, _ = run_ranks(4, "loop_orders.py", env={"SHOAL_STALL_SHUTDOWN_TIME": "60"}, timeout=540)
    return rc, out


@pytest.mark.parametrize("optimizer,order", PAIRS, ids=[f"{o}-{r}" for o, r in PAIRS])
def test_loop_order(matrix, optimizer, order):
    rc, out = matrix
    prefix = f"LOOP {optimizer} {order} "
    lines = [line[len(prefix):] for line in out.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, f"{len(lines)} result lines for {optimizer}/{order} (job exited {rc}):\n{out[-6000:]}"
    verdict, _, detail = lines[0].partition(" ")
    if (optimizer, order) in SPEC.SKIPS:
        assert verdict == "SKIP", lines[0]
        pytest.skip(detail)
    assert verdict == "PASS", detail


def test_loop_order_job_exits_cleanly(matrix):
    rc, out = matrix
    assert rc == 0, f"the loop-order job exited {rc}:\n{out[-6000:]}"
    assert "Traceback" not in out, out[-6000:]
