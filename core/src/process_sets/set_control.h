// Horovod's add_process_set and remove_process_set (process_sets.h has the table and the
// agreement's rules): every rank's calls agree through one global allgather, then the
// members make or drop the set on their progress drivers (docs/design.md §14, §17).
#pragma once
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "engines/backend.h"
#include "process_sets/process_sets.h"
#include "runtime/entry.h"

namespace shoal {

class Submissions;

class SetControl {
 public:
  // What the calls need of the runtime that runs them.
  class Host {
   public:
    // Queues op `d` and waits for it (a user thread): its status, and its entry in `*e`.
    virtual Status RunOp(const shoal_op_desc& d, EntryPtr* e) = 0;
    // Queues `e`, an op of the runtime's own that its driver hands to Run, and waits for it
    // (a user thread); SHOAL_ABORTED at once if the runtime stops or left.
    virtual Status RunOnDriver(const EntryPtr& e) = 0;
    virtual void Finish(const EntryPtr& e, const Status& st) = 0;
    // Driver: set `s` is being removed: what the runtime keeps of it (cached batches, a vote
    // on retiring its names) goes, and ops waiting for its coordinator fail.
    virtual void EndSet(const ProcessSet& s) = 0;
    virtual void ForgetSet(int set) = 0;  // driver, once removed: its names (takes the runtime's mutex)

   protected:
    ~Host() = default;
  };

  // `fusion_threshold`: the coordinators' of the sets this rank leads.
  SetControl(Host* host, Submissions* submissions, Backend* backend, ProcessSets* sets, int64_t fusion_threshold)
      : host_(host), submissions_(submissions), backend_(backend), sets_(sets), fusion_threshold_(fusion_threshold) {}

  // User threads, every rank in the same order (semantics: shoal_add_process_set). Blocking.
  // `refusal`: this rank refuses the call (bad arguments above the core): every rank raises it.
  // Throw ArgumentError, the same on every rank.
  int32_t Add(const std::vector<int>& ranks, const std::string& refusal = "");
  void Remove(int32_t id, const std::string& refusal = "");
  // Driver: runs the step of op `e` (kOpSetControl) that Add or Remove queued, then finishes it.
  void Run(const EntryPtr& e);

 private:
  // The allgather through which every rank's add/remove calls agree: every rank's vote.
  // Numbers `mine` (this rank's next call; `what` names it), judges the calls alike on every
  // rank (throws ArgumentError), and gives the highest call number in `top`.
  std::vector<SetVote> Agree(SetVote& mine, std::string* what, int64_t* top);
  Status OnDriver(std::function<Status()> job);  // runs `job` on the progress driver; waits
  Status MakeSet(int32_t id, const std::vector<int>& ranks);  // driver
  void DropSet(int32_t id);                                   // driver

  Host* host_;
  Submissions* submissions_;  // ops of a set still in flight here
  Backend* backend_;
  ProcessSets* sets_;
  int64_t fusion_threshold_;
  std::mutex jobs_mu_;
  std::map<const Entry*, std::function<Status()>> jobs_;  // jobs_mu_: OnDriver's, by its op, until it runs
};

}  // namespace shoal
