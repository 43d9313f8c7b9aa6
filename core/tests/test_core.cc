// Unit tests of the core's pure logic: the negotiation state machine driven by N
// fake ranks (threads) submitting in different orders, the wire format, and the
// half-precision conversions. Exit status 0 = all passed.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "negotiation/coordinator.h"
#include "common/reduce.h"
#include "neighbor/topology.h"

using namespace shoal;

static int g_failed = 0, g_passed = 0;
#define CHECK(cond)                                                      \
  do {                                                                   \
    if (cond) { ++g_passed; }                                            \
    else { ++g_failed; std::printf("FAILED %s:%d: %s\n", __FILE__, __LINE__, #cond); } \
  } while (0)

static Request Req(const std::string& name, int op, int dtype, std::vector<int64_t> shape,
                   int root = 0, int reduce = 0) {
  Request r;
  r.name = name;
  r.sig.op = op;
  r.sig.dtype = dtype;
  r.sig.shape = std::move(shape);
  r.sig.root_rank = root;
  r.sig.reduce_op = reduce;
  return r;
}

// N threads (fake ranks) submit the same named ops, each in its own random order.
static void TestOutOfOrderThreads() {
  const int n = 6, ops = 40;
  Coordinator c(n, 1 << 20);
  std::mutex mu;
  std::vector<std::thread> ranks;
  for (int r = 0; r < n; ++r) {
    ranks.emplace_back([&, r] {
      std::vector<int> order(ops);
      for (int i = 0; i < ops; ++i) order[i] = i;
      std::shuffle(order.begin(), order.end(), std::mt19937(r));
      for (int i : order) {
        std::lock_guard<std::mutex> lock(mu);
        c.Add(r, Req("t" + std::to_string(i), SHOAL_OP_ALLREDUCE, SHOAL_FLOAT32, {4}), 0);
      }
    });
  }
  for (auto& t : ranks) t.join();
  auto resps = c.TakeResponses();
  std::vector<std::string> names;
  for (auto& r : resps) {
    CHECK(r.kind == Response::EXECUTE);
    names.insert(names.end(), r.names.begin(), r.names.end());
  }
  std::sort(names.begin(), names.end());
  CHECK(names.size() == static_cast<size_t>(ops));
  CHECK(std::unique(names.begin(), names.end()) == names.end());
  CHECK(resps.size() == 1);  // 40 x 16 bytes fuse into one batch
  CHECK(c.num_pending() == 0);
  // Encoded and decoded, every rank sees the same schedule.
  auto enc = EncodeResponses(resps);
  auto dec = DecodeResponses(enc.data(), enc.size());
  CHECK(dec.size() == resps.size() && dec[0].names == resps[0].names);
  // Requests keep the GPU data path on the wire.
  Request q = Req("p", SHOAL_OP_NEIGHBOR_ALLGATHER, SHOAL_FLOAT32, {2, 3});
  q.sig.device_type = SHOAL_DEVICE_CUDA;
  q.sig.path = kPathNccl | kFakePlugin;
  auto qenc = EncodeRequests({q});
  auto qdec = DecodeRequests(qenc.data(), qenc.size());
  CHECK(qdec.size() == 1 && qdec[0].sig == q.sig);
  Signature other = q.sig;
  other.path = kPathNccl;
  CHECK(!other.CompatibleForNeighbors(q.sig) && q.sig.CompatibleForNeighbors(q.sig));
}

static void TestMismatches() {
  const int n = 3;
  struct Case { std::vector<Request> reqs; std::string expect; };
  std::vector<Case> cases = {
      {{Req("a", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT32, {3}), Req("a", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT32, {4}),
        Req("a", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT32, {3})},
       "allreduce 'a': mismatched shapes across ranks: [3] on ranks 0, 2; [4] on rank 1"},
      {{Req("b", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT32, {3}), Req("b", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT64, {3}),
        Req("b", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT64, {3})},
       "mismatched dtypes across ranks: float32 on rank 0; float64 on ranks 1, 2"},
      {{Req("c", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT32, {3}), Req("c", SHOAL_OP_ALLGATHER, SHOAL_FLOAT32, {3}),
        Req("c", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT32, {3})},
       "mismatched operations"},
      {{Req("d", SHOAL_OP_BROADCAST, SHOAL_INT32, {2}, 0), Req("d", SHOAL_OP_BROADCAST, SHOAL_INT32, {2}, 1),
        Req("d", SHOAL_OP_BROADCAST, SHOAL_INT32, {2}, 0)},
       "mismatched root ranks across ranks: root 0 on ranks 0, 2; root 1 on rank 1"},
      {{Req("e", SHOAL_OP_ALLGATHER, SHOAL_INT32, {2, 3}), Req("e", SHOAL_OP_ALLGATHER, SHOAL_INT32, {5, 4}),
        Req("e", SHOAL_OP_ALLGATHER, SHOAL_INT32, {1, 3})},
       "mismatched trailing dimensions"},
      {{Req("f", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT32, {3}, 0, 0), Req("f", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT32, {3}, 0, 1),
        Req("f", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT32, {3}, 0, 0)},
       "mismatched reduce ops"},
  };
  // CUDA tensors: a rank moving the data by NCCL and ranks staging it cannot meet.
  auto gpu = [](const std::string& name, int path) {
    Request r = Req(name, SHOAL_OP_NEIGHBOR_ALLREDUCE, SHOAL_FLOAT32, {3});
    r.sig.device_type = SHOAL_DEVICE_CUDA;
    r.sig.path = path;
    return r;
  };
  cases.push_back({{gpu("g", kPathNccl), gpu("g", kPathStaged), gpu("g", kPathStaged)},
                   "neighbor_allreduce 'g': mismatched GPU data paths (SHOAL_GPU_BACKEND, CUDA-aware MPI, "
                   "SHOAL_CUDA_PLUGIN) across ranks: NCCL on rank 0; MPI staged through host memory on ranks 1, 2"});
  cases.push_back({{gpu("h", kPathMpi | kFakePlugin), gpu("h", kPathMpi), gpu("h", kPathMpi)},
                   "CUDA-aware MPI (fake plugin) on rank 0"});
  for (auto& cs : cases) {
    Coordinator c(n, 0);
    for (int r = n - 1; r >= 0; --r) c.Add(r, cs.reqs[r], 0);
    auto resps = c.TakeResponses();
    CHECK(resps.size() == 1 && resps[0].kind == Response::ERROR);
    bool found = !resps.empty() && resps[0].error.find(cs.expect) != std::string::npos;
    if (!found) std::printf("  got: %s\n", resps.empty() ? "(none)" : resps[0].error.c_str());
    CHECK(found);
    // The name is free again: a correct op under it now succeeds.
    for (int r = 0; r < n; ++r) c.Add(r, cs.reqs[0], 0);
    auto again = c.TakeResponses();
    CHECK(again.size() == 1 && again[0].kind == Response::EXECUTE);
  }
}

static void TestAllgatherDimsAndStalls() {
  Coordinator c(3, 0);
  c.Add(0, Req("g", SHOAL_OP_ALLGATHER, SHOAL_FLOAT32, {1, 2}), 0);
  c.Add(2, Req("g", SHOAL_OP_ALLGATHER, SHOAL_FLOAT32, {0, 2}), 0);
  CHECK(c.TakeResponses().empty());
  auto stalls = c.Stalled(70, 60);
  CHECK(stalls.size() == 1 && stalls[0].missing == std::vector<int>{1} &&
        stalls[0].ready == (std::vector<int>{0, 2}));
  c.Add(1, Req("g", SHOAL_OP_ALLGATHER, SHOAL_FLOAT32, {5, 2}), 0);
  auto r = c.TakeResponses();
  CHECK(r.size() == 1 && r[0].first_dims.size() == 1 &&
        r[0].first_dims[0] == (std::vector<int64_t>{1, 5, 0}));
  // Abort of a pending name yields one error, and the name is gone.
  c.Add(0, Req("h", SHOAL_OP_BARRIER, 0, {}), 0);
  auto ab = c.Abort("h", "stalled");
  CHECK(ab.kind == Response::ERROR && ab.names[0] == "h" && c.num_pending() == 0);
}

static void TestFusionThreshold() {
  Coordinator c(2, 64);  // bytes
  for (int r = 0; r < 2; ++r) {
    c.Add(r, Req("x1", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT32, {8}), 0);   // 32 B
    c.Add(r, Req("x2", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT32, {8}), 0);   // 32 B: fits exactly
    c.Add(r, Req("x3", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT32, {1}), 0);   // 4 B: over
    c.Add(r, Req("x4", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT64, {1}), 0);   // other dtype
    c.Add(r, Req("x5", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT32, {100}), 0); // larger than the buffer
  }
  auto resps = c.TakeResponses();
  CHECK(resps.size() == 4);
  CHECK(resps[0].names == (std::vector<std::string>{"x1", "x2"}));
  CHECK(resps[1].names == (std::vector<std::string>{"x3"}));
  CHECK(resps[2].names == (std::vector<std::string>{"x4"}));
  CHECK(resps[3].names == (std::vector<std::string>{"x5"}));
}

// A call refused at the call on one rank: ranks that submitted it get the error at once,
// ranks that submit it later (same step) too; the next step negotiates as usual.
static void TestRefusalReachesEveryRank() {
  Coordinator c(3, 1 << 20);
  Request a = Req("r", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT32, {2});
  c.Add(0, a, 0);
  Request no = a;
  no.reject = "allreduce: bad";
  no.reject_code = SHOAL_INVALID_TYPE;
  c.Add(1, no, 0);
  auto resps = c.TakeResponses();
  CHECK(resps.size() == 1 && resps[0].kind == Response::REJECTED && resps[0].step == 0);
  CHECK(resps[0].code == SHOAL_INVALID_TYPE);
  CHECK(resps[0].error == "allreduce: bad (raised at the call on rank 1)");
  c.Add(2, a, 0);  // late, same step: answered with the same error, nothing left pending
  resps = c.TakeResponses();
  CHECK(resps.size() == 1 && resps[0].kind == Response::REJECTED && resps[0].error.find("rank 1") != std::string::npos);
  CHECK(c.num_pending() == 0);
  Request next = a;
  next.step = 1;
  for (int r = 0; r < 3; ++r) c.Add(r, next, 0);
  resps = c.TakeResponses();
  CHECK(resps.size() == 1 && resps[0].kind == Response::EXECUTE);
  auto enc = EncodeRequests({no});
  auto dec = DecodeRequests(enc.data(), enc.size());
  CHECK(dec.size() == 1 && dec[0].reject == no.reject && dec[0].reject_code == no.reject_code && dec[0].step == 0);
  // Every rank is past the refused step: the refusal is forgotten, so once the name's steps
  // restart (retired in a vote another coordinator ran: a machine's, docs/design.md §19)
  // its step 0 runs.
  c.Add(1, no, 0);
  Request no2 = no;
  no2.reject = "allreduce: bad too";
  c.Add(2, no2, 0);
  c.Add(1, a, 0);  // told again: rank 1 still counts once
  resps = c.TakeResponses();
  CHECK(resps.size() == 3 && resps[2].kind == Response::REJECTED);
  c.Add(0, a, 0);  // the last rank past it
  resps = c.TakeResponses();
  CHECK(resps.size() == 1 && resps[0].kind == Response::REJECTED && resps[0].error.find("bad too") != std::string::npos);
  for (int r = 0; r < 3; ++r) c.Add(r, a, 0);
  resps = c.TakeResponses();
  CHECK(resps.size() == 1 && resps[0].kind == Response::EXECUTE && resps[0].names[0] == "r");
}

// A rank that left: every pending name fails naming it, and so does every later one.
static void TestLeftRankFailsPendingAndLater() {
  Coordinator c(4, 1 << 20);
  c.Add(0, Req("p", SHOAL_OP_BROADCAST, SHOAL_FLOAT32, {1}), 0);
  c.Add(2, Req("p", SHOAL_OP_BROADCAST, SHOAL_FLOAT32, {1}), 0);
  auto resps = c.Leave(3);
  CHECK(resps.size() == 1 && resps[0].kind == Response::LEFT && resps[0].names[0] == "p");
  CHECK(resps[0].error == "broadcast 'p': rank 3 left the job (script ended, sys.exit or shoal.shutdown()) "
                          "before taking part in this op");
  CHECK(c.num_pending() == 0);
  c.Add(1, Req("q", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT32, {1}), 0);
  resps = c.TakeResponses();
  CHECK(resps.size() == 1 && resps[0].kind == Response::LEFT && resps[0].names[0] == "q");
  auto enc = EncodeResponses(resps);
  auto dec = DecodeResponses(enc.data(), enc.size());
  CHECK(dec.size() == 1 && dec[0].kind == Response::LEFT && dec[0].error == resps[0].error);
}

static void TestHalfConversions() {
  // Every float16 bit pattern survives float16 -> float32 -> float16.
  for (uint32_t h = 0; h < 65536; ++h) {
    float f = HalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    if (FloatToHalf(f) != h) { CHECK(false); std::printf("  half 0x%04x\n", h); break; }
  }
  CHECK(FloatToHalf(1.0f) == 0x3c00 && FloatToHalf(65504.0f) == 0x7bff);
  CHECK(FloatToHalf(65520.0f) == 0x7c00);                  // rounds to infinity
  CHECK(FloatToHalf(1.0f + 1.0f / 2048) == 0x3c00);        // tie -> even
  CHECK(FloatToHalf(std::ldexp(1.0f, -24)) == 0x0001);     // smallest subnormal
  CHECK(BFloat16ToFloat(FloatToBFloat16(3.0f)) == 3.0f);
  CHECK(FloatToBFloat16(1.0f + 1.0f / 256) == 0x3f80);     // tie -> even
  // Uniform combine is sum-then-divide.
  std::vector<double> self = {1, 2}, a = {2, 4}, b = {3, 6}, out(2);
  Combine(self.data(), {a.data(), b.data()}, out.data(), SHOAL_FLOAT64, 2, true, 0, {});
  CHECK(out[0] == 2.0 && out[1] == 4.0);
  // With 1, 2, 3 and 7 sources (a multiply by 1/2, 1/4, 1/8 where exact, else a divide),
  // bit for bit the sum divided, subnormals and odd last bits included.
  std::mt19937_64 rng(5);
  for (size_t k : {1, 2, 3, 7}) {
    std::vector<std::vector<double>> src(k + 1, std::vector<double>(64));
    for (auto& v : src)
      for (size_t i = 0; i < v.size(); ++i)
        v[i] = std::ldexp(static_cast<double>(rng() >> 11), static_cast<int>(i % 3 == 0 ? -1100 : -52));
    std::vector<const void*> ptrs;
    for (size_t j = 1; j <= k; ++j) ptrs.push_back(src[j].data());
    std::vector<double> got(64);
    Combine(src[0].data(), ptrs, got.data(), SHOAL_FLOAT64, 64, true, 0, {});
    bool same = true;
    for (size_t i = 0; i < 64; ++i) {
      double sum = src[0][i];
      for (size_t j = 1; j <= k; ++j) sum += src[j][i];
      same = same && got[i] == sum / static_cast<double>(k + 1);
    }
    CHECK(same);
  }
}

static void TestSum() {
  // In source order, into an aliased source; integers wrap; halves add in float32.
  std::vector<int8_t> x = {100, -128, 5}, y = {100, -1, 6};
  Sum({x.data(), y.data(), x.data()}, x.data(), SHOAL_INT8, 3);
  CHECK(x[0] == 44 && x[1] == -1 && x[2] == 16);  // 300 - 256, -257 + 256, 5 + 6 + 5
  std::vector<uint16_t> h = {FloatToHalf(2048.0f)}, one = {FloatToHalf(1.0f)};
  Sum({h.data(), one.data(), one.data()}, h.data(), SHOAL_FLOAT16, 1);
  CHECK(HalfToFloat(h[0]) == 2050.0f);  // pairwise float16 adds would stay at 2048
  std::vector<float> z = {-0.0f};
  Sum({z.data()}, z.data(), SHOAL_FLOAT32, 1);
  CHECK(std::signbit(z[0]));
}

// Which batches the coordinator caches on a channel (negotiation/response_cache.cc): repeats only,
// of cacheable signatures, while channels are free; and how probes of a cached round's
// stall behave: they name the missing ranks, and go away when the round is over.
// A repeated broadcast gets a channel (docs/design.md §20); a dead one's channel is free
// again only once every rank has submitted the name after its last round.
static void TestCachedBroadcastChannels() {
  Coordinator c(2, 0, 1);  // 2 ranks, no fusion, 1 channel
  auto run = [&](const Request& q) {
    c.Add(0, q, 0);
    c.Add(1, q, 0);
    auto resps = c.TakeResponses();
    return resps.size() == 1 ? resps[0] : Response{};
  };
  const Request bc = Req("bc", SHOAL_OP_BROADCAST, SHOAL_UINT8, {4}, 1), other = Req("o", SHOAL_OP_BROADCAST, SHOAL_FLOAT32, {4});
  CHECK(run(bc).channel == -1);  // first sight
  const int ch = run(bc).channel;
  CHECK(ch == 0);
  run(other);
  CHECK(run(other).channel == -1);  // the channel is in use
  c.ReleaseAfter("bc", ch);
  CHECK(run(other).channel == -1);  // not before every rank submitted "bc" again
  c.Add(0, bc, 0);
  CHECK(c.TakeResponses().empty());
  c.Add(1, bc, 0);
  auto resps = c.TakeResponses();
  CHECK(resps.size() == 1 && resps[0].channel == ch);  // free again, and "bc" repeats: cached again
}

static void TestCachingAndProbes() {
  Coordinator c(2, 0, 2);  // 2 ranks, no fusion, 2 channels
  auto run = [&](const Request& q) {
    c.Add(0, q, 0);
    c.Add(1, q, 0);
    auto resps = c.TakeResponses();
    return resps.size() == 1 ? resps[0] : Response{};
  };
  const Request a = Req("a", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT32, {4});
  CHECK(run(a).channel == -1);  // first sight
  Response second = run(a);
  CHECK(second.kind == Response::EXECUTE && second.channel >= 0);
  Request shape = a;
  shape.sig.shape = {5};
  CHECK(run(shape).channel == -1);  // another signature: not a repeat
  Request local = Req("local", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT32, {4});
  local.sig.scope = SHOAL_SCOPE_MACHINE;
  Request bytes = Req("bytes", SHOAL_OP_ALLREDUCE, SHOAL_INT8, {4}, 0, SHOAL_REDUCE_SUM);
  Request bcast = Req("bcast", SHOAL_OP_BROADCAST, SHOAL_FLOAT32, {4});
  bcast.sig.scope = SHOAL_SCOPE_MACHINE;
  Request gpu = Req("gpu", SHOAL_OP_BROADCAST, SHOAL_FLOAT32, {4});
  gpu.sig.device_type = SHOAL_DEVICE_CUDA;
  for (int k = 0; k < 2; ++k)
    for (auto* q : {&local, &bytes, &bcast, &gpu}) CHECK(run(*q).channel == -1);  // never cached
  const Request b = Req("b", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT64, {2}), d = Req("d", SHOAL_OP_ALLREDUCE, SHOAL_INT64, {2});
  run(b);
  const int cb = run(b).channel;
  CHECK(cb >= 0 && cb != second.channel);
  run(d);
  CHECK(run(d).channel == -1);  // both channels in use
  c.ReleaseChannel(cb);
  CHECK(run(d).channel == cb);
  // Probes: rank 0's round of "a" at step 7 waits; rank 1 never probes.
  Request probe = a;
  probe.probe = true;
  probe.step = 7;
  c.Add(0, probe, 0);
  auto stalls = c.Stalled(10, 1);
  CHECK(stalls.size() == 1 && stalls[0].name == "a" && stalls[0].missing == std::vector<int>{1});
  c.RoundDone("a", 7);  // the round completed on rank 0: every rank took part
  CHECK(c.Stalled(10, 1).empty());
  c.Add(1, probe, 0);  // a late probe of that round
  CHECK(c.Stalled(10, 1).empty() && c.TakeResponses().empty());
  probe.step = 8;  // both ranks probe the next round (it completes as they do): nothing runs
  c.Add(0, probe, 0);
  c.Add(1, probe, 0);
  CHECK(c.TakeResponses().empty() && c.num_pending() == 0);
  c.Add(0, probe, 0);  // a probe, then the op itself (its batch died): the op replaces it
  Request normal = a;
  normal.step = 8;
  c.Add(1, normal, 0);
  c.Add(0, normal, 0);
  auto resps = c.TakeResponses();
  CHECK(resps.size() == 1 && resps[0].kind == Response::EXECUTE && resps[0].names == std::vector<std::string>{"a"});
}

// Horovod's join: names wait only for the ranks that have not joined; their responses list
// the joined ranks with the signatures they contribute zeros of; broadcast fails naming them;
// a joined rank is not a stall; the join completes with the last rank after every op; then
// repeated names are cached again. A rank that leaves fails the join.
static void TestJoin() {
  Coordinator c(3, 1 << 20, 2);
  auto join = Req("join.noname.0", kOpJoin, 0, {});
  for (int r : {0, 1}) {
    c.Add(r, Req("a", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT32, {4}), 0);
    c.Add(r, Req("b", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT64, {2}, 0, SHOAL_REDUCE_AVERAGE), 0);
  }
  CHECK(c.TakeResponses().empty() && c.Stalled(10, 1).size() == 2);
  c.Add(2, join, 0);
  CHECK(c.any_joined() && c.Stalled(10, 1).empty());
  auto resps = c.TakeResponses();
  auto enc = EncodeResponses(resps);
  auto dec = DecodeResponses(enc.data(), enc.size());
  CHECK(dec.size() == 2);
  for (auto& r : dec)
    CHECK(r.kind == Response::EXECUTE && r.joined == std::vector<int>{2} && r.sigs.size() == 1 &&
          r.sigs[0].shape == (r.names[0] == "a" ? std::vector<int64_t>{4} : std::vector<int64_t>{2}) && r.channel < 0);
  for (int r : {0, 1}) c.Add(r, Req("c", SHOAL_OP_BROADCAST, SHOAL_FLOAT32, {3}), 0);
  resps = c.TakeResponses();
  CHECK(resps.size() == 1 && resps[0].kind == Response::ERROR &&
        resps[0].error.find("rank 2 has joined") != std::string::npos);
  c.Add(1, join, 0);
  c.Add(0, Req("d", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT32, {1}), 0);  // alone: no one else to wait for
  resps = c.TakeResponses();
  CHECK(resps.size() == 1 && resps[0].names == std::vector<std::string>{"d"} &&
        resps[0].joined == (std::vector<int>{1, 2}));
  auto gpu = Req("e", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT32, {2});
  gpu.sig.device_type = SHOAL_DEVICE_CUDA;  // a joined rank's zeros are in host memory
  c.Add(0, gpu, 0);
  resps = c.TakeResponses();
  CHECK(resps.size() == 1 && resps[0].kind == Response::ERROR &&
        resps[0].error.find("ranks 1, 2 have joined") != std::string::npos &&
        resps[0].error.find("CUDA tensors") != std::string::npos);
  c.Add(0, join, 0);
  resps = c.TakeResponses();
  CHECK(resps.size() == 1 && resps[0].op == kOpJoin && resps[0].joined == std::vector<int>{0} && !c.any_joined());
  for (int r : {0, 1, 2}) c.Add(r, Req("a", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT32, {4}), 0);
  resps = c.TakeResponses();
  CHECK(resps.size() == 1 && resps[0].joined.empty() && resps[0].channel >= 0);  // cached again
  c.Add(1, join, 0);
  resps = c.Leave(2);
  CHECK(resps.size() == 1 && resps[0].kind == Response::LEFT && resps[0].op == kOpJoin &&
        resps[0].error.find("rank 2 left") != std::string::npos);
}

// A rank's plan of a graph (BlueFog's convention: edge i -> j of weight w, j weights i's
// value by w; a self loop is the self weight), and the graphs it refuses.
static void TestTopologyPlan() {
  // 0 -> 1 (0.5), 2 -> 1 (0.25), 1 -> 1 (0.25), 1 -> 0 (1), 1 -> 2 (1), given in no order.
  const std::vector<int32_t> src = {2, 1, 0, 1, 1}, dst = {1, 0, 1, 1, 2};
  const std::vector<double> w = {0.25, 1.0, 0.5, 0.25, 1.0};
  TopologyPlan p = PlanOf(3, src, dst, w, 1, true);
  CHECK(p.recv == std::vector<int>({0, 2}) && p.recv_weights == std::vector<double>({0.5, 0.25}));
  CHECK(p.send == std::vector<int>({0, 2}) && p.self_weight == 0.25 && p.weighted && p.nodes == 3);
  TopologyPlan q = PlanOf(3, src, dst, w, 0, false);
  CHECK(q.recv == std::vector<int>({1}) && q.send == std::vector<int>({1}) && q.self_weight == 0.0 && !q.weighted);
  auto refused = [&](std::vector<int32_t> s, std::vector<int32_t> d, std::vector<double> ws, const char* what) {
    try {
      PlanOf(3, s, d, ws, 0, false);
    } catch (const ArgumentError& e) {
      return std::string(e.what()).find(what) != std::string::npos;
    }
    return false;
  };
  CHECK(refused({0, 0}, {1, 1}, {1, 1}, "edge 0 -> 1 is given twice"));
  CHECK(refused({0}, {3}, {1}, "outside [0, 3)"));
  CHECK(refused({0}, {1}, {NAN}, "non-finite weight"));
  Topologies t;
  CHECK(t.Get(SHOAL_GRAPH_RANKS).version == 0);
  CHECK(t.Set(SHOAL_GRAPH_RANKS, p) == 1 && t.Set(SHOAL_GRAPH_RANKS, q) == 2 && t.Set(SHOAL_GRAPH_MACHINES, p) == 1);
  CHECK(t.Get(SHOAL_GRAPH_RANKS).recv == q.recv && t.Get(SHOAL_GRAPH_MACHINES).recv == p.recv);
}

// Alltoall: every rank's splits travel with its request and come back to every rank as
// one table; grouped ops: one request per rank with the members' signatures, one response
// whose chunks fuse adjacent allreduce members of one dtype up to the threshold; both
// survive the wire.
static void TestAlltoallAndGroups() {
  Coordinator c(3, 16);
  for (int r = 0; r < 3; ++r) {
    Request q = Req("a2a", SHOAL_OP_ALLTOALL, SHOAL_FLOAT32, {r + 3, 2});
    q.splits = {r, 1, 2};
    auto enc = EncodeRequests({q});
    c.Add(r, DecodeRequests(enc.data(), enc.size())[0], 0);
  }
  auto resps = c.TakeResponses();
  auto enc = EncodeResponses(resps);
  auto dec = DecodeResponses(enc.data(), enc.size());
  CHECK(dec.size() == 1 && dec[0].kind == Response::EXECUTE &&
        dec[0].first_dims == (std::vector<std::vector<int64_t>>{{0, 1, 2}, {1, 1, 2}, {2, 1, 2}}));
  const int gop = SHOAL_GROUPED | SHOAL_OP_ALLREDUCE;
  for (int r = 0; r < 3; ++r) {
    Request g = Req("grp", gop, 0, {});
    // float32 [2] and [2] fuse (16 bytes); the third float32 would pass the threshold; float64 differs.
    for (auto& m : {Req("", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT32, {2}), Req("", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT32, {2}),
                    Req("", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT32, {1}), Req("", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT64, {1})})
      g.members.push_back(m.sig);
    auto genc = EncodeRequests({g});
    c.Add(r, DecodeRequests(genc.data(), genc.size())[0], 0);
  }
  resps = c.TakeResponses();
  enc = EncodeResponses(resps);
  dec = DecodeResponses(enc.data(), enc.size());
  CHECK(dec.size() == 1 && dec[0].kind == Response::EXECUTE && dec[0].op == gop &&
        dec[0].names == std::vector<std::string>{"grp"} && dec[0].chunks == (std::vector<int32_t>{2, 1, 1}));
  // A member whose shape differs on rank 2 fails the whole group, naming the member.
  for (int r = 0; r < 3; ++r) {
    Request g = Req("grp", gop, 0, {});
    g.members = {Req("", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT32, {2}).sig,
                 Req("", SHOAL_OP_ALLREDUCE, SHOAL_FLOAT32, {r == 2 ? 3 : 1}).sig};
    c.Add(r, g, 0);
  }
  resps = c.TakeResponses();
  CHECK(resps.size() == 1 && resps[0].kind == Response::ERROR && resps[0].names == std::vector<std::string>{"grp"} &&
        resps[0].error.find("grouped_allreduce 'grp': allreduce 'grp[1]': mismatched shapes across ranks: [1] on "
                            "ranks 0, 1; [3] on rank 2") == 0);
}

// Retiring names (negotiation/names.cc) at the coordinator: once both ranks propose name n at
// the same count, the answer asks for a vote; a vote is never reported as stalled (every
// driver sends one without a user call), so a late one lands in its own round; the vote's
// response retires the names every rank voted for, and none that a rank voted to keep.
static void TestRetirementVotes() {
  Coordinator c(2, 0);
  auto proposal = [](const std::string& carrier, int64_t count) {
    Request q;
    q.name = carrier;
    q.sig.op = SHOAL_OP_ALLREDUCE;
    q.retire = {"n"};
    q.retire_calls = {count};
    return q;
  };
  auto vote = [](bool keep) {
    Request q;
    q.name = "shoal.retire";
    q.sig.op = kOpRetire;
    if (!keep) q.retire = {"n"}, q.retire_calls = {5};
    return q;
  };
  auto retired = [](const std::vector<Response>& rs) {
    std::vector<std::string> names;
    for (auto& r : rs)
      if (r.op == kOpRetire) names.insert(names.end(), r.retired.begin(), r.retired.end());
    return names;
  };
  for (int round = 0; round < 2; ++round) {
    const std::string carrier = "a" + std::to_string(round);
    c.Add(0, proposal(carrier, 5), 10.0 * round);
    c.Add(1, proposal(carrier, 5), 10.0 * round);
    CHECK(retired(c.TakeResponses()) == std::vector<std::string>{"n"});  // the answer: vote on n
    c.Add(0, vote(false), 10.0 * round);
    CHECK(c.Stalled(10.0 * round + 9, 1.0).empty());  // rank 1's vote is late, not stalled
    c.Add(1, vote(round == 1), 10.0 * round + 9);     // round 1: rank 1 called n meanwhile
    const std::vector<std::string> want = round == 0 ? std::vector<std::string>{"n"} : std::vector<std::string>{};
    CHECK(retired(c.TakeResponses()) == want);
  }
}

int main() {
  TestTopologyPlan();
  TestRetirementVotes();
  TestOutOfOrderThreads();
  TestMismatches();
  TestAllgatherDimsAndStalls();
  TestFusionThreshold();
  TestHalfConversions();
  TestRefusalReachesEveryRank();
  TestLeftRankFailsPendingAndLater();
  TestSum();
  TestCachingAndProbes();
  TestCachedBroadcastChannels();
  TestJoin();
  TestAlltoallAndGroups();
  std::printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed ? 1 : 0;
}
