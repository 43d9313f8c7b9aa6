// CUDA tensors in the core (libshoal.so side): the lazily loaded CUDA plugin and the
// host-staged data path through the MPI engine.
//
// At enqueue (user thread) the core records an event on the caller's stream, so it
// knows the point the producer reached without any synchronisation. The background
// thread then, on its own non-blocking stream per device, waits for that event, copies
// the tensor to pinned host memory and, once the copy is done, hands the entry to the
// unchanged CPU path (negotiation, fusion, MPI, combine). At completion it copies the
// result back on its stream and makes the caller's stream wait for that copy: the
// caller's later work is ordered after it, with no device-wide synchronisation.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cuda_plugin/cuda_api.h"
#include "runtime/entry.h"

namespace shoal {

// The plugin (libshoal_cuda.so beside libshoal.so, or as $SHOAL_CUDA_PLUGIN says), loaded
// once per process; nullptr and *why when it is missing or does not load.
const shoal_cuda_api* CudaPlugin(std::string* why);
// The file CudaPlugin loads (whether or not it is there).
std::string CudaPluginPath();

// Per-entry GPU state; the device pointers stay here while the entry works on host copies.
struct GpuOp {
  const shoal_cuda_api* api = nullptr;
  int device = 0;
  void* user_stream = nullptr;  // NULL: the legacy default stream
  void* ready = nullptr;        // the producer's point on the caller's stream
  bool own_ready = false;       // created by the core (else the caller's event, kept alive by it)
  void* dev_in = nullptr;
  void* dev_out = nullptr;
  size_t nbytes = 0;
  void* host_in = nullptr;
  void* host_out = nullptr;
  void* staged = nullptr;  // recorded after the device->host copy
  bool started = false, on_host = false, finished = false;
  bool nccl = false;    // a collective run by NCCL on the device pointers (no host copies)
  bool direct = false;  // a neighbor op whose data moves from device memory (neighbor/device_plane.h)
  ~GpuOp();
};

// Enqueue: validates a CUDA tensor and captures its producer's point. Throws
// ArgumentError when GPU support is unavailable or the tensors disagree on the device.
std::shared_ptr<GpuOp> CaptureGpuOp(const shoal_op_desc& d, size_t nbytes);

// Progress driver only (and Stop, after the driver has left). The driver may be a user
// thread, whose current device Runtime::Drive restores after each cycle.
class GpuStaging {
 public:
  explicit GpuStaging(const shoal_cuda_api* api) : api_(api) {}
  const shoal_cuda_api* api() const { return api_; }
  ~GpuStaging();
  // Queues the wait for the producer and the device->host copy.
  Status Start(const EntryPtr& e);
  // Entries whose host copies are complete, now pointing at host memory; entries whose
  // copy failed go to *failed.
  std::vector<EntryPtr> Ready(std::vector<std::pair<EntryPtr, Status>>* failed);
  // At completion: copies the host result back (ops with a tensor output, on success)
  // and makes the caller's stream wait for it. Returns `st`, or the CUDA error.
  Status Complete(Entry& e, const Status& st);
  // Returns host buffers whose copies have finished to the pool.
  void Retire();
  bool Idle() const { return staging_.empty(); }
  // The calling thread's current device, and putting it back after a cycle.
  int CurrentDevice() const { return api_->get_device(); }
  void RestoreDevice(int device) const { api_->set_device(device); }
  // The core's stream on `device` (made current); nullptr and *err on failure.
  void* Stream(int device, const char** err);
  // Pooled pinned host memory of at least n bytes, and giving it back.
  void* HostBuffer(size_t n, const char** err);
  void ReturnHostBuffer(void* p) { pool_[sizes_[p]].push_back(p); }
  // Pooled device memory likewise: cudaFree would synchronise the device.
  void* DeviceBuffer(int device, size_t n, const char** err);
  void ReturnDeviceBuffer(void* p) { device_pool_[device_sizes_[p]].push_back(p); }

 private:
  Status Err(const char* msg) const;

  const shoal_cuda_api* api_;
  std::map<int, void*> streams_;
  std::map<size_t, std::vector<void*>> pool_;  // free pinned buffers by power-of-two size
  std::map<void*, size_t> sizes_;             // every pinned buffer and its size
  std::map<std::pair<int, size_t>, std::vector<void*>> device_pool_;  // by (device, size)
  std::map<void*, std::pair<int, size_t>> device_sizes_;
  std::vector<EntryPtr> staging_;
  struct Retiring {
    void* event;
    std::vector<void*> buffers;
  };
  std::vector<Retiring> retiring_;
};

}  // namespace shoal
