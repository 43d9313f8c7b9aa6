"""Horovod PyTorch scripts run with only the import changed (`import shoal.torch as hvd`;
issue 17): each check of tests/workers/horovod_torch.py is its own item, at 2 ranks and at
4 ranks on two simulated machines (so cross_rank/cross_size are not trivial); the gradients
of the differentiable collectives against Horovod's definitions, exact values per op × process
set × dtype (tests/workers/horovod_grads.py, each check an item, at 2 and 4 ranks); and a
Horovod-style synthetic benchmark (tests/workers/horovod_synthetic_benchmark.py: ResNet-style
model, fp16 compression, backward_passes_per_step=2, op=hvd.Average; with SyncBatchNorm at
4 ranks) at 2 and 4 ranks; DistributedOptimizer's attributes, warnings and errors and the
object helpers in a process set (tests/workers/horovod_behaviour.py); the timeline files
HOROVOD_TIMELINE gives (a file, a directory, an unwritable path, DYNAMIC). (The training
script with join and uneven data: test_join.py.)"""
import json
import os
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


@pytest.mark.parametrize("check", worker_checks("horovod_behaviour.py"))
def test_horovod_behaviour(check):
    """DistributedOptimizer's attributes, warnings and errors, object helpers in a process
    set (tests/workers/horovod_behaviour.py), at 4 ranks on two simulated machines."""
    Job(4, "horovod_behaviour.py", env=SETTINGS[4], timeout=240).check(check)


def timeline_job(path):
    """The timeline worker on 2 ranks with HOROVOD_TIMELINE=path (run in the test's
    directory); its output."""
    out = run_ok(2, "horovod_behaviour.py", "timeline", env={"HOROVOD_TIMELINE": str(path)}, timeout=120)
    assert out.count("timeline job done") == 2, out
    return out


def test_horovod_timeline_file_is_rank_0s_trace(tmp_path):
    # Horovod writes HOROVOD_TIMELINE=<file> from rank 0; Shoal writes <file><rank>.json
    # on each rank and links <file> to rank 0's, which stays a Chrome-trace JSON array.
    (tmp_path / "t.json").write_text("left by an earlier run")  # replaced, as Horovod truncates it
    out = timeline_job(tmp_path / "t.json")
    assert os.readlink(tmp_path / "t.json") == "t.json0.json"
    for rank in (0, 1):
        events = json.loads((tmp_path / f"t.json{rank}.json").read_text())
        assert isinstance(events, list) and {"ph", "pid"} <= set(events[0]), events[:2]
        assert {e["pid"] for e in events} == {rank}
        assert any("tl.op" in json.dumps(e) for e in events), events
    assert json.loads((tmp_path / "t.json").read_text()) == json.loads((tmp_path / "t.json0.json").read_text())
    # stop_timeline cannot stop it early: a RuntimeWarning on each rank.
    assert out.count("warnings: ['RuntimeWarning']") == 2, out


def test_horovod_timeline_in_a_directory_or_unwritable(tmp_path):
    # A directory: Horovod cannot open it and records nothing; Shoal's per-rank prefix
    # writes next to it (<dir>0.json) and links nothing.
    (tmp_path / "tl").mkdir()
    timeline_job(tmp_path / "tl")
    assert (tmp_path / "tl").is_dir() and not list((tmp_path / "tl").iterdir())
    assert sorted(p.name for p in tmp_path.glob("tl*.json")) == ["tl0.json", "tl1.json"]
    # Unwritable (no such directory): as Horovod, an error is logged, nothing is recorded
    # and the job runs on.
    out = timeline_job(tmp_path / "missing" / "t.json")
    assert "cannot write the timeline" in out and not (tmp_path / "missing").exists(), out
    assert out.count("warnings: []") == 2, out


def test_horovod_dynamic_timeline(tmp_path):
    # HOROVOD_TIMELINE=DYNAMIC is Horovod's "start it later with start_timeline": no file
    # named DYNAMIC; Shoal cannot start one after init(), so start_timeline warns and the
    # script goes on.
    out = timeline_job("DYNAMIC")
    assert out.count("warnings: ['RuntimeWarning']") == 2, out
    assert sorted(p.name for p in tmp_path.iterdir() if "json" in p.name) == [], list(tmp_path.iterdir())
