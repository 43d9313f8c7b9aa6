"""Machine-local ops (is_hierarchical_local=True) complete per machine, on 2 and on 4
simulated machines of 2 ranks each (SHOAL_RANKS_PER_MACHINE=2: 4 and 8 ranks): each check of
tests/workers/machine_local.py is its own item; a machine that waited for another would hang
its job, which the timeout fails."""
import pytest

from conftest import Job, worker_checks

MACHINES = [2, 4]


@pytest.mark.parametrize("check", worker_checks("machine_local.py"))
@pytest.mark.parametrize("machines", MACHINES)
def test_machine_local(machines, check):
    Job(2 * machines, "machine_local.py", env={"SHOAL_RANKS_PER_MACHINE": "2"}, timeout=300).check(check)
