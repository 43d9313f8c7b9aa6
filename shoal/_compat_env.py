"""BlueFog's and Horovod's environment variables, mapped onto Shoal's SHOAL_* settings.

A BlueFog script (or its job file) may set `BLUEFOG_TIMELINE`, `BLUEFOG_LOG_LEVEL`, ...;
the core reads only SHOAL_* variables, once, at `init()` (core/src/common/config.cc). `init()`
calls `apply_bluefog_env()` just before starting the core: each BLUEFOG_X that is set
gives its SHOAL_X, unless SHOAL_X is set too (the Shoal name wins). Values are read the
way BlueFog read them (it never rejected a malformed number or log level), so a job that
ran under BlueFog does not fail here. Table and reasons: docs/reference/bluefog-semantics.md
§4.11 and "Shoal's differences". Horovod's HOROVOD_* tuning variables map the same way
(a BLUEFOG_X wins over a HOROVOD_X). HOROVOD_TIMELINE names one file in Horovod (rank 0's
Chrome trace) but a per-rank prefix here (<prefix><rank>.json): `link_horovod_timeline`
puts rank 0's file at the name too; HOROVOD_TIMELINE=DYNAMIC (Horovod: on, no file until
`start_timeline`) sets no prefix.
"""
import math
import os
import re

# BlueFog's C++ used strtof/strtol: the longest numeric prefix, 0 when there is none.
_FLOAT_PREFIX = re.compile(r"\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
_INT_PREFIX = re.compile(r"\s*[+-]?\d+")
_LOG_LEVELS = {"trace": "trace", "debug": "debug", "info": "info", "warning": "warning",
               "error": "error", "fatal": "error"}  # Shoal has no "fatal": errors are its top level
_BY_MPI = ("BLUEFOG_ALLREDUCE_BY_MPI", "BLUEFOG_BROADCAST_BY_MPI", "BLUEFOG_ALLGATHER_BY_MPI",
           "BLUEFOG_NEIGHBOR_ALLGATHER_BY_MPI", "BLUEFOG_NEIGHBOR_ALLREDUCE_BY_MPI",
           "BLUEFOG_WIN_OPS_BY_MPI", "BLUEFOG_OPS_ON_CPU")
# Read by BlueFog, without a Shoal counterpart (reasons in bluefog-semantics.md).
IGNORED = ("BLUEFOG_LOG_HIDE_TIME", "BLUEFOG_MPI_THREAD_LEVEL", "BLUEFOG_WIN_ON_GPU",
           "BLUEFOG_MAX_WIN_SENT_LENGTH", "BLUEFOG_NUM_FINALIZER_THREADS",
           "BLUEFOG_SLEEP_USEC_FOR_WIN_PASSIVE")


def _strtod(text):
    m = _FLOAT_PREFIX.match(text)
    return float(m.group(0)) if m else 0.0


def _strtol(text):
    m = _INT_PREFIX.match(text)
    return int(m.group(0)) if m else 0


def _number(value):
    """A number the core accepts ([0, 1e9], written without exponent noise)."""
    v = min(max(value, 0.0), 1e9) if math.isfinite(value) else 0.0
    return repr(float(v)) if v != int(v) else str(int(v))


def _log_level(text):
    return _LOG_LEVELS.get(text.strip().lower(), "warning")  # BlueFog's fallback: warning


def _ranks_per_machine(text):
    k = _strtol(text)
    if k <= 0:  # BlueFog aborted the process (BFLOG(FATAL))
        raise ValueError(f"BLUEFOG_NODES_PER_MACHINE='{text}' must be a positive integer "
                         "(ranks per machine; Shoal's name is SHOAL_RANKS_PER_MACHINE)")
    return str(k)


HOROVOD_DYNAMIC_TIMELINE = "DYNAMIC"
_MAP = (
    ("BLUEFOG_TIMELINE", "SHOAL_TIMELINE", str),  # same files: <prefix><rank>.json
    ("BLUEFOG_LOG_LEVEL", "SHOAL_LOG_LEVEL", _log_level),
    ("BLUEFOG_CYCLE_TIME", "SHOAL_CYCLE_TIME", lambda v: _number(_strtod(v))),  # ms in both
    ("BLUEFOG_FUSION_THRESHOLD", "SHOAL_FUSION_THRESHOLD", lambda v: _number(_strtol(v))),  # bytes
    ("BLUEFOG_NODES_PER_MACHINE", "SHOAL_RANKS_PER_MACHINE", _ranks_per_machine),
    ("HOROVOD_TIMELINE", "SHOAL_TIMELINE", lambda v: None if v.strip() == HOROVOD_DYNAMIC_TIMELINE else v),
    ("HOROVOD_LOG_LEVEL", "SHOAL_LOG_LEVEL", _log_level),
    ("HOROVOD_CYCLE_TIME", "SHOAL_CYCLE_TIME", lambda v: _number(_strtod(v))),  # ms in both
    ("HOROVOD_FUSION_THRESHOLD", "SHOAL_FUSION_THRESHOLD", lambda v: _number(_strtol(v))),  # bytes
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "SHOAL_STALL_CHECK_TIME", lambda v: _number(_strtod(v))),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "SHOAL_STALL_SHUTDOWN_TIME", lambda v: _number(_strtod(v))),
    ("HOROVOD_GPU_OPERATIONS", "SHOAL_GPU_BACKEND", lambda v: "nccl" if v.strip().upper() == "NCCL" else "mpi"),
)


def bluefog_settings(environ):
    """{SHOAL_X: value} that the BLUEFOG_* variables of `environ` stand for, leaving out
    every SHOAL_X already set (non-empty) in `environ`. Pure: `environ` is not changed.
    Raises ValueError for a BLUEFOG_NODES_PER_MACHINE that is not a positive integer."""
    def given(key):
        return bool(environ.get(key))  # the core treats an empty variable as unset

    out = {}
    for other, shoal, convert in _MAP:  # BLUEFOG_* first: the first one given wins
        if given(other) and not given(shoal) and shoal not in out:
            value = convert(environ[other])
            if value is not None:
                out[shoal] = value
    # BlueFog's "=1 forces MPI for GPU tensors" (per op) / "stage through the host": Shoal's
    # `mpi` GPU backend stages every op of a CUDA tensor through host memory.
    if any(environ.get(k, "").startswith("1") for k in _BY_MPI) and not given("SHOAL_GPU_BACKEND"):
        out["SHOAL_GPU_BACKEND"] = "mpi"
    return out


def apply_bluefog_env(environ=None):
    """Set in `environ` (default os.environ) the SHOAL_* settings its BLUEFOG_* variables
    stand for (see `bluefog_settings`); returns what was set. Called by `init()` before
    the core reads its configuration."""
    environ = os.environ if environ is None else environ
    settings = bluefog_settings(environ)
    environ.update(settings)
    return settings


def link_horovod_timeline(rank, environ=None):
    """Where Horovod writes its timeline: when the per-rank prefix is Horovod's file name
    (HOROVOD_TIMELINE, or `start_timeline` before `init()`), rank 0 makes that name a
    symbolic link to its own file `<name>0.json` (a Chrome-trace JSON array, as Horovod's),
    replacing a file or link left there, as Horovod truncates it. Nothing is done when
    the name is a directory or rank 0's file could not be written (the core logged the
    error and records nothing; Horovod's runtime logs one and records nothing too).
    Returns the link's path, or None."""
    environ = os.environ if environ is None else environ
    path = environ.get("HOROVOD_TIMELINE", "")
    if rank != 0 or not path or path != environ.get("SHOAL_TIMELINE") or not os.path.basename(path):
        return None
    target = os.path.basename(path) + "0.json"  # in the same directory as the link
    if os.path.isdir(path) or not os.path.isfile(os.path.join(os.path.dirname(path), target)):
        return None
    tmp = f"{path}.{os.getpid()}.link"
    try:
        os.symlink(target, tmp)
        os.replace(tmp, path)
    except OSError:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        return None
    return path
