// Counters behind shoal.stats(); written by the progress driver and the window thread, read
// by anyone. windows / window_bytes are gauges: MPI windows and bytes they hold now.
#pragma once
#include <atomic>
#include <cstdint>
#include <sstream>
#include <string>

namespace shoal {

struct Stats {
#define SHOAL_COUNTERS(X)                                                                   \
  X(allreduce) X(broadcast) X(allgather) X(barrier) X(neighbor_allreduce) X(neighbor_allgather) X(reducescatter) X(hierarchical_neighbor_allreduce) X(alltoall) X(bytes_sent)    \
  X(bytes_received) X(fused_batches) X(negotiations) X(coordinator_rounds) X(cache_hits) \
  X(global_collectives) X(stalls) X(errors) X(windows) X(window_bytes) X(win_puts)          \
  X(win_accumulates) X(win_gets) X(win_updates) X(neighbor_bytes_sent_mpi) X(neighbor_bytes_sent_staged)   \
  X(neighbor_bytes_sent_nccl) X(names_retired) X(held_calls)
#define SHOAL_DECLARE(n) std::atomic<int64_t> n{0};
  SHOAL_COUNTERS(SHOAL_DECLARE)
#undef SHOAL_DECLARE

  std::string ToString() const {
    std::ostringstream s;
#define SHOAL_PRINT(n) s << #n "=" << n.load() << "\n";
    SHOAL_COUNTERS(SHOAL_PRINT)
#undef SHOAL_PRINT
    return s.str();
  }
  void Reset() {
#define SHOAL_ZERO(n) n = 0;
    SHOAL_COUNTERS(SHOAL_ZERO)
#undef SHOAL_ZERO
  }
};

}  // namespace shoal
