"""shoal.tensorflow and shoal.keras: exact ops eagerly and in tf.function, gradients,
out-of-order graph ops, errors, Keras callbacks, and torch + TF in one process."""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import shoal  # noqa: E402
import shoal.tensorflow as st  # noqa: E402
from shoal import compression  # noqa: E402
from checks import Skip, check, raises, run_all  # noqa: E402

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
    # broadcast and allgather: Horovod's, the ranks' gradients averaged
    tf.debugging.assert_equal(tape.gradient(loss, x), tf.fill([3], (N + 1) / 2 if R == 0 else 0.0))
    with tf.GradientTape() as tape:
        y = st.allgather(tf.tile(x[None], [R + 1, 1]), name="g.ag")
        loss = tf.reduce_sum(y * tf.cast(tf.range(tf.shape(y)[0])[:, None], tf.float32))
    start = sum(k + 1 for k in range(R))
    tf.debugging.assert_equal(tape.gradient(loss, x), tf.fill([3], float(sum(range(start, start + R + 1)))))


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
    if N > 2:  # receive from R-1, send to R+2: the pattern check fails on every rank
        try:
            st.neighbor_allreduce(tf.ones([2]), self_weight=0.5, src_weights={(R - 1) % N: 0.5},
                                  dst_weights=[(R + 2) % N], name="tf.pattern")
        except ValueError as e:
            assert isinstance(e, shoal.NeighborPatternError) and isinstance(e, shoal.ShoalError), type(e)
            assert "send and receive ranks disagree" in str(e), e
        else:
            raise AssertionError("pattern mismatch not raised")
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


D, B, S, LR = 4, 4, 4, 0.125


def keras_data(r):
    """Rank r's S*B samples: small integer features, targets ±1000 far from any prediction,
    so every mean-absolute-error gradient is -sign(y)·x/B: dyadic (exact arithmetic)."""
    g = np.random.RandomState(40 + r)
    return g.randint(-3, 4, size=(S * B, D)).astype(np.float32), \
        np.where(g.rand(S * B, 1) < 0.5, -1000.0, 1000.0).astype(np.float32)


def dyadic_start(r):
    """Rank r's own initial weights (kernel [D, 1], bias [1]), dyadic."""
    return [((np.arange(D, dtype=np.float32) - 1.5) * (r + 1) / 4).reshape(D, 1), np.full(1, r / 2, np.float32)]


def linear_model(r):
    import keras
    model = keras.Sequential([keras.Input((D,)), keras.layers.Dense(1)])
    model.set_weights(dyadic_start(r))
    return model


def one_peer_matrix(t):
    """The one-peer exponential schedule's mixing matrix at round t (W[i, j]: i's weight
    of j's value): i averages with i - 2**(t mod log2 n) (shoal.topology's schedule)."""
    if N == 1:
        return np.ones((1, 1))  # no peer: the schedule keeps the rank's own value
    tau = (N - 1).bit_length()
    w = np.zeros((N, N))
    for i in range(N):
        w[i, i] += 0.5
        w[i, (i - 2 ** (t % tau)) % N] += 0.5
    return w


def gradient(weights, x, y):
    """Keras' mean-absolute-error gradient of the linear model at `weights` (float64)."""
    kernel, bias = weights
    sign = np.sign(x @ kernel + bias - y)  # [B, 1]
    return [x.T @ sign / len(x), sign.mean(0)]


@check
def keras_decentralized_optimizers_match_their_replay_exactly():
    """shoal.keras AWC and ATC optimizers in model.fit with the one-peer schedule: every
    rank's weights equal a replay of x⁺ = W x − γ g(x) (AWC) / W (x − γ g(x)) (ATC) over
    all ranks, exactly (dyadic data, weights 1/2)."""
    import keras
    import shoal.keras as sk
    if N & (N - 1):
        raise Skip("the one-peer schedule averages exactly for a power-of-two number of ranks only")
    data = [keras_data(r) for r in range(N)]
    # compression "none": CHOCO's gossip with a lossless compressor and step 1 is plain
    # averaging, to the bit here (shoal.compressed_gossip on numpy arrays)
    for make, mode, compressor in [(sk.DistributedAdaptWithCombineOptimizer, "awc", None),
                                   (sk.DistributedAdaptThenCombineOptimizer, "atc", None),
                                   (sk.DistributedAdaptWithCombineOptimizer, "awc", "none")]:
        model = linear_model(R)
        opt = make(keras.optimizers.SGD(LR), schedule="one-peer-exp", name=f"keras.replay.{mode}.{compressor}",
                   compression=compressor)
        assert isinstance(opt, keras.optimizers.SGD)
        model.compile(optimizer=opt, loss="mae")
        model.fit(*data[R], batch_size=B, epochs=1, shuffle=False, verbose=0)
        xs = [[w.astype(np.float64) for w in dyadic_start(r)] for r in range(N)]
        for t in range(S):
            grads = [gradient(xs[r], data[r][0][t * B:(t + 1) * B], data[r][1][t * B:(t + 1) * B]) for r in range(N)]
            w = one_peer_matrix(t)
            if mode == "awc":
                xs = [[sum(w[i, j] * xs[j][k] for j in range(N)) - LR * grads[i][k] for k in range(2)]
                      for i in range(N)]
            else:
                stepped = [[xs[j][k] - LR * grads[j][k] for k in range(2)] for j in range(N)]
                xs = [[sum(w[i, j] * stepped[j][k] for j in range(N)) for k in range(2)] for i in range(N)]
        for got, want in zip(model.get_weights(), xs[R]):
            assert np.array_equal(got.astype(np.float64), want), (mode, got, want)
        assert opt.communications == S and int(opt.iterations.numpy()) == S


@check
def keras_int8_gossip_keeps_the_average_and_sends_a_quarter_of_the_bytes():
    """shoal.keras with compression="int8" (learning rate 0: gossip only): the ranks come
    together, the average over ranks is kept (CHOCO's doubly stochastic gossip), and the
    bytes sent are the packed payloads', about 26 % of float32's."""
    import keras
    import shoal.keras as sk
    if N < 2:
        raise Skip("needs 2 or more ranks")
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32)])
    start = [np.random.RandomState(7 + R).standard_normal(w.shape).astype(np.float32) for w in model.get_weights()]
    model.set_weights(start)
    opt = sk.DistributedAdaptWithCombineOptimizer(keras.optimizers.SGD(0.0), "one-peer-exp",
                                                  compression="int8", name="keras.int8")
    rounds = 8 * (N - 1).bit_length()
    before = shoal.stats()["bytes_sent"]
    for _ in range(rounds):
        opt.apply_gradients(zip([tf.zeros_like(v) for v in model.trainable_variables], model.trainable_variables))
    sent = shoal.stats()["bytes_sent"] - before
    payload = sum(compression.Int8().payload_bytes(w.size, np.float32) for w in start)  # one peer a round
    assert payload * rounds <= sent < 1.1 * payload * rounds, (sent, payload * rounds)
    assert payload <= 0.3 * sum(w.size * 4 for w in start)
    flat0 = np.concatenate([w.ravel() for w in start]).astype(np.float64)
    flat = np.concatenate([w.ravel() for w in model.get_weights()]).astype(np.float64)
    every0, every = shoal.allgather(flat0[None], name="keras.int8.x0"), shoal.allgather(flat[None], name="keras.int8.x")
    assert np.abs(every.mean(0) - every0.mean(0)).max() < 1e-5, np.abs(every.mean(0) - every0.mean(0)).max()
    spread0, spread = np.square(every0 - every0.mean(0)).sum(), np.square(every - every.mean(0)).sum()
    assert spread < 0.05 * spread0, (spread, spread0)
    assert opt.communications == rounds


@check
def keras_decentralized_optimizers_reach_consensus_and_control_it():
    import keras
    import shoal.keras as sk
    x, y = keras_data(R)
    # Learning rate 0: only averaging. One-peer rounds, every second step (k = 2): after
    # log2(n) rounds every rank holds the exact average of the initial weights (AWC in
    # model.fit, ATC in an eager loop of apply_gradients).
    for make in (sk.DistributedAdaptWithCombineOptimizer, sk.DistributedAdaptThenCombineOptimizer):
        if N & (N - 1):
            break
        model = linear_model(R)
        opt = make(keras.optimizers.SGD(0.0), "one-peer-exp", 2)
        rounds = (N - 1).bit_length()
        if make is sk.DistributedAdaptWithCombineOptimizer:
            model.compile(optimizer=opt, loss="mae")
            model.fit(x[:2 * rounds * B], y[:2 * rounds * B], batch_size=B, epochs=1, shuffle=False, verbose=0)
        else:
            for _ in range(2 * rounds):
                opt.apply_gradients(zip([tf.ones_like(v) for v in model.trainable_variables],
                                        model.trainable_variables))
        mean = [sum(dyadic_start(r)[k] for r in range(N)) / N for k in range(2)]
        for got, want in zip(model.get_weights(), mean):
            assert np.array_equal(got, want), (make.__name__, got, want)
        assert opt.communications == rounds
    # Consensus control: ranks that never average (a schedule without peers) drift apart
    # with every local step; after every step Ξ <= target all the same, by gossip rounds over
    # the static topology (then an exact average if they do not get there) or by an exact
    # average at once; the same decisions on every rank.
    alone = lambda t: (1.0, {}, [])  # noqa: E731
    for method in ("gossip", "allreduce"):
        model = linear_model(R)
        cc = sk.ConsensusControl(target=1e-3, max_extra_rounds=2, method=method)
        opt = sk.DistributedAdaptThenCombineOptimizer(keras.optimizers.SGD(LR), alone, consensus_control=cc)
        model.compile(optimizer=opt, loss="mae")
        xi = sk.ConsensusDistanceCallback(every_k_batches=1)
        model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0, callbacks=[xi])
        assert len(xi.history) == S + 1 and all(v <= 1e-3 for v in xi.history), (method, xi.history)
        assert opt.last_consensus_distance <= 1e-3, opt.last_consensus_distance
        counts = shoal.allgather(np.array([[opt.extra_rounds, opt.exact_averages]]), name=f"keras.cc.{method}")
        assert (counts == counts[0]).all(), counts
        if N > 1 and method == "allreduce":
            assert (opt.extra_rounds, opt.exact_averages) == (0, S), counts
        elif N > 1:  # every step needed control; at 2 ranks one gossip round is the exact average
            assert opt.extra_rounds >= S and (N > 2 or (opt.extra_rounds, opt.exact_averages) == (S, 0)), counts
    raises(TypeError, sk.DistributedAdaptWithCombineOptimizer, keras.optimizers.SGD(0.1), consensus_control=0.1)
    raises(ValueError, sk.DistributedAdaptThenCombineOptimizer, keras.optimizers.SGD(0.1), "ring")
    raises(ValueError, sk.DistributedAdaptThenCombineOptimizer, keras.optimizers.SGD(0.1), None, 0)


sys.exit(1 if run_all(R) else 0)
