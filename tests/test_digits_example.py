"""The main job (examples/torch_digits.py) runs end to end: it trains, prints per-epoch
lines, writes its history and plot."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import shoalrun_cmd

pytest.importorskip("torch")
pytest.importorskip("sklearn")
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "torch_digits.py"


@pytest.mark.parametrize("args", [["--optimizer", "awc"],
                                  ["--optimizer", "atc", "--topology", "base-k", "--base-k", "2"],
                                  ["--optimizer", "gradient-allreduce", "--partition", "dirichlet"],
                                  ["--topology", "ring", "--consensus-target", "0.05"]])
def test_digits_trains(tmp_path, args):
    cmd = shoalrun_cmd(4, sys.executable, str(EXAMPLE), "--epochs", "4", "--no-progress",
                       "--out-dir", str(tmp_path), *args)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    acc = [float(a) for a in re.findall(r"epoch +\d+ .*test accuracy ([\d.]+)%", out.stdout)]
    assert len(acc) == 4 and acc[-1] > 60, out.stdout
    hist = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert len(hist["consensus_distance"]) == 4
    if "--consensus-target" in args:
        assert "extra gossip rounds" in out.stdout
    assert (tmp_path / "digits.png").stat().st_size > 10_000
    summary = re.findall(r"^summary: optimizer=(\S+) topology=(\S+) partition=(\S+) ranks=4 epochs=4 "
                         r"test_accuracy=([\d.]+)% consensus_distance=(\S+) time=[\d.]+s$", out.stdout, re.M)
    assert len(summary) == 1, out.stdout  # rank 0 only
    optimizer, topo, partition, accuracy, xi = summary[0]
    expect = dict(zip(args[::2], args[1::2]))
    assert optimizer == expect.get("--optimizer", "awc") and partition == expect.get("--partition", "iid")
    assert topo == ("allreduce" if optimizer == "gradient-allreduce" else expect.get("--topology", "one-peer-exp"))
    assert float(accuracy) == acc[-1] and float(xi) == float(f"{hist['consensus_distance'][-1]:.3e}"), summary
