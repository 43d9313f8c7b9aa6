// Horovod's join: a rank that ran out of data calls join(); until every rank has joined it
// takes part in the other ranks' allreduces contributing the identity of the reduction
// (zeros for Sum, and for Average's sum, whose divisor stays the number of ranks, as in
// Horovod; the dtype's largest value or +inf for Min, its lowest or -inf for Max, ones for
// Product), in their reducescatters (zeros) and in their barriers. The join completes on every rank when the last rank joins, with that rank as
// its result; then the job runs as before (the next epoch, another join).
//
// The coordinator knows which ranks joined (negotiation/coordinator.cc): a name submitted by every rank
// that has not joined is complete, and its response lists the joined ranks and the
// signatures, so each joined rank runs the collective on identity buffers of that signature
// (JoinedEntry) in the same order as the others. Broadcast, allgather, alltoall and
// neighbor ops fail there with an error naming the joined ranks (Horovod raises for
// broadcast, allgather and alltoall too).
//
// Cached batches (negotiation/response_cache.cc) skip the coordinator, so a joined rank would be missing
// from their rounds: the joining rank dooms every batch and tells every peer (a notice on
// the neighbor tag, as a leaving rank does), which dooms them too, so their ops go to the
// coordinator; no batch is cached while a rank is joined. The join request itself goes to
// the coordinator only after this rank's ops held by cached batches went there: its
// requests must arrive before its join, or the coordinator would run them without it.
// The notice also lets neighbor ops that need a joined rank fail at once.
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "common/reduce.h"
#include "runtime/runtime.h"

namespace shoal {
namespace {

constexpr uint32_t kJoinMagic = 0x4a4f494eu;  // "JOIN"

Bytes JoinNotice(uint64_t generation, int64_t epoch) {
  auto msg = std::make_shared<ByteVec>(sizeof(kJoinMagic) + sizeof(generation) + sizeof(epoch));
  std::memcpy(msg->data(), &kJoinMagic, sizeof(kJoinMagic));
  std::memcpy(msg->data() + sizeof(kJoinMagic), &generation, sizeof(generation));
  std::memcpy(msg->data() + sizeof(kJoinMagic) + sizeof(generation), &epoch, sizeof(epoch));
  return msg;
}

}  // namespace

bool Runtime::IsJoinNotice(const ByteVec& msg, uint64_t* generation, int64_t* epoch) {
  uint32_t magic = 0;
  if (msg.size() != sizeof(magic) + sizeof(*generation) + sizeof(*epoch)) return false;
  std::memcpy(&magic, msg.data(), sizeof(magic));
  if (magic != kJoinMagic) return false;
  std::memcpy(generation, msg.data() + sizeof(magic), sizeof(*generation));
  std::memcpy(epoch, msg.data() + sizeof(magic) + sizeof(*generation), sizeof(*epoch));
  return true;
}

void Runtime::RouteJoin(const EntryPtr& e) {
  joining_ = e;
  join_sent_ = false;
  cache_.DoomAll();
  const WorldInfo& w = world();
  auto notice = JoinNotice(generation_, join_epoch_);
  for (int r = 0; r < w.size; ++r)
    if (r != w.rank && !departures_.Left(r)) backend_->Send(r, NeighborExchange::kTag, notice, [](const Status&) {});
}

void Runtime::SendJoin(std::vector<Request>* to_coordinator) {
  // Doomed batches hand their ops to late_requests_, which this cycle has sent already.
  if (cache_.HoldsOwnOps() || (gpu_ && !gpu_->Idle())) return;
  {
    // Calls held for a vote on retiring names (negotiation/names.cc) are this rank's calls
    // before the join: they reach the coordinator first (queued at the commit, sent the
    // cycle after).
    std::lock_guard<std::mutex> lock(mu_);
    if (names_.Holding() || !queue_.empty()) return;
  }
  join_sent_ = true;
  Ask(joining_, to_coordinator);
}

bool Runtime::AnyPeerJoined() const {
  for (size_t r = 0; r < peer_joined_at_.size(); ++r)
    if (PeerJoined(static_cast<int>(r))) return true;
  return false;
}

void Runtime::OnJoinNotice(int rank, int64_t epoch) {
  if (epoch < join_epoch_) return;  // of a join that completed here already
  if (peer_joined_at_.empty()) peer_joined_at_.assign(world().size, -1);
  peer_joined_at_[rank] = epoch;
  cache_.DoomAll();
  if (epoch != join_epoch_) return;  // the next join: this rank has yet to complete the current one
  for (auto& e : neighbors_.TakeNeeding(rank))
    Finish(e, Status::Error(SHOAL_MISMATCH, OpError(e->sig.op, e->name, "rank " +
                                                        std::to_string(rank) +
                                                        " joined (join()) and takes no part in neighbor ops until "
                                                        "every rank has joined")));
}

EntryPtr Runtime::JoinedEntry(const Response& r, size_t i) {
  if (i >= r.sigs.size() || std::find(r.joined.begin(), r.joined.end(), world().rank) == r.joined.end())
    return nullptr;
  return IdentityEntry(r.names[i], r.sigs[i]);
}

EntryPtr Runtime::IdentityEntry(const std::string& name, const Signature& sig) {
  auto e = std::make_shared<Entry>();
  e->name = name;
  e->sig = sig;
  {
    // The op counts as this rank's call of the name: its step, and for an unnamed op the
    // generated-name counter, stay those of the ranks that ran it, so the ops after the
    // join pair up again.
    std::lock_guard<std::mutex> lock(mu_);
    e->step = names_[e->name].calls++;
    names_.FollowUnnamed(e->sig.op, e->name);
  }
  // The identity of the reduction (zeros for Sum, Average and reducescatter; the dtype's
  // largest value for Min, its lowest for Max, ones for Product), so the result is the
  // reduction over the ranks still running.
  e->joined_input.resize(std::max<size_t>(e->nbytes(), 1));
  FillIdentity(e->joined_input.data(), e->sig.dtype, static_cast<size_t>(e->count()), e->sig.reduce_op);
  e->input.data = e->output.data = e->joined_input.data();
  return e;
}

void Runtime::FinishJoin(const Response& r, const std::vector<EntryPtr>& batch) {
  joining_ = nullptr;
  join_sent_ = false;
  ++join_epoch_;  // every peer's join of this count is over
  const int32_t last = r.joined.empty() ? -1 : r.joined[0];
  for (auto& e : batch) {
    e->result = std::malloc(sizeof(last));
    std::memcpy(e->result, &last, sizeof(last));
    e->result_nbytes = sizeof(last);
    e->result_shape.clear();
    Finish(e, Status::Ok());
  }
}

}  // namespace shoal
