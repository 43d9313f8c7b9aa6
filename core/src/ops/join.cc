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
// (AddIdentities) in the same order as the others. Broadcast, allgather, alltoall and
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
#include "ops/join.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "common/reduce.h"
#include "negotiation/response_cache.h"
#include "neighbor/neighbor_exchange.h"
#include "runtime/submissions.h"

namespace shoal {
namespace {

constexpr uint32_t kJoinMagic = 0x4a4f494eu;  // "JOIN"

}  // namespace

Join::Join(Host* host, Submissions* submissions, Backend* backend, const Departures* departures, ResponseCache* cache,
           NeighborExchange* neighbors, uint64_t generation)
    : host_(host), submissions_(submissions), backend_(backend), departures_(departures), cache_(cache), neighbors_(neighbors),
      generation_(generation), peer_joined_at_(backend->world().size, -1) {}

void Join::Route(const EntryPtr& e) {
  joining_ = e;
  sent_ = false;
  auto notice = std::make_shared<ByteVec>(sizeof(kJoinMagic) + sizeof(generation_) + sizeof(epoch_));
  std::memcpy(notice->data(), &kJoinMagic, sizeof(kJoinMagic));
  std::memcpy(notice->data() + sizeof(kJoinMagic), &generation_, sizeof(generation_));
  std::memcpy(notice->data() + sizeof(kJoinMagic) + sizeof(generation_), &epoch_, sizeof(epoch_));
  cache_->DoomAll(-1, true);
  const WorldInfo& w = backend_->world();
  for (int r = 0; r < w.size; ++r)
    if (r != w.rank && !departures_->Left(r)) backend_->Send(r, NeighborExchange::kTag, notice, [](const Status&) {});
}

void Join::SendRequest(std::vector<Request>* to_coordinator) {
  if (!joining_ || sent_ || !host_->Submitted()) return;
  sent_ = true;
  host_->Ask(joining_, to_coordinator);
}

bool Join::OnMessage(int rank, const ByteVec& msg) {
  uint32_t magic = 0;
  uint64_t generation = 0;
  int64_t epoch = 0;
  if (msg.size() != sizeof(magic) + sizeof(generation) + sizeof(epoch)) return false;
  std::memcpy(&magic, msg.data(), sizeof(magic));
  if (magic != kJoinMagic) return false;
  std::memcpy(&generation, msg.data() + sizeof(magic), sizeof(generation));
  std::memcpy(&epoch, msg.data() + sizeof(magic) + sizeof(generation), sizeof(epoch));
  // Of a runtime before a shutdown, or of a join that completed here already.
  if (generation != generation_ || epoch < epoch_) return true;
  peer_joined_at_[rank] = epoch;
  any_notice_ = true;
  cache_->DoomAll();
  if (!PeerJoined(rank)) return true;  // the next join: this rank has yet to complete the current one
  for (auto& e : neighbors_->TakeNeeding(rank))
    host_->Finish(e, Status::Error(SHOAL_MISMATCH, OpError(e->sig.op, e->name, "rank " + std::to_string(rank) +
                                                                                 " joined (join()) and takes no part "
                                                                                 "in neighbor ops until every rank has "
                                                                                 "joined")));
  return true;
}

void Join::AddIdentities(const Response& r, size_t i, std::vector<EntryPtr>* batch) {
  if (std::find(r.joined.begin(), r.joined.end(), backend_->world().rank) == r.joined.end()) return;
  if (!(r.op & SHOAL_GROUPED)) {
    if (i < r.sigs.size()) batch->push_back(IdentityEntry(r.names[i], r.sigs[i]));
    return;
  }
  const std::string& group = r.names[0];
  submissions_->CountCall(group, r.op);  // the group counts as this rank's call too
  for (size_t k = 0; k < r.sigs.size(); ++k) batch->push_back(IdentityEntry(MemberName(group, static_cast<int>(k)), r.sigs[k]));
}

bool Join::AnyPeerJoinedNow() const {
  return std::any_of(peer_joined_at_.begin(), peer_joined_at_.end(), [this](int64_t at) { return at == epoch_; });
}

EntryPtr Join::IdentityEntry(const std::string& name, const Signature& sig) {
  auto e = std::make_shared<Entry>();
  e->name = name;
  e->sig = sig;
  e->step = submissions_->CountCall(name, sig.op);
  // The identity of the reduction (zeros for Sum, Average and reducescatter; the dtype's
  // largest value for Min, its lowest for Max, ones for Product), so the result is the
  // reduction over the ranks still running.
  e->joined_input.resize(std::max<size_t>(e->nbytes(), 1));
  FillIdentity(e->joined_input.data(), e->sig.dtype, static_cast<size_t>(e->count()), e->sig.reduce_op);
  e->input.data = e->output.data = e->joined_input.data();
  return e;
}

void Join::Complete(const Response& r, const std::vector<EntryPtr>& batch) {
  joining_ = nullptr;
  sent_ = false;
  ++epoch_;  // every peer's join of this count is over
  const int32_t last = r.joined.empty() ? -1 : r.joined[0];
  for (auto& e : batch) {
    e->result = std::malloc(sizeof(last));
    std::memcpy(e->result, &last, sizeof(last));
    e->result_nbytes = sizeof(last);
    e->result_shape.clear();
  }
  for (auto& e : batch) host_->Finish(e, Status::Ok());
}

}  // namespace shoal
