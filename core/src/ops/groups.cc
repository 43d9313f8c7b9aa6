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

#include "ops/groups.h"

#include "negotiation/negotiation.h"
#include "ops/collectives.h"

namespace shoal {

void GroupedOps::Route(const EntryPtr& e, std::vector<Request>* to_coordinator) {
  std::vector<EntryPtr>& parts = groups_[e->group];
  if (parts.empty()) parts.resize(e->group_size);
  parts[e->group_index] = e;
  if (std::any_of(parts.begin(), parts.end(), [](const EntryPtr& p) { return !p; })) return;
  const std::string group = e->group;  // its key in the per-name tables
  const std::string shown = parts[0]->name.substr(0, parts[0]->name.rfind('['));  // the group's own name
  const int gop = SHOAL_GROUPED | e->sig.op;
  const int set = sets_->NegotiatedIn(e->set, e->sig.scope);
  // A refusal of this call on another rank, or a rank of its set that left: every member fails.
  const Status st = negotiation_->Unrunnable(group, e->group_step, set, gop, shown);
  if (!st.ok()) {
    std::vector<EntryPtr> members = std::move(parts);
    groups_.erase(group);
    for (auto& m : members) host_->Finish(m, st);
    return;
  }
  negotiation_->Await(group, parts[0]);
  Request req;
  req.set = set;
  req.name = shown;
  req.sig.op = gop;
  req.step = e->group_step;
  for (auto& m : parts) req.members.push_back(m->sig);
  to_coordinator->push_back(std::move(req));
}

void GroupedOps::Expand(const EntryPtr& e, std::vector<EntryPtr>* out) {
  auto it = e->group.empty() ? groups_.end() : groups_.find(e->group);
  if (it == groups_.end()) {
    out->push_back(e);
    return;
  }
  for (auto& m : it->second)
    if (m) out->push_back(m);
  groups_.erase(it);
}

void GroupedOps::Run(const Response& r, std::vector<EntryPtr> members) {
  size_t total = 0;
  for (int32_t c : r.chunks) total += c > 0 ? static_cast<size_t>(c) : members.size() + 1;
  if (members.empty() || total != members.size()) {
    Log(LOG_ERROR, "coordinator scheduled a group this rank does not have as it is: " + r.names[0]);
    for (auto& e : members) host_->Finish(e, Status::Error(SHOAL_ABORTED, "internal error: inconsistent schedule"));
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
    collectives_->Run(sub, std::move(batch));
  }
}

}  // namespace shoal
