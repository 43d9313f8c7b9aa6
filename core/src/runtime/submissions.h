// The ops this rank's threads submitted, from the call to their handle's release: each op's
// name and step (negotiation/names.h, and the vote that retires idle names), the queue the
// progress driver takes each cycle, and the handles user threads poll and wait on, with
// what a binding attached to each (shoal_attach: the one registry of a handle's objects).
// Any thread. Its own mutex; under it, it calls out only to code that takes no lock
// (HierarchicalStages::Start, the proposal's `busy` test). The runtime's mutex, where both
// are held, is taken first (docs/design.md, "Core layout").
#pragma once
#include <atomic>
#include <functional>
#include <set>
#include <utility>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/thread_annotations.h"
#include "negotiation/coordinator.h"
#include "negotiation/names.h"
#include "ops/stages.h"
#include "process_sets/process_sets.h"
#include "runtime/entry.h"

namespace shoal {

class Submissions {
 public:
  // `stages`: how a hierarchical op becomes its first stage when it is queued.
  Submissions(size_t name_limit, const HierarchicalStages* stages) : stages_(stages), names_(name_limit) {}

  // Queues `e` (checked: runtime/describe.cc) as this rank's call named `name` (null: a
  // generated name) of its op, negotiated in set `negotiated` (ProcessSets::NegotiatedIn):
  // its name, step and handle; held instead while a vote froze its name. Throws
  // ArgumentError for a name in flight here. Returns the handle.
  int64_t Add(const EntryPtr& e, const char* name, int negotiated, shoal_callback cb, void* cb_arg) EXCLUDES(mu_);
  // The members of grouped op `gop` (ops/groups.h) named `name`, in process set `set`, queued
  // as Add does under the group's name and step: their handles, in order.
  std::vector<int64_t> AddGroup(const std::vector<EntryPtr>& members, int gop, const char* name, int set,
                                int negotiated, shoal_callback cb, void* const* cb_args) EXCLUDES(mu_);
  // An op of the runtime's own (a process-set change): a handle, queued (no name of its own).
  int64_t AddOwn(const EntryPtr& e) EXCLUDES(mu_);
  // A stage of a multi-stage op: its name's next step, a handle, queued.
  void AddStage(const EntryPtr& e) EXCLUDES(mu_);

  // A call refused on this rank: uses up the next step of op `op` named `name` (null:
  // generated, as Add) in its set (`pset`, null: every rank; `scope`: which coordinator hears
  // of it) with a refusal the peers that submit it hear of (code, error); a hierarchical op's
  // stages each get it. False if an op of that name is in flight here (the call is refused as
  // a duplicate instead, and is not this step's).
  bool Refuse(int op, const char* name, int negotiated, int code, const std::string& error, const ProcessSetPtr& pset,
              int scope) EXCLUDES(mu_);
  // The same for a name already made (a later stage of a failed multi-stage op).
  bool RefuseNamed(int op, const std::string& name, int code, const std::string& error, int scope) EXCLUDES(mu_);

  // Driver: the queue, taken into `fresh` (emptied first; both keep their capacity).
  void Take(std::vector<EntryPtr>* fresh) EXCLUDES(mu_);
  size_t Queued() const { return queued_; }  // without the mutex (a hint for the driver)
  // `e` completed with `st`: its name is free again. False if it had completed already.
  bool Complete(const EntryPtr& e, const Status& st) EXCLUDES(mu_);
  // Every op not completed (the queue emptied): the runtime fails them.
  std::vector<EntryPtr> TakeUnfinished() EXCLUDES(mu_);

  // A binding's data kept with a handle (shoal_attach): `drop(data)` runs once, when the
  // handle is released or this table ends, never under a lock of the core (it may run the
  // binding's code, which may call the C ABI).
  class Attached {
   public:
    Attached() = default;
    Attached(void* data, void (*drop)(void*)) : data_(data), drop_(drop) {}
    Attached(Attached&& o) noexcept : data_(o.data_), drop_(o.drop_) { o.drop_ = nullptr; }
    Attached& operator=(Attached&& o) noexcept {
      std::swap(data_, o.data_);
      std::swap(drop_, o.drop_);
      return *this;
    }
    ~Attached() {
      if (drop_) drop_(data_);
    }
    void* data() const { return data_; }
    void Disown() { drop_ = nullptr; }  // never dropped: its owner keeps it

   private:
    void* data_ = nullptr;
    void (*drop_)(void*) = nullptr;
  };

  // Handles (the C ABI's), numbered once per process: the next one (shoal_next_handle).
  static int64_t NextHandle();
  EntryPtr Find(int64_t handle) EXCLUDES(mu_);
  // Attaches `a` to `handle` (what was attached before is dropped); false, with `a` kept
  // by the caller, for an unknown handle.
  bool Attach(int64_t handle, Attached* a) EXCLUDES(mu_);
  void* AttachedTo(int64_t handle) EXCLUDES(mu_);  // null: none, or an unknown handle
  // Takes back what is attached to `handle` (null if none): never dropped, the caller owns it.
  void* Detach(int64_t handle) EXCLUDES(mu_);
  int Poll(int64_t handle) EXCLUDES(mu_);   // 1 done, 0 not, -SHOAL_UNKNOWN_HANDLE
  int InUse(int64_t handle) EXCLUDES(mu_);  // 1 while the op's tensors may still be read or written (shoal_in_use)
  bool Release(int64_t handle) EXCLUDES(mu_);
  size_t HandleCount() EXCLUDES(mu_);
  int InFlightIn(int set) EXCLUDES(mu_);  // ops of process set `set` not completed

  // Names.
  // A call of `name` this rank makes without submitting it (a joined rank's): its step.
  int64_t CountCall(const std::string& name, int op) EXCLUDES(mu_);
  // Every call went to the driver: none queued, none held for a vote.
  bool Idle() EXCLUDES(mu_);
  // This rank's call of `key` at `step` has left the queue (it will not meet a refusal of it at routing).
  bool Routed(const std::string& key, int64_t step) EXCLUDES(mu_);
  void Propose(const Entry& e, const std::function<bool(const std::string&)>& busy, Request* req) EXCLUDES(mu_);
  bool Vote(const Response& r, Request* vote) EXCLUDES(mu_);  // NameTable::Vote
  // The vote's outcome for `set` (NameTable::Thaw): the held calls are queued.
  NameTable::Thawed Thaw(int set, const std::set<std::string>& gone) EXCLUDES(mu_);
  std::vector<int> VotingSets() EXCLUDES(mu_);  // sets with a vote in flight
  bool Voting(int set) EXCLUDES(mu_);
  bool Voting() EXCLUDES(mu_);
  void Forget(int set) EXCLUDES(mu_);  // a removed process set's names
  size_t NameCount() EXCLUDES(mu_);

 private:
  void Register(const EntryPtr& e, shoal_callback cb, void* cb_arg) REQUIRES(mu_);
  void Push(const EntryPtr& e) REQUIRES(mu_);  // onto the queue; a hierarchical op as its first stage
  void Stage(const EntryPtr& e) REQUIRES(mu_);
  bool RefuseLocked(int op, const std::string& name, int code, const std::string& error, const ProcessSetPtr& pset,
                    int scope) REQUIRES(mu_);

  const HierarchicalStages* stages_;
  Mutex mu_;
  NameTable names_ GUARDED_BY(mu_);
  std::vector<EntryPtr> queue_ GUARDED_BY(mu_);
  std::atomic<size_t> queued_{0};
  struct Handle {
    EntryPtr entry;
    Attached attached;
  };
  std::unordered_map<int64_t, Handle> handles_ GUARDED_BY(mu_);
};

}  // namespace shoal
