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
#include <map>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engines/backend.h"
#include "common/buffer_pool.h"
#include "neighbor/device_plane.h"
#include "runtime/entry.h"
#include "common/stats.h"
#include "negotiation/wire.h"

namespace shoal {

class NeighborExchange {
 public:
  static constexpr int kTag = 17;      // headers, with the data of small tensors
  static constexpr int kDataTag = 18;  // data of large tensors, sent from their memory
  static constexpr size_t kDirectBytes = 64 << 10;

  // `trace`: record the timeline's phase times in each entry.
  // `device` moves the data of CUDA tensors whose path is NCCL or CUDA-aware MPI.
  NeighborExchange(Backend* backend, DevicePlane* device, int64_t fusion_threshold, Stats* stats, bool trace)
      : backend_(backend), device_(device), threshold_(fusion_threshold), stats_(stats), trace_(trace) {}

  // Sends each entry's (weighted) tensor to its send ranks; it then awaits its sources.
  void Start(const std::vector<EntryPtr>& ready);
  // Stashes the pieces of one arrived message (tag kTag) from `src`.
  void Accept(int src, Bytes msg);
  // Entries whose sources have all arrived, combined, with their status.
  std::vector<std::pair<EntryPtr, Status>> Complete();
  // Waiting entries and the sources they still miss.
  std::vector<std::pair<EntryPtr, std::vector<int>>> Waiting() const;
  // Forget a waiting entry (failed elsewhere: stall, shutdown).
  void Drop(const EntryPtr& e);
  // Takes the waiting entries that can no longer complete because `rank` left the job:
  // they miss its data, or it will never take theirs (a large send).
  std::vector<EntryPtr> TakeNeeding(int rank);
  // A piece of `name` from `src` has arrived (or its data is on the way).
  bool HasPiece(int src, const std::string& name) const {
    auto s = stash_.find(Key{src, name});
    return s != stash_.end() && !s->second.empty();
  }
  // Step `step` of `name` failed on this rank: its pieces, stashed or still to come, are
  // dropped, so the name's next step takes that step's data (docs/design.md §18). Pieces
  // in device memory stay (their transfers are the device plane's).
  void Failed(const std::string& name, int64_t step);
  // Name `name` retired (its steps start again at 0): forget its failed steps and its
  // stashed pieces, and those of its parts ("<name>/...", a sharded exchange's).
  void Forget(const std::string& name);
  // Takes the waiting entries of `name` at `step` (-1: any step).
  std::vector<EntryPtr> TakeNamed(const std::string& name, int64_t step);
  // The message a leaving rank sends each peer on kTag: after all its neighbor data, so a
  // receiver has every piece the leaver sent when it learns that it left.
  // `generation` tells runtimes apart across shutdown/init: MPI may give a new
  // communicator the context id of a freed one, so a late notice can reach the next runtime.
  static Bytes LeaveNotice(uint64_t generation);
  static bool IsLeaveNotice(const ByteVec& msg, uint64_t* generation);
  std::vector<EntryPtr> TakeAll();
  bool Idle() const { return waiting_.empty(); }
  // (source, name) of stashed pieces older than `age` s that no waiting entry wants,
  // each reported once.
  std::vector<std::pair<int, std::string>> Unmatched(Clock::time_point now, double age);
  // Sends this rank did not expect, found while an entry of their name waits here at their
  // step or later (docs/design.md §18): each one's error, once, for every rank of that step.
  // Scans at most every 50 ms: a dispute is the rare case, the scan costs O(stash x waiting).
  struct Dispute {
    std::string name;
    Signature sig;
    int64_t step;
    std::string error;
  };
  std::vector<Dispute> Disputes(Clock::time_point now);

 private:
  struct Piece {
    std::shared_ptr<Arrival> arrival;  // null: the data is in `msg` already (else kDataTag or device)
    bool Arrived() const { return !arrival || arrival->done; }
    Bytes msg;
    size_t offset = 0;
    size_t nbytes = 0;
    int64_t step = 0;
    Signature sig;
    Clock::time_point arrived = Clock::now();
    bool reported = false;
    bool disputed = false;
  };
  Status Finish(const EntryPtr& e, std::vector<Piece>& got, bool* deferred);
  // A sharded exchange's part `e` and its queue `q` from one source, whose first piece is
  // of another step: drops those of earlier steps; true if one of e's step is first now.
  bool OwnStep(const Entry& e, std::vector<Piece>& q);
  void Flush(int dst, std::vector<std::pair<EntryPtr, double>>& items);
  void FlushDevice(int dst, int path, std::vector<std::pair<EntryPtr, double>>& items);
  size_t MessageEnd(const std::vector<std::pair<EntryPtr, double>>& items, size_t i, size_t* payload) const;
  static Writer Headers(const std::vector<std::pair<EntryPtr, double>>& items, size_t i, size_t j, uint8_t how);

  struct Header {  // of one piece of an arrived message
    std::string name;
    Signature sig;
    int64_t step = 0;
    uint64_t nbytes = 0;
    uint8_t how = 0;  // 0: data in the message, 1: on kDataTag, else the DataPath of a device piece
  };

  Backend* backend_;
  DevicePlane* device_;
  std::shared_ptr<BufferPool> pool_ = BufferPool::Create();
  int64_t threshold_;
  Stats* stats_;
  bool trace_;
  std::vector<EntryPtr> waiting_;
  // Scratch, kept to spare allocations per op.
  std::vector<std::tuple<int, EntryPtr, double>> sends_;
  std::vector<std::pair<EntryPtr, double>> items_;
  std::vector<Header> headers_;
  std::vector<Piece> got_;
  std::vector<const void*> srcs_;
  // Pieces by (source, name), oldest first. Emptied keys stay (no allocation per message
  // in steady state) until there are many of them.
  using Key = std::pair<int, std::string_view>;  // lookups without copying the name
  struct KeyLess {
    using is_transparent = void;
    template <typename A, typename B> bool operator()(const A& a, const B& b) const {
      return a.first != b.first ? a.first < b.first : std::string_view(a.second) < std::string_view(b.second);
    }
  };
  std::map<std::pair<int, std::string>, std::vector<Piece>, KeyLess> stash_;
  size_t empty_keys_ = 0;
  Clock::time_point last_scan_{};
  std::unordered_map<std::string, int64_t> failed_;  // name -> its last step that failed here
};

}  // namespace shoal
