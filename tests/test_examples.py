"""The examples run and show what they claim, print their defaults in --help and end with
one summary line."""
import importlib.util
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
    summary = re.findall(r"^summary: mode=synchronous ranks=8 steps=12 initial_distance=(\S+) "
                         r"final_distance=(\S+) time=[\d.]+s$", out.stdout, re.M)
    assert len(summary) == 1 and [float(d) for d in summary[0]] == [dist[0], dist[-1]], out.stdout


@pytest.mark.parametrize("ranks", [3, 8])
def test_asynchronous_push_sum_reaches_the_average(ranks):
    out = subprocess.run(shoalrun_cmd(ranks, sys.executable, str(EXAMPLES / "average_consensus.py"),
                                      "--asynchronous", "--seconds", "2",
                                      # converged whatever the load: every rank runs 500 iterations or more
                                      "--min-iterations", "500"),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    finals = re.findall(r"rank (\d+)\s+final after (\d+) iterations: relative distance ([0-9.e+-]+)\s+p ([0-9.]+)",
                        out.stdout)
    assert len(finals) == ranks, out.stdout
    for rank, iters, rel, p in finals:
        assert float(rel) < 1e-6, (rank, rel)  # de-biased estimate x/p = the average
    iters = [int(f[1]) for f in finals]
    # Ranks ran at their own pace: when each first reported its progress (after a quarter of
    # the time), they had run different numbers of iterations.
    first = {}
    for rank, it in re.findall(r"^rank (\d+)\s+t\s+[\d.]+ s\s+iteration\s+(\d+)", out.stdout, re.M):
        first.setdefault(rank, int(it))
    assert len(first) == ranks and len(set(first.values())) > 1, first
    total = float(re.search(r"sum of p = (\S+)", out.stdout).group(1))
    assert abs(total - ranks) < 1e-9, total  # float64 mass is conserved
    summary = re.findall(rf"^summary: mode=asynchronous ranks={ranks} seconds=2 iterations=(\d+)-(\d+) "
                         r"worst_relative_distance=(\S+) sum_p=(\S+) time=[\d.]+s$", out.stdout, re.M)
    assert len(summary) == 1, out.stdout
    fewest, most, worst, sum_p = summary[0]
    assert (int(fewest), int(most)) == (min(iters), max(iters)) and float(worst) < 1e-6, summary
    assert float(sum_p) == total, summary
    print(out.stdout)


# keras_digits.py too, but its --help alone imports TensorFlow (half a minute on 2 cores).
@pytest.mark.parametrize("example", ["average_consensus.py", "optimization.py", "torch_digits.py"])
def test_help_shows_the_defaults(example):
    needs = {"torch_digits.py": ["torch", "sklearn"]}
    for module in needs.get(example, []):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")
    out = subprocess.run([sys.executable, str(EXAMPLES / example), "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())  # argparse wraps the help lines
    options = re.findall(r"^  (--[\w-]+)", out.stdout, re.M)
    assert len(options) >= 4, out.stdout
    # Every option shows its default (a flag's is False).
    assert text.count("(default: ") == len(options), out.stdout
