"""shoalrun: the README's commands, plain mpiexec, flags, --check-build."""
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import shoalrun_cmd

ALLREDUCE = ("import shoal.torch as bf, torch; bf.init(); "
             "print(bf.allreduce(torch.ones(3)*bf.rank(), average=False))")


def _run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, **kw)


def test_check_build_reports_mpich_from_pypi_and_torch():
    out = _run([sys.executable, "-m", "shoal.launcher.run", "--check-build"])
    assert out.returncode == 0, out.stderr
    assert "MPICH" in out.stdout and "from PyPI" in out.stdout, out.stdout
    if pytest.importorskip("torch"):
        assert "torch binding: usable" in out.stdout, out.stdout


def test_shoalrun_allreduce_prints_sum_on_every_rank():
    pytest.importorskip("torch")
    out = _run(shoalrun_cmd(4, sys.executable, "-c", ALLREDUCE))
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("tensor([6., 6., 6.])") == 4, out.stdout


def test_commands_work_from_the_checkout_root():
    # There, the checkout's (unbuilt, for a non-editable install) shoal/ comes first on
    # the import path of `python -c` and `python -m`.
    pytest.importorskip("torch")
    root = Path(__file__).resolve().parent.parent
    out = _run(shoalrun_cmd(2, sys.executable, "-c", ALLREDUCE), cwd=root)
    assert out.returncode == 0 and out.stdout.count("tensor([1., 1., 1.])") == 2, out.stdout + out.stderr
    out = _run([sys.executable, "-m", "shoal.timeline", "/nonexistent/prefix"], cwd=root)
    assert "no timeline files" in out.stderr, out.stderr


def test_plain_mpiexec_works_too():
    pytest.importorskip("torch")
    from shoal.launcher.run import find_mpiexec
    out = _run([find_mpiexec(), "-n", "4", sys.executable, "-c", ALLREDUCE])
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("tensor([6., 6., 6.])") == 4, out.stdout


def test_flags_reach_the_ranks():
    code = ("import os; print('ENV', os.environ.get('SHOAL_LOG_LEVEL'), os.environ.get('FOO'), "
            "os.environ.get('SHOAL_FUSION_THRESHOLD'), os.environ.get('OMP_NUM_THREADS'))")
    cmd = [sys.executable, "-m", "shoal.launcher.run", "-np", "3", "--log-level", "error",
           "-x", "FOO=bar", sys.executable, "-c", code]
    out = _run(cmd, env={**__import__("os").environ, "SHOAL_FUSION_THRESHOLD": "123"})
    assert out.returncode == 0, out.stderr
    import os
    omp = "1" if 3 > (os.cpu_count() or 1) and "OMP_NUM_THREADS" not in os.environ else os.environ.get("OMP_NUM_THREADS")
    assert out.stdout.count(f"ENV error bar 123 {omp}") == 3, out.stdout


def test_usage_errors():
    out = _run([sys.executable, "-m", "shoal.launcher.run", "python", "x.py"])
    assert out.returncode != 0 and "-np" in out.stderr
