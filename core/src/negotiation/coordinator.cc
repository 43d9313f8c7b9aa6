#include "negotiation/coordinator.h"

#include <algorithm>
#include <functional>
#include <sstream>
#include <tuple>


namespace shoal {

void Coordinator::Add(int rank, const Request& req, double now) {
  if (!req.reject.empty()) {
    // One rank refused the call: the ranks that submitted it, or will, get its error. Ranks
    // that refused the same call too may already wait in the name's next step: that stays.
    // A neighbor's dispute (neighbor/neighbor_exchange.h): the first one of a step only. A
    // refusal passed on (a hierarchical op's later stages'): where it was raised, as it was.
    const bool dispute = req.reject_code == SHOAL_NEIGHBOR_MISMATCH;
    auto old = rejected_.find(req.name);
    if (dispute && old != rejected_.end() && old->second.r.step == req.step) return;
    const char* at = dispute ? " (found by rank " : " (raised at the call on rank ";
    const std::string error = req.reject.find(at) != std::string::npos ? req.reject
                                                                        : req.reject + at + std::to_string(World(rank)) + ")";
    auto it = pending_.find(req.name);
    const bool later = it != pending_.end() && std::any_of(it->second.req.begin(), it->second.req.end(), [&](auto& x) {
      return !x.name.empty() && x.step != req.step;
    });
    std::vector<int> past = {rank};  // and the ranks told now, or in a later step
    for (int q = 0; it != pending_.end() && q < size_; ++q)
      if (it->second.have[q] && (!later || it->second.req[q].step != req.step)) past.push_back(q);
    Response r = later ? Response{} : Abort(req.name, error);
    r.names = {req.name};
    r.error = error;
    r.kind = Response::REJECTED;
    r.op = req.sig.op;
    r.step = req.step;
    r.code = req.reject_code;
    if (!rejected_.count(req.name)) rejected_order_.push_back(req.name);
    Refusal& f = rejected_[req.name];
    if (f.past.empty() || f.r.step != req.step) f = Refusal{r, std::vector<char>(size_, 0), 0};
    f.r = r;
    if (rejected_order_.size() > 1024) {
      rejected_.erase(rejected_order_.front());
      rejected_order_.erase(rejected_order_.begin());
    }
    early_.push_back(std::move(r));
    for (int q : past) Past(req.name, q);
    return;
  }
  if (!req.retire.empty() && req.sig.op != kOpRetire) Propose(rank, req);
  if (req.probe) {
    auto done = rounds_done_.find(req.name);
    auto it = pending_.find(req.name);
    if (!left_.empty() || (done != rounds_done_.end() && done->second >= req.step) ||
        (it != pending_.end() && !it->second.probe))
      return;  // that round is over (the op came normally: its batch died)
    if (it != pending_.end()) {
      const Request& first = *std::find_if(it->second.req.begin(), it->second.req.end(),
                                           [](const Request& q) { return !q.name.empty(); });
      if (first.step > req.step) return;            // a stale probe
      if (first.step < req.step) pending_.erase(it);  // that step is over where this one waits
    }
  } else {
    auto it = pending_.find(req.name);
    if (it != pending_.end() && it->second.probe) pending_.erase(it);  // its round is over
  }
  auto rej = rejected_.find(req.name);
  if (rej != rejected_.end() && rej->second.r.step == req.step) {
    early_.push_back(rej->second.r);
    Past(req.name, rank);
    return;
  }
  if (!left_.empty()) {
    Response r;
    r.kind = Response::LEFT;
    r.op = req.sig.op;
    r.names = {req.name};
    r.error = LeftError(req.name, req.sig.op);
    early_.push_back(std::move(r));
    return;
  }
  if (req.sig.op == kOpJoin) return AddJoin(rank, req);
  auto it = pending_.find(req.name);
  if (it == pending_.end()) {
    Pending p;
    p.req.resize(size_);
    p.have.assign(size_, false);
    p.first_seen = now;
    p.probe = req.probe;
    p.vote = req.sig.op == kOpRetire;
    it = pending_.emplace(req.name, std::move(p)).first;
  }
  Pending& p = it->second;
  if (p.have[rank]) return;  // enqueue rejects duplicates; ignore a replay
  p.have[rank] = true;
  p.req[rank] = req;
  ++p.count;
  if (!Ready(p)) return;
  if (p.probe) {
    pending_.erase(it);  // every rank is in the round (or joined): it is completing
  } else {
    p.complete = true;
    complete_.push_back(req.name);
  }
}

bool Coordinator::Ready(const Pending& p) const {
  if (p.count == size_) return true;
  if (num_joined_ == 0 || p.vote) return false;
  for (int r = 0; r < size_; ++r)
    if (!p.have[r] && !joined_[r]) return false;
  return true;
}

void Coordinator::AddJoin(int rank, const Request& req) {
  if (joined_.empty()) joined_.assign(size_, 0);
  if (joined_[rank]) return;  // a replay
  joined_[rank] = 1;
  ++num_joined_;
  last_joined_ = rank;
  join_name_ = req.name;
  // The rank's requests came before its join: what waited only for it is complete now.
  for (auto it = pending_.begin(); it != pending_.end();) {
    Pending& p = it->second;
    if (!p.complete && Ready(p)) {
      if (p.probe) {
        it = pending_.erase(it);
        continue;
      }
      p.complete = true;
      complete_.push_back(it->first);
    }
    ++it;
  }
}

std::vector<std::string> Coordinator::Agreed(const std::vector<const Request*>& lists) const {
  if (!left_.empty() || num_joined_ > 0) return {};
  std::vector<std::string> agreed;
  const Request& first = *lists[0];
  for (size_t i = 0; i < first.retire.size(); ++i) {
    const std::string& n = first.retire[i];
    bool all = !pending_.count(n);
    for (size_t r = 1; r < lists.size() && all; ++r) {
      const Request& q = *lists[r];
      auto at = std::lower_bound(q.retire.begin(), q.retire.end(), n);
      all = at != q.retire.end() && *at == n && q.retire_calls[at - q.retire.begin()] == first.retire_calls[i];
    }
    if (all) agreed.push_back(n);
  }
  return agreed;
}

void Coordinator::Propose(int rank, const Request& req) {
  if (proposals_.empty()) proposals_.resize(size_);
  if (proposals_[rank].retire.empty()) ++num_proposals_;
  proposals_[rank].retire = req.retire;
  proposals_[rank].retire_calls = req.retire_calls;
  if (num_proposals_ < size_) return;
  std::vector<const Request*> lists;
  for (auto& q : proposals_) lists.push_back(&q);
  Response r;
  r.op = kOpRetire;
  r.set = req.set;
  r.retired = Agreed(lists);
  proposals_.clear();
  num_proposals_ = 0;
  early_.push_back(std::move(r));
}

void Coordinator::Past(const std::string& name, int rank) {
  auto it = rejected_.find(name);
  if (it == rejected_.end() || it->second.past[rank]) return;
  it->second.past[rank] = 1;
  if (++it->second.count < size_) return;
  rejected_.erase(it);
  rejected_order_.erase(std::find(rejected_order_.begin(), rejected_order_.end(), name));
}

void Coordinator::RoundDone(const std::string& name, int64_t step) {
  rounds_done_[name] = step;
  auto it = pending_.find(name);
  if (it != pending_.end() && it->second.probe) pending_.erase(it);
}

namespace {

// "<value> on rank 0, 2; <value> on rank 1" when `field` differs, else "" (`world`: the
// world rank of each index, empty for the identity).
std::string Differences(const std::vector<Request>& req,
                        const std::function<std::string(const Request&)>& field, const std::vector<int>& world) {
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (int r = 0; r < static_cast<int>(req.size()); ++r) {
    if (req[r].name.empty()) continue;  // a rank that joined instead
    std::string v = field(req[r]);
    auto g = std::find_if(groups.begin(), groups.end(),
                          [&](const auto& x) { return x.first == v; });
    const int who = world.empty() ? r : world[r];
    if (g == groups.end()) groups.push_back({v, {who}});
    else g->second.push_back(who);
  }
  if (groups.size() == 1) return "";
  std::string s;
  for (size_t i = 0; i < groups.size(); ++i)
    s += (i ? "; " : "") + groups[i].first + " on " + RanksNamed(groups[i].second);
  return s;
}

// Why ranks that joined cannot take part in an op of `sig` ("" if they can: they contribute
// the identity of the reduction, as in Horovod's join, where allreduce is the one op
// supported and broadcast and allgather raise).
std::string JoinedUnsupported(const Signature& sig) {
  switch (sig.op) {
    case SHOAL_OP_BARRIER:
      return "";
    case SHOAL_OP_ALLREDUCE:
    case SHOAL_OP_REDUCESCATTER:  // every reduce op has an identity (ops/join.cc)
      if (sig.device_type != SHOAL_DEVICE_CPU)
        return "a joined rank contributes from host memory; CUDA tensors are not supported while ranks are joined";
      return "";
    case SHOAL_OP_NEIGHBOR_ALLREDUCE:
    case SHOAL_OP_NEIGHBOR_ALLGATHER:
      return "neighbor ops need every rank that sends or receives; finish them before join()";
    case SHOAL_OP_ALLTOALL:
      return "alltoall needs rows from every rank (Horovod: \"Alltoall is not supported with Join at this time\")";
    default:
      return "only allreduce, reducescatter (and barrier) run while ranks are joined, as in Horovod's join";
  }
}

}  // namespace

Response Coordinator::Validate(const std::string& name, const Pending& p) {
  const Request& first = *std::find_if(p.req.begin(), p.req.end(), [](const Request& q) { return !q.name.empty(); });
  if (first.sig.op & SHOAL_GROUPED) return ValidateGroup(name, p);
  return ValidateOne(name, p.req, true);
}

Response Coordinator::ValidateOne(const std::string& name, const std::vector<Request>& req, bool cache) {
  Response resp;
  std::vector<int> absent;  // ranks that joined instead of submitting it
  for (int r = 0; r < size_; ++r)
    if (req[r].name.empty()) absent.push_back(r);
  const Request& first = *std::find_if(req.begin(), req.end(), [](const Request& q) { return !q.name.empty(); });
  resp.op = first.sig.op;
  resp.names = {name};
  auto fail = [&](const std::string& what, const std::string& diff) {
    resp.kind = Response::ERROR;
    resp.error = OpError(resp.op, name, "mismatched " + what +
                 " across ranks: " + diff);
    return resp;
  };
  using F = std::function<std::string(const Request&)>;
  std::vector<std::pair<const char*, F>> checks = {
      {"operations", [](const Request& r) { return std::string(OpName(r.sig.op)); }},
      {"dtypes", [](const Request& r) { return std::string(DtypeName(r.sig.dtype)); }},
      {"devices",
       [](const Request& r) { return std::string(r.sig.device_type ? "cuda" : "cpu"); }},
      // SHOAL_GPU_BACKEND, CUDA-aware MPI and SHOAL_CUDA_PLUGIN decide it on each rank.
      {"GPU data paths (SHOAL_GPU_BACKEND, CUDA-aware MPI, SHOAL_CUDA_PLUGIN)", [](const Request& r) {
         return std::string(PathName(r.sig.path)) + ((r.sig.path & kFakePlugin) ? " (fake plugin)" : "");
       }}};
  const int op = resp.op;
  if (op == SHOAL_OP_ALLGATHER || op == SHOAL_OP_NEIGHBOR_ALLGATHER || op == SHOAL_OP_ALLTOALL) {
    checks.push_back({"ranks (number of dimensions)",
                      [](const Request& r) { return std::to_string(r.sig.shape.size()); }});
    checks.push_back({"trailing dimensions", [](const Request& r) {
                        std::vector<int64_t> t(r.sig.shape.begin() + (r.sig.shape.empty() ? 0 : 1),
                                               r.sig.shape.end());
                        return ShapeString(t);
                      }});
  } else if (op != SHOAL_OP_BARRIER) {
    checks.push_back({"shapes", [](const Request& r) { return ShapeString(r.sig.shape); }});
  }
  if (op == SHOAL_OP_ALLREDUCE || op == SHOAL_OP_REDUCESCATTER)
    checks.push_back({"reduce ops", [](const Request& r) {
                        return std::string("op=") + ReduceOpName(r.sig.reduce_op);
                      }});
  if (op == SHOAL_OP_ALLREDUCE || op == SHOAL_OP_BROADCAST)
    checks.push_back({"scopes", [](const Request& r) {
                        return std::string(r.sig.scope == SHOAL_SCOPE_MACHINE ? "machine" : "world");
                      }});
  if (op == SHOAL_OP_BROADCAST)
    checks.push_back({"root ranks", [](const Request& r) {
                        return "root " + std::to_string(r.sig.root_rank);
                      }});
  auto cached = cache ? validated_.find(name) : validated_.end();
  bool all_cached = cached != validated_.end();
  for (auto& r : req) all_cached = all_cached && (r.name.empty() || r.sig == cached->second);
  resp.repeat = all_cached;
  if (!all_cached) {
    // Operations first: other fields are meaningless across different ops.
    for (auto& c : checks) {
      std::string d = Differences(req, c.second, world_);
      if (!d.empty()) return fail(c.first, d);
    }
    if (cache) ++negotiations_;
    // A cache only (a name missing is validated again): bounded, for scripts that invent names.
    if (validated_.size() >= kValidatedNames) validated_.clear();
    if (cache && op != SHOAL_OP_ALLGATHER && op != SHOAL_OP_NEIGHBOR_ALLGATHER && op != SHOAL_OP_ALLTOALL)
      validated_[name] = first.sig;
  }
  if (!absent.empty()) {
    std::string why = JoinedUnsupported(first.sig);
    if (!why.empty()) {
      resp.kind = Response::ERROR;
      resp.error = OpError(op, name, RanksNamed(absent) +
                   (absent.size() == 1 ? " has" : " have") + " joined (join()) and cannot take part: " + why);
      return resp;
    }
    resp.joined = absent;
  }
  std::string edges = CheckEdges(req);
  if (!edges.empty()) {
    resp.kind = Response::ERROR;
    resp.error = OpError(op, name, "send and receive ranks disagree: " + edges);
    resp.code = SHOAL_NEIGHBOR_MISMATCH;
    return resp;
  }
  resp.trusted = std::all_of(req.begin(), req.end(), [](const Request& r) { return r.name.empty() || r.known; });
  if (op == SHOAL_OP_ALLGATHER) {
    std::vector<int64_t> dims;
    for (auto& r : req) dims.push_back(r.sig.shape.empty() ? 0 : r.sig.shape[0]);
    resp.first_dims = {dims};
  }
  if (op == SHOAL_OP_ALLTOALL)  // every rank learns what every rank sends it
    for (auto& r : req) resp.first_dims.push_back(r.splits);
  return resp;
}

// A grouped op arrives as one request per rank with its members' signatures: validated as
// one unit and answered with one response, so every member runs or every member fails,
// with the same error on every rank.
Response Coordinator::ValidateGroup(const std::string& name, const Pending& p) {
  Response resp;
  const Request& first = *std::find_if(p.req.begin(), p.req.end(), [](const Request& q) { return !q.name.empty(); });
  resp.op = first.sig.op;
  resp.names = {name};
  auto fail = [&](const std::string& why) {
    resp.kind = Response::ERROR;
    resp.error = OpError(resp.op, name, why);
    return resp;
  };
  std::string d = Differences(p.req, [](const Request& r) { return std::string(OpName(r.sig.op)); }, world_);
  if (!d.empty()) return fail("mismatched operations across ranks: " + d);
  d = Differences(p.req, [](const Request& r) { return std::to_string(r.members.size()) + " tensors"; }, world_);
  if (!d.empty()) return fail("mismatched numbers of tensors across ranks: " + d);
  const size_t n = first.members.size();
  for (size_t i = 0; i < n; ++i) {
    std::vector<Request> member(size_);
    for (int r = 0; r < size_; ++r) {
      if (p.req[r].name.empty()) continue;  // joined
      member[r].name = MemberName(name, static_cast<int>(i));
      member[r].sig = p.req[r].members[i];
    }
    Response m = ValidateOne(MemberName(name, static_cast<int>(i)), member, false);
    if (m.kind != Response::EXECUTE) return fail(m.error + "; no tensor of the group ran");
    resp.first_dims.push_back(m.first_dims.empty() ? std::vector<int64_t>{} : m.first_dims[0]);
    resp.joined = m.joined;
  }
  ++negotiations_;
  // Consecutive allreduce members that one fused collective can carry; gathers one each.
  const bool fuse = (resp.op & ~SHOAL_GROUPED) == SHOAL_OP_ALLREDUCE && fusion_threshold_ > 0;
  int64_t bytes = 0;
  for (size_t i = 0; i < n; ++i) {
    const Signature& s = first.members[i];
    const Signature* prev = i ? &first.members[i - 1] : nullptr;
    const int64_t b = static_cast<int64_t>(s.nbytes());
    if (fuse && prev && s.dtype == prev->dtype && s.device_type == prev->device_type && s.path == prev->path &&
        bytes + b <= fusion_threshold_) {
      ++resp.chunks.back();
      bytes += b;
    } else {
      resp.chunks.push_back(1);
      bytes = b;
    }
  }
  return resp;
}

std::string Coordinator::CheckEdges(const std::vector<Request>& req) const {
  bool any = false;
  for (auto& r : req) any = any || r.topo_check;
  if (!any) return "";
  std::vector<std::string> bad;
  auto has = [](const std::vector<int>& v, int x) { return std::find(v.begin(), v.end(), x) != v.end(); };
  for (int i = 0; i < size_; ++i) {
    for (int j : req[i].send)
      if (j >= 0 && j < size_ && !has(req[j].recv, i))
        bad.push_back("rank " + std::to_string(i) + " sends to rank " + std::to_string(j) +
                      ", which does not receive from it");
    for (int j : req[i].recv)
      if (j >= 0 && j < size_ && !has(req[j].send, i))
        bad.push_back("rank " + std::to_string(i) + " receives from rank " + std::to_string(j) +
                      ", which does not send to it");
  }
  std::string s;
  for (size_t k = 0; k < bad.size() && k < 8; ++k) s += (k ? "; " : "") + bad[k];
  if (bad.size() > 8) s += "; and " + std::to_string(bad.size() - 8) + " more";
  return s;
}

std::string Coordinator::LeftError(const std::string& name, int op) const {
  std::string who;
  for (size_t i = 0; i < left_.size(); ++i) who += (i ? ", " : "") + std::to_string(left_[i]);
  return OpError(op, name, (left_.size() == 1 ? "rank " : "ranks ") + who +
         " left the job (script ended, sys.exit or shoal.shutdown()) before taking part in this op");
}

std::vector<Response> Coordinator::Leave(int rank) {
  rank = World(rank);  // left_ names world ranks
  if (std::find(left_.begin(), left_.end(), rank) == left_.end()) left_.push_back(rank);
  std::vector<Response> out;
  if (num_joined_ > 0) {  // the ranks that joined wait for one that will not
    Response r;
    r.kind = Response::LEFT;
    r.op = kOpJoin;
    r.names = {join_name_};
    r.error = LeftError(join_name_, kOpJoin);
    out.push_back(std::move(r));
    joined_.assign(size_, 0);
    num_joined_ = 0;
  }
  std::vector<std::string> names;
  for (auto& kv : pending_) names.push_back(kv.first);
  for (auto& name : names) {
    int op = 0;
    for (size_t r = 0; r < pending_[name].have.size(); ++r)
      if (pending_[name].have[r]) { op = pending_[name].req[r].sig.op; break; }
    out.push_back(Abort(name, LeftError(name, op)));
    out.back().kind = Response::LEFT;
  }
  return out;
}

std::vector<Response> Coordinator::TakeResponses() {
  std::vector<Response> out;
  out.swap(early_);
  // Fuse consecutive-in-spirit allreduces: one open batch per (dtype, reduce op, device).
  std::map<std::tuple<int, int, int, int>, std::pair<size_t, int64_t>> open;  // -> (index, bytes)
  const size_t first = out.size();
  std::vector<int64_t> batch_bytes;  // by index in `out` from `first`
  std::vector<std::vector<Signature>> batch_sigs;  // the same
  for (auto& name : complete_) {
    auto rel = release_after_.find(name);
    if (rel != release_after_.end()) {
      free_channels_.push_back(rel->second);
      release_after_.erase(rel);
    }
    auto it = pending_.find(name);
    if (it == pending_.end()) continue;  // aborted meanwhile
    Response r = Validate(name, it->second);
    if (it->second.vote && r.kind == Response::EXECUTE) {
      std::vector<const Request*> votes;
      for (auto& q : it->second.req) votes.push_back(&q);
      r.retired = Agreed(votes);
      for (auto& n : r.retired)  // forgotten here too, with a hierarchical op's stages
        for (int s = -1; s < 3; ++s) {
          const std::string key = s < 0 ? n : n + kHierarchicalStages[s].suffix;
          validated_.erase(key);
          rounds_done_.erase(key);
          if (rejected_.erase(key))  // (rare: then its place in the order goes too)
            rejected_order_.erase(std::find(rejected_order_.begin(), rejected_order_.end(), key));
        }
    }
    // Copied (the entry is erased next) from a rank that submitted it (rank 0 may have joined).
    const Request& q = *std::find_if(it->second.req.begin(), it->second.req.end(), [](const Request& x) {
      return !x.name.empty();
    });
    const Signature sig = q.sig;
    // What a joined rank runs on its identity buffers: the op, or a group's members.
    std::vector<Signature> sigs = (sig.op & SHOAL_GROUPED) ? q.members : std::vector<Signature>{sig};
    pending_.erase(it);
    if (r.kind == Response::EXECUTE && r.op == SHOAL_OP_ALLREDUCE && fusion_threshold_ > 0) {
      auto key = std::make_tuple(sig.dtype, sig.reduce_op, sig.device_type, sig.scope);
      int64_t bytes = static_cast<int64_t>(sig.nbytes());
      auto o = open.find(key);
      if (o != open.end() && o->second.second + bytes <= fusion_threshold_) {
        Response& b = out[o->second.first];
        b.names.push_back(name);
        batch_sigs[o->second.first - first].push_back(sig);
        for (int j : r.joined)
          if (std::find(b.joined.begin(), b.joined.end(), j) == b.joined.end()) b.joined.push_back(j);
        std::sort(b.joined.begin(), b.joined.end());
        out[o->second.first].repeat &= r.repeat && Cacheable(sig);
        o->second.second += bytes;
        batch_bytes[o->second.first - first] += bytes;
        continue;
      }
      open[key] = {out.size(), bytes};
      r.repeat &= Cacheable(sig);
    } else {
      r.repeat &= r.kind == Response::EXECUTE && (r.op == SHOAL_OP_ALLREDUCE || r.op == SHOAL_OP_BROADCAST) &&
                  Cacheable(sig);
    }
    batch_bytes.push_back(static_cast<int64_t>(sig.nbytes()));
    batch_sigs.push_back(std::move(sigs));
    out.push_back(std::move(r));
  }
  complete_.clear();
  for (size_t i = first; i < out.size(); ++i)
    if (!out[i].joined.empty()) out[i].sigs = std::move(batch_sigs[i - first]);
  // A batch that ran before as it is now is likely to repeat (a training step's
  // gradients): from now on it runs on a channel of its own, without this round trip.
  // Only small ones: a large one's data dwarfs the round trip, and its cached rounds would
  // copy it twice more (into and out of the round's buffer).
  for (size_t i = first; i < out.size() && left_.empty() && num_joined_ == 0 && !free_channels_.empty(); ++i)
    if (out[i].repeat && out[i].kind == Response::EXECUTE &&
        (out[i].op == SHOAL_OP_ALLREDUCE || out[i].op == SHOAL_OP_BROADCAST) && batch_bytes[i - first] <= kMaxCachedBytes) {
      out[i].channel = free_channels_.back();
      free_channels_.pop_back();
    }
  if (num_joined_ == size_) {  // after every op it completed: the join is the last response
    Response j;
    j.op = kOpJoin;
    j.names = {join_name_};
    j.joined = {last_joined_};
    out.push_back(std::move(j));
    joined_.assign(size_, 0);
    num_joined_ = 0;
  }
  return out;
}

bool Coordinator::Cacheable(const Signature& sig) {
  // Host memory, world scope (a CUDA tensor's and a machine's broadcasts stay negotiated);
  // an allreduce: a sum whose last element can count the ranks exactly (half types are
  // summed in float32).
  const int d = sig.dtype;
  if (sig.device_type != SHOAL_DEVICE_CPU || sig.scope != SHOAL_SCOPE_WORLD) return false;
  if (sig.op == SHOAL_OP_BROADCAST) return true;  // moves bytes: any dtype
  return (sig.reduce_op == SHOAL_REDUCE_SUM || sig.reduce_op == SHOAL_REDUCE_AVERAGE) &&
         (d == SHOAL_FLOAT16 || d == SHOAL_BFLOAT16 || d == SHOAL_FLOAT32 || d == SHOAL_FLOAT64 ||
          d == SHOAL_INT32 || d == SHOAL_INT64);
}

std::vector<Stall> Coordinator::Stalled(double now, double older_than) const {
  std::vector<Stall> out;
  for (auto& kv : pending_) {
    const Pending& p = kv.second;
    // A vote is never late: every rank's driver sends one at once, without a user call (a
    // rank that died or left ends it through Leave); aborting it would let a late vote
    // land in the next round.
    if (now - p.first_seen < older_than || p.complete || p.vote) continue;
    Stall s;
    s.name = kv.first;
    s.waited = now - p.first_seen;
    for (int r = 0; r < size_; ++r) {
      if (p.have[r]) s.ready.push_back(World(r));
      else if (num_joined_ == 0 || !joined_[r]) s.missing.push_back(World(r));  // a joined rank is not late
    }
    if (!s.missing.empty()) out.push_back(std::move(s));
  }
  return out;
}

Response Coordinator::Abort(const std::string& name, const std::string& message) {
  Response r;
  r.kind = Response::ERROR;
  r.names = {name};
  r.error = message;
  auto it = pending_.find(name);
  if (it != pending_.end()) {
    for (auto& q : it->second.req)
      if (q.name == name) {
        r.op = q.sig.op;
        r.step = q.step;
        break;
      }
    pending_.erase(it);
  }
  return r;
}

}  // namespace shoal
