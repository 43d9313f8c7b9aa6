"""shoal.torch training layer: optimizers, state utilities, consensus, autograd."""
import pytest

from conftest import run_ok

pytest.importorskip("torch")


def test_optimizers_and_consensus():
    out = run_ok(4, "optimizers.py", env={"SHOAL_RANKS_PER_MACHINE": "2"}, timeout=400)
    assert out.count("checks passed, 0 failed") == 4, out


@pytest.mark.parametrize("ranks", [2, 4])
def test_autograd_matches_manual_gradients(ranks):
    out = run_ok(ranks, "autograd.py", timeout=200)
    assert out.count("autograd ok") == ranks, out
