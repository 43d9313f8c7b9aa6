// Process sets (process_sets/process_sets.h): every rank's add/remove calls agree through one global
// allgather; the members then make the set on their progress drivers; each set's ops go to
// the set's own coordinator, at its first rank.
#include "process_sets/process_sets.h"

#include <algorithm>
#include <cstring>

#include "negotiation/wire.h"

namespace shoal {
namespace {

std::string List(const std::vector<int>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

[[noreturn]] void Fail(int code, const std::string& msg) { throw ArgumentError(code, msg); }

}  // namespace

bool KeyInSet(const std::string& key, int set, std::string* name) {
  const size_t nul = key.find('\0');
  if (set == 0) {
    if (nul != std::string::npos) return false;
    *name = key;
    return true;
  }
  if (nul == std::string::npos || key.compare(nul + 1, std::string::npos, std::to_string(set)) != 0) return false;
  *name = key.substr(0, nul);
  return true;
}

int ProcessSet::IndexOf(int world_rank) const {
  auto it = std::lower_bound(ranks.begin(), ranks.end(), world_rank);
  return it != ranks.end() && *it == world_rank ? static_cast<int>(it - ranks.begin()) : -1;
}

std::string ProcessSet::Describe() const {
  return id < 0 ? "machine of ranks " + List(ranks) : "process set " + std::to_string(id) + " (ranks " + List(ranks) + ")";
}

void ProcessSets::SetMachine(const std::vector<int>& machine, int world_rank, int world_size, int64_t fusion_threshold) {
  if (machine.empty() || static_cast<int>(machine.size()) >= world_size) return;  // one machine: the global set
  auto s = std::make_shared<ProcessSet>();
  s->ranks = machine;
  std::sort(s->ranks.begin(), s->ranks.end());
  s->id = -1 - s->leader();  // the same on each of its ranks, unique among machines
  s->index = s->IndexOf(world_rank);
  // No cached batches (channels): machine-scope allreduces run on the world engine's
  // machine communicator, which has none.
  if (s->index == 0) machine_.coordinator = std::make_unique<Coordinator>(s->size(), fusion_threshold, 0, s->ranks);
  leader_ = leader_ || machine_.coordinator != nullptr;
  machine_.info = std::move(s);
}

ProcessSetPtr ProcessSets::Find(int32_t id) const {
  MutexLock lock(mu_);
  auto it = sets_.find(id);
  return it == sets_.end() ? nullptr : it->second.info;
}

bool ProcessSets::Empty() const {
  MutexLock lock(mu_);
  return sets_.empty();
}

ProcessSetPtr ProcessSets::WithRanks(const std::vector<int>& ranks) const {
  MutexLock lock(mu_);
  for (auto& kv : sets_)
    if (kv.second.info->ranks == ranks) return kv.second.info;
  return nullptr;
}

const ProcessSet* ProcessSets::Of(int set) const {
  if (set == 0) return nullptr;
  if (set < 0) return machine_.info && machine_.info->id == set ? machine_.info.get() : nullptr;
  auto it = Driven().find(set);
  return it == Driven().end() ? nullptr : it->second.info.get();
}

Coordinator* ProcessSets::CoordinatorOf(int set) const {
  if (set < 0) return machine_.info && machine_.info->id == set ? machine_.coordinator.get() : nullptr;
  auto it = Driven().find(set);
  return it == Driven().end() ? nullptr : it->second.coordinator.get();
}

void ProcessSets::Add(ProcessSetPtr set, std::unique_ptr<Coordinator> coordinator) {
  leader_ = leader_ || coordinator != nullptr;
  MutexLock lock(mu_);
  State& s = sets_[set->id];
  s.info = std::move(set);
  s.coordinator = std::move(coordinator);
}

void ProcessSets::Remove(int32_t id) {
  MutexLock lock(mu_);
  sets_.erase(id);
  leader_ = machine_.coordinator != nullptr;
  for (auto& kv : sets_) leader_ = leader_ || kv.second.coordinator != nullptr;
}

// One rank's add/remove call, as every rank sees it once they agree.
const char* const kSetRule = " (every rank calls add_process_set and remove_process_set with the same arguments, in "
                             "the same order, as in Horovod)";

std::string SetVote::Call() const {
  return kind == kAdd ? "add_process_set(" + List(ranks) + ")" : "remove_process_set(" + std::to_string(id) + ")";
}

ByteVec EncodeVote(const SetVote& v) {
  // Prefixed by its length: an allgather's concatenation reads back as every rank's vote in rank order.
  Writer body;
  SetVote::Fields(body, v);
  ByteVec payload(sizeof(uint32_t) + body.size());
  const uint32_t n = static_cast<uint32_t>(body.size());
  std::memcpy(payload.data(), &n, sizeof n);
  std::memcpy(payload.data() + sizeof n, body.buffer().data(), n);
  return payload;
}

std::vector<SetVote> DecodeVotes(const char* data, size_t size) {
  std::vector<SetVote> votes;
  Reader all(data, size);
  while (!all.done()) {
    const uint32_t len = all.Get<uint32_t>();
    Reader one(all.Skip(len), len);
    votes.emplace_back();
    SetVote::Fields(one, votes.back());
  }
  return votes;
}

// The first refusal, then calls that differ: the same error on every rank (all see the same votes).
void JudgeSetCalls(const std::vector<SetVote>& votes) {
  for (size_t r = 0; r < votes.size(); ++r)
    if (votes[r].code != 0) Fail(votes[r].code, votes[r].refusal + " (raised at the call on rank " + std::to_string(r) + ")");
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (size_t r = 0; r < votes.size(); ++r) {
    const std::string call = votes[r].Call();
    auto g = std::find_if(groups.begin(), groups.end(), [&](const auto& x) { return x.first == call; });
    if (g == groups.end()) groups.push_back({call, {static_cast<int>(r)}});
    else g->second.push_back(static_cast<int>(r));
  }
  if (groups.size() == 1) return;
  std::string diff;
  for (size_t i = 0; i < groups.size(); ++i) diff += (i ? "; " : "") + groups[i].first + " on " + RanksNamed(groups[i].second);
  Fail(SHOAL_MISMATCH, "process sets: mismatched calls across ranks: " + diff + kSetRule);
}

}  // namespace shoal
