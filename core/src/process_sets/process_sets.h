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
//
// Each machine's ranks form one more such group (docs/design.md §19): its machine-local
// ops (machine scope) negotiate with a coordinator at the machine's first rank, so each
// machine completes them on its own. Its id is negative (-1 - that rank); its ops keep the
// global set's names and run on the machine's communicator (machine scope), so it has no
// communicators, names or cached batches of its own.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/common.h"
#include "common/thread_annotations.h"
#include "negotiation/coordinator.h"

namespace shoal {

struct ProcessSet {
  int32_t id = 0;
  std::vector<int> ranks;  // world ranks, ascending
  int index = -1;          // this rank's place in `ranks`; -1: not a member

  int size() const { return static_cast<int>(ranks.size()); }
  int leader() const { return ranks.front(); }  // runs the set's coordinator
  int IndexOf(int world_rank) const;            // -1 for a rank outside the set
  bool Has(int world_rank) const { return IndexOf(world_rank) >= 0; }
  std::string Describe() const;                 // "process set 1 (ranks [0, 2])", "machine of ranks [2, 3]"
};
using ProcessSetPtr = std::shared_ptr<const ProcessSet>;
// One rank's add/remove call, as every rank sees it once they agree.
struct SetVote {
  static constexpr int32_t kAdd = 1, kRemove = 2;
  int32_t kind = 0;
  int32_t code = 0;         // a refusal's status code (0: none)
  std::string refusal;
  std::vector<int> ranks;   // add: the ranks asked for, ascending (duplicates kept, to be reported)
  int32_t id = 0;           // remove: the set
  int32_t busy = 0;         // remove: ops of that set in flight on the rank
  int64_t calls = 0;        // the rank's earlier agreements: the next id is above every rank's

  template <typename IO, typename V> static void Fields(IO& io, V& v) {
    io.Field(v.kind);
    io.Field(v.code);
    io.Field(v.refusal);
    io.Field(v.ranks);
    io.Field(v.id);
    io.Field(v.busy);
    io.Field(v.calls);
  }
  std::string Call() const;  // "add_process_set([0, 2])"
};

ByteVec EncodeVote(const SetVote& v);
std::vector<SetVote> DecodeVotes(const char* data, size_t size);  // every rank's, in rank order
// The first refusal, then calls that differ: the same ArgumentError on every rank (all see
// the same votes).
void JudgeSetCalls(const std::vector<SetVote>& votes);
extern const char* const kSetRule;  // what every rank must do, for messages

// The key of op name `name` in process set `set` in the runtime's per-name tables: names are
// scoped per set. The name itself in the global set (user names have no NUL character).
inline std::string SetKey(int set, const std::string& name) {
  return set <= 0 ? name : name + '\0' + std::to_string(set);  // a machine's ops keep the global names
}

// The process sets other than the global one, by id, with the coordinator of each set this
// rank leads, and this rank's machine group. Written only on the progress driver (sets are
// made and dropped there), under the table's mutex; read by the driver without it and by
// other threads with it.
class ProcessSets {
 public:
  // At start-up, before the progress driver runs: the machine group of this rank, whose
  // world ranks are `machine` (by local rank); none when they are every rank of the job.
  // `fusion_threshold`: its coordinator's (at the machine's first rank).
  void SetMachine(const std::vector<int>& machine, int world_rank, int world_size, int64_t fusion_threshold);

  // Any thread. The user's sets (Horovod's), not the machine group.
  ProcessSetPtr Find(int32_t id) const;
  bool Empty() const;
  ProcessSetPtr WithRanks(const std::vector<int>& ranks) const;  // a set of exactly these ranks

  // Driver only (and the machine group's: any thread).
  // The set whose coordinator negotiates an op of process set `set` and scope `scope`
  // (shoal_scope): the machine group for machine scope, else `set`.
  int32_t NegotiatedIn(int set, int scope) const {
    return scope == SHOAL_SCOPE_MACHINE && machine_.info ? machine_.info->id : set;
  }
  const ProcessSet* Of(int set) const;        // null for the global set (0) and unknown ids
  Coordinator* CoordinatorOf(int set) const;  // of a set (not 0) this rank leads, else null
  bool Leader() const { return leader_; }     // this rank coordinates some set
  void Add(ProcessSetPtr set, std::unique_ptr<Coordinator> coordinator);
  void Remove(int32_t id);
  template <typename F> void ForEach(F&& f) const {  // f(const ProcessSet&, Coordinator* or null)
    if (machine_.info) f(*machine_.info, machine_.coordinator.get());
    for (auto& kv : Driven()) f(*kv.second.info, kv.second.coordinator.get());
  }

  // Add/remove calls agree one at a time per rank (the returned lock), numbered so that
  // every rank's next agreement is above every rank's last (its id: that number).
  ReturnedLock BeginAgreement() { return ReturnedLock(agreement_mu_); }
  int64_t NextCall() {
    agreement_mu_.AssertHeld();  // BeginAgreement's
    return calls_++;
  }
  void Agreed(int64_t top) {
    agreement_mu_.AssertHeld();
    calls_ = top + 1;
  }

 private:
  struct State {
    ProcessSetPtr info;
    std::unique_ptr<Coordinator> coordinator;  // at the set's leader only
  };
  // The driver writes sets_ (with mu_), so it reads it without; other threads take mu_.
  const std::map<int, State>& Driven() const NO_THREAD_SAFETY_ANALYSIS { return sets_; }
  mutable Mutex mu_;
  std::map<int, State> sets_ GUARDED_BY(mu_);
  State machine_;  // this rank's machine group (none on one machine); set before the driver runs
  bool leader_ = false;
  Mutex agreement_mu_;
  int64_t calls_ GUARDED_BY(agreement_mu_) = 0;  // add/remove agreements so far
};

// Whether per-name table key `key` is of process set `set`, and its name there.
bool KeyInSet(const std::string& key, int set, std::string* name);

// The global exchange through which every rank's add/remove calls agree (one name, one step
// per call: a rank's k-th call pairs with every other rank's k-th).
constexpr const char* kSetsAgreement = "shoal.process_sets";

}  // namespace shoal
