#include "runtime/submissions.h"

#include <algorithm>

namespace shoal {
namespace {

// Handles are unique for the whole process, across init/shutdown cycles.
std::atomic<int64_t> g_next_handle{1};

ArgumentError Duplicate(int op, const std::string& name) {
  return ArgumentError(SHOAL_DUPLICATE_NAME, std::string(OpName(op)) + ": an op named '" + name +
                                                 "' is already in flight on this rank; wait for it or use another name");
}

}  // namespace

int64_t Submissions::Add(const EntryPtr& e, const char* name, int negotiated, shoal_callback cb, void* cb_arg) {
  MutexLock lock(mu_);
  const int op = e->sig.op;
  e->name = names_.Name(op, name, negotiated);
  if (e->set) e->set_key = SetKey(e->set, e->name);
  NameState& ns = names_[e->key()];
  if (ns.in_flight) throw Duplicate(op, e->name);
  ns.in_flight = true;
  ns.last_use = names_.Use();
  if (op == SHOAL_OP_HIERARCHICAL_NEIGHBOR_ALLREDUCE) ns.staged = true;
  Register(e, cb, cb_arg);
  if (ns.frozen) {
    names_.Hold(e);  // numbered at the commit of the vote that froze its name
  } else {
    e->step = ns.calls++;
    Push(e);
  }
  return e->handle;
}

std::vector<int64_t> Submissions::AddGroup(const std::vector<EntryPtr>& members, int gop, const char* name, int set,
                                           int negotiated, shoal_callback cb, void* const* cb_args) {
  MutexLock lock(mu_);
  const int n = static_cast<int>(members.size()), op = gop & ~SHOAL_GROUPED;
  const std::string group = names_.Name(gop, name, negotiated);
  const std::string group_key = set ? SetKey(set, group) : group;  // in the per-name tables
  NameState& gs = names_[group_key];
  if (gs.in_flight) throw Duplicate(gop, group);
  for (int i = 0; i < n; ++i) {
    members[i]->name = MemberName(group, i);
    if (set) members[i]->set_key = SetKey(set, members[i]->name);
    const NameState* ns = names_.Find(members[i]->key());
    if (ns && ns->in_flight) throw Duplicate(op, members[i]->name);
  }
  // A name frozen for retirement as a single op's (grouped names never are): the whole
  // group waits for the commit (Thaw numbers it then).
  bool hold = gs.frozen;
  for (int i = 0; i < n; ++i) {
    const NameState* ns = names_.Find(members[i]->key());
    hold |= ns && ns->frozen;
  }
  gs.in_flight = gs.grouped = true;
  gs.members_left = n;
  gs.last_use = names_.Use();
  const int64_t step = hold ? -1 : gs.calls++;
  std::vector<int64_t> handles;
  for (int i = 0; i < n; ++i) {
    const EntryPtr& e = members[i];
    NameState& ns = names_[e->key()];
    ns.in_flight = ns.grouped = true;
    e->group = group_key;
    e->group_index = i;
    e->group_size = n;
    Register(e, cb, cb_args ? cb_args[i] : nullptr);
    if (hold) {
      names_.Hold(e);
    } else {
      e->step = ns.calls++;
      e->group_step = step;
      Push(e);
    }
    handles.push_back(e->handle);
  }
  return handles;
}

int64_t Submissions::AddOwn(const EntryPtr& e) {
  MutexLock lock(mu_);
  Register(e, nullptr, nullptr);
  queue_.push_back(e);
  queued_ = queue_.size();
  return e->handle;
}

void Submissions::AddStage(const EntryPtr& e) {
  MutexLock lock(mu_);
  Stage(e);
}

void Submissions::Stage(const EntryPtr& e) {
  NameState& ns = names_[e->name];
  ns.in_flight = true;
  ns.stage = true;  // retired with its op's name only
  e->step = ns.calls++;
  Register(e, nullptr, nullptr);
  queue_.push_back(e);
  queued_ = queue_.size();
}

void Submissions::Register(const EntryPtr& e, shoal_callback cb, void* cb_arg) {
  e->callback = cb;
  e->callback_arg = cb_arg;
  e->handle = g_next_handle++;
  handles_[e->handle].entry = e;
}

void Submissions::Push(const EntryPtr& e) {
  if (e->sig.op == SHOAL_OP_HIERARCHICAL_NEIGHBOR_ALLREDUCE) {
    Stage(stages_->Start(e));  // the op completes after its last stage
  } else {
    queue_.push_back(e);
    queued_ = queue_.size();
  }
}

bool Submissions::Refuse(int op, const char* name, int negotiated, int code, const std::string& error,
                         const ProcessSetPtr& pset, int scope) {
  MutexLock lock(mu_);
  const std::string full = names_.Name(op, name, negotiated);
  if (op != SHOAL_OP_HIERARCHICAL_NEIGHBOR_ALLREDUCE) return RefuseLocked(op, full, code, error, pset, scope);
  NameState& ns = names_[full];
  if (ns.in_flight) return false;
  ns.staged = true;  // its stages' names are retired with it
  ns.last_use = names_.Use();
  ++(ns.frozen ? ns.held_calls : ns.calls);  // the stages' refusals below carry the steps
  for (auto& [stage, suffix, stage_scope] : kHierarchicalStages) {
    RefuseLocked(stage, full + suffix, code, error, nullptr, stage_scope);
    names_[full + suffix].stage = true;
  }
  return true;
}

bool Submissions::RefuseNamed(int op, const std::string& name, int code, const std::string& error, int scope) {
  MutexLock lock(mu_);
  return RefuseLocked(op, name, code, error, nullptr, scope);
}

bool Submissions::RefuseLocked(int op, const std::string& name, int code, const std::string& error,
                               const ProcessSetPtr& pset, int scope) {
  auto e = std::make_shared<Entry>();
  e->sig.op = op;
  e->sig.scope = scope;  // which coordinator hears of it
  e->name = name;
  if (pset) {
    e->set = pset->id;
    e->pset = pset;
    e->set_key = SetKey(e->set, name);
  }
  NameState& ns = names_[e->key()];
  if (ns.in_flight) return false;  // the call is refused as a duplicate: it is not this step's
  e->reject = error;
  // A refusal at the call is a ValueError or TypeError everywhere; a failed earlier stage
  // of a multi-stage op is a runtime failure (ShoalError) on the ranks waiting in later ones.
  e->reject_code = code == SHOAL_INVALID_TYPE || code == SHOAL_ABORTED ? code : SHOAL_INVALID_ARGUMENT;
  e->done = true;
  ns.last_use = names_.Use();
  if (ns.frozen) {
    names_.Hold(e);
    return true;
  }
  e->step = ns.calls++;
  queue_.push_back(e);
  queued_ = queue_.size();
  return true;
}

void Submissions::Take(std::vector<EntryPtr>* fresh) {
  fresh->clear();
  MutexLock lock(mu_);
  fresh->swap(queue_);
  queued_ = 0;
}

bool Submissions::Complete(const EntryPtr& e, const Status& st) {
  MutexLock lock(mu_);
  if (e->done) return false;
  e->status = st;
  e->done = true;
  if (NameState* ns = names_.Find(e->key())) ns->in_flight = false;
  if (!e->group.empty()) {  // the group's name is free once every member is done
    NameState* gs = names_.Find(e->group);
    if (gs && --gs->members_left <= 0) gs->in_flight = false;
  }
  return true;
}

std::vector<EntryPtr> Submissions::TakeUnfinished() {
  std::vector<EntryPtr> pending;
  MutexLock lock(mu_);
  for (auto& kv : handles_)
    if (!kv.second.entry->done) pending.push_back(kv.second.entry);
  for (auto& e : queue_)
    if (!e->done) pending.push_back(e);
  queue_.clear();
  queued_ = 0;
  return pending;
}

int64_t Submissions::NextHandle() { return g_next_handle; }

EntryPtr Submissions::Find(int64_t handle) {
  MutexLock lock(mu_);
  auto it = handles_.find(handle);
  return it == handles_.end() ? nullptr : it->second.entry;
}

bool Submissions::Attach(int64_t handle, Attached* a) {
  Attached before;  // dropped after the lock
  MutexLock lock(mu_);
  auto it = handles_.find(handle);
  if (it == handles_.end()) return false;
  before = std::move(it->second.attached);
  it->second.attached = std::move(*a);
  return true;
}

void* Submissions::AttachedTo(int64_t handle) {
  MutexLock lock(mu_);
  auto it = handles_.find(handle);
  return it == handles_.end() ? nullptr : it->second.attached.data();
}

int Submissions::Poll(int64_t handle) {
  const EntryPtr e = Find(handle);
  if (!e) return -SHOAL_UNKNOWN_HANDLE;
  return e->done ? 1 : 0;
}

int Submissions::InUse(int64_t handle) {
  const EntryPtr e = Find(handle);
  if (!e) return -SHOAL_UNKNOWN_HANDLE;
  return !e->done || (e->direct_sends && e->sends_pending > 0) ? 1 : 0;  // done first: it orders the rest
}

void* Submissions::Detach(int64_t handle) {
  MutexLock lock(mu_);
  auto it = handles_.find(handle);
  if (it == handles_.end()) return nullptr;
  Attached& a = it->second.attached;
  a.Disown();
  void* data = a.data();
  a = Attached();
  return data;
}

bool Submissions::Release(int64_t handle) {
  Attached attached;  // dropped after the lock
  MutexLock lock(mu_);
  auto it = handles_.find(handle);
  if (it == handles_.end()) return false;
  attached = std::move(it->second.attached);
  handles_.erase(it);
  return true;
}

size_t Submissions::HandleCount() {
  MutexLock lock(mu_);
  return handles_.size();
}

int Submissions::InFlightIn(int set) {
  MutexLock lock(mu_);
  int n = 0;
  for (auto& kv : handles_) n += kv.second.entry->set == set && !kv.second.entry->done;
  return n;
}

int64_t Submissions::CountCall(const std::string& name, int op) {
  // The op counts as this rank's call of the name: its step, and for an unnamed op the
  // generated-name counter, stay those of the ranks that ran it, so the ops after the
  // join pair up again.
  MutexLock lock(mu_);
  const int64_t step = names_[name].calls++;
  names_.FollowUnnamed(op, name);
  return step;
}

bool Submissions::Idle() {
  MutexLock lock(mu_);
  return !names_.Holding() && queue_.empty();
}

bool Submissions::Routed(const std::string& key, int64_t step) {
  MutexLock lock(mu_);
  const NameState* ns = names_.Find(key);
  const bool queued =
      std::any_of(queue_.begin(), queue_.end(), [&](const EntryPtr& q) { return q->key() == key && q->step == step; });
  return ns && ns->calls > step && !queued;
}

void Submissions::Propose(const Entry& e, const std::function<bool(const std::string&)>& busy, Request* req) {
  MutexLock lock(mu_);
  names_.Propose(e, busy, req);
}

bool Submissions::Vote(const Response& r, Request* vote) {
  MutexLock lock(mu_);
  return names_.Vote(r, vote);
}

NameTable::Thawed Submissions::Thaw(int set, const std::set<std::string>& gone) {
  MutexLock lock(mu_);
  NameTable::Thawed out = names_.Thaw(set, gone);
  for (auto& e : out.calls) Push(e);
  return out;
}

std::vector<int> Submissions::VotingSets() {
  MutexLock lock(mu_);
  return names_.VotingSets();
}

bool Submissions::Voting(int set) {
  MutexLock lock(mu_);
  return names_.Voting(set);
}

bool Submissions::Voting() {
  MutexLock lock(mu_);
  return names_.Voting();
}

void Submissions::Forget(int set) {
  MutexLock lock(mu_);
  names_.Forget(set);
}

size_t Submissions::NameCount() {
  MutexLock lock(mu_);
  return names_.size();
}

}  // namespace shoal
