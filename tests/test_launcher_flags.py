"""shoalrun accepts horovodrun's and bfrun's flags (issue 17): each maps onto a Shoal
setting or the MPI launcher, checked in the command it would run (--dry-run) and, for
--output-filename, in a real 2-rank job."""
import os
import shlex
import subprocess
import sys

import pytest

from conftest import run_ranks


def dry_run(*flags):
    out = subprocess.run([sys.executable, "-m", "shoal.launcher.run", "-np", "2", *flags, "--dry-run", "python", "x.py"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return shlex.split(out)


def value_after(words, key):
    return words[words.index(key) + 1]


def passed(words):
    """The variables the command passes to the ranks: hydra's `-genv K V`, Open MPI's `-x K=V`."""
    env = {}
    for i, w in enumerate(words):
        if w == "-genv":
            env[words[i + 1]] = words[i + 2]
        elif w == "-x" and "=" in words[i + 1]:
            k, v = words[i + 1].split("=", 1)
            env[k] = v
    return env


def open_mpi():
    """Whether shoalrun launches with Open MPI's mpirun (Shoal built against a system Open MPI)."""
    from shoal.launcher import run
    return run.mpi_flavor(run.find_mpiexec()) == "openmpi"


def test_horovodrun_tuning_flags_set_shoal_settings():
    env = passed(dry_run("--fusion-threshold-mb", "2", "--cycle-time-ms", "0.5", "--stall-check-warning-time-seconds",
                         "30", "--stall-check-shutdown-time-seconds", "90"))
    assert env["SHOAL_FUSION_THRESHOLD"] == str(2 << 20)
    assert env["SHOAL_CYCLE_TIME"] == "0.5"
    assert float(env["SHOAL_STALL_CHECK_TIME"]) == 30
    assert float(env["SHOAL_STALL_SHUTDOWN_TIME"]) == 90


@pytest.mark.parametrize("flag", ["--mpi-args", "--extra-mpi-flags"])
def test_extra_mpi_arguments_reach_the_launcher(flag):
    words = dry_run(flag, "-genv FOO bar -l")
    at = words.index("-genv")
    assert words[at + 1:at + 4] == ["FOO", "bar", "-l"] and words.index("python") > at


def test_network_interface_and_ssh_port():
    words = dry_run("--network-interface", "eth7", "-p", "2222")
    assert passed(words)["NCCL_SOCKET_IFNAME"] == "eth7"
    if open_mpi():
        assert value_after(words, "btl_tcp_if_include") == "eth7" and value_after(words, "oob_tcp_if_include") == "eth7"
        assert value_after(words, "plm_ssh_args") == "-p 2222"
    else:
        assert value_after(words, "-iface") == "eth7"
        wrapper = value_after(words, "-launcher-exec")
        assert wrapper.endswith("/ssh")  # a script that runs ssh -p 2222 (removed with the job's temp dir)


def test_bfrun_hostfile_spelling(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    assert value_after(dry_run("-hostfile", str(hosts)), "--hostfile" if open_mpi() else "-f") == str(hosts)


def test_output_filename_writes_each_rank_s_streams(tmp_path):
    out_dir = tmp_path / "logs"
    assert passed(dry_run("--output-filename", str(out_dir)))["SHOAL_OUTPUT_DIR"] == str(out_dir)
    rc, out, _ = run_ranks(2, "hello.py", env={"SHOAL_OUTPUT_DIR": str(out_dir)}, timeout=120)
    assert rc == 0, out
    for r in range(2):  # in the files, and on the terminal as before
        assert (out_dir / f"rank.{r}" / "stdout").read_text() == f"rank {r} ok\n"
        assert (out_dir / f"rank.{r}" / "stderr").read_text() == f"rank {r} err\n"
        assert f"rank {r} ok" in out


def test_ranks_get_the_launching_path_a_forwarded_path_included():
    # rank.py puts it first on the ranks' PATH (Open MPI's mpirun may prepend its own bin/)
    assert passed(dry_run())["SHOAL_LAUNCH_PATH"] == os.environ["PATH"]
    assert passed(dry_run("-x", "PATH=/custom/bin:/usr/bin"))["SHOAL_LAUNCH_PATH"] == "/custom/bin:/usr/bin"


def test_elastic_flags_run_a_fixed_set_of_ranks_or_say_why_not(tmp_path):
    out = subprocess.run([sys.executable, "-m", "shoal.launcher.run", "-np", "2", "--min-np", "1", "--max-np", "4",
                          sys.executable, "-c", "print('ran')"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.count("ran") == 2, out.stdout + out.stderr
    assert "a fixed set of 2 ranks" in out.stderr, out.stderr
    for flags, why in ((["--min-np", "3"], "outside [--min-np, --max-np]"),
                       (["--host-discovery-script", "d.sh"], "elastic jobs are not supported")):
        out = subprocess.run([sys.executable, "-m", "shoal.launcher.run", "-np", "2", *flags, "python", "x.py"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and why in out.stderr, out.stderr


@pytest.mark.parametrize("version", ["mpirun (Open MPI) 5.0.11", "HYDRA build details:\n    Version: 5.0.2"])
def test_a_launcher_of_another_mpi_is_a_clear_error(tmp_path, version):
    from shoal.launcher import run
    fake = tmp_path / "mpiexec"
    fake.write_text(f"#!/bin/sh\necho '{version}'\n")
    fake.chmod(0o755)
    built, library = run.core_flavor()
    if (run.mpi_flavor(str(fake)) == built):
        assert run.mpi_check(str(fake)) == built
        return
    with pytest.raises(SystemExit) as exc:
        run.mpi_check(str(fake))
    assert f"Shoal was built with {library}, but {fake} is " in str(exc.value), exc.value
    assert "cannot start it" in str(exc.value)


def test_emulated_machines_under_open_mpi_start_daemons_through_the_machine_script(tmp_path):
    """Open MPI on the emulated cluster (tests/test_cluster.py runs it): mpirun on machine 0,
    its daemons started on the others by the cluster's script, MPI and PRRTE on eth0."""
    from shoal.launcher import cluster, run
    args = run.parse_args(["-np", "4", "--machines", "2", "python", "x.py"])
    args.emulated = cluster.Cluster(cluster.placement(4, 2), None, None, workdir=str(tmp_path))
    words = run.build_command(args, "mpirun", "openmpi", {}, [])
    assert words[:2] == [args.emulated.script, args.emulated.address(0)], words
    inner = shlex.split(words[2])
    assert inner[inner.index("plm_ssh_agent") + 1] == args.emulated.script
    assert inner[inner.index("-H") + 1] == args.emulated.hosts() == f"{args.emulated.address(0)}:2,{args.emulated.address(1)}:2"
    assert inner[inner.index("oob_tcp_if_include") + 1] == inner[inner.index("btl_tcp_if_include") + 1] == "eth0"


def test_open_mpi_transports_are_chosen_on_one_host_only(tmp_path):
    from shoal.launcher import run
    command = ["python", "x.py"]
    for hosts, one_host in ((None, True), ("localhost:2", True), ("node7:1,node8:1", False)):
        args = run.parse_args(["-np", "2", *(["-H", hosts] if hosts else []), *command])
        args.machines = None
        words = run.build_command(args, "mpirun", "openmpi", {}, [])
        assert words[:3] == ["mpirun", "-np", "2"] and words[-2:] == command
        assert all(w in words for w in run.OPENMPI_DEFAULTS)  # --oversubscribe, --bind-to none
        assert ("ob1" in words and "sm,tcp,self" in words) == one_host, (hosts, words)
