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
#include "ops/join.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "common/reduce.h"

namespace shoal {
namespace {

constexpr uint32_t kJoinMagic = 0x4a4f494eu;  // "JOIN"

}  // namespace

bool Join::IsNotice(const ByteVec& msg, uint64_t* generation, int64_t* epoch) {
  uint32_t magic = 0;
  if (msg.size() != sizeof(magic) + sizeof(*generation) + sizeof(*epoch)) return false;
  std::memcpy(&magic, msg.data(), sizeof(magic));
  if (magic != kJoinMagic) return false;
  std::memcpy(generation, msg.data() + sizeof(magic), sizeof(*generation));
  std::memcpy(epoch, msg.data() + sizeof(magic) + sizeof(*generation), sizeof(*epoch));
  return true;
}

Bytes Join::Start(const EntryPtr& e, uint64_t generation) {
  joining_ = e;
  sent_ = false;
  auto msg = std::make_shared<ByteVec>(sizeof(kJoinMagic) + sizeof(generation) + sizeof(epoch_));
  std::memcpy(msg->data(), &kJoinMagic, sizeof(kJoinMagic));
  std::memcpy(msg->data() + sizeof(kJoinMagic), &generation, sizeof(generation));
  std::memcpy(msg->data() + sizeof(kJoinMagic) + sizeof(generation), &epoch_, sizeof(epoch_));
  return msg;
}

bool Join::AnyPeerJoinedNow() const {
  return std::any_of(peer_joined_at_.begin(), peer_joined_at_.end(), [this](int64_t at) { return at == epoch_; });
}

bool Join::OnNotice(int rank, int64_t epoch) {
  if (epoch < epoch_) return false;  // of a join that completed here already
  peer_joined_at_[rank] = epoch;
  any_notice_ = true;
  return true;
}

EntryPtr Join::IdentityEntry(const std::string& name, const Signature& sig, int64_t step) {
  auto e = std::make_shared<Entry>();
  e->name = name;
  e->sig = sig;
  e->step = step;
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
}

}  // namespace shoal
