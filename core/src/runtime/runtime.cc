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

}  // namespace

Runtime::Runtime(const Config& cfg, std::unique_ptr<Backend> backend, uint64_t generation)
    : cfg_(cfg), backend_(std::move(backend)), generation_(generation ? generation : ++g_generations),
      devices_(this, cfg_, backend_.get(), &stats_),
      neighbors_(backend_.get(), devices_.plane(), cfg.fusion_threshold, &stats_, !cfg.timeline.empty()),
      names_(cfg_.name_limit), departures_(backend_->world().size), cache_(this, cfg_, &stats_, fusion_pool_), stalls_(cfg_, &stats_),
      join_(backend_->world().size) {
  if (world().rank == 0) coordinator_ = std::make_unique<Coordinator>(world().size, cfg_.fusion_threshold, Backend::kChannels);
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
  cache_.KeepRoundBuffers();
  devices_.Stop();
  timeline_.Close();
}

double Runtime::Now() const {
  return std::chrono::duration<double>(Clock::now() - start_).count();
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
  auto pending = std::make_shared<std::atomic<int>>(0);
  try {
    // Queued requests (a refusal, say) reach the coordinator, and the coordinator's
    // answers its peers, before they learn that this rank left.
    SafeCycle(false);
    cache_.DoomAll();  // every rank dooms them when it hears of this; this rank's rounds first
    const WorldInfo& w = world();
    for (int r = 0; r < w.size; ++r) {
      if (r == w.rank || departures_.Left(r)) continue;
      ++*pending;
      backend_->Send(r, NeighborExchange::kTag, NeighborExchange::LeaveNotice(generation_),
                     [pending](const Status&) { --*pending; });
    }
    // Small messages complete at once; a peer that is gone must not hold this rank here.
    const auto deadline = Clock::now() + std::chrono::seconds(5);
    while ((*pending > 0 || cache_.InFlight()) && Clock::now() < deadline) {
      if (!backend_->Progress()) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  } catch (const std::exception& ex) {
    Log(LOG_WARNING, std::string("could not tell the peers that this rank leaves: ") + ex.what());
  }
  lock.lock();
  driving_ = false;
  leaving_ = false;
  done_cv_.notify_all();
}

EntryPtr Runtime::Find(int64_t handle) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = handles_.find(handle);
  return it == handles_.end() ? nullptr : it->second;
}

size_t Runtime::HandleCount() {
  std::lock_guard<std::mutex> lock(mu_);
  return handles_.size();
}

int Runtime::Poll(int64_t handle) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = handles_.find(handle);
  if (it == handles_.end()) return -SHOAL_UNKNOWN_HANDLE;
  return it->second->done ? 1 : 0;
}

int Runtime::InUse(int64_t handle) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = handles_.find(handle);
  if (it == handles_.end()) return -SHOAL_UNKNOWN_HANDLE;
  const Entry& e = *it->second;
  return !e.done || (e.direct_sends && e.sends_pending > 0) ? 1 : 0;
}

Status Runtime::Wait(int64_t handle, int64_t timeout_ms) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = handles_.find(handle);
  if (it == handles_.end()) return Status::Error(SHOAL_UNKNOWN_HANDLE, "unknown handle " + std::to_string(handle));
  EntryPtr e = it->second;
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms < 0 ? int64_t{1} << 40 : timeout_ms);
  // Drive progress here rather than hand the op to the background thread and be woken
  // again: on busy cores each thread switch costs tens of microseconds.
  ++waiters_;
  e->waited = true;
  Pacer pace(cfg_.cycle_time_ms, CycleTime());
  bool busy = false;
  const auto longest = CycleTime();
  auto wait = std::chrono::microseconds(0);
  // Like MPI_Sendrecv, stay until this op's own sends are through too (receivers of large
  // messages need the sender's progress), unless they stopped moving or others drive.
  auto finished = [&] {
    return e->done && (e->sends_pending == 0 || wait >= longest || driving_ || stop_);
  };
  while (!finished() && Clock::now() < deadline) {
    if (driving_ || stop_ || leaving_) {
      done_cv_.wait_until(lock, leaving_ ? std::min(deadline, Clock::now() + CycleTime()) : deadline);
      continue;
    }
    wait = Drive(lock, &pace, &busy, e.get());
    if (wait.count() > 0 && !finished()) done_cv_.wait_until(lock, std::min(deadline, Clock::now() + wait));
  }
  --waiters_;
  // Hand progress on: to another waiter, else to the background thread if work is left.
  if (waiters_ > 0 || stop_) done_cv_.notify_all();
  else if (busy || !queue_.empty()) work_cv_.notify_one();
  if (!e->done) return Status::Error(SHOAL_TIMEOUT, "still running");
  return e->status;
}

std::chrono::microseconds Runtime::Drive(std::unique_lock<std::mutex>& lock, Pacer* pace, bool* busy,
                                         const Entry* waited) {
  driving_ = true;
  lock.unlock();
  // The driver may be a user thread: leave its current CUDA device as it was.
  const int device = devices_.CurrentDevice();
  bool progressed = SafeCycle(pace == nullptr);
  devices_.RestoreDevice(device);
  auto wait = std::chrono::microseconds(0);
  if (pace) {
    *busy = !awaiting_response_.empty() || !neighbors_.Idle() || backend_->num_in_flight() > 0 ||
            devices_.Busy();
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

bool Runtime::Release(int64_t handle) {
  std::lock_guard<std::mutex> lock(mu_);
  return handles_.erase(handle) > 0;
}

void Runtime::Finish(const EntryPtr& e, const Status& st_in) {
  Status st = e->gpu ? devices_.Complete(*e, st_in) : st_in;
  // A failure while the job lost a rank is the loss's, whatever failed first (a send to the
  // dead rank, a peer's leave notice): one error on every survivor (docs/design.md §16).
  if (!st.ok() && st.code != SHOAL_RANK_LOST && backend_->Lost()) st.code = SHOAL_RANK_LOST;
  if (st.ok()) {
    switch (e->sig.op) {
      case SHOAL_OP_ALLREDUCE: ++stats_.allreduce; break;
      case SHOAL_OP_BROADCAST: ++stats_.broadcast; break;
      case SHOAL_OP_ALLGATHER: ++stats_.allgather; break;
      case SHOAL_OP_BARRIER: ++stats_.barrier; break;
      case SHOAL_OP_NEIGHBOR_ALLREDUCE: ++stats_.neighbor_allreduce; break;
      case SHOAL_OP_NEIGHBOR_ALLGATHER: ++stats_.neighbor_allgather; break;
      case SHOAL_OP_REDUCESCATTER: ++stats_.reducescatter; break;
      case SHOAL_OP_HIERARCHICAL_NEIGHBOR_ALLREDUCE: ++stats_.hierarchical_neighbor_allreduce; break;
      case SHOAL_OP_ALLTOALL: ++stats_.alltoall; break;
    }
  } else {
    ++stats_.errors;
    Log(LOG_DEBUG, "op failed: " + st.message);
    if (e->sig.op == SHOAL_OP_NEIGHBOR_ALLREDUCE || e->sig.op == SHOAL_OP_NEIGHBOR_ALLGATHER)
      neighbors_.Failed(e->name, e->step);  // its peers' pieces of that step are not data for the next
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (e->done) return;
    e->done = true;
    e->status = st;
    if (NameState* ns = names_.Find(e->key())) ns->in_flight = false;
    if (!e->group.empty()) {  // the group's name is free once every member is done
      NameState* gs = names_.Find(e->group);
      if (gs && --gs->members_left <= 0) gs->in_flight = false;
    }
    if (e->sig.op == kOpJoin) join_.SetInFlight(false);
  }
  auto t_callback = Clock::now();
  done_cv_.notify_all();
  if (e->callback) e->callback(e->handle, st.code, st.message.c_str(), e->callback_arg);
  if (timeline_.enabled()) Trace(*e, st, t_callback);
  if (e->stages) stages_.Next(e, st);
}

void Runtime::Trace(const Entry& e, const Status& st, Clock::time_point t_callback) {
  const Clock::time_point unset{}, now = Clock::now();
  std::string args = "\"bytes\": " + std::to_string(e.nbytes());
  if (!st.ok()) args += ", \"error\": \"" + JsonEscape(st.message) + "\"";
  timeline_.Span(e.name, OpName(e.sig.op), e.enqueued, now, args);
  auto span = [&](const char* phase, Clock::time_point a, Clock::time_point b) {
    if (a != unset && b != unset) timeline_.Span(e.name, phase, a, b);
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
  timeline_.Span(e.name, (std::string("ENQUEUE_") + bf).c_str(), e.enqueued, now);
  timeline_.Span(e.name, (std::string("PROC_") + bf).c_str(), proc, now);
  timeline_.Span(e.name, (std::string("MPI_") + bf).c_str(), proc, now);
  span("COMMUNICATE", e.t_comm_start, e.t_peers_ready);
  if (base != SHOAL_OP_NEIGHBOR_ALLGATHER) span("COMPUTE_AVERAGE", e.t_reduce_start, e.t_reduce_end);
}

void Runtime::FailAll(const std::string& why, int code) {
  std::vector<EntryPtr> pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& kv : handles_) if (!kv.second->done) pending.push_back(kv.second);
    for (auto& e : queue_) if (!e->done) pending.push_back(e);
    queue_.clear();
    queued_ = 0;
  }
  for (auto& e : pending)
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
  awaiting_response_.clear();
  grouped_.Clear();
  neighbor_ready_.clear();
  fresh_.clear();
  neighbors_.TakeAll();
  stop_ = true;
  if (backend_->Lost()) FailAll(kLostRank, SHOAL_RANK_LOST);
  else FailAll("Shoal's runtime failed: " + failure);
  return false;
}

void Runtime::Loop() {
  SetLogContext(world().rank, cfg_.log_level);
  const auto longest = CycleTime();
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
    else if (wait.count() > 0) work_cv_.wait_for(lock, wait, [&] { return stop_ || !queue_.empty(); });
  }
}

bool Runtime::Cycle(bool start_only) {
  bool progressed = false;
  // Swapped with queue_ and cleared after use: both keep their capacity.
  std::vector<EntryPtr>& fresh = fresh_;
  if (queued_ > 0) {
    std::lock_guard<std::mutex> lock(mu_);
    fresh.swap(queue_);
    queued_ = 0;
  }
  std::vector<Request> to_coordinator;
  for (auto& e : fresh) {
    if (e->gpu) devices_.Stage(e, &to_coordinator);
    else Route(e, &to_coordinator);
  }
  progressed |= !fresh.empty();
  fresh.clear();
  if (!late_requests_.empty()) {
    to_coordinator.insert(to_coordinator.end(), late_requests_.begin(), late_requests_.end());
    late_requests_.clear();
  }
  progressed |= devices_.Poll(&to_coordinator);
  if (join_.RequestDue()) SendJoin(&to_coordinator);  // after the rank's own requests

  if (!to_coordinator.empty()) {
    ++stats_.coordinator_rounds;
    SendRequests(&to_coordinator);
  }
  // Every arrived message. The control tag is probed first: that probe also runs MPI's
  // progress, so neighbor data that just arrived is matched by the next probe in this same
  // cycle (probing neighbor data first, or MPI_ANY_TAG, left small messages unseen for up
  // to hundreds of microseconds with the MPICH wheel).
  static const std::vector<int> kCoordinatorTags = {kRequestTag, NeighborExchange::kTag},
                                kWorkerTags = {kResponseTag, NeighborExchange::kTag},
                                kLeaderTags = {kRequestTag, kResponseTag, NeighborExchange::kTag};  // of a process set
  Status st;
  int src = -1, tag = -1;
  while (!start_only) {
    if (!spare_) spare_ = recv_pool_->Get(0);
    if (!backend_->Receive(coordinator_ ? kCoordinatorTags : sets_.Leader() ? kLeaderTags : kWorkerTags, &tag, &src,
                           spare_.get(), &st))
      break;
    if (!st.ok()) throw std::runtime_error(st.message);
    progressed = true;
    Bytes msg = std::move(spare_);
    if (tag == NeighborExchange::kTag) {
      uint64_t generation = 0;
      int64_t join_epoch = 0;
      if (DevicePlane::IsLinkMessage(*msg)) devices_.plane()->OnLinkMessage(src, *msg);
      else if (Join::IsNotice(*msg, &generation, &join_epoch)) { if (generation == generation_) OnJoinNotice(src, join_epoch); }
      else if (!NeighborExchange::IsLeaveNotice(*msg, &generation)) neighbors_.Accept(src, std::move(msg));
      else if (generation == generation_) OnLeave(src);  // else: from a runtime before a shutdown
    } else if (tag == kRequestTag) {
      OnRequests(src, *msg);
    } else if (tag == kResponseTag && !coordinator_) {
      for (auto& r : DecodeResponses(msg->data(), msg->size())) Apply(r);
    } else {
      throw std::runtime_error("unexpected message with tag " + std::to_string(tag) + " from rank " + std::to_string(src));
    }
  }
  if (!st.ok()) throw std::runtime_error(st.message);
  if (coordinator_ && !start_only) {
    std::vector<Response> resps = coordinator_->TakeResponses();
    if (!resps.empty()) {
      Respond(nullptr, std::move(resps));
      progressed = true;
    }
    if (!sets_.Leader()) stats_.negotiations = coordinator_->negotiations();
  }
  if (sets_.Leader() && !start_only) progressed |= RespondForSets();  // (and counts every coordinator's negotiations)

  if (!neighbor_ready_.empty()) {
    neighbors_.Start(neighbor_ready_);
    neighbor_ready_.clear();
    progressed = true;
  }
  if (start_only) return progressed;
  progressed |= backend_->Progress();  // first: sends and separate data that completed
  for (auto& done : neighbors_.Complete()) {
    Finish(done.first, done.second);
    progressed = true;
  }
  if (!cache_.Empty()) cache_.Check(Clock::now());
  CheckStalls();
  if (timeline_.enabled() && Clock::now() - last_flush_ > std::chrono::milliseconds(100)) {
    timeline_.Flush();  // keep the file readable while the job runs
    last_flush_ = Clock::now();
  }
  return progressed;
}

}  // namespace shoal
