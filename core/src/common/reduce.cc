#include "common/reduce.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "common/common.h"
#include "shoal/c_api.h"

namespace shoal {
namespace {

float FromBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint32_t Bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  return x;
}

}  // namespace

float HalfToFloat(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while (!(man & 0x400u)) { man <<= 1; --exp; }
      bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  return FromBits(bits);
}

uint16_t FloatToHalf(float f) {
  uint32_t x = Bits(f);
  uint32_t sign = (x >> 16) & 0x8000u, mag = x & 0x7fffffffu;
  if (mag >= 0x7f800000u) return sign | 0x7c00u | (mag > 0x7f800000u ? 0x200u : 0);  // inf/nan
  if (mag >= 0x477ff000u) return sign | 0x7c00u;  // rounds past the largest half: inf
  if (mag < 0x38800000u) {                        // subnormal or zero in half
    if (mag < 0x33000000u) return sign;           // below half the smallest subnormal
    uint32_t e = mag >> 23, m = (mag & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - e;  // 14 + (113 - e)... aligns to 2^-24 units
    uint32_t q = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1))) ++q;
    return sign | q;
  }
  uint32_t r = mag + 0xc8000000u;  // rebias exponent (127 -> 15)
  uint32_t q = r >> 13, rem = r & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (q & 1))) ++q;
  return sign | q;
}

float BFloat16ToFloat(uint16_t h) { return FromBits(static_cast<uint32_t>(h) << 16); }

uint16_t FloatToBFloat16(float f) {
  uint32_t x = Bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // nan
  x += 0x7fffu + ((x >> 16) & 1);  // round to nearest even
  return static_cast<uint16_t>(x >> 16);
}

namespace {

// Storage type S, compute type A, and conversions for one floating dtype.
template <typename S, typename A> struct Plain {
  using Store = S;
  using Acc = A;
  static A Load(S v) { return static_cast<A>(v); }
  static S Save(A v) { return static_cast<S>(v); }
};
struct F16 {
  using Store = uint16_t;
  using Acc = float;
  static float Load(uint16_t v) { return HalfToFloat(v); }
  static uint16_t Save(float v) { return FloatToHalf(v); }
};
struct BF16 {
  using Store = uint16_t;
  using Acc = float;
  static float Load(uint16_t v) { return BFloat16ToFloat(v); }
  static uint16_t Save(float v) { return FloatToBFloat16(v); }
};

// Integers (window ops) compute in double and round to nearest.
template <typename S> struct Rounded {
  using Store = S;
  using Acc = double;
  static double Load(S v) { return static_cast<double>(v); }
  static S Save(double v) { return static_cast<S>(std::llround(v)); }
};

template <typename Fn> void DispatchFloating(int dtype, Fn&& fn) {
  switch (dtype) {
    case SHOAL_FLOAT16: return fn(F16{});
    case SHOAL_BFLOAT16: return fn(BF16{});
    case SHOAL_FLOAT32: return fn(Plain<float, float>{});
    case SHOAL_FLOAT64: return fn(Plain<double, double>{});
    case SHOAL_INT32: return fn(Rounded<int32_t>{});
    case SHOAL_INT64: return fn(Rounded<int64_t>{});
  }
  throw std::invalid_argument("weighted math needs a floating, int32 or int64 dtype");
}

// Integers for sums: two's-complement wrap-around, computed in uint64_t (no overflow UB).
template <typename S> struct Wrapping {
  using Store = S;
  using Acc = uint64_t;
  static uint64_t Load(S v) { return static_cast<uint64_t>(v); }
  static S Save(uint64_t v) { return static_cast<S>(v); }
};

// The integer dtypes, each as Int<its C type>; false (fn not called) for any other dtype.
template <template <typename> class Int, typename Fn> bool DispatchIntegers(int dtype, Fn&& fn) {
  switch (dtype) {
    case SHOAL_INT8: fn(Int<int8_t>{}); return true;
    case SHOAL_UINT8: fn(Int<uint8_t>{}); return true;
    case SHOAL_INT16: fn(Int<int16_t>{}); return true;
    case SHOAL_INT32: fn(Int<int32_t>{}); return true;
    case SHOAL_INT64: fn(Int<int64_t>{}); return true;
  }
  return false;
}

template <typename Fn> void DispatchSummable(int dtype, Fn&& fn) {
  if (!DispatchIntegers<Wrapping>(dtype, fn)) DispatchFloating(dtype, fn);
}

}  // namespace

void WidenToFloat32(const void* src, int dtype, float* dst, size_t n) {
  auto s = static_cast<const uint16_t*>(src);
  if (dtype == SHOAL_FLOAT16) for (size_t i = 0; i < n; ++i) dst[i] = HalfToFloat(s[i]);
  else for (size_t i = 0; i < n; ++i) dst[i] = BFloat16ToFloat(s[i]);
}

void NarrowFromFloat32(const float* src, int dtype, void* dst, size_t n) {
  auto d = static_cast<uint16_t*>(dst);
  if (dtype == SHOAL_FLOAT16) for (size_t i = 0; i < n; ++i) d[i] = FloatToHalf(src[i]);
  else for (size_t i = 0; i < n; ++i) d[i] = FloatToBFloat16(src[i]);
}

namespace {

// dst[i] = op(src[i], c), computed in the dtype's accumulation type.
template <typename Op> void WithConstant(const void* src, void* dst, int dtype, size_t n, double c, Op op) {
  DispatchFloating(dtype, [&](auto t) {
    using T = decltype(t);
    using A = typename T::Acc;
    auto s = static_cast<const typename T::Store*>(src);
    auto d = static_cast<typename T::Store*>(dst);
    const A a = static_cast<A>(c);
    for (size_t i = 0; i < n; ++i) d[i] = T::Save(op(T::Load(s[i]), a));
  });
}

}  // namespace

void Divide(const void* src, void* dst, int dtype, size_t n, double divisor) {
  WithConstant(src, dst, dtype, n, divisor, std::divides<>());
}

void Scale(const void* src, void* dst, int dtype, size_t n, double w) {
  WithConstant(src, dst, dtype, n, w, std::multiplies<>());
}

namespace {

// `v` toward zero as an int64 (saturated; NaN gives 0).
int64_t TruncToInt64(double v) {
  if (!(v == v)) return 0;
  if (v >= 9223372036854775807.0) return INT64_MAX;
  if (v <= -9223372036854775808.0) return INT64_MIN;
  return static_cast<int64_t>(v);
}

}  // namespace

void Rescale(const void* src, void* dst, int dtype, size_t n, int divisor, double factor) {
  const bool integer = DispatchIntegers<Wrapping>(dtype, [&](auto t) {
    using S = typename decltype(t)::Store;
    auto s = static_cast<const S*>(src);
    auto d = static_cast<S*>(dst);
    if (factor == 1.0) {
      for (size_t i = 0; i < n; ++i) d[i] = static_cast<S>(static_cast<int64_t>(s[i]) / divisor);
      return;
    }
    const double f = factor / divisor;
    for (size_t i = 0; i < n; ++i) d[i] = static_cast<S>(TruncToInt64(static_cast<double>(s[i]) * f));
  });
  if (integer) return;
  DispatchFloating(dtype, [&](auto t) {
    using T = decltype(t);
    using A = typename T::Acc;
    auto s = static_cast<const typename T::Store*>(src);
    auto d = static_cast<typename T::Store*>(dst);
    const A div = static_cast<A>(divisor), f = static_cast<A>(factor);
    for (size_t i = 0; i < n; ++i) {
      A v = T::Load(s[i]);
      if (divisor > 1) v = v / div;
      if (factor != 1.0) v = v * f;
      d[i] = T::Save(v);
    }
  });
}

void Combine(const void* self, const std::vector<const void*>& srcs, void* out, int dtype,
             size_t n, bool uniform, double self_weight, const std::vector<double>& weights) {
  if (srcs.empty() && out == self && (uniform || self_weight == 1.0)) return;  // nothing changes
  DispatchFloating(dtype, [&](auto t) {
    using T = decltype(t);
    using S = typename T::Store;
    using A = typename T::Acc;
    auto x = static_cast<const S*>(self);
    auto y = static_cast<S*>(out);
    if (std::is_same<S, A>::value) {
      // Accumulate straight into the output (it may alias the input: each element is
      // read before it is written): one pass per source, the division fused into the
      // last one, no scratch buffer.
      A* o = reinterpret_cast<A*>(y);
      const A sw = static_cast<A>(self_weight);
      const A div = static_cast<A>(srcs.size() + 1);
      // 1/div is exact for a power of two, and then x * (1/div) is x / div bit for bit
      // (both the one rounding of the same value): a multiply, several times cheaper.
      const bool pow2 = ((srcs.size() + 1) & srcs.size()) == 0;
      const A inv = A(1) / div;
      if (srcs.empty()) {
        for (size_t i = 0; i < n; ++i) o[i] = uniform ? static_cast<A>(x[i]) : sw * static_cast<A>(x[i]);
        return;
      }
      for (size_t j = 0; j < srcs.size(); ++j) {
        auto s = static_cast<const S*>(srcs[j]);
        const A* prev = j == 0 ? reinterpret_cast<const A*>(x) : o;
        const A first = j == 0 && !uniform ? sw : A(1);
        const bool last = j + 1 == srcs.size();
        if (uniform) {
          if (last && pow2) for (size_t i = 0; i < n; ++i) o[i] = (prev[i] + static_cast<A>(s[i])) * inv;
          else if (last) for (size_t i = 0; i < n; ++i) o[i] = (prev[i] + static_cast<A>(s[i])) / div;
          else for (size_t i = 0; i < n; ++i) o[i] = prev[i] + static_cast<A>(s[i]);
        } else {
          const A w = static_cast<A>(weights[j]);
          for (size_t i = 0; i < n; ++i) o[i] = first * prev[i] + w * static_cast<A>(s[i]);
        }
      }
      return;
    }
    std::vector<A> acc(n);
    const A sw = static_cast<A>(uniform ? 1.0 : self_weight);
    for (size_t i = 0; i < n; ++i) acc[i] = uniform ? T::Load(x[i]) : sw * T::Load(x[i]);
    for (size_t j = 0; j < srcs.size(); ++j) {
      auto s = static_cast<const S*>(srcs[j]);
      if (uniform) {
        for (size_t i = 0; i < n; ++i) acc[i] += T::Load(s[i]);
      } else {
        const A w = static_cast<A>(weights[j]);
        for (size_t i = 0; i < n; ++i) acc[i] += w * T::Load(s[i]);
      }
    }
    const A div = static_cast<A>(srcs.size() + 1);
    for (size_t i = 0; i < n; ++i) y[i] = T::Save(uniform ? acc[i] / div : acc[i]);
  });
}

namespace {

// Min and max compare in the dtype itself (int64 beyond 2^53 stays exact).
template <typename S> struct Same {
  using Store = S;
  using Acc = S;
  static S Load(S v) { return v; }
  static S Save(S v) { return v; }
};

template <typename Fn> void DispatchOrdered(int dtype, Fn&& fn) {
  if (DispatchIntegers<Same>(dtype, fn)) return;
  switch (dtype) {
    case SHOAL_FLOAT16: return fn(F16{});
    case SHOAL_BFLOAT16: return fn(BF16{});
    case SHOAL_FLOAT32: return fn(Plain<float, float>{});
    case SHOAL_FLOAT64: return fn(Plain<double, double>{});
  }
  throw std::invalid_argument("min and max need a numeric dtype");
}

// d[i] = fold of op over srcs[j][i], in the accumulation type of T.
template <typename T, typename Op> void Fold(const std::vector<const void*>& srcs, void* dst, size_t n, Op op) {
  using S = typename T::Store;
  auto d = static_cast<S*>(dst);
  for (size_t i = 0; i < n; ++i) {  // every source read before d[i] is written
    typename T::Acc acc = T::Load(static_cast<const S*>(srcs[0])[i]);  // keeps -0.0 alone
    for (size_t j = 1; j < srcs.size(); ++j) acc = op(acc, T::Load(static_cast<const S*>(srcs[j])[i]));
    d[i] = T::Save(acc);
  }
}

}  // namespace

void Reduce(const std::vector<const void*>& srcs, void* dst, int dtype, size_t n, int reduce_op) {
  if (srcs.empty()) return;
  switch (reduce_op) {
    case SHOAL_REDUCE_SUM:
      return DispatchSummable(dtype, [&](auto t) { Fold<decltype(t)>(srcs, dst, n, std::plus<>()); });
    case SHOAL_REDUCE_PRODUCT:
      return DispatchSummable(dtype, [&](auto t) { Fold<decltype(t)>(srcs, dst, n, std::multiplies<>()); });
    case SHOAL_REDUCE_MIN:
      return DispatchOrdered(dtype, [&](auto t) { Fold<decltype(t)>(srcs, dst, n, [](auto a, auto b) { return b < a ? b : a; }); });
    case SHOAL_REDUCE_MAX:
      return DispatchOrdered(dtype, [&](auto t) { Fold<decltype(t)>(srcs, dst, n, [](auto a, auto b) { return a < b ? b : a; }); });
  }
  throw std::invalid_argument("unknown reduce op " + std::to_string(reduce_op));
}

void FillIdentity(void* dst, int dtype, size_t n, int reduce_op) {
  if (reduce_op == SHOAL_REDUCE_SUM || reduce_op == SHOAL_REDUCE_AVERAGE) {
    std::memset(dst, 0, n * DtypeSize(dtype));
    return;
  }
  auto fill = [&](auto t, auto v) {
    using T = decltype(t);
    auto d = static_cast<typename T::Store*>(dst);
    const auto x = T::Save(static_cast<typename T::Acc>(v));
    for (size_t i = 0; i < n; ++i) d[i] = x;
  };
  if (reduce_op == SHOAL_REDUCE_PRODUCT) return DispatchSummable(dtype, [&](auto t) { fill(t, 1); });
  DispatchOrdered(dtype, [&](auto t) {
    using A = typename decltype(t)::Acc;
    using L = std::numeric_limits<A>;
    const bool max_wanted = reduce_op == SHOAL_REDUCE_MIN;  // min's identity is the top
    if (reduce_op != SHOAL_REDUCE_MIN && reduce_op != SHOAL_REDUCE_MAX)
      throw std::invalid_argument("unknown reduce op " + std::to_string(reduce_op));
    if (L::has_infinity) fill(t, max_wanted ? L::infinity() : -L::infinity());
    else fill(t, max_wanted ? L::max() : L::lowest());
  });
}

}  // namespace shoal
