// Ranks that left the job (shoal.shutdown(), the script's end, sys.exit): the progress
// driver records each from its leave notice; ops that need a rank that left fail with a
// message naming it instead of waiting.
#pragma once
#include <string>
#include <vector>

#include "common/thread_annotations.h"
#include "runtime/entry.h"

namespace shoal {

class Departures {
 public:
  explicit Departures(int world_size) : left_(world_size, 0) {}

  // Driver only.
  bool Record(int rank) EXCLUDES(mu_);  // false if its leave was known already
  bool Any() const { return any_; }
  bool Left(int rank) const { return any_ && left_[rank]; }
  std::vector<int> Members(const ProcessSet* set) const;  // ranks of `set` (null: every rank) that left

  // Any thread: "rank 1 left the job (...)" once some rank left, else "".
  std::string Message() const EXCLUDES(mu_);
  // "ranks 0, 2 left the job (...) before taking part in this op".
  static std::string Describe(const std::vector<int>& ranks);

 private:
  std::vector<char> left_;  // by rank
  bool any_ = false;
  mutable Mutex mu_;
  std::vector<int> in_order_ GUARDED_BY(mu_);  // the ranks that left, for other threads
};

}  // namespace shoal
