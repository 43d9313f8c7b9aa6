"""Horovod's alltoall (with splits) and grouped ops (grouped_allreduce, grouped_allgather,
grouped_reducescatter) for numpy and torch at 2 and 4 ranks, TensorFlow at 4 (4: two
simulated machines), exact values: each check of tests/workers/a2a_grouped_{numpy,torch,tf}.py
is its own item, one job per worker and size."""
import pytest

from conftest import Job, worker_checks

RANKS = [2, 4]


def job(script, ranks):
    env = {"SHOAL_RANKS_PER_MACHINE": "2"} if ranks >= 4 else {}
    return Job(ranks, script, env=env, timeout=400)


@pytest.mark.parametrize("check", worker_checks("a2a_grouped_numpy.py"))
@pytest.mark.parametrize("ranks", RANKS)
def test_numpy(ranks, check):
    job("a2a_grouped_numpy.py", ranks).check(check)


@pytest.mark.parametrize("check", worker_checks("a2a_grouped_torch.py"))
@pytest.mark.parametrize("ranks", RANKS)
def test_torch(ranks, check):
    pytest.importorskip("torch")
    job("a2a_grouped_torch.py", ranks).check(check)


# TensorFlow at 4 ranks only: its start-up is the slowest of the three, and the ops are the
# core's (the numpy and torch jobs run them at 2 ranks too).
@pytest.mark.parametrize("check", worker_checks("a2a_grouped_tf.py"))
@pytest.mark.parametrize("ranks", [4])
def test_tensorflow(ranks, check):
    pytest.importorskip("tensorflow")
    job("a2a_grouped_tf.py", ranks).check(check)


@pytest.mark.parametrize("script,ranks", [("a2a_grouped_numpy.py", 2), ("a2a_grouped_numpy.py", 4),
                                          ("a2a_grouped_torch.py", 2), ("a2a_grouped_torch.py", 4),
                                          ("a2a_grouped_tf.py", 4)])
def test_job_ends_well(script, ranks):
    if script != "a2a_grouped_numpy.py":
        pytest.importorskip("torch" if "torch" in script else "tensorflow")
    out = job(script, ranks).output()
    assert out.count("checks passed, 0 failed") == ranks, out
