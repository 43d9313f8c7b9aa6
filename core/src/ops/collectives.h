// The element counts of collectives whose sizes differ by rank, from a response; shared by
// the host path (ops/collectives.cc, ops/alltoall.cc) and the device path (gpu/device_path.cc).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "negotiation/coordinator.h"
#include "runtime/entry.h"

namespace shoal {

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
