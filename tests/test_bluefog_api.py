"""Migration exactness (issue 14, scope 7): what a BlueFog 0.3.0 script observes through
`import shoal.torch as bf` — names, keywords, defaults, exception types, returned values, window
and push-sum state, BlueFog's environment variables. The optimizer classes and the parameter
utilities are checked with the optimizers. Expected values come from BlueFog's source
(github.com/Bluefog-Lib/bluefog, bluefog/torch/__init__.py, mpi_ops.py, common/basics.py,
common/topology_util.py, torch/topology_util.py); deliberate differences are listed in
docs/reference/bluefog-semantics.md ("Where Shoal differs")."""
import inspect
import os
import subprocess
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
import shoal.torch as bf  # noqa: E402
from shoal import _compat_env, basics  # noqa: E402
from conftest import Job, worker_checks  # noqa: E402

# ---- BlueFog's public surface, from its source --------------------------------------------------
# Every name `bluefog.torch` exports except the optimizer classes (tested with the optimizers),
# plus what mpi_ops.py defines without exporting and scripts import from there.
BLUEFOG_SIGNATURES = {
    # basics (bluefog/common/basics.py, bound methods: `self` dropped)
    "init": "(topology_fn=None, is_weighted=False)",
    "shutdown": "()",
    "size": "()", "local_size": "()", "rank": "()", "local_rank": "()",
    "machine_size": "()", "machine_rank": "()",
    "load_topology": "()", "set_topology": "(topology=None, is_weighted=False)",
    "load_machine_topology": "()", "set_machine_topology": "(topology, is_weighted=False)",
    "in_neighbor_ranks": "()", "out_neighbor_ranks": "()",
    "in_neighbor_machine_ranks": "()", "out_neighbor_machine_ranks": "()",
    "mpi_threads_supported": "()", "unified_mpi_window_model_supported": "()",
    "nccl_built": "()", "is_homogeneous": "()", "suspend": "()", "resume": "()",
    "set_skip_negotiate_stage": "(value)", "get_skip_negotiate_stage": "()",
    "is_topo_weighted": "()", "is_machine_topo_weighted": "()",
    "timeline_start_activity": "(tensor_name, activity_name)",
    "timeline_end_activity": "(tensor_name)",
    "timeline_context": "(tensor_name, activity_name)",
    # collectives and neighbor ops (bluefog/torch/mpi_ops.py)
    **{n: "(tensor, average=True, is_hierarchical_local=False, name=None)"
       for n in ("allreduce", "allreduce_nonblocking", "allreduce_", "allreduce_nonblocking_")},
    **{n: "(tensor, root_rank, name=None)"
       for n in ("broadcast", "broadcast_nonblocking", "broadcast_", "broadcast_nonblocking_")},
    "allgather": "(tensor, name=None)", "allgather_nonblocking": "(tensor, name=None)",
    **{n: "(tensor, *, src_ranks=None, dst_ranks=None, enable_topo_check=True, name=None)"
       for n in ("neighbor_allgather", "neighbor_allgather_nonblocking")},
    **{n: "(tensor, *, self_weight=None, src_weights=None, dst_weights=None, enable_topo_check=True, "
          "name=None)" for n in ("neighbor_allreduce", "neighbor_allreduce_nonblocking")},
    **{n: "(tensor, *, self_weight=None, src_machine_weights=None, dst_machine_weights=None, "
          "enable_topo_check=False, name=None)"
       for n in ("hierarchical_neighbor_allreduce", "hierarchical_neighbor_allreduce_nonblocking")},
    **{n: "(tensor, target_rank, self_weight=None, pair_weight=None, name=None)"
       for n in ("pair_gossip", "pair_gossip_nonblocking")},
    "poll": "(handle)", "synchronize": "(handle)", "wait": "(handle)", "barrier": "()",
    # windows
    "win_create": "(tensor, name, zero_init=False)",
    "win_free": "(name=None)",
    "win_update": "(name, self_weight=None, neighbor_weights=None, reset=False, clone=False, "
                  "require_mutex=False)",
    "win_update_then_collect": "(name, require_mutex=True)",
    **{p + n + s: "(tensor, name, self_weight=None, dst_weights=None, require_mutex=False)"
       for p in ("", "neighbor_") for n in ("win_put", "win_accumulate") for s in ("", "_nonblocking")},
    **{p + "win_get" + s: "(name, src_weights=None, require_mutex=False)"
       for p in ("", "neighbor_") for s in ("", "_nonblocking")},
    "win_poll": "(handle)", "win_wait": "(handle)",
    "get_current_created_window_names": "()", "get_win_version": "(name)",
    "win_lock": "(name)", "win_mutex": "(name, for_self=False, ranks=None)",
    "win_associated_p": "(name)",
    "turn_on_win_ops_with_associated_p": "()", "turn_off_win_ops_with_associated_p": "()",
    # parameter utilities (names only here; behaviour is tested with the optimizers)
    "broadcast_parameters": None, "allreduce_parameters": None, "broadcast_optimizer_state": None,
    # topology (bluefog/common/topology_util.py, bluefog/torch/topology_util.py)
    "IsTopologyEquivalent": "(topo1, topo2)",
    "GetRecvWeights": "(topo, rank)", "GetSendWeights": "(topo, rank)",
    "IsRegularGraph": "(topo)",
    "ExponentialTwoGraph": "(size)", "ExponentialGraph": "(size, base=2)",
    "SymmetricExponentialGraph": "(size, base=4)", "MeshGrid2DGraph": "(size, shape=None)",
    "StarGraph": "(size, center_rank=0)", "RingGraph": "(size, connect_style=0)",
    "FullyConnectedGraph": "(size)",
    "GetDynamicOnePeerSendRecvRanks": "(topo, self_rank)",
    "GetExp2DynamicSendRecvMachineRanks": "(world_size, local_size, self_rank, local_rank)",
    "GetInnerOuterRingDynamicSendRecvRanks": "(world_size, local_size, self_rank)",
    "GetInnerOuterExpo2DynamicSendRecvRanks": "(world_size, local_size, self_rank)",
    "InferSourceFromDestinationRanks": "(dst_ranks, construct_adjacency_matrix=False)",
    "InferDestinationFromSourceRanks": "(src_ranks, construct_adjacency_matrix=False)",
}
# Defined in bluefog/torch/mpi_ops.py but not exported by bluefog.torch: Shoal exports them.
NOT_EXPORTED_BY_BLUEFOG = {"pair_gossip", "pair_gossip_nonblocking", "win_lock", "is_topo_weighted",
                           "is_machine_topo_weighted"}
# Deliberate default differences (bluefog-semantics.md, "Where Shoal differs").
DEFAULT_DIFFERENCES = {("allreduce", "average"), ("allreduce_nonblocking", "average"),
                       ("allreduce_", "average"), ("allreduce_nonblocking_", "average")}


def _bluefog_signature(text):
    ns = {}
    exec(f"def f{text}: pass", ns)  # noqa: S102 - our own table
    return inspect.signature(ns["f"])


def signature_problems(name, ours, theirs):
    """What a call written for `theirs` (BlueFog) would do differently against `ours`."""
    P = inspect.Parameter
    problems, our_params = [], list(ours.parameters.values())
    for i, p in enumerate(theirs.parameters.values()):
        q = ours.parameters.get(p.name)
        if q is None:
            problems.append(f"no parameter {p.name!r}")
            continue
        if p.kind is P.POSITIONAL_OR_KEYWORD and (q.kind is not P.POSITIONAL_OR_KEYWORD
                                                 or our_params.index(q) != i):
            problems.append(f"{p.name!r} is not positional parameter {i}")
        if p.kind is P.KEYWORD_ONLY and q.kind not in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY):
            problems.append(f"{p.name!r} cannot be passed by keyword")
        if p.default is not P.empty and (name, p.name) not in DEFAULT_DIFFERENCES:
            if q.default is P.empty:
                problems.append(f"{p.name!r} has no default (BlueFog: {p.default!r})")
            elif type(q.default) is not type(p.default) or q.default != p.default:
                problems.append(f"{p.name!r} defaults to {q.default!r} (BlueFog: {p.default!r})")
    for q in our_params:
        if q.name not in theirs.parameters and q.default is P.empty and q.kind not in (P.VAR_POSITIONAL,
                                                                                      P.VAR_KEYWORD):
            problems.append(f"extra required parameter {q.name!r}")
    return problems


@pytest.mark.parametrize("name", sorted(BLUEFOG_SIGNATURES))
def test_name_exported(name):
    assert callable(getattr(bf, name, None)), f"bf.{name} is missing"
    assert name in bf.__all__, f"{name} is not in shoal.torch.__all__ (from shoal.torch import *)"


@pytest.mark.parametrize("name", sorted(n for n, s in BLUEFOG_SIGNATURES.items() if s))
def test_signature(name):
    problems = signature_problems(name, inspect.signature(getattr(bf, name)),
                                  _bluefog_signature(BLUEFOG_SIGNATURES[name]))
    assert not problems, f"bf.{name}{inspect.signature(getattr(bf, name))}: {problems}"


def test_signature_check_can_fail():
    theirs = _bluefog_signature("(tensor, *, self_weight=None, name=None)")
    assert signature_problems("f", _bluefog_signature("(tensor, name=None)"), theirs)  # missing
    assert signature_problems("f", _bluefog_signature("(tensor, self_weight=1.0, name=None)"), theirs)
    assert signature_problems("f", _bluefog_signature("(x, self_weight=None, name=None)"), theirs)
    assert signature_problems("f", _bluefog_signature("(tensor, self_weight=None, name=None, *, k)"),
                              theirs)
    assert not signature_problems("f", _bluefog_signature("(tensor, self_weight=None, name=None, op=None)"),
                                  theirs)


def test_optimizer_class_names_are_tracked_elsewhere():
    # Listed so the table above stays the complete non-optimizer export list of bluefog.torch.
    optimizer_names = {"CommunicationType", "DistributedAdaptThenCombineOptimizer",
                       "DistributedAdaptWithCombineOptimizer", "DistributedGradientAllreduceOptimizer",
                       "DistributedWinPutOptimizer", "DistributedAllreduceOptimizer",
                       "DistributedNeighborAllreduceOptimizer",
                       "DistributedHierarchicalNeighborAllreduceOptimizer"}
    exported = set(BLUEFOG_SIGNATURES) - NOT_EXPORTED_BY_BLUEFOG
    assert len(exported) + len(optimizer_names) == 99  # bluefog/torch/__init__.py imports 99 names


def test_topology_functions_take_bluefog_keywords():
    g = bf.ExponentialGraph(size=8, base=2)
    assert bf.GetRecvWeights(topo=g, rank=0) == (0.25, {4: 0.25, 6: 0.25, 7: 0.25})
    assert bf.GetSendWeights(topo=g, rank=0) == (0.25, {1: 0.25, 2: 0.25, 4: 0.25})
    assert bf.IsRegularGraph(topo=g) is True
    assert bf.IsTopologyEquivalent(topo1=g, topo2=bf.ExponentialTwoGraph(size=8)) is True
    gen = bf.GetDynamicOnePeerSendRecvRanks(topo=g, self_rank=0)
    assert [next(gen) for _ in range(4)] == [([1], [7]), ([2], [6]), ([4], [4]), ([1], [7])]
    assert bf.MeshGrid2DGraph(size=6, shape=(2, 3)).number_of_nodes() == 6
    assert bf.StarGraph(size=4, center_rank=1).has_edge(1, 3)
    assert bf.RingGraph(size=5, connect_style=2).has_edge(0, 1) and not bf.RingGraph(5, 2).has_edge(1, 0)
    assert bf.SymmetricExponentialGraph(size=12, base=4).number_of_edges() == 12 * 5
    assert bf.FullyConnectedGraph(size=3).number_of_edges() == 9
    machine = bf.GetExp2DynamicSendRecvMachineRanks(world_size=8, local_size=2, self_rank=2, local_rank=0)
    assert next(machine) == ([2], [0])
    ring = bf.GetInnerOuterRingDynamicSendRecvRanks(world_size=8, local_size=4, self_rank=0)
    assert next(ring) == ([4], [4])
    expo = bf.GetInnerOuterExpo2DynamicSendRecvRanks(world_size=8, local_size=4, self_rank=1)
    assert next(expo) == ([2], [3])


def test_topology_util_module_path():
    # `from bluefog.common import topology_util` migrates by the same import change.
    from shoal.common import topology_util
    import shoal.topology
    assert sorted(topology_util.__all__) == sorted(shoal.topology.BLUEFOG_NAMES)
    assert topology_util.ExponentialGraph is bf.ExponentialGraph
    assert topology_util.GetRecvWeights(topo=topology_util.RingGraph(4), rank=0) == bf.GetRecvWeights(
        bf.RingGraph(4), 0)


# ---- single process (plain python = 1 rank) -------------------------------------------------------
def test_queries_before_init():
    assert not basics.is_initialized()
    assert bf.in_neighbor_ranks() == [] and bf.out_neighbor_ranks() == []  # BlueFog: [] without topology
    assert bf.in_neighbor_machine_ranks() == [] and bf.load_topology() is None
    for f in (bf.size, bf.rank, bf.local_size, bf.local_rank, bf.mpi_threads_supported,
              bf.is_homogeneous, bf.unified_mpi_window_model_supported):
        with pytest.raises(ValueError):
            f()
    bf.set_skip_negotiate_stage(True)  # BlueFog ignores it before init
    assert bf.get_skip_negotiate_stage() is False
    assert bf.timeline_start_activity("t", "a") is False


@pytest.fixture
def single():
    bf.init()
    yield
    bf.set_skip_negotiate_stage(False)
    bf.shutdown()


def test_query_return_types(single):
    v = bf.mpi_threads_supported()
    assert type(v) is int and v in (0, 1)  # BlueFog returns the C int
    assert bf.unified_mpi_window_model_supported() is True
    built, what = basics._core.gpu_support()
    assert bf.nccl_built() is (built and "NCCL backend" in what and "no NCCL backend" not in what)
    assert bf.is_homogeneous() is True
    assert bf.suspend() is None and bf.resume() is None
    assert bf.set_skip_negotiate_stage(1) is None and bf.get_skip_negotiate_stage() is True


def test_topology_argument_errors(single):
    with pytest.raises(TypeError):
        bf.set_topology(bf.RingGraph(2))  # wrong node count: TypeError in BlueFog
    with pytest.raises(ValueError):
        bf.set_topology(bf.RingGraph(2))  # ... and ValueError, as Shoal's other argument errors
    with pytest.raises(TypeError):
        bf.set_topology("ring")
    with pytest.raises(ValueError):
        bf.set_machine_topology(None)
    with pytest.raises(TypeError):
        bf.set_machine_topology(bf.RingGraph(2))


def test_window_error_types(single):
    with pytest.raises(KeyError):
        bf.win_free("never.created")  # BlueFog: KeyError from its registry
    with pytest.raises(KeyError):
        bf.win_update("never.created")
    with pytest.raises(ValueError):
        bf.win_update("never.created")
    with pytest.raises(ValueError):  # BlueFog's win_lock: ValueError
        with bf.win_lock("never.created"):
            pass
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert bf.win_wait(123456789) is False
    assert any("unknown window handle" in str(w.message) for w in seen)
    with pytest.raises(ValueError):
        bf.win_poll(123456789)


def test_deprecated_keywords_raise_type_error(single):
    with pytest.raises(TypeError):
        bf.neighbor_allreduce(torch.ones(2), neighbor_weights={})
    with pytest.raises(TypeError):
        bf.neighbor_allreduce_nonblocking(torch.ones(2), send_neighbors=[])
    with pytest.raises(TypeError):
        bf.hierarchical_neighbor_allreduce(torch.ones(2), send_neighbor_machines=[])


# ---- environment variables ---------------------------------------------------------------------
ENV_CASES = {
    "timeline": ({"BLUEFOG_TIMELINE": "/tmp/tl"}, {"SHOAL_TIMELINE": "/tmp/tl"}),
    "log_level": ({"BLUEFOG_LOG_LEVEL": "DEBUG"}, {"SHOAL_LOG_LEVEL": "debug"}),
    "log_level_fatal": ({"BLUEFOG_LOG_LEVEL": "fatal"}, {"SHOAL_LOG_LEVEL": "error"}),
    "log_level_unknown": ({"BLUEFOG_LOG_LEVEL": "loud"}, {"SHOAL_LOG_LEVEL": "warning"}),
    "cycle_time": ({"BLUEFOG_CYCLE_TIME": "0.5"}, {"SHOAL_CYCLE_TIME": "0.5"}),
    "cycle_time_prefix": ({"BLUEFOG_CYCLE_TIME": "20ms"}, {"SHOAL_CYCLE_TIME": "20"}),
    "cycle_time_negative": ({"BLUEFOG_CYCLE_TIME": "-3"}, {"SHOAL_CYCLE_TIME": "0"}),
    "fusion_threshold": ({"BLUEFOG_FUSION_THRESHOLD": "1048576"}, {"SHOAL_FUSION_THRESHOLD": "1048576"}),
    "nodes_per_machine": ({"BLUEFOG_NODES_PER_MACHINE": "4"}, {"SHOAL_RANKS_PER_MACHINE": "4"}),
    "by_mpi": ({"BLUEFOG_ALLREDUCE_BY_MPI": "1"}, {"SHOAL_GPU_BACKEND": "mpi"}),
    "ops_on_cpu": ({"BLUEFOG_OPS_ON_CPU": "1"}, {"SHOAL_GPU_BACKEND": "mpi"}),
    "by_mpi_off": ({"BLUEFOG_WIN_OPS_BY_MPI": "0"}, {}),
    "shoal_wins": ({"BLUEFOG_TIMELINE": "/tmp/a", "SHOAL_TIMELINE": "/tmp/b"}, {}),
    "empty_is_unset": ({"BLUEFOG_TIMELINE": "", "BLUEFOG_LOG_LEVEL": "info", "SHOAL_LOG_LEVEL": ""},
                       {"SHOAL_LOG_LEVEL": "info"}),
    "ignored": ({k: "1" for k in _compat_env.IGNORED}, {}),
}


@pytest.mark.parametrize("case", sorted(ENV_CASES))
def test_bluefog_env_mapping(case):
    env, want = ENV_CASES[case]
    before = dict(env)
    assert _compat_env.bluefog_settings(env) == want
    assert env == before  # pure
    applied = dict(env)
    assert _compat_env.apply_bluefog_env(applied) == want
    assert applied == {**before, **want}


@pytest.mark.parametrize("value", ["0", "-2", "many"])
def test_bluefog_nodes_per_machine_must_be_positive(value):
    with pytest.raises(ValueError, match="BLUEFOG_NODES_PER_MACHINE"):
        _compat_env.bluefog_settings({"BLUEFOG_NODES_PER_MACHINE": value})


def _init_env_probe(tmp_path):
    """A plain-python process with BlueFog variables set: what init() made of them."""
    code = ("import os, shoal\nshoal.init()\n"
            "print(os.environ.get('SHOAL_TIMELINE'), os.environ.get('SHOAL_LOG_LEVEL'),"
            " shoal.timeline_start_activity('probe', 'SPAN'))\nshoal.shutdown()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "BLUEFOG_"))}
    env.update(BLUEFOG_TIMELINE=str(tmp_path / "probe"), BLUEFOG_LOG_LEVEL="fatal")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_init_applies_bluefog_env(tmp_path):
    timeline, level, recorded = _init_env_probe(tmp_path)
    assert (timeline, level, recorded) == (str(tmp_path / "probe"), "error", "True")
    assert (tmp_path / "probe0.json").exists()


# ---- 4 ranks, 2 per machine (BLUEFOG_NODES_PER_MACHINE), one job for every item ----------------
WORKER_ITEMS = [
    "env_nodes_per_machine", "env_log_level_fatal", "env_cycle_time_and_fusion", "env_timeline",
    "init_default_topology", "init_again_resets_topology", "rank_queries_are_ints",
    "mpi_threads_supported_int", "unified_mpi_window_model_supported_bool", "nccl_built_bool",
    "set_topology_returns_and_errors", "set_machine_topology_errors_and_neighbors", "suspend_resume",
    "skip_negotiate_stage", "barrier_returns_none", "allreduce_average_default_and_sum",
    "allreduce_inplace_returns_tensor", "nonblocking_handles_poll_wait", "broadcast_forms",
    "allgather_variable_first_dim", "neighbor_allgather_static_and_dynamic",
    "neighbor_allreduce_static", "neighbor_allreduce_dynamic_dst_weights",
    "neighbor_allreduce_dynamic_pattern_mismatch_is_value_error",
    "neighbor_allreduce_deprecated_kwargs", "one_peer_dynamic_loop_with_bluefog_keywords",
    "hierarchical_neighbor_allreduce", "pair_gossip", "infer_ranks",
    "win_create_names_and_set_topology_refused", "win_aliases_are_the_same_functions",
    "win_put_versions_update_returns_registered_tensor",
    "win_put_self_weight_scales_in_place_and_handles", "win_get_and_accumulate_versions",
    "push_sum_associated_p", "win_mutex_and_win_lock", "win_free_unknown_and_all",
]
RANKS = 4


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """(the one job of every item, its directory); it runs when the first item asks."""
    tmp = tmp_path_factory.mktemp("bluefog_api")
    probe = _init_env_probe(tmp)
    wired = probe[:2] != ["None", "None"]
    env = {"BLUEFOG_NODES_PER_MACHINE": "2", "BLUEFOG_LOG_LEVEL": "fatal", "BLUEFOG_CYCLE_TIME": "0.5",
           "BLUEFOG_FUSION_THRESHOLD": "1048576", "BLUEFOG_TIMELINE": str(tmp / "timeline"),
           "SHOAL_STALL_SHUTDOWN_TIME": "30"}  # a check that desynchronizes the ranks fails, not hangs
    for k in ("SHOAL_RANKS_PER_MACHINE", "SHOAL_LOG_LEVEL", "SHOAL_CYCLE_TIME", "SHOAL_FUSION_THRESHOLD",
              "SHOAL_TIMELINE"):
        env[k] = ""  # empty = unset for the core and for the mapping
    return Job(RANKS, "bluefog_api.py", *([] if wired else ["--explicit-env"]), env=env, timeout=240), tmp


@pytest.mark.parametrize("name", WORKER_ITEMS)
def test_multi_rank(job, name):
    job[0].check(name)


def test_multi_rank_job_exit_code(job):
    out = job[0].output()
    assert out.count("BFAPI done") == RANKS, out[-3000:]


def test_multi_rank_timeline_files(job):
    # BLUEFOG_TIMELINE=prefix: BlueFog's file names, <prefix><rank>.json, with the user's spans.
    job[0].output()
    tmp = job[1]
    for r in range(RANKS):
        text = (tmp / f"timeline{r}.json").read_text()
        assert "USER_SPAN" in text and "CONTEXT_SPAN" in text, (r, text[-500:])


# BlueFog's activity names (v0.3.0: bluefog/torch/mpi_ops.cc and mpi_win_ops.cc write
# ENQUEUE_<OP> around the whole op, bluefog/common/operations.cc PROC_<OP> or WIN_<OP> while
# it runs, mpi_controller.cc COMMUNICATE and COMPUTE_AVERAGE inside; its test/timeline_test.py
# and docs/timeline.rst read MPI_<OP>, the name before its 2020 rename), next to Shoal's own.
BLUEFOG_TRACKS = {
    "bfapi.nar_dst": ["neighbor_allreduce", "WAIT_FOR_PEERS", "REDUCE", "ENQUEUE_NEIGHBOR_ALLREDUCE",
                      "PROC_NEIGHBOR_ALLREDUCE", "MPI_NEIGHBOR_ALLREDUCE", "COMMUNICATE", "COMPUTE_AVERAGE"],
    "bfapi.nag": ["neighbor_allgather", "WAIT_FOR_PEERS", "ENQUEUE_NEIGHBOR_ALLGATHER",
                  "PROC_NEIGHBOR_ALLGATHER", "MPI_NEIGHBOR_ALLGATHER", "COMMUNICATE"],
    "bfapi.w": ["ENQUEUE_WIN_PUT", "WIN_PUT", "MPI_WIN_PUT"],
    "bfapi.g": ["ENQUEUE_WIN_GET", "WIN_GET", "MPI_WIN_GET",
                "ENQUEUE_WIN_ACCUMULATE", "WIN_ACCUMULATE", "MPI_WIN_ACCUMULATE"],
}


def test_multi_rank_timeline_has_bluefog_activity_names(job):
    from shoal import timeline
    job[0].output()
    for r in range(RANKS):
        events = [e for e in timeline.load(job[1] / f"timeline{r}.json") if e.get("ph") == "X"]
        for track, want in BLUEFOG_TRACKS.items():
            spans = [e for e in events if e["args"].get("tensor") == track]
            names = {e["name"] for e in spans}
            assert set(want) <= names, (r, track, sorted(set(want) - names), sorted(names))
        # Each op's BlueFog spans nest as BlueFog's do: ENQUEUE_ holds PROC_, which holds COMMUNICATE.
        spans = [e for e in events if e["args"].get("tensor") == "bfapi.nar_dst"]
        first = {n: next(e for e in spans if e["name"] == n)
                 for n in ("ENQUEUE_NEIGHBOR_ALLREDUCE", "PROC_NEIGHBOR_ALLREDUCE", "COMMUNICATE")}
        for outer, inner in (("ENQUEUE_NEIGHBOR_ALLREDUCE", "PROC_NEIGHBOR_ALLREDUCE"),
                             ("PROC_NEIGHBOR_ALLREDUCE", "COMMUNICATE")):
            o, i = first[outer], first[inner]
            # (a few µs of slack: each timestamp maps the monotonic clock to wall time on its own)
            assert o["ts"] <= i["ts"] + 5 and i["ts"] + i["dur"] <= o["ts"] + o["dur"] + 5, (r, o, i)


def test_every_worker_item_has_a_test_id():
    assert worker_checks("bluefog_api.py") == WORKER_ITEMS
