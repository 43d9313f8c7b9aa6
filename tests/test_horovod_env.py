"""Horovod's tuning variables map onto SHOAL_* settings (shoal/_compat_env.py), below the
Shoal name and BlueFog's."""
import os

from shoal._compat_env import bluefog_settings, link_horovod_timeline


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


def test_horovod_dynamic_timeline_sets_no_prefix():
    # HOROVOD_TIMELINE=DYNAMIC: Horovod's "on, no file until start_timeline", not a file name.
    assert bluefog_settings({"HOROVOD_TIMELINE": "DYNAMIC", "HOROVOD_CYCLE_TIME": "2"}) == {"SHOAL_CYCLE_TIME": "2"}


def test_rank_0_links_horovods_timeline_name_to_its_file(tmp_path):
    path = str(tmp_path / "t.json")
    env = {"HOROVOD_TIMELINE": path, "SHOAL_TIMELINE": path}
    assert link_horovod_timeline(0, env) is None  # rank 0's file not written (yet, or ever): no link
    (tmp_path / "t.json0.json").write_text("[\n]\n")
    assert link_horovod_timeline(1, env) is None  # only rank 0 links
    assert link_horovod_timeline(0, {"SHOAL_TIMELINE": path}) is None  # a Shoal prefix: nothing to link
    (tmp_path / "t.json").write_text("an earlier run's")
    assert link_horovod_timeline(0, env) == path
    assert os.readlink(path) == "t.json0.json" and open(path).read() == "[\n]\n"
    assert link_horovod_timeline(0, env) == path  # again (init() twice): the same link
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json", "t.json0.json"]
    (tmp_path / "d").mkdir()
    (tmp_path / "d0.json").write_text("[\n]\n")
    d = str(tmp_path / "d")
    assert link_horovod_timeline(0, {"HOROVOD_TIMELINE": d, "SHOAL_TIMELINE": d}) is None and os.path.isdir(d)
