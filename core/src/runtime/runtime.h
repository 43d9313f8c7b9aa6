// The one runtime object of a process: queue, handles, progress.
//
// User threads enqueue ops (runtime/enqueue.cc: checked, then named, numbered and queued by
// Submissions) and wait on handles. One thread at a time, the driver, runs the
// communication cycle (Scheduler::Cycle): (1) ops that need agreement go to their
// coordinator, whose ordered responses it applies: collectives always, neighbor ops the
// first time a name is seen; (2) neighbor data goes directly between neighbours (no global
// step); (3) in-flight requests progress; (4) stalls are checked. The driver is a user
// thread blocked in Wait, or the enqueuing thread for one cycle, else the background
// thread (ops with callbacks, ops nobody waits for yet). Handing a small op to another
// thread and being woken back cost more than the op itself on busy cores, so a waiter
// drives rather than sleeps. The driving token (`driving_`) and who waits are this class's
// state, under `mu_`; everything the cycle touches is the scheduler's.
#pragma once
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/stats.h"
#include "common/timeline.h"
#include "engines/backend.h"
#include "neighbor/topology.h"
#include "ops/stages.h"
#include "process_sets/process_sets.h"
#include "process_sets/set_control.h"
#include "runtime/departures.h"
#include "runtime/entry.h"
#include "runtime/scheduler.h"
#include "runtime/submissions.h"
#include "windows/windows.h"

namespace shoal {

// When a progress driver polls again: at once after progress, after a yield for `poll`
// after the last progress while ops are in flight, else after a sleep that doubles up to
// the cycle time (at once the cycle time when nothing is in flight). A user thread blocked
// in Wait polls for a whole cycle time, as MPI's blocking calls do: a timed sleep wakes
// tens of microseconds late, longer than a small op. The background thread polls briefly.
class Pacer {
 public:
  Pacer(double cycle_time_ms, std::chrono::microseconds poll)
      : longest_(static_cast<int64_t>(cycle_time_ms * 1000)), poll_(poll) {}
  std::chrono::microseconds Next(bool progressed, bool busy);

 private:
  std::chrono::microseconds longest_, poll_, idle_{0};
  Clock::time_point last_progress_ = Clock::now();
};

class Runtime final : private Scheduler::Host, private HierarchicalStages::Host, private SetControl::Host {
 public:
  // `generation`: which start-up of the job this is (leave notices of an earlier one are
  // ignored); 0: count this process's runtimes (every rank starts and stops them together).
  Runtime(const Config& cfg, std::unique_ptr<Backend> backend, uint64_t generation = 0);
  ~Runtime() {
    Stop();
    if (Lost()) (void)windows_.release();  // abandoned (WindowQueue::Abandon): its thread may still use it
  }
  // Stops the loop; pending ops fail with SHOAL_ABORTED. Idempotent.
  void Stop();

  const WorldInfo& world() const { return backend_->world(); }
  const Config& config() const { return cfg_; }
  Stats& stats() { return stats_; }
  // This rank's ops from the call to the handle's release: names, queue, handles (any thread).
  Submissions& submissions() { return submissions_; }
  Timeline& timeline() { return timeline_; }
  // The static graphs over ranks and machines (any thread).
  Topologies& topologies() { return topologies_; }
  // One-sided window ops run on their own thread (windows/windows.h); null until attached.
  void AttachWindows(std::unique_ptr<WindowQueue> w) { windows_ = std::move(w); }
  WindowQueue* windows() { return windows_.get(); }

  // Validates and queues; throws ArgumentError for bad arguments (and tells the peers,
  // which may be waiting for this call, through Reject).
  int64_t Enqueue(const shoal_op_desc& desc, shoal_callback cb = nullptr, void* cb_arg = nullptr);
  // A grouped op (shoal_enqueue_group; ops/groups.h): its members' handles, in order.
  std::vector<int64_t> EnqueueGroup(const char* name, const shoal_op_desc* descs, int n, shoal_callback cb,
                                    void* const* cb_args);
  // desc.op == kOpJoin: Horovod's join (ops/join.cc); its result is the last rank to join.
  // A call of `op` named `name` (null: unnamed) refused at the call on this rank with
  // `error`: its name and step are used up as if it ran, and every rank that submits it
  // gets the same error instead of waiting for this rank.
  // `scope`: the call's (shoal_scope; machine: only the ranks of this machine wait for it).
  void Reject(int op, const char* name, int code, const std::string& error, int set = 0,
              int scope = SHOAL_SCOPE_WORLD);
  // Horovod's add_process_set / remove_process_set, called by every rank in the same order
  // (process_sets/set_control.h; semantics: shoal_add_process_set). `refusal`: this rank refuses
  // the call (bad arguments above the core): every rank raises it. Throw ArgumentError (the
  // same on every rank). Blocking.
  int32_t AddProcessSet(const std::vector<int>& ranks, const std::string& refusal = "") {
    return set_control_.Add(ranks, refusal);
  }
  void RemoveProcessSet(int32_t id, const std::string& refusal = "") { set_control_.Remove(id, refusal); }
  // Set `id`'s members, or null for a set that does not exist (any thread).
  ProcessSetPtr FindSet(int32_t id) { return sets_.Find(id); }
  // This rank takes part in no more ops: tells every peer, so ops that need this rank fail
  // there instead of waiting. Later enqueues are refused. Idempotent; Stop() calls it.
  void Leave();
  // The ranks that left the job (Message(): any thread).
  const Departures& departures() const { return scheduler_.departures(); }
  // Fault-tolerant mode: a rank of the job died; every op here failed with SHOAL_RANK_LOST
  // and later ones are refused with it (the C API's shoal_recover starts the next runtime).
  bool Lost() const { return backend_->Lost(); }
  static constexpr const char* kLostRank =
      "a rank of the job was lost (fault-tolerant mode: the survivors go on without it)";
  // Blocks until the op completes, or (timeout_ms >= 0) returns SHOAL_TIMEOUT.
  Status Wait(int64_t handle, int64_t timeout_ms = -1);

 private:
  void Loop();
  // Runs one cycle as the progress driver (mu_ held on entry and exit, released during
  // the cycle); returns how long to wait before the next. Without a pacer, only starts
  // what was queued (sends, requests to the coordinator): the enqueuing thread's cycle.
  std::chrono::microseconds Drive(std::unique_lock<std::mutex>& lock, Pacer* pace, bool* busy,
                                  const Entry* waited = nullptr);
  bool SafeCycle(bool start_only);
  bool Cycle(bool start_only);
  void Start(std::unique_lock<std::mutex>& lock, bool callback);
  // Enqueue's parts (runtime/describe.cc, enqueue.cc): the call's process set (null: global;
  // throws ArgumentError naming `what`, default: d's op), the entry of a valid desc (throws
  // ArgumentError), and whether this rank takes new ops (mu_ held; throws).
  ProcessSetPtr CallSet(const shoal_op_desc& d, const char* what = nullptr);
  EntryPtr Describe(const shoal_op_desc& d, const ProcessSetPtr& pset);
  void Admissible(int op) const;
  // Scheduler::Host: handle, waiters, callback, timeline, next stage.
  void Complete(const EntryPtr& e, const Status& st) override;
  void FailAll(const std::string& why, int code = SHOAL_ABORTED) override;
  // HierarchicalStages::Host (takes mu_).
  void AfterStage(const EntryPtr& done, const EntryPtr& next, const Status& failed,
                  const std::vector<EntryPtr>& later) override;
  void Finish(const EntryPtr& e, const Status& st) override { scheduler_.Finish(e, st); }
  // SetControl::Host.
  Status RunOp(const shoal_op_desc& d, EntryPtr* e) override;
  Status RunOnDriver(const EntryPtr& e) override;
  void EndSet(const ProcessSet& s) override { scheduler_.EndSet(s); }
  void ForgetSet(int set) override { scheduler_.ForgetSet(set); }

  Config cfg_;
  std::unique_ptr<Backend> backend_;
  Stats stats_;
  Timeline timeline_;
  Topologies topologies_;
  ProcessSets sets_;  // the process sets other than the global one
  HierarchicalStages stages_{this, backend_->world()};

  // Shared with user threads.
  Submissions submissions_{cfg_.name_limit, &stages_};  // its own mutex, taken after mu_
  std::mutex mu_;  // the driving token and what decides who drives
  std::condition_variable work_cv_, done_cv_;
  bool driving_ = false;  // a thread is running Cycle()
  bool left_ = false;     // Leave() ran
  bool leaving_ = false;  // Leave() waits for the driving token
  int waiters_ = 0;       // user threads in Wait
  // Read without the mutex by the loop, so polling never contends with enqueue.
  std::atomic<bool> stop_{false};

  // Driver only.
  std::vector<EntryPtr> fresh_;  // the queue taken this cycle
  Scheduler scheduler_;
  SetControl set_control_{this, &submissions_, backend_.get(), &sets_, cfg_.fusion_threshold};  // adds and removes sets
  std::thread thread_;
  std::unique_ptr<WindowQueue> windows_;
};

}  // namespace shoal
