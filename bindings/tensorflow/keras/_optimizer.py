"""Horovod's Keras `DistributedOptimizer`, `PartialDistributedOptimizer` and `load_model` for Keras 3 (issue 17;
Horovod 0.28 `horovod/tensorflow/keras/__init__.py`, `horovod/_keras/__init__.py`,
`horovod/tensorflow/gradient_aggregation_eager.py`).

As in Horovod, `DistributedOptimizer(opt)` returns an instance of a class made on the fly
that derives from `type(opt)`, has its name, and is built from `opt.get_config()`, so
`model.compile`, `isinstance(..., keras.optimizers.SGD)` and saving work, and a saved model
loads without Shoal (as the plain optimizer). Keras 3's public hook is overridden:
`apply(grads, trainable_variables)` (which `apply_gradients` and the TensorFlow trainer's
train step call) reduces the gradients with `shoal.tensorflow.ops.reduce_gradients` (the
TF allreduce kernel) before the wrapped optimizer's `apply`. Only the TensorFlow backend
is supported (NotImplementedError otherwise).
"""
import keras
import tensorflow as tf

from shoal import process_sets
from shoal.tensorflow import _horovod
from shoal.tensorflow import ops as _tf_ops
from shoal._ops import Average, Sum


class _Settings:
    """What DistributedOptimizer was given (a plain object: Keras does not track it)."""

    def __init__(self, name, compression, sparse_as_dense, gradient_predivide_factor, op,
                 backward_passes_per_step, average_aggregated_gradients, scale_local_gradients,
                 process_set=None):
        self.name, self.compression, self.sparse_as_dense = name, compression, sparse_as_dense
        self.process_set = process_set
        self.gradient_predivide_factor, self.op = gradient_predivide_factor, op
        self.passes, self.average_aggregated = backward_passes_per_step, average_aggregated_gradients
        self.scale_local_gradients = scale_local_gradients


class _State:
    """Per optimizer instance: local variables, and the accumulators of
    backward_passes_per_step > 1 (tf.Variables held outside Keras' tracking, as Horovod's
    are: they are neither saved nor broadcast)."""

    def __init__(self):
        self.local, self.counter, self.sums = set(), None, None


def _state(opt):
    state = opt.__dict__.get("_shoal_state")
    if state is None:
        state = _State()
        object.__setattr__(opt, "_shoal_state", state)
    return state


def _check(op, process_set, compression, backward_passes_per_step, num_groups, groups, what):
    process_sets.id_of(process_set, what)
    if op is _horovod.Adasum or (op is not Average and op is not Sum):
        raise ValueError(f"{what}: op currently only supports Average and Sum (Horovod's rule), got {op!r}")
    _horovod.check_compression(compression, what)
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
            or backward_passes_per_step < 1:
        raise ValueError(f"{what}: backward_passes_per_step must be an int >= 1, got {backward_passes_per_step!r}")
    if groups is None and num_groups:
        groups = num_groups
    if groups is not None and not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
        raise ValueError("groups should be a non-negative integer or a list of list of tf.Variable.")
    if keras.backend.backend() != "tensorflow":
        raise NotImplementedError(f"{what}: Keras backend {keras.backend.backend()!r}: shoal.keras reduces "
                                  "gradients with the TensorFlow kernels; use KERAS_BACKEND=tensorflow (or "
                                  "shoal.torch's DistributedOptimizer in a torch training loop)")


def applied_variables(opt, trainable_variables):
    """The variables an `apply(grads, trainable_variables)` call of Keras optimizer `opt`
    updates, or None when Keras must answer (not built, and none given)."""
    if trainable_variables is not None:
        return list(trainable_variables)
    return list(opt._trainable_variables) if opt.built else None


def _distributed_class(base, settings):
    """A subclass of the Keras optimizer class `base`, with base's name and module, whose
    `apply` reduces the gradients first."""

    def reduce(self, grads, variables):
        state = _state(self)
        picked = [i for i, v in enumerate(variables) if id(v) not in state.local]
        reduced = _tf_ops.reduce_gradients(
            [grads[i] for i in picked], [variables[i] for i in picked], settings.name,
            compression=settings.compression, op=settings.op,
            gradient_predivide_factor=settings.gradient_predivide_factor,
            sparse_as_dense=settings.sparse_as_dense, what="DistributedOptimizer",
            process_set=settings.process_set)
        out = list(grads)
        for i, g in zip(picked, reduced):
            out[i] = g
        n = process_sets.layout(process_sets.id_of(settings.process_set, "DistributedOptimizer"))[0]
        for i, v in enumerate(variables):
            if id(v) in state.local:  # Horovod: local gradients / size() with scale_local_gradients
                out[i] = _tf_ops.local_gradient(out[i], settings.scale_local_gradients, n)
        return out

    def build(self, variables):
        super(cls, self).build(variables)
        if settings.passes > 1:
            state = _state(self)
            with tf.init_scope():
                state.counter = tf.Variable(0, dtype=tf.int64, trainable=False)
                state.sums = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False) for v in variables]

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        variables = applied_variables(self, trainable_variables)
        if variables is None or len(grads) == 0:  # Keras' own error, or nothing to reduce
            return super(cls, self).apply(grads, trainable_variables)
        if settings.passes == 1:
            return super(cls, self).apply(reduce(self, grads, variables), trainable_variables)
        return _aggregate(self, grads, variables, trainable_variables)

    def _aggregate(self, grads, variables, trainable_variables):
        # Horovod's LocalGradientAggregationHelperEager: sum the gradients of k backward
        # passes locally; at the k-th, reduce the sums (divided by k with
        # average_aggregated_gradients) and apply them; the other calls only count
        # `iterations`.
        if not self.built:
            self.build(variables)
            self.built = True
        state = _state(self)
        for g in grads:
            if isinstance(g, tf.IndexedSlices) and not settings.sparse_as_dense:
                raise ValueError("IndexedSlices are not supported when `backward_passes_per_step` > 1 and "
                                 "`sparse_as_dense` is False.")
        index = [self._get_variable_index(v) for v in variables]
        for g, i in zip(grads, index):
            if g is not None:
                state.sums[i].assign_add(tf.convert_to_tensor(g))
        state.counter.assign_add(1)

        def reduce_and_apply():
            sums = [None if g is None else state.sums[i].read_value() for g, i in zip(grads, index)]
            reduced = reduce(self, sums, variables)
            if settings.average_aggregated:
                reduced = [None if g is None else g / tf.cast(settings.passes, g.dtype) for g in reduced]
            super(cls, self).apply(reduced, trainable_variables)
            state.counter.assign(0)
            for s in state.sums:
                s.assign(tf.zeros_like(s))
            return tf.constant(True)

        def count_only():
            self.iterations.assign_add(1)
            return tf.constant(False)

        return tf.cond(tf.equal(state.counter, settings.passes), reduce_and_apply, count_only)

    def register_local_var(self, var):
        """Horovod's register_local_var: `var`'s gradient is not reduced (divided by
        size() with scale_local_gradients, as in Horovod)."""
        _state(self).local.add(id(var))

    cls = type(base.__name__, (base,), {
        "apply": apply, "build": build, "register_local_var": register_local_var,
        "__module__": base.__module__, "__qualname__": base.__qualname__,
        "__doc__": f"{base.__name__} whose gradients are reduced over all ranks first "
                   "(shoal.keras.DistributedOptimizer).",
        "_shoal_settings": settings})
    return cls


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                         compression=_horovod.Compression.none, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=_horovod.global_process_set, scale_local_gradients=True):
    """Horovod's Keras DistributedOptimizer (its positional order) for a Keras 3 optimizer:
    gradients are averaged (op=Average) or summed (op=Sum) over all ranks before the
    wrapped optimizer applies them, in `model.fit` (inside its tf.function) and in custom
    loops calling `apply_gradients`/`apply`.

    Args (Horovod's):
        optimizer: a `keras.optimizers.Optimizer` (TensorFlow backend).
        name: prefix of the reduction's op names (default "Distributed<Class>"); the
            optimizer's own `name` is unchanged.
        device_dense, device_sparse: accepted, change nothing.
        compression: Compression.none / fp16 / bf16.
        sparse_as_dense: densify tf.IndexedSlices gradients (else allgather of values
            and indices, as Horovod).
        gradient_predivide_factor: for Average, each gradient times 1/f before the sum
            and the average times f after it.
        op: Average or Sum (anything else: ValueError, as in Horovod).
        backward_passes_per_step, average_aggregated_gradients: sum k passes locally,
            reduce and apply at the k-th (divided by k if average_aggregated_gradients);
            the other calls only count `iterations`.
        num_groups, groups: checked as Horovod does; they change nothing (Shoal fuses
            whatever is ready in one cycle).
        process_set: a `ProcessSet`: gradients are reduced over its members only; on a
            rank outside it they are applied as they are (Horovod's rule).
        scale_local_gradients: gradients of variables given to `register_local_var` are
            not reduced, and divided by size() when True.

    A gradient that is None stays None (Keras skips that variable), as in Horovod: it
    must then be None on every rank. Returns a new optimizer (from `optimizer.get_config()`;
    its variables, if already built, are not copied), as Horovod does.
    """
    what = "DistributedOptimizer"
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"{what}: expected a Keras 3 optimizer (keras.optimizers.Optimizer), got "
                        f"{type(optimizer).__name__}")
    _check(op, process_set, compression, backward_passes_per_step, num_groups, groups, what)
    base = type(optimizer)
    base = getattr(base, "_shoal_base", base)  # wrapping a wrapped optimizer wraps its base once
    settings = _Settings(name or f"Distributed{base.__name__}", compression, bool(sparse_as_dense),
                         float(gradient_predivide_factor), op, backward_passes_per_step,
                         bool(average_aggregated_gradients), bool(scale_local_gradients), process_set)
    cls = _distributed_class(base, settings)
    cls._shoal_base = base
    return cls.from_config(optimizer.get_config())


def PartialDistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",  # noqa: N802
                                compression=_horovod.Compression.none, sparse_as_dense=False,
                                gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,
                                average_aggregated_gradients=False, groups=None,
                                process_set=_horovod.global_process_set, local_layers=None,
                                scale_local_gradients=True):
    """Horovod's `PartialDistributedOptimizer` (horovod.keras; its positional order): a
    DistributedOptimizer whose `local_layers` (Keras layers) keep their gradients local
    (not reduced; divided by size() with scale_local_gradients, as Horovod).
    ValueError for a local layer that is not a Keras layer."""
    local = _tf_ops._local_layers_variables(local_layers)
    opt = DistributedOptimizer(optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
                               gradient_predivide_factor, op, backward_passes_per_step,
                               average_aggregated_gradients, 0, groups, process_set, scale_local_gradients)
    for v in local:
        opt.register_local_var(v)
    return opt


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=_horovod.Compression.none,
               legacy_opts=False):
    """Horovod's load_model: `keras.models.load_model(filepath)` with the model's
    optimizer (any class of `keras.optimizers`, or of `custom_optimizers`) built as a
    DistributedOptimizer with `compression`, so training resumes with the saved
    optimizer state. `custom_objects` entries win over these. `legacy_opts` (Keras 2's
    `keras.optimizers.legacy`) does not exist in Keras 3: True raises ValueError."""
    if legacy_opts:
        raise ValueError("load_model: legacy_opts=True needs keras.optimizers.legacy, which Keras 3 does not have")
    _check(Average, None, compression, 1, 0, None, "load_model")
    objects = {}
    for base in list(keras.optimizers.Optimizer.__subclasses__()) + list(custom_optimizers or []):
        if base.__name__.startswith("_") or getattr(base, "_shoal_base", None) is not None:
            continue
        settings = _Settings(f"Distributed{base.__name__}", compression, False, 1.0, Average, 1, False, True)
        cls = _distributed_class(base, settings)
        cls._shoal_base = base
        objects[base.__name__] = cls
    objects.update(custom_objects or {})
    return keras.models.load_model(filepath, custom_objects=objects)
