// Shared by the plugin's translation units: error messages as C strings.
#pragma once
#include <cuda_runtime_api.h>

#include <string>

#include "cuda_plugin/cuda_api.h"

namespace shoal_cuda {

// Keeps `msg` in a per-thread buffer and returns it (valid until the next error here).
shoal_cuda_error Fail(std::string msg);

inline shoal_cuda_error Check(cudaError_t rc, const char* what) {
  if (rc == cudaSuccess) return nullptr;
  cudaGetLastError();  // clear a non-sticky error so later calls are not blamed
  return Fail(std::string(what) + ": " + cudaGetErrorString(rc));
}

#define SHOAL_CUDA_TRY(expr)                      \
  do {                                            \
    if (shoal_cuda_error e_ = (expr)) return e_;  \
  } while (0)

// Kernels (kernels.cu) and NCCL (core/cuda_plugin/nccl_ops.cc), gathered into the table.
shoal_cuda_error Combine(void* out, const void* self, const void* const* srcs, const double* weights,
                         int n_src, int uniform, double self_weight, int dtype, int64_t n, void* stream);
shoal_cuda_error Scale(void* dst, const void* src, double factor, int divide, int dtype, int64_t n,
                       void* stream);
shoal_cuda_error Pack(void* fused, void* const* parts, const int64_t* offsets, const int64_t* nbytes,
                      int n_parts, int unpack, void* stream);
void FillNccl(shoal_cuda_api* api);  // leaves the nccl_* entries NULL without NCCL headers
const char* NcclBuildInfo();

}  // namespace shoal_cuda
