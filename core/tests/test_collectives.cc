// Unit tests of alltoall (ops/alltoall.cc) and of grouped ops (ops/groups.cc,
// Coordinator::ValidateGroup) in the Runtime, with N ranks as threads over the fake backend
// (fake_backend.h), at 2, 4 and 8 ranks: exact values for even, uneven and empty splits and
// several dtypes; the splits each rank receives; mismatched dtypes or trailing dimensions
// (the same error on every rank) and bad splits (refused at the call, the same error on the
// peers); grouped allreduce (fused), allgather and reducescatter with exact values and one
// negotiation per group; a group whose member mismatches, whose sizes differ across ranks,
// or that one rank refuses fails as a whole, with one error on every rank and member;
// Horovod's prescale, postscale and integer average (TestHorovodScaling).
// tests/test_core_cpp.py also runs it under ThreadSanitizer. Exit status 0 = all passed.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "runtime/runtime.h"
#include "testing/runtime_harness.h"

using namespace shoal;
using namespace shoal::testing;

namespace {

// Small integers, exact in every dtype (int8 and float16 included).
double Val(int r, int64_t row, int col) { return static_cast<double>((r * 13 + row * 3 + col) % 97); }

// Rows rank r sends to rank q under each pattern.
int64_t Split(int pattern, int r, int q, int n) {
  switch (pattern) {
    case 0: return 2;                     // even (no splits given)
    case 1: return (r + 2 * q) % 3;       // uneven, some zero
    case 2: return q == 0 ? r + 1 : 0;    // everything to rank 0
    default: return 0;                    // nothing at all
  }
  (void)n;
}

// Every rank's alltoall of [d0, 2] tensors of several dtypes under each pattern: rank r
// gets rank q's rows [sum_{k<r} s(q,k), + s(q,r)) in rank order, and the received splits.
void TestAlltoallValues(int n) {
  g_case = "alltoall values n=" + std::to_string(n);
  Job job(n, TestConfig(8 << 20), 41 + n);
  job.Run([&](int r, Runtime& rt) {
    int k = 0;
    for (int pattern : {0, 1, 2, 3})
      for (int dtype : {SHOAL_FLOAT64, SHOAL_INT8, SHOAL_FLOAT16, SHOAL_UINT8, SHOAL_INT64, SHOAL_BOOL}) {
        std::vector<int64_t> splits(n);
        int64_t d0 = 0;
        for (int q = 0; q < n; ++q) d0 += splits[q] = Split(pattern, r, q, n);
        TypedOp a("a2a." + std::to_string(k++), SHOAL_OP_ALLTOALL, dtype, {d0, 2});
        if (pattern != 0) a.splits = splits;
        for (int64_t i = 0; i < d0; ++i)
          for (int c = 0; c < 2; ++c) {
            const double v = Val(r, i, c);
            PutValue(dtype, a.x.data(), i * 2 + c, dtype == SHOAL_BOOL ? std::fmod(v, 2.0) : v);
          }
        shoal_op_desc d = a.Desc();
        std::vector<char> got;
        std::vector<int64_t> shape, recv;
        Status st = WaitTake(rt, rt.Enqueue(d), &got, &shape, &recv);
        std::vector<double> want;
        std::vector<int64_t> want_recv;
        for (int q = 0; q < n; ++q) {
          int64_t from = 0;
          for (int j = 0; j < r; ++j) from += Split(pattern, q, j, n);
          want_recv.push_back(Split(pattern, q, r, n));
          for (int64_t i = from; i < from + Split(pattern, q, r, n); ++i)
            for (int c = 0; c < 2; ++c) want.push_back(dtype == SHOAL_BOOL ? std::fmod(Val(q, i, c), 2.0) : Val(q, i, c));
        }
        const int64_t rows = static_cast<int64_t>(want.size() / 2);
        bool same = st.ok() && shape == std::vector<int64_t>({rows, 2}) && recv == want_recv &&
                    got.size() == want.size() * DtypeSize(dtype);
        for (size_t i = 0; same && i < want.size(); ++i) same = GetValue(dtype, got.data(), i) == want[i];
        CHECK(same, "rank %d pattern %d %s: %s (%zu rows of %lld)", r, pattern, DtypeName(dtype), st.message.c_str(),
              got.size() / std::max<size_t>(1, 2 * DtypeSize(dtype)), static_cast<long long>(rows));
      }
  });
}

// Mismatched trailing dimensions and dtypes fail with one message on every rank; bad splits
// are refused at the call, and the peers get the same error; a dim 0 that does not divide
// is refused everywhere. Each name runs normally afterwards.
void TestAlltoallErrors(int n) {
  g_case = "alltoall errors n=" + std::to_string(n);
  Job job(n, TestConfig(8 << 20), 43 + n);
  std::vector<std::string> trailing(n), dtypes(n), splits(n);
  job.Run([&](int r, Runtime& rt) {
    TypedOp t("a2a.trailing", SHOAL_OP_ALLTOALL, SHOAL_FLOAT32, {n, r == 0 ? 3 : 2});
    shoal_op_desc d = t.Desc();
    Status st = WaitTake(rt, rt.Enqueue(d));
    trailing[r] = st.message;
    CHECK(st.code == SHOAL_MISMATCH &&
              st.message.find("alltoall 'a2a.trailing': mismatched trailing dimensions across ranks: [3] on rank 0; "
                              "[2] on rank") != std::string::npos,
          "rank %d: %s", r, st.message.c_str());
    TypedOp u("a2a.dtype", SHOAL_OP_ALLTOALL, r == n - 1 ? SHOAL_INT32 : SHOAL_FLOAT32, {n});
    d = u.Desc();
    st = WaitTake(rt, rt.Enqueue(d));
    dtypes[r] = st.message;
    CHECK(st.code == SHOAL_MISMATCH && st.message.find("alltoall 'a2a.dtype': mismatched dtypes across ranks") !=
                                           std::string::npos && st.message.find("int32 on rank " + std::to_string(n - 1)) != std::string::npos,
          "rank %d: %s", r, st.message.c_str());
    // Rank 1's splits sum to one row more than its dim 0: refused there, the same error here.
    TypedOp b("a2a.splits", SHOAL_OP_ALLTOALL, SHOAL_FLOAT64, {n});
    b.splits.assign(n, 1);
    if (r == 1) b.splits[0] = 2;
    d = b.Desc();
    if (r == 1) {
      std::string what;
      try {
        rt.Enqueue(d);
      } catch (const ArgumentError& ex) {
        what = ex.what();
      }
      splits[r] = what;
      CHECK(what == "alltoall: splits sum to " + std::to_string(n + 1) + " rows, but dim 0 is " + std::to_string(n),
            "rank %d: %s", r, what.c_str());
    } else {
      st = WaitTake(rt, rt.Enqueue(d));
      splits[r] = st.message;
      CHECK(st.code == SHOAL_INVALID_ARGUMENT &&
                st.message == "alltoall: splits sum to " + std::to_string(n + 1) + " rows, but dim 0 is " +
                                  std::to_string(n) + " (raised at the call on rank 1)",
            "rank %d: %s", r, st.message.c_str());
    }
    // Wrong number of splits, a negative one, a dim 0 that does not divide: refused at the call.
    for (int bad = 0; bad < 3; ++bad) {
      TypedOp c("a2a.bad" + std::to_string(bad), SHOAL_OP_ALLTOALL, SHOAL_FLOAT64, {bad == 2 ? n + 1 : n});
      if (bad == 0) c.splits.assign(n + 1, 0);
      if (bad == 1) {
        c.splits.assign(n, 1);
        c.splits[0] = -1;
        c.splits[1] += 2;
      }
      d = c.Desc();
      std::string what;
      try {
        WaitTake(rt, rt.Enqueue(d));
      } catch (const ArgumentError& ex) {
        what = ex.what();
      }
      const char* want[] = {"splits for", "is outside [0, dim 0", "is not divisible by the number of ranks"};
      CHECK(what.find(want[bad]) != std::string::npos, "rank %d bad %d: %s", r, bad, what.c_str());
    }
    // The names work again.
    for (const char* name : {"a2a.trailing", "a2a.splits"}) {
      TypedOp ok(name, SHOAL_OP_ALLTOALL, SHOAL_FLOAT64, {n});
      for (int i = 0; i < n; ++i) PutValue(SHOAL_FLOAT64, ok.x.data(), i, r * 10 + i);
      d = ok.Desc();
      std::vector<char> got;
      st = WaitTake(rt, rt.Enqueue(d), &got);
      bool exact = st.ok() && got.size() == n * sizeof(double);
      for (int q = 0; exact && q < n; ++q) exact = GetValue(SHOAL_FLOAT64, got.data(), q) == q * 10 + r;
      CHECK(exact, "rank %d %s again: %s", r, name, st.message.c_str());
    }
  });
  for (int r = 1; r < n; ++r) {
    CHECK(trailing[r] == trailing[0] && dtypes[r] == dtypes[0], "rank %d saw other errors", r);
    if (r != 1) CHECK(splits[r] == splits[0], "rank %d: %s vs %s", r, splits[r].c_str(), splits[0].c_str());
  }
}

// A group's members as descs; each TypedOp outlives its op.
std::vector<int64_t> EnqueueGroup(Runtime& rt, const char* name, std::vector<TypedOp>& ops) {
  std::vector<shoal_op_desc> d;
  for (auto& o : ops) d.push_back(o.Desc());
  return rt.EnqueueGroup(name, d.data(), static_cast<int>(d.size()), nullptr, nullptr);
}

// Grouped allreduce (Sum of mixed dtypes, fused where they agree; Average; Min), allgather
// (first dims differ per rank) and reducescatter: exact values; one negotiation per group
// on the coordinator; unnamed groups and groups submitted in different orders.
void TestGroupValues(int n, int64_t fusion) {
  g_case = "group values n=" + std::to_string(n) + " fusion=" + std::to_string(fusion);
  Job job(n, TestConfig(fusion), 47 + n);
  job.Run([&](int r, Runtime& rt) {
    auto fill = [&](TypedOp& o, int k) {
      for (size_t i = 0; i < o.count(); ++i) PutValue(o.dtype, o.x.data(), i, Val(r, static_cast<int64_t>(i), k));
    };
    for (int rop : {SHOAL_REDUCE_SUM, SHOAL_REDUCE_AVERAGE, SHOAL_REDUCE_MIN}) {
      std::vector<TypedOp> ops;
      ops.emplace_back("", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT64, std::vector<int64_t>{3});
      ops.emplace_back("", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT64, std::vector<int64_t>{4, 2});
      ops.emplace_back("", SHOAL_OP_ALLREDUCE, rop == SHOAL_REDUCE_AVERAGE ? SHOAL_FLOAT32 : SHOAL_INT32,
                       std::vector<int64_t>{5});
      ops.emplace_back("", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT16, std::vector<int64_t>{2});
      ops.emplace_back("", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT64, std::vector<int64_t>{0});
      for (size_t k = 0; k < ops.size(); ++k) {
        ops[k].reduce_op = rop;
        fill(ops[k], static_cast<int>(k));
      }
      const int64_t fused = rt.stats().fused_batches, negotiations = rt.stats().negotiations;
      const std::string name = "g.ar." + std::to_string(rop);
      std::vector<int64_t> h = EnqueueGroup(rt, name.c_str(), ops);
      for (size_t k = 0; k < ops.size(); ++k) {
        Status st = WaitTake(rt, h[k]);
        bool exact = st.ok();
        for (size_t i = 0; exact && i < ops[k].count(); ++i) {
          double want = rop == SHOAL_REDUCE_MIN ? 1e9 : 0;
          for (int q = 0; q < n; ++q) {
            const double v = Val(q, static_cast<int64_t>(i), static_cast<int>(k));
            want = rop == SHOAL_REDUCE_MIN ? std::min(want, v) : want + v;
          }
          if (rop == SHOAL_REDUCE_AVERAGE) want = ops[k].dtype == SHOAL_FLOAT64 ? want / n : static_cast<float>(want) / n;
          if (ops[k].dtype == SHOAL_FLOAT16) want = HalfToFloat(FloatToHalf(static_cast<float>(want)));
          exact = GetValue(ops[k].dtype, ops[k].out.data(), i) == want;
        }
        CHECK(exact, "rank %d %s member %zu: %s", r, name.c_str(), k, st.ok() ? "inexact" : st.message.c_str());
      }
      // Members 0 and 1 (float64, adjacent) run as one fused collective.
      if (fusion > 0) CHECK(rt.stats().fused_batches > fused, "rank %d %s: not fused", r, name.c_str());
      if (r == 0)
        CHECK(rt.stats().negotiations == negotiations + 1, "rank 0 %s: %lld negotiations", name.c_str(),
              static_cast<long long>(rt.stats().negotiations - negotiations));
    }
    // Grouped allgather: first dims differ by rank; grouped reducescatter of uneven dim 0.
    std::vector<TypedOp> g;
    g.emplace_back("", SHOAL_OP_ALLGATHER, SHOAL_FLOAT32, std::vector<int64_t>{r + 1, 2});
    g.emplace_back("", SHOAL_OP_ALLGATHER, SHOAL_INT64, std::vector<int64_t>{2 - r % 2});
    for (size_t k = 0; k < g.size(); ++k) fill(g[k], static_cast<int>(k));
    std::vector<int64_t> h = EnqueueGroup(rt, "g.ag", g);
    for (size_t k = 0; k < g.size(); ++k) {
      std::vector<char> got;
      Status st = WaitTake(rt, h[k], &got);
      std::vector<double> want;
      for (int q = 0; q < n; ++q) {
        const int64_t rows = k == 0 ? q + 1 : 2 - q % 2, width = k == 0 ? 2 : 1;
        for (int64_t i = 0; i < rows * width; ++i) want.push_back(Val(q, i, static_cast<int>(k)));
      }
      bool exact = st.ok() && got.size() == want.size() * DtypeSize(g[k].dtype);
      for (size_t i = 0; exact && i < want.size(); ++i) exact = GetValue(g[k].dtype, got.data(), i) == want[i];
      CHECK(exact, "rank %d g.ag member %zu: %s", r, k, st.ok() ? "inexact" : st.message.c_str());
    }
    std::vector<TypedOp> s;
    s.emplace_back("", SHOAL_OP_REDUCESCATTER, SHOAL_FLOAT64, std::vector<int64_t>{2 * n + 1, 2});
    s.emplace_back("", SHOAL_OP_REDUCESCATTER, SHOAL_INT32, std::vector<int64_t>{n});
    for (size_t k = 0; k < s.size(); ++k) fill(s[k], static_cast<int>(k));
    h = EnqueueGroup(rt, "g.rs", s);
    for (size_t k = 0; k < s.size(); ++k) {
      std::vector<char> got;
      Status st = WaitTake(rt, h[k], &got);
      const int64_t d0 = s[k].shape[0], width = k == 0 ? 2 : 1;
      const int64_t rows = d0 / n + (r < d0 % n ? 1 : 0), first = r * (d0 / n) + std::min<int64_t>(r, d0 % n);
      bool exact = st.ok() && got.size() == static_cast<size_t>(rows * width) * DtypeSize(s[k].dtype);
      for (int64_t i = 0; exact && i < rows * width; ++i) {
        double want = 0;
        for (int q = 0; q < n; ++q) want += Val(q, first * width + i, static_cast<int>(k));
        exact = GetValue(s[k].dtype, got.data(), i) == want;
      }
      CHECK(exact, "rank %d g.rs member %zu: %s", r, k, st.ok() ? "inexact" : st.message.c_str());
    }
    // Unnamed groups pair up in order; named ones in any order (odd ranks swap them).
    for (int rep = 0; rep < 2; ++rep) {
      std::vector<TypedOp> u;
      u.emplace_back("", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT64, std::vector<int64_t>{2});
      fill(u[0], rep);
      std::vector<int64_t> hu = EnqueueGroup(rt, nullptr, u);
      Status st = WaitTake(rt, hu[0]);
      double want = 0;
      for (int q = 0; q < n; ++q) want += Val(q, 1, rep);
      CHECK(st.ok() && GetValue(SHOAL_FLOAT64, u[0].out.data(), 1) == want, "rank %d unnamed group %d: %s", r, rep,
            st.message.c_str());
    }
    std::vector<TypedOp> a, b;
    a.emplace_back("", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT64, std::vector<int64_t>{3});
    b.emplace_back("", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT64, std::vector<int64_t>{4});
    fill(a[0], 7);
    fill(b[0], 8);
    std::vector<int64_t> ha, hb;
    if (r % 2) {
      hb = EnqueueGroup(rt, "g.order.b", b);
      ha = EnqueueGroup(rt, "g.order.a", a);
    } else {
      ha = EnqueueGroup(rt, "g.order.a", a);
      hb = EnqueueGroup(rt, "g.order.b", b);
    }
    Status sa = WaitTake(rt, ha[0]), sb = WaitTake(rt, hb[0]);
    CHECK(sa.ok() && sb.ok(), "rank %d orders: %s / %s", r, sa.message.c_str(), sb.message.c_str());
  });
}

// A member that mismatches on one rank, numbers of members that differ, and a member one
// rank refuses at the call: every member fails on every rank with one message; the group's
// name (and a duplicate in flight) behave as an op's.
// Horovod's scaling (shoal_op_desc.horovod_scaling): each rank's input times its own
// prescale (0.5 or 2), the reduction, Average's division, the postscale; integers truncated
// toward zero (negative inputs included), and Average of integers allowed only with it.
// Exact in every dtype: small integers, powers of two and 1.5. Single ops (in place on the
// output), grouped ones (fused unless fusion is 0), repeated names (cached rounds) and
// reducescatter (float32 sent from a scaled copy, float16 through float32).
double ScaleVal(int r, size_t i) { return static_cast<double>((r * 7 + static_cast<int>(i) * 5) % 11) - 5; }
double Trunc(double v) { return v < 0 ? std::ceil(v) : std::floor(v); }
double Scaled(int dtype, double v, double f) { return IsFloating(dtype) ? v * f : Trunc(v * f); }

double ScaledReduction(int dtype, int rop, int n, size_t i, double post) {
  double s = 0;
  for (int q = 0; q < n; ++q) s += Scaled(dtype, ScaleVal(q, i), q % 2 ? 2.0 : 0.5);
  const int div = rop == SHOAL_REDUCE_AVERAGE ? n : 1;
  if (IsFloating(dtype)) return s / div * post;
  if (post == 1.0) return static_cast<double>(static_cast<int64_t>(s) / div);
  return Trunc(s * (post / div));
}

void TestHorovodScaling(int n, int64_t fusion) {
  g_case = "horovod scaling n=" + std::to_string(n) + " fusion=" + std::to_string(fusion);
  Job job(n, TestConfig(fusion), 59 + n);
  const std::vector<int> dtypes = {SHOAL_FLOAT64, SHOAL_FLOAT32, SHOAL_FLOAT16, SHOAL_INT32, SHOAL_INT8, SHOAL_INT64};
  job.Run([&](int r, Runtime& rt) {
    auto make = [&](int op, int dtype, int rop, double post, int64_t rows) {
      TypedOp o("", op, dtype, std::vector<int64_t>{rows});
      o.reduce_op = rop;
      o.horovod_scaling = true;
      o.prescale = r % 2 ? 2.0 : 0.5;
      o.postscale = post;
      for (size_t i = 0; i < o.count(); ++i) PutValue(dtype, o.x.data(), i, ScaleVal(r, i));
      return o;
    };
    for (int rop : {SHOAL_REDUCE_SUM, SHOAL_REDUCE_AVERAGE}) {
      for (double post : {1.0, 1.5}) {
        const std::string tag = std::to_string(rop) + "." + std::to_string(static_cast<int>(post * 2));
        for (int round = 0; round < 3; ++round) {  // the same names again: cached rounds
          std::vector<TypedOp> ops;
          for (int dt : dtypes) ops.push_back(make(SHOAL_OP_ALLREDUCE, dt, rop, post, 9));
          std::vector<int64_t> h = EnqueueGroup(rt, ("hs.group." + tag).c_str(), ops);
          TypedOp single = make(SHOAL_OP_ALLREDUCE, SHOAL_INT32, rop, post, 5);
          single.name = "hs.single." + tag;
          shoal_op_desc d = single.Desc();
          const int64_t hs = rt.Enqueue(d);
          ops.push_back(std::move(single));
          h.push_back(hs);
          for (size_t k = 0; k < ops.size(); ++k) {
            Status st = WaitTake(rt, h[k]);
            bool exact = st.ok();
            size_t bad = 0;
            for (size_t i = 0; exact && i < ops[k].count(); ++i) {
              exact = GetValue(ops[k].dtype, ops[k].out.data(), i) == ScaledReduction(ops[k].dtype, rop, n, i, post);
              bad = i;
            }
            CHECK(exact, "rank %d allreduce %s member %zu (%s) element %zu: %s (got %g, want %g)", r, tag.c_str(), k,
                  DtypeName(ops[k].dtype), bad, st.ok() ? "inexact" : st.message.c_str(),
                  st.ok() ? GetValue(ops[k].dtype, ops[k].out.data(), bad) : 0.0,
                  ScaledReduction(ops[k].dtype, rop, n, bad, post));
          }
        }
        for (int dt : {SHOAL_FLOAT32, SHOAL_FLOAT16, SHOAL_INT32, SHOAL_INT8}) {
          TypedOp o = make(SHOAL_OP_REDUCESCATTER, dt, rop, post, 2 * n + 1);
          o.name = "hs.rs." + tag + "." + DtypeName(dt);
          shoal_op_desc d = o.Desc();
          std::vector<char> got;
          Status st = WaitTake(rt, rt.Enqueue(d), &got);
          const int64_t rows = 2 + (r < 1 ? 1 : 0), start = r == 0 ? 0 : 2 * r + 1;
          bool exact = st.ok() && got.size() == static_cast<size_t>(rows) * DtypeSize(dt);
          for (int64_t i = 0; exact && i < rows; ++i)
            exact = GetValue(dt, got.data(), i) == ScaledReduction(dt, rop, n, static_cast<size_t>(start + i), post);
          CHECK(exact, "rank %d reducescatter %s %s: %s", r, tag.c_str(), DtypeName(dt),
                st.ok() ? "inexact" : st.message.c_str());
        }
      }
    }
    // Without horovod_scaling, Average of integers is refused at the call.
    TypedOp plain("hs.refused", SHOAL_OP_ALLREDUCE, SHOAL_INT32, std::vector<int64_t>{2});
    plain.reduce_op = SHOAL_REDUCE_AVERAGE;
    shoal_op_desc d = plain.Desc();
    std::string err;
    try {
      rt.Enqueue(d);
    } catch (const std::exception& e) {
      err = e.what();
    }
    CHECK(err.find("average of int32 is not representable") != std::string::npos, "rank %d: refusal was '%s'", r,
          err.c_str());
  });
}

void TestGroupErrors(int n) {
  g_case = "group errors n=" + std::to_string(n);
  Job job(n, TestConfig(8 << 20), 53 + n);
  std::vector<std::string> shape_err(n), count_err(n);
  job.Run([&](int r, Runtime& rt) {
    auto group = [&](int size, int bad_member, std::vector<int64_t> bad_shape) {
      std::vector<TypedOp> ops;
      for (int k = 0; k < size; ++k)
        ops.emplace_back("", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT64, k == bad_member ? bad_shape : std::vector<int64_t>{3});
      return ops;
    };
    // Member 1 has another shape on rank 1.
    std::vector<TypedOp> ops = group(3, r == 1 ? 1 : -1, {4});
    std::vector<int64_t> h = EnqueueGroup(rt, "g.bad", ops);
    std::vector<std::string> seen;
    for (int64_t x : h) {
      Status st = WaitTake(rt, x);
      CHECK(st.code == SHOAL_MISMATCH, "rank %d: a member of a mismatched group did not fail: %s", r, st.message.c_str());
      seen.push_back(st.message);
    }
    shape_err[r] = seen[0];
    CHECK(std::all_of(seen.begin(), seen.end(), [&](const std::string& m) { return m == seen[0]; }),
          "rank %d: members failed differently", r);
    CHECK(seen[0].find("grouped_allreduce 'g.bad': allreduce 'g.bad[1]': mismatched shapes across ranks: [3] on rank") !=
              std::string::npos && seen[0].find("[4] on rank 1") != std::string::npos,
          "rank %d: %s", r, seen[0].c_str());
    // The name works again.
    ops = group(3, -1, {});
    h = EnqueueGroup(rt, "g.bad", ops);
    for (int64_t x : h) {
      Status st = WaitTake(rt, x);
      CHECK(st.ok(), "rank %d: g.bad again: %s", r, st.message.c_str());
    }
    // Rank 0 has two members, the others three.
    ops = group(r == 0 ? 2 : 3, -1, {});
    h = EnqueueGroup(rt, "g.count", ops);
    seen.clear();
    for (int64_t x : h) seen.push_back(WaitTake(rt, x).message);
    count_err[r] = seen[0];
    CHECK(std::all_of(seen.begin(), seen.end(), [&](const std::string& m) { return m == seen[0]; }) &&
              seen[0].find("grouped_allreduce 'g.count': mismatched numbers of tensors across ranks: 2 tensors on "
                           "rank 0; 3 tensors on rank") != std::string::npos,
          "rank %d: %s", r, seen[0].c_str());
    // The last rank's member 1 is a bool tensor: refused there, every member fails here.
    ops = group(3, -1, {});
    if (r == n - 1) ops[1] = TypedOp("", SHOAL_OP_ALLREDUCE, SHOAL_BOOL, {3});
    const std::string refusal = "grouped_allreduce: tensor 1: allreduce: bool tensors cannot be reduced (op=Sum); use "
                                "an integer dtype";
    if (r == n - 1) {
      std::string what;
      try {
        EnqueueGroup(rt, "g.refused", ops);
      } catch (const ArgumentError& ex) {
        what = ex.what();
      }
      CHECK(what == refusal, "rank %d: %s", r, what.c_str());
    } else {
      h = EnqueueGroup(rt, "g.refused", ops);
      for (int64_t x : h) {
        Status st = WaitTake(rt, x);
        CHECK(st.code == SHOAL_INVALID_ARGUMENT &&
                  st.message == refusal + " (raised at the call on rank " + std::to_string(n - 1) + ")",
              "rank %d: %s", r, st.message.c_str());
      }
    }
    // A second group of one name in flight is refused here only.
    ops = group(2, -1, {});
    std::vector<TypedOp> again = group(2, -1, {});
    h = EnqueueGroup(rt, "g.dup", ops);
    if (r == 0) {
      bool dup = false;
      try {
        EnqueueGroup(rt, "g.dup", again);
      } catch (const ArgumentError& ex) {
        dup = ex.code == SHOAL_DUPLICATE_NAME;
      }
      CHECK(dup, "rank %d: a duplicate group was not refused", r);
    }
    for (int64_t x : h) CHECK(WaitTake(rt, x).ok(), "rank %d: g.dup failed", r);
  });
  for (int r = 1; r < n; ++r)
    CHECK(shape_err[r] == shape_err[0] && count_err[r] == count_err[0], "rank %d saw other errors", r);
}

}  // namespace

int main() {
  for (int n : {2, 4, 8}) {
    TestAlltoallValues(n);
    TestAlltoallErrors(n);
    TestGroupValues(n, 8 << 20);
    TestGroupValues(n, 0);
    TestGroupErrors(n);
    TestHorovodScaling(n, 8 << 20);
    TestHorovodScaling(n, 0);
  }
  std::printf("%d passed, %d failed\n", g_passed.load(), g_failed.load());
  return g_failed ? 1 : 0;
}
