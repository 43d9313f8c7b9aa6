#include "runtime/scheduler.h"

#include <atomic>
#include <thread>

namespace shoal {

Scheduler::Scheduler(Host* host, const Config& cfg, Backend* backend, Stats* stats, Submissions* submissions,
                     ProcessSets* sets, SetControl* set_control, uint64_t generation)
    : host_(host), backend_(backend), stats_(stats), submissions_(submissions), sets_(sets), set_control_(set_control),
      generation_(generation), devices_(this, cfg, backend, stats),
      neighbors_(backend, devices_.plane(), cfg.fusion_threshold, stats, !cfg.timeline.empty()),
      departures_(backend->world().size), collectives_(this, backend, &devices_, stats),
      negotiation_(this, backend, sets, &departures_, &grouped_, stats, cfg.fusion_threshold),
      cache_(this, &negotiation_, &collectives_, submissions, cfg, stats), stalls_(cfg, stats),
      grouped_(this, sets, &negotiation_, &collectives_),
      join_(this, submissions, backend, &departures_, &cache_, &neighbors_, generation) {}

bool Scheduler::Cycle(const std::vector<EntryPtr>& fresh, bool start_only) {
  bool progressed = false;
  std::vector<Request> to_coordinator;
  for (auto& e : fresh) {
    if (e->gpu) devices_.Stage(e, &to_coordinator);
    else Route(e, &to_coordinator);
  }
  progressed |= !fresh.empty();
  negotiation_.TakeLater(&to_coordinator);
  progressed |= devices_.Poll(&to_coordinator);
  join_.SendRequest(&to_coordinator);  // after the rank's own requests

  if (!to_coordinator.empty()) {
    ++stats_->coordinator_rounds;
    negotiation_.Send(&to_coordinator);
  }
  // Every arrived message. The control tag is probed first: that probe also runs MPI's
  // progress, so neighbor data that just arrived is matched by the next probe in this same
  // cycle (probing neighbor data first, or MPI_ANY_TAG, left small messages unseen for up
  // to hundreds of microseconds with the MPICH wheel).
  constexpr int kRequestTag = Negotiation::kRequestTag, kResponseTag = Negotiation::kResponseTag;
  static const std::vector<int> kCoordinatorTags = {kRequestTag, NeighborExchange::kTag},
                                kWorkerTags = {kResponseTag, NeighborExchange::kTag},
                                kLeaderTags = {kRequestTag, kResponseTag, NeighborExchange::kTag};  // of a process set
  Status st;
  int src = -1, tag = -1;
  while (!start_only) {
    if (!spare_) spare_ = recv_pool_->Get(0);
    if (!backend_->Receive(negotiation_.Coordinates() ? kCoordinatorTags : sets_->Leader() ? kLeaderTags : kWorkerTags, &tag, &src,
                           spare_.get(), &st))
      break;
    if (!st.ok()) throw std::runtime_error(st.message);
    progressed = true;
    Bytes msg = std::move(spare_);
    if (tag == NeighborExchange::kTag) {
      uint64_t generation = 0;
      if (DevicePlane::IsLinkMessage(*msg)) {
        devices_.plane()->OnLinkMessage(src, *msg);
      } else if (NeighborExchange::IsLeaveNotice(*msg, &generation)) {
        if (generation == generation_) OnLeave(src);  // else: from a runtime before a shutdown
      } else if (!join_.OnMessage(src, *msg)) {
        neighbors_.Accept(src, std::move(msg));
      }
    } else if (tag == kRequestTag) {
      negotiation_.OnRequests(src, *msg);
    } else if (tag == kResponseTag && !negotiation_.Coordinates()) {
      negotiation_.OnResponses(*msg);
    } else {
      throw std::runtime_error("unexpected message with tag " + std::to_string(tag) + " from rank " + std::to_string(src));
    }
  }
  if (!st.ok()) throw std::runtime_error(st.message);
  if (!start_only) progressed |= negotiation_.Answer();  // of the coordinators this rank runs

  if (!neighbor_ready_.empty()) {
    StartNeighbors(neighbor_ready_);
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
  return progressed;
}

bool Scheduler::Busy() {
  return negotiation_.Waiting() || !neighbors_.Idle() || backend_->num_in_flight() > 0 || devices_.Busy();
}

void Scheduler::StartNeighbors(std::vector<EntryPtr>& ready) {
  std::vector<EntryPtr> parts, stages_done;
  auto plain = std::remove_if(ready.begin(), ready.end(), [&](const EntryPtr& e) {
    if (!ShardedExchange::Applies(*e)) return false;
    if (!sharded_.Start(e, &parts)) stages_done.push_back(e);
    return true;
  });
  ready.erase(plain, ready.end());
  if (!ready.empty()) neighbors_.Start(ready);
  ready.clear();
  StartParts(std::move(parts));
  for (auto& e : stages_done) Finish(e, Status::Ok());
}

void Scheduler::StartParts(std::vector<EntryPtr> parts) {
  if (parts.empty()) return;
  std::vector<EntryPtr> unreachable;
  if (departures_.Any()) {
    // As FailIfUnreachable does for a neighbor op: sends to a rank that left are skipped,
    // a piece it never sent fails the part.
    auto gone = std::remove_if(parts.begin(), parts.end(), [&](const EntryPtr& p) {
      for (size_t k = p->send_ranks.size(); k-- > 0;) {
        if (!departures_.Left(p->send_ranks[k])) continue;
        p->send_ranks.erase(p->send_ranks.begin() + k);
        if (k < p->send_weights.size()) p->send_weights.erase(p->send_weights.begin() + k);
      }
      for (int r : p->recv_ranks)
        if (departures_.Left(r) && !neighbors_.HasPiece(r, p->name)) return true;
      return false;
    });
    unreachable.assign(gone, parts.end());
    parts.erase(gone, parts.end());
  }
  if (!parts.empty()) neighbors_.Start(parts);
  for (auto& p : unreachable) {
    std::vector<int> left;
    for (int r : p->recv_ranks) if (departures_.Left(r)) left.push_back(r);
    Finish(p, Status::Error(SHOAL_ABORTED, OpError(p->sig.op, p->name, Departures::Describe(left))));
  }
}

void Scheduler::Finish(const EntryPtr& e, const Status& st_in) {
  if (e->sharded) {  // a part of a sharded exchange: its run goes on, or its stage ends
    std::vector<EntryPtr> next;
    Status stage_st;
    EntryPtr stage = sharded_.Done(e, st_in, &next, &stage_st);
    StartParts(std::move(next));
    if (!stage) return;
    // A failure here is the step's on every rank: its peers' runs wait for this one's
    // pieces, or would use them (a refusal, as a dispute travels: docs/design.md §24).
    if (!stage_st.ok())
      negotiation_.SendLater(Request{stage->name, stage->sig, stage->step, stage_st.message, stage_st.code, false, {}, {}});
    Finish(stage, stage_st);
    return;
  }
  Status st = e->gpu ? devices_.Complete(*e, st_in) : st_in;
  // A failure while the job lost a rank is the loss's, whatever failed first (a send to the
  // dead rank, a peer's leave notice): one error on every survivor (docs/design.md §16).
  if (!st.ok() && st.code != SHOAL_RANK_LOST && backend_->Lost()) st.code = SHOAL_RANK_LOST;
  if (st.ok()) {
    switch (e->sig.op) {
      case SHOAL_OP_ALLREDUCE: ++stats_->allreduce; break;
      case SHOAL_OP_BROADCAST: ++stats_->broadcast; break;
      case SHOAL_OP_ALLGATHER: ++stats_->allgather; break;
      case SHOAL_OP_BARRIER: ++stats_->barrier; break;
      case SHOAL_OP_NEIGHBOR_ALLREDUCE: ++stats_->neighbor_allreduce; break;
      case SHOAL_OP_NEIGHBOR_ALLGATHER: ++stats_->neighbor_allgather; break;
      case SHOAL_OP_REDUCESCATTER: ++stats_->reducescatter; break;
      case SHOAL_OP_HIERARCHICAL_NEIGHBOR_ALLREDUCE: ++stats_->hierarchical_neighbor_allreduce; break;
      case SHOAL_OP_ALLTOALL: ++stats_->alltoall; break;
    }
  } else {
    ++stats_->errors;
    Log(LOG_DEBUG, "op failed: " + st.message);
    if (e->sig.op == SHOAL_OP_NEIGHBOR_ALLREDUCE || e->sig.op == SHOAL_OP_NEIGHBOR_ALLGATHER)
      neighbors_.Failed(e->name, e->step);  // its peers' pieces of that step are not data for the next
  }
  // Before the op is done (a thread it wakes may call join() again), and only the first time
  // (a later join may be in flight by a repeated finish).
  if (e->sig.op == kOpJoin && !e->done) join_.SetInFlight(false);
  host_->Complete(e, st);
}

void Scheduler::Leave() {
  cache_.DoomAll();  // every rank dooms them when it hears of this; this rank's rounds first
  auto pending = std::make_shared<std::atomic<int>>(0);
  const WorldInfo& w = backend_->world();
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
}

void Scheduler::Stop() {
  cache_.KeepRoundBuffers();
  devices_.Stop();
}

void Scheduler::Abandon() {
  negotiation_.Clear();
  grouped_.Clear();
  neighbor_ready_.clear();
  neighbors_.TakeAll();
  sharded_.Clear();
}

bool Scheduler::Submitted() {
  // Doomed batches hand their ops to the negotiation's late requests, which this cycle sent.
  // Calls held for a vote on retiring names (negotiation/names.cc) are this rank's calls
  // before the join: they reach the coordinator first (queued at the commit, sent the
  // cycle after).
  return !cache_.HoldsOwnOps() && devices_.Idle() && submissions_->Idle();
}

// Retiring idle names (negotiation/names.cc): the table decides; the scheduler sends the
// vote, and forgets the retired names' negotiated state.
void Scheduler::Retire(const Response& r) {
  if (r.names.empty()) {  // the names every rank proposed: this rank's vote
    if (r.set && !negotiation_.SetOf(r.set)) return;  // removed meanwhile (ForgetSet forgot its proposal)
    Request vote;
    if (submissions_->Vote(r, &vote)) negotiation_.SendLater(std::move(vote));  // sent next cycle, whatever the user threads do
    return;
  }
  std::set<std::string> gone;  // the vote's outcome
  if (r.kind == Response::EXECUTE)
    for (auto& n : r.retired) gone.insert(SetKey(r.set, n));
  Thaw(r.set, gone);
}

void Scheduler::Thaw(int set, const std::set<std::string>& gone) {
  const NameTable::Thawed out = submissions_->Thaw(set, gone);  // the held calls queued
  for (auto& key : out.retired) {
    neighbor_patterns_.Forget(key);
    stalls_.Forget(key);
    neighbors_.Forget(key);
  }
  stats_->names_retired += out.ops_retired;
  stats_->held_calls += static_cast<int64_t>(out.calls.size());
}

void Scheduler::EndSet(const ProcessSet& s) {
  const int id = s.id;
  cache_.Drop(id);
  if (submissions_->Voting(id)) Thaw(id, {});  // its coordinator will not answer the vote
  // Submitted by another thread meanwhile.
  negotiation_.FailAwaiting([id](const Entry& e) { return e.set == id; }, SHOAL_INVALID_ARGUMENT,
                            s.Describe() + " was removed");
}

void Scheduler::ForgetSet(int set) {
  submissions_->Forget(set);
  negotiation_.ForgetSet(set);
  std::string name;
  neighbor_patterns_.ForgetIf([&](const std::string& key) { return KeyInSet(key, set, &name); });
  stalls_.ForgetSet(set);
}

}  // namespace shoal
