// The runtime's schedule: routing ops to the coordinator or the neighbors, applying the
// coordinator's responses, running collectives, and the failure paths (stalls, ranks
// that left). Driver only, like the rest of the cycle (runtime/runtime.cc).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "common/reduce.h"
#include "runtime/runtime.h"

namespace shoal {
void Runtime::Route(const EntryPtr& e, std::vector<Request>* to_coordinator) {
  if (!e->reject.empty()) {  // a refusal: only the coordinator hears of it, and tells the others
    cache_.Route(e);  // a batch of that name will not run as cached
    Request req{e->name, e->sig, e->step, e->reject, e->reject_code, false, {}, {}};
    req.set = sets_.NegotiatedIn(e->set, e->sig.scope);
    if (Coordinator* c = CoordinatorOf(req.set)) c->Add(IndexIn(req.set, world().rank), req, Now());
    else to_coordinator->push_back(std::move(req));
    return;
  }
  if (e->sig.op == kOpSetControl) return set_control_.Run(e);
  if (e->set && !SetOf(e->set))
    return Finish(e, Status::Error(SHOAL_INVALID_ARGUMENT, OpError(e->sig.op, e->name, e->pset->Describe() + " was removed")));
  if (!e->group.empty()) return grouped_.Route(e, to_coordinator);
  // Every call of a cached broadcast takes part in the root's round of its step, even one
  // refused on another rank (docs/design.md §20): the round's outcome decides.
  if (!cache_.Empty() && cache_.IsBroadcast(e->key()) && cache_.Route(e)) return;
  if (FailIfUnreachable(e)) return;
  if (e->sig.op == kOpJoin) return RouteJoin(e);
  if (e->sig.op == SHOAL_OP_ALLREDUCE && !cache_.Empty() && cache_.Route(e)) return;
  const bool neighbor = e->sig.op == SHOAL_OP_NEIGHBOR_ALLREDUCE || e->sig.op == SHOAL_OP_NEIGHBOR_ALLGATHER;
  if (neighbor && neighbor_patterns_.Skips(*e)) {
    ++stats_.cache_hits;
    neighbor_ready_.push_back(e);
    return;
  }
  Ask(e, to_coordinator);
}

Status Runtime::TakeRefusal(const std::string& key, int64_t step) {
  if (rejections_.empty()) return Status::Ok();
  auto it = rejections_.find(key);
  if (it == rejections_.end() || it->second.step != step) return Status::Ok();
  const Status st = Status::Error(it->second.code, it->second.error);
  rejections_.erase(it);
  return st;
}

Status Runtime::Departed(int set, int op, const std::string& name) const {
  if (!departures_.Any()) return Status::Ok();
  const std::vector<int> gone = departures_.Members(SetOf(set));
  return gone.empty() ? Status::Ok() : Status::Error(SHOAL_ABORTED, OpError(op, name, Departures::Describe(gone)));
}

Status Runtime::Unrunnable(const std::string& key, int64_t step, int set, int op, const std::string& name) {
  const Status st = TakeRefusal(key, step);
  return st.ok() ? Departed(set, op, name) : st;
}

bool Runtime::FailIfUnreachable(const EntryPtr& e) {
  const bool neighbor = e->sig.op == SHOAL_OP_NEIGHBOR_ALLREDUCE || e->sig.op == SHOAL_OP_NEIGHBOR_ALLGATHER;
  // Every rank of its process set (or machine) takes part in a collective and in a negotiation.
  Status st = neighbor ? TakeRefusal(e->key(), e->step)
                       : Unrunnable(e->key(), e->step, sets_.NegotiatedIn(e->set, e->sig.scope), e->sig.op, e->name);
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
    st = Departed(sets_.NegotiatedIn(e->set, e->sig.scope), e->sig.op, e->name);
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

void Runtime::OnLeave(int rank) {
  if (!departures_.Record(rank)) return;
  cache_.DoomAll(rank);  // its rounds would never complete
  Log(LOG_DEBUG, "rank " + std::to_string(rank) + " left the job");
  devices_.plane()->OnLeave(rank);
  ThawIfLost(rank);
  const std::string why = Departures::Describe({rank});
  for (auto& e : neighbors_.TakeNeeding(rank)) Finish(e, Status::Error(SHOAL_ABORTED, OpError(e->sig.op, e->name, why)));
  if (coordinator_) {
    std::vector<Response> resps = coordinator_->Leave(rank);
    if (!resps.empty()) Respond(nullptr, std::move(resps));
  } else if (rank == 0) {  // no coordinator any more: nothing waiting for it can complete
    FailAwaiting([this](const Entry& e) { return sets_.NegotiatedIn(e.set, e.sig.scope) == 0; }, SHOAL_ABORTED, why);
  }
  LeaveSets(rank);
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
    stalls_.Forget(name);
    auto it = awaiting_response_.find(name);
    if (it == awaiting_response_.end() ||
        (r.step >= 0 && (it->second->group.empty() ? it->second->step : it->second->group_step) != r.step)) {
      if (r.kind == Response::EXECUTE && !r.joined.empty() && r.op != kOpJoin) {
        // This rank joined: it adds the identity of the reduction.
        if (r.op & SHOAL_GROUPED) JoinedGroup(r, &batch);
        else if (EntryPtr z = JoinedEntry(r, i)) batch.push_back(z);
        continue;
      }
      // A stall of a cached batch's round (its probes, negotiation/response_cache.cc), a call refused on
      // another rank (the batch cannot run), or an abort for an op this rank never sent.
      if ((r.kind == Response::ERROR || r.kind == Response::REJECTED) && !cache_.Empty())
        cache_.Fail(name, r.step, Status::Error(code, r.error), r.kind == Response::ERROR);
      continue;
    }
    it->second->t_negotiated = now;
    grouped_.Expand(it->second, &batch);
    awaiting_response_.erase(it);
  }
  if (r.op == kOpJoin) {
    if (r.kind == Response::EXECUTE) return FinishJoin(r, batch);
    join_.Abandon();  // failed (a rank left): so is the job
  }
  if (r.kind != Response::EXECUTE) {
    if (r.kind == Response::REJECTED) {
      for (auto& user_name : r.names) {
        if (r.set == 0) {
          for (auto& e : neighbors_.TakeNamed(user_name, r.step)) batch.push_back(e);
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
        std::lock_guard<std::mutex> lock(mu_);
        const NameState* ns = names_.Find(name);
        const bool queued = std::any_of(queue_.begin(), queue_.end(), [&](const EntryPtr& q) {
          return q->key() == name && q->step == r.step;
        });
        if ((!ns || ns->calls <= r.step || queued) && rejections_.size() < 1024)
          rejections_[name] = r;
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
  if (r.channel >= 0 && (r.op == SHOAL_OP_ALLREDUCE || r.op == SHOAL_OP_BROADCAST) && !Lost(r.set))
    cache_.Add(r, batch, SetSize(r.set), IndexIn(r.set, world().rank), join_.Active());
  RunCollective(r, std::move(batch));
}

void Runtime::CheckStalls() {
  const auto now = Clock::now();
  // A send a neighbor did not expect: every rank waiting in that step fails with its error
  // (a refusal through the coordinator, as a refusal at the call travels).
  for (auto& d : neighbors_.Disputes(now)) {
    Request req{d.name, d.sig, d.step, d.error, SHOAL_NEIGHBOR_MISMATCH, false, {}, {}};
    late_requests_.push_back(std::move(req));
  }
  if (!stalls_.Due(now)) return;
  auto check = [&](Coordinator* c, const ProcessSet* set) {
    std::vector<Response> aborts = stalls_.Check(*c, set, Now());
    if (!aborts.empty()) Respond(set, std::move(aborts));
  };
  if (coordinator_) check(coordinator_.get(), nullptr);
  sets_.ForEach([&](const ProcessSet& s, Coordinator* c) {
    if (c) check(c, &s);
  });
  for (auto& [e, st] : stalls_.Check(neighbors_, now)) Finish(e, st);
}

void Runtime::Ask(const EntryPtr& e, std::vector<Request>* to_coordinator) {
  awaiting_response_[e->key()] = e;
  Request req{e->name, e->sig, e->step, {}, 0, e->topo_check, {}, {}};
  req.set = sets_.NegotiatedIn(e->set, e->sig.scope);
  if (e->topo_check) {
    req.send = e->send_ranks;
    req.recv = e->recv_ranks;
    req.known = neighbor_patterns_.Checked(*e);
  }
  req.splits = e->splits;  // alltoall
  if (req.set == e->set) {  // names retire in their set's vote (a machine's ops keep the global names)
    std::lock_guard<std::mutex> lock(mu_);
    names_.Propose(*e, [this](const std::string& key) { return cache_.Has(key) || rejections_.count(key) > 0; }, &req);
  }
  to_coordinator->push_back(std::move(req));
}

void Runtime::Renegotiate(const EntryPtr& e) {
  if (!FailIfUnreachable(e)) Ask(e, &late_requests_);
}

// Retiring idle names (negotiation/names.cc): the table decides; the runtime sends the
// vote, runs the held calls and forgets the retired names' negotiated state.
void Runtime::Vote(const Response& r) {
  if (r.set && !SetOf(r.set)) return;  // removed meanwhile (DropSet forgot its proposal)
  Request vote;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!names_.Vote(r, &vote)) return;
  }
  late_requests_.push_back(std::move(vote));  // sent next cycle, whatever the user threads do
}

void Runtime::Commit(const Response& r) {
  std::set<std::string> gone;
  if (r.kind == Response::EXECUTE)
    for (auto& n : r.retired) gone.insert(SetKey(r.set, n));
  std::lock_guard<std::mutex> lock(mu_);
  Thaw(r.set, gone);
}

void Runtime::Thaw(int set, const std::set<std::string>& gone) {
  NameTable::Thawed out = names_.Thaw(set, gone);
  for (auto& key : out.retired) {
    neighbor_patterns_.Forget(key);
    stalls_.Forget(key);
  }
  stats_.names_retired += out.ops_retired;
  stats_.held_calls += static_cast<int64_t>(out.calls.size());
  for (auto& e : out.calls) Push(e);
}

void Runtime::ThawIfLost(int left_rank) {
  std::lock_guard<std::mutex> lock(mu_);
  for (int set : names_.VotingSets()) {
    const ProcessSet* s = sets_.Of(set);
    const int leader = set == 0 ? 0 : !s ? left_rank : s->leader();
    if (left_rank == leader) Thaw(set, {});  // no coordinator will answer the vote
  }
}

void Runtime::ForgetSet(int set) {
  std::lock_guard<std::mutex> lock(mu_);
  names_.Forget(set);
  std::string name;
  for (auto it = rejections_.begin(); it != rejections_.end();)
    it = KeyInSet(it->first, set, &name) ? rejections_.erase(it) : std::next(it);
  neighbor_patterns_.ForgetIf([&](const std::string& key) { return KeyInSet(key, set, &name); });
  stalls_.ForgetSet(set);
}

size_t Runtime::NameCount() {
  std::lock_guard<std::mutex> lock(mu_);
  return names_.size();
}

bool Runtime::Voting() {
  std::lock_guard<std::mutex> lock(mu_);
  return names_.Voting();
}

// Requests to the coordinators (the global one at rank 0, each process set's at its first
// rank) and their responses to every rank of the set.
void Runtime::SendRequests(std::vector<Request>* reqs) {
  const int me = world().rank;
  auto send = [this](int leader, const std::vector<Request>& to) {
    auto msg = std::make_shared<ByteVec>(EncodeRequests(to));
    backend_->Send(leader, kRequestTag, msg, [this, leader](const Status& st) {
      if (st.ok()) return;
      if (leader == 0) return FailAll("cannot reach the coordinator (rank 0): " + st.message);
      // Only the sets it leads lose their coordinator.
      FailAwaiting([this, leader](const Entry& e) {
        const ProcessSet* s = SetOf(sets_.NegotiatedIn(e.set, e.sig.scope));
        return s && s->leader() == leader;
      }, SHOAL_ABORTED,
                   "cannot reach rank " + std::to_string(leader) + ", the coordinator of its process set: " + st.message);
    });
  };
  if (std::all_of(reqs->begin(), reqs->end(), [](const Request& r) { return r.set == 0; })) {  // the common case
    if (!coordinator_) return send(0, *reqs);
    for (auto& r : *reqs) coordinator_->Add(0, r, Now());
    return;
  }
  std::map<int, std::vector<Request>> by_leader;
  for (auto& r : *reqs) {
    if (Coordinator* c = CoordinatorOf(r.set)) {
      c->Add(IndexIn(r.set, me), r, Now());
      continue;
    }
    const ProcessSet* s = SetOf(r.set);
    if (r.set != 0 && !s) continue;  // removed meanwhile: its ops failed (DropSet)
    by_leader[s ? s->leader() : 0].push_back(std::move(r));
  }
  for (auto& kv : by_leader) send(kv.first, kv.second);
}

void Runtime::OnRequests(int src, const ByteVec& msg) {
  for (auto& r : DecodeRequests(msg.data(), msg.size())) {
    Coordinator* c = CoordinatorOf(r.set);
    const int index = IndexIn(r.set, src);
    if (!c && r.set == 0) throw std::runtime_error("unexpected request from rank " + std::to_string(src));
    if (!c || index < 0) {  // of a set removed meanwhile (its ops failed there too)
      Log(LOG_DEBUG, "dropped a request for process set " + std::to_string(r.set) + " from rank " + std::to_string(src));
      continue;
    }
    c->Add(index, r, Now());
  }
}

void Runtime::Respond(const ProcessSet* set, std::vector<Response> resps) {
  const int id = set ? set->id : 0, me = world().rank;
  for (auto& r : resps) r.set = id;
  auto msg = std::make_shared<ByteVec>(EncodeResponses(resps));
  auto send = [&](int q) {
    if (q != me && !departures_.Left(q)) backend_->Send(q, kResponseTag, msg, [](const Status&) {});
  };
  if (set) {
    for (int q : set->ranks) send(q);
  } else {
    for (int q = 0; q < world().size; ++q) send(q);
  }
  for (auto& r : resps) Apply(r);
}

bool Runtime::RespondForSets() {
  bool any = false;
  int64_t negotiations = coordinator_ ? coordinator_->negotiations() : 0;
  sets_.ForEach([&](const ProcessSet& s, Coordinator* c) {
    if (!c) return;
    std::vector<Response> resps = c->TakeResponses();
    negotiations += c->negotiations();  // with this cycle's, before their ops can complete
    if (resps.empty()) return;
    Respond(&s, std::move(resps));
    any = true;
  });
  stats_.negotiations = negotiations;
  return any;
}

void Runtime::FailAwaiting(const std::function<bool(const Entry&)>& which, int code, const std::string& why) {
  std::vector<EntryPtr> lost;
  for (auto a = awaiting_response_.begin(); a != awaiting_response_.end();) {
    if (which(*a->second)) {
      grouped_.Expand(a->second, &lost);  // a group waits as its first member: all of them
      a = awaiting_response_.erase(a);
    } else {
      ++a;
    }
  }
  for (auto& e : lost) Finish(e, Status::Error(code, OpError(e->sig.op, e->name, why)));
}

}  // namespace shoal
