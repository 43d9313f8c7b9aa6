// Unit tests of bounded per-name state (negotiation/names.cc) with N ranks as threads over the
// fake backend, at 2, 4 and 8 ranks and a name limit of a few dozen: a run of fresh names
// keeps the tables bounded with exact results, every rank retires the same number of names,
// retired names work again (from step 0 everywhere); calls of names being retired, submitted
// in different orders on different ranks, wait and then run exactly. And the other state a
// handle carries in Submissions: what a binding attaches to it (TestAttached).
// tests/test_core_cpp.py also runs them under ThreadSanitizer. Exit status 0 = all passed.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "testing/runtime_harness.h"

using namespace shoal;
using namespace shoal::testing;

namespace {

std::vector<int32_t> Ring(int r, int n) {
  if (n == 2) return {1 - r};
  return {(r + n - 1) % n, (r + 1) % n};
}

// Rank r's op `name` on input Data(r, k, len): an allreduce (sum), or with `neighbor` a
// uniform neighbor average over the ring.
void Make(Op* op, const std::string& name, int r, int n, bool neighbor, int k, size_t len) {
  op->name = name;
  op->x = Data(r, k, len);
  op->op = neighbor ? SHOAL_OP_NEIGHBOR_ALLREDUCE : SHOAL_OP_ALLREDUCE;
  if (neighbor) op->recv = op->send = Ring(r, n);
}

bool Exact(const Op& op, int r, int n, int k) {
  const size_t len = op.x.size();
  for (size_t i = 0; i < len; ++i) {
    double want = 0;
    if (op.op == SHOAL_OP_ALLREDUCE) {
      for (int q = 0; q < n; ++q) want += Data(q, k, len)[i];
    } else {
      want = Data(r, k, len)[i];
      for (int q : op.recv) want += Data(q, k, len)[i];
      want /= static_cast<double>(op.recv.size() + 1);
    }
    if (op.out[i] != want) return false;
  }
  return true;
}

int64_t g_held = 0;  // calls that waited for a vote, in every TestHeldCalls

Config Limited(size_t limit) {
  Config c = TestConfig(8 << 20);
  c.name_limit = limit;
  return c;
}

// Every rank retired the same names (the count), and each table stays near the limit.
void SameRetirement(const std::vector<int64_t>& retired, const std::vector<size_t>& names, size_t limit) {
  CHECK(retired[0] > 0, "no name was retired");
  for (size_t r = 0; r < retired.size(); ++r) {
    CHECK(retired[r] == retired[0], "rank %zu retired %lld names, rank 0 %lld", r, static_cast<long long>(retired[r]),
          static_cast<long long>(retired[0]));
    CHECK(names[r] <= 2 * limit, "rank %zu keeps %zu names (limit %zu)", r, names[r], limit);
  }
  std::printf("%s: %lld names retired on every rank, %zu kept at the end (limit %zu)\n", g_case.c_str(),
              static_cast<long long>(retired[0]), *std::max_element(names.begin(), names.end()), limit);
}

// 600 blocking ops, each of a fresh name, and one name used all along; then the first
// names again (retired by then).
void TestFreshNames(int n) {
  g_case = "fresh names n=" + std::to_string(n);
  const size_t limit = 48;
  Job job(n, Limited(limit), 3 + n);
  std::vector<int64_t> retired(n);
  std::vector<size_t> names(n);
  job.Run([&](int r, Runtime& rt) {
    for (int k = 0; k < 640; ++k) {
      Op op;
      const bool again = k >= 600;  // f.0 .. f.39 once more
      Make(&op, k % 10 == 9 ? "hot" : "f." + std::to_string(again ? k - 600 : k), r, n, k % 2, k, 1 + k % 5);
      op.Enqueue(rt);
      Status st = op.Wait(rt);
      CHECK(st.ok() && Exact(op, r, n, k), "rank %d op %d (%s): %s", r, k, op.name.c_str(), st.message.c_str());
    }
    CHECK(job.Settle([&] { return RetiredAlike(job); }), "rank %d: the ranks' retired names never agreed", r);
    retired[r] = rt.stats().names_retired;
    names[r] = rt.submissions().NameCount();
  });
  SameRetirement(retired, names, limit);
}

// Each step every rank starts a fresh name and two names of a pool of 60 (the same random
// picks on every rank, so pool names are retired while others are about to call them) in
// its own random order, then waits in another order; the held calls run exactly.
void TestHeldCalls(int n) {
  g_case = "held calls n=" + std::to_string(n);
  const size_t limit = 32;
  const int pool = 60;
  Job job(n, Limited(limit), 5 + n);
  std::vector<int64_t> retired(n), held(n);
  std::vector<size_t> names(n);
  job.Run([&](int r, Runtime& rt) {
    std::mt19937 rng(97 * r + n), picks(11);
    for (int k = 0; k < 400; ++k) {
      std::vector<Op> ops(3);
      const int a = static_cast<int>(picks() % pool), b = (a + 1 + static_cast<int>(picks() % (pool - 1))) % pool;
      Make(&ops[0], "h." + std::to_string(k), r, n, false, 3 * k, 3);
      Make(&ops[1], "p." + std::to_string(a), r, n, a % 2, 3 * k + 1, 1 + a % 5);
      Make(&ops[2], "p." + std::to_string(b), r, n, b % 2, 3 * k + 2, 1 + b % 5);
      std::vector<int> order = {0, 1, 2};
      std::shuffle(order.begin(), order.end(), rng);
      for (int i : order) ops[i].Enqueue(rt);
      std::shuffle(order.begin(), order.end(), rng);
      for (int i : order) {
        Status st = ops[i].Wait(rt);
        CHECK(st.ok() && Exact(ops[i], r, n, 3 * k + i), "rank %d step %d %s: %s", r, k, ops[i].name.c_str(),
              st.message.c_str());
      }
    }
    CHECK(job.Settle([&] { return RetiredAlike(job); }), "rank %d: the ranks' retired names never agreed", r);
    retired[r] = rt.stats().names_retired;
    held[r] = rt.stats().held_calls;
    names[r] = rt.submissions().NameCount();
  });
  SameRetirement(retired, names, limit);
  int64_t total = 0;
  for (int64_t h : held) total += h;
  g_held += total;
  std::printf("%s: %lld calls waited for a vote\n", g_case.c_str(), static_cast<long long>(total));
}

}  // namespace

// A user op may not take the name of the runtime's vote.
void TestReservedName() {
  g_case = "reserved name";
  Job job(2, Limited(32), 3);
  job.Run([&](int r, Runtime& rt) {
    Op op;
    Make(&op, "shoal.retire", r, 2, false, 0, 2);
    std::string error;
    try {
      op.Enqueue(rt);
      op.Wait(rt);
    } catch (const ArgumentError& ex) {
      error = ex.what();
    }
    CHECK(error.find("the op name 'shoal.retire' is reserved") != std::string::npos, "rank %d: %s", r, error.c_str());
    Make(&op, "after", r, 2, false, 1, 2);
    op.Enqueue(rt);
    CHECK(op.Wait(rt).ok() && Exact(op, r, 2, 1), "rank %d: the next op", r);
  });
}

// What a binding attaches to a handle (shoal_attach) is dropped exactly once: when it is
// attached over, when the handle is released (after the table's lock: the drop may call
// back into the table), or when the runtime ends with the handle still held; an unknown
// handle takes nothing; detached (shoal_detach), it is its taker's and never dropped.
std::atomic<int> g_dropped{0};
Submissions* g_table = nullptr;

void CountDrop(void* p) {
  ++g_dropped;
  if (g_table) g_table->HandleCount();  // the drop may call back: no lock of the table is held
  delete static_cast<int*>(p);
}

void TestAttached() {
  g_case = "attached";
  g_dropped = 0;
  {
    Job job(1, TestConfig(8 << 20), 71);
    Runtime& rt = *job.rt[0];
    g_table = &rt.submissions();
    auto op = [&](const char* name) {
      Op a;
      a.name = name;
      a.op = SHOAL_OP_ALLREDUCE;
      a.x = Data(0, 0, 3);
      a.Enqueue(rt);
      CHECK(rt.Wait(a.handle).ok(), "allreduce %s", name);
      return a.handle;
    };
    const int64_t h1 = op("att.1"), h2 = op("att.2");
    Submissions::Attached a(new int(1), CountDrop), b(new int(2), CountDrop), c(new int(3), CountDrop);
    CHECK(rt.submissions().Attach(h1, &a), "attach to a live handle");
    CHECK(*static_cast<int*>(rt.submissions().AttachedTo(h1)) == 1, "the data attached");
    CHECK(rt.submissions().Attach(h1, &b) && g_dropped == 1, "attached over: the first dropped (%d)", g_dropped.load());
    CHECK(*static_cast<int*>(rt.submissions().AttachedTo(h1)) == 2, "the second attached");
    int* kept = new int(4);
    Submissions::Attached unknown(kept, CountDrop);
    CHECK(!rt.submissions().Attach(h2 + 1000, &unknown) && unknown.data() == kept, "an unknown handle takes nothing");
    unknown.Disown();
    delete kept;
    CHECK(rt.submissions().Release(h1) && g_dropped == 2, "released: dropped (%d)", g_dropped.load());
    CHECK(rt.submissions().AttachedTo(h1) == nullptr, "nothing attached to a released handle");
    CHECK(rt.submissions().Attach(h2, &c) && g_dropped == 2, "attached to the held handle");
    const int64_t h3 = op("att.3");
    Submissions::Attached d(new int(5), CountDrop);
    CHECK(rt.submissions().Attach(h3, &d), "attach to a third handle");
    int* taken = static_cast<int*>(rt.submissions().Detach(h3));
    CHECK(taken && *taken == 5 && rt.submissions().Detach(h3) == nullptr, "detached once, by one caller");
    delete taken;
    CHECK(rt.submissions().Release(h3) && g_dropped == 2, "a detached handle's release drops nothing");
    g_table = nullptr;  // the table ends with the runtime below
  }
  CHECK(g_dropped == 3, "the runtime ended with a handle held: its data dropped (%d)", g_dropped.load());
}

int main() {
  TestReservedName();
  TestAttached();
  for (int n : {2, 4, 8}) {
    TestFreshNames(n);
    TestHeldCalls(n);
  }
  // Whether a call meets a frozen name is timing (tens do at each n): over all three runs.
  g_case = "held calls";
  CHECK(g_held > 0, "no call waited for a vote: the test did not test held calls");
  std::printf("%d passed, %d failed\n", g_passed.load(), g_failed.load());
  return g_failed ? 1 : 0;
}
