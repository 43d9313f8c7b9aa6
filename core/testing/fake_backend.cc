#include "testing/fake_backend.h"

#include <algorithm>
#include <cstring>

#include "common/reduce.h"

namespace shoal {
namespace testing {

enum { kAllreduce = 1, kBroadcast, kAllgather, kBarrier, kReduceScatter, kAlltoall };

FakeWorld::FakeWorld(int size, uint64_t seed, int max_delay_us, int ranks_per_machine)
    : size_(size), per_machine_(ranks_per_machine > 0 ? ranks_per_machine : size), rng_(seed),
      max_delay_us_(max_delay_us), inbox_(size), dead_(size, 0) {}

void FakeWorld::Kill(int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  dead_[rank] = 1;
  any_dead_ = true;
  inbox_[rank].clear();
  for (auto& box : inbox_)  // what it sent and nobody took yet vanishes with it
    box.erase(std::remove_if(box.begin(), box.end(), [&](const Msg& m) { return m.src == rank; }), box.end());
  made_.notify_all();  // members waiting in AddSet for it
}

FakeWorld::Clock::time_point FakeWorld::Due(int src, int dst, int tag) {
  auto due = Clock::now();
  if (max_delay_us_ > 0) due += std::chrono::microseconds(rng_() % (max_delay_us_ + 1));
  auto& last = last_due_[{src, dst, tag}];
  due = std::max(due, last);  // MPI keeps the order per (source, destination, tag)
  last = due;
  return due;
}

void FakeWorld::Finish(Coll& c) {
  const size_t n = c.count * DtypeSize(c.dtype);
  if (c.kind == kAllreduce) {
    std::vector<const void*> srcs(c.bufs.begin(), c.bufs.end());
    ByteVec sum(std::max<size_t>(n, 1));
    Reduce(srcs, sum.data(), c.dtype, static_cast<size_t>(c.count), c.reduce_op);
    for (void* b : c.bufs) std::memcpy(b, sum.data(), n);
  } else if (c.kind == kReduceScatter) {
    std::vector<const void*> srcs(c.sends.begin(), c.sends.end());
    ByteVec all(std::max<size_t>(n, 1));
    Reduce(srcs, all.data(), c.dtype, static_cast<size_t>(c.count), c.reduce_op);
    const size_t es = DtypeSize(c.dtype);
    size_t at = 0;
    for (int r = 0; r < c.members; ++r) {
      std::memcpy(c.bufs[r], all.data() + at, c.split[r] * es);
      at += c.split[r] * es;
    }
  } else if (c.kind == kBroadcast) {
    for (int r = 0; r < c.members; ++r)
      if (r != c.root) std::memcpy(c.bufs[r], c.bufs[c.root], n);
  } else if (c.kind == kAlltoall) {
    const size_t es = DtypeSize(c.dtype);
    for (int r = 0; r < c.members && c.error.empty(); ++r)
      for (int q = 0; q < c.members; ++q)
        if (c.received[r][q] != c.sent[q][r])
          c.error = "rank " + std::to_string(r) + " expects " + std::to_string(c.received[r][q]) + " elements from rank " +
                    std::to_string(q) + ", which sends " + std::to_string(c.sent[q][r]);
    for (int r = 0; r < c.members && c.error.empty(); ++r) {
      size_t at = 0;
      for (int q = 0; q < c.members; ++q) {  // rank q's rows for r start after those for ranks < r
        int64_t from = 0;
        for (int k = 0; k < r; ++k) from += c.sent[q][k];
        std::memcpy(static_cast<char*>(c.bufs[r]) + at, static_cast<const char*>(c.sends[q]) + from * es,
                    c.sent[q][r] * es);
        at += c.sent[q][r] * es;
      }
    }
  } else if (c.kind == kAllgather) {
    const size_t es = DtypeSize(c.dtype);
    for (int r = 0; r < c.members; ++r) {
      size_t at = 0;
      for (int q = 0; q < c.members; ++q) {
        std::memcpy(static_cast<char*>(c.bufs[r]) + at, c.sends[q], c.counts[q] * es);
        at += c.counts[q] * es;
      }
    }
  }
}

FakeBackend::FakeBackend(std::shared_ptr<FakeWorld> world, int rank) : w_(std::move(world)) {
  const int per = w_->ranks_per_machine();
  info_.rank = rank;
  info_.size = w_->size();
  info_.local_rank = rank % per;
  info_.local_size = per;
  info_.machine_rank = rank / per;
  info_.machine_size = (w_->size() + per - 1) / per;
  info_.homogeneous = w_->size() % per == 0;
  for (int q = rank - rank % per; q < std::min(w_->size(), rank - rank % per + per); ++q) info_.machine_ranks.push_back(q);
}

void FakeBackend::Send(int dst, int tag, Bytes msg, Callback done) {
  SendFrom(dst, tag, msg->data(), msg->size(), [msg, done](const Status& st) { done(st); });
}

void FakeBackend::SendFrom(int dst, int tag, const void* data, size_t n, Callback done) {
  Status st;
  {
    std::lock_guard<std::mutex> lock(w_->mu_);
    if (w_->dead_[dst]) {
      st = Status::Error(SHOAL_ABORTED, "fake backend: rank " + std::to_string(dst) + " is dead");
    } else if (!w_->dead_[info_.rank]) {
      const char* p = static_cast<const char*>(data);
      w_->inbox_[dst].push_back({info_.rank, tag, ByteVec(p, p + n), w_->Due(info_.rank, dst, tag)});
    }
  }
  sent_.push_back({std::move(done), st});
}

void FakeBackend::ReceiveInto(int src, int tag, void* data, size_t n, Callback done) {
  posted_.push_back({src, tag, data, n, std::move(done)});
}

bool FakeBackend::Receive(const std::vector<int>& tags, int* tag, int* src, ByteVec* msg, Status* st) {
  *st = Status::Ok();
  std::lock_guard<std::mutex> lock(w_->mu_);
  auto& box = w_->inbox_[info_.rank];
  const auto now = FakeWorld::Clock::now();
  for (int t : tags) {
    for (auto it = box.begin(); it != box.end(); ++it) {
      if (it->tag != t || it->due > now) continue;
      *tag = t;
      *src = it->src;
      msg->swap(it->data);
      box.erase(it);
      return true;
    }
  }
  return false;
}

void FakeBackend::Collective(const FakeGroup& group, FakeWorld::Coll mine, Callback done, int channel, int scope) {
  // Every rank of the group's scope issues the collectives of one channel in the same order.
  const bool machine = scope == SHOAL_SCOPE_MACHINE && group.set_ == 0;
  int members = machine ? info_.local_size : info_.size, me = machine ? info_.local_rank : info_.rank;
  if (group.set_ != 0) {
    members = static_cast<int>(group.ranks_.size());
    me = static_cast<int>(std::find(group.ranks_.begin(), group.ranks_.end(), info_.rank) - group.ranks_.begin());
  }
  const uint64_t space = machine ? 1000 + info_.machine_rank : channel + 1;
  const std::pair<int, uint64_t> key{
      group.set_, (space << 40) | next_coll_[{group.set_, channel, machine ? info_.machine_rank : -1}]++};
  pending_colls_.push_back({key, std::move(done)});
  std::lock_guard<std::mutex> lock(w_->mu_);
  auto& c = w_->colls_[key];
  if (c.arrived == 0) {
    c.kind = mine.kind;
    c.dtype = mine.dtype;
    c.count = mine.count;
    c.root = mine.root;
    c.reduce_op = mine.reduce_op;
    c.split = mine.split;
    c.members = members;
    c.bufs.assign(members, nullptr);
    c.sends.assign(members, nullptr);
    c.counts.assign(members, 0);
    c.in.assign(members, 0);
    for (int i = 0; i < members; ++i)
      c.ranks.push_back(group.set_ != 0 ? group.ranks_[i] : machine ? info_.machine_ranks[i] : i);
  }
  c.in[me] = 1;
  c.bufs[me] = mine.bufs.empty() ? nullptr : mine.bufs[0];
  c.sends[me] = mine.sends.empty() ? nullptr : mine.sends[0];
  c.counts[me] = mine.count;
  if (mine.kind == kAlltoall) {
    c.sent.resize(members);
    c.received.resize(members);
    c.sent[me] = mine.split;
    c.received[me] = mine.recv_split;
  }
  if (++c.arrived == members) {
    w_->Finish(c);  // the last to arrive computes every rank's result
    c.complete = true;
  }
}

void FakeGroup::Allreduce(void* buf, int64_t count, int dtype, int reduce_op, int scope, Callback done) {
  FakeWorld::Coll c;
  c.kind = kAllreduce;
  c.reduce_op = reduce_op;
  c.bufs = {buf};
  c.count = count;
  c.dtype = dtype;
  b_->Collective(*this, std::move(c), std::move(done), -1, scope);
}

void FakeGroup::AllreduceOn(int channel, void* buf, int64_t count, int dtype, Callback done) {
  FakeWorld::Coll c;
  c.kind = kAllreduce;
  c.bufs = {buf};
  c.count = count;
  c.dtype = dtype;
  b_->Collective(*this, std::move(c), std::move(done), channel);
}

void FakeGroup::BroadcastOn(int channel, void* buf, int64_t count, int dtype, int root, Callback done) {
  BroadcastIn(channel, SHOAL_SCOPE_WORLD, buf, count, dtype, root, std::move(done));
}

void FakeGroup::Broadcast(void* buf, int64_t count, int dtype, int root, int scope, Callback done) {
  BroadcastIn(-1, scope, buf, count, dtype, root, std::move(done));
}

void FakeGroup::BroadcastIn(int channel, int scope, void* buf, int64_t count, int dtype, int root, Callback done) {
  FakeWorld::Coll c;
  c.kind = kBroadcast;
  c.bufs = {buf};
  c.count = count;
  c.dtype = dtype;
  c.root = root;
  b_->Collective(*this, std::move(c), std::move(done), channel, scope);
}

void FakeGroup::Allgatherv(const void* send, int64_t count, void* recv, const std::vector<int64_t>&, int dtype,
                           Callback done) {
  FakeWorld::Coll c;
  c.kind = kAllgather;
  c.bufs = {recv};
  c.sends = {send};
  c.count = count;
  c.dtype = dtype;
  b_->Collective(*this, std::move(c), std::move(done));
}

void FakeGroup::ReduceScatter(const void* send, void* recv, const std::vector<int64_t>& counts, int dtype,
                              int reduce_op, Callback done) {
  FakeWorld::Coll c;
  c.kind = kReduceScatter;
  c.bufs = {recv};
  c.sends = {send};
  c.split = counts;
  for (int64_t k : counts) c.count += k;
  c.dtype = dtype;
  c.reduce_op = reduce_op;
  b_->Collective(*this, std::move(c), std::move(done));
}

void FakeGroup::Alltoallv(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                          const std::vector<int64_t>& recv_counts, int dtype, Callback done) {
  FakeWorld::Coll c;
  c.kind = kAlltoall;
  c.bufs = {recv};
  c.sends = {send};
  c.split = send_counts;
  c.recv_split = recv_counts;
  c.dtype = dtype;
  b_->Collective(*this, std::move(c), std::move(done));
}

void FakeGroup::Barrier(Callback done) {
  FakeWorld::Coll c;
  c.kind = kBarrier;
  b_->Collective(*this, std::move(c), std::move(done));
}

bool FakeGroup::Progress() { return b_->Progress(); }
size_t FakeGroup::num_in_flight() const { return b_->num_in_flight(); }

Status FakeBackend::AddSet(int id, const std::vector<int>& ranks) {
  // As MPI_Comm_create_group: returns once every member has called it (or one is dead).
  std::unique_lock<std::mutex> lock(w_->mu_);
  ++w_->making_[id];
  w_->made_.notify_all();
  auto dead = [&] {
    for (int r : ranks) if (w_->dead_[r]) return r;
    return -1;
  };
  w_->made_.wait_for(lock, std::chrono::seconds(30), [&] {
    return w_->making_[id] >= static_cast<int>(ranks.size()) || dead() >= 0;
  });
  if (w_->making_[id] < static_cast<int>(ranks.size()))
    return Status::Error(SHOAL_ABORTED, "fake backend: process set " + std::to_string(id) + ": rank " +
                                            std::to_string(dead()) + " never made it");
  sets_[id] = std::make_unique<FakeGroup>(this, id, ranks);
  return Status::Ok();
}

GroupCollectives* FakeBackend::OfSet(int id) {
  auto it = sets_.find(id);
  return it == sets_.end() ? nullptr : it->second.get();
}

bool FakeBackend::Progress() {
  std::vector<std::pair<Callback, Status>> run;
  run.swap(sent_);
  {
    std::lock_guard<std::mutex> lock(w_->mu_);
    auto& box = w_->inbox_[info_.rank];
    const auto now = FakeWorld::Clock::now();
    // Posted receives match in posting order, each the oldest message of its (source, tag).
    for (auto p = posted_.begin(); p != posted_.end();) {
      auto m = std::find_if(box.begin(), box.end(), [&](const FakeWorld::Msg& x) {
        return x.src == p->src && x.tag == p->tag;
      });
      if (m == box.end() || m->due > now) {
        if (w_->dead_[p->src]) {
          run.push_back({std::move(p->done), Status::Error(SHOAL_ABORTED, "fake backend: rank " +
                                                                             std::to_string(p->src) + " is dead")});
          p = posted_.erase(p);
        } else {
          ++p;
        }
        continue;
      }
      Status st = m->data.size() == p->n ? Status::Ok()
                                         : Status::Error(SHOAL_ABORTED, "fake backend: message of another size");
      std::memcpy(p->data, m->data.data(), std::min(p->n, m->data.size()));
      box.erase(m);
      run.push_back({std::move(p->done), st});
      p = posted_.erase(p);
    }
    for (auto c = pending_colls_.begin(); c != pending_colls_.end();) {
      auto it = w_->colls_.find(c->first);
      if (!it->second.complete) {
        // A member that died before it arrived: the collective cannot complete (MPI ends the
        // job, or fails it under ULFM).
        const FakeWorld::Coll& k = it->second;
        int dead = -1;
        for (size_t i = 0; i < k.ranks.size() && dead < 0; ++i)
          if (!k.in[i] && w_->dead_[k.ranks[i]]) dead = k.ranks[i];
        if (dead < 0) {
          ++c;
          continue;
        }
        run.push_back({std::move(c->second),
                       Status::Error(SHOAL_ABORTED, "fake backend: rank " + std::to_string(dead) + " is dead")});
        c = pending_colls_.erase(c);
        continue;
      }
      const Status st = it->second.error.empty() ? Status::Ok()
                                                 : Status::Error(SHOAL_ABORTED, "fake backend: " + it->second.error);
      if (++it->second.seen == it->second.members) w_->colls_.erase(it);
      run.push_back({std::move(c->second), st});
      c = pending_colls_.erase(c);
    }
  }
  for (auto& r : run) r.first(r.second);
  return !run.empty();
}

size_t FakeBackend::num_in_flight() const { return sent_.size() + posted_.size() + pending_colls_.size(); }

}  // namespace testing
}  // namespace shoal
