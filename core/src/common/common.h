// Shared small types of the Shoal core: status, dtypes, tensor signatures.
#pragma once
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "shoal/c_api.h"

namespace shoal {

// Byte buffers that resize without zero-filling: message and fusion buffers are
// written in full before they are read, and zeroing 16 MiB costs as much as moving it.
template <typename T> struct NoInitAllocator : std::allocator<T> {
  template <typename U> struct rebind { using other = NoInitAllocator<U>; };
  NoInitAllocator() = default;
  template <typename U> NoInitAllocator(const NoInitAllocator<U>&) {}
  template <typename U> void construct(U* p) noexcept { ::new (static_cast<void*>(p)) U; }
  template <typename U, typename... A> void construct(U* p, A&&... a) {
    ::new (static_cast<void*>(p)) U(std::forward<A>(a)...);
  }
};
using ByteVec = std::vector<char, NoInitAllocator<char>>;

struct Status {
  int code = SHOAL_OK;
  std::string message;
  bool ok() const { return code == SHOAL_OK; }
  static Status Ok() { return {}; }
  static Status Error(int code, std::string msg) { return {code, std::move(msg)}; }
};

// Thrown for bad arguments at enqueue; turned into a status at the C ABI.
struct ArgumentError : std::runtime_error {
  int code;
  ArgumentError(int c, const std::string& m) : std::runtime_error(m), code(c) {}
};
[[noreturn]] inline void Bad(const std::string& msg) { throw ArgumentError(SHOAL_INVALID_ARGUMENT, msg); }

size_t DtypeSize(int dtype);
const char* DtypeName(int dtype);
const char* OpName(int op);  // "allreduce", ...; "grouped_allreduce" with SHOAL_GROUPED
// An op code of the C ABI (shoal_op_type).
inline bool IsOpCode(int op) {
  return (op >= SHOAL_OP_ALLREDUCE && op <= SHOAL_OP_ALLTOALL) || op == SHOAL_OP_HIERARCHICAL_NEIGHBOR_ALLREDUCE;
}
// Ranks in a message: "0, 2, 5"; named: "rank 3", "ranks 0, 2, 5".
std::string RankList(const std::vector<int>& ranks);
std::string RanksNamed(const std::vector<int>& ranks);
// The one form of an op's error message: "<op> '<name>': <why>" (op: shoal_op_type, or
// with SHOAL_GROUPED).
std::string OpError(int op, const std::string& name, const std::string& why);
// The name of member `index` of the grouped op `group` (shoal_enqueue_group).
std::string MemberName(const std::string& group, int index);
// Horovod's join (ops/join.cc): an op of the runtime and the coordinator only, not of
// the C ABI's shoal_op_type (shoal_enqueue_join starts it).
constexpr int kOpJoin = 100;
// Process sets' agreement and creation on the progress driver (process_sets/process_sets.cc): an op of
// the runtime only.
constexpr int kOpSetControl = 101;
// The vote that retires idle op names (negotiation/names.cc): an op of the runtime and the
// coordinator only.
constexpr int kOpRetire = 102;
// A hierarchical op's stages (ops/stages.cc): their ops, the suffixes of their names and
// their scopes (the machine's stages negotiate with its coordinator: docs/design.md §19).
struct Stage {
  int op;
  const char* suffix;
  int scope;
};
inline constexpr Stage kHierarchicalStages[3] = {{SHOAL_OP_ALLREDUCE, ".machine_sum", SHOAL_SCOPE_MACHINE},
                                                 {SHOAL_OP_NEIGHBOR_ALLREDUCE, ".exchange", SHOAL_SCOPE_WORLD},
                                                 {SHOAL_OP_BROADCAST, ".share", SHOAL_SCOPE_MACHINE}};
const char* ReduceOpName(int reduce_op);  // "Sum", "Average", "Min", "Max", "Product"
bool IsFloating(int dtype);
std::string ShapeString(const std::vector<int64_t>& shape);
int64_t NumElements(const std::vector<int64_t>& shape);

// What ranks must agree on for one named op.
// How a rank moves a CUDA tensor's data (Signature::path).
enum DataPath : int32_t {
  kPathHost = 0,    // CPU tensors
  kPathStaged = 1,  // copied to pinned host memory, moved by MPI (SHOAL_GPU_BACKEND=mpi)
  kPathMpi = 2,     // device memory handed to a CUDA-aware MPI (neighbor ops)
  kPathNccl = 3,    // device memory moved by NCCL (SHOAL_GPU_BACKEND=nccl)
  kFakePlugin = 16,
};
const char* PathName(int32_t path);  // "staged through host memory (MPI)", ...

struct Signature {
  int32_t op = 0;
  int32_t dtype = 0;
  int32_t device_type = SHOAL_DEVICE_CPU;
  int32_t reduce_op = 0;
  int32_t root_rank = 0;
  int32_t scope = SHOAL_SCOPE_WORLD;
  // CUDA tensors: how this rank moves the data (a DataPath, plus kFakePlugin when the fake
  // device plugin runs it); ranks must agree, so it is part of negotiation.
  int32_t path = 0;
  std::vector<int64_t> shape;

  bool operator==(const Signature& o) const {
    return op == o.op && dtype == o.dtype && device_type == o.device_type &&
           reduce_op == o.reduce_op && root_rank == o.root_rank && scope == o.scope &&
           path == o.path && shape == o.shape;
  }
  // What two ends of a neighbor edge must agree on (gathers: all but the first dim).
  bool CompatibleForNeighbors(const Signature& o) const;
  bool operator!=(const Signature& o) const { return !(*this == o); }
  size_t nbytes() const { return NumElements(shape) * DtypeSize(dtype); }
  std::string ToString() const;  // "float32[3, 4] on cpu"
};

}  // namespace shoal
