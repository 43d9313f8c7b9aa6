// MPI implementation of WindowEngine: two windows per tensor, whatever the world size.
//   data window (bytes): slot 0 = this rank's published value (the target of win_get),
//                        slot 1+k = receive buffer of in-neighbour recv[k]
//   ctrl window (8-byte words): version[k] | mutex[k] | p[k] | own p
// Puts and gets use passive-target epochs (MPI_Win_lock/unlock) and complete at unlock.
// Local reads and writes of a rank's own window memory happen inside an exclusive
// epoch on itself, so a win_update never sees half of a put.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <numeric>
#include <sstream>
#include <thread>

#include "../../reduce.h"
#include "../../windows.h"

namespace shoal {
namespace {

std::string MpiErr(int code, const std::string& what) {
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, msg, &len);
  return what + " failed: " + std::string(msg, len);
}

struct MpiFailure : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// A wait that ran past SHOAL_STALL_SHUTDOWN_TIME (the windows stay usable).
struct Stalled : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// MPICH runs out of communicator context ids near 2048 windows; stay clear of it.
constexpr size_t kMaxWindows = 1000;

void Check(int rc, const std::string& what) {
  if (rc != MPI_SUCCESS) throw MpiFailure(MpiErr(rc, what));
}

MPI_Datatype SumType(int dtype) {
  switch (dtype) {
    case SHOAL_FLOAT32: return MPI_FLOAT;
    case SHOAL_FLOAT64: return MPI_DOUBLE;
    case SHOAL_INT32: return MPI_INT32_T;
    case SHOAL_INT64: return MPI_INT64_T;
  }
  return MPI_DATATYPE_NULL;  // half types: get, add, put
}

std::string Join(const std::vector<int>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}

std::vector<std::string> Split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  std::istringstream in(s);
  while (std::getline(in, cur, sep)) out.push_back(cur);
  if (!s.empty() && s.back() == sep) out.emplace_back();
  return out;
}

std::vector<int> ParseRanks(const std::string& s) {
  std::vector<int> out;
  for (auto& t : Split(s, ',')) if (!t.empty()) out.push_back(std::stoi(t));
  return out;
}

struct Window {
  int dtype = 0;
  std::vector<int64_t> shape;
  size_t nbytes = 0, count = 0;
  std::vector<int> recv, send;
  std::vector<int> slot_at_dst;  // per send[k]: my slot at that rank
  std::vector<int> degree;       // in-degree of every rank (its ctrl window layout)
  MPI_Win data = MPI_WIN_NULL, ctrl = MPI_WIN_NULL;
  char* base = nullptr;
  int64_t* words = nullptr;
  size_t bytes = 0;  // data + ctrl, for stats
  std::map<std::pair<int, int>, int> held;  // (owner, slot) -> times this process holds it
  int Slot(int src) const {
    auto it = std::find(recv.begin(), recv.end(), src);
    return it == recv.end() ? -1 : static_cast<int>(it - recv.begin());
  }
  MPI_Aint VersionAt(int k) const { return k; }
  MPI_Aint MutexAt(int k, int deg) const { return deg + k; }
  static MPI_Aint PAt(int k, int deg) { return 2 * deg + k; }
  double& OwnP() { return reinterpret_cast<double*>(words)[3 * recv.size()]; }
  double& SlotP(int k) { return reinterpret_cast<double*>(words)[2 * recv.size() + k]; }
};

// Epoch helper: MPI_Win_lock on construction, unlock (completing every RMA op) on scope exit.
class Epoch {
 public:
  Epoch(MPI_Win w, int rank, int type) : w_(w), rank_(rank) {
    Check(MPI_Win_lock(type, rank, 0, w), "MPI_Win_lock");
  }
  ~Epoch() noexcept(false) {
    int rc = MPI_Win_unlock(rank_, w_);
    if (rc != MPI_SUCCESS && !std::uncaught_exceptions()) throw MpiFailure(MpiErr(rc, "MPI_Win_unlock"));
  }

 private:
  MPI_Win w_;
  int rank_;
};

class MpiWindows : public WindowEngine {
 public:
  MpiWindows(const Config& cfg, Stats* stats, const std::atomic<bool>* stop)
      : cfg_(cfg), stats_(stats), stop_(stop) {
    MPI_Comm_dup(MPI_COMM_WORLD, &comm_);
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  // Windows still open at shutdown are left to MPI_Finalize: freeing them is collective.
  ~MpiWindows() override {}

  Status Create(const WinArgs& a) override {
    return Guard("win_create", a.name, [&] {
      const size_t count = NumElements(a.shape), nbytes = count * DtypeSize(a.dtype);
      std::ostringstream rec;
      rec << "create\x1f" << a.name << "\x1f" << DtypeName(a.dtype) << ShapeString(a.shape) << "\x1f"
          << (windows_.count(a.name) ? "exists" : "new") << "\x1f" << Join(a.ranks) << "\x1f"
          << Join(a.send);
      std::vector<std::vector<std::string>> all;
      Status st = Agree(rec.str(), "win_create('" + a.name + "')", &all);
      if (!st.ok()) return st;
      for (int r = 1; r < size_; ++r)
        if (all[r][2] != all[0][2])
          return Status::Error(SHOAL_MISMATCH, "win_create('" + a.name + "'): ranks disagree: rank 0 has " +
                               all[0][2] + ", rank " + std::to_string(r) + " has " + all[r][2]);
      for (int r = 0; r < size_; ++r) {
        if (all[r][3] == "exists")
          return Status::Error(SHOAL_INVALID_ARGUMENT, "win_create: a window named '" + a.name +
                               "' already exists on rank " + std::to_string(r) + "; win_free it first");
      }
      std::vector<std::vector<int>> recv(size_), send(size_);
      for (int r = 0; r < size_; ++r) {
        recv[r] = ParseRanks(all[r][4]);
        send[r] = ParseRanks(all[r][5]);
      }
      for (int r = 0; r < size_; ++r)
        for (int d : send[r])
          if (std::find(recv[d].begin(), recv[d].end(), r) == recv[d].end())
            return Status::Error(SHOAL_MISMATCH, "win_create('" + a.name + "'): rank " + std::to_string(r) +
                                 " sends to rank " + std::to_string(d) + ", which does not receive from it");
      for (int r = 0; r < size_; ++r)
        for (int s : recv[r])
          if (std::find(send[s].begin(), send[s].end(), r) == send[s].end())
            return Status::Error(SHOAL_MISMATCH, "win_create('" + a.name + "'): rank " + std::to_string(r) +
                                 " receives from rank " + std::to_string(s) + ", which does not send to it");
      if (windows_.size() >= kMaxWindows)
        return Status::Error(SHOAL_INVALID_ARGUMENT, "win_create('" + a.name + "'): " + std::to_string(kMaxWindows) +
                             " windows exist, the most one process may hold; win_free some first");
      if (nbytes > INT_MAX)
        return Status::Error(SHOAL_INVALID_ARGUMENT, "win_create('" + a.name + "'): window tensors are limited to 2^31-1 bytes");
      auto w = std::make_unique<Window>();
      w->dtype = a.dtype;
      w->shape = a.shape;
      w->count = count;
      w->nbytes = nbytes;
      w->recv = a.ranks;
      w->send = a.send;
      for (int d : a.send) {
        auto& rd = recv[d];
        w->slot_at_dst.push_back(static_cast<int>(std::find(rd.begin(), rd.end(), rank_) - rd.begin()));
      }
      for (auto& r : recv) w->degree.push_back(static_cast<int>(r.size()));
      const size_t deg = w->recv.size();
      const MPI_Aint data_bytes = static_cast<MPI_Aint>((1 + deg) * nbytes);
      const MPI_Aint ctrl_words = static_cast<MPI_Aint>(3 * deg + 1);
      Check(MPI_Win_allocate(data_bytes, 1, MPI_INFO_NULL, comm_, &w->base, &w->data), "MPI_Win_allocate");
      Check(MPI_Win_allocate(ctrl_words * 8, 8, MPI_INFO_NULL, comm_, &w->words, &w->ctrl), "MPI_Win_allocate");
      MPI_Win_set_errhandler(w->data, MPI_ERRORS_RETURN);
      MPI_Win_set_errhandler(w->ctrl, MPI_ERRORS_RETURN);
      w->bytes = data_bytes + ctrl_words * 8;
      {
        Epoch e1(w->data, rank_, MPI_LOCK_EXCLUSIVE), e2(w->ctrl, rank_, MPI_LOCK_EXCLUSIVE);
        for (size_t k = 0; k <= deg; ++k) {
          char* slot = w->base + k * nbytes;
          if (k == 0 || !a.zero_init) std::memcpy(slot, a.data, nbytes);
          else std::memset(slot, 0, nbytes);
        }
        std::fill(w->words, w->words + 2 * deg, 0);
        for (size_t k = 0; k < deg; ++k) w->SlotP(k) = a.zero_init ? 0.0 : 1.0;
        w->OwnP() = 1.0;
      }
      // Nobody may put before every buffer is initialised.
      Check(MPI_Barrier(comm_), "MPI_Barrier");
      stats_->windows += 2;
      stats_->window_bytes += w->bytes;
      windows_[a.name] = std::move(w);
      return Status::Ok();
    });
  }

  Status Free(const std::string& name) override {
    return Guard("win_free", name, [&] {
      std::string have;
      if (name.empty()) for (auto& n : Names()) have += (have.empty() ? "" : ", ") + n;
      else have = windows_.count(name) ? "exists" : "missing";
      const std::string what = name.empty() ? "win_free(all)" : "win_free('" + name + "')";
      std::vector<std::vector<std::string>> all;
      Status st = Agree("free\x1f" + (name.empty() ? "*" : name) + "\x1f" + have, what, &all);
      if (!st.ok()) return st;
      for (int r = 0; r < size_; ++r) {
        if (name.empty() && all[r][2] != all[0][2])
          return Status::Error(SHOAL_MISMATCH, what + ": ranks hold different windows: rank 0 has [" +
                               all[0][2] + "], rank " + std::to_string(r) + " has [" + all[r][2] + "]");
        if (!name.empty() && all[r][2] != "exists")
          return Status::Error(SHOAL_INVALID_ARGUMENT, what + ": no window named '" + name + "' on rank " + std::to_string(r));
      }
      std::vector<std::string> names = name.empty() ? Names() : std::vector<std::string>{name};
      for (auto& n : names) {
        auto& w = windows_.at(n);
        Check(MPI_Win_free(&w->data), "MPI_Win_free");
        Check(MPI_Win_free(&w->ctrl), "MPI_Win_free");
        stats_->windows -= 2;
        stats_->window_bytes -= w->bytes;
        windows_.erase(n);
      }
      return Status::Ok();
    });
  }

  Status Put(const WinArgs& a, bool accumulate) override {
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
      ByteVec scaled(w->nbytes), old;
      for (size_t i : order) {
        const int dst = a.ranks[i], k = w->slot_at_dst[at[i]], deg = w->degree[dst];
        const double wt = a.weights[i];
        const void* src = a.data;
        if (wt != 1.0) {
          Scale(a.data, scaled.data(), w->dtype, w->count, wt);
          src = scaled.data();
        }
        if (a.require_mutex) Lock(w, dst, k, true);
        const MPI_Aint disp = static_cast<MPI_Aint>((1 + k) * w->nbytes);
        {
          // Data and control in one access epoch: the owner's win_update (exclusive on
          // both) sees a value and its version and p together or not at all.
          Epoch ed(w->data, dst, MPI_LOCK_SHARED), ec(w->ctrl, dst, MPI_LOCK_SHARED);
          MPI_Datatype sum = SumType(w->dtype);
          if (!accumulate) {
            Check(MPI_Put(src, Count(w->nbytes), MPI_BYTE, dst, disp, Count(w->nbytes), MPI_BYTE, w->data), "MPI_Put");
          } else if (sum != MPI_DATATYPE_NULL) {
            Check(MPI_Accumulate(src, Count(w->count), sum, dst, disp, Count(w->count), sum, MPI_SUM, w->data), "MPI_Accumulate");
          } else {  // no MPI sum for half types: read, add in float32, write back
            old.resize(w->nbytes);
            Check(MPI_Get(old.data(), Count(w->nbytes), MPI_BYTE, dst, disp, Count(w->nbytes), MPI_BYTE, w->data), "MPI_Get");
            Check(MPI_Win_flush(dst, w->data), "MPI_Win_flush");
            Combine(old.data(), {src}, old.data(), w->dtype, w->count, false, 1.0, {1.0});
            Check(MPI_Put(old.data(), Count(w->nbytes), MPI_BYTE, dst, disp, Count(w->nbytes), MPI_BYTE, w->data), "MPI_Put");
          }
          // The data lands (and its lock is really held) before version and p move: MPI
          // may take locks lazily, and the ctrl epoch closes first.
          Check(MPI_Win_flush(dst, w->data), "MPI_Win_flush");
          const int64_t one = 1;
          if (!accumulate)
            Check(MPI_Accumulate(&one, 1, MPI_INT64_T, dst, w->VersionAt(k), 1, MPI_INT64_T, MPI_SUM, w->ctrl), "MPI_Accumulate");
          const double p = p_self * wt;
          if (a.with_p)
            Check(MPI_Accumulate(&p, 1, MPI_DOUBLE, dst, Window::PAt(k, deg), 1, MPI_DOUBLE,
                                 accumulate ? MPI_SUM : MPI_REPLACE, w->ctrl), "MPI_Accumulate");
        }
        if (a.require_mutex) Lock(w, dst, k, false);
        (accumulate ? stats_->win_accumulates : stats_->win_puts) += 1;
        stats_->bytes_sent += w->nbytes;
      }
      if (a.self_weight != 1.0) Scale(a.data, a.data, w->dtype, w->count, a.self_weight);
      Epoch e1(w->data, rank_, MPI_LOCK_EXCLUSIVE), e2(w->ctrl, rank_, MPI_LOCK_EXCLUSIVE);
      std::memcpy(w->base, a.data, w->nbytes);  // publish the new local value
      if (a.with_p) w->OwnP() *= a.self_weight;
      return Status::Ok();
    });
  }

  Status Get(const WinArgs& a) override {
    return Guard("win_get", a.name, [&] {
      Window* w = Find(a, "win_get");
      std::vector<int> slots = Slots(w, a.ranks, "win_get");
      ByteVec buf(w->nbytes);
      for (size_t i = 0; i < a.ranks.size(); ++i) {
        const int src = a.ranks[i], k = slots[i];
        if (a.require_mutex) Lock(w, rank_, k, true);
        double p = 0;
        {
          // Value and p from one state of the source: its update is exclusive on both.
          Epoch ed(w->data, src, MPI_LOCK_SHARED);
          Check(MPI_Get(buf.data(), Count(w->nbytes), MPI_BYTE, src, 0, Count(w->nbytes), MPI_BYTE, w->data), "MPI_Get");
          Check(MPI_Win_flush(src, w->data), "MPI_Win_flush");
          if (a.with_p) {
            Epoch ec(w->ctrl, src, MPI_LOCK_SHARED);
            Check(MPI_Get(&p, 1, MPI_DOUBLE, src, OwnPOffset(w, src), 1, MPI_DOUBLE, w->ctrl), "MPI_Get");
          }
        }
        if (a.weights[i] != 1.0) Scale(buf.data(), buf.data(), w->dtype, w->count, a.weights[i]);
        {
          Epoch e1(w->data, rank_, MPI_LOCK_EXCLUSIVE), e2(w->ctrl, rank_, MPI_LOCK_EXCLUSIVE);
          std::memcpy(w->base + (1 + k) * w->nbytes, buf.data(), w->nbytes);
          w->words[w->VersionAt(k)] += 1;
          if (a.with_p) w->SlotP(k) = p * a.weights[i];
        }
        if (a.require_mutex) Lock(w, rank_, k, false);
        stats_->win_gets += 1;
        stats_->bytes_received += w->nbytes;
      }
      return Status::Ok();
    });
  }

  Status Update(const WinArgs& a) override {
    return Guard("win_update", a.name, [&] {
      Window* w = Find(a, "win_update");
      std::vector<int> slots = Slots(w, a.ranks, "win_update");
      std::vector<int> sorted = slots;
      std::sort(sorted.begin(), sorted.end());
      std::vector<std::pair<int, int>> own;
      for (int k : sorted) own.emplace_back(rank_, k);
      if (a.require_mutex) LockAll(w, own);
      {
        Epoch e1(w->data, rank_, MPI_LOCK_EXCLUSIVE), e2(w->ctrl, rank_, MPI_LOCK_EXCLUSIVE);
        std::vector<const void*> srcs;
        for (int k : slots) srcs.push_back(w->base + (1 + k) * w->nbytes);
        Combine(a.data, srcs, a.data, w->dtype, w->count, a.uniform, a.self_weight, a.weights);
        double p = a.uniform ? w->OwnP() : a.self_weight * w->OwnP();
        for (size_t i = 0; i < slots.size(); ++i) p += (a.uniform ? 1.0 : a.weights[i]) * w->SlotP(slots[i]);
        if (a.uniform) p /= static_cast<double>(slots.size() + 1);
        if (a.with_p) w->OwnP() = p;
        for (int k : slots) {
          w->words[w->VersionAt(k)] = 0;
          if (a.reset) {
            std::memset(w->base + (1 + k) * w->nbytes, 0, w->nbytes);
            w->SlotP(k) = 0.0;
          }
        }
        if (!a.clone) std::memcpy(w->base, a.data, w->nbytes);  // publish
      }
      if (a.require_mutex) for (auto it = sorted.rbegin(); it != sorted.rend(); ++it) Lock(w, rank_, *it, false);
      stats_->win_updates += 1;
      return Status::Ok();
    });
  }

  Status Mutex(const WinArgs& a, bool acquire) override {
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

  Status Versions(const std::string& name, std::vector<int>* ranks, std::vector<int64_t>* v) override {
    WinArgs a;
    a.name = name;
    return Guard("get_win_version", name, [&] {
      Window* w = Find(a, "get_win_version");
      Epoch e(w->ctrl, rank_, MPI_LOCK_EXCLUSIVE);
      *ranks = w->recv;
      v->assign(w->words, w->words + w->recv.size());
      return Status::Ok();
    });
  }

  Status AssociatedP(const std::string& name, double* p) override {
    WinArgs a;
    a.name = name;
    return Guard("win_associated_p", name, [&] {
      *p = LocalP(Find(a, "win_associated_p"));
      return Status::Ok();
    });
  }

  std::vector<std::string> Names() const override {
    std::vector<std::string> out;
    for (auto& kv : windows_) out.push_back(kv.first);
    return out;
  }

 private:
  static int Count(size_t n) {
    if (n > INT_MAX) throw ArgumentError(SHOAL_INVALID_ARGUMENT, "window tensors are limited to 2^31-1 bytes");
    return static_cast<int>(n);
  }

  template <typename F> Status Guard(const char* op, const std::string& name, F&& body) {
    if (broken_) return Status::Error(SHOAL_ABORTED, std::string(op) + ": window ops are disabled after an earlier failure: " + broken_why_);
    try {
      return body();
    } catch (const ArgumentError& ex) {
      return Status::Error(ex.code, ex.what());
    } catch (const Stalled& ex) {
      return Status::Error(SHOAL_ABORTED, std::string(op) + "('" + name + "'): " + ex.what());
    } catch (const MpiFailure& ex) {
      broken_ = true;
      broken_why_ = ex.what();
      return Status::Error(SHOAL_ABORTED, std::string(op) + "('" + name + "'): " + ex.what());
    }
  }

  Window* Find(const WinArgs& a, const char* op) {
    auto it = windows_.find(a.name);
    if (it == windows_.end())
      throw ArgumentError(SHOAL_INVALID_ARGUMENT, std::string(op) + ": no window named '" + a.name + "'; create it with win_create");
    Window* w = it->second.get();
    if (a.data && (a.dtype != w->dtype || a.shape != w->shape))
      throw ArgumentError(SHOAL_INVALID_ARGUMENT, std::string(op) + ": window '" + a.name + "' holds " +
                          DtypeName(w->dtype) + ShapeString(w->shape) + ", got " + DtypeName(a.dtype) + ShapeString(a.shape));
    return w;
  }

  std::vector<int> Slots(Window* w, const std::vector<int>& ranks, const char* op) {
    std::vector<int> out;
    for (int r : ranks) {
      int k = w->Slot(r);
      if (k < 0)
        throw ArgumentError(SHOAL_INVALID_ARGUMENT, std::string(op) + ": rank " + std::to_string(r) +
                            " is not an in-neighbour of rank " + std::to_string(rank_));
      out.push_back(k);
    }
    return out;
  }

  double LocalP(Window* w) {
    Epoch e(w->ctrl, rank_, MPI_LOCK_SHARED);
    return w->OwnP();
  }

  // A rank's own p follows its 3 * in-degree control words.
  static MPI_Aint OwnPOffset(Window* w, int src) { return 3 * static_cast<MPI_Aint>(w->degree[src]); }

  // Distributed spin lock on (owner, slot): compare-and-swap 0 -> 1, back off, retry.
  // Takes every (owner, slot) mutex in order; on failure releases those already taken.
  void LockAll(Window* w, const std::vector<std::pair<int, int>>& locks) {
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
  void Lock(Window* w, int owner, int k, bool acquire) {
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

  void SpinLock(Window* w, int owner, int k, bool acquire) {
    const MPI_Aint disp = w->MutexAt(k, w->degree[owner]);
    const int64_t zero = 0, one = 1;
    int64_t old = 0;
    auto start = std::chrono::steady_clock::now();
    bool warned = false;
    for (int spin = 0;; ++spin) {
      {
        Epoch e(w->ctrl, owner, MPI_LOCK_SHARED);
        if (acquire) Check(MPI_Compare_and_swap(&one, &zero, &old, MPI_INT64_T, owner, disp, w->ctrl), "MPI_Compare_and_swap");
        else Check(MPI_Accumulate(&zero, 1, MPI_INT64_T, owner, disp, 1, MPI_INT64_T, MPI_REPLACE, w->ctrl), "MPI_Accumulate");
      }
      if (!acquire || old == 0) return;
      double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (*stop_) throw MpiFailure("Shoal was shut down while waiting for a window mutex");
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

  // Allgather of one text record per rank (fields split at \x1f); every rank then checks
  // the records it got, so every rank reaches the same verdict. Waits without blocking
  // forever: a rank that never joins ends in an error after SHOAL_STALL_SHUTDOWN_TIME.
  Status Agree(const std::string& mine, const std::string& what, std::vector<std::vector<std::string>>* all) {
    // On the heap: a collective given up on still writes into them when late ranks come,
    // so they are then kept (abandoned_) rather than freed.
    auto x = std::make_shared<Exchange>();
    x->mine = mine;
    x->len = static_cast<int>(mine.size());
    x->lens.resize(size_);
    x->displs.resize(size_);
    MPI_Request req;
    Check(MPI_Iallgather(&x->len, 1, MPI_INT, x->lens.data(), 1, MPI_INT, comm_, &req), "MPI_Iallgather");
    Status st = Await(&req, what);
    if (!st.ok()) return abandoned_.push_back(x), st;
    auto& lens = x->lens;
    auto& displs = x->displs;
    std::partial_sum(lens.begin(), lens.end() - 1, displs.begin() + 1);
    x->buf.assign(displs.back() + lens.back(), '\0');
    Check(MPI_Iallgatherv(x->mine.data(), x->len, MPI_CHAR, &x->buf[0], lens.data(), displs.data(), MPI_CHAR, comm_, &req), "MPI_Iallgatherv");
    st = Await(&req, what);
    if (!st.ok()) return abandoned_.push_back(x), st;
    const std::string& buf = x->buf;
    all->clear();
    for (int r = 0; r < size_; ++r) all->push_back(Split(buf.substr(displs[r], lens[r]), '\x1f'));
    const auto& ref = (*all)[0];
    for (int r = 1; r < size_; ++r) {
      const auto& f = (*all)[r];
      // Fields 0..1 (kind, name) must agree everywhere; callers check the rest.
      for (size_t i = 0; i < 2 && i < ref.size(); ++i)
        if (f.size() <= i || f[i] != ref[i])
          return Status::Error(SHOAL_MISMATCH, what + ": ranks disagree: rank 0 called " + Describe(ref) +
                               ", rank " + std::to_string(r) + " called " + Describe(f));
    }
    return Status::Ok();
  }
  static std::string Describe(const std::vector<std::string>& f) {
    if (f.empty()) return "?";
    std::string s = "win_" + f[0];
    if (f.size() > 1) s += f[1] == "*" ? "(all)" : "('" + f[1] + "')";
    return s;
  }

  Status Await(MPI_Request* req, const std::string& what) {
    auto start = std::chrono::steady_clock::now();
    bool warned = false;
    for (int spin = 0;; ++spin) {
      int flag = 0;
      Check(MPI_Test(req, &flag, MPI_STATUS_IGNORE), "MPI_Test");
      if (flag) return Status::Ok();
      double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (*stop_ || (cfg_.stall_shutdown_time > 0 && waited > cfg_.stall_shutdown_time)) {
        broken_ = true;
        broken_why_ = what + " never completed";
        return Status::Error(SHOAL_ABORTED, what + ": other ranks did not join within " +
                                                std::to_string(static_cast<int>(waited)) + " s (a collective: every rank must call it)");
      }
      if (!warned && cfg_.stall_check_time > 0 && waited > cfg_.stall_check_time) {
        Log(LOG_WARNING, what + " has waited " + std::to_string(static_cast<int>(waited)) + " s for other ranks to call it");
        warned = true;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(std::min(spin, 200) + 1));
    }
  }

  Config cfg_;
  Stats* stats_;
  const std::atomic<bool>* stop_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  std::map<std::string, std::unique_ptr<Window>> windows_;
  struct Exchange {
    std::string mine, buf;
    int len = 0;
    std::vector<int> lens, displs;
  };
  std::vector<std::shared_ptr<Exchange>> abandoned_;
  bool broken_ = false;
  std::string broken_why_;
};

}  // namespace

std::unique_ptr<WindowEngine> CreateMpiWindows(const Config& cfg, Stats* stats, const std::atomic<bool>* stop) {
  return std::make_unique<MpiWindows>(cfg, stats, stop);
}

}  // namespace shoal
