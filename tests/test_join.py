"""Horovod's join under shoalrun (core/src/ops/join.cc): each check of
tests/workers/join.py is its own item, at 2 and 4 ranks (fusion off, every name its own
batch, is covered by core/tests/test_join.cc); and a Horovod-style PyTorch training script with uneven data per
rank ending in hvd.join() (tests/workers/horovod_join_train.py) at 2 and 4 ranks."""
import pytest

from conftest import Job, run_ok, worker_checks

pytest.importorskip("torch")

SETTINGS = [(2, "fusion"), (4, "fusion")]


def job(ranks, fusion):
    env = {"SHOAL_STALL_CHECK_TIME": "2", "SHOAL_STALL_SHUTDOWN_TIME": "4"}
    if ranks == 4:  # two machines of two ranks: the hierarchical op's check
        env["SHOAL_RANKS_PER_MACHINE"] = "2"
    if fusion == "nofusion":
        env["SHOAL_FUSION_THRESHOLD"] = "0"
    return Job(ranks, "join.py", env=env, timeout=400)


@pytest.mark.parametrize("check", worker_checks("join.py"))
@pytest.mark.parametrize("ranks,fusion", SETTINGS)
def test_join(ranks, fusion, check):
    job(ranks, fusion).check(check)


@pytest.mark.parametrize("ranks", [2, 4])
def test_horovod_training_script_with_join(ranks):
    out = run_ok(ranks, "horovod_join_train.py", timeout=240)
    assert out.count("identical and exact") == ranks, out[-3000:]
