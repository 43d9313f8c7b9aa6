// An op's description (shoal_op_desc) checked at the call and turned into an Entry: its
// process set, signature, peers, weights and splits. Errors are ArgumentErrors, raised in
// the caller's thread before anything is queued.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "runtime/runtime.h"

namespace shoal {
namespace {

// `op` and `which` ("receive"/"send") name the list in errors. Runs for every op: no
// allocation beyond the result unless the list is long.
std::vector<int> CheckPeers(const char* op, const char* which, const int32_t* ranks, int n, int self, int size) {
  auto what = [&] { return std::string(op) + " " + which + " ranks"; };
  if (n < 0 || (n > 0 && !ranks)) Bad(what() + ": missing rank list");
  std::vector<int> out(ranks, ranks + n);
  for (int r : out) {
    if (r < 0 || r >= size) Bad(what() + ": rank " + std::to_string(r) + " is outside [0, " + std::to_string(size) + ")");
    if (r == self) Bad(what() + ": rank " + std::to_string(r) + " is this rank itself");
  }
  auto twice = [&](int r) { Bad(what() + ": rank " + std::to_string(r) + " appears twice"); };
  if (n <= 16) {
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < i; ++j)
        if (out[i] == out[j]) twice(out[i]);
  } else {
    std::vector<int> sorted = out;
    std::sort(sorted.begin(), sorted.end());
    auto dup = std::adjacent_find(sorted.begin(), sorted.end());
    if (dup != sorted.end()) twice(*dup);
  }
  return out;
}

// Horovod's alltoall splits: rows of dim 0 per destination rank, or dim 0 / size each.
std::vector<int64_t> CheckSplits(const shoal_op_desc& d, const std::vector<int64_t>& shape, int size) {
  if (shape.empty()) Bad("alltoall: a 0-d tensor has no first dimension to split");
  const int64_t d0 = shape[0];
  if (d.n_splits == 0) {
    if (d0 % size != 0)
      Bad("alltoall: dim 0 (" + std::to_string(d0) + ") is not divisible by the number of ranks (" +
          std::to_string(size) + "); pass splits");
    return std::vector<int64_t>(size, d0 / size);
  }
  if (d.n_splits != size || !d.splits)
    Bad("alltoall: " + std::to_string(d.n_splits) + " splits for " + std::to_string(size) +
        " ranks; give one per rank");
  std::vector<int64_t> out(d.splits, d.splits + size);
  int64_t sum = 0;
  for (int q = 0; q < size; ++q) {
    if (out[q] < 0 || out[q] > d0)
      Bad("alltoall: splits[" + std::to_string(q) + "] = " + std::to_string(out[q]) + " is outside [0, dim 0 = " +
          std::to_string(d0) + "]");
    sum += out[q];
  }
  if (sum != d0)
    Bad("alltoall: splits sum to " + std::to_string(sum) + " rows, but dim 0 is " + std::to_string(d0));
  return out;
}

// Horovod's scaling factors, kept on the entry (1.0 each when not asked for).
void Scaling(const shoal_op_desc& d, Entry* e) {
  if (!d.horovod_scaling) return;
  e->horovod_scaling = true;
  e->prescale = d.prescale_factor;
  e->postscale = d.postscale_factor;
}

}  // namespace

ProcessSetPtr Runtime::CallSet(const shoal_op_desc& d, const char* what) {
  if (d.process_set == 0) return nullptr;
  const char* op = what ? what : OpName(d.op);
  if (d.op == SHOAL_OP_NEIGHBOR_ALLREDUCE || d.op == SHOAL_OP_NEIGHBOR_ALLGATHER ||
      d.op == SHOAL_OP_HIERARCHICAL_NEIGHBOR_ALLREDUCE || d.op == kOpJoin)
    Bad(std::string(op) + ": process sets apply to collectives (allreduce, broadcast, allgather, reducescatter, "
                          "alltoall, barrier); " + (d.op == kOpJoin ? "join is global" : "neighbor ops run over the topology"));
  ProcessSetPtr pset = FindSet(d.process_set);
  if (!pset) Bad(std::string(op) + ": no process set has id " + std::to_string(d.process_set) + " (never added, or removed)");
  if (pset->index < 0)
    Bad(std::string(op) + ": rank " + std::to_string(world().rank) + " is not a member of " + pset->Describe());
  if (d.scope != SHOAL_SCOPE_WORLD)
    Bad(std::string(op) + ": machine scope (is_hierarchical_local) cannot be combined with a process set");
  return pset;
}

EntryPtr Runtime::Describe(const shoal_op_desc& d, const ProcessSetPtr& pset) {
  const WorldInfo& w = world();
  auto e = std::make_shared<Entry>();
  const char* op = OpName(d.op);
  if (pset) {
    e->set = pset->id;
    e->pset = pset;
  }
  e->sig.op = d.op;
  if (d.op != SHOAL_OP_BARRIER && d.op != kOpJoin) {
    DtypeSize(d.input.dtype);  // throws for an unknown dtype
    if (d.input.ndim < 0 || d.input.ndim > 32 || (d.input.ndim > 0 && !d.input.shape)) Bad(std::string(op) + ": bad shape");
    e->sig.dtype = d.input.dtype;
    e->sig.shape.assign(d.input.shape, d.input.shape + d.input.ndim);
    for (auto s : e->sig.shape) if (s < 0) Bad(std::string(op) + ": negative dimension in " + ShapeString(e->sig.shape));
    e->sig.device_type = d.input.device_type;
    if (d.input.device_type != SHOAL_DEVICE_CPU && d.input.device_type != SHOAL_DEVICE_CUDA)
      Bad(std::string(op) + ": unknown device type " + std::to_string(d.input.device_type));
    if (!d.input.data && e->nbytes() > 0) Bad(std::string(op) + ": null data pointer");
    if (e->count() > INT32_MAX) Bad(std::string(op) + ": tensors of more than 2^31-1 elements are not supported");
    e->input = {d.input.data, d.input.device_type, d.input.device_id, d.input.stream, d.input.ready_event};
    e->output = e->input;
    if (d.output.data) e->output.data = d.output.data;
  }
  const std::string dt = DtypeName(e->sig.dtype);
  if (d.op == SHOAL_OP_ALLREDUCE || d.op == SHOAL_OP_BROADCAST) {
    if (d.scope != SHOAL_SCOPE_WORLD && d.scope != SHOAL_SCOPE_MACHINE) Bad(std::string(op) + ": unknown scope");
    e->sig.scope = d.scope;
  }
  const int scope_size = e->sig.scope == SHOAL_SCOPE_MACHINE ? w.local_size : w.size;
  switch (d.op) {
    case SHOAL_OP_ALLREDUCE:
      if (d.reduce_op < SHOAL_REDUCE_SUM || d.reduce_op > SHOAL_REDUCE_PRODUCT)
        Bad("allreduce: unknown reduce op code " + std::to_string(d.reduce_op));
      if (d.input.dtype == SHOAL_BOOL)
        Bad(std::string("allreduce: bool tensors cannot be reduced (op=") + ReduceOpName(d.reduce_op) +
            "); use an integer dtype");
      if (d.reduce_op == SHOAL_REDUCE_AVERAGE && !IsFloating(d.input.dtype) && !d.horovod_scaling)
        Bad("allreduce: average of " + dt + " is not representable; use op=Sum or a floating dtype");
      Scaling(d, e.get());
      e->sig.reduce_op = d.reduce_op;
      break;
    case SHOAL_OP_BROADCAST:
      if (d.root_rank < 0 || d.root_rank >= scope_size)
        Bad("broadcast: root rank " + std::to_string(d.root_rank) + " is outside [0, " + std::to_string(scope_size) + ")");
      if (pset && !pset->Has(d.root_rank))  // Horovod's root: a world rank, in the set
        Bad("broadcast: root rank " + std::to_string(d.root_rank) + " is not in " + pset->Describe());
      e->sig.root_rank = d.root_rank;
      break;
    case SHOAL_OP_ALLGATHER:
      if (e->sig.shape.empty()) Bad("allgather: a 0-d tensor has no first dimension to concatenate along");
      break;
    case SHOAL_OP_REDUCESCATTER:
      if (e->sig.shape.empty()) Bad("reducescatter: a 0-d tensor has no first dimension to split");
      if (d.reduce_op != SHOAL_REDUCE_SUM && d.reduce_op != SHOAL_REDUCE_AVERAGE)
        Bad(std::string("reducescatter: op=") + ReduceOpName(d.reduce_op) + " is not supported; use Sum or Average");
      if (d.input.dtype == SHOAL_BOOL) Bad("reducescatter: bool tensors cannot be summed");
      if (d.reduce_op == SHOAL_REDUCE_AVERAGE && !IsFloating(d.input.dtype) && !d.horovod_scaling)
        Bad("reducescatter: average of " + dt + " is not representable; use op=Sum or a floating dtype");
      Scaling(d, e.get());
      e->sig.reduce_op = d.reduce_op;
      break;
    case SHOAL_OP_ALLTOALL:
      e->splits = CheckSplits(d, e->sig.shape, pset ? pset->size() : w.size);
      break;
    case SHOAL_OP_HIERARCHICAL_NEIGHBOR_ALLREDUCE:
    case SHOAL_OP_NEIGHBOR_ALLGATHER:
    case SHOAL_OP_NEIGHBOR_ALLREDUCE: {
      const bool machines = d.op == SHOAL_OP_HIERARCHICAL_NEIGHBOR_ALLREDUCE;
      if (d.op != SHOAL_OP_NEIGHBOR_ALLGATHER && !IsFloating(d.input.dtype))
        Bad(std::string(op) + ": weighted averaging needs a floating dtype, got " + dt);
      if (d.op == SHOAL_OP_NEIGHBOR_ALLGATHER && e->sig.shape.empty())
        Bad("neighbor_allgather: a 0-d tensor has no first dimension to concatenate along");
      if (machines && !w.homogeneous)
        Bad(std::string(op) + ": needs the same number of ranks on every machine, placed contiguously "
            "(see SHOAL_RANKS_PER_MACHINE)");
      const int self = machines ? w.machine_rank : w.rank, nodes = machines ? w.machine_size : w.size;
      e->recv_ranks = CheckPeers(op, machines ? "receive machine" : "receive", d.recv_ranks, d.n_recv, self, nodes);
      e->send_ranks = CheckPeers(op, machines ? "send machine" : "send", d.send_ranks, d.n_send, self, nodes);
      e->topo_check = d.topo_check != 0;
      e->uniform = d.uniform != 0;
      e->self_weight = d.self_weight;
      if (!e->uniform) {
        if (d.n_recv > 0 && !d.recv_weights) Bad("neighbor_allreduce: weights missing");
        e->recv_weights.assign(d.recv_weights, d.recv_weights + d.n_recv);
      }
      if (d.send_weights) e->send_weights.assign(d.send_weights, d.send_weights + d.n_send);
      break;
    }
  }
  return e;
}

}  // namespace shoal
