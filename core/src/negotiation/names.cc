// Op names and bounded per-name state. Each name keeps a call count on every rank (its
// step: how ranks pair their calls of it), so a script that invents names (a step number
// in each) would grow the tables without end. Past cfg_.name_limit names, idle names (not
// called in the last name_limit calls) are retired, on every rank at one agreed point, so
// that their next call is step 0 everywhere:
//   1. propose: a request to the coordinator carries this rank's least recently used idle
//      names of its set with their counts (Propose); once every rank's proposal is on file,
//      the coordinator answers with the names all of them proposed with the same count;
//   2. vote: on that answer each rank freezes the ones still idle at that count (new calls
//      of them wait in held_) and its driver sends its vote at once (Vote): the round needs
//      no user call, so a held call never waits on another call;
//   3. commit: the vote's response names those every rank froze: each rank forgets them,
//      then numbers and queues the held calls (Thaw).
// Names of grouped ops and of cached allreduce batches are kept (a script that invents
// group names still grows the tables).
#include "negotiation/names.h"

#include <algorithm>
#include <cstdlib>

#include "process_sets/process_sets.h"

namespace shoal {
namespace {

constexpr int64_t kUnnamed = 1024;
const char* const kRetireName = "shoal.retire";

}  // namespace

std::string NameTable::Name(int op, const char* name, int set) {
  // Unnamed ops cycle through kUnnamed names per op, so caches stay bounded and repeated
  // unnamed neighbor ops hit the negotiated-name cache; one count per process set (only
  // its members run its ops).
  if (name && *name) {
    if (std::string(name) == kRetireName)  // the vote's name at the coordinator
      throw ArgumentError(SHOAL_INVALID_ARGUMENT, std::string(OpName(op)) + ": the op name '" + kRetireName +
                                                      "' is reserved for the runtime; choose another name");
    return name;
  }
  // A machine's (set < 0) differ from the global set's, with which they share names.
  return std::string(OpName(op)) + (set < 0 ? ".local.noname." : ".noname.") +
         std::to_string(unnamed_[{set, op}]++ % kUnnamed);
}

void NameTable::FollowUnnamed(int op, const std::string& name) {
  const std::string prefix = std::string(OpName(op)) + ".noname.";
  if (name.compare(0, prefix.size(), prefix) != 0) return;
  unnamed_[{0, op}] = std::strtoll(name.c_str() + prefix.size(), nullptr, 10) + 1;  // the next one's index
}

NameState* NameTable::Find(const std::string& key) {
  auto it = names_.find(key);
  return it == names_.end() ? nullptr : &it->second;
}

void NameTable::Propose(const Entry& y, const std::function<bool(const std::string&)>& busy, Request* req) {
  if (names_.size() <= limit_ || names_.size() < next_proposal_at_ || proposed_.count(y.set) ||
      voting_sets_.count(y.set))
    return;
  std::vector<std::pair<int64_t, const std::string*>> idle;  // (last use, key)
  std::string name;
  // Names not called in the last name_limit calls: a script's names used every step stay
  // (as long as there are fewer than the limit).
  const int64_t stale = uses_ - static_cast<int64_t>(limit_);
  for (auto& [key, ns] : names_) {
    if (ns.last_use >= stale || ns.in_flight || ns.frozen || ns.grouped || ns.stage || key == y.key() ||
        !KeyInSet(key, y.set, &name) || name == kSetsAgreement || busy(key))
      continue;
    bool busy_stage = false;  // a hierarchical op's machine sum runs as a cached allreduce
    if (ns.staged)
      for (auto& stage : kHierarchicalStages)  // (or has a refusal on file)
        busy_stage |= busy(key + stage.suffix);
    if (!busy_stage) idle.push_back({ns.last_use, &key});
  }
  const size_t excess = names_.size() - limit_ / 2;
  if (idle.size() > excess) {
    std::nth_element(idle.begin(), idle.begin() + excess, idle.end());
    idle.resize(excess);
  }
  if (idle.empty()) return Later();
  auto& mine = proposed_[y.set];
  for (auto& [last_use, key] : idle) {
    KeyInSet(*key, y.set, &name);
    mine[name] = names_[*key].calls;
  }
  for (auto& [n, calls] : mine) {  // sorted by name: the coordinator intersects the lists
    req->retire.push_back(n);
    req->retire_calls.push_back(calls);
  }
}

bool NameTable::Vote(const Response& r, Request* vote) {
  vote->name = kRetireName;
  vote->sig.op = kOpRetire;
  vote->set = r.set;
  {
    std::map<std::string, int64_t> mine;  // this rank's proposal on file (there is one)
    auto filed = proposed_.find(r.set);
    if (filed != proposed_.end()) {
      mine = std::move(filed->second);
      proposed_.erase(filed);
    }
    if (r.retired.empty()) {  // no name every rank proposed: no vote
      Later();
      return false;
    }
    // Every rank votes, with the names it froze (possibly none): the others wait for it.
    for (auto& n : std::set<std::string>(r.retired.begin(), r.retired.end())) {
      auto calls = mine.find(n);
      const std::string key = SetKey(r.set, n);
      auto ns = names_.find(key);
      if (calls == mine.end() || ns == names_.end() || ns->second.in_flight || ns->second.grouped ||
          ns->second.calls != calls->second)
        continue;  // called since it was proposed: this rank votes to keep it
      ns->second.frozen = true;
      frozen_.push_back({key, key, r.set});
      if (ns->second.staged)
        for (auto& stage : kHierarchicalStages) {
          auto s = names_.find(key + stage.suffix);
          if (s == names_.end()) continue;
          s->second.frozen = true;
          frozen_.push_back({s->first, key, r.set});
        }
      vote->retire.push_back(n);
      vote->retire_calls.push_back(calls->second);
    }
    voting_sets_.insert(r.set);
  }
  return true;
}

NameTable::Thawed NameTable::Thaw(int set, const std::set<std::string>& gone) {
  Thawed out;
  std::vector<Frozen> thawed, still;
  for (auto& f : frozen_) (f.set == set ? thawed : still).push_back(std::move(f));
  frozen_.swap(still);
  for (auto& f : thawed) {
    auto ns = names_.find(f.key);
    if (ns == names_.end()) continue;
    NameState& s = ns->second;
    s.frozen = false;
    if (gone.count(f.op_key)) {
      s.calls = 0;
      out.retired.push_back(f.key);
      if (f.key == f.op_key) ++out.ops_retired;
    }
    s.calls += s.held_calls;
    s.held_calls = 0;
  }
  // The set's calls made meanwhile, in call order; a grouped op's members share its step.
  std::vector<EntryPtr> held, other;
  for (auto& e : held_) (e->set == set ? held : other).push_back(e);
  held_.swap(other);
  int64_t group_step = 0;
  for (auto& e : held) {
    if (!e->group.empty() && e->group_index == 0) group_step = names_[e->group].calls++;
    if (!e->group.empty()) e->group_step = group_step;
    e->step = names_[e->key()].calls++;
  }
  out.calls = std::move(held);
  for (auto& f : thawed) {
    auto ns = names_.find(f.key);
    if (ns != names_.end() && gone.count(f.op_key) && ns->second.calls == 0 && !ns->second.in_flight)
      names_.erase(ns);
  }
  voting_sets_.erase(set);
  // Every idle name was proposed (or enough to halve the table): look again only after
  // more new names, else each call past the limit would scan the whole table again.
  Later();
  return out;
}

void NameTable::Later() { next_proposal_at_ = names_.size() + std::max<size_t>(1, limit_ / 16); }

void NameTable::Forget(int set) {
  std::string name;
  for (auto it = names_.begin(); it != names_.end();) it = KeyInSet(it->first, set, &name) ? names_.erase(it) : std::next(it);
  for (auto it = unnamed_.begin(); it != unnamed_.end();) it = it->first.first == set ? unnamed_.erase(it) : std::next(it);
  proposed_.erase(set);
}

}  // namespace shoal
