// The communication engine the runtime drives. Calls come from one thread at a time
// (the runtime's progress driver); every operation is asynchronous and completes through a
// callback from Progress(), so the loop never blocks on a slow peer.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common.h"
#include "config.h"

namespace shoal {

using Callback = std::function<void(const Status&)>;
using Bytes = std::shared_ptr<ByteVec>;

struct WorldInfo {
  int rank = 0, size = 1, local_rank = 0, local_size = 1;
  int machine_rank = 0, machine_size = 1;
  bool homogeneous = true;
  bool threads_multiple = true;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const WorldInfo& world() const = 0;

  // Point-to-point messages (control plane and neighbor data).
  virtual void Send(int dst, int tag, Bytes msg, Callback done) = 0;
  // Zero-copy forms: send `n` bytes at `data` / receive `n` bytes from `src` into `data`.
  // The memory must stay valid until `done` runs (the callback may own it).
  virtual void SendFrom(int dst, int tag, const void* data, size_t n, Callback done) = 0;
  virtual void ReceiveInto(int src, int tag, void* data, size_t n, Callback done) = 0;
  // Takes one waiting message with one of `tags` (tried in that order) from any rank;
  // false if none.
  virtual bool Receive(const std::vector<int>& tags, int* tag, int* src, ByteVec* msg, Status* st) = 0;

  // Collectives of process set `set` (0: every rank; else a set made by AddSet), which
  // every member starts in the same order. Ranks in them (root, counts) are indices in the
  // set's ranks (ascending world ranks).
  // scope: SHOAL_SCOPE_WORLD or SHOAL_SCOPE_MACHINE (root is then a local rank; set 0 only).
  // reduce_op: SHOAL_REDUCE_SUM, MIN, MAX or PRODUCT (an average is a sum here).
  virtual void Allreduce(void* buf, int64_t count, int dtype, int reduce_op, int scope, int set, Callback done) = 0;
  virtual void Broadcast(void* buf, int64_t count, int dtype, int root, int scope, int set, Callback done) = 0;
  virtual void Allgatherv(const void* send, int64_t count, void* recv, const std::vector<int64_t>& counts,
                          int dtype, int set, Callback done) = 0;
  // Reduces every member's `send` (the sum of `counts` elements) with reduce_op (SUM, MIN,
  // MAX, PRODUCT) and leaves member r the counts[r] elements at offset counts[0] + ... +
  // counts[r-1] in its `recv` (MPI_Reduce_scatter).
  virtual void ReduceScatter(const void* send, void* recv, const std::vector<int64_t>& counts, int dtype,
                             int reduce_op, int set, Callback done) = 0;
  virtual void Barrier(int set, Callback done) = 0;
  // Allreduce (sum) on collective channel `channel` of process set `set`, in
  // [0, kChannels) for set 0 and [0, kSetChannels) for the others: each channel has its
  // own collective order (an MPI communicator), independent of the others and of the
  // collectives above, so ops cached on different channels never wait for each other
  // (runtime_cache.cc). Made with their set.
  static constexpr int kChannels = 64, kSetChannels = 16;
  virtual void AllreduceOn(int set, int channel, void* buf, int64_t count, int dtype, Callback done) = 0;

  // Process sets (process_sets.h): the members of set `id` (ascending world ranks, this
  // rank among them) make its communicators together, every member calling AddSet for
  // the sets it belongs to in the same order (blocking until every member has called it);
  // RemoveSet frees them (every member, in the same order). The progress driver calls both.
  virtual Status AddSet(int id, const std::vector<int>& ranks) = 0;
  virtual void RemoveSet(int id) = 0;

  // Completes finished operations (running their callbacks); true if any finished.
  virtual bool Progress() = 0;
  virtual size_t num_in_flight() const = 0;
};

// MPI engine: initialises MPI if nobody has, duplicates its communicators.
std::unique_ptr<Backend> CreateMpiBackend(const Config& cfg, Status* st);
void FinalizeMpiIfOwned();
void AbortJob(int exit_code);
std::string MpiLibraryVersion();

}  // namespace shoal
