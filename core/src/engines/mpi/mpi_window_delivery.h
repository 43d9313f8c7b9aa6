// win_put and win_accumulate as messages (docs/design.md §16, "Puts as messages"): the
// sender sends the scaled tensor to the owner, whose delivery thread answers and adds or
// copies it into the slot; the put completes with that answer. Over TCP between machines,
// MPI's passive-target accumulate moved push-sum's bytes a third slower than point-to-point,
// and an owner's win_update (an exclusive epoch) waited out every put's epoch on its window.
// Part of MpiWindows (mpi_windows.h); internal to libshoal.
#pragma once
#include <mpi.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "common/config.h"
#include "common/stats.h"
#include "windows/windows.h"

namespace shoal {
namespace mpiwin {

struct Window;

class Delivery {
 public:
  // One message: a window's slot at the owner gets `nbytes` of `data` (added with
  // `accumulate`), and with `with_p` its p (added or replaced likewise).
  struct Parcel {
    int dst = 0, slot = 0;
    std::shared_ptr<std::vector<char>> bytes;  // the window's nbytes; kept while MPI may read it
    bool accumulate = false, with_p = false;
    double p = 0.0;
  };

  Delivery(MPI_Comm comm, const Config& cfg, Stats* stats, WindowCancel* cancel);
  ~Delivery();  // stops the thread (it cancels its receive)

  // Owner's side: which windows messages may reach (the thread starts with the first).
  void Add(Window* w);
  void Remove(Window* w);
  // Held around every access epoch a process opens on its own windows: the delivery thread
  // and the op thread are one MPI process, which may not hold two locks on one target.
  std::unique_lock<std::mutex> OwnWindows() { return std::unique_lock<std::mutex>(mu_); }

  // Sender's side. Post() sends every parcel of window `w` at once; Test() is true once
  // each owner has applied its parcel. Both throw MpiFailure (RankLost for a lost rank):
  // an MPI error, an owner's refusal, a shutdown, or no answer within
  // SHOAL_STALL_SHUTDOWN_TIME; the batch's buffers are then kept for MPI (the engine's
  // window ops stay disabled). Send() is Post() and Test() until it is true.
  struct Batch;
  std::shared_ptr<Batch> Post(Window* w, const std::vector<Parcel>& parcels);
  bool Test(const std::shared_ptr<Batch>& b);
  void Send(Window* w, const std::vector<Parcel>& parcels);
  // A batch given up on (a shutdown, or window ops disabled meanwhile): MPI may still use it.
  void Keep(const std::shared_ptr<Batch>& b) { abandoned_.push_back(b); }

 private:
  struct Header {
    int32_t window, slot, flags, reply_tag;
    int64_t nbytes;
    double p;
  };
  struct Outgoing;  // one parcel in flight (mpi_window_delivery.cc)
  void Serve();
  bool Stopping() const { return stop_ || cancel_->stop; }
  // Under mu_: the window a parcel is for (nullptr: none it fits), and its application.
  Window* Fits(const Header& h);
  void Apply(Window* w, const Header& h, const void* payload);
  // Test()s `req` until it completes (false: the thread is stopping).
  bool Drain(MPI_Request* req);
  // Throws for a send's MPI error `rc`: RankLost (the runtime told), or MpiFailure.
  [[noreturn]] void Failed(int rc, int dst);

  MPI_Comm data_ = MPI_COMM_NULL, replies_ = MPI_COMM_NULL;  // dups: headers and payloads; answers
  int rank_ = 0;
  const Config& cfg_;
  Stats* stats_;
  WindowCancel* cancel_;
  std::mutex mu_;  // the windows below, and every epoch on this process's own windows
  std::map<int, Window*> windows_;
  std::set<int> senders_;  // every window's in-neighbours: the thread receives from each
  std::atomic<bool> stop_{false};
  std::thread thread_;
  int32_t next_tag_ = 0;
  std::vector<std::shared_ptr<Batch>> abandoned_;  // sends given up on: MPI may still use them
};

}  // namespace mpiwin
}  // namespace shoal
