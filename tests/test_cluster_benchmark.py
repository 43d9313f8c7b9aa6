"""benchmarks/cluster_training.py: its predictions of link bytes, its summary line, and a
short job of the delayed-mixing configurations on 2 emulated machines."""
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import needs_netns, shoalrun_cmd

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "cluster_training.py"
_spec = importlib.util.spec_from_file_location("cluster_training", SCRIPT)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.mark.parametrize("size,per_machine", [(4, 2), (8, 2), (8, 4), (16, 4)])
def test_decent_dp_prediction_follows_its_topology(size, per_machine):
    """The prediction pairs ranks as decent-dp's "one-peer-exp" does (its own edge list,
    built without a process group): one model sent per rank whose partner is elsewhere."""
    topo_mod = pytest.importorskip("decent_dp.topo", reason="decent-dp not installed (pip install decent-dp)")
    topo = object.__new__(topo_mod.TopologyReg.registry["one-peer-exp"])
    topo._world_size = size
    rounds = topo._get_topo_edges()
    crossing = sum(len(e.ranks) for edges in rounds for e in edges if len({r // per_machine for r in e.ranks}) > 1)
    expected = crossing / len(rounds) / (size // per_machine)
    assert bench.predicted_models_per_machine("Decent-DP", size, per_machine) == expected


def test_predictions_at_8_ranks_on_4_machines():
    # one-peer exp2 at 8 ranks: hop 1 crosses machines for 4 ranks, hops 2 and 4 for all 8:
    # 1, 2 and 2 models per machine, 5/3 on average; Decent-DP's pairs: round 0 within
    # machines, rounds 1 and 2 all across: 4/3.
    assert bench.predicted_models_per_machine("comm only", 8, 2) == pytest.approx(5 / 3)
    assert bench.predicted_models_per_machine("Decent-DP", 8, 2) == pytest.approx(4 / 3)
    assert bench.predicted_models_per_machine("AWC delayed pairs", 8, 2) == pytest.approx(4 / 3)  # Decent-DP's pairs
    assert bench.predicted_models_per_machine("comm only pairs", 8, 2) == pytest.approx(4 / 3)
    # int8 gossip: 260 bytes per 256 float32 values (1,024 bytes) of one-peer's traffic
    assert bench.predicted_models_per_machine("AWC int8", 8, 2) == pytest.approx(5 / 3 * 260 / 1024)
    # AWC delayed: the exchange started at the end of step t has step t's weights: the same
    assert bench.predicted_models_per_machine("AWC delayed", 8, 2) == pytest.approx(5 / 3)
    assert bench.predicted_models_per_machine("AWC delayed", 4, 2) == pytest.approx(3 / 2)


def test_delayed_line():
    line = bench.delayed_line({"AWC delayed": 0.6, "compute only": 0.25, "comm only": 0.5, "Decent-DP": 0.75,
                               "AWC one-peer": 0.8})
    assert line == ("AWC delayed: 0.600 s/step; 1.20x its bound max(compute only, "
                    "comm only) = 0.500 s/step; 0.80x Decent-DP's s/step; 0.75x AWC one-peer's s/step")
    assert bench.delayed_line({"AWC delayed": 0.6}) == "AWC delayed: 0.600 s/step"
    # over Decent-DP's pairs: its own exchange alone is its bound
    line = bench.delayed_line({"AWC delayed": 0.6, "AWC delayed pairs": 0.45, "compute only": 0.25, "comm only": 0.5,
                               "comm only pairs": 0.4, "Decent-DP": 0.5})
    assert line.splitlines()[1] == ("AWC delayed pairs: 0.450 s/step; 1.12x its bound max(compute only, "
                                    "comm only pairs) = 0.400 s/step; 0.90x Decent-DP's s/step")
    assert bench.delayed_line({"compute only": 0.25}) is None


def test_groups_time_the_baselines_beside_every_group():
    """Configurations alive at once are bounded (memory); allreduce and DDP are timed in
    every group, so each configuration's ratio is against baseline rounds beside it."""
    wanted = ["AWC one-peer", "grad allreduce", "AWC delayed", "push-sum", "DDP gloo", "compute only"]
    assert bench.groups(wanted, 4) == [["grad allreduce", "DDP gloo", "AWC one-peer", "AWC delayed"],
                                       ["grad allreduce", "DDP gloo", "push-sum", "compute only"]]
    assert bench.groups(wanted, 8) == [["grad allreduce", "DDP gloo", "AWC one-peer", "AWC delayed", "push-sum",
                                        "compute only"]]
    assert bench.groups(["AWC one-peer", "ATC one-peer", "push-sum"], 2) == [["AWC one-peer", "ATC one-peer"],
                                                                            ["push-sum"]]
    assert bench.groups(["grad allreduce"], 8) == [["grad allreduce"]]


def test_missing_decent_dp_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "decent_dp.ddp", None)  # import of it raises ImportError
    with pytest.raises(SystemExit, match="pip install decent-dp"):
        bench.decent_dp(None, None, None, 0.01)


@pytest.mark.mpich_only("--machines drives MPICH's Hydra launcher")
@needs_netns
def test_delayed_configurations_on_2_machines(tmp_path):
    """4 ranks on 2 machines, the new configurations beside AWC one-peer: every one runs,
    the table's rows and predictions are the configurations' own, and the summary line is
    computed from the rows' s/step."""
    pytest.importorskip("decent_dp", reason="decent-dp not installed (pip install decent-dp)")
    configs = ["AWC one-peer", "AWC delayed", "AWC delayed pairs", "Decent-DP", "comm only", "comm only pairs",
               "compute only"]
    out_json = tmp_path / "out.json"
    cmd = shoalrun_cmd(4, sys.executable, str(SCRIPT), "--model", "tiny160", "--configs", ",".join(configs),
                       "--steps", "2", "--rounds", "1", "--json", str(out_json),
                       launch=("--machines", "2", "--link", "1gbit"))
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    result = json.loads(out_json.read_text())
    rows = {r["config"]: r for r in result["rows"]}
    assert list(rows) == configs
    # one-peer exp2 at 4 ranks on 2 machines: hop 1 crosses for 2 ranks, hop 2 for all 4
    assert [rows[c]["predicted_models_per_step"] for c in configs] == [1.5, 1.5, 1.0, 1.0, 1.5, 1.0, 0.0]
    assert all(len(r["rounds"]) == 1 and r["s_per_step"] > 0 for r in rows.values())
    lines = re.search(r"^AWC delayed: .*\nAWC delayed pairs: .*$", run.stdout, re.M)
    assert lines, run.stdout[-3000:]
    assert lines.group(0) == bench.delayed_line({c: r["s_per_step"] for c, r in rows.items()})


@pytest.mark.mpich_only("--machines drives MPICH's Hydra launcher")
@needs_netns
def test_ddp_under_torchrun_beside_the_job(tmp_path):
    """The driver's "DDP torchrun": a second job of one shoalrun rank per machine, each
    running torchrun with the machine's ranks as workers (4 ranks on 2 machines); its row
    joins the setting's table beside the first job's."""
    cmd = [sys.executable, str(SCRIPT), "--links", "1gbit", "--np", "4", "--machines", "2", "--model", "tiny160",
           "--configs", "grad allreduce,DDP torchrun", "--steps", "2", "--rounds", "1"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    assert "--torchrun-node" in run.stdout and "Shoal's fastest decentralized" not in run.stdout
    result = json.loads((tmp_path / "cluster_training.1gbit.json").read_text())
    rows = {r["config"]: r for r in result["rows"]}
    assert list(rows) == ["grad allreduce", "DDP torchrun"]
    ddp = rows["DDP torchrun"]
    # gloo's ring over 4 ranks in blocks of 2: 2(n-1)/n = 1.5 models across each machine link
    assert ddp["predicted_models_per_step"] == 1.5
    assert ddp["samples_per_s"] > 0 and len(ddp["rounds"]) == 1
    assert len(ddp["link_mib_per_step"]) == 2 and min(ddp["link_mib_per_step"]) > 0  # each machine's leader counted
    assert re.search(r"^DDP torchrun\s+\d", run.stdout, re.M)
