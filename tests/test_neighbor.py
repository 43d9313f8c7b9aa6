"""Neighbor ops equal W @ X (numpy) at 1-8 ranks, with and without fusion."""
import pytest

from conftest import run_ok


@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
@pytest.mark.parametrize("fusion", ["default", "off"])
def test_neighbor_ops_match_numpy(ranks, fusion):
    env = {"SHOAL_FUSION_THRESHOLD": "0"} if fusion == "off" else {}
    if ranks >= 4:
        env["SHOAL_RANKS_PER_MACHINE"] = "2"  # hierarchical ops across 2-rank "machines"
    out = run_ok(ranks, "neighbor.py", env=env)
    assert out.count("checks passed, 0 failed") == ranks, out
    assert "'global_collectives': 0" in out and "'coordinator_rounds': 0" in out
