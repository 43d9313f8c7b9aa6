// A Backend of N fake ranks in one process, for unit tests of the Runtime without MPI:
// each rank's Runtime gets a FakeBackend of one shared FakeWorld. Messages keep MPI's
// order per (source, destination, tag) but may be delayed at random (so arrival order
// across sources and tags varies with the seed); collectives rendezvous in issue order.
// Faults: Kill(rank) makes a rank vanish mid-run (its messages are dropped, sends to it
// fail), as a crashed process does; in a fault-tolerant world (SetFaultTolerant) every
// backend then reports Lost(), as ULFM's revoke tells every survivor. Ranks form machines of `ranks_per_machine` contiguous
// ranks (0: one machine), as SHOAL_RANKS_PER_MACHINE makes them; machine-scope
// collectives rendezvous per machine, in their own order. Process sets (AddSet) have
// collectives of their own (OfSet), over their members only, one order per (set, channel),
// as MPI communicators do.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "engines/backend.h"

namespace shoal {
namespace testing {

class FakeWorld {
 public:
  // Each message is delivered after 0..max_delay_us (0: at once).
  FakeWorld(int size, uint64_t seed, int max_delay_us, int ranks_per_machine = 0);
  int size() const { return size_; }
  int ranks_per_machine() const { return per_machine_; }
  void Kill(int rank);
  void SetFaultTolerant() { fault_tolerant_ = true; }

 private:
  friend class FakeBackend;
  friend class FakeGroup;
  using Clock = std::chrono::steady_clock;
  struct Msg {
    int src, tag;
    ByteVec data;
    Clock::time_point due;
  };
  struct Coll {  // one collective, as issued by each of its ranks (by index among them)
    int kind = 0, arrived = 0, seen = 0, members = 0;
    bool complete = false;
    std::vector<void*> bufs;
    std::vector<const void*> sends;
    std::vector<int64_t> counts;
    std::vector<int64_t> split;  // reducescatter: every rank's share; alltoall: what one rank sends
    std::vector<int64_t> recv_split;                    // alltoall: what one rank expects
    std::vector<std::vector<int64_t>> sent, received;   // alltoall: the above, by rank
    std::string error;  // the ranks' calls do not match: the collective fails everywhere
    std::vector<int> ranks;  // the members' world ranks
    std::vector<char> in;    // by member: arrived (one dead before it did fails the others)
    int64_t count = 0;
    int dtype = 0, root = 0, reduce_op = 0;
  };
  Clock::time_point Due(int src, int dst, int tag);  // mu_ held
  void Finish(Coll& c);                              // mu_ held: computes every rank's result

  const int size_, per_machine_;
  std::mutex mu_;
  std::mt19937_64 rng_;
  const int max_delay_us_;
  std::vector<std::deque<Msg>> inbox_;  // by destination, in send order
  std::vector<char> dead_;
  std::atomic<bool> fault_tolerant_{false}, any_dead_{false};
  std::map<std::tuple<int, int, int>, Clock::time_point> last_due_;
  std::map<std::pair<int, uint64_t>, Coll> colls_;  // by (process set, sequence number)
  // Process sets being made: id -> members arrived (AddSet waits until all have).
  std::map<int, int> making_;
  std::condition_variable made_;
};

class FakeBackend;

// The collectives of every rank (set 0) or of process set `set` of one FakeBackend.
class FakeGroup : public GroupCollectives {
 public:
  FakeGroup(FakeBackend* b, int set, std::vector<int> ranks) : b_(b), set_(set), ranks_(std::move(ranks)) {}
  void Allreduce(void* buf, int64_t count, int dtype, int reduce_op, int scope, Callback done) override;
  void Broadcast(void* buf, int64_t count, int dtype, int root, int scope, Callback done) override;
  void Allgatherv(const void* send, int64_t count, void* recv, const std::vector<int64_t>& counts, int dtype,
                  Callback done) override;
  void ReduceScatter(const void* send, void* recv, const std::vector<int64_t>& counts, int dtype, int reduce_op,
                     Callback done) override;
  void Alltoallv(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                 const std::vector<int64_t>& recv_counts, int dtype, Callback done) override;
  void Barrier(Callback done) override;
  void AllreduceOn(int channel, void* buf, int64_t count, int dtype, Callback done) override;
  void BroadcastOn(int channel, void* buf, int64_t count, int dtype, int root, Callback done) override;
  bool Progress() override;
  size_t num_in_flight() const override;

 private:
  friend class FakeBackend;
  void BroadcastIn(int channel, int scope, void* buf, int64_t count, int dtype, int root, Callback done);
  FakeBackend* b_;
  int set_;
  std::vector<int> ranks_;  // of a process set (empty for every rank)
};

class FakeBackend : public Backend {
 public:
  FakeBackend(std::shared_ptr<FakeWorld> world, int rank);
  const WorldInfo& world() const override { return info_; }
  void Send(int dst, int tag, Bytes msg, Callback done) override;
  void SendFrom(int dst, int tag, const void* data, size_t n, Callback done) override;
  void ReceiveInto(int src, int tag, void* data, size_t n, Callback done) override;
  bool Receive(const std::vector<int>& tags, int* tag, int* src, ByteVec* msg, Status* st) override;
  // Every rank's collectives: the world group's.
  void Allreduce(void* buf, int64_t count, int dtype, int reduce_op, int scope, Callback done) override {
    world_.Allreduce(buf, count, dtype, reduce_op, scope, std::move(done));
  }
  void Broadcast(void* buf, int64_t count, int dtype, int root, int scope, Callback done) override {
    world_.Broadcast(buf, count, dtype, root, scope, std::move(done));
  }
  void Allgatherv(const void* send, int64_t count, void* recv, const std::vector<int64_t>& counts, int dtype,
                  Callback done) override {
    world_.Allgatherv(send, count, recv, counts, dtype, std::move(done));
  }
  void ReduceScatter(const void* send, void* recv, const std::vector<int64_t>& counts, int dtype, int reduce_op,
                     Callback done) override {
    world_.ReduceScatter(send, recv, counts, dtype, reduce_op, std::move(done));
  }
  void Alltoallv(const void* send, const std::vector<int64_t>& send_counts, void* recv,
                 const std::vector<int64_t>& recv_counts, int dtype, Callback done) override {
    world_.Alltoallv(send, send_counts, recv, recv_counts, dtype, std::move(done));
  }
  void Barrier(Callback done) override { world_.Barrier(std::move(done)); }
  void AllreduceOn(int channel, void* buf, int64_t count, int dtype, Callback done) override {
    world_.AllreduceOn(channel, buf, count, dtype, std::move(done));
  }
  void BroadcastOn(int channel, void* buf, int64_t count, int dtype, int root, Callback done) override {
    world_.BroadcastOn(channel, buf, count, dtype, root, std::move(done));
  }
  Status AddSet(int id, const std::vector<int>& ranks) override;
  void RemoveSet(int id) override { sets_.erase(id); }
  GroupCollectives* OfSet(int id) override;
  bool Progress() override;
  size_t num_in_flight() const override;
  bool Lost() const override { return w_->fault_tolerant_ && w_->any_dead_; }

 private:
  friend class FakeGroup;
  // `channel`: -1 the collectives' own order, 0.. those of AllreduceOn and BroadcastOn; `scope`: the world
  // or this rank's machine (root and results by index among its ranks); `group`: every
  // rank's or a process set's.
  void Collective(const FakeGroup& group, FakeWorld::Coll mine, Callback done, int channel = -1,
                  int scope = SHOAL_SCOPE_WORLD);
  struct Posted {
    int src, tag;
    void* data;
    size_t n;
    Callback done;
  };
  std::shared_ptr<FakeWorld> w_;
  WorldInfo info_;
  std::map<std::tuple<int, int, int>, uint64_t> next_coll_;  // by (set, channel, scope)
  std::vector<std::pair<Callback, Status>> sent_;  // completions of sends, run in Progress
  std::deque<Posted> posted_;
  std::vector<std::pair<std::pair<int, uint64_t>, Callback>> pending_colls_;  // (collective, completion)
  FakeGroup world_{this, 0, {}};
  std::map<int, std::unique_ptr<FakeGroup>> sets_;
};

}  // namespace testing
}  // namespace shoal
