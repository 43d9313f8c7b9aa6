"""Horovod's join under shoalrun (core/src/ops/join.cc): each check of
tests/workers/join.py is its own item, at 2 and 4 ranks and at 4 ranks on two machines of two
(SHOAL_RANKS_PER_MACHINE=2) (fusion off, every name its own
batch, is covered by core/tests/test_join.cc); and a Horovod-style PyTorch training script with uneven data per
rank ending in hvd.join() (tests/workers/horovod_join_train.py) at 2 and 4 ranks."""
import pytest

from conftest import Job, run_ok, worker_checks

pytest.importorskip("torch")

SETTINGS = [(2, "fusion"), (4, "fusion"), (4, "machines")]


def job(ranks, setting):
    env = {"SHOAL_STALL_CHECK_TIME": "2", "SHOAL_STALL_SHUTDOWN_TIME": "4"}
    if setting == "machines":  # two machines of two ranks (and the hierarchical op's check)
        env["SHOAL_RANKS_PER_MACHINE"] = "2"
    if setting == "nofusion":
        env["SHOAL_FUSION_THRESHOLD"] = "0"
    return Job(ranks, "join.py", env=env, timeout=400)


@pytest.mark.parametrize("check", worker_checks("join.py"))
@pytest.mark.parametrize("ranks,setting", SETTINGS)
def test_join(ranks, setting, check):
    job(ranks, setting).check(check)


@pytest.mark.parametrize("ranks", [2, 4])
def test_horovod_training_script_with_join(ranks):
    out = run_ok(ranks, "horovod_join_train.py", timeout=240)
    assert out.count("identical and exact") == ranks, out[-3000:]
