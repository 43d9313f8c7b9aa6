"""Neighbor communication against numpy: every generator, random weighted graphs,
one-peer schedules, dst_weights, neighbor_allgather, hierarchical, pair_gossip, topology
checks, and the no-global-collective steady state."""
import os
import sys
import time
import zlib

import networkx as nx
import numpy as np

import shoal
from shoal import topology as T
from checks import Skip, check, raises, run_all

shoal.init()
R, N = shoal.rank(), shoal.size()


def data(r, dtype="float64"):
    return ((np.arange(6) + 3 * r) % 7 - 2).astype(dtype)  # small integers: exact sums


def all_data(dtype="float64"):
    return np.stack([data(r, dtype) for r in range(N)])


def generators():
    gens = {"exp2": T.exponential_two_graph(N), "exp3": T.exponential_graph(N, base=3),
            "sym_exp": T.symmetric_exponential_graph(N), "mesh": T.mesh_grid_2d_graph(N),
            "star": T.star_graph(N), "full": T.fully_connected_graph(N)}
    for style in (0, 1, 2):
        gens[f"ring{style}"] = T.ring_graph(N, connect_style=style)
    rng = np.random.default_rng(42)  # same on every rank
    und = nx.gnp_random_graph(N, 0.5, seed=7)
    gens["random_mh"] = T.metropolis_hastings_weights(und)
    w = rng.random((N, N)) * (rng.random((N, N)) < 0.6) + np.eye(N)
    gens["random_directed"] = T.from_mixing_matrix(w / w.sum(axis=0, keepdims=True))
    return gens


@check
def every_generator_matches_w_times_x():
    for name, g in generators().items():
        for weighted in (False, True):
            shoal.set_topology(g, is_weighted=weighted)
            for dt in ("float32", "float64"):
                got = shoal.neighbor_allreduce(data(R, dt), name=f"gen.{name}.{dt}")
                if weighted:
                    want = (T.mixing_matrix(g).T @ all_data())[R]
                    assert np.allclose(got, want, rtol=1e-6, atol=1e-6), (name, got, want)
                else:  # uniform: exact sum then divide
                    ins = shoal.in_neighbor_ranks()
                    want = (data(R, dt) + sum(data(j, dt) for j in ins)) / np.asarray(len(ins) + 1, dt)
                    assert np.array_equal(got, want), (name, dt, got, want)
    shoal.set_topology(T.exponential_two_graph(N))


@check
def one_peer_schedule_matches_and_averages_exactly():
    scheds = [T.one_peer_exponential_schedule(N, r) for r in range(N)]
    x_all = all_data()
    x = data(R)
    steps = max(1, (N - 1).bit_length())
    for t in range(steps):
        plans = [next(s) for s in scheds]
        send, recv = plans[R][0], plans[R][1]
        w = 1.0 / (len(recv) + 1)
        x = shoal.neighbor_allreduce(x, self_weight=w, src_weights={j: w for j in recv},
                                     dst_weights=list(send), enable_topo_check=(t == 0), name="onepeer")
        W = T.schedule_mixing_matrix([p[:2] for p in plans], N)
        x_all = W.T @ x_all
        assert np.allclose(x, x_all[R], rtol=0, atol=1e-12), (t, x, x_all[R])
    if N & (N - 1) == 0:  # power of two: exact average after log2(N) steps
        assert np.array_equal(x, all_data().mean(axis=0)), (x, all_data().mean(axis=0))


@check
def dst_weights_scale_on_the_sender():
    if N == 1:
        raise Skip("needs 2 or more ranks")
    rng = np.random.default_rng(3)
    dw = rng.random(N)  # rank j scales what it sends by dw[j]
    sw, pw = 0.3, 0.7
    got = shoal.neighbor_allreduce(data(R), self_weight=sw, src_weights={(R - 1) % N: pw},
                                   dst_weights={(R + 1) % N: dw[R]}, name="dstw")
    j = (R - 1) % N
    assert np.allclose(got, sw * data(R) + pw * dw[j] * data(j), rtol=1e-14, atol=1e-14), got


@check
def large_tensors_sent_from_their_memory():
    # >= 64 KiB leaves straight from the tensor (header and data as separate messages);
    # the op completes only once its data has left, so overwriting it at once is safe.
    if N == 1:
        raise Skip("needs 2 or more ranks")
    big = lambda r: ((np.arange(50_000) * (r + 1)) % 11).astype("float64")  # 400 KB, integers
    nxt, prv = (R + 1) % N, (R - 1) % N
    x = big(R)
    hs = [shoal.neighbor_allreduce_nonblocking(x, self_weight=0.5, src_weights={prv: 0.5}, dst_weights=[nxt],
                                               name="big.direct"),
          shoal.neighbor_allreduce_nonblocking(x, self_weight=0.5, src_weights={prv: 0.5},
                                               dst_weights={nxt: 0.25}, name="big.scaled"),
          shoal.neighbor_allreduce_nonblocking(data(R), self_weight=0.5, src_weights={prv: 0.5}, dst_weights=[nxt],
                                               name="big.small")]
    direct, scaled, small = [shoal.synchronize(h) for h in hs]
    x[:] = -1  # must not reach any peer
    assert np.array_equal(direct, (big(R) + big(prv)) / 2), "direct"
    assert np.array_equal(scaled, 0.5 * big(R) + 0.125 * big(prv)), "scaled"
    assert np.array_equal(small, (data(R) + data(prv)) / 2), "small"
    rows = 3000 * (R + 1)  # 3000..24000 rows of 8 float32: 96 KB and more
    got = shoal.neighbor_allgather(np.full((rows, 8), R, "float32"), src_ranks=[prv], dst_ranks=[nxt],
                                   name="big.gather")
    assert got.shape == (3000 * (prv + 1), 8) and np.all(got == prv), got.shape
    for step in range(3):  # repeated: pieces match their own step
        y = shoal.neighbor_allreduce(big(R) + step, self_weight=0.5, src_weights={prv: 0.5}, dst_weights=[nxt],
                                     name="big.repeat")
        assert np.array_equal(y, (big(R) + big(prv)) / 2 + step), step
    shoal.barrier()


@check
def any_numpy_layout_same_result():
    # Plain float arrays take a one-call path into the core; every other layout or type is
    # converted first. Both must give the same values and keep the input's shape.
    if N == 1:
        raise Skip("needs 2 or more ranks")
    nxt, prv = (R + 1) % N, (R - 1) % N
    kw = dict(self_weight=0.5, src_weights={prv: 0.5}, dst_weights=[nxt], name="layout")
    base = lambda r: (np.arange(24).reshape(4, 6) * (r + 1)) % 5
    cases = {"c": lambda a: a.astype("float64"), "fortran": lambda a: np.asfortranarray(a.astype("float32")),
             "strided": lambda a: a.astype("float64")[:, ::2], "big_endian": lambda a: a.astype(">f8"),
             "half": lambda a: a.astype("float16"), "list": lambda a: a.astype("float64").tolist(),
             "0d": lambda a: np.float64(a[1, 1]), "empty": lambda a: a.astype("float64")[:0]}
    for label, make in cases.items():
        got = shoal.neighbor_allreduce(make(base(R)), **kw)
        want = (np.asarray(make(base(R)), dtype="float64") + np.asarray(make(base(prv)), dtype="float64")) / 2
        assert got.shape == want.shape and np.array_equal(np.asarray(got, "float64"), want), (label, got, want)
    raises(ValueError, shoal.neighbor_allreduce, np.arange(4), **dict(kw, name=None))  # int dtype
    raises(TypeError, shoal.neighbor_allreduce, np.ones(3), **dict(kw, name=7))
    shoal.barrier()


@check
def native_entry_same_as_general_path():
    # shoal.neighbor_allreduce is one C function that remembers resolved weights by value;
    # every argument form must give what the Python path (nonblocking + synchronize) gives,
    # on first sight and when remembered, and bad arguments must raise every time.
    if N == 1:
        raise Skip("needs 2 or more ranks")
    nxt, prv = (R + 1) % N, (R - 1) % N
    w = np.array(0.25)
    forms = [((0.5, {prv: 0.5}, [nxt]), {}), ((0.5, {prv: 0.25}, [nxt]), {}), ((), dict(self_weight=0.5, src_weights={prv: 0.5}, dst_weights=(nxt,))),
             ((0.5, {prv: 0.25}, {nxt: 2.0}), {}), ((0.0, {prv: 1.0}, [nxt]), {}), ((-0.0, {prv: 1.0}, [nxt]), {}),
             ((np.float64(0.5), {prv: np.float64(0.5)}, [np.int64(nxt)]), {}), ((1, {prv: 1}, [nxt]), {}),
             ((0.5, {prv: w}, [nxt]), {}), ((0.5, {prv: 0.5}, [nxt], True), {"name": "native.checked"})]
    x = data(R)

    class Sub(np.ndarray):  # not a plain array: the Python path
        pass
    for i, (args, kw) in enumerate(forms):
        for rep in range(2):
            if i == 8 and rep == 1:
                w[...] = 0.75  # a 0-d array weight changed in place is read again
            got = shoal.neighbor_allreduce(x, *args, **kw)
            started = shoal.synchronize(shoal.neighbor_allreduce_nonblocking(x, *args, **kw))
            want = np.asarray(shoal.neighbor_allreduce(x.view(Sub), *args, **kw))
            for out in (got, started):
                assert type(out) is np.ndarray and out.dtype == x.dtype and np.array_equal(out, want), (i, rep, out, want)
    assert np.array_equal(got, 0.5 * data(R) + 0.5 * data(prv))
    got = shoal.neighbor_allreduce(x.view(Sub), 0.5, {prv: 0.5}, [nxt])
    assert type(got) is Sub and np.array_equal(got, 0.5 * data(R) + 0.5 * data(prv))  # as the general path
    for bad, exc in (((0.5, {N: 0.5}, [nxt]), ValueError), ((0.5, {prv: 0.5}, [nxt], True, "n", 1), TypeError)):
        for _ in range(2):
            raises(exc, shoal.neighbor_allreduce, x, *bad)
    for kw in ({"tensor": x}, {"src_weights": {prv: 0.5}, "bogus": 1}):  # tensor twice; unknown keyword
        raises(TypeError, shoal.neighbor_allreduce, x, **kw)
    shoal.barrier()


@check
def native_allreduce_forms_same_as_general_path():
    # allreduce, allreduce_, allreduce_nonblocking(_) and synchronize are C functions for
    # plain arrays and arguments; every form gives what the Python path (an ndarray
    # subclass) gives, and what the C functions hand on raises as before.
    class Sub(np.ndarray):
        pass
    forms = [((), {}), ((False,), {}), ((True, False, "nat.ar"), {}), ((), dict(op=shoal.Sum)),
             ((), dict(average=True, op=shoal.Average, name="nat.ar2"))]
    for dtype in ("float64", "float32", "float16", "int32", "int64"):
        x = data(R, dtype) + (0 if dtype.startswith("int") else 0.25)
        for args, kw in forms:
            if dtype.startswith("int") and (args[:1] != (False,) and kw.get("op") is not shoal.Sum):
                raises(ValueError, shoal.allreduce_nonblocking, x, *args, **kw)  # integer average
                continue
            want = np.asarray(shoal.allreduce(x.view(Sub), *args, **kw))
            outs = [shoal.allreduce(x, *args, **kw), shoal.synchronize(shoal.allreduce_nonblocking(x, *args, **kw))]
            for inplace in (shoal.allreduce_, lambda *a, **k: shoal.wait(shoal.allreduce_nonblocking_(*a, **k))):
                y = x.copy()
                assert inplace(y, *args, **kw) is y
                outs.append(y)
            for out in outs:
                assert type(out) is np.ndarray and out.dtype == x.dtype and np.array_equal(out, want), (dtype, args, kw)
    frozen = data(R)
    frozen.flags.writeable = False
    raises(ValueError, shoal.allreduce_, frozen)
    raises(ValueError, shoal.allreduce_nonblocking_, frozen)
    h = shoal.allreduce_nonblocking(data(R), name="nat.once")
    shoal.synchronize(h)
    raises(ValueError, shoal.synchronize, h)  # synchronized already: unknown
    raises(ValueError, shoal.synchronize, -5)
    raises(TypeError, shoal.synchronize)
    import threading
    for i in range(20):  # three threads synchronize one handle: one result, two ValueErrors
        h = shoal.allreduce_nonblocking(data(R), name="nat.threads")
        got, refused = [], []

        def sync():
            try:
                got.append(shoal.synchronize(h))
            except ValueError as e:
                refused.append(e)
        threads = [threading.Thread(target=sync) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(got) == 1 and len(refused) == 2 and np.array_equal(got[0], all_data().mean(0)), (i, got, refused)
    shoal.barrier()


@check
def interrupted_wait_leaves_the_op_running():
    # Ctrl-C in a blocking op or in synchronize: the op runs on with its tensors kept alive;
    # a nonblocking handle stays valid.
    if N == 1:
        raise Skip("needs 2 or more ranks")
    import gc
    import signal

    def interrupt(*_):
        raise KeyboardInterrupt

    # Rank N-1 sends to rank 0 only once rank 0 has been interrupted twice (a file in the
    # job's status directory says so): the ops cannot complete before their interruption.
    status_dir = os.environ.get("SHOAL_STATUS_DIR")
    if not status_dir:
        raise Skip("needs shoalrun's status directory (SHOAL_STATUS_DIR)")
    interrupted = os.path.join(status_dir, "interrupted_wait.done")
    nxt, prv = (R + 1) % N, (R - 1) % N
    kw = dict(self_weight=0.5, src_weights={prv: 0.5}, dst_weights=[nxt])
    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        if R == 0:
            signal.setitimer(signal.ITIMER_REAL, 0.2)
            try:
                shoal.neighbor_allreduce(np.full(20_000, 1.0), name="intr.block", **kw)
                raise AssertionError("not interrupted")
            except KeyboardInterrupt:
                pass
            gc.collect()  # the op's arrays must survive this
            h = shoal.neighbor_allreduce_nonblocking(np.full(10, 1.0), name="intr.handle", **kw)
            signal.setitimer(signal.ITIMER_REAL, 0.2)
            try:
                shoal.synchronize(h)
                raise AssertionError("not interrupted")
            except KeyboardInterrupt:
                pass
            open(interrupted, "w").close()
            assert np.array_equal(shoal.synchronize(h), np.full(10, 0.5 + 0.5 * prv)), "handle"
        else:
            if R == N - 1:
                deadline = time.monotonic() + 60
                while not os.path.exists(interrupted):
                    assert time.monotonic() < deadline, "rank 0 was never interrupted"
                    time.sleep(0.01)
            got = shoal.neighbor_allreduce(np.full(20_000, float(R)), name="intr.block", **kw)
            assert np.array_equal(got, np.full(20_000, 0.5 * R + 0.5 * (prv if prv else 1.0))), got[:3]
            got = shoal.neighbor_allreduce(np.full(10, float(R)), name="intr.handle", **kw)
            assert np.array_equal(got, np.full(10, 0.5 * R + 0.5 * (prv if prv else 1.0))), got[:3]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    shoal.barrier()


@check
def neighbor_allgather_static_and_dynamic():
    x = np.full((R % 3 + 1, 2), R, dtype="int32")
    got = shoal.neighbor_allgather(x, name="nag.static")
    ins = shoal.in_neighbor_ranks()
    want = np.concatenate([np.full((j % 3 + 1, 2), j, "int32") for j in ins]) if ins else np.zeros((0, 2), "int32")
    assert np.array_equal(got, want), (got, want)
    if N > 1:
        src = [(R + 1) % N, (R - 1) % N] if N > 2 else [(R + 1) % N]
        dst = [(R - 1) % N, (R + 1) % N] if N > 2 else [(R + 1) % N]
        got = shoal.neighbor_allgather(x, src_ranks=src, dst_ranks=dst, name="nag.dyn")
        want = np.concatenate([np.full((j % 3 + 1, 2), j, "int32") for j in src])
        assert np.array_equal(got, want), (got, want)


@check
def hierarchical_dynamic_needs_no_machine_topology():
    L, M = shoal.local_size(), shoal.machine_size()
    if L < 2 or M < 2:
        raise Skip(f"needs 2 or more machines of 2 or more ranks (here: {M} of {L})")
    m = shoal.machine_rank()
    nxt, prv = (m + 1) % M, (m - 1) % M
    got = shoal.hierarchical_neighbor_allreduce(data(R), self_weight=0.5, src_machine_weights={prv: 0.5},
                                                dst_machine_weights=[nxt], name="hier.dyn")
    machine_sum = lambda k: sum(data(r) for r in range(k * L, (k + 1) * L))
    assert np.array_equal(got, (0.5 * machine_sum(m) + 0.5 * machine_sum(prv)) / L), got


@check
def hierarchical_over_machine_ring():
    L, M = shoal.local_size(), shoal.machine_size()
    if L < 2 or M < 2:
        raise Skip(f"needs 2 or more machines of 2 or more ranks (here: {M} of {L})")
    shoal.set_machine_topology(T.ring_graph(M))
    got = shoal.hierarchical_neighbor_allreduce(data(R), name="hier")
    S = [sum(data(m * L + l) for l in range(L)) for m in range(M)]
    m = shoal.machine_rank()
    ins = shoal.in_neighbor_machine_ranks()
    want = (S[m] + sum(S[k] for k in ins)) / (len(ins) + 1) / L
    assert np.allclose(got, want, rtol=1e-14), (got, want)
    got = shoal.hierarchical_neighbor_allreduce(data(R), self_weight=0.5,
                                                src_machine_weights={k: 0.5 / len(ins) for k in ins},
                                                dst_machine_weights=shoal.out_neighbor_machine_ranks(),
                                                name="hier.dyn")
    want = (0.5 * S[m] + sum(0.5 / len(ins) * S[k] for k in ins)) / L
    assert np.allclose(got, want, rtol=1e-14), (got, want)


@check
def pair_gossip_pairs_up():
    if N % 2:
        raise Skip("needs an even number of ranks")
    peer = R ^ 1
    got = shoal.pair_gossip(data(R), peer, name="pair")
    assert np.array_equal(got, (data(R) + data(peer)) / 2), got


@check
def infer_neighbors():
    dst = [(R + 1) % N] if N > 1 else []
    src = shoal.InferSourceFromDestinationRanks(dst)
    assert src == ([(R - 1) % N] if N > 1 else []), src
    back, W = shoal.InferDestinationFromSourceRanks(src, construct_adjacency_matrix=True)
    assert back == dst and np.allclose(W.sum(axis=0), 1.0), (back, W)


@check
def steady_state_has_no_global_collective():
    # Static, dynamic unchecked, and dynamic with the default topology check: a one-peer
    # schedule's patterns are checked in its first round only (docs/design.md §18).
    shoal.set_topology(T.exponential_two_graph(N))
    x = data(R)
    sched = T.one_peer_exponential_schedule(N, R)
    tau = max(1, (N - 1).bit_length())

    def dynamic(x, send, recv, **kw):
        w = 1.0 / (len(recv) + 1)
        return shoal.neighbor_allreduce(x, self_weight=w, src_weights={j: w for j in recv}, dst_weights=list(send),
                                        **kw)

    for warm in range(tau + 1):  # first sight of each name, and of each checked pattern
        x = shoal.neighbor_allreduce(x, name="steady.static")
        send, recv = next(sched)[:2]
        x = dynamic(x, send, recv, enable_topo_check=False, name="steady.dyn")
        x = dynamic(x, send, recv, name="steady.checked")
    shoal.barrier()
    shoal.reset_stats()
    for _ in range(100):
        x = shoal.neighbor_allreduce(x, name="steady.static")
        send, recv = next(sched)[:2]
        x = dynamic(x, send, recv, enable_topo_check=False, name="steady.dyn")
        x = dynamic(x, send, recv, name="steady.checked")
    st = shoal.stats()
    assert st["neighbor_allreduce"] == 300, st
    assert st["global_collectives"] == 0 and st["coordinator_rounds"] == 0, st
    if R == 0:
        print(f"steady state over 200 neighbor ops: {st}", flush=True)


def expect_error(fn, *needles, kind=shoal.ShoalError):
    start = time.monotonic()
    try:
        fn()
    except shoal.ShoalError as e:
        assert type(e) is kind, type(e)
        assert time.monotonic() - start < 10
        for n in needles:
            assert n in str(e), (n, str(e))
        return
    raise AssertionError("no ShoalError")


@check
def mismatched_dynamic_topology_names_the_edge():
    if N < 2:
        raise Skip("needs 2 or more ranks")
    # Rank 0 sends to rank 1, which does not list rank 0 as a source.
    dst = [1] if R == 0 else []
    expect_error(lambda: shoal.neighbor_allreduce(data(R), self_weight=1.0, src_weights={}, dst_weights=dst,
                                                  name="badtopo"),
                 "rank 0 sends to rank 1, which does not receive from it", kind=shoal.NeighborPatternError)


@check
def unchecked_mismatch_is_an_error_not_mixing():
    if N < 2:
        raise Skip("needs 2 or more ranks")
    kw = dict(self_weight=0.5, enable_topo_check=False, name="unchecked")
    # Step 0: rank 0 sends to 1, but rank 1 does not receive. Step 1: both agree.
    shoal.neighbor_allreduce(data(R), src_weights={}, dst_weights=[1] if R == 0 else [], **kw)
    if R == 1:
        expect_error(lambda: shoal.neighbor_allreduce(data(R), src_weights={0: 0.5}, dst_weights=[], **kw),
                     "rank 0 sent to this rank at its step 0", "at step 1", kind=shoal.NeighborPatternError)
    else:
        shoal.neighbor_allreduce(data(R), src_weights={}, dst_weights=[1] if R == 0 else [], **kw)
    shoal.barrier()


@check
def checked_schedule_one_step_off_fails_alike():
    # The default topology check, once the schedule's patterns were checked (step tau):
    # rank 1 then runs one step ahead. Every rank whose sender sends elsewhere fails with
    # one NeighborPatternError, the same on each (docs/design.md §18); the rest are exact.
    if N < 4:
        raise Skip("needs 4 or more ranks (below, one step ahead is the same pattern)")
    tau = (N - 1).bit_length()
    last = 2 * tau + 1

    def shift(r, t):
        return 2 ** ((t + (r == 1 and t == last)) % tau)

    for t in range(last + 1):
        k = shift(R, t)
        src = (R - k) % N
        try:
            got = shoal.neighbor_allreduce(data(R), self_weight=0.5, src_weights={src: 0.5},
                                           dst_weights=[(R + k) % N], name="offstep")
            error = ""
        except shoal.NeighborPatternError as e:
            error = str(e)
        assert t == last or not error, (t, error)
        if not error:
            assert np.array_equal(got, (data(R) + data(src)) / 2), (t, got)
    # A rank whose sender sends elsewhere must fail; one that got its data may have failed
    # too (the dispute fails every rank still waiting in that step).
    fed = (src + shift(src, last)) % N == R
    assert error or fed, "completed without its sender's data"
    assert not error or "send and receive ranks disagree" in error, error
    crcs = shoal.allgather(np.array([zlib.crc32(error.encode()) if error else -1], dtype=np.int64))
    assert len({c for c in crcs.tolist() if c >= 0}) == 1, (crcs, error)
    shoal.barrier()


@check
def different_topologies_across_ranks_rejected():
    if N < 2:
        raise Skip("needs 2 or more ranks")
    g = T.ring_graph(N) if R == 0 else T.exponential_two_graph(N)
    try:
        shoal.set_topology(g)
    except ValueError as e:
        assert "different graph" in str(e), e
    else:
        if not T.is_topology_equivalent(T.ring_graph(N), T.exponential_two_graph(N)):
            raise AssertionError("mismatched set_topology accepted")
    shoal.set_topology(T.exponential_two_graph(N))


sys.exit(1 if run_all(R) else 0)
