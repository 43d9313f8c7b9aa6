// The one runtime object of a process: queue, handles, progress.
//
// User threads enqueue ops and wait on handles. One thread at a time, the driver,
// runs the communication cycle; each cycle it (1) reports newly submitted ops that
// need agreement to the coordinator (rank 0) and applies the coordinator's ordered
// responses: collectives always, neighbor ops the first time a name is seen;
// (2) sends and receives neighbor data directly between neighbours (no global step);
// (3) progresses in-flight MPI requests; (4) checks for stalls.
// The driver is a user thread blocked in Wait, or the enqueuing thread for one cycle,
// else the background thread (ops with callbacks, ops nobody waits for yet). Handing a
// small op to another thread and being woken back cost more than the op itself on
// busy cores, so a waiter drives rather than sleeps. "Driver only" state below is
// touched only by the thread holding the `driving_` token.
#pragma once
#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "engines/backend.h"
#include "common/buffer_pool.h"
#include "negotiation/coordinator.h"
#include "negotiation/names.h"
#include "negotiation/response_cache.h"
#include "negotiation/stall_inspector.h"
#include "neighbor/checked_patterns.h"
#include "neighbor/device_plane.h"
#include "engines/nccl/nccl_backend.h"
#include "gpu/device_path.h"
#include "ops/collectives.h"
#include "runtime/departures.h"
#include "runtime/entry.h"
#include "process_sets/process_sets.h"
#include "process_sets/set_control.h"
#include "gpu/staging.h"
#include "neighbor/neighbor_exchange.h"
#include "ops/groups.h"
#include "ops/join.h"
#include "ops/stages.h"
#include "common/stats.h"
#include "common/timeline.h"
#include "neighbor/topology.h"
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

class Runtime final : private ResponseCache::Host, private DevicePath::Host, private GroupedOps::Host,
                private HierarchicalStages::Host, private SetControl::Host {
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
  size_t NameCount();  // names with per-name state here (bounded: negotiation/names.cc)
  bool Voting();       // a vote on retiring names is in flight here (tests)
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
  const Departures& departures() const { return departures_; }
  // Fault-tolerant mode: a rank of the job died; every op here failed with SHOAL_RANK_LOST
  // and later ones are refused with it (the C API's shoal_recover starts the next runtime).
  bool Lost() const { return backend_->Lost(); }
  static constexpr const char* kLostRank =
      "a rank of the job was lost (fault-tolerant mode: the survivors go on without it)";
  int Poll(int64_t handle);
  // 1 while the op's tensors may still be read or written (see shoal_in_use).
  int InUse(int64_t handle);
  // Blocks until the op completes, or (timeout_ms >= 0) returns SHOAL_TIMEOUT.
  Status Wait(int64_t handle, int64_t timeout_ms = -1);
  EntryPtr Find(int64_t handle);
  size_t HandleCount();
  bool Release(int64_t handle);

 private:
  static constexpr int kRequestTag = 1, kResponseTag = 2;  // to and from the coordinator
  void Loop();
  // Runs one cycle as the progress driver (mu_ held on entry and exit, released during
  // the cycle); returns how long to wait before the next. Without a pacer, only starts
  // what was queued (sends, requests to the coordinator): the enqueuing thread's cycle.
  std::chrono::microseconds Drive(std::unique_lock<std::mutex>& lock, Pacer* pace, bool* busy,
                                  const Entry* waited = nullptr);
  bool SafeCycle(bool start_only);
  bool Cycle(bool start_only);
  void Route(const EntryPtr& e, std::vector<Request>* to_coordinator) override;
  void Apply(const Response& r);
  void RunCollective(const Response& r, std::vector<EntryPtr> batch) override;
  void RunReduceScatter(const EntryPtr& e, GroupCollectives* engine);
  GroupCollectives* Group(int set) override;  // the engine of process set `set` (0: every rank); null if unknown here
  void RunAlltoall(const Response& r, const EntryPtr& e, GroupCollectives* engine);  // ops/alltoall.cc
  // Enqueue's parts: the entry of a valid desc (throws ArgumentError), whether this rank
  // takes new ops (mu_ held; throws), queueing (mu_ held), and starting the queue.
  // The call's process set (null: global); throws ArgumentError naming `what` (default: d's op).
  ProcessSetPtr CallSet(const shoal_op_desc& d, const char* what = nullptr);
  EntryPtr Describe(const shoal_op_desc& d, const ProcessSetPtr& pset);
  void Admissible(int op) const;
  static ArgumentError Duplicate(int op, const std::string& name);
  void Queue(const EntryPtr& e, shoal_callback cb, void* cb_arg);  // Register, then Push
  void Register(const EntryPtr& e, shoal_callback cb, void* cb_arg);  // its handle (mu_ held)
  void Push(const EntryPtr& e);  // onto the queue; a hierarchical op as its first stage (mu_ held)
  void Start(std::unique_lock<std::mutex>& lock, bool callback);
  void JoinedGroup(const Response& r, std::vector<EntryPtr>* batch);  // takes mu_
  void Finish(const EntryPtr& e, const Status& st) override;
  void Trace(const Entry& e, const Status& st, Clock::time_point t_callback);
  void CheckStalls();
  void OnLeave(int rank);
  bool FailIfUnreachable(const EntryPtr& e);
  // The refusal on file of `key`'s call at `step`, taken (ok: none).
  Status TakeRefusal(const std::string& key, int64_t step);
  // Ranks of set `set` (0: every rank) that left, as the error of a call of `op` named `name`.
  Status Departed(int set, int op, const std::string& name) const;
  // GroupedOps::Host.
  Status Unrunnable(const std::string& key, int64_t step, int set, int op, const std::string& name) override;
  void Await(const std::string& key, const EntryPtr& first) override { awaiting_response_[key] = first; }
  // Uses up `name`'s next step (in process set `pset`, null: every rank's; machine scope: the
  // machine's) with a refusal its peers hear of; false if an op of that name is in flight here (mu_ held).
  bool RejectLocked(int op, const std::string& name, int code, const std::string& error,
                    const ProcessSetPtr& pset = nullptr, int scope = SHOAL_SCOPE_WORLD);
  // Queues an op of the runtime's own (a stage) under a handle of its own (mu_ held).
  void QueueLocked(const EntryPtr& e);
  // HierarchicalStages::Host (takes mu_).
  void AfterStage(const EntryPtr& done, const EntryPtr& next, const Status& failed,
                  const std::vector<EntryPtr>& later) override;
  // Bounded per-name state (negotiation/names.cc): past cfg_.name_limit names, idle names
  // every rank agrees on are retired (propose with a request, vote, commit).
  void Vote(const Response& r);    // the names every rank proposed (takes mu_)
  void Commit(const Response& r);  // the vote's outcome (takes mu_)
  // Thaws set `set`'s frozen names, forgets those in `gone`, runs its held calls (mu_ held).
  void Thaw(int set, const std::set<std::string>& gone);
  void ThawIfLost(int left_rank);  // a vote's coordinator left (takes mu_)
  void FailAll(const std::string& why, int code = SHOAL_ABORTED);
  double Now() const;
  std::chrono::microseconds CycleTime() const {
    return std::chrono::microseconds(static_cast<int64_t>(cfg_.cycle_time_ms * 1000));
  }
  // Asks `e`'s coordinator to negotiate it; the answer comes to Apply.
  void Ask(const EntryPtr& e, std::vector<Request>* to_coordinator);
  // ResponseCache::Host.
  void Renegotiate(const EntryPtr& e) override;
  void SendLater(Request req) override { late_requests_.push_back(std::move(req)); }
  void CountJoinedCall(const std::string& key, const Signature& sig) override { CountCall(key, sig); }
  // SetControl::Host.
  Status RunOp(const shoal_op_desc& d, EntryPtr* e) override;
  Status RunOnDriver(const EntryPtr& e) override;
  int InFlightIn(int set) override;
  void EndSet(const ProcessSet& s) override;
  void ForgetSet(int set) override;  // a removed set's names, refusals on file, checked patterns, stalls
  // Process sets as negotiation sees them (runtime/process_set_steps.cc).
  Coordinator* CoordinatorOf(int set) override;                        // driver: null if not this rank's
  const ProcessSet* SetOf(int set) const override;                     // driver: null for set 0 and unknown sets
  int IndexIn(int set, int world_rank) const;                 // driver
  int SetSize(int set) const { const ProcessSet* s = SetOf(set); return s ? s->size() : world().size; }
  bool Lost(int set) const;  // driver: a member of `set` left the job
  void SendRequests(std::vector<Request>* reqs);
  void OnRequests(int src, const ByteVec& msg);
  bool RespondForSets();     // the set coordinators' responses of this cycle
  void Respond(const ProcessSet* set, std::vector<Response> resps);
  void LeaveSets(int rank);  // `rank` left: the sets it is in
  // Fails, with `code` and "<op> '<name>': <why>", the ops waiting for a coordinator that `which` picks.
  void FailAwaiting(const std::function<bool(const Entry&)>& which, int code, const std::string& why);
  // Join (ops/join.cc).
  void RouteJoin(const EntryPtr& e);
  void SendJoin(std::vector<Request>* to_coordinator);
  void OnJoinNotice(int rank, int64_t epoch);
  EntryPtr JoinedEntry(const Response& r, size_t i);
  // This rank's call of `name` that it runs on the identity of `sig`'s reduction (takes mu_).
  EntryPtr IdentityEntry(const std::string& name, const Signature& sig);
  int64_t CountCall(const std::string& name, const Signature& sig);  // its step (takes mu_)
  void FinishJoin(const Response& r, const std::vector<EntryPtr>& batch);

  Config cfg_;
  std::unique_ptr<Backend> backend_;
  uint64_t generation_;
  Stats stats_;
  Timeline timeline_;
  Topologies topologies_;
  DevicePath devices_;  // CUDA tensors: staging, the device data plane, NCCL (driver only)
  std::shared_ptr<BufferPool> fusion_pool_ = BufferPool::Create(4);
  Clock::time_point last_flush_ = Clock::now();
  std::unique_ptr<Coordinator> coordinator_;  // rank 0 only
  NeighborExchange neighbors_;
  std::shared_ptr<BufferPool> recv_pool_ = BufferPool::Create();
  Bytes spare_;  // receive buffer of the next probe (driver only)
  std::vector<EntryPtr> fresh_;  // the queue taken this cycle (driver only)

  // Shared with user threads.
  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::vector<EntryPtr> queue_;
  std::unordered_map<int64_t, EntryPtr> handles_;
  NameTable names_;  // op names and their per-name state
  bool driving_ = false;  // a thread is running Cycle()
  bool left_ = false;     // Leave() ran
  bool leaving_ = false;  // Leave() waits for the driving token
  int waiters_ = 0;       // user threads in Wait
  // Read without the mutex by the loop, so polling never contends with enqueue.
  std::atomic<bool> stop_{false};
  std::atomic<size_t> queued_{0};

  // Driver only.
  std::map<std::string, EntryPtr> awaiting_response_;  // a grouped op: by its name, its first member
  CheckedPatterns neighbor_patterns_;  // neighbor ops that skip the coordinator
  Departures departures_;
  // Calls rejected on another rank that this rank has not submitted yet: name -> (step, error).
  std::map<std::string, Response> rejections_;
  std::vector<EntryPtr> neighbor_ready_;
  ResponseCache cache_;  // allreduce batches and broadcasts that skip the coordinator
  std::vector<Request> late_requests_;  // from batches that died, for the next cycle's round
  StallInspector stalls_;
  Clock::time_point start_ = Clock::now();
  Join join_;  // Horovod's join: this rank's, and its peers'
  ProcessSets sets_;  // the process sets other than the global one
  GroupedOps grouped_{this, &sets_};
  HierarchicalStages stages_{this, backend_->world()};
  SetControl set_control_{this, backend_.get(), &sets_, cfg_.fusion_threshold};  // adds and removes sets
  std::thread thread_;
  std::unique_ptr<WindowQueue> windows_;
};

}  // namespace shoal
