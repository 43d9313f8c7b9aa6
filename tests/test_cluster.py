"""The emulated cluster (`shoalrun --machines M --link RATE`, launcher/cluster.py): Shoal's
suites across emulated machines, the link rate, the straggler, the link report, and that
every set-up is removed however a job ends, touching nothing else."""
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

from conftest import CAN_EMULATE, WORKERS, Job, needs_netns, shoalrun_cmd, worker_checks
from shoal.launcher import cluster

# The cluster's own checks run under the default MPI (MPICH); Open MPI's mpirun crosses it
# in tests/test_fault_tolerance.py (a machine's ranks lost) and tests/test_launcher_flags.py.
pytestmark = pytest.mark.mpich_only("the emulated cluster's checks run under MPICH, the default MPI")
MACHINES4 = ("--machines", "4", "--link", "1gbit")
SUITES = [("neighbor.py",), ("windows.py",), ("coll_numpy.py",), ("cluster.py", "--machines", "4")]


def _suite_job():
    return Job(8, "bundle.py", json.dumps(SUITES), launch=MACHINES4, timeout=300)


@needs_netns
@pytest.mark.parametrize("check", [c for part in SUITES for c in worker_checks(part[0])])
def test_suites_across_4_machines(check):
    """The neighbor suite (hierarchical ops included), windows and push-sum, collectives,
    and the machine layout from the real hosts: 8 ranks on 4 machines, 2 each."""
    _suite_job().check(check)


@needs_netns
def test_suites_across_4_machines_job_and_link_report():
    out = _suite_job().output()
    table = re.findall(r"^  (\d)\s+node(\d)\s+(\d-\d)\s+([\d.]+)\s+([\d.]+)", out, re.M)
    assert [(m, h, span) for m, h, span, _, _ in table] == [
        ("0", "0", "0-1"), ("1", "1", "2-3"), ("2", "2", "4-5"), ("3", "3", "6-7")], out[-3000:]
    assert all(float(sent) > 0.5 for *_, sent, _ in table), table  # MiB: the suites crossed every link


def _cluster_state():
    """What the host has that a job could leave behind (or wrongly touch)."""
    names = [n for n in os.listdir(cluster.NETNS_DIR)] if os.path.isdir(cluster.NETNS_DIR) else []
    root = cluster._cgroup_root()
    groups = [g for g in os.listdir(root) if g.startswith(cluster.PREFIX)] if root else []
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    routes = subprocess.run(["ip", "route"], capture_output=True, text=True).stdout
    with open("/etc/hosts", "rb") as f:
        hosts = hashlib.sha1(f.read()).hexdigest()
    return {"netns": sorted(n for n in names if n.startswith(cluster.PREFIX)), "cgroups": groups,
            "links": [line.split()[1] for line in links.splitlines()], "routes": routes, "hosts": hosts}


def _processes(token):
    found = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if token.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def _wait_until(fn, seconds=15):
    end = time.monotonic() + seconds
    while time.monotonic() < end and not fn():
        time.sleep(0.1)
    return fn()


# Ranks that stay in touch (an allreduce every 50 ms) until argv[1] seconds have passed.
# Every rank runs the same number of beats: the loop goes on while every rank is within its time
# (an average of 1), so no rank leaves while another still calls one.
SLEEPER = ("import os, shoal, sys, time, numpy as np; shoal.init(); shoal.allreduce(np.ones(1), name='up')\n"
           "print('started', shoal.rank(), os.getpid(), flush=True); end = time.monotonic() + float(sys.argv[1])\n"
           "while shoal.allreduce(np.array([float(time.monotonic() < end)]), name='beat')[0] == 1.0: time.sleep(0.05)")


def _start(np_, seconds, token, tmp=None):
    """A job on 2 machines; `tmp`: its TMPDIR (where shoalrun's temporary folders go)."""
    cmd = shoalrun_cmd(np_, sys.executable, "-c", SLEEPER, str(seconds), token,
                       launch=("--machines", "2", "--link", "100mbit"))
    env = dict(os.environ, **({"TMPDIR": str(tmp)} if tmp else {}))
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)


def _wait_started(proc, np_):
    seen = 0
    lines = []
    for line in proc.stdout:
        lines.append(line)
        seen += line.startswith("started")
        if seen == np_:
            return lines
    raise AssertionError("the job ended before its ranks started:\n" + "".join(lines))


@needs_netns
def test_20_jobs_however_they_end_leave_nothing_behind(tmp_path):
    before = _cluster_state()
    ends = ["normal"] * 8 + ["ctrl-c"] * 4 + ["kill a rank"] * 4 + ["kill shoalrun"] * 4
    for i, how in enumerate(ends):
        token = f"shoal-test-{uuid.uuid4().hex}"
        proc = _start(2, 0 if how == "normal" else 60, token, tmp_path)
        try:
            if how != "normal":
                started = _wait_started(proc, 2)
            if how == "ctrl-c":
                os.kill(proc.pid, signal.SIGINT)
            elif how == "kill a rank":
                os.kill(int(started[-1].split()[2]), signal.SIGKILL)
            elif how == "kill shoalrun":
                os.kill(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if how == "normal":
            assert proc.returncode == 0, out
        elif how == "kill a rank":
            assert proc.returncode != 0 and "SIGKILL" in out, out
        # Killed shoalrun: its reaper removes the set-up once shoalrun is gone.
        assert _wait_until(lambda: _cluster_state() == before), (how, i, _cluster_state(), before)
        assert _wait_until(lambda: not _processes(token), 10), (how, i, _processes(token))
        # shoalrun's folders (the machine script, the output socket) go too, by the reaper if need be.
        assert _wait_until(lambda: not os.listdir(tmp_path), 10), (how, i, os.listdir(tmp_path))


@needs_netns
def test_jobs_that_exit_without_shutdown_end():
    """8 ranks on 4 machines that init() and exit (the runtime leaves at exit, telling every
    peer): each job ends. Over libfabric's tcp provider most of them hung in MPI_Isend."""
    for _ in range(4):
        out = subprocess.run(shoalrun_cmd(8, sys.executable, "-c", "import shoal; shoal.init(); print('up')",
                                          launch=("--machines", "4")), capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.count("up") == 8, out.stdout + out.stderr
        assert "WARN" not in out.stderr, out.stderr


@needs_netns
def test_two_jobs_at_once_do_not_collide():
    tokens = [f"shoal-test-{uuid.uuid4().hex}" for _ in range(2)]
    procs = [_start(4, 1, t) for t in tokens]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0 and out.count("started") == 4, out


@needs_netns
def test_a_crashed_shoalruns_set_up_is_removed_at_the_next_start():
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer runs
    stale = f"{cluster.PREFIX}{gone.pid}.1-m0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        proc = _start(2, 0, "shoal-test-stale")
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
        assert stale not in os.listdir(cluster.NETNS_DIR)
    finally:
        subprocess.run(["ip", "netns", "delete", stale], capture_output=True)


@needs_netns
def test_link_rate_and_report(tmp_path):
    """100 Mbit/s each way: a 12 MiB exchange between two machines runs at the set rate within
    15 % (tests/workers/cluster.py), and the report counts what each link carried."""
    report = tmp_path / "links.json"
    cmd = shoalrun_cmd(2, sys.executable, str(WORKERS / "cluster.py"), "--machines", "2", "--rate", "1e8",
                       launch=("--machines", "2", "--link", "100mbit", "--link-report", str(report)))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    checks = len(worker_checks("cluster.py"))
    assert out.stdout.count(f"{checks} checks passed, 0 failed") == 2, out.stdout
    record = json.loads(report.read_text())
    assert record["link_bits_per_s"] == 1e8 and record["machines"] == 2
    # Twice 12 MiB each way, 4 MiB one way (the accumulate check), start-up and headers.
    most = 1.1 * (28 << 20) + (2 << 20)
    for link in record["links"]:
        assert 24 << 20 <= link["sent_bytes"] <= most and 24 << 20 <= link["received_bytes"] <= most, record
    assert sum(link["sent_bytes"] for link in record["links"]) >= 52 << 20, record
    assert "links 100 Mbit/s each way" in out.stderr, out.stderr


SPIN = ("import os, time, shoal, numpy as np; shoal.init(); shoal.allreduce(np.ones(1), name='up');"
        "c, w = time.process_time(), time.perf_counter()\n"
        "while time.process_time() - c < 0.4: pass\n"
        "print('ratio', shoal.rank(), (time.perf_counter() - w) / (time.process_time() - c), flush=True)")


@needs_netns
def test_straggler_gets_its_cpu_fraction():
    """--straggler 0.25 on 2 machines of a 2-core host: the last machine's rank gets a quarter
    of its core (cgroup cpu quota), so its CPU-bound loop takes about 4x its CPU time in wall time."""
    cmd = shoalrun_cmd(2, sys.executable, "-c", SPIN, launch=("--machines", "2", "--straggler", "0.25"))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    ratio = {int(r): float(v) for r, v in re.findall(r"ratio (\d) ([\d.]+)", out.stdout)}
    # One rank on the machine, at most one core of fair share: a quota of a quarter core.
    assert ratio[1] >= 3.2, ratio
    assert "machine 1 a straggler at 0.25 of its CPU share" in out.stderr, out.stderr


@needs_netns
def test_failure_and_whole_lines_across_machines():
    """A rank on another machine that fails is named; a 100 KiB line from it arrives whole."""
    script = ("import shoal, sys, numpy as np; shoal.init(); r = shoal.rank();\n"
              "print(str(r) * 100000, flush=True)\n"
              "if r == 3: raise RuntimeError('rank 3 fails')\n"
              "shoal.allreduce(np.ones(2), name='never')")
    cmd = shoalrun_cmd(4, sys.executable, "-c", script, launch=("--machines", "2"))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "first failure: rank 3" in out.stderr and "rank 3 fails" in out.stderr, out.stderr
    lines = [line for line in out.stdout.splitlines() if len(line) >= 1000]
    assert sorted(lines) == [str(r) * 100000 for r in range(4)], [line[:20] for line in lines]


def test_cluster_flags_are_checked():
    for flags, message in [(["--link", "1gbit"], "--link needs --machines"),
                           (["--machines", "3"], "--machines 3: must be between 1 and -np (2)"),
                           (["--machines", "2", "--link", "fast"], "--link: link rate 'fast'"),
                           (["--machines", "2", "--straggler", "0"], "--straggler 0.0: a CPU fraction"),
                           (["--machines", "2", "-H", "a:1,b:1"], "excludes -H and --hostfile"),
                           (["--machines", "2", "--link-report", "/nonexistent/links.json"], "cannot write in")]:
        out = subprocess.run(shoalrun_cmd(2, "true", launch=flags), capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and message in out.stderr, (flags, out.stderr)


def test_rates_and_placement():
    assert cluster.parse_rate("1gbit") == 1e9 and cluster.parse_rate("200mbit") == 2e8
    assert cluster.parse_rate("12.5mbps") == 1e8 and cluster.parse_rate("500kbit") == 5e5
    for bad in ("1 gigabit", "-1gbit", "0mbit", "gbit", ""):
        with pytest.raises(ValueError):
            cluster.parse_rate(bad)
    assert cluster.placement(8, 4) == [2, 2, 2, 2] and cluster.placement(7, 3) == [3, 2, 2]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root to drop to nobody")
def test_without_privileges_a_clear_error_before_anything_starts(tmp_path):
    before = _cluster_state() if CAN_EMULATE else None
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    if subprocess.run([*nobody, sys.executable, "-c", "import shoal.launcher.run"], capture_output=True,
                      cwd="/", timeout=60).returncode != 0:
        pytest.skip("user nobody cannot read this environment (it lies in a folder only root may enter)")
    cmd = [*nobody, *shoalrun_cmd(2, "true", launch=("--machines", "2"))]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd="/")
    assert out.returncode == 1 and "--machines needs root" in out.stderr, out.stderr
    if before is not None:
        assert _cluster_state() == before
