// Streams of the fake device plugin (libshoal_cuda_fake.so, tests only; docs/design.md
// §12), shared by its runtime part (fake_plugin.cc) and its NCCL part (fake_nccl.cc).
#pragma once
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "cuda_plugin/cuda_api.h"

namespace shoal_fake {

// Keeps `msg` in a per-thread buffer and returns it, as the real plugin's errors.
shoal_cuda_error Fail(std::string msg);

int DeviceCount();

// A CUDA stream stand-in. A created stream is an in-order queue run asynchronously by
// its own worker thread, which sleeps SHOAL_FAKE_STREAM_DELAY_US before each item so
// that reading a result without the event wait or sync sees the old data. A device's
// legacy default stream (NULL) is the host timeline instead: what is queued on it runs
// on the calling thread at once and a wait on it blocks the caller. That is where torch
// CPU ops (producers and consumers of tensors marked as fake-device tensors) run.
//
// Work returns "" or an error; an error fails the stream like a faulted kernel: it is
// sticky, later work is not run (`skipped` is called instead) and every event recorded
// after it reports it.
class Stream {
 public:
  using Work = std::function<std::string()>;
  static std::shared_ptr<Stream> Create(int device, bool host);
  int device() const { return device_; }
  bool host() const { return host_; }
  // Queues `run`; returns its ticket (1, 2, ...).
  uint64_t Enqueue(Work run, std::function<void()> skipped = {});
  // The last ticket queued: what an event recorded now stands for.
  uint64_t Position();
  // Whether everything up to `ticket` has run; a failure at or before it goes to *err
  // (and counts as reached).
  bool Reached(uint64_t ticket, std::string* err);
  // Blocks until `ticket` is reached; returns "" or the failure.
  std::string Wait(uint64_t ticket);
  // The worker runs what is queued, then exits (cudaStreamDestroy returns at once too).
  void Close();

 private:
  Stream(int device, bool host) : device_(device), host_(host) {}
  void Run(std::shared_ptr<Stream> self);
  struct Item {
    uint64_t ticket;
    Work run;
    std::function<void()> skipped;
  };
  const int device_;
  const bool host_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Item> queue_;  // FIFO; the worker swaps it out
  uint64_t queued_ = 0, done_ = 0, failed_at_ = 0;
  std::string error_;
  bool closed_ = false;
};

// The stream behind a handle; NULL is the current device's legacy default stream.
// nullptr and *err for an unknown handle.
std::shared_ptr<Stream> FindStream(void* handle, shoal_cuda_error* err);

// The NCCL entries (fake_nccl.cc).
void FillNccl(shoal_cuda_api* api);

}  // namespace shoal_fake
