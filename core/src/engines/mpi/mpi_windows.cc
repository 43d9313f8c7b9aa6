// MPI windows, part 1 of 2: the lifecycle and the registry (class in mpi_windows.h).
// win_create / win_free are collectives on the window communicator: Agree allgathers one
// record per rank so every rank reaches the same verdict, Await waits on it without hanging.
// The one-sided ops and the window mutexes are in mpi_window_ops.cc.
#include "engines/mpi/mpi_windows.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <numeric>
#include <sstream>
#include <thread>

namespace shoal {
namespace mpiwin {

std::string MpiErr(int code, const std::string& what) {
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, msg, &len);
  return what + " failed: " + std::string(msg, len);
}

void Check(int rc, const std::string& what) {
  if (rc != MPI_SUCCESS) throw MpiFailure(MpiErr(rc, what));
}

namespace {

// MPICH runs out of communicator context ids near 2048 windows; stay clear of it.
constexpr size_t kMaxWindows = 1000;

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

// `s` without the record's field separator.
std::string Sanitized(std::string s) {
  std::replace(s.begin(), s.end(), '\x1f', ' ');
  return s;
}

std::vector<int> ParseRanks(const std::string& s) {
  std::vector<int> out;
  for (auto& t : Split(s, ',')) if (!t.empty()) out.push_back(std::stoi(t));
  return out;
}

}  // namespace

Status MpiWindows::Create(const WinArgs& a) {
  return Guard("win_create", a.name, [&] {
    const size_t count = NumElements(a.shape), nbytes = count * DtypeSize(a.dtype);
    std::ostringstream rec;
    rec << "create\x1f" << a.name << "\x1f" << DtypeName(a.dtype) << ShapeString(a.shape) << "\x1f"
        << (windows_.count(a.name) ? "exists" : "new") << "\x1f" << Join(a.ranks) << "\x1f"
        << Join(a.send) << "\x1f" << a.refused_code << "\x1f" << Sanitized(a.refused);
    std::vector<std::vector<std::string>> all;
    Status st = Agree(rec.str(), "win_create('" + a.name + "')", &all);
    if (!st.ok()) return st;
    // A rank that refused the call at its start: every rank raises its error.
    if (!a.refused.empty()) return Status::Error(a.refused_code, a.refused);
    for (int r = 0; r < size_; ++r)
      if (all[r].size() > 7 && !all[r][7].empty())
        return Status::Error(std::stoi(all[r][6]), all[r][7] + " (raised at the call on rank " + std::to_string(r) + ")");
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
    // Lists from the C ABI come unchecked (Python's come from the topology): each rank's
    // neighbours are other ranks, once each; every rank sees every list, so all raise alike.
    auto wrong = [&](int r, const std::vector<int>& list, size_t i) -> std::string {
      const int q = list[i];
      if (q == r) return "itself";
      if (q < 0 || q >= size_) return "rank " + std::to_string(q) + ", outside [0, " + std::to_string(size_) + ")";
      if (std::find(list.begin(), list.begin() + i, q) != list.begin() + i)
        return "rank " + std::to_string(q) + " twice";
      return "";
    };
    for (int r = 0; r < size_; ++r)
      for (const auto* list : {&recv[r], &send[r]})
        for (size_t i = 0; i < list->size(); ++i) {
          const std::string bad = wrong(r, *list, i);
          if (!bad.empty())
            return Status::Error(SHOAL_INVALID_ARGUMENT, "win_create('" + a.name + "'): rank " + std::to_string(r) +
                                 (list == &recv[r] ? " receives from " : " sends to ") + bad);
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
    w->id = ++next_id_;
    {
      auto own = delivery_->OwnWindows();
      Epoch e1(w->data, rank_, MPI_LOCK_EXCLUSIVE), e2(w->ctrl, rank_, MPI_LOCK_EXCLUSIVE);
      for (size_t k = 0; k <= deg; ++k) {
        char* slot = w->base + k * nbytes;
        if (k == 0 || !a.zero_init) std::memcpy(slot, a.data, nbytes);
        else std::memset(slot, 0, nbytes);
      }
      std::fill(w->words, w->words + 2 * deg, 0);
      // p slots start at 0, with zero_init or not (BlueFog: its p window is 1 at the owner, 0 elsewhere).
      for (size_t k = 0; k < deg; ++k) w->SlotP(k) = 0.0;
      w->zero.assign(deg, a.zero_init);
      w->OwnP() = 1.0;
    }
    delivery_->Add(w.get());
    try {
      // Nobody may put before every buffer is initialised.
      Check(MPI_Barrier(comm_), "MPI_Barrier");
    } catch (...) {
      delivery_->Remove(w.get());  // before the window goes: a parcel may still come
      throw;
    }
    stats_->windows += 2;
    stats_->window_bytes += w->bytes;
    windows_[a.name] = std::move(w);
    return Status::Ok();
  });
}

Status MpiWindows::Free(const std::string& name) {
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
      // Every put to it has been answered: each rank's puts completed before it came here.
      delivery_->Remove(w.get());
      Check(MPI_Win_free(&w->data), "MPI_Win_free");
      Check(MPI_Win_free(&w->ctrl), "MPI_Win_free");
      stats_->windows -= 2;
      stats_->window_bytes -= w->bytes;
      windows_.erase(n);
    }
    return Status::Ok();
  });
}

std::vector<std::string> MpiWindows::Names() const {
  std::vector<std::string> out;
  for (auto& kv : windows_) out.push_back(kv.first);
  return out;
}

Window* MpiWindows::Find(const WinArgs& a, const char* op) {
  auto it = windows_.find(a.name);
  if (it == windows_.end())
    throw ArgumentError(SHOAL_INVALID_ARGUMENT, std::string(op) + ": no window named '" + a.name + "'; create it with win_create");
  Window* w = it->second.get();
  if (a.data && (a.dtype != w->dtype || a.shape != w->shape))
    throw ArgumentError(SHOAL_INVALID_ARGUMENT, std::string(op) + ": window '" + a.name + "' holds " +
                        DtypeName(w->dtype) + ShapeString(w->shape) + ", got " + DtypeName(a.dtype) + ShapeString(a.shape));
  return w;
}

std::vector<int> MpiWindows::Slots(Window* w, const std::vector<int>& ranks, const char* op) {
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

// Allgather of one text record per rank (fields split at \x1f); every rank then checks
// the records it got, so every rank reaches the same verdict. Waits without blocking
// forever: a rank that never joins ends in an error after SHOAL_STALL_SHUTDOWN_TIME.
Status MpiWindows::Agree(const std::string& mine, const std::string& what, std::vector<std::vector<std::string>>* all) {
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

std::string MpiWindows::Describe(const std::vector<std::string>& f) {
  if (f.empty()) return "?";
  std::string s = "win_" + f[0];
  if (f.size() > 1) s += f[1] == "*" ? "(all)" : "('" + f[1] + "')";
  return s;
}

Status MpiWindows::Await(MPI_Request* req, const std::string& what) {
  auto start = std::chrono::steady_clock::now();
  bool warned = false;
  for (int spin = 0;; ++spin) {
    int flag = 0;
    Check(MPI_Test(req, &flag, MPI_STATUS_IGNORE), "MPI_Test");
    if (flag) return Status::Ok();
    double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (cancel_->stop || (cfg_.stall_shutdown_time > 0 && waited > cfg_.stall_shutdown_time)) {
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

}  // namespace mpiwin

std::unique_lock<std::mutex> mpiwin::MpiWindows::WritingCaller() {
  std::unique_lock<std::mutex> lock(cancel_->writing);
  if (cancel_->orphaned) throw MpiFailure("a rank of the job was lost and the caller stopped waiting");
  return lock;
}

std::unique_ptr<WindowEngine> CreateMpiWindows(const Config& cfg, Stats* stats, WindowCancel* cancel) {
  return std::make_unique<mpiwin::MpiWindows>(cfg, stats, cancel);
}

}  // namespace shoal
