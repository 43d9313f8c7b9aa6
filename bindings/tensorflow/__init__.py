"""shoal.tensorflow: Shoal's ops as TensorFlow ops (AsyncOpKernels over the same C++
runtime as `shoal` and `shoal.torch`), usable eagerly and inside `tf.function`, with
gradients; plus DistributedGradientTape, broadcast_variables and consensus_distance.

Names and semantics are those of `shoal` (BlueFog's; docs/reference/bluefog-semantics.md §1).
In eager mode a runtime failure raises `shoal.ShoalError` (`shoal.NeighborPatternError`,
also a ValueError, when a dynamic neighbor op's send and receive ranks disagree); inside a
graph TensorFlow raises `tf.errors.AbortedError` whose message starts with "ShoalError:"
("ShoalError: NeighborPatternError:" for that one). The kernels are
compiled against the installed TensorFlow on first import (see `_build.py`). XLA
(`jit_compile=True`) has no Shoal kernels: calling an op there raises ValueError.
Inside a `tf.while_loop`/`tf.range` loop, iterations may run concurrently and would submit
one op name twice; use `parallel_iterations=1` for loops that contain Shoal ops.

Horovod's names (`import shoal.tensorflow as hvd`, issue 17): `alltoall`, `grouped_allreduce`,
`grouped_allgather`, `grouped_reducescatter` (`_horovod_ops.py`), `DistributedOptimizer` for
a Keras 3 optimizer, `DistributedGradientTape` with Horovod's keywords,
`PartialDistributedGradientTape`, `SyncBatchNormalization`, `broadcast_object[_fn]`,
`allgather_object`, `Compression`, `global_process_set`, `cross_rank`, `rank_op` & co., the
`*_built()` facts (`_horovod.py`); `allreduce` takes Horovod's keywords (keyword-only).
"""
from shoal import topology  # noqa: F401
from shoal._ops import Average, Max, Min, Product, ReduceOp, Sum  # noqa: F401
from shoal.basics import *  # noqa: F401,F403
from shoal.basics import __all__ as _basics_all

from ._horovod import *  # noqa: F401,F403
from ._horovod import __all__ as _horovod_all
from ._horovod_ops import *  # noqa: F401,F403  (alltoall, grouped ops)
from ._horovod_ops import __all__ as _horovod_ops_all
from .ops import (DistributedGradientTape, PartialDistributedGradientTape, allgather,  # noqa: F401
                  allgather_object, allreduce, broadcast, broadcast_, broadcast_object, broadcast_object_fn,
                  broadcast_variables, consensus_distance, hierarchical_neighbor_allreduce, neighbor_allgather,
                  neighbor_allreduce, reducescatter)
from .sync_batch_norm import SyncBatchNormalization  # noqa: F401


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="", device_sparse="",
                         compression=Compression.none, sparse_as_dense=False,  # noqa: F405
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True):  # noqa: F405
    """Horovod's `horovod.tensorflow.DistributedOptimizer` (its positional order) for a
    Keras 3 optimizer: the same wrapper as `shoal.keras.DistributedOptimizer` (see
    there). `use_locking` is TF1's and changes nothing; TF1 `tf.compat.v1.train`
    optimizers are not supported (TypeError)."""
    from shoal.keras._optimizer import DistributedOptimizer as _keras_distributed
    return _keras_distributed(optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
                              gradient_predivide_factor, op, backward_passes_per_step,
                              average_aggregated_gradients, num_groups, groups, process_set, scale_local_gradients)


__all__ = list(_basics_all) + [
    "allreduce", "broadcast", "broadcast_", "allgather", "reducescatter", "neighbor_allreduce", "neighbor_allgather",
    "hierarchical_neighbor_allreduce", "broadcast_variables", "consensus_distance",
    "DistributedGradientTape", "PartialDistributedGradientTape", "DistributedOptimizer", "SyncBatchNormalization",
    "broadcast_object", "broadcast_object_fn", "allgather_object",
    "Sum", "Average", "Min", "Max", "Product", "ReduceOp", "topology"] + list(_horovod_all) + list(_horovod_ops_all)
