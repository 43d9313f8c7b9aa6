#include "runtime/departures.h"

#include <algorithm>

#include "process_sets/process_sets.h"

namespace shoal {

bool Departures::Record(int rank) {
  if (left_[rank]) return false;
  left_[rank] = 1;
  any_ = true;
  MutexLock lock(mu_);
  in_order_.push_back(rank);
  return true;
}

std::vector<int> Departures::Members(const ProcessSet* set) const {
  std::vector<int> gone;
  if (!any_) return gone;
  for (size_t r = 0; r < left_.size(); ++r)
    if (left_[r] && (!set || set->Has(static_cast<int>(r)))) gone.push_back(static_cast<int>(r));
  return gone;
}

std::string Departures::Describe(const std::vector<int>& ranks) {
  return RanksNamed(ranks) + " left the job (script ended, sys.exit or shoal.shutdown()) before taking part in this op";
}

std::string Departures::Message() const {
  std::vector<int> ranks;
  {
    MutexLock lock(mu_);
    ranks = in_order_;
  }
  if (ranks.empty()) return "";
  std::sort(ranks.begin(), ranks.end());
  return Describe(ranks);
}

}  // namespace shoal
