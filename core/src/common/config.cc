#include <atomic>
#include "common/config.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <sstream>
#include <stdexcept>
#include <strings.h>

#include "common/thread_annotations.h"

namespace shoal {
namespace {

const char* Env(const char* name) {
  const char* v = std::getenv(name);
  return (v && *v) ? v : nullptr;
}

double EnvDouble(const char* name, double def) {
  const char* v = Env(name);
  if (!v) return def;
  char* end;
  double d = std::strtod(v, &end);
  if (*end || !(d >= 0) || d > 1e9) throw std::invalid_argument(std::string(name) + "='" + v + "' is not a number in [0, 1e9]");
  return d;
}

bool EnvBool(const char* name, bool def) {
  const char* v = Env(name);
  if (!v) return def;
  const std::string s = v;
  if (s != "0" && s != "1") throw std::invalid_argument(std::string(name) + " must be 0 or 1, got '" + s + "'");
  return s == "1";
}

const char* const kLevelNames[] = {"trace", "debug", "info", "warning", "error"};

int ParseLogLevel(const char* v) {
  for (int i = 0; i < 5; ++i) if (!strcasecmp(v, kLevelNames[i])) return i;
  if (!strcasecmp(v, "warn")) return LOG_WARNING;
  throw std::invalid_argument(std::string("SHOAL_LOG_LEVEL='") + v +
                              "' is not one of trace, debug, info, warning, error");
}

// Set at init and by the progress thread, read by any thread that logs.
std::atomic<int> g_rank{-1};
std::atomic<int> g_level{LOG_WARNING};
Mutex g_log_mu;  // one log line at a time on stderr

}  // namespace

Config Config::FromEnvironment() {
  Config c;
  c.fusion_threshold = static_cast<int64_t>(EnvDouble("SHOAL_FUSION_THRESHOLD", c.fusion_threshold));
  c.cycle_time_ms = EnvDouble("SHOAL_CYCLE_TIME", c.cycle_time_ms);
  c.stall_check_time = EnvDouble("SHOAL_STALL_CHECK_TIME", c.stall_check_time);
  c.stall_shutdown_time = EnvDouble("SHOAL_STALL_SHUTDOWN_TIME", c.stall_shutdown_time);
  c.ranks_per_machine = static_cast<int>(EnvDouble("SHOAL_RANKS_PER_MACHINE", 0));
  if (const char* v = Env("SHOAL_LOG_LEVEL")) c.log_level = ParseLogLevel(v);
  if (const char* v = Env("SHOAL_TIMELINE")) c.timeline = v;
  if (const char* v = Env("SHOAL_GPU_BACKEND")) c.gpu_backend = v;
  if (c.gpu_backend != "nccl" && c.gpu_backend != "mpi")
    throw std::invalid_argument("SHOAL_GPU_BACKEND must be nccl or mpi, got '" + c.gpu_backend + "'");
  c.cuda_aware_mpi = EnvBool("SHOAL_CUDA_AWARE_MPI", c.cuda_aware_mpi);
  c.fault_tolerant = EnvBool("SHOAL_FAULT_TOLERANT", c.fault_tolerant);
  const double limit = EnvDouble("SHOAL_NAME_LIMIT", static_cast<double>(c.name_limit));
  if (limit < 16)
    throw std::invalid_argument("SHOAL_NAME_LIMIT must be at least 16 (names), got " + std::to_string(static_cast<int64_t>(limit)));
  c.name_limit = static_cast<size_t>(limit);
  return c;
}

std::string Config::ToString() const {
  std::ostringstream s;
  s << "SHOAL_FUSION_THRESHOLD=" << fusion_threshold << " SHOAL_CYCLE_TIME=" << cycle_time_ms
    << " SHOAL_STALL_CHECK_TIME=" << stall_check_time
    << " SHOAL_STALL_SHUTDOWN_TIME=" << stall_shutdown_time
    << " SHOAL_RANKS_PER_MACHINE=" << ranks_per_machine
    << " SHOAL_LOG_LEVEL=" << kLevelNames[log_level] << " SHOAL_TIMELINE=" << timeline << " SHOAL_GPU_BACKEND=" << gpu_backend
    << " SHOAL_CUDA_AWARE_MPI=" << cuda_aware_mpi << " SHOAL_FAULT_TOLERANT=" << fault_tolerant << " SHOAL_NAME_LIMIT=" << name_limit;
  return s.str();
}

void SetLogContext(int rank, int level) {
  g_rank = rank;
  g_level = level;
}

bool LogEnabled(int level) { return level >= g_level; }

void Log(int level, const std::string& msg) {
  if (!LogEnabled(level)) return;
  static const char* tags[] = {"TRACE", "DEBUG", "INFO", "WARNING", "ERROR"};
  auto now = std::chrono::system_clock::now();
  std::time_t t = std::chrono::system_clock::to_time_t(now);
  int ms = static_cast<int>(
      std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000);
  char ts[32];
  std::tm tm{};
  localtime_r(&t, &tm);
  std::strftime(ts, sizeof ts, "%H:%M:%S", &tm);
  MutexLock lock(g_log_mu);
  std::fprintf(stderr, "[shoal %s.%03d rank %d %s] %s\n", ts, ms, g_rank.load(), tags[level], msg.c_str());
  std::fflush(stderr);
}

std::string Config::CudaPlugin() {
  const char* v = Env("SHOAL_CUDA_PLUGIN");
  return v ? v : "";
}

std::string Config::StatusDir() {
  const char* v = Env("SHOAL_STATUS_DIR");
  return v ? v : "";
}

}  // namespace shoal
