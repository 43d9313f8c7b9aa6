#include "windows/windows.h"

#include <algorithm>

namespace shoal {

Status WindowQueue::Lost() {
  return Status::Error(SHOAL_RANK_LOST, "window op: a rank of the job was lost (fault-tolerant mode: the survivors go on without it)");
}

WindowQueue::WindowQueue(const std::function<std::unique_ptr<WindowEngine>(WindowCancel*)>& make)
    : engine_(make(&cancel_)), thread_([this] { Loop(); }) {}

void WindowQueue::Stop() {
  {
    MutexLock lock(mu_);
    if (cancel_.stop.exchange(true)) return;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  UniqueLock lock(mu_);
  while (running_) lock.Wait(done_cv_);  // a waiter may be running a job itself
  if (!travelling_.empty()) PollTravelling(true);
  for (auto& [h, job] : queue_) {
    job->status = Status::Error(SHOAL_ABORTED, "Shoal was shut down before this window op ran");
    job->done = true;
  }
  queue_.clear();
  done_cv_.notify_all();
}

void WindowQueue::Abandon() {
  {
    MutexLock lock(mu_);
    cancel_.stop = true;
    for (auto& [h, job] : queue_) {
      job->status = Lost();
      job->done = true;
    }
    queue_.clear();
    // Their parcels stay with the engine, which is never destroyed (see the header).
    for (auto& job : travelling_) {
      job->status = Lost();
      job->done = true;
    }
    travelling_.clear();
  }
  cv_.notify_all();
  done_cv_.notify_all();
  if (thread_.joinable()) thread_.detach();
}

int64_t WindowQueue::Submit(std::function<Status(WindowEngine&)> fn, bool quick, bool needs_all) {
  auto job = std::make_shared<Job>();
  job->fn = std::move(fn);
  job->quick = quick;
  job->needs_all = needs_all;
  MutexLock lock(mu_);
  if (cancel_.stop) throw ArgumentError(SHOAL_NOT_INITIALIZED, "Shoal is shut down");
  // Numbered once per process: a handle of a runtime that a loss ended is never another's.
  static std::atomic<int64_t> next{1};
  int64_t h = next++;
  jobs_[h] = job;
  queue_.emplace_back(h, job);
  cv_.notify_one();
  return h;
}

Status WindowQueue::Outcome(Status st, const std::function<bool()>& lost) const {
  return !st.ok() && lost && lost() ? Lost() : st;
}

bool WindowQueue::Startable() const {
  return !running_ && !queue_.empty() && travelling_.size() < kMaxTravelling &&
         (queue_.front().second->quick || travelling_.empty());
}

void WindowQueue::RunFront() {
  auto job = queue_.front().second;
  queue_.pop_front();
  running_ = true;
  const auto lost = lost_;
  // The caller's lock object still owns mu_: it is taken back below, whatever the job throws.
  mu_.Unlock();
  Status st;
  Travelling travelling;
  if (lost && lost()) {
    st = Lost();
  } else {
    try {
      st = job->fn(*engine_);
    } catch (const std::exception& ex) {
      st = Status::Error(SHOAL_INVALID_ARGUMENT, ex.what());
    } catch (...) {
      st = Status::Error(SHOAL_INVALID_ARGUMENT, "window op: unknown exception");
    }
    travelling = engine_->TakeTravelling();  // also after a throw: never the next job's
    st = Outcome(st, lost);
  }
  if (!st.ok() && travelling) (void)travelling(true);  // failed after its parcels left: they stay MPI's
  mu_.Lock();
  if (st.ok() && travelling) {
    job->travelling = std::move(travelling);
    travelling_.push_back(job);
  } else {
    job->status = st;
    job->done = true;
  }
  running_ = false;
  cv_.notify_all();
  done_cv_.notify_all();
}

void WindowQueue::PollTravelling(bool give_up) {
  running_ = true;
  const auto lost = lost_;
  std::vector<std::shared_ptr<Job>> jobs = travelling_;
  mu_.Unlock();
  std::vector<std::optional<Status>> got(jobs.size());
  for (size_t i = 0; i < jobs.size(); ++i) {
    try {
      got[i] = jobs[i]->travelling(give_up);
    } catch (const std::exception& ex) {
      got[i] = Status::Error(SHOAL_INVALID_ARGUMENT, ex.what());
    } catch (...) {
      got[i] = Status::Error(SHOAL_INVALID_ARGUMENT, "window op: unknown exception");
    }
    if (got[i]) got[i] = Outcome(*got[i], lost);
  }
  mu_.Lock();
  for (size_t i = 0; i < jobs.size(); ++i) {
    auto it = std::find(travelling_.begin(), travelling_.end(), jobs[i]);
    // Not there: Abandon() ended it (SHOAL_RANK_LOST) while this poll ran without mu_.
    if (!got[i] || it == travelling_.end()) continue;
    travelling_.erase(it);
    jobs[i]->status = *got[i];
    jobs[i]->done = true;
    jobs[i]->travelling = nullptr;
  }
  running_ = false;
  cv_.notify_all();
  done_cv_.notify_all();
}

void WindowQueue::Loop() {
  UniqueLock lock(mu_);
  for (int64_t polls = 0;;) {
    if (cancel_.stop) return;
    if (Startable()) {
      RunFront();
      // Between jobs too: a stream of quick jobs must not hold up the puts' completions.
      if (!cancel_.stop && !running_ && !travelling_.empty()) PollTravelling(false);
    } else if (!running_ && !travelling_.empty()) {
      // Polled at 5 us rising to 100 us: an answer comes a round trip after the last byte.
      PollTravelling(false);
      const auto pause = std::chrono::microseconds(std::min<int64_t>(100, 5 + 5 * polls++));
      if (!travelling_.empty() && !Startable())
        (void)lock.WaitUntil(cv_, std::chrono::steady_clock::now() + pause);
      if (travelling_.empty()) polls = 0;
    } else {
      lock.Wait(cv_);
    }
  }
}

int WindowQueue::Poll(int64_t h) {
  MutexLock lock(mu_);
  auto it = jobs_.find(h);
  if (it == jobs_.end()) return -SHOAL_UNKNOWN_HANDLE;
  return it->second->done ? 1 : 0;
}

Status WindowQueue::Wait(int64_t h, int64_t timeout_ms) {
  UniqueLock lock(mu_);
  auto it = jobs_.find(h);
  if (it == jobs_.end()) return Status::Error(SHOAL_UNKNOWN_HANDLE, "unknown window handle " + std::to_string(h));
  auto job = it->second;
  // A waiter whose job is next runs it itself: a blocking window op then costs no
  // thread hand-off (the window thread only carries ops nobody is waiting for yet).
  if (job->quick && !lost_ && !job->done && !cancel_.stop && Startable() && queue_.front().second == job) RunFront();
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(timeout_ms < 0 ? int64_t{1} << 40 : timeout_ms);
  while (!job->done) {
    auto until = std::min(deadline, std::chrono::steady_clock::now() + std::chrono::milliseconds(100));
    while (!job->done && lock.WaitUntil(done_cv_, until) == std::cv_status::no_timeout) {}
    if (job->done) break;
    if (lost_ && lost_()) {
      // The job may be stuck in MPI on the lost rank: stop waiting, and from here on it
      // writes nothing of the caller's (a write in progress ends first).
      cancel_.orphaned = true;
      std::lock_guard<std::mutex> writing(cancel_.writing);
      return Lost();
    }
    if (job->needs_all && gone_) {
      std::string gone = gone_();
      if (!gone.empty()) return Status::Error(SHOAL_ABORTED, "window op: " + gone);
    }
    if (std::chrono::steady_clock::now() >= deadline) return Status::Error(SHOAL_TIMEOUT, "window op still running");
  }
  return job->status;
}

bool WindowQueue::Release(int64_t h) {
  MutexLock lock(mu_);
  return jobs_.erase(h) > 0;
}

Status WindowQueue::Run(std::function<Status(WindowEngine&)> fn) {
  int64_t h = Submit(std::move(fn), true);
  Status st = Wait(h);
  Release(h);
  return st;
}

}  // namespace shoal
