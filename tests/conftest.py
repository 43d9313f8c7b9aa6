"""Helpers to run real multi-rank jobs under `shoalrun`, with a timeout so a hang fails, and
to make each check of a worker (tests/workers/checks.py) its own pytest item.

A worker's checks share one shoalrun job per (worker, ranks, arguments, settings): the first
item that needs the job runs it, the others read its cached output. `[rank R] PASS|SKIP|FAIL
<check>` lines (checks.run_all) decide each item: it fails when the check failed on any rank
(with that rank's traceback) or a rank reported nothing for it, it is skipped (with the
reason) when every rank skipped it, and every item of a job that hung, crashed or exited
non-zero without a failed check to explain it fails, with the reason."""
import fcntl
import functools
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest


def _can_emulate():
    """Whether this host can run the emulated cluster (launcher/cluster.py): root, its tools,
    and network, UTS and mount namespaces."""
    import shutil
    from shoal.launcher import cluster
    return os.geteuid() == 0 and all(shutil.which(t) for t in cluster.TOOLS) and subprocess.run(
        ["unshare", "--net", "--uts", "--mount", "true"], capture_output=True).returncode == 0


CAN_EMULATE = _can_emulate()
needs_netns = pytest.mark.skipif(not CAN_EMULATE, reason="needs root and iproute2/util-linux "
                                                          "(network namespaces) to emulate machines")

WORKERS = Path(__file__).parent / "workers"
# One BLAS / OpenMP thread per process: two test workers already share the cores with the
# ranks they start, and OpenBLAS's idle threads spin, which on oversubscribed cores costs
# far more than its parallelism gains. (shoalrun keeps a value that is already set.)
os.environ.setdefault("OMP_NUM_THREADS", "1")


@functools.lru_cache(maxsize=None)
def installed_mpi():
    """"openmpi" or "mpich": the MPI library of the installed Shoal, as its core reports it."""
    from shoal.launcher.run import core_flavor
    return core_flavor()[0]


def pytest_configure(config):
    config.addinivalue_line("markers", "mpich_only(reason): needs MPICH (skipped where Shoal is built "
                                       "with Open MPI)")
    config.addinivalue_line("markers", "versions: the subset CI runs on the other torch and TensorFlow "
                                       "versions it verifies (tests/conftest.py, VERSIONS)")
    # CI names the MPI it built against (SHOAL_TEST_MPI=openmpi|mpich), so a run that picked
    # up the other build fails here instead of silently testing it twice.
    wanted = os.environ.get("SHOAL_TEST_MPI")
    if wanted and wanted != installed_mpi():
        raise pytest.UsageError(f"SHOAL_TEST_MPI={wanted}, but the installed Shoal is built with "
                                f"{installed_mpi()} ({sys.executable})")


def pytest_runtest_setup(item):
    mark = item.get_closest_marker("mpich_only")
    if mark and installed_mpi() != "mpich":
        pytest.skip(f"MPICH only: {mark.args[0] if mark.args else 'MPICH-specific'}")


@pytest.fixture(autouse=True)
def _outside_source_tree(tmp_path, monkeypatch):
    """Run every test (and the processes it starts) outside the checkout, so `import
    shoal` finds the installed package, not the unbuilt sources."""
    monkeypatch.chdir(tmp_path)


def shoalrun_cmd(np_, *command, launch=()):
    """shoalrun's command line; `launch`: its own flags (e.g. --machines 4)."""
    return [sys.executable, "-m", "shoal.launcher.run", "-np", str(np_), *launch, *command]


def _run(np_, script, args, env, timeout, launch=()):
    """(exit status, or None when the job hung and was killed; output; seconds).

    The whole job runs in its own process group, killed on timeout, and also when pytest
    interrupts the wait (pytest-timeout, Ctrl-C): no job outlives its test."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    cmd = shoalrun_cmd(np_, sys.executable, str(WORKERS / script), *map(str, args), launch=launch)
    # A module-scoped fixture runs before _outside_source_tree: not in the checkout either.
    cwd = tempfile.gettempdir() if Path.cwd().is_relative_to(WORKERS.parent.parent) else None
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full_env, start_new_session=True, cwd=cwd)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out, time.monotonic() - start
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    secs = time.monotonic() - start
    if os.environ.get("SHOAL_TEST_JOB_LOG"):  # where the suite's time goes: one line per job
        with open(os.environ["SHOAL_TEST_JOB_LOG"], "a") as log:
            log.write(f"{secs:8.1f} {np_} {script} {' '.join(map(str, args))} {sorted((env or {}).items())}\n")
    return proc.returncode, out, secs


def run_ranks(np_, script, *args, env=None, timeout=120):
    """Run `python tests/workers/<script> args` on `np_` ranks; returns (rc, output, seconds).
    A hang is a test failure, not a stuck CI."""
    rc, out, secs = _run(np_, script, args, env, timeout)
    if rc is None:
        pytest.fail(f"{script} on {np_} ranks hung for {timeout} s; output:\n{out[-4000:]}")
    return rc, out, secs


def run_ok(np_, script, *args, env=None, timeout=120):
    rc, out, secs = run_ranks(np_, script, *args, env=env, timeout=timeout)
    assert rc == 0, f"{script} on {np_} ranks exited {rc}:\n{out[-6000:]}"
    return out


def worker_checks(script):
    """The names of the `@check` functions of tests/workers/<script>, in their order."""
    return re.findall(r"^@check\ndef (\w+)", (WORKERS / script).read_text(), re.M)


_REPORT = re.compile(r"\[rank (\d+)\] (PASS|SKIP|FAIL) (\w+)(.*)$", re.M)
_SUMMARY = re.compile(r"\[rank (\d+)\] \d+ checks passed, (\d+) failed", re.M)
_outputs = {}  # Job.key -> (exit status or None, output, why it did not end, or None)

_RPM2 = {"SHOAL_RANKS_PER_MACHINE": "2"}


def fake_device_env(ranks, backend):
    """Settings of the GPU suites on fake devices (tests/gpu/test_fake_device.py): the fake
    plugin, SHOAL_GPU_BACKEND `backend` ("mpi-direct": mpi with a CUDA-aware MPI), and from 4
    ranks on 2-rank "machines" (hierarchical ops across machines, as the CPU suite)."""
    env = {"SHOAL_CUDA_PLUGIN": "fake", "SHOAL_FAKE_DEVICE": "1", "SHOAL_GPU_BACKEND": backend.split("-")[0]}
    if backend == "mpi-direct":
        env["SHOAL_FAKE_CUDA_AWARE_MPI"] = "1"
    return {**env, **(_RPM2 if ranks >= 4 else {})}


# Workers that share a rank count and settings run as parts of one job (tests/workers/
# bundle.py): each rank imports torch (3 s of CPU, 2 more for torch.optim) and TensorFlow
# (9 s) once for all of them, on a fresh runtime for each part. (ranks, settings, timeout,
# parts: (worker, *arguments)); a Job of one of the parts runs the bundle.
BUNDLES = [
    (4, {}, 500, [("tf_ops.py",), ("psets.py", "tf"), ("psets.py", "torch"), ("psets.py", "numpy")]),
    (4, {}, 400, [("ops_torch.py",), ("windows.py",), ("optimizer_compat.py",)]),
    (4, _RPM2, 500, [("horovod_keras.py",), ("coll_tf.py",), ("a2a_grouped_tf.py",)]),  # first: it sets TF's threads
    (4, _RPM2, 500, [("optimizers.py",), ("coll_torch.py",), ("a2a_grouped_torch.py",), ("horovod_torch.py",),
                     ("horovod_grads.py",), ("coll_numpy.py",), ("a2a_grouped_numpy.py",)]),
    (2, {}, 500, [("ops_torch.py",), ("coll_torch.py",), ("a2a_grouped_torch.py",), ("windows.py",),
                  ("horovod_torch.py",), ("horovod_grads.py",), ("coll_numpy.py",), ("a2a_grouped_numpy.py",)]),
] + [(ranks, fake_device_env(ranks, backend), 400, [("ops_cuda.py",), ("neighbor_device.py",)])
     for ranks, backend in [(2, "nccl"), (4, "nccl"), (8, "nccl"), (4, "mpi")]]


def _key(np_, script, args, env, launch=()):
    return np_, script, tuple(map(str, args)), tuple(sorted(env.items())), tuple(launch)


_BUNDLE_OF = {_key(np_, script, args, env): bundle for bundle in BUNDLES
              for np_, env, _, parts in [bundle] for script, *args in parts}
_shared_dir = None  # where xdist workers share bundles' results


@pytest.fixture(scope="session", autouse=True)
def _bundle_results(tmp_path_factory):
    global _shared_dir
    base = tmp_path_factory.getbasetemp()  # an xdist worker's is <the run's root>/popen-gwN
    _shared_dir = (base.parent if base.name.startswith("popen-gw") else base) / "bundles"
    _shared_dir.mkdir(exist_ok=True)


def _judge(np_, rc, out, timeout):
    """Why a job (or a bundle's part) did not end well, or None."""
    if rc is None:
        return f"it hung: killed after {timeout} s"
    summaries = {int(r): int(f) for r, f in _SUMMARY.findall(out)}
    missing = sorted(set(range(np_)) - set(summaries))
    if missing:
        return f"ranks {missing} did not finish their checks (exit status {rc})"
    if rc != 0 and not any(summaries.values()):
        return f"it exited {rc} although no check failed"
    return None


_MARK = re.compile(r"\[rank (\d+)\] BUNDLE (BEGIN|END) (\d+)(?: (-?\d+))?$")
_RANK_LINE = re.compile(r"\[rank (\d+)\] ")


def _split(np_, rc, out, count):
    """Each part's (exit status, output) from a bundle's output: a rank's lines go to the
    part it is in, other lines to every part a rank is in then; a part that not every rank
    ended has the bundle's status."""
    now, texts, ends = {}, [[] for _ in range(count)], [{} for _ in range(count)]
    for line in out.splitlines(keepends=True):
        mark, who = _MARK.match(line.rstrip("\n")), _RANK_LINE.match(line)
        if mark:
            r, i = int(mark[1]), int(mark[3])
            if mark[2] == "BEGIN":
                now[r] = i
            else:
                now.pop(r, None)
                ends[i][r] = int(mark[4])
        elif who:
            if int(who[1]) in now:
                texts[now[int(who[1])]].append(line)
        else:
            for i in set(now.values()):
                texts[i].append(line)
    return [(next((s for s in e.values() if s), 0) if len(e) == np_ else rc, "".join(t))
            for e, t in zip(ends, texts)]


def _run_bundle(bundle):
    """Run `bundle` once per session, across xdist workers (the first that needs it runs it,
    the others wait for it), and file each part's result in _outputs."""
    np_, env, timeout, parts = bundle
    keys = [_key(np_, script, args, env) for script, *args in parts]
    path = _shared_dir / hashlib.sha1(repr(keys).encode()).hexdigest()[:16]
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not Path(f"{path}.json").exists():
            try:
                rc, out, _ = _run(np_, "bundle.py", [json.dumps(parts)], env, timeout)
                results = [(status, text, _judge(np_, status, text, timeout))
                           for status, text in _split(np_, rc, out, len(parts))]
            except BaseException as exc:  # interrupted: the parts' items fail at once
                results = [(None, "", f"its run was interrupted ({type(exc).__name__}: {exc})")] * len(parts)
                Path(f"{path}.json").write_text(json.dumps(results))
                raise
            Path(f"{path}.json").write_text(json.dumps(results))
        results = json.loads(Path(f"{path}.json").read_text())
    for key, result in zip(keys, results):
        _outputs[key] = tuple(result)


class Job:
    """One shoalrun job of a worker that runs its checks with checks.run_all; it runs once
    per session, when the first item that needs it asks (with the other parts of its
    bundle, if it is in one)."""

    def __init__(self, np_, script, *args, env=None, timeout=120, launch=()):
        self.np, self.script, self.args, self.env, self.timeout = np_, script, args, dict(env or {}), timeout
        self.launch = tuple(launch)
        self.key = _key(np_, script, args, self.env, self.launch)
        self.title = f"{script} {' '.join(map(str, args))}".rstrip() + f" on {np_} ranks" + \
            (f" (shoalrun {' '.join(self.launch)})" if self.launch else "")
        if self.key in _BUNDLE_OF:
            self.title += " (a part of one job with " + ", ".join(
                " ".join(part) for part in _BUNDLE_OF[self.key][3] if part != (script, *self.args)) + ")"

    def result(self):
        """(exit status, output, None) of the job, or (status, output, why) when it did
        not end well: hung, interrupted, or stopped before every rank reported."""
        if self.key not in _outputs and self.key in _BUNDLE_OF:
            _run_bundle(_BUNDLE_OF[self.key])
        if self.key not in _outputs:
            try:
                rc, out, _ = _run(self.np, self.script, self.args, self.env, self.timeout, self.launch)
            except BaseException as exc:  # interrupted: the job's other items fail at once
                _outputs[self.key] = None, "", f"its run was interrupted ({type(exc).__name__}: {exc})"
                raise
            _outputs[self.key] = rc, out, _judge(self.np, rc, out, self.timeout)
        return _outputs[self.key]

    def check(self, name):
        """Fail, skip or pass as check `name` did on every rank of the job."""
        rc, out, why = self.result()
        status, at = {}, {}
        for m in _REPORT.finditer(out):
            if m[3] == name:
                status[int(m[1])] = m[2], m[4].removeprefix(":").strip()
                at[int(m[1])] = m.start()
        tail = f"\n--- output (last 6000 characters):\n{out[-6000:]}"
        for r, (verdict, _) in sorted(status.items()):
            if verdict == "FAIL":
                end = out.find("\n[rank ", at[r] + 1)
                note = f"\n(and the job did not end well: {why})" if why else ""
                pytest.fail(f"{name} failed on rank {r} of {self.title}:\n{out[at[r]:end if end > 0 else None]}{note}",
                            pytrace=False)
        if why:
            seen = ", ".join(f"rank {r} {v}" for r, (v, _) in sorted(status.items())) or "no rank"
            pytest.fail(f"{self.title}: {why}; {name} reported by {seen}{tail}", pytrace=False)
        missing = sorted(set(range(self.np)) - set(status))
        if missing:
            pytest.fail(f"ranks {missing} of {self.title} reported nothing for {name}{tail}", pytrace=False)
        reasons = {why for verdict, why in status.values() if verdict == "SKIP"}
        if reasons:
            assert len(reasons) == 1 and all(v == "SKIP" for v, _ in status.values()), \
                f"{name} skipped on some ranks only, or for different reasons: {status}"
            pytest.skip(reasons.pop())

    def output(self):
        """The output of the job, which must have ended with exit status 0."""
        rc, out, why = self.result()
        if why:
            pytest.fail(f"{self.title}: {why}\n{out[-6000:]}", pytrace=False)
        failed = sorted({m[3] for m in _REPORT.finditer(out) if m[2] == "FAIL"})
        assert rc == 0, f"{self.title} exited {rc}" + (f"; failed checks (each an item of its own): {', '.join(failed)}"
                                                      if failed else f":\n{out[-6000:]}")
        return out


# Longest first (seconds of one worker, 2-core machine): each worker takes whole files in
# this order (`--dist loadfile --no-loadscope-reorder`), so the long files overlap each other
# and short ones fill the end, instead of one worker running a long file alone at the end.
# Files whose jobs share bundles go to one worker together (else one worker would wait for
# a bundle the other runs): the first two groups.
SAME_WORKER = [("test_torch_training.py", "test_collectives.py", "test_alltoall_grouped.py", "test_ops.py",
                "test_windows.py", "test_horovod_keras.py", "test_horovod_torch.py"),
               ("test_tensorflow.py", "test_process_sets.py")]
LONGEST_FIRST = [*SAME_WORKER[0], "test_core_cpp.py", *SAME_WORKER[1], "gpu/test_fake_device.py", "test_cluster.py",
                 "test_exits.py",
                 "test_digits_example.py", "test_join.py", "gpu/test_gpu_paths.py", "test_launcher.py",
                 "test_loop_orders.py"]


# The subset that CI runs again on the other versions it verifies (.ci/run: the oldest torch
# with the oldest TensorFlow, and the newest torch; README, "Versions"), selected by
# `pytest -m versions`: (file, test function, parameters its items must have; None: any). What
# differs between versions, in few jobs: the torch binding's BlueFog surface (one process, and
# one 4-rank job), the tensor access compiled against the installed torch and its Python
# fallback, the optimizers with Horovod's torch API, the gradients of the registered ops and
# torch.compile's tracing of them (one 4-rank job: tests/conftest.py's BUNDLES), the digits
# example; TensorFlow's ops and gradients with the Horovod Keras script (one 4-rank job) and
# the Keras example (Keras 3 optimizers).
VERSIONS = [
    ("test_bluefog_api.py", None, None),
    ("test_ops.py", "test_torch_ops_exact_without_a_compiler", None),
    ("test_torch_training.py", "test_optimizers_and_consensus", None),
    ("test_torch_training.py", "test_bluefog_optimizer_names_are_exported", None),
    ("test_torch_training.py", "test_delayed_mixing_is_awc_started_a_step_early", None),
    ("test_compression.py", "test_round_trip", None),
    ("test_compression.py", "test_numpy_arrays_compress_as_torch_tensors", None),
    ("test_horovod_torch.py", "test_horovod_script_check", {"ranks": 4}),
    ("test_horovod_torch.py", "test_horovod_script_job", {"ranks": 4}),
    ("test_horovod_torch.py", "test_horovod_gradients", {"ranks": 4}),
    ("test_horovod_torch.py", "test_horovod_gradients_job", {"ranks": 4}),
    ("test_collectives.py", "test_torch", {"ranks": 4}),
    ("test_alltoall_grouped.py", "test_torch", {"ranks": 4}),
    ("test_digits_example.py", "test_digits_trains", {"args": ["--optimizer", "awc"]}),
    ("test_horovod_keras.py", None, {"ranks": 4}),
    ("test_collectives.py", "test_tensorflow", None),
    ("test_alltoall_grouped.py", "test_tensorflow", None),
    ("test_tensorflow.py", "test_keras_digits_reaches_95_percent", None),
]


def _versions_entry(item, file):
    """The index in VERSIONS of the entry that selects `item` (of tests/`file`), or None."""
    params = item.callspec.params if hasattr(item, "callspec") else {}
    for i, (name, function, want) in enumerate(VERSIONS):
        if name == file and function in (None, item.originalname) and \
                all(params.get(k) == v for k, v in (want or {}).items()):
            return i
    return None


@pytest.hookimpl(tryfirst=True)  # before -m and -k deselect: every item of a file is here
def pytest_collection_modifyitems(config, items):
    """Files in LONGEST_FIRST order, then the rest in their own order (the sort is stable);
    the items that VERSIONS names are marked `versions`."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    here = Path(__file__).parent
    files = {item: item.path.relative_to(here).as_posix() for item in items}
    items.sort(key=lambda item: rank.get(files[item], len(rank)))
    used = set()
    for item in items:
        entry = _versions_entry(item, files[item])
        if entry is not None:
            item.add_marker(pytest.mark.versions)
            used.add(entry)
    # An entry that selects nothing (a test renamed) would shrink the subset unseen; checked
    # where whole files were collected (not for node ids given on the command line).
    if not any("::" in arg for arg in config.args):
        stale = [e for i, e in enumerate(VERSIONS) if i not in used and e[0] in files.values()]
        if stale:
            raise pytest.UsageError(f"tests/conftest.py: VERSIONS entries that select no item: {stale}")


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, with each group of SAME_WORKER's files as one unit of work."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling
    unit = {f"tests/{name}": "+".join(files) for files in SAME_WORKER for name in files}

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            path = nodeid.split("::", 1)[0]
            return unit.get(path, path)

    return Scheduling(config, log)
