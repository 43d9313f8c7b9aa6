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

#include "../../backend.h"

namespace shoal {
namespace {

bool g_we_initialized_mpi = false;

std::string MpiError(int code, const char* what) {
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, msg, &len);
  return std::string(what) + " failed: " + std::string(msg, len);
}

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

class MpiBackend : public Backend {
 public:
  MpiBackend(const Config& cfg, Status* st) {
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
    MPI_Comm_dup(MPI_COMM_WORLD, &ctrl_);
    MPI_Comm_dup(MPI_COMM_WORLD, &coll_);
    for (MPI_Comm c : {ctrl_, coll_}) MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
    MPI_Comm_rank(ctrl_, &info_.rank);
    MPI_Comm_size(ctrl_, &info_.size);
    if (cfg.ranks_per_machine > 0)
      MPI_Comm_split(ctrl_, info_.rank / cfg.ranks_per_machine, info_.rank, &local_);
    else
      MPI_Comm_split_type(ctrl_, MPI_COMM_TYPE_SHARED, info_.rank, MPI_INFO_NULL, &local_);
    MPI_Comm_set_errhandler(local_, MPI_ERRORS_RETURN);
    for (MPI_Comm& c : channels_) {
      MPI_Comm_dup(coll_, &c);
      MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
    }
    MPI_Comm_rank(local_, &info_.local_rank);
    MPI_Comm_size(local_, &info_.local_size);
    // Homogeneous: equal local sizes and contiguous placement (rank = m*L + l).
    int mine[2] = {info_.local_size, info_.rank % info_.local_size == info_.local_rank};
    std::vector<int> all(2 * info_.size);
    MPI_Allgather(mine, 2, MPI_INT, all.data(), 2, MPI_INT, ctrl_);
    info_.homogeneous = true;
    for (int r = 0; r < info_.size; ++r)
      info_.homogeneous &= all[2 * r] == info_.local_size && all[2 * r + 1];
    info_.machine_size = info_.size / info_.local_size;
    info_.machine_rank = info_.rank / info_.local_size;
  }

  ~MpiBackend() override {
    // Requests still open here belong to peers that never answered; freeing the
    // communicators defers to MPI, which completes or discards them.
    for (MPI_Comm* c : {&ctrl_, &coll_, &local_})
      if (*c != MPI_COMM_NULL) MPI_Comm_free(c);
    for (MPI_Comm& c : channels_)
      if (c != MPI_COMM_NULL) MPI_Comm_free(&c);
  }

  const WorldInfo& world() const override { return info_; }

  void Send(int dst, int tag, Bytes msg, Callback done) override {
    Op op;
    op.keep = msg;
    op.done = std::move(done);
    op.what = "MPI_Isend to rank";
    op.peer = dst;
    Start(std::move(op), [&](MPI_Request* r) {
      return MPI_Isend(msg->data(), CheckedCount(msg->size(), "bytes"), MPI_BYTE, dst, tag, ctrl_, r);
    });
  }

  void SendFrom(int dst, int tag, const void* data, size_t n, Callback done) override {
    Op op{{}, std::move(done), "MPI_Isend to rank"};
    op.peer = dst;
    Start(std::move(op), [&](MPI_Request* r) {
      return MPI_Isend(data, CheckedCount(n, "bytes"), MPI_BYTE, dst, tag, ctrl_, r);
    });
  }

  void ReceiveInto(int src, int tag, void* data, size_t n, Callback done) override {
    Op op{{}, std::move(done), "MPI_Irecv from rank"};
    op.peer = src;
    Start(std::move(op), [&](MPI_Request* r) {
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
      *st = Status::Error(SHOAL_ABORTED, MpiError(rc, "MPI_Improbe"));
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
    if (rc != MPI_SUCCESS) *st = Status::Error(SHOAL_ABORTED, MpiError(rc, "MPI_Mrecv"));
    return true;
  }

  void Allreduce(void* buf, int64_t count, int dtype, int reduce_op, int scope, Callback done) override {
    Start(Op{{}, std::move(done), "MPI_Iallreduce"}, [&](MPI_Request* r) {
      return MPI_Iallreduce(MPI_IN_PLACE, buf, CheckedCount(count), ReduceType(dtype), ReduceOp(reduce_op),
                            Comm(scope), r);
    });
  }

  void AllreduceOn(int channel, void* buf, int64_t count, int dtype, Callback done) override {
    Start(Op{{}, std::move(done), "MPI_Iallreduce"}, [&](MPI_Request* r) {
      return MPI_Iallreduce(MPI_IN_PLACE, buf, CheckedCount(count), ReduceType(dtype), MPI_SUM,
                            channels_.at(channel), r);
    });
  }

  void Broadcast(void* buf, int64_t count, int dtype, int root, int scope, Callback done) override {
    Start(Op{{}, std::move(done), "MPI_Ibcast"}, [&](MPI_Request* r) {
      return MPI_Ibcast(buf, CheckedCount(count), MoveType(dtype), root, Comm(scope), r);
    });
  }

  void Allgatherv(const void* send, int64_t count, void* recv, const std::vector<int64_t>& counts,
                  int dtype, Callback done) override {
    auto c = std::make_shared<std::vector<int>>(counts.size());
    auto d = std::make_shared<std::vector<int>>(counts.size());
    Callback keep_alive = [c, d, done = std::move(done)](const Status& s) { done(s); };
    Start(Op{{}, std::move(keep_alive), "MPI_Iallgatherv"}, [&](MPI_Request* r) {
      int64_t off = 0;
      for (size_t i = 0; i < counts.size(); ++i) {
        (*c)[i] = CheckedCount(counts[i]);
        (*d)[i] = CheckedCount(off);
        off += counts[i];
      }
      return MPI_Iallgatherv(send, CheckedCount(count), MoveType(dtype), recv, c->data(),
                             d->data(), MoveType(dtype), coll_, r);
    });
  }

  void ReduceScatter(const void* send, void* recv, const std::vector<int64_t>& counts, int dtype, int reduce_op,
                     Callback done) override {
    auto c = std::make_shared<std::vector<int>>(counts.size());
    Callback keep_alive = [c, done = std::move(done)](const Status& s) { done(s); };
    const bool even = std::all_of(counts.begin(), counts.end(), [&](int64_t k) { return k == counts[0]; });
    Start(Op{{}, std::move(keep_alive), even ? "MPI_Ireduce_scatter_block" : "MPI_Ireduce_scatter"},
          [&](MPI_Request* r) {
            for (size_t i = 0; i < counts.size(); ++i) (*c)[i] = CheckedCount(counts[i]);
            if (even)  // the block form: MPI libraries have faster algorithms for it
              return MPI_Ireduce_scatter_block(send, recv, (*c)[0], ReduceType(dtype), ReduceOp(reduce_op), coll_, r);
            return MPI_Ireduce_scatter(send, recv, c->data(), ReduceType(dtype), ReduceOp(reduce_op), coll_, r);
          });
  }

  void Alltoallv(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                 const std::vector<int64_t>& recv_counts, int dtype, Callback done) override {
    // counts and displacements: send, then receive (MPI reads them until completion)
    auto v = std::make_shared<std::array<std::vector<int>, 4>>();
    Callback keep_alive = [v, done = std::move(done)](const Status& s) { done(s); };
    Start(Op{{}, std::move(keep_alive), "MPI_Ialltoallv"}, [&](MPI_Request* r) {
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
                            (*v)[3].data(), MoveType(dtype), coll_, r);
    });
  }

  void Barrier(Callback done) override {
    Start(Op{{}, std::move(done), "MPI_Ibarrier"},
          [&](MPI_Request* r) { return MPI_Ibarrier(coll_, r); });
  }

  bool Progress() override {
    bool any = false;
    for (auto it = ops_.begin(); it != ops_.end();) {
      int flag = 0;
      int rc = MPI_Test(&it->req, &flag, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS || flag) {
        Op op = std::move(*it);
        it = ops_.erase(it);
        op.done(rc == MPI_SUCCESS ? Status::Ok() : Status::Error(SHOAL_ABORTED, MpiError(rc, op.Describe().c_str())));
        any = true;
      } else {
        ++it;
      }
    }
    return any;
  }

  size_t num_in_flight() const override { return ops_.size(); }

 private:
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

  // Machine-scope collectives run on the local communicator; the coordinator's one
  // global order keeps every machine's order consistent too.
  MPI_Comm Comm(int scope) const { return scope == SHOAL_SCOPE_MACHINE ? local_ : coll_; }

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
      op.done(Status::Error(SHOAL_ABORTED, MpiError(rc, op.Describe().c_str())));
      return;
    }
    ops_.push_back(std::move(op));
  }

  WorldInfo info_;
  MPI_Comm ctrl_ = MPI_COMM_NULL, coll_ = MPI_COMM_NULL, local_ = MPI_COMM_NULL;
  std::array<MPI_Comm, kChannels> channels_;
  std::list<Op> ops_;
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
  const char* dir = std::getenv("SHOAL_STATUS_DIR");
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
