// The static topologies (docs/design.md §7): this rank's view of the graph over ranks
// set by set_topology, and of the graph over machines set by set_machine_topology.
// BlueFog's convention: edge i -> j with weight w means node j weights node i's value by
// w when it combines; a self loop gives a node its own weight (0 without one).
#pragma once
#include <cstdint>
#include <vector>

#include "common/common.h"
#include "common/thread_annotations.h"

namespace shoal {

struct TopologyPlan {
  int64_t version = 0;    // 0: never set; each set_topology of this graph adds one
  int32_t nodes = 0;      // ranks, or machines
  bool weighted = false;  // combine with the graph's weights (else uniform)
  std::vector<int> recv, send;       // in- and out-neighbors, ascending, self excluded
  std::vector<double> recv_weights;  // by recv
  double self_weight = 0;            // the self loop's weight, 0 without one
};

// This node's plan of the graph with `nodes` nodes and edges src[k] -> dst[k] of weight
// weight[k]. Throws ArgumentError for a node outside [0, nodes), a duplicate edge or a
// non-finite weight.
TopologyPlan PlanOf(int nodes, const std::vector<int32_t>& src, const std::vector<int32_t>& dst,
                    const std::vector<double>& weight, int me, bool weighted);

// The plans of the graphs of shoal_graph (ranks, machines), set and read from any thread.
class Topologies {
 public:
  // Sets `graph`'s plan; returns its version.
  int64_t Set(int graph, TopologyPlan plan) EXCLUDES(mu_);
  TopologyPlan Get(int graph) const EXCLUDES(mu_);

 private:
  mutable Mutex mu_;
  TopologyPlan plans_[2] GUARDED_BY(mu_);
};

}  // namespace shoal
