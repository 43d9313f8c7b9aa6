// The scheduler's routing of ops (to the coordinator, a cached batch or the neighbors), its
// applying of the coordinators' responses, and the failure paths (stalls, ranks that left).
// Driver only, like the rest of the cycle (runtime/scheduler.cc).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "common/reduce.h"
#include "runtime/scheduler.h"

namespace shoal {
void Scheduler::Route(const EntryPtr& e, std::vector<Request>* to_coordinator) {
  if (!e->reject.empty()) {  // a refusal: only the coordinator hears of it, and tells the others
    cache_.Route(e);  // a batch of that name will not run as cached
    Request req{e->name, e->sig, e->step, e->reject, e->reject_code, false, {}, {}};
    req.set = sets_->NegotiatedIn(e->set, e->sig.scope);
    if (!negotiation_.AddHere(req)) to_coordinator->push_back(std::move(req));
    return;
  }
  if (e->sig.op == kOpSetControl) return set_control_->Run(e);
  if (e->set && !negotiation_.SetOf(e->set))
    return Finish(e, Status::Error(SHOAL_INVALID_ARGUMENT, OpError(e->sig.op, e->name, e->pset->Describe() + " was removed")));
  if (!e->group.empty()) return grouped_.Route(e, to_coordinator);
  // Every call of a cached broadcast takes part in the root's round of its step, even one
  // refused on another rank (docs/design.md §20): the round's outcome decides.
  if (!cache_.Empty() && cache_.IsBroadcast(e->key()) && cache_.Route(e)) return;
  if (FailIfUnreachable(e)) return;
  if (e->sig.op == kOpJoin) return join_.Route(e);
  if (e->sig.op == SHOAL_OP_ALLREDUCE && !cache_.Empty() && cache_.Route(e)) return;
  const bool neighbor = e->sig.op == SHOAL_OP_NEIGHBOR_ALLREDUCE || e->sig.op == SHOAL_OP_NEIGHBOR_ALLGATHER;
  if (neighbor && neighbor_patterns_.Skips(*e)) {
    ++stats_->cache_hits;
    neighbor_ready_.push_back(e);
    return;
  }
  Ask(e, to_coordinator);
}

bool Scheduler::FailIfUnreachable(const EntryPtr& e) {
  const bool neighbor = e->sig.op == SHOAL_OP_NEIGHBOR_ALLREDUCE || e->sig.op == SHOAL_OP_NEIGHBOR_ALLGATHER;
  // Every rank of its process set (or machine) takes part in a collective and in a negotiation.
  Status st = neighbor ? negotiation_.TakeRefusal(e->key(), e->step)
                       : negotiation_.Unrunnable(e->key(), e->step, sets_->NegotiatedIn(e->set, e->sig.scope), e->sig.op, e->name);
  if (!st.ok() || !neighbor) {
    if (!st.ok()) Finish(e, st);
    return !st.ok();
  }
  if (join_.AnyPeerJoined()) {
    std::vector<int> joined;
    for (auto* list : {&e->recv_ranks, &e->send_ranks})
      for (int r : *list)
        if (join_.PeerJoined(r) && std::find(joined.begin(), joined.end(), r) == joined.end()) joined.push_back(r);
    if (!joined.empty()) {
      Finish(e, Status::Error(SHOAL_MISMATCH, OpError(e->sig.op, e->name, RanksNamed(joined) +
                                                          " joined (join()) and takes no part in neighbor ops "
                                                          "until every rank has joined")));
      return true;
    }
  }
  if (!departures_.Any()) return false;
  if (!neighbor_patterns_.Skips(*e)) {
    st = negotiation_.Departed(sets_->NegotiatedIn(e->set, e->sig.scope), e->sig.op, e->name);
    if (!st.ok()) Finish(e, st);
    return !st.ok();
  }
  std::vector<int> gone;
  // A peer that left may have sent its piece before it left: only a missing one is fatal.
  for (int r : e->recv_ranks) if (departures_.Left(r) && !neighbors_.HasPiece(r, e->name)) gone.push_back(r);
  // Nobody takes what is sent to a rank that left (it needs nothing more): skip it.
  for (size_t k = e->send_ranks.size(); k-- > 0;) {
    if (!departures_.Left(e->send_ranks[k])) continue;
    e->send_ranks.erase(e->send_ranks.begin() + k);
    if (k < e->send_weights.size()) e->send_weights.erase(e->send_weights.begin() + k);
  }
  if (gone.empty()) return false;
  Finish(e, Status::Error(SHOAL_ABORTED, OpError(e->sig.op, e->name, Departures::Describe(gone))));
  return true;
}

void Scheduler::OnLeave(int rank) {
  if (!departures_.Record(rank)) return;
  cache_.DoomAll(rank);  // its rounds would never complete
  Log(LOG_DEBUG, "rank " + std::to_string(rank) + " left the job");
  devices_.plane()->OnLeave(rank);
  for (int set : submissions_->VotingSets()) {  // a vote this rank coordinated gets no answer
    const ProcessSet* s = sets_->Of(set);
    if (rank == (set == 0 ? 0 : !s ? rank : s->leader())) Thaw(set, {});
  }
  const std::string why = Departures::Describe({rank});
  for (auto& e : neighbors_.TakeNeeding(rank)) Finish(e, Status::Error(SHOAL_ABORTED, OpError(e->sig.op, e->name, why)));
  negotiation_.OnLeave(rank);
}

void Scheduler::Apply(const Response& r) {
  if (r.op == kOpRetire) return Retire(r);
  std::vector<EntryPtr> batch;
  const auto now = Clock::now();
  const int code = r.kind == Response::REJECTED ? r.code
                   : r.kind == Response::LEFT   ? SHOAL_ABORTED
                   : r.code                     ? r.code  // e.g. SHOAL_NEIGHBOR_MISMATCH
                                                : SHOAL_MISMATCH;
  for (size_t i = 0; i < r.names.size(); ++i) {
    std::string keyed;  // names are scoped per process set
    const std::string& name = r.set ? (keyed = SetKey(r.set, r.names[i])) : r.names[i];
    stalls_.Forget(name);
    EntryPtr waiting = negotiation_.Take(name, r.step);
    if (!waiting) {
      if (r.kind == Response::EXECUTE && !r.joined.empty() && r.op != kOpJoin) {
        // This rank joined: it adds the identity of the reduction.
        join_.AddIdentities(r, i, &batch);
        continue;
      }
      // A stall of a cached batch's round (its probes, negotiation/response_cache.cc), a call refused on
      // another rank (the batch cannot run), or an abort for an op this rank never sent.
      if ((r.kind == Response::ERROR || r.kind == Response::REJECTED) && !cache_.Empty())
        cache_.Fail(name, r.step, Status::Error(code, r.error), r.kind == Response::ERROR);
      continue;
    }
    waiting->t_negotiated = now;
    grouped_.Expand(waiting, &batch);
  }
  if (r.op == kOpJoin) {
    if (r.kind == Response::EXECUTE) return join_.Complete(r, batch);
    join_.Abandon();  // failed (a rank left): so is the job
  }
  if (r.kind != Response::EXECUTE) {
    if (r.kind == Response::REJECTED) {
      for (auto& user_name : r.names) {
        if (r.set == 0) {
          for (auto& e : neighbors_.TakeNamed(user_name, r.step)) batch.push_back(e);
          if (EntryPtr stage = sharded_.Take(user_name, r.step)) batch.push_back(stage);
          for (auto it = neighbor_ready_.begin(); it != neighbor_ready_.end();) {  // routed this cycle
            const bool hit = (*it)->name == user_name && (*it)->step == r.step;
            if (hit) batch.push_back(*it);
            it = hit ? neighbor_ready_.erase(it) : std::next(it);
          }
        }
        if (!batch.empty()) continue;
        // Remember it for when this rank submits that step, or routes it (still queued),
        // unless it is past it already.
        const std::string name = SetKey(r.set, user_name);
        if (!submissions_->Routed(name, r.step)) negotiation_.File(name, r);
      }
    }
    for (auto& e : batch) Finish(e, Status::Error(code, r.error));
    return;
  }
  if (r.op & SHOAL_GROUPED) return grouped_.Run(r, std::move(batch));
  if (batch.size() != r.names.size()) {
    Log(LOG_ERROR, "coordinator scheduled an op this rank does not have: " + r.names[0]);
    for (auto& e : batch) Finish(e, Status::Error(SHOAL_ABORTED, "internal error: inconsistent schedule"));
    return;
  }
  if (r.op == SHOAL_OP_NEIGHBOR_ALLREDUCE || r.op == SHOAL_OP_NEIGHBOR_ALLGATHER) {
    for (auto& e : batch) {
      neighbor_patterns_.Negotiated(*e, r.trusted);
      neighbor_ready_.push_back(e);
    }
    return;
  }
  // A batch negotiated before the coordinator heard of a join goes back to it at once: a
  // joined rank takes part in no rounds (ops/join.cc).
  if (r.channel >= 0 && (r.op == SHOAL_OP_ALLREDUCE || r.op == SHOAL_OP_BROADCAST) && !negotiation_.Lost(r.set))
    cache_.Add(r, batch, negotiation_.SetSize(r.set), negotiation_.IndexIn(r.set, backend_->world().rank), join_.Active());
  collectives_.Run(r, std::move(batch));
}

void Scheduler::CheckStalls() {
  const auto now = Clock::now();
  // A send a neighbor did not expect: every rank waiting in that step fails with its error
  // (a refusal through the coordinator, as a refusal at the call travels).
  for (auto& d : neighbors_.Disputes(now)) {
    if (const Entry* stage = sharded_.StageOf(d.name, d.step)) {  // a part's: its stage is what ranks submitted
      d.name = stage->name;
      d.sig = stage->sig;
    }
    Request req{d.name, d.sig, d.step, d.error, SHOAL_NEIGHBOR_MISMATCH, false, {}, {}};
    negotiation_.SendLater(std::move(req));
  }
  if (!stalls_.Due(now)) return;
  negotiation_.CheckStalls(&stalls_);
  for (auto& [e, st] : stalls_.Check(neighbors_, now)) Finish(e, st);
}

void Scheduler::Ask(const EntryPtr& e, std::vector<Request>* to_coordinator) {
  negotiation_.Await(e->key(), e);
  Request req{e->name, e->sig, e->step, {}, 0, e->topo_check, {}, {}};
  req.set = sets_->NegotiatedIn(e->set, e->sig.scope);
  if (e->topo_check) {
    req.send = e->send_ranks;
    req.recv = e->recv_ranks;
    req.known = neighbor_patterns_.Checked(*e);
  }
  req.splits = e->splits;  // alltoall
  if (req.set == e->set)  // names retire in their set's vote (a machine's ops keep the global names)
    submissions_->Propose(*e, [this](const std::string& key) { return cache_.Has(key) || negotiation_.Refused(key); },
                         &req);
  to_coordinator->push_back(std::move(req));
}

void Scheduler::Renegotiate(const EntryPtr& e) {
  if (FailIfUnreachable(e)) return;
  std::vector<Request> reqs;
  Ask(e, &reqs);
  negotiation_.SendLater(std::move(reqs[0]));
}

}  // namespace shoal
