#include "engines/mpi/mpi_window_delivery.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <string>
#include <thread>

#include "common/reduce.h"
#include "engines/mpi/mpi_windows.h"

namespace shoal {
namespace mpiwin {
namespace {

constexpr int kHeaderTag = 1, kPayloadTag = 2;
constexpr int32_t kAccumulate = 1, kWithP = 2;
// Answers: 0 taken; else why not.
constexpr int32_t kBadParcel = 1;

void Pause(int64_t polls, int64_t longest_us) {
  std::this_thread::sleep_for(std::chrono::microseconds(std::min(longest_us, 5 + 5 * std::min(polls, longest_us))));
}

// The error of a request that failed inside MPI_Testall (else `rc` itself).
int RequestError(int rc, const MPI_Status* st, int n) {
  int cls = MPI_SUCCESS;
  MPI_Error_class(rc, &cls);
  if (cls != MPI_ERR_IN_STATUS) return rc;
  for (int i = 0; i < n; ++i) {
    MPI_Error_class(st[i].MPI_ERROR, &cls);
    if (cls != MPI_SUCCESS && cls != MPI_ERR_PENDING) return st[i].MPI_ERROR;
  }
  return rc;
}

}  // namespace

struct Delivery::Outgoing {
  Header header{};
  int32_t answer = -1;
  std::shared_ptr<std::vector<char>> bytes;
  MPI_Request req[3] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL, MPI_REQUEST_NULL};  // answer, header, payload
};

Delivery::Delivery(MPI_Comm comm, const Config& cfg, Stats* stats, WindowCancel* cancel)
    : cfg_(cfg), stats_(stats), cancel_(cancel) {
  MPI_Comm_dup(comm, &data_);
  MPI_Comm_dup(comm, &replies_);
  MPI_Comm_set_errhandler(data_, MPI_ERRORS_RETURN);
  MPI_Comm_set_errhandler(replies_, MPI_ERRORS_RETURN);
  MPI_Comm_rank(comm, &rank_);
}

Delivery::~Delivery() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  // MPI may still write an answer into a batch given up on, or read its payload, until
  // MPI_Finalize: those are never freed.
  if (!abandoned_.empty()) (void)new std::vector<std::shared_ptr<Batch>>(std::move(abandoned_));
}

void Delivery::Add(Window* w) {
  std::lock_guard<std::mutex> lock(mu_);
  windows_[w->id] = w;
  senders_.insert(w->recv.begin(), w->recv.end());
  if (!thread_.joinable()) thread_ = std::thread([this] { Serve(); });
}

void Delivery::Remove(Window* w) {
  std::lock_guard<std::mutex> lock(mu_);
  windows_.erase(w->id);
}

struct Delivery::Batch {
  std::vector<std::shared_ptr<Outgoing>> out;
  std::vector<int> dst;
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  bool warned = false;
};

std::shared_ptr<Delivery::Batch> Delivery::Post(Window* w, const std::vector<Parcel>& parcels) {
  auto b = std::make_shared<Batch>();
  try {
    for (const Parcel& p : parcels) {
      auto o = std::make_shared<Outgoing>();
      b->out.push_back(o);
      b->dst.push_back(p.dst);
      o->bytes = p.bytes;
      next_tag_ = next_tag_ % 30000 + 1;  // MPI guarantees tags up to 32767
      o->header = Header{w->id, p.slot, (p.accumulate ? kAccumulate : 0) | (p.with_p ? kWithP : 0), next_tag_,
                         static_cast<int64_t>(w->nbytes), p.p};
      // The answer's receive first: it must be posted before the owner can send it.
      int rc = MPI_Irecv(&o->answer, 1, MPI_INT32_T, p.dst, next_tag_, replies_, &o->req[0]);
      if (rc == MPI_SUCCESS) rc = MPI_Isend(&o->header, sizeof(Header), MPI_BYTE, p.dst, kHeaderTag, data_, &o->req[1]);
      if (rc == MPI_SUCCESS && w->nbytes > 0)
        rc = MPI_Isend(o->bytes->data(), static_cast<int>(w->nbytes), MPI_BYTE, p.dst, kPayloadTag, data_, &o->req[2]);
      if (rc != MPI_SUCCESS) Failed(rc, p.dst);
    }
  } catch (...) {
    Keep(b);
    throw;
  }
  return b;
}

void Delivery::Failed(int rc, int dst) {
  if (cancel_->stop) throw MpiFailure("Shoal was shut down while a put was in flight");  // not the next runtime's loss
  Status st = ReportMpiFailure(rc, "a put to rank " + std::to_string(dst));
  if (st.code == SHOAL_RANK_LOST) throw RankLost(st.message);
  throw MpiFailure(st.message);
}

bool Delivery::Test(const std::shared_ptr<Batch>& b) {
  try {
    size_t done = 0;
    for (size_t i = 0; i < b->out.size(); ++i) {
      int flag = 0;
      MPI_Status st[3];
      const int rc = MPI_Testall(3, b->out[i]->req, &flag, st);
      if (rc != MPI_SUCCESS) Failed(RequestError(rc, st, 3), b->dst[i]);  // a process failure, say
      done += flag ? 1 : 0;
    }
    if (done < b->out.size()) {
      if (cancel_->stop) throw MpiFailure("Shoal was shut down while a put was in flight");
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - b->start).count();
      if (cfg_.stall_shutdown_time > 0 && waited > cfg_.stall_shutdown_time)
        throw MpiFailure("a put found no owner to take it within " + std::to_string(static_cast<int>(waited)) +
                         " s (SHOAL_STALL_SHUTDOWN_TIME); window ops are off from here");
      if (!b->warned && cfg_.stall_check_time > 0 && waited > cfg_.stall_check_time) {
        Log(LOG_WARNING, "a put has waited " + std::to_string(static_cast<int>(waited)) + " s for its owner");
        b->warned = true;
      }
      return false;
    }
  } catch (...) {
    Keep(b);
    throw;
  }
  for (size_t i = 0; i < b->out.size(); ++i)
    if (b->out[i]->answer != 0)
      throw MpiFailure("rank " + std::to_string(b->dst[i]) + " refused a put: it holds no such window "
                       "(freed there?), or one of another size");
  return true;
}

void Delivery::Send(Window* w, const std::vector<Parcel>& parcels) {
  auto b = Post(w, parcels);
  for (int64_t polls = 0; !Test(b); ++polls) Pause(polls, 100);
}

bool Delivery::Drain(MPI_Request* req) {
  for (int64_t polls = 0;; ++polls) {
    int flag = 0;
    if (MPI_Test(req, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS) return false;
    if (flag) return true;
    if (Stopping()) return false;
    Pause(polls, 50);
  }
}

// The delivery thread: takes one parcel at a time, from any sender, until stopped. One
// receive is posted per possible sender (an in-neighbour of some window), not one from
// MPI_ANY_SOURCE: under MPICH, with another thread in MPI, a message between machines
// was at times never matched to a wildcard receive (seen on the emulated cluster). It
// sleeps between polls (never a blocking MPI wait: MPI spins in those, and the ranks share
// the cores with their compute), longer the longer it has been idle.
void Delivery::Serve() {
  struct Inbox {
    std::vector<int> from;             // a sender per receive
    std::deque<Header> headers;        // stable addresses: MPI writes them
    std::vector<MPI_Request> pending;  // MPI_REQUEST_NULL: to be posted again
    int32_t answer = 0;
    std::vector<char> staging;
  };
  auto in = std::make_unique<Inbox>();
  bool clean = true;  // false: MPI may still write into `in`, which is then never freed
  auto post = [&](size_t i) {
    return MPI_Irecv(&in->headers[i], sizeof(Header), MPI_BYTE, in->from[i], kHeaderTag, data_, &in->pending[i]) ==
           MPI_SUCCESS;
  };
  for (int idle = 0; !Stopping();) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (int src : senders_) {
        if (std::find(in->from.begin(), in->from.end(), src) != in->from.end()) continue;
        in->from.push_back(src);
        in->headers.emplace_back();
        in->pending.push_back(MPI_REQUEST_NULL);
        if (!post(in->from.size() - 1)) clean = false;
      }
    }
    if (!clean) break;
    int index = MPI_UNDEFINED, flag = 0;
    MPI_Status st;
    if (!in->pending.empty()) {
      const int rc = MPI_Testany(static_cast<int>(in->pending.size()), in->pending.data(), &index, &flag, &st);
      if (rc != MPI_SUCCESS) {  // e.g. a lost rank (fault-tolerant mode: the runtime learns of it)
        if (!Stopping()) ReportMpiFailure(rc, "window puts from neighbours");  // a stopped engine's is not news
        clean = false;
        break;
      }
    }
    if (!flag || index == MPI_UNDEFINED) {
      Pause(idle, 1000);
      idle = std::min(idle + 1, 1 << 20);  // no overflow however long it idles
      continue;
    }
    idle = 0;
    const Header h = in->headers[index];
    const int src = in->from[index];
    MPI_Request r = MPI_REQUEST_NULL;
    if (h.nbytes > 0) {
      if (in->staging.size() < static_cast<size_t>(h.nbytes)) in->staging.resize(h.nbytes);
      if (MPI_Irecv(in->staging.data(), static_cast<int>(h.nbytes), MPI_BYTE, src, kPayloadTag, data_, &r) !=
              MPI_SUCCESS || !Drain(&r)) {
        clean = false;
        break;
      }
    }
    {
      // Answered before it is applied, but under mu_: whatever the owner reads after the
      // put completed (a win_update after a barrier) waits for the apply. The sender's
      // next parcel is on its way meanwhile.
      std::lock_guard<std::mutex> lock(mu_);
      Window* w = Fits(h);
      in->answer = w ? 0 : kBadParcel;
      if (MPI_Isend(&in->answer, 1, MPI_INT32_T, src, h.reply_tag, replies_, &r) != MPI_SUCCESS) {
        clean = false;
        break;
      }
      if (w) Apply(w, h, in->staging.data());
    }
    if (!Drain(&r) || !post(index)) {
      clean = false;
      break;
    }
  }
  for (auto& req : in->pending) {
    if (!clean || req == MPI_REQUEST_NULL) continue;
    MPI_Cancel(&req);
    int flag = 0;
    for (int i = 0; i < 1000 && !flag; ++i)
      if (MPI_Test(&req, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS) break;
    clean = flag != 0;
  }
  if (!clean) (void)in.release();
}

Window* Delivery::Fits(const Header& h) {
  auto it = windows_.find(h.window);
  if (it == windows_.end()) return nullptr;
  Window* w = it->second;
  if (h.slot < 0 || h.slot >= static_cast<int>(w->recv.size()) || h.nbytes != static_cast<int64_t>(w->nbytes))
    return nullptr;
  return w;
}

void Delivery::Apply(Window* w, const Header& h, const void* payload) {
  try {
    // Exclusive on its own window: a neighbour's win_get of the published value, or a
    // mutex taken through MPI, never sees half of it.
    Epoch e1(w->data, rank_, MPI_LOCK_EXCLUSIVE), e2(w->ctrl, rank_, MPI_LOCK_EXCLUSIVE);
    char* slot = w->base + (1 + h.slot) * w->nbytes;
    if (h.flags & kAccumulate) Sum({slot, payload}, slot, w->dtype, w->count);
    else std::memcpy(slot, payload, w->nbytes);
    w->zero[h.slot] = false;
    if (!(h.flags & kAccumulate)) w->words[w->VersionAt(h.slot)] += 1;
    if (h.flags & kWithP) {
      if (h.flags & kAccumulate) w->SlotP(h.slot) += h.p;
      else w->SlotP(h.slot) = h.p;
    }
  } catch (const std::exception& ex) {
    // MPI refused a lock on this process's own window: window ops are broken here.
    Log(LOG_ERROR, std::string("a put from a neighbour could not be applied: ") + ex.what());
    return;
  }
  stats_->bytes_received += h.nbytes;
}

}  // namespace mpiwin
}  // namespace shoal
