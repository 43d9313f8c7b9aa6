"""shoalrun: start N ranks of a command through the MPI Shoal was built with.

    shoalrun -np 4 python train.py
    shoalrun -np 8 -H a:4,b:4 -x NCCL_DEBUG --log-level debug python train.py
    shoalrun --check-build

Flags map onto the MPI launcher (MPICH's Hydra or Open MPI's mpirun), environment
variables SHOAL_* are forwarded, OMP_NUM_THREADS is set to cores // ranks when ranks
outnumber cores and the user set none. If any rank fails, the launcher stops the
others and shoalrun exits non-zero.
"""
import argparse
import importlib.metadata
import os
import shutil
import subprocess
import sys


def _build_info():
    from shoal import _build_info
    return _build_info


def find_mpiexec():
    """Absolute path of the mpiexec matching Shoal's MPI library."""
    info = _build_info()
    if info.MPIEXEC:
        return info.MPIEXEC
    dist = importlib.metadata.distribution("mpich")
    names = {os.path.basename(str(f)): f for f in dist.files or []}
    for name in ("mpiexec.hydra", "mpiexec"):
        if name in names:
            return os.path.realpath(dist.locate_file(names[name]))
    found = shutil.which("mpiexec")
    if not found:
        sys.exit("shoalrun: cannot find mpiexec of the mpich wheel")
    return found


def mpi_flavor(mpiexec):
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    return "openmpi" if "Open MPI" in out or "OpenRTE" in out else "mpich"


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="shoalrun", description="Launch a Shoal job (decentralized training) with MPI.")
    p.add_argument("-np", "-n", dest="np", type=int, help="number of ranks")
    p.add_argument("-H", "--hosts", help="host:slots,host:slots,...")
    p.add_argument("--hostfile", help="file of 'host slots=N' or 'host:N' lines")
    p.add_argument("-x", dest="env", action="append", default=[],
                   help="forward VAR (or set VAR=value) to every rank; repeatable")
    p.add_argument("--log-level", choices=["trace", "debug", "info", "warning", "error"],
                   help="sets SHOAL_LOG_LEVEL")
    p.add_argument("--timeline-filename", help="sets SHOAL_TIMELINE (per-rank trace prefix)")
    p.add_argument("--check-build", action="store_true",
                   help="print the MPI, bindings and GPU support of this build, then exit")
    p.add_argument("--dry-run", action="store_true", help="print the mpiexec command and exit")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if not args.check_build:
        if not args.command:
            p.error("a command to run is required")
        if not args.np or args.np < 1:
            p.error("-np N (N >= 1) is required")
    return args


def worker_env(args, base=None):
    """Environment of the ranks: base plus SHOAL_* settings from flags, -x VAR=value."""
    env = dict(os.environ if base is None else base)
    if args.log_level:
        env["SHOAL_LOG_LEVEL"] = args.log_level
    if args.timeline_filename:
        env["SHOAL_TIMELINE"] = args.timeline_filename
    cores = os.cpu_count() or 1
    if "OMP_NUM_THREADS" not in env and args.np > cores:
        env["OMP_NUM_THREADS"] = str(max(1, cores // args.np))
    forwarded = []
    for item in args.env:
        key, sep, value = item.partition("=")
        if sep:
            env[key] = value
        forwarded.append(key)
    forwarded += [k for k in env if k.startswith("SHOAL_") or k == "OMP_NUM_THREADS"]
    return env, sorted(set(forwarded))


def build_command(args, mpiexec, flavor, env, forwarded):
    cmd = [mpiexec]
    if flavor == "openmpi":
        cmd += ["-np", str(args.np)]
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        cmd.append("--oversubscribe")
        if args.hosts:
            cmd += ["-H", args.hosts]
        if args.hostfile:
            cmd += ["--hostfile", args.hostfile]
        for k in forwarded:
            if k in env:
                cmd += ["-x", f"{k}={env[k]}"]
    else:  # MPICH Hydra
        cmd += ["-n", str(args.np)]
        if args.hosts:
            cmd += ["-hosts", args.hosts]
        if args.hostfile:
            cmd += ["-f", args.hostfile]
        for k in forwarded:
            if k in env:
                cmd += ["-genv", k, env[k]]
    return cmd + args.command


def check_build():
    from shoal._loader import MPI_LIBRARY, _core
    info = _build_info()
    version = _core.mpi_library_version().strip().splitlines()[0]
    source = "from PyPI (mpich wheel)" if info.MPI_FLAVOR == "mpich-pypi" else "system"
    print(f"Shoal {importlib.metadata.version('shoal')}")
    print(f"MPI: {version} [{source}]; library {MPI_LIBRARY or info.MPI_LIBRARIES}")
    print(f"mpiexec: {find_mpiexec()}")
    try:
        import torch
        import shoal.torch  # noqa: F401
        print(f"torch binding: usable (torch {torch.__version__})")
        cuda = torch.cuda.is_available()
    except ImportError as exc:
        print(f"torch binding: not usable ({exc})")
        cuda = False
    print("tensorflow binding: not built in this version")
    print(f"CUDA: {'available' if cuda else 'not available'}; NCCL backend: not built")
    return 0


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.check_build:
        return check_build()
    mpiexec = find_mpiexec()
    env, forwarded = worker_env(args)
    cmd = build_command(args, mpiexec, mpi_flavor(mpiexec), env, forwarded)
    if args.dry_run:
        print(" ".join(cmd))
        return 0
    proc = subprocess.Popen(cmd, env=env)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        try:
            return proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            return 130


if __name__ == "__main__":
    sys.exit(main())
