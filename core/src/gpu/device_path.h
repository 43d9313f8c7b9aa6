// The CUDA tensors' path through the runtime: staging to host memory and back (GpuStaging),
// the device data plane of neighbor ops (DevicePlane), and collectives on the device by NCCL
// (one NcclBackend per device). Which path an op takes follows from this rank's settings
// alone and is part of its signature, so ranks that disagree get the same mismatch error.
// Driver only.
#pragma once
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "common/config.h"
#include "engines/nccl/nccl_backend.h"
#include "gpu/staging.h"
#include "negotiation/coordinator.h"
#include "neighbor/device_plane.h"

namespace shoal {

class DevicePath {
 public:
  // What the device path needs of the runtime that runs it.
  class Host {
   public:
    // An op whose data is ready (staged, or on its device): on to negotiation or its neighbors.
    virtual void Route(const EntryPtr& e, std::vector<Request>* to_coordinator) = 0;
    virtual void Finish(const EntryPtr& e, const Status& st) = 0;

   protected:
    ~Host() = default;
  };

  DevicePath(Host* host, const Config& cfg, Backend* backend, Stats* stats)
      : host_(host), cfg_(cfg), backend_(backend), plane_(backend, stats) {}

  DevicePlane* plane() { return &plane_; }  // the neighbor exchange moves device data through it
  // A CUDA op at its first cycle: picks its path, starts its staging (or refuses it).
  void Stage(const EntryPtr& e, std::vector<Request>* to_coordinator);
  // Staged ops on to Route; NCCL and device-plane completions: whether anything moved.
  bool Poll(std::vector<Request>* to_coordinator);
  // A negotiated batch of collectives of CUDA tensors on their device, by NCCL.
  void Run(const Response& r, const std::vector<EntryPtr>& batch);
  // Before `e` completes with `st`: the result copied back (its status on failure).
  Status Complete(Entry& e, const Status& st);
  bool Busy() const;      // something in flight on a device
  bool Idle() const { return !gpu_ || gpu_->Idle(); }  // nothing staging
  int CurrentDevice() const { return gpu_ ? gpu_->CurrentDevice() : -1; }
  void RestoreDevice(int device) const {
    if (device >= 0) gpu_->RestoreDevice(device);
  }
  void Stop();

 private:
  Host* host_;
  const Config& cfg_;
  Backend* backend_;
  DevicePlane plane_;
  std::unique_ptr<GpuStaging> gpu_;                   // created at the first CUDA tensor
  std::map<int, std::unique_ptr<NcclBackend>> nccl_;  // by device
};

}  // namespace shoal
