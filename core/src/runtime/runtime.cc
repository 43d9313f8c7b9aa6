#include "runtime/runtime.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "common/reduce.h"

namespace shoal {
namespace {

// Runtimes created in this process; the same sequence on every rank (init is collective).
std::atomic<uint64_t> g_generations{0};

// The op's spans on the timeline: the whole op, its phases, and BlueFog's activity names.
void TraceOp(Timeline* timeline, const Entry& e, const Status& st, Clock::time_point t_callback) {
  const Clock::time_point unset{}, now = Clock::now();
  std::string args = "\"bytes\": " + std::to_string(e.nbytes());
  if (!st.ok()) args += ", \"error\": \"" + JsonEscape(st.message) + "\"";
  timeline->Span(e.name, OpName(e.sig.op), e.enqueued, now, args);
  auto span = [&](const char* phase, Clock::time_point a, Clock::time_point b) {
    if (a != unset && b != unset) timeline->Span(e.name, phase, a, b);
  };
  span("NEGOTIATE", e.t_negotiated != unset ? e.enqueued : unset, e.t_negotiated);
  span("FUSION_COPY", e.t_copy_start, e.t_copy_end);
  const bool neighbor = e.sig.op == SHOAL_OP_NEIGHBOR_ALLREDUCE || e.sig.op == SHOAL_OP_NEIGHBOR_ALLGATHER;
  span(neighbor ? "WAIT_FOR_PEERS" : "COMMUNICATE", e.t_comm_start, neighbor ? e.t_peers_ready : e.t_comm_end);
  span("REDUCE", e.t_reduce_start, e.t_reduce_end);
  span("CALLBACK", t_callback, now);
  // BlueFog's activity names for its neighbor ops, on the same track, for the scripts and
  // viewers that look for them: ENQUEUE_<OP> (the whole op, as BlueFog's caller-side span),
  // PROC_<OP> (its processing, as its background thread's; MPI_<OP> before its 2020
  // rename, still what its timeline test and docs read), COMMUNICATE, COMPUTE_AVERAGE.
  const int base = e.sig.op & ~SHOAL_GROUPED;
  const char* bf = base == SHOAL_OP_NEIGHBOR_ALLGATHER ? "NEIGHBOR_ALLGATHER"
                   : base == SHOAL_OP_NEIGHBOR_ALLREDUCE || base == SHOAL_OP_HIERARCHICAL_NEIGHBOR_ALLREDUCE
                       ? "NEIGHBOR_ALLREDUCE" : nullptr;
  if (!bf) return;
  Clock::time_point proc = unset;
  for (auto t : {e.t_negotiated, e.t_copy_start, e.t_comm_start, e.t_reduce_start})
    if (t != unset && (proc == unset || t < proc)) proc = t;
  if (proc == unset) proc = e.enqueued;
  timeline->Span(e.name, (std::string("ENQUEUE_") + bf).c_str(), e.enqueued, now);
  timeline->Span(e.name, (std::string("PROC_") + bf).c_str(), proc, now);
  timeline->Span(e.name, (std::string("MPI_") + bf).c_str(), proc, now);
  span("COMMUNICATE", e.t_comm_start, e.t_peers_ready);
  if (base != SHOAL_OP_NEIGHBOR_ALLGATHER) span("COMPUTE_AVERAGE", e.t_reduce_start, e.t_reduce_end);
}

}  // namespace

Runtime::Runtime(const Config& cfg, std::unique_ptr<Backend> backend, uint64_t generation)
    : cfg_(cfg), backend_(std::move(backend)),
      scheduler_(this, cfg_, backend_.get(), &stats_, &submissions_, &sets_, &set_control_,
                 generation ? generation : ++g_generations) {
  sets_.SetMachine(world().machine_ranks, world().rank, world().size, cfg_.fusion_threshold);
  if (!cfg_.timeline.empty()) {
    std::string path = cfg_.timeline + std::to_string(world().rank) + ".json";
    if (!timeline_.Open(path, world().rank)) Log(LOG_ERROR, "cannot write the timeline " + path);
  }
  thread_ = std::thread([this] { Loop(); });
}

void Runtime::Stop() {
  if (!stop_) Leave();
  if (windows_ && Lost()) windows_->Abandon();  // its thread may be stuck in MPI (see ~Runtime)
  else if (windows_) windows_->Stop();
  {
    std::unique_lock<std::mutex> lock(mu_);
    stop_ = true;
    work_cv_.notify_all();
    done_cv_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
  {
    // A waiting user thread may be in the middle of a cycle; MPI may be finalized next.
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return !driving_; });
  }
  FailAll(backend_->Lost() ? kLostRank : "Shoal was shut down before the op completed",
          backend_->Lost() ? SHOAL_RANK_LOST : SHOAL_ABORTED);
  scheduler_.Stop();
  timeline_.Close();
}

void Runtime::Start(std::unique_lock<std::mutex>& lock, bool callback) {
  if (driving_) return;  // the driver takes it next cycle
  if (waiters_ > 0) {
    done_cv_.notify_all();  // a waiter between cycles drives it
  } else if (callback) {
    work_cv_.notify_one();  // nobody will wait: the background thread runs it
  } else {
    // Start it here (send to peers, or ask the coordinator) without waking a thread;
    // whoever waits for it drives the rest, else the background thread within a cycle time.
    Drive(lock, nullptr, nullptr);
    // A thread that came to wait while this one drove slept on done_cv_: hand it the
    // token (only here: waiters hand over on leaving Wait, and waking every waiter after
    // every cycle would make them chase each other).
    if (waiters_ > 0) done_cv_.notify_all();
  }
}

void Runtime::Leave() {
  std::unique_lock<std::mutex> lock(mu_);
  if (left_) return;
  left_ = true;
  leaving_ = true;  // drivers step aside after their cycle (they do not notify when they do)
  while (driving_) done_cv_.wait_for(lock, std::chrono::milliseconds(1));
  driving_ = true;  // the backend is this thread's alone now
  lock.unlock();
  try {
    // Queued requests (a refusal, say) reach the coordinator, and the coordinator's
    // answers its peers, before they learn that this rank left.
    SafeCycle(false);
    scheduler_.Leave();
  } catch (const std::exception& ex) {
    Log(LOG_WARNING, std::string("could not tell the peers that this rank leaves: ") + ex.what());
  }
  lock.lock();
  driving_ = false;
  leaving_ = false;
  done_cv_.notify_all();
}

Status Runtime::Wait(int64_t handle, int64_t timeout_ms) {
  const EntryPtr e = submissions_.Find(handle);
  if (!e) return Status::Error(SHOAL_UNKNOWN_HANDLE, "unknown handle " + std::to_string(handle));
  std::unique_lock<std::mutex> lock(mu_);
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms < 0 ? int64_t{1} << 40 : timeout_ms);
  // Drive progress here rather than hand the op to the background thread and be woken
  // again: on busy cores each thread switch costs tens of microseconds.
  ++waiters_;
  e->waited = true;
  Pacer pace(cfg_.cycle_time_ms, cfg_.CycleTime());
  bool busy = false;
  const auto longest = cfg_.CycleTime();
  auto wait = std::chrono::microseconds(0);
  // Like MPI_Sendrecv, stay until this op's own sends are through too (receivers of large
  // messages need the sender's progress), unless they stopped moving or others drive.
  auto finished = [&] {
    return e->done && (e->sends_pending == 0 || wait >= longest || driving_ || stop_);
  };
  while (!finished() && Clock::now() < deadline) {
    if (driving_ || stop_ || leaving_) {
      done_cv_.wait_until(lock, leaving_ ? std::min(deadline, Clock::now() + cfg_.CycleTime()) : deadline);
      continue;
    }
    wait = Drive(lock, &pace, &busy, e.get());
    if (wait.count() > 0 && !finished()) done_cv_.wait_until(lock, std::min(deadline, Clock::now() + wait));
  }
  --waiters_;
  // Hand progress on: to another waiter, else to the background thread if work is left.
  if (waiters_ > 0 || stop_) done_cv_.notify_all();
  else if (busy || submissions_.Queued() > 0) work_cv_.notify_one();
  if (!e->done) return Status::Error(SHOAL_TIMEOUT, "still running");
  return e->status;
}

std::chrono::microseconds Runtime::Drive(std::unique_lock<std::mutex>& lock, Pacer* pace, bool* busy,
                                         const Entry* waited) {
  driving_ = true;
  lock.unlock();
  // The driver may be a user thread: leave its current CUDA device as it was.
  const int device = scheduler_.devices().CurrentDevice();
  bool progressed = SafeCycle(pace == nullptr);
  scheduler_.devices().RestoreDevice(device);
  auto wait = std::chrono::microseconds(0);
  if (pace) {
    *busy = scheduler_.Busy();
    wait = pace->Next(progressed, *busy);
    // A waiter whose op is not done yields even after progress (its own send, say): on a
    // shared core the rank it waits for may be the one ready to run.
    if (wait.count() == 0 && (!progressed || (waited && !waited->done))) std::this_thread::yield();
  }
  lock.lock();
  driving_ = false;
  if (stop_) done_cv_.notify_all();  // Stop() waits for the driver to leave
  return wait;
}

std::chrono::microseconds Pacer::Next(bool progressed, bool busy) {
  const auto now = Clock::now();
  if (progressed) {
    idle_ = std::chrono::microseconds(0);
    last_progress_ = now;
    return idle_;
  }
  // Peers usually answer within microseconds: poll (yielding the core) for a short
  // window after the last progress, then back off. With nothing in flight there is
  // nothing to poll for (new ops start where they are enqueued, or notify): sleep the
  // longest at once rather than wake a thread on busy cores every few microseconds.
  if (busy && now - last_progress_ < poll_) return std::chrono::microseconds(0);
  idle_ = busy ? std::min(longest_, std::max(std::chrono::microseconds(20), idle_ * 2)) : longest_;
  return idle_;
}

void Runtime::Complete(const EntryPtr& e, const Status& st) {
  if (!submissions_.Complete(e, st)) return;
  auto t_callback = Clock::now();
  { std::lock_guard<std::mutex> lock(mu_); }  // a waiter between its check of `done` and its sleep
  done_cv_.notify_all();
  if (e->callback) e->callback(e->handle, st.code, st.message.c_str(), e->callback_arg);
  if (timeline_.enabled()) TraceOp(&timeline_, *e, st, t_callback);
  if (e->stages) stages_.Next(e, st);
}


void Runtime::FailAll(const std::string& why, int code) {
  for (auto& e : submissions_.TakeUnfinished())
    Finish(e, Status::Error(code, OpError(e->sig.op, e->name, why)));
}

bool Runtime::SafeCycle(bool start_only) {
  std::string failure;
  try {
    const bool progressed = Cycle(start_only);
    if (!backend_->Lost()) return progressed;
  } catch (const std::exception& ex) {
    failure = ex.what();
  }
  // Unrecoverable (MPI failure, corrupt message, a lost rank): fail everything and stop
  // touching any op's memory; later enqueues are refused.
  if (!backend_->Lost()) Log(LOG_ERROR, "runtime loop failed: " + failure);
  scheduler_.Abandon();
  fresh_.clear();
  {
    // Under the mutex: an Enqueue admitted before this point has queued its op (FailAll
    // below fails it); one after it is refused. The cycle runs with the mutex released.
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  if (backend_->Lost()) FailAll(kLostRank, SHOAL_RANK_LOST);
  else FailAll("Shoal's runtime failed: " + failure);
  return false;
}

void Runtime::Loop() {
  SetLogContext(world().rank, cfg_.log_level);
  const auto longest = cfg_.CycleTime();
  Pacer pace(cfg_.cycle_time_ms, std::chrono::microseconds(100));
  bool busy = false;
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    if (driving_ || waiters_ > 0 || leaving_) {  // a waiting user thread drives; stay off its cores
      work_cv_.wait_for(lock, longest);
      continue;
    }
    auto wait = Drive(lock, &pace, &busy);
    if (waiters_ > 0) done_cv_.notify_all();  // a user thread came to wait: let it drive
    // Sleep, but wake at once for new work.
    else if (wait.count() > 0) work_cv_.wait_for(lock, wait, [&] { return stop_ || submissions_.Queued() > 0; });
  }
}

bool Runtime::Cycle(bool start_only) {
  // Swapped with the queue and cleared after use: both keep their capacity.
  if (submissions_.Queued() > 0) submissions_.Take(&fresh_);
  const bool progressed = scheduler_.Cycle(fresh_, start_only);
  fresh_.clear();
  if (!start_only) timeline_.FlushEvery(std::chrono::milliseconds(100));  // readable while the job runs
  return progressed;
}

}  // namespace shoal
