"""Error paths of the device data paths on fake devices (tests/workers/gpu_errors.py):
a failed NCCL id on rank 0 or on one edge, ranks that disagree on SHOAL_GPU_BACKEND, and a
rank that leaves while NCCL transfers wait for it. One job per setting, one item per check."""
import pytest

from conftest import Job

FAKE = {"SHOAL_CUDA_PLUGIN": "fake", "SHOAL_FAKE_DEVICE": "1", "SHOAL_GPU_BACKEND": "nccl",
        "SHOAL_FAKE_NCCL_TIMEOUT": "20"}


@pytest.mark.parametrize("check", ["nccl_id_failure_on_rank_0_reaches_every_rank",
                                   "edge_id_failure_fails_that_edge_only",
                                   "rank_leaving_ends_waiting_nccl_transfers"])
@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_gpu_error_paths(ranks, check):
    pytest.importorskip("torch")
    Job(ranks, "gpu_errors.py", env=FAKE, timeout=180).check(check)


def test_ranks_that_disagree_on_the_gpu_backend_get_one_error():
    pytest.importorskip("torch")
    Job(4, "gpu_errors.py", "split", env=FAKE, timeout=180).check("ranks_that_disagree_on_the_gpu_path_get_one_error")


def test_failed_machine_exchange_reaches_the_whole_machine():
    pytest.importorskip("torch")
    Job(4, "gpu_errors.py", "machines", env=FAKE, timeout=180).check("failed_machine_exchange_reaches_the_whole_machine")


def test_device_piece_for_a_rank_without_device_ops_fails_at_once():
    pytest.importorskip("torch")
    Job(3, "gpu_errors.py", "mixed", env={**FAKE, "SHOAL_FAKE_NCCL_TIMEOUT": "5"}, timeout=120).check(
        "device_piece_for_a_rank_without_device_ops_fails_at_once")
