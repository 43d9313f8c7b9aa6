// libshoal_cuda_fake.so: the CUDA plugin's table (cuda_api.h) on the CPU, for tests only
// (docs/design.md §12): SHOAL_CUDA_PLUGIN=fake makes libshoal.so load it instead of the
// real plugin, so the GPU code path (events, streams, staging, NCCL) runs in CI at many
// ranks. N fake devices (SHOAL_FAKE_DEVICES, default 8) share host memory; streams run
// asynchronously (fake_stream.h); the kernels are the core's own CPU loops (common/reduce.h),
// with the real kernels' argument rules; the NCCL entries run over MPI (fake_nccl.cc).
// Misuse that CUDA reports is reported too: unknown handles, events recorded on another
// device's stream, frees of pointers it did not allocate, non-floating kernel dtypes.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <thread>

#include "common/common.h"
#include "testing/fake_stream.h"
#include "cuda_plugin/plugin_table.h"
#include "common/reduce.h"

namespace shoal_fake {

shoal_cuda_error Fail(std::string msg) { return KeepError(std::move(msg)); }

namespace {

int EnvInt(const char* name, int fallback, int lo, int hi) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  return *end || x < lo || x > hi ? fallback : static_cast<int>(x);
}

const int kDevices = EnvInt("SHOAL_FAKE_DEVICES", 8, 1, 1024);
std::atomic<int> delay_us{EnvInt("SHOAL_FAKE_STREAM_DELAY_US", 100, 0, 10000000)};
thread_local int current_device = 0;  // as CUDA's: per host thread

struct Event {
  int device;
  std::shared_ptr<Stream> stream;  // null until recorded: queries as complete, as in CUDA
  uint64_t ticket = 0;
};

struct Allocation {
  size_t nbytes;
  bool host;
};

// Every live handle, so a stale or foreign one is an error instead of a crash. Leaked on
// purpose: worker threads may outlive static destruction at process exit.
struct Registry {
  std::mutex mu;
  std::map<void*, std::shared_ptr<Stream>> streams;
  std::vector<std::shared_ptr<Stream>> defaults;  // per device, the legacy default stream
  std::map<void*, std::shared_ptr<Event>> events;
  std::map<void*, Allocation> allocations;
};

Registry& Reg() {
  static Registry* r = [] {
    auto* x = new Registry;
    for (int d = 0; d < kDevices; ++d) x->defaults.push_back(Stream::Create(d, true));
    return x;
  }();
  return *r;
}

shoal_cuda_error BadDevice(const char* what, int device) {
  return Fail(std::string(what) + ": invalid device ordinal " + std::to_string(device) + " (" +
              std::to_string(kDevices) + " fake devices, SHOAL_FAKE_DEVICES)");
}

#define FAKE_TRY(expr)                               \
  do {                                               \
    if (shoal_cuda_error e_ = (expr)) return e_;     \
  } while (0)

shoal_cuda_error CheckDevice(const char* what, int device) {
  return device >= 0 && device < kDevices ? nullptr : BadDevice(what, device);
}

std::shared_ptr<Event> FindEvent(void* e, const char* what, shoal_cuda_error* err) {
  Registry& r = Reg();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.events.find(e);
  if (it != r.events.end()) return it->second;
  *err = Fail(std::string(what) + ": invalid resource handle (unknown event)");
  return nullptr;
}

// Queues `work` on the stream behind `handle`.
shoal_cuda_error Launch(void* handle, Stream::Work work) {
  shoal_cuda_error err = nullptr;
  auto s = FindStream(handle, &err);
  if (s) s->Enqueue(std::move(work));
  return err;
}

// Exceptions of the core's loops (bad dtype) become the stream's error.
template <typename F> Stream::Work Guarded(const char* what, F f) {
  return [what, f]() -> std::string {
    try {
      f();
      return "";
    } catch (const std::exception& ex) {
      return std::string(what) + ": " + ex.what();
    }
  };
}

int DeviceCountApi(const char** why) {
  (void)why;
  return kDevices;
}

shoal_cuda_error SetDevice(int device) {
  FAKE_TRY(CheckDevice("cudaSetDevice", device));
  current_device = device;
  return nullptr;
}

int GetDevice() { return current_device; }

shoal_cuda_error StreamCreate(int device, void** stream) {
  FAKE_TRY(CheckDevice("cudaStreamCreate", device));
  auto s = Stream::Create(device, false);
  Registry& r = Reg();
  std::lock_guard<std::mutex> lock(r.mu);
  r.streams[s.get()] = s;
  *stream = s.get();
  return nullptr;
}

shoal_cuda_error StreamDestroy(void* stream) {
  std::shared_ptr<Stream> s;
  {
    Registry& r = Reg();
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.streams.find(stream);
    if (it == r.streams.end()) return Fail("cudaStreamDestroy: invalid resource handle");
    s = it->second;
    r.streams.erase(it);
  }
  s->Close();
  return nullptr;
}

shoal_cuda_error StreamSync(void* stream) {
  shoal_cuda_error err = nullptr;
  auto s = FindStream(stream, &err);
  if (!s) return err;
  std::string e = s->Wait(s->Position());
  return e.empty() ? nullptr : Fail(e);
}

shoal_cuda_error StreamWaitEvent(void* stream, void* event) {
  shoal_cuda_error err = nullptr;
  auto s = FindStream(stream, &err);
  auto ev = s ? FindEvent(event, "cudaStreamWaitEvent", &err) : nullptr;
  if (!ev) return err;
  std::shared_ptr<Stream> src;
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> lock(Reg().mu);  // the event's latest record, as CUDA
    src = ev->stream;
    ticket = ev->ticket;
  }
  if (!src) return nullptr;  // never recorded: nothing to wait for
  if (s->host()) {
    std::string e = src->Wait(ticket);
    return e.empty() ? nullptr : Fail(e);
  }
  s->Enqueue([src, ticket]() -> std::string {
    std::string e = src->Wait(ticket);
    return e.empty() ? e : "waited for an event of a failed stream: " + e;
  });
  return nullptr;
}

shoal_cuda_error EventCreate(int device, void** event) {
  FAKE_TRY(CheckDevice("cudaEventCreate", device));
  auto ev = std::make_shared<Event>();
  ev->device = device;
  Registry& r = Reg();
  std::lock_guard<std::mutex> lock(r.mu);
  r.events[ev.get()] = ev;
  *event = ev.get();
  return nullptr;
}

shoal_cuda_error EventDestroy(void* event) {
  Registry& r = Reg();
  std::lock_guard<std::mutex> lock(r.mu);
  // Destroying a recorded event is fine in CUDA: waits already queued keep their ticket.
  if (!r.events.erase(event)) return Fail("cudaEventDestroy: invalid resource handle");
  return nullptr;
}

shoal_cuda_error EventRecord(void* event, void* stream) {
  shoal_cuda_error err = nullptr;
  auto s = FindStream(stream, &err);
  auto ev = s ? FindEvent(event, "cudaEventRecord", &err) : nullptr;
  if (!ev) return err;
  if (ev->device != s->device())
    return Fail("cudaEventRecord: invalid resource handle (an event of fake device " + std::to_string(ev->device) +
                " recorded on a stream of device " + std::to_string(s->device()) + ")");
  std::lock_guard<std::mutex> lock(Reg().mu);
  ev->stream = s;
  ev->ticket = s->Position();
  return nullptr;
}

shoal_cuda_error Capture(int device, void* stream, void** event) {
  const int prev = current_device;  // the user's thread: leave its device as it was
  shoal_cuda_error err = SetDevice(device);
  if (!err) err = EventCreate(device, event);
  if (!err && (err = EventRecord(*event, stream))) {
    std::string keep = err;
    EventDestroy(*event);
    err = Fail(keep);
  }
  current_device = prev;
  return err;
}

shoal_cuda_error EventQuery(void* event, int* done) {
  shoal_cuda_error err = nullptr;
  auto ev = FindEvent(event, "cudaEventQuery", &err);
  if (!ev) return err;
  std::shared_ptr<Stream> src;
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> lock(Reg().mu);
    src = ev->stream;
    ticket = ev->ticket;
  }
  std::string e;
  *done = !src || src->Reached(ticket, &e) ? 1 : 0;
  return e.empty() ? nullptr : Fail(e);
}

shoal_cuda_error MemcpyAsync(void* dst, const void* src, size_t n, void* stream) {
  if (n && (!dst || !src)) return Fail("cudaMemcpyAsync: invalid argument (null pointer)");
  return Launch(stream, [=]() -> std::string {
    std::memmove(dst, src, n);
    return "";
  });
}

shoal_cuda_error Alloc(size_t n, bool host, void** p) {
  // 256-byte aligned like cudaMalloc; filled with a pattern so reading memory nobody
  // wrote shows up as garbage, not as zeros.
  const size_t size = (std::max<size_t>(n, 1) + 255) / 256 * 256;
  void* q = std::aligned_alloc(256, size);
  if (!q) return Fail(host ? "cudaHostAlloc: out of memory" : "cudaMalloc: out of memory");
  std::memset(q, 0xa5, size);
  Registry& r = Reg();
  std::lock_guard<std::mutex> lock(r.mu);
  r.allocations[q] = {n, host};
  *p = q;
  return nullptr;
}

// cudaFree and cudaFreeHost wait for the device's work; here, for every stream.
shoal_cuda_error Free(void* p, bool host) {
  if (!p) return nullptr;
  std::vector<std::shared_ptr<Stream>> all;
  {
    Registry& r = Reg();
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.allocations.find(p);
    if (it == r.allocations.end() || it->second.host != host)
      return Fail(host ? "cudaFreeHost: invalid argument (not allocated by cudaHostAlloc)"
                       : "cudaFree: invalid device pointer (not allocated by cudaMalloc)");
    r.allocations.erase(it);
    for (auto& kv : r.streams) all.push_back(kv.second);
  }
  for (auto& s : all) s->Wait(s->Position());
  std::free(p);
  return nullptr;
}

shoal_cuda_error HostAlloc(size_t n, void** p) { return Alloc(n, true, p); }
shoal_cuda_error HostFree(void* p) { return Free(p, true); }
shoal_cuda_error DeviceAlloc(int device, size_t n, void** p) {
  FAKE_TRY(SetDevice(device));
  return Alloc(n, false, p);
}
shoal_cuda_error DeviceFree(void* p) { return Free(p, false); }

// The real kernels take floating dtypes only: so does the fake, or the core could rely
// on something only the fake does.
shoal_cuda_error CheckFloating(int dtype) {
  if (dtype >= SHOAL_FLOAT16 && dtype <= SHOAL_FLOAT64) return nullptr;
  return Fail("GPU kernels take floating dtypes only (dtype code " + std::to_string(dtype) + ")");
}

constexpr int kMaxSources = 128;  // as the real combine kernel

shoal_cuda_error Combine(void* out, const void* self, const void* const* srcs, const double* weights, int n_src,
                         int uniform, double self_weight, int dtype, int64_t n, void* stream) {
  if (n_src < 0 || n_src > kMaxSources)
    return Fail("GPU combine: " + std::to_string(n_src) + " sources (at most " + std::to_string(kMaxSources) + ")");
  FAKE_TRY(CheckFloating(dtype));
  if (n <= 0) return nullptr;
  // Copied now, as kernel arguments are at launch: the caller's arrays may go away.
  std::vector<const void*> s(srcs, srcs + n_src);
  std::vector<double> w(n_src, 1.0);
  if (weights) w.assign(weights, weights + n_src);
  return Launch(stream, Guarded("combine kernel", [=] {
    shoal::Combine(self, s, out, dtype, static_cast<size_t>(n), uniform != 0, self_weight, w);
  }));
}

shoal_cuda_error Scale(void* dst, const void* src, double factor, int divide, int dtype, int64_t n, void* stream) {
  FAKE_TRY(CheckFloating(dtype));
  if (n <= 0) return nullptr;
  return Launch(stream, Guarded("scale kernel", [=] {
    if (divide) shoal::Divide(src, dst, dtype, static_cast<size_t>(n), factor);
    else shoal::Scale(src, dst, dtype, static_cast<size_t>(n), factor);
  }));
}

shoal_cuda_error Pack(void* fused, void* const* parts, const int64_t* offsets, const int64_t* nbytes, int n_parts,
                      int unpack, void* stream) {
  if (n_parts <= 0) return nullptr;
  std::vector<char*> p(n_parts);
  for (int k = 0; k < n_parts; ++k) p[k] = static_cast<char*>(parts[k]);
  std::vector<int64_t> off(offsets, offsets + n_parts), len(nbytes, nbytes + n_parts);
  char* f = static_cast<char*>(fused);
  return Launch(stream, [=]() -> std::string {
    for (int k = 0; k < n_parts; ++k) {
      if (unpack) std::memcpy(p[k], f + off[k], len[k]);
      else std::memcpy(f + off[k], p[k], len[k]);
    }
    return "";
  });
}

// Fake devices are host memory, so any MPI moves them: SHOAL_FAKE_CUDA_AWARE_MPI=1 makes the
// fake say its MPI is CUDA-aware, to test the direct path.
int MpiCudaAware(const char** how) {
  const char* env = std::getenv("SHOAL_FAKE_CUDA_AWARE_MPI");
  const int yes = env && std::string(env) == "1";
  if (how) *how = yes ? "yes: fake devices are host memory (SHOAL_FAKE_CUDA_AWARE_MPI=1)"
                      : "no: the fake plugin says so unless SHOAL_FAKE_CUDA_AWARE_MPI=1";
  return yes;
}

shoal_cuda_api MakeTable() {
  shoal_cuda_api t{};
  t.abi_version = SHOAL_CUDA_ABI_VERSION;
  static const std::string build = "fake CPU devices for tests (" + std::to_string(kDevices) +
                                   ", SHOAL_FAKE_DEVICES; streams on worker threads, " + std::to_string(delay_us.load()) +
                                   " us per op); NCCL backend faked over MPI, ordering rules checked";
  t.build = build.c_str();
  SHOAL_FILL_CUDA_TABLE(t, DeviceCountApi);
  return t;
}

}  // namespace

int DeviceCount() { return kDevices; }

std::shared_ptr<Stream> FindStream(void* handle, shoal_cuda_error* err) {
  Registry& r = Reg();
  std::lock_guard<std::mutex> lock(r.mu);
  if (!handle) return r.defaults[current_device];
  auto it = r.streams.find(handle);
  if (it != r.streams.end()) return it->second;
  *err = Fail("invalid resource handle (unknown stream)");
  return nullptr;
}

// ---- Stream ----

std::shared_ptr<Stream> Stream::Create(int device, bool host) {
  std::shared_ptr<Stream> s(new Stream(device, host));
  // The worker holds the stream until it has drained the queue after Close().
  if (!host) std::thread([s] { s->Run(s); }).detach();
  return s;
}

uint64_t Stream::Enqueue(Work run, std::function<void()> skipped) {
  std::unique_lock<std::mutex> lock(mu_);
  const uint64_t ticket = ++queued_;
  if (!host_) {
    queue_.push_back({ticket, std::move(run), std::move(skipped)});
    cv_.notify_all();
    return ticket;
  }
  // The host timeline: run now, on the caller.
  const bool failed = failed_at_ != 0;
  lock.unlock();
  std::string e;
  if (failed) {
    if (skipped) skipped();
  } else {
    e = run();
  }
  lock.lock();
  if (!e.empty() && !failed_at_) {
    failed_at_ = ticket;
    error_ = e;
  }
  done_ = std::max(done_, ticket);  // callers on several threads may finish out of order
  cv_.notify_all();
  return ticket;
}

uint64_t Stream::Position() {
  std::lock_guard<std::mutex> lock(mu_);
  return queued_;
}

bool Stream::Reached(uint64_t ticket, std::string* err) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_at_ && failed_at_ <= ticket) {
    *err = error_;
    return true;
  }
  return done_ >= ticket;
}

std::string Stream::Wait(uint64_t ticket) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return done_ >= ticket || (failed_at_ && failed_at_ <= ticket); });
  return failed_at_ && failed_at_ <= ticket ? error_ : std::string();
}

void Stream::Close() {
  std::lock_guard<std::mutex> lock(mu_);
  closed_ = true;
  cv_.notify_all();
}

void Stream::Run(std::shared_ptr<Stream> self) {
  std::vector<Item> batch;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return !queue_.empty() || closed_; });
    if (queue_.empty()) break;  // closed and drained
    batch.swap(queue_);
    for (auto& item : batch) {
      const bool failed = failed_at_ != 0;
      lock.unlock();
      std::string e;
      if (const int us = delay_us.load()) std::this_thread::sleep_for(std::chrono::microseconds(us));
      if (failed) {
        if (item.skipped) item.skipped();
      } else {
        e = item.run();
      }
      const uint64_t ticket = item.ticket;
      item = Item{};  // drop captured state outside the lock
      lock.lock();
      if (!e.empty() && !failed_at_) {
        failed_at_ = ticket;
        error_ = e;
      }
      done_ = ticket;
      cv_.notify_all();
    }
    batch.clear();
  }
  lock.unlock();
  self.reset();
}

}  // namespace shoal_fake

extern "C" __attribute__((visibility("default"))) const shoal_cuda_api* shoal_cuda_plugin(int abi_version) {
  static const shoal_cuda_api table = shoal_fake::MakeTable();
  return abi_version == SHOAL_CUDA_ABI_VERSION ? &table : nullptr;
}

// Test hook (not in the table): sets the delay worker streams sleep before each item, in
// microseconds; returns the previous one.
extern "C" __attribute__((visibility("default"))) int shoal_fake_set_stream_delay_us(int us) {
  return shoal_fake::delay_us.exchange(us);
}
