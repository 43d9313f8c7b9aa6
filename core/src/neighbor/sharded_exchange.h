// The exchange of hierarchical_neighbor_allreduce on host memory, sharded over the
// machine's ranks and pipelined in pieces (docs/design.md §24). Local rank l of machine m
// owns shard l of the tensor: its machine's other ranks send it their slices of shard l,
// which it sums (the machine's sum); it exchanges that sum with local rank l of its
// neighbor machines and combines (BlueFog's weights, then / local_size); it sends the
// result to its machine's other ranks. Every rank of a machine carries a share of the
// machine's traffic, and each piece moves on as soon as the phase before it is done, so
// the three phases overlap. Each move is a part: an entry of the neighbor exchange named
// after the stage and the piece ("<stage>/s<k>.<l>", "/x<k>", "/g<k>.<l>"), matched by
// name and step like any neighbor data; its signature keeps the whole tensor's shape, so
// ranks holding different shapes fail as a neighbor_allreduce does.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engines/backend.h"
#include "neighbor/neighbor_exchange.h"
#include "runtime/entry.h"

namespace shoal {

class ShardedExchange {
 public:
  static constexpr size_t kPieceBytes = 2 << 20;  // a piece's target size
  static constexpr int kMaxPieces = 32;           // per shard

  ShardedExchange(const WorldInfo& world, NeighborExchange* neighbors) : world_(world), neighbors_(neighbors) {}

  // Whether stage `e` runs here: a hierarchical op's exchange stage on host memory.
  static bool Applies(const Entry& e) {
    return e.stages && e.sig.op == SHOAL_OP_NEIGHBOR_ALLREDUCE && e.sig.device_type != SHOAL_DEVICE_CUDA;
  }
  // Starts stage `e`: its first parts go to `start`. False when it has nothing to move
  // (an empty tensor): the stage is then done.
  bool Start(const EntryPtr& e, std::vector<EntryPtr>* start);
  // Part `p` ended with `st`; the parts that waited for it go to `start`. Returns the
  // stage, with *stage_st, once every part has ended, or at once when `st` is a failure:
  // the run stops there (its other parts leave the neighbor exchange, its peers' pieces of
  // that step are dropped as they come) and the caller refuses the stage's step for
  // every rank, so no peer waits for a piece that never comes and none uses one that is
  // not the op's. Else null.
  EntryPtr Done(const EntryPtr& p, const Status& st, std::vector<EntryPtr>* start, Status* stage_st);
  // Stops the run of stage `name` at `step` (refused elsewhere), as a failure does.
  // Returns its stage (null if none runs).
  EntryPtr Take(const std::string& name, int64_t step);
  // The stage whose running part is named `part` at `step` (null if none).
  const Entry* StageOf(const std::string& part, int64_t step) const;
  void Clear();  // forgets every run (the runtime abandoned its ops)

 private:
  struct Key {
    std::string name;
    int64_t step;
    bool operator<(const Key& o) const { return step != o.step ? step < o.step : name < o.name; }
  };
  EntryPtr Part(const std::shared_ptr<ShardedRun>& run, const std::string& suffix, int64_t offset, int64_t count);
  void Launch(ShardedRun& run, int part, std::vector<EntryPtr>* start);
  // Ends `run` (`failed`: the part whose failure ends it, or -1): its stage.
  EntryPtr Stop(std::shared_ptr<ShardedRun> run, int failed = -1);

  const WorldInfo& world_;
  NeighborExchange* neighbors_;
  std::map<Key, std::shared_ptr<ShardedRun>> runs_;
};

}  // namespace shoal
