"""How a rank starts and ends, so that no exit path leaves its peers waiting.

* At exit (end of script, `sys.exit`) a rank first tells its peers that it leaves
  (`_core.leave()`): their ops that need it fail with a `ShoalError` naming it instead of
  waiting; only then does it free its windows (collective) and finalize MPI.
* An uncaught exception records which rank failed and why for `shoalrun`, then aborts
  the whole job (MPI_Abort), since peers may be blocked waiting for this rank.
* A child forked after `init()` (DataLoader workers, multiprocessing) must not
  communicate: the core refuses its calls; here its exit hooks do nothing.
* `init()` refuses to run as a singleton when a known launcher says the job is larger
  (a Shoal built against one MPI, started by another MPI's launcher).
"""
import os
import sys
import time

from ._loader import _core
from ._process import STATE


def launch_rank():
    """This process's rank as numbered at launch (fault-tolerant mode renumbers the
    survivors after a loss; shoalrun's records use the launch numbering)."""
    rank = _core.rank()
    return STATE.launch_ranks[rank] if STATE.launch_ranks and 0 <= rank < len(STATE.launch_ranks) else rank

# (rank variable, size variable) of launchers Shoal knows; srun's step size is its own.
LAUNCHER_VARIABLES = [("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                      ("PMIX_RANK", None), ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS")]


def launcher_mismatch(size, env=os.environ):
    """A message if launcher variables in `env` say this process belongs to a job of more
    than `size` processes (the size MPI reports), else None."""
    seen = []
    for rank_var, size_var in LAUNCHER_VARIABLES:
        rank_val, size_val = env.get(rank_var, ""), env.get(size_var, "") if size_var else ""
        big = (rank_val.isdigit() and int(rank_val) >= size) or (size_val.isdigit() and int(size_val) > size)
        if big:
            seen += [f"{rank_var}={rank_val}"] + ([f"{size_var}={size_val}"] if size_val else [])
    if not seen or size > 1:
        return None
    return (f"shoal.init(): the launcher says this process is part of a larger job ({', '.join(seen)}), "
            f"but MPI started it as a single process (rank 0 of {size}). The MPI library Shoal loaded "
            f"({' '.join(_core.mpi_library_version().split()[:3])}) is probably not the one whose "
            "launcher started the job: launch with `shoalrun` (or the mpiexec of Shoal's MPI), or "
            "rebuild Shoal against the launcher's MPI (`MPICXX=$(which mpicxx) pip install .`)")


RANK_PID = "SHOAL_RANK_PID"  # set by a rank of a multi-rank job, inherited by what it starts


def started_by_a_rank(env=os.environ):
    """A message if this process was started (fork + exec: os.system, subprocess) by a rank
    of a running job, else None. It inherited the launcher's variables and connection: MPI
    would join it to the parent's job, which hangs it and can stall the parent."""
    parent = env.get(RANK_PID)
    if not parent or parent == str(os.getpid()):
        return None
    return (f"shoal.init(): this process was started by a rank of a running job (pid {parent}) and "
            "inherited its launcher's connection; it cannot join that job. Start Shoal jobs with "
            f"shoalrun, or remove {RANK_PID} and the launcher's variables (PMI_*, OMPI_*) from its "
            "environment to run it as a job of its own")


def mark_rank(size):
    """Called once init() succeeded: processes this rank starts can tell (started_by_a_rank)."""
    if size > 1:
        os.environ[RANK_PID] = str(os.getpid())


def record_failure(description, status=1):
    """Tell `shoalrun` (through its status directory, when it started this rank) that this
    rank failed and how; the earliest record is the 'first failure' it reports."""
    directory = os.environ.get("SHOAL_STATUS_DIR")
    if not directory or not _core.is_initialized():
        return
    try:
        from shoal.launcher.rank import write_status
    except ImportError:
        return
    try:
        write_status(directory, launch_rank(), status, description)
    except OSError:
        pass


def fault_tolerant():
    """Whether this process runs in fault-tolerant mode (SHOAL_FAULT_TOLERANT=1, shoal._fault)."""
    return os.environ.get("SHOAL_FAULT_TOLERANT") == "1"


def record_mark(rank, kind, when=None):
    """Fault-tolerant mode: file `rank<R>.<kind>` (a time) in shoalrun's status directory,
    if it started this rank: `dropped` (the survivors went on without R, shoal._fault) or
    `finished`. Either way shoalrun does not count R's end as the job's failure; without the
    file (no directory, a write error) it does."""
    directory = os.environ.get("SHOAL_STATUS_DIR")
    if not directory:
        return
    try:
        with open(os.path.join(directory, f"rank{rank}.{kind}"), "w") as f:
            f.write(f"{time.time() if when is None else when:.6f}\n")
    except OSError:
        pass


def record_finish():
    """Fault-tolerant mode: this rank has finished (it shuts Shoal down). Its ranks end
    without MPI_Finalize, and after a loss Open MPI's runtime has been seen to kill a
    survivor that was already exiting: shoalrun does not count that as a failure."""
    if fault_tolerant() and _core.is_initialized():
        record_mark(launch_rank(), "finished")


def at_exit():
    """Registered with atexit by init(): leave, free windows (collective), finalize."""
    if _core.forked():
        return
    from . import _win
    record_finish()
    _core.leave()
    _win.free_all_at_exit()
    _core.finalize_mpi()


def install_excepthook():
    """An uncaught exception on one rank must end the job: its peers may be blocked
    waiting for it, and MPI_Finalize at exit would wait for them in turn. Print the
    traceback, record the failure for shoalrun, then abort the whole job (in
    fault-tolerant mode end this rank only: the survivors drop it)."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        previous(kind, value, tb)
        if _core.forked() or not _core.is_initialized() or _core.size() <= 1 or issubclass(kind, SystemExit):
            return
        first = (str(value).strip().splitlines() or [""])[0]
        record_failure(f"raised {kind.__name__}" + (f": {first[:300]}" if first else ""))
        # Fault-tolerant mode: this rank alone ends; the survivors drop it (shoal._fault).
        alone = fault_tolerant()
        sys.stderr.write(f"[shoal] rank {launch_rank()}: uncaught {kind.__name__}; "
                         f"{'this rank ends' if alone else 'aborting the job'}\n")
        sys.stderr.flush()
        sys.stdout.flush()
        if alone:
            os._exit(1)
        time.sleep(0.5)  # let the launcher forward the traceback before the job ends
        _core.abort(1)

    sys.excepthook = hook
