// The fake plugin's NCCL entries, over MPI, with NCCL's rules checked instead of trusted.
// Within a communicator every rank must issue its collectives and grouped send/recv in
// the same order, and each call runs like a kernel on its stream: the stream waits until
// the ranks the call involves reach it. Before any data moves, a call sends a description
// of itself to each rank it involves and compares theirs with its own, so where real NCCL
// would deadlock (or mix data) the ranks that disagree fail the call with a message, and
// where it would hang (a rank skipped the call, a cycle of grouped send/recv) the call
// fails after SHOAL_FAKE_NCCL_TIMEOUT seconds (default 60). Each communicator has an MPI
// communicator of its own, made from MPI_COMM_WORLD for exactly its ranks.
//
// Not detected: swapped calls that look alike (two allreduces of one size and dtype),
// which NCCL silently mixes too. Zero-sized collectives are no-ops, as in NCCL.
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <thread>

#include "common/common.h"
#include "testing/fake_mpi.h"
#include "testing/fake_stream.h"
#include "cuda_plugin/plugin_table.h"
#include "common/reduce.h"

namespace shoal_fake {
namespace {

enum Kind : int64_t { kAllreduce = 1, kBroadcast, kAllgather, kGroup, kReduceScatter };
constexpr int kTagCall = 1, kTagVerdict = 2;                             // a communicator's own (and kTagData)
// Setup messages on MPI_COMM_WORLD use tags of the id's serial number, so communicators can
// be set up concurrently (from several threads, as the core sets up its per-edge ones):
// tags are distinct while a creator has fewer than 1024 setups in flight at once and
// (MPI_Comm_create_group needs distinct tags for overlapping groups) up to 8 ranks create
// concurrently; beyond that they may collide, which this test plugin accepts.
constexpr int kTagJoin = 20000, kTagMembers = 21024, kTagCreate = 22048;
int SetupTag(int base, uint64_t serial, int creator = 0) {
  return base + (creator % 8) * 1024 + static_cast<int>(serial % 1024);  // kTagCreate + 8192 < 32767
}

struct Comm {
  MPI_Comm mpi = MPI_COMM_NULL;
  int rank = 0, size = 1, device = 0;
  std::mutex mu;
  std::condition_variable cv;
  uint64_t issued = 0, finished = 0;
  std::vector<uint64_t> shared;  // per rank: calls issued so far that involve it
  std::string error;             // the first failure; nccl_check reports it from then on
  bool aborted = false;          // ncclCommAbort: calls stop waiting for peers
};

bool Aborted(Comm& m) {
  std::lock_guard<std::mutex> lock(m.mu);
  return m.aborted;
}

std::mutex comms_mu;
std::map<void*, std::shared_ptr<Comm>>& Comms() {
  static auto* m = new std::map<void*, std::shared_ptr<Comm>>;  // leaked: see fake_plugin.cc
  return *m;
}

shoal_cuda_error FindComm(void* h, const char* what, std::shared_ptr<Comm>* c) {
  std::lock_guard<std::mutex> lock(comms_mu);
  auto it = Comms().find(h);
  if (it == Comms().end()) return Fail(std::string(what) + ": invalid argument (unknown communicator)");
  *c = it->second;
  return nullptr;
}

// One call as issued: what it tells, and expects from, each rank it involves (the body
// after [call number, number among the calls shared with that rank]), and its data moves.
struct Call {
  std::shared_ptr<Comm> comm;
  uint64_t number = 0;
  std::map<int, Body> tell, expect;
  std::function<std::string(Comm&, Requests&)> move;
};

std::string Sizes(const int64_t* v, int64_t n) {
  std::string s = "[";
  for (int64_t i = 0; i < n; ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

// `b` as said by `who` ("this rank" or "rank 3") to `other`.
std::string Describe(const Body& b, const std::string& who, const std::string& other) {
  if (b.empty()) return "an empty message";
  switch (b[0]) {
    case kAllreduce:
      return "an allreduce (op=" + std::string(shoal::ReduceOpName(static_cast<int>(b[3]))) + ") of " +
             std::to_string(b[2]) + " " + shoal::DtypeName(static_cast<int>(b[1]));
    case kBroadcast: return "a broadcast of " + std::to_string(b[1]) + " bytes from rank " + std::to_string(b[2]);
    case kAllgather: return "an allgather of " + Sizes(&b[2], b[1]) + " bytes";
    case kReduceScatter:
      return "a reducescatter (op=" + std::string(shoal::ReduceOpName(static_cast<int>(b[2]))) + ") of " +
             shoal::DtypeName(static_cast<int>(b[1])) + " shares " + Sizes(&b[4], b[3]);
    case kGroup: {
      const int64_t ns = b[1], nr = b[2 + ns];
      return "grouped send/recv in which " + who + " sends " + Sizes(&b[2], ns) + " bytes to " + other +
             " and receives " + Sizes(&b[3 + ns], nr) + " bytes from it";
    }
  }
  return "an unknown call";
}

// Every rank involved agrees on this call, or the call fails on all of them: each sends
// its description to the others, compares theirs with its own, then sends its verdict
// ("" or why it fails). A failing verdict that arrives early ends the wait too.
std::string Agree(Call& c, Clock::time_point deadline) {
  Comm& m = *c.comm;
  Requests out;
  for (auto& kv : c.tell) out.Send(Pack64(kv.second), kv.first, kTagCall, m.mpi);
  std::map<int, Body> pending = c.expect;
  std::map<int, std::string> verdicts;
  std::string why, msg;
  auto poll_verdicts = [&] {
    for (auto& kv : c.tell) {
      if (verdicts.count(kv.first) || !TryReceive(m.mpi, kv.first, kTagVerdict, &msg)) continue;
      verdicts[kv.first] = msg;
      if (!msg.empty() && why.empty()) why = "rank " + std::to_string(kv.first) + " failed this call: " + msg;
    }
  };
  for (Backoff b; !pending.empty() && why.empty(); b.Pause()) {
    for (auto it = pending.begin(); it != pending.end() && why.empty();) {
      const int p = it->first;
      if (!TryReceive(m.mpi, p, kTagCall, &msg)) {
        ++it;
        continue;
      }
      const Body got = Unpack64(msg), &mine = c.tell[p];
      const Body theirs(got.begin() + std::min<size_t>(2, got.size()), got.end());
      if (got.size() < 2 || got[1] != mine[1] || theirs != it->second) {
        const std::string rp = "rank " + std::to_string(p);
        why = "ranks disagree on the order of calls on a communicator of " + std::to_string(m.size) +
              " ranks: this rank's call #" + std::to_string(c.number) + " is " +
              Describe(Body(mine.begin() + 2, mine.end()), "this rank", rp) + ", but " + rp + "'s call #" +
              std::to_string(got.empty() ? 0 : got[0]) + " with it is " + Describe(theirs, rp, "this rank") +
              ". Real NCCL would deadlock (or mix data) here: every rank must issue a communicator's "
              "collectives and grouped send/recv in the same order, with matching sizes";
      }
      it = pending.erase(it);
    }
    poll_verdicts();
    if (why.empty() && Aborted(m)) why = "the communicator was aborted (ncclCommAbort)";
    if (why.empty() && !pending.empty() && Clock::now() > deadline)
      why = "rank " + std::to_string(pending.begin()->first) + " has not reached its counterpart of this rank's call #" +
            std::to_string(c.number) + " " + Within() +
            ". Real NCCL would hang here: a rank skipped or reordered a call, or grouped send/recv wait on each "
            "other in a cycle";
  }
  for (auto& kv : c.tell) out.Send(why, kv.first, kTagVerdict, m.mpi);
  for (Backoff b; why.empty() && verdicts.size() < c.tell.size(); b.Pause()) {
    poll_verdicts();
    if (why.empty() && verdicts.size() < c.tell.size() && Clock::now() > deadline)
      why = "a rank did not finish agreeing on call #" + std::to_string(c.number) + " " + Within();
  }
  out.Wait(deadline);
  return why;
}

// Tells the ranks involved that this call fails here, so they fail instead of waiting.
void Abandon(Call& c, const std::string& why) {
  Requests out;
  for (auto& kv : c.tell) out.Send(Pack64(kv.second), kv.first, kTagCall, c.comm->mpi);
  for (auto& kv : c.tell) out.Send(why, kv.first, kTagVerdict, c.comm->mpi);
  out.Wait(Clock::now());  // do not wait: leaves them to finish
}

std::atomic<int64_t> calls_done{0};  // for tests: shoal_fake_nccl_calls()

// Runs on the stream's worker thread (or the caller's, for the legacy default stream).
std::string Execute(Call& c, bool stream_failed) {
  Comm& m = *c.comm;
  const auto deadline = Deadline();
  std::string err;
  {
    std::unique_lock<std::mutex> lock(m.mu);
    // Calls run in the order they were issued, even when issued on different streams.
    if (!m.cv.wait_until(lock, deadline, [&] { return m.finished + 1 >= c.number; }))
      err = "call #" + std::to_string(c.number) + " waits for an earlier call on another stream that has not run " + Within();
    else if (!m.error.empty())
      err = "the communicator failed earlier: " + m.error;
  }
  if (err.empty() && stream_failed) err = "its stream failed earlier";
  if (!err.empty()) {
    Abandon(c, err);
  } else if ((err = Agree(c, deadline)).empty()) {
    Requests data;
    err = c.move(m, data);
    if (err.empty() && !data.Wait(deadline)) err = "the data of call #" + std::to_string(c.number) + " did not arrive " + Within();
  }
  if (err.empty()) ++calls_done;
  std::lock_guard<std::mutex> lock(m.mu);
  m.finished = std::max(m.finished, c.number);
  if (!err.empty() && m.error.empty()) m.error = err;
  m.cv.notify_all();
  return err.empty() ? err : "fake NCCL: " + err;
}

// Queues `c` on the stream: like a kernel, it holds the stream until the peers join.
shoal_cuda_error Issue(void* comm, void* stream, const char* what, std::shared_ptr<Call> c) {
  if (shoal_cuda_error err = FindComm(comm, what, &c->comm)) return err;
  shoal_cuda_error err = nullptr;
  auto s = FindStream(stream, &err);
  if (!s) return err;
  if (s->device() != c->comm->device)
    return Fail(std::string(what) + ": a stream of fake device " + std::to_string(s->device()) +
                " with a communicator of device " + std::to_string(c->comm->device));
  {
    Comm& m = *c->comm;
    std::lock_guard<std::mutex> lock(m.mu);
    c->number = ++m.issued;
    for (auto& kv : c->tell) {
      const uint64_t k = ++m.shared[kv.first];
      kv.second.insert(kv.second.begin(), {static_cast<int64_t>(c->number), static_cast<int64_t>(k)});
    }
  }
  s->Enqueue([c] { return Execute(*c, false); }, [c] { Execute(*c, true); });
  return nullptr;
}

// A collective: every other rank must issue the same body at the same point.
std::shared_ptr<Call> Collective(const Comm& m, Body body) {
  auto c = std::make_shared<Call>();
  for (int p = 0; p < m.size; ++p) {
    if (p == m.rank) continue;
    c->tell[p] = body;
    c->expect[p] = body;
  }
  return c;
}

std::shared_ptr<Comm> Peek(void* comm) {
  std::lock_guard<std::mutex> lock(comms_mu);
  auto it = Comms().find(comm);
  return it == Comms().end() ? nullptr : it->second;
}

shoal_cuda_error TooLarge(const char* what, int64_t n) {
  return n > INT_MAX ? Fail(std::string(what) + ": the fake moves at most 2^31-1 bytes per message") : nullptr;
}

// ---- The table's entries ----

struct UniqueIdBytes {
  char magic[16];
  int32_t creator;  // MPI_COMM_WORLD rank that collects the members
  int32_t pid;
  uint64_t serial, nonce;
};
const char kMagic[16] = "shoal-fake-nccl";

shoal_cuda_error MpiReady(const char* what) {
  int inited = 0, finalized = 0, level = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&finalized);
  if (!inited || finalized) return Fail(std::string(what) + ": the fake NCCL needs MPI (shoal.init() first)");
  MPI_Query_thread(&level);
  if (level != MPI_THREAD_MULTIPLE) return Fail(std::string(what) + ": the fake NCCL needs MPI_THREAD_MULTIPLE");
  return nullptr;
}

shoal_cuda_error UniqueId(void* id) {
  if (shoal_cuda_error e = MpiReady("ncclGetUniqueId")) return e;
  // Tests: a failure where real NCCL can fail (no network interface, say), read at each call.
  const char* fail = std::getenv("SHOAL_FAKE_NCCL_FAIL_ID");
  if (fail && std::string(fail) == "1") return Fail("ncclGetUniqueId: unhandled system error (SHOAL_FAKE_NCCL_FAIL_ID=1)");
  static std::atomic<uint64_t> serial{0};
  UniqueIdBytes u{};
  std::memcpy(u.magic, kMagic, sizeof u.magic);
  MPI_Comm_rank(MPI_COMM_WORLD, &u.creator);
  u.pid = static_cast<int32_t>(getpid());
  u.serial = ++serial;
  u.nonce = std::random_device{}();
  std::memset(id, 0, 128);
  std::memcpy(id, &u, sizeof u);
  return nullptr;
}

shoal_cuda_error CommInit(int device, int nranks, const void* id, int rank, void** comm) {
  if (shoal_cuda_error e = MpiReady("ncclCommInitRank")) return e;
  UniqueIdBytes u;
  std::memcpy(&u, id, sizeof u);
  int me = 0, world = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (std::memcmp(u.magic, kMagic, sizeof u.magic) != 0 || u.creator < 0 || u.creator >= world)
    return Fail("ncclCommInitRank: invalid argument (not an id of the fake NCCL)");
  if (device < 0 || device >= DeviceCount() || nranks < 1 || rank < 0 || rank >= nranks)
    return Fail("ncclCommInitRank: invalid argument (device " + std::to_string(device) + ", rank " +
                std::to_string(rank) + " of " + std::to_string(nranks) + ")");
  // The id's creator collects every member's MPI_COMM_WORLD rank and sends the list back.
  const auto deadline = Deadline();
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  // Machines that SHOAL_RANKS_PER_MACHINE simulates on this host are hosts of their own
  // (as the ranks' fake devices are picked per machine, by local rank).
  const char* rpm = std::getenv("SHOAL_RANKS_PER_MACHINE");
  const int per_machine = rpm ? std::max(0, std::atoi(rpm)) : 0;
  const std::string where = std::string(host) + (per_machine > 0 ? "#" + std::to_string(me / per_machine) : "");
  const Body join{static_cast<int64_t>(u.serial), static_cast<int64_t>(u.nonce), rank, nranks, me, device,
                  static_cast<int64_t>(std::hash<std::string>()(where))};
  Body members(nranks, -1);
  std::map<std::pair<int64_t, int64_t>, int64_t> used{{{join[6], device}, rank}};  // (host, device) -> rank
  std::string msg;
  if (me == u.creator) {
    // Every member gets an answer: the list ("L"), or why the setup failed ("E").
    members[rank] = me;
    std::string why;
    std::vector<int> joined;
    for (int k = 1; k < nranks; ++k) {
      int from = -1;
      if (!Receive(MPI_COMM_WORLD, MPI_ANY_SOURCE, SetupTag(kTagJoin, u.serial), deadline, &msg, &from)) {
        why = std::to_string(nranks - k) + " ranks did not join " + Within();
        break;
      }
      joined.push_back(from);
      Body j = Unpack64(msg);
      if (!why.empty()) continue;
      if (j.size() != join.size() || j[0] != join[0] || j[1] != join[1] || j[3] != nranks || j[2] < 0 ||
          j[2] >= nranks || members[j[2]] != -1) {
        why = "MPI rank " + std::to_string(from) +
              " joined with another id, size or a rank already taken (communicators set up concurrently?)";
        continue;
      }
      auto dup = used.emplace(std::make_pair(j[6], j[5]), j[2]);
      if (!dup.second)  // what real NCCL refuses ("Duplicate GPU detected")
        why = "ranks " + std::to_string(dup.first->second) + " and " + std::to_string(j[2]) + " use the same device " +
              std::to_string(j[5]) + " of one host; NCCL refuses that";
      members[j[2]] = j[4];
    }
    const std::string answer = why.empty() ? "L" + Pack64(members) : "E" + why;
    for (int w : joined)
      MPI_Send(answer.data(), static_cast<int>(answer.size()), MPI_BYTE, w, SetupTag(kTagMembers, u.serial), MPI_COMM_WORLD);
    if (!why.empty()) return Fail("ncclCommInitRank: " + why);
  } else {
    const std::string j = Pack64(join);
    MPI_Send(j.data(), static_cast<int>(j.size()), MPI_BYTE, u.creator, SetupTag(kTagJoin, u.serial), MPI_COMM_WORLD);
    if (!Receive(MPI_COMM_WORLD, u.creator, SetupTag(kTagMembers, u.serial), deadline, &msg))
      return Fail("ncclCommInitRank: the id's creator (MPI rank " + std::to_string(u.creator) + ") did not answer " + Within());
    if (msg.empty() || msg[0] != 'L') return Fail("ncclCommInitRank: " + (msg.empty() ? std::string("setup failed") : msg.substr(1)));
    members = Unpack64(msg.substr(1));
  }
  std::vector<int> ranks(members.begin(), members.end());
  auto c = std::make_shared<Comm>();
  c->rank = rank;
  c->size = nranks;
  c->device = device;
  c->shared.assign(nranks, 0);
  MPI_Group all, group;
  MPI_Comm_group(MPI_COMM_WORLD, &all);
  MPI_Group_incl(all, nranks, ranks.data(), &group);
  const int rc = MPI_Comm_create_group(MPI_COMM_WORLD, group, SetupTag(kTagCreate, u.serial, u.creator), &c->mpi);
  MPI_Group_free(&group);
  MPI_Group_free(&all);
  if (rc != MPI_SUCCESS) return Fail("ncclCommInitRank: MPI_Comm_create_group failed");
  std::lock_guard<std::mutex> lock(comms_mu);
  Comms()[c.get()] = c;
  *comm = c.get();
  return nullptr;
}

shoal_cuda_error CommDestroy(void* comm) {
  std::shared_ptr<Comm> c;
  {
    std::lock_guard<std::mutex> lock(comms_mu);
    auto it = Comms().find(comm);
    if (it == Comms().end()) return Fail("ncclCommDestroy: invalid argument (unknown communicator)");
    c = it->second;
    Comms().erase(it);
  }
  std::unique_lock<std::mutex> lock(c->mu);  // NCCL flushes the calls still queued first
  c->cv.wait_until(lock, Deadline(), [&] { return c->finished >= c->issued; });
  MPI_Comm_free(&c->mpi);
  return nullptr;
}

// Fails the communicator's queued and running calls at once (their waits end), as
// ncclCommAbort does; the communicator's MPI resources stay (test plugin: a small leak).
shoal_cuda_error CommAbort(void* comm) {
  std::shared_ptr<Comm> c;
  if (shoal_cuda_error err = FindComm(comm, "ncclCommAbort", &c)) return err;
  {
    std::lock_guard<std::mutex> lock(c->mu);
    if (c->error.empty()) c->error = "the communicator was aborted (ncclCommAbort)";
    c->aborted = true;
    c->cv.notify_all();
  }
  std::lock_guard<std::mutex> lock(comms_mu);
  Comms().erase(comm);
  return nullptr;
}

shoal_cuda_error CheckComm(void* comm) {
  std::shared_ptr<Comm> c;
  if (shoal_cuda_error err = FindComm(comm, "ncclCommGetAsyncError", &c)) return err;
  std::lock_guard<std::mutex> lock(c->mu);
  return c->error.empty() ? nullptr : Fail("fake NCCL: " + c->error);
}

shoal_cuda_error AllReduce(void* buf, int64_t count, int dtype, int reduce_op, void* comm, void* stream) {
  if (dtype == SHOAL_INT16 || dtype == SHOAL_BOOL || dtype < 0 || dtype > SHOAL_BOOL)
    return Fail(std::string("NCCL cannot reduce ") + (dtype == SHOAL_INT16 ? "int16" : dtype == SHOAL_BOOL ? "bool" : "this dtype") + " tensors");
  if (reduce_op != SHOAL_REDUCE_SUM && reduce_op != SHOAL_REDUCE_MIN && reduce_op != SHOAL_REDUCE_MAX &&
      reduce_op != SHOAL_REDUCE_PRODUCT)
    return Fail("ncclAllReduce: invalid argument (reduce op " + std::to_string(reduce_op) + ")");
  auto m = Peek(comm);
  if (!m) return Fail("ncclAllReduce: invalid argument (unknown communicator)");
  const int64_t bytes = count * static_cast<int64_t>(shoal::DtypeSize(dtype));
  if (shoal_cuda_error e = TooLarge("ncclAllReduce", bytes)) return e;
  if (count <= 0) return nullptr;
  auto c = Collective(*m, {kAllreduce, dtype, count, reduce_op});
  auto from = std::make_shared<std::vector<shoal::ByteVec>>(m->size);
  c->move = [=](Comm& cm, Requests& r) -> std::string {
    for (int p = 0; p < cm.size; ++p) {
      if (p == cm.rank) continue;
      (*from)[p].resize(bytes);
      r.Recv((*from)[p].data(), bytes, p, cm.mpi);
    }
    for (int p = 0; p < cm.size; ++p)
      if (p != cm.rank) r.Send(buf, bytes, p, kTagData, cm.mpi);
    if (!r.Wait(Deadline())) return "the data of an allreduce did not arrive " + Within();
    // The reduction in rank order: the same bits on every rank.
    std::vector<const void*> srcs(cm.size);
    for (int p = 0; p < cm.size; ++p) srcs[p] = p == cm.rank ? buf : (*from)[p].data();
    shoal::Reduce(srcs, buf, dtype, static_cast<size_t>(count), reduce_op);
    return "";
  };
  return Issue(comm, stream, "ncclAllReduce", c);
}

shoal_cuda_error ReduceScatter(const void* send, void* recv, const int64_t* counts, int nranks, int dtype,
                               int reduce_op, void* comm, void* stream) {
  if (dtype == SHOAL_INT16 || dtype == SHOAL_BOOL || dtype < 0 || dtype > SHOAL_BOOL)
    return Fail(std::string("NCCL cannot reduce ") + (dtype == SHOAL_INT16 ? "int16" : dtype == SHOAL_BOOL ? "bool" : "this dtype") + " tensors");
  auto m = Peek(comm);
  if (!m) return Fail("ncclReduceScatter: invalid argument (unknown communicator)");
  if (nranks != m->size) return Fail("reducescatter: " + std::to_string(nranks) + " shares for " + std::to_string(m->size) + " ranks");
  Body body{kReduceScatter, dtype, reduce_op, nranks};
  int64_t total = 0;
  for (int r = 0; r < nranks; ++r) {
    body.push_back(counts[r]);
    total += counts[r];
  }
  const size_t es = shoal::DtypeSize(dtype);
  if (shoal_cuda_error e = TooLarge("ncclReduceScatter", total * static_cast<int64_t>(es))) return e;
  if (total == 0) return nullptr;
  auto c = Collective(*m, body);
  std::vector<int64_t> share(counts, counts + nranks);
  c->move = [=](Comm& cm, Requests& r) -> std::string {
    // Every rank's whole input to every rank, then the reduction in rank order (the same
    // bits everywhere), of which this rank keeps its share.
    std::vector<shoal::ByteVec> from(cm.size);
    for (int p = 0; p < cm.size; ++p) {
      if (p == cm.rank) continue;
      from[p].resize(total * es);
      r.Recv(from[p].data(), total * es, p, cm.mpi);
    }
    for (int p = 0; p < cm.size; ++p)
      if (p != cm.rank) r.Send(send, total * es, p, kTagData, cm.mpi);
    if (!r.Wait(Deadline())) return "the data of a reducescatter did not arrive " + Within();
    std::vector<const void*> srcs(cm.size);
    for (int p = 0; p < cm.size; ++p) srcs[p] = p == cm.rank ? send : from[p].data();
    shoal::ByteVec all(total * es);
    shoal::Reduce(srcs, all.data(), dtype, static_cast<size_t>(total), reduce_op);
    int64_t off = 0;
    for (int p = 0; p < cm.rank; ++p) off += share[p];
    std::memcpy(recv, all.data() + off * es, share[cm.rank] * es);
    return "";
  };
  return Issue(comm, stream, "ncclReduceScatter", c);
}

shoal_cuda_error Broadcast(void* buf, int64_t nbytes, int root, void* comm, void* stream) {
  auto m = Peek(comm);
  if (!m) return Fail("ncclBroadcast: invalid argument (unknown communicator)");
  if (root < 0 || root >= m->size) return Fail("ncclBroadcast: invalid argument (root " + std::to_string(root) + ")");
  if (shoal_cuda_error e = TooLarge("ncclBroadcast", nbytes)) return e;
  if (nbytes <= 0) return nullptr;
  auto c = Collective(*m, {kBroadcast, nbytes, root});
  c->move = [=](Comm& cm, Requests& r) -> std::string {
    if (cm.rank != root) r.Recv(buf, nbytes, root, cm.mpi);
    else for (int p = 0; p < cm.size; ++p) if (p != root) r.Send(buf, nbytes, p, kTagData, cm.mpi);
    return "";
  };
  return Issue(comm, stream, "ncclBroadcast", c);
}

shoal_cuda_error Allgatherv(const void* send, void* recv, const int64_t* nbytes, const int64_t* offsets, int nranks,
                            void* comm, void* stream) {
  auto m = Peek(comm);
  if (!m) return Fail("ncclBroadcast (allgather): invalid argument (unknown communicator)");
  if (nranks != m->size) return Fail("allgather: " + std::to_string(nranks) + " sizes for " + std::to_string(m->size) + " ranks");
  Body body{kAllgather, nranks};
  int64_t total = 0;
  for (int r = 0; r < nranks; ++r) {
    if (shoal_cuda_error e = TooLarge("ncclBroadcast (allgather)", nbytes[r])) return e;
    body.push_back(nbytes[r]);
    total += nbytes[r];
  }
  if (total == 0) return nullptr;
  auto c = Collective(*m, body);
  std::vector<int64_t> len(nbytes, nbytes + nranks), off(offsets, offsets + nranks);
  char* out = static_cast<char*>(recv);
  c->move = [=](Comm& cm, Requests& r) -> std::string {
    for (int p = 0; p < cm.size; ++p)
      if (p != cm.rank && len[p] > 0) r.Recv(out + off[p], len[p], p, cm.mpi);
    for (int p = 0; p < cm.size; ++p)
      if (p != cm.rank && len[cm.rank] > 0) r.Send(send, len[cm.rank], p, kTagData, cm.mpi);
    if (!r.Wait(Deadline())) return "the data of an allgather did not arrive " + Within();
    std::memmove(out + off[cm.rank], send, len[cm.rank]);
    return "";
  };
  return Issue(comm, stream, "ncclGroupEnd (allgather)", c);
}

// Per peer, the byte counts of this rank's sends to it and receives from it, in order.
struct Lanes {
  std::vector<int64_t> sends, recvs;
  std::vector<const void*> send_bufs;
  std::vector<void*> recv_bufs;
};

shoal_cuda_error Exchange(const shoal_nccl_peer* sends, int n_send, const shoal_nccl_peer* recvs, int n_recv, void* comm,
                          void* stream) {
  auto m = Peek(comm);
  if (!m) return Fail("ncclGroupEnd: invalid argument (unknown communicator)");
  std::map<int, Lanes> lanes;
  for (int k = 0; k < n_send + n_recv; ++k) {
    const shoal_nccl_peer& x = k < n_send ? sends[k] : recvs[k - n_send];
    if (x.peer < 0 || x.peer >= m->size || x.count < 0)
      return Fail(std::string(k < n_send ? "ncclSend" : "ncclRecv") + ": invalid argument (peer " + std::to_string(x.peer) + ")");
    if (shoal_cuda_error e = TooLarge("ncclSend/ncclRecv", x.count)) return e;
    Lanes& l = lanes[x.peer];
    if (k < n_send) l.sends.push_back(x.count), l.send_bufs.push_back(x.buf);
    else l.recvs.push_back(x.count), l.recv_bufs.push_back(x.buf);
  }
  if (lanes.empty()) return nullptr;
  auto it = lanes.find(m->rank);
  if (it != lanes.end() && it->second.sends != it->second.recvs)
    return Fail("ncclGroupEnd: sends to this rank " + Sizes(it->second.sends.data(), it->second.sends.size()) +
                " do not match its receives from itself " + Sizes(it->second.recvs.data(), it->second.recvs.size()));
  auto c = std::make_shared<Call>();
  for (auto& kv : lanes) {
    if (kv.first == m->rank) continue;
    const Lanes& l = kv.second;
    Body tell{kGroup, static_cast<int64_t>(l.sends.size())}, expect{kGroup, static_cast<int64_t>(l.recvs.size())};
    tell.insert(tell.end(), l.sends.begin(), l.sends.end());
    tell.push_back(static_cast<int64_t>(l.recvs.size()));
    tell.insert(tell.end(), l.recvs.begin(), l.recvs.end());
    expect.insert(expect.end(), l.recvs.begin(), l.recvs.end());  // the peer sends what this rank receives
    expect.push_back(static_cast<int64_t>(l.sends.size()));
    expect.insert(expect.end(), l.sends.begin(), l.sends.end());
    c->tell[kv.first] = tell;
    c->expect[kv.first] = expect;
  }
  c->move = [lanes](Comm& cm, Requests& r) -> std::string {
    for (auto& kv : lanes) {
      const Lanes& l = kv.second;
      if (kv.first == cm.rank) {
        for (size_t k = 0; k < l.sends.size(); ++k) std::memmove(l.recv_bufs[k], l.send_bufs[k], l.sends[k]);
        continue;
      }
      for (size_t k = 0; k < l.recvs.size(); ++k) r.Recv(l.recv_bufs[k], l.recvs[k], kv.first, cm.mpi);
      for (size_t k = 0; k < l.sends.size(); ++k) r.Send(l.send_bufs[k], l.sends[k], kv.first, kTagData, cm.mpi);
    }
    return "";
  };
  return Issue(comm, stream, "ncclGroupEnd", c);
}

}  // namespace

void FillNccl(shoal_cuda_api* t) { SHOAL_FILL_NCCL_TABLE(t); }

}  // namespace shoal_fake

// Test hook (not in the table): NCCL calls completed in this process.
extern "C" __attribute__((visibility("default"))) int64_t shoal_fake_nccl_calls(void) {
  return shoal_fake::calls_done.load();
}
