// Multi-stage ops: hierarchical_neighbor_allreduce as one op of the core (BlueFog's
// semantics; how: stages.cc). This class makes an op's stages and moves it from one to the
// next; each op's stages still to run travel with the stage in flight (Entry::stages).
// Start runs with the runtime's mutex held (the op is queued), Next on the thread that
// finished a stage, without it (docs/design.md §17).
#pragma once
#include <string>
#include <vector>

#include "engines/backend.h"
#include "runtime/entry.h"

namespace shoal {

class HierarchicalStages {
 public:
  // What the stages need of the runtime that queues them.
  class Host {
   public:
    // Stage `done` is over: its handle retired, then (under the runtime's mutex, at once)
    // `next` queued as an op of the runtime's own; or, with no `next`, if `failed` is an
    // error and the runtime still runs, each of `later` refused with it (its code and
    // message), so the ranks waiting in those stages fail too.
    virtual void AfterStage(const EntryPtr& done, const EntryPtr& next, const Status& failed,
                            const std::vector<EntryPtr>& later) = 0;
    virtual void Finish(const EntryPtr& e, const Status& st) = 0;

   protected:
    ~Host() = default;
  };

  // `world`: this rank's place (machines of local_size ranks), the backend's.
  HierarchicalStages(Host* host, const WorldInfo& world) : host_(host), world_(world) {}

  // The stages of op `e` (named, on its handle): the first, which carries the rest.
  EntryPtr Start(const EntryPtr& e) const;
  // Stage `s` finished with `st`: the next stage is queued, or the op finishes (its result
  // divided by local_size, BlueFog's average over the machine).
  void Next(const EntryPtr& s, const Status& st);

 private:
  static Status DivideResult(const Entry& e, int divisor);  // e's output by `divisor`, in place

  Host* host_;
  const WorldInfo& world_;
};

}  // namespace shoal
