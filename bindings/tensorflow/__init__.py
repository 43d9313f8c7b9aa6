"""shoal.tensorflow: Shoal's ops as TensorFlow ops (AsyncOpKernels over the same C++
runtime as `shoal` and `shoal.torch`), usable eagerly and inside `tf.function`, with
gradients; plus DistributedGradientTape, broadcast_variables and consensus_distance.

Names and semantics are those of `shoal` (BlueFog's; reference/bluefog-semantics.md §1).
In eager mode a runtime failure raises `shoal.ShoalError`; inside a graph TensorFlow
raises `tf.errors.AbortedError` whose message starts with "ShoalError:". The kernels are
compiled against the installed TensorFlow on first import (see `_build.py`). XLA
(`jit_compile=True`) has no Shoal kernels: calling an op there raises ValueError.
Inside a `tf.while_loop`/`tf.range` loop, iterations may run concurrently and would submit
one op name twice; use `parallel_iterations=1` for loops that contain Shoal ops.
"""
from shoal import topology  # noqa: F401
from shoal._ops import Average, ReduceOp, Sum  # noqa: F401
from shoal.basics import *  # noqa: F401,F403
from shoal.basics import __all__ as _basics_all

from .ops import (DistributedGradientTape, allgather, allreduce, broadcast, broadcast_variables,  # noqa: F401
                  consensus_distance, hierarchical_neighbor_allreduce, neighbor_allgather,
                  neighbor_allreduce)

__all__ = list(_basics_all) + [
    "allreduce", "broadcast", "allgather", "neighbor_allreduce", "neighbor_allgather",
    "hierarchical_neighbor_allreduce", "broadcast_variables", "consensus_distance",
    "DistributedGradientTape", "Sum", "Average", "ReduceOp", "topology"]
