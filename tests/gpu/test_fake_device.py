"""The GPU code path on CPUs, through the fake device plugin (SHOAL_CUDA_PLUGIN=fake;
docs/design.md §12): the GPU suite (tests/workers/ops_cuda.py, on CPU tensors marked as device
tensors with SHOAL_FAKE_DEVICE=1) with NCCL at 2, 4 and 8 ranks and the MPI backend at 4; the fake's
NCCL rules (tests/workers/fake_nccl.py); the CPU neighbor suite (tests/workers/neighbor.py)
on fake-device tensors with every GPU backend (tests/workers/neighbor_device.py); the fake's
streams, events and memory, called here.

Each check of a worker is its own test id; one shoalrun job per (worker, ranks, settings)
runs all of its checks, the first test that needs it starts it."""
import ctypes
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import Job, fake_device_env, worker_checks as _checks


def _outcome(np_, script, env, name, timeout):
    Job(np_, script, env=env, timeout=timeout).check(name)


# NCCL, with ordering rules of its own, at 2, 4 and 8 ranks; the MPI backend (host staging)
# at 4, as in NEIGHBOR_SETTINGS below (the suite's CPU half runs at 1-8 ranks in test_ops.py).
# From 4 ranks on 2-rank "machines"; each setting runs in one job with the neighbor suite's
# (tests/conftest.py BUNDLES).
GPU_SETTINGS = [(2, "nccl"), (4, "nccl"), (8, "nccl"), (4, "mpi")]


@pytest.mark.parametrize("check", _checks("ops_cuda.py"))
@pytest.mark.parametrize("ranks,backend", GPU_SETTINGS)
def test_gpu_suite_on_fake_devices(ranks, backend, check):
    pytest.importorskip("torch")
    _outcome(ranks, "ops_cuda.py", fake_device_env(ranks, backend), check, timeout=240)


# tests/workers/neighbor.py's checks on fake-device tensors (tests/workers/neighbor_device.py
# routes its numpy ops through shoal.torch), then that worker's own two: ranks submitting
# the same ops in different orders, and which backend carried the data. mpi-direct:
# SHOAL_GPU_BACKEND=mpi with the fake plugin claiming a CUDA-aware MPI. A job is mostly its
# ranks importing torch (2 cores, measured: about 6 s at 2 ranks, 10-17 s at 4, 20-36 s at
# 8), so NCCL, the backend with ordering rules of its own, runs at 2, 4 and 8 ranks and the
# MPI backends at 4, which has the 2-rank cases too (a peer that is both source and
# destination, pairs for pair_gossip). A hang costs the timeout, about 3x the slowest job.
NEIGHBOR_SETTINGS = [(2, "nccl"), (4, "nccl"), (8, "nccl"), (4, "mpi"), (4, "mpi-direct")]


@pytest.mark.parametrize("check", _checks("neighbor.py") + _checks("neighbor_device.py"))
@pytest.mark.parametrize("ranks,backend", NEIGHBOR_SETTINGS)
def test_neighbor_suite_on_fake_devices(ranks, backend, check):
    pytest.importorskip("torch")
    _outcome(ranks, "neighbor_device.py", fake_device_env(ranks, backend), check, timeout=120)


# Compressed gossip (tests/workers/compressed_gossip.py) on fake-device tensors: the
# compressors are torch operations on the tensor's device and the packed payloads travel
# by each GPU data path, counted in stats() as what they are.
@pytest.mark.parametrize("check", _checks("compressed_gossip.py"))
@pytest.mark.parametrize("backend", ["nccl", "mpi", "mpi-direct"])
def test_compressed_gossip_on_fake_devices(backend, check):
    pytest.importorskip("torch")
    _outcome(4, "compressed_gossip.py", fake_device_env(4, backend), check, timeout=120)


@pytest.mark.parametrize("check", _checks("fake_nccl.py"))
def test_fake_nccl_rules(check):
    # The cycle check waits for this timeout; the others fail or pass at once.
    env = {"SHOAL_CUDA_PLUGIN": "fake", "SHOAL_FAKE_NCCL_TIMEOUT": "4"}
    _outcome(3, "fake_nccl.py", env, check, timeout=120)


def _gpu_report(env):
    """--check-build's GPU lines (launcher/run.py gpu_report) under `env`, in a fresh process
    (the plugin is chosen at its first load); tests/test_gpu_build.py runs the whole report."""
    return subprocess.run([sys.executable, "-c", "from shoal.launcher.run import gpu_report; gpu_report()"],
                          capture_output=True, text=True, timeout=120, check=True, env={**os.environ, **env}).stdout


def test_check_build_names_the_fake_plugin():
    out = _gpu_report({"SHOAL_CUDA_PLUGIN": "fake"})
    assert "CUDA plugin: fake" in out and "libshoal_cuda_fake.so" in out, out
    assert "CUDA kernels: built (fake CPU devices" in out and "NCCL backend: built" in out, out
    assert "CUDA-aware MPI: no: the fake plugin says so" in out, out
    assert "GPU data paths (SHOAL_GPU_BACKEND=mpi): neighbor ops staged through pinned host memory" in out, out


@pytest.mark.parametrize("env, line", [
    ({"SHOAL_FAKE_CUDA_AWARE_MPI": "1"}, "GPU data paths (SHOAL_GPU_BACKEND=mpi): neighbor ops from device memory by "
                                         "CUDA-aware MPI"),
    ({"SHOAL_FAKE_CUDA_AWARE_MPI": "1", "SHOAL_CUDA_AWARE_MPI": "0"}, "not used (SHOAL_CUDA_AWARE_MPI=0)"),
    ({"SHOAL_GPU_BACKEND": "nccl"}, "GPU data paths (SHOAL_GPU_BACKEND=nccl): collectives and neighbor ops by NCCL"),
])
def test_check_build_reports_the_gpu_data_path(env, line):
    out = _gpu_report({"SHOAL_CUDA_PLUGIN": "fake", **env})
    assert line in out, out


# ---- The fake's streams, events and memory, in this process ----

DELAY_US = 200_000  # per stream item: a race below is decided by 0.2 s, not by luck


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setenv("SHOAL_CUDA_PLUGIN", "fake")
    from shoal import _gpu
    table, lib = _gpu.plugin(), _gpu.library()
    assert _gpu.is_fake(table.build), table.build
    prev = lib.shoal_fake_set_stream_delay_us(DELAY_US)
    yield table
    lib.shoal_fake_set_stream_delay_us(prev)


def ok(err):
    assert not err, err.decode()


def stream(t, device=0):
    s = ctypes.c_void_p()
    ok(t.stream_create(device, ctypes.byref(s)))
    return s.value


def event(t, device=0):
    e = ctypes.c_void_p()
    ok(t.event_create(device, ctypes.byref(e)))
    return e.value


def done(t, e):
    d = ctypes.c_int(-1)
    ok(t.event_query(e, ctypes.byref(d)))
    return d.value


def copy(t, dst, src, s):
    ok(t.memcpy_async(dst.ctypes.data, src.ctypes.data, src.nbytes, s))


def test_worker_stream_is_asynchronous(fake):
    s, e = stream(fake), event(fake)
    src, dst = np.arange(1000, dtype=np.float32), np.zeros(1000, np.float32)
    copy(fake, dst, src, s)
    ok(fake.event_record(e, s))
    assert not dst.any(), "a result read without the event wait must be stale"
    assert done(fake, e) == 0
    ok(fake.stream_sync(s))
    assert done(fake, e) == 1 and np.array_equal(dst, src)
    ok(fake.stream_destroy(s))


def test_stream_wait_event_orders_streams(fake):
    a, b, e = stream(fake), stream(fake), event(fake)
    x, junk = np.arange(64, dtype=np.int64), np.zeros(64, np.int64)
    y, z = np.zeros(64, np.int64), np.full(64, -1, np.int64)
    copy(fake, junk, x, a)  # stream a is busy for two items, b's copy comes after one
    copy(fake, y, x, a)
    ok(fake.event_record(e, a))
    ok(fake.stream_wait_event(b, e))
    copy(fake, z, y, b)
    ok(fake.stream_sync(b))
    assert np.array_equal(z, x), z
    # The same without the wait: b reads y before a wrote it.
    y2, z2 = np.zeros(64, np.int64), np.full(64, -1, np.int64)
    copy(fake, junk, x, a)
    copy(fake, y2, x, a)
    copy(fake, z2, y2, b)
    ok(fake.stream_sync(a))
    ok(fake.stream_sync(b))
    assert np.array_equal(y2, x) and not z2.any(), "a missing stream_wait_event must give a stale result"


def test_legacy_default_stream_is_the_host(fake):
    src, dst = np.arange(10, dtype=np.float64), np.zeros(10)
    copy(fake, dst, src, None)  # NULL: runs on the caller, at once
    assert np.array_equal(dst, src)
    s, e = stream(fake), event(fake)
    late = np.zeros(10)
    copy(fake, late, src, s)
    ok(fake.event_record(e, s))
    ok(fake.stream_wait_event(None, e))  # the host waits, as torch CPU work must
    assert np.array_equal(late, src) and done(fake, e) == 1


def test_events_follow_cuda_rules(fake):
    s0, s1 = stream(fake, 0), stream(fake, 1)
    e0, e1 = event(fake, 0), event(fake, 1)
    assert done(fake, e0) == 1, "an event never recorded is complete"
    err = fake.event_record(e1, s0)
    assert err and b"invalid resource handle" in err and b"device 1" in err, err
    ok(fake.event_record(e1, s1))
    ok(fake.stream_sync(s1))
    ok(fake.event_destroy(e0))
    assert b"invalid resource handle" in fake.event_query(e0, ctypes.byref(ctypes.c_int()))
    assert b"invalid resource handle" in fake.stream_sync(ctypes.c_void_p(12345))
    # Capture records on the given device and leaves the caller's current device alone.
    ok(fake.set_device(2))
    e = ctypes.c_void_p()
    ok(fake.capture(1, None, ctypes.byref(e)))
    assert fake.get_device() == 2 and done(fake, e.value) == 1


def test_memory_and_kernel_arguments(fake):
    n = fake.device_count(None)
    assert n >= 1 and b"invalid device ordinal" in fake.set_device(n)
    p = ctypes.c_void_p()
    ok(fake.device_alloc(0, 1000, ctypes.byref(p)))
    assert p.value % 256 == 0 and ctypes.string_at(p.value, 4) == b"\xa5" * 4, "fresh memory is a pattern, not zeros"
    assert b"cudaFreeHost" in fake.host_free(p.value)
    ok(fake.device_free(p.value))
    assert b"invalid device pointer" in fake.device_free(p.value)
    x = np.zeros(4, np.int32)
    ptrs = (ctypes.c_void_p * 1)(x.ctypes.data)
    err = fake.combine(x.ctypes.data, x.ctypes.data, ptrs, None, 1, 1, 1.0, 7, 4, None)
    assert err and b"floating dtypes only" in err, err
    many = (ctypes.c_void_p * 129)(*[x.ctypes.data] * 129)
    assert b"at most 128" in fake.combine(x.ctypes.data, x.ctypes.data, many, None, 129, 1, 1.0, 2, 1, None)
