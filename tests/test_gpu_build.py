"""GPU support on a machine without a GPU (--check-build's GPU lines: test_launcher.py): a CUDA
tensor gives a clear ValueError (not a crash), and shoalrun's rank -> GPU binding."""
import subprocess
import sys

import pytest

from shoal.launcher import rank as rank_wrapper


def test_cuda_tensor_without_usable_gpu_is_a_value_error():
    from shoal._loader import _core
    built, _ = _core.gpu_support()
    code = (
        "import shoal\nfrom shoal._loader import _core\nshoal.init()\n"
        "try:\n    _core.enqueue(0, 'x', 4096, 2, [4], 4096, device_type=1, device_id=0, stream=0)\n"
        "except ValueError as e:\n    print('ValueError:', e)\nshoal.shutdown()\n")
    try:
        import torch
        if torch.cuda.is_available():
            pytest.skip("a GPU is usable here")
    except ImportError:
        pass
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert "ValueError: allreduce: " in out, out
    assert ("CUDA device 0 is not usable" in out) if built else ("no CUDA support" in out), out


@pytest.mark.parametrize("env,count,want", [
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "5", "SHOAL_GPU_BIND": "1"}, 4, "1"),
    ({"MPI_LOCALRANKID": "2", "SHOAL_GPU_BIND": "1"}, 1, "0"),            # ranks share the one GPU
    ({"MPI_LOCALRANKID": "2", "SHOAL_GPU_BIND": "1", "CUDA_VISIBLE_DEVICES": "3"}, 4, "3"),  # the user's choice wins
    ({"MPI_LOCALRANKID": "2"}, 4, None),            # default: scripts pick their device (set_device(local_rank))
    ({"MPI_LOCALRANKID": "2", "SHOAL_GPU_BIND": "1"}, 0, None),  # no GPU: nothing set
    ({"SHOAL_GPU_BIND": "1"}, 4, None),             # not under a launcher
])
def test_rank_gpu_binding(env, count, want):
    env = dict(env)
    rank_wrapper.bind_gpu(env, count=lambda: count)
    assert env.get("CUDA_VISIBLE_DEVICES") == want
