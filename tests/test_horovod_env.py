"""Horovod's tuning variables map onto SHOAL_* settings (shoal/_compat_env.py), below the
Shoal name and BlueFog's."""
from shoal._compat_env import bluefog_settings


def test_horovod_variables_map_onto_shoal_settings():
    got = bluefog_settings({"HOROVOD_FUSION_THRESHOLD": "67108864", "HOROVOD_CYCLE_TIME": "3.5",
                            "HOROVOD_STALL_CHECK_TIME_SECONDS": "30", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "120",
                            "HOROVOD_TIMELINE": "/tmp/t", "HOROVOD_LOG_LEVEL": "DEBUG",
                            "HOROVOD_GPU_OPERATIONS": "NCCL"})
    assert got == {"SHOAL_FUSION_THRESHOLD": "67108864", "SHOAL_CYCLE_TIME": "3.5", "SHOAL_STALL_CHECK_TIME": "30",
                   "SHOAL_STALL_SHUTDOWN_TIME": "120", "SHOAL_TIMELINE": "/tmp/t", "SHOAL_LOG_LEVEL": "debug",
                   "SHOAL_GPU_BACKEND": "nccl"}


def test_shoal_and_bluefog_names_win_over_horovod_s():
    got = bluefog_settings({"HOROVOD_CYCLE_TIME": "3", "BLUEFOG_CYCLE_TIME": "2", "HOROVOD_FUSION_THRESHOLD": "1",
                            "SHOAL_FUSION_THRESHOLD": "5", "HOROVOD_GPU_OPERATIONS": "MPI"})
    assert got == {"SHOAL_CYCLE_TIME": "2", "SHOAL_GPU_BACKEND": "mpi"}
