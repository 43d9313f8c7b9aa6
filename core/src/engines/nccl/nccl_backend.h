// NCCL as an engine behind the Collectives interface (engines/backend.h), for the CUDA tensors of
// one device (SHOAL_GPU_BACKEND=nccl): each call runs on the core's stream of that device
// (GpuStaging::Stream), in the order the calls are made, which negotiation makes the same on
// every rank. One communicator per scope (world, machine), set up at first use without
// blocking the driver: the scope's rank 0 creates the id (or fails to) and broadcasts it,
// with the error if any, over the control engine (MPI); ranks join on a helper thread, and
// calls made meanwhile wait in order. Allreduce also takes AVERAGE (sum, then divide on the
// device), and with Horovod's scaling (floating dtypes) multiplies the input by a prescale and
// the result by a postscale on the device, as the CPU path (ops/fusion.h); gathers and
// alltoall leave their result in host memory, through pinned buffers. Destroyed
// (aborted, with work outstanding) by Stop. Driver only.
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

#include "engines/backend.h"
#include "gpu/staging.h"

namespace shoal {

class NcclBackend : public Collectives {
 public:
  // `control` carries the NCCL ids; `gpu` owns the device's stream and buffer pools.
  NcclBackend(Backend* control, GpuStaging* gpu, const shoal_cuda_api* api, int device)
      : control_(control), gpu_(gpu), api_(api), device_(device) {}
  ~NcclBackend() override { Stop(); }

  void Allreduce(void* buf, int64_t count, int dtype, int reduce_op, int scope, Callback done) override {
    Allreduce(buf, count, dtype, reduce_op, scope, 1.0, 1.0, std::move(done));
  }
  // With Horovod's scaling: `buf` times `prescale` first, the result times `postscale`.
  void Allreduce(void* buf, int64_t count, int dtype, int reduce_op, int scope, double prescale, double postscale,
                 Callback done);
  void Broadcast(void* buf, int64_t count, int dtype, int root, int scope, Callback done) override;
  void Allgatherv(const void* send, int64_t count, void* recv, const std::vector<int64_t>& counts, int dtype,
                  Callback done) override;
  void ReduceScatter(const void* send, void* recv, const std::vector<int64_t>& counts, int dtype, int reduce_op,
                     Callback done) override {
    ReduceScatter(send, recv, counts, dtype, reduce_op, 1.0, 1.0, std::move(done));
  }
  // With Horovod's scaling: a scaled copy of `send` reduced, the result times `postscale`.
  void ReduceScatter(const void* send, void* recv, const std::vector<int64_t>& counts, int dtype, int reduce_op,
                     double prescale, double postscale, Callback done);
  void Alltoallv(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                 const std::vector<int64_t>& recv_counts, int dtype, Callback done) override;
  bool Progress() override;
  size_t num_in_flight() const override;
  void Stop();

 private:
  // One call on the stream: what to return to the pools and to copy to host memory once
  // its event has completed, then `done`.
  struct Call {
    void* event = nullptr;
    void* comm = nullptr;
    std::vector<void*> device_buffers, pinned;
    std::vector<std::tuple<void*, void*, size_t>> host_copies;  // (pinned, destination, bytes)
    Callback done;
  };
  // Enqueues its work on (comm, stream), filling the Call; returns an error or null.
  using Issue = std::function<const char*(void* comm, void* stream, Call* call)>;
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
    std::vector<std::pair<Issue, Callback>> parked;  // in call order
  };
  void Submit(int scope, Issue issue, Callback done);
  void Run(void* comm, const Issue& issue, Callback done);
  void StartComm(Comm& c, int scope);
  bool AdvanceComms();
  // A device buffer of at least n bytes for the call, and a pinned copy of it to `dst`
  // (host) after the work enqueued so far.
  void* Temp(Call* call, size_t n, const char** err);
  const char* CopyToHost(Call* call, void* dst, const void* src, size_t n, void* stream);

  Backend* control_;
  GpuStaging* gpu_;
  const shoal_cuda_api* api_;
  int device_;
  std::map<int, Comm> comms_;  // by scope
  std::vector<Call> in_flight_;
};

}  // namespace shoal
