// Runtime configuration: every SHOAL_* environment variable, parsed once at init().
#pragma once
#include <chrono>
#include <cstdint>
#include <string>

namespace shoal {

enum LogLevel { LOG_TRACE = 0, LOG_DEBUG, LOG_INFO, LOG_WARNING, LOG_ERROR };

struct Config {
  int64_t fusion_threshold = 8 << 20;  // SHOAL_FUSION_THRESHOLD, bytes; 0 disables fusion
  double cycle_time_ms = 1.0;          // SHOAL_CYCLE_TIME, longest idle sleep of the loop
  double stall_check_time = 60;        // SHOAL_STALL_CHECK_TIME, seconds; 0 disables
  double stall_shutdown_time = 0;      // SHOAL_STALL_SHUTDOWN_TIME, seconds; 0 = warn only
  int ranks_per_machine = 0;           // SHOAL_RANKS_PER_MACHINE; 0 = one machine per host
  int log_level = LOG_WARNING;         // SHOAL_LOG_LEVEL
  std::string timeline;                // SHOAL_TIMELINE: per-rank trace prefix; "" = off
  std::string gpu_backend = "mpi";     // SHOAL_GPU_BACKEND: nccl (CUDA tensors' collectives and neighbor ops) or mpi
  bool cuda_aware_mpi = true;          // SHOAL_CUDA_AWARE_MPI=0: stage neighbor ops even where MPI is CUDA-aware
  bool fault_tolerant = false;         // SHOAL_FAULT_TOLERANT=1: survive lost ranks (Open MPI's ULFM; docs/design.md §16)
  size_t name_limit = 16384;           // SHOAL_NAME_LIMIT: op names kept before idle ones are retired (negotiation/names.cc)

  std::chrono::microseconds CycleTime() const {
    return std::chrono::microseconds(static_cast<int64_t>(cycle_time_ms * 1000));
  }
  static Config FromEnvironment();  // throws std::invalid_argument on a malformed value
  // Read where no Config is at hand: the CUDA plugin loads once per process, maybe before
  // init(); MPI_Abort may come before init() or after shutdown().
  static std::string CudaPlugin();  // SHOAL_CUDA_PLUGIN: "", "real", "fake" or a plugin's path
  static std::string StatusDir();   // SHOAL_STATUS_DIR: where shoalrun collects how ranks ended
  std::string ToString() const;
};

// Logging to stderr, prefixed with rank and time.
void SetLogContext(int rank, int level);
bool LogEnabled(int level);
void Log(int level, const std::string& msg);

}  // namespace shoal
