// Op names and their bounded per-name state (the retirement protocol: names.cc). Each
// name keeps a call count on every rank (its step: how ranks pair their calls of it).
// Guarded by the runtime's mutex: user threads number their calls, the driver retires.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "negotiation/coordinator.h"
#include "runtime/entry.h"

namespace shoal {

struct NameState {
  int64_t calls = 0;  // ops submitted so far
  bool in_flight = false;
  int members_left = 0;    // a grouped op's name: its members still running
  int64_t last_use = 0;    // NameTable::Use() at its last call
  int64_t held_calls = 0;  // a hierarchical op's refused calls while proposed
  bool frozen = false;     // voted to retire: new calls wait (Hold) until the commit
  bool staged = false;     // a hierarchical op's name (its stages' names go with it)
  bool stage = false;      // a stage's name
  bool grouped = false;    // a grouped op's or member's name (kept)
};

class NameTable {
 public:
  explicit NameTable(size_t limit) : limit_(limit) {}

  // The op's name: the user's (ArgumentError for the runtime's reserved name), or for an
  // unnamed op the next of kUnnamed generated names of its op in process set `set` (or
  // machine group: ProcessSets::NegotiatedIn).
  std::string Name(int op, const char* name, int set);
  // A generated name ran here without a call (a joined rank): the next one follows it.
  void FollowUnnamed(int op, const std::string& name);

  NameState& operator[](const std::string& key) { return names_[key]; }
  NameState* Find(const std::string& key);
  size_t size() const { return names_.size(); }
  int64_t Use() { return ++uses_; }  // a call: its NameState::last_use
  void Hold(const EntryPtr& e) { held_.push_back(e); }  // a call of a frozen name
  bool Holding() const { return !held_.empty(); }
  bool Voting() const { return !voting_sets_.empty(); }
  bool Voting(int set) const { return voting_sets_.count(set) > 0; }
  std::vector<int> VotingSets() const { return {voting_sets_.begin(), voting_sets_.end()}; }

  // Retirement. Propose: adds this rank's idle names of `y`'s set to its request, past the
  // limit; `busy`: names that must stay (cached batches, refusals on file).
  void Propose(const Entry& y, const std::function<bool(const std::string&)>& busy, Request* req);
  // The coordinator's answer to the proposals: freezes the names still idle and fills
  // `vote`; false if there is nothing to vote on.
  bool Vote(const Response& r, Request* vote);
  // The vote's outcome for `set` (`gone`: the keys every rank froze; empty: none retire).
  struct Thawed {
    std::vector<EntryPtr> calls;       // the held calls, numbered, in call order
    std::vector<std::string> retired;  // keys whose count restarts at 0
    int64_t ops_retired = 0;           // of those, names of ops (not stages)
  };
  Thawed Thaw(int set, const std::set<std::string>& gone);
  void Forget(int set);  // a removed process set's names, counters and proposal

 private:
  void Later();  // propose again only after more names (a scan costs O(names))

  struct Frozen {
    std::string key, op_key;  // op_key: its own, or a stage's hierarchical op's
    int set;
  };
  size_t limit_;
  std::map<std::string, NameState> names_;
  std::map<std::pair<int, int>, int64_t> unnamed_;  // by (process set, op): generated names so far
  int64_t uses_ = 0;                                // calls so far
  std::vector<EntryPtr> held_;                      // calls of frozen names, in call order
  std::vector<Frozen> frozen_;
  std::map<int, std::map<std::string, int64_t>> proposed_;  // by set: the names on file, with counts
  std::set<int> voting_sets_;                               // sets whose vote is in flight
  size_t next_proposal_at_ = 0;                             // size() at which to look for idle names again
};

}  // namespace shoal
