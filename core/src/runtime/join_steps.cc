// The runtime's steps of Horovod's join (ops/join.h holds the join's state): notices to
// the peers, the join's request once this rank's earlier requests went, and the identity
// entries a joined rank runs in the other ranks' collectives.
#include <algorithm>

#include "ops/join.h"
#include "runtime/runtime.h"

namespace shoal {

void Runtime::RouteJoin(const EntryPtr& e) {
  auto notice = join_.Start(e, generation_);
  cache_.DoomAll(-1, true);
  const WorldInfo& w = world();
  for (int r = 0; r < w.size; ++r)
    if (r != w.rank && !departures_.Left(r)) backend_->Send(r, NeighborExchange::kTag, notice, [](const Status&) {});
}

void Runtime::SendJoin(std::vector<Request>* to_coordinator) {
  // Doomed batches hand their ops to late_requests_, which this cycle has sent already.
  if (cache_.HoldsOwnOps() || !devices_.Idle()) return;
  {
    // Calls held for a vote on retiring names (negotiation/names.cc) are this rank's calls
    // before the join: they reach the coordinator first (queued at the commit, sent the
    // cycle after).
    std::lock_guard<std::mutex> lock(mu_);
    if (names_.Holding() || !queue_.empty()) return;
  }
  Ask(join_.TakeRequest(), to_coordinator);
}

void Runtime::OnJoinNotice(int rank, int64_t epoch) {
  if (!join_.OnNotice(rank, epoch)) return;  // of a join that completed here already
  cache_.DoomAll();
  if (!join_.PeerJoined(rank)) return;  // the next join: this rank has yet to complete the current one
  for (auto& e : neighbors_.TakeNeeding(rank))
    Finish(e, Status::Error(SHOAL_MISMATCH, OpError(e->sig.op, e->name, "rank " + std::to_string(rank) +
                                                                            " joined (join()) and takes no part in "
                                                                            "neighbor ops until every rank has joined")));
}

EntryPtr Runtime::JoinedEntry(const Response& r, size_t i) {
  if (i >= r.sigs.size() || std::find(r.joined.begin(), r.joined.end(), world().rank) == r.joined.end())
    return nullptr;
  return IdentityEntry(r.names[i], r.sigs[i]);
}

EntryPtr Runtime::IdentityEntry(const std::string& name, const Signature& sig) {
  return Join::IdentityEntry(name, sig, CountCall(name, sig));
}

int64_t Runtime::CountCall(const std::string& name, const Signature& sig) {
  // The op counts as this rank's call of the name: its step, and for an unnamed op the
  // generated-name counter, stay those of the ranks that ran it, so the ops after the
  // join pair up again.
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t step = names_[name].calls++;
  names_.FollowUnnamed(sig.op, name);
  return step;
}

void Runtime::JoinedGroup(const Response& r, std::vector<EntryPtr>* batch) {
  if (std::find(r.joined.begin(), r.joined.end(), world().rank) == r.joined.end()) return;
  const std::string& group = r.names[0];
  {
    std::lock_guard<std::mutex> lock(mu_);  // the group counts as this rank's call (JoinedEntry)
    ++names_[group].calls;
    names_.FollowUnnamed(r.op, group);
  }
  for (size_t i = 0; i < r.sigs.size(); ++i) batch->push_back(IdentityEntry(MemberName(group, static_cast<int>(i)), r.sigs[i]));
}

void Runtime::FinishJoin(const Response& r, const std::vector<EntryPtr>& batch) {
  join_.Complete(r, batch);
  for (auto& e : batch) Finish(e, Status::Ok());
}

}  // namespace shoal
