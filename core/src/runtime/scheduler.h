// The progress driver's half of the runtime. Each cycle (Cycle) it routes the ops taken from
// the queue (to the device path, a cached batch, the neighbors or a coordinator), receives
// every arrived message, applies the coordinators' responses (collectives, neighbor ops,
// join, name retirement), progresses the engines and checks for stalls and ranks that left.
// It owns the state only the driver touches and the feature objects that hold it; an op
// ends in Finish, then in the runtime's Host::Complete (handle, callback).
// Driver only: whoever holds the runtime's driving token (runtime/runtime.h).
#pragma once
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "common/buffer_pool.h"
#include "common/stats.h"
#include "engines/backend.h"
#include "gpu/device_path.h"
#include "negotiation/negotiation.h"
#include "negotiation/response_cache.h"
#include "negotiation/stall_inspector.h"
#include "neighbor/checked_patterns.h"
#include "neighbor/neighbor_exchange.h"
#include "neighbor/sharded_exchange.h"
#include "ops/collectives.h"
#include "ops/groups.h"
#include "ops/join.h"
#include "process_sets/process_sets.h"
#include "process_sets/set_control.h"
#include "runtime/departures.h"
#include "runtime/entry.h"
#include "runtime/submissions.h"

namespace shoal {

class Scheduler final : private Finisher, private Negotiation::Host, private ResponseCache::Host,
                        private DevicePath::Host, private Join::Host {
 public:
  // What the scheduler needs of the runtime around it.
  class Host {
   public:
    // `e` is over with `st` (the scheduler's part done): its handle, waiters and callback.
    virtual void Complete(const EntryPtr& e, const Status& st) = 0;
    // Fails every op not completed, with `code` and "<op> '<name>': <why>".
    virtual void FailAll(const std::string& why, int code) = 0;

   protected:
    ~Host() = default;
  };

  // `generation`: the runtime's (leave and join notices of an earlier one are ignored);
  // `sets`, `set_control`: the runtime's process sets and their changes.
  Scheduler(Host* host, const Config& cfg, Backend* backend, Stats* stats, Submissions* submissions,
            ProcessSets* sets, SetControl* set_control, uint64_t generation);

  // One cycle over `fresh`, the ops taken from the queue; `start_only`: only start them
  // (sends, requests to the coordinators): the enqueuing thread's cycle. True if anything progressed.
  bool Cycle(const std::vector<EntryPtr>& fresh, bool start_only);
  // Something is in flight: an op awaits a response, neighbor data or an engine.
  bool Busy();
  void Finish(const EntryPtr& e, const Status& st) override;
  // This rank leaves: every peer hears of it after the cycle's requests (bounded wait).
  void Leave();
  void Stop();     // the runtime stopped: round buffers outlive it, the device path closes
  void Abandon();  // the cycle failed: forget every op in flight (they are failed elsewhere)

  DevicePath& devices() { return devices_; }
  const Departures& departures() const { return departures_; }  // Message(): any thread
  // Any thread: this rank's join is in flight (it takes part in no new ops; ops/join.h).
  bool Joining() const { return join_.InFlight(); }
  void SetJoining(bool v) { join_.SetInFlight(v); }

  // Process-set changes (process_sets/set_control.h): set `s` is being removed; set `set` is gone.
  void EndSet(const ProcessSet& s);
  void ForgetSet(int set);  // its names, refusals on file, checked patterns, stalls

 private:
  // Routing (runtime/schedule.cc).
  void Route(const EntryPtr& e, std::vector<Request>* to_coordinator) override;
  bool FailIfUnreachable(const EntryPtr& e);
  void Ask(const EntryPtr& e, std::vector<Request>* to_coordinator) override;
  void Renegotiate(const EntryPtr& e) override;
  // Responses.
  void Apply(const Response& r) override;
  void FailAll(const std::string& why, int code) override { host_->FailAll(why, code); }
  // Name retirement (negotiation/names.cc): the vote, the commit, and a vote whose coordinator left.
  void Retire(const Response& r);
  void Thaw(int set, const std::set<std::string>& gone);
  // Stalls and departures.
  void CheckStalls();
  void OnLeave(int rank);
  // Starts the neighbor entries of `ready` (a sharded exchange's stage: its first parts).
  void StartNeighbors(std::vector<EntryPtr>& ready);
  // Starts the parts of sharded exchanges in `parts` (a part that needs a rank that left
  // fails instead).
  void StartParts(std::vector<EntryPtr> parts);
  bool Submitted() override;  // Join::Host

  Host* host_;
  Backend* backend_;
  Stats* stats_;
  Submissions* submissions_;
  ProcessSets* sets_;
  SetControl* set_control_;
  const uint64_t generation_;
  DevicePath devices_;  // CUDA tensors: staging, the device data plane, NCCL
  NeighborExchange neighbors_;
  ShardedExchange sharded_{backend_->world(), &neighbors_};  // hierarchical ops' exchange on host memory
  CheckedPatterns neighbor_patterns_;  // neighbor ops that skip the coordinator
  std::vector<EntryPtr> neighbor_ready_;
  Departures departures_;
  std::shared_ptr<BufferPool> recv_pool_ = BufferPool::Create();
  Bytes spare_;  // receive buffer of the next probe
  CollectiveOps collectives_;
  Negotiation negotiation_;
  ResponseCache cache_;  // allreduce batches and broadcasts that skip the coordinator
  StallInspector stalls_;
  GroupedOps grouped_;
  Join join_;  // Horovod's join
};

}  // namespace shoal
