"""Horovod PyTorch scripts run with only the import changed (`import shoal.torch as hvd`;
issue 17): each check of tests/workers/horovod_torch.py is its own item, at 2 ranks and at
4 ranks on two simulated machines (so cross_rank/cross_size are not trivial); the gradients
of the differentiable collectives against Horovod's definitions, exact values per op × process
set × dtype (tests/workers/horovod_grads.py, each check an item, at 2 and 4 ranks); and a
Horovod-style synthetic benchmark (tests/workers/horovod_synthetic_benchmark.py: ResNet-style
model, fp16 compression, backward_passes_per_step=2, op=hvd.Average; with SyncBatchNorm at
4 ranks) at 2 and 4 ranks. (The training script with join and uneven data: test_join.py.)"""
import re

import pytest

from conftest import Job, run_ok, worker_checks

pytest.importorskip("torch")

SETTINGS = {2: {}, 4: {"SHOAL_RANKS_PER_MACHINE": "2"}}


def job(ranks):
    return Job(ranks, "horovod_torch.py", env=SETTINGS[ranks], timeout=240)


@pytest.mark.parametrize("check", worker_checks("horovod_torch.py"))
@pytest.mark.parametrize("ranks", sorted(SETTINGS))
def test_horovod_script_check(ranks, check):
    job(ranks).check(check)


@pytest.mark.parametrize("ranks", sorted(SETTINGS))
def test_horovod_script_job(ranks):
    out = job(ranks).output()
    assert out.count("checks passed, 0 failed") == ranks, out


@pytest.mark.parametrize("check", worker_checks("horovod_grads.py"))
@pytest.mark.parametrize("ranks", sorted(SETTINGS))
def test_horovod_gradients(ranks, check):
    Job(ranks, "horovod_grads.py", env=SETTINGS[ranks], timeout=240).check(check)


@pytest.mark.parametrize("ranks", sorted(SETTINGS))
def test_horovod_gradients_job(ranks):
    out = Job(ranks, "horovod_grads.py", env=SETTINGS[ranks], timeout=240).output()
    assert out.count("checks passed, 0 failed") == ranks, out


@pytest.mark.parametrize("ranks,extra", [(2, []), (4, ["--sync-bn"])])
def test_horovod_synthetic_benchmark(ranks, extra):
    out = run_ok(ranks, "horovod_synthetic_benchmark.py", "--fp16-allreduce", *extra, env=SETTINGS[ranks],
                 timeout=240)
    assert len(re.findall(r"^Iter #\d: [\d.]+ img/sec per rank$", out, re.M)) == 3, out
    assert re.search(rf"^Total img/sec on {ranks} rank\(s\): [\d.]+ \+-[\d.]+$", out, re.M), out
    # The script asserts the models are identical and the loss went down, then says so.
    assert out.count("models identical; mean loss") == ranks, out
