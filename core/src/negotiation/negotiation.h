// Negotiation with the coordinators (docs/design.md §5): rank 0 coordinates the ops of every
// rank, each process set's first rank (and each machine's, for machine-scope ops) those of
// its set. This class owns what the runtime keeps of it: rank 0's coordinator, the ops that
// wait for a response, requests due next cycle, and refusals heard from other ranks before
// this rank made that call. It sends requests, answers for the coordinators this rank runs,
// and hands each response to the runtime (Host::Apply). Driver only.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/stats.h"
#include "engines/backend.h"
#include "negotiation/coordinator.h"
#include "negotiation/stall_inspector.h"
#include "process_sets/process_sets.h"
#include "runtime/departures.h"
#include "runtime/entry.h"

namespace shoal {

class GroupedOps;

class Negotiation {
 public:
  static constexpr int kRequestTag = 1, kResponseTag = 2;  // to and from a coordinator

  class Host {
   public:
    virtual void Apply(const Response& r) = 0;  // a coordinator's response, as every rank of its set runs it
    virtual void Finish(const EntryPtr& e, const Status& st) = 0;
    virtual void FailAll(const std::string& why, int code) = 0;  // the job's coordinator is unreachable

   protected:
    ~Host() = default;
  };

  // `groups`: where a waiting group's members are (FailAwaiting fails all of them).
  Negotiation(Host* host, Backend* backend, ProcessSets* sets, const Departures* departures, GroupedOps* groups,
              Stats* stats, int64_t fusion_threshold);

  // The sets as negotiation sees them (set 0: every rank; negative: a machine's ranks).
  bool Coordinates() const { return coordinator_ != nullptr; }  // rank 0
  Coordinator* CoordinatorOf(int set);                          // null if this rank does not coordinate `set`
  const ProcessSet* SetOf(int set) const;                       // null for set 0 and unknown sets
  int IndexIn(int set, int world_rank) const;                   // -1 outside the set
  int SetSize(int set) const;
  bool Lost(int set) const;  // a member of `set` left the job

  // Requests. `e` waits for the response to its per-name key `key` (a group: its first member).
  void Await(const std::string& key, const EntryPtr& e) { awaiting_[key] = e; }
  // The op waiting for a response to `key` at step `step` (any step if < 0), taken; null if none.
  EntryPtr Take(const std::string& key, int64_t step);
  bool Waiting() const { return !awaiting_.empty(); }
  void SendLater(Request req) { late_.push_back(std::move(req)); }  // with the next cycle's requests
  void TakeLater(std::vector<Request>* to) {
    to->insert(to->end(), late_.begin(), late_.end());
    late_.clear();
  }
  // Adds `req` to its coordinator if this rank runs it; false if it must be sent.
  bool AddHere(const Request& req);
  void Send(std::vector<Request>* reqs);  // each to its coordinator (this rank's: added)
  void OnRequests(int src, const ByteVec& msg);
  // The responses of the coordinators this rank runs, sent to their sets and applied here.
  bool Answer();
  void OnResponses(const ByteVec& msg);

  // Refusals made on another rank, on file until this rank submits that call.
  void File(const std::string& key, const Response& r);
  bool Refused(const std::string& key) const { return refusals_.count(key) > 0; }
  Status TakeRefusal(const std::string& key, int64_t step);  // ok: none on file for that step
  // The ranks of set `set` that left, as the error of a call of `op` named `name` (ok: none).
  Status Departed(int set, int op, const std::string& name) const;
  // Why a call (key `key`, step `step`, negotiated in `set`) cannot run: a refusal, else a departure.
  Status Unrunnable(const std::string& key, int64_t step, int set, int op, const std::string& name);

  // Fails, with `code` and "<op> '<name>': <why>", the waiting ops that `which` picks.
  void FailAwaiting(const std::function<bool(const Entry&)>& which, int code, const std::string& why);
  void OnLeave(int rank);                       // its coordinators answer without it, or (it ran them) fail
  void CheckStalls(StallInspector* stalls);     // ops some rank never submitted: aborted
  void ForgetSet(int set);                      // a removed set's refusals on file
  void Clear() { awaiting_.clear(); }           // the runtime failed: its ops are failed elsewhere

 private:
  double Now() const;  // seconds since the start: the coordinators' clock
  void Respond(const ProcessSet* set, std::vector<Response> resps);

  Host* host_;
  Backend* backend_;
  ProcessSets* sets_;
  const Departures* departures_;
  GroupedOps* groups_;
  Stats* stats_;
  std::unique_ptr<Coordinator> coordinator_;             // rank 0 only
  std::map<std::string, EntryPtr> awaiting_;             // by per-name key (a group: its first member)
  std::vector<Request> late_;                            // from batches that died, votes, disputes
  std::map<std::string, Response> refusals_;             // by per-name key: the refusal and its step
  Clock::time_point start_ = Clock::now();
};

}  // namespace shoal
