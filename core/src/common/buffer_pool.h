// Reuses large byte buffers (neighbor messages, fusion buffers): a fresh 100 MB buffer
// costs ~25k page faults per step, more than moving the data. Used by the progress
// driver only; buffers handed out return here when their last owner drops them.
#pragma once
#include <memory>
#include <vector>

#include "common/common.h"

namespace shoal {

class BufferPool : public std::enable_shared_from_this<BufferPool> {
 public:
  static std::shared_ptr<BufferPool> Create(size_t max_buffers = 8) {
    return std::shared_ptr<BufferPool>(new BufferPool(max_buffers));
  }

  // A buffer of `size` bytes (contents undefined).
  std::shared_ptr<ByteVec> Get(size_t size) {
    std::unique_ptr<ByteVec> buf;
    // The smallest free buffer that fits; if none fits, the largest (it grows).
    auto fits = [&](size_t i) { return free_[i]->capacity() >= size; };
    auto better = [&](size_t i, size_t b) {
      if (fits(i) != fits(b)) return fits(i);
      return fits(i) ? free_[i]->capacity() < free_[b]->capacity()
                     : free_[i]->capacity() > free_[b]->capacity();
    };
    size_t best = free_.size();
    for (size_t i = 0; i < free_.size(); ++i)
      if (best == free_.size() || better(i, best)) best = i;
    if (best < free_.size()) {
      buf = std::move(free_[best]);
      free_.erase(free_.begin() + best);
      buf->clear();  // so a growing resize reallocates without copying old bytes
    } else {
      buf = std::make_unique<ByteVec>();
    }
    buf->resize(size);
    std::weak_ptr<BufferPool> pool = shared_from_this();
    return std::shared_ptr<ByteVec>(buf.release(), [pool](ByteVec* v) {
      if (auto p = pool.lock()) p->Put(v);
      else delete v;
    });
  }

 private:
  explicit BufferPool(size_t max_buffers) : max_(max_buffers) {}
  void Put(ByteVec* v) {
    if (free_.size() < max_) free_.emplace_back(v);
    else delete v;
  }

  size_t max_;
  std::vector<std::unique_ptr<ByteVec>> free_;
};

}  // namespace shoal
