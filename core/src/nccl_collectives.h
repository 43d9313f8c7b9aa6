// NCCL collectives of CUDA tensors (SHOAL_GPU_BACKEND=nccl): allreduce, broadcast and
// allgather of a negotiated batch run on the device pointers, on the core's stream, in the
// order negotiation gave every rank. One communicator per (scope, device), set up at first
// use without blocking the driver (rank 0's id, or its failure, travels over MPI; ranks join
// on a helper thread; batches wait in order) and destroyed (aborted, with work
// outstanding) at Stop. Driver only.
#pragma once
#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "backend.h"
#include "coordinator.h"
#include "entry.h"
#include "gpu.h"

namespace shoal {

class NcclCollectives {
 public:
  using FinishFn = std::function<void(const EntryPtr&, const Status&)>;
  // `backend` carries the NCCL ids (MPI); `finish` completes an entry.
  NcclCollectives(Backend* backend, FinishFn finish) : backend_(backend), finish_(std::move(finish)) {}
  // Runs (or queues, while its communicator is being set up) one negotiated batch.
  void Run(const Response& r, const std::vector<EntryPtr>& batch, GpuStaging* gpu);
  // Communicators set up, batches done: true if anything happened.
  bool Poll();
  bool Idle() const;
  void Stop();

 private:
  struct Batch {
    void* event;
    void* comm;
    std::vector<EntryPtr> batch;
    std::vector<void*> device_buffers;
    std::vector<std::tuple<void*, void*, size_t>> host_copies;  // (pinned, result, bytes) at completion
  };
  struct Comm {
    struct Setup {
      std::thread thread;
      std::atomic<bool> done{false};
      void* comm = nullptr;
      std::string error;
      bool retry = false;
    };
    bool started = false, retry = false;
    void* comm = nullptr;
    std::string error;
    std::shared_ptr<Setup> setup;
    std::vector<std::pair<Response, std::vector<EntryPtr>>> parked;  // in negotiated order
  };
  std::map<std::pair<int, int>, Comm> comms_;  // (scope, device)
  std::vector<Batch> in_flight_;
  void StartComm(Comm& c, int scope, int device);
  bool AdvanceComms();

  Backend* backend_;
  FinishFn finish_;
  GpuStaging* gpu_ = nullptr;
};

}  // namespace shoal
