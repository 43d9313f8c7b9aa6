"""Grouped ops (Horovod's grouped_allreduce, grouped_allgather, grouped_reducescatter): a
list of tensors negotiated by the core as one unit (shoal_enqueue_group), so every member
runs (allreduces fused where they can be) or every member fails with the same error on
every rank. Framework-neutral, like shoal._ops: adapters only describe the tensors.
"""
import weakref

from ._loader import _core
from . import process_sets
from ._ops import (ALLGATHER, ALLREDUCE, GROUPED, REDUCESCATTER, STATE, WORLD, _told, op_name, reduce_op,
                   reducescatter_op)


class _Members:
    """A grouped op's members after the first, whose handle `synchronize` waits for and
    releases: `result` takes their results; if that never happens (the group failed, or its
    handle was dropped), they are handed to the core's lingering registry, which releases
    each once the core is done with it."""

    def __init__(self, handles, keep):
        self.handles = handles
        self._linger = weakref.finalize(self, _linger, handles, keep)

    def results(self, result):
        try:
            out = []
            for i, h in enumerate(self.handles, 1):
                _core.wait(h)
                out.append(result(i, h))
            return out
        finally:
            self._linger()  # the rest (after an error), or every one: released once done


def _linger(handles, keep):
    for h in handles:
        _core.linger(h, keep)


def _submit_group(op, name, adapter, tensors, outputs, keep, result, code=0, scope=WORLD, process_set=0,
                  scaling=None):
    """Enqueue the grouped form of `op` over `tensors` (prepared, with `outputs` or None
    each): one negotiation for the list, every member runs or every member fails with the
    same error. `code`: the reduce op's; `process_set`: the core's id of the set; `scaling`:
    Horovod's for every member (shoal._horovod.scaling). Returns one handle; `synchronize`
    gives [result(i, member handle), ...]."""
    name = op_name(name)
    items = []
    for t, o in zip(tensors, outputs):
        ptr, dtype, shape = adapter.describe(t)
        out_ptr = ptr if o is None or o is t else adapter.describe(o)[0]
        items.append((ptr, dtype, shape, out_ptr) + tuple(adapter.device(t)))
    STATE.calls.reached = True
    handles = _core.enqueue_group(op, name, items, reduce_op=code, scope=scope, process_set=process_set,
                                  scaling=scaling)
    first, rest = handles[0], _Members(handles[1:], keep)

    def finish():
        return [result(0, first)] + rest.results(result)

    _core.attach(first, ((keep, rest), finish))  # kept by the core with the handle, for synchronize
    return first


def _tensor_list(tensors, what):
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{what}: tensors must be a list or tuple of tensors, got {type(tensors).__name__}")
    return list(tensors)


@_told(GROUPED | ALLREDUCE)
def grouped_allreduce(adapter, tensors, average=None, name=None, op=None, inplace=False, scope=WORLD,
                      process_set=None, scaling=None):
    """See `shoal.grouped_allreduce_nonblocking` for the semantics; `scaling`: Horovod's."""
    rop = reduce_op(average, op)
    pset = process_sets.id_of(process_set, "grouped_allreduce")
    tensors = _tensor_list(tensors, "grouped_allreduce")
    pairs = [adapter.prepare(t, inplace, "grouped_allreduce") for t in tensors]
    outs = [p[1] for p in pairs]
    return _submit_group(ALLREDUCE, name, adapter, [p[0] for p in pairs], outs, (tensors, pairs),
                         lambda i, h: outs[i], code=rop.code, scope=scope, process_set=pset, scaling=scaling)


def _gathered(adapter, srcs):
    def result(i, handle):
        data, shape = _core.take_result(handle)
        return adapter.from_bytes(data, shape, srcs[i])
    return result


@_told(GROUPED | ALLGATHER)
def grouped_allgather(adapter, tensors, name=None, process_set=None):
    """See `shoal.grouped_allgather_nonblocking` for the semantics."""
    pset = process_sets.id_of(process_set, "grouped_allgather")
    tensors = _tensor_list(tensors, "grouped_allgather")
    srcs = [adapter.prepare(t, False, "grouped_allgather", need_output=False)[0] for t in tensors]
    return _submit_group(ALLGATHER, name, adapter, srcs, [None] * len(srcs), (tensors, srcs),
                         _gathered(adapter, srcs), process_set=pset)


@_told(GROUPED | REDUCESCATTER)
def grouped_reducescatter(adapter, tensors, op=None, name=None, process_set=None, scaling=None):
    """See `shoal.grouped_reducescatter_nonblocking` for the semantics; `scaling`: Horovod's."""
    rop = reducescatter_op(op)
    pset = process_sets.id_of(process_set, "grouped_reducescatter")
    tensors = _tensor_list(tensors, "grouped_reducescatter")
    srcs = [adapter.prepare(t, False, "grouped_reducescatter", need_output=False)[0] for t in tensors]
    return _submit_group(REDUCESCATTER, name, adapter, srcs, [None] * len(srcs), (tensors, srcs),
                         _gathered(adapter, srcs), code=rop.code, process_set=pset, scaling=scaling)
