"""Per-rank wrapper used by shoalrun: runs the rank's command and, if it fails, records
which rank failed and how, so shoalrun can say which rank died first.

    python -m shoal.launcher.rank STATUS_DIR command...

The command runs as a child that dies with this wrapper (PR_SET_PDEATHSIG), so killing the
job never leaves a rank behind; file descriptors stay open for MPI's process manager.
"""
import ctypes
import os
import signal
import subprocess
import sys
import time


def _die_with_parent():
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def rank_from_env():
    for key in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        if key in os.environ:
            return int(os.environ[key])
    return -1


def describe(status):
    if status < 0:
        sig = -status
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"killed by signal {sig} ({name})"
    return f"exited with status {status}"


def main(argv):
    status_dir, cmd = argv[0], argv[1:]
    child = subprocess.Popen(cmd, close_fds=False, preexec_fn=_die_with_parent)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    status = child.wait()
    if status != 0:
        path = os.path.join(status_dir, f"rank{rank_from_env()}.status")
        with open(path, "w") as f:
            f.write(f"{time.time():.6f} {rank_from_env()} {status} {describe(status)}\n")
    return 128 - status if status < 0 else status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
