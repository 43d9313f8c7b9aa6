// Element-wise math the core does itself (CPU): one generic dtype dispatch.
// Half types (float16, bfloat16) are stored as 16-bit words and computed in float32.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace shoal {

float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);
float BFloat16ToFloat(uint16_t h);
uint16_t FloatToBFloat16(float f);

// Half types <-> float32 (other dtypes are not accepted).
void WidenToFloat32(const void* src, int dtype, float* dst, size_t n);
void NarrowFromFloat32(const float* src, int dtype, void* dst, size_t n);

// Weighted math takes floating dtypes, and int32/int64 (computed in double, rounded).
// dst[i] = src[i] / divisor (dst may alias src).
void Divide(const void* src, void* dst, int dtype, size_t n, double divisor);
// dst[i] = src[i] * w (dst may alias src).
void Scale(const void* src, void* dst, int dtype, size_t n, double w);

// Horovod's scaling of a reduction's input or result (ops/fusion.h): dst[i] = src[i] /
// divisor * factor (dst may alias src). Floating dtypes compute in their accumulation type
// (float32 for half types); integers truncate toward zero: the exact quotient when factor
// is 1, else trunc(src[i] * (factor / divisor)) in double (Horovod's ScaleBuffer), wrapped
// to the dtype's width as a conversion from int64 (saturated there; NaN gives 0).
void Rescale(const void* src, void* dst, int dtype, size_t n, int divisor, double factor);

// Weighted combine for neighbor averaging, written to `out` (may alias `self`):
//   uniform: out = (self + sum_j srcs[j]) / (srcs.size() + 1)
//   else:    out = self_weight * self + sum_j weights[j] * srcs[j]
void Combine(const void* self, const std::vector<const void*>& srcs, void* out, int dtype,
             size_t n, bool uniform, double self_weight, const std::vector<double>& weights);

// dst[i] = srcs[0][i] op srcs[1][i] op ... in the order of srcs (dst may alias a source)
// for `reduce_op` SHOAL_REDUCE_SUM, MIN, MAX or PRODUCT and every numeric dtype but bool:
// half types compute in float32 and round once; integer sums and products wrap
// (two's complement, like MPI's and NCCL's); min and max compare in the dtype itself.
void Reduce(const std::vector<const void*>& srcs, void* dst, int dtype, size_t n, int reduce_op);
// dst[0..n) = the identity of `reduce_op` in `dtype`: 0 for SHOAL_REDUCE_SUM and AVERAGE,
// 1 for PRODUCT, the largest value (+inf for floating dtypes) for MIN, the lowest (-inf)
// for MAX, so reducing with it changes nothing.
void FillIdentity(void* dst, int dtype, size_t n, int reduce_op);
inline void Sum(const std::vector<const void*>& srcs, void* dst, int dtype, size_t n) {
  Reduce(srcs, dst, dtype, n, 0 /* SHOAL_REDUCE_SUM */);
}

}  // namespace shoal
