// Unit tests of the Runtime (negotiation, neighbor exchange with fusion, stalls, dead
// peers, dynamic weights) with N ranks as threads in one process over the fake backend
// (fake_backend.h), at 2, 4 and 8 ranks. tests/test_core_cpp.py also runs them under
// ThreadSanitizer. Exit status 0 = all passed.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "testing/runtime_harness.h"
#include "common/reduce.h"
#include "runtime/runtime.h"

using namespace shoal;

using namespace shoal::testing;

static std::vector<int32_t> Ring(int r, int n) {
  if (n == 2) return {1 - r};
  return {(r + n - 1) % n, (r + 1) % n};
}

// Ranks submit 12 named ops in their own random orders and wait in other random orders:
// every result is the exact uniform average of its ring neighbours. Twice: the second
// round goes straight to the neighbours (names negotiated), with no coordinator round.
static void TestNeighborOrders(int n, int64_t fusion, int delay_us) {
  g_case = "neighbor orders n=" + std::to_string(n) + " fusion=" + std::to_string(fusion);
  Job job(n, TestConfig(fusion), 7 + n, delay_us);
  const int k_ops = 12;
  for (int round = 0; round < 2; ++round) {
    job.Run([&](int r, Runtime& rt) {
      std::vector<Op> ops(k_ops);
      std::vector<int> order(k_ops);
      for (int k = 0; k < k_ops; ++k) order[k] = k;
      std::mt19937 rng(r * 31 + round);
      std::shuffle(order.begin(), order.end(), rng);
      const int64_t rounds_before = rt.stats().coordinator_rounds;
      for (int k : order) {
        ops[k].name = "nb." + std::to_string(k);
        ops[k].x = Data(r, k, 1 + 37 * k);  // several sizes, so fusion packs different mixes
        ops[k].recv = ops[k].send = Ring(r, n);
        ops[k].Enqueue(rt);
      }
      std::shuffle(order.begin(), order.end(), rng);
      for (int k : order) {
        Status st = ops[k].Wait(rt);
        CHECK(st.ok(), "rank %d op %d: %s", r, k, st.message.c_str());
        if (!st.ok()) continue;
        bool exact = true;
        for (size_t i = 0; i < ops[k].x.size(); ++i) {
          double sum = ops[k].x[i];
          for (int src : ops[k].recv) sum += Data(src, k, ops[k].x.size())[i];
          exact = exact && ops[k].out[i] == sum / static_cast<double>(ops[k].recv.size() + 1);
        }
        CHECK(exact, "rank %d op %d: not the uniform average", r, k);
      }
      if (round == 1) CHECK(rt.stats().coordinator_rounds == rounds_before, "rank %d asked the coordinator", r);
    });
  }
}

// Ranks that disagree get the same error, naming what differs, on every rank.
static void TestMismatch(int n) {
  g_case = "mismatch n=" + std::to_string(n);
  Job job(n, TestConfig(8 << 20), 3, 50);
  std::vector<std::string> errors(n);
  job.Run([&](int r, Runtime& rt) {
    Op a;
    a.name = "mm.shape";
    a.op = SHOAL_OP_ALLREDUCE;
    a.x = Data(r, 0, r == 0 ? 3 : 4);
    a.Enqueue(rt);
    Status st = a.Wait(rt);
    CHECK(st.code == SHOAL_MISMATCH && st.message.find("mismatched shapes") != std::string::npos, "rank %d: %s", r,
          st.message.c_str());
    errors[r] = st.message;
    Op b;  // a neighbor op: negotiated at its first call
    b.name = "mm.nbr";
    b.x = Data(r, 1, 5);
    b.recv = b.send = Ring(r, n);
    b.dtype = r == n - 1 ? SHOAL_FLOAT32 : SHOAL_FLOAT64;  // the buffer is large enough for either
    b.Enqueue(rt);
    st = b.Wait(rt);
    CHECK(st.code == SHOAL_MISMATCH && st.message.find("mismatched dtypes") != std::string::npos, "rank %d: %s", r,
          st.message.c_str());
  });
  for (int r = 1; r < n; ++r) CHECK(errors[r] == errors[0], "rank %d: %s vs %s", r, errors[r].c_str(), errors[0].c_str());
}

// A rank that never submits: the collective and the neighbor exchange both end in a stall
// error that names it (SHOAL_STALL_SHUTDOWN_TIME), not a hang.
static void TestStall(int n) {
  g_case = "stall n=" + std::to_string(n);
  Job job(n, StallConfig(8 << 20), 5, 50);
  const int last = n - 1;
  job.Run([&](int r, Runtime& rt) {
    Op warm;  // negotiate the neighbor name while everyone takes part
    warm.name = "st.nbr";
    warm.x = Data(r, 0, 3);
    warm.recv = warm.send = Ring(r, n);
    warm.Enqueue(rt);
    CHECK(warm.Wait(rt).ok(), "rank %d: warm-up failed", r);
  });
  job.Run([&](int r, Runtime& rt) {
    if (r == last) return;  // this rank never submits either op
    Op a;
    a.name = "st.ar";
    a.op = SHOAL_OP_ALLREDUCE;
    a.x = Data(r, 0, 3);
    a.Enqueue(rt);
    Status st = a.Wait(rt);
    CHECK(!st.ok() && st.message.find("missing ranks " + std::to_string(last)) != std::string::npos, "rank %d: %s", r,
          st.message.c_str());
    Op b;
    b.name = "st.nbr";
    b.x = Data(r, 1, 3);
    b.recv = b.send = Ring(r, n);
    const bool needs_last = std::count(b.recv.begin(), b.recv.end(), last) > 0;
    b.Enqueue(rt);
    st = b.Wait(rt);
    if (needs_last)
      CHECK(!st.ok() && st.message.find("stalled") != std::string::npos &&
                st.message.find("ranks " + std::to_string(last)) != std::string::npos,
            "rank %d: %s", r, st.message.c_str());
    else
      CHECK(st.ok(), "rank %d: %s", r, st.message.c_str());
  });
}

// A rank dies (its messages vanish) right after submitting: each neighbour either got
// its data before (exact result) or ends in an error naming it; none hangs.
static void TestDeadPeer(int n, int delay_us) {
  g_case = "dead peer n=" + std::to_string(n);
  Op left;  // the dead rank's op: its memory stays until its runtime stops (after the job)
  Job job(n, StallConfig(8 << 20), 11, delay_us);
  const int dead = n - 1;
  for (int round = 0; round < 2; ++round) {
    job.Run([&](int r, Runtime& rt) {
      Op mine;
      Op& a = r == dead && round == 1 ? left : mine;
      a.name = "dp";
      a.x = Data(r, round, 1000);
      a.recv = a.send = Ring(r, n);
      a.Enqueue(rt);
      if (r == dead && round == 1) {
        job.world->Kill(dead);
        return;
      }
      Status st = a.Wait(rt);
      if (round == 0 || std::count(a.recv.begin(), a.recv.end(), dead) == 0) {
        CHECK(st.ok(), "rank %d round %d: %s", r, round, st.message.c_str());
        return;
      }
      if (st.ok()) {
        double sum = a.x[5];
        for (int src : a.recv) sum += Data(src, round, 1000)[5];
        CHECK(a.out[5] == sum / static_cast<double>(a.recv.size() + 1), "rank %d: wrong data", r);
      } else {
        CHECK(st.message.find("ranks " + std::to_string(dead)) != std::string::npos, "rank %d: %s", r,
              st.message.c_str());
      }
    });
  }
}

// The one-peer exponential schedule with dynamic weights (0.5 self, 0.5 from the peer):
// after log2(n) steps of one op name every rank holds the exact average (Ying et al. 2021).
static void TestDynamicWeights(int n) {
  g_case = "dynamic weights n=" + std::to_string(n);
  Job job(n, TestConfig(8 << 20), 13, 100);
  job.Run([&](int r, Runtime& rt) {
    std::vector<double> x = Data(r, 0, 9);
    for (int step = 0; (1 << step) < n; ++step) {
      Op a;
      a.name = "dyn";
      a.x = x;
      a.send = {(r + (1 << step)) % n};
      a.recv = {(r - (1 << step) + n) % n};
      a.uniform = false;
      a.self_w = 0.5;
      a.recv_w = {0.5};
      a.send_w = {1.0};
      a.Enqueue(rt);
      Status st = a.Wait(rt);
      CHECK(st.ok(), "rank %d step %d: %s", r, step, st.message.c_str());
      x = a.out;
    }
    bool exact = true;
    for (size_t i = 0; i < x.size(); ++i) {
      double mean = 0;
      for (int q = 0; q < n; ++q) mean += Data(q, 0, 9)[i];
      exact = exact && x[i] == mean / n;
    }
    CHECK(exact, "rank %d: not the exact average after the schedule", r);
  });
}

// A checked one-peer schedule (the default enable_topo_check): checked by the coordinator
// until a round in which every rank's pattern was checked before (step tau), then no
// coordinator round. Then rank 1 runs one step ahead of its schedule: the ranks whose
// sender sends elsewhere fail with a NeighborPatternError, all with the same message
// (one rank's dispute, through the coordinator), and the others complete exactly.
static void TestCheckedSchedule(int n) {
  g_case = "checked one-peer schedule n=" + std::to_string(n);
  int tau = 0;
  while ((1 << tau) < n) ++tau;
  const int steps = 3 * tau + 1;  // + the step rank 1 runs ahead
  std::mutex mu;
  std::vector<std::string> errors(n);
  auto shift = [&](int r, int t) { return 1 << ((t + (r == 1 && t == steps - 1 ? 1 : 0)) % tau); };
  Job job(n, NoStallConfig(8 << 20), 29, 100);
  job.Run([&](int r, Runtime& rt) {
    int64_t rounds = 0;
    for (int t = 0; t < steps; ++t) {
      Op a;
      a.name = "checked";
      a.x = Data(r, t, 5);
      a.topo_check = true;
      a.send = {(r + shift(r, t)) % n};
      a.recv = {(r - shift(r, t) + n) % n};
      a.Enqueue(rt);
      Status st = a.Wait(rt);
      if (t == tau + 1) rounds = rt.stats().coordinator_rounds;
      if (t == steps - 2)
        CHECK(rt.stats().coordinator_rounds == rounds, "rank %d: %lld coordinator rounds after the schedule was trusted",
              r, static_cast<long long>(rt.stats().coordinator_rounds - rounds));
      if (t < steps - 1) {
        CHECK(st.ok(), "rank %d step %d: %s", r, t, st.message.c_str());
        continue;
      }
      const int src = a.recv[0];
      const bool fed = (src + shift(src, t)) % n == r;  // its sender sends to it
      if (st.ok()) {
        CHECK(fed, "rank %d: completed without its sender's data", r);
        const std::vector<double> mine = Data(r, t, 5), theirs = Data(src, t, 5);
        for (size_t i = 0; i < mine.size(); ++i)
          CHECK(a.out[i] == (mine[i] + theirs[i]) / 2, "rank %d: element %zu is %g", r, i, a.out[i]);
        continue;
      }
      CHECK(st.code == SHOAL_NEIGHBOR_MISMATCH, "rank %d: %s (code %d)", r, st.message.c_str(), st.code);
      std::lock_guard<std::mutex> lock(mu);
      errors[r] = st.message;
    }
  });
  std::string first;
  for (int r = 0; r < n; ++r) {
    if (errors[r].empty()) continue;
    if (first.empty()) first = errors[r];
    CHECK(errors[r] == first, "rank %d's error differs: '%s' / '%s'", r, errors[r].c_str(), first.c_str());
  }
  CHECK(n <= 2 || first.find("send and receive ranks disagree") != std::string::npos, "error: '%s'", first.c_str());
}

// Allreduces that repeat run cached (negotiation/response_cache.cc): ranks submit six named ops in
// their own random orders and wait in others, five times. Every sum is exact, and once
// the batches are cached (the third time) no rank asks the coordinator again.
static void TestCachedAllreduce(int n, int64_t fusion) {
  g_case = "cached allreduce n=" + std::to_string(n) + " fusion=" + std::to_string(fusion);
  Job job(n, NoStallConfig(fusion), 17 + n, 100);
  const int k_ops = 6;
  for (int round = 0; round < 5; ++round) {
    job.Run([&](int r, Runtime& rt) {
      std::vector<Op> ops(k_ops);
      std::vector<int> order(k_ops);
      for (int k = 0; k < k_ops; ++k) order[k] = k;
      std::mt19937 rng(r * 17 + round);
      std::shuffle(order.begin(), order.end(), rng);
      const int64_t rounds_before = rt.stats().coordinator_rounds;
      for (int k : order) {
        ops[k].name = "ca." + std::to_string(k);
        ops[k].op = SHOAL_OP_ALLREDUCE;
        ops[k].x = Data(r, k + round, 1 + 5 * k);
        ops[k].Enqueue(rt);
      }
      std::shuffle(order.begin(), order.end(), rng);
      for (int k : order) {
        Status st = ops[k].Wait(rt);
        CHECK(st.ok(), "rank %d round %d op %d: %s", r, round, k, st.message.c_str());
        bool exact = st.ok();
        for (size_t i = 0; exact && i < ops[k].x.size(); ++i) {
          double sum = 0;
          for (int q = 0; q < n; ++q) sum += Data(q, k + round, ops[k].x.size())[i];
          exact = ops[k].out[i] == sum;
        }
        CHECK(exact, "rank %d round %d op %d: not the sum", r, round, k);
      }
      if (round >= 3)
        CHECK(rt.stats().coordinator_rounds == rounds_before, "rank %d round %d asked the coordinator", r, round);
    });
  }
}

// A cached allreduce gone wrong: another shape on one rank (the same mismatch error on
// every rank), a rank that never submits it (a stall error, not a hang), a rank that
// leaves instead (an error naming it).
static void TestCachedFailures(int n) {
  g_case = "cached failures n=" + std::to_string(n);
  Job job(n, StallConfig(8 << 20), 19, 50);
  const int last = n - 1;
  auto warm = [&](const std::string& name) {
    for (int round = 0; round < 3; ++round)
      job.Run([&](int r, Runtime& rt) {
        Op a;
        a.name = name;
        a.op = SHOAL_OP_ALLREDUCE;
        a.x = Data(r, round, 4);
        a.Enqueue(rt);
        CHECK(a.Wait(rt).ok(), "rank %d: warm-up of %s failed", r, name.c_str());
      });
  };
  warm("cf.shape");
  std::vector<std::string> errors(n);
  job.Run([&](int r, Runtime& rt) {
    Op a;
    a.name = "cf.shape";
    a.op = SHOAL_OP_ALLREDUCE;
    a.x = Data(r, 0, r == last ? 5 : 4);
    a.Enqueue(rt);
    Status st = a.Wait(rt);
    CHECK(st.code == SHOAL_MISMATCH && st.message.find("mismatched shapes") != std::string::npos, "rank %d: %s", r,
          st.message.c_str());
    errors[r] = st.message;
  });
  for (int r = 1; r < n; ++r) CHECK(errors[r] == errors[0], "rank %d: %s vs %s", r, errors[r].c_str(), errors[0].c_str());
  warm("cf.stall");
  job.Run([&](int r, Runtime& rt) {
    if (r == last) return;
    Op a;
    a.name = "cf.stall";
    a.op = SHOAL_OP_ALLREDUCE;
    a.x = Data(r, 0, 4);
    a.Enqueue(rt);
    Status st = a.Wait(rt);
    CHECK(!st.ok() && st.message.find("stalled") != std::string::npos &&
              st.message.find("missing ranks " + std::to_string(last)) != std::string::npos,
          "rank %d: %s", r, st.message.c_str());
  });
  // Rank 0 comes with another shape (the batch is doomed) and the last rank never comes:
  // the ops waiting behind the dying batch still end in a stall error naming it.
  warm("cf.dying");
  job.Run([&](int r, Runtime& rt) {
    if (r == last) return;
    Op a;
    a.name = "cf.dying";
    a.op = SHOAL_OP_ALLREDUCE;
    a.x = Data(r, 0, r == 0 ? 5 : 4);
    a.Enqueue(rt);
    Status st = a.Wait(rt);
    CHECK(!st.ok() && st.message.find("missing ranks " + std::to_string(last)) != std::string::npos,
          "rank %d: %s", r, st.message.c_str());
  });
  // Refused at the call on rank 0; the last rank submits only after it has heard of it.
  warm("cf.refused");
  job.Run([&](int r, Runtime& rt) {
    if (r == 0) return rt.Reject(SHOAL_OP_ALLREDUCE, "cf.refused", SHOAL_INVALID_ARGUMENT, "bad argument here");
    if (r == last) std::this_thread::sleep_for(std::chrono::milliseconds(200));
    Op a;
    a.name = "cf.refused";
    a.op = SHOAL_OP_ALLREDUCE;
    a.x = Data(r, 0, 4);
    a.Enqueue(rt);
    Status st = a.Wait(rt);
    CHECK(st.code == SHOAL_INVALID_ARGUMENT && st.message.find("bad argument here") != std::string::npos,
          "rank %d: %s", r, st.message.c_str());
  });
  // Refused on every rank, rank 0 last (the others already wait in the name's next step
  // when its refusal comes): that next step runs, with every rank.
  job.Run([&](int r, Runtime& rt) {
    if (r == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    rt.Reject(SHOAL_OP_ALLREDUCE, "cf.all_refused", SHOAL_INVALID_ARGUMENT, "bad argument everywhere");
    Op a;
    a.name = "cf.all_refused";
    a.op = SHOAL_OP_ALLREDUCE;
    a.x = Data(r, 0, 4);
    a.Enqueue(rt);
    Status st = a.Wait(rt);
    CHECK(st.ok(), "rank %d: %s", r, st.message.c_str());
    std::vector<double> want(4, 0.0);
    for (int q = 0; q < n; ++q)
      for (size_t i = 0; i < 4; ++i) want[i] += Data(q, 0, 4)[i];
    CHECK(a.out == want, "rank %d: wrong sum after a refusal on every rank", r);
  });
  warm("cf.leave");
  job.Run([&](int r, Runtime& rt) {
    if (r == last) return rt.Leave();
    Op a;
    a.name = "cf.leave";
    a.op = SHOAL_OP_ALLREDUCE;
    a.x = Data(r, 0, 4);
    a.Enqueue(rt);
    Status st = a.Wait(rt);
    CHECK(!st.ok() && st.message.find("rank " + std::to_string(last) + " left") != std::string::npos, "rank %d: %s", r,
          st.message.c_str());
  });
}

// Allreduce with every reduce op over int8, int32, float16 and float64, all in flight at
// once (fused or not): exact element-wise results (int8 products wrap, float16 computes in
// float32), batches never mix ops. Then ranks that disagree on the op all get one error
// naming both, and bad ops are refused at the call.
static void TestReduceOps(int n, int64_t fusion) {
  g_case = "reduce ops n=" + std::to_string(n) + " fusion=" + std::to_string(fusion);
  Job job(n, TestConfig(fusion), 11 + n, 100);
  const int rops[] = {SHOAL_REDUCE_SUM, SHOAL_REDUCE_MIN, SHOAL_REDUCE_MAX, SHOAL_REDUCE_PRODUCT};
  const int dtypes[] = {SHOAL_INT8, SHOAL_INT32, SHOAL_FLOAT16, SHOAL_FLOAT64};
  auto value = [](int r, size_t i) { return static_cast<int>(i % 3) - 1 + r % 2 + (i == 5 ? r : 0); };
  // Stored as `dtype` (float16 bits for halves), read back as double.
  auto put = [](int dtype, char* p, double v) {
    switch (dtype) {
      case SHOAL_INT8: { int8_t x = static_cast<int8_t>(static_cast<int64_t>(v)); std::memcpy(p, &x, 1); break; }
      case SHOAL_INT32: { int32_t x = static_cast<int32_t>(v); std::memcpy(p, &x, 4); break; }
      case SHOAL_FLOAT16: { uint16_t x = FloatToHalf(static_cast<float>(v)); std::memcpy(p, &x, 2); break; }
      default: std::memcpy(p, &v, 8);
    }
  };
  job.Run([&](int r, Runtime& rt) {
    const size_t len = 6;
    struct T { std::vector<char> in, out, want; int64_t handle = 0; int rop = 0, dtype = 0; };
    std::vector<T> ts;
    std::vector<int64_t> shape = {static_cast<int64_t>(len)};
    for (int rop : rops)
      for (int dtype : dtypes) {
        T t;
        t.rop = rop;
        t.dtype = dtype;
        const size_t es = DtypeSize(dtype);
        t.in.resize(len * es);
        t.out.resize(len * es);
        t.want.resize(len * es);
        for (size_t i = 0; i < len; ++i) {
          put(dtype, &t.in[i * es], value(r, i));
          double acc = value(0, i);  // exact in double: |values| <= 8, products <= 2^24
          for (int q = 1; q < n; ++q) {
            const double v = value(q, i);
            acc = rop == SHOAL_REDUCE_SUM ? acc + v : rop == SHOAL_REDUCE_MIN ? std::min(acc, v)
                  : rop == SHOAL_REDUCE_MAX ? std::max(acc, v) : acc * v;
          }
          put(dtype, &t.want[i * es], acc);
        }
        ts.push_back(std::move(t));
      }
    for (auto& t : ts) {
      shoal_op_desc d{};
      d.op = SHOAL_OP_ALLREDUCE;
      const std::string name = "rop." + std::to_string(t.rop) + "." + std::to_string(t.dtype);
      d.name = name.c_str();
      d.input = {t.in.data(), t.dtype, 1, shape.data(), SHOAL_DEVICE_CPU, 0, nullptr, nullptr};
      d.output = d.input;
      d.output.data = t.out.data();
      d.reduce_op = t.rop;
      t.handle = rt.Enqueue(d);
    }
    for (auto& t : ts) {
      Status st = rt.Wait(t.handle);
      rt.submissions().Release(t.handle);
      CHECK(st.ok() && t.out == t.want, "rank %d op %s dtype %s: %s", r, ReduceOpName(t.rop), DtypeName(t.dtype),
            st.message.c_str());
    }
    // Rank 0 asks for Min, the others for Max: the same error everywhere.
    Op a;
    a.name = "rop.mismatch";
    a.op = SHOAL_OP_ALLREDUCE;
    a.x = Data(r, 0, 3);
    a.reduce_op = r == 0 ? SHOAL_REDUCE_MIN : SHOAL_REDUCE_MAX;
    a.Enqueue(rt);
    Status st = a.Wait(rt);
    CHECK(st.code == SHOAL_MISMATCH && st.message.find("mismatched reduce ops across ranks: op=Min on rank 0; op=Max on rank") !=
                                           std::string::npos,
          "rank %d: %s", r, st.message.c_str());
    a.reduce_op = SHOAL_REDUCE_MAX;  // the name is usable again
    a.Enqueue(rt);
    st = a.Wait(rt);
    CHECK(st.ok() && a.out[0] == Data(n - 1, 0, 3)[0], "rank %d: %s", r, st.message.c_str());
    for (int bad : {-1, 5}) {
      Op b;
      b.name = "rop.bad";
      b.op = SHOAL_OP_ALLREDUCE;
      b.x = {1.0};
      b.reduce_op = bad;
      std::string msg;
      try { b.Enqueue(rt); } catch (const ArgumentError& ex) { msg = ex.what(); }
      CHECK(msg.find("unknown reduce op code " + std::to_string(bad)) != std::string::npos, "rank %d: %s", r,
            msg.c_str());
    }
  });
}

// Reducescatter of [d0, 2] float64 (Sum and Average), float16 and int32 (Sum) tensors,
// d0 even, uneven, smaller than the number of ranks and 0: rank r gets its rows of the
// exact reduction (Horovod's split); mismatched shapes fail on every rank.
static void TestReduceScatter(int n) {
  g_case = "reducescatter n=" + std::to_string(n);
  Job job(n, TestConfig(8 << 20), 13 + n, 100);
  job.Run([&](int r, Runtime& rt) {
    int k = 0;
    for (int64_t d0 : {int64_t(2 * n), int64_t(2 * n + n - 1), int64_t(1), int64_t(0)})
      for (int dtype : {SHOAL_FLOAT64, SHOAL_FLOAT16, SHOAL_INT32})
        for (int rop : {SHOAL_REDUCE_SUM, SHOAL_REDUCE_AVERAGE}) {
          if (rop == SHOAL_REDUCE_AVERAGE && dtype != SHOAL_FLOAT64) continue;
          const size_t es = DtypeSize(dtype), len = static_cast<size_t>(d0) * 2;
          auto at = [&](int q, size_t i) { return static_cast<double>(q + 1) * static_cast<double>(i % 5); };
          std::vector<char> in(std::max<size_t>(len * es, 1));
          for (size_t i = 0; i < len; ++i) {
            if (dtype == SHOAL_FLOAT64) { double v = at(r, i); std::memcpy(&in[i * es], &v, 8); }
            if (dtype == SHOAL_INT32) { int32_t v = static_cast<int32_t>(at(r, i)); std::memcpy(&in[i * es], &v, 4); }
            if (dtype == SHOAL_FLOAT16) { uint16_t v = FloatToHalf(static_cast<float>(at(r, i))); std::memcpy(&in[i * es], &v, 2); }
          }
          std::vector<int64_t> shape = {d0, 2};
          shoal_op_desc d{};
          d.op = SHOAL_OP_REDUCESCATTER;
          const std::string name = "rs." + std::to_string(k++);
          d.name = name.c_str();
          d.input = {in.data(), dtype, 2, shape.data(), SHOAL_DEVICE_CPU, 0, nullptr, nullptr};
          d.reduce_op = rop;
          const int64_t h = rt.Enqueue(d);
          Status st = rt.Wait(h);
          EntryPtr e = rt.submissions().Find(h);
          const int64_t rows = d0 / n + (r < d0 % n ? 1 : 0), first = r * (d0 / n) + std::min<int64_t>(r, d0 % n);
          bool same = st.ok() && e->result_shape == std::vector<int64_t>({rows, 2}) &&
                      e->result_nbytes == static_cast<size_t>(rows * 2) * es;
          for (int64_t i = 0; same && i < rows * 2; ++i) {
            double want = 0, got = 0;
            for (int q = 0; q < n; ++q) want += at(q, first * 2 + i);
            if (rop == SHOAL_REDUCE_AVERAGE) want /= n;
            const char* p = static_cast<const char*>(e->result) + i * es;
            if (dtype == SHOAL_FLOAT64) std::memcpy(&got, p, 8);
            if (dtype == SHOAL_INT32) { int32_t v; std::memcpy(&v, p, 4); got = v; }
            if (dtype == SHOAL_FLOAT16) { uint16_t v; std::memcpy(&v, p, 2); got = HalfToFloat(v); }
            same = got == want;
          }
          rt.submissions().Release(h);
          CHECK(same, "rank %d d0 %lld %s %s: %s", r, static_cast<long long>(d0), DtypeName(dtype), ReduceOpName(rop),
                st.message.c_str());
        }
    Op a;
    a.name = "rs.mismatch";
    a.op = SHOAL_OP_REDUCESCATTER;
    a.x = Data(r, 0, r == 0 ? 4 : 6);
    a.Enqueue(rt);
    Status st = a.Wait(rt);
    CHECK(st.code == SHOAL_MISMATCH && st.message.find("reducescatter 'rs.mismatch': mismatched shapes across ranks: "
                                                       "[4] on rank 0; [6] on rank") != std::string::npos,
          "rank %d: %s", r, st.message.c_str());
  });
}

int main() {
  for (int n : {2, 4, 8}) {
    TestNeighborOrders(n, 8 << 20, 200);  // fused
    TestNeighborOrders(n, 0, 200);        // one message per tensor
    TestMismatch(n);
    TestStall(n);
    TestDeadPeer(n, 300);
    TestDynamicWeights(n);
    TestCheckedSchedule(n);
    TestCachedAllreduce(n, 8 << 20);
    TestCachedAllreduce(n, 0);
    TestCachedFailures(n);
    TestReduceOps(n, 8 << 20);
    TestReduceOps(n, 0);
    TestReduceScatter(n);
  }
  std::printf("%d passed, %d failed\n", g_passed.load(), g_failed.load());
  return g_failed ? 1 : 0;
}
