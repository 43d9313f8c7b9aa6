"""Horovod Keras 3 scripts run with only the import changed (`import shoal.keras as hvd`;
issue 17): each check of tests/workers/horovod_keras.py is its own item, at 2 ranks and at
4 ranks on two simulated machines (so cross_rank/cross_size are not trivial)."""
import pytest

from conftest import Job, worker_checks

pytest.importorskip("tensorflow")
pytest.importorskip("keras")

SETTINGS = {2: {}, 4: {"SHOAL_RANKS_PER_MACHINE": "2"}}


def job(ranks):
    return Job(ranks, "horovod_keras.py", env=SETTINGS[ranks], timeout=300)


@pytest.mark.parametrize("check", worker_checks("horovod_keras.py"))
@pytest.mark.parametrize("ranks", sorted(SETTINGS))
def test_horovod_keras_script_check(ranks, check):
    job(ranks).check(check)


@pytest.mark.parametrize("ranks", sorted(SETTINGS))
def test_horovod_keras_script_job(ranks):
    out = job(ranks).output()
    assert out.count("checks passed, 0 failed") == ranks, out
