// NCCL collectives of CUDA tensors (SHOAL_GPU_BACKEND=nccl): allreduce, broadcast and
// allgather run on the device pointers, on the core's stream, after negotiation ordered
// them identically on every rank. One communicator per (scope, device), created on first
// use (its unique id travels over MPI) and kept for the runtime's life.
#include <cstdlib>
#include <cstring>

#include "gpu.h"
#include "runtime.h"

namespace shoal {

void* Runtime::NcclComm(int scope, int device, std::string* err) {
  auto key = std::make_pair(scope, device);
  auto it = nccl_comms_.find(key);
  if (it != nccl_comms_.end()) return it->second;
  const shoal_cuda_api* api = CudaPlugin(nullptr);
  const WorldInfo& w = world();
  const bool machine = scope == SHOAL_SCOPE_MACHINE;
  const int n = machine ? w.local_size : w.size, me = machine ? w.local_rank : w.rank;
  char id[128] = {0};
  const char* e = me == 0 ? api->nccl_unique_id(id) : nullptr;
  // Every rank of the scope reaches this point in the same collective, so a blocking
  // broadcast of the id is safe here; it happens once per communicator.
  bool done = false;
  Status st;
  backend_->Broadcast(id, sizeof id, SHOAL_UINT8, 0, scope, [&](const Status& s) { st = s; done = true; });
  while (!done) backend_->Progress();
  if (!st.ok()) {
    *err = "NCCL communicator setup: " + st.message;
    return nullptr;
  }
  void* comm = nullptr;
  if (!e) e = api->nccl_comm_init(device, n, id, me, &comm);
  if (e) {
    *err = e;
    return nullptr;
  }
  nccl_comms_[key] = comm;
  return comm;
}

void Runtime::RunNccl(const Response& r, const std::vector<EntryPtr>& batch) {
  const shoal_cuda_api* api = batch[0]->gpu->api;
  const int device = batch[0]->gpu->device, scope = batch[0]->sig.scope;
  std::string why;
  const char* e = nullptr;
  void* stream = gpu_->Stream(device, &e);
  void* comm = e ? nullptr : NcclComm(scope, device, &why);
  if (e) why = e;
  auto fail = [&](const std::string& msg) {
    for (auto& x : batch) Finish(x, Status::Error(SHOAL_ABORTED, std::string(OpName(r.op)) + " '" + x->name + "': NCCL: " + msg));
  };
  if (!comm) return fail(why);
  NcclBatch nb{nullptr, comm, batch, {}};
  for (auto& x : batch) {
    GpuOp& g = *x->gpu;
    if (g.device != device) return fail("tensors of one fused batch are on different devices");
    if (r.op == SHOAL_OP_ALLGATHER) {
      const WorldInfo& w = world();
      int64_t row = DtypeSize(x->sig.dtype);
      for (size_t i = 1; i < x->sig.shape.size(); ++i) row *= x->sig.shape[i];
      std::vector<int64_t> nbytes, offsets;
      int64_t rows = 0, total = 0;
      for (int64_t d : r.first_dims[0]) {
        offsets.push_back(total);
        nbytes.push_back(d * row);
        total += d * row;
        rows += d;
      }
      x->result_shape = x->sig.shape;
      x->result_shape[0] = rows;
      x->result_nbytes = total;
      x->result = std::malloc(std::max<int64_t>(total, 1));
      void* tmp = nullptr;
      if (total > 0 && !e) e = api->device_alloc(device, total, &tmp);
      if (tmp) nb.device_buffers.push_back(tmp);
      if (total > 0 && !e) e = api->nccl_allgatherv(g.dev_in, tmp, nbytes.data(), offsets.data(), w.size, comm, stream);
      // Gathers hand back host results (as the CPU path does); the binding moves them.
      if (total > 0 && !e) e = api->memcpy_async(x->result, tmp, total, stream);
      continue;
    }
    if (g.dev_out != g.dev_in && g.nbytes && !e &&
        (r.op == SHOAL_OP_ALLREDUCE ||
         (scope == SHOAL_SCOPE_MACHINE ? world().local_rank : world().rank) == x->sig.root_rank))
      e = api->memcpy_async(g.dev_out, g.dev_in, g.nbytes, stream);
    if (x->count() == 0 || e) continue;
    if (r.op == SHOAL_OP_BROADCAST) {
      e = api->nccl_broadcast(g.dev_out, g.nbytes, x->sig.root_rank, comm, stream);
    } else {
      e = api->nccl_allreduce(g.dev_out, x->count(), x->sig.dtype, comm, stream);
      const int n = scope == SHOAL_SCOPE_MACHINE ? world().local_size : world().size;
      if (!e && x->sig.reduce_op == SHOAL_REDUCE_AVERAGE)  // sum, then divide: as the CPU path
        e = api->scale(g.dev_out, g.dev_out, n, 1, x->sig.dtype, x->count(), stream);
    }
  }
  if (!e) e = api->event_create(device, &nb.event);
  if (!e) e = api->event_record(nb.event, stream);
  if (e) {
    // Nothing may still use the buffers we free: wait for the stream first.
    api->stream_sync(stream);
    for (void* p : nb.device_buffers) api->device_free(p);
    if (nb.event) api->event_destroy(nb.event);
    return fail(e);
  }
  nccl_in_flight_.push_back(std::move(nb));
}

bool Runtime::PollNccl() {
  bool any = false;
  for (auto it = nccl_in_flight_.begin(); it != nccl_in_flight_.end();) {
    const shoal_cuda_api* api = it->batch[0]->gpu->api;
    int done = 0;
    const char* e = api->event_query(it->event, &done);
    if (!e && !done) e = api->nccl_check(it->comm);  // a failed peer shows up here
    if (!e && !done) {
      ++it;
      continue;
    }
    if (!e) api->event_destroy(it->event);  // on error the event may still be pending: leak it
    for (void* p : it->device_buffers) if (!e) api->device_free(p);
    for (auto& x : it->batch) {
      x->t_comm_end = Clock::now();
      Finish(x, e ? Status::Error(SHOAL_ABORTED, std::string(OpName(x->sig.op)) + " '" + x->name + "': NCCL: " + e)
                  : Status::Ok());
    }
    it = nccl_in_flight_.erase(it);
    any = true;
  }
  return any;
}

}  // namespace shoal
