"""GPU checks (skip without a GPU): CUDA tensors with 4 ranks sharing one GPU through MPI,
staged through host memory and, where the machine's MPI is CUDA-aware, from device memory;
the stream-race check; NCCL with one rank (NCCL refuses two ranks on one GPU).
tests/gpu/run_on_device.sh runs these and the benchmarks on a GPU machine."""
import os
import re
import subprocess
import sys

import pytest

from conftest import run_ok

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _cuda_aware_mpi():
    out = subprocess.run([sys.executable, "-m", "shoal.launcher.run", "--check-build"], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "SHOAL_CUDA_PLUGIN": "real"}).stdout
    return "CUDA-aware MPI: yes" in out


@pytest.mark.parametrize("path", ["staged", "direct"])
def test_mpi_path_4_ranks_share_one_gpu(path):
    if path == "direct" and not _cuda_aware_mpi():
        pytest.skip("this machine's MPI is not CUDA-aware (shoalrun --check-build)")
    env = {"SHOAL_GPU_BACKEND": "mpi", "SHOAL_CUDA_AWARE_MPI": "1" if path == "direct" else "0"}
    out = run_ok(4, "ops_cuda.py", env=env, timeout=600)
    assert out.count("checks passed, 0 failed") == 4, out
    races = re.findall(r"stream race: (\d+)/100 correct", out)
    print(*(f"stream race: {r}/100 correct" for r in races), sep="\n")  # for run_on_device.sh's summary
    assert races == ["100"] * 4, races


def test_nccl_one_rank():
    out = run_ok(1, "ops_cuda.py", env={"SHOAL_GPU_BACKEND": "nccl"}, timeout=300)
    assert "checks passed, 0 failed" in out, out
