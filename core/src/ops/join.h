// Horovod's join: a rank that ran out of data calls join(); until every rank has joined it
// takes part in the other ranks' allreduces contributing the identity of the reduction, in
// their reducescatters (zeros) and in their barriers (how: join.cc). This class holds this
// rank's join and what it knows of its peers', and runs the join's steps. Driver only, but
// for InFlight().
#pragma once
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "engines/backend.h"
#include "negotiation/coordinator.h"
#include "runtime/departures.h"
#include "runtime/entry.h"

namespace shoal {

class NeighborExchange;
class ResponseCache;
class Submissions;

class Join {
 public:
  // What the join needs of the runtime (driver only).
  class Host {
   public:
    virtual void Finish(const EntryPtr& e, const Status& st) = 0;
    virtual void Ask(const EntryPtr& e, std::vector<Request>* to_coordinator) = 0;  // negotiate `e`
    // Every earlier call of this rank's went to its coordinator (none queued, held or in a live cached batch).
    virtual bool Submitted() = 0;

   protected:
    ~Host() = default;
  };

  // `submissions`: where this rank's calls are counted (a joined rank's too); `generation`: the
  // runtime's (notices of an earlier runtime are ignored).
  Join(Host* host, Submissions* submissions, Backend* backend, const Departures* departures, ResponseCache* cache,
       NeighborExchange* neighbors, uint64_t generation);

  // This rank joins with op `e`: every peer hears of it; cached batches go back to the coordinator.
  void Route(const EntryPtr& e);
  // The join's request, into `to_coordinator` once this rank's earlier requests went (a cycle's last).
  void SendRequest(std::vector<Request>* to_coordinator);
  // `msg` from `rank` on the neighbor tag: true if it is a join notice (and was handled).
  bool OnMessage(int rank, const ByteVec& msg);
  // Response `r` (its name `i`) runs while this rank is joined: this rank's identity entries into `batch`.
  void AddIdentities(const Response& r, size_t i, std::vector<EntryPtr>* batch);
  // Every rank joined (response `r`): each of `batch` completes with the last rank to join as its result.
  void Complete(const Response& r, const std::vector<EntryPtr>& batch);
  void Abandon() { joining_ = nullptr; }  // failed (a rank left): so is the job

  bool PeerJoined(int rank) const { return peer_joined_at_[rank] == epoch_; }
  bool AnyPeerJoined() const { return any_notice_ && AnyPeerJoinedNow(); }
  // A batch cached now would miss a joined rank in its rounds.
  bool Active() const { return joining_ || AnyPeerJoined(); }

  // Any thread: this rank's join is in flight (it takes part in no new ops).
  bool InFlight() const { return in_flight_; }
  void SetInFlight(bool v) { in_flight_ = v; }

 private:
  bool AnyPeerJoinedNow() const;
  // This rank's call of `name` (step `step`) that it runs on the identity of `sig`'s reduction.
  EntryPtr IdentityEntry(const std::string& name, const Signature& sig);

  Host* host_;
  Submissions* submissions_;
  Backend* backend_;
  const Departures* departures_;
  ResponseCache* cache_;
  NeighborExchange* neighbors_;
  const uint64_t generation_;
  EntryPtr joining_;  // this rank's join until it completes
  bool sent_ = false;  // its request went to the coordinator
  int64_t epoch_ = 0;  // joins completed
  bool any_notice_ = false;
  std::vector<int64_t> peer_joined_at_;  // by peer: the join (that count then) it announced
  std::atomic<bool> in_flight_{false};
};

}  // namespace shoal
