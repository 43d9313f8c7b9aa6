"""C++ unit tests, built with CMake without MPI under ThreadSanitizer (one build, module
scope): test_core (the negotiation state machine with N fake ranks as threads, the wire
format, the dtype math) and test_runtime (the Runtime itself over the fake backend,
core/testing/fake_backend.h: neighbor exchange in random orders with and without fusion,
mismatches, stalls, a dead peer, dynamic weights, at 2, 4 and 8 ranks) and test_join
(Horovod's join in the Runtime: uneven steps, zeros in fused and cached allreduces, the
last rank returned, the ops that fail while ranks are joined, a rank that leaves, the
identities joined ranks contribute), test_stages (hierarchical_neighbor_allreduce as one
op of the core over machines of fake ranks: exact values in any submission order, a
refusal on one rank, a dead rank), test_collectives (alltoall with splits and grouped
ops in the Runtime: exact values, mismatches, a group that fails as a whole) and
test_process_sets (process sets: disjoint sets whose ops never wait for each other,
negotiation at each set's leader, cached batches per set, mismatched membership, a member
that leaves or dies), test_names (bounded per-name state: fresh names retired on every
rank alike, exact results, held calls of names being retired in any submission order),
test_machine_local (machine-local ops negotiated per machine: machines with names and
rounds of their own completing while the others wait, exact values, mismatches, refusals
and stalls within one machine, a dead rank) and test_cached_broadcast (broadcasts that skip
the coordinator: exact in any order, roots that change, a root's and a non-root's changed
call, refusals, a stall, a join and a rank that leaves) and test_window_queue (the window
thread's queue with puts in flight after their job: quick ops beside them, others after,
their errors, a shutdown, a loss, the bound on how many travel)."""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    if not shutil.which("cmake"):
        pytest.skip("cmake not installed")
    build = tmp_path_factory.mktemp("unit") / "build"
    subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build), "-DSHOAL_BUILD_RUNTIME=OFF",
                    "-DSHOAL_BUILD_TESTS=ON", "-DSHOAL_SANITIZE=thread",
                    "-DCMAKE_UNITY_BUILD=ON"], check=True, capture_output=True, timeout=300)
    subprocess.run(["cmake", "--build", str(build), "-j", "2", "--target", "test_core", "test_runtime", "test_join",
                    "test_stages", "test_collectives", "test_process_sets", "test_names", "test_cached_broadcast",
                    "test_machine_local", "test_fault_tolerance", "test_window_queue"],
                   check=True, capture_output=True, timeout=1200)
    return build


# The first one also builds (every sanitized binary: minutes on 2 busy cores; a unity build
# compiles each library as one file: 28% less CPU than file by file).
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("binary", ["test_core", "test_runtime", "test_join", "test_stages", "test_collectives",
                                    "test_process_sets", "test_names", "test_cached_broadcast",
                                    "test_machine_local", "test_fault_tolerance", "test_window_queue"])
def test_unit_tests_under_thread_sanitizer(build, binary):
    out = subprocess.run([str(build / binary)], capture_output=True, text=True, timeout=600,
                         env={"TSAN_OPTIONS": "halt_on_error=1 exitcode=66"})
    report = out.stdout + out.stderr
    assert "ThreadSanitizer" not in report, report[-8000:]
    assert out.returncode == 0, report[-8000:]
    assert ", 0 failed" in out.stdout, out.stdout[-4000:]
