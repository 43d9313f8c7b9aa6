#include "gpu/staging.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>

#include "common/config.h"

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
  const std::string choice = Config::CudaPlugin();
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
      const std::string chosen = Config::CudaPlugin();
      if (!chosen.empty() && chosen != "real")
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

}  // namespace shoal
