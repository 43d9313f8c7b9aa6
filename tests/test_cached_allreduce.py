"""Cached allreduces (core/src/negotiation/response_cache.cc): each check of tests/workers/cached.py is
its own item, at 2 and 4 ranks (4: with fusion off, so every name is its own batch)."""
import pytest

from conftest import Job, worker_checks

SETTINGS = [(2, "fusion"), (4, "nofusion"), (4, "fusion")]


def job(ranks, fusion):
    env = {"SHOAL_FUSION_THRESHOLD": "0"} if fusion == "nofusion" else {}
    env["SHOAL_NAME_LIMIT"] = "512"  # fresh_names_are_retired_alike_on_every_rank: past it soon
    return Job(ranks, "cached.py", env=env, timeout=180)


@pytest.mark.parametrize("check", worker_checks("cached.py"))
@pytest.mark.parametrize("ranks,fusion", SETTINGS)
def test_cached_allreduce(ranks, fusion, check):
    job(ranks, fusion).check(check)
