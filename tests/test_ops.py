"""Exact results of every op and dtype at 1, 2, 4 and 8 ranks, with and without fusion."""
import pytest

from conftest import run_ok


@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
@pytest.mark.parametrize("fusion", ["default", "off"])
def test_numpy_ops_exact(ranks, fusion):
    env = {"SHOAL_FUSION_THRESHOLD": "0"} if fusion == "off" else {}
    if ranks >= 4:
        env["SHOAL_RANKS_PER_MACHINE"] = "2"  # exercise the multi-machine grouping
    out = run_ok(ranks, "ops_numpy.py", env=env)
    assert out.count("checks passed, 0 failed") == ranks, out


@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
def test_torch_ops_exact(ranks):
    pytest.importorskip("torch")
    out = run_ok(ranks, "ops_torch.py", timeout=300)
    assert out.count("checks passed, 0 failed") == ranks, out
