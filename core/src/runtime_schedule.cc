// The runtime's schedule: routing ops to the coordinator or the neighbors, applying the
// coordinator's responses, running collectives, and the failure paths (stalls, ranks
// that left). Driver only, like the rest of the cycle (runtime.cc).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "reduce.h"
#include "runtime.h"

namespace shoal {
namespace {

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

}  // namespace

std::vector<int64_t> GatherCounts(Entry& e, const std::vector<int64_t>& first_dims) {
  int64_t row = 1;
  for (size_t i = 1; i < e.sig.shape.size(); ++i) row *= e.sig.shape[i];
  std::vector<int64_t> counts;
  int64_t rows = 0;
  for (int64_t d : first_dims) {
    counts.push_back(d * row);
    rows += d;
  }
  e.result_shape = e.sig.shape;
  e.result_shape[0] = rows;
  e.result_nbytes = rows * row * DtypeSize(e.sig.dtype);
  e.result = std::malloc(std::max<size_t>(e.result_nbytes, 1));
  return counts;
}

std::vector<int64_t> ScatterCounts(Entry& e, int size, int rank) {
  // Horovod's split of dim 0: d0 / size rows each, one more for the first d0 % size ranks.
  const int64_t d0 = e.sig.shape[0], row = e.count() / std::max<int64_t>(d0, 1);
  std::vector<int64_t> counts(size);
  for (int q = 0; q < size; ++q) counts[q] = (d0 / size + (q < d0 % size ? 1 : 0)) * row;
  e.result_shape = e.sig.shape;
  e.result_shape[0] = d0 / size + (rank < d0 % size ? 1 : 0);
  e.result_nbytes = counts[rank] * DtypeSize(e.sig.dtype);
  e.result = std::malloc(std::max<size_t>(e.result_nbytes, 1));
  return counts;
}

void Runtime::Route(const EntryPtr& e, std::vector<Request>* to_coordinator) {
  if (!e->reject.empty()) {  // a refusal: only the coordinator hears of it, and tells the others
    RouteCached(e);  // a batch of that name will not run as cached
    Request req{e->name, e->sig, e->step, e->reject, e->reject_code, false, {}, {}};
    req.set = e->set;
    if (Coordinator* c = CoordinatorOf(e->set)) c->Add(IndexIn(e->set, world().rank), req, Now());
    else to_coordinator->push_back(std::move(req));
    return;
  }
  if (e->sig.op == kOpSetControl) return RunControl(e);
  if (e->set && !SetOf(e->set))
    return Finish(e, Status::Error(SHOAL_INVALID_ARGUMENT, std::string(OpName(e->sig.op)) + " '" + e->name + "': " +
                                                               e->pset->Describe() + " was removed"));
  if (!e->group.empty()) return RouteGroupMember(e, to_coordinator);
  if (FailIfUnreachable(e)) return;
  if (e->sig.op == kOpJoin) return RouteJoin(e);
  if (e->sig.op == SHOAL_OP_ALLREDUCE && !cached_members_.empty() && RouteCached(e)) return;
  const bool neighbor = e->sig.op == SHOAL_OP_NEIGHBOR_ALLREDUCE || e->sig.op == SHOAL_OP_NEIGHBOR_ALLGATHER;
  if (neighbor && !e->topo_check && negotiated_neighbor_names_.count(e->name)) {
    ++stats_.cache_hits;
    neighbor_ready_.push_back(e);
    return;
  }
  Ask(e, to_coordinator);
}

bool Runtime::FailIfUnreachable(const EntryPtr& e) {
  if (!rejections_.empty()) {
    auto it = rejections_.find(e->key());
    if (it != rejections_.end() && it->second.step == e->step) {
      const Status st = Status::Error(it->second.code, it->second.error);
      rejections_.erase(it);
      Finish(e, st);
      return true;
    }
  }
  const bool neighbor = e->sig.op == SHOAL_OP_NEIGHBOR_ALLREDUCE || e->sig.op == SHOAL_OP_NEIGHBOR_ALLGATHER;
  if (neighbor && !peer_joined_at_.empty() && AnyPeerJoined()) {
    std::vector<int> joined;
    for (auto* list : {&e->recv_ranks, &e->send_ranks})
      for (int r : *list)
        if (PeerJoined(r) && std::find(joined.begin(), joined.end(), r) == joined.end()) joined.push_back(r);
    if (!joined.empty()) {
      Finish(e, Status::Error(SHOAL_MISMATCH, std::string(OpName(e->sig.op)) + " '" + e->name + "': " +
                                                          (joined.size() == 1 ? "rank " : "ranks ") + Ranks(joined) +
                                                          " joined (join()) and takes no part in neighbor ops "
                                                          "until every rank has joined"));
      return true;
    }
  }
  if (!any_left_) return false;
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
  } else {  // every rank (of its process set) takes part in a collective and in a negotiation
    gone = LeftMembers(*e);
  }
  if (gone.empty()) return false;
  Finish(e, Status::Error(SHOAL_ABORTED, std::string(OpName(e->sig.op)) + " '" + e->name + "': " + LeftMessage(gone)));
  return true;
}

std::vector<int> Runtime::LeftMembers(const Entry& e) const {
  std::vector<int> gone;
  for (size_t r = 0; r < peer_left_.size(); ++r)
    if (peer_left_[r] && (!e.pset || e.pset->Has(static_cast<int>(r)))) gone.push_back(static_cast<int>(r));
  return gone;
}

std::string Runtime::LeftMessage(const std::vector<int>& ranks) {
  return (ranks.size() == 1 ? "rank " : "ranks ") + Ranks(ranks) +
         " left the job (script ended, sys.exit or shoal.shutdown()) before taking part in this op";
}

std::string Runtime::LeftRanksMessage() const {
  std::lock_guard<std::mutex> lock(left_mu_);
  if (left_ranks_.empty()) return "";
  std::vector<int> ranks = left_ranks_;
  std::sort(ranks.begin(), ranks.end());
  return LeftMessage(ranks);
}

void Runtime::OnLeave(int rank) {
  if (peer_left_.empty()) peer_left_.assign(world().size, 0);
  if (peer_left_[rank]) return;
  peer_left_[rank] = 1;
  any_left_ = true;
  DoomAllCached(rank);  // its rounds would never complete
  {
    std::lock_guard<std::mutex> lock(left_mu_);
    left_ranks_.push_back(rank);
  }
  Log(LOG_DEBUG, "rank " + std::to_string(rank) + " left the job");
  device_plane_.OnLeave(rank);
  ThawIfLost(rank);
  const std::string why = " left the job (script ended, sys.exit or shoal.shutdown()) before taking part in this op";
  for (auto& e : neighbors_.TakeNeeding(rank))
    Finish(e, Status::Error(SHOAL_ABORTED, std::string(OpName(e->sig.op)) + " '" + e->name + "': rank " +
                                               std::to_string(rank) + why));
  if (coordinator_) {
    std::vector<Response> resps = coordinator_->Leave(rank);
    if (!resps.empty()) Respond(nullptr, std::move(resps));
  } else if (rank == 0) {  // no coordinator any more: nothing waiting for it can complete
    FailAwaiting([](const Entry& e) { return e.set == 0; }, SHOAL_ABORTED, "rank 0" + why);
  }
  if (!sets_.empty()) LeaveSets(rank);
}

void Runtime::Apply(const Response& r) {
  if (r.op == kOpRetire) return r.names.empty() ? Vote(r) : Commit(r);
  std::vector<EntryPtr> batch;
  const auto now = Clock::now();
  const int code = r.kind == Response::REJECTED ? r.code
                   : r.kind == Response::LEFT   ? SHOAL_ABORTED
                   : r.code                     ? r.code  // e.g. SHOAL_NEIGHBOR_MISMATCH
                                                : SHOAL_MISMATCH;
  for (size_t i = 0; i < r.names.size(); ++i) {
    std::string keyed;  // names are scoped per process set
    const std::string& name = r.set ? (keyed = SetKey(r.set, r.names[i])) : r.names[i];
    stall_warned_.erase(name);
    auto it = awaiting_response_.find(name);
    if (it == awaiting_response_.end() ||
        (r.step >= 0 && (it->second->group.empty() ? it->second->step : it->second->group_step) != r.step)) {
      if (r.kind == Response::EXECUTE && !r.joined.empty() && r.op != kOpJoin) {
        // This rank joined: it adds the identity of the reduction.
        if (r.op & SHOAL_GROUPED) JoinedGroup(r, &batch);
        else if (EntryPtr z = JoinedEntry(r, i)) batch.push_back(z);
        continue;
      }
      // A stall of a cached batch's round (its probes, runtime_cache.cc), a call refused on
      // another rank (the batch cannot run), or an abort for an op this rank never sent.
      if ((r.kind == Response::ERROR || r.kind == Response::REJECTED) && !cached_members_.empty())
        FailCached(name, r.step, Status::Error(code, r.error), r.kind == Response::ERROR);
      continue;
    }
    it->second->t_negotiated = now;
    ExpandGroup(it->second, &batch);
    awaiting_response_.erase(it);
  }
  if (r.op == kOpJoin) {
    if (r.kind == Response::EXECUTE) return FinishJoin(r, batch);
    joining_ = nullptr;  // failed (a rank left): so is the job
  }
  if (r.kind != Response::EXECUTE) {
    if (r.kind == Response::REJECTED) {
      for (auto& user_name : r.names) {
        if (r.set == 0)
          for (auto& e : neighbors_.TakeNamed(user_name, r.step)) batch.push_back(e);
        if (!batch.empty()) continue;
        // Remember it for when this rank submits that step, unless it is past it already.
        const std::string name = SetKey(r.set, user_name);
        std::lock_guard<std::mutex> lock(mu_);
        auto ns = names_.find(name);
        if ((ns == names_.end() || ns->second.calls <= r.step) && rejections_.size() < 1024)
          rejections_[name] = r;
      }
    }
    for (auto& e : batch) Finish(e, Status::Error(code, r.error));
    return;
  }
  if (r.op & SHOAL_GROUPED) return RunGroup(r, std::move(batch));
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
  if (r.channel >= 0 && r.op == SHOAL_OP_ALLREDUCE) CacheBatch(r, batch);
  RunCollective(r, std::move(batch));
}

GroupCollectives* Runtime::Group(int set) { return set == 0 ? backend_.get() : backend_->OfSet(set); }

void Runtime::RunCollective(const Response& r, std::vector<EntryPtr> batch) {
  const WorldInfo& w = world();
  const ProcessSet* pset = batch[0]->pset.get();
  ++stats_.global_collectives;
  const auto t0 = Clock::now();
  for (auto& e : batch) e->t_comm_start = t0;
  if (r.op != SHOAL_OP_BARRIER && batch[0]->gpu && batch[0]->gpu->nccl) return RunOnDevice(r, batch);
  // The engine of its group: every rank's, or its process set's.
  GroupCollectives* engine = Group(batch[0]->set);
  if (!engine) {
    for (auto& e : batch) Finish(e, Status::Error(SHOAL_ABORTED, "internal error: no communicator for " + pset->Describe()));
    return;
  }
  // Completion of the communication itself (the timeline's COMMUNICATE phase).
  auto communicated = [](const EntryPtr& e) { e->t_comm_end = Clock::now(); };
  if (r.op == SHOAL_OP_BARRIER) {
    engine->Barrier([this, communicated, e = batch[0]](const Status& st) { communicated(e); Finish(e, st); });
    return;
  }
  if (r.op == SHOAL_OP_BROADCAST) {
    EntryPtr e = batch[0];
    if (w.rank == e->sig.root_rank && e->output.data != e->input.data)
      std::memcpy(e->output.data, e->input.data, e->nbytes());
    if (e->count() == 0) return Finish(e, Status::Ok());
    const int root = pset ? pset->IndexOf(e->sig.root_rank) : e->sig.root_rank;
    engine->Broadcast(e->output.data, e->count(), e->sig.dtype, root, e->sig.scope,
                      [this, communicated, e](const Status& st) { communicated(e); Finish(e, st); });
    return;
  }
  if (r.op == SHOAL_OP_REDUCESCATTER) return RunReduceScatter(batch[0], engine);
  if (r.op == SHOAL_OP_ALLTOALL) return RunAlltoall(r, batch[0], engine);
  if (r.op == SHOAL_OP_ALLGATHER) {
    EntryPtr e = batch[0];
    const std::vector<int64_t> counts = GatherCounts(*e, r.first_dims[0]);
    if (e->result_nbytes == 0) return Finish(e, Status::Ok());
    engine->Allgatherv(e->input.data, e->count(), e->result, counts, e->sig.dtype,
                       [this, communicated, e](const Status& st) { communicated(e); Finish(e, st); });
    return;
  }
  // Allreduce: a batch (fused when > 1 or half precision) reduced in one call. The
  // coordinator fuses only members of one reduce op.
  const int dtype = batch[0]->sig.dtype;
  const bool average = batch[0]->sig.reduce_op == SHOAL_REDUCE_AVERAGE;
  const int rop = average ? SHOAL_REDUCE_SUM : batch[0]->sig.reduce_op;
  const int scope = batch[0]->sig.scope;
  const int n = scope == SHOAL_SCOPE_MACHINE ? w.local_size : pset ? pset->size() : w.size;
  int64_t total = 0;
  for (auto& e : batch) total += e->count();
  if (total == 0) {
    for (auto& e : batch) Finish(e, Status::Ok());
    return;
  }
  if (batch.size() == 1 && !IsHalf(dtype)) {
    EntryPtr e = batch[0];
    if (e->output.data != e->input.data) std::memcpy(e->output.data, e->input.data, e->nbytes());
    engine->Allreduce(e->output.data, e->count(), dtype, rop, scope, [this, communicated, e, average, n](const Status& st) {
      communicated(e);
      e->t_reduce_start = Clock::now();
      if (st.ok() && average) Divide(e->output.data, e->output.data, e->sig.dtype, e->count(), n);
      e->t_reduce_end = Clock::now();
      Finish(e, st);
    });
    return;
  }
  // Half types are widened: the reduction computes in float32 and is rounded once (exact
  // for min and max).
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
  engine->Allreduce(fused->data(), total, wire, rop, scope, [this, communicated, fused, batch, dtype, wire, wsize, average, n](const Status& st) {
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

void Runtime::RunReduceScatter(const EntryPtr& e, GroupCollectives* engine) {
  // Over the members of its process set, in rank order.
  const int size = e->pset ? e->pset->size() : world().size, rank = e->pset ? e->pset->index : world().rank;
  const int dtype = e->sig.dtype;
  const std::vector<int64_t> counts = ScatterCounts(*e, size, rank);
  const int64_t mine = counts[rank];
  if (e->count() == 0) return Finish(e, Status::Ok());
  // Half types are reduced in float32 and rounded once, as allreduce does.
  const bool half = IsHalf(dtype);
  const int wire = half ? SHOAL_FLOAT32 : dtype;
  Bytes in, out;
  const void* send = e->input.data;
  void* recv = e->result;
  if (half) {
    e->t_copy_start = Clock::now();
    in = fusion_pool_->Get(e->count() * sizeof(float));
    out = fusion_pool_->Get(std::max<int64_t>(mine, 1) * sizeof(float));
    WidenToFloat32(e->input.data, dtype, reinterpret_cast<float*>(in->data()), e->count());
    send = in->data();
    recv = out->data();
    e->t_copy_end = Clock::now();
  }
  const bool average = e->sig.reduce_op == SHOAL_REDUCE_AVERAGE;
  engine->ReduceScatter(send, recv, counts, wire, SHOAL_REDUCE_SUM,
                        [this, e, in, out, average, dtype, wire, mine, n = size](const Status& st) {
    e->t_comm_end = e->t_reduce_start = Clock::now();
    if (st.ok()) {
      void* p = out ? static_cast<void*>(out->data()) : e->result;
      if (average) Divide(p, p, wire, mine, n);
      if (out) NarrowFromFloat32(reinterpret_cast<const float*>(p), dtype, e->result, mine);
    }
    e->t_reduce_end = Clock::now();
    Finish(e, st);
  });
}

void Runtime::CheckStalls() {
  if (cfg_.stall_check_time <= 0 && cfg_.stall_shutdown_time <= 0) return;
  auto now_tp = Clock::now();
  if (now_tp - last_stall_check_ < std::chrono::milliseconds(200)) return;
  last_stall_check_ = now_tp;
  const double kill = cfg_.stall_shutdown_time;
  const double warn = cfg_.stall_check_time > 0 ? cfg_.stall_check_time : kill;
  // Every coordinator here (the global one, process sets' leaders) names the late ranks.
  auto check = [&](Coordinator* c, const ProcessSet* set) {
    for (auto& s : c->Stalled(Now(), std::min(warn, kill > 0 ? kill : warn))) {
      // Process set agreements end in an error even without SHOAL_STALL_SHUTDOWN_TIME: a
      // rank that never calls add/remove_process_set fails the call everywhere.
      const double end = kill > 0 || s.name != kSetsAgreement ? kill : warn;
      std::string what = "'" + s.name + "' waited " + std::to_string(static_cast<int>(s.waited)) +
                         " s: submitted by ranks " + Ranks(s.ready) + "; missing ranks " + Ranks(s.missing);
      const std::string key = SetKey(set ? set->id : 0, s.name);
      if (end > 0 && s.waited >= end) {
        ++stats_.stalls;
        Response r = c->Abort(s.name, "stalled op " + what + " (" +
                                          (kill > 0 ? "SHOAL_STALL_SHUTDOWN_TIME=" : "SHOAL_STALL_CHECK_TIME=") +
                                          Seconds(end) + " s)");
        r.set = set ? set->id : 0;
        Respond(set, {r});
      } else if (s.waited >= warn && stall_warned_.insert(key).second) {
        ++stats_.stalls;
        Log(LOG_WARNING, "stall: " + what);
      }
    }
  };
  if (coordinator_) check(coordinator_.get(), nullptr);
  for (auto& kv : sets_)
    if (kv.second.coordinator) check(kv.second.coordinator.get(), kv.second.info.get());
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
