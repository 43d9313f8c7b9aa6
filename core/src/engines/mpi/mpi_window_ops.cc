// MPI windows, part 2 of 2: the one-sided ops (win_put / win_accumulate, sent by
// mpi_window_delivery.h; win_get / win_update, versions, associated p) and the window
// mutexes, a distributed spin lock on the ctrl window (class in mpi_windows.h; creation and
// freeing are in mpi_windows.cc).
#include <algorithm>
#include <chrono>
#include <climits>
#include <numeric>
#include <thread>

#include "common/reduce.h"
#include "engines/mpi/mpi_windows.h"

namespace shoal {
namespace mpiwin {

Status MpiWindows::Put(const WinArgs& a, bool accumulate) {
  const char* op = accumulate ? "win_accumulate" : "win_put";
  return Guard(op, a.name, [&] {
    Window* w = Find(a, op);
    std::vector<int> at(a.ranks.size());
    for (size_t i = 0; i < a.ranks.size(); ++i) {
      auto it = std::find(w->send.begin(), w->send.end(), a.ranks[i]);
      if (it == w->send.end())
        throw ArgumentError(SHOAL_INVALID_ARGUMENT, std::string(op) + ": rank " + std::to_string(a.ranks[i]) +
                            " is not an out-neighbour of rank " + std::to_string(rank_) + " for window '" + a.name + "'");
      at[i] = static_cast<int>(it - w->send.begin());
    }
    // Nearest clockwise destination first: spreads the traffic over the ring.
    std::vector<size_t> order(a.ranks.size());
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](size_t x, size_t y) {
      return (a.ranks[x] - rank_ + size_) % size_ < (a.ranks[y] - rank_ + size_) % size_;
    });
    const double p_self = a.with_p ? LocalP(w) : 0.0;
    std::vector<Delivery::Parcel> parcels;
    for (size_t i : order) {
      Delivery::Parcel p;
      p.dst = a.ranks[i];
      p.slot = w->slot_at_dst[at[i]];
      // A copy, scaled: MPI reads it after this op returns if the owner never answers.
      p.bytes = std::make_shared<std::vector<char>>(w->nbytes);
      if (a.weights[i] != 1.0) Scale(a.data, p.bytes->data(), w->dtype, w->count, a.weights[i]);
      else if (w->nbytes) std::memcpy(p.bytes->data(), a.data, w->nbytes);
      p.accumulate = accumulate;
      p.with_p = a.with_p;
      p.p = p_self * a.weights[i];
      parcels.push_back(std::move(p));
    }
    if (!a.require_mutex) {
      // To every destination at once; the parcels travel after this job (the window thread
      // polls them), so the ops behind it need not wait for them (docs/design.md §23).
      auto batch = delivery_->Post(w, parcels);
      travelling_ = [this, batch, op, name = a.name](bool give_up) -> std::optional<Status> {
        bool done = false;
        Status st = Guard(op, name, [&] {
          done = delivery_->Test(batch);  // at a shutdown: true if it landed, else it throws
          if (give_up && !done) throw MpiFailure("a put was given up while in flight");
          return Status::Ok();
        });
        if (!st.ok()) delivery_->Keep(batch);  // window ops broken meanwhile: MPI may still read it
        if (st.ok() && !done) return std::nullopt;
        return st;
      };
    } else {
      // One owner's mutex at a time, as a win_mutex holder would take them.
      for (auto& p : parcels) {
        Lock(w, p.dst, p.slot, true);
        try {
          delivery_->Send(w, {p});
        } catch (...) {
          Lock(w, p.dst, p.slot, false);
          throw;
        }
        Lock(w, p.dst, p.slot, false);
      }
    }
    (accumulate ? stats_->win_accumulates : stats_->win_puts) += static_cast<int64_t>(parcels.size());
    stats_->bytes_sent += static_cast<int64_t>(parcels.size() * w->nbytes);
    auto own = delivery_->OwnWindows();
    Epoch e1(w->data, rank_, MPI_LOCK_EXCLUSIVE), e2(w->ctrl, rank_, MPI_LOCK_EXCLUSIVE);
    auto writing = WritingCaller();  // after the locks: never held across an MPI wait
    if (a.self_weight != 1.0) Scale(a.data, a.data, w->dtype, w->count, a.self_weight);
    std::memcpy(w->base, a.data, w->nbytes);  // publish the new local value
    if (a.with_p) w->OwnP() *= a.self_weight;
    return Status::Ok();
  });
}

Status MpiWindows::Get(const WinArgs& a) {
  return Guard("win_get", a.name, [&] {
    Window* w = Find(a, "win_get");
    std::vector<int> slots = Slots(w, a.ranks, "win_get");
    ByteVec buf(w->nbytes);
    for (size_t i = 0; i < a.ranks.size(); ++i) {
      const int src = a.ranks[i], k = slots[i];
      if (a.require_mutex) Lock(w, rank_, k, true);
      {
        // The value only: p slots are moved by put/accumulate alone (BlueFog's win_get leaves them).
        Epoch ed(w->data, src, MPI_LOCK_SHARED);
        Check(MPI_Get(buf.data(), Count(w->nbytes), MPI_BYTE, src, 0, Count(w->nbytes), MPI_BYTE, w->data), "MPI_Get");
        Check(MPI_Win_flush(src, w->data), "MPI_Win_flush");
      }
      if (a.weights[i] != 1.0) Scale(buf.data(), buf.data(), w->dtype, w->count, a.weights[i]);
      {
        auto own = delivery_->OwnWindows();
        Epoch e1(w->data, rank_, MPI_LOCK_EXCLUSIVE), e2(w->ctrl, rank_, MPI_LOCK_EXCLUSIVE);
        std::memcpy(w->base + (1 + k) * w->nbytes, buf.data(), w->nbytes);
        w->zero[k] = false;
        w->words[w->VersionAt(k)] += 1;
      }
      if (a.require_mutex) Lock(w, rank_, k, false);
      stats_->win_gets += 1;
      stats_->bytes_received += w->nbytes;
    }
    return Status::Ok();
  });
}

Status MpiWindows::Update(const WinArgs& a) {
  return Guard("win_update", a.name, [&] {
    Window* w = Find(a, "win_update");
    std::vector<int> slots = Slots(w, a.ranks, "win_update");
    std::vector<int> sorted = slots;
    std::sort(sorted.begin(), sorted.end());
    std::vector<std::pair<int, int>> own;
    for (int k : sorted) own.emplace_back(rank_, k);
    if (a.require_mutex) LockAll(w, own);
    {
      auto mine = delivery_->OwnWindows();
      Epoch e1(w->data, rank_, MPI_LOCK_EXCLUSIVE), e2(w->ctrl, rank_, MPI_LOCK_EXCLUSIVE);
      std::vector<const void*> srcs;
      std::vector<double> weights;
      for (size_t i = 0; i < slots.size(); ++i) {
        // A weighted sum skips the slots that hold zeros (push-sum's one peer a step: one
        // slot of several); a uniform average counts every slot. The one difference: an
        // element -0.0 with nothing added stays -0.0 (adding +0.0 would make it +0.0).
        if (!a.uniform && w->zero[slots[i]]) continue;
        srcs.push_back(w->base + (1 + slots[i]) * w->nbytes);
        weights.push_back(a.weights[i]);
      }
      auto writing = WritingCaller();  // after the locks: never held across an MPI wait
      Combine(a.data, srcs, a.data, w->dtype, w->count, a.uniform, a.self_weight, weights);
      double p = a.uniform ? w->OwnP() : a.self_weight * w->OwnP();
      for (size_t i = 0; i < slots.size(); ++i) p += (a.uniform ? 1.0 : a.weights[i]) * w->SlotP(slots[i]);
      if (a.uniform) p /= static_cast<double>(slots.size() + 1);
      if (a.with_p) w->OwnP() = p;
      for (int k : slots) {
        w->words[w->VersionAt(k)] = 0;
        if (a.reset) {
          if (!w->zero[k]) std::memset(w->base + (1 + k) * w->nbytes, 0, w->nbytes);
          w->zero[k] = true;
          if (a.with_p) w->SlotP(k) = 0.0;  // BlueFog: p slots are reset only with p on
        }
      }
      if (!a.clone) std::memcpy(w->base, a.data, w->nbytes);  // publish
    }
    if (a.require_mutex) for (auto it = sorted.rbegin(); it != sorted.rend(); ++it) Lock(w, rank_, *it, false);
    stats_->win_updates += 1;
    return Status::Ok();
  });
}

Status MpiWindows::Mutex(const WinArgs& a, bool acquire) {
  return Guard("win_mutex", a.name, [&] {
    Window* w = Find(a, "win_mutex");
    // (owner, slot) pairs, taken in one global order so two holders never wait on each other.
    std::vector<std::pair<int, int>> locks;
    if (a.for_self) {
      for (int k : Slots(w, a.ranks, "win_mutex")) locks.emplace_back(rank_, k);
    } else {
      for (int d : a.ranks) {
        auto it = std::find(w->send.begin(), w->send.end(), d);
        if (it == w->send.end())
          throw ArgumentError(SHOAL_INVALID_ARGUMENT, "win_mutex: rank " + std::to_string(d) + " is not an out-neighbour");
        locks.emplace_back(d, w->slot_at_dst[it - w->send.begin()]);
      }
    }
    std::sort(locks.begin(), locks.end());
    if (acquire) LockAll(w, locks);
    else for (auto it = locks.rbegin(); it != locks.rend(); ++it) Lock(w, it->first, it->second, false);
    return Status::Ok();
  });
}

Status MpiWindows::Versions(const std::string& name, std::vector<int>* ranks, std::vector<int64_t>* v) {
  WinArgs a;
  a.name = name;
  return Guard("get_win_version", name, [&] {
    Window* w = Find(a, "get_win_version");
    auto own = delivery_->OwnWindows();
    Epoch e(w->ctrl, rank_, MPI_LOCK_EXCLUSIVE);
    *ranks = w->recv;
    v->assign(w->words, w->words + w->recv.size());
    return Status::Ok();
  });
}

Status MpiWindows::AssociatedP(const std::string& name, double* p) {
  WinArgs a;
  a.name = name;
  return Guard("win_associated_p", name, [&] {
    *p = LocalP(Find(a, "win_associated_p"));
    return Status::Ok();
  });
}

double MpiWindows::LocalP(Window* w) {
  auto own = delivery_->OwnWindows();
  Epoch e(w->ctrl, rank_, MPI_LOCK_SHARED);
  return w->OwnP();
}

// Distributed spin lock on (owner, slot): test-and-set (swap in 1; taken when 0 came back),
// back off, retry. A mutex word only ever holds 0 or 1.
// Takes every (owner, slot) mutex in order; on failure releases those already taken.
void MpiWindows::LockAll(Window* w, const std::vector<std::pair<int, int>>& locks) {
  size_t taken = 0;
  try {
    for (; taken < locks.size(); ++taken) Lock(w, locks[taken].first, locks[taken].second, true);
  } catch (...) {
    while (taken-- > 0) Lock(w, locks[taken].first, locks[taken].second, false);
    throw;
  }
}

// Reentrant per process: a mutex this process holds is counted, not re-taken, so
// win_put(require_mutex=True) inside `with win_mutex(...)` does not wait on itself.
void MpiWindows::Lock(Window* w, int owner, int k, bool acquire) {
  int& held = w->held[{owner, k}];
  if (acquire && held++ > 0) return;
  if (!acquire) {
    if (held == 0) {
      w->held.erase({owner, k});
      throw ArgumentError(SHOAL_INVALID_ARGUMENT, "win_mutex: releasing a mutex this rank does not hold");
    }
    if (--held > 0) return;
    w->held.erase({owner, k});
  }
  try {
    SpinLock(w, owner, k, acquire);
  } catch (...) {
    if (acquire) w->held.erase({owner, k});
    throw;
  }
}

void MpiWindows::SpinLock(Window* w, int owner, int k, bool acquire) {
  const MPI_Aint disp = w->MutexAt(k, w->degree[owner]);
  const int64_t zero = 0, one = 1;
  int64_t old = 0;
  auto start = std::chrono::steady_clock::now();
  bool warned = false;
  for (int spin = 0;; ++spin) {
    {
      std::unique_lock<std::mutex> own;
      if (owner == rank_) own = delivery_->OwnWindows();
      Epoch e(w->ctrl, owner, MPI_LOCK_SHARED);
      // Test-and-set (an atomic swap) rather than MPI_Compare_and_swap, which crashes Open
      // MPI 4.1's osc/rdma over shared memory (btl/vader's emulated compare-and-swap).
      if (acquire) Check(MPI_Fetch_and_op(&one, &old, MPI_INT64_T, owner, disp, MPI_REPLACE, w->ctrl), "MPI_Fetch_and_op");
      else Check(MPI_Accumulate(&zero, 1, MPI_INT64_T, owner, disp, 1, MPI_INT64_T, MPI_REPLACE, w->ctrl), "MPI_Accumulate");
    }
    if (!acquire || old == 0) return;
    double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (cancel_->stop) throw MpiFailure("Shoal was shut down while waiting for a window mutex");
    if (cfg_.stall_shutdown_time > 0 && waited > cfg_.stall_shutdown_time)
      throw Stalled("the mutex of rank " + std::to_string(owner) + " (slot " + std::to_string(k) +
                    ") stayed taken for more than " + std::to_string(static_cast<int>(waited)) + " s");
    if (!warned && cfg_.stall_check_time > 0 && waited > cfg_.stall_check_time) {
      Log(LOG_WARNING, "waiting " + std::to_string(static_cast<int>(waited)) + " s for the mutex of rank " +
                           std::to_string(owner) + " (slot " + std::to_string(k) + ")");
      warned = true;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(std::min(spin, 100) + 1));
  }
}

}  // namespace mpiwin
}  // namespace shoal
