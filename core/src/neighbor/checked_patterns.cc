#include "neighbor/checked_patterns.h"

#include <algorithm>

namespace shoal {

bool CheckedPatterns::Skips(const Entry& e) const {
  auto it = names_.find(e.name);
  return it != names_.end() && (!e.topo_check || it->second.trusted);
}

bool CheckedPatterns::Checked(const Entry& e) const {
  auto it = names_.find(e.name);
  if (it == names_.end()) return false;
  // Compared as sets without sorted copies: the lists are short and free of duplicates.
  auto same = [](const std::vector<int>& sorted, const std::vector<int>& v) {
    return sorted.size() == v.size() &&
           std::all_of(v.begin(), v.end(), [&](int r) { return std::binary_search(sorted.begin(), sorted.end(), r); });
  };
  const auto& checked = it->second.checked;
  return std::any_of(checked.begin(), checked.end(),
                     [&](const Pattern& p) { return same(p.send, e.send_ranks) && same(p.recv, e.recv_ranks); });
}

void CheckedPatterns::Negotiated(const Entry& e, bool trusted) {
  Name& n = names_[e.name];
  n.trusted = n.trusted || (e.topo_check && trusted);
  if (!e.topo_check || n.trusted || Checked(e)) return;
  if (n.checked.size() == kPerName) n.checked.erase(n.checked.begin());
  Pattern p{e.send_ranks, e.recv_ranks};
  std::sort(p.send.begin(), p.send.end());
  std::sort(p.recv.begin(), p.recv.end());
  n.checked.push_back(std::move(p));
}

void CheckedPatterns::ForgetIf(const std::function<bool(const std::string&)>& which) {
  for (auto it = names_.begin(); it != names_.end();) it = which(it->first) ? names_.erase(it) : std::next(it);
}

}  // namespace shoal
