"""GPU checks (skip without a GPU): CUDA tensors through the host-staged MPI path with 4
ranks sharing one GPU, the stream-race check, and NCCL with one rank.
tests/gpu/run_on_device.sh runs these and the kernel benchmark on a GPU machine."""
import re

import pytest

from conftest import run_ok

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def test_mpi_path_4_ranks_share_one_gpu():
    out = run_ok(4, "ops_cuda.py", env={"SHOAL_GPU_BACKEND": "mpi"}, timeout=600)
    assert out.count("checks passed, 0 failed") == 4, out
    races = re.findall(r"stream race: (\d+)/100 correct", out)
    assert races == ["100"] * 4, races


def test_nccl_one_rank():
    out = run_ok(1, "ops_cuda.py", env={"SHOAL_GPU_BACKEND": "nccl"}, timeout=300)
    assert "checks passed, 0 failed" in out, out
