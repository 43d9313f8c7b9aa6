// The communication engines the runtime drives (docs/design.md §12): MPI, NCCL
// (engines/nccl/nccl_backend.h) and the unit tests' fake implement these interfaces. Calls come from one
// thread at a time (the runtime's progress driver); every operation is asynchronous and
// completes through a callback from Progress(), so the loop never blocks on a slow peer.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/common.h"
#include "common/config.h"

namespace shoal {

using Callback = std::function<void(const Status&)>;
using Bytes = std::shared_ptr<ByteVec>;

struct WorldInfo {
  int rank = 0, size = 1, local_rank = 0, local_size = 1;
  int machine_rank = 0, machine_size = 1;
  bool homogeneous = true;
  bool threads_multiple = true;
  std::vector<int> machine_ranks;  // the world ranks of this rank's machine, by local rank
};

// Collectives of one engine over the world or this rank's machine (scope), on memory that
// engine reads (host memory for MPI and the fake, device memory for NCCL); every rank of
// the scope starts them in the same order. Asynchronous: `done` runs from Progress().
class Collectives {
 public:
  virtual ~Collectives() = default;
  // In place. reduce_op: SHOAL_REDUCE_SUM, MIN, MAX or PRODUCT (engines that say so also
  // take AVERAGE: the sum, divided by the scope's size). root: a rank of the scope.
  virtual void Allreduce(void* buf, int64_t count, int dtype, int reduce_op, int scope, Callback done) = 0;
  virtual void Broadcast(void* buf, int64_t count, int dtype, int root, int scope, Callback done) = 0;
  // World scope. `recv` is host memory (the core allocates gathered results there): rank
  // r's counts[r] elements at offset counts[0] + ... + counts[r-1].
  virtual void Allgatherv(const void* send, int64_t count, void* recv, const std::vector<int64_t>& counts,
                          int dtype, Callback done) = 0;
  // Reduces every rank's `send` (the sum of `counts` elements) and leaves rank r, in host
  // memory `recv`, the counts[r] elements at offset counts[0] + ... + counts[r-1]
  // (MPI_Reduce_scatter). World scope; reduce_op as Allreduce's.
  virtual void ReduceScatter(const void* send, void* recv, const std::vector<int64_t>& counts, int dtype,
                             int reduce_op, Callback done) = 0;
  // World scope. Sends send_counts[q] elements of `send` (consecutive, in rank order) to
  // rank q and receives recv_counts[q] elements from rank q into host memory `recv`, in
  // rank order (MPI_Alltoallv).
  virtual void Alltoallv(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                         const std::vector<int64_t>& recv_counts, int dtype, Callback done) = 0;
  // Completes finished operations (running their callbacks); true if any finished.
  virtual bool Progress() = 0;
  virtual size_t num_in_flight() const = 0;
};

// The collectives of one group of ranks on host memory: every rank (a Backend itself) or a
// process set (Backend::OfSet; process_sets/process_sets.h), with its barrier and its channels for cached
// batches. In a set, the scope is the set (machine scope is the world's only), and ranks (a
// broadcast's root, the order of counts) are indices in the set's ranks (ascending).
class GroupCollectives : public Collectives {
 public:
  virtual void Barrier(Callback done) = 0;
  // Allreduce (sum) and broadcast from `root` (an index in the group) on collective channel
  // `channel` in [0, kChannels) ([0, kSetChannels) in a process set): each channel has its
  // own collective order (an MPI communicator), independent of the others and of the
  // collectives above, so ops cached on different channels never wait for each other
  // (negotiation/response_cache.cc). Made with their group.
  static constexpr int kChannels = 64, kSetChannels = 16;
  virtual void AllreduceOn(int channel, void* buf, int64_t count, int dtype, Callback done) = 0;
  virtual void BroadcastOn(int channel, void* buf, int64_t count, int dtype, int root, Callback done) = 0;
};

// The communication engine of the runtime (MPI; in the unit tests, a fake of N ranks as
// threads): the collectives on host memory over every rank and over process sets, plus
// point-to-point messages.
class Backend : public GroupCollectives {
 public:
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

  // Process sets (process_sets/process_sets.h): the members of set `id` (ascending world ranks, this
  // rank among them) make its communicators together, every member calling AddSet for
  // the sets it belongs to in the same order (blocking until every member has called it);
  // RemoveSet frees them (every member, in the same order). The progress driver calls both.
  // OfSet: the set's collectives (null for a set not made here); their operations complete
  // in this Backend's Progress().
  virtual Status AddSet(int id, const std::vector<int>& ranks) = 0;
  virtual void RemoveSet(int id) = 0;
  virtual GroupCollectives* OfSet(int id) = 0;

  // Fault-tolerant mode (docs/design.md §16): true once an operation failed because a rank
  // of the job died; the engine has then made sure every survivor hears of it (MPI: it
  // revoked the control communicator). Any thread.
  virtual bool Lost() const { return false; }
};

// MPI engine: initialises MPI if nobody has, duplicates its communicators.
std::unique_ptr<Backend> CreateMpiBackend(const Config& cfg, Status* st);
void FinalizeMpiIfOwned();
// Fault tolerance (docs/design.md §16). Whether this MPI can survive a lost rank (Open MPI
// with ULFM), and if not, why.
bool MpiFaultTolerant(std::string* why);
// Collective over the survivors of the job's communicator (MPI_COMM_WORLD or the last
// shrink's): shrinks it to them; later backends (CreateMpiBackend) and windows use the new
// one. `lost`: the ranks gone, numbered as before. Blocks until every survivor calls it.
Status ShrinkMpiJob(std::vector<int>* lost);
void AbortJob(int exit_code);
std::string MpiLibraryVersion();

}  // namespace shoal
