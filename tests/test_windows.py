"""One-sided window ops at 1-8 ranks (each check of tests/workers/windows.py is its own item,
one job per rank count), push-sum, leaks."""
import pytest

from conftest import Job, run_ok, worker_checks

RANKS = [1, 2, 4, 8]


def windows_job(ranks):
    return Job(ranks, "windows.py", timeout=240)


@pytest.mark.parametrize("check", worker_checks("windows.py"))
@pytest.mark.parametrize("ranks", RANKS)
def test_window_ops_exact(ranks, check):
    windows_job(ranks).check(check)


@pytest.mark.parametrize("ranks", RANKS)
def test_window_ops_job(ranks):
    out = windows_job(ranks).output()
    assert out.count("checks passed, 0 failed") == ranks, out


def test_200_create_put_update_free_cycles_leak_nothing():
    job = Job(4, "windows.py", "no_leaks_over_200_cycles", "--cycles", timeout=240)
    job.check("no_leaks_over_200_cycles")
    out = job.output()
    print(out)
    assert out.count("windows=0 window_bytes=0") == 4, out


def test_window_optimizers_do_not_wait_for_a_slow_rank():
    pytest.importorskip("torch")
    # A rank whose steps waited for the held one would end in a stall error, not a hang.
    out = run_ok(4, "win_optimizers.py", env={"SHOAL_STALL_SHUTDOWN_TIME": "120"}, timeout=240)
    print(out)  # step rates of the slow and the fast ranks
    assert "sum of p after push-sum: 4.0000000000" in out, out
    assert out.count("DistributedWinPutOptimizer:") == 4 and out.count("DistributedPushSumOptimizer:") == 4


def test_rank_exiting_early_without_win_free_does_not_hang_its_neighbours():
    out = run_ok(3, "win_early_exit.py", env={"SHOAL_STALL_SHUTDOWN_TIME": "20"}, timeout=60)
    assert out.count("exiting without win_free") == 3, out
