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

class GroupedOps {
 public:
  // What the grouped ops need of the runtime that runs them (driver only, mu_ not held).
  class Host {
   public:
    // Why a call of `op` named `name` (per-name key `key`, step `step`) negotiated in set
    // `set` cannot run: a refusal of it on another rank, or a rank of `set` that left; ok
    // if it can run.
    virtual Status Unrunnable(const std::string& key, int64_t step, int set, int op, const std::string& name) = 0;
    // `first`, for its group `key`, waits for its coordinator's response (the runtime's Apply).
    virtual void Await(const std::string& key, const EntryPtr& first) = 0;
    virtual void Finish(const EntryPtr& e, const Status& st) = 0;
    virtual void RunCollective(const Response& r, std::vector<EntryPtr> batch) = 0;

   protected:
    ~Host() = default;
  };

  GroupedOps(Host* host, const ProcessSets* sets) : host_(host), sets_(sets) {}

  // Member `e` is ready: once every member of its group is, the group's one request goes
  // into `to_coordinator` (or, refused elsewhere or missing a rank that left, every member fails).
  void Route(const EntryPtr& e, std::vector<Request>* to_coordinator);
  // `e`, which waited for a response: all its group's members into `out` (itself if not a group's).
  void Expand(const EntryPtr& e, std::vector<EntryPtr>* out);
  // The coordinator's response `r` to a group: runs `members` in the batches its chunks name.
  void Run(const Response& r, std::vector<EntryPtr> members);
  void Clear() { groups_.clear(); }  // the runtime failed: its ops are failed elsewhere

 private:
  Host* host_;
  const ProcessSets* sets_;  // which set negotiates a group (read on the driver)
  std::map<std::string, std::vector<EntryPtr>> groups_;  // by the group's key: its members, by index
};

}  // namespace shoal
