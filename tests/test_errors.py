"""Mismatches become the same ShoalError on every rank; a dead rank ends the job."""
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import shoal
from conftest import Job, run_ok, run_ranks, shoalrun_cmd, worker_checks


@pytest.mark.parametrize("check", worker_checks("mismatch.py"))
@pytest.mark.parametrize("ranks", [2, 4])
def test_mismatches_raise_on_every_rank(ranks, check):
    Job(ranks, "mismatch.py").check(check)


@pytest.mark.parametrize("ranks", [2, 4])
def test_mismatches_job(ranks):
    out = Job(ranks, "mismatch.py").output()
    assert out.count("checks passed, 0 failed") == ranks, out


def test_dead_rank_ends_job_quickly():
    rc, out, secs = run_ranks(4, "die.py", timeout=60)
    assert rc != 0, out
    assert secs < 30, f"job took {secs:.1f} s to end after a rank died"
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", "workers/die.py"], capture_output=True, text=True).stdout
    assert not left.strip(), f"ranks left running: {left}"


def test_uncaught_exception_ends_the_job():
    # Rank 1 raises while the others wait for it in a collective.
    rc, out, secs = run_ranks(3, "raise_error.py", timeout=60)
    assert rc != 0 and secs < 30, (rc, secs, out)
    assert "RuntimeError: rank 1 fails" in out and "aborting the job" in out, out


def test_works_after_mpi4py_initialised_mpi():
    pytest.importorskip("mpi4py")
    from shoal._loader import _core
    probe = subprocess.run([sys.executable, "-c", "from mpi4py import MPI; print(MPI.Get_library_version())"],
                           capture_output=True, text=True, timeout=60)
    theirs, ours = probe.stdout.split(" ", 1)[0], _core.mpi_library_version().split(" ", 1)[0]
    if theirs != ours:
        pytest.skip(f"mpi4py here uses another MPI ({theirs}) than Shoal's build ({ours})")
    code = ("from mpi4py import MPI\nimport numpy as np, shoal\nshoal.init()\n"
            "x = shoal.allreduce(np.ones(2) * MPI.COMM_WORLD.Get_rank(), average=False)\n"
            "assert x.tolist() == [1.0, 1.0], x\nshoal.shutdown()\nprint('ok', MPI.COMM_WORLD.Get_rank())\n")
    out = subprocess.run(shoalrun_cmd(2, sys.executable, "-c", code), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.count("ok") == 2, out.stdout + out.stderr


def test_ops_before_init_and_after_shutdown_raise():
    code = (
        "import numpy as np, shoal\n"
        "for phase in ('before', 'after'):\n"
        "    try:\n"
        "        shoal.allreduce(np.ones(2))\n"
        "    except ValueError as e:\n"
        "        assert 'not initialized' in str(e), e\n"
        "    else:\n"
        "        raise SystemExit('no error ' + phase)\n"
        "    shoal.init(); shoal.shutdown()\n"
        "for _ in range(20):\n"
        "    shoal.init(); assert shoal.allreduce(np.ones(2)).tolist() == [1, 1]; shoal.shutdown()\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_single_process_without_launcher():
    shoal.init()
    try:
        assert shoal.size() == 1 and shoal.rank() == 0
        assert shoal.allreduce(np.arange(3.0), average=False).tolist() == [0, 1, 2]
        assert shoal.neighbor_allreduce(np.arange(3.0)).tolist() == [0, 1, 2]
        assert shoal.in_neighbor_ranks() == [] and shoal.out_neighbor_ranks() == []
    finally:
        shoal.shutdown()


def test_argument_errors_name_what_was_given():
    torch = pytest.importorskip("torch")
    import shoal.torch as bft
    shoal.init()
    try:
        for allreduce, ones in ((shoal.allreduce, np.ones), (bft.allreduce, torch.ones)):
            with pytest.raises(TypeError, match="average must be a bool, got str"):
                allreduce(ones(2), average="no")  # a string would read as true
            assert allreduce(ones(2) * 3, average=np.False_).tolist() == [3, 3]
            # torch's Horovod path averages integers by truncation; bool is no integer there
            with pytest.raises(ValueError, match=r"bool tensors cannot be reduced \(op=Average\)"):
                allreduce(ones(2, dtype=bool))
        h = shoal.allreduce_nonblocking(np.ones(2))
        with pytest.raises(ValueError, match="unknown handle"):
            shoal.synchronize(h + 1000)
        for bad in (2**70, -1, True, 1.0):
            with pytest.raises(ValueError, match="unknown handle"):
                shoal.synchronize(bad)
        assert shoal.poll(np.int64(h)) in (True, False)
        assert shoal.synchronize(np.int64(h)).tolist() == [1, 1]  # a numpy integer is a handle too
    finally:
        shoal.shutdown()
    with pytest.raises(shoal.ShoalError, match=f"handle {h} belongs to a runtime that shutdown"):
        shoal.synchronize(h)


def test_a_handle_is_finished_once():
    # The handle's objects are taken (shoal_detach) before its result is made, so of two
    # threads synchronizing one handle exactly one gets the result, whichever path (the C
    # synchronize for a plain op, Python's for a grouped one) each takes. The taking itself,
    # then two threads racing (their interleaving is the scheduler's: this part may pass
    # without meeting the race).
    import threading
    from shoal._loader import _core
    shoal.init()
    try:
        h = shoal.allreduce_nonblocking(np.ones(2))
        entry = _core.detach(h)
        assert isinstance(entry, tuple) and _core.detach(h) is None and _core.attached(h) is None
        with pytest.raises(ValueError, match=f"unknown handle {h}"):
            shoal.synchronize(h)  # taken: as one another thread finished
        _core.release(h)
        for grouped in (False, True):
            for _ in range(100):
                h = (shoal.grouped_allreduce_nonblocking([np.ones(2), np.ones(3)]) if grouped
                     else shoal.allreduce_nonblocking(np.ones(2)))
                got, start = [], threading.Barrier(2)

                def finish():
                    start.wait()
                    try:
                        shoal.synchronize(h)
                        got.append("result")
                    except ValueError:
                        got.append("ValueError")
                threads = [threading.Thread(target=finish) for _ in range(2)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                assert sorted(got) == ["ValueError", "result"], (grouped, got)
    finally:
        shoal.shutdown()


def test_bad_configuration_is_a_clear_error():
    code = "import shoal\ntry:\n    shoal.init()\nexcept ValueError as e:\n    print(e)\n"
    env = dict(os.environ, SHOAL_LOG_LEVEL="loud")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert "SHOAL_LOG_LEVEL='loud'" in out.stdout, out


def test_failed_large_send_keeps_its_tensor():
    # Rank 1 freezes (SIGSTOP) past rank 0's stall timeout while rank 0's 16 MiB send is
    # in flight; rank 0 gets the stall error, frees its array and reuses the memory.
    out = run_ok(2, "stall_send.py", timeout=90)
    assert "for ranks 1 to take its data" in out and out.count("] ok") == 2, out
