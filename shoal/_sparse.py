"""Horovod's allreduce of a sparse tensor (`hvd.sparse_allreduce_async` in torch, a
`tf.IndexedSlices` in TensorFlow), written once: the semantics, the op names and, for the
numpy and torch adapters, the op itself (TensorFlow runs the same two allgathers with its
kernels).

A sparse tensor of shape S is (indices [nnz, k], values [nnz, *S[k:]]): value j sits at
S-index indices[j] (duplicates add up). Its allreduce is the sparse tensor of every rank's
entries, concatenated in rank order: two allgathers (`<name>.indices`, `<name>.values`),
nnz may differ between ranks (and be 0). op=Sum keeps the values; op=Average divides them
by the number of ranks (Horovod: `values / process_set.size()`), so the dense form of the result is the
sum or average of the dense forms. Other reduce ops: NotImplementedError (as Horovod's
TensorFlow allreduce of IndexedSlices).
"""
from . import _ops, _process, process_sets


def names(name):
    """The allgathers' names (`name`: a str, the tensor's name)."""
    return name + ".indices", name + ".values"


def check_op(op, what):
    """Sum or Average (None: Average); NotImplementedError for another reduce op."""
    rop = _ops.reduce_op(None, op)
    if rop is not _ops.Sum and rop is not _ops.Average:
        raise NotImplementedError(f"{what}: a sparse tensor can only be summed or averaged (op=Sum or Average), "
                         f"got {rop!r}")
    return rop


def scale(values, rop, size=None):
    """The gathered values as the result has them: divided by the number of ranks (`size`,
    default size(); a process set's) for Average."""
    return values / (size or _process.size()) if rop is _ops.Average else values


def sparse_allreduce(adapter, indices, values, op, name, process_set=None):
    """Start the allreduce of the sparse tensor (indices [nnz, k], values [nnz, ...]) of
    `adapter`'s tensors; `name` (a str) names its two allgathers. Returns a function that
    waits and gives (indices [Σ nnz, k], values [Σ nnz, ...]) in rank order, the values
    scaled by `scale` (Horovod's `sparse_allreduce_async` returns such a function too).
    A failure raises ShoalError from it, after the other allgather has ended too. In
    `process_set` (a ProcessSet) over its members."""
    rop = check_op(op, "sparse allreduce")
    size = process_sets.layout(process_sets.id_of(process_set, "sparse allreduce"))[0]
    indices_name, values_name = names(name)
    gathering_indices = _ops.allgather(adapter, indices, indices_name, process_set=process_set)
    gathering_values = _ops.allgather(adapter, values, values_name, process_set=process_set)

    def result():
        try:
            gathered = _ops.synchronize(gathering_values)
        except BaseException:
            try:  # every rank submitted both: the indices' op ends (or fails) too
                _ops.synchronize(gathering_indices)
            except Exception:  # noqa: BLE001 - the values' error is the one raised
                pass
            raise
        return _ops.synchronize(gathering_indices), scale(gathered, rop, size)
    return result
