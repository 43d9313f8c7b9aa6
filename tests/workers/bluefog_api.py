"""What a BlueFog script observes, on 4 ranks grouped 2 per machine by BLUEFOG_NODES_PER_MACHINE:
`import shoal.torch as bf` in place of `import bluefog.torch as bf`. Each check is an item of
tests/test_bluefog_api.py (checks.run_all: one PASS or FAIL line per check and rank).
Expected values are BlueFog 0.3.0's (docs/reference/bluefog-semantics.md)."""
import os
import sys

import torch

import shoal.torch as bf
from shoal import _compat_env
from checks import check, raises, run_all

if "--explicit-env" in sys.argv:  # until init() maps BLUEFOG_* itself
    _compat_env.apply_bluefog_env()
bf.init()
R, N = bf.rank(), bf.size()
assert N == 4, "this worker expects 4 ranks"
EXP2_IN = sorted({(R - 1) % N, (R - 2) % N})
EXP2_OUT = sorted({(R + 1) % N, (R + 2) % N})
def x_of(r, dtype=torch.float64):
    return torch.arange(4, dtype=dtype) + 8 * r  # small integers: sums are exact


# ---- environment ---------------------------------------------------------------------------------
@check
def env_nodes_per_machine():
    assert os.environ.get("SHOAL_RANKS_PER_MACHINE") == "2", os.environ.get("SHOAL_RANKS_PER_MACHINE")
    assert (bf.local_size(), bf.local_rank(), bf.machine_size(), bf.machine_rank()) == (2, R % 2, 2, R // 2)
    assert bf.is_homogeneous() is True


@check
def env_log_level_fatal():
    assert os.environ.get("SHOAL_LOG_LEVEL") == "error"  # BlueFog's "fatal": init() did not reject it


@check
def env_cycle_time_and_fusion():
    got = os.environ.get("SHOAL_CYCLE_TIME"), os.environ.get("SHOAL_FUSION_THRESHOLD")
    assert got == ("0.5", "1048576"), got


@check
def env_timeline():
    assert os.environ.get("SHOAL_TIMELINE") == os.environ["BLUEFOG_TIMELINE"]
    assert bf.timeline_start_activity("bfapi", "USER_SPAN") is True
    assert bf.timeline_end_activity("bfapi") is True
    with bf.timeline_context("bfapi", "CONTEXT_SPAN"):
        pass


# ---- basics --------------------------------------------------------------------------------------
@check
def init_default_topology():
    assert bf.IsTopologyEquivalent(bf.load_topology(), bf.ExponentialGraph(N))
    assert bf.is_topo_weighted() is False
    assert (bf.in_neighbor_ranks(), bf.out_neighbor_ranks()) == (EXP2_IN, EXP2_OUT)


@check
def init_again_resets_topology():
    assert bf.set_topology(bf.RingGraph(N)) is True
    bf.init()  # BlueFog: every init() sets the topology again (exponential-2 by default)
    assert bf.IsTopologyEquivalent(bf.load_topology(), bf.ExponentialGraph(N))
    bf.init(topology_fn=bf.RingGraph, is_weighted=True)
    assert bf.is_topo_weighted() is True
    assert bf.in_neighbor_ranks() == sorted({(R - 1) % N, (R + 1) % N})
    bf.init()
    assert bf.is_topo_weighted() is False


@check
def rank_queries_are_ints():
    for f in (bf.size, bf.rank, bf.local_size, bf.local_rank, bf.machine_size, bf.machine_rank):
        assert type(f()) is int, f


@check
def mpi_threads_supported_int():
    v = bf.mpi_threads_supported()
    assert type(v) is int and v in (0, 1), repr(v)


@check
def unified_mpi_window_model_supported_bool():
    assert bf.unified_mpi_window_model_supported() is True


@check
def nccl_built_bool():
    assert type(bf.nccl_built()) is bool


@check
def set_topology_returns_and_errors():
    assert bf.set_topology(bf.RingGraph(N)) is True
    assert bf.set_topology(bf.RingGraph(N)) is True  # equivalent: still True
    raises(TypeError, bf.set_topology, bf.RingGraph(N + 1))
    raises(TypeError, bf.set_topology, [[1.0]])
    assert bf.set_topology() is True  # None: exponential-2
    assert bf.IsTopologyEquivalent(bf.load_topology(), bf.ExponentialGraph(N))


@check
def set_machine_topology_errors_and_neighbors():
    raises(ValueError, bf.set_machine_topology, None)
    raises(TypeError, bf.set_machine_topology, bf.RingGraph(3))
    raises(TypeError, bf.set_machine_topology, "ring")
    assert bf.set_machine_topology(bf.RingGraph(2)) is True
    assert bf.IsTopologyEquivalent(bf.load_machine_topology(), bf.RingGraph(2))
    other = 1 - bf.machine_rank()
    assert (bf.in_neighbor_machine_ranks(), bf.out_neighbor_machine_ranks()) == ([other], [other])
    assert bf.is_machine_topo_weighted() is False


@check
def suspend_resume():
    assert bf.suspend() is None
    assert bf.resume() is None
    assert torch.equal(bf.allreduce(torch.ones(2), name="bfapi.after_resume"), torch.ones(2))


@check
def skip_negotiate_stage():
    assert bf.get_skip_negotiate_stage() is False
    assert bf.set_skip_negotiate_stage(True) is None
    assert bf.get_skip_negotiate_stage() is True
    bf.set_skip_negotiate_stage(False)
    assert bf.get_skip_negotiate_stage() is False


@check
def barrier_returns_none():
    assert bf.barrier() is None


# ---- collectives ---------------------------------------------------------------------------------
MEAN = sum(x_of(r) for r in range(N)) / N


@check
def allreduce_average_default_and_sum():
    x = x_of(R)
    y = bf.allreduce(x, name="bfapi.ar")
    assert torch.equal(y, MEAN) and torch.equal(x, x_of(R)) and y is not x
    assert torch.equal(bf.allreduce(x, average=False, name="bfapi.ar_sum"), MEAN * N)
    loc = bf.allreduce(x, is_hierarchical_local=True, name="bfapi.ar_local")
    m = bf.machine_rank()
    assert torch.equal(loc, (x_of(2 * m) + x_of(2 * m + 1)) / 2), loc


@check
def allreduce_inplace_returns_tensor():
    x = x_of(R)
    assert bf.allreduce_(x, name="bfapi.ar_") is x and torch.equal(x, MEAN)
    h = bf.allreduce_nonblocking_(x, average=False, name="bfapi.ar_nb_")
    assert type(h) is int
    assert bf.synchronize(h) is x and torch.equal(x, MEAN * N)


@check
def nonblocking_handles_poll_wait():
    h = bf.allreduce_nonblocking(x_of(R), name="bfapi.nb")
    assert type(h) is int
    while not bf.poll(h):
        pass
    assert type(bf.poll(h)) is bool
    assert torch.equal(bf.wait(h), MEAN)
    raises(ValueError, bf.synchronize, h)  # released
    raises(ValueError, bf.poll, 10 ** 9)


@check
def broadcast_forms():
    x = x_of(R)
    assert torch.equal(bf.broadcast(x, 2, name="bfapi.bc"), x_of(2)) and torch.equal(x, x_of(R))
    assert torch.equal(bf.broadcast(x, root_rank=1, name="bfapi.bc_kw"), x_of(1))
    assert bf.broadcast_(x, 3, name="bfapi.bc_") is x and torch.equal(x, x_of(3))
    h = bf.broadcast_nonblocking(x_of(R), 0, name="bfapi.bc_nb")
    assert torch.equal(bf.synchronize(h), x_of(0))


@check
def allgather_variable_first_dim():
    x = torch.full((R + 1, 2), float(R))
    y = bf.allgather(x, name="bfapi.ag")
    want = torch.cat([torch.full((r + 1, 2), float(r)) for r in range(N)])
    assert torch.equal(y, want), y
    assert torch.equal(bf.synchronize(bf.allgather_nonblocking(x, name="bfapi.ag_nb")), want)


@check
def neighbor_allgather_static_and_dynamic():
    x = torch.full((1, 3), float(R))
    y = bf.neighbor_allgather(x, name="bfapi.nag")
    assert torch.equal(y, torch.cat([torch.full((1, 3), float(j)) for j in EXP2_IN])), y
    src, dst = [(R + 1) % N, (R - 1) % N], [(R - 1) % N, (R + 1) % N]  # order as given
    y = bf.neighbor_allgather(x, src_ranks=src, dst_ranks=dst, name="bfapi.nag_dyn")
    assert torch.equal(y, torch.cat([torch.full((1, 3), float(j)) for j in src])), y
    raises(ValueError, bf.neighbor_allgather, x, src_ranks=src)


@check
def neighbor_allreduce_static():
    x = x_of(R)
    y = bf.neighbor_allreduce(x, name="bfapi.nar")
    assert torch.equal(y, (x + sum(x_of(j) for j in EXP2_IN)) / 3), y  # sum then divide
    sw, sb = 0.5, {EXP2_IN[0]: 0.25, EXP2_IN[1]: 0.25}
    y = bf.neighbor_allreduce(x, self_weight=sw, src_weights=sb, name="bfapi.nar_w")
    assert torch.equal(y, 0.5 * x + 0.25 * x_of(EXP2_IN[0]) + 0.25 * x_of(EXP2_IN[1])), y
    not_a_source = (R + 1) % N
    raises(ValueError, bf.neighbor_allreduce, x, self_weight=0.5, src_weights={not_a_source: 0.5})


@check
def neighbor_allreduce_dynamic_dst_weights():
    # Each rank sends to R+1 with weight 2 and to R+2 with weight 1 (the sender scales).
    x = x_of(R)
    dst = {(R + 1) % N: 2.0, (R + 2) % N: 1.0}
    src = {(R - 1) % N: 0.25, (R - 2) % N: 0.25}
    y = bf.neighbor_allreduce(x, self_weight=0.5, src_weights=src, dst_weights=dst, name="bfapi.nar_dst")
    want = 0.5 * x + 0.25 * 2.0 * x_of((R - 1) % N) + 0.25 * 1.0 * x_of((R - 2) % N)
    assert torch.equal(y, want), (y, want)
    y = bf.neighbor_allreduce(x, self_weight=0.5, src_weights={(R - 1) % N: 0.5},
                              dst_weights=[(R + 1) % N], name="bfapi.nar_list")
    assert torch.equal(y, 0.5 * x + 0.5 * x_of((R - 1) % N)), y
    raises(ValueError, bf.neighbor_allreduce, x, dst_weights=[(R + 1) % N])  # needs both weights


@check
def neighbor_allreduce_dynamic_pattern_mismatch_is_value_error():
    # BlueFog's own case (test/torch_ops_test.py, test_neighbor_allreduce_dynamic_topo_check):
    # receive from R-1, send to R+2. BlueFog's check (mpi_controller.cc,
    # CheckNeighborSendRecvPattern: an allgather of every rank's pattern) fails the op with
    # Status::InvalidArgument on every rank, a ValueError at the wait. Shoal raises
    # NeighborPatternError there, a ValueError and a ShoalError.
    x = x_of(R)
    kw = dict(self_weight=0.0, src_weights={(R - 1) % N: 1.0}, dst_weights=[(R + 2) % N])
    for dtype in (torch.float16, torch.float32, torch.float64):
        for blocking in (True, False):
            try:
                if blocking:
                    bf.neighbor_allreduce(x.to(dtype), name="bfapi.topo_check", **kw)
                else:
                    h = bf.neighbor_allreduce_nonblocking(x.to(dtype), name="bfapi.topo_check", **kw)
                    bf.synchronize(h)  # the call itself returned a handle; the wait raises
            except ValueError as e:
                assert isinstance(e, bf.ShoalError) and type(e) is bf.NeighborPatternError, type(e).__mro__
                assert "neighbor_allreduce 'bfapi.topo_check': send and receive ranks disagree" in str(e), e
                assert f"rank {R} sends to rank {(R + 2) % N}, which does not receive from it" in str(e), e
            else:
                raise AssertionError(f"no ValueError ({dtype}, blocking={blocking})")
    # The name works again with a pattern that agrees.
    y = bf.neighbor_allreduce(x, self_weight=0.0, src_weights={(R - 1) % N: 1.0}, dst_weights=[(R + 1) % N],
                              name="bfapi.topo_check")
    assert torch.equal(y, x_of((R - 1) % N)), y
    # neighbor_allgather's check (BlueFog: the same allgather of patterns) raises the same.
    try:
        bf.neighbor_allgather(x, src_ranks=[(R - 1) % N], dst_ranks=[(R + 2) % N], name="bfapi.topo_check_ag")
    except bf.NeighborPatternError as e:
        assert "neighbor_allgather 'bfapi.topo_check_ag': send and receive ranks disagree" in str(e), e
    else:
        raise AssertionError("no NeighborPatternError from neighbor_allgather")


@check
def neighbor_allreduce_deprecated_kwargs():
    raises(TypeError, bf.neighbor_allreduce, x_of(R), neighbor_weights={})
    raises(TypeError, bf.neighbor_allreduce, x_of(R), send_neighbors=[])
    raises(TypeError, bf.hierarchical_neighbor_allreduce, x_of(R), neighbor_machine_weights={})


@check
def one_peer_dynamic_loop_with_bluefog_keywords():
    # BlueFog's canonical dynamic loop; on exp-2 with 4 ranks, two one-peer steps average exactly.
    gen = bf.GetDynamicOnePeerSendRecvRanks(topo=bf.load_topology(), self_rank=bf.rank())
    x = x_of(R)
    for k in range(2):
        send, recv = next(gen)
        assert send == [(R + 2 ** k) % N] and recv == [(R - 2 ** k) % N], (k, send, recv)
        x = bf.neighbor_allreduce(x, self_weight=0.5, src_weights={r: 0.5 for r in recv},
                                  dst_weights=send, name=f"bfapi.onepeer.{k}")
    assert torch.equal(x, MEAN), x


@check
def hierarchical_neighbor_allreduce():
    x = x_of(R)
    bf.set_machine_topology(bf.RingGraph(2))
    m = bf.machine_rank()
    s = [x_of(2 * k) + x_of(2 * k + 1) for k in range(2)]
    y = bf.hierarchical_neighbor_allreduce(x, name="bfapi.hier")
    assert torch.equal(y, (s[0] + s[1]) / 4), y  # uniform: (S_self + S_other) / (L * 2)
    y = bf.hierarchical_neighbor_allreduce(x, self_weight=0.75, src_machine_weights={1 - m: 0.25},
                                           dst_machine_weights=[1 - m], name="bfapi.hier_dyn")
    assert torch.equal(y, (0.75 * s[m] + 0.25 * s[1 - m]) / 2), y


@check
def pair_gossip():
    x = x_of(R)
    peer = R ^ 1
    assert torch.equal(bf.pair_gossip(x, peer, name="bfapi.pg"), (x + x_of(peer)) / 2)
    y = bf.pair_gossip(x, peer, self_weight=0.75, pair_weight=0.25, name="bfapi.pg_w")
    assert torch.equal(y, 0.75 * x + 0.25 * x_of(peer)), y
    raises(ValueError, bf.pair_gossip, x, peer, self_weight=0.5)


@check
def infer_ranks():
    dst = [(R + 1) % N]
    assert bf.InferSourceFromDestinationRanks(dst_ranks=dst) == [(R - 1) % N]
    assert bf.InferDestinationFromSourceRanks(src_ranks=[(R - 1) % N]) == [(R + 1) % N]


# ---- windows -------------------------------------------------------------------------------------
@check
def win_create_names_and_set_topology_refused():
    x = x_of(R)
    assert bf.win_create(x, "bfapi.w") is True
    assert bf.win_create(torch.zeros(2), "bfapi.a", zero_init=True) is True
    assert bf.get_current_created_window_names() == ["bfapi.a", "bfapi.w"]
    assert bf.set_topology(bf.RingGraph(N)) is False  # frozen while windows exist
    assert bf.win_free("bfapi.a") is True
    assert bf.get_current_created_window_names() == ["bfapi.w"]


@check
def win_aliases_are_the_same_functions():
    for n in ("win_put", "win_get", "win_accumulate"):
        for suffix in ("", "_nonblocking"):
            assert getattr(bf, n + suffix) is getattr(bf, "neighbor_" + n + suffix), n + suffix


@check
def win_put_versions_update_returns_registered_tensor():
    x = bf.win_update("bfapi.w")  # registered tensor: no puts yet, buffers hold x itself
    assert torch.equal(x, x_of(R))
    bf.barrier()  # every rank has read its buffers before anyone puts
    assert bf.win_put(x, "bfapi.w") is True
    bf.barrier()
    assert bf.get_win_version("bfapi.w") == {j: 1 for j in EXP2_IN}
    c = bf.win_update("bfapi.w", clone=True)
    assert torch.equal(c, (x_of(R) + sum(x_of(j) for j in EXP2_IN)) / 3) and torch.equal(x, x_of(R))
    y = bf.win_update("bfapi.w")
    assert y is x and torch.equal(x, c)
    assert bf.get_win_version("bfapi.w") == {j: 0 for j in EXP2_IN}
    bf.barrier()


@check
def win_put_self_weight_scales_in_place_and_handles():
    x = x_of(R)
    assert bf.win_create(x, "bfapi.s") is True
    h = bf.win_put_nonblocking(x, "bfapi.s", self_weight=0.5, dst_weights={EXP2_OUT[0]: 1.0})
    assert type(h) is int
    assert type(bf.win_poll(h)) is bool
    assert bf.win_wait(h) is True
    assert torch.equal(x, x_of(R) * 0.5)
    import warnings
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert bf.win_wait(h) is False  # BlueFog: unknown (already waited) handle -> False
    assert seen, "no warning for an unknown handle"
    raises(ValueError, bf.win_put, x, "bfapi.s", dst_weights={R: 1.0})  # self is not an out-neighbor
    bf.barrier()
    assert bf.win_free("bfapi.s") is True


@check
def win_get_and_accumulate_versions():
    assert bf.win_create(x_of(R), "bfapi.g") is True
    assert bf.win_get("bfapi.g", src_weights={EXP2_IN[0]: 0.5}) is True
    assert bf.get_win_version("bfapi.g") == {EXP2_IN[0]: 1, EXP2_IN[1]: 0}
    bf.barrier()
    assert bf.win_accumulate(x_of(R), "bfapi.g") is True
    bf.barrier()
    assert bf.get_win_version("bfapi.g") == {EXP2_IN[0]: 1, EXP2_IN[1]: 0}  # accumulate: no bump
    y = bf.win_update_then_collect("bfapi.g")
    # buffer j0: 0.5 x_j0 (get) + x_j0 (accumulate); buffer j1: x_j1 (initial copy of own x!) + x_j1
    want = x_of(R) + 1.5 * x_of(EXP2_IN[0]) + x_of(R) + x_of(EXP2_IN[1])
    assert torch.equal(y, want), (y, want)
    assert torch.equal(bf.win_update("bfapi.g", clone=True), y / 3)  # collect zeroed the buffers
    bf.barrier()
    assert bf.win_free("bfapi.g") is True


@check
def push_sum_associated_p():
    # A push-sum step with unequal weights: p moves with the same weights as the data.
    x = torch.cat([x_of(R), torch.ones(1, dtype=torch.float64)])
    assert bf.win_create(x, "bfapi.ps", zero_init=True) is True
    assert bf.win_associated_p("bfapi.ps") == 1.0
    assert bf.turn_on_win_ops_with_associated_p() is None
    try:
        a, b, c = 0.5, 0.25, 0.25
        bf.win_accumulate(x, "bfapi.ps", self_weight=a, dst_weights={(R + 1) % N: b, (R + 2) % N: c})
        bf.barrier()
        y = bf.win_update_then_collect("bfapi.ps")
        p = bf.win_associated_p("bfapi.ps")
        assert type(p) is float
        w_in = {(R - 1) % N: b, (R - 2) % N: c}  # what each source gave this rank
        want = a * torch.cat([x_of(R), torch.ones(1, dtype=torch.float64)])
        for j, w in w_in.items():
            want = want + w * torch.cat([x_of(j), torch.ones(1, dtype=torch.float64)])
        assert torch.equal(y, want), (y, want)
        assert p == float(y[-1]) == a + b + c, (p, y[-1])
    finally:
        assert bf.turn_off_win_ops_with_associated_p() is None
    bf.barrier()
    assert bf.win_free("bfapi.ps") is True


@check
def win_mutex_and_win_lock():
    with bf.win_mutex("bfapi.w"):
        pass
    with bf.win_mutex("bfapi.w", for_self=True, ranks=EXP2_IN):
        pass
    with bf.win_lock("bfapi.w"):
        pass
    raises(ValueError, lambda: bf.win_lock("bfapi.nope").__enter__())  # BlueFog: ValueError
    raises(KeyError, bf.win_update, "bfapi.nope")  # BlueFog: KeyError from its registry
    bf.barrier()


@check
def win_free_unknown_and_all():
    raises(KeyError, bf.win_free, "bfapi.nope")  # every rank calls it: the same error everywhere
    assert bf.win_free() is True
    assert bf.get_current_created_window_names() == []
    assert bf.set_topology(bf.ExponentialGraph(N)) is True


failed = run_all(R)
bf.shutdown()
print(f"BFAPI done rank {R} failed {failed}", flush=True)
sys.exit(1 if failed else 0)
