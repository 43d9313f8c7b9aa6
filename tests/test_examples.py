"""The examples run and show what they claim."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import shoalrun_cmd

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_average_consensus_contracts_geometrically():
    out = subprocess.run(shoalrun_cmd(8, sys.executable, str(EXAMPLES / "average_consensus.py")),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    dist = [float(m) for m in re.findall(r"distance to average (\S+)", out.stdout)]
    assert len(dist) == 13, out.stdout
    # Exponential-2 graph on 8 ranks: ||W - J||_2 = 1/2, so every step at least halves it.
    for a, b in zip(dist, dist[1:]):
        assert b <= 0.5 * a * (1 + 1e-9), (a, b)
    assert dist[-1] < 1e-3 * dist[0]


@pytest.mark.parametrize("ranks", [3, 8])
def test_asynchronous_push_sum_reaches_the_average(ranks):
    out = subprocess.run(shoalrun_cmd(ranks, sys.executable, str(EXAMPLES / "average_consensus.py"),
                                      "--asynchronous", "--seconds", "2"),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    finals = re.findall(r"rank (\d+)\s+final after (\d+) iterations: relative distance ([0-9.e+-]+)\s+p ([0-9.]+)",
                        out.stdout)
    assert len(finals) == ranks, out.stdout
    for rank, iters, rel, p in finals:
        assert float(rel) < 1e-6, (rank, rel)  # de-biased estimate x/p = the average
    iters = [int(f[1]) for f in finals]
    assert len(set(iters)) > 1, iters  # ranks ran at their own pace
    total = float(re.search(r"sum of p = (\S+)", out.stdout).group(1))
    assert abs(total - ranks) < 1e-9, total  # float64 mass is conserved
    print(out.stdout)
