// Cached allreduce batches: the coordinator round trip skipped for collectives that repeat.
//
// When the coordinator runs an allreduce batch whose names all ran before with the same
// signatures, it also gives the batch a collective channel (Response::channel). Every
// rank applies that response at the same point, so every rank then knows the batch, its
// members' signatures and its channel. From then on, a rank that has all the batch's
// members submitted contributes a *round* on that channel: one allreduce of the fused
// members plus one element that is 1 ("ready") or 0. Each channel carries only its own
// batch, whose size every rank knows, so rounds always match; ranks may submit batches
// in any order (channels are independent). The round's last element sums to size() only
// if every rank was ready: then the result is the op's result. Otherwise the batch is
// dead on every rank at once (all see the same sum), and its ops go to the coordinator,
// which validates, reports mismatches and runs them as usual.
//
// A rank contributes a 0 round (dooms the batch) when a member comes with another
// signature (or is refused at the call), when a thread has waited kWaitedMs for a member
// of a batch that is only partly submitted (its program may need that op before it
// submits the rest), after the stall warning time, and when a rank leaves the job (every
// rank dooms every batch; the leaving rank stays until its rounds are through).
//
// A broadcast that repeats is cached the same way, but its round carries only the root's
// data: the root decides each round with a header element (docs/design.md §20).
#include "negotiation/response_cache.h"

#include <algorithm>
#include <cstring>

#include "negotiation/negotiation.h"
#include "ops/collectives.h"
#include "runtime/submissions.h"
#include "ops/fusion.h"

namespace shoal {

struct ResponseCache::Batch {
  int set = 0, size = 0;  // its process set, and how many ranks it has
  int channel = 0;        // of that set
  std::vector<std::string> names, keys;  // keys: SetKey(set, name)
  std::vector<Signature> sigs;
  int dtype = 0, wire = 0;  // members' dtype; the dtype of the round (half types: float32)
  bool average = false;
  int64_t total = 0;               // elements of all members
  std::vector<EntryPtr> held;      // by member: submitted here, waiting for the round
  size_t num_held = 0;
  std::vector<EntryPtr> later;     // submitted while the batch cannot take them: go to the coordinator
  std::vector<EntryPtr> in_round;  // members whose data is in the running round
  bool in_flight = false, ready_round = false, dying = false, dead = false, abandoned = false;
  Clock::time_point since, waited_since, round_start;
  std::shared_ptr<FusedBuffer> buf;  // the running round's
  // A broadcast (one member): its root's and this rank's index in the set (root < 0: an
  // allreduce batch); this rank joined; the coordinator failed the step of the next round
  // here (a stall) with `failed`; the running round's header and data.
  int root = -1, index = 0;
  bool joined = false, fail_next = false;
  Status failed;
  std::shared_ptr<ByteVec> bytes;
};

bool ResponseCache::IsBroadcast(const Batch& b) { return b.root >= 0; }

namespace {

constexpr int kWaitedMs = 50;

int64_t Slot(int set, int channel) { return (static_cast<int64_t>(set) << 32) | static_cast<uint32_t>(channel); }

void PutCount(void* p, int dtype, int v) {
  switch (dtype) {
    case SHOAL_FLOAT32: { float f = static_cast<float>(v); std::memcpy(p, &f, sizeof f); break; }
    case SHOAL_FLOAT64: { double d = v; std::memcpy(p, &d, sizeof d); break; }
    case SHOAL_INT32: { int32_t i = v; std::memcpy(p, &i, sizeof i); break; }
    default: { int64_t i = v; std::memcpy(p, &i, sizeof i); break; }
  }
}

double GetCount(const void* p, int dtype) {
  switch (dtype) {
    case SHOAL_FLOAT32: { float f; std::memcpy(&f, p, sizeof f); return f; }
    case SHOAL_FLOAT64: { double d; std::memcpy(&d, p, sizeof d); return d; }
    case SHOAL_INT32: { int32_t i; std::memcpy(&i, p, sizeof i); return i; }
    default: { int64_t i; std::memcpy(&i, p, sizeof i); return static_cast<double>(i); }
  }
}

}  // namespace

ResponseCache::ResponseCache(Host* host, Negotiation* negotiation, CollectiveOps* collectives, Submissions* submissions,
                             const Config& cfg, Stats* stats)
    : host_(host), negotiation_(negotiation), collectives_(collectives), submissions_(submissions), warn_(cfg.stall_check_time > 0 ? cfg.stall_check_time : cfg.stall_shutdown_time),
      kill_(cfg.stall_shutdown_time), stats_(stats), pool_(collectives->pool()) {}

void ResponseCache::Add(const Response& r, const std::vector<EntryPtr>& batch, int set_size, int index, bool doom) {
  if (r.channel < 0 || r.channel >= (r.set ? Backend::kSetChannels : Backend::kChannels)) return;
  const bool broadcast = r.op == SHOAL_OP_BROADCAST;
  if (broadcast && doom) return;  // a joined rank would miss its rounds: it stays negotiated
  auto b = std::make_shared<Batch>();
  if (broadcast) {
    const Entry& e = *batch[0];
    b->root = e.pset ? e.pset->IndexOf(e.sig.root_rank) : e.sig.root_rank;
    b->index = index;
  }
  b->set = r.set;
  b->size = set_size;
  b->channel = r.channel;
  b->dtype = batch[0]->sig.dtype;
  b->wire = FusedBuffer::WireDtype(b->dtype);
  b->average = batch[0]->sig.reduce_op == SHOAL_REDUCE_AVERAGE;
  for (auto& e : batch) {
    b->names.push_back(e->name);
    b->keys.push_back(e->key());
    b->sigs.push_back(e->sig);
    b->total += e->count();
  }
  b->held.resize(batch.size());
  // The channel's previous batch died on every rank; its last round may still be running
  // here (rounds on one channel complete in order).
  retired_.erase(std::remove_if(retired_.begin(), retired_.end(), [](const BatchPtr& x) { return !x->in_flight; }),
                 retired_.end());
  BatchPtr& slot = cached_[Slot(r.set, r.channel)];
  if (slot && slot->in_flight) retired_.push_back(slot);
  slot = b;
  for (size_t i = 0; i < b->keys.size(); ++i) members_[b->keys[i]] = {b, i};
  if (doom) Doom(b);
}

bool ResponseCache::Route(const EntryPtr& e) {
  auto it = members_.find(e->key());
  if (it == members_.end()) return false;
  const BatchPtr b = it->second.first;
  const size_t i = it->second.second;
  if (b->root >= 0) {  // every call of the name takes part in the root's round of its step
    if (b->in_flight || !b->later.empty()) b->later.push_back(e);
    else Broadcast(b, e);
    return true;
  }
  if (!e->reject.empty() || !(e->sig == b->sigs[i])) {
    Doom(b);  // its members will not all come as cached
    if (!e->reject.empty()) return false;  // the refusal itself goes to the coordinator
  }
  if (b->dying || b->in_flight || b->held[i]) {
    b->later.push_back(e);
    return true;
  }
  b->held[i] = e;
  if (b->num_held++ == 0) b->since = Clock::now();
  if (b->num_held == b->held.size()) Contribute(b, true);
  return true;
}

void ResponseCache::Doom(const BatchPtr& b) {
  if (b->dead || b->dying) return;
  if (b->root >= 0 && b->root != b->index) return;  // only a broadcast's root ends its rounds
  b->dying = true;
  if (b->root >= 0) return;  // its next round says so
  if (!b->in_flight) Contribute(b, false);
}

void ResponseCache::Contribute(const BatchPtr& b, bool ready) {
  b->buf = std::make_shared<FusedBuffer>(*pool_, b->dtype, b->total, 1);
  if (ready) {
    const auto now = Clock::now();  // as on the negotiated path, COMMUNICATE holds the copy
    for (auto& e : b->held) e->t_comm_start = now;
    b->buf->Pack(b->held);
    b->in_round = std::move(b->held);
    b->held.assign(b->in_round.size(), nullptr);
    b->num_held = 0;
  }
  PutCount(b->buf->at_element(b->total), b->wire, ready ? 1 : 0);
  b->in_flight = true;
  b->ready_round = ready;
  b->round_start = Clock::now();
  b->waited_since = {};
  ++stats_->global_collectives;
  if (ready) ++stats_->cache_hits;
  GroupCollectives* engine = collectives_->Engine(b->set);  // there while the set is (DropSet drops its batches)
  if (!engine) return OnRound(b, Status::Error(SHOAL_ABORTED, "internal error: a cached batch of a removed process set"));
  engine->AllreduceOn(b->channel, b->buf->data(), b->total + 1, b->wire, [this, b](const Status& st) { OnRound(b, st); });
}

void ResponseCache::OnRound(const BatchPtr& b, const Status& st) {
  if (b->root >= 0) return OnBroadcast(b, st);
  b->in_flight = false;
  const bool all_ready = st.ok() && GetCount(b->buf->at_element(b->total), b->wire) == b->size;
  std::vector<EntryPtr> round = std::move(b->in_round);
  b->in_round.clear();
  if (all_ready && b->ready_round) {
    Coordinator* c = negotiation_->CoordinatorOf(b->set);
    for (size_t k = 0; k < round.size(); ++k) {
      const EntryPtr& e = round[k];
      if (c) c->RoundDone(e->name, e->step);
      e->t_comm_end = Clock::now();
      if (!b->abandoned) {
        b->buf->UnpackMember(k, *e, b->average ? b->size : 1);
        host_->Finish(e, Status::Ok());
      }
    }
    round.clear();
  }
  b->buf.reset();
  if (all_ready && !b->abandoned) {
    if (b->dying) Contribute(b, false);
    return;
  }
  // Dead on every rank: its ops go to the coordinator (or fail with the channel's error).
  Bury(b, true);
  std::vector<EntryPtr> rest = std::move(round);
  for (auto& e : b->held) if (e) rest.push_back(e);
  for (auto& e : b->later) rest.push_back(e);
  b->held.clear();
  b->later.clear();
  for (auto& e : rest) {
    if (b->abandoned && e->done) continue;
    if (!st.ok()) host_->Finish(e, st);
    else host_->Renegotiate(e);
  }
}

void ResponseCache::Bury(const BatchPtr& b, bool channel_free) {
  b->dead = true;
  for (auto& n : b->keys) {
    auto it = members_.find(n);
    if (it != members_.end() && it->second.first == b) members_.erase(it);
  }
  if (Coordinator* c = negotiation_->CoordinatorOf(b->set)) {
    c->ForgetRounds(b->names);
    auto slot = cached_.find(Slot(b->set, b->channel));
    if (channel_free && slot != cached_.end() && slot->second == b) {
      // A broadcast's root may complete its last round before a slow rank has started it.
      if (b->root < 0) c->ReleaseChannel(b->channel);
      else c->ReleaseAfter(b->names[0], b->channel);
    }
  }
}

void ResponseCache::DoomAll(int with_rank, bool joining) {
  for (auto& kv : cached_) {
    const BatchPtr b = kv.second;
    const ProcessSet* s = negotiation_->SetOf(b->set);
    if (with_rank >= 0 && s && !s->Has(with_rank)) continue;
    if (b->root < 0 || b->dead) {
      Doom(b);
    } else if (with_rank >= 0) {
      // A rank that left takes part in no round: this rank's rounds end here, and its ops
      // fail as any op that needs that rank does (through the runtime's routing).
      b->abandoned = true;
      Bury(b, false);
      std::vector<EntryPtr> rest = std::move(b->in_round);
      rest.insert(rest.end(), b->later.begin(), b->later.end());
      b->in_round.clear();
      b->later.clear();
      for (auto& e : rest) if (e->reject.empty()) host_->Renegotiate(e);
    } else {
      Doom(b);
      if (!joining) continue;
      // This rank submits none of its calls until every rank has joined: it takes part in
      // the root's rounds until one says dead (the root's, at once).
      b->joined = true;
      if (!b->in_flight && b->later.empty()) Broadcast(b, nullptr);
    }
  }
}

void ResponseCache::Drop(int set) {
  // No op of the set is in flight on any rank (remove_process_set checked): its batches are
  // idle; a round still running keeps its batch alive until it completes.
  for (auto c = cached_.begin(); c != cached_.end();) {
    if (c->second->set != set) {
      ++c;
      continue;
    }
    for (auto& k : c->second->keys) members_.erase(k);
    c->second->dead = true;
    if (c->second->in_flight) retired_.push_back(c->second);
    c = cached_.erase(c);
  }
}

bool ResponseCache::InFlight() const {
  // A broadcast's round needs no wait: the peers end theirs when this rank leaves.
  for (auto& kv : cached_) if (kv.second->in_flight && kv.second->root < 0) return true;
  return false;
}

// This rank's ops are in some batch that is not dead (its join waits until they are not).
bool ResponseCache::HoldsOwnOps() const {
  auto own = [](const BatchPtr& b) {
    return !b->dead && (b->num_held > 0 || !b->later.empty() || (!b->in_round.empty() && !b->abandoned));
  };
  for (auto& kv : cached_) if (own(kv.second)) return true;
  for (auto& b : retired_) if (own(b)) return true;
  return false;
}

void ResponseCache::KeepRoundBuffers() {
  // A round still running at shutdown (a peer never took part) may be completed by MPI
  // after this runtime is gone, into its buffer: that buffer must outlive the runtime.
  auto keep = [](const BatchPtr& b) {
    if (b->in_flight && b->buf) new std::shared_ptr<FusedBuffer>(b->buf);  // deliberately never freed
    if (b->in_flight && b->bytes) new std::shared_ptr<ByteVec>(b->bytes);
  };
  for (auto& kv : cached_) keep(kv.second);
  for (auto& b : retired_) keep(b);
}

void ResponseCache::Check(Clock::time_point now) {
  const double warn = warn_, kill = kill_;
  for (auto& kv : cached_) {
    const BatchPtr& b = kv.second;
    if (b->dead) continue;
    if (!b->in_flight && b->num_held > 0 && !b->dying) {
      // Part of the batch is here. Waiting for the rest is right while the program goes
      // on submitting (a backward pass); not when it waits for one of these ops first.
      bool waited = false;
      for (auto& e : b->held) waited |= e && e->waited.load(std::memory_order_relaxed);
      if (waited && b->waited_since == Clock::time_point{}) b->waited_since = now;
      const bool long_wait = waited && now - b->waited_since > std::chrono::milliseconds(kWaitedMs);
      if (long_wait || (warn > 0 && std::chrono::duration<double>(now - b->since).count() > warn)) Doom(b);
      continue;
    }
    if (!b->in_flight || b->abandoned) continue;
    const double waited = std::chrono::duration<double>(now - b->round_start).count();
    // Its ops wait for the other ranks (in this round, or behind a dying batch's last
    // round): after a while, tell the coordinator, whose stall check then names the
    // missing ranks and fails the op everywhere (FailCached) as for an op it negotiates.
    const double probe_after = std::min(warn > 0 ? warn : kill, kill > 0 ? kill : warn) / 4;
    if (probe_after > 0 && waited >= probe_after) {
      for (auto* list : {&b->in_round, &b->held, &b->later})
        for (auto& e : *list) {
          if (!e || e->probed) continue;
          e->probed = true;
          Request req{e->name, e->sig, e->step, {}, 0, false, {}, {}};
          req.probe = true;
          req.set = b->set;
          negotiation_->SendLater(std::move(req));
        }
    }
    if (!b->ready_round) continue;
    const std::string what = "allreduce '" + b->names[0] + "'" + (b->names.size() > 1 ? " (and its fused batch)" : "") +
                             " waited " + std::to_string(static_cast<int>(waited)) +
                             " s for the other ranks to submit it (the coordinator did not answer)";
    if (kill > 0 && waited >= 2 * kill) {  // only if the coordinator's stall check did not
      ++stats_->stalls;
      b->abandoned = true;  // the round may still complete: it no longer touches these ops
      for (auto& e : b->in_round) host_->Finish(e, Status::Error(SHOAL_ABORTED, "stalled op " + what + " (SHOAL_STALL_SHUTDOWN_TIME)"));
    }
  }
}

// The coordinator failed `name` at `step` on every rank: a stall of a round (`fail_round`:
// the ops in it fail now; the missing ranks doom the batch when they hear of it), or a call
// refused on some rank (the batch is doomed; its ops go to the coordinator, which refuses
// that one and runs the others).
void ResponseCache::Fail(const std::string& name, int64_t step, const Status& st, bool fail_round) {
  auto it = members_.find(name);
  if (it == members_.end()) return;
  const BatchPtr b = it->second.first;
  auto matches = [&](const EntryPtr& e) { return e && e->key() == name && (step < 0 || e->step == step); };
  if (b->root >= 0) {
    // Every rank still takes part in the root's round of that step; on this rank it is
    // dead whatever its header says (so on every rank: the root's is abandoned or dead).
    if (fail_round && !b->abandoned && std::any_of(b->in_round.begin(), b->in_round.end(), matches)) {
      b->abandoned = true;
      for (auto& e : b->in_round) host_->Finish(e, st);
    } else if (fail_round) {
      b->fail_next = true;
      b->failed = st;
    }
    return Doom(b);
  }
  if (fail_round) {
    if (!b->abandoned && std::any_of(b->in_round.begin(), b->in_round.end(), matches)) {
      b->abandoned = true;
      for (auto& e : b->in_round) host_->Finish(e, st);
    }
    for (auto& e : b->held)
      if (matches(e)) {
        host_->Finish(e, st);
        e = nullptr;
        --b->num_held;
      }
    for (auto& e : b->later) if (matches(e)) host_->Finish(e, st);
    b->later.erase(std::remove_if(b->later.begin(), b->later.end(), matches), b->later.end());
  }
  Doom(b);
}

// A broadcast's round (docs/design.md §20): [header, data] from the root, into a buffer of
// the cached size on every rank, whatever its call. The root's header is 1 when its call
// is the cached one and the name is not doomed; then each rank whose call matches takes
// the data. Otherwise the name is dead on every rank and the step goes to the coordinator.
void ResponseCache::Broadcast(const BatchPtr& b, const EntryPtr& e) {
  const bool root = b->root == b->index;
  const bool matches = e && e->reject.empty() && e->sig == b->sigs[0];
  if (root && (!matches || b->fail_next)) b->dying = true;
  const size_t width = DtypeSize(b->dtype), n = static_cast<size_t>(b->total) * width;
  b->bytes = pool_->Get(width + n);
  b->bytes->resize(width + n);
  char* p = b->bytes->data();
  std::memset(p, 0, width);
  const auto now = Clock::now();
  if (root && !b->dying) {
    p[0] = 1;
    std::memcpy(p + width, e->input.data, n);
    if (e->output.data != e->input.data) std::memcpy(e->output.data, e->input.data, n);
  }
  if (matches) e->t_comm_start = now;
  b->in_round.clear();
  if (e) b->in_round.push_back(e);
  b->in_flight = true;
  b->ready_round = matches;
  b->round_start = now;
  ++stats_->global_collectives;
  if (matches) ++stats_->cache_hits;
  GroupCollectives* engine = collectives_->Engine(b->set);
  if (!engine) return OnRound(b, Status::Error(SHOAL_ABORTED, "internal error: a cached broadcast of a removed process set"));
  engine->BroadcastOn(b->channel, p, b->total + 1, b->dtype, b->root, [this, b](const Status& st) { OnRound(b, st); });
}

void ResponseCache::OnBroadcast(const BatchPtr& b, const Status& st) {
  b->in_flight = false;
  const EntryPtr e = b->in_round.empty() ? nullptr : b->in_round[0];
  b->in_round.clear();
  const std::shared_ptr<ByteVec> bytes = std::move(b->bytes);
  if (b->dead) return;  // ended when a rank left (its ops went)
  const bool failed = b->fail_next;
  if (st.ok() && !b->abandoned && !failed && (*bytes)[0] == 1) {
    if (e) Deliver(b, e, bytes->data() + DtypeSize(b->dtype));
    else if (b->root != b->index) submissions_->CountCall(b->keys[0], b->sigs[0].op);  // a joined rank's
    if (!b->later.empty()) {
      EntryPtr next = b->later.front();
      b->later.erase(b->later.begin());
      Broadcast(b, next);
    } else if (b->joined) {
      Broadcast(b, nullptr);
    }
    return;
  }
  // Dead on every rank: the step's calls go to the coordinator, which validates them and
  // reports any mismatch as usual (or they fail with the channel's or the stall's error).
  Bury(b, st.ok() && !b->abandoned && !failed);
  std::vector<EntryPtr> rest;
  if (e && !(b->abandoned && e->done)) rest.push_back(e);
  rest.insert(rest.end(), b->later.begin(), b->later.end());
  b->later.clear();
  for (auto& x : rest) {
    if (!x->reject.empty()) continue;  // its refusal went to the coordinator at the call
    if (!st.ok()) host_->Finish(x, st);
    else if (failed && x == e) host_->Finish(x, b->failed);
    else host_->Renegotiate(x);
  }
}

void ResponseCache::Deliver(const BatchPtr& b, const EntryPtr& e, const char* data) {
  e->t_comm_end = Clock::now();
  if (!e->reject.empty()) return;  // refused at the call here: the root dooms the name when it hears
  const Signature& root = b->sigs[0];
  if (e->sig == root) {
    if (Coordinator* c = negotiation_->CoordinatorOf(b->set)) c->RoundDone(e->name, e->step);
    if (b->root != b->index) std::memcpy(e->output.data, data, e->nbytes());
    return host_->Finish(e, Status::Ok());
  }
  // This rank's call changed while the root's did not: only this rank can know (§20). It
  // fails; the refusal tells the root, which ends the name's rounds at its next call.
  const int me = e->pset ? e->pset->ranks[b->index] : b->index;
  auto call = [](const Signature& s) { return s.ToString() + " from root " + std::to_string(s.root_rank); };
  const std::string error = OpError(SHOAL_OP_BROADCAST, e->name,
                                    "rank " + std::to_string(me) + " called it with " + call(e->sig) +
                                        ", which differs from the cached call the root ran, " + call(root) +
                                        " (the other ranks completed this step)");
  Request req{e->name, e->sig, e->step, error, SHOAL_MISMATCH, false, {}, {}};
  req.set = b->set;
  negotiation_->SendLater(std::move(req));
  host_->Finish(e, Status::Error(SHOAL_MISMATCH, error));
}

}  // namespace shoal
