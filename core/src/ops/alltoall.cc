// Horovod's alltoall on host memory: rank r sends splits[q] rows of its dim 0 to each rank
// q, in order, and receives the rows every rank sends it, concatenated in rank order. The
// coordinator gathers every rank's splits while it validates the op (dtype, the dimensions
// after the first) and hands the whole table to every rank, so receivers know their
// counts without another exchange; then one MPI_Ialltoallv moves the data (CUDA tensors
// with NCCL: NcclBackend::Alltoallv, from RunOnDevice).
#include <algorithm>
#include <cstdlib>

#include "ops/collectives.h"
#include "process_sets/process_sets.h"

namespace shoal {

std::string AlltoallCounts(const Response& r, Entry& e, int size, int rank, std::vector<int64_t>* send,
                           std::vector<int64_t>* recv, bool* any) {
  if (static_cast<int>(r.first_dims.size()) != size || e.sig.shape.empty()) return "a table of splits of another size";
  for (auto& row : r.first_dims)
    if (static_cast<int>(row.size()) != size) return "a table of splits of another size";
  int64_t row = 1;  // elements per row of dim 0
  for (size_t i = 1; i < e.sig.shape.size(); ++i) row *= e.sig.shape[i];
  send->assign(size, 0);
  recv->assign(size, 0);
  e.recv_splits.assign(size, 0);
  int64_t rows = 0;
  *any = false;
  for (int q = 0; q < size; ++q) {
    (*send)[q] = r.first_dims[rank][q] * row;
    e.recv_splits[q] = r.first_dims[q][rank];
    (*recv)[q] = e.recv_splits[q] * row;
    rows += e.recv_splits[q];
    for (int64_t k : r.first_dims[q]) *any = *any || (k > 0 && row > 0);
  }
  e.result_shape = e.sig.shape;
  e.result_shape[0] = rows;
  e.result_nbytes = static_cast<size_t>(rows * row) * DtypeSize(e.sig.dtype);
  e.result = std::malloc(std::max<size_t>(e.result_nbytes, 1));
  return "";
}

void CollectiveOps::RunAlltoall(const Response& r, const EntryPtr& e, GroupCollectives* engine) {
  std::vector<int64_t> send, recv;
  bool any = false;
  const WorldInfo& w = backend_->world();  // over the members of its process set, in rank order
  const int size = e->pset ? e->pset->size() : w.size, rank = e->pset ? e->pset->index : w.rank;
  const std::string bad = AlltoallCounts(r, *e, size, rank, &send, &recv, &any);
  if (!bad.empty()) {
    Log(LOG_ERROR, "coordinator scheduled alltoall '" + e->name + "' with " + bad);
    return host_->Finish(e, Status::Error(SHOAL_ABORTED, "internal error: inconsistent schedule"));
  }
  if (!any) return host_->Finish(e, Status::Ok());
  engine->Alltoallv(e->input.data, send, e->result, recv, e->sig.dtype, [this, e](const Status& st) {
    e->t_comm_end = Clock::now();
    host_->Finish(e, st);
  });
}

}  // namespace shoal
