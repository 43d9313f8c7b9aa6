#include "ops/fusion.h"

#include <algorithm>
#include <cstring>

#include "common/reduce.h"

namespace shoal {
namespace {

bool IsHalf(int dtype) { return dtype == SHOAL_FLOAT16 || dtype == SHOAL_BFLOAT16; }

}  // namespace

int FusedBuffer::WireDtype(int dtype) { return IsHalf(dtype) ? SHOAL_FLOAT32 : dtype; }

void FusedBuffer::Unpack(void* src, int dtype, void* out, int64_t count, int divisor, double postscale) {
  const int wire = WireDtype(dtype);
  if (divisor > 1 || postscale != 1.0) Rescale(src, src, wire, count, std::max(divisor, 1), postscale);
  if (wire != dtype) NarrowFromFloat32(static_cast<const float*>(src), dtype, out, count);
  else if (out != src) std::memcpy(out, src, count * DtypeSize(dtype));
}

FusedBuffer::FusedBuffer(BufferPool& pool, int dtype, int64_t elements, int64_t extra)
    : dtype_(dtype), wire_(WireDtype(dtype)), wire_size_(DtypeSize(wire_)),
      buf_(pool.Get(std::max<int64_t>(elements + extra, 1) * wire_size_)) {}

void FusedBuffer::Pack(const std::vector<EntryPtr>& members) {
  offsets_.clear();
  size_t off = 0;
  for (auto& e : members) {
    e->t_copy_start = Clock::now();
    offsets_.push_back(off);
    if (wire_ != dtype_) WidenToFloat32(e->input.data, dtype_, reinterpret_cast<float*>(data() + off), e->count());
    else std::memcpy(data() + off, e->input.data, e->nbytes());
    if (e->prescale != 1.0) Rescale(data() + off, data() + off, wire_, e->count(), 1, e->prescale);
    off += e->count() * wire_size_;
    e->t_copy_end = Clock::now();
  }
}

void FusedBuffer::UnpackMember(size_t k, const Entry& e, int divisor) {
  Unpack(data() + offsets_[k], dtype_, e.output.data, e.count(), divisor, e.postscale);
}

}  // namespace shoal
