#include "neighbor.h"

#include <algorithm>

#include "reduce.h"
#include "wire.h"

namespace shoal {
namespace {
constexpr uint32_t kMagic = 0x5348414cu;  // "SHAL"
}

void NeighborExchange::Start(const std::vector<EntryPtr>& ready) {
  std::map<int, std::vector<std::pair<EntryPtr, double>>> out;
  for (auto& e : ready) {
    for (size_t k = 0; k < e->send_ranks.size(); ++k)
      out[e->send_ranks[k]].push_back({e, e->send_weights.empty() ? 1.0 : e->send_weights[k]});
    waiting_.push_back(e);
  }
  for (auto& kv : out) Flush(kv.first, kv.second);
}

void NeighborExchange::Flush(int dst, std::vector<std::pair<EntryPtr, double>>& items) {
  size_t i = 0;
  while (i < items.size()) {
    // One message: as many entries as fit under the threshold (at least one).
    size_t j = i, payload = 0;
    do {
      payload += items[j].first->nbytes();
      ++j;
    } while (j < items.size() && threshold_ > 0 &&
             static_cast<int64_t>(payload + items[j].first->nbytes()) <= threshold_);
    Writer w;
    w.Put<uint32_t>(kMagic);
    w.Put<uint32_t>(static_cast<uint32_t>(j - i));
    for (size_t k = i; k < j; ++k) {
      w.PutString(items[k].first->name);
      w.PutSignature(items[k].first->sig);
      w.Put<uint64_t>(items[k].first->nbytes());
    }
    auto msg = std::make_shared<std::vector<char>>(std::move(w.buffer()));
    size_t at = msg->size();
    msg->resize(at + payload);
    for (size_t k = i; k < j; ++k) {
      const Entry& e = *items[k].first;
      char* dstp = msg->data() + at;
      if (items[k].second == 1.0) std::memcpy(dstp, e.input.data, e.nbytes());
      else Scale(e.input.data, dstp, e.sig.dtype, e.count(), items[k].second);
      at += e.nbytes();
    }
    if (j - i > 1) ++stats_->fused_batches;
    stats_->bytes_sent += msg->size();
    backend_->Send(dst, kTag, msg, [](const Status&) {});
    i = j;
  }
}

bool NeighborExchange::Receive(Status* st) {
  bool any = false;
  while (true) {
    auto msg = std::make_shared<std::vector<char>>();
    int src = -1;
    if (!backend_->Receive(kTag, &src, msg.get(), st) || !st->ok()) return any;
    any = true;
    stats_->bytes_received += msg->size();
    Reader r(msg->data(), msg->size());
    if (r.Get<uint32_t>() != kMagic) throw std::runtime_error("corrupt neighbor message");
    uint32_t n = r.Get<uint32_t>();
    std::vector<std::pair<std::string, Piece>> pieces(n);
    std::vector<uint64_t> sizes(n);
    for (uint32_t k = 0; k < n; ++k) {
      pieces[k].first = r.GetString();
      pieces[k].second.sig = r.GetSignature();
      sizes[k] = r.Get<uint64_t>();
    }
    for (uint32_t k = 0; k < n; ++k) {
      pieces[k].second.msg = msg;
      pieces[k].second.offset = r.Skip(sizes[k]) - msg->data();
      stash_[{src, pieces[k].first}].push_back(std::move(pieces[k].second));
    }
  }
}

std::vector<std::pair<EntryPtr, Status>> NeighborExchange::Complete() {
  std::vector<std::pair<EntryPtr, Status>> done;
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    Entry& e = **it;
    bool all = std::all_of(e.recv_ranks.begin(), e.recv_ranks.end(), [&](int src) {
      auto s = stash_.find({src, e.name});
      return s != stash_.end() && !s->second.empty();
    });
    if (!all) { ++it; continue; }
    std::vector<Piece> got;
    for (int src : e.recv_ranks) {
      auto s = stash_.find({src, e.name});
      got.push_back(std::move(s->second.front()));
      s->second.pop_front();
      if (s->second.empty()) stash_.erase(s);
    }
    Status st;
    std::vector<const void*> srcs;
    for (size_t k = 0; k < got.size() && st.ok(); ++k) {
      if (got[k].sig != e.sig)
        st = Status::Error(SHOAL_MISMATCH,
                           std::string(OpName(e.sig.op)) + " '" + e.name + "': rank " +
                               std::to_string(e.recv_ranks[k]) + " sent " +
                               OpName(got[k].sig.op) + " " + got[k].sig.ToString() +
                               " but this rank has " + OpName(e.sig.op) + " " + e.sig.ToString());
      srcs.push_back(got[k].msg->data() + got[k].offset);
    }
    if (st.ok())
      Combine(e.input.data, srcs, e.output.data, e.sig.dtype, e.count(), e.uniform,
              e.self_weight, e.recv_weights);
    done.push_back({*it, st});
    it = waiting_.erase(it);
  }
  return done;
}

std::vector<std::pair<EntryPtr, std::vector<int>>> NeighborExchange::Waiting() const {
  std::vector<std::pair<EntryPtr, std::vector<int>>> out;
  for (auto& e : waiting_) {
    std::vector<int> missing;
    for (int src : e->recv_ranks) {
      auto s = stash_.find({src, e->name});
      if (s == stash_.end() || s->second.empty()) missing.push_back(src);
    }
    out.push_back({e, missing});
  }
  return out;
}

void NeighborExchange::Drop(const EntryPtr& e) {
  waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), e), waiting_.end());
}

std::vector<EntryPtr> NeighborExchange::TakeAll() {
  std::vector<EntryPtr> all;
  all.swap(waiting_);
  return all;
}

}  // namespace shoal
