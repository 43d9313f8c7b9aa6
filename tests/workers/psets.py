"""Process sets (Horovod's `hvd.add_process_set`, `process_set=`) in one framework, given as
the argument: numpy (`shoal`), torch (`shoal.torch`) or tf (`shoal.tensorflow`). At 4 ranks
with the sets {0, 2} and {1, 3}: both sets run different ops at once with exact values; a
set's op completes while the other set's ranks wait for it to have completed (so neither
waits for the other, whatever the timing); every reduce op and dtype in a set; non-members
refused; remove then add again; mismatched membership the same error on every rank;
DistributedOptimizer / DistributedGradientTape averaging within a set; repeated named
allreduces in a set skipping the coordinator. Run by tests/test_process_sets.py."""
import functools
import hashlib
import os
import sys
import time

import numpy as np

FW = sys.argv[1] if len(sys.argv) > 1 else "numpy"
if FW == "tf":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    import shoal.keras as hvd_keras
    import shoal.tensorflow as hvd
elif FW == "torch":
    import torch

    import shoal.torch as hvd
else:
    import shoal as hvd
import shoal  # noqa: E402
from checks import Skip, check, raises, run_all  # noqa: E402

hvd.init()
R, N = hvd.rank(), hvd.size()
if N != 4:
    raise SystemExit("psets.py runs at 4 ranks")
EVEN = hvd.add_process_set([0, 2])
ODD = hvd.add_process_set(hvd.ProcessSet([3, 1]))
MINE, OTHER = (EVEN, ODD) if R % 2 == 0 else (ODD, EVEN)
DTYPES = ["int8", "uint8", "int16", "int32", "int64", "float16", "float32", "float64"] + (
    [] if FW == "numpy" else ["bfloat16"])
FOLDS = {"Sum": np.add, "Min": np.minimum, "Max": np.maximum, "Product": np.multiply}


def tensor(values, dtype):
    """`values` (numpy) as this framework's tensor of `dtype` (bfloat16 from float32)."""
    values = np.asarray(values)
    if FW == "torch":
        src = torch.from_numpy(values.astype("float32" if dtype == "bfloat16" else dtype))
        return src.to(getattr(torch, dtype))
    if FW == "tf":
        return tf.cast(tf.constant(values % 256 if dtype == "uint8" else values), getattr(tf, dtype))
    return values.astype(dtype)


def array(t):
    """A framework tensor back as a numpy array (bfloat16 as float32)."""
    if FW == "torch":
        t = t.detach()
        return (t.float() if t.dtype == torch.bfloat16 else t).numpy()
    if FW == "tf":
        return (tf.cast(t, tf.float32) if t.dtype == tf.bfloat16 else t).numpy()
    return np.asarray(t)


def value(r, n=6):
    """Rank r's input: small integers in [-2, 4] (exact in every dtype; products of two
    fit int8; uint8 wraps the negative ones)."""
    i = np.arange(n)
    return (i % 4 - 1) * (1 + r % 2) + (i == n - 1) * r


def in_dtype(v, dtype):
    return v.astype("float32" if dtype == "bfloat16" else dtype)


def same_everywhere(msg):
    """Every rank got the very same text (compared over every rank)."""
    digest = np.frombuffer(hashlib.sha256(msg.encode()).digest(), np.uint8)
    every = shoal.allgather(digest[None, :], name=f"same.{hashlib.sha1(msg.encode()).hexdigest()[:12]}")
    assert all(np.array_equal(row, every[0]) for row in every), f"ranks saw different errors; here: {msg}"


def wait_for(path, what, limit=120):
    deadline = time.monotonic() + limit
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{what} never happened"
        time.sleep(0.005)


@check
def sets_as_horovod():
    ids = shoal.allgather(np.array([EVEN.process_set_id, ODD.process_set_id]), name="ids").reshape(N, 2)
    assert (ids == ids[0]).all() and 0 < ids[0, 0] < ids[0, 1], ids
    assert EVEN.ranks == [0, 2] and ODD.ranks == [1, 3], (EVEN.ranks, ODD.ranks)
    assert EVEN.size() == ODD.size() == 2
    assert MINE.included() and not OTHER.included()
    assert MINE.rank() == R // 2, MINE.rank()
    raises(ValueError, OTHER.rank)
    assert str(EVEN) == f"ProcessSet(process_set_id={EVEN.process_set_id}, ranks=[0, 2], mpi_comm=None)", str(EVEN)
    g = hvd.global_process_set
    assert g.process_set_id == 0 and g.ranks == [0, 1, 2, 3] and g.size() == 4 and g.rank() == R and g.included()
    assert hvd.remove_process_set(g) is False
    fresh = hvd.ProcessSet([2, 0, 1])
    assert fresh.process_set_id is None and fresh.size() is None and fresh.rank() is None and fresh.ranks == [0, 1, 2]
    if FW == "tf":
        assert hvd_keras.ProcessSet is hvd.ProcessSet and hvd_keras.add_process_set is hvd.add_process_set


@check
def init_with_process_sets():
    ps = hvd.ProcessSet([3, 0])
    hvd.init(process_sets=[ps])  # Horovod's static form (init is idempotent)
    assert ps.process_set_id and ps.ranks == [0, 3] and ps.size() == 2, ps
    if ps.included():
        got = array(hvd.allreduce(tensor(np.array([R]), "int64"), op=hvd.Sum, name="init.ps", process_set=ps))
        assert np.array_equal(got, [3]), got
    assert hvd.remove_process_set(ps) is True
    hvd.init(process_sets="dynamic")  # nothing to add
    raises(TypeError, hvd.init, process_sets="static")


@check
def disjoint_sets_run_different_ops_at_once():
    # {0, 2}: allreduce Sum and reducescatter; {1, 3}: allgather (uneven rows) and a
    # broadcast from world rank 3, all with the same names in both sets (names are per set).
    for dt in ("int32", "float32", "float64"):
        if R % 2 == 0:
            got = array(hvd.allreduce(tensor(value(R), dt), op=hvd.Sum, name=f"mix.{dt}", process_set=EVEN))
            assert np.array_equal(got, in_dtype(value(0) + value(2), dt)), (dt, got)
            got = array(hvd.reducescatter(tensor(np.arange(6) * (R + 1), dt), op=hvd.Sum, name=f"mix.rs.{dt}",
                                          process_set=EVEN))
            want = np.arange(6) * 4
            assert np.array_equal(got, in_dtype(want[:3] if R == 0 else want[3:], dt)), (dt, got)
        else:
            got = array(hvd.allgather(tensor(np.full((R, 2), R), dt), name=f"mix.{dt}", process_set=ODD))
            assert np.array_equal(got, in_dtype(np.full((4, 2), 3) - (np.arange(4) < 1)[:, None] * 2, dt)), (dt, got)
            got = array(hvd.broadcast(tensor(value(R), dt), 3, name=f"mix.rs.{dt}", process_set=ODD))
            assert np.array_equal(got, in_dtype(value(3), dt)), (dt, got)
    if FW == "tf":
        return
    # Several in flight at once, each set its own.
    start = hvd.allreduce_nonblocking if FW == "numpy" else hvd.allreduce_async
    handles = [start(tensor(value(R) + k, "float64"), op=hvd.Sum, name=f"mix.nb.{k}", process_set=MINE)
               for k in range(6)]
    mates = MINE.ranks
    for k, h in enumerate(handles):
        got = array(hvd.synchronize(h))
        assert np.array_equal(got, value(mates[0]) + value(mates[1]) + 2 * k), (k, got)


@check
def a_set_completes_while_the_other_waits_for_it():
    # Round 1: rank 1 has its {1, 3} allreduce in flight, and rank 3 submits its part only
    # once rank 0 has finished its {0, 2} ops (a file says so): the even set must complete
    # while the odd set's op waits for it. Round 2: the same the other way round. A set that
    # waited for the other (a global negotiation, one collective order) would hang here.
    status = os.environ.get("SHOAL_STATUS_DIR")
    if not status:
        raise Skip("needs shoalrun's status directory (SHOAL_STATUS_DIR)")
    even_done, odd_done = (os.path.join(status, f"psets.{FW}.{s}.done") for s in ("even", "odd"))
    start = {"numpy": getattr(hvd, "allreduce_nonblocking", None), "torch": getattr(hvd, "allreduce_async", None)}
    if R == 1 and FW != "tf":
        h = start[FW](tensor(np.full(3, 1.0), "float64"), op=hvd.Sum, name="wait.odd", process_set=ODD)
    if R % 2 == 0:
        got = array(hvd.allreduce(tensor(np.full(3, R + 1.0), "float64"), op=hvd.Sum, name="wait.even.1",
                                  process_set=EVEN))
        assert np.array_equal(got, np.full(3, 4.0)), got
        got = array(hvd.allgather(tensor(np.array([R]), "int64"), name="wait.even.2", process_set=EVEN))
        assert np.array_equal(got, [0, 2]), got
        if R == 0:
            open(even_done, "w").close()
            h = start[FW](tensor(np.full(2, 5.0), "float64"), op=hvd.Sum, name="wait.even.3",
                          process_set=EVEN) if FW != "tf" else None
        else:
            wait_for(odd_done, "the odd set's round")
            got = array(hvd.allreduce(tensor(np.full(2, 7.0), "float64"), op=hvd.Sum, name="wait.even.3",
                                      process_set=EVEN))
            assert np.array_equal(got, np.full(2, 12.0)), got
        if R == 0 and FW != "tf":
            assert np.array_equal(array(hvd.synchronize(h)), np.full(2, 12.0))
        elif R == 0:  # TensorFlow's eager ops block: its half goes after the file
            wait_for(odd_done, "the odd set's round")
            got = array(hvd.allreduce(tensor(np.full(2, 5.0), "float64"), op=hvd.Sum, name="wait.even.3",
                                      process_set=EVEN))
            assert np.array_equal(got, np.full(2, 12.0)), got
    else:
        if R == 3:
            wait_for(even_done, "the even set's round")
        if R == 3 or FW == "tf":
            got = array(hvd.allreduce(tensor(np.full(3, 2.0), "float64"), op=hvd.Sum, name="wait.odd",
                                      process_set=ODD))
        else:
            got = array(hvd.synchronize(h))
        assert np.array_equal(got, np.full(3, 1.0 + 2.0 if FW != "tf" else 4.0)), got
        got = array(hvd.broadcast(tensor(np.full(2, R), "int32"), 1, name="wait.odd.2", process_set=ODD))
        assert np.array_equal(got, [1, 1]), got
        if R == 3:
            open(odd_done, "w").close()


@check
def every_reduce_op_and_dtype_in_a_set():
    mates = MINE.ranks
    for op, fold in FOLDS.items():
        for dt in DTYPES:
            got = array(hvd.allreduce(tensor(value(R), dt), op=getattr(hvd, op), name=f"rop.{op}.{dt}",
                                      process_set=MINE))
            with np.errstate(over="ignore"):
                want = functools.reduce(fold, [in_dtype(value(q), dt) for q in mates])
            assert got.dtype == want.dtype and np.array_equal(got, want), (op, dt, got, want)
    for dt in ("float16", "float32", "float64") + (("bfloat16",) if FW != "numpy" else ()):
        got = array(hvd.allreduce(tensor(value(R), dt), op=hvd.Average, name=f"rop.avg.{dt}", process_set=MINE))
        want = in_dtype((value(mates[0]) + value(mates[1])) / 2, dt)  # halves: exact
        assert np.array_equal(got, want), (dt, got, want)
    # Reducescatter Average over the set's two ranks, uneven rows: 3 rows, 2 to the first.
    got = array(hvd.reducescatter(tensor(np.arange(6).reshape(3, 2) * (R + 1), "float64"), op=hvd.Average,
                                  name="rop.rs", process_set=MINE))
    total = np.arange(6).reshape(3, 2) * (mates[0] + mates[1] + 2) / 2
    assert np.array_equal(got, total[:2] if MINE.rank() == 0 else total[2:]), got


@check
def alltoall_and_grouped_ops_in_a_set():
    me, mates = MINE.rank(), MINE.ranks
    for dt in ("int32", "float64"):
        # Member i sends i + 1 + j rows of 10 * rank + j to member j (splits by position in the set).
        splits = [me + 1 + j for j in range(2)]
        rows = np.concatenate([np.full((s, 2), 10 * R + j) for j, s in enumerate(splits)])
        out, received = hvd.alltoall(tensor(rows, dt), splits=splits, name=f"set.a2a.{dt}", process_set=MINE)
        want = np.concatenate([np.full((i + 1 + me, 2), 10 * q + me) for i, q in enumerate(mates)])
        assert np.array_equal(array(out), in_dtype(want, dt)), (dt, array(out), want)
        assert list(array(received)) == [i + 1 + me for i in range(2)], array(received)
    ints, floats = hvd.grouped_allreduce([tensor(value(R), "int64"), tensor(value(R), "float32")], op=hvd.Sum,
                                         name="set.grp.ar", process_set=MINE)
    total = value(mates[0]) + value(mates[1])
    assert np.array_equal(array(ints), total) and np.array_equal(array(floats), total.astype("float32")), total
    rows, ids = hvd.grouped_allgather([tensor(np.full((R + 1, 2), R), "int16"), tensor(np.array([R]), "float64")],
                                      name="set.grp.ag", process_set=MINE)
    assert np.array_equal(array(rows), np.concatenate([np.full((q + 1, 2), q) for q in mates]).astype("int16"))
    assert np.array_equal(array(ids), np.array(mates, "float64")), array(ids)
    (part,) = hvd.grouped_reducescatter([tensor(np.arange(6).reshape(3, 2) * (R + 1), "float64")], op=hvd.Sum,
                                        name="set.grp.rs", process_set=MINE)
    total = np.arange(6).reshape(3, 2) * (mates[0] + mates[1] + 2)
    assert np.array_equal(array(part), total[:2] if me == 0 else total[2:]), array(part)
    if FW == "torch":  # the gradients run in the same set
        x = torch.full((3,), float(R), requires_grad=True)
        (y,) = hvd.grouped_allreduce([x], op=hvd.Sum, name="set.grp.grad", process_set=MINE)
        ((R + 1) * y.sum()).backward()
        assert torch.equal(x.grad, torch.full((3,), float(mates[0] + mates[1] + 2))), x.grad
        x = torch.zeros((3, 2), requires_grad=True)
        out, _ = hvd.alltoall(x, splits=[1 + me, 2 - me], name="set.a2a.grad", process_set=MINE)
        ((R + 1) * out).sum().backward()  # rows sent to member j come back scaled by its rank + 1
        want = np.concatenate([np.full((s, 2), q + 1.0) for s, q in zip([1 + me, 2 - me], mates)])
        assert np.array_equal(x.grad.numpy(), want.astype("float32")), x.grad


@check
def non_members_and_bad_roots_refused():
    x = tensor(np.ones(2), "float32")
    calls = {"allreduce": lambda: hvd.allreduce(x, name="refused", process_set=OTHER),
             "broadcast": lambda: hvd.broadcast(x, OTHER.ranks[0], name="refused", process_set=OTHER),
             "allgather": lambda: hvd.allgather(x, name="refused", process_set=OTHER),
             "reducescatter": lambda: hvd.reducescatter(x, name="refused", process_set=OTHER),
             "alltoall": lambda: hvd.alltoall(x, name="refused", process_set=OTHER),
             "grouped_allreduce": lambda: hvd.grouped_allreduce([x, x], name="refused.g", process_set=OTHER)}
    for op, call in calls.items():
        try:
            call()
        except ValueError as exc:
            want = f"{op}: rank {R} is not a member of process set {OTHER.process_set_id} (ranks {OTHER.ranks})"
            assert want in str(exc), (op, str(exc))
        else:
            raise AssertionError(f"{op} in another rank's set did not raise")
    try:
        shoal.barrier(process_set=OTHER)
    except ValueError as exc:
        assert f"barrier: rank {R} is not a member" in str(exc), str(exc)
    else:
        raise AssertionError("barrier in another rank's set did not raise")
    # A root outside the set: refused on both members (each at its own call).
    try:
        hvd.broadcast(x, OTHER.ranks[0], name="bad.root", process_set=MINE)
    except ValueError as exc:
        assert f"broadcast: root rank {OTHER.ranks[0]} is not in process set {MINE.process_set_id}" in str(exc), str(exc)
    else:
        raise AssertionError("a root outside the set did not raise")
    raises(TypeError, hvd.allreduce, x, name="refused.type", process_set="even")
    shoal.barrier(process_set=MINE)  # still usable


@check
def remove_then_add_again():
    first = hvd.add_process_set([0, 1, 3])
    if R != 2:
        got = array(hvd.allreduce(tensor(np.array([R]), "int64"), op=hvd.Sum, name="re", process_set=first))
        assert np.array_equal(got, [4]), got
    old_id = first.process_set_id
    assert hvd.remove_process_set(first) is True and first.process_set_id is None
    assert hvd.remove_process_set(first) is False  # as Horovod: nothing to remove
    if R != 2:
        try:
            hvd.allreduce(tensor(np.array([R]), "int64"), name="re", process_set=first)
        except ValueError as exc:
            assert "is not added" in str(exc), str(exc)
        else:
            raise AssertionError("an op in a removed set did not raise")
    again = hvd.add_process_set([3, 1, 0])
    assert again.process_set_id > old_id, (again.process_set_id, old_id)
    if R != 2:  # the same names as before: a new set, new negotiations
        got = array(hvd.allreduce(tensor(np.array([R]), "int64"), op=hvd.Sum, name="re", process_set=again))
        assert np.array_equal(got, [4]), got
    assert hvd.remove_process_set(again) is True


@check
def mismatched_membership_same_error_everywhere():
    try:
        hvd.add_process_set([0, 2] if R < 2 else [0, 1])
    except shoal.ShoalError as exc:
        msg = str(exc)
    else:
        raise AssertionError("mismatched add_process_set did not raise")
    assert ("process sets: mismatched calls across ranks: add_process_set([0, 2]) on ranks 0, 1; "
            "add_process_set([0, 1]) on ranks 2, 3") in msg, msg
    same_everywhere(msg)
    try:  # one rank's list is not ints: TypeError on every rank
        hvd.add_process_set(["x", 1] if R == 2 else [0, 1])
    except TypeError as exc:
        msg = str(exc)
    else:
        raise AssertionError("a list of non-ints on rank 2 did not raise")
    assert "(raised at the call on rank 2)" in msg, msg
    same_everywhere(msg)
    try:  # the ranks of a set that exists
        hvd.add_process_set([2, 0])
    except ValueError as exc:
        msg = str(exc)
    else:
        raise AssertionError("a duplicate set did not raise")
    assert f"process set {EVEN.process_set_id} (ranks [0, 2]) has these ranks already" in msg, msg
    same_everywhere(msg)


@check
def distributed_optimizer_averages_within_the_set():
    # Loss sum(W x + b), x = 2^r: dW = 2^r, db = 1. In {0, 2} they are averaged (dW 2.5),
    # ranks 1 and 3 take local steps (lr 1, W starts at 1).
    x = 2.0 ** R
    want_w = 1 - ((1 + 4) / 2 if R % 2 == 0 else x)
    if FW == "numpy":
        raise Skip("numpy has no DistributedOptimizer (it is shoal.torch's and shoal.tensorflow's)")
    if FW == "torch":
        model = torch.nn.Linear(3, 2)
        with torch.no_grad():
            model.weight.fill_(1.0)
            model.bias.fill_(1.0)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                       named_parameters=model.named_parameters(), process_set=EVEN)
        for _ in range(2):  # twice: the second step runs the cached batches
            with torch.no_grad():
                model.weight.fill_(1.0)
                model.bias.fill_(1.0)
            opt.zero_grad()
            model(torch.full((1, 3), x)).sum().backward()
            opt.step()
            assert torch.equal(model.weight, torch.full((2, 3), want_w)), model.weight
            assert torch.equal(model.bias, torch.zeros(2)), model.bias
        return
    w, b = tf.Variable(tf.ones((3, 2), tf.float64)), tf.Variable(tf.ones(2, tf.float64))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.matmul(tf.fill((1, 3), tf.constant(x, tf.float64)), w) + b)
    gw, gb = hvd.DistributedGradientTape(tape, process_set=EVEN).gradient(loss, [w, b])
    assert np.array_equal(gw.numpy(), np.full((3, 2), 1 - want_w)) and np.array_equal(gb.numpy(), np.ones(2)), gw
    import keras
    w, b = keras.Variable(np.ones((3, 2)), dtype="float64"), keras.Variable(np.ones(2), dtype="float64")
    opt = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(learning_rate=1.0), process_set=EVEN)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.matmul(tf.fill((1, 3), tf.constant(x, tf.float64)), w) + b)
    opt.apply_gradients(zip(tape.gradient(loss, [w, b]), [w, b]))
    assert np.array_equal(w.numpy(), np.full((3, 2), want_w)) and np.array_equal(b.numpy(), np.zeros(2)), w.numpy()


@check
def repeated_named_allreduces_skip_the_coordinator():
    # A training loop's gradient allreduces repeat by name: after the first steps they run
    # cached on the set's own channels, without the round trip to its coordinator.
    mates = MINE.ranks

    def step(k):
        for i in range(3):
            got = array(hvd.allreduce(tensor(np.full(4 + i, R + k + i), "float32"), op=hvd.Sum, name=f"steady.{i}",
                                      process_set=MINE))
            assert np.array_equal(got, np.full(4 + i, mates[0] + mates[1] + 2 * (k + i), "float32")), (k, i, got)
    for k in range(3):
        step(k)
    before = shoal.stats()["coordinator_rounds"]
    for k in range(3, 8):
        step(k)
    assert shoal.stats()["coordinator_rounds"] == before, (before, shoal.stats()["coordinator_rounds"])


@check
def unnamed_ops_in_sets_and_everywhere_pair_up():
    mates = MINE.ranks
    for k in range(3):  # unnamed ops counted per set: the job-wide ones after them still pair up
        got = array(hvd.allreduce(tensor(np.array([R + k]), "int32"), op=hvd.Sum, process_set=MINE))
        assert np.array_equal(got, [mates[0] + mates[1] + 2 * k]), got
    got = array(hvd.allreduce(tensor(np.array([R]), "int32"), op=hvd.Sum))
    assert np.array_equal(got, [6]), got


@check
def sparse_allreduce_in_a_set():
    # Horovod's sparse allreduce (allgather of indices and values) over the set's members:
    # rank r puts r + 1 at index r % 3; Average divides by the set's size.
    if FW == "numpy":
        raise Skip("numpy has no sparse tensors")
    mates = MINE.ranks
    want = np.zeros(4)
    for q in mates:
        want[q % 3] += (q + 1) / 2
    if FW == "torch":
        t = torch.sparse_coo_tensor(torch.tensor([[R % 3]]), torch.tensor([R + 1.0]), (4,))
        got = hvd.sparse_allreduce_async(t, "sparse", hvd.Average, process_set=MINE)()
        assert got._nnz() == 2 and torch.equal(got.to_dense(), torch.tensor(want, dtype=torch.float32)), got
        return
    s = tf.IndexedSlices(tf.constant([[R + 1.0]]), tf.constant([R % 3]), dense_shape=tf.constant([4, 1]))
    got = hvd.allreduce(s, op=hvd.Average, name="sparse", process_set=MINE)
    assert isinstance(got, tf.IndexedSlices) and np.array_equal(tf.convert_to_tensor(got).numpy()[:, 0], want), got


@check
def gradients_in_a_set():
    if FW == "numpy":
        raise Skip("numpy ops have no gradients")
    mates = MINE.ranks
    if FW == "torch":
        t = torch.full((3,), float(R), requires_grad=True)
        y = hvd.allreduce(t, op=hvd.Sum, name="g.ar", process_set=MINE)
        (y * (R + 1)).sum().backward()
        assert torch.equal(t.grad, torch.full((3,), float(mates[0] + mates[1] + 2))), t.grad
        t = torch.full((R + 1, 2), 1.0, requires_grad=True)
        y = hvd.allgather(t, name="g.ag", process_set=MINE)
        (y * torch.arange(y.shape[0], dtype=y.dtype)[:, None]).sum().backward()
        rows = np.arange(mates[0] + 1 + mates[1] + 1)  # each member's rows weighted by their index, averaged
        mine = rows[:R + 1] if MINE.rank() == 0 else rows[mates[0] + 1:]
        assert torch.equal(t.grad, torch.tensor(1.0 * mine, dtype=torch.float32)[:, None].expand(-1, 2)), t.grad
        return
    t = tf.Variable(tf.fill((3,), float(R)))
    with tf.GradientTape() as tape:
        y = hvd.allreduce(t, op=hvd.Sum, name="g.ar", process_set=MINE)
        loss = tf.reduce_sum(y * (R + 1))
    assert np.array_equal(tape.gradient(loss, t).numpy(), np.full(3, float(mates[0] + mates[1] + 2)))


sys.exit(1 if run_all(R) else 0)
