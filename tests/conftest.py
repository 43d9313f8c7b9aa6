"""Helpers to run real multi-rank jobs under `shoalrun`, with a timeout so a hang fails, and
to make each check of a worker (tests/workers/checks.py) its own pytest item.

A worker's checks share one shoalrun job per (worker, ranks, arguments, settings): the first
item that needs the job runs it, the others read its cached output. `[rank R] PASS|SKIP|FAIL
<check>` lines (checks.run_all) decide each item: it fails when the check failed on any rank
(with that rank's traceback) or a rank reported nothing for it, it is skipped (with the
reason) when every rank skipped it, and every item of a job that hung, crashed or exited
non-zero without a failed check to explain it fails, with the reason."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

WORKERS = Path(__file__).parent / "workers"
# One BLAS / OpenMP thread per process: two test workers already share the cores with the
# ranks they start, and OpenBLAS's idle threads spin, which on oversubscribed cores costs
# far more than its parallelism gains. (shoalrun keeps a value that is already set.)
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _outside_source_tree(tmp_path, monkeypatch):
    """Run every test (and the processes it starts) outside the checkout, so `import
    shoal` finds the installed package, not the unbuilt sources."""
    monkeypatch.chdir(tmp_path)


def shoalrun_cmd(np_, *command):
    return [sys.executable, "-m", "shoal.launcher.run", "-np", str(np_), *command]


def _run(np_, script, args, env, timeout):
    """(exit status, or None when the job hung and was killed; output; seconds).

    The whole job runs in its own process group, killed on timeout, and also when pytest
    interrupts the wait (pytest-timeout, Ctrl-C): no job outlives its test."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    cmd = shoalrun_cmd(np_, sys.executable, str(WORKERS / script), *map(str, args))
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full_env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out, time.monotonic() - start
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    secs = time.monotonic() - start
    if os.environ.get("SHOAL_TEST_JOB_LOG"):  # where the suite's time goes: one line per job
        with open(os.environ["SHOAL_TEST_JOB_LOG"], "a") as log:
            log.write(f"{secs:8.1f} {np_} {script} {' '.join(map(str, args))} {sorted((env or {}).items())}\n")
    return proc.returncode, out, secs


def run_ranks(np_, script, *args, env=None, timeout=120):
    """Run `python tests/workers/<script> args` on `np_` ranks; returns (rc, output, seconds).
    A hang is a test failure, not a stuck CI."""
    rc, out, secs = _run(np_, script, args, env, timeout)
    if rc is None:
        pytest.fail(f"{script} on {np_} ranks hung for {timeout} s; output:\n{out[-4000:]}")
    return rc, out, secs


def run_ok(np_, script, *args, env=None, timeout=120):
    rc, out, secs = run_ranks(np_, script, *args, env=env, timeout=timeout)
    assert rc == 0, f"{script} on {np_} ranks exited {rc}:\n{out[-6000:]}"
    return out


def worker_checks(script):
    """The names of the `@check` functions of tests/workers/<script>, in their order."""
    return re.findall(r"^@check\ndef (\w+)", (WORKERS / script).read_text(), re.M)


_REPORT = re.compile(r"\[rank (\d+)\] (PASS|SKIP|FAIL) (\w+)(.*)$", re.M)
_SUMMARY = re.compile(r"\[rank (\d+)\] \d+ checks passed, (\d+) failed", re.M)
_outputs = {}  # Job.key -> (exit status or None, output, why it did not end, or None)


class Job:
    """One shoalrun job of a worker that runs its checks with checks.run_all; it runs once
    per session, when the first item that needs it asks."""

    def __init__(self, np_, script, *args, env=None, timeout=120):
        self.np, self.script, self.args, self.env, self.timeout = np_, script, args, dict(env or {}), timeout
        self.key = (np_, script, tuple(map(str, args)), tuple(sorted(self.env.items())))
        self.title = f"{script} {' '.join(map(str, args))}".rstrip() + f" on {np_} ranks"

    def result(self):
        """(exit status, output, None) of the job, or (status, output, why) when it did
        not end well: hung, interrupted, or stopped before every rank reported."""
        if self.key not in _outputs:
            try:
                rc, out, _ = _run(self.np, self.script, self.args, self.env, self.timeout)
            except BaseException as exc:  # interrupted: the job's other items fail at once
                _outputs[self.key] = None, "", f"its run was interrupted ({type(exc).__name__}: {exc})"
                raise
            why = None
            if rc is None:
                why = f"it hung: killed after {self.timeout} s"
            else:
                summaries = {int(r): int(f) for r, f in _SUMMARY.findall(out)}
                missing = sorted(set(range(self.np)) - set(summaries))
                if missing:
                    why = f"ranks {missing} did not finish their checks (exit status {rc})"
                elif rc != 0 and not any(summaries.values()):
                    why = f"it exited {rc} although no check failed"
            _outputs[self.key] = rc, out, why
        return _outputs[self.key]

    def check(self, name):
        """Fail, skip or pass as check `name` did on every rank of the job."""
        rc, out, why = self.result()
        status, at = {}, {}
        for m in _REPORT.finditer(out):
            if m[3] == name:
                status[int(m[1])] = m[2], m[4].removeprefix(":").strip()
                at[int(m[1])] = m.start()
        tail = f"\n--- output (last 6000 characters):\n{out[-6000:]}"
        for r, (verdict, _) in sorted(status.items()):
            if verdict == "FAIL":
                end = out.find("\n[rank ", at[r] + 1)
                note = f"\n(and the job did not end well: {why})" if why else ""
                pytest.fail(f"{name} failed on rank {r} of {self.title}:\n{out[at[r]:end if end > 0 else None]}{note}",
                            pytrace=False)
        if why:
            seen = ", ".join(f"rank {r} {v}" for r, (v, _) in sorted(status.items())) or "no rank"
            pytest.fail(f"{self.title}: {why}; {name} reported by {seen}{tail}", pytrace=False)
        missing = sorted(set(range(self.np)) - set(status))
        if missing:
            pytest.fail(f"ranks {missing} of {self.title} reported nothing for {name}{tail}", pytrace=False)
        reasons = {why for verdict, why in status.values() if verdict == "SKIP"}
        if reasons:
            assert len(reasons) == 1 and all(v == "SKIP" for v, _ in status.values()), \
                f"{name} skipped on some ranks only, or for different reasons: {status}"
            pytest.skip(reasons.pop())

    def output(self):
        """The output of the job, which must have ended with exit status 0."""
        rc, out, why = self.result()
        if why:
            pytest.fail(f"{self.title}: {why}\n{out[-6000:]}", pytrace=False)
        failed = sorted({m[3] for m in _REPORT.finditer(out) if m[2] == "FAIL"})
        assert rc == 0, f"{self.title} exited {rc}" + (f"; failed checks (each an item of its own): {', '.join(failed)}"
                                                      if failed else f":\n{out[-6000:]}")
        return out


# Longest first (seconds of one worker, 2-core machine): each worker takes whole files in
# this order (`--dist loadfile --no-loadscope-reorder`), so the long files overlap each other
# and short ones fill the end, instead of one worker running a long file alone at the end.
LONGEST_FIRST = ["test_core_cpp.py", "gpu/test_fake_device.py", "test_torch_training.py", "test_tensorflow.py",
                 "test_exits.py", "test_alltoall_grouped.py", "test_digits_example.py", "test_ops.py", "test_join.py",
                 "test_windows.py", "test_collectives.py", "gpu/test_gpu_paths.py", "test_horovod_keras.py",
                 "test_launcher.py", "test_horovod_torch.py", "test_loop_orders.py", "test_process_sets.py"]


def pytest_collection_modifyitems(items):
    """Files in LONGEST_FIRST order, then the rest in their own order (the sort is stable)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    here = Path(__file__).parent
    items.sort(key=lambda item: rank.get(item.path.relative_to(here).as_posix(), len(rank)))
