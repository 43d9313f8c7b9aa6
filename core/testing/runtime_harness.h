// What the Runtime unit tests share (test_runtime.cc, test_join.cc): N runtimes as threads
// over one fake world (fake_backend.h), a CHECK that counts passes and failures from any
// rank thread, and the test configuration (short cycle, stall check and shutdown times).
#pragma once
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "testing/fake_backend.h"
#include "common/reduce.h"
#include "runtime/runtime.h"

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
  Job(int n, const Config& cfg, uint64_t seed, int delay_us = 100, int ranks_per_machine = 0)
      : world(std::make_shared<FakeWorld>(n, seed, delay_us, ranks_per_machine)) {
    for (int r = 0; r < n; ++r)  // one job: one generation (leave notices count)
      rt.push_back(std::make_unique<Runtime>(cfg, std::make_unique<FakeBackend>(world, r), 1));
  }
  ~Job() {
    std::vector<std::thread> t;  // every rank leaves at once, as processes end
    for (auto& r : rt) t.emplace_back([&r] { r->Stop(); });
    for (auto& x : t) x.join();
  }
  // Called by every rank thread after its last op: returns once every rank has called it
  // and no vote on retiring names is in flight anywhere, with `agreed` (e.g. as many names
  // retired on every rank) true for 50 ms on end; false after 60 s. Votes run without user
  // calls, so a rank may still commit one after its last op returns.
  bool Settle(const std::function<bool()>& agreed) {
    ++arrived;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    auto since = std::chrono::steady_clock::now();
    while (std::chrono::steady_clock::now() < deadline) {
      bool quiet = arrived == static_cast<int>(rt.size()) && agreed();
      for (auto& r : rt) quiet = quiet && !r->submissions().Voting();
      if (!quiet) since = std::chrono::steady_clock::now();
      else if (std::chrono::steady_clock::now() - since > std::chrono::milliseconds(50)) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return false;
  }
  std::atomic<int> arrived{0};
  void Run(const std::function<void(int, Runtime&)>& fn) {
    std::vector<std::thread> t;
    for (int r = 0; r < static_cast<int>(rt.size()); ++r) t.emplace_back([&, r] { fn(r, *rt[r]); });
    for (auto& x : t) x.join();
  }
};

// Every rank q has retired as many names as rank q % period (the ranks of its sets).
inline bool RetiredAlike(const Job& job, int period = 1) {
  for (size_t q = 0; q < job.rt.size(); ++q)
    if (job.rt[q]->stats().names_retired != job.rt[q % period]->stats().names_retired) return false;
  return true;
}

// Stall warnings (and a cached round's probe of the coordinator) early; a stall error only
// after 30 s: a rank thread starved for seconds under a sanitizer on busy cores is no stall,
// and a lost message still fails the test, with its error.
inline Config TestConfig(int64_t fusion) {
  Config c;
  c.fusion_threshold = fusion;
  c.cycle_time_ms = 0.5;
  c.stall_check_time = 0.3;
  c.stall_shutdown_time = 30.0;
  c.log_level = LOG_ERROR;
  return c;
}

// For tests that end in a stall error (a rank that never calls, a dead peer).
inline Config StallConfig(int64_t fusion) {
  Config c = TestConfig(fusion);
  c.stall_shutdown_time = 1.0;
  return c;
}

// For tests that assert no coordinator round: stall times far beyond any round, so a
// cached round on loaded cores does not probe the coordinator (TestConfig's probe comes
// after 75 ms; the stall paths have tests of their own).
inline Config NoStallConfig(int64_t fusion) {
  Config c = TestConfig(fusion);
  c.stall_check_time = 30;
  c.stall_shutdown_time = 60;
  return c;
}

// Rank r's k-th input of `len` small exact values (sums and averages stay exact).
inline std::vector<double> Data(int r, int k, size_t len) {
  std::vector<double> v(len);
  for (size_t i = 0; i < len; ++i) v[i] = r * 1000.0 + k * 10.0 + static_cast<double>(i % 7);
  return v;
}

// One op (float64 by default): its arrays outlive it (the core reads and writes them until
// it completes); the rank lists are read at enqueue.
struct Op {
  std::string name;
  int op = SHOAL_OP_NEIGHBOR_ALLREDUCE, dtype = SHOAL_FLOAT64;
  std::vector<double> x, out;
  std::vector<int64_t> shape;
  std::vector<int32_t> recv, send;
  std::vector<double> recv_w, send_w;
  double self_w = 1.0;
  bool uniform = true, topo_check = false;
  int reduce_op = SHOAL_REDUCE_SUM, root = 0;
  int64_t handle = 0;

  int64_t Enqueue(Runtime& rt) {
    shoal_op_desc d{};
    d.op = op;
    d.name = name.c_str();
    shape = {static_cast<int64_t>(x.size())};
    out.assign(x.size(), 0.0);
    d.input = {x.data(), dtype, 1, shape.data(), SHOAL_DEVICE_CPU, 0, nullptr, nullptr};
    d.output = d.input;
    d.output.data = out.data();
    d.reduce_op = reduce_op;
    d.root_rank = root;
    d.n_recv = static_cast<int32_t>(recv.size());
    d.recv_ranks = recv.data();
    d.recv_weights = recv_w.empty() ? nullptr : recv_w.data();
    d.self_weight = self_w;
    d.uniform = uniform;
    d.topo_check = topo_check;
    d.n_send = static_cast<int32_t>(send.size());
    d.send_ranks = send.data();
    d.send_weights = send_w.empty() ? nullptr : send_w.data();
    return handle = rt.Enqueue(d);
  }
  Status Wait(Runtime& rt) {
    Status st = rt.Wait(handle);
    rt.submissions().Release(handle);
    return st;
  }
};

// Element i of a buffer of `dtype`, written from and read as a double (exact for the small
// integers and halves the tests use; half types through float32).
inline void PutValue(int dtype, void* buf, size_t i, double v) {
  char* p = static_cast<char*>(buf) + i * DtypeSize(dtype);
  auto put = [p](auto x) { std::memcpy(p, &x, sizeof x); };
  switch (dtype) {
    case SHOAL_FLOAT16: put(FloatToHalf(static_cast<float>(v))); break;
    case SHOAL_BFLOAT16: put(FloatToBFloat16(static_cast<float>(v))); break;
    case SHOAL_FLOAT32: put(static_cast<float>(v)); break;
    case SHOAL_FLOAT64: put(v); break;
    case SHOAL_INT8: put(static_cast<int8_t>(v)); break;
    case SHOAL_UINT8: put(static_cast<uint8_t>(v)); break;
    case SHOAL_INT16: put(static_cast<int16_t>(v)); break;
    case SHOAL_INT32: put(static_cast<int32_t>(v)); break;
    case SHOAL_INT64: put(static_cast<int64_t>(v)); break;
    default: put(static_cast<uint8_t>(v != 0)); break;
  }
}

inline double GetValue(int dtype, const void* buf, size_t i) {
  const char* p = static_cast<const char*>(buf) + i * DtypeSize(dtype);
  auto get = [p](auto x) { std::memcpy(&x, p, sizeof x); return x; };
  switch (dtype) {
    case SHOAL_FLOAT16: return HalfToFloat(get(uint16_t{}));
    case SHOAL_BFLOAT16: return BFloat16ToFloat(get(uint16_t{}));
    case SHOAL_FLOAT32: return get(float{});
    case SHOAL_FLOAT64: return get(double{});
    case SHOAL_INT8: return get(int8_t{});
    case SHOAL_UINT8: return get(uint8_t{});
    case SHOAL_INT16: return get(int16_t{});
    case SHOAL_INT32: return get(int32_t{});
    case SHOAL_INT64: return static_cast<double>(get(int64_t{}));
    default: return get(uint8_t{});
  }
}

// One op of any dtype and shape over byte buffers that outlive it (the core reads and
// writes them until it completes); `out` is allreduce's output.
struct TypedOp {
  std::string name;
  int op = SHOAL_OP_ALLREDUCE, reduce_op = SHOAL_REDUCE_SUM, dtype = SHOAL_FLOAT64;
  std::vector<int64_t> shape, splits;
  std::vector<char> x, out;
  bool horovod_scaling = false;  // with prescale and postscale (shoal_op_desc)
  double prescale = 1.0, postscale = 1.0;
  TypedOp(std::string n, int o, int dt, std::vector<int64_t> s) : name(std::move(n)), op(o), dtype(dt), shape(std::move(s)) {
    x.assign(std::max<size_t>(NumElements(shape) * DtypeSize(dtype), 1), 0);
    out = x;
  }
  size_t count() const { return static_cast<size_t>(NumElements(shape)); }
  shoal_op_desc Desc() {
    shoal_op_desc d{};
    d.op = op;
    d.name = name.c_str();
    d.input = {x.data(), dtype, static_cast<int32_t>(shape.size()), shape.data(), SHOAL_DEVICE_CPU, 0, nullptr, nullptr};
    d.output = d.input;
    d.output.data = out.data();
    d.reduce_op = reduce_op;
    d.n_splits = static_cast<int32_t>(splits.size());
    d.splits = splits.empty() ? nullptr : splits.data();
    d.horovod_scaling = horovod_scaling;
    d.prescale_factor = prescale;
    d.postscale_factor = postscale;
    return d;
  }
};

// Waits for `h`, takes its core-allocated result (if any) into *result, releases it.
inline Status WaitTake(Runtime& rt, int64_t h, std::vector<char>* result = nullptr,
                       std::vector<int64_t>* shape = nullptr, std::vector<int64_t>* recv_splits = nullptr) {
  Status st = rt.Wait(h);
  EntryPtr e = rt.submissions().Find(h);
  if (st.ok() && e && result) {
    const char* p = static_cast<const char*>(e->result);
    result->assign(p, p + e->result_nbytes);
    if (shape) *shape = e->result_shape;
    if (recv_splits) *recv_splits = e->recv_splits;
  }
  rt.submissions().Release(h);
  return st;
}

}  // namespace shoal::testing
