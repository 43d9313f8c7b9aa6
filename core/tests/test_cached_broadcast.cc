// Unit tests of cached broadcasts (docs/design.md §20) over the fake backend, N ranks as
// threads: repeated broadcasts are exact and skip the coordinator; a root whose call
// changes fails every rank with one error; a non-root whose call changes fails alone and
// the name goes back to negotiation; refusals, stalls, joins and a rank that leaves.
// Exit status 0 = all passed.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "testing/runtime_harness.h"
#include "runtime/runtime.h"

using namespace shoal;
using namespace shoal::testing;

namespace {

Op Bcast(const std::string& name, int root, std::vector<double> x) {
  Op a;
  a.name = name;
  a.op = SHOAL_OP_BROADCAST;
  a.root = root;
  a.x = std::move(x);
  return a;
}

bool IsRootData(const Op& a, int root, int k) { return a.out == Data(root, k, a.x.size()); }

int JoinNow(Runtime& rt, Status* st) {
  shoal_op_desc d{};
  d.op = kOpJoin;
  const int64_t h = rt.Enqueue(d);
  *st = rt.Wait(h);
  rt.submissions().Release(h);
  return 0;
}

}  // namespace

// Three broadcast names with different roots and one allreduce, submitted in each rank's
// own random order and waited for in another, ten steps: every result is exact, and once
// cached (the third step) no rank asks the coordinator. At step 5 every name's root moves
// to the next rank: the old root's changed call ends the cached rounds on every rank, and
// the new root is cached from step 7 on.
static void TestRepeated(int n) {
  g_case = "cached broadcast n=" + std::to_string(n);
  Job job(n, NoStallConfig(8 << 20), 23 + n, 100);
  const int k_ops = 4;  // the last one: an allreduce
  for (int step = 0; step < 10; ++step) {
    job.Run([&](int r, Runtime& rt) {
      std::vector<Op> ops(k_ops);
      std::vector<int> order(k_ops);
      for (int k = 0; k < k_ops; ++k) order[k] = k;
      std::mt19937 rng(r * 13 + step);
      std::shuffle(order.begin(), order.end(), rng);
      const int64_t rounds_before = rt.stats().coordinator_rounds;
      for (int k : order) {
        const int root = (k + (step >= 5 ? 1 : 0)) % n;
        ops[k] = Bcast("cb." + std::to_string(k), root, Data(r, k + step, 3 + 300 * k));
        if (k == k_ops - 1) ops[k].op = SHOAL_OP_ALLREDUCE;
        ops[k].Enqueue(rt);
      }
      std::shuffle(order.begin(), order.end(), rng);
      for (int k : order) {
        Status st = ops[k].Wait(rt);
        CHECK(st.ok(), "rank %d step %d op %d: %s", r, step, k, st.message.c_str());
        if (k == k_ops - 1) {
          bool exact = st.ok();
          for (size_t i = 0; exact && i < ops[k].x.size(); ++i) {
            double sum = 0;
            for (int q = 0; q < n; ++q) sum += Data(q, k + step, ops[k].x.size())[i];
            exact = ops[k].out[i] == sum;
          }
          CHECK(exact, "rank %d step %d: not the sum", r, step);
        } else {
          CHECK(st.ok() && IsRootData(ops[k], ops[k].root, k + step), "rank %d step %d op %d: not the root's data", r,
                step, k);
        }
      }
      if ((step >= 3 && step < 5) || step >= 7)
        CHECK(rt.stats().coordinator_rounds == rounds_before, "rank %d step %d asked the coordinator", r, step);
    });
  }
}

static void Warm(Job& job, const std::string& name, int root = 0) {
  for (int step = 0; step < 3; ++step)
    job.Run([&](int r, Runtime& rt) {
      Op a = Bcast(name, root, Data(r, step, 4));
      a.Enqueue(rt);
      CHECK(a.Wait(rt).ok() && IsRootData(a, root, step), "rank %d: warm-up of %s failed", r, name.c_str());
    });
}

static void TestChanged(int n) {
  g_case = "cached broadcast changed n=" + std::to_string(n);
  Job job(n, NoStallConfig(8 << 20), 29 + n, 50);
  const int last = n - 1;
  // The root's shape changes: its round says dead, and the coordinator fails every rank
  // with the same mismatch error.
  Warm(job, "cbc.root");
  std::vector<std::string> errors(n);
  job.Run([&](int r, Runtime& rt) {
    Op a = Bcast("cbc.root", 0, Data(r, 0, r == 0 ? 5 : 4));
    a.Enqueue(rt);
    Status st = a.Wait(rt);
    CHECK(st.code == SHOAL_MISMATCH && st.message.find("mismatched shapes") != std::string::npos, "rank %d: %s", r,
          st.message.c_str());
    errors[r] = st.message;
  });
  for (int r = 1; r < n; ++r) CHECK(errors[r] == errors[0], "rank %d: %s vs %s", r, errors[r].c_str(), errors[0].c_str());
  // A non-root's shape changes: it alone fails (the root's data went to every other rank);
  // the name goes back to the coordinator at the root's next call, then is cached again.
  Warm(job, "cbc.peer");
  job.Run([&](int r, Runtime& rt) {
    Op a = Bcast("cbc.peer", 0, Data(r, 3, r == last ? 5 : 4));
    a.Enqueue(rt);
    Status st = a.Wait(rt);
    if (r == last)
      CHECK(st.code == SHOAL_MISMATCH && st.message.find("rank " + std::to_string(last) + " called it with float64[5]") !=
                                             std::string::npos &&
                st.message.find("the cached call the root ran, float64[4]") != std::string::npos,
            "rank %d: %s", r, st.message.c_str());
    else
      CHECK(st.ok() && IsRootData(a, 0, 3), "rank %d: %s", r, st.message.c_str());
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the refusal reaches the root
  for (int step = 4; step < 8; ++step)
    job.Run([&](int r, Runtime& rt) {
      const int64_t rounds_before = rt.stats().coordinator_rounds;
      Op a = Bcast("cbc.peer", 0, Data(r, step, 4));
      a.Enqueue(rt);
      Status st = a.Wait(rt);
      CHECK(st.ok() && IsRootData(a, 0, step), "rank %d step %d: %s", r, step, st.message.c_str());
      const bool asked = rt.stats().coordinator_rounds > rounds_before;
      if (step == 4) CHECK(asked, "rank %d: the changed name did not go back to the coordinator", r);
      if (step == 7) CHECK(!asked, "rank %d: the name was not cached again", r);
    });
  // Refused at the call on the root: its round says dead, every rank raises the refusal.
  Warm(job, "cbc.refused");
  job.Run([&](int r, Runtime& rt) {
    if (r == 0) return rt.Reject(SHOAL_OP_BROADCAST, "cbc.refused", SHOAL_INVALID_ARGUMENT, "bad argument here");
    Op a = Bcast("cbc.refused", 0, Data(r, 0, 4));
    a.Enqueue(rt);
    Status st = a.Wait(rt);
    CHECK(st.code == SHOAL_INVALID_ARGUMENT && st.message.find("bad argument here") != std::string::npos,
          "rank %d: %s", r, st.message.c_str());
  });
  // Roots of several cached names submitted in opposite orders on different ranks.
  for (int k = 0; k < 3; ++k) Warm(job, "cbc.multi." + std::to_string(k), k % n);
  job.Run([&](int r, Runtime& rt) {
    std::vector<Op> ops;
    for (int k = 0; k < 3; ++k) ops.push_back(Bcast("cbc.multi." + std::to_string(k), k % n, Data(r, 9 + k, 4)));
    for (int i = 0; i < 3; ++i) ops[r % 2 ? 2 - i : i].Enqueue(rt);
    for (int i = 0; i < 3; ++i) {
      Status st = ops[i].Wait(rt);
      CHECK(st.ok() && IsRootData(ops[i], i % n, 9 + i), "rank %d op %d: %s", r, i, st.message.c_str());
    }
  });
}

// A rank that never submits (a stall error, not a hang), a rank that joins (the others'
// call either runs before the root heard of it or fails naming the join; after the join
// the name runs again, exact), a rank that leaves (an error naming it).
static void TestFailures(int n) {
  g_case = "cached broadcast failures n=" + std::to_string(n);
  Job job(n, StallConfig(8 << 20), 31 + n, 50);
  const int last = n - 1;
  Warm(job, "cbf.stall");
  job.Run([&](int r, Runtime& rt) {
    if (r == last) return;
    Op a = Bcast("cbf.stall", 0, Data(r, 0, 4));
    a.Enqueue(rt);
    Status st = a.Wait(rt);
    CHECK(!st.ok() && st.message.find("missing ranks " + std::to_string(last)) != std::string::npos, "rank %d: %s", r,
          st.message.c_str());
  });
  Warm(job, "cbf.join");
  std::vector<int> outcome(n, -1);
  job.Run([&](int r, Runtime& rt) {
    Status st;
    if (r != last) {
      Op a = Bcast("cbf.join", 0, Data(r, 5, 4));
      a.Enqueue(rt);
      st = a.Wait(rt);
      outcome[r] = st.ok() ? 1 : 0;
      CHECK(st.ok() ? IsRootData(a, 0, 5) : st.message.find("joined") != std::string::npos, "rank %d: %s", r,
            st.message.c_str());
    }
    JoinNow(rt, &st);
    CHECK(st.ok(), "rank %d: join: %s", r, st.message.c_str());
  });
  for (int r = 1; r < last; ++r) CHECK(outcome[r] == outcome[0], "rank %d's outcome differs from rank 0's", r);
  for (int step = 6; step < 10; ++step)
    job.Run([&](int r, Runtime& rt) {
      Op a = Bcast("cbf.join", 0, Data(r, step, 4));
      a.Enqueue(rt);
      Status st = a.Wait(rt);
      CHECK(st.ok() && IsRootData(a, 0, step), "rank %d step %d after the join: %s", r, step, st.message.c_str());
    });
  Warm(job, "cbf.leave");
  job.Run([&](int r, Runtime& rt) {
    if (r == last) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      return rt.Leave();
    }
    Op a = Bcast("cbf.leave", 0, Data(r, 0, 4));
    a.Enqueue(rt);
    Status st = a.Wait(rt);
    CHECK(!st.ok() && st.message.find("rank " + std::to_string(last) + " left") != std::string::npos, "rank %d: %s", r,
          st.message.c_str());
  });
}

int main() {
  for (int n : {2, 4, 8}) {
    TestRepeated(n);
    TestChanged(n);
    TestFailures(n);
  }
  std::printf("%d passed, %d failed\n", g_passed.load(), g_failed.load());
  return g_failed ? 1 : 0;
}
