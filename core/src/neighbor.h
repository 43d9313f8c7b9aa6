// Neighbor data plane: point-to-point exchange for neighbor_allreduce.
//
// Each cycle, the ready entries are packed per destination into self-describing
// messages (header: name, signature, bytes per entry) of up to the fusion threshold.
// Receivers take every message as it arrives and stash its pieces by (source, name),
// so ranks may submit in any order and no global synchronisation is needed; an entry
// completes once a piece from each of its sources is there. The header's signature
// is checked against the receiver's own, so a shape or dtype change on one rank is an
// error on its neighbours, never silent mixing. Each piece also carries the sender's
// step (how many ops of that name it ran before), so a send that the receiver did not
// expect at that step is an error naming the edge, not data mixed into a later step.
#pragma once
#include <deque>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "backend.h"
#include "buffer_pool.h"
#include "entry.h"
#include "stats.h"

namespace shoal {

class NeighborExchange {
 public:
  static constexpr int kTag = 17;

  NeighborExchange(Backend* backend, int64_t fusion_threshold, Stats* stats)
      : backend_(backend), threshold_(fusion_threshold), stats_(stats) {}

  // Sends each entry's (weighted) tensor to its send ranks; it then awaits its sources.
  void Start(const std::vector<EntryPtr>& ready);
  // Moves arrived messages into the stash; true if any arrived.
  bool Receive(Status* st);
  // Entries whose sources have all arrived, combined, with their status.
  std::vector<std::pair<EntryPtr, Status>> Complete();
  // Waiting entries and the sources they still miss.
  std::vector<std::pair<EntryPtr, std::vector<int>>> Waiting() const;
  // Forget a waiting entry (failed elsewhere: stall, shutdown).
  void Drop(const EntryPtr& e);
  std::vector<EntryPtr> TakeAll();
  bool Idle() const { return waiting_.empty(); }
  // (source, name) of stashed pieces older than `age` s that no waiting entry wants,
  // each reported once.
  std::vector<std::pair<int, std::string>> Unmatched(Clock::time_point now, double age);

 private:
  struct Piece {
    Bytes msg;
    size_t offset = 0;
    size_t nbytes = 0;
    int64_t step = 0;
    Signature sig;
    Clock::time_point arrived = Clock::now();
    bool reported = false;
  };
  Status Finish(Entry& e, std::vector<Piece>& got);
  void Flush(int dst, std::vector<std::pair<EntryPtr, double>>& items);

  Backend* backend_;
  std::shared_ptr<BufferPool> pool_ = BufferPool::Create();
  int64_t threshold_;
  Stats* stats_;
  std::vector<EntryPtr> waiting_;
  std::map<std::pair<int, std::string>, std::deque<Piece>> stash_;
};

}  // namespace shoal
