"""Helpers to run real multi-rank jobs under `shoalrun`, with a timeout so a hang fails."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

WORKERS = Path(__file__).parent / "workers"


@pytest.fixture(autouse=True)
def _outside_source_tree(tmp_path, monkeypatch):
    """Run every test (and the processes it starts) outside the checkout, so `import
    shoal` finds the installed package, not the unbuilt sources."""
    monkeypatch.chdir(tmp_path)


def shoalrun_cmd(np_, *command):
    return [sys.executable, "-m", "shoal.launcher.run", "-np", str(np_), *command]


def run_ranks(np_, script, *args, env=None, timeout=120):
    """Run `python tests/workers/<script> args` on `np_` ranks; returns (rc, output, seconds).

    The whole job runs in its own process group and is killed on timeout, so a hang is
    a test failure, not a stuck CI.
    """
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
        pytest.fail(f"{script} on {np_} ranks hung for {timeout} s; output:\n{out[-4000:]}")
    return proc.returncode, out, time.monotonic() - start


def run_ok(np_, script, *args, env=None, timeout=120):
    rc, out, secs = run_ranks(np_, script, *args, env=env, timeout=timeout)
    assert rc == 0, f"{script} on {np_} ranks exited {rc}:\n{out[-6000:]}"
    return out
