// Grouped ops (Horovod's grouped_allreduce, grouped_allgather, grouped_reducescatter): a
// list of ops negotiated as one unit. The members are enqueued together under the group's
// name and routed as their data gets ready (CUDA tensors are staged first); once every
// member is here, the group goes to the coordinator as one request carrying every
// member's signature. The coordinator validates it as a whole (Coordinator::ValidateGroup)
// and answers with one response: every member runs, consecutive allreduce members fused
// into the collectives the response's chunks name, or every member fails with the same
// error on every rank. Errors for the group (a refusal at the call on some rank, a stall,
// a rank that left) name the group and fail each of its members.
#include <algorithm>

#include "runtime/runtime.h"

namespace shoal {

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

void Runtime::RouteGroupMember(const EntryPtr& e, std::vector<Request>* to_coordinator) {
  std::vector<EntryPtr>& parts = groups_[e->group];
  if (parts.empty()) parts.resize(e->group_size);
  parts[e->group_index] = e;
  if (std::any_of(parts.begin(), parts.end(), [](const EntryPtr& p) { return !p; })) return;
  const std::string group = e->group;  // its key in the per-name tables
  const std::string shown = parts[0]->name.substr(0, parts[0]->name.rfind('['));  // the group's own name
  const int gop = SHOAL_GROUPED | e->sig.op;
  // A refusal of this call on another rank, or a rank of its set that left: every member fails.
  Status st;
  auto rej = rejections_.find(group);
  if (rej != rejections_.end() && rej->second.step == e->group_step) {
    st = Status::Error(rej->second.code, rej->second.error);
    rejections_.erase(rej);
  } else if (departures_.Any()) {
    const std::vector<int> gone = departures_.Members(SetOf(sets_.NegotiatedIn(e->set, e->sig.scope)));
    if (!gone.empty()) st = Status::Error(SHOAL_ABORTED, OpError(gop, shown, Departures::Describe(gone)));
  }
  if (!st.ok()) {
    std::vector<EntryPtr> members = std::move(parts);
    groups_.erase(group);
    for (auto& m : members) Finish(m, st);
    return;
  }
  awaiting_response_[group] = parts[0];
  Request req;
  req.set = sets_.NegotiatedIn(e->set, e->sig.scope);
  req.name = shown;
  req.sig.op = gop;
  req.step = e->group_step;
  for (auto& m : parts) req.members.push_back(m->sig);
  to_coordinator->push_back(std::move(req));
}

void Runtime::ExpandGroup(const EntryPtr& e, std::vector<EntryPtr>* out) {
  auto it = e->group.empty() ? groups_.end() : groups_.find(e->group);
  if (it == groups_.end()) {
    out->push_back(e);
    return;
  }
  for (auto& m : it->second)
    if (m) out->push_back(m);
  groups_.erase(it);
}

void Runtime::RunGroup(const Response& r, std::vector<EntryPtr> members) {
  size_t total = 0;
  for (int32_t c : r.chunks) total += c > 0 ? static_cast<size_t>(c) : members.size() + 1;
  if (members.empty() || total != members.size()) {
    Log(LOG_ERROR, "coordinator scheduled a group this rank does not have as it is: " + r.names[0]);
    for (auto& e : members) Finish(e, Status::Error(SHOAL_ABORTED, "internal error: inconsistent schedule"));
    return;
  }
  const auto now = Clock::now();
  Response sub;
  sub.op = r.op & ~SHOAL_GROUPED;
  sub.set = r.set;
  size_t at = 0;
  for (int32_t c : r.chunks) {
    std::vector<EntryPtr> batch(members.begin() + at, members.begin() + at + c);
    sub.names.clear();
    for (auto& e : batch) {
      sub.names.push_back(e->name);
      if (e->t_negotiated == Clock::time_point{}) e->t_negotiated = now;
    }
    sub.first_dims.clear();
    if (at < r.first_dims.size() && !r.first_dims[at].empty()) sub.first_dims = {r.first_dims[at]};
    at += c;
    RunCollective(sub, std::move(batch));
  }
}

void Runtime::JoinedGroup(const Response& r, std::vector<EntryPtr>* batch) {
  if (std::find(r.joined.begin(), r.joined.end(), world().rank) == r.joined.end()) return;
  const std::string& group = r.names[0];
  {
    std::lock_guard<std::mutex> lock(mu_);  // the group counts as this rank's call (JoinedEntry)
    ++names_[group].calls;
    names_.FollowUnnamed(r.op, group);
  }
  for (size_t i = 0; i < r.sigs.size(); ++i) batch->push_back(IdentityEntry(MemberName(group, static_cast<int>(i)), r.sigs[i]));
}

}  // namespace shoal
