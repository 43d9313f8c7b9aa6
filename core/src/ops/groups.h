// Grouped ops (Horovod's grouped_allreduce, grouped_allgather, grouped_reducescatter): a
// list of ops negotiated as one unit (how: groups.cc). This class holds the members of each
// group from their routing until its coordinator's response. Driver only (docs/design.md §17).
#pragma once
#include <map>
#include <string>
#include <vector>

#include "common/config.h"
#include "negotiation/coordinator.h"
#include "process_sets/process_sets.h"
#include "runtime/entry.h"

namespace shoal {

class CollectiveOps;
class Negotiation;

class GroupedOps {
 public:
  // `negotiation`: where a group waits for its response, and hears of refusals; `collectives`:
  // what runs its chunks.
  GroupedOps(Finisher* host, const ProcessSets* sets, Negotiation* negotiation, CollectiveOps* collectives)
      : host_(host), sets_(sets), negotiation_(negotiation), collectives_(collectives) {}

  // Member `e` is ready: once every member of its group is, the group's one request goes
  // into `to_coordinator` (or, refused elsewhere or missing a rank that left, every member fails).
  void Route(const EntryPtr& e, std::vector<Request>* to_coordinator);
  // `e`, which waited for a response: all its group's members into `out` (itself if not a group's).
  void Expand(const EntryPtr& e, std::vector<EntryPtr>* out);
  // The coordinator's response `r` to a group: runs `members` in the batches its chunks name.
  void Run(const Response& r, std::vector<EntryPtr> members);
  void Clear() { groups_.clear(); }  // the runtime failed: its ops are failed elsewhere

 private:
  Finisher* host_;
  const ProcessSets* sets_;  // which set negotiates a group (read on the driver)
  Negotiation* negotiation_;
  CollectiveOps* collectives_;
  std::map<std::string, std::vector<EntryPtr>> groups_;  // by the group's key: its members, by index
};

}  // namespace shoal
