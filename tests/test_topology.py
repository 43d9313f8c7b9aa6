"""Single-process tests of shoal.topology (generators, conversions, schedules, analysis).

Reference values: algorithms.md §2.2 (spectral gaps, one-peer contraction, Base-(k+1) round counts)
and bluefog-semantics.md §2 (generator edges and weights, schedule examples).
"""
import math
import random

import networkx as nx
import numpy as np
import pytest

from shoal import topology as topo

STATIC_GENERATORS = [
    ("exp2", lambda n: topo.exponential_two_graph(n)),
    ("exp3", lambda n: topo.exponential_graph(n, base=3)),
    ("symexp4", lambda n: topo.symmetric_exponential_graph(n)),
    ("symexp2", lambda n: topo.symmetric_exponential_graph(n, base=2)),
    ("ring", lambda n: topo.ring_graph(n)),
    ("ring_left", lambda n: topo.ring_graph(n, 1)),
    ("ring_right", lambda n: topo.ring_graph(n, 2)),
    ("mesh", lambda n: topo.mesh_grid_2d_graph(n)),
    ("star", lambda n: topo.star_graph(n)),
    ("star_last", lambda n: topo.star_graph(n, center_rank=n - 1)),
    ("full", lambda n: topo.fully_connected_graph(n)),
]


def _out(g, r):
    return set(topo.out_neighbors(g, r))


def _step(gens):
    return [next(g) for g in gens]


def _assert_consistent(step):
    """Whenever a sends to b, b receives from a, and vice versa."""
    for a, (send, recv) in enumerate(step):
        for b in send:
            assert a in step[b][1], (a, b, step)
        for b in recv:
            assert a in step[b][0], (a, b, step)


# ---------------------------------------------------------------------------- static generators
def test_exponential_graph_n8():
    g = topo.exponential_graph(8)
    assert _out(g, 0) == {1, 2, 4}
    assert topo.in_neighbors(g, 0) == [4, 6, 7]
    for i, j, w in g.edges(data="weight"):
        assert type(w) is float and w == 1 / 4
    assert all(g.has_edge(i, i) for i in range(8))


def test_exponential_graph_n12():
    g = topo.exponential_two_graph(12)
    assert _out(g, 0) == {1, 2, 4, 8}
    assert {w for _, _, w in g.edges(data="weight")} == {1 / 5}
    assert topo.is_topology_equivalent(g, topo.exponential_graph(12, 2))


def test_exponential_graph_exact_power_test():
    # BlueFog's float-log isPowerOf(243, 3) was False and dropped this edge.
    g = topo.exponential_graph(300, base=3)
    assert _out(g, 0) == {1, 3, 9, 27, 81, 243}
    assert g.has_edge(10, 253) and g[0][243]["weight"] == 1 / 7


def test_symmetric_exponential_graph():
    assert _out(topo.symmetric_exponential_graph(8), 0) == {1, 4, 7}
    assert _out(topo.symmetric_exponential_graph(12), 0) == {1, 4, 8, 11}
    g = topo.symmetric_exponential_graph(12)
    assert {w for _, _, w in g.edges(data="weight")} == {1 / 5}
    assert np.array_equal(topo.mixing_matrix(g), topo.mixing_matrix(g).T)


def test_ring_graph():
    assert np.array_equal(topo.mixing_matrix(topo.ring_graph(1)), [[1.0]])
    for style in (0, 1, 2):
        assert np.array_equal(topo.mixing_matrix(topo.ring_graph(2, style)), np.full((2, 2), 0.5))
    g = topo.ring_graph(5)
    assert _out(g, 0) == {1, 4} and g[0][0]["weight"] == 1 / 3 == g[0][4]["weight"]
    assert _out(topo.ring_graph(5, 1), 0) == {4} and _out(topo.ring_graph(5, 2), 0) == {1}
    assert topo.ring_graph(5, 2)[0][1]["weight"] == 0.5


def test_star_graph():
    w = topo.mixing_matrix(topo.star_graph(4, center_rank=2))
    expected = np.diag([0.75, 0.75, 0.25, 0.75])
    expected[2, :] = expected[:, 2] = 0.25
    assert np.array_equal(w, expected)
    assert np.array_equal(topo.mixing_matrix(topo.star_graph(1)), [[1.0]])


def test_fully_connected_graph():
    w = topo.mixing_matrix(topo.fully_connected_graph(6))
    assert np.array_equal(w, np.full((6, 6), 1 / 6))


def test_mesh_grid_shape_and_weights():
    g = topo.mesh_grid_2d_graph(12)  # default shape (3, 4)
    assert _out(g, 0) == {1, 4} and _out(g, 5) == {1, 4, 6, 9}
    assert _out(topo.mesh_grid_2d_graph(7), 3) == {2, 4}  # prime: a line
    assert _out(topo.mesh_grid_2d_graph(12, shape=(2, 6)), 0) == {1, 6}
    # corner (deg 3 incl. self) next to an edge node (deg 4): weight 1/4
    assert g[0][1]["weight"] == 1 / 4 and g[5][6]["weight"] == 1 / 5
    assert g[0][0]["weight"] == pytest.approx(1 - 2 / 4, abs=1e-15)


@pytest.mark.parametrize("name,make", STATIC_GENERATORS, ids=[s[0] for s in STATIC_GENERATORS])
def test_generators_doubly_stochastic(name, make):
    for n in range(1, 18):
        g = make(n)
        assert sorted(g.nodes) == list(range(n))
        assert all(g.has_edge(i, i) for i in range(n)), (name, n)
        w = topo.mixing_matrix(g)
        assert w.dtype == np.float64 and w.shape == (n, n)
        assert (w >= 0).all() and topo.is_doubly_stochastic(g, tol=1e-14), (name, n)


def test_metropolis_hastings_random_graphs():
    rng = random.Random(0)
    for n in (1, 2, 5, 9, 16):
        und = nx.gnp_random_graph(n, 0.4, seed=rng.randint(0, 10**6))
        g = topo.metropolis_hastings_weights(und)
        w = topo.mixing_matrix(g)
        assert np.array_equal(w, w.T) and topo.is_doubly_stochastic(w, tol=1e-14)
        deg = [und.degree(i) + 1 for i in range(n)]
        for i, j in und.edges():
            assert w[i, j] == 1 / max(deg[i], deg[j])
        # the matrix and directed forms give the same result
        a = nx.to_numpy_array(und)
        assert topo.is_topology_equivalent(topo.metropolis_hastings_weights(a), g)
    with pytest.raises(TypeError):
        topo.metropolis_hastings_weights([[0, 1], [1, 0]])


# ---------------------------------------------------------------------------- conversions / views
def test_matrix_round_trip_and_views():
    g = topo.exponential_graph(8)
    w = topo.mixing_matrix(g)
    assert topo.is_topology_equivalent(topo.from_mixing_matrix(w), g)
    assert topo.as_graph(g) is g
    expected_recv = (0.25, {4: 0.25, 6: 0.25, 7: 0.25})
    assert topo.recv_weights(g, 0) == expected_recv == topo.recv_weights(w, 0)
    assert topo.send_weights(g, 0) == (0.25, {1: 0.25, 2: 0.25, 4: 0.25}) == topo.send_weights(w, 0)
    assert topo.GetRecvWeights(g, 0) == expected_recv
    assert topo.in_neighbors(w, 0) == [4, 6, 7] and topo.out_neighbors(w, 0) == [1, 2, 4]
    # directed, non-symmetric weights: recv = column, send = row
    m = np.array([[0.5, 0.25, 0.0], [0.5, 0.5, 1.0], [0.0, 0.25, 0.0]])
    assert topo.recv_weights(m, 1) == (0.5, {0: 0.25, 2: 0.25})
    assert topo.send_weights(m, 1) == (0.5, {0: 0.5, 2: 1.0})
    assert topo.recv_weights(m, 2) == (0.0, {1: 1.0})


def test_conversion_errors():
    with pytest.raises(TypeError):
        topo.as_graph([[1.0]])
    with pytest.raises(TypeError):
        topo.as_graph(nx.Graph([(0, 1)]))
    with pytest.raises(ValueError):
        topo.as_graph(np.ones((2, 3)))
    with pytest.raises(ValueError):
        topo.mixing_matrix(nx.DiGraph([(1, 2)]))
    with pytest.raises(ValueError):
        topo.from_mixing_matrix(np.array([[np.nan]]))
    with pytest.raises(ValueError):
        topo.recv_weights(topo.ring_graph(4), 4)


def test_regular_and_equivalence():
    assert topo.is_regular_graph(topo.exponential_graph(12))
    assert not topo.is_regular_graph(topo.star_graph(5))
    assert topo.IsRegularGraph(topo.ring_graph(7))
    g = topo.ring_graph(6)
    assert topo.is_topology_equivalent(g, topo.mixing_matrix(g))
    assert not topo.is_topology_equivalent(g, None) and not topo.IsTopologyEquivalent(None, g)
    assert not topo.is_topology_equivalent(g, topo.ring_graph(7))
    assert not topo.is_topology_equivalent(g, topo.ring_graph(6, 1))
    h = topo.ring_graph(6)
    h[0][1]["weight"] = 0.3333
    assert not topo.is_topology_equivalent(g, h)


# ---------------------------------------------------------------------------- one-peer schedules
def test_one_peer_bluefog_example():
    gen = topo.GetDynamicOnePeerSendRecvRanks(topo.ExponentialTwoGraph(8), 0)
    steps = [next(gen) for _ in range(4)]
    assert steps == [([1], [7]), ([2], [6]), ([4], [4]), ([1], [7])]


@pytest.mark.parametrize("self_loops", [True, False])
def test_one_peer_exponential_exact(self_loops):
    for n in (2, 4, 8, 16):
        base = topo.exponential_two_graph(n)
        if not self_loops:
            base.remove_edges_from([(i, i) for i in range(n)])
        tau = int(math.log2(n))
        gens = [topo.dynamic_one_peer_send_recv_ranks(base, r) for r in range(n)]
        mats = []
        for _ in range(2 * tau):
            step = _step(gens)
            _assert_consistent(step)
            assert all(len(s) == 1 and len(r) == 1 for s, r in step)
            mats.append(topo.schedule_mixing_matrix(step, n))
        for phase in range(tau):  # exact from every phase, with float64 equality
            prod = np.linalg.multi_dot(mats[phase:phase + tau] + [np.eye(n)])
            assert np.array_equal(prod, np.full((n, n), 1 / n)), (n, phase)
            assert topo.averages_exactly(mats[phase:]) == (True, tau)


def test_one_peer_matches_with_and_without_self_loop():
    g = topo.exponential_graph(12, base=3)
    h = g.copy()
    h.remove_edges_from([(i, i) for i in range(12)])
    for r in range(12):
        a = topo.dynamic_one_peer_send_recv_ranks(g, r)
        b = topo.dynamic_one_peer_send_recv_ranks(h, r)
        assert [next(a) for _ in range(7)] == [next(b) for _ in range(7)]


def test_one_peer_non_power_of_two_contraction():
    # algorithms.md §2.2: average contraction per step of one-peer exp-2
    for n, rate in [(6, 0.60), (12, 0.68), (24, 0.73), (48, 0.77), (100, 0.79)]:
        tau = len(topo.out_neighbors(topo.exponential_two_graph(n), 0))
        gens = [topo.one_peer_exponential_schedule(n, r) for r in range(n)]
        mats = topo.schedule_matrices(gens, tau)
        assert round(topo.effective_rate(mats), 2) == rate
        assert topo.averages_exactly(mats) == (False, None)
        assert all(topo.is_doubly_stochastic(m) for m in mats)


def test_one_peer_rank_without_out_neighbors():
    gens = [topo.dynamic_one_peer_send_recv_ranks(np.array([[1.0, 0.0], [0.5, 0.5]]).T, r)
            for r in range(2)]
    # edge 0 -> 1 only (transposed matrix): rank 1 never sends
    assert _step(gens) == [([1], []), ([], [0])]


def test_schedule_mixing_matrix_errors_and_weights():
    w = topo.schedule_mixing_matrix([([1], []), ([2], [0]), ([], [1])], 3)
    assert np.array_equal(w, [[1.0, 0.5, 0.0], [0.0, 0.5, 0.5], [0.0, 0.0, 0.5]])
    assert topo.is_column_stochastic(w) and not topo.is_row_stochastic(w)
    with pytest.raises(ValueError, match="inconsistent"):
        topo.schedule_mixing_matrix([([1], []), ([], [])], 2)
    with pytest.raises(ValueError, match="inconsistent"):
        topo.schedule_mixing_matrix([([], []), ([], [0])], 2)
    with pytest.raises(ValueError):
        topo.schedule_mixing_matrix([([0], [0]), ([], [])], 2)
    with pytest.raises(ValueError):
        topo.schedule_mixing_matrix([([1], [])], 2)
    with pytest.raises(ValueError):
        topo.schedule_mixing_matrix([([5], []), ([], [])], 2)


# ---------------------------------------------------------------------------- Base-(k+1)
def test_base_k_plus_1_exact_small_n():
    for n in range(1, 21):
        for k in range(1, 5):
            mats = topo.base_k_plus_1_matrices(n, k)
            ok, steps = topo.averages_exactly(mats, tol=1e-12)
            assert ok and steps <= len(mats), (n, k)
            for w in mats:
                assert w.dtype == np.float64 and (w >= 0).all() and np.array_equal(w, w.T)
                assert topo.is_doubly_stochastic(w, tol=1e-14)
                offdiag = (w != 0) & ~np.eye(n, dtype=bool)
                assert offdiag.sum(axis=0).max() <= k and offdiag.sum(axis=1).max() <= k, (n, k)


def test_base_k_plus_1_round_counts():
    # algorithms.md §2.2 table (authors' code)
    table = {1: {6: 4, 12: 5, 24: 6, 25: 9, 48: 7, 96: 8, 100: 11},
             2: {6: 2, 12: 3, 24: 4, 25: 6, 48: 5, 96: 6, 100: 8},
             3: {6: 2, 12: 2, 24: 3, 25: 5, 48: 3, 96: 4, 100: 6, 64: 3, 128: 4}}
    for k, row in table.items():
        for n, rounds in row.items():
            mats = topo.base_k_plus_1_matrices(n, k)
            assert len(mats) == rounds, (n, k)
            assert topo.averages_exactly(mats)[0] and topo.effective_rate(mats) ** rounds < 1e-12
    for m in range(1, 7):
        assert len(topo.base_k_plus_1_matrices(2 ** m, 1)) == m


def test_base_k_plus_1_schedule_matches_matrices():
    for n, k in [(7, 1), (13, 2), (25, 3)]:
        mats = topo.base_k_plus_1_matrices(n, k)
        gens = [topo.base_k_plus_1_schedule(n, k, r) for r in range(n)]
        for t in range(len(mats) + 2):  # cycles
            step = _step(gens)
            _assert_consistent([s[:2] for s in step])
            w = np.zeros((n, n))
            for r, (send, recv, self_w, src) in enumerate(step):
                assert send == recv == sorted(src)
                w[r, r] = self_w
                for s, v in src.items():
                    w[s, r] = v
            assert np.array_equal(w, mats[t % len(mats)]), (n, k, t)
    assert next(topo.base_k_plus_1_schedule(1, 2, 0)) == ([], [], 1.0, {})
    with pytest.raises(ValueError):
        topo.base_k_plus_1_matrices(5, 0)
    with pytest.raises(ValueError):
        topo.base_k_plus_1_schedule(5, 1, 5)


# ---------------------------------------------------------------------------- machine schedules
MACHINE_SIZES = [(6, 3), (8, 4), (12, 3), (12, 4), (20, 5), (24, 6), (64, 4), (40, 8)]


@pytest.mark.parametrize("world,local", MACHINE_SIZES)
def test_inner_outer_schedules_consistent(world, local):
    for make in (topo.inner_outer_ring_dynamic_send_recv_ranks,
                 topo.inner_outer_expo2_dynamic_send_recv_ranks):
        gens = [make(world, local, r) for r in range(world)]
        for t in range(3 * local):
            step = _step(gens)
            _assert_consistent(step)
            assert sorted(s[0][0] for s in step) == list(range(world))  # a permutation
            for r, (send, _) in enumerate(step):
                outside = r % local == t % local
                assert (send[0] // local != r // local) == outside and send[0] != r
            assert topo.is_doubly_stochastic(topo.schedule_mixing_matrix(step, world))


def test_inner_outer_ring_values():
    gen = topo.GetInnerOuterRingDynamicSendRecvRanks(12, 4, 1)  # machine 0, local rank 1
    assert [next(gen) for _ in range(3)] == [([2], [3]), ([5], [9]), ([3], [0])]


@pytest.mark.parametrize("world,local", MACHINE_SIZES + [(4, 1), (6, 2), (10, 1)])
def test_exp2_machine_schedule(world, local):
    machines = world // local
    gens = [topo.exp2_dynamic_send_recv_machine_ranks(world, local, m * local, 0)
            for m in range(machines)]
    for _ in range(6):
        step = _step(gens)
        _assert_consistent(step)
    gen = topo.GetExp2DynamicSendRecvMachineRanks(world, local, local, 0)  # machine 1
    period = (machines - 1).bit_length()
    dists = [1 << (t % period) for t in range(5)]
    assert [next(gen) for _ in range(5)] == [([(1 + d) % machines], [(1 - d) % machines])
                                             for d in dists]


def test_machine_schedule_errors():
    with pytest.raises(ValueError, match="at least 2 machines"):
        topo.exp2_dynamic_send_recv_machine_ranks(4, 4, 0, 0)
    with pytest.raises(ValueError, match="local_rank"):
        topo.exp2_dynamic_send_recv_machine_ranks(8, 4, 5, 0)
    with pytest.raises(ValueError, match="multiple"):
        topo.exp2_dynamic_send_recv_machine_ranks(10, 4, 0, 0)
    for make in (topo.inner_outer_ring_dynamic_send_recv_ranks,
                 topo.inner_outer_expo2_dynamic_send_recv_ranks):
        with pytest.raises(ValueError, match="at least 2 machines"):
            make(4, 4, 0)
        with pytest.raises(ValueError, match="local_size > 2"):
            make(8, 2, 0)
        with pytest.raises(ValueError):
            make(8, 4, 8)


# ---------------------------------------------------------------------------- analysis
def test_spectral_gap():
    for n in range(1, 11):
        assert topo.spectral_gap(topo.fully_connected_graph(n)) == 1.0
    for n in range(3, 40):
        closed = 1 - (1 + 2 * math.cos(2 * math.pi / n)) / 3
        for method in ("norm", "eig"):
            assert topo.spectral_gap(topo.ring_graph(n), method) == pytest.approx(closed, abs=1e-12)
    for n in range(4, 40, 2):  # algorithms.md §2.7 item 2
        expected = 2 / (2 + (n - 1).bit_length() - 1)
        gap = topo.spectral_gap(topo.exponential_two_graph(n))
        assert gap == pytest.approx(expected, abs=1e-12)
    # table values, algorithms.md §2.2
    assert round(topo.spectral_gap(topo.ring_graph(8)), 5) == 0.19526
    assert round(topo.spectral_gap(topo.mesh_grid_2d_graph(16)), 5) == 0.13136
    assert round(topo.spectral_gap(topo.mesh_grid_2d_graph(64)), 5) == 0.03230
    with pytest.raises(ValueError):
        topo.spectral_gap(topo.ring_graph(4), method="svd")


def test_stochasticity_checks():
    w = np.array([[0.5, 0.5], [0.25, 0.75]])
    assert topo.is_row_stochastic(w) and not topo.is_column_stochastic(w)
    assert not topo.is_doubly_stochastic(w) and topo.is_column_stochastic(w.T)
    assert not topo.is_row_stochastic(np.array([[1.5, -0.5], [0.5, 0.5]]))
    assert topo.is_row_stochastic(np.array([[1.0 + 1e-9]]), tol=1e-8)
    assert not topo.is_row_stochastic(np.array([[1.0 + 1e-9]]))


def test_effective_rate_and_averages_exactly():
    ring = topo.mixing_matrix(topo.ring_graph(8))
    assert topo.effective_rate([ring]) == pytest.approx(1 - topo.spectral_gap(ring), abs=1e-12)
    assert topo.averages_exactly([ring] * 5) == (False, None)
    assert topo.averages_exactly([topo.fully_connected_graph(5)]) == (True, 1)
    with pytest.raises(ValueError):
        topo.effective_rate([])
    with pytest.raises(ValueError):
        topo.averages_exactly([np.eye(2), np.eye(3)])


# ---------------------------------------------------------------------------- errors / aliases
def test_generator_errors():
    with pytest.raises(ValueError):
        topo.exponential_graph(0)
    with pytest.raises(ValueError):
        topo.exponential_graph(8, base=1)
    with pytest.raises(TypeError):
        topo.exponential_graph(8.0)
    with pytest.raises(ValueError):
        topo.ring_graph(8, connect_style=3)
    with pytest.raises(ValueError):
        topo.star_graph(4, center_rank=4)
    with pytest.raises(ValueError):
        topo.mesh_grid_2d_graph(12, shape=(5, 3))


def test_bluefog_aliases():
    assert topo.ExponentialGraph is topo.exponential_graph
    assert topo.SymmetricExponentialGraph(12, 4).number_of_edges() == 12 * 5
    assert topo.RingGraph(5, 1).has_edge(0, 4)
    assert topo.MeshGrid2DGraph(6, (2, 3)).has_edge(0, 3)
    assert topo.StarGraph(5, 2).has_edge(0, 2)
    assert topo.FullyConnectedGraph(3).number_of_edges() == 9
    assert topo.GetSendWeights(topo.RingGraph(3), 0)[0] == 1 / 3
    gen = topo.GetInnerOuterExpo2DynamicSendRecvRanks(12, 4, 0)
    assert next(gen) == ([4], [8])


def test_acceptance_ranges():
    """Issue acceptance ranges: exp-2 gap 2/(2+floor(log2(n-1))) for even n and ring
    rho = 1/3 + (2/3)cos(2 pi/n) up to n = 256; one-peer exp-2 products equal J up to 1024."""
    for n in range(4, 257, 2):
        expected = 2 / (2 + (n - 1).bit_length() - 1)
        assert topo.spectral_gap(topo.exponential_two_graph(n)) == pytest.approx(expected, abs=1e-12)
    for n in range(3, 257):
        rho = 1 / 3 + 2 / 3 * math.cos(2 * math.pi / n)
        assert 1 - topo.spectral_gap(topo.ring_graph(n)) == pytest.approx(rho, abs=1e-12)
    for m in range(1, 11):
        n = 2 ** m
        gens = [topo.one_peer_exponential_schedule(n, r) for r in range(n)]
        mats = [topo.schedule_mixing_matrix([next(g)[:2] for g in gens], n) for _ in range(m)]
        prod = np.linalg.multi_dot(mats + [np.eye(n)]) if m > 1 else mats[0]
        assert np.array_equal(prod, np.full((n, n), 1 / n)), n


def test_one_peer_hypercube_schedule_pairs_and_averages_exactly():
    for n in (1, 2, 4, 8, 16, 6, 12):
        tau = max(1, (n - 1).bit_length())
        gens = [topo.one_peer_hypercube_schedule(n, r) for r in range(n)]
        steps = [[next(g) for g in gens] for _ in range(2 * tau)]
        for t, step in enumerate(steps):
            for r, (send, recv) in enumerate(step):
                assert send == recv  # a pair averages both ways
                if send:  # the partner pairs back, along dimension t mod log2 n
                    assert send == [r ^ (1 << (t % tau))] and step[send[0]][0] == [r]
        mats = [topo.schedule_mixing_matrix(step, n) for step in steps]
        assert all(topo.is_doubly_stochastic(m) for m in mats)
        if n & (n - 1) == 0:  # a power of 2: exact after log2(n) steps, from any start
            for start in range(tau):
                prod = np.linalg.multi_dot(mats[start:start + tau] + [np.eye(n)])
                assert np.array_equal(prod, np.full((n, n), 1 / n)), (n, start)
    # 8 ranks in machines of 2: the first step's pairs stay inside machines
    assert [next(topo.one_peer_hypercube_schedule(8, r))[0][0] // 2 for r in range(8)] == [r // 2 for r in range(8)]
