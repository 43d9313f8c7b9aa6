#include "negotiation/negotiation.h"

#include <algorithm>

#include "ops/groups.h"

namespace shoal {

Negotiation::Negotiation(Host* host, Backend* backend, ProcessSets* sets, const Departures* departures,
                         GroupedOps* groups, Stats* stats, int64_t fusion_threshold)
    : host_(host), backend_(backend), sets_(sets), departures_(departures), groups_(groups), stats_(stats) {
  const WorldInfo& w = backend_->world();
  if (w.rank == 0) coordinator_ = std::make_unique<Coordinator>(w.size, fusion_threshold, Backend::kChannels);
}

double Negotiation::Now() const { return std::chrono::duration<double>(Clock::now() - start_).count(); }

Coordinator* Negotiation::CoordinatorOf(int set) { return set == 0 ? coordinator_.get() : sets_->CoordinatorOf(set); }

const ProcessSet* Negotiation::SetOf(int set) const { return sets_->Of(set); }

int Negotiation::IndexIn(int set, int world_rank) const {
  if (set == 0) return world_rank;
  const ProcessSet* s = SetOf(set);
  return s ? s->IndexOf(world_rank) : -1;
}

int Negotiation::SetSize(int set) const {
  const ProcessSet* s = SetOf(set);
  return s ? s->size() : backend_->world().size;
}

bool Negotiation::Lost(int set) const {
  if (!departures_->Any()) return false;
  const ProcessSet* s = SetOf(set);
  if (!s) return true;
  for (int r : s->ranks)
    if (departures_->Left(r)) return true;
  return false;
}

EntryPtr Negotiation::Take(const std::string& key, int64_t step) {
  auto it = awaiting_.find(key);
  if (it == awaiting_.end()) return nullptr;
  const Entry& e = *it->second;
  if (step >= 0 && (e.group.empty() ? e.step : e.group_step) != step) return nullptr;
  EntryPtr out = std::move(it->second);
  awaiting_.erase(it);
  return out;
}

bool Negotiation::AddHere(const Request& req) {
  Coordinator* c = CoordinatorOf(req.set);
  if (!c) return false;
  c->Add(IndexIn(req.set, backend_->world().rank), req, Now());
  return true;
}

void Negotiation::Send(std::vector<Request>* reqs) {
  auto send = [this](int leader, const std::vector<Request>& to) {
    auto msg = std::make_shared<ByteVec>(EncodeRequests(to));
    backend_->Send(leader, kRequestTag, msg, [this, leader](const Status& st) {
      if (st.ok()) return;
      if (leader == 0) return host_->FailAll("cannot reach the coordinator (rank 0): " + st.message, SHOAL_ABORTED);
      // Only the sets it leads lose their coordinator.
      FailAwaiting([this, leader](const Entry& e) {
        const ProcessSet* s = SetOf(sets_->NegotiatedIn(e.set, e.sig.scope));
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
    if (AddHere(r)) continue;
    const ProcessSet* s = SetOf(r.set);
    if (r.set != 0 && !s) continue;  // removed meanwhile: its ops failed (SetControl)
    by_leader[s ? s->leader() : 0].push_back(std::move(r));
  }
  for (auto& kv : by_leader) send(kv.first, kv.second);
}

void Negotiation::OnRequests(int src, const ByteVec& msg) {
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

void Negotiation::OnResponses(const ByteVec& msg) {
  for (auto& r : DecodeResponses(msg.data(), msg.size())) host_->Apply(r);
}

bool Negotiation::Answer() {
  bool any = false;
  if (coordinator_) {
    std::vector<Response> resps = coordinator_->TakeResponses();
    if (!resps.empty()) {
      Respond(nullptr, std::move(resps));
      any = true;
    }
  }
  int64_t negotiations = coordinator_ ? coordinator_->negotiations() : 0;
  if (!sets_->Leader()) {
    if (coordinator_) stats_->negotiations = negotiations;
    return any;
  }
  sets_->ForEach([&](const ProcessSet& s, Coordinator* c) {
    if (!c) return;
    std::vector<Response> resps = c->TakeResponses();
    negotiations += c->negotiations();  // with this cycle's, before their ops can complete
    if (resps.empty()) return;
    Respond(&s, std::move(resps));
    any = true;
  });
  stats_->negotiations = negotiations;
  return any;
}

void Negotiation::Respond(const ProcessSet* set, std::vector<Response> resps) {
  const int id = set ? set->id : 0, me = backend_->world().rank;
  for (auto& r : resps) r.set = id;
  auto msg = std::make_shared<ByteVec>(EncodeResponses(resps));
  auto send = [&](int q) {
    if (q != me && !departures_->Left(q)) backend_->Send(q, kResponseTag, msg, [](const Status&) {});
  };
  if (set) {
    for (int q : set->ranks) send(q);
  } else {
    for (int q = 0; q < backend_->world().size; ++q) send(q);
  }
  for (auto& r : resps) host_->Apply(r);
}

void Negotiation::File(const std::string& key, const Response& r) {
  if (refusals_.size() < 1024) refusals_[key] = r;
}

Status Negotiation::TakeRefusal(const std::string& key, int64_t step) {
  if (refusals_.empty()) return Status::Ok();
  auto it = refusals_.find(key);
  if (it == refusals_.end() || it->second.step != step) return Status::Ok();
  const Status st = Status::Error(it->second.code, it->second.error);
  refusals_.erase(it);
  return st;
}

Status Negotiation::Departed(int set, int op, const std::string& name) const {
  if (!departures_->Any()) return Status::Ok();
  const std::vector<int> gone = departures_->Members(SetOf(set));
  return gone.empty() ? Status::Ok() : Status::Error(SHOAL_ABORTED, OpError(op, name, Departures::Describe(gone)));
}

Status Negotiation::Unrunnable(const std::string& key, int64_t step, int set, int op, const std::string& name) {
  const Status st = TakeRefusal(key, step);
  return st.ok() ? Departed(set, op, name) : st;
}

void Negotiation::FailAwaiting(const std::function<bool(const Entry&)>& which, int code, const std::string& why) {
  std::vector<EntryPtr> lost;
  for (auto a = awaiting_.begin(); a != awaiting_.end();) {
    if (which(*a->second)) {
      groups_->Expand(a->second, &lost);  // a group waits as its first member: all of them
      a = awaiting_.erase(a);
    } else {
      ++a;
    }
  }
  for (auto& e : lost) host_->Finish(e, Status::Error(code, OpError(e->sig.op, e->name, why)));
}

void Negotiation::OnLeave(int rank) {
  const std::string why = Departures::Describe({rank});
  if (coordinator_) {
    std::vector<Response> resps = coordinator_->Leave(rank);
    if (!resps.empty()) Respond(nullptr, std::move(resps));
  } else if (rank == 0) {  // no coordinator any more: nothing waiting for it can complete
    FailAwaiting([this](const Entry& e) { return sets_->NegotiatedIn(e.set, e.sig.scope) == 0; }, SHOAL_ABORTED, why);
  }
  sets_->ForEach([&](const ProcessSet& s, Coordinator* c) {
    if (s.index < 0 || !s.Has(rank)) return;  // not this rank's business, or not the leaver's
    if (c) {
      std::vector<Response> resps = c->Leave(s.IndexOf(rank));
      if (!resps.empty()) Respond(&s, std::move(resps));
    } else if (rank == s.leader()) {  // the set's coordinator is gone: what waits for it fails
      const int id = s.id;
      FailAwaiting([this, id](const Entry& e) { return sets_->NegotiatedIn(e.set, e.sig.scope) == id; },
                   SHOAL_ABORTED, why);
    }
  });
}

void Negotiation::CheckStalls(StallInspector* stalls) {
  auto check = [&](Coordinator* c, const ProcessSet* set) {
    std::vector<Response> aborts = stalls->Check(*c, set, Now());
    if (!aborts.empty()) Respond(set, std::move(aborts));
  };
  if (coordinator_) check(coordinator_.get(), nullptr);
  sets_->ForEach([&](const ProcessSet& s, Coordinator* c) {
    if (c) check(c, &s);
  });
}

void Negotiation::ForgetSet(int set) {
  std::string name;
  for (auto it = refusals_.begin(); it != refusals_.end();)
    it = KeyInSet(it->first, set, &name) ? refusals_.erase(it) : std::next(it);
}

}  // namespace shoal
