"""Every way a rank can leave ends the job in bounded time, with the default configuration:
non-zero exit, `shoalrun` names the rank, no process left. Forked children cannot
communicate; a launcher that disagrees with MPI is an error; a call refused on one rank
reaches the others as the same error."""
import concurrent.futures
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import WORKERS, run_ranks, shoalrun_cmd

HOWS = ["return", "sys_exit", "exception", "os_exit", "sigkill"]
DURINGS = ["allreduce", "neighbor", "window", "barrier"]
# (how, during, repeat): each way of leaving during each kind of op; signals, MPI_Abort
# and shutdown() during one; SIGKILL three more times (it once left peers waiting 100 s).
CASES = ([(h, d, 0) for h in HOWS for d in DURINGS] +
         [(h, "allreduce", 0) for h in ("sigterm", "abort", "shutdown")] +
         [("return", "broadcast", 0)] + [("sigkill", d, k) for d in ("neighbor", "allreduce") for k in (1, 2)])
LIMIT = 30  # seconds, the bound


def _alive(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _run_case(case, root):
    how, during, k = case
    d = root / f"{how}-{during}-{k}"
    d.mkdir()
    cmd = shoalrun_cmd(4, sys.executable, str(WORKERS / "exits.py"), how, during, str(d))
    start = time.monotonic()
    # cwd: this module-scoped fixture runs before tests/conftest.py leaves the checkout.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, cwd=root)
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
    secs = time.monotonic() - start
    pids = [int(f.read_text()) for f in d.glob("pid*")]
    deadline = time.monotonic() + 5  # the parent-death signal arrives asynchronously
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return {"rc": proc.returncode, "out": out, "secs": secs, "pids": len(pids),
            "left": [p for p in pids if _alive(p)]}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    root = tmp_path_factory.mktemp("exits")
    # Two 4-rank jobs at a time: each case's bound still holds on 2 cores.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return dict(zip(CASES, pool.map(lambda c: _run_case(c, root), CASES)))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}" + (f"-again{c[2]}" if c[2] else ""))
def test_leaving_rank_ends_the_job(outcomes, case):
    how, during, _ = case
    o = outcomes[case]
    tail = o["out"][-3000:]
    assert o["pids"] == 4, f"not every rank started:\n{tail}"
    assert o["secs"] <= LIMIT, f"took {o['secs']:.1f} s:\n{tail}"
    assert o["rc"] != 0, tail
    assert not o["left"], f"processes left running: {o['left']}"
    summary = [line for line in o["out"].splitlines() if line.startswith("shoalrun: job failed")]
    assert summary, tail
    if how in ("return", "sys_exit", "shutdown"):
        # Rank 1 did not fail itself: the first rank to fail says that rank 1 left.
        assert "rank 1 left the job" in summary[0] or "rank 1 called win_free" in summary[0], summary[0]
    else:
        expected = {"exception": "rank 1 raised RuntimeError: rank 1 fails on purpose",
                    "os_exit": "rank 1 exited with status 3", "sigkill": "rank 1 killed by signal 9 (SIGKILL)",
                    "sigterm": "rank 1 killed by signal 15 (SIGTERM)", "abort": "rank 1"}[how]
        assert f"first failure: {expected}" in summary[0], summary[0]


def test_healthy_job_with_uneven_ends_exits_cleanly():
    # Ranks finish at different times after their last op: nobody needs the early ones.
    code = ("import time, numpy as np, shoal; shoal.init(); "
            "x = shoal.neighbor_allreduce(np.ones(3), name='n'); shoal.allreduce(x, name='a'); "
            "time.sleep(0.3 * shoal.rank()); print('done', shoal.rank())")
    out = subprocess.run(shoalrun_cmd(4, sys.executable, "-c", code), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(out.stdout.split("\n"))[-4:] == ["done 0", "done 1", "done 2", "done 3"], out.stdout
    assert "rror" not in out.stderr and "left the job" not in out.stderr, out.stderr


def test_init_shutdown_cycles_on_four_ranks():
    # A leave notice of one cycle must not reach the next cycle's runtime.
    code = ("import numpy as np, shoal\n"
            "for cycle in range(10):\n"
            "    shoal.init()\n"
            "    assert shoal.allreduce(np.ones(2), average=False, name='a')[0] == shoal.size()\n"
            "    shoal.shutdown()\n"
            "print('cycles done', flush=True)\n")
    out = subprocess.run(shoalrun_cmd(4, sys.executable, "-c", code), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.count("cycles done") == 4, out.stdout + out.stderr
    assert "left the job" not in out.stderr, out.stderr


def test_process_started_by_a_rank_cannot_join_its_job():
    code = ("import os, sys, numpy as np, shoal\n"
            "shoal.init()\n"
            "child = 'import shoal; shoal.init()'\n"
            "st = os.system(f'{sys.executable} -c \"{child}\" 2> child{shoal.rank()}.err')\n"
            "err = open(f'child{shoal.rank()}.err').read()\n"
            "print('child', st != 0, 'started by a rank' in err, flush=True)\n"
            "print('sum', shoal.allreduce(np.ones(1), average=False, name='x')[0], flush=True)\n")
    out = subprocess.run(shoalrun_cmd(4, sys.executable, "-c", code), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("child True True") == 4 and out.stdout.count("sum 4.0") == 4, out.stdout


def test_call_refused_on_one_rank_reaches_the_others():
    rc, out, _ = run_ranks(4, "refused.py", env={"SHOAL_RANKS_PER_MACHINE": "2"}, timeout=120)
    assert rc == 0, out
    for case in ("allreduce-int-average", "neighbor-int", "set-topology", "set-machine-topology", "python-check",
                 "native-weights", "torch-op", "hierarchical"):
        lines = [line for line in out.splitlines() if line.startswith(case + " ")]
        assert len(lines) == 4, (case, out)
        messages = {line.split(": ", 1)[1].replace(" (raised at the call on rank 1)", "") for line in lines}
        assert len(messages) == 1, lines  # the same error on every rank
        assert sum("(raised at the call on rank 1)" in line for line in lines) == 3, lines
        assert all(": ValueError:" in line or ": TypeError:" in line for line in lines), lines
    assert out.count("after 4.0") == 4, out  # and every rank goes on together


def test_forked_children_cannot_communicate():
    pytest.importorskip("torch")
    rc, out, _ = run_ranks(4, "forks.py", timeout=120)
    assert rc == 0, out
    worker_lines = [line for line in out.splitlines() if line.startswith("worker ")]
    assert len(worker_lines) == 4 * 8 + 4, out  # 8 DataLoader items and one Process per rank
    for line in worker_lines:
        assert "ShoalError" in line and "forked" in line and "rank()=" in line, line
        assert float(line.split(" after ")[1].split("s")[0]) < 5.0, line
    assert out.count("parent sums ok") == 4, out


@pytest.mark.parametrize("env", [{"PMI_RANK": "1", "PMI_SIZE": "2"},
                                 {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"},
                                 {"PMI_RANK": "0", "PMI_SIZE": "4"},
                                 {"SLURM_PROCID": "1", "SLURM_NTASKS": "2"},
                                 {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2"}],
                         ids=lambda e: "-".join(f"{k}={v}" for k, v in e.items()))
def test_singleton_under_a_launcher_that_says_more_raises(env):
    code = "import shoal; shoal.init(); print('size', shoal.size())"
    full = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "SLURM_"))}
    out = subprocess.run([sys.executable, "-c", code], env={**full, **env}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0, out.stdout
    assert "ShoalError" in out.stderr and "single process" in out.stderr, out.stderr
    for k, v in env.items():
        if k != "SLURM_NTASKS":
            assert f"{k}={v}" in out.stderr, out.stderr


def test_singleton_in_a_batch_allocation_is_fine():
    # An sbatch script's own shell is task 0 of the allocation: plain python there is one rank.
    code = "import shoal; shoal.init(); print('size', shoal.size())"
    env = {**os.environ, "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "size 1" in out.stdout, out.stderr
