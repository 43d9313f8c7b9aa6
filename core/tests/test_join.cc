// Unit tests of Horovod's join in the Runtime (ops/join.cc) with N ranks as threads over
// the fake backend (fake_backend.h), at 2, 4 and 8 ranks: uneven steps per rank with the
// joined ranks contributing zeros to fused and cached allreduces, the last rank to join
// returned everywhere, a second join in the same job, the ops that fail while ranks are
// joined, a joined rank that is not stalled, an op still in a cached batch at join, a
// rank that leaves instead of joining, and the identities joined ranks add to Min, Max and
// Product allreduces (and zeros to reducescatters). tests/test_core_cpp.py also runs it under
// ThreadSanitizer. Exit status 0 = all passed.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "testing/runtime_harness.h"
#include "runtime/runtime.h"

using namespace shoal;

using namespace shoal::testing;

// The harness's op, an allreduce unless set otherwise.
struct AllreduceOp : Op {
  AllreduceOp() { op = SHOAL_OP_ALLREDUCE; }
};

// Joins, returns the last rank to join (-1 on failure, with the error in *st).
static int RunJoin(Runtime& rt, Status* st) {
  shoal_op_desc d{};
  d.op = kOpJoin;
  const int64_t h = rt.Enqueue(d);
  *st = rt.Wait(h);
  int32_t last = -1;
  EntryPtr e = rt.submissions().Find(h);
  if (st->ok() && e && e->result_nbytes == sizeof(last)) std::memcpy(&last, e->result, sizeof(last));
  rt.submissions().Release(h);
  return last;
}

// Returns once every other rank has joined (its join reached the coordinator): an
// allreduce only this rank submits completes only then, joined ranks adding zeros. An
// ordering, not a sleep, makes the caller the last to join on loaded cores.
static void AwaitOthersJoined(Runtime& rt, int r, const std::string& name) {
  AllreduceOp probe;
  probe.name = name;
  probe.x = {1.0};
  probe.Enqueue(rt);
  Status st = probe.Wait(rt);
  CHECK(st.ok() && probe.out[0] == 1.0, "rank %d: %s: %s", r, name.c_str(), st.message.c_str());
}

// Rank r runs steps[r] steps of three allreduces (two Sum, one of them unnamed, one Average;
// fused when fusion > 0, cached after their second step), then joins. Every result is exact: at step s the sum over
// the ranks still running (the joined ones add zeros), the average that sum / n (Horovod's
// divisor). Join returns the rank with the most steps on every rank. Then a full epoch runs
// normally, and a second join in which rank 0 alone runs on (and joins last).
static void TestUneven(int n, int64_t fusion) {
  g_case = "uneven n=" + std::to_string(n) + " fusion=" + std::to_string(fusion);
  Job job(n, TestConfig(fusion), 23 + n);
  auto steps = [n](int r) { return 4 + 2 * ((r + 1) % n); };  // the most: rank n - 2 (0 at n = 2)
  const int last = n == 2 ? 0 : n - 2;
  auto epoch = [&](int r, Runtime& rt, int first, int count, const std::function<bool(int, int)>& running) {
    for (int s = first; s < first + count; ++s) {
      std::vector<AllreduceOp> ops(3);
      std::vector<int> order = {0, 1, 2};
      std::mt19937 rng(r * 7 + s);
      std::shuffle(order.begin(), order.end(), rng);
      for (int k : order) {
        ops[k].name = k == 1 ? "" : "ue." + std::to_string(k);  // one unnamed: its generated names stay aligned
        ops[k].reduce_op = k == 2 ? SHOAL_REDUCE_AVERAGE : SHOAL_REDUCE_SUM;
        ops[k].x = Data(r, s + k, 2 + 3 * k);
        ops[k].Enqueue(rt);
      }
      std::shuffle(order.begin(), order.end(), rng);
      for (int k : order) {
        Status st = ops[k].Wait(rt);
        CHECK(st.ok(), "rank %d step %d op %d: %s", r, s, k, st.message.c_str());
        bool exact = st.ok();
        for (size_t i = 0; exact && i < ops[k].x.size(); ++i) {
          double sum = 0;
          for (int q = 0; q < n; ++q)
            if (running(q, s)) sum += Data(q, s + k, ops[k].x.size())[i];
          exact = ops[k].out[i] == (k == 2 ? sum / n : sum);
        }
        CHECK(exact, "rank %d step %d op %d: not the sum over the ranks still running (%g)", r, s, k, ops[k].out[0]);
      }
    }
  };
  job.Run([&](int r, Runtime& rt) {
    epoch(r, rt, 0, steps(r), [&](int q, int s) { return s < steps(q); });
    CHECK(rt.stats().cache_hits > 0, "rank %d: no batch ran cached before the joins", r);
    Status st;
    const int got = RunJoin(rt, &st);
    CHECK(st.ok() && got == last, "rank %d: join returned %d (%s), want %d", r, got, st.message.c_str(), last);
    epoch(r, rt, 100, 3, [](int, int) { return true; });  // back to normal
    if (r == 0) epoch(r, rt, 200, 3, [](int q, int) { return q == 0; });
    const int again = RunJoin(rt, &st);
    CHECK(st.ok() && again == 0, "rank %d: second join returned %d (%s)", r, again, st.message.c_str());
  });
}

// Fresh names past a name limit of 16 while ranks join one after another (rank r after
// 20 + 8r steps; no name is retired while a rank is joined), then 40 more steps on every
// rank: exact sums over the ranks still running, and as many names retired on every rank.
static void TestFreshNames(int n) {
  g_case = "fresh names and join n=" + std::to_string(n);
  Config cfg = TestConfig(8 << 20);
  cfg.name_limit = 16;
  Job job(n, cfg, 43 + n);
  auto steps = [](int r) { return 20 + 8 * r; };
  std::vector<int64_t> retired(n);
  job.Run([&](int r, Runtime& rt) {
    auto run = [&](int s, const std::function<bool(int)>& running) {
      AllreduceOp op;
      op.name = "j." + std::to_string(s);
      op.x = Data(r, s, 3);
      op.Enqueue(rt);
      Status st = op.Wait(rt);
      std::vector<double> want(3, 0.0);
      for (int q = 0; q < n; ++q)
        if (running(q))
          for (size_t i = 0; i < 3; ++i) want[i] += Data(q, s, 3)[i];
      CHECK(st.ok() && op.out == want, "rank %d step %d: %s", r, s, st.message.c_str());
    };
    for (int s = 0; s < steps(r); ++s) run(s, [&](int q) { return s < steps(q); });
    Status st;
    CHECK(RunJoin(rt, &st) == n - 1 && st.ok(), "rank %d: join: %s", r, st.message.c_str());
    for (int s = 1000; s < 1040; ++s) run(s, [](int) { return true; });
    CHECK(job.Settle([&] { return RetiredAlike(job); }), "rank %d: the ranks' retired names never agreed", r);
    retired[r] = rt.stats().names_retired;
  });
  for (int r = 0; r < n; ++r)
    CHECK(retired[r] > 0 && retired[r] == retired[0], "rank %d retired %lld names, rank 0 %lld", r,
          static_cast<long long>(retired[r]), static_cast<long long>(retired[0]));
}

// While ranks [n/2, n) are joined: broadcast and allgather fail with the same error on every
// rank still running, naming the joined ranks (as in Horovod); neighbor ops with a joined
// peer fail naming it; the running ranks' disagreeing shapes are a mismatch as usual; a
// barrier runs; a joined rank gets no new ops. Then rank 0 runs alone past the stall
// shutdown time (the joined ranks wait, not stalled), runs an allreduce and joins last.
static void TestWhileJoined(int n) {
  g_case = "while joined n=" + std::to_string(n);
  Job job(n, TestConfig(8 << 20), 29 + n);
  const int half = n / 2;
  auto pair = [&](int r) { return r < half ? r + half : r - half; };
  job.Run([&](int r, Runtime& rt) {  // negotiate a neighbor name while every rank runs
    AllreduceOp a;
    a.name = "wj.nbr";
    a.op = SHOAL_OP_NEIGHBOR_ALLREDUCE;
    a.x = Data(r, 0, 3);
    a.recv = a.send = {pair(r)};
    a.Enqueue(rt);
    CHECK(a.Wait(rt).ok(), "rank %d: warm-up failed", r);
  });
  std::vector<std::string> bcast(half), gather(half);
  job.Run([&](int r, Runtime& rt) {
    Status st;
    if (r >= half) {
      shoal_op_desc d{};
      d.op = kOpJoin;
      const int64_t h = rt.Enqueue(d);
      bool refused = false;
      AllreduceOp late;
      late.name = "wj.late";
      late.x = Data(r, 0, 2);
      try {
        late.Enqueue(rt);
      } catch (const ArgumentError& ex) {
        refused = std::string(ex.what()).find("called join()") != std::string::npos;
      }
      CHECK(refused, "rank %d: an op during its join was not refused", r);
      st = rt.Wait(h);
      int32_t got = -1;
      if (EntryPtr e = rt.submissions().Find(h)) std::memcpy(&got, e->result, sizeof(got));
      rt.submissions().Release(h);
      CHECK(st.ok() && got == 0, "rank %d: join returned %d (%s)", r, got, st.message.c_str());
      return;
    }
    auto run = [&](Op& a) {
      a.x = Data(r, 1, a.x.empty() ? 4 : a.x.size());
      a.Enqueue(rt);
      return a.Wait(rt);
    };
    AllreduceOp b;
    b.name = "wj.bcast";
    b.op = SHOAL_OP_BROADCAST;
    st = run(b);
    const std::string joined = half == 1 ? "rank 1 has joined" : "ranks " + std::to_string(half);
    CHECK(st.code == SHOAL_MISMATCH && st.message.find(joined) != std::string::npos, "rank %d: %s", r,
          st.message.c_str());
    bcast[r] = st.message;
    AllreduceOp g;
    g.name = "wj.gather";
    g.op = SHOAL_OP_ALLGATHER;
    st = run(g);
    CHECK(st.code == SHOAL_MISMATCH && st.message.find(joined) != std::string::npos, "rank %d: %s", r,
          st.message.c_str());
    gather[r] = st.message;
    for (const char* name : {"wj.nbr", "wj.nbr2"}) {  // negotiated, and a first call
      AllreduceOp nb;
      nb.name = name;
      nb.op = SHOAL_OP_NEIGHBOR_ALLREDUCE;
      nb.recv = nb.send = {pair(r)};
      st = run(nb);
      CHECK(!st.ok() && st.message.find(std::to_string(pair(r)) + " joined") != std::string::npos, "rank %d %s: %s",
            r, name, st.message.c_str());
    }
    if (half > 1) {
      AllreduceOp m;
      m.name = "wj.shape";
      m.x.resize(r == 0 ? 3 : 4);
      st = run(m);
      CHECK(st.code == SHOAL_MISMATCH && st.message.find("mismatched shapes") != std::string::npos, "rank %d: %s", r,
            st.message.c_str());
    }
    AllreduceOp barrier;
    barrier.name = "wj.barrier";
    barrier.op = SHOAL_OP_BARRIER;
    st = run(barrier);
    CHECK(st.ok(), "rank %d: barrier: %s", r, st.message.c_str());
    if (r == 0) {  // past the stall shutdown time, while every other rank is joined
      std::this_thread::sleep_for(std::chrono::milliseconds(1300));
      AllreduceOp a;  // a signature nobody else submits: the joined ranks run it on zeros
      a.name = "wj.sum";
      a.x.resize(5);
      st = run(a);
      bool exact = st.ok();
      for (size_t i = 0; exact && i < a.x.size(); ++i) exact = a.out[i] == a.x[i];
      CHECK(exact, "rank %d: %s", r, st.ok() ? "not its own values" : st.message.c_str());
    }
    const int got = RunJoin(rt, &st);
    CHECK(st.ok() && got == 0, "rank %d: join returned %d (%s)", r, got, st.message.c_str());
  });
  for (int r = 1; r < half; ++r) {
    CHECK(bcast[r] == bcast[0], "rank %d: %s vs %s", r, bcast[r].c_str(), bcast[0].c_str());
    CHECK(gather[r] == gather[0], "rank %d: %s vs %s", r, gather[r].c_str(), gather[0].c_str());
  }
}

// The last rank submits a cached allreduce and joins without waiting for it: its data
// still counts (its request reaches the coordinator before its join), while the others'
// next, uncached op gets its zeros. Then a rank leaves instead of joining: every joined
// rank's join fails naming it.
static void TestCachedAndLeave(int n) {
  g_case = "cached and leave n=" + std::to_string(n);
  Job job(n, TestConfig(8 << 20), 31 + n);
  const int last = n - 1;
  for (int s = 0; s < 3; ++s)
    job.Run([&](int r, Runtime& rt) {
      AllreduceOp a;
      a.name = "cl.x";
      a.x = Data(r, s, 4);
      a.Enqueue(rt);
      CHECK(a.Wait(rt).ok(), "rank %d: warm-up failed", r);
    });
  job.Run([&](int r, Runtime& rt) {
    AllreduceOp x, y;
    x.name = "cl.x";
    x.x = Data(r, 5, 4);
    y.name = "cl.y";
    y.x = Data(r, 6, 3);
    Status st;
    if (r == last) {
      x.Enqueue(rt);
      const int got = RunJoin(rt, &st);
      CHECK(st.ok() && got == 0, "rank %d: join returned %d (%s)", r, got, st.message.c_str());
    } else {
      y.Enqueue(rt);
      st = y.Wait(rt);
      bool exact = st.ok();
      for (size_t i = 0; exact && i < 3; ++i) {
        double sum = 0;
        for (int q = 0; q < last; ++q) sum += Data(q, 6, 3)[i];
        exact = y.out[i] == sum;
      }
      CHECK(exact, "rank %d: y: %s", r, st.ok() ? "not the sum without the joined rank" : st.message.c_str());
      x.Enqueue(rt);
    }
    st = x.Wait(rt);
    bool exact = st.ok();
    for (size_t i = 0; exact && i < 4; ++i) {
      double sum = 0;
      for (int q = 0; q < n; ++q) sum += Data(q, 5, 4)[i];
      exact = x.out[i] == sum;
    }
    CHECK(exact, "rank %d: x: %s", r, st.ok() ? "not the sum over every rank" : st.message.c_str());
    if (r != last) {
      if (r == 0) AwaitOthersJoined(rt, r, "cl.others_joined");
      const int got = RunJoin(rt, &st);
      CHECK(st.ok() && got == 0, "rank %d: join returned %d (%s)", r, got, st.message.c_str());
    }
  });
  job.Run([&](int r, Runtime& rt) {
    if (r == last) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      return rt.Leave();
    }
    Status st;
    RunJoin(rt, &st);
    CHECK(!st.ok() && st.message.find("rank " + std::to_string(last) + " left") != std::string::npos, "rank %d: %s", r,
          st.message.c_str());
  });
}

// While ranks [n/2, n) are joined, the running ranks' allreduces with op=Min, Max and
// Product (of several dtypes, fused, and a grouped one) get the reduction over the running
// ranks only (a joined rank adds the identity: the dtype's largest value or +inf, its lowest
// or -inf, one), and reducescatters the sum (zeros) or sum / n (Horovod's divisor) of their
// rows; an alltoall fails with one message naming the joined ranks, as in Horovod.
static void TestIdentities(int n) {
  g_case = "identities n=" + std::to_string(n);
  Job job(n, TestConfig(8 << 20), 37 + n);
  const int half = n / 2;
  std::vector<std::string> a2a(half);
  job.Run([&](int r, Runtime& rt) {
    Status st;
    if (r >= half) {
      const int got = RunJoin(rt, &st);
      CHECK(st.ok() && got == 0, "rank %d: join returned %d (%s)", r, got, st.message.c_str());
      return;
    }
    // Values in [-2, 2], negative ones too (so Max's identity must be below them); uint8's in
    // [0, 3]. Products over up to 4 running ranks stay in range (int8: 16, uint8: 81).
    auto val = [](int q, size_t i, int k) { return static_cast<double>((q * 5 + static_cast<int>(i) * 3 + k) % 5) - 2; };
    auto uval = [&](int q, size_t i, int k) { return std::fmod(val(q, i, k) + 2, 4.0); };
    const int rops[] = {SHOAL_REDUCE_MIN, SHOAL_REDUCE_MAX, SHOAL_REDUCE_PRODUCT};
    const int dtypes[] = {SHOAL_FLOAT64, SHOAL_FLOAT32, SHOAL_FLOAT16, SHOAL_INT8, SHOAL_UINT8, SHOAL_INT32, SHOAL_INT64};
    std::vector<std::unique_ptr<TypedOp>> ops;
    std::vector<int64_t> handles;
    int k = 0;
    for (int rop : rops)
      for (int dt : dtypes) {  // all in flight at once: fused per (dtype, op)
        ops.push_back(std::make_unique<TypedOp>("id." + std::to_string(k), SHOAL_OP_ALLREDUCE, dt, std::vector<int64_t>{5}));
        ops.back()->reduce_op = rop;
        for (size_t i = 0; i < 5; ++i) PutValue(dt, ops.back()->x.data(), i, dt == SHOAL_UINT8 ? uval(r, i, k) : val(r, i, k));
        shoal_op_desc d = ops.back()->Desc();
        handles.push_back(rt.Enqueue(d));
        ++k;
      }
    for (size_t j = 0; j < ops.size(); ++j) {
      TypedOp& o = *ops[j];
      st = WaitTake(rt, handles[j]);
      bool exact = st.ok();
      for (size_t i = 0; exact && i < 5; ++i) {
        double want = o.reduce_op == SHOAL_REDUCE_PRODUCT ? 1 : o.reduce_op == SHOAL_REDUCE_MIN ? 1e9 : -1e9;
        for (int q = 0; q < half; ++q) {
          const double v = o.dtype == SHOAL_UINT8 ? uval(q, i, static_cast<int>(j)) : val(q, i, static_cast<int>(j));
          want = o.reduce_op == SHOAL_REDUCE_PRODUCT ? want * v : o.reduce_op == SHOAL_REDUCE_MIN ? std::min(want, v)
                                                                                                 : std::max(want, v);
        }
        exact = GetValue(o.dtype, o.out.data(), i) == want;
      }
      CHECK(exact, "rank %d %s %s: %s (got %g)", r, DtypeName(o.dtype), ReduceOpName(o.reduce_op),
            st.ok() ? "not the reduction over the running ranks" : st.message.c_str(), GetValue(o.dtype, o.out.data(), 0));
    }
    // A grouped allreduce (Max) with a joined rank: its members get the identity too.
    std::vector<TypedOp> g;
    g.emplace_back("", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT64, std::vector<int64_t>{3});
    g.emplace_back("", SHOAL_OP_ALLREDUCE, SHOAL_INT32, std::vector<int64_t>{2});
    std::vector<shoal_op_desc> gd;
    for (auto& o : g) {
      o.reduce_op = SHOAL_REDUCE_MAX;
      for (size_t i = 0; i < o.count(); ++i) PutValue(o.dtype, o.x.data(), i, -10.0 - r - static_cast<double>(i));
      gd.push_back(o.Desc());
    }
    std::vector<int64_t> gh = rt.EnqueueGroup("id.group", gd.data(), 2, nullptr, nullptr);
    for (size_t m = 0; m < g.size(); ++m) {
      st = WaitTake(rt, gh[m]);
      bool exact = st.ok();
      for (size_t i = 0; exact && i < g[m].count(); ++i) exact = GetValue(g[m].dtype, g[m].out.data(), i) == -10.0 - i;
      CHECK(exact, "rank %d group member %zu: %s", r, m, st.ok() ? "not the max over the running ranks" : st.message.c_str());
    }
    // Reducescatter: the joined ranks add zeros; Average still divides by n.
    for (int rop : {SHOAL_REDUCE_SUM, SHOAL_REDUCE_AVERAGE}) {
      const int64_t d0 = 2 * n + 1;
      TypedOp s("id.rs." + std::to_string(rop), SHOAL_OP_REDUCESCATTER, SHOAL_FLOAT64, {d0, 2});
      s.reduce_op = rop;
      for (size_t i = 0; i < s.count(); ++i) PutValue(SHOAL_FLOAT64, s.x.data(), i, val(r, i, 0) * 2);
      shoal_op_desc d = s.Desc();
      std::vector<char> got;
      st = WaitTake(rt, rt.Enqueue(d), &got);
      const int64_t rows = d0 / n + (r < d0 % n ? 1 : 0), first = r * (d0 / n) + std::min<int64_t>(r, d0 % n);
      bool exact = st.ok() && got.size() == static_cast<size_t>(rows * 2) * sizeof(double);
      for (int64_t i = 0; exact && i < rows * 2; ++i) {
        double want = 0;
        for (int q = 0; q < half; ++q) want += val(q, static_cast<size_t>(first * 2 + i), 0) * 2;
        if (rop == SHOAL_REDUCE_AVERAGE) want /= n;
        exact = GetValue(SHOAL_FLOAT64, got.data(), static_cast<size_t>(i)) == want;
      }
      CHECK(exact, "rank %d reducescatter %s: %s", r, ReduceOpName(rop), st.ok() ? "inexact" : st.message.c_str());
    }
    TypedOp t("id.a2a", SHOAL_OP_ALLTOALL, SHOAL_FLOAT32, {n});
    shoal_op_desc d = t.Desc();
    st = WaitTake(rt, rt.Enqueue(d));
    a2a[r] = st.message;
    const std::string joined = half == 1 ? "rank 1 has joined" : "ranks " + std::to_string(half);
    CHECK(st.code == SHOAL_MISMATCH && st.message.find(joined) != std::string::npos &&
              st.message.find("Alltoall is not supported with Join") != std::string::npos,
          "rank %d: %s", r, st.message.c_str());
    if (r == 0) {  // completes once every other rank has joined: rank 0 joins last
      TypedOp last("id.last", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT64, {1});
      d = last.Desc();
      st = WaitTake(rt, rt.Enqueue(d));
      CHECK(st.ok(), "rank 0: %s", st.message.c_str());
    }
    const int got = RunJoin(rt, &st);
    CHECK(st.ok() && got == 0, "rank %d: join returned %d (%s)", r, got, st.message.c_str());
  });
  for (int r = 1; r < half; ++r) CHECK(a2a[r] == a2a[0], "rank %d: %s vs %s", r, a2a[r].c_str(), a2a[0].c_str());
}

// Past a name limit of 16: each round, every rank runs fresh names, starts an allreduce of
// a name from a pool of 8 (it may wait for a vote that retires it) and joins at once: the
// pool op is this rank's call before the join, so it sums over every rank, exactly.
static void TestHeldThenJoin(int n) {
  g_case = "held call then join n=" + std::to_string(n);
  Config cfg = TestConfig(8 << 20);
  cfg.name_limit = 16;
  Job job(n, cfg, 71 + n);
  std::vector<int64_t> held(n);
  job.Run([&](int r, Runtime& rt) {
    std::mt19937 rng(13 * r + n);
    for (int round = 0; round < 60; ++round) {
      // Fresh names, and the pool's other names, in random order, waited for in another.
      std::vector<AllreduceOp> ops(6);
      for (int s = 0; s < 6; ++s) {
        ops[s].name = s < 4 ? "fresh." + std::to_string(round) + "." + std::to_string(s)
                            : "pool." + std::to_string((round + 3 * s) % 8);
        ops[s].x = Data(r, s, 2);
      }
      std::vector<int> order = {0, 1, 2, 3, 4, 5};
      std::shuffle(order.begin(), order.end(), rng);
      for (int i : order) ops[i].Enqueue(rt);
      std::shuffle(order.begin(), order.end(), rng);
      for (int i : order) CHECK(ops[i].Wait(rt).ok(), "rank %d round %d: %s failed", r, round, ops[i].name.c_str());
      AllreduceOp pool;
      pool.name = "pool." + std::to_string(round % 8);
      pool.x = Data(r, round, 3);
      pool.Enqueue(rt);
      Status st;
      CHECK(RunJoin(rt, &st) >= 0 && st.ok(), "rank %d round %d: join: %s", r, round, st.message.c_str());
      Status ps = pool.Wait(rt);
      std::vector<double> want(3, 0.0);
      for (int q = 0; q < n; ++q)
        for (size_t i = 0; i < 3; ++i) want[i] += Data(q, round, 3)[i];
      CHECK(ps.ok() && pool.out == want, "rank %d round %d: pool op: %s", r, round, ps.message.c_str());
    }
    held[r] = rt.stats().held_calls;
  });
  int64_t total = 0;
  for (int64_t h : held) total += h;
  std::printf("%s: %lld calls waited for a vote\n", g_case.c_str(), static_cast<long long>(total));
}

int main() {
  for (int n : {2, 4, 8}) {
    TestUneven(n, 8 << 20);  // fused
    TestUneven(n, 0);        // one allreduce per tensor
    TestWhileJoined(n);
    TestCachedAndLeave(n);
    TestIdentities(n);
    TestFreshNames(n);
    TestHeldThenJoin(n);
  }
  std::printf("%d passed, %d failed\n", g_passed.load(), g_failed.load());
  return g_failed ? 1 : 0;
}
