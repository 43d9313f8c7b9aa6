// The calls that queue ops (any thread): the checks of a call (describe.cc), then its name,
// step and handle (runtime/submissions.h); and the refusals at the call that its peers hear of.
#include <algorithm>

#include "runtime/runtime.h"

namespace shoal {

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
  if (d.op == kOpJoin) scheduler_.SetJoining(true);
  int64_t handle;
  try {
    handle = submissions_.Add(e, d.name, sets_.NegotiatedIn(e->set, e->sig.scope), cb, cb_arg);
  } catch (const ArgumentError&) {
    if (d.op == kOpJoin) scheduler_.SetJoining(false);  // refused (a name in flight): no join
    throw;
  }
  Start(lock, cb != nullptr);
  return handle;
}

void Runtime::Admissible(int op) const {
  if (Lost()) throw ArgumentError(SHOAL_RANK_LOST, std::string(OpName(op)) + ": " + kLostRank);
  if (stop_) throw ArgumentError(SHOAL_NOT_INITIALIZED, "Shoal is shutting down");
  if (left_) throw ArgumentError(SHOAL_ABORTED, "this rank has left the job (shoal.shutdown() or exit)");
  if (scheduler_.Joining())  // its peers run its part of their ops: it has no more data
    throw ArgumentError(op == kOpJoin ? SHOAL_DUPLICATE_NAME : SHOAL_INVALID_ARGUMENT,
                        std::string(OpName(op)) + ": this rank called join(), which is still in flight; it takes "
                                                  "part in no new ops until every rank has joined");
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
  std::vector<int64_t> handles =
      submissions_.AddGroup(members, gop, name, set, sets_.NegotiatedIn(set, members[0]->sig.scope), cb, cb_args);
  Start(lock, cb != nullptr);
  return handles;
}

void Runtime::Reject(int op, const char* name, int code, const std::string& error, int set, int scope) {
  // A grouped op's refusal (SHOAL_GROUPED | op) names the group.
  const int base = (op & SHOAL_GROUPED) ? op & ~SHOAL_GROUPED : op;
  if (!IsOpCode(base) || world().size == 1) return;
  ProcessSetPtr pset = set ? sets_.Find(set) : nullptr;
  if (set && (!pset || pset->index < 0 || pset->size() == 1)) return;  // nobody waits for this rank's call
  // Scope is allreduce's and broadcast's (Describe); with machine scope, the machine's ranks
  // wait. Not with a process set: Describe refuses the pair, and the set's members wait.
  if (set != 0 || (base != SHOAL_OP_ALLREDUCE && base != SHOAL_OP_BROADCAST)) scope = SHOAL_SCOPE_WORLD;
  std::unique_lock<std::mutex> lock(mu_);
  if (stop_ || left_) return;
  if (!submissions_.Refuse(op, name, sets_.NegotiatedIn(set, scope), code, error, pset, scope)) return;
  if (driving_) return;
  if (waiters_ > 0) done_cv_.notify_all();
  else Drive(lock, nullptr, nullptr);
}

void Runtime::AfterStage(const EntryPtr& done, const EntryPtr& next, const Status& failed,
                         const std::vector<EntryPtr>& later) {
  std::lock_guard<std::mutex> lock(mu_);
  submissions_.Release(done->handle);
  if (next) {
    submissions_.AddStage(next);
  } else {
    if (failed.ok() || stop_ || left_) return;
    for (auto& s : later) submissions_.RefuseNamed(s->sig.op, s->name, failed.code, failed.message, s->sig.scope);
  }
  if (!driving_) work_cv_.notify_one();
}

// SetControl::Host: a process-set change runs as ops of this rank (the agreement), then as an
// op of the runtime's own on the driver.
Status Runtime::RunOp(const shoal_op_desc& d, EntryPtr* e) {
  const int64_t h = Enqueue(d);
  const Status st = Wait(h);
  *e = submissions_.Find(h);
  submissions_.Release(h);
  return st;
}

Status Runtime::RunOnDriver(const EntryPtr& e) {
  int64_t handle;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_ || left_) return Status::Error(SHOAL_ABORTED, "Shoal is shutting down");
    handle = submissions_.AddOwn(e);
  }
  work_cv_.notify_one();
  Status st = Wait(handle);  // drives the cycle that runs it, unless another thread does
  submissions_.Release(handle);
  return st;
}

}  // namespace shoal
