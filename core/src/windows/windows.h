// One-sided window ops (BlueFog's win_*; docs/reference/bluefog-semantics.md §1.7).
//
// Progress model: window ops never go through the background thread. They start in
// submission order on one window thread per process (so a nonblocking put overlaps the
// caller's compute) on a communicator of their own: gets and mutexes are MPI passive-target
// RMA, puts messages to the owner's delivery thread; the target's own ops take no part, so
// a window op can never wait on the target's collectives, and the background thread's
// collectives never wait on window ops. A put whose parcels are still travelling when its
// job returns stays in flight beside the quick ops after it (docs/design.md §23).
// win_create/win_free are collectives on the window communicator; ranks must call them in
// the same order (checked: a mismatch is the same error on every rank).
#pragma once
#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/common.h"
#include "common/config.h"
#include "common/stats.h"
#include "common/thread_annotations.h"

namespace shoal {

struct WinArgs {
  std::string name;
  void* data = nullptr;  // create/put/accumulate: the local tensor; update: in/out tensor
  int dtype = 0;
  std::vector<int64_t> shape;
  std::vector<int> ranks;       // put/accumulate: destinations; get/update: sources; create: in-neighbours; mutex: ranks
  std::vector<double> weights;  // one per rank
  std::vector<int> send;        // create: out-neighbours
  double self_weight = 1.0;
  bool uniform = false;  // update: (x + sum of buffers) / (m + 1), sum then divide
  bool zero_init = false, require_mutex = false, reset = false, with_p = false, for_self = false;
  bool clone = false;  // update: writes a copy; the published value stays
  std::string refused;  // create: why this rank refused the call ("": it did not)
  int refused_code = 0;
};

// A put's parcels in flight: nullopt while any travels, else the put's status; `give_up`
// (shutdown) ends it at once with an error, leaving the buffers to MPI.
using Travelling = std::function<std::optional<Status>(bool give_up)>;

// The communication engine of windows (MPI: core/src/engines/mpi/mpi_windows.h).
// Every call is made from the window thread.
class WindowEngine {
 public:
  virtual ~WindowEngine() = default;
  virtual Status Create(const WinArgs& a) = 0;
  virtual Status Free(const std::string& name) = 0;  // "" frees every window
  virtual Status Put(const WinArgs& a, bool accumulate) = 0;
  virtual Status Get(const WinArgs& a) = 0;
  virtual Status Update(const WinArgs& a) = 0;
  virtual Status Mutex(const WinArgs& a, bool acquire) = 0;
  virtual Status Versions(const std::string& name, std::vector<int>* ranks, std::vector<int64_t>* v) = 0;
  virtual Status AssociatedP(const std::string& name, double* p) = 0;
  virtual std::vector<std::string> Names() const = 0;
  // What the last Put left travelling (null: it finished inside the job): taken by the
  // window thread right after the job and polled until it gives the put's status.
  virtual Travelling TakeTravelling() { return nullptr; }
};

// What tells window jobs to give up, shared by the window thread and the engine: `stop` ends
// long waits; `orphaned` (fault-tolerant mode: a waiter stopped waiting for a running job after
// a lost rank) forbids writing the caller's memory, which a job writes only holding `writing`.
struct WindowCancel {
  std::atomic<bool> stop{false}, orphaned{false};
  std::mutex writing;
};

std::unique_ptr<WindowEngine> CreateMpiWindows(const Config& cfg, Stats* stats, WindowCancel* cancel);

// The window thread: runs submitted jobs one at a time, in order; handles in their own space.
class WindowQueue {
 public:
  // `make` builds the engine; it gets what tells its jobs to give up.
  explicit WindowQueue(const std::function<std::unique_ptr<WindowEngine>(WindowCancel*)>& make);
  ~WindowQueue() { Stop(); }
  void Stop() EXCLUDES(mu_);  // pending jobs fail with SHOAL_ABORTED; idempotent
  // `quick`: the job cannot block for long and needs none of this rank's earlier puts to
  // have landed (puts, gets and updates without mutexes; local reads): a waiter may run it
  // itself (the caller's 200 ms waits, which let Ctrl-C through, keep their rhythm), and it
  // starts while earlier puts still travel. Any other job starts once none travels.
  // `needs_all`: a collective that every rank must join (create): its waiters give up
  // once `gone` (SetGone) names ranks that left the job. One-sided ops to a rank that left
  // still complete: it serves its windows until every rank frees them (asynchronous ranks
  // finish at different times).
  int64_t Submit(std::function<Status(WindowEngine&)> job, bool quick = false, bool needs_all = false)
      EXCLUDES(mu_);
  void SetGone(std::function<std::string()> gone) EXCLUDES(mu_) {
    MutexLock lock(mu_);
    gone_ = std::move(gone);
  }
  // Fault-tolerant mode (docs/design.md §16): once `lost` is true the job lost a rank.
  // ULFM's one-sided ops are not fault tolerant (a flush to a dead rank may never return),
  // so jobs then fail with SHOAL_RANK_LOST: those not started without running, waits
  // without waiting for the job (which may then no longer write the caller's memory), jobs
  // that failed with their error. In this mode every job runs on the window thread (none
  // inline on a waiter, loss or not), which Abandon() can leave stuck in MPI.
  void SetLost(std::function<bool()> lost) EXCLUDES(mu_) {
    MutexLock lock(mu_);
    lost_ = std::move(lost);
  }
  // Instead of Stop() once the job lost a rank: queued jobs fail with SHOAL_RANK_LOST and
  // the window thread is left to end by itself. The queue must then never be destroyed
  // (the thread may still use it): the caller leaks it, with its MPI windows.
  void Abandon() EXCLUDES(mu_);
  int Poll(int64_t handle) EXCLUDES(mu_);  // 1 done, 0 pending, -SHOAL_UNKNOWN_HANDLE
  Status Wait(int64_t handle, int64_t timeout_ms = -1) EXCLUDES(mu_);
  bool Release(int64_t handle) EXCLUDES(mu_);
  // Submit (quick: a local read) + Wait + Release.
  Status Run(std::function<Status(WindowEngine&)> job);

 private:
  void Loop() EXCLUDES(mu_);
  static Status Lost();
  // Runs the job at the head of the queue, without mu_ while it runs.
  void RunFront() REQUIRES(mu_);
  // The head of the queue may start now.
  bool Startable() const REQUIRES(mu_);
  // Tests the travelling puts once (or gives them up), without mu_ while it does.
  void PollTravelling(bool give_up) REQUIRES(mu_);
  // A job's status after it failed: SHOAL_RANK_LOST once the job lost a rank.
  Status Outcome(Status st, const std::function<bool()>& lost) const;
  struct Job {
    std::function<Status(WindowEngine&)> fn;
    bool done = false, quick = false, needs_all = false;  // done: under the queue's mu_
    Status status;                                        // under the queue's mu_
    Travelling travelling;                                // the job returned, its parcels not yet in
  };
  // Bounds the puts in flight (and the buffers they keep): the next job waits for room.
  static constexpr size_t kMaxTravelling = 256;
  std::vector<std::shared_ptr<Job>> travelling_ GUARDED_BY(mu_);
  WindowCancel cancel_;
  std::unique_ptr<WindowEngine> engine_;  // used by whoever runs a job (running_: one at a time)
  Mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::deque<std::pair<int64_t, std::shared_ptr<Job>>> queue_ GUARDED_BY(mu_);
  std::map<int64_t, std::shared_ptr<Job>> jobs_ GUARDED_BY(mu_);
  bool running_ GUARDED_BY(mu_) = false;  // the engine is in use: a job (window thread or a waiter), or a poll
  std::function<std::string()> gone_ GUARDED_BY(mu_);
  std::function<bool()> lost_ GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace shoal
