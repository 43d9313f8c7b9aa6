"""shoal.torch: Shoal's ops for torch tensors (CPU in this build), BlueFog-compatible.

`import shoal.torch as bf` runs BlueFog scripts: same names, same semantics
(docs/reference/bluefog-semantics.md §1). The blocking ops are registered with
`torch.library` (namespace `shoal`), so they work eagerly and under `torch.compile`.
Nothing here is compiled against torch: tensors reach the core as raw pointers.
"""
import torch  # noqa: F401

from shoal import topology  # noqa: F401
from shoal.topology import BLUEFOG_NAMES as _TOPOLOGY_NAMES
from shoal._infer import InferDestinationFromSourceRanks, InferSourceFromDestinationRanks  # noqa: F401
from shoal._ops import Average, Max, Min, Product, ReduceOp, Sum  # noqa: F401
from shoal.basics import *  # noqa: F401,F403
from shoal.basics import __all__ as _basics_all

from . import _horovod
from . import _ops as _torch_ops
from ._adapter import ADAPTER

from shoal._win import build_win_api  # noqa: E402

_API = dict(_horovod.TORCH_API)  # shoal._api.build_api(ADAPTER), built once
_API.update(build_win_api(ADAPTER))
globals().update(_API)
globals().update({_n: getattr(topology, _n) for _n in _TOPOLOGY_NAMES})  # bf.ExponentialGraph, ...
# Blocking forms go through the registered torch.library ops.
from ._ops import allgather, allreduce, broadcast, neighbor_allreduce  # noqa: E402,F401,F811

from .consensus import ConsensusControl, consensus_distance  # noqa: E402
from .optimizers import (CommunicationType, CommunicationTypeError,  # noqa: E402
                         DistributedAdaptThenCombineOptimizer, DistributedAdaptWithCombineOptimizer,
                         DistributedAllreduceOptimizer, DistributedGradientAllreduceOptimizer,
                         DistributedHierarchicalNeighborAllreduceOptimizer,
                         DistributedNeighborAllreduceOptimizer, GradientsInFlightError)
from ._horovod_optimizer import DistributedOptimizer  # noqa: E402
from . import elastic  # noqa: E402,F401  (Horovod's hvd.elastic, for a fixed set of ranks)
from .win_optimizers import DistributedPushSumOptimizer, DistributedWinPutOptimizer  # noqa: E402
from .sync_batch_norm import SyncBatchNorm  # noqa: E402
from . import compression  # noqa: E402,F401  (gossip compressors)
from .compressed_gossip import CompressedGossip  # noqa: E402
from .utility import (allgather_object, allreduce_parameters, broadcast_object,  # noqa: E402
                      broadcast_parameters)
# Horovod's names (`import shoal.torch as hvd`), and the shared names with Horovod's
# keywords added (allreduce, allreduce_, broadcast, broadcast_, allgather,
# broadcast_optimizer_state): bindings/torch/_horovod.py.
from ._horovod import *  # noqa: E402,F401,F403,F811
from ._horovod import __all__ as _HOROVOD_NAMES  # noqa: E402
# Horovod's alltoall and grouped ops (differentiable, torch.library): _horovod_ops.py.
from ._horovod_ops import *  # noqa: E402,F401,F403,F811
from ._horovod_ops import __all__ as _HOROVOD_OPS  # noqa: E402

__all__ = list(_basics_all) + sorted(_API) + [
    "ConsensusControl", "consensus_distance", "CommunicationType",
    "DistributedAdaptThenCombineOptimizer", "DistributedAdaptWithCombineOptimizer",
    "DistributedAllreduceOptimizer", "DistributedNeighborAllreduceOptimizer",
    "DistributedHierarchicalNeighborAllreduceOptimizer", "GradientsInFlightError", "CommunicationTypeError",
    "DistributedGradientAllreduceOptimizer", "DistributedOptimizer", "DistributedPushSumOptimizer",
    "DistributedWinPutOptimizer", "SyncBatchNorm", "allgather_object",
    "allreduce_parameters", "broadcast_object", "broadcast_optimizer_state",
    "broadcast_parameters", "elastic", "compression",
    "CompressedGossip"] + ["Sum", "Average", "Min", "Max", "Product", "ReduceOp", "topology",
                                                         "InferSourceFromDestinationRanks",
                                                         "InferDestinationFromSourceRanks"]
__all__ += list(_TOPOLOGY_NAMES)
__all__ += [n for n in list(_HOROVOD_NAMES) + list(_HOROVOD_OPS) if n not in __all__]
del _torch_ops
