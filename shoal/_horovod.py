"""Horovod's framework-neutral names (Horovod 0.28 `horovod/common/basics.py`,
`process_sets.py`, `compression.py`'s interface), shared by `shoal.torch` and
`shoal.tensorflow`/`shoal.keras` (their `_horovod.py` add the tensor casts and op wrappers).

Process sets are `shoal.process_sets`' (re-exported here). Differences from Horovod kept
here: `Adasum` is not implemented (NotImplementedError naming it); the timeline is per
rank and configured at `init()` (rank 0's file is also linked where Horovod writes it).
"""
import os
import warnings

from . import basics
from ._compat_env import HOROVOD_DYNAMIC_TIMELINE
from ._loader import _core
from ._ops import ReduceOp
from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set  # noqa: F401

HorovodInternalError = basics.ShoalError
"""Horovod's runtime-failure exception: Shoal's `ShoalError` itself (a RuntimeError), so
`except hvd.HorovodInternalError` catches every failure the runtime reports (mismatch,
stall, dead peer, shutdown)."""

Adasum = ReduceOp("Adasum", None)  # Horovod's op=hvd.Adasum: not implemented (see check_op)


def check_op(op, what):
    """NotImplementedError for Horovod's Adasum (the other ops go to `shoal._ops.reduce_op`)."""
    if op is Adasum:
        raise NotImplementedError(
            f"{what}: op=Adasum is not implemented in Shoal (Horovod's Adasum reduction); use "
            "op=Average or op=Sum, or a decentralized optimizer (DistributedAdaptWithCombineOptimizer)")


def check_process_set(process_set, what):
    """NotImplementedError for a process set other than the global one (or None), for the
    few functions that run only over every rank (they say so where they are defined)."""
    if process_set is None or process_set is global_process_set:
        return
    raise NotImplementedError(f"{what}: process_set={process_set!r}: only the global process set is supported here")


def factor(value, what):
    """A scaling factor as a float: any real number (numpy scalars, a one-element tensor:
    what Horovod's C++ binding converts to double); TypeError for bool and non-numbers."""
    if isinstance(value, (bool, str, bytes)) or not hasattr(value, "__float__"):
        raise TypeError(f"{what} must be a number, got {type(value).__name__}")
    return float(value)


def scaling(prescale_factor, postscale_factor, integers):
    """Horovod's scaling of an allreduce or reducescatter for the core (`_core.enqueue`'s
    `scaling`; shoal_op_desc.horovod_scaling): (prescale, postscale) as floats, or None when
    there is nothing to do. The core multiplies each rank's input by the prescale and the
    result by the postscale (after Average's division), integers truncated toward zero as
    Horovod's ScaleBuffer. With `integers` (the op has integer tensors) it is always asked
    for: it allows Horovod's truncated integer average (which Shoal's own names refuse), and
    every rank takes the same data path whatever its factors. TypeError for a factor that is
    not a number."""
    pre, post = factor(prescale_factor, "prescale_factor"), factor(postscale_factor, "postscale_factor")
    return (pre, post) if integers or pre != 1.0 or post != 1.0 else None


# ---- Compression: Horovod's compress(tensor) -> (tensor, ctx) / decompress(tensor, ctx) ----

class Compressor:
    """Horovod's compressor interface: `compress(tensor) -> (tensor, ctx)` before the
    exchange, `decompress(tensor, ctx) -> tensor` after it."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class NoneCompressor(Compressor):
    """No compression: the tensor itself travels (Horovod's Compression.none)."""


def check_compression(compression, what):
    if hasattr(compression, "payload_bytes") and not hasattr(compression, "compress"):
        raise ValueError(f"{what}: {compression!r} is a gossip compressor (int8, int4, topk, randomk): an "
                         "allreduce cannot sum its payloads (differently scaled or sparse); use it with the "
                         "decentralized optimizers' compression=, or Compression.fp16/bf16 here")
    if not (callable(getattr(compression, "compress", None)) and callable(getattr(compression, "decompress", None))):
        raise TypeError(f"{what}: compression must be hvd.Compression.none/fp16/bf16 or an object with "
                        f"compress(tensor) and decompress(tensor, ctx), got {compression!r}")
    return compression


# ---- Job layout, build facts, timeline ----

def cross_rank():
    """Horovod's cross_rank: the index of this rank's machine (`machine_rank()`). Equal to
    Horovod's on a homogeneous job; on a heterogeneous one Horovod counts only the
    machines that have this local rank."""
    return basics.machine_rank()


def cross_size():
    """Horovod's cross_size: the number of machines (`machine_size()`; see cross_rank)."""
    return basics.machine_size()


def mpi_built():
    """True: Shoal always runs on MPI (its one engine)."""
    return True


def mpi_enabled():
    """True: MPI is the engine of every Shoal job (Horovod: MPI controller in use)."""
    return True


def gloo_built():
    """False: Shoal has no Gloo engine."""
    return False


def gloo_enabled():
    return False


def cuda_built():
    """True when this build's CUDA plugin loads (Shoal finds GPU support at run time;
    the fake test plugin does not count)."""
    built, what = _core.gpu_support()
    return bool(built) and not what.startswith("fake ")


def rocm_built():
    return False


def ddl_built():
    return False


def ccl_built():
    return False


def _timeline_on():
    on = basics.timeline_start_activity("horovod", "START_TIMELINE")
    if on:
        basics.timeline_end_activity("horovod")
    return on


def start_timeline(file_path, mark_cycles=False):
    """Horovod's start_timeline over Shoal's per-rank timeline (`SHOAL_TIMELINE`).

    Shoal's timeline is configured when the runtime starts. Before `init()` this sets
    HOROVOD_TIMELINE=file_path (Horovod raises ValueError there), so init() records to
    `<file_path><rank>.json` (one file per rank) and rank 0 links `file_path` to its file
    (`shoal._compat_env.link_horovod_timeline`; Horovod writes that one file from rank 0).
    After init(), a timeline that is recording goes on (into the files named at init: Shoal
    cannot switch files) and this marks the call on it. One that is off cannot be started:
    with HOROVOD_TIMELINE=DYNAMIC (Horovod's "start it later") a RuntimeWarning says that
    nothing is recorded and the script goes on; otherwise ValueError, as Horovod raises
    when no timeline was set up at init, saying how to turn it on. Shoal's timeline has no
    cycle markers: mark_cycles=True warns. Raises ValueError for an empty or non-str path.
    """
    if not isinstance(file_path, str) or not file_path:
        raise ValueError("start_timeline: file_path must be a non-empty str")
    if mark_cycles:
        warnings.warn("start_timeline: Shoal's timeline has no cycle markers; mark_cycles is ignored",
                      RuntimeWarning, stacklevel=2)
    if not basics.is_initialized():
        os.environ["HOROVOD_TIMELINE"] = os.environ["SHOAL_TIMELINE"] = file_path
        return
    if _timeline_on():
        return
    how = ("set HOROVOD_TIMELINE=<file> (or SHOAL_TIMELINE=<prefix>, or shoalrun --timeline-filename <prefix>) "
           "before init(), or call start_timeline before init(); each rank writes <prefix><rank>.json")
    if os.environ.get("HOROVOD_TIMELINE", "").strip() == HOROVOD_DYNAMIC_TIMELINE:
        warnings.warn(f"start_timeline({file_path!r}): Shoal's timeline cannot be started after init(), so "
                      f"nothing is recorded (HOROVOD_TIMELINE=DYNAMIC); {how}", RuntimeWarning, stacklevel=2)
        return
    raise ValueError(f"start_timeline: no timeline was set up at init(), and Shoal's cannot be started "
                     f"after it; {how}")


def stop_timeline():
    """Horovod's stop_timeline. Shoal's timeline records until `shutdown()` (its files stay
    valid JSON meanwhile): with the timeline on this warns and records on; off, nothing
    to do."""
    if basics.is_initialized() and _timeline_on():
        warnings.warn("stop_timeline: Shoal's timeline records until shutdown(); it cannot be stopped "
                      "earlier", RuntimeWarning, stacklevel=2)


__all__ = ["HorovodInternalError", "Adasum", "ProcessSet", "global_process_set", "add_process_set",
           "remove_process_set", "Compressor", "NoneCompressor", "cross_rank", "cross_size", "mpi_built",
           "mpi_enabled", "gloo_built", "gloo_enabled", "cuda_built", "rocm_built", "ddl_built", "ccl_built",
           "start_timeline", "stop_timeline"]
