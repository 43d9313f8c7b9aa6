// Horovod's join: a rank that ran out of data calls join(); until every rank has joined it
// takes part in the other ranks' allreduces contributing the identity of the reduction, in
// their reducescatters (zeros) and in their barriers (how: join.cc). This class holds this
// rank's join and what it knows of its peers'. Driver only, but for InFlight().
#pragma once
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "engines/backend.h"
#include "negotiation/coordinator.h"
#include "runtime/entry.h"

namespace shoal {

class Join {
 public:
  explicit Join(int world_size) : peer_joined_at_(world_size, -1) {}

  // Whether `msg` is a peer's join notice, and its runtime generation and join count.
  static bool IsNotice(const ByteVec& msg, uint64_t* generation, int64_t* epoch);
  // This rank's call of `name` (step `step`) that it runs on the identity of `sig`'s reduction.
  static EntryPtr IdentityEntry(const std::string& name, const Signature& sig, int64_t step);

  // This rank joins with op `e`: the notice for every peer.
  Bytes Start(const EntryPtr& e, uint64_t generation);
  bool Joining() const { return joining_ != nullptr; }
  bool RequestDue() const { return joining_ && !sent_; }  // its request has yet to go to the coordinator
  EntryPtr TakeRequest() {
    sent_ = true;
    return joining_;
  }
  void Abandon() { joining_ = nullptr; }  // failed (a rank left): so is the job
  // Every rank joined (response `r`): each of `batch` gets the last rank to join as its result.
  void Complete(const Response& r, const std::vector<EntryPtr>& batch);

  // Peer `rank` announced its join number `epoch`: false if that join completed here already.
  bool OnNotice(int rank, int64_t epoch);
  bool PeerJoined(int rank) const { return peer_joined_at_[rank] == epoch_; }
  bool AnyPeerJoined() const { return any_notice_ && AnyPeerJoinedNow(); }
  // A batch cached now would miss a joined rank in its rounds.
  bool Active() const { return joining_ || AnyPeerJoined(); }

  // Any thread: this rank's join is in flight (it takes part in no new ops).
  bool InFlight() const { return in_flight_; }
  void SetInFlight(bool v) { in_flight_ = v; }

 private:
  bool AnyPeerJoinedNow() const;

  EntryPtr joining_;  // this rank's join until it completes
  bool sent_ = false;  // its request went to the coordinator
  int64_t epoch_ = 0;  // joins completed
  bool any_notice_ = false;
  std::vector<int64_t> peer_joined_at_;  // by peer: the join (that count then) it announced
  std::atomic<bool> in_flight_{false};
};

}  // namespace shoal
