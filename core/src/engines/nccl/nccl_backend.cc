#include "engines/nccl/nccl_backend.h"

#include <algorithm>
#include <cstring>

namespace shoal {

void NcclBackend::StartComm(Comm& c, int scope) {
  const WorldInfo& w = control_->world();
  const bool machine = scope == SHOAL_SCOPE_MACHINE;
  const int n = machine ? w.local_size : w.size, me = machine ? w.local_rank : w.rank;
  c.started = true;
  auto buf = std::make_shared<ByteVec>(1 + 128 + 256, 0);  // [ok][id][rank 0's error]
  if (me == 0) {
    const char* e = api_->nccl_unique_id(buf->data() + 1);
    (*buf)[0] = e ? 0 : 1;
    if (e) std::strncpy(buf->data() + 129, e, 255);
  }
  auto setup = std::make_shared<Comm::Setup>();
  c.setup = setup;
  const shoal_cuda_api* api = api_;
  const int device = device_;
  control_->Broadcast(buf->data(), buf->size(), SHOAL_UINT8, 0, scope, [api, buf, setup, device, n, me](const Status& st) {
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

bool NcclBackend::AdvanceComms() {
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
      if (c.error.empty()) Run(c.comm, p.first, std::move(p.second));
      else p.second(Status::Error(SHOAL_ABORTED, "NCCL: " + c.error));
    }
    any = true;
  }
  return any;
}

void NcclBackend::Submit(int scope, Issue issue, Callback done) {
  Comm& c = comms_[scope];
  if (c.retry && c.parked.empty()) c = Comm{};
  if (!c.started) StartComm(c, scope);
  if (!c.error.empty()) return done(Status::Error(SHOAL_ABORTED, "NCCL: " + c.error));
  if (!c.comm) return c.parked.push_back({std::move(issue), std::move(done)});
  Run(c.comm, issue, std::move(done));
}

void NcclBackend::Run(void* comm, const Issue& issue, Callback done) {
  const char* e = nullptr;
  void* stream = gpu_->Stream(device_, &e);
  Call call;
  call.comm = comm;
  call.done = std::move(done);
  if (!e) e = issue(comm, stream, &call);
  if (!e) e = api_->event_create(device_, &call.event);
  if (!e) e = api_->event_record(call.event, stream);
  if (!e) return in_flight_.push_back(std::move(call));
  // Nothing may still use the buffers given back: wait for the stream first.
  if (stream) api_->stream_sync(stream);
  for (void* p : call.device_buffers) gpu_->ReturnDeviceBuffer(p);
  for (void* p : call.pinned) gpu_->ReturnHostBuffer(p);
  if (call.event) api_->event_destroy(call.event);
  call.done(Status::Error(SHOAL_ABORTED, std::string("NCCL: ") + e));
}

void* NcclBackend::Temp(Call* call, size_t n, const char** err) {
  void* p = gpu_->DeviceBuffer(device_, std::max<size_t>(n, 1), err);
  if (p) call->device_buffers.push_back(p);
  return p;
}

const char* NcclBackend::CopyToHost(Call* call, void* dst, const void* src, size_t n, void* stream) {
  if (n == 0) return nullptr;
  const char* e = nullptr;
  void* pinned = gpu_->HostBuffer(n, &e);
  if (!pinned) return e;
  call->pinned.push_back(pinned);
  call->host_copies.push_back({pinned, dst, n});
  return api_->memcpy_async(pinned, src, n, stream);
}

void NcclBackend::Allreduce(void* buf, int64_t count, int dtype, int reduce_op, int scope, double prescale,
                            double postscale, Callback done) {
  const WorldInfo& w = control_->world();
  const int n = scope == SHOAL_SCOPE_MACHINE ? w.local_size : w.size;
  Submit(scope, [=](void* comm, void* stream, Call*) {
    const int rop = reduce_op == SHOAL_REDUCE_AVERAGE ? SHOAL_REDUCE_SUM : reduce_op;
    const char* e = prescale != 1.0 ? api_->scale(buf, buf, prescale, 0, dtype, count, stream) : nullptr;
    if (!e) e = api_->nccl_allreduce(buf, count, dtype, rop, comm, stream);
    if (!e && reduce_op == SHOAL_REDUCE_AVERAGE)  // sum, then divide: as the CPU path
      e = api_->scale(buf, buf, n, 1, dtype, count, stream);
    if (!e && postscale != 1.0) e = api_->scale(buf, buf, postscale, 0, dtype, count, stream);
    return e;
  }, std::move(done));
}

void NcclBackend::Broadcast(void* buf, int64_t count, int dtype, int root, int scope, Callback done) {
  const int64_t nbytes = count * static_cast<int64_t>(DtypeSize(dtype));
  Submit(scope, [=](void* comm, void* stream, Call*) { return api_->nccl_broadcast(buf, nbytes, root, comm, stream); },
         std::move(done));
}

void NcclBackend::Allgatherv(const void* send, int64_t, void* recv, const std::vector<int64_t>& counts, int dtype,
                             Callback done) {
  const int64_t es = static_cast<int64_t>(DtypeSize(dtype));
  std::vector<int64_t> nbytes, offsets;
  int64_t total = 0;
  for (int64_t c : counts) {
    offsets.push_back(total);
    nbytes.push_back(c * es);
    total += c * es;
  }
  Submit(SHOAL_SCOPE_WORLD, [=](void* comm, void* stream, Call* call) {
    const char* e = nullptr;
    void* tmp = Temp(call, total, &e);
    if (!e) e = api_->nccl_allgatherv(send, tmp, nbytes.data(), offsets.data(), static_cast<int>(nbytes.size()), comm,
                                      stream);
    if (!e) e = CopyToHost(call, recv, tmp, total, stream);
    return e;
  }, std::move(done));
}

void NcclBackend::ReduceScatter(const void* send, void* recv, const std::vector<int64_t>& counts, int dtype,
                                int reduce_op, double prescale, double postscale, Callback done) {
  const WorldInfo& w = control_->world();
  const int64_t mine = counts[w.rank], bytes = mine * static_cast<int64_t>(DtypeSize(dtype));
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  Submit(SHOAL_SCOPE_WORLD, [=](void* comm, void* stream, Call* call) {
    const char* e = nullptr;
    void* tmp = Temp(call, bytes, &e);
    const void* in = send;
    if (!e && prescale != 1.0) {  // the caller's input stays as it is
      void* scaled = Temp(call, total * static_cast<int64_t>(DtypeSize(dtype)), &e);
      if (!e) e = api_->scale(scaled, send, prescale, 0, dtype, total, stream);
      in = scaled;
    }
    const int rop = reduce_op == SHOAL_REDUCE_AVERAGE ? SHOAL_REDUCE_SUM : reduce_op;
    if (!e) e = api_->nccl_reducescatter(in, tmp, counts.data(), w.size, dtype, rop, comm, stream);
    if (!e && mine > 0 && reduce_op == SHOAL_REDUCE_AVERAGE) e = api_->scale(tmp, tmp, w.size, 1, dtype, mine, stream);
    if (!e && mine > 0 && postscale != 1.0) e = api_->scale(tmp, tmp, postscale, 0, dtype, mine, stream);
    if (!e) e = CopyToHost(call, recv, tmp, bytes, stream);
    return e;
  }, std::move(done));
}

void NcclBackend::Alltoallv(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                            const std::vector<int64_t>& recv_counts, int dtype, Callback done) {
  const int64_t es = static_cast<int64_t>(DtypeSize(dtype));
  int64_t total = 0;
  for (int64_t c : recv_counts) total += c * es;
  Submit(SHOAL_SCOPE_WORLD, [=](void* comm, void* stream, Call* call) {
    const char* e = nullptr;
    void* tmp = Temp(call, total, &e);
    // One group of ncclSend/ncclRecv with every rank that sends here or is sent to (this
    // rank too); empty parts are left out, on both ends alike.
    std::vector<shoal_nccl_peer> sends, recvs;
    int64_t at_send = 0, at_recv = 0;
    for (int q = 0; q < static_cast<int>(send_counts.size()); ++q) {
      if (send_counts[q] > 0)
        sends.push_back({q, const_cast<char*>(static_cast<const char*>(send)) + at_send * es, send_counts[q] * es});
      if (recv_counts[q] > 0) recvs.push_back({q, static_cast<char*>(tmp) + at_recv * es, recv_counts[q] * es});
      at_send += send_counts[q];
      at_recv += recv_counts[q];
    }
    if (!e && (!sends.empty() || !recvs.empty()))
      e = api_->nccl_exchange(sends.data(), static_cast<int>(sends.size()), recvs.data(), static_cast<int>(recvs.size()),
                              comm, stream);
    if (!e) e = CopyToHost(call, recv, tmp, total, stream);
    return e;
  }, std::move(done));
}

bool NcclBackend::Progress() {
  bool any = AdvanceComms();
  for (auto it = in_flight_.begin(); it != in_flight_.end();) {
    int done = 0;
    const char* e = api_->event_query(it->event, &done);
    if (!e && !done) e = api_->nccl_check(it->comm);  // a failed peer shows up here
    if (!e && !done) {
      ++it;
      continue;
    }
    if (!e) {  // on error the event and buffers may still be in use: leak them
      api_->event_destroy(it->event);
      for (auto& h : it->host_copies) std::memcpy(std::get<1>(h), std::get<0>(h), std::get<2>(h));
      for (void* p : it->device_buffers) gpu_->ReturnDeviceBuffer(p);
      for (void* p : it->pinned) gpu_->ReturnHostBuffer(p);
    }
    Callback cb = std::move(it->done);
    it = in_flight_.erase(it);
    cb(e ? Status::Error(SHOAL_ABORTED, std::string("NCCL: ") + e) : Status::Ok());
    any = true;
  }
  return any;
}

size_t NcclBackend::num_in_flight() const {
  size_t n = in_flight_.size();
  for (auto& kv : comms_) n += kv.second.parked.size() + (kv.second.setup ? 1 : 0);
  return n;
}

void NcclBackend::Stop() {
  for (auto& kv : comms_) {
    Comm& c = kv.second;
    if (c.setup) {  // a rank that never joins leaves the thread blocked in NCCL: let it go
      auto deadline = Clock::now() + std::chrono::seconds(5);
      while (!c.setup->done && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      if (c.setup->done && c.setup->thread.joinable()) c.setup->thread.join();
      else if (c.setup->thread.joinable()) c.setup->thread.detach();
      if (c.setup->done) c.comm = c.setup->comm;
      c.setup.reset();
    }
    if (!c.comm) continue;
    // Work still queued would keep the caller's streams waiting: abort it, else destroy.
    bool busy = false;
    for (auto& call : in_flight_) busy = busy || call.comm == c.comm;
    if (busy) api_->nccl_comm_abort(c.comm);
    else api_->nccl_comm_destroy(c.comm);
  }
  comms_.clear();
}

}  // namespace shoal
