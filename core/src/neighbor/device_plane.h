// Neighbor data of CUDA tensors moved from device memory, without host staging: by NCCL
// (SHOAL_GPU_BACKEND=nccl) or by a CUDA-aware MPI (SHOAL_GPU_BACKEND=mpi where MPI says
// it can read device memory). The neighbor exchange (neighbor/neighbor_exchange.h) still sends each piece's
// header over MPI; only the data takes this path.
//
// Why it cannot deadlock, although ranks submit named ops in any order and NCCL needs
// matching calls in one order per communicator: every directed edge src -> dst has a
// communicator of its own (2 ranks: the sender is rank 0) and a stream of its own on each
// end. Only the sender issues sends on it, in the order it sends the headers over MPI;
// MPI keeps messages from one rank in order, so the receiver issues the matching receives
// in that same order when the headers arrive, whether or not it has submitted the op yet
// (the data lands in a pooled device buffer, as pieces of the MPI path land in the stash).
// No call on one edge waits for a call on another edge, so no cycle can form. The
// communicator is made when the edge first carries data: the sender creates the NCCL id
// and sends it ahead of the first header; both ends join on a helper thread, so the
// driving thread never blocks in ncclCommInitRank; data queues until it is ready. The
// CUDA-aware MPI path posts MPI sends from device memory once the data is ready (an
// event), in header order, and receives into pooled device buffers likewise.
//
// A rank uses one device for its neighbor ops (the first one it submits on). Driver only.
#pragma once
#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "engines/backend.h"
#include "cuda_plugin/cuda_api.h"
#include "runtime/entry.h"
#include "common/stats.h"

namespace shoal {

class GpuStaging;

// Data of a neighbor piece received separately from its header: by MPI into host memory
// (neighbor/neighbor_exchange.cc), or here into `device` memory.
struct Arrival {
  bool done = false;
  Status status;
  std::shared_ptr<void> device;  // the pooled device buffer (null for host pieces)
  void* data() const { return device.get(); }
};

class DevicePlane {
 public:
  static constexpr int kTag = 19;  // CUDA-aware MPI data, sent from device memory

  DevicePlane(Backend* backend, Stats* stats) : backend_(backend), stats_(stats) {}
  ~DevicePlane() { Stop(); }

  // This rank's neighbor ops use `device` (the first call fixes it); false and *why when
  // `device` is another one. `gpu` gives the core's stream for combines.
  bool Bind(const shoal_cuda_api* api, int device, GpuStaging* gpu, std::string* why);
  // The message a sender puts ahead of an edge's first header: the edge's NCCL id, or why
  // it has none (the receiver's pieces on that edge then fail with it).
  static bool IsLinkMessage(const ByteVec& msg);
  void OnLinkMessage(int src, const ByteVec& msg);
  // Sends the data of `items` (entry, send weight) of one header message to `dst` on
  // `path` (kPathNccl or kPathMpi): call before sending the header, which it may precede
  // with the edge's link message. Each entry's sends_pending counts until sent.
  void Send(int dst, int path, const std::vector<std::pair<EntryPtr, double>>& items);
  // Receives the pieces of one header message from `src`, `nbytes` each, into device
  // buffers: one Arrival per piece, done when its data is there.
  std::vector<std::shared_ptr<Arrival>> Receive(int src, int path, const std::vector<uint64_t>& nbytes);
  // Combines (neighbor_allreduce) or gathers (neighbor_allgather, into e->result) the
  // arrived pieces (`nbytes` each) on the device; the entry comes back from Poll once that
  // work is done. Gathers: the caller has set e->result_shape.
  Status Finish(const EntryPtr& e, const std::vector<std::shared_ptr<Arrival>>& pieces,
                const std::vector<size_t>& nbytes, bool trace);
  // Progress: edge setup, queued calls, completions. Finished entries go to *done.
  bool Poll(std::vector<std::pair<EntryPtr, Status>>* done);
  bool Idle() const;
  // Orders `stream` after every call this rank issued that may still use e's memory
  // (its sends): on error completions, whose sends may still be queued.
  void Fence(const Entry& e, void* stream);
  // `rank` left the job: its edges' calls that cannot complete fail at once (setups it
  // will never join), the others after a grace period unless they complete (it may have
  // taken or sent the data before it left); NCCL communicators are then aborted.
  void OnLeave(int rank);
  // Fails e's sends still queued or running (their receiver will not take them).
  void Abandon(const Entry& e, const std::string& why);
  // Aborts communicators with work outstanding, destroys the others, frees the pools.
  void Stop();

 private:
  struct Pool;
  struct Call {  // one grouped NCCL call (or a set of MPI transfers) on an edge, in order
    bool send = false;
    std::vector<EntryPtr> entries;                   // sends: whose sends_pending it holds
    std::vector<std::pair<EntryPtr, double>> items;  // sends, until issued
    std::vector<uint64_t> nbytes;                    // receives
    std::vector<std::shared_ptr<Arrival>> arrivals;  // receives
    std::vector<std::shared_ptr<void>> hold;         // scaled copies being sent
    std::vector<shoal_nccl_peer> parts;
    void* event = nullptr;                           // recorded after the call
    bool posted = false;                             // MPI transfers posted
    std::shared_ptr<int> mpi_pending;                // MPI transfers not yet complete
    std::shared_ptr<Status> mpi_status;
  };
  struct Setup {  // an NCCL communicator being joined on a helper thread
    std::thread thread;
    std::atomic<bool> done{false};
    void* comm = nullptr;
    std::string error;
  };
  struct Link {
    int peer = -1, path = 0;
    bool out = false;
    bool have_id = false;
    char id[128] = {0};
    std::shared_ptr<Setup> setup;
    void* comm = nullptr;
    void* stream = nullptr;
    std::string error;  // the edge failed: every call on it fails with this
    bool retry = false;  // it failed in setup, before any data moved: the next data starts over
    Clock::time_point peer_left{};  // set: the peer left; running calls fail after a grace period
    std::deque<Call> queued, running;
  };
  using LinkKey = std::tuple<int, bool, int>;  // (peer, out, path)
  struct Pending {  // a combine or gather on the device, until its event completes
    EntryPtr entry;
    void* event = nullptr;
    std::vector<std::shared_ptr<Arrival>> pieces;
    std::vector<std::pair<std::shared_ptr<void>, size_t>> host;  // gathers: pinned copies, bytes
  };

  Link& GetLink(int peer, bool out, int path);
  void Reset(Link& l);
  bool Advance(Link& l);
  bool Issue(Link& l, Call& c, std::string* err);
  bool Check(Link& l, Call& c, std::string* err);
  void FailLink(Link& l, const std::string& why);
  void FailCall(Call& c, const std::string& why);
  void StartSetup(Link& l);
  std::string Describe(const Link& l) const;

  Backend* backend_;
  Stats* stats_;
  const shoal_cuda_api* api_ = nullptr;
  GpuStaging* gpu_ = nullptr;
  int device_ = -1;
  std::shared_ptr<Pool> device_pool_, host_pool_;
  std::map<LinkKey, Link> links_;
  std::vector<Pending> pending_;
};

}  // namespace shoal
