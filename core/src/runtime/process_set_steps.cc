// The runtime's side of process sets: what adding and removing them (process_sets/set_control.h)
// needs of it, and the sets as its negotiation sees them (driver only).
#include "runtime/runtime.h"

namespace shoal {

Status Runtime::RunOp(const shoal_op_desc& d, EntryPtr* e) {
  const int64_t h = Enqueue(d);
  const Status st = Wait(h);
  *e = Find(h);
  Release(h);
  return st;
}

Status Runtime::RunOnDriver(const EntryPtr& e) {
  int64_t handle;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_ || left_) return Status::Error(SHOAL_ABORTED, "Shoal is shutting down");
    Register(e, nullptr, nullptr);
    handle = e->handle;
    queue_.push_back(e);
    queued_ = queue_.size();
  }
  work_cv_.notify_one();
  Status st = Wait(handle);  // drives the cycle that runs it, unless another thread does
  Release(handle);
  return st;
}

int Runtime::InFlightIn(int set) {
  std::lock_guard<std::mutex> lock(mu_);
  int n = 0;
  for (auto& kv : handles_) n += kv.second->set == set && !kv.second->done;
  return n;
}

void Runtime::EndSet(const ProcessSet& s) {
  const int id = s.id;
  cache_.Drop(id);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (names_.Voting(id)) Thaw(id, {});  // its coordinator will not answer the vote
  }
  // Submitted by another thread meanwhile.
  FailAwaiting([id](const Entry& e) { return e.set == id; }, SHOAL_INVALID_ARGUMENT, s.Describe() + " was removed");
}

Coordinator* Runtime::CoordinatorOf(int set) { return set == 0 ? coordinator_.get() : sets_.CoordinatorOf(set); }

const ProcessSet* Runtime::SetOf(int set) const { return sets_.Of(set); }

int Runtime::IndexIn(int set, int world_rank) const {
  if (set == 0) return world_rank;
  const ProcessSet* s = SetOf(set);
  return s ? s->IndexOf(world_rank) : -1;
}

bool Runtime::Lost(int set) const {
  if (!departures_.Any()) return false;
  const ProcessSet* s = SetOf(set);
  if (!s) return true;
  for (int r : s->ranks)
    if (departures_.Left(r)) return true;
  return false;
}

void Runtime::LeaveSets(int rank) {
  sets_.ForEach([&](const ProcessSet& s, Coordinator* c) {
    if (s.index < 0 || !s.Has(rank)) return;  // not this rank's business, or not the leaver's
    if (c) {
      std::vector<Response> resps = c->Leave(s.IndexOf(rank));
      if (!resps.empty()) Respond(&s, std::move(resps));
    } else if (rank == s.leader()) {  // the set's coordinator is gone: what waits for it fails
      const int id = s.id;
      FailAwaiting([this, id](const Entry& e) { return sets_.NegotiatedIn(e.set, e.sig.scope) == id; }, SHOAL_ABORTED,
                   Departures::Describe({rank}));
    }
  });
}

}  // namespace shoal
