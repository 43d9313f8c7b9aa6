// MPI implementation of WindowEngine (windows/windows.h): the class and window layout shared by
// mpi_windows.cc (create, free, the registry, the ranks' agreement on collectives) and
// mpi_window_ops.cc (the one-sided ops and the window mutexes). Internal to libshoal.
// Two windows per tensor, whatever the world size:
//   data window (bytes): slot 0 = this rank's published value (the target of win_get),
//                        slot 1+k = receive buffer of in-neighbour recv[k]
//   ctrl window (8-byte words): version[k] | mutex[k] | p[k] | own p
// Puts and accumulates are messages to the owner's delivery thread (mpi_window_delivery.h);
// gets and the mutexes use passive-target epochs (MPI_Win_lock/unlock), complete at unlock.
// Local reads and writes of a rank's own window memory happen inside an exclusive epoch on
// itself, under Delivery::OwnWindows(), so a win_update never sees half of a put.
#pragma once
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <exception>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "engines/mpi/mpi_fault.h"
#include "engines/mpi/mpi_window_delivery.h"
#include "windows/windows.h"

namespace shoal {
namespace mpiwin {

std::string MpiErr(int code, const std::string& what);

struct MpiFailure : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// A process failure (fault-tolerant mode): SHOAL_RANK_LOST, the runtime told (ReportMpiFailure).
struct RankLost : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// A wait that ran past SHOAL_STALL_SHUTDOWN_TIME (the windows stay usable).
struct Stalled : std::runtime_error {
  using std::runtime_error::runtime_error;
};

void Check(int rc, const std::string& what);  // throws MpiFailure

struct Window {
  int id = 0;  // the same on every rank: windows are created in the same order
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
  // Per slot: holds exact zeros (zero_init or a reset, nothing written since). Under
  // Delivery::OwnWindows, as the slots are.
  std::vector<bool> zero;
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
  MpiWindows(const Config& cfg, Stats* stats, WindowCancel* cancel)
      : cfg_(cfg), stats_(stats), cancel_(cancel) {
    MPI_Comm_dup(MpiJobComm(), &comm_);
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    delivery_ = std::make_unique<Delivery>(comm_, cfg_, stats_, cancel_);
  }
  // Windows still open at shutdown are left to MPI_Finalize: freeing them is collective.
  ~MpiWindows() override {}

  Status Create(const WinArgs& a) override;
  Status Free(const std::string& name) override;
  Status Put(const WinArgs& a, bool accumulate) override;
  Status Get(const WinArgs& a) override;
  Status Update(const WinArgs& a) override;
  Status Mutex(const WinArgs& a, bool acquire) override;
  Status Versions(const std::string& name, std::vector<int>* ranks, std::vector<int64_t>* v) override;
  Status AssociatedP(const std::string& name, double* p) override;
  std::vector<std::string> Names() const override;
  Travelling TakeTravelling() override {
    Travelling t;
    t.swap(travelling_);
    return t;
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
    } catch (const RankLost& ex) {
      broken_ = true;  // the recovery makes new windows
      broken_why_ = ex.what();
      return Status::Error(SHOAL_RANK_LOST, std::string(op) + "('" + name + "'): " + ex.what());
    } catch (const MpiFailure& ex) {
      broken_ = true;
      broken_why_ = ex.what();
      return Status::Error(SHOAL_ABORTED, std::string(op) + "('" + name + "'): " + ex.what());
    }
  }

  Window* Find(const WinArgs& a, const char* op);
  std::vector<int> Slots(Window* w, const std::vector<int>& ranks, const char* op);
  double LocalP(Window* w);

  // The window mutexes (mpi_window_ops.cc).
  void LockAll(Window* w, const std::vector<std::pair<int, int>>& locks);
  void Lock(Window* w, int owner, int k, bool acquire);
  void SpinLock(Window* w, int owner, int k, bool acquire);

  // The ranks' agreement on a collective (mpi_windows.cc).
  Status Agree(const std::string& mine, const std::string& what, std::vector<std::vector<std::string>>* all);
  static std::string Describe(const std::vector<std::string>& f);
  Status Await(MPI_Request* req, const std::string& what);

  Config cfg_;
  Stats* stats_;
  WindowCancel* cancel_;
  // Held while a job writes the caller's memory; throws once the caller stopped waiting.
  std::unique_lock<std::mutex> WritingCaller();
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  std::map<std::string, std::unique_ptr<Window>> windows_;
  int next_id_ = 0;
  std::unique_ptr<Delivery> delivery_;  // after windows_: destroyed (its thread stopped) first
  struct Exchange {
    std::string mine, buf;
    int len = 0;
    std::vector<int> lens, displs;
  };
  std::vector<std::shared_ptr<Exchange>> abandoned_;
  bool broken_ = false;
  std::string broken_why_;
  Travelling travelling_;  // what the last Put left in flight
};

}  // namespace mpiwin
}  // namespace shoal
