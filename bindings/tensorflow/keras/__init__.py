"""shoal.keras: a Keras 3 entry point for data-parallel and decentralized training.

`import horovod.tensorflow.keras as hvd` scripts run with `import shoal.keras as hvd`
(issue 17): `init`, `shutdown`, `rank`, `size`, `local_rank`, `local_size`, `cross_rank`,
`cross_size`, `is_initialized`, the `*_built()` facts, `allreduce`/`allgather`/`broadcast`/`alltoall`
(Horovod's Keras signatures, over the shoal.tensorflow kernels), `broadcast_object`,
`DistributedOptimizer` (gradient allreduce before a Keras 3 optimizer's `apply`;
`_optimizer.py`), `load_model`, `Compression`, process sets (`ProcessSet`,
`add_process_set`, `remove_process_set`, `global_process_set`), and Horovod's callbacks
as `hvd.callbacks.X` (and `hvd.X`): `BroadcastGlobalVariablesCallback`,
`MetricAverageCallback`, `LearningRateScheduleCallback`, `LearningRateWarmupCallback`
(`callbacks.py`), `BestModelCheckpoint`, `PartialDistributedOptimizer`, `reducescatter`,
`SyncBatchNormalization`, `join`, `start_timeline`/`stop_timeline`, `elastic` (for a fixed
set of ranks: `elastic.py`). Beyond Horovod,
decentralized training: `DistributedAdaptWithCombineOptimizer` / `DistributedAdaptThenCombineOptimizer`
(AWC / ATC over the topology or a one-peer schedule, with `ConsensusControl`; `_neighbor.py`),
`NeighborAveragingCallback` (average the weights with neighbors every k batches, ATC) and
`ConsensusDistanceCallback`.

Only the TensorFlow backend of Keras 3 runs the optimizer (the callbacks move weights
through Shoal's numpy API and run on any backend with host-readable variables).
"""
import tensorflow as tf

from shoal.basics import (ShoalError, init, is_homogeneous, is_initialized, local_rank,  # noqa: F401
                          local_size, mpi_threads_supported, nccl_built, rank, shutdown, size)
from shoal.tensorflow import _horovod_ops as _tf_ops_more
from shoal.tensorflow import ops as _tf_ops
from shoal.tensorflow.sync_batch_norm import SyncBatchNormalization  # noqa: F401
from shoal.tensorflow._horovod import *  # noqa: F401,F403
from shoal.tensorflow._horovod import __all__ as _horovod_all
from shoal.tensorflow._horovod import Compression, broadcast_global_variables, global_process_set  # noqa: F401
from shoal._consensus import ConsensusControl  # noqa: F401
from shoal._ops import Average, Max, Min, Product, Sum  # noqa: F401

from . import callbacks, elastic  # noqa: F401
from ._neighbor import DistributedAdaptThenCombineOptimizer, DistributedAdaptWithCombineOptimizer  # noqa: F401
from ._optimizer import DistributedOptimizer, PartialDistributedOptimizer, load_model  # noqa: F401
from .callbacks import *  # noqa: F401,F403
from .callbacks import __all__ as _callbacks_all

broadcast_object = _tf_ops.broadcast_object
allgather_object = _tf_ops.allgather_object


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None,
              compression=Compression.none, process_set=global_process_set):
    """Horovod's Keras `allreduce(value, name, average, prescale_factor, postscale_factor,
    op, compression)`: the average (default) or sum over all ranks of a tensor-compatible
    value, as a tf.Tensor (`shoal.tensorflow.allreduce`; integer averages truncate toward
    zero as in Horovod). `process_set` (a ProcessSet): over its members only."""
    return _tf_ops.allreduce(tf.convert_to_tensor(value), average, name=name, op=op, compression=compression,
                             prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                             process_set=process_set)


def allgather(value, name=None, process_set=global_process_set):
    """Horovod's Keras `allgather`: every rank's value concatenated along the first
    dimension (which may differ between ranks), in rank order, as a tf.Tensor."""
    return _tf_ops.allgather(tf.convert_to_tensor(value), name=name, process_set=process_set)


def alltoall(value, splits=None, name=None, process_set=global_process_set):
    """Horovod's `alltoall` for a tensor-compatible value: rank r sends splits[q] rows of
    dim 0 to each rank q (without `splits`, dim 0 / size() each) and gets every rank's rows
    for it in rank order — the tf.Tensor, or (tensor, received_splits) when `splits` is
    given (`shoal.tensorflow.alltoall`)."""
    return _tf_ops_more.alltoall(tf.convert_to_tensor(value), splits, name=name, process_set=process_set)


def broadcast(value, root_rank, name=None, process_set=global_process_set):
    """Horovod's Keras `broadcast`: root_rank's value on every rank, as a tf.Tensor."""
    return _tf_ops.broadcast(tf.convert_to_tensor(value), root_rank, name=name, process_set=process_set)


def reducescatter(value, name=None, op=Average):
    """Horovod's Keras `reducescatter(value, name, op)`: the element-wise average (op=Average,
    default) or sum (op=Sum) over all ranks of a tensor-compatible [d0, ...] value, split
    along dim 0 (rank r gets d0 // size() rows, one more for the first d0 % size() ranks),
    as a tf.Tensor (`shoal.tensorflow.reducescatter`)."""
    return _tf_ops.reducescatter(tf.convert_to_tensor(value), op=op, name=name)


__all__ = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
           "mpi_threads_supported", "nccl_built", "is_homogeneous", "ShoalError", "allreduce", "allgather", "alltoall",
           "broadcast", "reducescatter", "broadcast_object", "allgather_object", "broadcast_global_variables",
           "DistributedOptimizer", "PartialDistributedOptimizer", "load_model", "SyncBatchNormalization",
           "DistributedAdaptWithCombineOptimizer", "DistributedAdaptThenCombineOptimizer", "ConsensusControl",
           "callbacks", "elastic", "Average", "Sum", "Min", "Max", "Product"]
__all__ += [n for n in _horovod_all if n not in __all__] + list(_callbacks_all)
