"""Horovod's collectives in shoal.tensorflow / shoal.keras with exact expected values:
allreduce with op=Min/Max/Product (every dtype, eager and tf.function, gradients) and
reducescatter (uneven splits, integer average, gradients).
Run at 2 and 4 ranks by tests/test_collectives.py."""
import functools
import math
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import shoal.keras as hvd_keras  # noqa: E402
import shoal.tensorflow as hvd  # noqa: E402
from checks import check, raises, run_all  # noqa: E402

hvd.init()
R, N = hvd.rank(), hvd.size()
DTYPES = [tf.int8, tf.uint8, tf.int16, tf.int32, tf.int64, tf.float16, tf.bfloat16, tf.float32, tf.float64]
FOLDS = ("Min", "Max", "Product")
NP_FOLDS = {"Min": np.minimum, "Max": np.maximum, "Product": np.multiply}


def value_np(r, n=6):
    """Rank r's input: small integers in [-2, 4] (uint8 wraps the negative ones), so
    products over 4 ranks overflow int8."""
    i = np.arange(n)
    return (i % 4 - 1) * (1 + r % 2) + (i == n - 1) * r


def value(r, dtype):
    return tf.cast(tf.constant(value_np(r) % 256 if dtype == tf.uint8 else value_np(r)), dtype)


def expected(op, dtype):
    """The fold in numpy in the dtype (wrapping; bfloat16 in float32: exact here)."""
    np_dt = np.float32 if dtype == tf.bfloat16 else dtype.as_numpy_dtype
    with np.errstate(over="ignore"):
        out = functools.reduce(NP_FOLDS[op], [value_np(r).astype(np_dt) for r in range(N)])
    return tf.cast(tf.constant(out), dtype)


def exact(prefix):
    for op in FOLDS:
        for dt in DTYPES:
            got = hvd.allreduce(value(R, dt), op=getattr(hvd, op), name=f"{prefix}.{op}.{dt.name}")
            tf.debugging.assert_equal(got, expected(op, dt), message=f"{op} {dt.name}")
    return tf.constant(True)


@check
def min_max_product_eager():
    exact("tf.rop.eager")


@check
def min_max_product_in_tf_function():
    assert bool(tf.function(exact)("tf.rop.graph"))


@check
def keras_names():
    got = hvd_keras.allreduce(value(R, tf.float32), name="tf.rop.keras", op=hvd_keras.Max)
    tf.debugging.assert_equal(got, expected("Max", tf.float32))


@check
def gradients():
    total = N * (N + 1) / 2
    for op, first, last in (("Max", N - 1, 0), ("Min", 0, N - 1)):
        x = tf.Variable([float(R), 5.0, -float(R)], dtype=tf.float64)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(hvd.allreduce(x, op=getattr(hvd, op), name=f"tf.rop.grad.{op}") * (R + 1))
        g = tape.gradient(loss, x)
        tf.debugging.assert_equal(g, tf.constant([total * (R == first), total / N, total * (R == last)], tf.float64))
    x = tf.Variable([R + 1.0, 2.0, 0.0 if R == 0 else 1.0], dtype=tf.float64)
    with tf.GradientTape() as tape:
        y = hvd.allreduce(x, op=hvd.Product, name="tf.rop.grad.prod")
        loss = tf.reduce_sum(y * (R + 1))
    tf.debugging.assert_equal(y, tf.constant([math.factorial(N), 2.0 ** N, 0.0], tf.float64))
    want = [total * math.factorial(N) / (R + 1), total * 2.0 ** (N - 1), total * (1.0 if R == 0 else 0.0)]
    tf.debugging.assert_equal(tape.gradient(loss, x), tf.constant(want, tf.float64))


@check
def bad_arguments():
    raises(ValueError, hvd.allreduce, tf.ones(2), average=True, op=hvd.Min, name="tf.rop.avg")
    raises(NotImplementedError, hvd.allreduce, tf.ones(2), op=hvd.Adasum, name="tf.rop.adasum")
    raises(ValueError, hvd.allreduce, tf.ones(2, tf.bool), op=hvd.Max, name="tf.rop.bool")
    tf.debugging.assert_equal(hvd.allreduce(tf.ones(2), op=hvd.Min, name="tf.rop.after"), tf.ones(2))


def rows_of(r, d0):
    """Horovod's split: (first row, rows) of rank r."""
    return r * (d0 // N) + min(r, d0 % N), d0 // N + (1 if r < d0 % N else 0)


def scatter(prefix):
    d0 = 2 * N + N - 1
    start, n = rows_of(R, d0)
    base = np.arange(d0 * 3).reshape(d0, 3) % 7
    for dt in DTYPES:
        got = hvd.reducescatter(tf.cast(base * (R + 1), dt), op=hvd.Sum, name=f"{prefix}.{dt.name}")
        tf.debugging.assert_equal(got, tf.cast(base[start:start + n] * (N * (N + 1) // 2), dt), message=dt.name)
    got = hvd.reducescatter(tf.constant(base * (R + 1), tf.float32), name=f"{prefix}.avg")  # Average
    tf.debugging.assert_equal(got, tf.constant(base[start:start + n] * (N * (N + 1) // 2) / N, tf.float32))
    got = hvd.reducescatter(tf.fill([N, 2], R), op=hvd.Average, name=f"{prefix}.intavg")  # truncated
    tf.debugging.assert_equal(got, tf.fill([1, 2], (N * (N - 1) // 2) // N))
    return tf.constant(True)


@check
def reducescatter_eager_and_in_tf_function():
    scatter("tf.rs.eager")
    assert bool(tf.function(scatter)("tf.rs.graph"))


@check
def reducescatter_gradient_is_allgather():
    d0 = 2 * N + 1
    owner = np.array([next(q for q in range(N) if rows_of(q, d0)[0] <= i < sum(rows_of(q, d0))) for i in range(d0)])
    for op, scale in ((hvd.Average, 1.0), (hvd.Sum, float(N))):  # Horovod's: times size() for Sum
        x = tf.Variable(tf.ones([d0, 2], tf.float64))
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(hvd.reducescatter(x, op=op, name=f"tf.rs.grad.{op.name}") * (R + 1))
        want = np.repeat(((owner + 1) * scale)[:, None], 2, axis=1)
        tf.debugging.assert_equal(tape.gradient(loss, x), tf.constant(want, tf.float64))


@check
def reducescatter_bad_arguments():
    raises(ValueError, hvd.reducescatter, tf.constant(1.0), name="tf.rs.0d")
    raises(ValueError, hvd.reducescatter, tf.ones([2, 2]), op=hvd.Max, name="tf.rs.max")


sys.exit(1 if run_all(R) else 0)
