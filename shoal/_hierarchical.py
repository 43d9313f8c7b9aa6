"""hierarchical_neighbor_allreduce: average within each machine, gossip between machines.

Semantics of BlueFog's op (docs/reference/bluefog-semantics.md §1.6): with S_m the sum of the
tensors of machine m's ranks and L ranks per machine,
    y = (self_weight·S_self + Σ_m src_machine_weights[m]·dst_w(m→self)·S_m) / L
(uniform: (S_self + Σ_m S_m) / (L·(n_in + 1))), the same on every rank of a machine.

The op is one op of the core (SHOAL_OP_HIERARCHICAL_NEIGHBOR_ALLREDUCE, one handle), which
runs its stages (core/src/ops/stages.cc); this module only resolves the machine weights,
as `neighbor_allreduce` resolves rank weights, for every binding.
"""
from . import _ops, _process

HIERARCHICAL = _ops.OPS["hierarchical_neighbor_allreduce"]


def machine_args(self_weight=None, src_machine_weights=None, dst_machine_weights=None, enable_topo_check=False):
    """The exchange's lists over machines (a dict as `_ops.neighbor_args` returns, machine
    ids for ranks): the machine topology's (static mode), or the given weights (dynamic
    mode: all three given; no machine topology needed). ValueError/TypeError for bad
    arguments; RuntimeError in static mode before `set_machine_topology`."""
    plan, weighted = (None, None) if dst_machine_weights is not None else _process.machine_plan()
    return _ops.neighbor_args(self_weight, src_machine_weights, dst_machine_weights, enable_topo_check,
                              plan=plan, weighted=weighted)


@_ops._told(HIERARCHICAL)
def hierarchical_neighbor_allreduce_nonblocking(adapter, tensor, self_weight=None, src_machine_weights=None,
                                                dst_machine_weights=None, enable_topo_check=False, name=None):
    """The op over `adapter`'s tensors; returns its handle."""
    peers = machine_args(self_weight, src_machine_weights, dst_machine_weights, enable_topo_check)
    src, out = adapter.prepare(tensor, False, "hierarchical_neighbor_allreduce")
    return _ops._submit(HIERARCHICAL, name, adapter, src, out, (tensor, src, out), lambda: out,
                        peers=_ops.peers_of(peers))
