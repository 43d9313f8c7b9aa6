"""Horovod's alltoall and grouped ops in shoal.tensorflow / shoal.keras with exact expected
values: alltoall (dtypes, splits, received splits, eager and tf.function, gradients,
errors), grouped_allreduce (every reduce op, mixed dtypes, integer average, scaling,
gradients), grouped_allgather and grouped_reducescatter (gradients), a group that fails as
a whole. Run at 4 ranks by tests/test_alltoall_grouped.py."""
import functools
import hashlib
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import a2a_expect  # noqa: E402
import shoal.keras as hvd_keras  # noqa: E402
import shoal.tensorflow as hvd  # noqa: E402
from a2a_expect import rows, split  # noqa: E402
from checks import Skip, check, raises, run_all  # noqa: E402

hvd.init()
R, N = hvd.rank(), hvd.size()
DTYPES = [tf.int8, tf.uint8, tf.int32, tf.int64, tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.bool]
NP_FOLDS = {"Sum": np.add, "Min": np.minimum, "Max": np.maximum, "Product": np.multiply}


def received(r, splits_of, d0_of, width=3):
    return a2a_expect.received(r, N, splits_of, d0_of, width)


def as_tf(a, dt):
    return tf.constant(a % 2 == 1) if dt == tf.bool else tf.cast(tf.constant(a), dt)


def same_everywhere(msg, strip=""):
    msg = msg.replace(strip, "") if strip else msg
    digest = np.frombuffer(hashlib.sha256(msg.encode()).digest(), np.uint8)
    every = hvd.allgather(tf.constant(digest[None, :]), name=f"same.{hashlib.sha1(msg.encode()).hexdigest()[:12]}")
    assert all(np.array_equal(row, every.numpy()[0]) for row in every.numpy()), f"ranks saw different errors: {msg}"


def error_of(exc_type, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc_type as e:
        return str(e)
    raise AssertionError(f"{fn.__name__} did not raise {exc_type.__name__}")


@check
def alltoall_dtypes_splits_and_received_splits():
    for dt in DTYPES:
        got = hvd.alltoall(as_tf(rows(R, 2 * N), dt), name=f"tf.a2a.even.{dt.name}")
        tf.debugging.assert_equal(got, as_tf(received(R, lambda q, k: 2, lambda q: 2 * N), dt), message=dt.name)
    d0 = sum(split(R, q) for q in range(N))
    got, rsplits = hvd.alltoall(tf.constant(rows(R, d0), tf.float64), splits=[split(R, q) for q in range(N)],
                                name="tf.a2a.uneven")
    want = received(R, split, lambda q: sum(split(q, k) for k in range(N)))
    assert np.array_equal(got.numpy(), want) and rsplits.dtype == tf.int32, (got, want, rsplits)
    assert rsplits.numpy().tolist() == [split(q, R) for q in range(N)], rsplits
    out = hvd_keras.alltoall(rows(R, N).astype("int32"), name="tf.a2a.keras")
    assert np.array_equal(out.numpy(), received(R, lambda q, k: 1, lambda q: N)), out


@check
def alltoall_in_tf_function_and_its_gradient():
    d0 = sum(split(R, q) for q in range(N))
    splits = tf.constant([split(R, q) for q in range(N)], tf.int32)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y, _ = hvd.alltoall(x, splits=splits, name="tf.a2a.fn")
            w = tf.cast(100 * R + tf.range(tf.shape(y)[0]), tf.float64)[:, None]
            loss = tf.reduce_sum(y * w)
        return y, tape.gradient(loss, x)

    y, g = step(tf.constant(rows(R, d0, 2), tf.float64))
    assert np.array_equal(y.numpy(), received(R, split, lambda q: sum(split(q, k) for k in range(N)), 2)), y
    want = []
    for q in range(N):
        before = sum(split(k, q) for k in range(R))
        want += [100 * q + before + j for j in range(split(R, q))]
    assert np.array_equal(g.numpy(), np.repeat(np.array(want, float)[:, None], 2, 1)), (g, want)


@check
def alltoall_errors_are_the_same_everywhere():
    if N == 1:
        raise Skip("needs 2 or more ranks")
    s = [1] * N
    if R == 1:
        s[0] = 2
    msg = error_of(ValueError, hvd.alltoall, tf.ones((N, 2)), splits=s, name="tf.a2a.badsum")
    assert f"alltoall: splits sum to {N + 1} rows, but dim 0 is {N}" in msg, msg
    same_everywhere(msg, " (raised at the call on rank 1)")
    raises(TypeError, hvd.alltoall, tf.ones((N, 2)), splits=[0.5] * N, name="tf.a2a.float")
    msg = error_of(hvd.ShoalError, hvd.alltoall, tf.ones((N, 2 + R % 2)), name="tf.a2a.trailing")
    assert "alltoall 'tf.a2a.trailing': mismatched trailing dimensions across ranks" in msg, msg
    same_everywhere(msg)


def member(r, k, shape):
    return (r * 5 + k * 7 + np.arange(int(np.prod(shape)))).reshape(shape) % 9 - 3


SHAPES = [(tf.float64, (3,)), (tf.float32, (2, 2)), (tf.int32, (5,)), (tf.bfloat16, (4,)), (tf.int8, (3,))]


def fold(op, k, dt, shape):
    np_dt = np.float32 if dt in (tf.bfloat16, tf.float16) else dt.as_numpy_dtype
    with np.errstate(over="ignore"):
        return tf.cast(functools.reduce(NP_FOLDS[op], [member(q, k, shape).astype(np_dt) for q in range(N)]), dt)


@check
def grouped_allreduce_every_op_eager_and_traced():
    for op in NP_FOLDS:
        xs = [tf.cast(member(R, k, shape), dt) for k, (dt, shape) in enumerate(SHAPES)]
        got = hvd.grouped_allreduce(xs, op=getattr(hvd, op), name=f"tf.g.{op}")
        for k, (dt, shape) in enumerate(SHAPES):
            tf.debugging.assert_equal(got[k], fold(op, k, dt, shape), message=f"{op} {k}")

    @tf.function
    def traced(a, b):
        return hvd.grouped_allreduce([a, b], op=hvd.Max)

    a, b = traced(tf.constant([float(R), -R]), tf.constant([R, 2 * R], tf.int64))
    assert np.array_equal(a.numpy(), [N - 1, 0.0]) and np.array_equal(b.numpy(), [N - 1, 2 * (N - 1)]), (a, b)


@check
def grouped_allreduce_horovod_extras():
    xs = [tf.constant(member(R, 0, (3,)), tf.float64), tf.constant(member(R, 2, (5,)), tf.int32)]
    got = hvd.grouped_allreduce(xs, op=hvd.Average, name="tf.g.intavg")  # ints: sum // size toward zero
    tf.debugging.assert_equal(got[0], fold("Sum", 0, tf.float64, (3,)) / N)
    tf.debugging.assert_equal(got[1], tf.truncatediv(fold("Sum", 2, tf.int32, (5,)), N))
    got = hvd.grouped_allreduce(xs, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5, name="tf.g.scaled")
    tf.debugging.assert_equal(got[0], fold("Sum", 0, tf.float64, (3,)))
    tf.debugging.assert_equal(got[1], fold("Sum", 2, tf.int32, (5,)))
    # Factors reach the core as doubles (Horovod's TensorFlow ops round them to float32):
    # 0.1 on float64 is numpy's x * 0.1 summed (to the sum's rounding; 0.1 as a float32 is
    # 1.5e-8 off), and int32 10 * 0.7 truncates to 7, not 6.
    got = hvd.grouped_allreduce([tf.constant([1.0, 3.0], tf.float64), tf.constant([10, -10], tf.int32)], op=hvd.Sum,
                                prescale_factor=0.1, postscale_factor=0.7, name="tf.g.exact")
    assert np.allclose(got[0].numpy(), np.array([1.0, 3.0]) * 0.1 * N * 0.7, rtol=1e-14, atol=0), got[0]
    assert np.array_equal(got[1].numpy(), np.trunc(np.trunc(np.array([10, -10]) * 0.1) * N * 0.7)), got[1]
    got = hvd.allreduce(tf.constant([10, -10], tf.int32), op=hvd.Sum, prescale_factor=0.7, name="tf.exact")
    assert np.array_equal(got.numpy(), [7 * N, -7 * N]), got
    got = hvd.grouped_allreduce([tf.constant(member(R, 1, (2, 2)), tf.float32)], op=hvd.Sum,
                                compression=hvd.Compression.fp16, name="tf.g.fp16")
    assert got[0].dtype == tf.float32
    tf.debugging.assert_equal(got[0], fold("Sum", 1, tf.float32, (2, 2)))


@check
def grouped_gradients():
    a = tf.Variable(tf.fill([3], float(R)))
    b = tf.Variable(tf.fill([2, 2], tf.cast(R, tf.float64)))
    with tf.GradientTape() as tape:
        ya, yb = hvd.grouped_allreduce([a, b], op=hvd.Sum, name="tf.g.grad.sum")
        loss = (R + 1) * tf.reduce_sum(ya) + tf.cast(2 * (R + 1) * tf.reduce_sum(yb), tf.float32)
    ga, gb = tape.gradient(loss, [a, b])
    total = N * (N + 1) / 2
    assert np.array_equal(ga.numpy(), np.full(3, total)) and np.array_equal(gb.numpy(), np.full((2, 2), 2 * total))
    c = tf.Variable([float(R), 5.0 + R])
    with tf.GradientTape() as tape:
        (yc,) = hvd.grouped_allreduce([c], op=hvd.Min, name="tf.g.grad.min")
        loss = (R + 1) * tf.reduce_sum(yc)
    want = np.full(2, total) if R == 0 else np.zeros(2)
    assert np.array_equal(tape.gradient(loss, c).numpy(), want)
    g1 = tf.Variable(tf.reshape(tf.range((R + 1) * 2, dtype=tf.float32), [R + 1, 2]))
    d0 = 2 * N + 1
    g2 = tf.Variable(tf.reshape(tf.range(d0 * 2, dtype=tf.float64), [d0, 2]) * (R + 1))
    with tf.GradientTape() as tape:
        (gathered,) = hvd.grouped_allgather([g1], name="tf.g.grad.ag")
        (scattered,) = hvd.grouped_reducescatter([g2], name="tf.g.grad.rs")  # Average
        loss = (R + 1) * tf.reduce_sum(gathered) + tf.cast(tf.reduce_sum(scattered), tf.float32)
    d1, d2 = tape.gradient(loss, [g1, g2])
    assert gathered.shape[0] == N * (N + 1) // 2
    # Horovod's: the mean of the k + 1; the allgather of the ones as it is (Average)
    assert np.array_equal(d1.numpy(), np.full((R + 1, 2), total / N)) and np.array_equal(d2.numpy(), np.ones((d0, 2)))
    start, n = R * (d0 // N) + min(R, d0 % N), d0 // N + (1 if R < d0 % N else 0)
    want = (np.arange(d0 * 2).reshape(d0, 2) * total / N)[start:start + n]
    assert np.array_equal(scattered.numpy(), want), scattered


@check
def a_group_fails_as_a_whole():
    if N == 1:
        raise Skip("needs 2 or more ranks")
    xs = [tf.ones(3), tf.ones(4 if R == 1 else 3)]
    msg = error_of(hvd.ShoalError, hvd.grouped_allreduce, xs, name="tf.g.bad")
    assert "grouped_allreduce 'tf.g.bad': allreduce 'tf.g.bad[1]': mismatched shapes across ranks" in msg, msg
    same_everywhere(msg)
    msg = error_of(hvd.ShoalError, hvd.grouped_allgather, [tf.ones((1, 2))] * (2 if R == 0 else 3), name="tf.g.count")
    assert "mismatched numbers of tensors across ranks: 2 tensors on rank 0" in msg, msg
    same_everywhere(msg)
    raises(TypeError, hvd.grouped_allreduce, tf.ones(2), name="tf.g.notalist")
    got = hvd.grouped_allreduce(xs[:1], op=hvd.Sum, name="tf.g.bad")  # the name works again
    assert np.array_equal(got[0].numpy(), np.full(3, float(N))), got


sys.exit(1 if run_all(R) else 0)
