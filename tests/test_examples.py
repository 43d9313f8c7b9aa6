"""The examples run and show what they claim."""
import re
import sys
from pathlib import Path

from conftest import shoalrun_cmd

import subprocess

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
