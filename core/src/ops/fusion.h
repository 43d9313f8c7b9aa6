// Tensor fusion, written once for every path that reduces a batch in one buffer
// (negotiated allreduces, cached rounds, reducescatter of half types): the members'
// inputs packed one after another in the wire dtype, and each member's result unpacked
// from it. Half types (float16, bfloat16) travel as float32: the reduction computes in
// float32 and rounds once (exact for min and max). An average is a sum divided on unpack;
// Horovod's scaling is done here too: each member's prescale on pack, its postscale on
// unpack (after the division), integers truncated toward zero (common/reduce.h, Rescale).
#pragma once
#include <cstdint>
#include <vector>

#include "common/buffer_pool.h"
#include "runtime/entry.h"

namespace shoal {

class FusedBuffer {
 public:
  // The dtype a reduction of `dtype` runs in.
  static int WireDtype(int dtype);
  // Converts `count` reduced elements at `src` (of `dtype`'s wire dtype) into `out` (of
  // `dtype`), divided by `divisor` when it is above 1, then times `postscale`. `src` may
  // be modified.
  static void Unpack(void* src, int dtype, void* out, int64_t count, int divisor, double postscale);

  // Room for `elements` members' elements plus `extra` more (a round's ready count), from
  // `pool`, in `dtype`'s wire dtype.
  FusedBuffer(BufferPool& pool, int dtype, int64_t elements, int64_t extra = 0);
  // Copies (or widens) each member's input in order, times its prescale; sets its
  // fusion-copy times.
  void Pack(const std::vector<EntryPtr>& members);
  // Member `k`'s (of the last Pack) result into its output, divided by `divisor` if > 1,
  // times its postscale.
  void UnpackMember(size_t k, const Entry& e, int divisor);
  // Elements [0, count) into `out`, divided by `divisor` if > 1, times `postscale`.
  void UnpackTo(void* out, int64_t count, int divisor, double postscale) {
    Unpack(data(), dtype_, out, count, divisor, postscale);
  }

  char* data() { return buf_->data(); }
  void* at_element(int64_t i) { return buf_->data() + i * wire_size_; }
  int wire() const { return wire_; }

 private:
  int dtype_, wire_;
  size_t wire_size_;
  std::shared_ptr<ByteVec> buf_;
  std::vector<size_t> offsets_;  // of each packed member, in bytes
};

}  // namespace shoal
