"""shoal.tensorflow / shoal.keras at 4 ranks (a TF job at 2 ranks: test_horovod_keras.py), and
the Keras example."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import Job, shoalrun_cmd, worker_checks

pytest.importorskip("tensorflow")
pytest.importorskip("keras")
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "keras_digits.py"


@pytest.mark.parametrize("check", worker_checks("tf_ops.py"))
@pytest.mark.parametrize("ranks", [4])
def test_tf_ops_callbacks_and_mixed_frameworks(ranks, check):
    Job(ranks, "tf_ops.py", timeout=400).check(check)


@pytest.mark.parametrize("ranks", [4])
def test_tf_ops_job(ranks):
    out = Job(ranks, "tf_ops.py", timeout=400).output()
    assert out.count("checks passed, 0 failed") == ranks, out


def test_keras_digits_reaches_95_percent():
    out = subprocess.run(shoalrun_cmd(4, sys.executable, str(EXAMPLE)), capture_output=True, text=True,
                         timeout=400)
    assert out.returncode == 0, out.stdout + out.stderr
    acc = [float(a) for a in re.findall(r"test accuracy ([\d.]+)%", out.stdout)]
    xi = [float(a) for a in re.findall(r"consensus distance (\S+)", out.stdout)]
    assert len(acc) == 12 and acc[-1] >= 95.0, out.stdout
    assert len(xi) == 12 and all(x > 0 for x in xi)
