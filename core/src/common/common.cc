#include "common/common.h"

#include <algorithm>
#include <sstream>

namespace shoal {

size_t DtypeSize(int dtype) {
  switch (dtype) {
    case SHOAL_FLOAT16: case SHOAL_BFLOAT16: case SHOAL_INT16: return 2;
    case SHOAL_FLOAT32: case SHOAL_INT32: return 4;
    case SHOAL_FLOAT64: case SHOAL_INT64: return 8;
    case SHOAL_INT8: case SHOAL_UINT8: case SHOAL_BOOL: return 1;
  }
  throw ArgumentError(SHOAL_INVALID_ARGUMENT, "unknown dtype code " + std::to_string(dtype));
}

const char* DtypeName(int dtype) {
  static const char* names[] = {"float16", "bfloat16", "float32", "float64", "int8",
                                "uint8",   "int16",    "int32",   "int64",   "bool"};
  return (dtype >= 0 && dtype <= SHOAL_BOOL) ? names[dtype] : "unknown";
}

const char* OpName(int op) {
  if (op == kOpJoin) return "join";
  if (op == kOpSetControl) return "process_set";
  if (op == kOpRetire) return "retire";
  if (op == SHOAL_OP_HIERARCHICAL_NEIGHBOR_ALLREDUCE) return "hierarchical_neighbor_allreduce";
  static const char* names[] = {"allreduce", "broadcast", "allgather", "barrier",
                                "neighbor_allreduce", "neighbor_allgather", "reducescatter", "alltoall"};
  static const char* grouped[] = {"grouped_allreduce", "grouped_broadcast", "grouped_allgather", "grouped_barrier",
                                  "grouped_neighbor_allreduce", "grouped_neighbor_allgather",
                                  "grouped_reducescatter", "grouped_alltoall"};
  const int base = op & ~SHOAL_GROUPED;
  if (base < 0 || base > SHOAL_OP_ALLTOALL || (op & ~(SHOAL_GROUPED | 0xff))) return "unknown_op";
  return (op & SHOAL_GROUPED) ? grouped[base] : names[base];
}

std::string MemberName(const std::string& group, int index) {
  return group + "[" + std::to_string(index) + "]";
}

const char* ReduceOpName(int reduce_op) {
  static const char* names[] = {"Sum", "Average", "Min", "Max", "Product"};
  return (reduce_op >= 0 && reduce_op <= SHOAL_REDUCE_PRODUCT) ? names[reduce_op] : "unknown";
}

bool IsFloating(int dtype) { return dtype <= SHOAL_FLOAT64; }

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < shape.size(); ++i) s << (i ? ", " : "") << shape[i];
  s << "]";
  return s.str();
}

int64_t NumElements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

const char* PathName(int32_t path) {
  switch (path & ~kFakePlugin) {
    case kPathStaged: return "MPI staged through host memory";
    case kPathMpi: return "CUDA-aware MPI";
    case kPathNccl: return "NCCL";
  }
  return "host memory";
}

bool Signature::CompatibleForNeighbors(const Signature& o) const {
  if (op != o.op || dtype != o.dtype || device_type != o.device_type || path != o.path) return false;
  if (op != SHOAL_OP_NEIGHBOR_ALLGATHER) return shape == o.shape;
  return shape.size() == o.shape.size() && !shape.empty() &&
         std::equal(shape.begin() + 1, shape.end(), o.shape.begin() + 1);
}

std::string Signature::ToString() const {
  std::string s = std::string(DtypeName(dtype)) + ShapeString(shape);
  if (device_type == SHOAL_DEVICE_CUDA) {
    s += " on cuda";
    if (path) s += std::string(" (") + PathName(path) + ((path & kFakePlugin) ? ", fake device plugin)" : ")");
  }
  return s;
}

std::string RankList(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

std::string RanksNamed(const std::vector<int>& ranks) {
  return (ranks.size() == 1 ? "rank " : "ranks ") + RankList(ranks);
}

std::string OpError(int op, const std::string& name, const std::string& why) {
  return std::string(OpName(op)) + " '" + name + "': " + why;
}

}  // namespace shoal
