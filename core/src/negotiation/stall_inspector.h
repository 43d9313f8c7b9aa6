// Stalls: ops that some ranks submitted and others did not. Every 200 ms the inspector
// looks at each coordinator here (the global one, the process sets' leaders) and at the
// neighbor ops waiting for data; it warns once per name after SHOAL_STALL_CHECK_TIME, naming
// the late ranks, and fails the op on every rank after SHOAL_STALL_SHUTDOWN_TIME. Ops waiting
// for a coordinator are not given up locally: a coordinator that never answers is a dead
// rank 0, which the launcher handles; giving up here would make this rank skip a collective
// that the others then run. Driver only.
#pragma once
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "common/config.h"
#include "common/stats.h"
#include "negotiation/coordinator.h"
#include "neighbor/neighbor_exchange.h"
#include "process_sets/process_sets.h"

namespace shoal {

class StallInspector {
 public:
  StallInspector(const Config& cfg, Stats* stats);
  // Whether a check is due now (enabled, and 200 ms since the last).
  bool Due(Clock::time_point now);
  // The responses that fail `c`'s stalled names on every rank of `set` (null: every rank);
  // `now`: seconds on the coordinator's clock.
  std::vector<Response> Check(Coordinator& c, const ProcessSet* set, double now);
  // Neighbor ops of `n` that waited for peers past the shutdown time since they started
  // there: dropped from `n`, with their errors.
  std::vector<std::pair<EntryPtr, Status>> Check(NeighborExchange& n, Clock::time_point now);
  // A name answered or retired: a later stall of it is reported again.
  void Forget(const std::string& key) { warned_.erase(key); }
  void ForgetSet(int set);

 private:
  double warn_, kill_;
  Stats* stats_;
  std::set<std::string> warned_;  // names (SetKey) already reported
  Clock::time_point last_ = Clock::now();
};

}  // namespace shoal
