// What the Runtime unit tests share (test_runtime.cc, test_join.cc): N runtimes as threads
// over one fake world (fake_backend.h), a CHECK that counts passes and failures from any
// rank thread, and the test configuration (short cycle, stall check and shutdown times).
#pragma once
#include <atomic>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "fake_backend.h"
#include "runtime.h"

namespace shoal::testing {

inline std::atomic<int> g_failed{0}, g_passed{0};  // rank threads count
inline std::string g_case;                          // the running case, for failure lines

#define CHECK(cond, ...)                                                                 \
  do {                                                                                   \
    if (cond) {                                                                          \
      ++::shoal::testing::g_passed;                                                      \
    } else {                                                                             \
      ++::shoal::testing::g_failed;                                                      \
      std::printf("FAILED %s:%d (%s): %s\n  ", __FILE__, __LINE__,                       \
                  ::shoal::testing::g_case.c_str(), #cond);                              \
      std::printf(__VA_ARGS__);                                                          \
      std::printf("\n");                                                                 \
    }                                                                                    \
  } while (0)

// N runtimes over one fake world; Run() calls fn(rank, runtime) on one thread per rank.
struct Job {
  std::shared_ptr<FakeWorld> world;
  std::vector<std::unique_ptr<Runtime>> rt;
  Job(int n, const Config& cfg, uint64_t seed, int delay_us = 100)
      : world(std::make_shared<FakeWorld>(n, seed, delay_us)) {
    for (int r = 0; r < n; ++r)  // one job: one generation (leave notices count)
      rt.push_back(std::make_unique<Runtime>(cfg, std::make_unique<FakeBackend>(world, r), 1));
  }
  ~Job() {
    std::vector<std::thread> t;  // every rank leaves at once, as processes end
    for (auto& r : rt) t.emplace_back([&r] { r->Stop(); });
    for (auto& x : t) x.join();
  }
  void Run(const std::function<void(int, Runtime&)>& fn) {
    std::vector<std::thread> t;
    for (int r = 0; r < static_cast<int>(rt.size()); ++r) t.emplace_back([&, r] { fn(r, *rt[r]); });
    for (auto& x : t) x.join();
  }
};

inline Config TestConfig(int64_t fusion) {
  Config c;
  c.fusion_threshold = fusion;
  c.cycle_time_ms = 0.5;
  c.stall_check_time = 0.3;
  c.stall_shutdown_time = 1.0;
  c.log_level = LOG_ERROR;
  return c;
}

// Rank r's k-th input of `len` small exact values (sums and averages stay exact).
inline std::vector<double> Data(int r, int k, size_t len) {
  std::vector<double> v(len);
  for (size_t i = 0; i < len; ++i) v[i] = r * 1000.0 + k * 10.0 + static_cast<double>(i % 7);
  return v;
}

}  // namespace shoal::testing
