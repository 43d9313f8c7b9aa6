#include "neighbor/topology.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace shoal {

TopologyPlan PlanOf(int nodes, const std::vector<int32_t>& src, const std::vector<int32_t>& dst,
                    const std::vector<double>& weight, int me, bool weighted) {
  auto bad = [](const std::string& m) { throw ArgumentError(SHOAL_INVALID_ARGUMENT, "topology: " + m); };
  if (nodes < 1) bad("a graph needs at least one node");
  if (src.size() != dst.size() || src.size() != weight.size()) bad("edge lists of different lengths");
  if (me < 0 || me >= nodes) bad("this node " + std::to_string(me) + " is outside [0, " + std::to_string(nodes) + ")");
  TopologyPlan p;
  p.nodes = nodes;
  p.weighted = weighted;
  std::vector<std::pair<int, double>> in;
  std::vector<int64_t> keys;
  keys.reserve(src.size());
  for (size_t k = 0; k < src.size(); ++k) {
    const int i = src[k], j = dst[k];
    if (i < 0 || i >= nodes || j < 0 || j >= nodes)
      bad("edge " + std::to_string(i) + " -> " + std::to_string(j) + " has a node outside [0, " +
          std::to_string(nodes) + ")");
    if (!std::isfinite(weight[k]))
      bad("edge " + std::to_string(i) + " -> " + std::to_string(j) + " has a non-finite weight");
    keys.push_back(int64_t{i} * nodes + j);
    if (i == me && j == me) p.self_weight = weight[k];
    else if (j == me) in.emplace_back(i, weight[k]);
    else if (i == me) p.send.push_back(j);
  }
  std::sort(keys.begin(), keys.end());
  auto dup = std::adjacent_find(keys.begin(), keys.end());
  if (dup != keys.end())
    bad("edge " + std::to_string(*dup / nodes) + " -> " + std::to_string(*dup % nodes) + " is given twice");
  std::sort(in.begin(), in.end());
  for (auto& [r, w] : in) {
    p.recv.push_back(r);
    p.recv_weights.push_back(w);
  }
  std::sort(p.send.begin(), p.send.end());
  return p;
}

int64_t Topologies::Set(int graph, TopologyPlan plan) {
  MutexLock lock(mu_);
  plan.version = plans_[graph].version + 1;
  plans_[graph] = std::move(plan);
  return plans_[graph].version;
}

TopologyPlan Topologies::Get(int graph) const {
  MutexLock lock(mu_);
  return plans_[graph];
}

}  // namespace shoal
