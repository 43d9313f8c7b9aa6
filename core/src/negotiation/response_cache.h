// Cached allreduce batches and broadcasts: the coordinator round trip skipped for
// collectives that repeat (how, and why rounds always match: response_cache.cc; a
// broadcast's rounds: docs/design.md §20). Driver only.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/buffer_pool.h"
#include "common/config.h"
#include "common/stats.h"
#include "engines/backend.h"
#include "negotiation/coordinator.h"
#include "process_sets/process_sets.h"
#include "runtime/entry.h"

namespace shoal {

class CollectiveOps;
class Negotiation;
class Submissions;

class ResponseCache {
 public:
  // What the cache needs of the runtime that runs it.
  class Host {
   public:
    virtual void Finish(const EntryPtr& e, const Status& st) = 0;
    // An op of a batch that died goes to the coordinator after all.
    virtual void Renegotiate(const EntryPtr& e) = 0;

   protected:
    ~Host() = default;
  };

  // `negotiation`: the coordinators of the batches' rounds, and requests for the next cycle;
  // `collectives`: the engines that run the rounds, and the fusion buffers; `submissions`: where
  // a joined rank's calls that the other ranks ran without it are counted.
  ResponseCache(Host* host, Negotiation* negotiation, CollectiveOps* collectives, Submissions* submissions,
                const Config& cfg, Stats* stats);

  bool Empty() const { return cached_.empty(); }
  bool Has(const std::string& key) const { return members_.count(key) > 0; }  // a member's name (SetKey)
  bool IsBroadcast(const std::string& key) const {
    auto it = members_.find(key);
    return it != members_.end() && IsBroadcast(*it->second.first);
  }
  // Batch `batch`, which response `r` ran and gave a channel, of a set of `set_size` ranks
  // in which this rank has index `index`; `doom`: it must go back to the coordinator at
  // once (a join is under way; a broadcast is then not cached).
  void Add(const Response& r, const std::vector<EntryPtr>& batch, int set_size, int index, bool doom);
  // Takes `e` if it is a member of a cached batch (a refusal only dooms an allreduce batch;
  // it takes part in a broadcast's round): true if taken.
  bool Route(const EntryPtr& e);
  // Every batch (with_rank >= 0: of the sets that have that rank, which left the job) goes
  // back to the coordinator; `joining`: this rank joins (it takes part in the broadcasts'
  // rounds it will not submit).
  void DoomAll(int with_rank = -1, bool joining = false);
  void Drop(int set);  // set removed: its (idle) batches go
  // The coordinator failed `name` at `step` on every rank (a stall of a round if
  // `fail_round`, else a call refused on some rank).
  void Fail(const std::string& name, int64_t step, const Status& st, bool fail_round);
  void Check(Clock::time_point now);  // waits that doom a batch; probes and stalls of rounds
  bool InFlight() const;              // an allreduce round is running
  bool HoldsOwnOps() const;           // this rank's ops are in a batch that is not dead
  void KeepRoundBuffers();            // at shutdown: buffers of running rounds outlive the runtime

 private:
  struct Batch;
  using BatchPtr = std::shared_ptr<Batch>;
  static bool IsBroadcast(const Batch& b);
  void Doom(const BatchPtr& b);
  void Contribute(const BatchPtr& b, bool ready);
  void OnRound(const BatchPtr& b, const Status& st);
  // Cached broadcasts (docs/design.md §20): a round of `e`'s step (null: a joined rank's), its end.
  void Broadcast(const BatchPtr& b, const EntryPtr& e);
  void OnBroadcast(const BatchPtr& b, const Status& st);
  void Deliver(const BatchPtr& b, const EntryPtr& e, const char* data);  // a good round's op
  // Dead on every rank: its members leave the cache; `channel_free`: and the coordinator may
  // give its channel again (to a broadcast's only once every rank passed its last round).
  void Bury(const BatchPtr& b, bool channel_free);

  Host* host_;
  Negotiation* negotiation_;
  CollectiveOps* collectives_;
  Submissions* submissions_;
  double warn_, kill_;  // stall times (s)
  Stats* stats_;
  std::shared_ptr<BufferPool> pool_;
  std::map<int64_t, BatchPtr> cached_;  // by (process set << 32 | collective channel)
  std::vector<BatchPtr> retired_;      // replaced on their channel while their last round ran
  std::unordered_map<std::string, std::pair<BatchPtr, size_t>> members_;  // name -> (batch, index)
};

}  // namespace shoal
