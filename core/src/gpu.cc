#include "gpu.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>

#include "runtime.h"

namespace shoal {
namespace {

struct Loaded {
  const shoal_cuda_api* api = nullptr;
  std::string why;
};

}  // namespace

// $SHOAL_CUDA_PLUGIN: unset or "real", libshoal_cuda.so beside libshoal.so; "fake", the
// fake device plugin beside it (tests only); else the path of a plugin.
std::string CudaPluginPath() {
  const char* env = std::getenv("SHOAL_CUDA_PLUGIN");
  const std::string choice = env ? env : "";
  if (!choice.empty() && choice != "real" && choice != "fake") return choice;
  const char* name = choice == "fake" ? "libshoal_cuda_fake.so" : "libshoal_cuda.so";
  Dl_info info{};
  if (!dladdr(reinterpret_cast<void*>(&CudaPlugin), &info) || !info.dli_fname) return name;
  std::string self = info.dli_fname;
  auto slash = self.rfind('/');
  return (slash == std::string::npos ? std::string() : self.substr(0, slash + 1)) + name;
}

namespace {

// A free buffer of `free_list`, else a new one from `alloc` (then `track` records it).
template <typename Alloc, typename Track>
void* Pooled(std::vector<void*>& free_list, Alloc alloc, Track track, const char** err) {
  if (!free_list.empty()) {
    void* p = free_list.back();
    free_list.pop_back();
    return p;
  }
  void* p = nullptr;
  *err = alloc(&p);
  if (*err) return nullptr;
  track(p);
  return p;
}

size_t Bucket(size_t n) {
  size_t b = 4096;
  while (b < n) b <<= 1;
  return b;
}

bool HasTensorOutput(int op) {
  return op == SHOAL_OP_ALLREDUCE || op == SHOAL_OP_BROADCAST || op == SHOAL_OP_NEIGHBOR_ALLREDUCE;
}

}  // namespace

const shoal_cuda_api* CudaPlugin(std::string* why) {
  // A process-wide fact (is the library there?), not runtime state: loaded once.
  static Loaded loaded;
  static std::once_flag once;
  std::call_once(once, [] {
    const std::string path = CudaPluginPath();
    void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* e = dlerror();
      const char* chosen = std::getenv("SHOAL_CUDA_PLUGIN");
      if (chosen && *chosen && std::string(chosen) != "real")
        loaded.why = "the CUDA plugin " + path + " (SHOAL_CUDA_PLUGIN) does not load: " + (e ? e : "not found");
      else
        loaded.why = "this build has no CUDA support (" + path + ": " + (e ? e : "not found") +
                     "); rebuild Shoal where nvcc is installed";
      return;
    }
    auto fn = reinterpret_cast<shoal_cuda_plugin_fn>(dlsym(h, SHOAL_CUDA_PLUGIN_SYMBOL));
    loaded.api = fn ? fn(SHOAL_CUDA_ABI_VERSION) : nullptr;
    if (!loaded.api) loaded.why = path + " does not match this libshoal.so (rebuild Shoal)";
  });
  if (!loaded.api && why) *why = loaded.why;
  return loaded.api;
}

GpuOp::~GpuOp() {
  // Destroying a recorded event is safe: CUDA frees it once it has completed.
  if (own_ready && ready) api->event_destroy(ready);
  if (staged) api->event_destroy(staged);
}

std::shared_ptr<GpuOp> CaptureGpuOp(const shoal_op_desc& d, size_t nbytes) {
  const std::string op = OpName(d.op);
  std::string why;
  const shoal_cuda_api* api = CudaPlugin(&why);
  if (!api) throw ArgumentError(SHOAL_INVALID_ARGUMENT, op + ": a CUDA tensor, but " + why);
  const char* no_device = nullptr;
  if (api->device_count(&no_device) <= d.input.device_id || d.input.device_id < 0)
    throw ArgumentError(SHOAL_INVALID_ARGUMENT, op + ": CUDA device " + std::to_string(d.input.device_id) +
                                                    " is not usable here" + (no_device ? std::string(" (") + no_device + ")" : ""));
  if (d.output.data && (d.output.device_type != SHOAL_DEVICE_CUDA || d.output.device_id != d.input.device_id))
    throw ArgumentError(SHOAL_INVALID_ARGUMENT, op + ": the output must be on the input's device (cuda:" +
                                                    std::to_string(d.input.device_id) + ")");
  auto g = std::make_shared<GpuOp>();
  g->api = api;
  g->device = d.input.device_id;
  g->user_stream = d.input.stream;
  g->dev_in = d.input.data;
  g->dev_out = d.output.data ? d.output.data : d.input.data;
  g->nbytes = nbytes;
  if (d.input.ready_event) {
    g->ready = d.input.ready_event;
  } else {
    if (const char* e = api->capture(g->device, g->user_stream, &g->ready))
      throw ArgumentError(SHOAL_INVALID_ARGUMENT, op + ": " + e);
    g->own_ready = true;
  }
  return g;
}

Status GpuStaging::Err(const char* msg) const { return Status::Error(SHOAL_ABORTED, std::string("CUDA: ") + msg); }

void* GpuStaging::Stream(int device, const char** err) {
  auto it = streams_.find(device);
  if (it != streams_.end()) {
    *err = api_->set_device(device);
    return it->second;
  }
  void* s = nullptr;
  *err = api_->stream_create(device, &s);
  if (!*err) streams_[device] = s;
  return s;
}

void* GpuStaging::HostBuffer(size_t n, const char** err) {
  return Pooled(pool_[Bucket(n)], [&](void** p) { return api_->host_alloc(Bucket(n), p); },
                [&](void* p) { sizes_[p] = Bucket(n); }, err);
}

void* GpuStaging::DeviceBuffer(int device, size_t n, const char** err) {
  const auto key = std::make_pair(device, Bucket(n));
  return Pooled(device_pool_[key], [&](void** p) { return api_->device_alloc(device, key.second, p); },
                [&](void* p) { device_sizes_[p] = key; }, err);
}

Status GpuStaging::Start(const EntryPtr& e) {
  GpuOp& g = *e->gpu;
  const char* err = nullptr;
  void* s = Stream(g.device, &err);
  if (!err) err = api_->stream_wait_event(s, g.ready);
  if (!g.nccl && !g.direct) {  // NCCL and the device plane work on the device pointers: only the wait above
    if (!err) g.host_in = HostBuffer(g.nbytes, &err);
    if (!err) g.host_out = g.dev_out == g.dev_in || !HasTensorOutput(e->sig.op) ? g.host_in : HostBuffer(g.nbytes, &err);
    if (!err && g.nbytes) err = api_->memcpy_async(g.host_in, g.dev_in, g.nbytes, s);
  }
  if (!err) err = api_->event_create(g.device, &g.staged);
  if (!err) err = api_->event_record(g.staged, s);
  g.started = true;  // from here Complete must retire the buffers
  if (err) return Err(err);
  staging_.push_back(e);
  return Status::Ok();
}

std::vector<EntryPtr> GpuStaging::Ready(std::vector<std::pair<EntryPtr, Status>>* failed) {
  std::vector<EntryPtr> ready;
  for (auto it = staging_.begin(); it != staging_.end();) {
    GpuOp& g = *(*it)->gpu;
    int done = 0;
    const char* err = g.finished ? nullptr : api_->event_query(g.staged, &done);
    if (err) failed->push_back({*it, Err(err)});
    if (g.finished || err) {
      it = staging_.erase(it);
      continue;
    }
    if (!done) {
      ++it;
      continue;
    }
    if (!g.nccl && !g.direct) {
      g.on_host = true;
      (*it)->input.data = g.host_in;
      (*it)->output.data = g.host_out;
    }
    ready.push_back(*it);
    it = staging_.erase(it);
  }
  return ready;
}

Status GpuStaging::Complete(Entry& e, const Status& st) {
  GpuOp& g = *e.gpu;
  if (g.finished || !g.started) {
    g.finished = true;
    return st;
  }
  g.finished = true;
  const char* err = nullptr;
  void* s = Stream(g.device, &err);
  const bool copy_back = st.ok() && g.on_host && HasTensorOutput(e.sig.op) && g.nbytes > 0;
  if (!err && copy_back) err = api_->memcpy_async(g.dev_out, g.host_out, g.nbytes, s);
  void* done = nullptr;
  if (!err) err = api_->event_create(g.device, &done);
  if (!err) err = api_->event_record(done, s);
  // Work the caller queues on its stream after this op completes runs after the copy
  // (or after the NCCL kernels and combines, which ran on the core's stream), also after
  // an error: device work may still be queued then.
  const bool device_work = (g.nccl || g.direct) && (HasTensorOutput(e.sig.op) || !st.ok());
  if (!err && (copy_back || device_work)) err = api_->stream_wait_event(g.user_stream, done);
  Retiring r{done, {}};
  if (g.host_in) r.buffers.push_back(g.host_in);
  if (g.host_out && g.host_out != g.host_in) r.buffers.push_back(g.host_out);
  if (done) {
    retiring_.push_back(std::move(r));
  } else if (s) {
    api_->stream_sync(s);  // no event to wait on: make sure the buffers are idle
    for (void* p : r.buffers) if (p) pool_[sizes_[p]].push_back(p);
  }
  if (err) return Err(err);
  return st;
}

void GpuStaging::Retire() {
  for (auto it = retiring_.begin(); it != retiring_.end();) {
    int done = 0;
    if (api_->event_query(it->event, &done) == nullptr && !done) {
      ++it;
      continue;
    }
    api_->event_destroy(it->event);
    for (void* p : it->buffers) if (p) pool_[sizes_[p]].push_back(p);
    it = retiring_.erase(it);
  }
}

GpuStaging::~GpuStaging() {
  // Errors are ignored here: at process exit the CUDA runtime may already be gone.
  for (auto& kv : streams_) api_->stream_sync(kv.second);
  for (auto& r : retiring_) api_->event_destroy(r.event);
  for (auto& kv : sizes_) api_->host_free(kv.first);
  for (auto& kv : device_sizes_) api_->device_free(kv.first);
  for (auto& kv : streams_) api_->stream_destroy(kv.second);
}

// ---- The runtime's GPU steps (declared in runtime.h) ----

void Runtime::StageGpu(const EntryPtr& e, std::vector<Request>* to_coordinator) {
  if (!gpu_) gpu_ = std::make_unique<GpuStaging>(e->gpu->api);
  GpuOp& g = *e->gpu;
  const int op = e->sig.op, dt = e->sig.dtype;
  // The path follows from this rank's settings alone and is part of the signature, so
  // ranks that disagree get the same mismatch error. NCCL takes the collectives it can
  // sum, and neighbor ops (device_plane.h); a CUDA-aware MPI takes neighbor ops.
  const bool neighbor = op == SHOAL_OP_NEIGHBOR_ALLREDUCE || op == SHOAL_OP_NEIGHBOR_ALLGATHER;
  const bool nccl = cfg_.gpu_backend == "nccl" && g.api->has_nccl;
  if (neighbor) {
    g.direct = nccl || (cfg_.cuda_aware_mpi && g.api->mpi_cuda_aware(nullptr));
    e->sig.path = !g.direct ? kPathStaged : nccl ? kPathNccl : kPathMpi;
  } else {  // a process set's collectives are staged (NCCL's communicators here span every rank)
    g.nccl = nccl && e->set == 0 && (op == SHOAL_OP_BROADCAST || op == SHOAL_OP_ALLGATHER || op == SHOAL_OP_ALLTOALL ||
                      ((op == SHOAL_OP_ALLREDUCE || op == SHOAL_OP_REDUCESCATTER) && dt != SHOAL_INT16 &&
                       dt != SHOAL_BOOL));
    e->sig.path = g.nccl ? kPathNccl : kPathStaged;
  }
  if (std::string(g.api->build).rfind("fake", 0) == 0) e->sig.path |= kFakePlugin;
  std::string why;
  if (g.direct && !device_plane_.Bind(g.api, g.device, gpu_.get(), &why)) {
    // Refused like a bad argument at the call: the peers get the same error.
    e->reject = std::string(OpName(op)) + ": " + why;
    e->reject_code = SHOAL_INVALID_ARGUMENT;
    g.direct = false;
    Route(e, to_coordinator);
    return Finish(e, Status::Error(SHOAL_INVALID_ARGUMENT, e->reject));
  }
  Status st = gpu_->Start(e);
  if (!st.ok()) Finish(e, st);
}

bool Runtime::PollGpu(std::vector<Request>* to_coordinator) {
  if (!gpu_) return false;
  std::vector<std::pair<EntryPtr, Status>> failed;
  auto ready = gpu_->Ready(&failed);
  for (auto& e : ready) Route(e, to_coordinator);
  for (auto& f : failed) Finish(f.first, f.second);
  bool nccl_done = false;
  for (auto& kv : nccl_) nccl_done |= kv.second->Progress();
  std::vector<std::pair<EntryPtr, Status>> device_done;
  bool device = device_plane_.Poll(&device_done);
  for (auto& d : device_done) Finish(d.first, d.second);
  gpu_->Retire();
  return !ready.empty() || !failed.empty() || nccl_done || device;
}

Status Runtime::CompleteGpu(Entry& e, const Status& st) { return gpu_ ? gpu_->Complete(e, st) : st; }

void Runtime::RunOnDevice(const Response& r, const std::vector<EntryPtr>& batch) {
  const WorldInfo& w = world();
  const int device = batch[0]->gpu->device;
  auto& engine = nccl_[device];
  if (!engine) engine = std::make_unique<NcclBackend>(backend_.get(), gpu_.get(), batch[0]->gpu->api, device);
  const char* err = nullptr;
  void* stream = gpu_->Stream(device, &err);
  for (const EntryPtr& e : batch) {
    const GpuOp& g = *e->gpu;
    auto done = [this, e](const Status& st) {
      e->t_comm_end = Clock::now();
      if (st.ok()) return Finish(e, st);
      Finish(e, Status::Error(st.code, std::string(OpName(e->sig.op)) + " '" + e->name + "': " + st.message));
    };
    if (err) {
      done(Status::Error(SHOAL_ABORTED, std::string("CUDA: ") + err));
      continue;
    }
    if (g.device != device) {
      done(Status::Error(SHOAL_ABORTED, "NCCL: tensors of one fused batch are on different devices"));
      continue;
    }
    const int dtype = e->sig.dtype, scope = e->sig.scope;
    if (r.op == SHOAL_OP_ALLTOALL) {  // the result in host memory, as on the CPU path
      std::vector<int64_t> send, recv;
      bool any = false;
      const std::string bad = AlltoallCounts(r, *e, w.size, w.rank, &send, &recv, &any);
      if (!bad.empty()) done(Status::Error(SHOAL_ABORTED, "internal error: " + bad));
      else if (!any) done(Status::Ok());
      else engine->Alltoallv(g.dev_in, send, e->result, recv, dtype, done);
      continue;
    }
    if (r.op == SHOAL_OP_ALLGATHER || r.op == SHOAL_OP_REDUCESCATTER) {
      // Results in host memory, as on the CPU path (the binding moves them).
      std::vector<int64_t> counts = r.op == SHOAL_OP_ALLGATHER ? GatherCounts(*e, r.first_dims[0]) : ScatterCounts(*e, w.size, w.rank);
      if (e->count() == 0 && r.op == SHOAL_OP_REDUCESCATTER) {
        done(Status::Ok());
        continue;
      }
      if (e->result_nbytes == 0) {
        done(Status::Ok());
        continue;
      }
      if (r.op == SHOAL_OP_ALLGATHER) engine->Allgatherv(g.dev_in, e->count(), e->result, counts, dtype, done);
      else engine->ReduceScatter(g.dev_in, e->result, counts, dtype, e->sig.reduce_op, done);
      continue;
    }
    const int me = scope == SHOAL_SCOPE_MACHINE ? w.local_rank : w.rank;
    const bool copy = g.dev_out != g.dev_in && g.nbytes && (r.op == SHOAL_OP_ALLREDUCE || me == e->sig.root_rank);
    const char* e_copy = copy ? gpu_->api()->memcpy_async(g.dev_out, g.dev_in, g.nbytes, stream) : nullptr;
    if (e_copy || e->count() == 0) {
      done(e_copy ? Status::Error(SHOAL_ABORTED, std::string("CUDA: ") + e_copy) : Status::Ok());
    } else if (r.op == SHOAL_OP_BROADCAST) {
      engine->Broadcast(g.dev_out, e->count(), dtype, e->sig.root_rank, scope, done);
    } else {
      engine->Allreduce(g.dev_out, e->count(), dtype, e->sig.reduce_op, scope, done);
    }
  }
}

}  // namespace shoal
