#include "neighbor/neighbor_exchange.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <tuple>

#include "gpu/staging.h"
#include "common/reduce.h"
#include "negotiation/wire.h"

namespace shoal {
namespace {
constexpr uint32_t kMagic = 0x5348414cu;  // "SHAL"
constexpr uint32_t kLeaveMagic = 0x4c454156u;  // "LEAV"
}

Bytes NeighborExchange::LeaveNotice(uint64_t generation) {
  auto msg = std::make_shared<ByteVec>(sizeof(kLeaveMagic) + sizeof(generation));
  std::memcpy(msg->data(), &kLeaveMagic, sizeof(kLeaveMagic));
  std::memcpy(msg->data() + sizeof(kLeaveMagic), &generation, sizeof(generation));
  return msg;
}

bool NeighborExchange::IsLeaveNotice(const ByteVec& msg, uint64_t* generation) {
  uint32_t magic = 0;
  if (msg.size() != sizeof(magic) + sizeof(*generation)) return false;
  std::memcpy(&magic, msg.data(), sizeof(magic));
  std::memcpy(generation, msg.data() + sizeof(magic), sizeof(*generation));
  return magic == kLeaveMagic;
}

void NeighborExchange::Start(const std::vector<EntryPtr>& ready) {
  // (destination, entry, weight), grouped by destination in a fixed order.
  sends_.clear();
  const auto now = Clock::now();  // the stall check's start too (StallInspector)
  for (auto& e : ready) {
    e->t_comm_start = now;
    for (size_t k = 0; k < e->send_ranks.size(); ++k)
      sends_.emplace_back(e->send_ranks[k], e, e->send_weights.empty() ? 1.0 : e->send_weights[k]);
    waiting_.push_back(e);
  }
  if (sends_.size() > 1)
    std::stable_sort(sends_.begin(), sends_.end(),
                     [](const auto& a, const auto& b) { return std::get<0>(a) < std::get<0>(b); });
  for (size_t i = 0; i < sends_.size();) {
    const int dst = std::get<0>(sends_[i]);
    items_.clear();
    for (; i < sends_.size() && std::get<0>(sends_[i]) == dst; ++i)
      items_.emplace_back(std::get<1>(sends_[i]), std::get<2>(sends_[i]));
    Flush(dst, items_);
  }
  sends_.clear();  // drop the references
  items_.clear();
}

// The end of the message that starts at items[i]: as many entries as fit under the
// fusion threshold (at least one); *payload gets their bytes. A large entry travels alone
// (from its own memory when unscaled): fusing it would only add a copy, and each one
// sent apart is taken by its receiver as soon as it arrives.
size_t NeighborExchange::MessageEnd(const std::vector<std::pair<EntryPtr, double>>& items, size_t i,
                                    size_t* payload) const {
  size_t j = i;
  *payload = 0;
  do {
    *payload += items[j].first->nbytes();
    ++j;
  } while (j < items.size() && threshold_ > 0 && items[i].first->nbytes() < kDirectBytes && items[j].first->nbytes() < kDirectBytes &&
           static_cast<int64_t>(*payload + items[j].first->nbytes()) <= threshold_);
  return j;
}

// The headers of items[i, j), each saying how its data travels (`how`).
Writer NeighborExchange::Headers(const std::vector<std::pair<EntryPtr, double>>& items, size_t i, size_t j,
                                 uint8_t how) {
  Writer w(64 * (j - i) + 16);
  w.Put<uint32_t>(kMagic);
  w.Put<uint32_t>(static_cast<uint32_t>(j - i));
  for (size_t k = i; k < j; ++k) {
    w.PutString(items[k].first->name);
    w.PutSignature(items[k].first->sig);
    w.Put<int64_t>(items[k].first->step);
    w.Put<uint64_t>(items[k].first->nbytes());
    w.Put<uint8_t>(how);
  }
  return w;
}

void NeighborExchange::Flush(int dst, std::vector<std::pair<EntryPtr, double>>& items) {
  // Pieces that move from device memory go in messages of their own (headers only).
  auto path = [](const EntryPtr& e) { return e->gpu && e->gpu->direct ? e->sig.path & ~kFakePlugin : 0; };
  auto mid = std::stable_partition(items.begin(), items.end(), [&](const auto& it) { return path(it.first) == 0; });
  if (mid != items.end()) {
    std::vector<std::pair<EntryPtr, double>> device(mid, items.end());
    items.erase(mid, items.end());
    std::stable_sort(device.begin(), device.end(), [&](const auto& a, const auto& b) { return path(a.first) < path(b.first); });
    for (size_t i = 0, j = 0; i < device.size(); i = j) {
      std::vector<std::pair<EntryPtr, double>> same;
      for (j = i; j < device.size() && path(device[j].first) == path(device[i].first); ++j) same.push_back(device[j]);
      FlushDevice(dst, path(device[i].first), same);
    }
  }
  size_t i = 0;
  while (i < items.size()) {
    size_t payload = 0;
    const size_t j = MessageEnd(items, i, &payload);
    // A large tensor sent unscaled leaves from its own memory, after a header message
    // (copying 16 MiB into a message costs a third of the exchange on busy cores).
    EntryPtr first = items[i].first;
    const bool direct = j == i + 1 && payload >= kDirectBytes &&
                        (items[i].second == 1.0 || first->sig.op != SHOAL_OP_NEIGHBOR_ALLREDUCE);
    Writer w = Headers(items, i, j, direct);
    auto msg = pool_->Get(w.size() + (direct ? 0 : payload));
    std::memcpy(msg->data(), w.buffer().data(), w.size());
    size_t at = w.size();
    for (size_t k = i; k < j && !direct; ++k) {
      Entry& e = *items[k].first;
      if (trace_ && e.t_copy_start == Clock::time_point{}) e.t_copy_start = Clock::now();
      char* dstp = msg->data() + at;
      if (items[k].second == 1.0 || e.sig.op != SHOAL_OP_NEIGHBOR_ALLREDUCE) std::memcpy(dstp, e.input.data, e.nbytes());
      else Scale(e.input.data, dstp, e.sig.dtype, e.count(), items[k].second);
      at += e.nbytes();
      if (trace_) e.t_copy_end = Clock::now();
    }
    for (size_t k = i; k < j; ++k)
      (items[k].first->gpu ? stats_->neighbor_bytes_sent_staged : stats_->neighbor_bytes_sent_mpi) += items[k].first->nbytes();
    if (j - i > 1) ++stats_->fused_batches;
    stats_->bytes_sent += msg->size() + (direct ? payload : 0);
    std::vector<EntryPtr> in_msg;
    for (size_t k = i; k < j; ++k) {
      ++items[k].first->sends_pending;
      in_msg.push_back(items[k].first);
    }
    backend_->Send(dst, kTag, msg, [in_msg](const Status&) {
      for (auto& e : in_msg) --e->sends_pending;
    });
    if (direct) {
      first->direct_sends = true;  // completes only once its memory is no longer read
      ++first->sends_pending;
      backend_->SendFrom(dst, kDataTag, first->input.data, payload, [first](const Status& st) {
        if (!st.ok()) first->send_error = st;
        --first->sends_pending;
      });
    }
    i = j;
  }
}

void NeighborExchange::FlushDevice(int dst, int path, std::vector<std::pair<EntryPtr, double>>& items) {
  for (size_t i = 0, j = 0; i < items.size(); i = j) {
    size_t payload = 0;
    j = MessageEnd(items, i, &payload);
    Writer w = Headers(items, i, j, static_cast<uint8_t>(path));
    auto msg = pool_->Get(w.size());
    std::memcpy(msg->data(), w.buffer().data(), w.size());
    // First: the edge's first data is preceded by its link message.
    device_->Send(dst, path, std::vector<std::pair<EntryPtr, double>>(items.begin() + i, items.begin() + j));
    if (j - i > 1) ++stats_->fused_batches;
    stats_->bytes_sent += msg->size();
    backend_->Send(dst, kTag, msg, [](const Status&) {});
  }
}

void NeighborExchange::Accept(int src, Bytes msg) {
  stats_->bytes_received += msg->size();
  Reader r(msg->data(), msg->size());
  if (r.Get<uint32_t>() != kMagic) throw std::runtime_error("corrupt neighbor message");
  const uint32_t n = r.Get<uint32_t>();
  // Headers first, then the data: a message holds the headers of all its pieces.
  headers_.resize(n);
  for (auto& h : headers_) {
    h.name = r.GetString();
    h.sig = r.GetSignature();
    h.step = r.Get<int64_t>();
    h.nbytes = r.Get<uint64_t>();
    h.how = r.Get<uint8_t>();
  }
  // Device pieces of one message are received together (one grouped NCCL call).
  std::vector<uint64_t> device_bytes;
  int path = 0;
  for (auto& h : headers_) {
    if (h.how < kPathMpi) continue;
    if (path && h.how != path) throw std::runtime_error("corrupt neighbor message (mixed device paths)");
    path = h.how;
    device_bytes.push_back(h.nbytes);
  }
  std::vector<std::shared_ptr<Arrival>> device;
  if (path) device = device_->Receive(src, path, device_bytes);
  size_t d = 0;
  for (auto& h : headers_) {
    Piece p;
    p.sig = std::move(h.sig);
    p.step = h.step;
    p.nbytes = h.nbytes;
    if (h.how >= kPathMpi) {
      p.arrival = device[d++];
    } else if (h.how) {
      // The data follows on kDataTag; messages from one rank with one tag arrive in
      // order, so receives posted in header order get the matching data.
      p.msg = pool_->Get(h.nbytes);
      p.arrival = std::make_shared<Arrival>();
      backend_->ReceiveInto(src, kDataTag, p.msg->data(), h.nbytes, [buf = p.msg, a = p.arrival](const Status& st) {
        a->status = st;
        a->done = true;
      });
    } else {
      p.msg = msg;
      p.offset = r.Skip(h.nbytes) - msg->data();
    }
    if (!failed_.empty() && h.how < kPathMpi) {  // data of a step that failed here: not wanted
      auto f = failed_.find(h.name);
      if (f != failed_.end() && h.step <= f->second) continue;
    }
    auto [it, fresh] = stash_.try_emplace({src, std::move(h.name)});
    if (!fresh && it->second.empty()) --empty_keys_;
    it->second.push_back(std::move(p));
  }
}

std::vector<std::pair<EntryPtr, Status>> NeighborExchange::Complete() {
  std::vector<std::pair<EntryPtr, Status>> done;
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    Entry& e = **it;
    // A piece that does not match this entry (another GPU data path, dtype, shape) fails it
    // at once: its data may never arrive (a device piece for a rank that has no device).
    bool mismatch = false;
    bool all = std::all_of(e.recv_ranks.begin(), e.recv_ranks.end(), [&](int src) {
      auto s = stash_.find(Key{src, e.name});
      if (s == stash_.end() || s->second.empty()) return false;
      if (e.sharded && s->second.front().step != e.step && !OwnStep(e, s->second)) return false;
      const Piece& p = s->second.front();
      if (p.Arrived() && e.sends_pending == 0) return true;  // the common case: no signature compare here
      if (!p.sig.CompatibleForNeighbors(e.sig)) mismatch = true;
      return p.Arrived() || mismatch;
    });
    all = all && (mismatch || !e.direct_sends || e.sends_pending == 0);
    if (!all) { ++it; continue; }
    if (trace_) e.t_peers_ready = Clock::now();
    got_.clear();
    for (int src : e.recv_ranks) {
      auto& q = stash_.find(Key{src, e.name})->second;
      got_.push_back(std::move(q.front()));
      q.erase(q.begin());
      if (q.empty()) ++empty_keys_;
    }
    bool deferred = false;
    Status st = Finish(*it, got_, &deferred);
    if (mismatch && e.sends_pending > 0 && e.gpu && e.gpu->direct)  // nobody will take its sends
      device_->Abandon(e, "abandoned after a mismatch with a neighbor: " + st.message);
    got_.clear();
    if (!deferred) done.push_back({*it, st});  // else the device plane reports it when done
    it = waiting_.erase(it);
  }
  if (empty_keys_ > 4096) {  // e.g. many one-off names
    for (auto it = stash_.begin(); it != stash_.end();) it = it->second.empty() ? stash_.erase(it) : std::next(it);
    empty_keys_ = 0;
  }
  return done;
}

bool NeighborExchange::OwnStep(const Entry& e, std::vector<Piece>& q) {
  // A part's step is its op's, counted by every rank's calls, refused ones included: a
  // piece of an earlier step is one of a step that failed here before it ran (a peer's
  // refusal reached this rank in an earlier stage), not a rank off its schedule. One of a
  // later step: its sender went on past a step that failed, whose run the refusal ends.
  auto mine = std::find_if(q.begin(), q.end(), [&](const Piece& p) { return p.step >= e.step; });
  q.erase(q.begin(), mine);  // a receive still posted keeps its own buffer
  if (q.empty()) ++empty_keys_;
  return !q.empty() && q.front().step == e.step;
}

Status NeighborExchange::Finish(const EntryPtr& ep, std::vector<Piece>& got, bool* deferred) {
  Entry& e = *ep;
  // Built only for an error: a successful op allocates nothing here.
  auto op = [&] { return OpError(e.sig.op, e.name, ""); };
  if (!e.send_error.ok()) return Status::Error(SHOAL_ABORTED, op() + e.send_error.message);
  for (size_t k = 0; k < got.size(); ++k) {
    const int src = e.recv_ranks[k];
    if (got[k].step != e.step)
      return Status::Error(SHOAL_NEIGHBOR_MISMATCH, op() + "send and receive ranks disagree: rank " + std::to_string(src) +
          " sent to this rank at its step " + std::to_string(got[k].step) + " but this rank receives from rank " +
          std::to_string(src) + " at step " + std::to_string(e.step));
    if (!got[k].sig.CompatibleForNeighbors(e.sig))
      return Status::Error(SHOAL_MISMATCH, op() + "rank " + std::to_string(src) + " sent " + OpName(got[k].sig.op) +
          " " + got[k].sig.ToString() + " but this rank has " + OpName(e.sig.op) + " " + e.sig.ToString());
  }
  for (auto& p : got)  // after the headers' checks: a mismatch is the error to report
    if (p.arrival && !p.arrival->status.ok()) return Status::Error(SHOAL_ABORTED, op() + p.arrival->status.message);
  if (e.gpu && e.gpu->direct) {  // every piece is in device memory (the paths matched)
    std::vector<std::shared_ptr<Arrival>> pieces;
    std::vector<size_t> nbytes;
    if (e.sig.op == SHOAL_OP_NEIGHBOR_ALLGATHER) {
      e.result_shape = e.sig.shape;
      e.result_shape[0] = 0;
    }
    for (auto& p : got) {
      pieces.push_back(p.arrival);
      nbytes.push_back(p.nbytes);
      if (e.sig.op == SHOAL_OP_NEIGHBOR_ALLGATHER) e.result_shape[0] += p.sig.shape[0];
    }
    Status st = device_->Finish(ep, pieces, nbytes, trace_);
    *deferred = st.ok();
    return st;
  }
  auto data = [&](size_t k) { return got[k].msg->data() + got[k].offset; };
  if (e.sig.op == SHOAL_OP_NEIGHBOR_ALLREDUCE) {
    srcs_.clear();
    for (size_t k = 0; k < got.size(); ++k) srcs_.push_back(data(k));
    if (trace_) e.t_reduce_start = Clock::now();
    Combine(e.input.data, srcs_, e.output.data, e.sig.dtype, e.count(), e.uniform, e.self_weight,
            e.recv_weights);
    if (trace_) e.t_reduce_end = Clock::now();
    return Status::Ok();
  }
  // neighbor_allgather: concatenate along dim 0 in receive order.
  e.result_shape = e.sig.shape;
  e.result_shape[0] = 0;
  for (auto& p : got) e.result_shape[0] += p.sig.shape[0];
  for (auto& p : got) e.result_nbytes += p.nbytes;
  e.result = std::malloc(std::max<size_t>(e.result_nbytes, 1));
  size_t at = 0;
  for (size_t k = 0; k < got.size(); ++k) {
    std::memcpy(static_cast<char*>(e.result) + at, data(k), got[k].nbytes);
    at += got[k].nbytes;
  }
  return Status::Ok();
}

std::vector<std::pair<EntryPtr, std::vector<int>>> NeighborExchange::Waiting() const {
  std::vector<std::pair<EntryPtr, std::vector<int>>> out;
  for (auto& e : waiting_) {
    std::vector<int> missing;
    for (int src : e->recv_ranks) {
      auto s = stash_.find(Key{src, e->name});
      if (s == stash_.end() || s->second.empty() || !s->second.front().Arrived()) missing.push_back(src);
    }
    out.push_back({e, missing});
  }
  return out;
}

std::vector<std::pair<int, std::string>> NeighborExchange::Unmatched(Clock::time_point now, double age) {
  std::vector<std::pair<int, std::string>> out;
  for (auto& kv : stash_) {
    if (kv.second.empty()) continue;
    Piece& head = kv.second.front();
    if (head.reported || std::chrono::duration<double>(now - head.arrived).count() < age) continue;
    bool wanted = std::any_of(waiting_.begin(), waiting_.end(), [&](const EntryPtr& e) {
      return e->name == kv.first.second &&
             std::find(e->recv_ranks.begin(), e->recv_ranks.end(), kv.first.first) != e->recv_ranks.end();
    });
    if (wanted) continue;
    head.reported = true;
    out.push_back(kv.first);
  }
  return out;
}

std::vector<NeighborExchange::Dispute> NeighborExchange::Disputes(Clock::time_point now) {
  std::vector<Dispute> out;
  if (waiting_.empty() || now - last_scan_ < std::chrono::milliseconds(50)) return out;
  last_scan_ = now;
  const int me = backend_->world().rank;
  for (auto& kv : stash_) {
    if (kv.second.empty() || kv.second.front().disputed) continue;
    Piece& head = kv.second.front();
    const int src = kv.first.first;
    for (auto& e : waiting_) {
      if (e->name != kv.first.second || e->step < head.step ||
          std::find(e->recv_ranks.begin(), e->recv_ranks.end(), src) != e->recv_ranks.end())
        continue;
      head.disputed = true;
      // Worded as the coordinator's check words it (negotiation/coordinator.cc, CheckEdges).
      out.push_back({e->name, e->sig, head.step,
                     OpError(e->sig.op, e->name, "send and receive ranks disagree: rank " + std::to_string(src) +
                                                     " sends to rank " + std::to_string(me) + " at step " +
                                                     std::to_string(head.step) +
                                                     ", which does not receive from it at that step")});
      break;
    }
  }
  return out;
}

void NeighborExchange::Drop(const EntryPtr& e) {
  waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), e), waiting_.end());
}

std::vector<EntryPtr> NeighborExchange::TakeNeeding(int rank) {
  std::vector<EntryPtr> out;
  auto has = [](const std::vector<int>& v, int x) { return std::find(v.begin(), v.end(), x) != v.end(); };
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    const Entry& e = **it;
    // Device sends to a leaver fail through the device plane, after a grace period: the
    // leaver may have taken them (its op completed) before the transfer is polled here.
    bool stuck = e.direct_sends && e.sends_pending > 0 && has(e.send_ranks, rank) && !(e.gpu && e.gpu->direct);
    if (!stuck && has(e.recv_ranks, rank)) {
      auto s = stash_.find(Key{rank, e.name});
      stuck = s == stash_.end() || s->second.empty();
    }
    if (stuck) {
      out.push_back(*it);
      it = waiting_.erase(it);
    } else {
      ++it;
    }
  }
  return out;
}

void NeighborExchange::Failed(const std::string& name, int64_t step) {
  if (failed_.size() > 4096) failed_.clear();  // bounded: names whose steps failed
  auto [f, fresh] = failed_.try_emplace(name, step);
  if (!fresh) f->second = std::max(f->second, step);
  for (auto& kv : stash_) {
    if (kv.first.second != name || kv.second.empty()) continue;
    auto& q = kv.second;
    q.erase(std::remove_if(q.begin(), q.end(), [&](const Piece& p) {
              return p.step <= step && !(p.arrival && !p.msg);  // not a device piece
            }), q.end());
    if (q.empty()) ++empty_keys_;
  }
}

void NeighborExchange::Forget(const std::string& name) {
  auto of = [&](std::string_view n) {
    return n.substr(0, name.size()) == name && (n.size() == name.size() || n[name.size()] == '/');
  };
  for (auto it = failed_.begin(); it != failed_.end();) it = of(it->first) ? failed_.erase(it) : std::next(it);
  for (auto& [key, q] : stash_) {
    if (q.empty() || !of(key.second)) continue;
    q.clear();  // a receive still posted keeps its own buffer
    ++empty_keys_;
  }
}

std::vector<EntryPtr> NeighborExchange::TakeNamed(const std::string& name, int64_t step) {
  std::vector<EntryPtr> out;
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    if ((*it)->name == name && (step < 0 || (*it)->step == step)) {
      out.push_back(*it);
      it = waiting_.erase(it);
    } else {
      ++it;
    }
  }
  return out;
}

std::vector<EntryPtr> NeighborExchange::TakeAll() {
  std::vector<EntryPtr> all;
  all.swap(waiting_);
  return all;
}

}  // namespace shoal
