// The calls that queue ops (any thread): the checks of a call (describe.cc), its name and
// step (negotiation/names.h), its handle; and the refusals at the call that its peers hear of.
#include <algorithm>
#include <atomic>

#include "runtime/runtime.h"

namespace shoal {
namespace {

// Handles are unique for the whole process, across init/shutdown cycles.
std::atomic<int64_t> g_next_handle{1};

}  // namespace

int64_t Runtime::Enqueue(const shoal_op_desc& d, shoal_callback cb, void* cb_arg) {
  if (!IsOpCode(d.op) && d.op != kOpJoin) Bad("unknown op code " + std::to_string(d.op));
  // A call in no set of this rank's is refused before the try: nobody waits for it.
  const ProcessSetPtr pset = CallSet(d);
  EntryPtr e;
  try {
    e = Describe(d, pset);
  } catch (const ArgumentError& ex) {
    Reject(d.op, d.name, ex.code, ex.what(), d.process_set, d.scope);
    throw;
  }
  // Last, after validation: marks the point the producer reached on the caller's stream.
  if (d.op != SHOAL_OP_BARRIER && d.input.device_type == SHOAL_DEVICE_CUDA) e->gpu = CaptureGpuOp(d, e->nbytes());
  std::unique_lock<std::mutex> lock(mu_);
  Admissible(d.op);
  if (d.op == kOpJoin && !sets_.Empty())
    throw ArgumentError(SHOAL_INVALID_ARGUMENT, "join: not supported while process sets other than the global one "
                                                "exist (remove_process_set them first)");
  if (d.op == kOpJoin) join_.SetInFlight(true);
  e->name = names_.Name(d.op, d.name, sets_.NegotiatedIn(e->set, e->sig.scope));
  if (e->set) e->set_key = SetKey(e->set, e->name);
  NameState& ns = names_[e->key()];
  if (ns.in_flight) throw Duplicate(d.op, e->name);
  ns.in_flight = true;
  ns.last_use = names_.Use();
  if (d.op == SHOAL_OP_HIERARCHICAL_NEIGHBOR_ALLREDUCE) ns.staged = true;
  Register(e, cb, cb_arg);
  if (ns.frozen) {
    names_.Hold(e);  // numbered at the commit of the vote that froze its name
  } else {
    e->step = ns.calls++;
    Push(e);
  }
  const int64_t handle = e->handle;
  Start(lock, cb != nullptr);
  return handle;
}

void Runtime::Admissible(int op) const {
  if (Lost()) throw ArgumentError(SHOAL_RANK_LOST, std::string(OpName(op)) + ": " + kLostRank);
  if (stop_) throw ArgumentError(SHOAL_NOT_INITIALIZED, "Shoal is shutting down");
  if (left_) throw ArgumentError(SHOAL_ABORTED, "this rank has left the job (shoal.shutdown() or exit)");
  if (join_.InFlight())  // its peers run its part of their ops: it has no more data
    throw ArgumentError(op == kOpJoin ? SHOAL_DUPLICATE_NAME : SHOAL_INVALID_ARGUMENT,
                        std::string(OpName(op)) + ": this rank called join(), which is still in flight; it takes "
                                                  "part in no new ops until every rank has joined");
}

ArgumentError Runtime::Duplicate(int op, const std::string& name) {
  return ArgumentError(SHOAL_DUPLICATE_NAME, std::string(OpName(op)) + ": an op named '" + name +
                                                 "' is already in flight on this rank; wait for it or use another name");
}

void Runtime::Queue(const EntryPtr& e, shoal_callback cb, void* cb_arg) {
  Register(e, cb, cb_arg);
  Push(e);
}

void Runtime::Register(const EntryPtr& e, shoal_callback cb, void* cb_arg) {
  e->callback = cb;
  e->callback_arg = cb_arg;
  e->handle = g_next_handle++;
  handles_[e->handle] = e;
}

void Runtime::Push(const EntryPtr& e) {
  if (e->sig.op == SHOAL_OP_HIERARCHICAL_NEIGHBOR_ALLREDUCE) {
    QueueLocked(stages_.Start(e));  // the op completes after its last stage
  } else {
    queue_.push_back(e);
    queued_ = queue_.size();
  }
}

std::vector<int64_t> Runtime::EnqueueGroup(const char* name, const shoal_op_desc* descs, int n, shoal_callback cb,
                                           void* const* cb_args) {
  const int op = n > 0 && descs ? descs[0].op : SHOAL_OP_ALLREDUCE;
  const int gop = SHOAL_GROUPED | op;
  const std::string what = OpName(gop);
  std::vector<EntryPtr> members;
  const int set = n > 0 && descs ? descs[0].process_set : 0;
  const ProcessSetPtr pset = n > 0 && descs ? CallSet(descs[0], what.c_str()) : nullptr;  // no set of this rank's: nobody waits
  try {
    if (n < 1 || !descs) Bad(what + ": no tensors to run");
    if (op != SHOAL_OP_ALLREDUCE && op != SHOAL_OP_ALLGATHER && op != SHOAL_OP_REDUCESCATTER)
      Bad("op code " + std::to_string(op) + " has no grouped form (allreduce, allgather or reducescatter)");
    for (int i = 0; i < n; ++i) {
      const shoal_op_desc& d = descs[i];
      if (d.op != op || d.reduce_op != descs[0].reduce_op || d.scope != descs[0].scope || d.process_set != set)
        Bad(what + ": tensor " + std::to_string(i) + " is given another op, reduce op, scope or process set than "
                   "tensor 0");
      try {
        members.push_back(Describe(d, pset));
      } catch (const ArgumentError& ex) {
        throw ArgumentError(ex.code, what + ": tensor " + std::to_string(i) + ": " + ex.what());
      }
    }
  } catch (const ArgumentError& ex) {
    Reject(gop, name, ex.code, ex.what(), set, descs ? descs[0].scope : 0);  // every rank that submits the group gets it too
    throw;
  }
  for (int i = 0; i < n; ++i)
    if (descs[i].input.device_type == SHOAL_DEVICE_CUDA) members[i]->gpu = CaptureGpuOp(descs[i], members[i]->nbytes());
  std::unique_lock<std::mutex> lock(mu_);
  Admissible(gop);
  const std::string group = names_.Name(gop, name, sets_.NegotiatedIn(set, members[0]->sig.scope));
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
  Start(lock, cb != nullptr);
  return handles;
}

void Runtime::Reject(int op, const char* name, int code, const std::string& error, int set, int scope) {
  // A grouped op's refusal (SHOAL_GROUPED | op) names the group.
  const int base = (op & SHOAL_GROUPED) ? op & ~SHOAL_GROUPED : op;
  if (!IsOpCode(base) || world().size == 1) return;
  ProcessSetPtr pset = set ? FindSet(set) : nullptr;
  if (set && (!pset || pset->index < 0 || pset->size() == 1)) return;  // nobody waits for this rank's call
  // Scope is allreduce's and broadcast's (Describe); with machine scope, the machine's ranks
  // wait. Not with a process set: Describe refuses the pair, and the set's members wait.
  if (set != 0 || (base != SHOAL_OP_ALLREDUCE && base != SHOAL_OP_BROADCAST)) scope = SHOAL_SCOPE_WORLD;
  std::unique_lock<std::mutex> lock(mu_);
  if (stop_ || left_) return;
  const std::string full = names_.Name(op, name, sets_.NegotiatedIn(set, scope));
  if (op != SHOAL_OP_HIERARCHICAL_NEIGHBOR_ALLREDUCE) {
    if (!RejectLocked(op, full, code, error, pset, scope)) return;
  } else {
    NameState& ns = names_[full];
    if (ns.in_flight) return;
    ns.staged = true;  // its stages' names are retired with it
    ns.last_use = names_.Use();
    ++(ns.frozen ? ns.held_calls : ns.calls);  // the stages' refusals below carry the steps
    for (auto& [stage, suffix, stage_scope] : kHierarchicalStages) {
      RejectLocked(stage, full + suffix, code, error, nullptr, stage_scope);
      names_[full + suffix].stage = true;
    }
  }
  if (driving_) return;
  if (waiters_ > 0) done_cv_.notify_all();
  else Drive(lock, nullptr, nullptr);
}

bool Runtime::RejectLocked(int op, const std::string& name, int code, const std::string& error,
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

void Runtime::AfterStage(const EntryPtr& done, const EntryPtr& next, const Status& failed,
                         const std::vector<EntryPtr>& later) {
  std::lock_guard<std::mutex> lock(mu_);
  handles_.erase(done->handle);
  if (next) {
    QueueLocked(next);
  } else {
    if (failed.ok() || stop_ || left_) return;
    for (auto& s : later) RejectLocked(s->sig.op, s->name, failed.code, failed.message, nullptr, s->sig.scope);
  }
  if (!driving_) work_cv_.notify_one();
}

void Runtime::QueueLocked(const EntryPtr& e) {
  NameState& ns = names_[e->name];
  ns.in_flight = true;
  ns.stage = true;  // retired with its op's name only
  e->step = ns.calls++;
  Register(e, nullptr, nullptr);
  queue_.push_back(e);
  queued_ = queue_.size();
}

}  // namespace shoal
