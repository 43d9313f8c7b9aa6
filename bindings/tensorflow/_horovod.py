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

from shoal._horovod import *  # noqa: F401,F403  (the framework-neutral names)
from shoal._horovod import Compressor, NoneCompressor, check_compression, check_op, check_process_set  # noqa: F401
from shoal._horovod import __all__ as _NEUTRAL
from shoal import _ops

# ---- Compression: the casts (Horovod's Compression.fp16 / bf16) ----


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


def join():
    """Horovod's `hvd.join()`: this rank has run out of data; blocks until every rank has
    joined and returns the rank that joined last (a Python int, the same everywhere).
    Meanwhile this rank contributes zeros to the others' allreduces (Average still divides
    by size(), as in Horovod) and reducescatters, the identity to their Min/Max/Product
    allreduces; semantics and errors: `shoal.join`. Eager only: it blocks
    the calling thread, so inside a tf.function it raises RuntimeError (Horovod's op
    returns a tensor there)."""
    if not tf.executing_eagerly():
        raise RuntimeError("join() blocks until every rank has joined: call it eagerly, outside tf.function")
    return _ops.join()


__all__ = list(_NEUTRAL) + ["Compression", "FP16Compressor", "BF16Compressor", "join"]
