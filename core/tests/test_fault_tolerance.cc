// Fault-tolerant mode in one process (docs/design.md §16): N runtimes as threads over a
// fault-tolerant fake world (fake_backend.h), one rank killed at each point of an op's life
// (before the survivors submit it, while the coordinator waits for its request, in the
// middle of a neighbor exchange, inside a fused batch; the coordinator itself among them).
// Every survivor's op then ends, without a hang, either complete with exact data (it
// finished before the loss) or with SHOAL_RANK_LOST, later calls are refused with
// SHOAL_RANK_LOST, and a fresh job of the survivors (the shrink) runs exactly. At 2, 4, 8.
// Also the window queue after a loss (windows/windows.h): a job stuck in the engine (a
// flush to a dead rank) is left by its waiter and then writes nothing of the caller's, jobs
// behind it fail, and Abandon() returns without it.
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "testing/runtime_harness.h"
#include "windows/windows.h"

using namespace shoal;
using namespace shoal::testing;

namespace {

enum Point { kBeforeSubmission, kDuringNegotiation, kMidExchange, kInFusedBatch };
const char* const kPointNames[] = {"before submission", "during negotiation", "mid-exchange", "in a fused batch"};

Config FaultConfig() {
  Config c = TestConfig(8 << 20);
  c.fault_tolerant = true;
  c.stall_check_time = 30;  // a lost rank must end the ops, not the stall check
  c.stall_shutdown_time = 60;
  return c;
}

// An op of a survivor ended by the loss: complete with `exact` data, or SHOAL_RANK_LOST.
void CheckEnded(const Status& st, bool exact, int r, const char* what) {
  if (st.ok()) {
    CHECK(exact, "rank %d %s: completed with wrong data", r, what);
  } else {
    CHECK(st.code == SHOAL_RANK_LOST, "rank %d %s: code %d, not SHOAL_RANK_LOST: %s", r, what, st.code,
          st.message.c_str());
  }
}

// Enqueues `a`; false if the loss came first (refused with SHOAL_RANK_LOST, checked).
bool Submit(Op& a, Runtime& rt, int r) {
  try {
    a.Enqueue(rt);
    return true;
  } catch (const ArgumentError& ex) {
    CHECK(ex.code == SHOAL_RANK_LOST, "rank %d: %s refused with code %d: %s", r, a.name.c_str(), ex.code, ex.what());
    return false;
  }
}

// Until the victim's thread has killed it (the survivors' threads may get there first).
void WaitForLoss(Runtime& rt) {
  for (int i = 0; i < 10000 && !rt.Lost(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

// Later calls on the lost runtime are refused with SHOAL_RANK_LOST.
void CheckRefused(Runtime& rt, int r) {
  Op later;
  later.op = SHOAL_OP_ALLREDUCE;
  later.name = "later";
  later.x = Data(r, 9, 4);
  try {
    later.Enqueue(rt);
    CHECK(false, "rank %d: an op after the loss was accepted", r);
  } catch (const ArgumentError& ex) {
    CHECK(ex.code == SHOAL_RANK_LOST, "rank %d: refused with code %d: %s", r, ex.code, ex.what());
  }
}

void TestLoss(int n, int victim, Point point) {
  g_case = std::string("rank ") + std::to_string(victim) + " lost " + kPointNames[point] + " n=" + std::to_string(n);
  // Each rank's ops outlive every runtime: a killed rank's runtime may still run the ops its
  // thread submitted (a real dead process frees its runtime with them).
  std::vector<std::vector<Op>> held(n, std::vector<Op>(5));
  Job job(n, FaultConfig(), 40 + n + victim, point == kMidExchange ? 300 : 100);
  job.world->SetFaultTolerant();
  const auto t0 = std::chrono::steady_clock::now();
  job.Run([&](int r, Runtime& rt) {
    if (point == kBeforeSubmission) {
      if (r == victim) {
        job.world->Kill(victim);
        return;
      }
      WaitForLoss(rt);
      CheckRefused(rt, r);
      return;
    }
    if (point == kDuringNegotiation) {  // the coordinator waits for the victim's request
      if (r == victim) {
        std::this_thread::sleep_for(std::chrono::milliseconds(30));
        job.world->Kill(victim);
        return;
      }
      Op& a = held[r][0];
      a.op = SHOAL_OP_ALLREDUCE;
      a.name = "negotiated";
      a.x = Data(r, 0, 16);
      if (Submit(a, rt, r)) CheckEnded(a.Wait(rt), false, r, "allreduce");
      CheckRefused(rt, r);
      return;
    }
    if (point == kMidExchange) {  // a large neighbor exchange, the victim dies after sending part
      Op& a = held[r][0];
      a.name = "exchange";
      a.x = Data(r, 1, 1 << 18);
      a.recv = a.send = {(r + n - 1) % n, (r + 1) % n};
      if (n == 2) a.recv = a.send = {1 - r};
      const bool submitted = Submit(a, rt, r);
      if (r == victim) {
        std::this_thread::sleep_for(std::chrono::microseconds(500));
        job.world->Kill(victim);
        return;
      }
      if (submitted) {
        const Status st = a.Wait(rt);
        double sum = a.x[5];
        for (int src : a.recv) sum += Data(src, 1, 1 << 18)[5];
        CheckEnded(st, st.ok() && a.out[5] == sum / static_cast<double>(a.recv.size() + 1), r, "neighbor_allreduce");
      }
      WaitForLoss(rt);  // an exchange without the victim may end before it dies
      CheckRefused(rt, r);
      return;
    }
    // In a fused batch: every rank submits five allreduces; the victim dies after three.
    std::vector<Op>& ops = held[r];
    for (int k = 0; k < 5; ++k) {
      ops[k].op = SHOAL_OP_ALLREDUCE;
      ops[k].name = "fused." + std::to_string(k);
      ops[k].x = Data(r, k, 64);
      if (r == victim && k == 3) {
        job.world->Kill(victim);
        return;
      }
      if (!Submit(ops[k], rt, r)) ops[k].handle = 0;
    }
    for (int k = 0; k < 5; ++k) {
      if (ops[k].handle == 0) continue;
      double sum = 0;
      for (int q = 0; q < n; ++q) sum += Data(q, k, 64)[3];
      const Status st = ops[k].Wait(rt);
      // Ops the victim never submitted cannot complete.
      CheckEnded(st, st.ok() && k < 3 && ops[k].out[3] == sum, r, ("allreduce " + ops[k].name).c_str());
    }
    CheckRefused(rt, r);
  });
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(secs < 10, "the survivors took %.1f s to end their ops", secs);

  // The shrink: a fresh job over the n-1 survivors (renumbered) runs exactly.
  if (n < 3) return;
  Job survivors(n - 1, FaultConfig(), 7, 100);
  survivors.world->SetFaultTolerant();
  survivors.Run([&](int r, Runtime& rt) {
    Op a;
    a.op = SHOAL_OP_ALLREDUCE;
    a.name = "after";
    a.x = Data(r, 2, 8);
    a.Enqueue(rt);
    const Status st = a.Wait(rt);
    double sum = 0;
    for (int q = 0; q < n - 1; ++q) sum += Data(q, 2, 8)[4];
    CHECK(st.ok() && a.out[4] == sum, "survivor %d after the shrink: %s", r, st.message.c_str());
  });
}

// A window engine whose put blocks until released (a flush to a dead rank), then writes the
// caller's tensor as MpiWindows does: holding the write lock, and not once orphaned.
class StuckEngine : public WindowEngine {
 public:
  explicit StuckEngine(WindowCancel* cancel) : cancel_(cancel) {}
  std::atomic<bool> release{false}, entered{false}, wrote{false};
  Status Put(const WinArgs& a, bool) override {
    entered = true;
    while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::lock_guard<std::mutex> writing(cancel_->writing);
    if (cancel_->orphaned) return Status::Error(SHOAL_ABORTED, "orphaned");
    static_cast<double*>(a.data)[0] = 42.0;
    wrote = true;
    return Status::Ok();
  }
  Status Create(const WinArgs&) override { return Status::Ok(); }
  Status Free(const std::string&) override { return Status::Ok(); }
  Status Get(const WinArgs&) override { return Status::Ok(); }
  Status Update(const WinArgs&) override { return Status::Ok(); }
  Status Mutex(const WinArgs&, bool) override { return Status::Ok(); }
  Status Versions(const std::string&, std::vector<int>*, std::vector<int64_t>*) override { return Status::Ok(); }
  Status AssociatedP(const std::string&, double*) override { return Status::Ok(); }
  std::vector<std::string> Names() const override { return {}; }

 private:
  WindowCancel* cancel_;
};

void TestAbandonedWindows() {
  g_case = "window queue after a loss";
  StuckEngine* engine = nullptr;
  // Leaked, as the runtime leaks an abandoned queue: its thread may outlive Abandon().
  auto* q = new WindowQueue([&](WindowCancel* c) {
    auto e = std::make_unique<StuckEngine>(c);
    engine = e.get();
    return e;
  });
  std::atomic<bool> lost{false};
  q->SetLost([&lost] { return lost.load(); });
  auto data = std::make_shared<std::vector<double>>(1, 1.0);
  WinArgs a;
  a.data = data->data();
  const int64_t stuck = q->Submit([a](WindowEngine& w) { return w.Put(a, false); }, true);
  const int64_t behind = q->Submit([a](WindowEngine& w) { return w.Put(a, false); }, true);
  // The caller waits for the stuck job; its rank is then lost.
  for (int i = 0; i < 5000 && !engine->entered; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::thread loser([&lost] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    lost = true;
  });
  const auto t0 = std::chrono::steady_clock::now();
  Status st = q->Wait(stuck);
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  loser.join();
  CHECK(st.code == SHOAL_RANK_LOST && waited < 2.0, "the waiter of a stuck job: code %d after %.2f s: %s", st.code,
        waited, st.message.c_str());
  q->Abandon();  // returns with the job still stuck
  CHECK(q->Wait(behind).code == SHOAL_RANK_LOST, "a job queued behind the stuck one did not fail with SHOAL_RANK_LOST");
  engine->release = true;  // the flush returns at last: the job must not write the caller's tensor
  for (int i = 0; i < 5000 && q->Poll(stuck) != 1; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  CHECK(q->Poll(stuck) == 1 && !engine->wrote && (*data)[0] == 1.0,
        "the orphaned job wrote the caller's tensor (%g) or never ended", (*data)[0]);
}

}  // namespace

int main() {
  TestAbandonedWindows();
  for (int n : {2, 4, 8})
    for (int point : {kBeforeSubmission, kDuringNegotiation, kMidExchange, kInFusedBatch})
      for (int victim : {0, n - 1})  // rank 0 is the coordinator
        TestLoss(n, victim, static_cast<Point>(point));
  std::printf("%d passed, %d failed\n", g_passed.load(), g_failed.load());
  return g_failed ? 1 : 0;
}
