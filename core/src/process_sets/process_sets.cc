// Process sets (process_sets/process_sets.h): every rank's add/remove calls agree through one global
// allgather; the members then make the set on their progress drivers; each set's ops go to
// the set's own coordinator, at its first rank.
#include "process_sets/process_sets.h"

#include <algorithm>
#include <cstring>

#include "runtime/runtime.h"
#include "negotiation/wire.h"

namespace shoal {
namespace {

std::string List(const std::vector<int>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

std::string RankWords(const std::vector<int>& v) {
  std::string s = v.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s;
}

constexpr int32_t kAdd = 1, kRemove = 2;
const char* const kRule = " (every rank calls add_process_set and remove_process_set with the same arguments, in "
                          "the same order, as in Horovod)";

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

std::string ProcessSet::Describe() const { return "process set " + std::to_string(id) + " (ranks " + List(ranks) + ")"; }

// One rank's add/remove call, as every rank sees it once they agree.
struct SetVote {
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
  std::string Call() const {
    return kind == kAdd ? "add_process_set(" + List(ranks) + ")" : "remove_process_set(" + std::to_string(id) + ")";
  }
};

std::vector<SetVote> Runtime::Agree(const SetVote& mine, const std::string& what) {
  // Each rank's vote, prefixed by its length: the allgather's concatenation reads back as
  // every rank's vote in rank order.
  Writer body;
  SetVote::Fields(body, mine);
  ByteVec payload(sizeof(uint32_t) + body.size());
  const uint32_t n = static_cast<uint32_t>(body.size());
  std::memcpy(payload.data(), &n, sizeof n);
  std::memcpy(payload.data() + sizeof n, body.buffer().data(), n);
  const std::vector<int64_t> shape = {static_cast<int64_t>(payload.size())};
  shoal_op_desc d{};
  d.op = SHOAL_OP_ALLGATHER;
  d.name = kSetsAgreement;
  d.input = {payload.data(), SHOAL_UINT8, 1, shape.data(), SHOAL_DEVICE_CPU, 0, nullptr, nullptr};
  const int64_t h = Enqueue(d);
  const Status st = Wait(h);
  EntryPtr e = Find(h);
  Release(h);
  if (!st.ok()) Fail(st.code, what + " did not complete: " + st.message + kRule);
  std::vector<SetVote> votes;
  Reader all(static_cast<const char*>(e->result), e->result_nbytes);
  while (!all.done()) {
    const uint32_t len = all.Get<uint32_t>();
    Reader one(all.Skip(len), len);
    votes.emplace_back();
    SetVote::Fields(one, votes.back());
  }
  if (static_cast<int>(votes.size()) != world().size) Fail(SHOAL_ABORTED, what + ": internal error: votes lost");
  return votes;
}

// The first refusal, then calls that differ: the same error on every rank (all see the same votes).
static void JudgeCalls(const std::vector<SetVote>& votes) {
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
  for (size_t i = 0; i < groups.size(); ++i) diff += (i ? "; " : "") + groups[i].first + " on " + RankWords(groups[i].second);
  Fail(SHOAL_MISMATCH, "process sets: mismatched calls across ranks: " + diff + kRule);
}

int32_t Runtime::AddProcessSet(const std::vector<int>& ranks, const std::string& refusal) {
  std::lock_guard<std::mutex> one(sets_mu_);
  SetVote mine;
  mine.kind = kAdd;
  mine.ranks = ranks;
  std::sort(mine.ranks.begin(), mine.ranks.end());
  if (!refusal.empty()) mine.code = SHOAL_INVALID_TYPE, mine.refusal = refusal;
  mine.calls = set_calls_++;
  const std::string what = mine.Call();
  const std::vector<SetVote> votes = Agree(mine, what);
  int64_t top = 0;
  for (auto& v : votes) top = std::max(top, v.calls);
  set_calls_ = top + 1;  // every rank numbers its next agreement above this one's
  JudgeCalls(votes);
  const int size = world().size;
  if (mine.ranks.empty()) Fail(SHOAL_INVALID_ARGUMENT, what + ": a process set needs at least one rank");
  for (size_t i = 0; i < mine.ranks.size(); ++i) {
    const int r = mine.ranks[i];
    if (r < 0 || r >= size)
      Fail(SHOAL_INVALID_ARGUMENT, what + ": rank " + std::to_string(r) + " is outside [0, " + std::to_string(size) + ")");
    if (i > 0 && mine.ranks[i - 1] == r) Fail(SHOAL_INVALID_ARGUMENT, what + ": rank " + std::to_string(r) + " appears twice");
  }
  if (static_cast<int>(mine.ranks.size()) == size)
    Fail(SHOAL_INVALID_ARGUMENT, what + ": these are the ranks of the global process set (id 0), which exists "
                                        "already (Horovod refuses duplicate process sets)");
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& kv : sets_)
      if (kv.second.info->ranks == mine.ranks)
        Fail(SHOAL_INVALID_ARGUMENT, what + ": " + kv.second.info->Describe() +
                                         " has these ranks already (Horovod refuses duplicate process sets)");
  }
  const int32_t id = static_cast<int32_t>(top + 1);  // above every earlier id, the same on every rank
  const Status st = OnDriver([this, id, r = mine.ranks] { return MakeSet(id, r); });
  if (!st.ok()) Fail(st.code, what + ": " + st.message);
  return id;
}

void Runtime::RemoveProcessSet(int32_t id, const std::string& refusal) {
  std::lock_guard<std::mutex> one(sets_mu_);
  SetVote mine;
  mine.kind = kRemove;
  mine.id = id;
  if (!refusal.empty()) mine.code = SHOAL_INVALID_TYPE, mine.refusal = refusal;
  mine.calls = set_calls_++;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& kv : handles_) mine.busy += kv.second->set == id && !kv.second->done;
  }
  const std::string what = mine.Call();
  const std::vector<SetVote> votes = Agree(mine, what);
  int64_t top = 0;
  for (auto& v : votes) top = std::max(top, v.calls);
  set_calls_ = top + 1;
  JudgeCalls(votes);
  if (id == 0) Fail(SHOAL_INVALID_ARGUMENT, what + ": the global process set cannot be removed");
  if (!FindSet(id)) Fail(SHOAL_INVALID_ARGUMENT, what + ": no process set has id " + std::to_string(id));
  std::vector<int> busy;
  for (size_t r = 0; r < votes.size(); ++r)
    if (votes[r].busy > 0) busy.push_back(static_cast<int>(r));
  if (!busy.empty())
    Fail(SHOAL_INVALID_ARGUMENT, what + ": ops of process set " + std::to_string(id) + " are in flight on " +
                                     RankWords(busy) + "; synchronize them first");
  const Status st = OnDriver([this, id] {
    DropSet(id);
    return Status::Ok();
  });
  if (!st.ok()) Fail(st.code, what + ": " + st.message);
}

void Runtime::FailAwaiting(const std::function<bool(const Entry&)>& which, int code, const std::string& why) {
  std::vector<EntryPtr> lost;
  for (auto a = awaiting_response_.begin(); a != awaiting_response_.end();) {
    if (which(*a->second)) {
      ExpandGroup(a->second, &lost);  // a group waits as its first member: all of them
      a = awaiting_response_.erase(a);
    } else {
      ++a;
    }
  }
  for (auto& e : lost) Finish(e, Status::Error(code, OpError(e->sig.op, e->name, why)));
}

ProcessSetPtr Runtime::FindSet(int32_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sets_.find(id);
  return it == sets_.end() ? nullptr : it->second.info;
}

void Runtime::RunControl(const EntryPtr& e) {
  std::function<Status()> job;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = set_jobs_.find(e->handle);
    if (it != set_jobs_.end()) {
      job = std::move(it->second);
      set_jobs_.erase(it);
    }
  }
  Finish(e, job ? job() : Status::Error(SHOAL_ABORTED, "internal error: a process set step without its job"));
}

Status Runtime::MakeSet(int32_t id, const std::vector<int>& ranks) {
  auto s = std::make_shared<ProcessSet>();
  s->id = id;
  s->ranks = ranks;
  s->index = s->IndexOf(world().rank);
  if (s->index >= 0) {
    // Blocks until every member is here: they all agreed, and make their sets in one order.
    Status st = backend_->AddSet(id, ranks);
    if (!st.ok()) return st;
  }
  SetState state;
  state.info = s;
  if (s->index == 0)
    state.coordinator = std::make_unique<Coordinator>(s->size(), cfg_.fusion_threshold, Backend::kSetChannels, ranks);
  {
    std::lock_guard<std::mutex> lock(mu_);
    sets_[id] = std::move(state);
  }
  set_leader_ = set_leader_ || s->index == 0;
  return Status::Ok();
}

void Runtime::DropSet(int32_t id) {
  auto it = sets_.find(id);
  if (it == sets_.end()) return;
  const ProcessSetPtr s = it->second.info;
  cache_.Drop(id);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (names_.Voting(id)) Thaw(id, {});  // its coordinator will not answer the vote
  }
  // Submitted by another thread meanwhile.
  FailAwaiting([id](const Entry& e) { return e.set == id; }, SHOAL_INVALID_ARGUMENT, s->Describe() + " was removed");
  if (s->index >= 0) backend_->RemoveSet(id);
  {
    std::lock_guard<std::mutex> lock(mu_);
    sets_.erase(it);
    ForgetSet(id);
  }
  set_leader_ = false;
  for (auto& kv : sets_) set_leader_ = set_leader_ || kv.second.coordinator != nullptr;
}

Coordinator* Runtime::CoordinatorOf(int set) {
  if (set == 0) return coordinator_.get();
  auto it = sets_.find(set);
  return it == sets_.end() ? nullptr : it->second.coordinator.get();
}

const ProcessSet* Runtime::SetOf(int set) const {
  if (set == 0) return nullptr;
  auto it = sets_.find(set);
  return it == sets_.end() ? nullptr : it->second.info.get();
}

int Runtime::IndexIn(int set, int world_rank) const {
  if (set == 0) return world_rank;
  const ProcessSet* s = SetOf(set);
  return s ? s->IndexOf(world_rank) : -1;
}

bool Runtime::Lost(int set) const {
  if (!departures_.Any()) return false;
  const ProcessSet* s = SetOf(set);
  if (!s) return true;
  for (int r : s->ranks)
    if (departures_.Left(r)) return true;
  return false;
}

void Runtime::SendRequests(std::vector<Request>* reqs) {
  const int me = world().rank;
  auto send = [this](int leader, const std::vector<Request>& to) {
    auto msg = std::make_shared<ByteVec>(EncodeRequests(to));
    backend_->Send(leader, kRequestTag, msg, [this, leader](const Status& st) {
      if (st.ok()) return;
      if (leader == 0) return FailAll("cannot reach the coordinator (rank 0): " + st.message);
      // Only the sets it leads lose their coordinator.
      FailAwaiting([leader](const Entry& e) { return e.pset && e.pset->leader() == leader; }, SHOAL_ABORTED,
                   "cannot reach rank " + std::to_string(leader) + ", the coordinator of its process set: " + st.message);
    });
  };
  if (std::all_of(reqs->begin(), reqs->end(), [](const Request& r) { return r.set == 0; })) {  // the common case
    if (!coordinator_) return send(0, *reqs);
    for (auto& r : *reqs) coordinator_->Add(0, r, Now());
    return;
  }
  std::map<int, std::vector<Request>> by_leader;
  for (auto& r : *reqs) {
    if (Coordinator* c = CoordinatorOf(r.set)) {
      c->Add(IndexIn(r.set, me), r, Now());
      continue;
    }
    const ProcessSet* s = SetOf(r.set);
    if (r.set != 0 && !s) continue;  // removed meanwhile: its ops failed (DropSet)
    by_leader[s ? s->leader() : 0].push_back(std::move(r));
  }
  for (auto& kv : by_leader) send(kv.first, kv.second);
}

void Runtime::OnRequests(int src, const ByteVec& msg) {
  for (auto& r : DecodeRequests(msg.data(), msg.size())) {
    Coordinator* c = CoordinatorOf(r.set);
    const int index = IndexIn(r.set, src);
    if (!c && r.set == 0) throw std::runtime_error("unexpected request from rank " + std::to_string(src));
    if (!c || index < 0) {  // of a set removed meanwhile (its ops failed there too)
      Log(LOG_DEBUG, "dropped a request for process set " + std::to_string(r.set) + " from rank " + std::to_string(src));
      continue;
    }
    c->Add(index, r, Now());
  }
}

void Runtime::Respond(const ProcessSet* set, std::vector<Response> resps) {
  const int id = set ? set->id : 0, me = world().rank;
  for (auto& r : resps) r.set = id;
  auto msg = std::make_shared<ByteVec>(EncodeResponses(resps));
  auto send = [&](int q) {
    if (q != me && !departures_.Left(q)) backend_->Send(q, kResponseTag, msg, [](const Status&) {});
  };
  if (set) {
    for (int q : set->ranks) send(q);
  } else {
    for (int q = 0; q < world().size; ++q) send(q);
  }
  for (auto& r : resps) Apply(r);
}

bool Runtime::RespondForSets() {
  bool any = false;
  int64_t negotiations = coordinator_ ? coordinator_->negotiations() : 0;
  for (auto& kv : sets_) {
    Coordinator* c = kv.second.coordinator.get();
    if (!c) continue;
    std::vector<Response> resps = c->TakeResponses();
    negotiations += c->negotiations();  // with this cycle's, before their ops can complete
    if (resps.empty()) continue;
    Respond(kv.second.info.get(), std::move(resps));
    any = true;
  }
  stats_.negotiations = negotiations;
  return any;
}

void Runtime::LeaveSets(int rank) {
  for (auto& kv : sets_) {
    const ProcessSet& s = *kv.second.info;
    if (s.index < 0 || !s.Has(rank)) continue;  // not this rank's business, or not the leaver's
    if (Coordinator* c = kv.second.coordinator.get()) {
      std::vector<Response> resps = c->Leave(s.IndexOf(rank));
      if (!resps.empty()) Respond(&s, std::move(resps));
    } else if (rank == s.leader()) {  // the set's coordinator is gone: what waits for it fails
      const int id = s.id;
      FailAwaiting([id](const Entry& e) { return e.set == id; }, SHOAL_ABORTED,
                   "rank " + std::to_string(rank) + " left the job (script ended, sys.exit or shoal.shutdown()) "
                   "before taking part in this op");
    }
  }
}

}  // namespace shoal
