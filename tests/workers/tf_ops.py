"""shoal.tensorflow and shoal.keras: exact ops eagerly and in tf.function, gradients,
out-of-order graph ops, errors, Keras callbacks, and torch + TF in one process."""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import shoal  # noqa: E402
import shoal.tensorflow as st  # noqa: E402
from checks import check, run_all  # noqa: E402

st.init()
R, N = st.rank(), st.size()
DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int8, tf.uint8, tf.int32, tf.int64]


def base(dt):
    return tf.cast(tf.reshape(tf.range(6) % 3, (2, 3)), dt)


def exact_ops(prefix):
    for dt in DTYPES:
        got = st.allreduce(base(dt) * tf.cast(R + 1, dt), average=False, name=f"{prefix}.sum.{dt.name}")
        want = base(dt) * tf.cast(N * (N + 1) // 2, dt)
        tf.debugging.assert_equal(got, want)
        b = st.broadcast(base(dt) + tf.cast(R, dt), N - 1, name=f"{prefix}.bc.{dt.name}")
        tf.debugging.assert_equal(b, base(dt) + tf.cast(N - 1, dt))
        g = st.allgather(tf.fill([R % 3, 2], tf.cast(R, dt)), name=f"{prefix}.ag.{dt.name}")
        tf.debugging.assert_equal(g, tf.concat([tf.fill([r % 3, 2], tf.cast(r, dt)) for r in range(N)], 0))
    ins = st.in_neighbor_ranks()
    for dt in [tf.float32, tf.float64]:
        got = st.neighbor_allreduce(base(dt) * (R + 1), name=f"{prefix}.nbr.{dt.name}")
        want = (base(dt) * (R + 1) + sum(base(dt) * (j + 1) for j in ins)) / (len(ins) + 1)
        tf.debugging.assert_equal(got, want)
    avg = st.allreduce(tf.fill([3], float(R + 1)), name=f"{prefix}.avg")
    tf.debugging.assert_equal(avg, tf.fill([3], (N + 1) / 2))
    nag = st.neighbor_allgather(tf.fill([1, 2], R), name=f"{prefix}.nag")
    tf.debugging.assert_equal(nag, tf.constant([[j, j] for j in ins], tf.int32) if ins else tf.zeros([0, 2], tf.int32))
    if N > 1:
        dyn = st.neighbor_allreduce(tf.fill([2], float(R)), self_weight=0.5, src_weights={(R - 1) % N: 0.5},
                                    dst_weights={(R + 1) % N: 2.0}, name=f"{prefix}.dyn")
        tf.debugging.assert_equal(dyn, tf.fill([2], 0.5 * R + 0.5 * 2.0 * ((R - 1) % N)))
    return tf.constant(True)


@check
def eager_ops_exact():
    exact_ops("eager")


@check
def tf_function_ops_exact():
    tf.function(lambda: exact_ops("graph"))()
    tf.function(lambda: exact_ops("graph"))()  # a second trace: new names, same results


@check
def out_of_order_graph_ops_complete():
    @tf.function
    def f(x):
        # independent ops created in a rank-dependent order: the executor may run them in any order
        names = [f"ooo.{i}" for i in range(8)]
        order = names if R % 2 == 0 else names[::-1]
        outs = {n: st.allreduce(x + float(names.index(n)), average=False, name=n) for n in order}
        return [outs[n] for n in names]
    for i, y in enumerate(f(tf.fill([4], float(R)))):
        tf.debugging.assert_equal(y, tf.fill([4], N * (N - 1) / 2 + N * i))


@check
def gradients_match_manual_formulas():
    x = tf.Variable(tf.fill([3], float(R + 1)))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(st.allreduce(x, average=False, name="g.ar") * (R + 1))
    tf.debugging.assert_equal(tape.gradient(loss, x), tf.fill([3], N * (N + 1) / 2))
    from shoal import topology as T
    W = T.mixing_matrix(T.exponential_two_graph(N))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(st.neighbor_allreduce(x, name="g.nbr") * (R + 1))
    np.testing.assert_allclose(tape.gradient(loss, x).numpy(), (W @ np.arange(1, N + 1.0))[R], rtol=1e-6)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(st.broadcast(x, 0, name="g.bc") * (R + 1))
    tf.debugging.assert_equal(tape.gradient(loss, x), tf.fill([3], N * (N + 1) / 2 if R == 0 else 0.0))
    with tf.GradientTape() as tape:
        y = st.allgather(tf.tile(x[None], [R + 1, 1]), name="g.ag")
        loss = tf.reduce_sum(y * tf.cast(tf.range(tf.shape(y)[0])[:, None], tf.float32))
    start = sum(k + 1 for k in range(R))
    tf.debugging.assert_equal(tape.gradient(loss, x), tf.fill([3], float(sum(range(start, start + R + 1)) * N)))


@check
def hierarchical_neighbor_allreduce_and_its_gradient():
    # One machine here (no SHOAL_RANKS_PER_MACHINE): the machine sum / local_size() is the
    # mean; the gradient is the op again (its machine lists transposed), so also the mean.
    assert st.machine_size() == 1 and st.local_size() == N
    x = tf.Variable(tf.fill([3], tf.constant(R + 1.0, tf.float64)))
    hier = lambda v, name: st.hierarchical_neighbor_allreduce(v, self_weight=1.0, src_machine_weights={},
                                                              dst_machine_weights=[], name=name)
    with tf.GradientTape() as tape:
        y = hier(x, "tf.hier")
        loss = tf.reduce_sum(y * float(R + 1))
    mean = tf.fill([3], tf.constant((N + 1) / 2, tf.float64))
    tf.debugging.assert_equal(y, mean)
    tf.debugging.assert_equal(tape.gradient(loss, x), mean)
    tf.debugging.assert_equal(tf.function(hier)(x, "tf.hier.graph"), mean)


@check
def gradient_tape_and_broadcast_variables():
    v = tf.Variable(tf.fill([2], float(R)))
    st.broadcast_variables([v], root_rank=0)
    tf.debugging.assert_equal(v, tf.zeros([2]))
    with st.DistributedGradientTape(tf.GradientTape()) as tape:
        loss = tf.reduce_sum(v * float(R + 1))
    tf.debugging.assert_equal(tape.gradient(loss, [v])[0], tf.fill([2], (N + 1) / 2))


@check
def retraces_none_gradients_and_two_tapes():
    @tf.function
    def f(x):
        return st.allreduce(tf.reduce_mean(x, keepdims=True))
    for n in ([4, 4, 3] if R == 1 else [4, 4, 4]):  # rank 1 alone retraces (uneven last batch)
        f(tf.ones([n]))
    a, b = tf.Variable([1.0]), tf.Variable([2.0])
    with st.DistributedGradientTape(tf.GradientTape()) as tape:
        loss = a * 3.0 + (b * 5.0 if R == 0 else 0.0)  # b's gradient is None except on rank 0
    ga, gb = tape.gradient(loss, [a, b])
    assert ga.numpy().tolist() == [3.0] and gb.numpy().tolist() == [5.0 / N], (ga, gb)
    v1, v2 = tf.Variable(tf.ones([1000])), tf.Variable(tf.ones([1000]))

    @tf.function
    def two_tapes():
        with st.DistributedGradientTape(tf.GradientTape()) as t1:
            l1 = tf.reduce_sum(v1 * 2.0)
        with st.DistributedGradientTape(tf.GradientTape()) as t2:
            l2 = tf.reduce_sum(v2 * 3.0)
        return t1.gradient(l1, [v1])[0], t2.gradient(l2, [v2])[0]
    g1, g2 = two_tapes()
    assert float(g1[0]) == 2.0 and float(g2[0]) == 3.0


@check
def errors_are_clear():
    if N > 1:
        try:
            st.allreduce(tf.ones([3 + R % 2]), name="mismatch")
        except shoal.ShoalError as e:
            assert "mismatched shapes" in str(e)
        else:
            raise AssertionError("mismatch not raised")
    try:
        tf.function(lambda x: st.allreduce(x, name="xla"), jit_compile=True)(tf.ones(2))
    except ValueError as e:
        assert "jit_compile" in str(e)
    else:
        raise AssertionError("jit_compile accepted")


@check
def torch_and_tensorflow_share_one_runtime():
    import torch
    import shoal.torch as bf
    a = bf.allreduce(torch.ones(2) * R, average=False, name="mixed.torch")
    b = st.allreduce(tf.ones(2) * R, average=False, name="mixed.tf")
    assert a.tolist() == b.numpy().tolist() == [N * (N - 1) / 2] * 2
    assert bf.rank() == st.rank() and shoal.stats()["allreduce"] >= 2


@check
def keras_callbacks():
    import keras
    import shoal.keras as sk
    keras.utils.set_random_seed(R)  # different initial weights per rank
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.0), loss="mse")
    x, y = np.random.default_rng(R).normal(size=(16, 4)), np.zeros((16, 1))
    xi_cb = sk.ConsensusDistanceCallback()
    before = sk.consensus_distance(model.trainable_weights)
    nbr = sk.NeighborAveragingCallback(schedule="one-peer-exp")
    hist = model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[nbr, xi_cb, sk.MetricAverageCallback()])
    assert nbr.rounds == 2 and (N == 1 or before > 0.1), (nbr.rounds, before)
    if N & (N - 1) == 0:  # n a power of two: exact average after log2(n) one-peer rounds
        assert hist.history["consensus_distance"][0] < 1e-6, hist.history
    keras.utils.set_random_seed(100 + R)  # different initial weights again
    model2 = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model2.compile(optimizer=keras.optimizers.SGD(learning_rate=0.0), loss="mse")
    warmup = sk.LearningRateWarmupCallback(0.0, warmup_epochs=1)
    model2.fit(x, y[:, :1].repeat(2, 1), batch_size=8, epochs=1, verbose=0,
               callbacks=[sk.BroadcastGlobalVariablesCallback(0), warmup])
    w = np.concatenate([a.ravel() for a in model2.get_weights()])
    every = shoal.allgather(w[None, :], name="keras.same")
    assert (every == every[0]).all(), "weights differ after BroadcastGlobalVariablesCallback"


sys.exit(1 if run_all(R) else 0)
