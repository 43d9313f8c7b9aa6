// Horovod's add_process_set and remove_process_set (set_control.h): every rank's calls agree
// through one global allgather (the rules: process_sets.cc); the members then make the set
// on their progress drivers.
#include "process_sets/set_control.h"

#include <algorithm>

#include "runtime/submissions.h"

namespace shoal {
namespace {

[[noreturn]] void Refuse(int code, const std::string& msg) { throw ArgumentError(code, msg); }

}  // namespace

std::vector<SetVote> SetControl::Agree(SetVote& mine, std::string* what, int64_t* top) {
  mine.calls = sets_->NextCall();
  *what = mine.Call();
  ByteVec payload = EncodeVote(mine);
  const std::vector<int64_t> shape = {static_cast<int64_t>(payload.size())};
  shoal_op_desc d{};
  d.op = SHOAL_OP_ALLGATHER;
  d.name = kSetsAgreement;
  d.input = {payload.data(), SHOAL_UINT8, 1, shape.data(), SHOAL_DEVICE_CPU, 0, nullptr, nullptr};
  EntryPtr e;
  const Status st = host_->RunOp(d, &e);
  if (!st.ok()) Refuse(st.code, *what + " did not complete: " + st.message + kSetRule);
  std::vector<SetVote> votes = DecodeVotes(static_cast<const char*>(e->result), e->result_nbytes);
  if (static_cast<int>(votes.size()) != backend_->world().size) Refuse(SHOAL_ABORTED, *what + ": internal error: votes lost");
  *top = 0;
  for (auto& v : votes) *top = std::max(*top, v.calls);
  sets_->Agreed(*top);
  JudgeSetCalls(votes);
  return votes;
}

int32_t SetControl::Add(const std::vector<int>& ranks, const std::string& refusal) {
  auto one = sets_->BeginAgreement();
  SetVote mine;
  mine.kind = SetVote::kAdd;
  mine.ranks = ranks;
  std::sort(mine.ranks.begin(), mine.ranks.end());
  if (!refusal.empty()) mine.code = SHOAL_INVALID_TYPE, mine.refusal = refusal;
  std::string what;
  int64_t top = 0;
  Agree(mine, &what, &top);
  const int size = backend_->world().size;
  if (mine.ranks.empty()) Refuse(SHOAL_INVALID_ARGUMENT, what + ": a process set needs at least one rank");
  for (size_t i = 0; i < mine.ranks.size(); ++i) {
    const int r = mine.ranks[i];
    if (r < 0 || r >= size)
      Refuse(SHOAL_INVALID_ARGUMENT, what + ": rank " + std::to_string(r) + " is outside [0, " + std::to_string(size) + ")");
    if (i > 0 && mine.ranks[i - 1] == r) Refuse(SHOAL_INVALID_ARGUMENT, what + ": rank " + std::to_string(r) + " appears twice");
  }
  if (static_cast<int>(mine.ranks.size()) == size)
    Refuse(SHOAL_INVALID_ARGUMENT, what + ": these are the ranks of the global process set (id 0), which exists "
                                        "already (Horovod refuses duplicate process sets)");
  if (ProcessSetPtr same = sets_->WithRanks(mine.ranks))
    Refuse(SHOAL_INVALID_ARGUMENT, what + ": " + same->Describe() +
                                     " has these ranks already (Horovod refuses duplicate process sets)");
  const int32_t id = static_cast<int32_t>(top + 1);  // above every earlier id, the same on every rank
  const Status st = OnDriver([this, id, r = mine.ranks] { return MakeSet(id, r); });
  if (!st.ok()) Refuse(st.code, what + ": " + st.message);
  return id;
}

void SetControl::Remove(int32_t id, const std::string& refusal) {
  auto one = sets_->BeginAgreement();
  SetVote mine;
  mine.kind = SetVote::kRemove;
  mine.id = id;
  if (!refusal.empty()) mine.code = SHOAL_INVALID_TYPE, mine.refusal = refusal;
  mine.busy = submissions_->InFlightIn(id);
  std::string what;
  int64_t top = 0;
  const std::vector<SetVote> votes = Agree(mine, &what, &top);
  if (id == 0) Refuse(SHOAL_INVALID_ARGUMENT, what + ": the global process set cannot be removed");
  if (!sets_->Find(id)) Refuse(SHOAL_INVALID_ARGUMENT, what + ": no process set has id " + std::to_string(id));
  std::vector<int> busy;
  for (size_t r = 0; r < votes.size(); ++r)
    if (votes[r].busy > 0) busy.push_back(static_cast<int>(r));
  if (!busy.empty())
    Refuse(SHOAL_INVALID_ARGUMENT, what + ": ops of process set " + std::to_string(id) + " are in flight on " +
                                     RanksNamed(busy) + "; synchronize them first");
  const Status st = OnDriver([this, id] {
    DropSet(id);
    return Status::Ok();
  });
  if (!st.ok()) Refuse(st.code, what + ": " + st.message);
}

Status SetControl::OnDriver(std::function<Status()> job) {
  auto e = std::make_shared<Entry>();
  e->sig.op = kOpSetControl;
  e->name = "process_sets.control";
  {
    std::lock_guard<std::mutex> lock(jobs_mu_);
    jobs_[e.get()] = std::move(job);
  }
  const Status st = host_->RunOnDriver(e);  // drives the cycle that runs it, unless another thread does
  std::lock_guard<std::mutex> lock(jobs_mu_);
  jobs_.erase(e.get());  // not run: the runtime stopped first
  return st;
}

void SetControl::Run(const EntryPtr& e) {
  std::function<Status()> job;
  {
    std::lock_guard<std::mutex> lock(jobs_mu_);
    auto it = jobs_.find(e.get());
    if (it != jobs_.end()) {
      job = std::move(it->second);
      jobs_.erase(it);
    }
  }
  host_->Finish(e, job ? job() : Status::Error(SHOAL_ABORTED, "internal error: a process set step without its job"));
}

Status SetControl::MakeSet(int32_t id, const std::vector<int>& ranks) {
  auto s = std::make_shared<ProcessSet>();
  s->id = id;
  s->ranks = ranks;
  s->index = s->IndexOf(backend_->world().rank);
  if (s->index >= 0) {
    // Blocks until every member is here: they all agreed, and make their sets in one order.
    Status st = backend_->AddSet(id, ranks);
    if (!st.ok()) return st;
  }
  std::unique_ptr<Coordinator> coordinator;
  if (s->index == 0)
    coordinator = std::make_unique<Coordinator>(s->size(), fusion_threshold_, Backend::kSetChannels, ranks);
  sets_->Add(s, std::move(coordinator));
  return Status::Ok();
}

void SetControl::DropSet(int32_t id) {
  const ProcessSetPtr s = sets_->Find(id);
  if (!s) return;
  host_->EndSet(*s);
  if (s->index >= 0) backend_->RemoveSet(id);
  sets_->Remove(id);
  host_->ForgetSet(id);
}

}  // namespace shoal
