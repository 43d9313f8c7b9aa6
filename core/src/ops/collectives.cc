// Collectives on host memory (and the device path's entry): one negotiated batch run on
// its group's engine; allreduce batches fused into one buffer.
#include "ops/collectives.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "common/reduce.h"
#include "gpu/device_path.h"
#include "ops/fusion.h"
#include "process_sets/process_sets.h"

namespace shoal {
std::vector<int64_t> GatherCounts(Entry& e, const std::vector<int64_t>& first_dims) {
  int64_t row = 1;
  for (size_t i = 1; i < e.sig.shape.size(); ++i) row *= e.sig.shape[i];
  std::vector<int64_t> counts;
  int64_t rows = 0;
  for (int64_t d : first_dims) {
    counts.push_back(d * row);
    rows += d;
  }
  e.result_shape = e.sig.shape;
  e.result_shape[0] = rows;
  e.result_nbytes = rows * row * DtypeSize(e.sig.dtype);
  e.result = std::malloc(std::max<size_t>(e.result_nbytes, 1));
  return counts;
}

std::vector<int64_t> ScatterCounts(Entry& e, int size, int rank) {
  // Horovod's split of dim 0: d0 / size rows each, one more for the first d0 % size ranks.
  const int64_t d0 = e.sig.shape[0], row = e.count() / std::max<int64_t>(d0, 1);
  std::vector<int64_t> counts(size);
  for (int q = 0; q < size; ++q) counts[q] = (d0 / size + (q < d0 % size ? 1 : 0)) * row;
  e.result_shape = e.sig.shape;
  e.result_shape[0] = d0 / size + (rank < d0 % size ? 1 : 0);
  e.result_nbytes = counts[rank] * DtypeSize(e.sig.dtype);
  e.result = std::malloc(std::max<size_t>(e.result_nbytes, 1));
  return counts;
}

GroupCollectives* CollectiveOps::Engine(int set) { return set == 0 ? backend_ : backend_->OfSet(set); }

void CollectiveOps::Run(const Response& r, std::vector<EntryPtr> batch) {
  const WorldInfo& w = backend_->world();
  const ProcessSet* pset = batch[0]->pset.get();
  ++stats_->global_collectives;
  const auto t0 = Clock::now();
  for (auto& e : batch) e->t_comm_start = t0;
  if (r.op != SHOAL_OP_BARRIER && batch[0]->gpu && batch[0]->gpu->nccl) return devices_->Run(r, batch);
  // The engine of its group: every rank's, or its process set's.
  GroupCollectives* engine = Engine(batch[0]->set);
  if (!engine) {
    for (auto& e : batch) host_->Finish(e, Status::Error(SHOAL_ABORTED, "internal error: no communicator for " + pset->Describe()));
    return;
  }
  // Completion of the communication itself (the timeline's COMMUNICATE phase).
  auto communicated = [](const EntryPtr& e) { e->t_comm_end = Clock::now(); };
  if (r.op == SHOAL_OP_BARRIER) {
    engine->Barrier([this, communicated, e = batch[0]](const Status& st) { communicated(e); host_->Finish(e, st); });
    return;
  }
  if (r.op == SHOAL_OP_BROADCAST) {
    EntryPtr e = batch[0];
    const int me = e->sig.scope == SHOAL_SCOPE_MACHINE ? w.local_rank : w.rank;  // the root's scope
    if (me == e->sig.root_rank && e->output.data != e->input.data)
      std::memcpy(e->output.data, e->input.data, e->nbytes());
    if (e->count() == 0) return host_->Finish(e, Status::Ok());
    const int root = pset ? pset->IndexOf(e->sig.root_rank) : e->sig.root_rank;
    engine->Broadcast(e->output.data, e->count(), e->sig.dtype, root, e->sig.scope,
                      [this, communicated, e](const Status& st) { communicated(e); host_->Finish(e, st); });
    return;
  }
  if (r.op == SHOAL_OP_REDUCESCATTER) return RunReduceScatter(batch[0], engine);
  if (r.op == SHOAL_OP_ALLTOALL) return RunAlltoall(r, batch[0], engine);
  if (r.op == SHOAL_OP_ALLGATHER) {
    EntryPtr e = batch[0];
    const std::vector<int64_t> counts = GatherCounts(*e, r.first_dims[0]);
    if (e->result_nbytes == 0) return host_->Finish(e, Status::Ok());
    engine->Allgatherv(e->input.data, e->count(), e->result, counts, e->sig.dtype,
                       [this, communicated, e](const Status& st) { communicated(e); host_->Finish(e, st); });
    return;
  }
  // Allreduce: a batch (fused when > 1 or half precision) reduced in one call. The
  // coordinator fuses only members of one reduce op.
  const int dtype = batch[0]->sig.dtype;
  const bool average = batch[0]->sig.reduce_op == SHOAL_REDUCE_AVERAGE;
  const int rop = average ? SHOAL_REDUCE_SUM : batch[0]->sig.reduce_op;
  const int scope = batch[0]->sig.scope;
  const int n = scope == SHOAL_SCOPE_MACHINE ? w.local_size : pset ? pset->size() : w.size;
  int64_t total = 0;
  for (auto& e : batch) total += e->count();
  if (total == 0) {
    for (auto& e : batch) host_->Finish(e, Status::Ok());
    return;
  }
  const int divisor = average ? n : 1;
  if (batch.size() == 1 && FusedBuffer::WireDtype(dtype) == dtype) {  // in place: no fusion buffer
    EntryPtr e = batch[0];
    if (e->output.data != e->input.data) std::memcpy(e->output.data, e->input.data, e->nbytes());
    if (e->prescale != 1.0) Rescale(e->output.data, e->output.data, dtype, e->count(), 1, e->prescale);
    engine->Allreduce(e->output.data, e->count(), dtype, rop, scope, [this, communicated, e, divisor](const Status& st) {
      communicated(e);
      e->t_reduce_start = Clock::now();
      if (st.ok()) FusedBuffer::Unpack(e->output.data, e->sig.dtype, e->output.data, e->count(), divisor, e->postscale);
      e->t_reduce_end = Clock::now();
      host_->Finish(e, st);
    });
    return;
  }
  auto fused = std::make_shared<FusedBuffer>(*pool_, dtype, total);
  fused->Pack(batch);
  if (batch.size() > 1) ++stats_->fused_batches;
  engine->Allreduce(fused->data(), total, fused->wire(), rop, scope, [this, communicated, fused, batch, divisor](const Status& st) {
    for (size_t k = 0; k < batch.size(); ++k) {
      const EntryPtr& e = batch[k];
      communicated(e);
      e->t_reduce_start = Clock::now();
      if (st.ok()) fused->UnpackMember(k, *e, divisor);
      e->t_reduce_end = Clock::now();
      host_->Finish(e, st);
    }
  });
}

void CollectiveOps::RunReduceScatter(const EntryPtr& e, GroupCollectives* engine) {
  // Over the members of its process set, in rank order.
  const WorldInfo& w = backend_->world();
  const int size = e->pset ? e->pset->size() : w.size, rank = e->pset ? e->pset->index : w.rank;
  const int dtype = e->sig.dtype;
  const std::vector<int64_t> counts = ScatterCounts(*e, size, rank);
  const int64_t mine = counts[rank];
  if (e->count() == 0) return host_->Finish(e, Status::Ok());
  // Half types are reduced in float32 and rounded once, as allreduce does; a prescaled
  // input is sent from a scaled copy.
  std::shared_ptr<FusedBuffer> in, out;
  const void* send = e->input.data;
  void* recv = e->result;
  const bool half = FusedBuffer::WireDtype(dtype) != dtype;
  if (half || e->prescale != 1.0) {
    in = std::make_shared<FusedBuffer>(*pool_, dtype, e->count());
    in->Pack({e});
    send = in->data();
  }
  if (half) {
    out = std::make_shared<FusedBuffer>(*pool_, dtype, mine);
    recv = out->data();
  }
  const int divisor = e->sig.reduce_op == SHOAL_REDUCE_AVERAGE ? size : 1;
  engine->ReduceScatter(send, recv, counts, FusedBuffer::WireDtype(dtype), SHOAL_REDUCE_SUM,
                        [this, e, in, out, divisor, mine](const Status& st) {
    e->t_comm_end = e->t_reduce_start = Clock::now();
    if (st.ok()) {
      if (out) out->UnpackTo(e->result, mine, divisor, e->postscale);
      else FusedBuffer::Unpack(e->result, e->sig.dtype, e->result, mine, divisor, e->postscale);
    }
    e->t_reduce_end = Clock::now();
    host_->Finish(e, st);
  });
}

}  // namespace shoal
