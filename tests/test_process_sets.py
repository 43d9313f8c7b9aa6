"""Process sets (Horovod's `add_process_set`, `process_set=`; core/src/process_sets/process_sets.h) at 4
ranks for numpy, torch and TensorFlow, with the sets {0, 2} and {1, 3}: each check of
tests/workers/psets.py is its own item, one job per framework. The core's side (a set whose
members stall, a member that leaves or dies, negotiation at each set's leader) is also
unit-tested over the fake backend: core/tests/test_process_sets.cc (tests/test_core_cpp.py)."""
import pytest

from conftest import Job, worker_checks

FRAMEWORKS = {"numpy": None, "torch": "torch", "tf": "tensorflow"}


def job(framework):
    return Job(4, "psets.py", framework, timeout=400)


@pytest.mark.parametrize("check", worker_checks("psets.py"))
@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_process_sets(framework, check):
    if FRAMEWORKS[framework]:
        pytest.importorskip(FRAMEWORKS[framework])
    job(framework).check(check)


@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_job_ends_well(framework):
    if FRAMEWORKS[framework]:
        pytest.importorskip(FRAMEWORKS[framework])
    out = job(framework).output()
    assert out.count("checks passed, 0 failed") == 4, out
