"""Timeline, stall inspector, failure reporting, init/shutdown hygiene (the timeline of the main
job: tests/test_digits_example.py, from one of its runs)."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import WORKERS, run_ranks, shoalrun_cmd


def test_timeline_repairs_a_cut_file(tmp_path):
    from shoal import timeline
    p = tmp_path / "t0.json"
    p.write_text('[\n{"name": "a", "ph": "X", "pid": 0, "tid": 1, "ts": 1, "dur": 2},\n{"name": "b", "ph')
    assert [e["name"] for e in timeline.load(p)] == ["a"]


def test_late_rank_is_named_in_a_stall_warning():
    rc, out, _ = run_ranks(4, "stall.py", "late", env={"SHOAL_STALL_CHECK_TIME": "1"}, timeout=60)
    assert rc == 0, out
    assert re.search(r"WARNING\] stall: 'late_tensor' waited \d+ s: submitted by ranks 0, 2, 3; missing ranks 1", out), out


def test_missing_rank_fails_the_others_before_and_after_caching():
    rc, out, _ = run_ranks(4, "stall.py", "missing",
                           env={"SHOAL_STALL_CHECK_TIME": "1", "SHOAL_STALL_SHUTDOWN_TIME": "3"}, timeout=90)
    assert rc == 0, out
    assert out.count("fresh: ShoalError") == 3 and out.count("cached allreduce: ShoalError") == 3, out
    assert out.count("cached neighbor: ShoalError") >= 1 and out.count("missing ok") == 4, out


def test_sigkill_of_one_rank_ends_the_job_and_names_it(tmp_path):
    proc = subprocess.Popen(shoalrun_cmd(4, sys.executable, str(WORKERS / "train_forever.py"), str(tmp_path)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("pid*"))) < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)  # mid-training
        victim = int((tmp_path / "pid2").read_text())
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=30)
        assert time.monotonic() - t0 < 30
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert "first failure: rank 2 killed by signal 9 (SIGKILL)" in err, err
    def alive(pid):
        try:
            return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
        except OSError:
            return False
    pids = [int(f.read_text()) for f in tmp_path.glob("pid*")]
    deadline = time.monotonic() + 5  # the kernel delivers the parent-death signal asynchronously
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)], "rank processes left running"


def test_init_shutdown_cycles_leak_no_threads_or_fds():
    # Threads that keep the process's name: Shoal's. MPICH starts one of its own ("async")
    # during MPI_Init, at its own pace, so a count of all threads raced with it under load.
    code = (
        "import os, numpy as np, shoal\n"
        "me = open('/proc/self/comm').read()\n"
        "def counts():\n"
        "    ours = [t for t in os.listdir('/proc/self/task') if open(f'/proc/self/task/{t}/comm').read() == me]\n"
        "    return len(ours), len(os.listdir('/proc/self/fd'))\n"
        "shoal.init(); shoal.allreduce(np.ones(2)); shoal.shutdown()\n"
        "before = counts()\n"
        "for _ in range(20):\n"
        "    shoal.init(); shoal.neighbor_allreduce(np.ones(2)); shoal.shutdown()\n"
        "after = counts()\n"
        "assert before == after, (before, after)\n"
        "print('threads, fds', after)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
