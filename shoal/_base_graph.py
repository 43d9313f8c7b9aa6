"""The steps of the Base-(k+1) graph (Takezawa, Sato, Bao, Niwa, Yamada, "Beyond Exponential
Graph: Communication-Efficient Topologies for Decentralized Learning via Finite-time Convergence",
NeurIPS 2023): sparse mixing steps whose product is the exact average for any n.  The public
views are `shoal.topology.base_k_plus_1_matrices` and `base_k_plus_1_schedule`.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

Step = Dict[Tuple[int, int], float]  # sparse mixing step: (src, dst) -> weight


def _greedy_factors(n: int, k: int) -> Optional[List[int]]:
    # n as factors in [2, k+1], largest first (as the authors), ascending; None if not (k+1)-smooth
    factors = []
    for f in range(k + 1, 1, -1):
        while n % f == 0:
            factors.append(f)
            n //= f
    return factors[::-1] if n == 1 else None


def _hyper_hypercube(nodes: List[int], k: int) -> List[Step]:
    """k-peer hyper-hypercube, node count f_1 ... f_L (mixed radix): step l averages each clique of
    nodes differing only in digit l (weight 1/f_l, degree f_l - 1 <= k); exact after L steps."""
    steps, stride, m = [], 1, len(nodes)
    for f in (_greedy_factors(m, k) if m > 1 else []):
        w, step = 1.0 / f, {}
        for idx in range(m):
            first = idx - ((idx // stride) % f) * stride
            for t in range(f):
                step[(nodes[first + t * stride], nodes[idx])] = w
        steps.append(step)
        stride *= f
    return steps


def _parallel(schedules: List[List[Step]]) -> List[Step]:
    # schedules on disjoint node sets side by side; finished ones idle (self weight 1)
    out: List[Step] = [{} for _ in range(max((len(s) for s in schedules), default=0))]
    for sched in schedules:
        for t, step in enumerate(sched):
            out[t].update(step)
    return out


def _simple_base(nodes: List[int], k: int) -> List[Step]:
    """Simple Base-(k+1) graph.  Write n = sum_l a_l (k+1)**p_l (base-(k+1) digits, p_0 > p_1 ...);
    group V_l = a_l (k+1)**p_l consecutive nodes, split into a_l subgroups of (k+1)**p_l.
    (1) Every V_l averages internally (hyper-hypercube, all in parallel).
    (2) Round s = 0..L-2: every node of the tail V_{>s} links to one node in each subgroup of V_s,
        weight n_s / (N_s a_s) with N_s = |V_{>=s}|, self 1 - n_s / N_s (degree a_s <= k; the tail
        fits: |V_{>s}| < (k+1)**p_s).  Each subgroup then averages (p_s rounds, overlapping later
        rounds).  All subgroups got the same tail mass, so V_s ends at the global mean; the tail
        carries V_s's share n_s / N_s on.  Exact after len(1) + p_0 + 1 rounds.
    The authors' optional edges among unmatched V_s nodes average equal values and are omitted."""
    n = len(nodes)
    if n == 1 or _greedy_factors(n, k) is not None:
        return _hyper_hypercube(nodes, k)
    b, p = k + 1, 0
    while b ** (p + 1) <= n:
        p += 1
    digits, rest = [], n
    for e in range(p, -1, -1):
        if rest // b ** e:
            digits.append((rest // b ** e, e))
            rest %= b ** e
    sizes = [a * b ** e for a, e in digits]
    groups = [nodes[sum(sizes[:l]):sum(sizes[:l + 1])] for l in range(len(sizes))]
    phase2: List[Step] = [{} for _ in range(p + 1)]
    for s, ((a_s, e_s), group) in enumerate(zip(digits[:-1], groups)):
        step, sub, tail = phase2[s], b ** e_s, sum(sizes[s:])
        w = sizes[s] / (tail * a_s)
        free = [group[c * sub:(c + 1) * sub] for c in range(a_s)]
        for i in (x for g in groups[s + 1:] for x in g):
            step[(i, i)] = 1.0 - sizes[s] / tail
            for c in range(a_s):
                j = free[c].pop()
                step[(i, j)] = step[(j, i)] = w
                step[(j, j)] = 1.0 - w
        for c in range(a_s):
            for t, st in enumerate(_hyper_hypercube(group[c * sub:(c + 1) * sub], k)):
                phase2[s + 1 + t].update(st)
    return _parallel([_hyper_hypercube(g, k) for g in groups]) + phase2


def base_steps(n: int, k: int) -> List[Step]:
    """The shorter of: the simple Base-(k+1) graph on all n nodes; or, with n = s * r and s the
    (k+1)-smooth part, simple graphs on s blocks of r nodes, then hyper-hypercubes across the blocks
    (ties go to the latter, as the authors' code)."""
    nodes, smooth, r = list(range(n)), 1, n
    best = _simple_base(nodes, k)
    for f in range(2, k + 2):
        while r % f == 0:
            r, smooth = r // f, smooth * f
    if smooth > 1 and r > 1:
        blocks = [nodes[r * i:r * (i + 1)] for i in range(smooth)]
        split = (_parallel([_simple_base(bl, k) for bl in blocks])
                 + _parallel([_hyper_hypercube([bl[j] for bl in blocks], k) for j in range(r)]))
        if len(split) <= len(best):
            best = split
    return best or [{}]  # n = 1: one trivial step
