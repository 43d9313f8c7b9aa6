// libshoal_cuda.so: CUDA runtime calls behind the C table of cuda_api.h. libshoal.so
// loads this library only when a CUDA tensor arrives (see core/src/gpu/staging.cc and device_path.cc).
#include <dlfcn.h>
#include <cuda_runtime_api.h>

#include <string>

#include "cuda_plugin/plugin_table.h"
#include "cuda_plugin/plugin_util.h"

namespace shoal_cuda {

shoal_cuda_error Fail(std::string msg) { return KeepError(std::move(msg)); }

namespace {

cudaStream_t S(void* s) { return static_cast<cudaStream_t>(s); }
cudaEvent_t E(void* e) { return static_cast<cudaEvent_t>(e); }

int DeviceCount(const char** why) {
  int n = 0;
  cudaError_t rc = cudaGetDeviceCount(&n);
  if (rc != cudaSuccess) {
    cudaGetLastError();
    if (why) *why = cudaGetErrorString(rc);
    return 0;
  }
  return n;
}

shoal_cuda_error SetDevice(int device) { return Check(cudaSetDevice(device), "cudaSetDevice"); }

int GetDevice() {
  int d = -1;
  return cudaGetDevice(&d) == cudaSuccess ? d : -1;
}

shoal_cuda_error StreamCreate(int device, void** stream) {
  SHOAL_CUDA_TRY(SetDevice(device));
  cudaStream_t s = nullptr;
  SHOAL_CUDA_TRY(Check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags"));
  *stream = s;
  return nullptr;
}

shoal_cuda_error StreamDestroy(void* s) { return Check(cudaStreamDestroy(S(s)), "cudaStreamDestroy"); }
shoal_cuda_error StreamSync(void* s) { return Check(cudaStreamSynchronize(S(s)), "cudaStreamSynchronize"); }
shoal_cuda_error StreamWaitEvent(void* s, void* e) {
  return Check(cudaStreamWaitEvent(S(s), E(e), 0), "cudaStreamWaitEvent");
}

shoal_cuda_error EventCreate(int device, void** event) {
  SHOAL_CUDA_TRY(SetDevice(device));
  cudaEvent_t e = nullptr;
  SHOAL_CUDA_TRY(Check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags"));
  *event = e;
  return nullptr;
}

shoal_cuda_error Capture(int device, void* stream, void** event) {
  // Called on the user's thread: leave its current device as it was.
  int prev = 0;
  SHOAL_CUDA_TRY(Check(cudaGetDevice(&prev), "cudaGetDevice"));
  shoal_cuda_error err = EventCreate(device, event);
  if (!err) {
    err = Check(cudaEventRecord(E(*event), S(stream)), "cudaEventRecord on the caller's stream");
    if (err) cudaEventDestroy(E(*event));
  }
  cudaSetDevice(prev);
  return err;
}

shoal_cuda_error EventDestroy(void* e) { return Check(cudaEventDestroy(E(e)), "cudaEventDestroy"); }
shoal_cuda_error EventRecord(void* e, void* s) { return Check(cudaEventRecord(E(e), S(s)), "cudaEventRecord"); }

shoal_cuda_error EventQuery(void* e, int* done) {
  cudaError_t rc = cudaEventQuery(E(e));
  if (rc == cudaErrorNotReady) {
    cudaGetLastError();
    *done = 0;
    return nullptr;
  }
  SHOAL_CUDA_TRY(Check(rc, "cudaEventQuery"));
  *done = 1;
  return nullptr;
}

shoal_cuda_error MemcpyAsync(void* dst, const void* src, size_t n, void* s) {
  return Check(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, S(s)), "cudaMemcpyAsync");
}

shoal_cuda_error HostAlloc(size_t n, void** p) {
  return Check(cudaHostAlloc(p, n, cudaHostAllocPortable), "cudaHostAlloc");
}
shoal_cuda_error HostFree(void* p) { return Check(cudaFreeHost(p), "cudaFreeHost"); }

shoal_cuda_error DeviceAlloc(int device, size_t n, void** p) {
  SHOAL_CUDA_TRY(SetDevice(device));
  return Check(cudaMalloc(p, n), "cudaMalloc");
}
shoal_cuda_error DeviceFree(void* p) { return Check(cudaFree(p), "cudaFree"); }

// CUDA-aware MPI: Open MPI (mpi-ext.h) and MPICH (4.x) export MPIX_Query_cuda_support; the
// MPI library is loaded globally before this plugin (shoal/_loader.py), so look it up there.
// MPICH aborts the process when it is asked before MPI_Init: check that first.
int MpiCudaAware(const char** how) {
  using Query = int (*)();
  using Initialized = int (*)(int*);
  auto q = reinterpret_cast<Query>(dlsym(RTLD_DEFAULT, "MPIX_Query_cuda_support"));
  auto initialized = reinterpret_cast<Initialized>(dlsym(RTLD_DEFAULT, "MPI_Initialized"));
  int ready = 0;
  if (q && initialized) initialized(&ready);
  if (q && !ready) {
    if (how) *how = "not known: MPI is not initialized yet";
    return 0;
  }
  const int yes = q ? q() : 0;
  if (how)
    *how = !q ? "no: this MPI has no MPIX_Query_cuda_support"
         : yes ? "yes: MPIX_Query_cuda_support() = 1"
               : "no: MPIX_Query_cuda_support() = 0";
  return yes;
}

shoal_cuda_api MakeTable() {
  shoal_cuda_api t{};
  t.abi_version = SHOAL_CUDA_ABI_VERSION;
  static const std::string build = "CUDA " + std::to_string(CUDART_VERSION / 1000) + "." +
                                   std::to_string(CUDART_VERSION % 1000 / 10) +
                                   " runtime (static); kernels " SHOAL_CUDA_ARCHS "; " + NcclBuildInfo();
  t.build = build.c_str();
  SHOAL_FILL_CUDA_TABLE(t, DeviceCount);
  return t;
}

}  // namespace
}  // namespace shoal_cuda

extern "C" __attribute__((visibility("default"))) const shoal_cuda_api* shoal_cuda_plugin(int abi_version) {
  static const shoal_cuda_api table = shoal_cuda::MakeTable();
  return abi_version == SHOAL_CUDA_ABI_VERSION ? &table : nullptr;
}
