"""`bluefog.common.topology_util` under Shoal: the BlueFog-named topology helpers of
`shoal.topology` (docs/reference/bluefog-semantics.md), nothing else."""
from shoal import topology as _topology

globals().update({name: getattr(_topology, name) for name in _topology.BLUEFOG_NAMES})
__all__ = list(_topology.BLUEFOG_NAMES)
