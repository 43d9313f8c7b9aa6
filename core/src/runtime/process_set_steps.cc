// The runtime's steps of process sets (process_sets/process_sets.h holds the table and the
// agreement's rules): every rank's add/remove calls agree through one global allgather; the
// members then make the set on their progress drivers.
#include <algorithm>

#include "runtime/runtime.h"

namespace shoal {
namespace {

[[noreturn]] void Fail(int code, const std::string& msg) { throw ArgumentError(code, msg); }

}  // namespace

std::vector<SetVote> Runtime::Agree(SetVote& mine, std::string* what, int64_t* top) {
  mine.calls = sets_.NextCall();
  *what = mine.Call();
  ByteVec payload = EncodeVote(mine);
  const std::vector<int64_t> shape = {static_cast<int64_t>(payload.size())};
  shoal_op_desc d{};
  d.op = SHOAL_OP_ALLGATHER;
  d.name = kSetsAgreement;
  d.input = {payload.data(), SHOAL_UINT8, 1, shape.data(), SHOAL_DEVICE_CPU, 0, nullptr, nullptr};
  const int64_t h = Enqueue(d);
  const Status st = Wait(h);
  EntryPtr e = Find(h);
  Release(h);
  if (!st.ok()) Fail(st.code, *what + " did not complete: " + st.message + kSetRule);
  std::vector<SetVote> votes = DecodeVotes(static_cast<const char*>(e->result), e->result_nbytes);
  if (static_cast<int>(votes.size()) != world().size) Fail(SHOAL_ABORTED, *what + ": internal error: votes lost");
  *top = 0;
  for (auto& v : votes) *top = std::max(*top, v.calls);
  sets_.Agreed(*top);
  JudgeSetCalls(votes);
  return votes;
}

int32_t Runtime::AddProcessSet(const std::vector<int>& ranks, const std::string& refusal) {
  auto one = sets_.BeginAgreement();
  SetVote mine;
  mine.kind = SetVote::kAdd;
  mine.ranks = ranks;
  std::sort(mine.ranks.begin(), mine.ranks.end());
  if (!refusal.empty()) mine.code = SHOAL_INVALID_TYPE, mine.refusal = refusal;
  std::string what;
  int64_t top = 0;
  Agree(mine, &what, &top);
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
  if (ProcessSetPtr same = sets_.WithRanks(mine.ranks))
    Fail(SHOAL_INVALID_ARGUMENT, what + ": " + same->Describe() +
                                     " has these ranks already (Horovod refuses duplicate process sets)");
  const int32_t id = static_cast<int32_t>(top + 1);  // above every earlier id, the same on every rank
  const Status st = OnDriver([this, id, r = mine.ranks] { return MakeSet(id, r); });
  if (!st.ok()) Fail(st.code, what + ": " + st.message);
  return id;
}

void Runtime::RemoveProcessSet(int32_t id, const std::string& refusal) {
  auto one = sets_.BeginAgreement();
  SetVote mine;
  mine.kind = SetVote::kRemove;
  mine.id = id;
  if (!refusal.empty()) mine.code = SHOAL_INVALID_TYPE, mine.refusal = refusal;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& kv : handles_) mine.busy += kv.second->set == id && !kv.second->done;
  }
  std::string what;
  int64_t top = 0;
  const std::vector<SetVote> votes = Agree(mine, &what, &top);
  if (id == 0) Fail(SHOAL_INVALID_ARGUMENT, what + ": the global process set cannot be removed");
  if (!FindSet(id)) Fail(SHOAL_INVALID_ARGUMENT, what + ": no process set has id " + std::to_string(id));
  std::vector<int> busy;
  for (size_t r = 0; r < votes.size(); ++r)
    if (votes[r].busy > 0) busy.push_back(static_cast<int>(r));
  if (!busy.empty())
    Fail(SHOAL_INVALID_ARGUMENT, what + ": ops of process set " + std::to_string(id) + " are in flight on " +
                                     RanksNamed(busy) + "; synchronize them first");
  const Status st = OnDriver([this, id] {
    DropSet(id);
    return Status::Ok();
  });
  if (!st.ok()) Fail(st.code, what + ": " + st.message);
}

ProcessSetPtr Runtime::FindSet(int32_t id) { return sets_.Find(id); }

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
  std::unique_ptr<Coordinator> coordinator;
  if (s->index == 0)
    coordinator = std::make_unique<Coordinator>(s->size(), cfg_.fusion_threshold, Backend::kSetChannels, ranks);
  sets_.Add(s, std::move(coordinator));
  return Status::Ok();
}

void Runtime::DropSet(int32_t id) {
  const ProcessSetPtr s = sets_.Find(id);
  if (!s) return;
  cache_.Drop(id);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (names_.Voting(id)) Thaw(id, {});  // its coordinator will not answer the vote
  }
  // Submitted by another thread meanwhile.
  FailAwaiting([id](const Entry& e) { return e.set == id; }, SHOAL_INVALID_ARGUMENT, s->Describe() + " was removed");
  if (s->index >= 0) backend_->RemoveSet(id);
  sets_.Remove(id);
  {
    std::lock_guard<std::mutex> lock(mu_);
    ForgetSet(id);
  }
}

Coordinator* Runtime::CoordinatorOf(int set) { return set == 0 ? coordinator_.get() : sets_.CoordinatorOf(set); }

const ProcessSet* Runtime::SetOf(int set) const { return sets_.Of(set); }

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

void Runtime::LeaveSets(int rank) {
  sets_.ForEach([&](const ProcessSet& s, Coordinator* c) {
    if (s.index < 0 || !s.Has(rank)) return;  // not this rank's business, or not the leaver's
    if (c) {
      std::vector<Response> resps = c->Leave(s.IndexOf(rank));
      if (!resps.empty()) Respond(&s, std::move(resps));
    } else if (rank == s.leader()) {  // the set's coordinator is gone: what waits for it fails
      const int id = s.id;
      FailAwaiting([this, id](const Entry& e) { return sets_.NegotiatedIn(e.set, e.sig.scope) == id; }, SHOAL_ABORTED,
                   Departures::Describe({rank}));
    }
  });
}

}  // namespace shoal
