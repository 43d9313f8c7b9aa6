#include "runtime.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "reduce.h"

namespace shoal {
namespace {

constexpr int kRequestTag = 1, kResponseTag = 2;
constexpr int64_t kUnnamed = 1024;
// Handles are unique for the whole process, across init/shutdown cycles.
std::atomic<int64_t> g_next_handle{1};
// Runtimes created in this process; the same sequence on every rank (init is collective).
std::atomic<uint64_t> g_generations{0};

bool IsHalf(int dtype) { return dtype == SHOAL_FLOAT16 || dtype == SHOAL_BFLOAT16; }

std::string Seconds(double s) {
  std::ostringstream o;
  o << s;
  return o.str();
}

std::string Ranks(const std::vector<int>& r) {
  std::ostringstream s;
  for (size_t i = 0; i < r.size(); ++i) s << (i ? ", " : "") << r[i];
  return s.str();
}

[[noreturn]] void Bad(const std::string& msg) { throw ArgumentError(SHOAL_INVALID_ARGUMENT, msg); }

// `op` and `which` ("receive"/"send") name the list in errors. Runs for every op: no
// allocation beyond the result unless the list is long.
std::vector<int> CheckPeers(const char* op, const char* which, const int32_t* ranks, int n, int self, int size) {
  auto what = [&] { return std::string(op) + " " + which + " ranks"; };
  if (n < 0 || (n > 0 && !ranks)) Bad(what() + ": missing rank list");
  std::vector<int> out(ranks, ranks + n);
  for (int r : out) {
    if (r < 0 || r >= size) Bad(what() + ": rank " + std::to_string(r) + " is outside [0, " + std::to_string(size) + ")");
    if (r == self) Bad(what() + ": rank " + std::to_string(r) + " is this rank itself");
  }
  auto twice = [&](int r) { Bad(what() + ": rank " + std::to_string(r) + " appears twice"); };
  if (n <= 16) {
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < i; ++j)
        if (out[i] == out[j]) twice(out[i]);
  } else {
    std::vector<int> sorted = out;
    std::sort(sorted.begin(), sorted.end());
    auto dup = std::adjacent_find(sorted.begin(), sorted.end());
    if (dup != sorted.end()) twice(*dup);
  }
  return out;
}

}  // namespace

Runtime::Runtime(const Config& cfg, std::unique_ptr<Backend> backend)
    : cfg_(cfg), backend_(std::move(backend)), generation_(++g_generations),
      device_plane_(backend_.get(), &stats_),
      neighbors_(backend_.get(), &device_plane_, cfg.fusion_threshold, &stats_, !cfg.timeline.empty()) {
  if (world().rank == 0) coordinator_ = std::make_unique<Coordinator>(world().size, cfg_.fusion_threshold);
  if (!cfg_.timeline.empty()) {
    std::string path = cfg_.timeline + std::to_string(world().rank) + ".json";
    if (!timeline_.Open(path, world().rank)) Log(LOG_ERROR, "cannot write the timeline " + path);
  }
  thread_ = std::thread([this] { Loop(); });
}

void Runtime::Stop() {
  if (!stop_) Leave();
  if (windows_) windows_->Stop();
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
  FailAll("Shoal was shut down before the op completed");
  device_plane_.Stop();
  StopNccl();
  timeline_.Close();
}

double Runtime::Now() const {
  return std::chrono::duration<double>(Clock::now() - start_).count();
}

int64_t Runtime::Enqueue(const shoal_op_desc& d, shoal_callback cb, void* cb_arg) {
  const WorldInfo& w = world();
  auto e = std::make_shared<Entry>();
  if (d.op < SHOAL_OP_ALLREDUCE || d.op > SHOAL_OP_NEIGHBOR_ALLGATHER) Bad("unknown op code " + std::to_string(d.op));
  const char* op = OpName(d.op);
  try {
  e->sig.op = d.op;
  if (d.op != SHOAL_OP_BARRIER) {
    DtypeSize(d.input.dtype);  // throws for an unknown dtype
    if (d.input.ndim < 0 || d.input.ndim > 32 || (d.input.ndim > 0 && !d.input.shape)) Bad(std::string(op) + ": bad shape");
    e->sig.dtype = d.input.dtype;
    e->sig.shape.assign(d.input.shape, d.input.shape + d.input.ndim);
    for (auto s : e->sig.shape) if (s < 0) Bad(std::string(op) + ": negative dimension in " + ShapeString(e->sig.shape));
    e->sig.device_type = d.input.device_type;
    if (d.input.device_type != SHOAL_DEVICE_CPU && d.input.device_type != SHOAL_DEVICE_CUDA)
      Bad(std::string(op) + ": unknown device type " + std::to_string(d.input.device_type));
    if (!d.input.data && e->nbytes() > 0) Bad(std::string(op) + ": null data pointer");
    if (e->count() > INT32_MAX) Bad(std::string(op) + ": tensors of more than 2^31-1 elements are not supported");
    e->input = {d.input.data, d.input.device_type, d.input.device_id, d.input.stream, d.input.ready_event};
    e->output = e->input;
    if (d.output.data) e->output.data = d.output.data;
  }
  const std::string dt = DtypeName(e->sig.dtype);
  if (d.op == SHOAL_OP_ALLREDUCE || d.op == SHOAL_OP_BROADCAST) {
    if (d.scope != SHOAL_SCOPE_WORLD && d.scope != SHOAL_SCOPE_MACHINE) Bad(std::string(op) + ": unknown scope");
    e->sig.scope = d.scope;
  }
  const int scope_size = e->sig.scope == SHOAL_SCOPE_MACHINE ? w.local_size : w.size;
  switch (d.op) {
    case SHOAL_OP_ALLREDUCE:
      if (d.input.dtype == SHOAL_BOOL) Bad("allreduce: bool tensors cannot be summed");
      if (d.reduce_op != SHOAL_REDUCE_SUM && d.reduce_op != SHOAL_REDUCE_AVERAGE) Bad("allreduce: unknown reduce op");
      if (d.reduce_op == SHOAL_REDUCE_AVERAGE && !IsFloating(d.input.dtype))
        Bad("allreduce: average of " + dt + " is not representable; use op=Sum or a floating dtype");
      e->sig.reduce_op = d.reduce_op;
      break;
    case SHOAL_OP_BROADCAST:
      if (d.root_rank < 0 || d.root_rank >= scope_size)
        Bad("broadcast: root rank " + std::to_string(d.root_rank) + " is outside [0, " + std::to_string(scope_size) + ")");
      e->sig.root_rank = d.root_rank;
      break;
    case SHOAL_OP_ALLGATHER:
      if (e->sig.shape.empty()) Bad("allgather: a 0-d tensor has no first dimension to concatenate along");
      break;
    case SHOAL_OP_NEIGHBOR_ALLGATHER:
    case SHOAL_OP_NEIGHBOR_ALLREDUCE:
      if (d.op == SHOAL_OP_NEIGHBOR_ALLREDUCE && !IsFloating(d.input.dtype))
        Bad("neighbor_allreduce: weighted averaging needs a floating dtype, got " + dt);
      if (d.op == SHOAL_OP_NEIGHBOR_ALLGATHER && e->sig.shape.empty())
        Bad("neighbor_allgather: a 0-d tensor has no first dimension to concatenate along");
      e->recv_ranks = CheckPeers(op, "receive", d.recv_ranks, d.n_recv, w.rank, w.size);
      e->send_ranks = CheckPeers(op, "send", d.send_ranks, d.n_send, w.rank, w.size);
      e->topo_check = d.topo_check != 0;
      e->uniform = d.uniform != 0;
      e->self_weight = d.self_weight;
      if (!e->uniform) {
        if (d.n_recv > 0 && !d.recv_weights) Bad("neighbor_allreduce: weights missing");
        e->recv_weights.assign(d.recv_weights, d.recv_weights + d.n_recv);
      }
      if (d.send_weights) e->send_weights.assign(d.send_weights, d.send_weights + d.n_send);
      break;
  }
  } catch (const ArgumentError& ex) {
    Reject(d.op, d.name, ex.code, ex.what());
    throw;
  }
  // Last, after validation: marks the point the producer reached on the caller's stream.
  if (d.op != SHOAL_OP_BARRIER && d.input.device_type == SHOAL_DEVICE_CUDA) e->gpu = CaptureGpuOp(d, e->nbytes());
  std::unique_lock<std::mutex> lock(mu_);
  if (stop_) throw ArgumentError(SHOAL_NOT_INITIALIZED, "Shoal is shutting down");
  if (left_) throw ArgumentError(SHOAL_ABORTED, "this rank has left the job (shoal.shutdown() or exit)");
  e->name = NameLocked(d.op, d.name);
  NameState& ns = names_[e->name];
  if (ns.in_flight)
    throw ArgumentError(SHOAL_DUPLICATE_NAME, std::string(op) + ": an op named '" + e->name +
                                                  "' is already in flight on this rank; wait for it or use another name");
  e->callback = cb;
  e->callback_arg = cb_arg;
  ns.in_flight = true;
  e->step = ns.calls++;
  e->handle = g_next_handle++;
  handles_[e->handle] = e;
  queue_.push_back(e);
  queued_ = queue_.size();
  const int64_t handle = e->handle;
  if (driving_) return handle;  // the driver takes it next cycle
  if (waiters_ > 0) {
    done_cv_.notify_all();  // a waiter between cycles drives it
  } else if (cb) {
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
  return handle;
}

std::string Runtime::NameLocked(int op, const char* name) {
  // Unnamed ops cycle through kUnnamed names per op, so caches stay bounded and repeated
  // unnamed neighbor ops hit the negotiated-name cache.
  if (name && *name) return name;
  return std::string(OpName(op)) + ".noname." + std::to_string(noname_counter_[op]++ % kUnnamed);
}

void Runtime::Reject(int op, const char* name, int code, const std::string& error) {
  if (op < SHOAL_OP_ALLREDUCE || op > SHOAL_OP_NEIGHBOR_ALLGATHER || world().size == 1) return;
  std::unique_lock<std::mutex> lock(mu_);
  if (stop_ || left_) return;
  auto e = std::make_shared<Entry>();
  e->sig.op = op;
  e->name = NameLocked(op, name);
  NameState& ns = names_[e->name];
  if (ns.in_flight) return;  // the call is refused as a duplicate: it is not this step's
  e->step = ns.calls++;
  e->reject = error;
  e->reject_code = code == SHOAL_INVALID_TYPE ? code : SHOAL_INVALID_ARGUMENT;
  e->done = true;
  queue_.push_back(e);
  queued_ = queue_.size();
  if (driving_) return;
  if (waiters_ > 0) done_cv_.notify_all();
  else Drive(lock, nullptr, nullptr);
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
    const WorldInfo& w = world();
    for (int r = 0; r < w.size; ++r) {
      if (r == w.rank || (r < static_cast<int>(peer_left_.size()) && peer_left_[r])) continue;
      ++*pending;
      backend_->Send(r, NeighborExchange::kTag, NeighborExchange::LeaveNotice(generation_),
                     [pending](const Status&) { --*pending; });
    }
    // Small messages complete at once; a peer that is gone must not hold this rank here.
    const auto deadline = Clock::now() + std::chrono::seconds(5);
    while (*pending > 0 && Clock::now() < deadline) {
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
  const int device = gpu_ ? gpu_->CurrentDevice() : -1;
  bool progressed = SafeCycle(pace == nullptr);
  if (device >= 0) gpu_->RestoreDevice(device);
  auto wait = std::chrono::microseconds(0);
  if (pace) {
    *busy = !awaiting_response_.empty() || !neighbors_.Idle() || backend_->num_in_flight() > 0 ||
            (gpu_ && !gpu_->Idle()) || !nccl_in_flight_.empty() || !device_plane_.Idle();
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
  if (e->gpu && e->gpu->direct && !st_in.ok() && gpu_) {
    // Sends of this entry may still be queued on the device plane's streams.
    const char* err = nullptr;
    if (void* s = gpu_->Stream(e->gpu->device, &err)) device_plane_.Fence(*e, s);
  }
  const Status st = e->gpu ? CompleteGpu(*e, st_in) : st_in;
  if (st.ok()) {
    switch (e->sig.op) {
      case SHOAL_OP_ALLREDUCE: ++stats_.allreduce; break;
      case SHOAL_OP_BROADCAST: ++stats_.broadcast; break;
      case SHOAL_OP_ALLGATHER: ++stats_.allgather; break;
      case SHOAL_OP_BARRIER: ++stats_.barrier; break;
      case SHOAL_OP_NEIGHBOR_ALLREDUCE: ++stats_.neighbor_allreduce; break;
      case SHOAL_OP_NEIGHBOR_ALLGATHER: ++stats_.neighbor_allgather; break;
    }
  } else {
    ++stats_.errors;
    Log(LOG_DEBUG, "op failed: " + st.message);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (e->done) return;
    e->done = true;
    e->status = st;
    auto ns = names_.find(e->name);
    if (ns != names_.end()) ns->second.in_flight = false;
  }
  auto t_callback = Clock::now();
  done_cv_.notify_all();
  if (e->callback) e->callback(e->handle, st.code, st.message.c_str(), e->callback_arg);
  if (timeline_.enabled()) Trace(*e, st, t_callback);
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
}

void Runtime::FailAll(const std::string& why) {
  std::vector<EntryPtr> pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& kv : handles_) if (!kv.second->done) pending.push_back(kv.second);
    for (auto& e : queue_) if (!e->done) pending.push_back(e);
    queue_.clear();
    queued_ = 0;
  }
  for (auto& e : pending)
    Finish(e, Status::Error(SHOAL_ABORTED, std::string(OpName(e->sig.op)) + " '" + e->name + "': " + why));
}

bool Runtime::SafeCycle(bool start_only) {
  try {
    return Cycle(start_only);
  } catch (const std::exception& ex) {
    // Unrecoverable (MPI failure, corrupt message): fail everything and stop
    // touching any op's memory; later enqueues are refused.
    Log(LOG_ERROR, std::string("runtime loop failed: ") + ex.what());
    awaiting_response_.clear();
    neighbor_ready_.clear();
    fresh_.clear();
    neighbors_.TakeAll();
    stop_ = true;
    FailAll(std::string("Shoal's runtime failed: ") + ex.what());
    return false;
  }
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
  const WorldInfo& w = world();
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
    if (e->gpu) StageGpu(e, &to_coordinator);
    else Route(e, &to_coordinator);
  }
  progressed |= !fresh.empty();
  fresh.clear();
  progressed |= PollGpu(&to_coordinator);

  if (!to_coordinator.empty()) {
    ++stats_.coordinator_rounds;
    if (coordinator_) {
      for (auto& r : to_coordinator) coordinator_->Add(0, r, Now());
    } else {
      auto msg = std::make_shared<ByteVec>(EncodeRequests(to_coordinator));
      backend_->Send(0, kRequestTag, msg, [this](const Status& st) {
        if (!st.ok()) FailAll("cannot reach the coordinator (rank 0): " + st.message);
      });
    }
  }
  // Every arrived message. The control tag is probed first: that probe also runs MPI's
  // progress, so neighbor data that just arrived is matched by the next probe in this same
  // cycle (probing neighbor data first, or MPI_ANY_TAG, left small messages unseen for up
  // to hundreds of microseconds with the MPICH wheel).
  static const std::vector<int> kCoordinatorTags = {kRequestTag, NeighborExchange::kTag},
                                kWorkerTags = {kResponseTag, NeighborExchange::kTag};
  Status st;
  int src = -1, tag = -1;
  while (!start_only) {
    if (!spare_) spare_ = recv_pool_->Get(0);
    if (!backend_->Receive(coordinator_ ? kCoordinatorTags : kWorkerTags, &tag, &src, spare_.get(), &st)) break;
    if (!st.ok()) throw std::runtime_error(st.message);
    progressed = true;
    Bytes msg = std::move(spare_);
    if (tag == NeighborExchange::kTag) {
      uint64_t generation = 0;
      if (DevicePlane::IsLinkMessage(*msg)) device_plane_.OnLinkMessage(src, *msg);
      else if (!NeighborExchange::IsLeaveNotice(*msg, &generation)) neighbors_.Accept(src, std::move(msg));
      else if (generation == generation_) OnLeave(src);  // else: from a runtime before a shutdown
    } else if (tag == kRequestTag && coordinator_) {
      for (auto& r : DecodeRequests(msg->data(), msg->size())) coordinator_->Add(src, r, Now());
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
      auto msg = std::make_shared<ByteVec>(EncodeResponses(resps));
      for (int r = 1; r < w.size; ++r)
        if (!any_left_ || !peer_left_[r]) backend_->Send(r, kResponseTag, msg, [](const Status&) {});
      for (auto& r : resps) Apply(r);
      progressed = true;
    }
    stats_.negotiations = coordinator_->negotiations();
  }

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
  CheckStalls();
  if (timeline_.enabled() && Clock::now() - last_flush_ > std::chrono::milliseconds(100)) {
    timeline_.Flush();  // keep the file readable while the job runs
    last_flush_ = Clock::now();
  }
  return progressed;
}

void Runtime::Route(const EntryPtr& e, std::vector<Request>* to_coordinator) {
  if (!e->reject.empty()) {  // a refusal: only the coordinator hears of it, and tells the others
    Request req{e->name, e->sig, e->step, e->reject, e->reject_code, false, {}, {}};
    if (coordinator_) coordinator_->Add(0, req, Now());
    else to_coordinator->push_back(std::move(req));
    return;
  }
  if (FailIfUnreachable(e)) return;
  const bool neighbor = e->sig.op == SHOAL_OP_NEIGHBOR_ALLREDUCE || e->sig.op == SHOAL_OP_NEIGHBOR_ALLGATHER;
  if (neighbor && !e->topo_check && negotiated_neighbor_names_.count(e->name)) {
    ++stats_.cache_hits;
    neighbor_ready_.push_back(e);
    return;
  }
  awaiting_response_[e->name] = e;
  Request req{e->name, e->sig, e->step, {}, 0, e->topo_check, {}, {}};
  if (e->topo_check) {
    req.send = e->send_ranks;
    req.recv = e->recv_ranks;
  }
  to_coordinator->push_back(std::move(req));
}

bool Runtime::FailIfUnreachable(const EntryPtr& e) {
  if (!rejections_.empty()) {
    auto it = rejections_.find(e->name);
    if (it != rejections_.end() && it->second.step == e->step) {
      const Status st = Status::Error(it->second.code, it->second.error);
      rejections_.erase(it);
      Finish(e, st);
      return true;
    }
  }
  if (!any_left_) return false;
  const bool neighbor = e->sig.op == SHOAL_OP_NEIGHBOR_ALLREDUCE || e->sig.op == SHOAL_OP_NEIGHBOR_ALLGATHER;
  std::vector<int> gone;
  if (neighbor && negotiated_neighbor_names_.count(e->name) && !e->topo_check) {
    // A peer that left may have sent its piece before it left: only a missing one is fatal.
    for (int r : e->recv_ranks) if (peer_left_[r] && !neighbors_.HasPiece(r, e->name)) gone.push_back(r);
    // Nobody takes what is sent to a rank that left (it needs nothing more): skip it.
    for (size_t k = e->send_ranks.size(); k-- > 0;) {
      if (!peer_left_[e->send_ranks[k]]) continue;
      e->send_ranks.erase(e->send_ranks.begin() + k);
      if (k < e->send_weights.size()) e->send_weights.erase(e->send_weights.begin() + k);
    }
  } else {  // every rank takes part in a collective and in a negotiation
    for (size_t r = 0; r < peer_left_.size(); ++r) if (peer_left_[r]) gone.push_back(static_cast<int>(r));
  }
  if (gone.empty()) return false;
  Finish(e, Status::Error(SHOAL_ABORTED, std::string(OpName(e->sig.op)) + " '" + e->name + "': " +
                                             (gone.size() == 1 ? "rank " : "ranks ") + Ranks(gone) +
                                             " left the job (script ended, sys.exit or shoal.shutdown()) "
                                             "before taking part in this op"));
  return true;
}

std::string Runtime::LeftRanksMessage() const {
  std::lock_guard<std::mutex> lock(left_mu_);
  if (left_ranks_.empty()) return "";
  std::vector<int> ranks = left_ranks_;
  std::sort(ranks.begin(), ranks.end());
  return (ranks.size() == 1 ? "rank " : "ranks ") + Ranks(ranks) +
         " left the job (script ended, sys.exit or shoal.shutdown()) before taking part in this op";
}

void Runtime::OnLeave(int rank) {
  if (peer_left_.empty()) peer_left_.assign(world().size, 0);
  if (peer_left_[rank]) return;
  peer_left_[rank] = 1;
  any_left_ = true;
  {
    std::lock_guard<std::mutex> lock(left_mu_);
    left_ranks_.push_back(rank);
  }
  Log(LOG_DEBUG, "rank " + std::to_string(rank) + " left the job");
  device_plane_.OnLeave(rank);
  const std::string why = " left the job (script ended, sys.exit or shoal.shutdown()) before taking part in this op";
  for (auto& e : neighbors_.TakeNeeding(rank))
    Finish(e, Status::Error(SHOAL_ABORTED, std::string(OpName(e->sig.op)) + " '" + e->name + "': rank " +
                                               std::to_string(rank) + why));
  if (coordinator_) {
    std::vector<Response> resps = coordinator_->Leave(rank);
    if (resps.empty()) return;
    auto msg = std::make_shared<ByteVec>(EncodeResponses(resps));
    for (int q = 1; q < world().size; ++q)
      if (!peer_left_[q]) backend_->Send(q, kResponseTag, msg, [](const Status&) {});
    for (auto& r : resps) Apply(r);
  } else if (rank == 0) {  // no coordinator any more: nothing waiting for it can complete
    std::vector<EntryPtr> waiting;
    for (auto& kv : awaiting_response_) waiting.push_back(kv.second);
    awaiting_response_.clear();
    for (auto& e : waiting)
      Finish(e, Status::Error(SHOAL_ABORTED, std::string(OpName(e->sig.op)) + " '" + e->name + "': rank 0" + why));
  }
}

void Runtime::Apply(const Response& r) {
  std::vector<EntryPtr> batch;
  const auto now = Clock::now();
  for (auto& name : r.names) {
    stall_warned_.erase(name);
    auto it = awaiting_response_.find(name);
    if (it == awaiting_response_.end() || (r.step >= 0 && it->second->step != r.step))
      continue;  // e.g. an abort for an op this rank never sent
    it->second->t_negotiated = now;
    batch.push_back(it->second);
    awaiting_response_.erase(it);
  }
  if (r.kind != Response::EXECUTE) {
    const int code = r.kind == Response::REJECTED ? r.code
                     : r.kind == Response::LEFT   ? SHOAL_ABORTED
                                                  : SHOAL_MISMATCH;
    if (r.kind == Response::REJECTED) {
      for (auto& name : r.names) {
        for (auto& e : neighbors_.TakeNamed(name, r.step)) batch.push_back(e);
        if (!batch.empty()) continue;
        // Remember it for when this rank submits that step, unless it is past it already.
        std::lock_guard<std::mutex> lock(mu_);
        auto ns = names_.find(name);
        if ((ns == names_.end() || ns->second.calls <= r.step) && rejections_.size() < 1024)
          rejections_[name] = r;
      }
    }
    for (auto& e : batch) Finish(e, Status::Error(code, r.error));
    return;
  }
  if (batch.size() != r.names.size()) {
    Log(LOG_ERROR, "coordinator scheduled an op this rank does not have: " + r.names[0]);
    for (auto& e : batch) Finish(e, Status::Error(SHOAL_ABORTED, "internal error: inconsistent schedule"));
    return;
  }
  if (r.op == SHOAL_OP_NEIGHBOR_ALLREDUCE || r.op == SHOAL_OP_NEIGHBOR_ALLGATHER) {
    for (auto& e : batch) {
      negotiated_neighbor_names_.insert(e->name);
      neighbor_ready_.push_back(e);
    }
    return;
  }
  RunCollective(r, std::move(batch));
}

void Runtime::RunCollective(const Response& r, std::vector<EntryPtr> batch) {
  const WorldInfo& w = world();
  ++stats_.global_collectives;
  const auto t0 = Clock::now();
  for (auto& e : batch) e->t_comm_start = t0;
  if (r.op != SHOAL_OP_BARRIER && batch[0]->gpu && batch[0]->gpu->nccl) return RunNccl(r, batch);
  // Completion of the communication itself (the timeline's COMMUNICATE phase).
  auto communicated = [](const EntryPtr& e) { e->t_comm_end = Clock::now(); };
  if (r.op == SHOAL_OP_BARRIER) {
    backend_->Barrier([this, communicated, e = batch[0]](const Status& st) { communicated(e); Finish(e, st); });
    return;
  }
  if (r.op == SHOAL_OP_BROADCAST) {
    EntryPtr e = batch[0];
    if (w.rank == e->sig.root_rank && e->output.data != e->input.data)
      std::memcpy(e->output.data, e->input.data, e->nbytes());
    if (e->count() == 0) return Finish(e, Status::Ok());
    backend_->Broadcast(e->output.data, e->count(), e->sig.dtype, e->sig.root_rank, e->sig.scope,
                        [this, communicated, e](const Status& st) { communicated(e); Finish(e, st); });
    return;
  }
  if (r.op == SHOAL_OP_ALLGATHER) {
    EntryPtr e = batch[0];
    int64_t row = 1;
    for (size_t i = 1; i < e->sig.shape.size(); ++i) row *= e->sig.shape[i];
    std::vector<int64_t> counts;
    int64_t rows = 0;
    for (int64_t d : r.first_dims[0]) {
      counts.push_back(d * row);
      rows += d;
    }
    e->result_shape = e->sig.shape;
    e->result_shape[0] = rows;
    e->result_nbytes = rows * row * DtypeSize(e->sig.dtype);
    e->result = std::malloc(std::max<size_t>(e->result_nbytes, 1));
    if (e->result_nbytes == 0) return Finish(e, Status::Ok());
    backend_->Allgatherv(e->input.data, e->count(), e->result, counts, e->sig.dtype,
                         [this, communicated, e](const Status& st) { communicated(e); Finish(e, st); });
    return;
  }
  // Allreduce: a batch (fused when > 1 or half precision) reduced in one call.
  const int dtype = batch[0]->sig.dtype;
  const bool average = batch[0]->sig.reduce_op == SHOAL_REDUCE_AVERAGE;
  const int scope = batch[0]->sig.scope;
  const int n = scope == SHOAL_SCOPE_MACHINE ? w.local_size : w.size;
  int64_t total = 0;
  for (auto& e : batch) total += e->count();
  if (total == 0) {
    for (auto& e : batch) Finish(e, Status::Ok());
    return;
  }
  if (batch.size() == 1 && !IsHalf(dtype)) {
    EntryPtr e = batch[0];
    if (e->output.data != e->input.data) std::memcpy(e->output.data, e->input.data, e->nbytes());
    backend_->Allreduce(e->output.data, e->count(), dtype, scope, [this, communicated, e, average, n](const Status& st) {
      communicated(e);
      e->t_reduce_start = Clock::now();
      if (st.ok() && average) Divide(e->output.data, e->output.data, e->sig.dtype, e->count(), n);
      e->t_reduce_end = Clock::now();
      Finish(e, st);
    });
    return;
  }
  // Half types are widened: the sum accumulates in float32 and is rounded once.
  const int wire = IsHalf(dtype) ? SHOAL_FLOAT32 : dtype;
  const size_t wsize = DtypeSize(wire);
  auto fused = fusion_pool_->Get(total * wsize);
  size_t off = 0;
  for (auto& e : batch) {
    e->t_copy_start = Clock::now();
    if (IsHalf(dtype)) WidenToFloat32(e->input.data, dtype, reinterpret_cast<float*>(fused->data() + off), e->count());
    else std::memcpy(fused->data() + off, e->input.data, e->nbytes());
    off += e->count() * wsize;
    e->t_copy_end = Clock::now();
  }
  if (batch.size() > 1) ++stats_.fused_batches;
  backend_->Allreduce(fused->data(), total, wire, scope, [this, communicated, fused, batch, dtype, wire, wsize, average, n](const Status& st) {
    size_t at = 0;
    for (auto& e : batch) {
      communicated(e);
      e->t_reduce_start = Clock::now();
      if (st.ok()) {
        char* p = fused->data() + at;
        if (average) Divide(p, p, wire, e->count(), n);
        if (wire != dtype) NarrowFromFloat32(reinterpret_cast<float*>(p), dtype, e->output.data, e->count());
        else std::memcpy(e->output.data, p, e->nbytes());
      }
      at += e->count() * wsize;
      e->t_reduce_end = Clock::now();
      Finish(e, st);
    }
  });
}

void Runtime::CheckStalls() {
  if (cfg_.stall_check_time <= 0 && cfg_.stall_shutdown_time <= 0) return;
  auto now_tp = Clock::now();
  if (now_tp - last_stall_check_ < std::chrono::milliseconds(200)) return;
  last_stall_check_ = now_tp;
  const double kill = cfg_.stall_shutdown_time;
  const double warn = cfg_.stall_check_time > 0 ? cfg_.stall_check_time : kill;
  if (coordinator_) {
    for (auto& s : coordinator_->Stalled(Now(), std::min(warn, kill > 0 ? kill : warn))) {
      std::string what = "'" + s.name + "' waited " + std::to_string(static_cast<int>(s.waited)) +
                         " s: submitted by ranks " + Ranks(s.ready) + "; missing ranks " + Ranks(s.missing);
      if (kill > 0 && s.waited >= kill) {
        ++stats_.stalls;
        Response r = coordinator_->Abort(
            s.name, "stalled op " + what + " (SHOAL_STALL_SHUTDOWN_TIME=" + Seconds(kill) + " s)");
        auto msg = std::make_shared<ByteVec>(EncodeResponses({r}));
        for (int q = 1; q < world().size; ++q)
          if (!any_left_ || !peer_left_[q]) backend_->Send(q, kResponseTag, msg, [](const Status&) {});
        Apply(r);
      } else if (s.waited >= warn && stall_warned_.insert(s.name).second) {
        ++stats_.stalls;
        Log(LOG_WARNING, "stall: " + what);
      }
    }
  }
  for (auto& wt : neighbors_.Waiting()) {
    const EntryPtr& e = wt.first;
    double waited = std::chrono::duration<double>(now_tp - e->enqueued).count();
    std::string what = std::string(OpName(e->sig.op)) + " '" + e->name + "' waited " + std::to_string(static_cast<int>(waited)) +
                       (wt.second.empty() ? " s for ranks " + Ranks(e->send_ranks) + " to take its data"
                                          : " s for ranks " + Ranks(wt.second));
    if (kill > 0 && waited >= kill) {
      ++stats_.stalls;
      neighbors_.Drop(e);
      Finish(e, Status::Error(SHOAL_ABORTED, "stalled op " + what + " (SHOAL_STALL_SHUTDOWN_TIME)"));
    } else if (waited >= warn && !e->stall_warned) {
      e->stall_warned = true;
      ++stats_.stalls;
      Log(LOG_WARNING, "stall: " + what);
    }
  }
  // Ops waiting for the coordinator are not given up locally: a coordinator that never
  // answers is a dead (or stopped) rank 0, which the launcher handles; giving up here
  // would make this rank skip a collective that the others then run.
  // Neighbor data that nobody here wants: the senders' lists disagree with ours.
  for (auto& w : neighbors_.Unmatched(now_tp, warn))
    Log(LOG_WARNING, "rank " + std::to_string(w.first) + " sent '" + w.second +
                         "' to this rank, which has not used it for " + std::to_string(static_cast<int>(warn)) +
                         " s (send and receive lists disagree?)");
}

}  // namespace shoal
