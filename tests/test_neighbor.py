"""Neighbor ops equal W @ X (numpy) at 1-8 ranks, with and without fusion: each check of
tests/workers/neighbor.py is its own item, one job per (ranks, fusion)."""
import math

import numpy as np
import pytest

from conftest import Job, worker_checks

SETTINGS = [(ranks, fusion) for ranks in (1, 2, 4, 8) for fusion in ("fusion", "nofusion")]


def neighbor_job(ranks, fusion):
    env = {"SHOAL_FUSION_THRESHOLD": "0"} if fusion == "nofusion" else {}
    if ranks >= 4:
        env["SHOAL_RANKS_PER_MACHINE"] = "2"  # hierarchical ops across 2-rank "machines"
    return Job(ranks, "neighbor.py", env=env)


@pytest.mark.parametrize("check", worker_checks("neighbor.py"))
@pytest.mark.parametrize("ranks,fusion", SETTINGS)
def test_neighbor(ranks, fusion, check):
    neighbor_job(ranks, fusion).check(check)


@pytest.mark.parametrize("ranks,fusion", SETTINGS)
def test_neighbor_job(ranks, fusion):
    out = neighbor_job(ranks, fusion).output()
    assert out.count("checks passed, 0 failed") == ranks, out
    assert "'global_collectives': 0" in out and "'coordinator_rounds': 0" in out


def test_remembered_dynamic_weights_only_for_plain_values():
    # neighbor_args remembers dynamic results keyed by their arguments; only plain ints
    # and floats may be keys (a 0-d array changed in place must be read again), the kind
    # of dst_weights is part of the key, and remembered lists cannot be modified.
    from shoal import _ops
    w = np.array(0.75)
    assert _ops.neighbor_args(0.25, {1: w}, [1], False)["recv_weights"] == [0.75]
    w[...] = 0.125
    assert _ops.neighbor_args(0.25, {1: w}, [1], False)["recv_weights"] == [0.125]
    # Weights of 1/(n+1) everywhere: the uniform (sum then divide) form, as BlueFog's.
    a = _ops.neighbor_args(0.5, {1: 0.5}, [1], False)
    assert a["uniform"] and not a["recv_weights"] and list(a["recv_ranks"]) == [1], a
    assert _ops.neighbor_args(0.5, {1: 0.5}, {1: 2.0}, False)["send_weights"] == (2.0,)
    for bad in ([(1, 2.0)], {1, 2}):
        with pytest.raises(TypeError):
            _ops.neighbor_args(0.5, {1: 0.5}, bad, False)
    a = _ops.neighbor_args(0.25, {1: 0.75}, [2, 3], False)
    assert a is _ops.neighbor_args(0.25, {1: 0.75}, [2, 3], False)  # remembered
    assert a["send_ranks"] == (2, 3) and a["recv_ranks"] == (1,) and a["self_weight"] == 0.25
    assert _ops.neighbor_args(0.25, {1: 0.75}, [2, 3], False, remember=False) is not a
    # -0.0 == 0.0, but a negative zero weight is not the same argument.
    assert math.copysign(1.0, _ops.neighbor_args(0.0, {1: 1.0}, [1], False)["self_weight"]) == 1.0
    assert math.copysign(1.0, _ops.neighbor_args(-0.0, {1: 1.0}, [1], False)["self_weight"]) == -1.0
    assert math.copysign(1.0, _ops.neighbor_args(0.5, {1: -0.0}, [1], False)["recv_weights"][0]) == -1.0
    # A rank too large for the core's int32 is out of range like any other, not a TypeError.
    for src, dst in (({2**40: 0.5}, [1]), ({1: 0.5}, [2**63]), ({1: 0.5}, {-2**33: 1.0})):
        with pytest.raises(ValueError, match="outside"):
            _ops.neighbor_args(0.5, src, dst, False)


def test_numpy_neighbor_allreduce_is_documented_like_python():
    # The numpy binding's blocking neighbor_allreduce is a C function: it keeps the Python
    # signature and docstring, and the torch binding's stays a Python function.
    import inspect

    import shoal
    sig = inspect.signature(shoal.neighbor_allreduce)
    assert list(sig.parameters) == ["tensor", "self_weight", "src_weights", "dst_weights",
                                    "enable_topo_check", "name"]
    assert sig.parameters["enable_topo_check"].default is True
    assert "neighbor_allreduce_nonblocking" in shoal.neighbor_allreduce.__doc__
    assert shoal.neighbor_allreduce.__module__ == "shoal"
    assert repr(shoal.neighbor_allreduce) == "<built-in function neighbor_allreduce>"
