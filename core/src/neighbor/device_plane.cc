#include "neighbor/device_plane.h"

#include <array>
#include <cstring>

#include "gpu/staging.h"
#include "neighbor/neighbor_exchange.h"

namespace shoal {
namespace {
constexpr uint32_t kLinkMagic = 0x4c494e4bu;  // "LINK"

std::string Err(const char* what, const char* e) { return std::string(what) + ": " + e; }
}  // namespace

// Pooled device or pinned host buffers by power-of-two size, never freed before Stop:
// cudaFree and cudaFreeHost synchronise the device, which the driver must not wait for.
struct DevicePlane::Pool : std::enable_shared_from_this<Pool> {
  const shoal_cuda_api* api;
  int device;
  bool host;
  std::map<size_t, std::vector<void*>> free;
  std::vector<void*> all;
  Pool(const shoal_cuda_api* a, int d, bool h) : api(a), device(d), host(h) {}
  std::shared_ptr<void> Get(size_t n, const char** err) {
    size_t b = 256;
    while (b < n) b <<= 1;
    void* p = nullptr;
    auto& f = free[b];
    if (!f.empty()) {
      p = f.back();
      f.pop_back();
    } else {
      *err = host ? api->host_alloc(b, &p) : api->device_alloc(device, b, &p);
      if (*err) return nullptr;
      all.push_back(p);
    }
    std::weak_ptr<Pool> self = shared_from_this();
    return std::shared_ptr<void>(p, [self, b](void* q) {
      if (auto s = self.lock()) s->free[b].push_back(q);
    });
  }
  ~Pool() {
    for (void* p : all) host ? api->host_free(p) : api->device_free(p);
  }
};

bool DevicePlane::Bind(const shoal_cuda_api* api, int device, GpuStaging* gpu, std::string* why) {
  if (device_ >= 0) {
    if (device == device_) return true;
    *why = "neighbor ops of one rank move device data on one device: this rank uses cuda:" + std::to_string(device_) +
           ", this tensor is on cuda:" + std::to_string(device);
    return false;
  }
  api_ = api;
  gpu_ = gpu;
  device_ = device;
  device_pool_ = std::make_shared<Pool>(api, device, false);
  host_pool_ = std::make_shared<Pool>(api, device, true);
  return true;
}

bool DevicePlane::IsLinkMessage(const ByteVec& msg) {
  uint32_t magic = 0;
  if (msg.size() < sizeof magic + 1) return false;
  std::memcpy(&magic, msg.data(), sizeof magic);
  return magic == kLinkMagic;
}

void DevicePlane::OnLinkMessage(int src, const ByteVec& msg) {
  Link& l = GetLink(src, false, kPathNccl);
  const char* body = msg.data() + sizeof kLinkMagic + 1;
  const size_t n = msg.size() - sizeof kLinkMagic - 1;
  if (l.retry) Reset(l);  // the sender starts over after a failed setup
  if (msg[sizeof kLinkMagic] == 0) {
    FailLink(l, "rank " + std::to_string(src) + " could not set up NCCL: " + std::string(body, n));
    l.retry = true;
    return;
  }
  if (n != sizeof l.id) return FailLink(l, "corrupt NCCL setup message from rank " + std::to_string(src));
  std::memcpy(l.id, body, sizeof l.id);
  l.have_id = true;
  Advance(l);
}

void DevicePlane::Reset(Link& l) {
  Link fresh;
  fresh.peer = l.peer;
  fresh.out = l.out;
  fresh.path = l.path;
  fresh.stream = l.stream;
  l = std::move(fresh);
}

DevicePlane::Link& DevicePlane::GetLink(int peer, bool out, int path) {
  auto [it, fresh] = links_.try_emplace(LinkKey{peer, out, path});
  if (fresh) {
    it->second.peer = peer;
    it->second.out = out;
    it->second.path = path;
  }
  return it->second;
}

std::string DevicePlane::Describe(const Link& l) const {
  return std::string(l.path == kPathNccl ? "NCCL" : "CUDA-aware MPI") + (l.out ? " send to rank " : " receive from rank ") +
         std::to_string(l.peer);
}

void DevicePlane::Send(int dst, int path, const std::vector<std::pair<EntryPtr, double>>& items) {
  Link& l = GetLink(dst, true, path);
  if (l.retry && l.queued.empty() && l.running.empty()) Reset(l);
  if (path == kPathNccl && !l.have_id && l.error.empty()) {
    // The edge's first data: its NCCL id goes ahead of the header that announces the data.
    char id[128] = {0};
    const char* e = api_->nccl_unique_id(id);
    std::string body = e ? std::string(e) : std::string(id, sizeof id);
    auto msg = std::make_shared<ByteVec>(sizeof kLinkMagic + 1 + body.size());
    std::memcpy(msg->data(), &kLinkMagic, sizeof kLinkMagic);
    (*msg)[sizeof kLinkMagic] = e ? 0 : 1;
    std::memcpy(msg->data() + sizeof kLinkMagic + 1, body.data(), body.size());
    backend_->Send(dst, NeighborExchange::kTag, msg, [](const Status&) {});
    if (e) {
      FailLink(l, e);
      l.retry = true;
    } else {
      std::memcpy(l.id, id, sizeof id);
      l.have_id = true;
    }
  }
  Call c;
  c.send = true;
  c.items = items;
  for (auto& it : items) {
    it.first->direct_sends = true;  // its memory is read until the call completes
    ++it.first->sends_pending;
    c.entries.push_back(it.first);
    (path == kPathNccl ? stats_->neighbor_bytes_sent_nccl : stats_->neighbor_bytes_sent_mpi) += it.first->nbytes();
    stats_->bytes_sent += it.first->nbytes();  // what the host path counts for the same data
  }
  if (!l.error.empty()) return FailCall(c, l.error);
  l.queued.push_back(std::move(c));
  Advance(l);
}

std::vector<std::shared_ptr<Arrival>> DevicePlane::Receive(int src, int path, const std::vector<uint64_t>& nbytes) {
  Link& l = GetLink(src, false, path);
  Call c;
  c.nbytes = nbytes;
  for (size_t k = 0; k < nbytes.size(); ++k) {
    c.arrivals.push_back(std::make_shared<Arrival>());
    stats_->bytes_received += nbytes[k];
  }
  auto arrivals = c.arrivals;
  if (!l.error.empty()) {
    FailCall(c, l.error);
  } else {
    l.queued.push_back(std::move(c));
    Advance(l);
  }
  return arrivals;
}

void DevicePlane::StartSetup(Link& l) {
  auto s = std::make_shared<Setup>();
  std::array<char, 128> id;
  std::memcpy(id.data(), l.id, id.size());
  const shoal_cuda_api* api = api_;
  const int device = device_, rank = l.out ? 0 : 1;
  s->thread = std::thread([s, api, id, device, rank] {
    const char* e = api->nccl_comm_init(device, 2, id.data(), rank, &s->comm);
    if (e) s->error = e;
    s->done = true;
  });
  l.setup = s;
}

bool DevicePlane::Advance(Link& l) {
  bool any = false;
  if (l.setup && l.setup->done) {
    l.setup->thread.join();
    if (!l.setup->error.empty()) {
      auto why = "setting up the NCCL communicator with rank " + std::to_string(l.peer) + ": " + l.setup->error;
      l.setup.reset();
      FailLink(l, why);
      l.retry = true;
      return true;
    }
    l.comm = l.setup->comm;
    l.setup.reset();
    any = true;
  }
  if (!l.error.empty() || device_ < 0) return any;
  if (l.path == kPathNccl && !l.comm) {
    if (l.peer_left != Clock::time_point{} && !l.queued.empty()) {  // it will never join
      FailLink(l, "rank " + std::to_string(l.peer) + " left the job before this data moved");
      return true;
    }
    if (l.have_id && !l.setup) StartSetup(l);
    return any;
  }
  if (!l.stream) {
    if (const char* e = api_->stream_create(device_, &l.stream)) {
      FailLink(l, Err("cudaStreamCreate", e));
      return true;
    }
  }
  std::string err;
  while (!l.queued.empty()) {
    if (!Issue(l, l.queued.front(), &err)) {
      l.running.push_back(std::move(l.queued.front()));
      l.queued.pop_front();
      FailLink(l, err);
      return true;
    }
    l.running.push_back(std::move(l.queued.front()));
    l.queued.pop_front();
    any = true;
  }
  // CUDA-aware MPI sends leave once their data is ready, in header order.
  for (auto& c : l.running) {
    if (c.posted) continue;
    int ready = 0;
    if (const char* e = api_->event_query(c.event, &ready)) {
      FailLink(l, Err("cudaEventQuery", e));
      return true;
    }
    if (!ready) break;
    c.posted = true;
    any = true;
    for (auto& p : c.parts) {
      auto pending = c.mpi_pending;
      auto status = c.mpi_status;
      backend_->SendFrom(l.peer, kTag, p.buf, static_cast<size_t>(p.count), [pending, status](const Status& st) {
        if (!st.ok() && status->ok()) *status = st;
        --*pending;
      });
    }
  }
  while (!l.running.empty()) {
    Call& c = l.running.front();
    if (!Check(l, c, &err)) {
      if (err.empty() && l.peer_left != Clock::time_point{} && Clock::now() - l.peer_left > std::chrono::seconds(5))
        err = "rank " + std::to_string(l.peer) + " left the job before this data moved";
      if (err.empty()) break;
      FailLink(l, err);
      return true;
    }
    for (auto& e : c.entries) --e->sends_pending;
    for (auto& a : c.arrivals) a->done = true;
    if (c.event) api_->event_destroy(c.event);
    l.running.pop_front();
    any = true;
  }
  return any;
}

bool DevicePlane::Issue(Link& l, Call& c, std::string* err) {
  const char* e = nullptr;
  const bool nccl = l.path == kPathNccl;
  c.mpi_pending = std::make_shared<int>(0);
  c.mpi_status = std::make_shared<Status>();
  if (c.send) {
    for (auto& it : c.items) {
      Entry& x = *it.first;
      GpuOp& g = *x.gpu;
      if (g.device != device_) {
        *err = "a tensor on cuda:" + std::to_string(g.device) + " but this rank's neighbor ops use cuda:" + std::to_string(device_);
        return false;
      }
      if (!e) e = api_->stream_wait_event(l.stream, g.staged);  // the producer's data is there
      void* data = g.dev_in;
      if (!e && it.second != 1.0 && x.sig.op == SHOAL_OP_NEIGHBOR_ALLREDUCE && x.count() > 0) {
        auto tmp = device_pool_->Get(x.nbytes(), &e);
        if (!e) e = api_->scale(tmp.get(), g.dev_in, it.second, 0, x.sig.dtype, x.count(), l.stream);
        data = tmp.get();
        c.hold.push_back(std::move(tmp));
      }
      if (x.nbytes() > 0) c.parts.push_back({nccl ? 1 : l.peer, data, static_cast<int64_t>(x.nbytes())});
    }
    c.items.clear();
    if (!e && nccl && !c.parts.empty())
      e = api_->nccl_exchange(c.parts.data(), static_cast<int>(c.parts.size()), nullptr, 0, l.comm, l.stream);
    if (!e) e = api_->event_create(device_, &c.event);
    if (!e) e = api_->event_record(c.event, l.stream);
    *c.mpi_pending = nccl ? 0 : static_cast<int>(c.parts.size());
    c.posted = nccl;  // MPI: posted once the event says the data is ready
  } else {
    for (size_t k = 0; k < c.nbytes.size() && !e; ++k) {
      auto buf = device_pool_->Get(c.nbytes[k], &e);
      if (e) break;
      if (c.nbytes[k] > 0) c.parts.push_back({0, buf.get(), static_cast<int64_t>(c.nbytes[k])});
      c.arrivals[k]->device = std::move(buf);
    }
    if (!e && nccl) {
      if (!c.parts.empty())
        e = api_->nccl_exchange(nullptr, 0, c.parts.data(), static_cast<int>(c.parts.size()), l.comm, l.stream);
      if (!e) e = api_->event_create(device_, &c.event);
      if (!e) e = api_->event_record(c.event, l.stream);
    } else if (!e) {
      *c.mpi_pending = static_cast<int>(c.parts.size());
      for (size_t k = 0, p = 0; k < c.nbytes.size(); ++k) {
        if (c.nbytes[k] == 0) continue;
        auto pending = c.mpi_pending;
        auto status = c.mpi_status;
        auto buf = c.arrivals[k]->device;  // alive until MPI is done with it, even on failure
        backend_->ReceiveInto(l.peer, kTag, c.parts[p++].buf, c.nbytes[k], [pending, status, buf](const Status& st) {
          if (!st.ok() && status->ok()) *status = st;
          --*pending;
        });
      }
    }
    c.posted = true;
  }
  if (e) *err = Err(nccl ? "NCCL" : "CUDA", e);
  return !e;
}

bool DevicePlane::Check(Link& l, Call& c, std::string* err) {
  if (!c.mpi_status->ok()) {
    *err = c.mpi_status->message;
    return false;
  }
  if (!c.posted || *c.mpi_pending > 0) return false;
  if (!c.event) return true;
  int done = 0;
  const char* e = api_->event_query(c.event, &done);
  if (!e && !done && l.comm) e = api_->nccl_check(l.comm);  // a failed peer shows up here
  if (e) *err = Err(l.comm ? "NCCL" : "CUDA", e);
  return !e && done;
}

void DevicePlane::FailCall(Call& c, const std::string& why) {
  const Status st = Status::Error(SHOAL_ABORTED, why);
  for (auto& e : c.entries) {
    if (e->send_error.ok()) e->send_error = st;
    --e->sends_pending;
  }
  for (auto& a : c.arrivals) {
    a->status = st;
    a->done = true;
  }
  c.entries.clear();
  c.arrivals.clear();
}

void DevicePlane::FailLink(Link& l, const std::string& why) {
  if (l.error.empty()) l.error = Describe(l) + ": " + why;
  // Work still queued on the communicator would hold its stream (and our buffers): end it.
  if (l.comm && !l.running.empty()) {
    api_->nccl_comm_abort(l.comm);
    l.comm = nullptr;
  }
  for (auto& c : l.running) FailCall(c, l.error);
  for (auto& c : l.queued) FailCall(c, l.error);
  l.running.clear();
  l.queued.clear();
}

Status DevicePlane::Finish(const EntryPtr& ep, const std::vector<std::shared_ptr<Arrival>>& pieces,
                           const std::vector<size_t>& nbytes, bool trace) {
  Entry& e = *ep;
  GpuOp& g = *e.gpu;
  const char* err = nullptr;
  void* s = gpu_->Stream(device_, &err);
  Pending p{ep, nullptr, pieces, {}};
  if (trace) e.t_reduce_start = Clock::now();
  if (!err && e.sig.op == SHOAL_OP_NEIGHBOR_ALLREDUCE) {
    std::vector<const void*> srcs;
    for (auto& a : pieces) srcs.push_back(a->data());
    if (e.count() > 0)
      err = api_->combine(g.dev_out, g.dev_in, srcs.data(), e.uniform ? nullptr : e.recv_weights.data(),
                          static_cast<int>(srcs.size()), e.uniform, e.self_weight, e.sig.dtype, e.count(), s);
  } else if (!err) {
    // neighbor_allgather: a host result, as on the CPU path (the binding moves it), copied
    // through pinned memory: a copy to pageable memory would block this thread.
    for (size_t k = 0; k < pieces.size() && !err; ++k) {
      auto host = host_pool_->Get(nbytes[k], &err);
      if (!err && nbytes[k] > 0) err = api_->memcpy_async(host.get(), pieces[k]->data(), nbytes[k], s);
      p.host.push_back({std::move(host), nbytes[k]});
    }
  }
  if (!err) err = api_->event_create(device_, &p.event);
  if (!err) err = api_->event_record(p.event, s);
  if (err) {
    if (p.event) api_->event_destroy(p.event);
    if (s) api_->stream_sync(s);  // nothing may still use the pieces
    return Status::Error(SHOAL_ABORTED, OpError(e.sig.op, e.name, std::string("CUDA: ") + err));
  }
  pending_.push_back(std::move(p));
  return Status::Ok();
}

bool DevicePlane::Poll(std::vector<std::pair<EntryPtr, Status>>* done) {
  bool any = false;
  for (auto& kv : links_) any |= Advance(kv.second);
  for (auto it = pending_.begin(); it != pending_.end();) {
    int ready = 0;
    const char* e = api_->event_query(it->event, &ready);
    if (!e && !ready) {
      ++it;
      continue;
    }
    Entry& x = *it->entry;
    if (!e) api_->event_destroy(it->event);
    if (!e && x.sig.op == SHOAL_OP_NEIGHBOR_ALLGATHER) {
      x.result_nbytes = 0;
      for (auto& h : it->host) x.result_nbytes += h.second;
      x.result = std::malloc(std::max<size_t>(x.result_nbytes, 1));
      size_t at = 0;
      for (auto& h : it->host) {
        std::memcpy(static_cast<char*>(x.result) + at, h.first.get(), h.second);
        at += h.second;
      }
    }
    if (x.t_reduce_start != Clock::time_point{}) x.t_reduce_end = Clock::now();
    done->push_back({it->entry, e ? Status::Error(SHOAL_ABORTED, OpError(x.sig.op, x.name, std::string("CUDA: ") + e))
                                  : Status::Ok()});
    it = pending_.erase(it);
    any = true;
  }
  return any;
}

bool DevicePlane::Idle() const {
  if (!pending_.empty()) return false;
  for (auto& kv : links_)
    if (!kv.second.queued.empty() || !kv.second.running.empty() || kv.second.setup) return false;
  return true;
}

void DevicePlane::Fence(const Entry& e, void* stream) {
  if (!api_) return;
  for (int dst : e.send_ranks) {
    for (int path : {static_cast<int>(kPathNccl), static_cast<int>(kPathMpi)}) {
      auto it = links_.find(LinkKey{dst, true, path});
      if (it == links_.end() || !it->second.stream) continue;
      void* ev = nullptr;
      if (api_->event_create(device_, &ev)) continue;
      if (!api_->event_record(ev, it->second.stream)) api_->stream_wait_event(stream, ev);
      api_->event_destroy(ev);
    }
  }
}

void DevicePlane::OnLeave(int rank) {
  for (auto& kv : links_) {
    Link& l = kv.second;
    if (l.peer != rank) continue;
    l.peer_left = Clock::now();
    Advance(l);
    if (!l.queued.empty()) FailLink(l, "rank " + std::to_string(rank) + " left the job before this data moved");
  }
}

void DevicePlane::Abandon(const Entry& e, const std::string& why) {
  for (auto& kv : links_) {
    Link& l = kv.second;
    if (!l.out) continue;
    auto uses = [&](const std::deque<Call>& calls) {
      for (auto& c : calls)
        for (auto& x : c.entries) if (x.get() == &e) return true;
      return false;
    };
    if (uses(l.queued) || uses(l.running)) FailLink(l, why);
  }
}

void DevicePlane::Stop() {
  if (!api_) return;
  for (auto& kv : links_) {
    Link& l = kv.second;
    if (!l.queued.empty() || !l.running.empty()) FailLink(l, "Shoal was shut down");
    if (l.setup) {
      // A peer that never joins leaves the setup thread blocked in NCCL: let it go after a
      // while. The fake plugin's setup gives up by itself (SHOAL_FAKE_NCCL_TIMEOUT) and uses
      // MPI, which is finalized next: wait for it.
      const bool fake = std::string(api_->build).rfind("fake", 0) == 0;
      auto deadline = Clock::now() + std::chrono::seconds(5);
      while (!l.setup->done && (fake || Clock::now() < deadline)) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      if (l.setup->done) {
        l.setup->thread.join();
        if (l.setup->comm) api_->nccl_comm_destroy(l.setup->comm);
      } else {
        l.setup->thread.detach();
      }
      l.setup.reset();
    }
    if (l.comm) api_->nccl_comm_destroy(l.comm);
    l.comm = nullptr;
    if (l.stream) {
      api_->stream_sync(l.stream);
      api_->stream_destroy(l.stream);
      l.stream = nullptr;
    }
  }
  links_.clear();
  for (auto& p : pending_) {
    if (gpu_) {
      const char* e = nullptr;
      if (void* s = gpu_->Stream(device_, &e)) api_->stream_sync(s);
    }
    api_->event_destroy(p.event);
  }
  pending_.clear();
  device_pool_.reset();
  host_pool_.reset();
  api_ = nullptr;
}

}  // namespace shoal
