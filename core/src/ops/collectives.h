// Collectives on host memory, and the element counts of collectives whose sizes differ by
// rank (shared with the device path, gpu/device_path.cc).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/buffer_pool.h"
#include "common/stats.h"
#include "engines/backend.h"
#include "negotiation/coordinator.h"
#include "runtime/entry.h"

namespace shoal {

class DevicePath;

// Runs one negotiated batch of a collective on its group's engine (every rank's, a process
// set's): allreduce batches fused into one buffer (ops/fusion.h), Average divided once
// after the sum; CUDA tensors with NCCL go to the device path. Driver only.
class CollectiveOps {
 public:
  CollectiveOps(Finisher* host, Backend* backend, DevicePath* devices, Stats* stats)
      : host_(host), backend_(backend), devices_(devices), stats_(stats) {}

  GroupCollectives* Engine(int set);  // of process set `set` (0: every rank); null if unknown here
  const std::shared_ptr<BufferPool>& pool() const { return pool_; }  // fusion buffers (the response cache's too)
  // The batch of response `r` (its members in the response's order).
  void Run(const Response& r, std::vector<EntryPtr> batch);

 private:
  void RunReduceScatter(const EntryPtr& e, GroupCollectives* engine);
  void RunAlltoall(const Response& r, const EntryPtr& e, GroupCollectives* engine);  // ops/alltoall.cc

  Finisher* host_;
  Backend* backend_;
  DevicePath* devices_;
  Stats* stats_;
  std::shared_ptr<BufferPool> pool_ = BufferPool::Create(4);
};

// The element counts of every rank of an allgather (from the ranks' first dims) or of a
// reducescatter (Horovod's split of dim 0); each also sets the entry's result shape and
// allocates its result (host memory).
std::vector<int64_t> GatherCounts(Entry& e, const std::vector<int64_t>& first_dims);
std::vector<int64_t> ScatterCounts(Entry& e, int size, int rank);  // over `size` ranks, this one `rank`
// Horovod's alltoall (ops/alltoall.cc), from the response's table of splits
// (first_dims[q][r]: rows rank q sends to rank r; ranks: indices in the op's process set of
// `size` ranks, this one `rank`): the elements this rank sends to and receives from each rank;
// sets the entry's received splits and result shape and allocates its result. Returns "" or
// why the table does not fit the entry; *any: whether any rank moves data (if none does, no
// rank calls the collective).
std::string AlltoallCounts(const Response& r, Entry& e, int size, int rank, std::vector<int64_t>* send,
                           std::vector<int64_t>* recv, bool* any);

}  // namespace shoal
