"""One-sided window ops against exact values: buffers start with the local value,
put/accumulate scale the local tensor, update with given/topology/uniform weights,
collect, versions, associated p, mutexes, errors; numpy and torch tensors."""
import sys
import time

import numpy as np

import shoal
from shoal import topology as T
from checks import Skip, check, run_all

shoal.init()
R, N = shoal.rank(), shoal.size()
DTYPES = ("float16", "float32", "float64", "int32", "int64")


def data(r, dtype="float64"):
    return ((np.arange(6) + 3 * r) % 7 - 2).astype(dtype)  # small integers: exact sums


def fresh(name, dtype="float64", zero_init=False, graph=None, weighted=False):
    """Free every window, set the topology, create `name` for data(R)."""
    shoal.win_free()
    assert shoal.set_topology(graph if graph is not None else T.exponential_two_graph(N), weighted)
    x = data(R, dtype)
    assert shoal.win_create(x, name, zero_init=zero_init)
    return x


def buffers(name, x):
    """Each in-neighbour's buffer, read through win_update(clone=True)."""
    return {j: shoal.win_update(name, 0.0, {j: 1.0}, clone=True) for j in shoal.in_neighbor_ranks()}


@check
def the_core_refuses_a_window_whose_neighbour_lists_are_wrong_on_every_rank():
    """The core's own check (the C ABI's lists come unchecked; Python's come from the
    topology): a rank that lists itself, a rank outside the job or a rank twice makes
    win_create fail on every rank with one error (not only on that rank, leaving the
    others waiting in it), and no window is left."""
    if N < 2:
        raise Skip("needs 2 ranks")
    from shoal import _win
    from shoal._loader import _core
    shoal.win_free()
    x = data(R)
    ok_recv, ok_send = [(R - 1) % N], [(R + 1) % N]
    for bad, where, what in (([R], "recv", "win_create('bad.lists'): rank 0 receives from itself"),
                             ([N], "send", f"win_create('bad.lists'): rank 0 sends to rank {N}, outside"),
                             (ok_send * 2, "send", f"win_create('bad.lists'): rank 0 sends to rank {1 % N} twice"),
                             ([N], "recv", f"win_create('bad.lists'): rank 0 receives from rank {N}, outside")):
        recv, send = (bad, ok_send) if where == "recv" and R == 0 else (ok_recv, bad if R == 0 else ok_send)
        h = _core.win_enqueue(_win.CREATE, "bad.lists", with_p=False, ranks=recv, send_ranks=send, zero_init=False,
                              data=x.ctypes.data, dtype=shoal._ops.DTYPE_CODES["float64"], shape=list(x.shape))
        try:
            _core.win_wait(h)
        except ValueError as e:  # an argument error, on every rank
            assert what in str(e), str(e)
        else:
            raise AssertionError("no error")
        finally:
            _core.win_release(h)
        assert shoal.get_current_created_window_names() == [], shoal.get_current_created_window_names()


@check
def buffers_start_with_local_value_or_zeros():
    for dt in DTYPES:
        for zero in (False, True):
            x = fresh("init", dt, zero_init=zero)
            for j, b in buffers("init", x).items():
                want = np.zeros(6, dt) if zero else data(R, dt)
                assert b.dtype == np.dtype(dt) and np.array_equal(b, want), (dt, zero, j, b)
            assert np.array_equal(x, data(R, dt))  # clone left the tensor alone
    shoal.win_free()


@check
def put_scales_and_update_combines_exactly():
    for dt in ("float16", "float32", "float64"):
        x = fresh("put", dt)
        out = shoal.out_neighbor_ranks()
        dst = {d: 0.5 ** (k + 1) for k, d in enumerate(out)}
        shoal.win_put(x, "put", self_weight=0.25, dst_weights=dst)
        assert np.array_equal(x, data(R, dt) * np.asarray(0.25, dt)), x  # scaled in place
        shoal.barrier()
        assert shoal.get_win_version("put") == {j: 1 for j in shoal.in_neighbor_ranks()}
        for j, b in buffers("put", x).items():
            k = shoal.topology.out_neighbors(shoal.load_topology(), j).index(R)
            assert np.array_equal(b, data(j, dt) * np.asarray(0.5 ** (k + 1), dt)), (dt, j, b)
        # Explicit weights: x <- 2x + sum_j 3 buf_j
        want = 2 * x.astype("float64") + sum(3 * b.astype("float64") for b in buffers("put", x).values())
        y = shoal.win_update("put", 2.0, {j: 3.0 for j in shoal.in_neighbor_ranks()})
        assert y is x and np.array_equal(x, want.astype(dt)), (x, want)
        assert shoal.get_win_version("put") == {j: 0 for j in shoal.in_neighbor_ranks()}
        shoal.barrier()
    shoal.win_free()


@check
def default_update_uniform_and_topology_weights():
    x = fresh("uni", "float64")
    shoal.win_put(x, "uni")
    shoal.barrier()
    ins = shoal.in_neighbor_ranks()
    want = (data(R) + sum(data(j) for j in ins)) / (len(ins) + 1)
    assert np.array_equal(shoal.win_update("uni"), want)  # sum then divide: exact
    shoal.barrier()
    rng = np.random.default_rng(3)
    w = rng.random((N, N)) * (rng.random((N, N)) < 0.6) + np.eye(N)
    g = T.from_mixing_matrix(w / w.sum(axis=0, keepdims=True))
    x = fresh("weighted", "float64", graph=g, weighted=True)
    shoal.win_put(x, "weighted")
    shoal.barrier()
    W = T.mixing_matrix(g)
    got = shoal.win_update("weighted")
    want = W[R, R] * data(R) + sum(W[j, R] * data(j) for j in shoal.in_neighbor_ranks())  # W[j, i]: edge j->i
    assert np.allclose(got, want, rtol=1e-12, atol=1e-12), (got, want)
    shoal.barrier()
    shoal.win_free()


@check
def accumulate_sums_collect_zeroes():
    for dt in DTYPES:
        x = fresh("acc", dt, zero_init=True)
        outs = shoal.out_neighbor_ranks()
        shoal.win_accumulate(x, "acc", dst_weights=outs)
        shoal.win_accumulate(x, "acc", dst_weights={d: 1.0 for d in outs})
        shoal.barrier()
        assert shoal.get_win_version("acc") == {j: 0 for j in shoal.in_neighbor_ranks()}  # BlueFog
        want = data(R, dt) + sum(2 * data(j, dt) for j in shoal.in_neighbor_ranks())
        got = shoal.win_update_then_collect("acc")
        assert np.array_equal(got, want), (dt, got, want)
        for b in buffers("acc", x).values():
            assert not b.any(), b  # collect zeroed the buffers
        shoal.barrier()
    shoal.win_free()


@check
def get_fetches_published_values_scaled():
    x = fresh("get", "float64")
    x *= 10  # not published: get sees the value of the last window op
    shoal.win_update("get", 1.0, {})  # publishes x
    shoal.barrier()
    ins = shoal.in_neighbor_ranks()
    shoal.win_get("get", {j: 0.5 for j in ins})
    shoal.win_get("get", ins)
    assert shoal.get_win_version("get") == {j: 2 for j in ins}
    for j, b in buffers("get", x).items():
        assert np.array_equal(b, 10 * data(j)), (j, b)
    shoal.barrier()
    shoal.win_free()


@check
def associated_p_follows_the_weights():
    shoal.turn_on_win_ops_with_associated_p()
    try:
        x = fresh("p", "float64", zero_init=True)
        assert shoal.win_associated_p("p") == 1.0
        outs, ins = shoal.out_neighbor_ranks(), shoal.in_neighbor_ranks()
        share = 1.0 / (len(outs) + 1)
        shoal.win_accumulate(x, "p", self_weight=share, dst_weights={d: share for d in outs})
        assert shoal.win_associated_p("p") == share
        shoal.barrier()
        shoal.win_update_then_collect("p")
        outdeg = {j: len(T.out_neighbors(shoal.load_topology(), j)) for j in range(N)}
        want_p = share + sum(1.0 / (outdeg[j] + 1) for j in ins)
        assert abs(shoal.win_associated_p("p") - want_p) < 1e-15, (shoal.win_associated_p("p"), want_p)
        total = shoal.allreduce(np.array([shoal.win_associated_p("p")]), average=False)[0]
        assert abs(total - N) < 1e-12, total  # mass conserved
        # put sets (not adds) p slots; update with weights combines p with them
        x2 = fresh("p2", "float64")
        shoal.win_put(x2, "p2", dst_weights={d: 0.5 for d in outs})
        shoal.barrier()
        shoal.win_update("p2", 0.5, {j: 1.0 for j in ins})
        assert shoal.win_associated_p("p2") == 0.5 + 0.5 * len(ins)
        shoal.barrier()
    finally:
        shoal.turn_off_win_ops_with_associated_p()
        shoal.win_free()


@check
def associated_p_bluefog_ring_values():
    # BlueFog's own case (test/torch_win_ops_test.py, test_asscoicated_with_p): ring, buffers
    # start with the local value (no zero_init), p on; one sender accumulates to its two ring
    # neighbours with 0.5 each and keeps self_weight 0.5; everyone collects. BlueFog's p
    # slots start at 0 whatever zero_init says (mpi_context.cc, InitializePWin), so p is
    # exactly 0.5 at the sender, 1.5 at its neighbours and 1.0 elsewhere.
    if N < 3:
        raise Skip("needs 3 or more ranks (two distinct ring neighbours)")
    shoal.turn_on_win_ops_with_associated_p()
    try:
        for sender in range(N):
            x = fresh("pring", "float32", graph=T.ring_graph(N))
            left, right = (sender - 1) % N, (sender + 1) % N
            if R == sender:
                shoal.win_accumulate(x, "pring", self_weight=0.5, dst_weights={left: 0.5, right: 0.5})
                assert shoal.win_associated_p("pring") == 0.5
            shoal.barrier()
            shoal.win_update_then_collect("pring")
            want = 0.5 if R == sender else 1.5 if R in (left, right) else 1.0
            assert shoal.win_associated_p("pring") == want, (sender, shoal.win_associated_p("pring"), want)
            shoal.barrier()
    finally:
        shoal.turn_off_win_ops_with_associated_p()
        shoal.win_free()


@check
def associated_p_put_then_default_update():
    # win_put sets the destination's slot to p*w (mpi_controller.cc, WinPut: an MPI_Put of
    # p*weight); slots nobody wrote stay 0; the default (uniform) win_update sums p and the
    # slots of every in-neighbour, then divides by in-degree + 1 (mpi_win_ops.cc, DoWinSync).
    if N < 2:
        raise Skip("needs 2 or more ranks")
    shoal.turn_on_win_ops_with_associated_p()
    try:
        x = fresh("pput", "float64")
        outs0 = T.out_neighbors(shoal.load_topology(), 0)
        if R == 0:
            shoal.win_put(x, "pput", self_weight=0.5, dst_weights={d: 0.5 for d in outs0})
            assert shoal.win_associated_p("pput") == 0.5
        shoal.barrier()
        shoal.win_update("pput")
        deg = len(shoal.in_neighbor_ranks())
        own = 0.5 if R == 0 else 1.0
        want = (own + (0.5 if R in outs0 else 0.0)) / (deg + 1)
        assert shoal.win_associated_p("pput") == want, (shoal.win_associated_p("pput"), want)
        if N == 4:  # exp-2 graph, in-degree 2: the numbers themselves
            assert want == {0: 0.5 / 3, 1: 0.5, 2: 0.5, 3: 1 / 3}[R], want
        shoal.barrier()
        # A second put replaces the slot (MPI_Put), an accumulate adds to it.
        if R == 0:
            shoal.win_put(x, "pput", dst_weights={d: 0.25 for d in outs0})
            shoal.win_put(x, "pput", dst_weights={d: 0.5 for d in outs0})
            shoal.win_accumulate(x, "pput", dst_weights={d: 0.25 for d in outs0})
        shoal.barrier()
        p0 = 0.5 / (len(T.in_neighbors(shoal.load_topology(), 0)) + 1)  # rank 0's p now
        before = shoal.win_associated_p("pput")
        shoal.win_update_then_collect("pput")
        want = before + (0.75 * p0 if R in outs0 else 0.0)
        assert shoal.win_associated_p("pput") == want, (shoal.win_associated_p("pput"), want)
        shoal.barrier()
    finally:
        shoal.turn_off_win_ops_with_associated_p()
        shoal.win_free()


@check
def associated_p_untouched_by_get_and_by_reset_with_p_off():
    # BlueFog's win_get moves values only (mpi_controller.cc, WinGet: no p), and win_update's
    # reset zeroes the p slots only while p is on (mpi_win_ops.cc, ResetNeighborTensor).
    if N < 2:
        raise Skip("needs 2 or more ranks")
    shoal.turn_on_win_ops_with_associated_p()
    try:
        x = fresh("pget", "float64")
        ins = shoal.in_neighbor_ranks()
        shoal.win_get("pget", {j: 0.5 for j in ins})
        shoal.win_update_then_collect("pget")
        assert shoal.win_associated_p("pget") == 1.0, shoal.win_associated_p("pget")
        shoal.barrier()
        x = fresh("preset", "float64", zero_init=True)
        shoal.win_accumulate(x, "preset")  # p slots: 1.0 from every in-neighbour
        shoal.barrier()
        shoal.turn_off_win_ops_with_associated_p()
        shoal.win_update("preset", 1.0, {j: 1.0 for j in ins}, reset=True)  # data zeroed, p slots kept
        assert shoal.win_associated_p("preset") == 1.0
        shoal.turn_on_win_ops_with_associated_p()
        shoal.win_update_then_collect("preset")
        assert shoal.win_associated_p("preset") == 1.0 + len(ins), shoal.win_associated_p("preset")
        shoal.barrier()
    finally:
        shoal.turn_off_win_ops_with_associated_p()
        shoal.win_free()


@check
def nonblocking_forms_and_poll():
    x = fresh("nb", "float32")
    h = shoal.win_put_nonblocking(x, "nb")
    while not shoal.win_poll(h):
        time.sleep(0.001)
    assert shoal.win_wait(h) is True
    h = shoal.win_get_nonblocking("nb")
    assert shoal.win_wait(h)
    h = shoal.win_accumulate_nonblocking(x, "nb", dst_weights=[])
    assert shoal.win_wait(h)
    assert shoal.neighbor_win_put is shoal.win_put
    shoal.barrier()
    shoal.win_free()


@check
def mutex_excludes_a_put_until_released():
    # An ordering, not a duration: no put with require_mutex lands (its version moves with
    # its data) while rank 0 holds its mutex; every one has landed once it released it.
    if N < 2:
        raise Skip("needs 2 or more ranks")
    x = fresh("mx", "float64")
    shoal.barrier()
    if R == 0:
        with shoal.win_mutex("mx", for_self=True):
            shoal.barrier()
            time.sleep(0.5)  # the in-neighbours' puts try meanwhile, and must wait
            early = {j: v for j, v in shoal.get_win_version("mx").items() if v}
        assert not early, f"puts with require_mutex landed while rank 0 held its mutex: {early}"
        shoal.barrier()
        got = shoal.get_win_version("mx")
        assert got == {j: 1 for j in shoal.in_neighbor_ranks()}, f"puts missing after the release: {got}"
    else:
        shoal.barrier()
        if 0 in shoal.out_neighbor_ranks():
            shoal.win_put(x, "mx", dst_weights=[0], require_mutex=True)
        shoal.barrier()
    with shoal.win_mutex("mx"):  # every out-neighbour's mutex for this rank
        pass
    shoal.barrier()
    shoal.win_free()


@check
def window_collectives_interleave_with_background_collectives():
    # Even ranks have an allreduce in flight while they create/free a window; odd ranks
    # finish the allreduce first. Neither thread waits for the other.
    shoal.win_free()
    for i in range(5):
        if R % 2 == 0:
            h = shoal.allreduce_nonblocking(np.ones(1000), name=f"inflight.{i}")
            shoal.win_create(data(R), f"il.{i}")
            got = shoal.synchronize(h)
        else:
            got = shoal.allreduce(np.ones(1000), name=f"inflight.{i}")
            shoal.win_create(data(R), f"il.{i}")
        assert np.array_equal(got, np.ones(1000))
        shoal.win_put(data(R), f"il.{i}")
        shoal.win_free(f"il.{i}")


@check
def mutexes_are_reentrant_per_process():
    x = fresh("re", "float64")
    with shoal.win_mutex("re"):
        with shoal.win_mutex("re"):  # nested: counted, not re-taken
            shoal.win_put(x, "re", require_mutex=True)
    with shoal.win_mutex("re", for_self=True):
        shoal.win_update("re", require_mutex=True)
    shoal.barrier()
    shoal.win_free()


@check
def set_topology_refused_while_windows_exist():
    fresh("topo", "float32")
    assert shoal.set_topology(T.ring_graph(N)) is False
    assert shoal.get_current_created_window_names() == ["topo"]
    shoal.win_free("topo")
    assert shoal.get_current_created_window_names() == []
    assert shoal.set_topology(T.exponential_two_graph(N)) is True


@check
def bad_input_errors():
    x = fresh("err", "float32")
    calls = {"unknown name": lambda: shoal.win_put(x, "missing"),
             "wrong dtype": lambda: shoal.win_put(x.astype("float64"), "err"),
             "int8": lambda: shoal.win_create(np.zeros(3, np.int8), "i8"),
             "one weight arg": lambda: shoal.win_update("err", 1.0),
             "put to self": lambda: shoal.win_put(x, "err", dst_weights={R: 1.0})}
    if N > 4:  # a rank that is not an in-neighbour
        calls["get from non-neighbour"] = lambda: shoal.win_get("err", {(R + 3) % N: 1.0})
    for what, call in calls.items():
        try:
            call()
        except ValueError:
            pass
        else:
            raise AssertionError(f"{what}: no ValueError")
    # Collective mismatches: the same ShoalError on every rank, windows still usable.
    for name, shape in ((f"m{R % 2}", 3), ("shape", 3 + R % 2)):
        if N == 1:
            break
        try:
            shoal.win_create(np.zeros(shape, np.float32), name)
        except shoal.ShoalError as e:
            assert "ranks disagree" in str(e), e
        else:
            raise AssertionError("mismatched win_create did not raise")
    try:
        shoal.win_create(x, "err")
    except ValueError as e:
        assert "already exists" in str(e)
    else:
        raise AssertionError("duplicate win_create did not raise")
    shoal.win_put(x, "err")
    shoal.barrier()
    shoal.win_free()


@check
def create_refused_on_one_rank_raises_on_every_rank():
    """A win_create one rank refuses at the call (a dtype the core refuses, a tensor the
    Python layer refuses) raises that error on every rank, at once, and windows work after."""
    if N == 1:
        raise Skip("needs peers")
    shoal.win_free()
    who = N - 1
    cases = [(np.zeros(3, np.int8), "window ops support"), (np.zeros(6, np.float32)[::2], "contiguous")]
    for bad, words in cases:
        x = bad if R == who else np.zeros(len(bad), np.float32)
        start = time.monotonic()
        try:
            shoal.win_create(x, "refused")
        except ValueError as e:
            msg = str(e)
        else:
            raise AssertionError(f"{words}: win_create did not raise")
        assert words in msg, msg
        assert msg.endswith(f"(raised at the call on rank {who})") == (R != who), msg
        assert time.monotonic() - start < 10, time.monotonic() - start
    x = fresh("after", "float32")
    shoal.win_put(x, "after")
    shoal.barrier()
    assert shoal.win_update("after", 0.0, {j: 1.0 for j in shoal.in_neighbor_ranks()[:1]}, clone=True) is not None
    shoal.win_free()


@check
def torch_half_types():
    try:
        import torch
    except ImportError:
        raise Skip("torch is not installed") from None
    import shoal.torch as bft
    for dt in (torch.bfloat16, torch.float16):
        shoal.win_free()
        t = torch.tensor(data(R), dtype=dt)
        bft.win_create(t, "t", zero_init=True)
        bft.win_accumulate(t, "t", self_weight=0.5)
        bft.win_accumulate(t, "t", self_weight=2.0)
        shoal.barrier()
        got = bft.win_update_then_collect("t")
        want = torch.tensor(data(R) + sum(data(j) * 1.5 for j in shoal.in_neighbor_ranks()), dtype=dt)
        assert got is t and torch.equal(got, want), (dt, got, want)
        shoal.barrier()
    shoal.win_free()


@check
def no_leaks_over_200_cycles():
    if "--cycles" not in sys.argv:
        raise Skip("runs in a job of its own, with --cycles (test_200_create_put_update_free_cycles_leak_nothing)")
    shoal.win_free()
    x = data(R, "float32").repeat(1000)
    rss = []
    for i in range(200):
        shoal.win_create(x, "cycle")
        shoal.win_put(x, "cycle")
        shoal.win_update("cycle")
        shoal.win_free("cycle")
        if i in (20, 199):
            with open("/proc/self/statm") as f:  # resident pages now
                rss.append(int(f.read().split()[1]) * 4)
    s = shoal.stats()
    print(f"[rank {R}] after 200 cycles: windows={s['windows']} window_bytes={s['window_bytes']} "
          f"win_puts={s['win_puts']} RSS {rss[0]} -> {rss[1]} KiB", flush=True)
    assert s["windows"] == 0 and s["window_bytes"] == 0
    assert rss[1] - rss[0] < 20 * 1024, rss  # KiB


sys.exit(1 if run_all(R, only=[a for a in sys.argv[1:] if not a.startswith("--")]) else 0)
