// Unit tests of process sets (process_sets/process_sets.h) in the Runtime over the fake backend, 4 ranks
// as threads: sets made and removed by every rank, ops in disjoint sets that never wait for
// each other (one set's members stall while the other's complete), negotiation at each
// set's own leader, cached batches per set, the same error on every rank for mismatched
// membership, non-members refused, a member that leaves or dies. tests/test_core_cpp.py also
// runs it under ThreadSanitizer. Exit status 0 = all passed.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "testing/runtime_harness.h"

using namespace shoal;
using namespace shoal::testing;

namespace {

// One collective of float64 values in process set `set`; core-allocated results (allgather,
// reducescatter) are copied into `out`.
struct Call {
  int op = SHOAL_OP_ALLREDUCE, rop = SHOAL_REDUCE_SUM, root = 0, set = 0;
  std::string name;
  std::vector<double> x, out;
  std::vector<int64_t> shape, result_shape;
  int64_t handle = 0;

  Call(int op_, std::string name_, std::vector<double> x_, int set_) : op(op_), set(set_), name(std::move(name_)), x(std::move(x_)) {}
  int64_t Start(Runtime& rt) {
    shape = {static_cast<int64_t>(x.size())};
    out.assign(x.size(), 0.0);
    shoal_op_desc d{};
    d.op = op;
    d.name = name.c_str();
    d.input = {x.data(), SHOAL_FLOAT64, 1, shape.data(), SHOAL_DEVICE_CPU, 0, nullptr, nullptr};
    d.output = d.input;
    d.output.data = out.data();
    d.reduce_op = rop;
    d.root_rank = root;
    d.process_set = set;
    return handle = rt.Enqueue(d);
  }
  Status Wait(Runtime& rt) {
    Status st = rt.Wait(handle);
    EntryPtr e = rt.submissions().Find(handle);
    if (st.ok() && e && e->result) {
      result_shape = e->result_shape;
      out.assign(static_cast<const double*>(e->result), static_cast<const double*>(e->result) + e->result_nbytes / 8);
    }
    rt.submissions().Release(handle);
    return st;
  }
  Status Run(Runtime& rt) {
    Start(rt);
    return Wait(rt);
  }
};

std::vector<double> Fill(double v, size_t n) { return std::vector<double>(n, v); }

// add_process_set on this rank; the error's code and text instead when it throws.
int32_t Add(Runtime& rt, const std::vector<int>& ranks, Status* err = nullptr, const std::string& refusal = "") {
  try {
    return rt.AddProcessSet(ranks, refusal);
  } catch (const ArgumentError& ex) {
    if (err) *err = Status::Error(ex.code, ex.what());
    return -1;
  }
}

Status Remove(Runtime& rt, int32_t id) {
  try {
    rt.RemoveProcessSet(id);
  } catch (const ArgumentError& ex) {
    return Status::Error(ex.code, ex.what());
  }
  return Status::Ok();
}

// Every rank got the very same text.
void SameEverywhere(const std::vector<std::string>& msgs, const char* what) {
  for (size_t r = 1; r < msgs.size(); ++r)
    CHECK(msgs[r] == msgs[0], "%s: rank %zu saw '%s', rank 0 '%s'", what, r, msgs[r].c_str(), msgs[0].c_str());
}

}  // namespace

// Every rank adds {0, 2} and {1, 3} (any order of the list); the ids and members agree;
// remove, then add the same ranks again: a new id, and the old one is gone.
static void TestAddRemove() {
  g_case = "add and remove";
  Job job(4, TestConfig(8 << 20), 21);
  std::vector<int32_t> even(4), odd(4), again(4);
  job.Run([&](int r, Runtime& rt) {
    even[r] = Add(rt, {2, 0});
    odd[r] = Add(rt, {1, 3});
    ProcessSetPtr e = rt.FindSet(even[r]), o = rt.FindSet(odd[r]);
    CHECK(e && e->ranks == std::vector<int>({0, 2}) && e->index == (r % 2 == 0 ? r / 2 : -1), "rank %d: even set", r);
    CHECK(o && o->ranks == std::vector<int>({1, 3}) && o->index == (r % 2 == 1 ? r / 2 : -1), "rank %d: odd set", r);
    Status st = Remove(rt, even[r]);
    CHECK(st.ok(), "rank %d: remove: %s", r, st.message.c_str());
    CHECK(!rt.FindSet(even[r]), "rank %d: the removed set is still there", r);
    again[r] = Add(rt, {0, 2});
    CHECK(again[r] > odd[r], "rank %d: ids %d then %d", r, odd[r], again[r]);
    Call c(SHOAL_OP_ALLREDUCE, "ar", Fill(r, 3), even[r]);  // the removed id is refused at the call
    std::string msg;
    try { c.Start(rt); } catch (const ArgumentError& ex) { msg = ex.what(); }
    CHECK(msg.find("no process set has id " + std::to_string(even[r])) != std::string::npos, "rank %d: %s", r, msg.c_str());
    CHECK(Remove(rt, again[r]).ok() && Remove(rt, odd[r]).ok(), "rank %d: final removes", r);
  });
  for (int r = 1; r < 4; ++r)
    CHECK(even[r] == even[0] && odd[r] == odd[0] && again[r] == again[0], "rank %d: ids differ from rank 0's", r);
  CHECK(even[0] > 0 && odd[0] > even[0], "ids %d %d", even[0], odd[0]);
}

// {0, 2} and {1, 3} run different ops at the same time, each while the other set's members
// stall: rank 3 holds its call until ranks 0 and 2 finished theirs (allreduce Sum, allgather,
// Average), then ranks 0 and 2 hold theirs until 1 and 3 finished (broadcast, reducescatter,
// barrier). Had either set waited for the other, this would end in a stall error. Exact
// values; the odd set negotiates at rank 1, never at rank 0.
static void TestDisjointSets() {
  g_case = "disjoint sets";
  Config cfg = TestConfig(8 << 20);
  cfg.stall_shutdown_time = 60;  // the held calls wait on purpose; only an error of the run fails
  Job job(4, cfg, 23);
  std::promise<void> even_done, odd_done;
  std::shared_future<void> even_ready = even_done.get_future().share(), odd_ready = odd_done.get_future().share();
  std::vector<int64_t> rank0_negotiations(2), rank1_negotiations(2);
  job.Run([&](int r, Runtime& rt) {
    const int32_t even = Add(rt, {0, 2}), odd = Add(rt, {1, 3});
    if (r % 2 == 0) {
      // Round 1: the odd set is stuck (rank 3 has not come); these complete regardless.
      Call a(SHOAL_OP_ALLREDUCE, "x", Fill(r + 1, 5), even);
      Status st = a.Run(rt);
      CHECK(st.ok() && a.out == Fill(1 + 3, 5), "rank %d: even allreduce: %s", r, st.message.c_str());
      Call g(SHOAL_OP_ALLGATHER, "x.gather", Fill(r, 1 + r), even);  // rows 1 and 3
      st = g.Run(rt);
      CHECK(st.ok() && g.out == std::vector<double>({0, 2, 2, 2}), "rank %d: even allgather: %s", r, st.message.c_str());
      Call v(SHOAL_OP_ALLREDUCE, "x.avg", Fill(r, 4), even);
      v.rop = SHOAL_REDUCE_AVERAGE;  // divides by the set's size
      st = v.Run(rt);
      CHECK(st.ok() && v.out == Fill(1, 4), "rank %d: even average: %s", r, st.message.c_str());
      // Round 2: rank 0's call waits for rank 2, which holds it until the odd set is done.
      Call late(SHOAL_OP_ALLREDUCE, "x", Fill(10 * r, 2), even);  // the same name as in the odd set
      if (r == 0) {
        rank0_negotiations[0] = rt.stats().negotiations;
        late.Start(rt);
        even_done.set_value();
      }
      odd_ready.wait();
      if (r == 2) late.Start(rt);
      st = late.Wait(rt);
      CHECK(st.ok() && late.out == Fill(20, 2), "rank %d: even late allreduce: %s", r, st.message.c_str());
    } else {
      if (r == 3) even_ready.wait();
      if (r == 1) rank1_negotiations[0] = rt.stats().negotiations;
      Call b(SHOAL_OP_BROADCAST, "x", Fill(r, 6), odd);
      b.root = 3;  // a world rank of the set
      Status st = b.Run(rt);
      CHECK(st.ok() && b.out == Fill(3, 6), "rank %d: odd broadcast: %s", r, st.message.c_str());
      Call s(SHOAL_OP_REDUCESCATTER, "x.rs", {1.0 * r, 2.0 * r, 3.0 * r}, odd);
      st = s.Run(rt);  // sum [4, 8, 12] split over 2 ranks: [4, 8] | [12]
      CHECK(st.ok() && s.out == (r == 1 ? std::vector<double>({4, 8}) : std::vector<double>({12})),
            "rank %d: odd reducescatter: %s", r, st.message.c_str());
      Call bar(SHOAL_OP_BARRIER, "x.barrier", {}, odd);
      st = bar.Run(rt);
      CHECK(st.ok(), "rank %d: odd barrier: %s", r, st.message.c_str());
      if (r == 1) rank1_negotiations[1] = rt.stats().negotiations;
      if (r == 3) {
        rank0_negotiations[1] = job.rt[0]->stats().negotiations;  // rank 2 has not come to round 2 yet
        odd_done.set_value();
      }
    }
  });
  CHECK(rank0_negotiations[1] == rank0_negotiations[0], "rank 0 negotiated the odd set's ops (%lld -> %lld)",
        static_cast<long long>(rank0_negotiations[0]), static_cast<long long>(rank0_negotiations[1]));
  CHECK(rank1_negotiations[1] >= rank1_negotiations[0] + 3, "rank 1 did not negotiate its set's ops (%lld -> %lld)",
        static_cast<long long>(rank1_negotiations[0]), static_cast<long long>(rank1_negotiations[1]));
}

// Every reduce op in a set, unnamed ops in a set and in the whole job interleaved (one
// count of unnamed names per set), and repeated named allreduces in both sets at once:
// cached after the third step, so members stop asking their coordinator.
static void TestOpsAndCache(int64_t fusion) {
  g_case = "ops and cache fusion=" + std::to_string(fusion);
  Job job(4, NoStallConfig(fusion), 25);
  job.Run([&](int r, Runtime& rt) {
    const int32_t even = Add(rt, {0, 2}), odd = Add(rt, {1, 3});
    const int32_t mine = r % 2 == 0 ? even : odd;
    const double a = r + 1, b = (r + 2) % 4 + 1;  // this rank's value, the other member's
    for (int rop : {SHOAL_REDUCE_SUM, SHOAL_REDUCE_AVERAGE, SHOAL_REDUCE_MIN, SHOAL_REDUCE_MAX, SHOAL_REDUCE_PRODUCT}) {
      Call c(SHOAL_OP_ALLREDUCE, "rop." + std::to_string(rop), Fill(a, 3), mine);
      c.rop = rop;
      Status st = c.Run(rt);
      const double want = rop == SHOAL_REDUCE_SUM ? a + b : rop == SHOAL_REDUCE_AVERAGE ? (a + b) / 2
                          : rop == SHOAL_REDUCE_MIN ? std::min(a, b) : rop == SHOAL_REDUCE_MAX ? std::max(a, b) : a * b;
      CHECK(st.ok() && c.out == Fill(want, 3), "rank %d op %s: %s", r, ReduceOpName(rop), st.message.c_str());
    }
    Call u1(SHOAL_OP_ALLREDUCE, "", Fill(a, 2), mine);  // unnamed, in this rank's set
    Status st = u1.Run(rt);
    CHECK(st.ok() && u1.out == Fill(a + b, 2), "rank %d: unnamed in a set: %s", r, st.message.c_str());
    Call u2(SHOAL_OP_ALLREDUCE, "", Fill(a, 2), 0);  // unnamed, every rank: the names still pair up
    st = u2.Run(rt);
    CHECK(st.ok() && u2.out == Fill(1 + 2 + 3 + 4, 2), "rank %d: unnamed global: %s", r, st.message.c_str());
    for (int step = 0; step < 6; ++step) {
      const int64_t rounds = rt.stats().coordinator_rounds;
      std::vector<Call> calls;
      for (int k = 0; k < 3; ++k) calls.emplace_back(SHOAL_OP_ALLREDUCE, "grad." + std::to_string(k), Fill(a * (k + 1), 4 + k), mine);
      for (auto& c : calls) c.Start(rt);
      for (int k = 0; k < 3; ++k) {
        st = calls[k].Wait(rt);
        CHECK(st.ok() && calls[k].out == Fill((a + b) * (k + 1), 4 + k), "rank %d step %d op %d: %s", r, step, k,
              st.message.c_str());
      }
      if (step >= 3)
        CHECK(rt.stats().coordinator_rounds == rounds, "rank %d step %d asked its set's coordinator", r, step);
    }
  });
}

// Ranks that pass different lists, a rank that calls remove instead, a rank that refuses the
// call, bad lists: the same error on every rank, and the sets stay as they were.
static void TestMismatch() {
  g_case = "membership mismatch";
  Job job(4, TestConfig(8 << 20), 27);
  std::vector<std::string> a(4), b(4), c(4);
  job.Run([&](int r, Runtime& rt) {
    Status st;
    CHECK(Add(rt, r < 2 ? std::vector<int>{0, 2} : std::vector<int>{0, 1}, &st) < 0 && st.code == SHOAL_MISMATCH &&
              st.message.find("add_process_set([0, 2]) on ranks 0, 1; add_process_set([0, 1]) on ranks 2, 3") !=
                  std::string::npos,
          "rank %d: %s", r, st.message.c_str());
    a[r] = st.message;
    st = Status::Ok();
    const int32_t id = r == 3 ? -1 : Add(rt, {1, 2}, &st);
    if (r == 3) CHECK(!Remove(rt, 7).ok(), "rank 3: remove did not fail");
    if (r != 3) CHECK(id < 0 && st.code == SHOAL_MISMATCH, "rank %d: %s", r, st.message.c_str());
    st = Status::Ok();
    Add(rt, {0, 1}, &st, r == 2 ? "add_process_set: ranks must be ints, got 'x'" : "");
    CHECK(st.code == SHOAL_INVALID_TYPE && st.message == "add_process_set: ranks must be ints, got 'x' (raised at the "
                                                          "call on rank 2)",
          "rank %d: %s", r, st.message.c_str());
    st = Status::Ok();
    Add(rt, {0, 9}, &st);
    CHECK(st.code == SHOAL_INVALID_ARGUMENT && st.message.find("rank 9 is outside [0, 4)") != std::string::npos,
          "rank %d: %s", r, st.message.c_str());
    b[r] = st.message;
    st = Status::Ok();
    Add(rt, {3, 1, 3}, &st);
    CHECK(st.message.find("rank 3 appears twice") != std::string::npos, "rank %d: %s", r, st.message.c_str());
    st = Status::Ok();
    Add(rt, {0, 1, 2, 3}, &st);
    CHECK(st.message.find("global process set") != std::string::npos, "rank %d: %s", r, st.message.c_str());
    const int32_t ok = Add(rt, {0, 1});
    CHECK(ok > 0, "rank %d: a good add after the failures failed", r);
    st = Status::Ok();
    Add(rt, {1, 0}, &st);
    CHECK(st.message.find("has these ranks already") != std::string::npos, "rank %d: %s", r, st.message.c_str());
    c[r] = st.message;
    // Ops of the set in flight on rank 0 when it is removed: refused everywhere, naming it.
    Call held(SHOAL_OP_ALLREDUCE, "held", Fill(r, 2), ok);
    if (r == 0) held.Start(rt);
    st = Remove(rt, ok);
    CHECK(st.code == SHOAL_INVALID_ARGUMENT && st.message.find("in flight on rank 0;") != std::string::npos,
          "rank %d: %s", r, st.message.c_str());
    if (r == 1) held.Start(rt);
    if (r < 2) CHECK(held.Wait(rt).ok() && held.out == Fill(1, 2), "rank %d: the held op", r);
    CHECK(Remove(rt, ok).ok(), "rank %d: remove after the held op", r);
  });
  SameEverywhere(a, "mismatched lists");
  SameEverywhere(b, "bad list");
  SameEverywhere(c, "duplicate set");
}

// A rank that never calls add_process_set: the others' calls end in an error naming it (the
// agreement's stall check), not a hang.
static void TestMissingCall() {
  g_case = "missing call";
  Config cfg = TestConfig(8 << 20);
  cfg.stall_shutdown_time = 0;  // warn only: the agreement still ends (after the check time)
  Job job(4, cfg, 29);
  std::vector<std::string> msgs(3);
  job.Run([&](int r, Runtime& rt) {
    if (r == 3) return;
    Status st;
    CHECK(Add(rt, {0, 1}, &st) < 0 && st.message.find("missing ranks 3") != std::string::npos &&
              st.message.find("add_process_set([0, 1]) did not complete") != std::string::npos,
          "rank %d: %s", r, st.message.c_str());
    msgs[r] = st.message;
  });
  SameEverywhere(msgs, "missing call");
}

// Non-members are refused at the call; a broadcast root outside the set too; join refuses to
// run while process sets exist; neighbor ops take no process set.
static void TestRefusedCalls() {
  g_case = "refused calls";
  Job job(4, TestConfig(8 << 20), 31);
  job.Run([&](int r, Runtime& rt) {
    const int32_t even = Add(rt, {0, 2});
    auto refusal = [&](Call c) {
      try {
        c.Start(rt);
      } catch (const ArgumentError& ex) {
        return std::string(ex.what());
      }
      c.Wait(rt);
      return std::string("(no error)");
    };
    if (r % 2 == 1) {
      const std::string msg = refusal(Call(SHOAL_OP_ALLREDUCE, "x", Fill(1, 2), even));
      CHECK(msg == "allreduce: rank " + std::to_string(r) + " is not a member of process set " + std::to_string(even) +
                       " (ranks [0, 2])",
            "rank %d: %s", r, msg.c_str());
    } else {
      Call b(SHOAL_OP_BROADCAST, "b", Fill(1, 2), even);
      b.root = 1;
      std::string msg = refusal(b);
      CHECK(msg.find("broadcast: root rank 1 is not in process set") != std::string::npos, "rank %d: %s", r, msg.c_str());
      Call n(SHOAL_OP_NEIGHBOR_ALLREDUCE, "n", Fill(1, 2), even);
      msg = refusal(n);
      CHECK(msg.find("neighbor ops run over the topology") != std::string::npos, "rank %d: %s", r, msg.c_str());
    }
    shoal_op_desc d{};
    d.op = kOpJoin;
    std::string msg;
    try { rt.Enqueue(d); } catch (const ArgumentError& ex) { msg = ex.what(); }
    CHECK(msg.find("join: not supported while process sets") != std::string::npos, "rank %d: %s", r, msg.c_str());
  });
}

// A member that leaves fails the ops of its sets, those it leads included; a disjoint set
// goes on (exactly). A member that dies (vanishes, no notice): its set's ops end in a stall
// error naming it; the other set's complete.
static void TestLeaverAndDeath() {
  g_case = "leaver";
  {
    Job job(4, StallConfig(8 << 20), 33);
    job.Run([&](int r, Runtime& rt) {
      const int32_t even = Add(rt, {0, 2}), odd = Add(rt, {1, 3}), led = Add(rt, {2, 3});
      if (r == 2) return rt.Leave();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the notice arrives (or the op fails anyway)
      if (r == 0) {
        Call c(SHOAL_OP_ALLREDUCE, "x", Fill(1, 2), even);
        Status st = c.Run(rt);
        CHECK(!st.ok() && st.message.find("rank 2 left") != std::string::npos, "rank 0: %s", st.message.c_str());
      } else {
        for (int k = 0; k < 3; ++k) {  // the odd set is untouched
          Call c(SHOAL_OP_ALLREDUCE, "x", Fill(r * 10 + k, 2), odd);
          Status st = c.Run(rt);
          CHECK(st.ok() && c.out == Fill(40 + 2 * k, 2), "rank %d step %d: %s", r, k, st.message.c_str());
        }
        // A grouped op of the odd set: a rank of another set that left is no member of it.
        Call a(SHOAL_OP_ALLREDUCE, "", Fill(r, 2), odd), b(SHOAL_OP_ALLREDUCE, "", Fill(2 * r, 3), odd);
        std::vector<shoal_op_desc> d(2);
        for (Call* c : {&a, &b}) {
          c->shape = {static_cast<int64_t>(c->x.size())};
          c->out.assign(c->x.size(), 0.0);
          shoal_op_desc& one = d[c == &a ? 0 : 1];
          one.op = SHOAL_OP_ALLREDUCE;
          one.input = {c->x.data(), SHOAL_FLOAT64, 1, c->shape.data(), SHOAL_DEVICE_CPU, 0, nullptr, nullptr};
          one.output = one.input;
          one.output.data = c->out.data();
          one.reduce_op = SHOAL_REDUCE_SUM;
          one.process_set = odd;
        }
        std::vector<int64_t> h = rt.EnqueueGroup("g", d.data(), 2, nullptr, nullptr);
        a.handle = h[0];
        b.handle = h[1];
        Status sa = a.Wait(rt), sb = b.Wait(rt);
        CHECK(sa.ok() && sb.ok() && a.out == Fill(4, 2) && b.out == Fill(8, 3), "rank %d group: %s %s", r,
              sa.message.c_str(), sb.message.c_str());
        if (r == 3) {
          Call c(SHOAL_OP_ALLREDUCE, "y", Fill(1, 2), led);  // its leader left
          Status st = c.Run(rt);
          CHECK(!st.ok() && st.message.find("rank 2 left") != std::string::npos, "rank 3: %s", st.message.c_str());
        }
      }
    });
  }
  g_case = "dead member";
  Job job(4, StallConfig(8 << 20), 35);
  job.Run([&](int r, Runtime& rt) {
    const int32_t even = Add(rt, {0, 2}), odd = Add(rt, {1, 3});
    if (r == 3) {
      job.world->Kill(3);
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (r == 1) {
      Call c(SHOAL_OP_ALLREDUCE, "x", Fill(1, 2), odd);
      Status st = c.Run(rt);
      CHECK(!st.ok() && st.message.find("missing ranks 3") != std::string::npos, "rank 1: %s", st.message.c_str());
    } else {
      Call c(SHOAL_OP_ALLREDUCE, "x", Fill(r, 2), even);
      Status st = c.Run(rt);
      CHECK(st.ok() && c.out == Fill(2, 2), "rank %d: %s", r, st.message.c_str());
    }
  });
}

// Fresh names past a name limit of 16, in {0, 2} and {1, 3} and (every third op) in the
// global set: each set retires its own names, as many on each of its members; exact sums.
static void TestFreshNames() {
  g_case = "fresh names in sets";
  Config cfg = TestConfig(8 << 20);
  cfg.name_limit = 16;
  Job job(4, cfg, 29);
  std::vector<int64_t> retired(4);
  job.Run([&](int r, Runtime& rt) {
    const int32_t even = Add(rt, {0, 2}), odd = Add(rt, {1, 3}), mine = r % 2 ? odd : even;
    for (int k = 0; k < 120; ++k) {
      const bool global = k % 3 == 2;
      Call c(SHOAL_OP_ALLREDUCE, "f." + std::to_string(k), Fill(r + k, 2), global ? 0 : mine);
      Status st = c.Run(rt);
      const double want = global ? 6 + 4 * k : (r % 2 ? 4 : 2) + 2 * k;  // ranks {0..3} or the set's two
      CHECK(st.ok() && c.out == Fill(want, 2), "rank %d op %d: %s", r, k, st.message.c_str());
    }
    CHECK(job.Settle([&] { return RetiredAlike(job, 2); }), "rank %d: the ranks' retired names never agreed", r);
    retired[r] = rt.stats().names_retired;
    const size_t before = rt.submissions().NameCount();
    CHECK(Remove(rt, even).ok() && Remove(rt, odd).ok(), "rank %d: removes", r);
    // The removed sets' names are forgotten (at least the 2 of their last ops).
    CHECK(rt.submissions().NameCount() + 2 <= before, "rank %d: %zu names before the removes, %zu after", r, before, rt.submissions().NameCount());
  });
  for (int r = 0; r < 4; ++r)
    CHECK(retired[r] > 0 && retired[r] == retired[r % 2], "rank %d retired %lld names, rank %d %lld", r,
          static_cast<long long>(retired[r]), r % 2, static_cast<long long>(retired[r % 2]));
}

int main() {
  TestAddRemove();
  TestDisjointSets();
  TestOpsAndCache(8 << 20);
  TestOpsAndCache(0);
  TestMismatch();
  TestMissingCall();
  TestRefusedCalls();
  TestLeaverAndDeath();
  TestFreshNames();
  std::printf("%d passed, %d failed\n", g_passed.load(), g_failed.load());
  return g_failed ? 1 : 0;
}
