"""Exact results of every op and dtype: numpy at 1, 2, 4 and 8 ranks with and without fusion,
torch (the same core ops through its binding) at 1, 2 and 4, and at 1 without a C++ compiler
for its tensor access; each check of tests/workers/ops_numpy.py and ops_torch.py is its own
item, one job per setting."""
import pytest

from conftest import Job, worker_checks

RANKS = [1, 2, 4, 8]
TORCH_RANKS = [1, 2, 4]  # a torch rank costs seconds of import on 2 cores; 8 ranks: numpy's
NUMPY_SETTINGS = [(ranks, fusion) for ranks in RANKS for fusion in ("fusion", "nofusion")]


def numpy_job(ranks, fusion):
    env = {"SHOAL_FUSION_THRESHOLD": "0"} if fusion == "nofusion" else {}
    if ranks >= 4:
        env["SHOAL_RANKS_PER_MACHINE"] = "2"  # exercise the multi-machine grouping
    return Job(ranks, "ops_numpy.py", env=env)


@pytest.mark.parametrize("check", worker_checks("ops_numpy.py"))
@pytest.mark.parametrize("ranks,fusion", NUMPY_SETTINGS)
def test_numpy_ops_exact(ranks, fusion, check):
    numpy_job(ranks, fusion).check(check)


@pytest.mark.parametrize("ranks,fusion", NUMPY_SETTINGS)
def test_numpy_ops_job(ranks, fusion):
    out = numpy_job(ranks, fusion).output()
    assert out.count("checks passed, 0 failed") == ranks, out


def torch_job(ranks):
    pytest.importorskip("torch")
    return Job(ranks, "ops_torch.py", timeout=300)


@pytest.mark.parametrize("check", worker_checks("ops_torch.py"))
@pytest.mark.parametrize("ranks", TORCH_RANKS)
def test_torch_ops_exact(ranks, check):
    torch_job(ranks).check(check)


@pytest.mark.parametrize("ranks", TORCH_RANKS)
def test_torch_ops_job(ranks):
    out = torch_job(ranks).output()
    assert out.count("checks passed, 0 failed") == ranks, out


def test_torch_ops_exact_without_a_compiler(tmp_path):
    """Where bindings/torch/torch_tensors.cc cannot be built (CXX=false, an empty cache), the
    torch entry points read tensors through torch's Python API: said once, every check
    still passes (one rank: the reading is per process)."""
    pytest.importorskip("torch")
    out = Job(1, "ops_torch.py", env={"CXX": "false", "SHOAL_CACHE_DIR": str(tmp_path)}, timeout=300).output()
    assert "checks passed, 0 failed" in out, out
    assert out.count("reading tensors through torch's Python API instead") == 1, out
    assert list(tmp_path.glob("torch-*/build-failed.txt")), "the failed build is remembered"
