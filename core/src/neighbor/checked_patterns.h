// Which neighbor ops skip the coordinator (docs/design.md §5, §18).
//
// A neighbor op's name is negotiated on first sight (signature; with `topo_check`, the
// edges in both directions). Later calls skip the coordinator when the check is off, or
// once the name is trusted: a checked round in which every rank's own send/receive
// pattern had been checked before (a one-peer schedule repeats after log2(n) steps, a
// static pattern after one). Every rank learns it from that round's response, before it
// can submit the name again (one call of a name in flight per rank), so all ranks skip
// from the same step on. What a rank alone cannot know after that, its peers' patterns at
// each step, the data headers check (neighbor/neighbor_exchange.h, Disputes).
#pragma once
#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

#include "runtime/entry.h"

namespace shoal {

class CheckedPatterns {
 public:
  // Patterns kept per name; an older one is checked again when it comes back.
  static constexpr size_t kPerName = 32;

  // `e` (a neighbor op) may skip the coordinator.
  bool Skips(const Entry& e) const;
  // This rank's pattern of `e` was part of a checked round before.
  bool Checked(const Entry& e) const;
  // The coordinator scheduled `e`; `trusted`: the response trusts its name from now on.
  void Negotiated(const Entry& e, bool trusted);
  void Forget(const std::string& name) { names_.erase(name); }
  void ForgetIf(const std::function<bool(const std::string&)>& which);

 private:
  struct Pattern {
    std::vector<int> send, recv;  // sorted
  };
  struct Name {
    bool trusted = false;
    std::vector<Pattern> checked;  // oldest first
  };
  std::unordered_map<std::string, Name> names_;
};

}  // namespace shoal
