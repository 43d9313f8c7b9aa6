"""Blocking ops registered with torch.library, so `torch.compile` can trace them.

Each op is an opaque call with a fake (meta) implementation giving its output shape;
the real implementation enqueues into the core and waits.
"""
import functools
import importlib.abc
import inspect
import sys

import torch

import shoal as _numpy_api
from shoal import _gradients, _horovod, _ops, process_sets
from shoal._loader import _core
from shoal._gradients import grad_name

from . import _adapter
from ._adapter import ADAPTER

_register_fake = getattr(torch.library, "register_fake", None) or torch.library.impl_abstract


def _define(schema, impl, fake, kernel=None):
    """Registers `shoal::<schema>` with the Python kernel `impl`, or with the C kernel
    `kernel(impl, doc, module, torch=, ops=)` (bindings/python/registered_kernels.cc) that
    takes a plain tensor to the core in one call and calls `impl` for anything else: a
    compiled graph calls the kernel on every step, so its cost is the compiled op's."""
    name = "shoal::" + schema.split("(", 1)[0]
    torch.library.define(name, "(" + schema.split("(", 1)[1])
    if kernel is not None and not _adapter._FAKE:
        impl = kernel(impl, impl.__doc__ or "", ADAPTER.module, torch=ADAPTER.torch_api, ops=_ops.REDUCE_OP_CODES)
    torch.library.impl(name, "CompositeExplicitAutograd")(impl)
    _register_fake(name)(fake)


def scaling(tensors, prescale, postscale):
    """Horovod's scaling of an op on `tensors` (a sequence: a grouped op's members) for the
    core (shoal._horovod.scaling): the factors, and for integer tensors (bool is none here:
    the core refuses it) Horovod's truncation, its integer average included. torch's ops
    truncate the integer average wherever they are called from (eager, compiled,
    nonblocking, grouped), as Horovod's do."""
    integers = any(not t.is_floating_point() and t.dtype != torch.bool for t in tensors)
    return _horovod.scaling(prescale, postscale, integers)


# `process_set`: the core's id of the set that runs the op (0: every rank); `prescale`,
# `postscale`: Horovod's factors, applied by the core.
def _allreduce_impl(tensor, reduce_op, local, name, process_set=0, prescale=1.0, postscale=1.0):
    rop = _ops.REDUCE_OPS_BY_CODE.get(reduce_op, reduce_op)
    return _ops.allreduce(ADAPTER, tensor, None, name or None, op=rop, scope=_ops.MACHINE if local else _ops.WORLD,
                          block=True, process_set=process_set, scaling=scaling((tensor,), prescale, postscale))


def _broadcast_impl(tensor, root_rank, name, process_set=0):
    return _ops.broadcast(ADAPTER, tensor, root_rank, name or None, block=True, process_set=process_set)


def _allgather_impl(tensor, name, process_set=0):
    a = _plain(tensor, _NUMPY_DTYPES)  # the eager entry's path (below)
    if a is not None:
        return torch.from_numpy(_numpy_api.allgather(a, name or None, process_set))
    return _ops.synchronize(_ops.allgather(ADAPTER, tensor, name or None, process_set=process_set))


def _allgather_fake(tensor, name, process_set=0):
    if process_sets.layout(process_set)[0] == 1:  # (an unused dynamic size fails the trace)
        return tensor.new_empty(tensor.shape)
    return tensor.new_empty((torch.library.get_ctx().new_dynamic_size(),) + tuple(tensor.shape[1:]))


def _reducescatter_impl(tensor, reduce_op, name, process_set=0, prescale=1.0, postscale=1.0):
    rop = _ops.REDUCE_OPS_BY_CODE.get(reduce_op, reduce_op)
    scaled = scaling((tensor,), prescale, postscale)
    a = None if scaled else _plain(tensor, _NUMPY_DTYPES)  # the eager entry's path (below)
    if a is not None:
        return torch.from_numpy(_numpy_api.reducescatter(a, rop, name or None, process_set))
    return _ops.synchronize(_ops.reducescatter(ADAPTER, tensor, rop, name or None, process_set=process_set,
                                               scaling=scaled))


def _reducescatter_fake(tensor, reduce_op, name, process_set=0, prescale=1.0, postscale=1.0):
    size, rank = process_sets.layout(process_set)
    rows = _ops.reducescatter_rows(tensor.shape[0], size, rank) if tensor.dim() else 0
    return tensor.new_empty((rows,) + tuple(tensor.shape[1:]))


def _neighbor_impl(tensor, self_weight, recv_ranks, recv_weights, send_ranks, send_weights,
                   uniform, topo_check, name):
    peers = {"recv_ranks": recv_ranks, "recv_weights": recv_weights, "self_weight": self_weight,
             "uniform": uniform, "send_ranks": send_ranks, "send_weights": send_weights,
             "topo_check": topo_check}
    return _ops.neighbor_allreduce_submit(ADAPTER, tensor, name or None, peers, block=True)


_define("allreduce(Tensor tensor, int reduce_op, bool local, str name, int process_set=0, float prescale=1.0, "
        "float postscale=1.0) -> Tensor", _allreduce_impl, lambda tensor, *args: torch.empty_like(tensor),
        _core.native_kernel_allreduce)
_define("broadcast(Tensor tensor, int root_rank, str name, int process_set=0) -> Tensor", _broadcast_impl,
        lambda tensor, root_rank, name, process_set=0: torch.empty_like(tensor), _core.native_kernel_broadcast)
_define("allgather(Tensor tensor, str name, int process_set=0) -> Tensor", _allgather_impl, _allgather_fake)
_define("reducescatter(Tensor tensor, int reduce_op, str name, int process_set=0, float prescale=1.0, "
        "float postscale=1.0) -> Tensor", _reducescatter_impl, _reducescatter_fake)
_define("neighbor_allreduce(Tensor tensor, float self_weight, int[] recv_ranks, "
        "float[] recv_weights, int[] send_ranks, float[] send_weights, bool uniform, bool topo_check, "
        "str name) "
        "-> Tensor", _neighbor_impl, lambda tensor, *args: torch.empty_like(tensor), _core.native_kernel_neighbor_allreduce)


# ---- The eager fast path ----
# A plain CPU tensor that autograd need not record skips the torch.library dispatch and
# argument rebuilding, which cost several times the exchange itself for a small tensor:
# allgather hands it to the numpy entry point as a numpy view of its memory; allreduce,
# broadcast and neighbor_allreduce go to one C function each. The same op layer and error messages;
# anything else, and everything traced by torch.compile, takes the registered ops.
_NUMPY_DTYPES = {torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16, torch.int32,
                 torch.int64, torch.bool}
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _plain(t, dtypes):
    """`t`'s numpy view if a blocking op can take the numpy entry, else None."""
    if type(t) not in _PLAIN_TYPES or t.dtype not in dtypes or not t.is_cpu or t.layout is not torch.strided \
            or _adapter._FAKE or torch.compiler.is_compiling() or t.is_neg() or t.is_conj():
        return None  # (a lazily negated or conjugated tensor's memory holds other values)
    if t.requires_grad:
        if torch.is_grad_enabled():
            return None
        t = t.detach()
    return t.numpy()


def _substitute(entry, traced):
    torch.compiler.substitute_in_graph(entry, skip_signature_check=True)(traced)


class _WhenDynamoLoads(importlib.abc.MetaPathFinder):
    """Registers the C entry points' substitutions for torch.compile once `torch._dynamo`
    is imported (torch.compile imports it), not at `import shoal.torch`: importing dynamo
    costs about 2 s of CPU in every process that never compiles. One finder, in
    sys.meta_path until dynamo's module has run, holds the (entry, traced) pairs waiting;
    a spec only asked for (importlib.util.find_spec) changes nothing."""

    def __init__(self):
        self.pending = []

    @classmethod
    def substitute(cls, entry, traced):
        if "torch._dynamo" in sys.modules:
            return _substitute(entry, traced)
        finder = next((f for f in sys.meta_path if isinstance(f, cls)), None)
        if finder is None:
            finder = cls()
            sys.meta_path.insert(0, finder)
        finder.pending.append((entry, traced))

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch._dynamo":
            return None
        # The spec of whichever finder comes next (any kind of install), its loader wrapped.
        spec = next(filter(None, (f.find_spec(fullname, path, target) for f in sys.meta_path
                                  if f is not self and hasattr(f, "find_spec"))), None)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenSubstitute(spec.loader, self)
        return spec

    def loaded(self):
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        while self.pending:
            _substitute(*self.pending.pop(0))


class _ThenSubstitute(importlib.abc.Loader):
    """`loader` (which may serve other modules too, so it is wrapped, not changed), then
    the waiting substitutions once the module has run."""

    def __init__(self, loader, finder):
        self.loader, self.finder = loader, finder

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.finder.loaded()

    def __getattr__(self, name):  # get_source, get_resource_reader, ...
        return getattr(self.loader, name)


def native(fallback, make, traced=None):
    """A torch entry point as the C function `make(fallback, doc, module, torch=...)`: plain
    tensors go to the core in one call, anything else to `fallback`. torch.compile traces
    `traced` (default: `fallback`) in its place (dynamo cannot look into a C function).
    Where `traced`'s signature is not one a C function can show, a Python function with
    that signature calls it. Without torch.compile's substitution, or for the fake device
    (tests), `fallback` itself."""
    traced = traced or fallback
    if _adapter._FAKE or not hasattr(torch.compiler, "substitute_in_graph"):  # torch < 2.5
        return fallback
    doc = f"{traced.__name__}{inspect.signature(traced)}\n--\n\n{traced.__doc__}"
    entry = make(fallback, doc, ADAPTER.module, torch=ADAPTER.torch_api)
    _WhenDynamoLoads.substitute(entry, traced)
    try:
        if inspect.signature(entry) == inspect.signature(traced):
            return entry
    except ValueError:  # defaults a text signature cannot hold (Horovod's Compression.none)
        pass

    @functools.wraps(traced)
    def call(*args, **kwargs):
        return entry(*args, **kwargs)
    return call


def _entry(op):
    """Decorates the torch entry point `fn` of `op` as `shoal._ops._told(op)(fn)`; traced
    code runs `fn` (nothing to tell at trace time)."""
    def wrap(fn):
        told = _ops._told(op)(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if torch.compiler.is_compiling():
                return fn(*args, **kwargs)
            return told(*args, **kwargs)
        return call
    return wrap


def _native(op, make):
    """Decorates the torch entry point `fn` of `op` as `native(...)` whose fallback is
    `_entry(op)(fn)`."""
    def wrap(fn):
        return native(_entry(op)(fn), make, traced=fn)
    return wrap


def _told(op, numpy_fn, dtypes):
    """The torch entry point of `op`: plain tensors take `numpy_fn` (the numpy entry point
    of the same name and signature), the others `shoal._ops._told(op)(fn)`, whose checks
    run before the op layer's (so a refusal here reaches the peers too); traced code calls
    `fn` directly (nothing to tell at trace time)."""
    def wrap(fn):
        told = _ops._told(op)(fn)

        @functools.wraps(fn)
        def call(tensor, *args, **kwargs):
            a = _plain(tensor, dtypes)
            if a is not None:
                return torch.from_numpy(numpy_fn(a, *args, **kwargs))
            if torch.compiler.is_compiling():
                return fn(tensor, *args, **kwargs)
            return told(tensor, *args, **kwargs)
        return call
    return wrap


def make_allreduce(fallback, doc, module, torch):
    """The C allreduce entry (for `native`)."""
    return _core.native_allreduce(fallback, doc, module, ops=_ops.REDUCE_OP_CODES, torch=torch)


@_native(_ops.ALLREDUCE, make_allreduce)
def allreduce(tensor, average=None, is_hierarchical_local=False, name=None, op=None, process_set=None, *,
              prescale_factor=1.0, postscale_factor=1.0):
    """Blocking allreduce of a torch tensor; semantics as `shoal.allreduce` (sum, sum then
    divide by size(), min, max or product; BlueFog's `average=` or Horovod's `op=`; over
    the members of `process_set`, a `shoal.ProcessSet`, if given), with Horovod's
    prescale/postscale factors and truncated integer average (shoal._horovod.scaling).
    Differentiable (shoal/_gradients.py; the backward op runs in the same set); op=Product
    with is_hierarchical_local has no gradient (NotImplementedError at backward)."""
    ADAPTER._check(tensor, "allreduce")
    rop = _ops.reduce_op(average, op)
    pre = _horovod.factor(prescale_factor, "prescale_factor")
    post = _horovod.factor(postscale_factor, "postscale_factor")
    return torch.ops.shoal.allreduce(tensor, rop.code, bool(is_hierarchical_local), _ops.op_name(name),
                                     process_sets.id_of(process_set, "allreduce"), pre, post)


def make_broadcast(fallback, doc, module, torch):
    """The C broadcast entry (for `native`)."""
    return _core.native_broadcast(fallback, doc, module, torch=torch)


@_native(_ops.BROADCAST, make_broadcast)
def broadcast(tensor, root_rank, name=None, process_set=None):
    """Blocking broadcast of `root_rank`'s tensor; semantics as `shoal.broadcast` (in
    `process_set` if given: root_rank is a world rank of the set). Differentiable, as
    Horovod's: the root's gradient is the average of the ranks' gradients (over the set),
    the others' zero (shoal/_gradients.py)."""
    ADAPTER._check(tensor, "broadcast")
    # Typed here: the registered op's int argument would take a bool, and refuse an int
    # beyond int64 with a RuntimeError the peers never hear of; the op checks the range.
    root_rank = _ops.root_int(root_rank)
    if not 0 <= root_rank < 2**31:
        _ops.root(root_rank)  # ValueError: outside [0, size())
    return torch.ops.shoal.broadcast(tensor, root_rank, _ops.op_name(name), process_sets.id_of(process_set, "broadcast"))


@_told(_ops.ALLGATHER, _numpy_api.allgather, _NUMPY_DTYPES)
def allgather(tensor, name=None, process_set=None):
    """Blocking allgather along dim 0 (first dims may differ); as `shoal.allgather` (of
    `process_set`'s members if given). Differentiable, as Horovod's: the gradient is this
    rank's rows of the average of the ranks' gradients (over the set; shoal/_gradients.py)."""
    ADAPTER._check(tensor, "allgather")
    return torch.ops.shoal.allgather(tensor, _ops.op_name(name), process_sets.id_of(process_set, "allgather"))


@_entry(_ops.REDUCESCATTER)
def reducescatter(tensor, op=None, name=None, process_set=None, *, prescale_factor=1.0, postscale_factor=1.0):
    """Blocking reducescatter along dim 0 (op Average or Sum); as `shoal.reducescatter`
    (over `process_set`'s members if given), with Horovod's prescale/postscale factors and
    truncated integer average (shoal._horovod.scaling). Differentiable, as Horovod's: the
    gradient is the allgather of the gradients, times the number of ranks for Sum
    (shoal/_gradients.py), times the factors."""
    ADAPTER._check(tensor, "reducescatter")
    rop = _ops.Average if op is None else _ops.reduce_op(None, op)
    pre = _horovod.factor(prescale_factor, "prescale_factor")
    post = _horovod.factor(postscale_factor, "postscale_factor")
    return torch.ops.shoal.reducescatter(tensor, rop.code, _ops.op_name(name),
                                         process_sets.id_of(process_set, "reducescatter"), pre, post)


@_native(_ops.NEIGHBOR_ALLREDUCE, _core.native_neighbor_allreduce)
def neighbor_allreduce(tensor, self_weight=None, src_weights=None, dst_weights=None,
                       enable_topo_check=True, name=None):
    """Blocking neighbor averaging step; semantics as `shoal.neighbor_allreduce`
    (BlueFog's static and dynamic modes)."""
    ADAPTER._check(tensor, "neighbor_allreduce")
    # Not remembered: torch.compile would guard on the cache's contents.
    a = _ops.neighbor_args(self_weight, src_weights, dst_weights, enable_topo_check, remember=False)
    return torch.ops.shoal.neighbor_allreduce(
        tensor, a["self_weight"], a["recv_ranks"], a["recv_weights"], a["send_ranks"],
        a["send_weights"], a["uniform"], a["topo_check"], _ops.op_name(name))


# ---- Autograd (the blocking ops are differentiable; the nonblocking forms are not) ----
# The formulas are shoal/_gradients.py's; here they run as the registered torch ops.
def _process_set(inputs, at):
    return inputs[at] if len(inputs) > at else 0


def _factors(inputs, at):
    """(prescale, postscale) from a registered op's inputs (left out when both are 1.0)."""
    return tuple(inputs[i] if len(inputs) > i else 1.0 for i in (at, at + 1))


def _allreduce_setup(ctx, inputs, output):
    ctx.reduce_op, ctx.local, ctx.name = inputs[1], inputs[2], inputs[3]
    ctx.process_set = _process_set(inputs, 4)
    ctx.pre, ctx.post = _factors(inputs, 5)
    if ctx.reduce_op in (_ops.Min.code, _ops.Max.code, _ops.Product.code):
        ctx.save_for_backward(inputs[0])


def _allreduce_backward(ctx, grad):
    grad, name, ps, pre, post = grad.contiguous(), grad_name(ctx.name), ctx.process_set, ctx.pre, ctx.post
    rop = _gradients.reduce_op_grad(ctx.reduce_op)
    if ctx.reduce_op in (_ops.Sum.code, _ops.Average.code):
        # y_q = post_q * R(pre_r * x_r over r): this rank's gradient is pre * R(post_q * g_q),
        # the same allreduce with the factors swapped (Horovod's, when ranks share factors).
        g = torch.ops.shoal.allreduce(grad, rop, ctx.local, name, ps, post, pre)
        return g, None, None, None, None, None, None

    def allreduce_sum(t, suffix):
        return torch.ops.shoal.allreduce(t.contiguous(), rop, ctx.local, name + suffix if name else "", ps)

    # Min/Max/Product: the derivative of the op at the scaled input pre * x, times pre.
    x, = ctx.saved_tensors
    x, grad = (x * pre if pre != 1.0 else x), (grad * post if post != 1.0 else grad)
    if ctx.reduce_op in (_ops.Min.code, _ops.Max.code):
        # Who holds the extremum of the scaled inputs: reduced again, as the forward's output
        # is postscaled (its rounding depends on the path) and factors may differ by rank, so
        # every rank runs this whatever its own factors.
        y = torch.ops.shoal.allreduce(x.contiguous(), ctx.reduce_op, ctx.local, name + ".extremum" if name else "", ps)
        g = _gradients.extremum_grad(x, y, grad, allreduce_sum, lambda a, b, like: (a == b).to(like.dtype))
    else:
        if ctx.local:
            raise NotImplementedError("allreduce: the gradient of op=Product with is_hierarchical_local=True is "
                                      "not implemented (it needs a machine-local allgather)")

        def others_product(t, suffix):
            every = torch.ops.shoal.allgather(t.contiguous().unsqueeze(0), name + suffix if name else "", ps)
            r = process_sets.layout(ps)[1]
            return torch.cat([every[:r], every[r + 1:]]).prod(0)
        g = _gradients.product_grad(x, grad, allreduce_sum, others_product)
    return (g * pre if pre != 1.0 else g), None, None, None, None, None, None


def _broadcast_setup(ctx, inputs, output):
    ctx.root, ctx.name, ctx.process_set = inputs[1], inputs[2], _process_set(inputs, 3)


def _broadcast_backward(ctx, grad):
    total = torch.ops.shoal.allreduce(grad.contiguous(), _gradients.GATHER_GRAD_OP, False, grad_name(ctx.name),
                                      ctx.process_set)
    return (total if _gradients.broadcast_keeps(ctx.root, _ops.WORLD) else torch.zeros_like(total)), None, None, None


def _allgather_setup(ctx, inputs, output):
    ctx.rows, ctx.name, ctx.process_set = inputs[0].shape[0], inputs[1], _process_set(inputs, 2)


def _allgather_backward(ctx, grad):
    ps = ctx.process_set
    total = torch.ops.shoal.allreduce(grad.contiguous(), _gradients.GATHER_GRAD_OP, False, grad_name(ctx.name), ps)
    rows = torch.ops.shoal.allgather(torch.tensor([ctx.rows], dtype=torch.int64),
                                     grad_name(ctx.name) + ".rows" if ctx.name else "", ps)
    start = int(_gradients.allgather_start(rows, torch.sum, process_sets.layout(ps)[1]))
    return total[start:start + ctx.rows], None, None


def _reducescatter_setup(ctx, inputs, output):
    ctx.reduce_op, ctx.name, ctx.process_set = inputs[1], inputs[2], _process_set(inputs, 3)
    ctx.pre, ctx.post = _factors(inputs, 4)


def _reducescatter_backward(ctx, grad):
    # With Horovod's factors, y = post * RS(pre * x): the gathered gradients are each
    # rank's times its postscale, and this rank's times its prescale.
    grad = grad * ctx.post if ctx.post != 1.0 else grad
    g = torch.ops.shoal.allgather(grad.contiguous(), grad_name(ctx.name), ctx.process_set)
    g = _gradients.reducescatter_grad(g, ctx.reduce_op, process_sets.layout(ctx.process_set)[0])
    return (g * ctx.pre if ctx.pre != 1.0 else g), None, None, None, None, None


def _neighbor_setup(ctx, inputs, output):
    (_, ctx.self_weight, ctx.recv, ctx.recv_w, ctx.send, ctx.send_w, ctx.uniform, _, ctx.name) = inputs


def _neighbor_backward(ctx, grad):
    p = _gradients.neighbor_peers(ctx.self_weight, ctx.recv, ctx.recv_w, ctx.send, ctx.send_w, ctx.uniform)
    g = torch.ops.shoal.neighbor_allreduce(grad.contiguous(), p["self_weight"], p["recv_ranks"], p["recv_weights"],
                                           p["send_ranks"], p["send_weights"], False, False, grad_name(ctx.name))
    return (g,) + (None,) * 8


if hasattr(torch.library, "register_autograd"):  # torch >= 2.4
    torch.library.register_autograd("shoal::allreduce", _allreduce_backward, setup_context=_allreduce_setup)
    torch.library.register_autograd("shoal::broadcast", _broadcast_backward, setup_context=_broadcast_setup)
    torch.library.register_autograd("shoal::allgather", _allgather_backward, setup_context=_allgather_setup)
    torch.library.register_autograd("shoal::reducescatter", _reducescatter_backward,
                                    setup_context=_reducescatter_setup)
    torch.library.register_autograd("shoal::neighbor_allreduce", _neighbor_backward,
                                    setup_context=_neighbor_setup)
