// Process sets (Horovod's `hvd.add_process_set`; docs/design.md §14): sub-communicators
// over some of the ranks, first-class in the core.
//
// Every rank adds and removes sets with the same arguments, in the same order; they agree
// through one global exchange (an allgather of each rank's call, process_sets/process_sets.cc), so any
// disagreement is the same error everywhere, and the set's id is that exchange's step.
// Then the members make the set's communicators together (Backend::AddSet) on their
// progress drivers. A collective in a set negotiates with the set's own coordinator, at
// the set's first rank, on messages of its own (Request/Response::set); its names are
// scoped by the set; its cached batches use the set's own channels; it runs on the set's
// communicator. So ops in disjoint sets never wait for each other, and a rank that leaves
// fails only the ops of the sets it is in.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace shoal {

struct ProcessSet {
  int32_t id = 0;
  std::vector<int> ranks;  // world ranks, ascending
  int index = -1;          // this rank's place in `ranks`; -1: not a member

  int size() const { return static_cast<int>(ranks.size()); }
  int leader() const { return ranks.front(); }  // runs the set's coordinator
  int IndexOf(int world_rank) const;            // -1 for a rank outside the set
  bool Has(int world_rank) const { return IndexOf(world_rank) >= 0; }
  std::string Describe() const;                 // "process set 1 (ranks [0, 2])"
};
using ProcessSetPtr = std::shared_ptr<const ProcessSet>;
struct SetVote;  // one rank's add/remove call (process_sets/process_sets.cc)

// The key of op name `name` in process set `set` in the runtime's per-name tables: names are
// scoped per set. The name itself in the global set (user names have no NUL character).
inline std::string SetKey(int set, const std::string& name) {
  return set == 0 ? name : name + '\0' + std::to_string(set);
}

// Whether per-name table key `key` is of process set `set`, and its name there.
bool KeyInSet(const std::string& key, int set, std::string* name);

// The global exchange through which every rank's add/remove calls agree (one name, one step
// per call: a rank's k-th call pairs with every other rank's k-th).
constexpr const char* kSetsAgreement = "shoal.process_sets";

}  // namespace shoal
