"""Horovod's names for TensorFlow and Keras (`horovod/tensorflow/mpi_ops.py`,
`compression.py`, `horovod/common/basics.py`, Horovod 0.28), so that
`import shoal.tensorflow as hvd` and `import shoal.keras as hvd` run Horovod scripts
(issue 17). Only names, argument checks and tensor casts live here: every op these
names reach is one of `shoal.tensorflow.ops`' kernels over the one runtime.

Differences from Horovod kept here (each said where it applies):
* `Adasum` is not implemented (NotImplementedError naming it).
Process sets (`process_set=`, `add_process_set`, `size_op(process_set_id)`) are
`shoal.process_sets`', as Horovod's (`SyncBatchNormalization` runs over every rank only:
NotImplementedError for another set).
"""
import tensorflow as tf

from shoal._horovod import *  # noqa: F401,F403  (the framework-neutral names)
from shoal._horovod import (Compressor, NoneCompressor, check_compression, check_op,  # noqa: F401
                            check_process_set, global_process_set)
from shoal._horovod import __all__ as _NEUTRAL
from shoal import _ops, _process, basics, process_sets
from shoal._loader import _core

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


def broadcast_global_variables(root_rank):
    """Horovod's broadcast_global_variables is TF1's (global variable collections); eagerly
    Horovod raises RuntimeError, and so does this, always (NotImplementedError, a
    RuntimeError). Use shoal.tensorflow.broadcast_variables(model.variables, root_rank), or
    BroadcastGlobalVariablesCallback(root_rank) in Keras's `fit`."""
    raise NotImplementedError("broadcast_global_variables needs TF1 global variables; use "
                              "hvd.broadcast_variables(model.variables, root_rank) or, in Keras, "
                              "hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank)")


def _int_op(value, name):
    return tf.constant(value, tf.int32, name=name)


def rank_op(name=None):
    """Horovod's `rank_op`: this rank as an int32 tensor (a constant: ranks never change in
    a Shoal job, which is not elastic)."""
    return _int_op(basics.rank(), name)


def local_rank_op(name=None):
    """Horovod's `local_rank_op`: the rank within the machine as an int32 tensor."""
    return _int_op(basics.local_rank(), name)


def size_op(process_set_id=0, name=None):
    """Horovod's `size_op`: the number of ranks of the process set with this id (0: every
    rank) as an int32 tensor (a constant, made when the op is made). ValueError for a set
    that does not exist."""
    return _int_op(process_sets.layout(_set_id(process_set_id, "size_op"))[0], name)


def local_size_op(name=None):
    """Horovod's `local_size_op`: the number of ranks on this machine as an int32 tensor."""
    return _int_op(basics.local_size(), name)


def process_set_included_op(process_set_id=0, name=None):
    """Horovod's `process_set_included_op`: an int32 tensor (a constant, made when the op is
    made): 1 when this rank belongs to the process set with this id, 0 when it does not,
    -3 (Horovod's HOROVOD_PROCESS_SET_ERROR_UNKNOWN_SET) for a set that does not exist."""
    ps = _set_id(process_set_id, "process_set_included_op")
    _process.require_init()  # ValueError before init()
    if ps and _core.process_set_ranks(ps) is None:
        return _int_op(-3, name)
    return _int_op(int(process_sets.layout(ps)[1] >= 0), name)


def _set_id(process_set_id, what):
    if isinstance(process_set_id, bool) or not isinstance(process_set_id, int):
        raise TypeError(f"{what}: process_set_id must be an int (a ProcessSet's process_set_id), "
                        f"got {process_set_id!r}")
    return process_set_id


__all__ = list(_NEUTRAL) + ["Compression", "FP16Compressor", "BF16Compressor", "join", "broadcast_global_variables",
                            "rank_op",
                            "local_rank_op", "size_op", "local_size_op", "process_set_included_op"]
