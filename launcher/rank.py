"""Per-rank wrapper used by shoalrun: runs the rank's command and, if it fails, records
which rank failed and how, so shoalrun can say which rank died first.

    python -m shoal.launcher.rank STATUS_DIR command...

The command runs as a child that dies with this wrapper (PR_SET_PDEATHSIG), so killing the
job never leaves a rank behind; file descriptors stay open for MPI's process manager.
Unless CUDA_VISIBLE_DEVICES is set (by the user) or SHOAL_GPU_BIND=0, the rank sees one GPU:
local_rank % device_count (several ranks share a GPU when they outnumber the GPUs).
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


def local_rank_from_env(env):
    for key in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK", "SLURM_LOCALID"):
        if env.get(key, "").isdigit():
            return int(env[key])
    return None


def gpu_count():
    """GPUs on this host, without loading CUDA: nvidia-smi (what this container sees),
    else the driver's /proc entries; 0 without a driver."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
        if out.returncode == 0:
            return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def bind_gpu(env, count=gpu_count):
    """Set CUDA_VISIBLE_DEVICES=local_rank % count in env unless the user chose devices."""
    if "CUDA_VISIBLE_DEVICES" in env or env.get("SHOAL_GPU_BIND") == "0":
        return None
    local = local_rank_from_env(env)
    n = count() if local is not None else 0
    if n > 0:
        env["CUDA_VISIBLE_DEVICES"] = str(local % n)
        return env["CUDA_VISIBLE_DEVICES"]
    return None


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
    env = dict(os.environ)
    bind_gpu(env)
    child = subprocess.Popen(cmd, close_fds=False, preexec_fn=_die_with_parent, env=env)
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
