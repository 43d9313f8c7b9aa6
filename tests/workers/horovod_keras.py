"""Horovod Keras 3 scripts with only the import changed (`import shoal.keras as hvd`; issue
17): `model.fit` with `hvd.DistributedOptimizer(keras.optimizers.SGD(...))` and Horovod's
three callbacks, checked exactly against one process training on every rank's data; the
gradient reduction against the mean of per-rank gradients; exact values of the Keras op
names; load_model; the clear refusals. Our own script, written the way Horovod's Keras
examples use the API (not a copy)."""
import os
import sys
import tempfile

import numpy as np
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)  # one summation order per kernel
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras  # noqa: E402

import shoal.keras as hvd  # noqa: E402
import shoal.tensorflow as st  # noqa: E402
from checks import check, raises, run_all  # noqa: E402

hvd.init()
R, N = hvd.rank(), hvd.size()
U = 2.0 ** -24  # float32 unit roundoff
D, B, S, EPOCHS, WARMUP, LR, MOMENTUM = 4, 4, 4, 3, 2, 0.125, 0.5


def rank_data(r):
    """Rank r's S*B samples: small integer features and targets ±1000, far from any
    prediction, so every mean-absolute-error gradient is ±x/B: a dyadic number that
    sums and averages without rounding (the reference below is then exact)."""
    g = np.random.RandomState(10 + r)
    x = g.randint(-3, 4, size=(S * B, D)).astype(np.float32)
    y = np.where(g.rand(S * B, 1) < 0.5, -1000.0, 1000.0).astype(np.float32)
    return x, y


def model_of(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((D,)), keras.layers.Dense(1)])


class RecordLR(keras.callbacks.Callback):
    """The learning rate each batch runs with (after the warm-up callback set it)."""

    def __init__(self):
        super().__init__()
        self.lrs = []

    def on_train_batch_begin(self, batch, logs=None):
        self.lrs.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))


def warmup(**kw):
    return hvd.callbacks.LearningRateWarmupCallback(initial_lr=LR, warmup_epochs=WARMUP, momentum_correction=True,
                                                    steps_per_epoch=S, **kw)


def same_on_all_ranks(arrays, what):
    flat = np.concatenate([np.asarray(a, np.float64).ravel() for a in arrays])
    every = hvd.allgather(flat[None, :], name=f"keras.same.{what}").numpy()
    assert (every == every[:1]).all(), f"{what}: differs between ranks: {every}"


@check
def fit_with_callbacks_equals_one_process_on_all_data():
    model = model_of(R)  # different initial weights on every rank
    root_start = hvd.broadcast_object(model.get_weights(), 0, name="keras.root_start")
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=LR, momentum=MOMENTUM)),
                  loss="mae")
    record = RecordLR()
    x, y = rank_data(R)
    hist = model.fit(x, y, batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0,
                     callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                hvd.callbacks.MetricAverageCallback(), warmup(), record]).history
    same_on_all_ranks(model.get_weights(), "fit.weights")
    same_on_all_ranks([hist["loss"]], "fit.loss")  # MetricAverageCallback: one value everywhere
    # The reference: one process, plain SGD, root's initial weights, every step's batch the
    # concatenation of every rank's batch of that step, the same warm-up (size() = N here).
    data = [rank_data(r) for r in range(N)]
    xs = np.concatenate([np.concatenate([d[0][s * B:(s + 1) * B] for d in data]) for s in range(S)])
    ys = np.concatenate([np.concatenate([d[1][s * B:(s + 1) * B] for d in data]) for s in range(S)])
    ref = model_of(100)
    ref.set_weights(root_start)
    ref.compile(optimizer=keras.optimizers.SGD(learning_rate=LR, momentum=MOMENTUM), loss="mae")
    ref_record = RecordLR()
    ref.fit(xs, ys, batch_size=N * B, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[warmup(), ref_record])
    for got, want in zip(model.get_weights(), ref.get_weights()):
        assert np.array_equal(got, want), (got, want)
    assert not np.array_equal(model.get_weights()[0], root_start[0]), "training did not move the weights"
    # Horovod's warm-up: lr = LR/N * ((epoch + (batch + 1)/S) * (N - 1)/WARMUP + 1) while
    # epoch < WARMUP, then the last value (LR); logs["lr"] at each epoch's end.
    want = []
    for e in range(EPOCHS):
        for b in range(S):
            t = min(e + (b + 1) / S, WARMUP)
            want.append(float(np.float32(LR / N * (t * (N - 1) / WARMUP + 1))))
    assert record.lrs == want and ref_record.lrs == want, (record.lrs, want)
    assert hist["lr"] == [want[S * e + S - 1] for e in range(EPOCHS)], hist["lr"]
    assert want[S * WARMUP - 1] == LR and (N == 1 or want[0] < LR)


class Recording(keras.optimizers.SGD):
    """SGD that keeps the gradients it was given (after the wrapper's reduction)."""

    def update_step(self, gradient, variable, learning_rate):
        self.sparse = getattr(self, "sparse", []) + [isinstance(gradient, tf.IndexedSlices)]
        self.seen.append(np.asarray(tf.convert_to_tensor(gradient)))
        super().update_step(gradient, variable, learning_rate)


def recording(**kw):
    opt = hvd.DistributedOptimizer(Recording(learning_rate=0.0), **kw)
    opt.seen = []
    return opt


@check
def gradients_are_the_mean_of_per_rank_gradients():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((D,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])
    st.broadcast_variables(model.trainable_variables, 0)  # one starting point on every rank

    def grads_of(r):
        g = np.random.RandomState(50 + r)
        x, y = g.randn(6, D).astype(np.float32), g.randn(6, 3).astype(np.float32)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.mean_squared_error(y, model(x)))
        return [t.numpy() for t in tape.gradient(loss, model.trainable_variables)]

    per_rank = [grads_of(r) for r in range(N)]
    for kw, scale in [({}, 1.0 / N), ({"op": hvd.Sum}, 1.0), ({"gradient_predivide_factor": 4.0}, 1.0 / N)]:
        opt = recording(**kw)
        opt.apply([tf.constant(g) for g in per_rank[R]], model.trainable_variables)
        same_on_all_ranks(opt.seen, f"grads.{kw}")
        for i, got in enumerate(opt.seen):
            parts = np.stack([p[i].astype(np.float64) for p in per_rank])
            # The core adds N float32 values (each addition rounds: at most (N-1)·U·Σ|g_r|),
            # then divides by N (one more rounding); 1/4 and ×4 are exact.
            tol = N * U * np.abs(parts).sum(0) * scale + 1e-30
            assert np.all(np.abs(got - parts.sum(0) * scale) <= tol), (kw, i, np.abs(got - parts.sum(0) * scale).max())


@check
def reduction_backward_passes_and_compression_exact():
    v = keras.Variable(np.zeros((2, 3), np.float32))
    total = N * (N + 1) / 2  # Σ_r (r + 1)
    opt = recording()
    opt.apply([tf.fill([2, 3], float(R + 1))], [v])
    assert np.array_equal(opt.seen[0], np.full((2, 3), total / N, np.float32))
    for average, div in [(False, 1.0), (True, 2.0)]:
        opt = recording(backward_passes_per_step=2, average_aggregated_gradients=average)
        opt.apply([tf.fill([2, 3], float(R + 1))], [v])
        assert opt.seen == [] and int(opt.iterations.numpy()) == 1, "applied after one pass of two"
        opt.apply([tf.fill([2, 3], 2.0 * (R + 1))], [v])
        assert len(opt.seen) == 1 and int(opt.iterations.numpy()) == 2
        assert np.array_equal(opt.seen[0], np.full((2, 3), 3 * total / N / div, np.float32)), opt.seen
    opt = recording(compression=hvd.Compression.fp16, op=hvd.Sum)
    opt.apply([tf.fill([2, 3], 1.0 / 3.0)], [v])
    want = np.float32(np.float16(np.float32(np.float16(1.0 / 3.0)) * N))  # float16 on the wire, float32 sum
    assert opt.seen[0].dtype == np.float32 and np.array_equal(opt.seen[0], np.full((2, 3), want)), opt.seen
    assert isinstance(opt, keras.optimizers.SGD) and type(opt).__name__ == "Recording"
    # Horovod's positional order: (optimizer, name, device_dense, device_sparse, compression, ...).
    opt = hvd.DistributedOptimizer(Recording(learning_rate=0.0), "pos", "", "", hvd.Compression.none, False, 1.0,
                                   hvd.Sum)
    opt.seen = []
    opt.apply([tf.fill([2, 3], float(R + 1))], [v])
    assert np.array_equal(opt.seen[0], np.full((2, 3), total, np.float32))


@check
def keras_ops_and_objects_exact_values():
    x = np.arange(3, dtype=np.float32) + R
    total = np.arange(3, dtype=np.float32) * N + N * (N - 1) / 2
    assert np.array_equal(hvd.allreduce(x, name="k.avg").numpy(), total / N)
    assert np.array_equal(hvd.allreduce(x, "k.sum", None, 1.0, 1.0, hvd.Sum).numpy(), total)  # positional
    got = hvd.allreduce(x, name="k.scaled", op=hvd.Sum, prescale_factor=0.5, postscale_factor=4.0)
    assert np.array_equal(got.numpy(), total * 2)
    got = hvd.allreduce(x, name="k.fp16", op=hvd.Sum, compression=hvd.Compression.fp16)
    assert got.dtype == tf.float32 and np.array_equal(got.numpy(), total)
    i = np.full((2,), -(R + 1), np.int32)  # Horovod's integer average: truncated toward zero
    assert hvd.allreduce(i, name="k.int").numpy().tolist() == [int(-(N * (N + 1) / 2) / N)] * 2
    g = hvd.allgather(np.full((R + 1, 2), float(R), np.float32), name="k.ag").numpy()
    assert np.array_equal(g, np.concatenate([np.full((r + 1, 2), float(r)) for r in range(N)]))
    assert np.array_equal(hvd.broadcast(np.full(2, float(R)), N - 1, name="k.b").numpy(), np.full(2, N - 1.0))
    assert hvd.broadcast_object({"from": R, "f": (lambda: 7) if R == 0 else None}, 0)["f"]() == 7
    assert hvd.allgather_object(("r", R)) == [("r", r) for r in range(N)]
    # A sparse gradient: Horovod's allgather of values and indices (values / size()).
    sl = tf.IndexedSlices(tf.fill([1, 2], float(R + 1)), tf.constant([R]), tf.constant([N, 2]))
    red = st.allreduce(sl, name="k.sparse")
    assert isinstance(red, tf.IndexedSlices) and red.indices.numpy().tolist() == list(range(N))
    assert np.array_equal(tf.convert_to_tensor(red).numpy(), np.repeat(np.arange(1.0, N + 1)[:, None], 2, 1) / N)
    emb = tf.Variable(tf.zeros([N, 2]))
    with st.DistributedGradientTape(tf.GradientTape(), sparse_as_dense=True, op=hvd.Sum,
                                    compression=hvd.Compression.fp16) as tape:
        loss = tf.reduce_sum(tf.gather(emb, [R]))
    (dense,) = tape.gradient(loss, [emb])
    assert isinstance(dense, tf.Tensor) and np.array_equal(dense.numpy(), np.ones((N, 2), np.float32))
    # The job's layout and build facts under Horovod's names.
    assert (hvd.cross_rank(), hvd.cross_size()) == (st.machine_rank(), st.machine_size())
    assert hvd.mpi_built() and not hvd.gloo_built() and hvd.is_initialized() and hvd.local_rank() < hvd.local_size()
    for n in ("init", "shutdown", "DistributedOptimizer", "load_model", "callbacks", "Compression",
              "global_process_set", "BroadcastGlobalVariablesCallback", "LearningRateScheduleCallback"):
        assert n in hvd.__all__, n


@check
def load_model_resumes_with_a_distributed_optimizer():
    model = model_of(0)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=MOMENTUM)), loss="mae")
    x, y = rank_data(R)
    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    path = os.path.join(tempfile.mkdtemp(), f"model{R}.keras")
    model.save(path)
    plain = keras.models.load_model(path)  # saved as a plain SGD: loads without Shoal
    assert not hasattr(type(plain.optimizer), "_shoal_settings")
    loaded = hvd.load_model(path)
    assert hasattr(type(loaded.optimizer), "_shoal_settings") and isinstance(loaded.optimizer, keras.optimizers.SGD)
    assert int(loaded.optimizer.iterations.numpy()) == S  # the saved optimizer state came back
    loaded.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    same_on_all_ranks(loaded.get_weights(), "loaded.weights")


@check
def positional_orders_and_refusals():
    cb = hvd.callbacks.LearningRateWarmupCallback(0.1, 3, False, 7, 1)  # Horovod's positional order
    assert (cb.initial_lr, cb.warmup_epochs, cb.momentum_correction, cb.steps_per_epoch, cb.verbose) == \
        (0.1, 3, False, 7, 1)
    sc = hvd.callbacks.LearningRateScheduleCallback(0.1, 0.5, 1, 4, False, False, 9)
    assert (sc.start_epoch, sc.end_epoch, sc.staircase, sc.momentum_correction, sc.steps_per_epoch) == \
        (1, 4, False, False, 9) and sc.multiplier(3) == 0.25
    assert hvd.callbacks.BroadcastGlobalVariablesCallback(1, "").root_rank == 1
    hvd.callbacks.MetricAverageCallback("")
    other = object()
    ones = np.ones(3, np.float32)
    for call in (lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), process_set=other),
                 lambda: hvd.allreduce(ones, process_set=other), lambda: hvd.allgather(ones, process_set=other),
                 lambda: hvd.broadcast(ones, 0, process_set=other),
                 lambda: hvd.broadcast_object(1, 0, process_set=other),
                 lambda: st.DistributedGradientTape(tf.GradientTape(), process_set=other),
                 lambda: st.DistributedOptimizer(keras.optimizers.SGD(0.1), process_set=other)):
        try:  # (process sets themselves: tests/workers/psets.py)
            call()
        except TypeError as e:
            assert "process_set must be a shoal.ProcessSet" in str(e), e
        else:
            raise AssertionError("a process_set that is not a ProcessSet was accepted")
    raises(ValueError, hvd.DistributedOptimizer, keras.optimizers.SGD(0.1), op=hvd.Adasum)  # Horovod's rule
    raises(NotImplementedError, hvd.allreduce, ones, op=hvd.Adasum)
    raises(TypeError, hvd.DistributedOptimizer, "sgd")
    raises(NotImplementedError, hvd.broadcast_global_variables, 0)
    assert np.array_equal(hvd.allreduce(ones, name="k.after.refusals").numpy(), ones)  # still usable


SIZES = [3, 0, 1, 4]  # uneven per-rank batches (rank 1 has none)


def bn_batch(step, rank, shape):
    g = np.random.RandomState(700 + 10 * step + rank)
    n = SIZES[rank % len(SIZES)]
    return g.randn(n, *shape) * 3 + 1, g.randn(n, *shape)


def close(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and np.allclose(got, want, rtol=1e-10, atol=1e-12), \
        (what, np.abs(got - want).max() if got.shape == want.shape else (got.shape, want.shape))


def bn_step(layer, x, w):
    x = tf.convert_to_tensor(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        out = layer(x, training=True)
        loss = tf.reduce_sum(out * w)
    return [out] + tape.gradient(loss, [x, layer.gamma, layer.beta])


@check
def sync_batch_normalization_equals_batch_norm_on_the_global_batch():
    """hvd.SyncBatchNormalization on uneven per-rank batches (eagerly and in a tf.function):
    output, input/gamma/beta gradients and moving statistics equal one process's Keras
    BatchNormalization on the concatenated batch (float64)."""
    for shape in [(2, 2, 3), (3,)]:
        c = shape[-1]
        init = dict(momentum=0.7, dtype="float64", gamma_initializer=keras.initializers.Constant(np.arange(1.0, c + 1)),
                    beta_initializer=keras.initializers.Constant(np.arange(c) - 1.0))
        layer, ref = hvd.SyncBatchNormalization(**init), keras.layers.BatchNormalization(**init)
        layer.build((None,) + shape), ref.build((None,) + shape)
        graph_step = tf.function(bn_step)
        for step in range(2):
            x, w = bn_batch(step, R, shape)
            got = (bn_step if step == 0 else graph_step)(layer, x, w)
            every = [bn_batch(step, r, shape) for r in range(N)]
            want = bn_step(ref, np.concatenate([e[0] for e in every]), np.concatenate([e[1] for e in every]))
            at = sum(SIZES[r % len(SIZES)] for r in range(R))
            mine = slice(at, at + x.shape[0])
            close(got[0], want[0][mine], ("output", shape, step))
            close(got[1], want[1][mine], ("input grad", shape, step))
            close(hvd.allreduce(got[2], name=f"ksbn.g.{len(shape)}.{step}", op=hvd.Sum), want[2], ("gamma grad", shape))
            close(hvd.allreduce(got[3], name=f"ksbn.b.{len(shape)}.{step}", op=hvd.Sum), want[3], ("beta grad", shape))
            close(layer.moving_mean, ref.moving_mean, ("moving_mean", shape, step))
            close(layer.moving_variance, ref.moving_variance, ("moving_variance", shape, step))
        assert not np.allclose(layer.moving_variance, 1.0), "moving statistics were not updated"
        x, _ = bn_batch(5, R, shape)
        close(layer(x, training=False), ref(x, training=False), ("inference", shape))  # moving stats, local


@check
def sync_batch_normalization_masks_fit_and_refusals():
    # A mask: only unmasked samples count (the moving mean after one step with momentum 0).
    g = np.random.RandomState(80 + R)
    x, mask = g.randn(2, 3, 2), g.rand(2, 3) < 0.5
    mask[0, 0] = True  # every rank has a sample
    layer = hvd.SyncBatchNormalization(momentum=0.0, dtype="float64")
    layer(x, training=True, mask=mask)
    pairs = hvd.allgather_object((x[mask], mask.sum()))
    values = np.concatenate([v for v, _ in pairs])
    close(layer.moving_mean, values.mean(0), "masked mean")
    close(layer.moving_variance, values.var(0), "masked variance")
    # In a model trained with fit and the DistributedOptimizer: the models stay identical.
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((D,)), keras.layers.Dense(4), hvd.SyncBatchNormalization(),
                              keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
    xs, ys = rank_data(R)
    model.fit(xs, ys / 1000, batch_size=B, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    same_on_all_ranks(model.get_weights(), "syncbn.fit")  # moving statistics included
    raises(ValueError, hvd.SyncBatchNormalization, fused=True)
    raises(NotImplementedError, hvd.SyncBatchNormalization, process_set=object())
    one = np.ones((1 if R == 0 else 0, 3))
    raises(ValueError, hvd.SyncBatchNormalization(), one, training=True)  # one value per channel in all


@check
def sparse_gradients_allgathered_or_densified_equal_the_dense_average():
    """tf.IndexedSlices gradients (an embedding lookup) through the Keras DistributedOptimizer
    and DistributedGradientTape: allgathered by default, dense with sparse_as_dense; the
    dense form equals the average of every rank's dense gradient exactly."""
    table = tf.Variable(tf.reshape(tf.range(12.0), [6, 2]))

    def slices_of(r):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(table, [r % 6, 1, 1]) * float(r + 1))
        return tape.gradient(loss, table)

    mine = slices_of(R)
    assert isinstance(mine, tf.IndexedSlices)
    want = sum(tf.convert_to_tensor(slices_of(r)).numpy() for r in range(N)) / N  # small integers / N: exact
    for as_dense in (False, True):
        opt = recording(sparse_as_dense=as_dense)
        opt.apply([mine], [table])
        assert opt.sparse == [not as_dense], (as_dense, opt.sparse)
        assert np.array_equal(opt.seen[0], want), (as_dense, opt.seen[0], want)
        with st.DistributedGradientTape(tf.GradientTape(), sparse_as_dense=as_dense) as tape:
            loss = tf.reduce_sum(tf.gather(table, [R % 6, 1, 1]) * float(R + 1))
        (got,) = tape.gradient(loss, [table])
        assert isinstance(got, tf.Tensor if as_dense else tf.IndexedSlices), type(got)
        assert np.array_equal(tf.convert_to_tensor(got).numpy(), want), (as_dense, got)
    # Horovod's rules: no pre/postscale with IndexedSlices, no accumulation of them.
    raises(NotImplementedError, recording(gradient_predivide_factor=2.0).apply, [mine], [table])
    raises(ValueError, recording(backward_passes_per_step=2).apply, [mine], [table])
    raises(NotImplementedError, st.allreduce, mine, op=hvd.Max)
    # In model.fit: an Embedding's sparse gradients keep the models identical.
    keras.utils.set_random_seed(9)
    model = keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(6, 2),
                              keras.layers.Flatten(), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    g = np.random.RandomState(30 + R)
    model.fit(g.randint(0, 6, (8, 3)), g.randn(8, 1), batch_size=4, epochs=1, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    same_on_all_ranks(model.get_weights(), "sparse.fit")


# Every public name of horovod.tensorflow.keras and horovod.keras (Horovod 0.28), and of
# their callbacks and elastic modules.
HOROVOD_KERAS = """init shutdown is_initialized start_timeline stop_timeline size local_size cross_size rank
local_rank cross_rank mpi_threads_supported mpi_enabled mpi_built gloo_enabled gloo_built ProcessSet
global_process_set add_process_set remove_process_set nccl_built ddl_built ccl_built cuda_built rocm_built Average
Sum Adasum Compression callbacks elastic DistributedOptimizer PartialDistributedOptimizer
broadcast_global_variables allreduce allgather broadcast reducescatter load_model""".split()
HOROVOD_CALLBACKS = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateScheduleCallback",
                     "LearningRateWarmupCallback", "BestModelCheckpoint"]
HOROVOD_ELASTIC = ["KerasState", "run", "CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback"]


class Split(keras.Model):
    """Two dense layers, the second to be local (PartialDistributed*)."""

    def __init__(self):
        super().__init__()
        self.shared, self.own = keras.layers.Dense(2), keras.layers.Dense(1)

    def call(self, x):
        return self.own(self.shared(x))


@check
def keras_entry_point_has_horovods_names_and_values():
    missing = [n for n in HOROVOD_KERAS if n not in hvd.__all__ or not hasattr(hvd, n)]
    missing += [n for n in HOROVOD_CALLBACKS if not hasattr(hvd.callbacks, n)]
    missing += [n for n in HOROVOD_ELASTIC if not hasattr(hvd.elastic, n)]
    assert not missing, missing
    # reducescatter(value, name, op): Horovod's split of the rows, average or sum.
    x = np.arange(2 * (N + 1), dtype=np.float32).reshape(N + 1, 2) * (R + 1)
    rows = np.arange(2 * (N + 1), dtype=np.float32).reshape(N + 1, 2) * (N * (N + 1) / 2)
    start = R + (1 if R > 0 else 0)  # rank 0 gets the extra row
    mine = rows[start:start + (2 if R == 0 else 1)]
    assert np.array_equal(hvd.reducescatter(x, "k.rs", hvd.Sum).numpy(), mine)
    assert np.array_equal(hvd.reducescatter(x, name="k.rs.avg").numpy(), mine / N)
    # Objects, join, Horovod's TF ops of the job layout.
    assert hvd.allgather_object(R * 10, None, "k.ago") == [10 * r for r in range(N)]  # (obj, session, name)
    assert st.broadcast_object_fn(N - 1, name="k.bfn")(("from", R)) == ("from", N - 1)
    assert [int(f().numpy()) for f in (st.rank_op, st.local_rank_op, st.size_op, st.local_size_op,
                                       st.process_set_included_op)] == [R, hvd.local_rank(), N, hvd.local_size(), 1]
    last = hvd.join()
    assert hvd.allgather_object(last, name="k.join") == [last] * N and 0 <= last < N
    ckpt = hvd.callbacks.BestModelCheckpoint("val_loss", 0, "min", "epoch", filepath=os.path.join(
        tempfile.mkdtemp(), "best.keras"))
    assert ckpt.save_best_only and ckpt.monitor == "val_loss" and not ckpt.save_weights_only
    # PartialDistributedOptimizer / PartialDistributedGradientTape: the local layer's
    # gradient stays this rank's, divided by size() (Horovod's scale_local_gradients);
    # the others are averaged.
    keras.utils.set_random_seed(2)
    model = Split()
    model(np.zeros((1, D), np.float32))
    st.broadcast_variables(model.variables, 0)

    def grads_of(r):
        g = np.random.RandomState(60 + r)
        xb, yb = g.randn(4, D).astype(np.float32), g.randn(4, 1).astype(np.float32)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(xb) - yb) ** 2)
        return [t.numpy() for t in tape.gradient(loss, model.trainable_variables)], (xb, yb)

    per_rank = [grads_of(r) for r in range(N)]
    local = {id(v) for v in model.own.trainable_variables}

    def check_grads(got, what):
        for v, g, i in zip(model.trainable_variables, got, range(len(got))):
            parts = np.stack([p[0][i].astype(np.float64) for p in per_rank])
            want = parts[R] / N if id(v) in local else parts.mean(0)
            assert np.allclose(g, want, rtol=0, atol=N * U * np.abs(parts).sum(0).max() + 1e-30), (what, v.path)

    opt = hvd.PartialDistributedOptimizer(Recording(learning_rate=0.0), local_layers=model.own)
    opt.seen = []
    opt.apply([tf.constant(g) for g in per_rank[R][0]], model.trainable_variables)
    check_grads(opt.seen, "PartialDistributedOptimizer")
    xb, yb = per_rank[R][1]
    with st.PartialDistributedGradientTape(tf.GradientTape(), local_layers=[model.own]) as tape:
        loss = tf.reduce_mean((model(xb) - yb) ** 2)
    check_grads([g.numpy() for g in tape.gradient(loss, model.trainable_variables)], "PartialDistributedGradientTape")
    raises(ValueError, hvd.PartialDistributedOptimizer, keras.optimizers.SGD(0.1), local_layers=["not a layer"])


@check
def elastic_state_syncs_commits_and_restores():
    """hvd.elastic for a fixed set of ranks: run() syncs rank 0's model, optimizer and
    attributes, then calls the function once; commit/restore keep and bring back state."""
    model = model_of(R)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=MOMENTUM)), loss="mae")
    state = hvd.elastic.KerasState(model, batch=0, epoch=R)  # attributes differ until sync
    x, y = rank_data(R)

    @hvd.elastic.run
    def train(state, epochs):
        model.fit(x, y, batch_size=B, epochs=epochs, shuffle=False, verbose=0,
                  callbacks=[hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.UpdateEpochStateCallback(state),
                             hvd.elastic.CommitStateCallback(state, batches_per_commit=2)])
        return state.epoch

    assert train(state, 2) == 2  # rank 0's epoch (0) carried over, plus the 2 epochs run
    same_on_all_ranks(model.get_weights(), "elastic.weights")
    assert state.batch == 0
    kept = model.get_weights()
    model.set_weights([w + 1 for w in kept])
    state.epoch = 99
    state.restore()  # back to the last commit (the end of the last epoch)
    assert (state.epoch, state.batch) == (2, 0), (state.epoch, state.batch)
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), kept))



@check
def tensorflow_horovod_keywords_set_ops_and_inplace_broadcast():
    # horovod/tensorflow/mpi_ops.py: device_dense/device_sparse/ignore_name_scope are
    # accepted (they change nothing here); allgather's positional order is Horovod's.
    x = tf.constant([float(R + 1)] * 3)
    total = [N * (N + 1) / 2] * 3
    got = st.allreduce(x, op=hvd.Sum, name="k.kw", device_dense="", device_sparse="", ignore_name_scope=True)
    assert got.numpy().tolist() == total
    assert st.allgather(x[None], "k.kw.ag", True).numpy().tolist() == [[r + 1.0] * 3 for r in range(N)]
    assert st.broadcast(x, N - 1, "k.kw.b", ignore_name_scope=True).numpy().tolist() == [float(N)] * 3
    # broadcast_ (in place): root's values assigned, returned in the order given.
    vs = [tf.Variable([float(R)] * 2), tf.Variable(R, dtype=tf.int32)]
    out = st.broadcast_(vs, N - 1, name="k.b_")
    assert [o.numpy().tolist() for o in out] == [[N - 1.0] * 2, N - 1]
    assert [v.numpy().tolist() for v in vs] == [[N - 1.0] * 2, N - 1]
    # size_op / process_set_included_op of a process set (ranks 1..N-1), and of one removed
    # (Horovod's HOROVOD_PROCESS_SET_ERROR_UNKNOWN_SET, -3).
    tail = hvd.add_process_set(list(range(1, N)))
    ps_id = tail.process_set_id
    assert int(st.size_op(ps_id).numpy()) == N - 1 and int(st.size_op().numpy()) == N
    assert int(st.process_set_included_op(ps_id).numpy()) == (1 if R >= 1 else 0)
    hvd.remove_process_set(tail)
    assert int(st.process_set_included_op(ps_id).numpy()) == -3
    raises(ValueError, st.size_op, ps_id)
    raises(TypeError, st.size_op, tail)  # an id, not the ProcessSet (as Horovod's op)
    # TF1's broadcast_global_variables: eagerly, Horovod's RuntimeError (NotImplementedError is one).
    raises(RuntimeError, st.broadcast_global_variables, 0)


sys.exit(1 if run_all(R) else 0)
