// Unit tests of machine-local ops (machine scope: BlueFog's is_hierarchical_local) in the
// Runtime over the fake backend, N ranks as threads in machines of L ranks (docs/design.md
// §19): each machine negotiates them with its own coordinator, so machines with their own
// names and their own numbers of rounds complete without the others (the other machines
// wait until one machine is done), in any order of submission; within a machine, fused
// and grouped allreduces and broadcasts are exact, a mismatch and a refusal at the call
// fail every rank of that machine alike (the others go on), a stall is an error naming
// the missing rank, and a dead rank fails its machine's op while the others complete.
// tests/test_core_cpp.py also runs it under ThreadSanitizer. Exit status 0 = all passed.
#include <algorithm>
#include <atomic>
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

// One float64 allreduce (or broadcast) with machine or world scope.
struct Local {
  std::string name;
  int op = SHOAL_OP_ALLREDUCE, rop = SHOAL_REDUCE_SUM, root = 0, scope = SHOAL_SCOPE_MACHINE, dtype = SHOAL_FLOAT64;
  std::vector<double> x, out;
  std::vector<int64_t> shape;
  int64_t handle = 0;

  Local(std::string n, std::vector<double> v) : name(std::move(n)), x(std::move(v)) {}
  shoal_op_desc Desc() {
    if (shape.empty()) shape = {static_cast<int64_t>(x.size())};
    out.assign(x.size(), 0.0);
    shoal_op_desc d{};
    d.op = op;
    d.name = name.empty() ? nullptr : name.c_str();
    d.input = {x.data(), dtype, static_cast<int32_t>(shape.size()), shape.data(), SHOAL_DEVICE_CPU, 0, nullptr, nullptr};
    d.output = d.input;
    d.output.data = out.data();
    d.reduce_op = rop;
    d.root_rank = root;
    d.scope = scope;
    return d;
  }
  // Its status, or the refusal at the call as a status.
  Status Start(Runtime& rt) {
    try {
      handle = rt.Enqueue(Desc());
      return Status::Ok();
    } catch (const ArgumentError& ex) {
      return Status::Error(ex.code, ex.what());
    }
  }
  Status Wait(Runtime& rt) {
    Status st = rt.Wait(handle);
    rt.submissions().Release(handle);
    return st;
  }
  Status Run(Runtime& rt) {
    Status st = Start(rt);
    return st.ok() ? Wait(rt) : st;
  }
};

// The sum over machine m's ranks (L each) of Data(r, k, len).
std::vector<double> MachineSum(int m, int L, int k, size_t len) {
  std::vector<double> s(len, 0.0);
  for (int r = m * L; r < (m + 1) * L; ++r) {
    auto x = Data(r, k, len);
    for (size_t i = 0; i < len; ++i) s[i] += x[i];
  }
  return s;
}

// Waits (at most 30 s) until `count` reaches `want`: false if it never does.
bool Await(const std::atomic<int>& count, int want) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (count.load() < want) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

// Machine m runs 2 + 3m named rounds of its own names ("m<m>.<k>") and of a shared name,
// and 1 + m unnamed ones, each rank in its own order; machine 0 finishes all of them while
// every other machine waits for it to, then the others run theirs in turn from the last
// machine down (so no machine's ops can need another's). A world allreduce after them, and
// an unnamed one, still pair up: exact sums everywhere. Machine leaders other than rank 0
// counted negotiations of their own.
void TestPerMachineRounds(int n, int L, int64_t fusion) {
  g_case = "per-machine rounds n=" + std::to_string(n) + " L=" + std::to_string(L) + " fusion=" + std::to_string(fusion);
  Job job(n, NoStallConfig(fusion), 5 + n + L, 150, L);
  const int M = n / L;
  std::atomic<int> done_machines{0};
  std::vector<std::atomic<int>> finished(M);
  job.Run([&](int r, Runtime& rt) {
    const int m = r / L, rounds = 2 + 3 * m;
    // Machine 0 first, then M-1, M-2, ...: machine m waits for the ones before it in that order.
    const int turn = m == 0 ? 0 : M - m;
    CHECK(Await(done_machines, turn), "rank %d: the machines before it never finished", r);
    std::vector<Local> ops;
    for (int k = 0; k < rounds; ++k) {
      ops.emplace_back("m" + std::to_string(m) + "." + std::to_string(k), Data(r, k, 3 + 17 * (k % 3)));
      ops.emplace_back("shared", Data(r, 100 + k, 5));
    }
    std::mt19937 rng(r * 31 + L);
    // The shared name's rounds in order (one in flight at a time); the own names in any order.
    std::vector<size_t> own;
    for (size_t i = 0; i < ops.size(); i += 2) own.push_back(i);
    std::shuffle(own.begin(), own.end(), rng);
    for (size_t i : own) CHECK(ops[i].Start(rt).ok(), "rank %d: %s refused", r, ops[i].name.c_str());
    for (size_t i = 1; i < ops.size(); i += 2) {
      Status st = ops[i].Run(rt);
      CHECK(st.ok() && ops[i].out == MachineSum(m, L, 100 + static_cast<int>(i / 2), 5), "rank %d shared round %zu: %s",
            r, i / 2, st.message.c_str());
    }
    std::shuffle(own.begin(), own.end(), rng);
    for (size_t i : own) {
      Status st = ops[i].Wait(rt);
      const int k = static_cast<int>(i / 2);
      CHECK(st.ok() && ops[i].out == MachineSum(m, L, k, ops[i].x.size()), "rank %d %s: %s", r, ops[i].name.c_str(),
            st.message.c_str());
    }
    for (int k = 0; k <= m; ++k) {  // unnamed, machine-local: as many as the machine's number
      Local u("", Data(r, 200 + k, 2));
      Status st = u.Run(rt);
      CHECK(st.ok() && u.out == MachineSum(m, L, 200 + k, 2), "rank %d unnamed local %d: %s", r, k, st.message.c_str());
    }
    if (++finished[m] == L) ++done_machines;
    CHECK(Await(done_machines, M), "rank %d: not every machine finished", r);
    if (r % L == 0 && r != 0)
      CHECK(rt.stats().negotiations > 0, "rank %d leads machine %d but negotiated nothing", r, m);
    std::vector<double> world(4, 0.0);
    for (int q = 0; q < n; ++q)
      for (int i = 0; i < 4; ++i) world[i] += Data(q, 300, 4)[i];
    for (const char* name : {"world.after", ""}) {  // named, then unnamed: every rank's name pairs up
      Local w(name, Data(r, 300, 4));
      w.scope = SHOAL_SCOPE_WORLD;
      Status st = w.Run(rt);
      CHECK(st.ok() && w.out == world, "rank %d world allreduce '%s' after: %s", r, name, st.message.c_str());
    }
  });
}

// Broadcast from local rank 1 and a grouped allreduce (one negotiation, fused), machine-local.
void TestBroadcastAndGroup(int n, int L) {
  g_case = "broadcast and group n=" + std::to_string(n) + " L=" + std::to_string(L);
  Job job(n, NoStallConfig(8 << 20), 7 + n, 150, L);
  job.Run([&](int r, Runtime& rt) {
    const int m = r / L;
    Local b("bcast", Data(r, 1, 6));
    b.op = SHOAL_OP_BROADCAST;
    b.root = 1;  // a local rank
    Status st = b.Run(rt);
    CHECK(st.ok() && b.out == Data(m * L + 1, 1, 6), "rank %d: broadcast from local rank 1: %s", r, st.message.c_str());
    std::vector<Local> members;
    for (int k = 0; k < 3; ++k) members.emplace_back("", Data(r, 10 + k, 2 + k));
    std::vector<shoal_op_desc> descs;
    for (auto& x : members) descs.push_back(x.Desc());
    const int64_t fused_before = rt.stats().fused_batches;
    std::vector<int64_t> hs = rt.EnqueueGroup("grp", descs.data(), 3, nullptr, nullptr);
    for (int k = 0; k < 3; ++k) {
      st = rt.Wait(hs[k]);
      rt.submissions().Release(hs[k]);
      CHECK(st.ok() && members[k].out == MachineSum(m, L, 10 + k, 2 + k), "rank %d group member %d: %s", r, k,
            st.message.c_str());
    }
    CHECK(rt.stats().fused_batches == fused_before + 1, "rank %d: the group's three allreduces ran as %lld fused batches",
          r, static_cast<long long>(rt.stats().fused_batches - fused_before));
  });
}

// Within machine 1, rank L+1 submits another shape (a mismatch), then refuses a call at the
// call (bool allreduce): every rank of machine 1 gets the same error each time, while the
// other machines' ops of those names complete, and the names are usable again; then a stall
// (rank L+1 never submits) is an error naming it on machine 1's other ranks.
void TestErrors(int n, int L) {
  g_case = "errors n=" + std::to_string(n) + " L=" + std::to_string(L);
  Job job(n, StallConfig(8 << 20), 11 + n, 150, L);
  const int odd = L + 1;
  std::vector<std::string> mismatch(n), refusal(n);
  job.Run([&](int r, Runtime& rt) {
    const int m = r / L;
    Local a("mm", Data(r, 0, r == odd ? 5 : 4));
    Status st = a.Run(rt);
    if (m == 1) {
      CHECK(st.code == SHOAL_MISMATCH && st.message.find("mm") != std::string::npos, "rank %d: %d %s", r, st.code,
            st.message.c_str());
      mismatch[r] = st.message;
    } else {
      CHECK(st.ok() && a.out == MachineSum(m, L, 0, 4), "rank %d: %s", r, st.message.c_str());
    }
    Local b("refused", Data(r, 1, 3));
    if (r == odd) b.dtype = SHOAL_BOOL;
    st = b.Run(rt);
    if (m == 1) {
      CHECK(st.code == SHOAL_INVALID_ARGUMENT && st.message.find("bool tensors cannot be reduced") != std::string::npos,
            "rank %d: %d %s", r, st.code, st.message.c_str());
      refusal[r] = st.message.substr(0, st.message.find(" (raised at the call"));
    } else {
      CHECK(st.ok() && b.out == MachineSum(m, L, 1, 3), "rank %d: %s", r, st.message.c_str());
    }
    for (const char* name : {"mm", "refused"}) {  // usable again
      Local again(name, Data(r, 3, 2));
      st = again.Run(rt);
      CHECK(st.ok() && again.out == MachineSum(m, L, 3, 2), "rank %d: '%s' again: %s", r, name, st.message.c_str());
    }
    if (r != odd) {  // the stall, last: rank `odd` never submits this one
      Local s("stalled", Data(r, 2, 2));
      st = s.Run(rt);
      if (m == 1)
        CHECK(st.code != SHOAL_OK && st.message.find("missing ranks " + std::to_string(odd)) != std::string::npos,
              "rank %d: %d %s", r, st.code, st.message.c_str());
      else
        CHECK(st.ok() && s.out == MachineSum(m, L, 2, 2), "rank %d: %s", r, st.message.c_str());
    }
  });
  for (int r = L; r < 2 * L; ++r) {
    CHECK(mismatch[r] == mismatch[L], "rank %d: %s vs %s", r, mismatch[r].c_str(), mismatch[L].c_str());
    CHECK(refusal[r] == refusal[L], "rank %d: %s vs %s", r, refusal[r].c_str(), refusal[L].c_str());
  }
}

// The last rank dies before its machine-local op: its machine's other ranks fail (naming
// it) instead of waiting; every other machine's op completes exactly.
void TestDeadRank(int n, int L) {
  g_case = "dead rank n=" + std::to_string(n) + " L=" + std::to_string(L);
  Job job(n, StallConfig(8 << 20), 13 + n, 150, L);
  const int dead = n - 1, M = n / L;
  job.Run([&](int r, Runtime& rt) {
    const int m = r / L;
    if (r == dead) {
      job.world->Kill(dead);
      return;
    }
    Local a("after.death", Data(r, 0, 8));
    Status st = a.Run(rt);
    if (m == M - 1)
      CHECK(!st.ok() && st.message.find("missing ranks " + std::to_string(dead)) != std::string::npos, "rank %d: %d %s", r, st.code,
            st.message.c_str());
    else
      CHECK(st.ok() && a.out == MachineSum(m, L, 0, 8), "rank %d: %s", r, st.message.c_str());
  });
}

}  // namespace

int main() {
  for (auto [n, L] : {std::pair{4, 2}, std::pair{8, 2}, std::pair{8, 4}}) {
    TestPerMachineRounds(n, L, 8 << 20);
    TestPerMachineRounds(n, L, 0);
    TestBroadcastAndGroup(n, L);
    TestErrors(n, L);
    TestDeadRank(n, L);
  }
  std::printf("%d passed, %d failed\n", g_passed.load(), g_failed.load());
  return g_failed ? 1 : 0;
}
