"""Horovod's names for TensorFlow and Keras (`horovod/tensorflow/mpi_ops.py`,
`compression.py`, `horovod/common/basics.py`, Horovod 0.28), so that
`import shoal.tensorflow as hvd` and `import shoal.keras as hvd` run Horovod scripts
(issue 17). Only names, argument checks and tensor casts live here: every op these
names reach is one of `shoal.tensorflow.ops`' kernels over the one runtime.

Differences from Horovod kept here (each said where it applies):
* Only the global process set exists: another `process_set=` raises NotImplementedError.
* `Adasum` is not implemented (NotImplementedError naming it).
"""
import tensorflow as tf

from shoal import basics
from shoal._loader import _core
from shoal._ops import ReduceOp

HorovodInternalError = basics.ShoalError
"""Horovod's runtime-failure exception: Shoal's `ShoalError` (a RuntimeError)."""

Adasum = ReduceOp("Adasum", None)  # Horovod's op=hvd.Adasum: not implemented (see check_op)


def check_op(op, what):
    """NotImplementedError for Horovod's Adasum (the other ops go to `_ops.reduce_op`)."""
    if op is Adasum:
        raise NotImplementedError(
            f"{what}: op=Adasum is not implemented in Shoal (Horovod's Adasum reduction); use "
            "op=Average or op=Sum")


class ProcessSet:
    """Horovod's process set object; Shoal has only the global one yet
    (`global_process_set`: every rank)."""

    process_set_id = 0

    @property
    def ranks(self):
        return list(range(basics.size()))

    def size(self):
        return basics.size()

    def rank(self):
        return basics.rank()

    def included(self):
        return True

    def __repr__(self):
        return "ProcessSet(process_set_id=0, ranks=<all>)"


global_process_set = ProcessSet()


def check_process_set(process_set, what):
    """Accept Horovod's global process set (or None); NotImplementedError for any other."""
    if process_set is None or process_set is global_process_set:
        return
    raise NotImplementedError(
        f"{what}: process_set={process_set!r}: Shoal supports only the global process set "
        "(hvd.global_process_set) so far; sub-communicators (add_process_set) are not available yet")


def add_process_set(process_set):
    """Horovod's add_process_set: not available yet (NotImplementedError)."""
    check_process_set(process_set, "add_process_set")
    return global_process_set


def remove_process_set(process_set):
    """Horovod's remove_process_set: the global process set cannot be removed (False, as
    in Horovod); any other is refused (NotImplementedError)."""
    check_process_set(process_set, "remove_process_set")
    return False


# ---- Compression (Horovod's compress(tensor) -> (tensor, ctx) / decompress(tensor, ctx)) ----

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


class FP16Compressor(Compressor):
    """Floating tensors travel as float16 and are cast back to their dtype (Horovod's
    Compression.fp16); other dtypes travel unchanged."""

    wire = tf.float16

    @classmethod
    def compress(cls, tensor):
        if tensor.dtype.is_floating and tensor.dtype != cls.wire:
            return tf.cast(tensor, cls.wire), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tf.cast(tensor, ctx)


class BF16Compressor(FP16Compressor):
    """Floating tensors travel as bfloat16 and are cast back to their dtype."""

    wire = tf.bfloat16


class Compression:
    """`hvd.Compression.none`, `.fp16`, `.bf16` (Horovod's names)."""
    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


def check_compression(compression, what):
    if not (callable(getattr(compression, "compress", None)) and callable(getattr(compression, "decompress", None))):
        raise TypeError(f"{what}: compression must be hvd.Compression.none/fp16/bf16 or an object with "
                        f"compress(tensor) and decompress(tensor, ctx), got {compression!r}")
    return compression


# ---- Job layout and build facts (Horovod's horovod/common/basics.py names) ----

def cross_rank():
    """Horovod's cross_rank: the index of this rank's machine (`machine_rank()`)."""
    return basics.machine_rank()


def cross_size():
    """Horovod's cross_size: the number of machines (`machine_size()`)."""
    return basics.machine_size()


def mpi_built():
    """True: Shoal always runs on MPI (its one engine)."""
    return True


def mpi_enabled():
    """True: MPI is the engine of every Shoal job."""
    return True


def gloo_built():
    """False: Shoal has no Gloo engine."""
    return False


def gloo_enabled():
    return False


def cuda_built():
    """True when this build's CUDA plugin loads (the fake test plugin does not count)."""
    built, what = _core.gpu_support()
    return bool(built) and not what.startswith("fake ")


def rocm_built():
    return False


def ddl_built():
    return False


def ccl_built():
    return False


__all__ = ["HorovodInternalError", "Adasum", "ProcessSet", "global_process_set", "add_process_set",
           "remove_process_set", "Compression", "Compressor", "NoneCompressor", "FP16Compressor",
           "BF16Compressor", "cross_rank", "cross_size", "mpi_built", "mpi_enabled", "gloo_built",
           "gloo_enabled", "cuda_built", "rocm_built", "ddl_built", "ccl_built"]
