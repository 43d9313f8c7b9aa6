// NCCL calls of the CUDA plugin. libnccl.so.2 is dlopen'ed on first use (from
// $SHOAL_NCCL_LIBRARY, which the Python package points at the nvidia-nccl wheel, or the
// loader's search path), so the plugin loads on machines without NCCL and the NCCL
// version is the one installed at run time. The prototypes come from the build's nccl.h.
#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cuda_plugin/plugin_table.h"
#include "cuda_plugin/plugin_util.h"
#include "shoal/c_api.h"

#ifdef SHOAL_WITH_NCCL
#include <nccl.h>

namespace shoal_cuda {
namespace {

// The NCCL entry points used, each named once: Nccl's fields and the dlsym calls.
#define SHOAL_NCCL_SYMBOLS(X)                                                                     \
  X(GetUniqueId) X(CommInitRank) X(CommDestroy) X(CommAbort) X(CommGetAsyncError)                 \
  X(GetErrorString) X(GetLastError) X(AllReduce) X(Broadcast) X(Send) X(Recv) X(GroupStart)       \
  X(GroupEnd) X(ReduceScatter) X(Reduce)

struct Nccl {
#define SHOAL_NCCL_FIELD(name) decltype(&nccl##name) name = nullptr;
  SHOAL_NCCL_SYMBOLS(SHOAL_NCCL_FIELD)
#undef SHOAL_NCCL_FIELD
  std::string error;  // why loading failed
};

const Nccl& Lib() {
  static Nccl lib;
  static std::once_flag once;
  std::call_once(once, [] {
    const char* env = std::getenv("SHOAL_NCCL_LIBRARY");
    std::vector<std::string> names;
    if (env && *env) names.push_back(env);
    names.push_back("libnccl.so.2");
    void* h = nullptr;
    std::string tried;
    for (auto& n : names) {
      h = dlopen(n.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (h) break;
      tried += std::string(tried.empty() ? "" : "; ") + dlerror();
    }
    if (!h) {
      lib.error = "cannot load NCCL (pip install nvidia-nccl-cu13, or set SHOAL_NCCL_LIBRARY): " + tried;
      return;
    }
    bool ok = true;
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
      if (!fn) {
        ok = false;
        lib.error += std::string(lib.error.empty() ? "NCCL library lacks " : ", ") + name;
      }
    };
#define SHOAL_NCCL_SYM(name) sym(lib.name, "nccl" #name);
    SHOAL_NCCL_SYMBOLS(SHOAL_NCCL_SYM)
#undef SHOAL_NCCL_SYM
    if (!ok) lib.GetUniqueId = nullptr;  // marks the library unusable
  });
  return lib;
}

#define SHOAL_NCCL_LOADED()                                  \
  const Nccl& L = Lib();                                     \
  if (!L.GetUniqueId) return Fail(L.error)

shoal_cuda_error NcclCheck(const Nccl& L, ncclResult_t rc, const char* what, ncclComm_t comm = nullptr) {
  if (rc == ncclSuccess) return nullptr;
  std::string msg = std::string(what) + ": " + L.GetErrorString(rc);
  const char* detail = L.GetLastError(comm);
  if (detail && *detail) msg += std::string(" (") + detail + ")";
  return Fail(msg);
}

ncclComm_t C(void* c) { return static_cast<ncclComm_t>(c); }
cudaStream_t S(void* s) { return static_cast<cudaStream_t>(s); }

// `*out` = the NCCL value `table` pairs with `code`; false if it has none.
template <typename T, size_t N> bool Find(const std::pair<int, T> (&table)[N], int code, T* out) {
  for (const auto& [key, value] : table)
    if (key == code) return *out = value, true;
  return false;
}

// Reduction types: NCCL has none for int16 and bool.
constexpr std::pair<int, ncclDataType_t> kReduceTypes[] = {
    {SHOAL_FLOAT16, ncclFloat16}, {SHOAL_BFLOAT16, ncclBfloat16}, {SHOAL_FLOAT32, ncclFloat32},
    {SHOAL_FLOAT64, ncclFloat64}, {SHOAL_INT8, ncclInt8}, {SHOAL_UINT8, ncclUint8},
    {SHOAL_INT32, ncclInt32}, {SHOAL_INT64, ncclInt64}};
constexpr std::pair<int, ncclRedOp_t> kReduceOps[] = {
    {SHOAL_REDUCE_SUM, ncclSum}, {SHOAL_REDUCE_MIN, ncclMin}, {SHOAL_REDUCE_MAX, ncclMax},
    {SHOAL_REDUCE_PRODUCT, ncclProd}};

bool ReduceType(int dtype, ncclDataType_t* t) { return Find(kReduceTypes, dtype, t); }
bool ReduceOp(int reduce_op, ncclRedOp_t* op) { return Find(kReduceOps, reduce_op, op); }

shoal_cuda_error UniqueId(void* id) {
  SHOAL_NCCL_LOADED();
  static_assert(sizeof(ncclUniqueId) == 128, "NCCL unique id size");
  return NcclCheck(L, L.GetUniqueId(static_cast<ncclUniqueId*>(id)), "ncclGetUniqueId");
}

shoal_cuda_error CommInit(int device, int nranks, const void* id, int rank, void** comm) {
  SHOAL_NCCL_LOADED();
  SHOAL_CUDA_TRY(Check(cudaSetDevice(device), "cudaSetDevice"));
  ncclUniqueId uid;
  std::memcpy(&uid, id, sizeof uid);
  ncclComm_t c = nullptr;
  SHOAL_CUDA_TRY(NcclCheck(L, L.CommInitRank(&c, nranks, uid, rank), "ncclCommInitRank"));
  *comm = c;
  return nullptr;
}

shoal_cuda_error CommDestroy(void* comm) {
  SHOAL_NCCL_LOADED();
  return NcclCheck(L, L.CommDestroy(C(comm)), "ncclCommDestroy");
}

shoal_cuda_error CommAbort(void* comm) {
  SHOAL_NCCL_LOADED();
  return NcclCheck(L, L.CommAbort(C(comm)), "ncclCommAbort");
}

shoal_cuda_error CheckComm(void* comm) {
  SHOAL_NCCL_LOADED();
  ncclResult_t async = ncclSuccess;
  SHOAL_CUDA_TRY(NcclCheck(L, L.CommGetAsyncError(C(comm), &async), "ncclCommGetAsyncError", C(comm)));
  return NcclCheck(L, async, "NCCL operation failed", C(comm));
}

shoal_cuda_error AllReduce(void* buf, int64_t count, int dtype, int reduce_op, void* comm, void* stream) {
  SHOAL_NCCL_LOADED();
  ncclDataType_t t;
  ncclRedOp_t op;
  if (!ReduceType(dtype, &t)) return Fail(std::string("NCCL cannot reduce ") + (dtype == SHOAL_INT16 ? "int16" : "bool") + " tensors");
  if (!ReduceOp(reduce_op, &op)) return Fail("ncclAllReduce: unknown reduce op " + std::to_string(reduce_op));
  return NcclCheck(L, L.AllReduce(buf, buf, count, t, op, C(comm), S(stream)), "ncclAllReduce", C(comm));
}

shoal_cuda_error ReduceScatter(const void* send, void* recv, const int64_t* counts, int nranks, int dtype,
                               int reduce_op, void* comm, void* stream) {
  SHOAL_NCCL_LOADED();
  ncclDataType_t t;
  ncclRedOp_t op;
  if (!ReduceType(dtype, &t)) return Fail(std::string("NCCL cannot reduce ") + (dtype == SHOAL_INT16 ? "int16" : "bool") + " tensors");
  if (!ReduceOp(reduce_op, &op)) return Fail("ncclReduceScatter: unknown reduce op " + std::to_string(reduce_op));
  bool even = true;
  for (int r = 1; r < nranks; ++r) even = even && counts[r] == counts[0];
  if (even)
    return NcclCheck(L, L.ReduceScatter(send, recv, counts[0], t, op, C(comm), S(stream)), "ncclReduceScatter", C(comm));
  // Uneven shares (Horovod's split): each rank is the root of a reduction of its share.
  const size_t es = dtype == SHOAL_FLOAT64 || dtype == SHOAL_INT64 ? 8
                    : dtype == SHOAL_FLOAT32 || dtype == SHOAL_INT32 ? 4
                    : dtype == SHOAL_FLOAT16 || dtype == SHOAL_BFLOAT16 ? 2 : 1;  // the plugin has no common/common.cc
  SHOAL_CUDA_TRY(NcclCheck(L, L.GroupStart(), "ncclGroupStart"));
  shoal_cuda_error err = nullptr;
  int64_t off = 0;
  for (int r = 0; r < nranks && !err; ++r) {
    if (counts[r] > 0)
      err = NcclCheck(L, L.Reduce(static_cast<const char*>(send) + off * es, recv, counts[r], t, op, r, C(comm), S(stream)),
                      "ncclReduce (reducescatter)", C(comm));
    off += counts[r];
  }
  shoal_cuda_error end = NcclCheck(L, L.GroupEnd(), "ncclGroupEnd", C(comm));
  return err ? err : end;
}

shoal_cuda_error Broadcast(void* buf, int64_t nbytes, int root, void* comm, void* stream) {
  SHOAL_NCCL_LOADED();
  return NcclCheck(L, L.Broadcast(buf, buf, nbytes, ncclUint8, root, C(comm), S(stream)), "ncclBroadcast", C(comm));
}

shoal_cuda_error Allgatherv(const void* send, void* recv, const int64_t* nbytes, const int64_t* offsets,
                            int nranks, void* comm, void* stream) {
  SHOAL_NCCL_LOADED();
  SHOAL_CUDA_TRY(NcclCheck(L, L.GroupStart(), "ncclGroupStart"));
  shoal_cuda_error err = nullptr;
  for (int r = 0; r < nranks && !err; ++r) {
    if (nbytes[r] == 0) continue;
    err = NcclCheck(L, L.Broadcast(send, static_cast<char*>(recv) + offsets[r], nbytes[r], ncclUint8, r, C(comm), S(stream)),
                "ncclBroadcast (allgather)", C(comm));
  }
  shoal_cuda_error end = NcclCheck(L, L.GroupEnd(), "ncclGroupEnd", C(comm));
  return err ? err : end;
}

shoal_cuda_error Exchange(const shoal_nccl_peer* sends, int n_send, const shoal_nccl_peer* recvs, int n_recv,
                          void* comm, void* stream) {
  SHOAL_NCCL_LOADED();
  SHOAL_CUDA_TRY(NcclCheck(L, L.GroupStart(), "ncclGroupStart"));
  shoal_cuda_error err = nullptr;
  for (int k = 0; k < n_send && !err; ++k)
    err = NcclCheck(L, L.Send(sends[k].buf, sends[k].count, ncclUint8, sends[k].peer, C(comm), S(stream)), "ncclSend", C(comm));
  for (int k = 0; k < n_recv && !err; ++k)
    err = NcclCheck(L, L.Recv(recvs[k].buf, recvs[k].count, ncclUint8, recvs[k].peer, C(comm), S(stream)), "ncclRecv", C(comm));
  shoal_cuda_error end = NcclCheck(L, L.GroupEnd(), "ncclGroupEnd", C(comm));
  return err ? err : end;
}

}  // namespace

void FillNccl(shoal_cuda_api* t) { SHOAL_FILL_NCCL_TABLE(t); }

const char* NcclBuildInfo() {
  static const std::string s = "NCCL backend (built against NCCL " + std::to_string(NCCL_MAJOR) + "." +
                               std::to_string(NCCL_MINOR) + " headers; libnccl loaded at run time)";
  return s.c_str();
}

}  // namespace shoal_cuda

#else  // no NCCL headers at build time: the table's nccl_* entries stay NULL

namespace shoal_cuda {
void FillNccl(shoal_cuda_api* t) { t->has_nccl = 0; }
const char* NcclBuildInfo() { return "no NCCL backend (built without NCCL headers)"; }
}  // namespace shoal_cuda

#endif
