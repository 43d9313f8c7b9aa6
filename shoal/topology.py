"""Framework-neutral topology API: generators, conversions, schedules, analysis.

Convention (BlueFog's; docs/design.md §7): a topology is a weighted ``networkx.DiGraph`` over
ranks 0..n-1.  Edge i -> j with attribute ``weight`` w means rank j weights rank i's value by w when
it combines; the self loop i -> i carries i's self weight.  The mixing matrix has W[i, j] = weight
of i -> j, so one gossip step is ``x_new = W.T @ x`` and a receiver's weights form a *column* of W
(algorithms.md §2, "Pitfall").  All generators give doubly stochastic W.  Wherever a topology is
expected, a DiGraph or a square numpy matrix in this convention is accepted (:func:`as_graph`).
Semantics: BlueFog 0.3.0 ``bluefog/common/topology_util.py`` (bluefog-semantics.md §2) with its bugs
fixed (exact power test, networkx-3 equivalence test, one-peer schedules without self loops).
"""
from __future__ import annotations

import itertools
import math
import operator
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import networkx as nx
import numpy as np

from ._base_graph import Step as _Step, base_steps as _base_steps

Topology = Union[nx.DiGraph, np.ndarray]
SendRecv = Tuple[List[int], List[int]]


# -- argument checks -------------------------------------------------------------------------------
def _check_int(value, name: str = "size", minimum: int = 1) -> int:
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if v < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {v}")
    return v


def _check_rank(rank, size: int, name: str = "rank") -> int:
    r = _check_int(rank, name, 0)
    if r >= size:
        raise ValueError(f"{name} {r} is out of range for a topology of {size} ranks")
    return r


def _check_labels(graph: nx.Graph) -> int:
    n = graph.number_of_nodes()
    if n == 0 or set(graph.nodes) != set(range(n)):
        raise ValueError(f"topology nodes must be the ranks 0..n-1, got {list(graph.nodes)[:8]}")
    return n


def _validated_matrix(matrix) -> np.ndarray:
    a = np.asarray(matrix, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] != a.shape[1] or a.shape[0] == 0:
        raise ValueError(f"mixing matrix must be square and non-empty, got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError("mixing matrix has non-finite entries")
    return a


# -- static generators -----------------------------------------------------------------------------
def _graph_from_edges(size: int, edges: Dict[Tuple[int, int], float]) -> nx.DiGraph:
    g = nx.DiGraph()
    g.add_nodes_from(range(size))
    # Sorted insertion keeps successors/predecessors ascending, like nx.from_numpy_array.
    g.add_weighted_edges_from((i, j, w) for (i, j), w in sorted(edges.items()))
    return g


def _circulant(size: int, offsets: Iterable[int]) -> nx.DiGraph:
    offs = sorted({d % size for d in offsets} | {0})
    w = 1.0 / len(offs)  # Python float 1/k: exactly what sum-then-divide averaging uses
    return _graph_from_edges(size, {(i, (i + d) % size): w for i in range(size) for d in offs})


def _powers_below(n: int, base: int) -> List[int]:
    # exact integers: BlueFog's float-log isPowerOf missed 243 = 3**5
    out, d = [], 1
    while d < n:
        out.append(d)
        d *= base
    return out


def exponential_graph(size: int, base: int = 2) -> nx.DiGraph:
    """Static exponential graph (BlueFog ``ExponentialGraph``; Ying et al., NeurIPS 2021).

    Circulant i -> (i + d) mod n for d = 0 and each d in 1..n-1 that is an integer power of ``base``
    (base**0 = 1 included), uniform weight 1/(1 + #powers).  n=8: out(0) = {1, 2, 4},
    in(0) = {4, 6, 7}, w = 1/4.  ValueError for size < 1 or base < 2; TypeError for non-ints.
    """
    n, b = _check_int(size), _check_int(base, "base", 2)
    return _circulant(n, _powers_below(n, b))


def exponential_two_graph(size: int) -> nx.DiGraph:
    """BlueFog ``ExponentialTwoGraph`` = ``exponential_graph(size, 2)``."""
    return exponential_graph(size, 2)


def symmetric_exponential_graph(size: int, base: int = 4) -> nx.DiGraph:
    """BlueFog ``SymmetricExponentialGraph``: circulant with offset d iff min(d, n - d) is a power
    of ``base``, uniform weights.  n=8: offsets {1, 4, 7}; n=12: {1, 4, 8, 11}.  Errors as above."""
    n, b = _check_int(size), _check_int(base, "base", 2)
    return _circulant(n, [d for p in _powers_below(n, b) if 2 * p <= n for d in (p, n - p)])


def ring_graph(size: int, connect_style: int = 0) -> nx.DiGraph:
    """BlueFog ``RingGraph``.  connect_style 0: i -> i±1, weights 1/3; 1 ("left"): i -> i-1;
    2 ("right"): i -> i+1, weights 1/2.  n=1: [[1]]; n=2: all 0.5 for every style.  ValueError for
    a style outside {0, 1, 2}."""
    n, style = _check_int(size), _check_int(connect_style, "connect_style", 0)
    if style > 2:
        raise ValueError(f"connect_style must be 0 (both), 1 (left) or 2 (right), got {style}")
    return _circulant(n, {0: (1, -1), 1: (-1,), 2: (1,)}[style])


def metropolis_hastings_weights(graph: Union[nx.Graph, np.ndarray]) -> nx.DiGraph:
    """Metropolis–Hastings weights (algorithms.md §2.3; BlueFog's MeshGrid2DGraph rule).

    ``graph``: ``nx.Graph``/``nx.DiGraph`` over 0..n-1 or a square numpy matrix; only the edge
    pattern is used, symmetrized, self loops ignored.  W[i, j] = 1/max(deg_i, deg_j), degrees
    counting self; W[i, i] = 1 - sum_j W[i, j]: symmetric, doubly stochastic.  TypeError for other
    inputs, ValueError for bad labels or a non-square matrix.
    """
    if isinstance(graph, np.ndarray):
        graph = nx.from_numpy_array(_validated_matrix(graph))  # undirected: pattern symmetrized
    elif not isinstance(graph, nx.Graph):
        raise TypeError(f"expected a networkx graph or numpy matrix, got {type(graph).__name__}")
    n = _check_labels(graph)
    und = nx.Graph(graph)
    und.remove_edges_from(list(nx.selfloop_edges(und)))
    deg = [und.degree(i) + 1 for i in range(n)]
    edges: _Step = {}
    for i in range(n):
        row = {(i, j): 1.0 / max(deg[i], deg[j]) for j in sorted(und[i])}
        edges.update(row)
        edges[(i, i)] = 1.0 - sum(row.values())
    return _graph_from_edges(n, edges)


def mesh_grid_2d_graph(size: int, shape: Optional[Tuple[int, int]] = None) -> nx.DiGraph:
    """BlueFog ``MeshGrid2DGraph``: 2-D grid, no wrap-around, Metropolis–Hastings weights; rank i at
    (i // ncol, i % ncol).  Default shape (largest divisor <= sqrt(n), n / that): a prime n gives a
    line.  ValueError if nrow * ncol != size."""
    n = _check_int(size)
    if shape is None:
        nrow = math.isqrt(n)
        while n % nrow:
            nrow -= 1
        shape = (nrow, n // nrow)
    nrow, ncol = (_check_int(s, "shape") for s in shape)
    if nrow * ncol != n:
        raise ValueError(f"shape {tuple(shape)} does not match size {n}")
    g = nx.Graph()
    g.add_nodes_from(range(n))
    g.add_edges_from((i, i + 1) for i in range(n) if (i + 1) % ncol)
    g.add_edges_from((i, i + ncol) for i in range(n - ncol))
    return metropolis_hastings_weights(g)


def star_graph(size: int, center_rank: int = 0) -> nx.DiGraph:
    """BlueFog ``StarGraph``: center <-> every leaf with weight 1/n, leaf self 1 - 1/n, center self
    1/n.  ValueError for center_rank outside [0, size)."""
    n = _check_int(size)
    c = _check_rank(center_rank, n, "center_rank")
    edges = {(i, i): 1.0 - 1.0 / n for i in range(n)}
    for i in range(n):
        edges[(c, i)] = edges[(i, c)] = 1.0 / n
    return _graph_from_edges(n, edges)


def fully_connected_graph(size: int) -> nx.DiGraph:
    """BlueFog ``FullyConnectedGraph``: complete graph with self loops, every weight 1/n."""
    n = _check_int(size)
    return _circulant(n, range(n))


# -- conversions and per-rank views ----------------------------------------------------------------
def from_mixing_matrix(matrix) -> nx.DiGraph:
    """DiGraph with edge i -> j of weight W[i, j] (Python float) for every nonzero entry of the
    array-like (n, n) ``matrix`` (cast to float64).  ValueError if not square, empty or not finite.
    """
    a = _validated_matrix(matrix)
    return _graph_from_edges(a.shape[0], {(int(i), int(j)): float(a[i, j])
                                          for i, j in zip(*np.nonzero(a))})


def as_graph(topology: Topology) -> nx.DiGraph:
    """``topology`` as a DiGraph: a DiGraph is returned as is, a numpy matrix converted.  TypeError
    for anything else (undirected and multi graphs included); ValueError for node labels other than
    0..n-1 or a non-square matrix."""
    if isinstance(topology, nx.DiGraph) and not topology.is_multigraph():
        _check_labels(topology)
        return topology
    if isinstance(topology, np.ndarray):
        return from_mixing_matrix(topology)
    raise TypeError("a topology must be a networkx.DiGraph or a square numpy matrix, "
                    f"got {type(topology).__name__}")


def mixing_matrix(topology: Topology) -> np.ndarray:
    """W as float64 (n, n), W[i, j] = weight of edge i -> j (0 if absent; 1 for an edge without a
    ``weight`` attribute, the networkx default).  Errors as :func:`as_graph`."""
    if isinstance(topology, np.ndarray):
        return _validated_matrix(topology).copy()
    g = as_graph(topology)
    return nx.to_numpy_array(g, nodelist=range(g.number_of_nodes()), dtype=np.float64)


def _edge_weight(g: nx.DiGraph, i: int, j: int) -> float:
    return float(g[i][j].get("weight", 1.0))


def _rank_weights(topology: Topology, rank: int, incoming: bool) -> Tuple[float, Dict[int, float]]:
    if isinstance(topology, np.ndarray):  # no graph build: O(n) per call
        a = _validated_matrix(topology)
        r = _check_rank(rank, a.shape[0])
        line = a[:, r] if incoming else a[r, :]
        return float(line[r]), {int(k): float(line[k]) for k in np.nonzero(line)[0] if k != r}
    g = as_graph(topology)
    r = _check_rank(rank, g.number_of_nodes())
    self_w = _edge_weight(g, r, r) if g.has_edge(r, r) else 0.0
    if incoming:
        return self_w, {s: _edge_weight(g, s, r) for s in sorted(g.predecessors(r)) if s != r}
    return self_w, {d: _edge_weight(g, r, d) for d in sorted(g.successors(r)) if d != r}


def recv_weights(topology: Topology, rank: int) -> Tuple[float, Dict[int, float]]:
    """BlueFog ``GetRecvWeights``: (self_weight, {src: w}) that ``rank`` combines with = column
    ``rank`` of W, sources ascending; self_weight 0.0 without a self loop.  ValueError: bad rank."""
    return _rank_weights(topology, rank, incoming=True)


def send_weights(topology: Topology, rank: int) -> Tuple[float, Dict[int, float]]:
    """BlueFog ``GetSendWeights``: (self_weight, {dst: w}) = row ``rank`` of W."""
    return _rank_weights(topology, rank, incoming=False)


def in_neighbors(topology: Topology, rank: int) -> List[int]:
    """Sorted ranks with an edge into ``rank``, self excluded."""
    return list(recv_weights(topology, rank)[1])


def out_neighbors(topology: Topology, rank: int) -> List[int]:
    """Sorted ranks ``rank`` has an edge to, self excluded."""
    return list(send_weights(topology, rank)[1])


def is_regular_graph(topology: Topology) -> bool:
    """BlueFog ``IsRegularGraph``: all ranks have the same networkx degree (in + out, loop 2)."""
    return len({d for _, d in as_graph(topology).degree()}) == 1


def is_topology_equivalent(topo1: Optional[Topology], topo2: Optional[Topology]) -> bool:
    """BlueFog ``IsTopologyEquivalent``: same node count, same edge set, exactly equal weights (no
    isomorphism test).  False if either is None."""
    if topo1 is None or topo2 is None:
        return False
    g1, g2 = as_graph(topo1), as_graph(topo2)
    if g1.number_of_nodes() != g2.number_of_nodes() or set(g1.edges) != set(g2.edges):
        return False
    return all(_edge_weight(g1, i, j) == _edge_weight(g2, i, j) for i, j in g1.edges)


# -- time-varying schedules: infinite generators of ([send ranks], [recv ranks]) for one rank ---
def dynamic_one_peer_send_recv_ranks(topology: Topology, rank: int) -> Iterator[SendRecv]:
    """BlueFog ``GetDynamicOnePeerSendRecvRanks``: one-peer schedule over a base graph.

    Each rank sorts its out-neighbors (self excluded) by clockwise distance (d - r) mod n; at step t
    rank r sends to ``sorted_out[r][t mod outdeg(r)]`` and receives from every rank whose pick at t
    is r (0, 1 or several, ascending).  A rank without out-neighbors sends to nobody.  Unlike
    BlueFog (outdeg - 1) this is right with or without self loops.  On exp-2 with n = 2**m every
    rank receives one value per step, and m steps of 1/2-1/2 averaging give the exact mean.
    """
    g = as_graph(topology)
    n = g.number_of_nodes()
    r = _check_rank(rank, n)
    order = [sorted((d for d in g.successors(s) if d != s), key=lambda d, s=s: (d - s) % n)
             for s in range(n)]

    def step(t: int) -> SendRecv:
        pick = [o[t % len(o)] if o else None for o in order]
        return pick[r:r + 1] if order[r] else [], [s for s in range(n) if s != r and pick[s] == r]
    return (step(t) for t in itertools.count())


def one_peer_exponential_schedule(size: int, rank: int) -> Iterator[SendRecv]:
    """One-peer exp-2: step t sends to rank + 2**(t mod #powers of 2 below n); =
    ``dynamic_one_peer_send_recv_ranks(exponential_two_graph(size), rank)``."""
    n = _check_int(size, "size")
    r = _check_rank(rank, n, "rank")
    if n == 1:
        return iter(lambda: ([], []), None)  # nothing to exchange, forever
    tau = (n - 1).bit_length()  # offsets 1, 2, 4, ... < n, in clockwise order
    # Closed form of the generic one-peer schedule on the exp-2 graph: O(1) per step.
    return (([(r + 2 ** (t % tau)) % n], [(r - 2 ** (t % tau)) % n]) for t in itertools.count())


def one_peer_hypercube_schedule(size: int, rank: int) -> Iterator[SendRecv]:
    """Pairwise exchange along the hypercube's dimensions: at step t rank r sends to and
    receives from r XOR 2**(t mod log2 n) (the pairs of Decent-DP's "one-peer-exp"). For n a
    power of 2, log2(n) steps with weights 1/2 average exactly, as one-peer exp-2 does, and
    with ranks placed on machines in blocks of a power of 2 the first steps stay inside
    machines, so fewer bytes cross them. For other n a rank whose partner would be n or
    more sits the step out (both lists empty: keep its own value, self weight 1)."""
    n = _check_int(size, "size")
    r = _check_rank(rank, n, "rank")
    tau = max(1, (n - 1).bit_length())

    def step(t):
        p = r ^ (1 << (t % tau))
        return ([p], [p]) if p < n and n > 1 else ([], [])
    return (step(t) for t in itertools.count())


def _check_machines(world_size, local_size, self_rank) -> Tuple[int, int, int]:
    world, local = _check_int(world_size, "world_size"), _check_int(local_size, "local_size")
    rank = _check_rank(self_rank, world, "self_rank")
    if world % local:
        raise ValueError(f"world_size {world} is not a multiple of local_size {local}: these "
                         "schedules need a homogeneous placement")
    if world // local < 2:
        raise ValueError(f"machine-level schedules need at least 2 machines, got {world // local} "
                         f"(world_size {world}, local_size {local})")
    return world // local, local, rank


def exp2_dynamic_send_recv_machine_ranks(world_size: int, local_size: int, self_rank: int,
                                         local_rank: int) -> Iterator[SendRecv]:
    """BlueFog ``GetExp2DynamicSendRecvMachineRanks``, for ``hierarchical_neighbor_allreduce``.

    Yields machine ids ([(m + d) mod M], [(m - d) mod M]), m = self_rank // local_size, M machines,
    d = 2**(t mod (floor(log2(M - 1)) + 1)) in integer arithmetic.  ValueError where BlueFog
    asserted: < 2 machines, world_size % local_size != 0, self_rank % local_size != local_rank.
    """
    machines, local, rank = _check_machines(world_size, local_size, self_rank)
    if rank % local != _check_int(local_rank, "local_rank", 0):
        raise ValueError(f"self_rank {rank} % local_size {local} != local_rank {local_rank}: ranks "
                         "must be placed contiguously per machine")
    m, period = rank // local, (machines - 1).bit_length()
    return (([(m + d) % machines], [(m - d) % machines])
            for d in (1 << (t % period) for t in itertools.count()))


def _inner_outer(world_size, local_size, self_rank) -> Tuple[int, int, int, int]:
    machines, local, rank = _check_machines(world_size, local_size, self_rank)
    if local <= 2:
        raise ValueError(f"inner/outer schedules need local_size > 2, got {local}; use "
                         "hierarchical_neighbor_allreduce or dynamic_one_peer_send_recv_ranks")
    return machines, local, rank // local, rank % local


def inner_outer_ring_dynamic_send_recv_ranks(world_size: int, local_size: int,
                                             self_rank: int) -> Iterator[SendRecv]:
    """BlueFog ``GetInnerOuterRingDynamicSendRecvRanks``: at step t local rank o = t mod L of every
    machine sends to local rank o of machine m + 1 (receives from m - 1); the other L - 1 local
    ranks form a ring that skips o.  Global ranks.  ValueError for local_size <= 2, an inhomogeneous
    world or 1 machine (where BlueFog sent to itself)."""
    machines, L, m, lr = _inner_outer(world_size, local_size, self_rank)

    def step(t: int) -> SendRecv:
        out = t % L
        if lr == out:
            return [((m + 1) % machines) * L + lr], [((m - 1) % machines) * L + lr]
        nxt, prv = (lr + 1) % L, (lr - 1) % L
        nxt = (nxt + 1) % L if nxt == out else nxt
        prv = (prv - 1) % L if prv == out else prv
        return [m * L + nxt], [m * L + prv]
    return (step(t) for t in itertools.count())


def inner_outer_expo2_dynamic_send_recv_ranks(world_size: int, local_size: int,
                                              self_rank: int) -> Iterator[SendRecv]:
    """BlueFog ``GetInnerOuterExpo2DynamicSendRecvRanks``: at step t local rank o = t mod L goes to
    machine m + 2**(t mod (floor(log2(M-1)) + 1)) (receives from m minus that); the others hop
    h = 2**(t mod (floor(log2(L-2)) + 1)) on the ring of non-outgoing local ranks (h + 1 if the hop
    reaches or passes o; mirrored for receiving).  As in BlueFog, some local ranks never meet their
    counterpart on some machines.  Errors as the ring version (BlueFog crashed on 1 machine)."""
    machines, L, m, lr = _inner_outer(world_size, local_size, self_rank)
    out_period, in_period = (machines - 1).bit_length(), (L - 2).bit_length()

    def step(t: int) -> SendRecv:
        out = t % L
        if lr == out:
            d = 1 << (t % out_period)
            return [((m + d) % machines) * L + lr], [((m - d) % machines) * L + lr]
        h = 1 << (t % in_period)
        fwd = h + 1 if h >= (out - lr) % L else h  # skip the outgoing rank o
        bwd = h + 1 if h >= (lr - out) % L else h
        return [m * L + (lr + fwd) % L], [m * L + (lr - bwd) % L]
    return (step(t) for t in itertools.count())


def schedule_mixing_matrix(send_recv_per_rank: Sequence[Sequence], size: int) -> np.ndarray:
    """Mixing matrix (float64, (n, n)) of one step of a dynamic schedule.

    ``send_recv_per_rank[r]`` = rank r's ``(send_ranks, recv_ranks, ...)`` (extra items ignored).
    Weights: BlueFog's uniform dynamic rule, receiver j gives itself and each source
    1/(1 + #recv_j), so W is column stochastic; doubly stochastic when every rank sends to and
    receives from the same number of ranks (one-peer exp-2, n = 2**m: all 1/2).  ValueError for a
    wrong length, out-of-range, self or duplicate ranks, or an inconsistent step (a sends to b but b
    does not receive from a, or the reverse).
    """
    n = _check_int(size)
    steps = list(send_recv_per_rank)
    if len(steps) != n:
        raise ValueError(f"need one (send_ranks, recv_ranks) per rank: got {len(steps)} for {n}")
    sends, recvs = [], []
    for r, step in enumerate(steps):
        for name, ranks, dest in (("send", step[0], sends), ("recv", step[1], recvs)):
            ranks = [_check_rank(x, n, f"rank {r} {name} rank") for x in ranks]
            if r in ranks or len(set(ranks)) != len(ranks):
                raise ValueError(f"rank {r}: {name} ranks {ranks} contain itself or duplicates")
            dest.append(set(ranks))
    mismatch = ({(a, b) for a in range(n) for b in sends[a]}
                ^ {(a, b) for b in range(n) for a in recvs[b]})
    if mismatch:
        a, b = min(mismatch)
        raise ValueError(f"inconsistent step: rank {a} send ranks {sorted(sends[a])}, "
                         f"rank {b} recv ranks {sorted(recvs[b])}")
    w = np.zeros((n, n))
    for j in range(n):
        w[list(recvs[j]) + [j], j] = 1.0 / (1 + len(recvs[j]))
    return w


def schedule_matrices(schedules: Sequence[Iterator], steps: int) -> List[np.ndarray]:
    """Advance one schedule per rank (``schedules[r]`` for rank r) ``steps`` times; returns the
    :func:`schedule_mixing_matrix` of each step (single-process simulation aid)."""
    return [schedule_mixing_matrix([next(g) for g in schedules], len(schedules))
            for _ in range(steps)]


# -- Base-(k+1) graph (Takezawa et al., NeurIPS 2023); its construction is in shoal/_base_graph.py
def base_k_plus_1_matrices(size: int, k: int) -> List[np.ndarray]:
    """Base-(k+1) graph (Takezawa, Sato, Bao, Niwa, Yamada, "Beyond Exponential Graph:
    Communication-Efficient Topologies for Decentralized Learning via Finite-time Convergence",
    NeurIPS 2023).

    T float64 (n, n) matrices, each symmetric, doubly stochastic, non-negative, <= k neighbors per
    rank, with W_1 W_2 ... W_T = J = 11^T/n (up to rounding) for ANY n.  Round counts match the
    authors' code (algorithms.md §2.2: n=25 takes 9, 6, 5 rounds for k = 1, 2, 3; n = 2**m, k = 1:
    m).  n = 1: [[[1.]]].  Cycle the list for a periodic schedule.  ValueError for size or k < 1.
    """
    n, k = _check_int(size), _check_int(k, "k")
    mats = []
    for step in _base_steps(n, k):
        w = np.eye(n)
        for (i, j), v in step.items():
            w[i, j] = v
        mats.append(w)
    return mats


def base_k_plus_1_schedule(size: int, k: int, rank: int
                           ) -> Iterator[Tuple[List[int], List[int], float, Dict[int, float]]]:
    """Per-rank view of :func:`base_k_plus_1_matrices`, cycled forever.

    Yields ``(send_ranks, recv_ranks, self_weight, src_weights)``: the first two as the other
    schedules (equal here: the graphs are symmetric), then the receive weights for
    ``neighbor_allreduce(self_weight=, src_weights=, dst_weights=send_ranks)``; they are not
    uniform, so :func:`schedule_mixing_matrix` does not apply.  Idle step: ([], [], 1.0, {}).
    ValueError for bad size, k or rank.
    """
    n, k = _check_int(size), _check_int(k, "k")
    r = _check_rank(rank, n)
    plan = []
    for step in _base_steps(n, k):
        src = {i: v for (i, j), v in sorted(step.items()) if j == r and i != r}
        send = sorted(j for (i, j) in step if i == r and j != r)
        plan.append((send, sorted(src), step.get((r, r), 1.0), src))
    return ((list(s), list(rc), w, dict(src)) for s, rc, w, src in itertools.cycle(plan))


# -- analysis --------------------------------------------------------------------------------------
def is_row_stochastic(topology: Topology, tol: float = 1e-12) -> bool:
    """Entries >= -tol and row sums 1 within tol (each rank's outgoing weights: mass preserved)."""
    w = mixing_matrix(topology)
    return bool(w.min() >= -tol and np.all(np.abs(w.sum(axis=1) - 1.0) <= tol))


def is_column_stochastic(topology: Topology, tol: float = 1e-12) -> bool:
    """Entries >= -tol and column sums 1 within tol (each receiver's weights: consensus)."""
    return is_row_stochastic(mixing_matrix(topology).T, tol)


def is_doubly_stochastic(topology: Topology, tol: float = 1e-12) -> bool:
    """Both :func:`is_row_stochastic` and :func:`is_column_stochastic`."""
    w = mixing_matrix(topology)
    return is_row_stochastic(w, tol) and is_column_stochastic(w, tol)


def spectral_gap(topology: Topology, method: str = "norm") -> float:
    """Spectral gap 1 - rho (algorithms.md §2.2).

    "norm" (default, algorithms.md): rho = ||W - J||_2, largest singular value (one-step contraction
    of disagreement, D-SGD theory).  "eig": rho = max |eig(W - J)| = second largest eigenvalue
    modulus of a row- or column-stochastic W (asymptotic rate).  Equal for normal W (symmetric or
    circulant: all generators here).  Fully connected: 1; bidirectional ring, n >= 3:
    1 - (1 + 2 cos(2 pi / n)) / 3.  ValueError for another method.
    """
    w = mixing_matrix(topology)
    d = w - 1.0 / w.shape[0]
    if method == "norm":
        rho = np.linalg.norm(d, 2)
    elif method == "eig":
        rho = np.max(np.abs(np.linalg.eigvals(d)))
    else:
        raise ValueError(f"method must be 'norm' or 'eig', got {method!r}")
    return float(1.0 - rho)


def _products(matrices: Sequence[Topology]) -> Iterator[Tuple[int, np.ndarray]]:
    # P_t = W_1 ... W_t: with x_new = W^T x, t steps apply P_t^T = W~_t ... W~_1 (W~ = W^T, the
    # row convention of algorithms.md §2.2); ||P_t - J|| is the same either way.
    p = None
    for t, m in enumerate(matrices, 1):
        w = mixing_matrix(m)
        if p is not None and w.shape != p.shape:
            raise ValueError(f"matrix {t} has shape {w.shape}, expected {p.shape}")
        p = w if p is None else p @ w
        yield t, p


def effective_rate(matrices: Sequence[Topology]) -> float:
    """||P_T - J||_2 ** (1/T), P_T the T-step operator: per-step contraction of a time-varying
    schedule (algorithms.md §2.2 rho_eff); 0 if it averages exactly.  ValueError if empty."""
    t, p = 0, None
    for t, p in _products(matrices):
        pass
    if p is None:
        raise ValueError("need at least one matrix")
    return float(np.linalg.norm(p - 1.0 / p.shape[0], 2) ** (1.0 / t))


def averages_exactly(matrices: Sequence[Topology],
                     tol: float = 1e-12) -> Tuple[bool, Optional[int]]:
    """(True, T) for the smallest T whose T-step operator equals J = 11^T/n within ``tol`` (max
    absolute entry); (False, None) if no prefix does."""
    for t, p in _products(matrices):
        if np.max(np.abs(p - 1.0 / p.shape[0])) <= tol:
            return True, t
    return False, None


# -- BlueFog names, with BlueFog's argument names too (`bf.GetRecvWeights(topo=g, rank=0)`), for
# one-import migration.  Functions whose arguments are named alike are the same objects.
(ExponentialGraph, ExponentialTwoGraph, SymmetricExponentialGraph, RingGraph, MeshGrid2DGraph,
 StarGraph, FullyConnectedGraph, IsTopologyEquivalent, GetExp2DynamicSendRecvMachineRanks,
 GetInnerOuterRingDynamicSendRecvRanks, GetInnerOuterExpo2DynamicSendRecvRanks) = (
    exponential_graph, exponential_two_graph, symmetric_exponential_graph, ring_graph,
    mesh_grid_2d_graph, star_graph, fully_connected_graph, is_topology_equivalent,
    exp2_dynamic_send_recv_machine_ranks, inner_outer_ring_dynamic_send_recv_ranks,
    inner_outer_expo2_dynamic_send_recv_ranks)


def GetRecvWeights(topo: Topology, rank: int) -> Tuple[float, Dict[int, float]]:
    """BlueFog ``GetRecvWeights``; see :func:`recv_weights`."""
    return recv_weights(topo, rank)


def GetSendWeights(topo: Topology, rank: int) -> Tuple[float, Dict[int, float]]:
    """BlueFog ``GetSendWeights``; see :func:`send_weights`."""
    return send_weights(topo, rank)


def IsRegularGraph(topo: Topology) -> bool:
    """BlueFog ``IsRegularGraph``; see :func:`is_regular_graph`."""
    return is_regular_graph(topo)


def GetDynamicOnePeerSendRecvRanks(topo: Topology, self_rank: int) -> Iterator[SendRecv]:
    """BlueFog ``GetDynamicOnePeerSendRecvRanks``; see :func:`dynamic_one_peer_send_recv_ranks`."""
    return dynamic_one_peer_send_recv_ranks(topo, self_rank)


# The names `bluefog.torch` re-exports from its topology_util (shoal and shoal.torch do too).
BLUEFOG_NAMES = (
    "ExponentialGraph", "ExponentialTwoGraph", "SymmetricExponentialGraph", "RingGraph",
    "MeshGrid2DGraph", "StarGraph", "FullyConnectedGraph", "IsTopologyEquivalent", "IsRegularGraph",
    "GetRecvWeights", "GetSendWeights", "GetDynamicOnePeerSendRecvRanks",
    "GetExp2DynamicSendRecvMachineRanks", "GetInnerOuterRingDynamicSendRecvRanks",
    "GetInnerOuterExpo2DynamicSendRecvRanks")

__all__ = sorted(name for name, obj in list(globals().items())
                 if not name.startswith("_") and getattr(obj, "__module__", None) == __name__)
