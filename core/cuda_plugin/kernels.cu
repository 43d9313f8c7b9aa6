// The element-wise work the core does itself on GPU tensors: weighted combine of
// received buffers, scaling (dst_weights, averaging) and fusion-buffer pack/unpack.
// Half types are loaded as 16-bit words and computed in float32, like the CPU path
// (core/src/common/reduce.cc). Loads and stores are 16 bytes wide when every pointer allows.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "cuda_plugin/plugin_util.h"
#include "shoal/c_api.h"

namespace shoal_cuda {
namespace {

struct F16 {
  using S = uint16_t;
  using A = float;
  static __device__ A Load(S x) { return __half2float(__ushort_as_half(x)); }
  static __device__ S Store(A a) { return __half_as_ushort(__float2half_rn(a)); }
};
struct BF16 {
  using S = uint16_t;
  using A = float;
  static __device__ A Load(S x) { return __bfloat162float(__ushort_as_bfloat16(x)); }
  static __device__ S Store(A a) { return __bfloat16_as_ushort(__float2bfloat16_rn(a)); }
};
template <typename T> struct Plain {
  using S = T;
  using A = T;
  static __device__ A Load(S x) { return x; }
  static __device__ S Store(A a) { return a; }
};

constexpr int kMaxSources = 128;  // kernel parameters stay under 4 KB
constexpr int kThreads = 256;

struct Sources {
  const void* p[kMaxSources];
  double w[kMaxSources];
};

template <typename T, int V> struct alignas(sizeof(T) * V) Vec { T v[V]; };

int Blocks(int64_t work) { return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((work + kThreads - 1) / kThreads, 4096))); }

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Elements [begin + V*i, begin + V*i + V) for each grid-stride index i < count.
template <typename D, int V>
__global__ void CombineKernel(typename D::S* out, const typename D::S* self, Sources src, int n_src,
                              int uniform, double self_weight, int64_t count, int64_t begin) {
  using S = typename D::S;
  using A = typename D::A;
  using W = Vec<S, V>;
  const A sw = uniform ? A(1) : static_cast<A>(self_weight);
  const A div = static_cast<A>(n_src + 1);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t at = begin / V + i;  // begin is a multiple of V
    W x = reinterpret_cast<const W*>(self)[at];
    A acc[V];
#pragma unroll
    for (int v = 0; v < V; ++v) acc[v] = sw * D::Load(x.v[v]);
    for (int j = 0; j < n_src; ++j) {
      W s = reinterpret_cast<const W*>(src.p[j])[at];
      const A w = uniform ? A(1) : static_cast<A>(src.w[j]);
#pragma unroll
      for (int v = 0; v < V; ++v) acc[v] += w * D::Load(s.v[v]);
    }
    W y;
#pragma unroll
    for (int v = 0; v < V; ++v) y.v[v] = D::Store(uniform ? acc[v] / div : acc[v]);
    reinterpret_cast<W*>(out)[at] = y;
  }
}

template <typename D, int V>
__global__ void ScaleKernel(typename D::S* dst, const typename D::S* src, double factor, int divide,
                            int64_t count, int64_t begin) {
  using S = typename D::S;
  using A = typename D::A;
  using W = Vec<S, V>;
  const A f = static_cast<A>(factor);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t at = begin / V + i;
    W x = reinterpret_cast<const W*>(src)[at];
#pragma unroll
    for (int v = 0; v < V; ++v) x.v[v] = D::Store(divide ? D::Load(x.v[v]) / f : D::Load(x.v[v]) * f);
    reinterpret_cast<W*>(dst)[at] = x;
  }
}

// Runs `launch(V, count, begin)` for the 16-byte-vector body and the scalar tail, or
// everything scalar when a pointer is not 16-byte aligned.
template <int V, typename F> void Split(int64_t n, bool aligned, F launch) {
  const int64_t body = aligned ? n / V : 0;
  if (body > 0) launch(std::integral_constant<int, V>{}, body, int64_t{0});
  if (n - body * V > 0) launch(std::integral_constant<int, 1>{}, n - body * V, body * V);
}

template <typename F> shoal_cuda_error Dispatch(int dtype, F f) {
  switch (dtype) {
    case SHOAL_FLOAT16: return f(F16{});
    case SHOAL_BFLOAT16: return f(BF16{});
    case SHOAL_FLOAT32: return f(Plain<float>{});
    case SHOAL_FLOAT64: return f(Plain<double>{});
    default: return Fail("GPU kernels take floating dtypes only (dtype code " + std::to_string(dtype) + ")");
  }
}

constexpr int kMaxParts = 64;
struct Parts {
  char* part[kMaxParts];
  int64_t off[kMaxParts];
  int64_t nbytes[kMaxParts];
};

// blockIdx.y is the part; 16-byte words when the part allows, else bytes.
__global__ void PackKernel(char* fused, Parts p, int unpack) {
  const int k = blockIdx.y;
  char* a = fused + p.off[k];
  char* b = p.part[k];
  char* dst = unpack ? b : a;
  const char* src = unpack ? a : b;
  const int64_t n = p.nbytes[k];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  int64_t words = 0;
  if (reinterpret_cast<uintptr_t>(dst) % 16 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0) {
    words = n / 16;
    for (int64_t i = first; i < words; i += stride)
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
  }
  for (int64_t i = words * 16 + first; i < n; i += stride) dst[i] = src[i];
}

}  // namespace

shoal_cuda_error Combine(void* out, const void* self, const void* const* srcs, const double* weights,
                         int n_src, int uniform, double self_weight, int dtype, int64_t n, void* stream) {
  if (n_src < 0 || n_src > kMaxSources)
    return Fail("GPU combine: " + std::to_string(n_src) + " sources (at most " + std::to_string(kMaxSources) + ")");
  if (n <= 0) return nullptr;
  Sources s{};
  bool aligned = Aligned16(out) && Aligned16(self);
  for (int j = 0; j < n_src; ++j) {
    s.p[j] = srcs[j];
    s.w[j] = weights ? weights[j] : 1.0;
    aligned = aligned && Aligned16(srcs[j]);
  }
  auto st = static_cast<cudaStream_t>(stream);
  return Dispatch(dtype, [&](auto d) -> shoal_cuda_error {
    using D = decltype(d);
    using S = typename D::S;
    Split<16 / sizeof(S)>(n, aligned, [&](auto v, int64_t count, int64_t begin) {
      CombineKernel<D, decltype(v)::value><<<Blocks(count), kThreads, 0, st>>>(
          static_cast<S*>(out), static_cast<const S*>(self), s, n_src, uniform, self_weight, count, begin);
    });
    return Check(cudaGetLastError(), "combine kernel launch");
  });
}

shoal_cuda_error Scale(void* dst, const void* src, double factor, int divide, int dtype, int64_t n,
                       void* stream) {
  if (n <= 0) return nullptr;
  auto st = static_cast<cudaStream_t>(stream);
  const bool aligned = Aligned16(dst) && Aligned16(src);
  return Dispatch(dtype, [&](auto d) -> shoal_cuda_error {
    using D = decltype(d);
    using S = typename D::S;
    Split<16 / sizeof(S)>(n, aligned, [&](auto v, int64_t count, int64_t begin) {
      ScaleKernel<D, decltype(v)::value><<<Blocks(count), kThreads, 0, st>>>(
          static_cast<S*>(dst), static_cast<const S*>(src), factor, divide, count, begin);
    });
    return Check(cudaGetLastError(), "scale kernel launch");
  });
}

shoal_cuda_error Pack(void* fused, void* const* parts, const int64_t* offsets, const int64_t* nbytes,
                      int n_parts, int unpack, void* stream) {
  auto st = static_cast<cudaStream_t>(stream);
  for (int first = 0; first < n_parts; first += kMaxParts) {
    const int k = std::min(kMaxParts, n_parts - first);
    Parts p{};
    int64_t largest = 0;
    for (int i = 0; i < k; ++i) {
      p.part[i] = static_cast<char*>(parts[first + i]);
      p.off[i] = offsets[first + i];
      p.nbytes[i] = nbytes[first + i];
      largest = std::max(largest, p.nbytes[i]);
    }
    if (largest == 0) continue;
    dim3 grid(std::min(Blocks(largest / 16 + 1), 1024), k);
    PackKernel<<<grid, kThreads, 0, st>>>(static_cast<char*>(fused), p, unpack);
    SHOAL_CUDA_TRY(Check(cudaGetLastError(), "pack kernel launch"));
  }
  return nullptr;
}

}  // namespace shoal_cuda
