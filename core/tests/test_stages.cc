// Unit tests of the multi-stage op of the Runtime, hierarchical_neighbor_allreduce
// (ops/stages.cc, neighbor/sharded_exchange.cc), with N ranks as threads over the fake
// backend in machines of L ranks: exact results in static-like and weighted modes with
// ranks submitting several ops in different orders, tensors of several pieces in and out
// of place, a call refused on one rank failing every rank the same way (and the name
// usable again), shapes that differ between machines failing the ranks that meet them,
// a dead rank failing the others instead of hanging.
// tests/test_core_cpp.py also runs them under ThreadSanitizer. Exit status 0 = all passed.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "testing/runtime_harness.h"

using namespace shoal;
using namespace shoal::testing;

namespace {

// A hierarchical op over machines: recv/send hold machine ids.
struct Hier : Op {
  Hier() { op = SHOAL_OP_HIERARCHICAL_NEIGHBOR_ALLREDUCE; }
};

// Machine m's sum of the k-th inputs (one value per element), as the fake backend adds them.
std::vector<double> MachineSum(int m, int L, int k, size_t len) {
  std::vector<double> s(len, 0.0);
  for (int r = m * L; r < (m + 1) * L; ++r) {
    auto x = Data(r, k, len);
    for (size_t i = 0; i < len; ++i) s[i] += x[i];
  }
  return s;
}

// Enqueues and waits for `h`: its status, or the refusal at the call as a status.
Status Called(Hier& h, Runtime& rt) {
  try {
    h.Enqueue(rt);
    return h.Wait(rt);
  } catch (const ArgumentError& ex) {
    return Status::Error(ex.code, ex.what());
  }
}

std::vector<int32_t> MachineRing(int m, int M) {
  if (M == 2) return {1 - m};
  return {(m + M - 1) % M, (m + 1) % M};
}

// Every rank submits `k_ops` ops in its own order (uniform over the machine ring, and
// weighted with dst weights), waits in another: every result is the op's formula, computed
// with the same operations (sum then divide, then divide by L).
void TestValues(int n, int L, int64_t fusion) {
  g_case = "hierarchical values n=" + std::to_string(n) + " L=" + std::to_string(L) + " fusion=" + std::to_string(fusion);
  Job job(n, TestConfig(fusion), 17 + n + L, 150, L);
  const int M = n / L, k_ops = 6;
  for (int round = 0; round < 2; ++round) {
    job.Run([&](int r, Runtime& rt) {
      const int m = r / L;
      std::vector<Hier> ops(k_ops);
      std::vector<int> order(k_ops);
      for (int k = 0; k < k_ops; ++k) order[k] = k;
      std::mt19937 rng(r * 13 + round);
      std::shuffle(order.begin(), order.end(), rng);
      for (int k : order) {
        Hier& h = ops[k];
        h.name = "hier." + std::to_string(k);
        h.x = Data(r, k, 3 + 29 * k);
        h.recv = h.send = MachineRing(m, M);
        if (k % 2) {  // weighted: 0.25 to itself, 0.75 over the in-machines; senders scale by 2
          h.uniform = false;
          h.self_w = 0.25;
          h.recv_w.assign(h.recv.size(), 0.75 / h.recv.size());
          h.send_w.assign(h.send.size(), 2.0);
        }
        h.Enqueue(rt);
      }
      std::shuffle(order.begin(), order.end(), rng);
      for (int k : order) {
        Hier& h = ops[k];
        Status st = h.Wait(rt);
        CHECK(st.ok(), "rank %d op %d: %s", r, k, st.message.c_str());
        if (!st.ok()) continue;
        const size_t len = h.x.size();
        auto mine = MachineSum(m, L, k, len);
        bool exact = true;
        for (size_t i = 0; i < len; ++i) {
          double want;
          if (h.uniform) {
            want = mine[i];
            for (int src : h.recv) want += MachineSum(src, L, k, len)[i];
            want /= static_cast<double>(h.recv.size() + 1);
          } else {
            want = h.self_w * mine[i];
            for (size_t j = 0; j < h.recv.size(); ++j) want += h.recv_w[j] * (2.0 * MachineSum(h.recv[j], L, k, len)[i]);
          }
          exact = exact && h.out[i] == want / L;
        }
        CHECK(exact, "rank %d op %d: not the hierarchical average", r, k);
      }
      CHECK(rt.stats().hierarchical_neighbor_allreduce == (round + 1) * k_ops, "rank %d: %lld ops counted", r,
            static_cast<long long>(rt.stats().hierarchical_neighbor_allreduce.load()));
    });
  }
}

// One rank refuses the call (a machine id out of range): every rank gets that error, from
// whichever stage it waits in, and the name then works again on every rank. Unnamed ops
// pair up before and after.
void TestRefused(int n, int L) {
  g_case = "hierarchical refused n=" + std::to_string(n) + " L=" + std::to_string(L);
  Job job(n, TestConfig(8 << 20), 3 + n, 100, L);
  const int M = n / L, bad = n - 1;
  std::vector<std::string> errors(n);
  job.Run([&](int r, Runtime& rt) {
    const int m = r / L;
    Hier u;  // unnamed
    u.x = Data(r, 0, 4);
    u.recv = u.send = MachineRing(m, M);
    u.Enqueue(rt);
    CHECK(u.Wait(rt).ok(), "rank %d: unnamed op failed", r);
    Hier h;
    h.name = "hier.refused";
    h.x = Data(r, 1, 4);
    h.recv = h.send = MachineRing(m, M);
    if (r == bad) h.recv = {static_cast<int32_t>(M + 3)};
    Status st = Called(h, rt);
    CHECK(st.code == SHOAL_INVALID_ARGUMENT && st.message.find("receive machine ranks: rank " + std::to_string(M + 3) +
                                                               " is outside [0, " + std::to_string(M) + ")") !=
                                                   std::string::npos,
          "rank %d: %d %s", r, st.code, st.message.c_str());
    errors[r] = st.message.substr(0, st.message.find(" (raised at the call"));
    Hier again;
    again.name = "hier.refused";
    again.x = Data(r, 2, 4);
    again.recv = again.send = MachineRing(m, M);
    again.Enqueue(rt);
    st = again.Wait(rt);
    CHECK(st.ok(), "rank %d: the name after the refusal: %s", r, st.message.c_str());
    Hier u2;
    u2.x = Data(r, 3, 4);
    u2.recv = u2.send = MachineRing(m, M);
    u2.Enqueue(rt);
    st = u2.Wait(rt);
    CHECK(st.ok(), "rank %d: unnamed op after the refusal: %s", r, st.message.c_str());
  });
  for (int r = 0; r < n; ++r) CHECK(errors[r] == errors[bad], "rank %d: %s vs %s", r, errors[r].c_str(), errors[bad].c_str());
}

// A rank dies after its op's first stage may have started: every other rank's op ends
// (an error naming the dead rank, or the exact result where it needed nothing of it).
void TestDeadRank(int n, int L) {
  g_case = "hierarchical dead rank n=" + std::to_string(n) + " L=" + std::to_string(L);
  Hier left;  // the dead rank's op: its memory stays until its runtime stops
  Job job(n, StallConfig(8 << 20), 23 + n, 200, L);
  const int M = n / L, dead = n - 1;
  job.Run([&](int r, Runtime& rt) {
    Hier mine;
    Hier& h = r == dead ? left : mine;
    h.name = "hier.dead";
    h.x = Data(r, 0, 64);
    h.recv = h.send = MachineRing(r / L, M);
    h.Enqueue(rt);
    if (r == dead) {
      job.world->Kill(dead);
      return;
    }
    Status st = h.Wait(rt);
    CHECK(!st.ok(), "rank %d: completed although rank %d died in the machine sum", r, dead);
  });
}

// Hierarchical ops of fresh names and of a pool of 10 reused names, past a name limit of
// 24 (four names per op: its own and its stages'), every seventh refused at the call on the
// last rank: names are retired with their stages, as many on every rank; a refusal fails
// that call on every rank alike and no later one (after retirement too: steps restart at
// 0); every other result is the uniform hierarchical average.
void TestFreshNames(int n, int L) {
  g_case = "hierarchical fresh names n=" + std::to_string(n) + " L=" + std::to_string(L);
  Config cfg = TestConfig(8 << 20);
  cfg.name_limit = 24;
  Job job(n, cfg, 41 + n + L, 150, L);
  const int M = n / L, bad = n - 1;
  std::vector<int64_t> retired(n);
  job.Run([&](int r, Runtime& rt) {
    const int m = r / L;
    for (int k = 0; k < 90; ++k) {
      Hier h;
      h.name = k % 3 ? "fresh." + std::to_string(k) : "pool." + std::to_string(k / 3 % 10);
      h.x = Data(r, k, 3);
      h.recv = h.send = MachineRing(m, M);
      const bool refused = k % 7 == 3;
      if (refused && r == bad) h.recv = {static_cast<int32_t>(M + 3)};
      Status st = Called(h, rt);
      if (refused) {
        CHECK(st.code == SHOAL_INVALID_ARGUMENT && st.message.find("is outside [0, " + std::to_string(M) + ")") !=
                                                       std::string::npos,
              "rank %d op %d (%s): %d %s", r, k, h.name.c_str(), st.code, st.message.c_str());
        continue;
      }
      std::vector<double> want = MachineSum(m, L, k, 3);
      for (int src : h.recv)
        for (size_t i = 0; i < 3; ++i) want[i] += MachineSum(src, L, k, 3)[i];
      for (auto& w : want) w = w / static_cast<double>(h.recv.size() + 1) / L;
      CHECK(st.ok() && h.out == want, "rank %d op %d (%s): %s", r, k, h.name.c_str(), st.message.c_str());
    }
    CHECK(job.Settle([&] { return RetiredAlike(job); }), "rank %d: the ranks' retired names never agreed", r);
    retired[r] = rt.stats().names_retired;
  });
  for (int r = 0; r < n; ++r)
    CHECK(retired[r] > 0 && retired[r] == retired[0], "rank %d retired %lld names, rank 0 %lld", r,
          static_cast<long long>(retired[r]), static_cast<long long>(retired[0]));
}

// Tensors of several pieces per shard (neighbor/sharded_exchange.h), out of place and in
// place (output = input: a rank's slices leave before its result lands there), float64
// and float32, weighted: every element is the hierarchical average, computed with the
// same operations.
void TestLarge(int n, int L) {
  g_case = "hierarchical large n=" + std::to_string(n) + " L=" + std::to_string(L);
  Job job(n, NoStallConfig(8 << 20), 29 + n + L, 200, L);  // 5 MiB a rank: slow under sanitizers
  const int M = n / L;
  const size_t len = 600001;  // 2 pieces a shard at L=2 (float64), 1 elsewhere
  job.Run([&](int r, Runtime& rt) {
    const int m = r / L;
    for (int k = 0; k < 4; ++k) {
      const bool in_place = k % 2 == 1, f32 = k >= 2;
      Hier h;
      h.name = "large." + std::to_string(k);
      h.dtype = f32 ? SHOAL_FLOAT32 : SHOAL_FLOAT64;
      h.x = Data(r, k, len);
      h.recv = h.send = MachineRing(m, M);
      h.uniform = false;
      h.self_w = 0.5;
      h.recv_w.assign(h.recv.size(), 0.5 / h.recv.size());
      std::vector<float> x32(h.x.begin(), h.x.end());
      std::vector<int64_t> shape{static_cast<int64_t>(len)};
      shoal_op_desc d{};
      d.op = h.op;
      d.name = h.name.c_str();
      d.input = {f32 ? static_cast<void*>(x32.data()) : h.x.data(), h.dtype, 1, shape.data(), SHOAL_DEVICE_CPU, 0,
                 nullptr, nullptr};
      h.out.assign(len, -1.0);
      std::vector<float> out32(len, -1.0f);
      d.output = d.input;
      if (!in_place) d.output.data = f32 ? static_cast<void*>(out32.data()) : h.out.data();
      d.self_weight = h.self_w;
      d.uniform = false;
      d.n_recv = d.n_send = static_cast<int32_t>(h.recv.size());
      d.recv_ranks = h.recv.data();
      d.recv_weights = h.recv_w.data();
      d.send_ranks = h.send.data();
      h.handle = rt.Enqueue(d);
      Status st = h.Wait(rt);
      CHECK(st.ok(), "rank %d op %d: %s", r, k, st.message.c_str());
      if (!st.ok()) continue;
      std::vector<std::vector<double>> sums;
      for (int src : h.recv) sums.push_back(MachineSum(src, L, k, len));
      const auto mine = MachineSum(m, L, k, len);
      size_t wrong = 0;
      for (size_t i = 0; i < len; ++i) {
        double want = 0.5 * mine[i];
        for (size_t j = 0; j < sums.size(); ++j) want += h.recv_w[j] * sums[j][i];
        want /= L;
        const double got = f32 ? (in_place ? x32[i] : out32[i]) : (in_place ? h.x[i] : h.out[i]);
        // float32: the same operations in float32 (values below 2^24: exact)
        wrong += got != want;
      }
      CHECK(wrong == 0, "rank %d op %d: %zu elements not the hierarchical average", r, k, wrong);
    }
  });
}

// Past a name's negotiated first step, machine 0's ranks hold one element more: every rank
// of machine 0 and of its neighbor machines fails naming both shapes; the others complete,
// or fail with that error (the step's refusal reached them first).
void TestShapes(int n, int L) {
  g_case = "hierarchical shapes n=" + std::to_string(n) + " L=" + std::to_string(L);
  Job job(n, TestConfig(8 << 20), 31 + n + L, 200, L);
  const int M = n / L;
  job.Run([&](int r, Runtime& rt) {
    const int m = r / L;
    for (int step = 0; step < 2; ++step) {
      Hier h;
      h.name = "large.shapes";
      h.x = Data(r, 9, 1001 + (step == 1 && m == 0 ? 1 : 0));
      h.recv = h.send = MachineRing(m, M);
      h.Enqueue(rt);
      Status st = h.Wait(rt);
      const auto ring = MachineRing(m, M);
      const bool involved = m == 0 || std::find(ring.begin(), ring.end(), 0) != ring.end();
      if (step == 0 || (!involved && st.ok())) {
        CHECK(st.ok(), "rank %d step %d: %s", r, step, st.message.c_str());
        continue;
      }
      CHECK(!st.ok() && st.message.find("float64[1002]") != std::string::npos &&
                st.message.find("float64[1001]") != std::string::npos,
            "rank %d: %s", r, st.ok() ? "completed with different shapes" : st.message.c_str());
    }
  });
}

// A call refused on the last rank at step 2, where the exchange no longer asks the
// coordinator (its parts already run on the other ranks, and the refusing rank goes on to
// step 3 at once): the ranks of its machine and of their neighbor machines fail that step
// (the others may complete it, exactly), and the name's later steps are exact on every rank
// (no piece of step 2 or 3 is taken for the other). Also machines of one rank.
void TestRefusedLater(int n, int L, size_t len) {
  g_case = "hierarchical refused later n=" + std::to_string(n) + " L=" + std::to_string(L) + " len=" +
           std::to_string(len);
  Job job(n, NoStallConfig(8 << 20), 5 + n + L, 100, L);
  const int M = n / L, bad = n - 1;
  job.Run([&](int r, Runtime& rt) {
    const int m = r / L;
    for (int step = 0; step < 6; ++step) {
      Hier h;
      h.name = "hier.later";
      h.x = Data(r, step, len);
      h.recv = h.send = MachineRing(m, M);
      if (step == 2 && r == bad) {
        std::this_thread::sleep_for(std::chrono::milliseconds(30));  // the others' parts start first
        h.recv = {static_cast<int32_t>(M + 3)};
      }
      Status st = Called(h, rt);
      const int bad_m = bad / L;
      const auto ring = MachineRing(m, M);
      const bool involved = m == bad_m || std::find(ring.begin(), ring.end(), bad_m) != ring.end();
      if (step == 2 && (involved || !st.ok())) {
        CHECK(!st.ok() && st.message.find("is outside [0, ") != std::string::npos, "rank %d: %s", r,
              st.ok() ? "the refused step completed" : st.message.c_str());
        continue;
      }
      CHECK(st.ok(), "rank %d step %d: %s", r, step, st.message.c_str());
      if (!st.ok()) continue;
      std::vector<double> want = MachineSum(m, L, step, len);
      for (int src : h.recv) {
        auto o = MachineSum(src, L, step, len);
        for (size_t i = 0; i < len; ++i) want[i] += o[i];
      }
      for (auto& w : want) w = w / static_cast<double>(h.recv.size() + 1) / L;
      CHECK(h.out == want, "rank %d step %d: not the hierarchical average", r, step);
    }
  });
}

}  // namespace

int main() {
  for (auto [n, L] : {std::pair{4, 2}, std::pair{8, 2}, std::pair{8, 4}}) {
    TestValues(n, L, 8 << 20);
    TestValues(n, L, 0);
    TestRefused(n, L);
    TestDeadRank(n, L);
    TestFreshNames(n, L);
    TestShapes(n, L);
    TestRefusedLater(n, L, 5);
    if (n == 4) {  // 5 MiB a rank: once
      TestLarge(n, L);
      TestRefusedLater(n, L, 200001);
    }
  }
  TestRefusedLater(4, 1, 5);  // machines of one rank
  std::printf("%d passed, %d failed\n", g_passed.load(), g_failed.load());
  return g_failed ? 1 : 0;
}
