#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "nccl_collectives.h"

namespace shoal {

// The communicator of (scope, device), set up without blocking the driver: rank 0 of the
// scope creates the id (or fails to) and broadcasts it, with the error if any, over MPI;
// every rank then joins on a helper thread. Batches wait in order until it is ready.
void NcclCollectives::StartComm(Comm& c, int scope, int device) {
  const shoal_cuda_api* api = CudaPlugin(nullptr);
  const WorldInfo& w = backend_->world();
  const bool machine = scope == SHOAL_SCOPE_MACHINE;
  const int n = machine ? w.local_size : w.size, me = machine ? w.local_rank : w.rank;
  c.started = true;
  auto buf = std::make_shared<ByteVec>(1 + 128 + 256, 0);  // [ok][id][rank 0's error]
  if (me == 0) {
    const char* e = api->nccl_unique_id(buf->data() + 1);
    (*buf)[0] = e ? 0 : 1;
    if (e) std::strncpy(buf->data() + 129, e, 255);
  }
  auto setup = std::make_shared<Comm::Setup>();
  c.setup = setup;
  backend_->Broadcast(buf->data(), buf->size(), SHOAL_UINT8, 0, scope, 0, [api, buf, setup, device, n, me](const Status& st) {
    if (!st.ok() || (*buf)[0] != 1) {
      setup->error = !st.ok() ? "broadcasting the NCCL id: " + st.message
                              : "rank 0 could not create the NCCL id: " + std::string(buf->data() + 129);
      setup->retry = st.ok();  // every rank heard of it at this same op: all start over next time
      setup->done = true;
      return;
    }
    setup->thread = std::thread([api, buf, setup, device, n, me] {
      const char* e = api->nccl_comm_init(device, n, buf->data() + 1, me, &setup->comm);
      if (e) setup->error = e;
      setup->done = true;
    });
  });
}

bool NcclCollectives::AdvanceComms() {
  bool any = false;
  for (auto& kv : comms_) {
    Comm& c = kv.second;
    if (!c.setup || !c.setup->done) continue;
    if (c.setup->thread.joinable()) c.setup->thread.join();
    c.comm = c.setup->comm;
    c.error = c.setup->error.empty() ? "" : "NCCL communicator setup: " + c.setup->error;
    c.retry = c.setup->retry;
    c.setup.reset();
    auto parked = std::move(c.parked);
    c.parked.clear();
    for (auto& p : parked) {
      if (c.error.empty()) {
        Run(p.first, p.second, gpu_);
        continue;
      }
      for (auto& x : p.second)
        finish_(x, Status::Error(SHOAL_ABORTED, std::string(OpName(p.first.op)) + " '" + x->name + "': NCCL: " + c.error));
    }
    any = true;
  }
  return any;
}

void NcclCollectives::Stop() {
  for (auto& kv : comms_) {
    Comm& c = kv.second;
    const shoal_cuda_api* api = CudaPlugin(nullptr);
    if (c.setup) {  // a rank that never joins leaves the thread blocked in NCCL: let it go
      auto deadline = Clock::now() + std::chrono::seconds(5);
      while (!c.setup->done && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      if (c.setup->done && c.setup->thread.joinable()) c.setup->thread.join();
      else if (c.setup->thread.joinable()) c.setup->thread.detach();
      if (c.setup->done) c.comm = c.setup->comm;
    }
    if (!c.comm) continue;
    // Work still queued would keep the caller's streams waiting: abort it, else destroy.
    bool busy = false;
    for (auto& b : in_flight_) busy = busy || b.comm == c.comm;
    if (busy) api->nccl_comm_abort(c.comm);
    else api->nccl_comm_destroy(c.comm);
  }
  comms_.clear();
}

void NcclCollectives::Run(const Response& r, const std::vector<EntryPtr>& batch, GpuStaging* gpu) {
  const shoal_cuda_api* api = batch[0]->gpu->api;
  const int device = batch[0]->gpu->device, scope = batch[0]->sig.scope;
  gpu_ = gpu;
  auto fail = [&](const std::string& msg) {
    for (auto& x : batch) finish_(x, Status::Error(SHOAL_ABORTED, std::string(OpName(r.op)) + " '" + x->name + "': NCCL: " + msg));
  };
  Comm& c = comms_[{scope, device}];
  if (c.retry && c.parked.empty()) c = Comm{};
  if (!c.started) StartComm(c, scope, device);
  if (!c.error.empty()) return fail(c.error);
  if (!c.comm) return c.parked.push_back({r, batch});
  const char* e = nullptr;
  void* stream = gpu_->Stream(device, &e);
  void* comm = c.comm;
  if (e) return fail(e);
  Batch nb{nullptr, comm, batch, {}, {}};
  for (auto& x : batch) {
    GpuOp& g = *x->gpu;
    if (g.device != device) return fail("tensors of one fused batch are on different devices");
    if (r.op == SHOAL_OP_ALLGATHER) {
      const WorldInfo& w = backend_->world();
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
      if (total > 0 && !e) tmp = gpu_->DeviceBuffer(device, total, &e);
      if (tmp) nb.device_buffers.push_back(tmp);
      if (total > 0 && !e) e = api->nccl_allgatherv(g.dev_in, tmp, nbytes.data(), offsets.data(), w.size, comm, stream);
      // Gathers hand back host results (as the CPU path does; the binding moves them),
      // through pinned memory: a copy to pageable memory would block this thread.
      void* pinned = total > 0 && !e ? gpu_->HostBuffer(total, &e) : nullptr;
      if (pinned) nb.host_copies.push_back({pinned, x->result, static_cast<size_t>(total)});
      if (pinned && !e) e = api->memcpy_async(pinned, tmp, total, stream);
      continue;
    }
    if (r.op == SHOAL_OP_REDUCESCATTER) {
      // Horovod's split of dim 0; the result comes back in host memory, as allgather's.
      const WorldInfo& w = backend_->world();
      const int64_t d0 = x->sig.shape[0], row = x->count() / std::max<int64_t>(d0, 1);
      std::vector<int64_t> counts(w.size);
      for (int q = 0; q < w.size; ++q) counts[q] = (d0 / w.size + (q < d0 % w.size ? 1 : 0)) * row;
      const int64_t mine = counts[w.rank], bytes = mine * static_cast<int64_t>(DtypeSize(x->sig.dtype));
      x->result_shape = x->sig.shape;
      x->result_shape[0] = d0 / w.size + (w.rank < d0 % w.size ? 1 : 0);
      x->result_nbytes = bytes;
      x->result = std::malloc(std::max<int64_t>(bytes, 1));
      if (x->count() == 0 || e) continue;
      void* tmp = gpu_->DeviceBuffer(device, std::max<int64_t>(bytes, 1), &e);
      if (tmp) nb.device_buffers.push_back(tmp);
      const int rop = x->sig.reduce_op == SHOAL_REDUCE_AVERAGE ? SHOAL_REDUCE_SUM : x->sig.reduce_op;
      if (!e) e = api->nccl_reducescatter(g.dev_in, tmp, counts.data(), w.size, x->sig.dtype, rop, comm, stream);
      if (!e && mine > 0 && x->sig.reduce_op == SHOAL_REDUCE_AVERAGE)
        e = api->scale(tmp, tmp, w.size, 1, x->sig.dtype, mine, stream);
      void* pinned = bytes > 0 && !e ? gpu_->HostBuffer(bytes, &e) : nullptr;
      if (pinned) nb.host_copies.push_back({pinned, x->result, static_cast<size_t>(bytes)});
      if (pinned && !e) e = api->memcpy_async(pinned, tmp, bytes, stream);
      continue;
    }
    if (g.dev_out != g.dev_in && g.nbytes && !e &&
        (r.op == SHOAL_OP_ALLREDUCE ||
         (scope == SHOAL_SCOPE_MACHINE ? backend_->world().local_rank : backend_->world().rank) == x->sig.root_rank))
      e = api->memcpy_async(g.dev_out, g.dev_in, g.nbytes, stream);
    if (x->count() == 0 || e) continue;
    if (r.op == SHOAL_OP_BROADCAST) {
      e = api->nccl_broadcast(g.dev_out, g.nbytes, x->sig.root_rank, comm, stream);
    } else {
      const int rop = x->sig.reduce_op == SHOAL_REDUCE_AVERAGE ? SHOAL_REDUCE_SUM : x->sig.reduce_op;
      e = api->nccl_allreduce(g.dev_out, x->count(), x->sig.dtype, rop, comm, stream);
      const int n = scope == SHOAL_SCOPE_MACHINE ? backend_->world().local_size : backend_->world().size;
      if (!e && x->sig.reduce_op == SHOAL_REDUCE_AVERAGE)  // sum, then divide: as the CPU path
        e = api->scale(g.dev_out, g.dev_out, n, 1, x->sig.dtype, x->count(), stream);
    }
  }
  if (!e) e = api->event_create(device, &nb.event);
  if (!e) e = api->event_record(nb.event, stream);
  if (e) {
    // Nothing may still use the buffers we free: wait for the stream first.
    api->stream_sync(stream);
    for (void* p : nb.device_buffers) gpu_->ReturnDeviceBuffer(p);
    for (auto& h : nb.host_copies) gpu_->ReturnHostBuffer(std::get<0>(h));
    if (nb.event) api->event_destroy(nb.event);
    return fail(e);
  }
  in_flight_.push_back(std::move(nb));
}

bool NcclCollectives::Idle() const {
  for (auto& kv : comms_) if (kv.second.setup || !kv.second.parked.empty()) return false;
  return in_flight_.empty();
}

bool NcclCollectives::Poll() {
  bool any = AdvanceComms();
  for (auto it = in_flight_.begin(); it != in_flight_.end();) {
    const shoal_cuda_api* api = it->batch[0]->gpu->api;
    int done = 0;
    const char* e = api->event_query(it->event, &done);
    if (!e && !done) e = api->nccl_check(it->comm);  // a failed peer shows up here
    if (!e && !done) {
      ++it;
      continue;
    }
    if (!e) api->event_destroy(it->event);  // on error the event may still be pending: leak it
    for (void* p : it->device_buffers) if (!e) gpu_->ReturnDeviceBuffer(p);
    for (auto& h : it->host_copies) {
      if (!e) std::memcpy(std::get<1>(h), std::get<0>(h), std::get<2>(h));
      if (!e) gpu_->ReturnHostBuffer(std::get<0>(h));
    }
    for (auto& x : it->batch) {
      x->t_comm_end = Clock::now();
      finish_(x, e ? Status::Error(SHOAL_ABORTED, std::string(OpName(x->sig.op)) + " '" + x->name + "': NCCL: " + e)
                  : Status::Ok());
    }
    it = in_flight_.erase(it);
    any = true;
  }
  return any;
}

}  // namespace shoal
