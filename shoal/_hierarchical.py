"""hierarchical_neighbor_allreduce: average within each machine, gossip between machines.

Semantics of BlueFog's op (reference/bluefog-semantics.md §1.6): with S_m the sum of the
tensors of machine m's ranks and L ranks per machine,
    y = (self_weight·S_self + Σ_m src_machine_weights[m]·dst_w(m→self)·S_m) / L
(uniform: (S_self + Σ_m S_m) / (L·(n_in + 1))), the same on every rank of a machine.
Stages: sum within the machine; the machine's local rank 0 exchanges with the local
rank 0 of its neighbor machines; broadcast of the result within the machine; divide by L.

Written once: `resolve` (checks, names, weights) and `run` (the stages) serve every
binding; a binding passes its own three stage functions (TensorFlow: its kernels; numpy
and torch: `_ops` over their adapter, where the op is one handle: its first stage's).
"""
from . import _ops, _process
from ._loader import _core
from ._process import STATE

_OP = "hierarchical_neighbor_allreduce"


def _machine_args(self_weight, src_machine_weights, dst_machine_weights, enable_topo_check):
    # Dynamic mode (machine weights given) needs no machine topology.
    plan, weighted = (None, None) if dst_machine_weights is not None else _process.machine_plan()
    a = _ops.neighbor_args(self_weight, src_machine_weights, dst_machine_weights,
                           enable_topo_check, plan=plan, weighted=weighted)
    lead = _process.local_size()  # machine m's leader is rank m * L
    return dict(a, native=None, recv_ranks=[m * lead for m in a["recv_ranks"]],
                send_ranks=[m * lead for m in a["send_ranks"]])


def resolve(self_weight=None, src_machine_weights=None, dst_machine_weights=None, enable_topo_check=False,
            name=None):
    """(name, peers) of one call: `name` (generated, bounded, when None) and the lists of
    the exchange stage (a dict as `_ops.neighbor_args` returns; no peers off the machine
    leaders). An argument error is told to the peers, which wait in the first stage."""
    name = name or STATE.unnamed(_OP + ".noname")
    try:
        if not _process.is_homogeneous():
            raise ValueError(f"{_OP} needs the same number of ranks on every machine, placed "
                             "contiguously (see SHOAL_RANKS_PER_MACHINE)")
        args = _machine_args(self_weight, src_machine_weights, dst_machine_weights, enable_topo_check)
    except (ValueError, TypeError) as exc:
        if isinstance(name, str) and "\0" not in name:
            _core.reject(_ops.ALLREDUCE, name + ".machine_sum", isinstance(exc, TypeError), str(exc))
        raise
    if _process.local_rank() != 0:  # only machine leaders exchange; the others still negotiate
        args = {"recv_ranks": [], "recv_weights": [], "self_weight": 1.0, "uniform": True,
                "send_ranks": [], "send_weights": [], "topo_check": False}
    return name, args


def run(total, name, args, exchange, share, divide):
    """The stages after the machine sum `total`: exchange(x, name, args) between leaders,
    share(x, name) from local rank 0, divide(x, L)."""
    try:
        mixed = exchange(total, name + ".exchange", args)
    except BaseException as exc:
        refuse_later_stages(name, exc, exchange_too=False)
        raise
    return divide(share(mixed, name + ".share"), _process.local_size())


def refuse_later_stages(name, exc, exchange_too=True):
    """A stage failed here: the ranks that wait for this one in the later stages (the other
    machines' leaders in the exchange, this machine's ranks in the share) fail with it."""
    why = f"{_OP} '{name}': an earlier stage failed on rank {_process.rank()}: {exc}"
    if exchange_too:
        _core.reject(_ops.NEIGHBOR_ALLREDUCE, name + ".exchange", False, why, failed=True)
    _core.reject(_ops.BROADCAST, name + ".share", False, why, failed=True)


def hierarchical_neighbor_allreduce_nonblocking(adapter, tensor, self_weight=None, src_machine_weights=None,
                                                dst_machine_weights=None, enable_topo_check=False, name=None):
    """The op over `adapter`'s tensors: one handle (the machine sum's) whose later stages run
    in `synchronize`."""
    name, args = resolve(self_weight, src_machine_weights, dst_machine_weights, enable_topo_check, name)
    first = _ops.allreduce(adapter, tensor, op=_ops.Sum, name=name + ".machine_sum", scope=_ops.MACHINE)

    def exchange(x, stage, peers):
        return _ops.neighbor_allreduce_submit(adapter, x, stage, peers, block=True)

    def share(x, stage):
        return _ops.broadcast(adapter, x, 0, stage, inplace=True, scope=_ops.MACHINE, block=True)

    def divide(x, n):
        x /= n
        return x

    return _ops.then(first, lambda total: run(total, name, args, exchange, share, divide),
                     on_failure=lambda exc: refuse_later_stages(name, exc))
