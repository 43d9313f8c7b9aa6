"""Fault-tolerant mode: the survivors of a lost rank go on (docs/design.md §16).

On by `shoalrun --fault-tolerant` (SHOAL_FAULT_TOLERANT=1; Open MPI >= 5, whose ULFM
revokes and shrinks). When a rank dies, every op of the job that is pending or submitted
later on a survivor fails with `RankLostError`; the first one on each survivor runs
`on_rank_lost` before it is raised, which every survivor reaches (the core revokes the
job's control communicator, so each survivor's next op fails too):

1. the core shrinks the job to the survivors, renumbered 0..n-1 in their old order, and
   starts a fresh runtime over them: names, negotiation, caches start again alike on
   every survivor (`shoal_recover`);
2. the static topology is rebuilt over n-1 ranks: a graph of one of Shoal's families
   (exponential-2, ring, ...) as the same family, any other graph as the survivors' part
   with Metropolis–Hastings weights (doubly stochastic again; renormalizing the old
   weights would bias the average);
3. the optimizers that registered (`register`) agree on the step from which every
   survivor communicates again: one allreduce (max) of each one's `fault_position()`,
   then `fault_align(step)`, and `fault_resync()` (which may be collective, e.g. a
   broadcast of the model) of those that every survivor still has.

4. process sets are added again over their surviving members (renumbered; a set with none
   left gets process_set_id None);
5. windows that every survivor has are created again, in their creation order, over the
   new topology (one allgather agrees on them and on step 3's positions): the same
   tensors (their current values), names and zero_init; receive buffers hold what a fresh
   win_create puts there and associated p starts again at 1 (what was in flight to or
   from the lost rank is gone; push-sum's mass is renormalized over the survivors).

Machine topologies of the lost runtime are not recreated: set them again after a loss.
"""
import collections
import hashlib
import time
import warnings
import weakref

import networkx as nx
import numpy as np

from . import topology as _topo
from ._lifecycle import fault_tolerant as enabled, record_mark  # noqa: F401 - enabled: the optimizers'
from ._loader import _core
from ._process import STATE
from .process_sets import shrink_process_sets

RankLostError = _core.RankLostError
RankLostError.__doc__ = (
    "Fault-tolerant mode (shoalrun --fault-tolerant): a rank of the job died while this op "
    "needed it. A ShoalError. When it is raised, the survivors have already shrunk the job "
    "(renumbered ranks: shoal.size() is smaller), rebuilt the topology and realigned the "
    "optimizers; later ops run on the survivors. `lost_ranks`: the lost ranks as numbered "
    "at launch; `lost_at`: time.time() of the recovery.")

# Shoal's graph families, rebuilt at the new size after a loss (their default arguments).
_FAMILIES = (_topo.exponential_two_graph, _topo.ring_graph, _topo.symmetric_exponential_graph,
             _topo.fully_connected_graph, _topo.star_graph, _topo.mesh_grid_2d_graph)


def survivors_graph(graph, lost):
    """The topology over the survivors of `graph` (n nodes) without the ranks `lost`
    (numbered 0..n-1): the same family at n - len(lost) for a graph of `_FAMILIES`
    (weights exactly as the family's), else the induced graph of the survivors relabelled
    in order, with Metropolis–Hastings weights (symmetric, doubly stochastic). Returns
    (graph, weighted): whether the new graph's weights must be used."""
    n = graph.number_of_nodes()
    for make in _FAMILIES:
        try:
            if _topo.is_topology_equivalent(make(n), graph):
                return make(n - len(lost)), None
        except ValueError:
            continue
    keep = [r for r in range(n) if r not in set(lost)]
    sub = nx.relabel_nodes(graph.subgraph(keep), {r: i for i, r in enumerate(keep)})
    if len(keep) > 1 and not nx.is_weakly_connected(sub):
        parts = sorted(sorted(c) for c in nx.weakly_connected_components(sub))
        warnings.warn(f"the topology over the survivors of ranks {sorted(lost)} falls apart into {parts} (new ranks): "
                      "they no longer average with each other; set a connected topology (shoal.set_topology)",
                      RuntimeWarning, stacklevel=2)
    return _topo.metropolis_hastings_weights(sub), True


def register(participant):
    """Register an object taking part in recovery (a distributed optimizer): it has
    `fault_position()` -> int (the first step it can communicate in again if the job
    shrank now), `fault_align(step)` and `fault_resync()`. Every rank registers the same
    objects in the same order: each gets the same serial number everywhere. Kept by weak
    reference (one that is gone on some ranks and not yet collected on others still agrees
    by its number)."""
    STATE.fault_serial += 1
    STATE.fault_participants.append((STATE.fault_serial, weakref.ref(participant)))


def losses():
    """The losses so far: a list of (time.time(), [lost ranks as numbered at launch])."""
    return list(STATE.fault_losses)


def on_rank_lost(message, set_topology):
    """The exception to raise for an op that failed with SHOAL_RANK_LOST; recovers first
    if the current runtime is the one that lost a rank (collective over the survivors).
    `set_topology`: shoal.basics.set_topology (which imports this module)."""
    with STATE.lock:
        lost = _core.recover()
        if lost:
            _recovered(lost, set_topology)
        when, launch_ranks = STATE.fault_losses[-1] if STATE.fault_losses else (time.time(), [])
    error = RankLostError(f"{message}; lost rank(s) {launch_ranks} (as numbered at launch); the job goes on "
                          f"with {_core.size()} ranks")
    error.lost_ranks, error.lost_at = launch_ranks, when
    return error


def _record_drop(loss, writer):
    """Tell shoalrun which ranks the survivors dropped (the new rank 0 writes a file per
    rank): their failure does not fail the job."""
    if writer:
        when, ranks = loss
        for r in ranks:
            record_mark(r, "dropped", when)


def _recovered(lost, set_topology):
    """After the core's shrink: the Python side's state for the new runtime, then the
    participants' alignment. Runs on every survivor in the same order."""
    launch = STATE.launch_ranks or list(range(_core.size() + len(lost)))
    STATE.fault_losses.append((time.time(), [launch[r] for r in lost]))
    _record_drop(STATE.fault_losses[-1], _core.rank() == 0)
    STATE.launch_ranks = [r for i, r in enumerate(launch) if i not in set(lost)]
    graph, plan, windows = STATE.topology, STATE.plan, list(STATE.window_makers.items())
    STATE.restart()
    if graph is not None:
        new, weighted = survivors_graph(graph, lost)
        set_topology(new, plan["weighted"] if weighted is None else weighted)
    shrink_process_sets([r for r in range(len(launch)) if r not in set(lost)])
    live = [(k, ref()) for k, ref in STATE.fault_participants]
    live = [(k, p) for k, p in live if p is not None]
    STATE.fault_participants = [(k, weakref.ref(p)) for k, p in live]
    from . import _ops
    from ._numpy import ADAPTER
    # One allgather: (serial, position) of each live participant, (-2, hash) of each window,
    # and a row that every rank sends.
    rows = np.array([(-1, 0)] + [(k, p.fault_position()) for k, p in live]
                    + [(-2, _name_hash(name)) for name, _ in windows], dtype=np.int64)
    every = _ops.synchronize(_ops.allgather(ADAPTER, rows, name="shoal.recovery.align")).tolist()
    # Windows every survivor has, again in creation order; one that a loss cut in win_create
    # or win_free on some survivors only is dropped everywhere (create it again on every rank).
    have = collections.Counter(h for k, h in every if k == -2)
    for name, make in windows:
        if have[_name_hash(name)] == _core.size():
            make()
        else:
            STATE.window_makers.pop(name, None)
            warnings.warn(f"window {name!r} existed on only some survivors of the loss (a win_create or win_free "
                          "it cut short): not created again; create it again on every rank", RuntimeWarning,
                          stacklevel=2)
    agreed, holders = {}, collections.Counter(k for k, _ in every if k >= 0)
    for k, position in every:
        if k >= 0:
            agreed[k] = max(agreed.get(k, position), position)
    for k, p in live:
        p.fault_align(agreed[k])
    for k, p in live:
        if holders[k] == _core.size():  # resyncs may be collective: one gone elsewhere takes none
            p.fault_resync()


def _name_hash(name):
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little", signed=True)
