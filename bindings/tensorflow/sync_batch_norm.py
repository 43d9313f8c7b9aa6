"""`SyncBatchNormalization`: Keras 3 batch normalization over every rank's batch (Horovod's
`hvd.SyncBatchNormalization`; the statistics and their gradient are
shoal/_sync_batch_norm.py's, run with the TensorFlow kernels)."""
import keras
import tensorflow as tf

from shoal import _process
from shoal import _sync_batch_norm as _math

from . import _horovod, ops


def _channel_vector(v, ndims, axis):
    """v [C] shaped to broadcast along `axis` of an `ndims`-D tensor."""
    shape = [1] * ndims
    shape[axis] = -1
    return tf.reshape(v, shape)


def global_moments(x, axis, reduction_axes, weights=None):
    """(mean [C], biased variance [C]) of the global batch along `reduction_axes` (every
    axis but the channel `axis`), differentiable (the gradient of the global loss).
    `weights`: None, or a 0/1 mask of x's shape (masked samples count nowhere)."""
    ndims = x.shape.rank
    c = x.shape[axis]
    if c is None:
        raise ValueError("SyncBatchNormalization needs a known channel dimension")

    @tf.custom_gradient
    def moments(x):
        x64 = tf.cast(x, tf.float64)
        w64 = None if weights is None else tf.cast(weights, tf.float64)
        if w64 is None:
            n_r = tf.cast(tf.size(x), tf.float64) / c
            total = tf.reduce_sum(x64, reduction_axes)
        else:
            n_r = tf.reduce_sum(w64, reduction_axes)[0]
            total = tf.reduce_sum(x64 * w64, reduction_axes)
        mean_r = total / tf.maximum(n_r, 1.0)  # a rank without samples contributes nothing
        dev = (x64 - _channel_vector(mean_r, ndims, axis)) ** 2
        m2_r = tf.reduce_sum(dev if w64 is None else dev * w64, reduction_axes)
        row = tf.concat([tf.reshape(n_r, [1]), mean_r, m2_r], 0)
        gathered = ops.allgather(row[None])
        n, mean, m2 = _math.combine(gathered, c, lambda t: tf.reduce_sum(t, 0))
        if tf.executing_eagerly():
            _math.check_count(n.numpy(), "SyncBatchNormalization")
        else:
            with tf.control_dependencies([tf.debugging.assert_greater(
                    n, tf.constant(1.0, tf.float64),
                    message="SyncBatchNormalization: expected more than 1 value per channel over all ranks' "
                            "batches when training")]):
                n = tf.identity(n)
        mean_b = _channel_vector(mean, ndims, axis)

        def grad(g_mean, g_var):
            summed = ops.allreduce(tf.cast(tf.concat([g_mean, g_var], 0), tf.float64), op=ops.Sum)
            dx = _math.input_grad(x64 - mean_b, _channel_vector(summed[:c], ndims, axis),
                                  _channel_vector(summed[c:], ndims, axis), n[0])
            return tf.cast(dx if w64 is None else dx * w64, x.dtype)

        return (tf.cast(mean, x.dtype), tf.cast(m2 / n, x.dtype)), grad

    return moments(x)


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Keras 3 `BatchNormalization` whose training statistics are those of the global
    batch, every rank's batch together (Horovod's `hvd.SyncBatchNormalization`; Ioffe &
    Szegedy 2015 over the concatenated batch). Arguments: Keras' BatchNormalization's,
    plus Horovod's `fused` (False only: ValueError otherwise, as Horovod) and
    `process_set` (the global one only until Shoal has process sets).

    Training: per channel, the mean and biased variance of all ranks' samples (ranks may
    have different batch sizes, even none; with a mask, only unmasked samples count)
    normalize each rank's input and update `moving_mean`/`moving_variance` as Keras'
    layer would with the global batch, the same on every rank. One allgather of
    [1 + 2C] float64 values per call, one allreduce of 2C in the backward pass
    (shoal/_sync_batch_norm.py). The input's gradient is that of the global loss; gamma
    and beta's gradients stay this rank's part (a DistributedOptimizer averages them).
    Inference uses the moving statistics, locally. Differences from Horovod: uneven batch
    sizes are weighted by their counts (Horovod averages the ranks' moments as if the
    batches were equal), and Keras' `synchronized`/`renorm` options are not combined
    with it (ValueError). TensorFlow backend; works eagerly and inside tf.function (not
    under XLA). A global batch of at most one value per channel raises ValueError
    (eagerly; InvalidArgumentError inside a tf.function) on every rank.
    """

    def __init__(self, fused=False, process_set=_horovod.global_process_set, **kwargs):
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True.")
        _horovod.check_process_set(process_set, "SyncBatchNormalization")
        if kwargs.get("synchronized") or kwargs.get("renorm"):
            raise ValueError("SyncBatchNormalization synchronizes over Shoal's ranks itself; synchronized=True "
                             "(tf.distribute) and renorm=True are not supported with it")
        super().__init__(**kwargs)

    def _moments(self, inputs, mask):
        if _process.size() == 1:
            return super()._moments(inputs, mask)
        weights = None
        if mask is not None:
            weights = tf.broadcast_to(tf.cast(tf.expand_dims(mask, -1), inputs.dtype), tf.shape(inputs))
        return global_moments(inputs, self.axis, list(self._reduction_axes), weights)
