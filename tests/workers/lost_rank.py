"""Fault-tolerant mode (shoalrun --fault-tolerant, Open MPI's ULFM): ranks die; the
survivors recover and go on. Usage: lost_rank.py SCENARIO DIR [KILLS]

KILLS: "RANK@ITER[:how],..." (launch ranks; how: exit (os._exit(3), the default), kill
(SIGKILL), raise (an uncaught exception), machine (SIGKILL to every rank of its emulated
machine, its network namespace; MPI's daemon there stays)). Scenarios:
  ops        a loop of allreduce, neighbor_allreduce, broadcast and allgather (numpy);
             after each loss the survivors realign the loop (allreduce max) and check
             exact results over the survivors
  tf_ops     the same through shoal.tensorflow's eager ops
  inflight   the victim dies while the survivors wait on nonblocking ops that involve it
  usergraph  a user graph (not one of Shoal's families): rebuilt with Metropolis-Hastings
  stopped    no rank dies: launch rank 2 is stopped (SIGSTOP) for 8 s mid-loop by rank 0,
             and nobody may take it for dead
  ringend    a ring; a rank dies before the last op, so rank 0 (no neighbor of it) finishes
             and shuts down without seeing the loss while its neighbors recover
  window     window puts to the neighbors and an exact win_update each round when a rank
             dies; the survivors go on in the recreated window
  elastic    a Horovod elastic script (hvd.elastic.run, TorchState, commit every 5 batches)
  keras_awc | keras_atc   a Keras decentralized optimizer in model.fit trains least squares
             through the loss (no elastic); keras_awc+cc with consensus control
  keras_elastic  the elastic script with Keras: model.fit in hvd.elastic.run, KerasState, Horovod's callbacks
             (+awc: with the AWC optimizer instead of DistributedOptimizer)
  psets      process sets [0, 1], [1, 2, 3] and [2] (launch ranks); launch rank 2 dies
  awc | atc | gradient | delayed | pushsum | winput   a torch optimizer trains least
             squares through the losses
             (+metric: with a user allreduce after every step)
Every survivor prints one "RESULT {json}" line; the victim records when it died in DIR.
LOST_RANK_NAP=S: ops and tf_ops sleep S seconds after each round (survivors that outlive a loss).
"""
import json
import os
import signal
import sys
import time

import networkx as nx
import numpy as np

import shoal
from shoal import topology


NAP = float(os.environ.get("LOST_RANK_NAP", "0"))


def kills(spec):
    out = {}
    for item in filter(None, spec.split(",")):
        who, _, rest = item.partition("@")
        it, _, how = rest.partition(":")
        out[int(who)] = (int(it), how or "exit")
    return out


def die(directory, how):
    with open(os.path.join(directory, f"died.{LAUNCH}"), "w") as f:
        f.write(f"{time.time():.6f}\n")
    if how == "machine":  # every rank of this emulated machine (its network namespace) at once
        mine, me = os.readlink("/proc/self/ns/net"), os.path.abspath(sys.argv[0]).encode()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    ours = f.read().split(b"\0")[1:2] == [me]  # python SCRIPT: a rank, not its wrapper
                if ours and int(pid) != os.getpid() and os.readlink(f"/proc/{pid}/ns/net") == mine:
                    os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass  # ended meanwhile
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "raise":
        raise RuntimeError("this rank fails on purpose")
    os._exit(3)


def retried(op):
    """op() again after a loss that surfaced in it (every survivor calls it next)."""
    try:
        return op()
    except shoal.RankLostError:
        return op()


def check_ops(x_rank):
    """Exact results of one round over the current ranks (x = rank)."""
    n, r = shoal.size(), shoal.rank()
    total = shoal.allreduce(np.full(3, float(x_rank)), op=shoal.Sum, name="sum")
    assert np.array_equal(total, np.full(3, float(n * (n - 1) // 2))), (total, n)
    got = shoal.neighbor_allreduce(np.full(3, float(x_rank)), name="nar")
    self_w, src = topology.recv_weights(topology.exponential_two_graph(n), r)
    want = self_w * r + sum(w * j for j, w in src.items())
    assert np.allclose(got, want, atol=1e-12), (got, want)
    root = n - 1
    b = shoal.broadcast(np.full(2, float(r)), root_rank=root, name="bcast")
    assert np.array_equal(b, np.full(2, float(root)))
    g = shoal.allgather(np.full((1, 2), float(r)), name="gather")
    assert np.array_equal(g[:, 0], np.arange(n, dtype=float))


def check_tf_ops(x_rank):
    """check_ops through shoal.tensorflow's eager ops (TensorFlow's kernels)."""
    import tensorflow as tf
    import shoal.tensorflow as st
    n, r = shoal.size(), shoal.rank()
    total = st.allreduce(tf.fill([3], float(x_rank)), op=st.Sum, name="sum").numpy()
    assert np.array_equal(total, np.full(3, float(n * (n - 1) // 2))), (total, n)
    got = st.neighbor_allreduce(tf.fill([3], float(x_rank)), name="nar").numpy()
    self_w, src = topology.recv_weights(topology.exponential_two_graph(n), r)
    assert np.allclose(got, self_w * r + sum(w * j for j, w in src.items()), atol=1e-6), got
    b = st.broadcast(tf.fill([2], float(r)), root_rank=n - 1, name="bcast").numpy()
    assert np.array_equal(b, np.full(2, float(n - 1)))
    g = st.allgather(tf.fill([1, 2], float(r)), name="gather").numpy()
    assert np.array_equal(g[:, 0], np.arange(n, dtype=np.float32))


def run_ops(directory, plan, iters=30, inflight=False, check=check_ops):
    losses, first_after = [], []
    it = 0
    while it < iters:
        if LAUNCH in plan and plan[LAUNCH][0] == it:
            if inflight:
                shoal.barrier()  # the others are waiting on ops that need this rank when it dies
                time.sleep(0.3)
            die(directory, plan[LAUNCH][1])
        try:
            if inflight and any(v[0] == it for v in plan.values()):
                hs = [shoal.allreduce_nonblocking(np.ones(4), name="ia"),
                      shoal.neighbor_allreduce_nonblocking(np.ones(4), name="inar")]
                shoal.barrier()
                for h in hs:
                    shoal.synchronize(h)
            check(shoal.rank())
            time.sleep(NAP)
            if len(first_after) < len(losses):
                first_after.append(time.time())
            it += 1
        except shoal.RankLostError as e:
            losses.append({"lost": e.lost_ranks, "at": e.lost_at, "iter": it, "size": shoal.size()})
            # The loop realigns: every survivor resumes at the furthest iteration any reached.
            it = int(shoal.allreduce(np.array([it], dtype=np.int64), op=shoal.Max, name="align")[0])
    assert topology.is_topology_equivalent(shoal.load_topology(), topology.exponential_two_graph(shoal.size()))
    return {"losses": losses, "first_after": first_after}


def run_usergraph(directory, plan):
    n = shoal.size()  # 4: a star around rank 0 with one more edge (1-2), of no family of Shoal's
    g = topology.metropolis_hastings_weights(nx.Graph([(0, 1), (0, 2), (0, 3), (1, 2)]))
    shoal.set_topology(g, is_weighted=True)
    out = run_ops_plain(directory, plan)
    keep = [r for r in range(n) if r not in plan]
    sub = nx.relabel_nodes(g.subgraph(keep), {r: i for i, r in enumerate(keep)})
    want = topology.metropolis_hastings_weights(sub)
    out["mh"] = topology.is_topology_equivalent(shoal.load_topology(), want)
    w = topology.mixing_matrix(shoal.load_topology())
    out["doubly_stochastic"] = bool(np.allclose(w.sum(0), 1) and np.allclose(w.sum(1), 1))
    return out


def run_ops_plain(directory, plan, iters=20):
    losses, it = [], 0
    while it < iters:
        if LAUNCH in plan and plan[LAUNCH][0] == it:
            die(directory, plan[LAUNCH][1])
        try:
            shoal.neighbor_allreduce(np.ones(3), name="nar")
            it += 1
        except shoal.RankLostError as e:
            losses.append({"lost": e.lost_ranks, "iter": it, "size": shoal.size()})
            it = int(shoal.allreduce(np.array([it], dtype=np.int64), op=shoal.Max, name="align")[0])
    return {"losses": losses}


def run_stopped(iters=20):
    pids = shoal.allgather(np.array([[os.getpid()]], dtype=np.int64), name="pids")[:, 0]
    losses, stopped_for = [], 0.0
    for it in range(iters):
        if it == 5 and shoal.rank() == 0:
            t = time.time()
            os.kill(int(pids[2]), signal.SIGSTOP)
            time.sleep(8)
            os.kill(int(pids[2]), signal.SIGCONT)
            stopped_for = time.time() - t
        try:
            check_ops(shoal.rank())
        except shoal.RankLostError as e:
            losses.append(e.lost_ranks)
    return {"losses": losses, "stopped_for": stopped_for}


def run_ringend(directory, plan, iters=10):
    shoal.set_topology(topology.ring_graph(shoal.size()))
    losses = []
    for it in range(iters):
        if LAUNCH in plan and plan[LAUNCH][0] == it:
            time.sleep(0.3)
            die(directory, plan[LAUNCH][1])
        try:
            shoal.neighbor_allreduce(np.ones(2), name="nar")
        except shoal.RankLostError as e:
            losses.append(e.lost_ranks)
    return {"losses": losses}


def run_window(directory, plan, iters=12):
    """Each round: put this rank's value (its launch rank) into the out-neighbours' windows,
    a barrier, then win_update (a copy) must be exactly the uniform average of the value and
    the in-neighbours' (as launch ranks). A round a loss interrupts runs again: the recovery
    recreated the window over the new topology (a put into the dead rank must not hang)."""
    x = np.full(4, float(LAUNCH))
    shoal.win_create(x, name="w")
    alive, losses, exact, it, wrong = list(range(shoal.size())), [], 0, 0, []
    while it < iters:
        if LAUNCH in plan and plan[LAUNCH][0] == it:
            die(directory, plan[LAUNCH][1])
        try:
            shoal.win_put(x, name="w")
            shoal.barrier()
            got = shoal.win_update("w", clone=True)
            shoal.barrier()  # nobody puts the next round's value before everyone combined
        except shoal.RankLostError as e:
            losses.append(e.lost_ranks)
            alive = [r for r in alive if r not in e.lost_ranks]
            it = int(shoal.allreduce(np.array([it], dtype=np.int64), op=shoal.Max, name="align")[0])
            continue
        values = [float(LAUNCH)] + [float(alive[r]) for r in shoal.in_neighbor_ranks()]
        if np.array_equal(got, np.full(4, sum(values) / len(values))):
            exact += 1
        else:
            wrong.append((it, got.tolist(), values))
        it += 1
    names = shoal.get_current_created_window_names()
    shoal.win_free("w")
    return {"losses": losses, "exact_rounds": exact, "windows": names, "wrong": wrong}


def run_elastic(directory, plan, epochs=4, batches=20):
    import torch
    import shoal.torch as hvd
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, opt, epoch=0, batch=0)
    w = torch.arange(8.0)[:, None] / 8
    resets = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])
    calls = []

    @hvd.elastic.run
    def train(state):
        calls.append(hvd.size())
        g = torch.Generator().manual_seed(1000 * state.epoch + state.batch + 7 * LAUNCH)
        while state.epoch < epochs:
            while state.batch < batches:
                step = state.epoch * batches + state.batch
                if LAUNCH in plan and plan[LAUNCH][0] == step:
                    die(directory, plan[LAUNCH][1])
                x = torch.randn(16, 8, generator=g)
                opt.zero_grad()
                ((model(x) - x @ w) ** 2).mean().backward()
                opt.step()
                state.batch += 1
                if state.batch % 5 == 0:
                    state.commit()
            state.epoch, state.batch = state.epoch + 1, 0
            state.commit()

    train(state)
    weight = model.weight.detach().clone()
    gathered = hvd.allgather(weight, name="replicas")
    return {"error": float((weight - w.T).norm()), "identical": all(torch.equal(gathered[0], r) for r in gathered),
            "calls": calls, "resets": resets, "epoch": state.epoch}


def run_keras_elastic(directory, plan, awc=False, epochs=4, batches=20):
    """A Keras elastic script: model.fit (a traced step) in hvd.elastic.run, Horovod's
    three callbacks, commit every 5 batches; the victim dies at its PLAN-th batch.
    `awc`: the AWC optimizer (its exchange runs on the host) instead of DistributedOptimizer."""
    import keras
    import tensorflow as tf
    import shoal.keras as hvd
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    wrap = hvd.DistributedAdaptWithCombineOptimizer if awc else hvd.DistributedOptimizer
    model.compile(optimizer=wrap(keras.optimizers.SGD(0.05)), loss="mse")
    w = (np.arange(8.0)[:, None] / 8).astype(np.float32)
    x = np.random.default_rng(LAUNCH).standard_normal((16 * batches, 8)).astype(np.float32)
    data = tf.data.Dataset.from_tensor_slices((x, x @ w)).batch(16).repeat()
    state = hvd.elastic.KerasState(model, epoch=0, batch=0)
    resets, calls, begun = [], [], [0]
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])

    class Victim(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if LAUNCH in plan and plan[LAUNCH][0] == begun[0]:
                die(directory, plan[LAUNCH][1])
            begun[0] += 1

    @hvd.elastic.run
    def train(state):
        calls.append(hvd.size())
        model.fit(data, steps_per_epoch=batches, epochs=epochs - state.epoch, verbose=0,
                  callbacks=[Victim(), hvd.elastic.UpdateBatchStateCallback(state),
                             hvd.elastic.UpdateEpochStateCallback(state),
                             hvd.elastic.CommitStateCallback(state, batches_per_commit=5)])

    train(state)
    weights = np.concatenate([v.ravel() for v in model.get_weights()])
    gathered = hvd.allgather(tf.constant(weights[None]), name="replicas").numpy()
    return {"error": float(np.linalg.norm(model.get_weights()[0] - w)), "calls": calls, "resets": resets,
            "epoch": state.epoch, "identical": bool((gathered == gathered[0]).all()),
            "spread": float(np.abs(gathered - gathered.mean(0)).max())}


def run_keras_optimizer(kind, directory, plan, steps=80):
    """A Keras decentralized optimizer (AWC or ATC, static topology) in model.fit, no
    elastic: the survivors' fit goes on through the loss."""
    import keras
    import shoal.keras as hvd
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    kind, _, variant = kind.partition("+")
    wrap = hvd.DistributedAdaptWithCombineOptimizer if kind == "awc" else hvd.DistributedAdaptThenCombineOptimizer
    # +cc: consensus control after every step (its Ξ allreduce is where a rank that is no
    # neighbor of the lost one meets the loss)
    cc = hvd.ConsensusControl(target=1e-4, check_every=1, max_extra_rounds=1) if variant == "cc" else None
    opt = wrap(keras.optimizers.SGD(0.05), consensus_control=cc)
    model.compile(optimizer=opt, loss="mse")
    w = (np.arange(8.0)[:, None] / 8).astype(np.float32)
    x = np.random.default_rng(LAUNCH).standard_normal((32 * steps, 8)).astype(np.float32)
    seen = {"size": hvd.size(), "losses": 0, "first_after": []}

    class Watch(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if LAUNCH in plan and plan[LAUNCH][0] == batch:
                die(directory, plan[LAUNCH][1])

        def on_train_batch_end(self, batch, logs=None):
            if hvd.size() < seen["size"]:  # a loss was recovered in this batch
                seen["size"], seen["losses"] = hvd.size(), seen["losses"] + 1
                seen["first_after"].append(None)
            elif seen["first_after"] and seen["first_after"][-1] is None:
                seen["first_after"][-1] = time.time()

    model.fit(x, x @ w, batch_size=32, epochs=1, shuffle=False, verbose=0, callbacks=[Watch()])
    weight = model.get_weights()[0]
    mean = shoal.allreduce(weight.astype(np.float64), name="mean")
    spread = float(shoal.allreduce(np.array([np.linalg.norm(weight - mean)]), op=shoal.Max, name="spread")[0])
    return {"error": float(np.linalg.norm(weight - w)), "spread": spread, "losses": seen["losses"],
            "first_after": seen["first_after"], "quiet_until": opt._shoal_mixer._quiet_until,
            "lost": shoal.losses(), "communications": opt.communications}


def run_psets(directory, plan, iters=12):
    sets = [shoal.add_process_set(r) for r in ([0, 1], [1, 2, 3], [2])]
    losses, it = [], 0
    while it < iters:
        if LAUNCH in plan and plan[LAUNCH][0] == it:
            die(directory, plan[LAUNCH][1])
        try:
            for ps in sets:
                if ps.process_set_id is not None and shoal.rank() in ps.ranks:
                    got = shoal.allreduce(np.full(2, float(shoal.rank())), op=shoal.Sum, name=f"s{sets.index(ps)}",
                                          process_set=ps)
                    assert got[0] == sum(ps.ranks), (got, ps)
            it += 1
        except shoal.RankLostError as e:
            losses.append(e.lost_ranks)
            it = int(shoal.allreduce(np.array([it], dtype=np.int64), op=shoal.Max, name="align")[0])
    return {"losses": losses, "sets": [[ps.process_set_id, ps.ranks] for ps in sets]}


def run_optimizer(kind, directory, plan, steps=80):
    """`kind` + "+metric": a user allreduce after every step too (a loss may surface there);
    "+cc": consensus control every second communication step (its Ξ collectives are where a
    rank that is no neighbor of the lost one meets the loss, and the survivors must agree on
    which steps check)."""
    import torch
    import shoal.torch as bf
    kind, variant = kind.partition("+")[::2]
    metric = variant == "metric"
    if variant == "gc":  # an optimizer made and dropped first, collected on rank 0 only
        import gc
        first = torch.nn.Linear(1, 1)
        dropped = bf.DistributedAdaptWithCombineOptimizer(torch.optim.SGD(first.parameters(), lr=0.1), first)
        del dropped, first
        if LAUNCH == 0:
            gc.collect()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    bf.broadcast_parameters(model.state_dict(), root_rank=0)
    base = torch.optim.SGD(model.parameters(), lr=0.05)
    if kind == "gradient":
        opt = bf.DistributedGradientAllreduceOptimizer(base, model)
    elif kind == "atc":
        opt = bf.DistributedAdaptThenCombineOptimizer(base, model)
    elif kind == "pushsum":
        opt = bf.DistributedPushSumOptimizer(base, model)
    elif kind == "winput":
        opt = bf.DistributedWinPutOptimizer(base, model)
    else:
        overlap = "delayed" if kind == "delayed" else "backward"
        cc = bf.ConsensusControl(target=1e-4, check_every=2, max_extra_rounds=1) if variant == "cc" else None
        opt = bf.DistributedAdaptWithCombineOptimizer(base, model, overlap=overlap, consensus_control=cc)
    g = torch.Generator().manual_seed(LAUNCH)
    w = torch.arange(8.0)[:, None] / 8
    size_before, first_after, losses = bf.size(), [], 0
    for step in range(steps):
        if LAUNCH in plan and plan[LAUNCH][0] == step:
            die(directory, plan[LAUNCH][1])
        x = torch.randn(32, 8, generator=g)
        opt.zero_grad()
        loss = ((model(x) - x @ w) ** 2).mean()
        loss.backward()
        opt.step()
        if metric:
            try:
                bf.allreduce(loss.detach(), name="metric")
            except bf.RankLostError:
                bf.allreduce(loss.detach(), name="metric")  # every survivor calls it again
        if bf.size() < size_before:  # a loss was recovered in this step
            size_before, losses = bf.size(), losses + 1
            first_after.append(None)
        elif first_after and first_after[-1] is None:
            first_after[-1] = time.time()  # the first step completed after it
    if hasattr(opt, "overlap"):
        opt.synchronize()
    windows = shoal.get_current_created_window_names()
    if hasattr(opt, "close"):
        retried(opt.close)  # collects what is still in flight (collective)
    weight = model.weight.detach().clone()
    mean = retried(lambda: bf.allreduce(weight, op=bf.Average, name="mean"))
    spread = bf.allreduce(torch.tensor([float((weight - mean).norm())]), op=bf.Max, name="spread").item()
    gathered = bf.allgather(weight, name="replicas")
    identical = all(torch.equal(gathered[0], row) for row in gathered)
    return {"error": float((weight - w.T).norm()), "spread": spread, "identical": identical, "losses": losses,
            "first_after": first_after, "quiet_until": opt._quiet_until, "lost": shoal.losses(), "windows": windows,
            "communications": getattr(opt, "communications", None)}


if __name__ == "__main__":
    scenario, directory = sys.argv[1], sys.argv[2]
    plan = kills(sys.argv[3] if len(sys.argv) > 3 else "")
    shoal.init()
    LAUNCH = shoal.rank()
    if scenario in ("ops", "inflight"):
        result = run_ops(directory, plan, inflight=scenario == "inflight")
    elif scenario == "tf_ops":
        result = run_ops(directory, plan, check=check_tf_ops)
    elif scenario == "usergraph":
        result = run_usergraph(directory, plan)
    elif scenario == "stopped":
        result = run_stopped()
    elif scenario == "ringend":
        result = run_ringend(directory, plan)
    elif scenario == "window":
        result = run_window(directory, plan)
    elif scenario == "elastic":
        result = run_elastic(directory, plan)
    elif scenario in ("keras_elastic", "keras_elastic+awc"):
        result = run_keras_elastic(directory, plan, awc=scenario.endswith("awc"))
    elif scenario in ("keras_awc", "keras_atc", "keras_awc+cc"):
        result = run_keras_optimizer(scenario[len("keras_"):], directory, plan)
    elif scenario == "psets":
        result = run_psets(directory, plan)
    else:
        result = run_optimizer(scenario, directory, plan)
    result.update(launch=LAUNCH, rank=shoal.rank(), size=shoal.size())
    print("RESULT " + json.dumps(result), flush=True)
    shoal.shutdown()
