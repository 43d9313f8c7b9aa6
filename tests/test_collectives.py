"""Horovod's collectives (allreduce op=Min/Max/Product, reducescatter) for numpy and torch
at 2 and 4 ranks, TensorFlow at 4 (4: two simulated machines), exact values: each check of
tests/workers/coll_{numpy,torch,tf}.py is its own item, one job per worker and size."""
import pytest

from conftest import Job, worker_checks

RANKS = [2, 4]


def job(script, ranks):
    env = {"SHOAL_RANKS_PER_MACHINE": "2"} if ranks >= 4 else {}
    return Job(ranks, script, env=env, timeout=400)


@pytest.mark.parametrize("check", worker_checks("coll_numpy.py"))
@pytest.mark.parametrize("ranks", RANKS)
def test_numpy(ranks, check):
    job("coll_numpy.py", ranks).check(check)


@pytest.mark.parametrize("check", worker_checks("coll_torch.py"))
@pytest.mark.parametrize("ranks", RANKS)
def test_torch(ranks, check):
    pytest.importorskip("torch")
    job("coll_torch.py", ranks).check(check)


# TensorFlow at 4 ranks only: its start-up is the slowest of the three, and the op is the
# core's (the numpy and torch jobs run it at 2 ranks too).
@pytest.mark.parametrize("check", worker_checks("coll_tf.py"))
@pytest.mark.parametrize("ranks", [4])
def test_tensorflow(ranks, check):
    pytest.importorskip("tensorflow")
    job("coll_tf.py", ranks).check(check)


@pytest.mark.parametrize("script,ranks", [("coll_numpy.py", 2), ("coll_numpy.py", 4), ("coll_torch.py", 2),
                                          ("coll_torch.py", 4), ("coll_tf.py", 4)])
def test_job_ends_well(script, ranks):
    if script != "coll_numpy.py":
        pytest.importorskip("torch" if script == "coll_torch.py" else "tensorflow")
    out = job(script, ranks).output()
    assert out.count("checks passed, 0 failed") == ranks, out
