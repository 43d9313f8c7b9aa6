// MPI messaging of the fake plugin's NCCL (fake_nccl.cc): messages of any length, waits
// with a deadline, polling that yields the CPU (in CI many ranks share few cores).
#pragma once
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace shoal_fake {

using Clock = std::chrono::steady_clock;
using Body = std::vector<int64_t>;  // what a call says about itself to one peer

constexpr int kTagData = 3;  // on a communicator's own MPI communicator

inline double TimeoutSeconds() {
  static const double s = [] {
    const char* v = std::getenv("SHOAL_FAKE_NCCL_TIMEOUT");
    const double x = v ? std::atof(v) : 0.0;
    return x > 0 ? x : 60.0;
  }();
  return s;
}

inline Clock::time_point Deadline() {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(TimeoutSeconds()));
}

inline std::string Within() {
  char b[64];
  std::snprintf(b, sizeof b, "within %g s (SHOAL_FAKE_NCCL_TIMEOUT)", TimeoutSeconds());
  return b;
}

// Polls without holding a core: in CI many ranks share few CPUs.
class Backoff {
 public:
  void Pause() {
    if (n_++ < 50) return std::this_thread::yield();
    std::this_thread::sleep_for(std::chrono::microseconds(std::min(1000, 20 << std::min(n_ - 50, 6))));
  }

 private:
  int n_ = 0;
};

// The next message from `peer` (or any source, which goes to *from) with `tag`, if one
// has arrived.
inline bool TryReceive(MPI_Comm comm, int peer, int tag, std::string* out, int* from = nullptr) {
  int flag = 0, n = 0;
  MPI_Message m;
  MPI_Status st;
  if (MPI_Improbe(peer, tag, comm, &flag, &m, &st) != MPI_SUCCESS || !flag) return false;
  MPI_Get_count(&st, MPI_BYTE, &n);
  out->resize(n);
  MPI_Mrecv(&(*out)[0], n, MPI_BYTE, &m, MPI_STATUS_IGNORE);
  if (from) *from = st.MPI_SOURCE;
  return true;
}

// The same, waiting until the deadline.
// Gives up once MPI is finalized: a setup the core left behind at shutdown (a peer never
// joined) must not call MPI after MPI_Finalize (a check between sleeps: rare races remain).
inline bool Receive(MPI_Comm comm, int peer, int tag, Clock::time_point deadline, std::string* out, int* from = nullptr) {
  for (Backoff b;; b.Pause()) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return false;
    if (TryReceive(comm, peer, tag, out, from)) return true;
    if (Clock::now() > deadline) return false;
  }
}

inline std::string Pack64(const Body& v) { return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 8); }
inline Body Unpack64(const std::string& s) {
  Body v(s.size() / 8);
  if (!v.empty()) std::memcpy(v.data(), s.data(), v.size() * 8);
  return v;
}

// Outstanding requests whose buffers must outlive them.
struct Requests {
  std::vector<MPI_Request> sends, recvs;
  std::vector<std::shared_ptr<std::string>> buffers;
  void Send(const void* p, size_t n, int peer, int tag, MPI_Comm c) {
    sends.emplace_back();
    MPI_Isend(p, static_cast<int>(n), MPI_BYTE, peer, tag, c, &sends.back());
  }
  void Send(std::string msg, int peer, int tag, MPI_Comm c) {
    buffers.push_back(std::make_shared<std::string>(std::move(msg)));
    Send(buffers.back()->data(), buffers.back()->size(), peer, tag, c);
  }
  void Recv(void* p, size_t n, int peer, MPI_Comm c) {
    recvs.emplace_back();
    MPI_Irecv(p, static_cast<int>(n), MPI_BYTE, peer, kTagData, c, &recvs.back());
  }
  // All complete by the deadline; else receives are cancelled and sends left to finish
  // with their buffers leaked (an error path: the communicator is dead from then on).
  bool Wait(Clock::time_point deadline) {
    std::vector<MPI_Request> all(sends);
    all.insert(all.end(), recvs.begin(), recvs.end());
    for (Backoff b;; b.Pause()) {
      int flag = 0;
      MPI_Testall(static_cast<int>(all.size()), all.data(), &flag, MPI_STATUSES_IGNORE);
      if (flag) break;
      if (Clock::now() > deadline) {
        for (size_t i = sends.size(); i < all.size(); ++i)
          if (all[i] != MPI_REQUEST_NULL) MPI_Cancel(&all[i]), MPI_Wait(&all[i], MPI_STATUS_IGNORE);
        for (size_t i = 0; i < sends.size(); ++i)
          if (all[i] != MPI_REQUEST_NULL) MPI_Request_free(&all[i]);
        new std::vector<std::shared_ptr<std::string>>(std::move(buffers));  // leaked on purpose
        sends.clear(), recvs.clear();
        return false;
      }
    }
    sends.clear(), recvs.clear(), buffers.clear();
    return true;
  }
};

}  // namespace shoal_fake
