// MPI implementation of Backend: nonblocking collectives and point-to-point on
// communicators duplicated from MPI_COMM_WORLD (errors return, never abort).
#include <mpi.h>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <list>
#include <map>
#include <memory>

#include "common/config.h"
#include "engines/backend.h"
#include "engines/mpi/mpi_fault.h"

namespace shoal {
namespace {

bool g_we_initialized_mpi = false;

MPI_Datatype ReduceType(int dtype) {
  switch (dtype) {
    case SHOAL_FLOAT32: return MPI_FLOAT;
    case SHOAL_FLOAT64: return MPI_DOUBLE;
    case SHOAL_INT8: return MPI_INT8_T;
    case SHOAL_UINT8: return MPI_UINT8_T;
    case SHOAL_INT16: return MPI_INT16_T;
    case SHOAL_INT32: return MPI_INT32_T;
    case SHOAL_INT64: return MPI_INT64_T;
  }
  throw std::invalid_argument(std::string("no MPI reduction for ") + DtypeName(dtype));
}

MPI_Op ReduceOp(int reduce_op) {
  switch (reduce_op) {
    case SHOAL_REDUCE_SUM: return MPI_SUM;
    case SHOAL_REDUCE_MIN: return MPI_MIN;
    case SHOAL_REDUCE_MAX: return MPI_MAX;
    case SHOAL_REDUCE_PRODUCT: return MPI_PROD;
  }
  throw std::invalid_argument(std::string("no MPI op for reduce op ") + ReduceOpName(reduce_op));
}

// Data movement only needs the element width.
MPI_Datatype MoveType(int dtype) {
  switch (DtypeSize(dtype)) {
    case 1: return MPI_UINT8_T;
    case 2: return MPI_UINT16_T;
    case 4: return MPI_UINT32_T;
    default: return MPI_UINT64_T;
  }
}

int CheckedCount(int64_t n, const char* unit = "elements") {
  if (n > INT_MAX) throw std::invalid_argument(std::string("more than 2^31-1 ") + unit + " in one message");
  return static_cast<int>(n);
}

// An MPI request in flight and what to run when it completes.
struct Op {
  Bytes keep;
  Callback done;
  const char* what;  // the MPI call ("... to rank", followed by the peer, formatted only on failure)
  MPI_Request req = MPI_REQUEST_NULL;
  int peer = -1;
  std::string Describe() const {
    if (peer < 0) return what;
    return std::string(what) + " " + std::to_string(peer);
  }
};

// The requests in flight of one backend (its groups' collectives too).
class Requests {
 public:
  explicit Requests(LossWatch* watch) : watch_(watch) {}
  // Never throws: a failure to start is reported through the op's callback.
  template <typename F> void Start(Op op, F&& start) {
    int rc;
    try {
      rc = start(&op.req);
    } catch (const std::exception& ex) {
      op.done(Status::Error(SHOAL_INVALID_ARGUMENT, op.Describe() + ": " + ex.what()));
      return;
    }
    if (rc != MPI_SUCCESS) {
      op.done(watch_->Error(rc, op.Describe()));
      return;
    }
    ops_.push_back(std::move(op));
  }

  bool Progress() {
    bool any = false;
    for (auto it = ops_.begin(); it != ops_.end();) {
      int flag = 0;
      int rc = MPI_Test(&it->req, &flag, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS || flag) {
        Op op = std::move(*it);
        it = ops_.erase(it);
        op.done(rc == MPI_SUCCESS ? Status::Ok() : watch_->Error(rc, op.Describe()));
        any = true;
      } else {
        ++it;
      }
    }
    return any;
  }

  size_t size() const { return ops_.size(); }
  Status Failure(int rc, const std::string& what) { return watch_->Error(rc, what); }

 private:
  LossWatch* watch_;
  std::list<Op> ops_;
};

// The collectives of every rank (on duplicates of MPI_COMM_WORLD, machine scope on the
// machine's communicator) or of a process set (on the communicator its members made): the
// group owns its communicators; its requests complete in the backend's Progress().
class MpiGroup : public GroupCollectives {
 public:
  MpiGroup(Requests* requests, const LossWatch* watch, MPI_Comm comm, MPI_Comm local, int channels)
      : requests_(requests), watch_(watch), comm_(comm), local_(local), channels_(channels, MPI_COMM_NULL) {
    for (MPI_Comm c : {comm_, local_}) MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
  }
  ~MpiGroup() override {
    // Requests still open here belong to peers that never answered; freeing the
    // communicators defers to MPI, which completes or discards them. After a lost rank
    // they are left alone: freeing a communicator with a dead member is not fault tolerant.
    if (watch_->lost()) return;
    for (MPI_Comm& c : channels_)
      if (c != MPI_COMM_NULL) MPI_Comm_free(&c);
    if (local_ != comm_ && local_ != MPI_COMM_NULL) MPI_Comm_free(&local_);
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }
  // The channels of cached batches: duplicates of the group's communicator (collective
  // over its members).
  Status MakeChannels() {
    for (MPI_Comm& c : channels_) {
      int rc = MPI_Comm_dup(comm_, &c);
      if (rc != MPI_SUCCESS) return requests_->Failure(rc, "MPI_Comm_dup");
      MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
    }
    return Status::Ok();
  }

  void Allreduce(void* buf, int64_t count, int dtype, int reduce_op, int scope, Callback done) override {
    requests_->Start(Op{{}, std::move(done), "MPI_Iallreduce"}, [&](MPI_Request* r) {
      return MPI_Iallreduce(MPI_IN_PLACE, buf, CheckedCount(count), ReduceType(dtype), ReduceOp(reduce_op),
                            Comm(scope), r);
    });
  }

  void AllreduceOn(int channel, void* buf, int64_t count, int dtype, Callback done) override {
    requests_->Start(Op{{}, std::move(done), "MPI_Iallreduce"}, [&](MPI_Request* r) {
      return MPI_Iallreduce(MPI_IN_PLACE, buf, CheckedCount(count), ReduceType(dtype), MPI_SUM,
                            channels_.at(channel), r);
    });
  }

  void BroadcastOn(int channel, void* buf, int64_t count, int dtype, int root, Callback done) override {
    requests_->Start(Op{{}, std::move(done), "MPI_Ibcast"}, [&](MPI_Request* r) {
      return MPI_Ibcast(buf, CheckedCount(count), MoveType(dtype), root, channels_.at(channel), r);
    });
  }

  void Broadcast(void* buf, int64_t count, int dtype, int root, int scope, Callback done) override {
    requests_->Start(Op{{}, std::move(done), "MPI_Ibcast"}, [&](MPI_Request* r) {
      return MPI_Ibcast(buf, CheckedCount(count), MoveType(dtype), root, Comm(scope), r);
    });
  }

  void Allgatherv(const void* send, int64_t count, void* recv, const std::vector<int64_t>& counts,
                  int dtype, Callback done) override {
    auto c = std::make_shared<std::vector<int>>(counts.size());
    auto d = std::make_shared<std::vector<int>>(counts.size());
    Callback keep_alive = [c, d, done = std::move(done)](const Status& s) { done(s); };
    requests_->Start(Op{{}, std::move(keep_alive), "MPI_Iallgatherv"}, [&](MPI_Request* r) {
      int64_t off = 0;
      for (size_t i = 0; i < counts.size(); ++i) {
        (*c)[i] = CheckedCount(counts[i]);
        (*d)[i] = CheckedCount(off);
        off += counts[i];
      }
      return MPI_Iallgatherv(send, CheckedCount(count), MoveType(dtype), recv, c->data(),
                             d->data(), MoveType(dtype), comm_, r);
    });
  }

  void ReduceScatter(const void* send, void* recv, const std::vector<int64_t>& counts, int dtype, int reduce_op,
                     Callback done) override {
    auto c = std::make_shared<std::vector<int>>(counts.size());
    Callback keep_alive = [c, done = std::move(done)](const Status& s) { done(s); };
    const bool even = std::all_of(counts.begin(), counts.end(), [&](int64_t k) { return k == counts[0]; });
    requests_->Start(Op{{}, std::move(keep_alive), even ? "MPI_Ireduce_scatter_block" : "MPI_Ireduce_scatter"},
                     [&](MPI_Request* r) {
                       for (size_t i = 0; i < counts.size(); ++i) (*c)[i] = CheckedCount(counts[i]);
                       if (even)  // the block form: MPI libraries have faster algorithms for it
                         return MPI_Ireduce_scatter_block(send, recv, (*c)[0], ReduceType(dtype), ReduceOp(reduce_op),
                                                          comm_, r);
                       return MPI_Ireduce_scatter(send, recv, c->data(), ReduceType(dtype), ReduceOp(reduce_op),
                                                  comm_, r);
                     });
  }

  void Alltoallv(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                 const std::vector<int64_t>& recv_counts, int dtype, Callback done) override {
    // counts and displacements: send, then receive (MPI reads them until completion)
    auto v = std::make_shared<std::array<std::vector<int>, 4>>();
    Callback keep_alive = [v, done = std::move(done)](const Status& s) { done(s); };
    requests_->Start(Op{{}, std::move(keep_alive), "MPI_Ialltoallv"}, [&](MPI_Request* r) {
      for (int k = 0; k < 2; ++k) {
        const std::vector<int64_t>& counts = k ? recv_counts : send_counts;
        int64_t off = 0;
        for (int64_t c : counts) {
          (*v)[2 * k].push_back(CheckedCount(c));
          (*v)[2 * k + 1].push_back(CheckedCount(off));
          off += c;
        }
      }
      return MPI_Ialltoallv(send, (*v)[0].data(), (*v)[1].data(), MoveType(dtype), recv, (*v)[2].data(),
                            (*v)[3].data(), MoveType(dtype), comm_, r);
    });
  }

  void Barrier(Callback done) override {
    requests_->Start(Op{{}, std::move(done), "MPI_Ibarrier"},
                     [&](MPI_Request* r) { return MPI_Ibarrier(comm_, r); });
  }

  bool Progress() override { return requests_->Progress(); }
  size_t num_in_flight() const override { return requests_->size(); }

 private:
  // Machine-scope collectives run on the local communicator; the coordinator's one
  // global order keeps every machine's order consistent too.
  MPI_Comm Comm(int scope) const { return scope == SHOAL_SCOPE_MACHINE ? local_ : comm_; }

  Requests* requests_;
  const LossWatch* watch_;
  MPI_Comm comm_, local_;
  std::vector<MPI_Comm> channels_;
};

class MpiBackend : public Backend {
 public:
  MpiBackend(const Config& cfg, Status* st) : watch_(cfg.fault_tolerant), requests_(&watch_) {
    int inited = 0, finalized = 0;
    MPI_Initialized(&inited);
    MPI_Finalized(&finalized);
    if (finalized) {
      *st = Status::Error(SHOAL_ABORTED, "MPI was already finalized; Shoal cannot start again in this process");
      return;
    }
    int provided = 0;
    if (!inited) {
      MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      g_we_initialized_mpi = true;
    } else {
      MPI_Query_thread(&provided);
    }
    info_.threads_multiple = provided == MPI_THREAD_MULTIPLE;
    MPI_Comm coll = MPI_COMM_NULL, local = MPI_COMM_NULL;
    std::string why;
    if (cfg.fault_tolerant && !MpiFaultTolerant(&why)) {
      *st = Status::Error(SHOAL_INVALID_ARGUMENT, why);
      return;
    }
    if (cfg.fault_tolerant)  // an error about a dead peer is reported, not fatal, whatever it came on
      for (MPI_Comm c : {MPI_COMM_WORLD, MPI_COMM_SELF}) MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
    // Collective over the job's ranks: with a dead one, fails (fault-tolerant mode: with
    // SHOAL_RANK_LOST, and the caller shrinks again).
    auto ok = [&](int rc, const char* what) {
      if (rc != MPI_SUCCESS && st->ok()) *st = watch_.Error(rc, what);
      return st->ok();
    };
    MPI_Comm job = MpiJobComm();
    if (!ok(MPI_Comm_dup(job, &ctrl_), "MPI_Comm_dup")) return;
    watch_.Watch(ctrl_);
    if (!ok(MPI_Comm_dup(job, &coll), "MPI_Comm_dup") || !ok(MPI_Comm_dup(job, &sets_parent_), "MPI_Comm_dup")) return;
    for (MPI_Comm c : {ctrl_, sets_parent_}) MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
    MPI_Comm_rank(ctrl_, &info_.rank);
    MPI_Comm_size(ctrl_, &info_.size);
    const int rc = cfg.ranks_per_machine > 0
                       ? MPI_Comm_split(ctrl_, info_.rank / cfg.ranks_per_machine, info_.rank, &local)
                       : MPI_Comm_split_type(ctrl_, MPI_COMM_TYPE_SHARED, info_.rank, MPI_INFO_NULL, &local);
    if (!ok(rc, "MPI_Comm_split")) return;
    world_ = std::make_unique<MpiGroup>(&requests_, &watch_, coll, local, kChannels);
    if (Status made = world_->MakeChannels(); !made.ok()) {
      *st = watch_.lost() ? Status::Error(SHOAL_RANK_LOST, made.message) : made;
      return;
    }
    MPI_Comm_rank(local, &info_.local_rank);
    MPI_Comm_size(local, &info_.local_size);
    {
      MPI_Group world_group = MPI_GROUP_NULL, local_group = MPI_GROUP_NULL;
      MPI_Comm_group(ctrl_, &world_group);
      MPI_Comm_group(local, &local_group);
      std::vector<int> locals(info_.local_size);
      for (int l = 0; l < info_.local_size; ++l) locals[l] = l;
      info_.machine_ranks.resize(info_.local_size);
      MPI_Group_translate_ranks(local_group, info_.local_size, locals.data(), world_group, info_.machine_ranks.data());
      MPI_Group_free(&local_group);
      MPI_Group_free(&world_group);
    }
    // Homogeneous: equal local sizes and contiguous placement (rank = m*L + l).
    int mine[2] = {info_.local_size, info_.rank % info_.local_size == info_.local_rank};
    std::vector<int> all(2 * info_.size);
    if (!ok(MPI_Allgather(mine, 2, MPI_INT, all.data(), 2, MPI_INT, ctrl_), "MPI_Allgather")) return;
    info_.homogeneous = true;
    for (int r = 0; r < info_.size; ++r)
      info_.homogeneous &= all[2 * r] == info_.local_size && all[2 * r + 1];
    info_.machine_size = info_.size / info_.local_size;
    info_.machine_rank = info_.rank / info_.local_size;
  }

  ~MpiBackend() override {
    sets_.clear();
    world_.reset();
    // ctrl_ is never freed: a message still unmatched on it (in flight at shutdown) would
    // match the probes of a later runtime's communicator that got its context id back
    // (Open MPI 4.1 reuses it; seen as lost neighbor messages after init, shutdown, init).
    if (sets_parent_ != MPI_COMM_NULL && !watch_.lost()) MPI_Comm_free(&sets_parent_);
  }

  const WorldInfo& world() const override { return info_; }

  void Send(int dst, int tag, Bytes msg, Callback done) override {
    Op op;
    op.keep = msg;
    op.done = std::move(done);
    op.what = "MPI_Isend to rank";
    op.peer = dst;
    requests_.Start(std::move(op), [&](MPI_Request* r) {
      return MPI_Isend(msg->data(), CheckedCount(msg->size(), "bytes"), MPI_BYTE, dst, tag, ctrl_, r);
    });
  }

  void SendFrom(int dst, int tag, const void* data, size_t n, Callback done) override {
    Op op{{}, std::move(done), "MPI_Isend to rank"};
    op.peer = dst;
    requests_.Start(std::move(op), [&](MPI_Request* r) {
      return MPI_Isend(data, CheckedCount(n, "bytes"), MPI_BYTE, dst, tag, ctrl_, r);
    });
  }

  void ReceiveInto(int src, int tag, void* data, size_t n, Callback done) override {
    Op op{{}, std::move(done), "MPI_Irecv from rank"};
    op.peer = src;
    requests_.Start(std::move(op), [&](MPI_Request* r) {
      return MPI_Irecv(data, CheckedCount(n, "bytes"), MPI_BYTE, src, tag, ctrl_, r);
    });
  }

  bool Receive(const std::vector<int>& tags, int* tag, int* src, ByteVec* msg, Status* st) override {
    int flag = 0;
    MPI_Message m;
    MPI_Status s;
    int rc = MPI_SUCCESS;
    // One probe per tag: with MPI_ANY_TAG the MPICH wheel sees small shared-memory
    // messages hundreds of microseconds late.
    for (int t : tags) {
      rc = MPI_Improbe(MPI_ANY_SOURCE, t, ctrl_, &flag, &m, &s);
      if (flag || rc != MPI_SUCCESS) break;
    }
    if (rc != MPI_SUCCESS) {
      *st = watch_.Error(rc, "MPI_Improbe");
      return false;
    }
    if (!flag) return false;
    int count = 0;
    MPI_Get_count(&s, MPI_BYTE, &count);
    msg->resize(count);
    // A matched message: its sender is already sending, so this cannot deadlock.
    rc = MPI_Mrecv(msg->data(), count, MPI_BYTE, &m, &s);
    *src = s.MPI_SOURCE;
    *tag = s.MPI_TAG;
    if (rc != MPI_SUCCESS) *st = watch_.Error(rc, "MPI_Mrecv");
    return true;
  }

  // Every rank's collectives: the world group's.
  void Allreduce(void* buf, int64_t count, int dtype, int reduce_op, int scope, Callback done) override {
    world_->Allreduce(buf, count, dtype, reduce_op, scope, std::move(done));
  }
  void AllreduceOn(int channel, void* buf, int64_t count, int dtype, Callback done) override {
    world_->AllreduceOn(channel, buf, count, dtype, std::move(done));
  }
  void BroadcastOn(int channel, void* buf, int64_t count, int dtype, int root, Callback done) override {
    world_->BroadcastOn(channel, buf, count, dtype, root, std::move(done));
  }
  void Broadcast(void* buf, int64_t count, int dtype, int root, int scope, Callback done) override {
    world_->Broadcast(buf, count, dtype, root, scope, std::move(done));
  }
  void Allgatherv(const void* send, int64_t count, void* recv, const std::vector<int64_t>& counts, int dtype,
                  Callback done) override {
    world_->Allgatherv(send, count, recv, counts, dtype, std::move(done));
  }
  void ReduceScatter(const void* send, void* recv, const std::vector<int64_t>& counts, int dtype, int reduce_op,
                     Callback done) override {
    world_->ReduceScatter(send, recv, counts, dtype, reduce_op, std::move(done));
  }
  void Alltoallv(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                 const std::vector<int64_t>& recv_counts, int dtype, Callback done) override {
    world_->Alltoallv(send, send_counts, recv, recv_counts, dtype, std::move(done));
  }
  void Barrier(Callback done) override { world_->Barrier(std::move(done)); }

  Status AddSet(int id, const std::vector<int>& ranks) override {
    // MPI_Comm_create_group: only the members take part (the other ranks go on with their
    // own ops), matched by a tag of this set among the sets being made.
    MPI_Group world = MPI_GROUP_NULL, group = MPI_GROUP_NULL;
    MPI_Comm_group(sets_parent_, &world);
    MPI_Group_incl(world, static_cast<int>(ranks.size()), ranks.data(), &group);
    MPI_Comm comm = MPI_COMM_NULL;
    int rc = MPI_Comm_create_group(sets_parent_, group, id % 32768, &comm);  // MPI_TAG_UB >= 32767
    MPI_Group_free(&group);
    MPI_Group_free(&world);
    if (rc != MPI_SUCCESS) return Status::Error(SHOAL_ABORTED, MpiError(rc, "MPI_Comm_create_group"));
    auto set = std::make_unique<MpiGroup>(&requests_, &watch_, comm, comm, kSetChannels);
    Status st = set->MakeChannels();
    if (!st.ok()) return st;
    sets_[id] = std::move(set);
    return Status::Ok();
  }

  void RemoveSet(int id) override { sets_.erase(id); }  // outstanding requests complete first (MPI defers the free)

  GroupCollectives* OfSet(int id) override {
    auto it = sets_.find(id);
    return it == sets_.end() ? nullptr : it->second.get();
  }

  bool Progress() override { return requests_.Progress(); }
  size_t num_in_flight() const override { return requests_.size(); }
  bool Lost() const override { return watch_.lost(); }

 private:
  WorldInfo info_;
  LossWatch watch_;
  Requests requests_;
  MPI_Comm ctrl_ = MPI_COMM_NULL;
  MPI_Comm sets_parent_ = MPI_COMM_NULL;  // process sets are made from it (AddSet)
  std::unique_ptr<MpiGroup> world_;
  std::map<int, std::unique_ptr<MpiGroup>> sets_;
};

}  // namespace

std::unique_ptr<Backend> CreateMpiBackend(const Config& cfg, Status* st) {
  auto b = std::make_unique<MpiBackend>(cfg, st);
  if (!st->ok()) return nullptr;
  return b;
}

void FinalizeMpiIfOwned() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (g_we_initialized_mpi && !finalized) MPI_Finalize();
  g_we_initialized_mpi = false;
}

void AbortJob(int exit_code) {
  int inited = 0, finalized = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&finalized);
  if (inited && !finalized) MPI_Abort(MPI_COMM_WORLD, exit_code);
  std::_Exit(exit_code);
}

std::string MpiLibraryVersion() {
  char v[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  MPI_Get_library_version(v, &len);
  return std::string(v, len);
}

}  // namespace shoal

// MPI's profiling interface: a rank that calls MPI_Abort (mpi4py's Comm.Abort, say) records
// it for shoalrun first, because the launcher then kills every process of the job at once,
// before the rank's wrapper can see how it ended. Same record as launcher/rank.py's
// write_status; an existing record (the exception hook's) is kept.
extern "C" __attribute__((visibility("default"))) int MPI_Abort(MPI_Comm comm, int errorcode) {
  const std::string status_dir = shoal::Config::StatusDir();
  const char* dir = status_dir.c_str();
  int rank = -1, inited = 0, finalized = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&finalized);
  if (inited && !finalized) PMPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (dir && *dir && rank >= 0) {
    const std::string path = std::string(dir) + "/rank" + std::to_string(rank) + ".status";
    const std::string tmp = path + ".tmp." + std::to_string(static_cast<long>(getpid()));
    if (access(path.c_str(), F_OK) != 0) {
      if (FILE* f = std::fopen(tmp.c_str(), "w")) {
        const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
        std::fprintf(f, "%.6f %d 1 called MPI_Abort (error code %d)\n", now, rank, errorcode);
        std::fclose(f);
        std::rename(tmp.c_str(), path.c_str());
      }
    }
  }
  return PMPI_Abort(comm, errorcode);
}
