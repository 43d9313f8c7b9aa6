"""The public op functions, built once per binding from its tensor adapter.

`shoal` (numpy / buffer protocol) and `shoal.torch` expose the same names with the same
semantics (BlueFog's, docs/reference/bluefog-semantics.md §1.4–1.5, plus Horovod's `op=`).
"""
import inspect

from . import _grouped, _hierarchical, _ops
from ._loader import _core


def _scope(is_hierarchical_local):
    return _ops.MACHINE if is_hierarchical_local else _ops.WORLD


_BLOCKING = ("allreduce", "allreduce_", "broadcast", "broadcast_", "neighbor_allreduce")


def build_api(adapter):
    """Return {name: function} of the collective API over `adapter`'s tensor type."""

    def allreduce_nonblocking(tensor, average=None, is_hierarchical_local=False, name=None, op=None,
                              process_set=None):
        """Start an allreduce; returns a handle for `synchronize`/`poll`/`wait`.

        Args:
            tensor: any shape (0-d and empty included); dtypes float16, bfloat16,
                float32, float64, int8, uint8, int16, int32, int64. Not modified.
            average: BlueFog's flag (default True); `op=shoal.Sum`/`shoal.Average` is
                Horovod's spelling of the same choice.
            is_hierarchical_local: reduce over the ranks of this machine only (divide by
                local_size() when averaging).
            name: negotiation key; all ranks use the same name for the same op.
                Omitted: "allreduce.noname.<k>" (ranks must then issue ops in one order).
            op: shoal.Sum, Average, Min, Max or Product (Horovod's hvd.Sum, ...).
            process_set: a `shoal.ProcessSet` (Horovod's): only its members call it, and
                the reduction is over them (Average divides by its size); names are
                scoped per set. Default: every rank.
        Result: element-wise over the ranks: the sum, or the sum then divided by size()
            (exact when representable), or the minimum, maximum or product (Horovod's
            semantics: MPI_MIN/MAX/PROD, ncclMin/Max/Prod). Half types compute in float32
            and round once; integer sums and products wrap (two's complement). Same shape
            and dtype.
        Raises:
            ValueError: average of an integer tensor, average= with Min/Max/Product, bool
                tensors, a second in-flight op with the same name, a rank outside
                `process_set` or a set not added (or removed). NotImplementedError:
                Horovod's Adasum. TypeError: average= not a bool (e.g. a string).
                ShoalError (at synchronize): ranks disagree on shape, dtype or op (the
                same error on every rank).
        """
        return _ops.allreduce(adapter, tensor, average, name, op, scope=_scope(is_hierarchical_local),
                              process_set=process_set)

    def allreduce_nonblocking_(tensor, average=None, is_hierarchical_local=False, name=None, op=None,
                               process_set=None):
        """In-place `allreduce_nonblocking`: the result overwrites `tensor` (contiguous)."""
        return _ops.allreduce(adapter, tensor, average, name, op, inplace=True,
                              scope=_scope(is_hierarchical_local), process_set=process_set)

    def allreduce(tensor, average=None, is_hierarchical_local=False, name=None, op=None, process_set=None):
        """Blocking allreduce: `synchronize(allreduce_nonblocking(...))`; see there."""
        return _ops.allreduce(adapter, tensor, average, name, op, scope=_scope(is_hierarchical_local),
                              block=True, process_set=process_set)

    def allreduce_(tensor, average=None, is_hierarchical_local=False, name=None, op=None, process_set=None):
        """Blocking in-place allreduce; returns `tensor`."""
        return _ops.allreduce(adapter, tensor, average, name, op, inplace=True,
                              scope=_scope(is_hierarchical_local), block=True, process_set=process_set)

    def broadcast_nonblocking(tensor, root_rank, name=None, process_set=None):
        """Start a broadcast of `root_rank`'s tensor (any dtype incl. bool, any shape);
        every rank gets a copy of the same shape and dtype. `process_set` (a
        `shoal.ProcessSet`): only its members call it; `root_rank` is still a world rank,
        one of the set's (Horovod's rule).

        Raises ValueError for a root outside [0, size()) or outside the set, a rank outside
        the set; ShoalError (at synchronize) when ranks disagree on shape, dtype or root.
        """
        return _ops.broadcast(adapter, tensor, root_rank, name, process_set=process_set)

    def broadcast_nonblocking_(tensor, root_rank, name=None, process_set=None):
        """In-place `broadcast_nonblocking`: `tensor` is overwritten on non-root ranks."""
        return _ops.broadcast(adapter, tensor, root_rank, name, inplace=True, process_set=process_set)

    def broadcast(tensor, root_rank, name=None, process_set=None):
        """Blocking broadcast; see `broadcast_nonblocking`."""
        return _ops.broadcast(adapter, tensor, root_rank, name, block=True, process_set=process_set)

    def broadcast_(tensor, root_rank, name=None, process_set=None):
        """Blocking in-place broadcast; returns `tensor`."""
        return _ops.broadcast(adapter, tensor, root_rank, name, inplace=True, block=True, process_set=process_set)

    def allgather_nonblocking(tensor, name=None, process_set=None):
        """Start an allgather: concatenation of every rank's tensor along dim 0, in rank
        order. Shapes [n_r, *rest]: n_r may differ per rank, `rest` and dtype must match
        (ShoalError otherwise). 0-d tensors raise ValueError. Any dtype incl. bool.
        `process_set` (a `shoal.ProcessSet`): its members' tensors, in their rank order."""
        return _ops.allgather(adapter, tensor, name, process_set=process_set)

    def allgather(tensor, name=None, process_set=None):
        """Blocking allgather; see `allgather_nonblocking`."""
        return _ops.synchronize(allgather_nonblocking(tensor, name, process_set))

    def reducescatter_nonblocking(tensor, op=None, name=None, process_set=None):
        """Start a reducescatter; returns a handle for `synchronize`/`poll`/`wait`.

        Semantics: Horovod's `reducescatter`. Every rank passes a tensor of the same shape
        [d0, *rest] and dtype (float16, bfloat16, float32, float64, int8, uint8, int16,
        int32, int64; not modified); they are reduced element-wise, op=shoal.Average
        (default: the sum divided by size()) or shoal.Sum, and the result is split along
        dim 0 in rank order: rank r gets rows [start_r, start_r + n_r) with
        n_r = d0 // size() plus one for the first d0 % size() ranks, as a new
        [n_r, *rest] tensor of the input's dtype (n_r may be 0). Half types compute in
        float32 and round once; integer sums wrap. `process_set` (a `shoal.ProcessSet`):
        over its members (size() and r: the set's size and `ProcessSet.rank()`).
        Raises:
            ValueError: a 0-d tensor, op other than Sum/Average, Average of an integer
                tensor, bool tensors. ShoalError (at synchronize): ranks disagree on shape,
                dtype or op (the same error on every rank).
        """
        return _ops.reducescatter(adapter, tensor, op, name, process_set=process_set)

    def reducescatter(tensor, op=None, name=None, process_set=None):
        """Blocking reducescatter: `synchronize(reducescatter_nonblocking(...))`; see there."""
        return _ops.synchronize(reducescatter_nonblocking(tensor, op, name, process_set))

    def alltoall_nonblocking(tensor, splits=None, name=None, process_set=None):
        """Start an alltoall; returns a handle whose `synchronize` gives (output,
        received_splits).

        Semantics: Horovod's `alltoall`. Rank r sends rows [o_q, o_q + splits[q]) of its
        tensor's dim 0 to rank q (o_q = splits[0] + ... + splits[q-1]); without `splits`,
        dim 0 is divided evenly by size(). In a `process_set` (a ProcessSet: its members
        only call it), ranks, splits and the order are the set's (ascending world ranks).
        `output` is the rows every rank sent to this
        rank, concatenated along dim 0 in rank order (shape [Σ received, *rest], the
        input's dtype; dims after the first and the dtype must agree across ranks, dim 0
        may differ); `received_splits` (int32, one per rank) says how many rows came from
        each. Any dtype incl. bool; the input is not modified.
        Args:
            splits: None, or size() non-negative ints summing to dim 0 (a list, numpy array
                or tensor).
        Raises:
            ValueError: a 0-d tensor, splits of another length or sum, negative splits, dim 0
                not divisible by size() without splits (the same error on the ranks that
                submit the call). TypeError: non-integer splits. ShoalError (at synchronize):
                ranks disagree on dtype or on the dims after the first, a rank joined.
        """
        return _ops.alltoall(adapter, tensor, splits, name, process_set)

    def alltoall(tensor, splits=None, name=None, process_set=None):
        """Blocking alltoall (Horovod's return convention): the received tensor, or
        (tensor, received_splits) when `splits` is given; see `alltoall_nonblocking`."""
        out, received = _ops.synchronize(alltoall_nonblocking(tensor, splits, name, process_set))
        return out if splits is None else (out, received)

    def grouped_allreduce_nonblocking(tensors, average=None, name=None, op=None, is_hierarchical_local=False,
                                      process_set=None):
        """Start an allreduce of every tensor of the list `tensors` as one grouped op;
        returns one handle whose `synchronize` gives the list of results.

        Semantics: Horovod's `grouped_allreduce` (its argument order up to `op`): each tensor
        as `allreduce_nonblocking`
        (same reduce op and scope for all; dtypes and shapes may differ between members,
        not across ranks), negotiated as one unit under `name` (members "<name>[i]"): every
        member runs, consecutive members of one dtype fused into one collective, or every
        member fails with the same ShoalError on every rank (a member whose shape or
        dtype differs across ranks, another number of tensors). Raises ValueError /
        TypeError as allreduce for any member (the whole group is refused), and for a
        `tensors` that is not a non-empty list or tuple. `process_set`: as for allreduce.
        """
        return _grouped.grouped_allreduce(adapter, tensors, average, name, op, scope=_scope(is_hierarchical_local),
                                          process_set=process_set)

    def grouped_allreduce_nonblocking_(tensors, average=None, name=None, op=None, is_hierarchical_local=False,
                                       process_set=None):
        """In-place `grouped_allreduce_nonblocking`: each result overwrites its tensor
        (contiguous)."""
        return _grouped.grouped_allreduce(adapter, tensors, average, name, op, inplace=True,
                                          scope=_scope(is_hierarchical_local), process_set=process_set)

    def grouped_allreduce(tensors, average=None, name=None, op=None, is_hierarchical_local=False, process_set=None):
        """Blocking grouped allreduce: the list of results; see `grouped_allreduce_nonblocking`."""
        return _ops.synchronize(grouped_allreduce_nonblocking(tensors, average, name, op, is_hierarchical_local,
                                                              process_set))

    def grouped_allreduce_(tensors, average=None, name=None, op=None, is_hierarchical_local=False, process_set=None):
        """Blocking in-place grouped allreduce; returns the list `tensors`."""
        return _ops.synchronize(grouped_allreduce_nonblocking_(tensors, average, name, op, is_hierarchical_local,
                                                               process_set))

    def grouped_allgather_nonblocking(tensors, name=None, process_set=None):
        """Start an allgather of every tensor of the list as one grouped op (Horovod's
        `grouped_allgather`): each as `allgather_nonblocking`, all run or all fail with one
        error (see `grouped_allreduce_nonblocking`); `synchronize` gives the list."""
        return _grouped.grouped_allgather(adapter, tensors, name, process_set)

    def grouped_allgather(tensors, name=None, process_set=None):
        """Blocking grouped allgather; see `grouped_allgather_nonblocking`."""
        return _ops.synchronize(grouped_allgather_nonblocking(tensors, name, process_set))

    def grouped_reducescatter_nonblocking(tensors, op=None, name=None, process_set=None):
        """Start a reducescatter of every tensor of the list as one grouped op (Horovod's
        `grouped_reducescatter`): each as `reducescatter_nonblocking` (op Average or Sum
        for all), all run or all fail with one error; `synchronize` gives the list."""
        return _grouped.grouped_reducescatter(adapter, tensors, op, name, process_set)

    def grouped_reducescatter(tensors, op=None, name=None, process_set=None):
        """Blocking grouped reducescatter; see `grouped_reducescatter_nonblocking`."""
        return _ops.synchronize(grouped_reducescatter_nonblocking(tensors, op, name, process_set))

    def neighbor_allreduce_nonblocking(tensor, self_weight=None, src_weights=None,
                                       dst_weights=None, enable_topo_check=True, name=None):
        """Start one neighbor-averaging (gossip) step; returns a handle.

        Static mode (dst_weights None), over the topology of `set_topology`:
            y_i = w_ii x_i + sum_{j in in-neighbors} w_ji x_j
            with the topology's weights if it was set with is_weighted=True, else uniform
            weights computed as (x_i + sum_j x_j) / (in_degree + 1) (sum then divide:
            exact). `self_weight` (float) with `src_weights` ({rank: weight}, ranks ⊆
            in-neighbors; missing in-neighbors weigh 0) overrides the weights.
        Dynamic mode (dst_weights {rank: weight} or [ranks]): send x_i·dst_weights[k] to
            each k, receive from the keys of src_weights; self_weight and src_weights are
            required.
        Given weights that are all 1/(n+1) (n sources, unscaled sends) are computed as the
            uniform sum then divide, as BlueFog does.
        Tensor: floating dtype (float16, bfloat16, float32, float64), same shape and dtype
            on every rank; the result has that shape and dtype.
        Semantics: BlueFog `neighbor_allreduce` (docs/reference/bluefog-semantics.md §1.5).
        `enable_topo_check` (dynamic mode): the send and receive ranks must pair up.
            Checked with every rank through the coordinator until a round in which every
            rank's own pattern had been checked before (a one-peer schedule's round log2(n));
            from then on the name's calls go straight to the neighbors, and the data
            headers check each send against its receiver's step (docs/design.md §18).
        Raises ValueError for bad weights/ranks; ShoalError (at synchronize) when ranks
        disagree on shape, dtype or op; NeighborPatternError when sends and receives do
        not pair up.
        """
        return _ops.neighbor_allreduce(adapter, tensor, self_weight, src_weights, dst_weights,
                                       enable_topo_check, name)

    def neighbor_allreduce(tensor, self_weight=None, src_weights=None, dst_weights=None,
                           enable_topo_check=True, name=None):
        """Blocking neighbor_allreduce; see `neighbor_allreduce_nonblocking`."""
        return _ops.neighbor_allreduce(adapter, tensor, self_weight, src_weights, dst_weights,
                                       enable_topo_check, name, block=True)

    def neighbor_allgather_nonblocking(tensor, src_ranks=None, dst_ranks=None,
                                       enable_topo_check=True, name=None):
        """Start a neighbor allgather; returns a handle.

        Result: the tensors of this rank's sources concatenated along dim 0 (self
        excluded). Static mode (both lists None): sources = `in_neighbor_ranks()` in
        ascending order, destinations = `out_neighbor_ranks()`. Dynamic mode: both lists
        given; the result follows `src_ranks` in the order given. First dimensions may
        differ per rank; trailing dims and dtype must match (ShoalError otherwise).
        `enable_topo_check` (dynamic mode): sends and receives must pair up, as for
        `neighbor_allreduce_nonblocking` (NeighborPatternError naming the edge otherwise).
        Any dtype incl. bool.
        Semantics: BlueFog `neighbor_allgather` (docs/reference/bluefog-semantics.md §1.4).
        """
        return _ops.neighbor_allgather(adapter, tensor, src_ranks, dst_ranks, enable_topo_check, name)

    def neighbor_allgather(tensor, src_ranks=None, dst_ranks=None, enable_topo_check=True, name=None):
        """Blocking neighbor_allgather; see `neighbor_allgather_nonblocking`."""
        return _ops.synchronize(neighbor_allgather_nonblocking(tensor, src_ranks, dst_ranks,
                                                               enable_topo_check, name))

    def hierarchical_neighbor_allreduce_nonblocking(tensor, self_weight=None, src_machine_weights=None,
                                                    dst_machine_weights=None, enable_topo_check=False,
                                                    name=None):
        """Start a hierarchical neighbor allreduce; returns a handle.

        Sum within each machine, one neighbor-averaging step between machines over the
        machine topology (`set_machine_topology`, static mode) or the given machine
        weights (dynamic mode: all three weight arguments), then share the result within
        the machine: y = (self_weight·S_self + Σ_m w_m·S_m) / local_size(), S = machine sums.
        The result is one per machine: the weights of the machine's local rank 0 are the
        ones used (BlueFog combines on each rank with that rank's own), so give every rank
        of a machine the same weights; others' are not checked against them. Floating
        dtypes. Needs a homogeneous job (ValueError otherwise); RuntimeError in static
        mode without a machine topology. One op of the core: its stages (machine
        sum, exchange between the machines' local rank 0, share within the machine) run
        as ops named "<name>.machine_sum", ".exchange", ".share"; a stage that fails on a
        rank fails the op on every rank waiting for it (ShoalError).
        Semantics: BlueFog `hierarchical_neighbor_allreduce` (§1.6).
        """
        return _hierarchical.hierarchical_neighbor_allreduce_nonblocking(
            adapter, tensor, self_weight, src_machine_weights, dst_machine_weights,
            enable_topo_check, name)

    def hierarchical_neighbor_allreduce(tensor, self_weight=None, src_machine_weights=None,
                                        dst_machine_weights=None, enable_topo_check=False, name=None):
        """Blocking hierarchical_neighbor_allreduce; see the nonblocking form."""
        return _ops.synchronize(hierarchical_neighbor_allreduce_nonblocking(
            tensor, self_weight, src_machine_weights, dst_machine_weights, enable_topo_check, name))

    def pair_gossip_nonblocking(tensor, target_rank, self_weight=None, pair_weight=None, name=None):
        """Start an exchange with one peer; both sides must name each other.

        Result: (x + x_peer) / 2 (sum then divide), or self_weight·x + pair_weight·x_peer.
        Floating dtypes. Semantics: BlueFog `pair_gossip`.
        """
        return _ops.pair_gossip(adapter, tensor, target_rank, self_weight, pair_weight, name)

    def pair_gossip(tensor, target_rank, self_weight=None, pair_weight=None, name=None):
        """Blocking pair_gossip; see `pair_gossip_nonblocking`."""
        return _ops.pair_gossip(adapter, tensor, target_rank, self_weight, pair_weight, name, block=True)

    api = {f.__name__: f for f in (
        neighbor_allgather, neighbor_allgather_nonblocking, hierarchical_neighbor_allreduce,
        hierarchical_neighbor_allreduce_nonblocking, pair_gossip, pair_gossip_nonblocking,
        allreduce, allreduce_, allreduce_nonblocking, allreduce_nonblocking_,
        broadcast, broadcast_, broadcast_nonblocking, broadcast_nonblocking_,
        allgather, allgather_nonblocking, reducescatter, reducescatter_nonblocking, neighbor_allreduce,
        neighbor_allreduce_nonblocking, alltoall, alltoall_nonblocking, grouped_allreduce, grouped_allreduce_,
        grouped_allreduce_nonblocking, grouped_allreduce_nonblocking_, grouped_allgather,
        grouped_allgather_nonblocking, grouped_reducescatter, grouped_reducescatter_nonblocking)}
    for f in api.values():  # error messages name the public function, not this factory
        f.__qualname__ = f.__name__
    # The names in adapter.native as one C function each (bindings/python/native_entry.cc):
    # plain tensors and arguments go to the core from C, anything else to the Python ones.
    for name in adapter.native:
        f = api[name]
        doc = f"{name}{inspect.signature(f)}\n--\n\n{f.__doc__}"
        kw = {"torch": adapter.torch_api, "nonblocking": name not in _BLOCKING}
        if name.startswith("allreduce"):
            api[name] = _core.native_allreduce(f, doc, adapter.module, _ops.REDUCE_OP_CODES,
                                               inplace=name.endswith("_"), **kw)
        elif name.startswith("broadcast"):
            api[name] = _core.native_broadcast(f, doc, adapter.module, inplace=name.endswith("_"), **kw)
        else:
            api[name] = _core.native_neighbor_allreduce(f, doc, adapter.module, **kw)
    api.update(synchronize=_ops.synchronize, wait=_ops.synchronize, poll=_ops.poll,
               barrier=_ops.barrier, join=_ops.join)
    return api
