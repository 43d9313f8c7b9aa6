"""hierarchical_neighbor_allreduce: average within each machine, gossip between machines.

Semantics of BlueFog's op (reference/bluefog-semantics.md §1.6): with S_m the sum of the
tensors of machine m's ranks and L ranks per machine,
    y = (self_weight·S_self + Σ_m src_machine_weights[m]·dst_w(m→self)·S_m) / L
(uniform: (S_self + Σ_m S_m) / (L·(n_in + 1))), the same on every rank of a machine.
Stages: sum within the machine; the machine's local rank 0 exchanges with the local
rank 0 of its neighbor machines; broadcast of the result within the machine.
"""
import itertools

from . import basics, _ops
from ._loader import _core

_unnamed = itertools.count()


def _machine_args(self_weight, src_machine_weights, dst_machine_weights, enable_topo_check):
    # Dynamic mode (machine weights given) needs no machine topology.
    plan, weighted = (None, None) if dst_machine_weights is not None else basics._machine_plan()
    a = _ops.neighbor_args(self_weight, src_machine_weights, dst_machine_weights,
                           enable_topo_check, plan=plan, weighted=weighted)
    lead = basics.local_size()  # machine m's leader is rank m * L
    return dict(a, recv_ranks=[m * lead for m in a["recv_ranks"]],
                send_ranks=[m * lead for m in a["send_ranks"]])


def hierarchical_neighbor_allreduce_nonblocking(adapter, tensor, self_weight=None,
                                                src_machine_weights=None,
                                                dst_machine_weights=None,
                                                enable_topo_check=False, name=None):
    name = name or f"hierarchical_neighbor_allreduce.noname.{next(_unnamed)}"
    try:
        if not basics.is_homogeneous():
            raise ValueError("hierarchical_neighbor_allreduce needs the same number of ranks on "
                             "every machine, placed contiguously (see SHOAL_RANKS_PER_MACHINE)")
        args = _machine_args(self_weight, src_machine_weights, dst_machine_weights, enable_topo_check)
    except (ValueError, TypeError) as exc:
        # The peers wait in the first stage: they get the same error (shoal_reject).
        if isinstance(name, str) and "\0" not in name:
            _core.reject(_ops.ALLREDUCE, name + ".machine_sum", isinstance(exc, TypeError), str(exc))
        raise
    leader = basics.local_rank() == 0
    if not leader:  # only machine leaders exchange; the others still take part in negotiation
        args = dict(_ops._NO_PEERS)
    first = _ops.allreduce(adapter, tensor, op=_ops.Sum, name=name + ".machine_sum",
                                       scope=_ops.MACHINE)

    def finish():
        total = _ops.synchronize(first)
        mixed = _ops.synchronize(_ops.neighbor_allreduce_submit(adapter, total, name + ".exchange", args))
        out = _ops.synchronize(_ops.broadcast(adapter, mixed, 0, name + ".share",
                                                          inplace=True, scope=_ops.MACHINE))
        out /= basics.local_size()
        return out

    return _ops.composite(first, finish)
