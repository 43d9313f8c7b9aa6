"""C++ unit tests of the negotiation state machine (N fake ranks as threads) and the
dtype math, built with CMake without MPI and run as one executable."""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_core_unit_tests(tmp_path):
    if not shutil.which("cmake"):
        pytest.skip("cmake not installed")
    build = tmp_path / "build"
    subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build), "-DSHOAL_BUILD_RUNTIME=OFF",
                    "-DSHOAL_BUILD_TESTS=ON"], check=True, capture_output=True, timeout=300)
    subprocess.run(["cmake", "--build", str(build), "-j", "2"], check=True, capture_output=True, timeout=600)
    out = subprocess.run([str(build / "test_core")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout
    assert ", 0 failed" in out.stdout
