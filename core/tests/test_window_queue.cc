// The window thread's queue (core/src/windows/window_queue.cc) with puts that travel after
// their job returns (docs/design.md §23): quick ops start beside them, other ops wait for
// them, their errors reach their waiters, a shutdown or a loss ends them, and the number
// in flight is bounded.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "testing/runtime_harness.h"
#include "windows/windows.h"

using namespace shoal;
using shoal::testing::g_case;
using shoal::testing::g_failed;
using shoal::testing::g_passed;

namespace {

// Puts leave a travelling part that lands when `landed` is set (with `error`: fails);
// every op records its name when it starts.
class TravellingEngine : public WindowEngine {
 public:
  std::atomic<bool> landed{false};
  std::atomic<int> give_ups{0}, puts{0};
  std::string error;             // set before any put: a travelling put fails with it
  bool fail_after_post = false;  // set before any put: the put's job fails once its parcels left
  // While `gate` is set, a poll that finds the put landed waits until `open` (a poll
  // taking long inside MPI); `polling` says it is waiting there.
  std::atomic<bool> gate{false}, open{false}, polling{false};
  std::vector<std::string> started() {
    std::lock_guard<std::mutex> l(mu_);
    return started_;
  }
  Status Put(const WinArgs& a, bool) override {
    Record("put " + a.name);
    ++puts;
    travelling_ = [this](bool give_up) -> std::optional<Status> {
      if (give_up) {
        ++give_ups;
        return Status::Error(SHOAL_ABORTED, "given up");
      }
      if (!landed) return std::nullopt;
      if (gate) {
        polling = true;
        while (!open) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      return error.empty() ? Status::Ok() : Status::Error(SHOAL_ABORTED, error);
    };
    return fail_after_post ? Status::Error(SHOAL_ABORTED, "publishing failed") : Status::Ok();
  }
  Travelling TakeTravelling() override {
    Travelling t;
    t.swap(travelling_);
    return t;
  }
  Status Update(const WinArgs& a) override { return Record("update " + a.name); }
  Status Get(const WinArgs& a) override { return Record("get " + a.name); }
  Status Mutex(const WinArgs& a, bool) override { return Record("mutex " + a.name); }
  Status Create(const WinArgs& a) override { return Record("create " + a.name); }
  Status Free(const std::string& n) override { return Record("free " + n); }
  Status Versions(const std::string&, std::vector<int>*, std::vector<int64_t>*) override { return Status::Ok(); }
  Status AssociatedP(const std::string&, double* p) override {
    *p = 1.0;
    return Record("p");
  }
  std::vector<std::string> Names() const override { return {}; }

 private:
  Status Record(const std::string& what) {
    std::lock_guard<std::mutex> l(mu_);
    started_.push_back(what);
    return Status::Ok();
  }
  std::mutex mu_;
  std::vector<std::string> started_;
  Travelling travelling_;
};

struct Queue {
  TravellingEngine* engine = nullptr;
  std::unique_ptr<WindowQueue> q;
  Queue() {
    q = std::make_unique<WindowQueue>([this](WindowCancel*) {
      auto e = std::make_unique<TravellingEngine>();
      engine = e.get();
      return e;
    });
  }
  int64_t Put(const std::string& name) {
    WinArgs a;
    a.name = name;
    return q->Submit([a](WindowEngine& w) { return w.Put(a, false); }, true);
  }
  int64_t Op(const std::string& what, bool quick) {
    WinArgs a;
    a.name = what;
    if (what == "update") return q->Submit([a](WindowEngine& w) { return w.Update(a); }, quick);
    if (what == "get") return q->Submit([a](WindowEngine& w) { return w.Get(a); }, quick);
    return q->Submit([a](WindowEngine& w) { return w.Mutex(a, true); }, quick);
  }
};

bool Settles(const std::function<bool()>& f) {
  for (int i = 0; i < 5000; ++i) {
    if (f()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return false;
}

void TestQuickOpsBesidePuts() {
  g_case = "quick ops beside travelling puts";
  Queue t;
  const int64_t put = t.Put("a"), put2 = t.Put("b");
  const int64_t update = t.Op("update", true), get = t.Op("get", true);
  CHECK(t.q->Wait(update, 5000).ok() && t.q->Wait(get, 5000).ok(), "an update or get behind travelling puts failed");
  CHECK(t.q->Poll(put) == 0 && t.q->Poll(put2) == 0, "a put finished before its parcels landed");
  std::vector<std::string> want = {"put a", "put b", "update update", "get get"};
  CHECK(t.engine->started() == want, "ops did not start in submission order (%zu started)", t.engine->started().size());
  double p = 0;
  CHECK(t.q->Run([&p](WindowEngine& w) { return w.AssociatedP("a", &p); }).ok() && p == 1.0 && t.q->Poll(put) == 0,
        "a local read waited for travelling puts");
  t.engine->landed = true;
  CHECK(t.q->Wait(put).ok() && t.q->Wait(put2).ok(), "the puts did not finish once landed");
}

void TestOtherOpsWaitForPuts() {
  g_case = "a mutex waits for travelling puts";
  Queue t;
  const int64_t put = t.Put("a");
  const int64_t mutex = t.Op("mutex", false);
  const int64_t update = t.Op("update", true);  // behind the mutex: in order
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  CHECK(t.q->Poll(mutex) == 0 && t.q->Poll(update) == 0 && t.engine->started().size() == 1,
        "a mutex started while a put travelled (%zu ops started)", t.engine->started().size());
  t.engine->landed = true;
  CHECK(t.q->Wait(mutex).ok() && t.q->Wait(update).ok() && t.q->Poll(put) == 1, "the mutex did not run once the put landed");
  std::vector<std::string> want = {"put a", "mutex mutex", "update update"};
  CHECK(t.engine->started() == want, "ops did not start in submission order");
}

void TestTravellingError() {
  g_case = "a travelling put fails";
  Queue t;
  t.engine->error = "rank 3 refused a put";
  const int64_t put = t.Put("a");
  t.engine->landed = true;
  Status st = t.q->Wait(put);
  CHECK(st.code == SHOAL_ABORTED && st.message == "rank 3 refused a put", "the put's error was lost: %d %s", st.code,
        st.message.c_str());
}

void TestStopGivesUp() {
  g_case = "shutdown with puts travelling";
  Queue t;
  const int64_t put = t.Put("a");
  CHECK(Settles([&] { return t.engine->puts == 1; }), "the put never started");
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  t.q->Stop();
  Status st = t.q->Wait(put);
  CHECK(st.code == SHOAL_ABORTED && t.engine->give_ups == 1, "a travelling put at shutdown: %d, %d give-ups", st.code,
        t.engine->give_ups.load());
}

void TestLossEndsTravelling() {
  g_case = "a loss with puts travelling";
  auto* t = new Queue;  // leaked, as the runtime leaks an abandoned queue
  std::atomic<bool> lost{false};
  t->q->SetLost([&lost] { return lost.load(); });
  const int64_t put = t->Put("a");
  CHECK(Settles([&] { return t->engine->puts == 1; }), "the put never started");
  lost = true;
  CHECK(t->q->Wait(put).code == SHOAL_RANK_LOST, "the waiter of a travelling put did not hear of the loss");
  t->q->Abandon();
  CHECK(t->q->Poll(put) == 1, "an abandoned queue left a travelling put pending");
  (void)t->q.release();
}

void TestFailedAfterPost() {
  g_case = "a put fails after its parcels left";
  Queue t;
  t.engine->fail_after_post = true;
  Status st = t.q->Wait(t.Put("a"), 5000);
  CHECK(st.code == SHOAL_ABORTED && st.message == "publishing failed" && t.engine->give_ups == 1,
        "the failed put: %d %s, %d give-ups (its parcels must be given up, not dropped)", st.code, st.message.c_str(),
        t.engine->give_ups.load());
  WinArgs a;
  a.name = "after";
  CHECK(t.q->Wait(t.q->Submit([a](WindowEngine& w) { return w.Get(a); }, true), 5000).ok(),
        "the op after a failed put inherited its parcels");
}

void TestAbandonDuringPoll() {
  g_case = "a loss while a poll runs";
  auto* t = new Queue;  // leaked, as the runtime leaks an abandoned queue
  std::atomic<bool> lost{false};
  t->q->SetLost([&lost] { return lost.load(); });
  t->engine->gate = true;
  const int64_t put = t->Put("a");
  CHECK(Settles([&] { return t->engine->puts == 1; }), "the put never started");
  t->engine->landed = true;  // the next poll finds it landed, then waits at the gate
  CHECK(Settles([&] { return t->engine->polling.load(); }), "the window thread never polled");
  lost = true;
  t->q->Abandon();  // ends the travelling put while the poll holds it
  t->engine->open = true;
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the poll returns and takes mu_
  Status st = t->q->Wait(put, 5000);
  CHECK(st.code == SHOAL_RANK_LOST, "the abandoned put's status was overwritten by the poll: %d %s", st.code,
        st.message.c_str());
  (void)t->q.release();
}

void TestBound() {
  g_case = "puts in flight are bounded";
  Queue t;
  std::vector<int64_t> puts;
  for (int i = 0; i < 300; ++i) puts.push_back(t.Put("p" + std::to_string(i)));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  CHECK(t.engine->puts == 256, "%d puts started, 256 may travel at once", t.engine->puts.load());
  t.engine->landed = true;
  bool ok = true;
  for (int64_t h : puts) ok = t.q->Wait(h).ok() && ok;
  CHECK(ok && t.engine->puts == 300, "not every put finished (%d started)", t.engine->puts.load());
}

}  // namespace

int main() {
  TestQuickOpsBesidePuts();
  TestOtherOpsWaitForPuts();
  TestTravellingError();
  TestStopGivesUp();
  TestLossEndsTravelling();
  TestFailedAfterPost();
  TestAbandonDuringPoll();
  TestBound();
  std::printf("%d passed, %d failed\n", g_passed.load(), g_failed.load());
  return g_failed ? 1 : 0;
}
