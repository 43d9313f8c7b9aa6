"""A call refused at the call on rank 1 only (bad arguments there, good ones elsewhere):
every rank prints what it raised, as `<case> <rank>: <type>: <message>`."""
import numpy as np

import shoal

shoal.init()
r = shoal.rank()


def attempt(case, fn):
    try:
        fn()
        print(f"{case} {r}: no error", flush=True)
    except (ValueError, TypeError, shoal.ShoalError) as exc:
        print(f"{case} {r}: {type(exc).__name__}: {exc}", flush=True)


# Refused by the core (unnamed: the name is used up on every rank alike).
attempt("allreduce-int-average",
        lambda: shoal.allreduce(np.ones(3, np.int32) if r == 1 else np.ones(3), average=True))
# A neighbor op already negotiated: in steady state no coordinator is involved. Every rank
# receives from rank 1 (a rank that does not may finish its op before it hears of the refusal).
shoal.set_topology(shoal.topology.fully_connected_graph(shoal.size()))
shoal.neighbor_allreduce(np.ones(3), name="n")
attempt("neighbor-int", lambda: shoal.neighbor_allreduce(np.ones(3, np.int64) if r == 1 else np.ones(3), name="n"))
# Collective set-up calls refused on rank 1 (a bad node label; a non-graph): the peers are
# in the call's agreement round.
ring = shoal.topology.ring_graph(shoal.size())
attempt("set-topology", lambda: shoal.set_topology(
    __import__("networkx").relabel_nodes(ring, {0: 7}) if r == 1 else ring))
attempt("set-machine-topology", lambda: shoal.set_machine_topology(
    [[1.0]] if r == 1 else shoal.topology.ring_graph(shoal.machine_size())))
shoal.set_topology(shoal.topology.fully_connected_graph(shoal.size()))
# Refused by the Python layer, before the core sees the call.
attempt("python-check", lambda: shoal.broadcast(np.ones(3), "0" if r == 1 else 0, name="b"))
# numpy's native neighbor_allreduce resolves its weights in C first.
attempt("native-weights", lambda: shoal.neighbor_allreduce(np.ones(3), self_weight=0.5, src_weights={1: 0.5},
                                                             name="nw") if r == 1 else
        shoal.neighbor_allreduce(np.ones(3), name="nw"))
# The torch binding checks before the op layer does.
import torch  # noqa: E402

import shoal.torch as bft  # noqa: E402
attempt("torch-op", lambda: bft.allreduce(torch.ones(3), op="bad" if r == 1 else None, name="t"))
# A multi-stage op: the peers wait in its first stage.
shoal.set_machine_topology(shoal.topology.ring_graph(shoal.machine_size()))
attempt("hierarchical", lambda: shoal.hierarchical_neighbor_allreduce(
    np.ones(3), self_weight=0.5 if r == 1 else None, name="h"))
print(f"rank {r} after", shoal.allreduce(np.ones(2), average=False)[0], flush=True)
