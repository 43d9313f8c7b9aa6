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

// Weighted combine for neighbor averaging, written to `out` (may alias `self`):
//   uniform: out = (self + sum_j srcs[j]) / (srcs.size() + 1)
//   else:    out = self_weight * self + sum_j weights[j] * srcs[j]
void Combine(const void* self, const std::vector<const void*>& srcs, void* out, int dtype,
             size_t n, bool uniform, double self_weight, const std::vector<double>& weights);

// dst[i] = the sum of srcs[j][i] in the order of srcs (dst may alias a source), for every
// numeric dtype but bool: half types accumulate in float32, integers wrap like NCCL's.
void Sum(const std::vector<const void*>& srcs, void* dst, int dtype, size_t n);

}  // namespace shoal
