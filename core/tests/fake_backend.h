// A Backend of N fake ranks in one process, for unit tests of the Runtime without MPI:
// each rank's Runtime gets a FakeBackend of one shared FakeWorld. Messages keep MPI's
// order per (source, destination, tag) but may be delayed at random (so arrival order
// across sources and tags varies with the seed); collectives rendezvous in issue order.
// Faults: Kill(rank) makes a rank vanish mid-run (its messages are dropped, sends to it
// fail), as a crashed process does. Process sets (AddSet) have collectives of their own,
// over their members only, one order per (set, channel), as MPI communicators do.
#pragma once
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <tuple>
#include <vector>

#include "backend.h"

namespace shoal {
namespace testing {

class FakeWorld {
 public:
  // Each message is delivered after 0..max_delay_us (0: at once).
  FakeWorld(int size, uint64_t seed, int max_delay_us);
  int size() const { return size_; }
  void Kill(int rank);

 private:
  friend class FakeBackend;
  using Clock = std::chrono::steady_clock;
  struct Msg {
    int src, tag;
    ByteVec data;
    Clock::time_point due;
  };
  struct Coll {  // one collective, as issued by each member of its set
    int kind = 0, arrived = 0, seen = 0;
    bool complete = false;
    int members = 0;
    std::vector<void*> bufs;  // by index in the set
    std::vector<const void*> sends;
    std::vector<int64_t> counts;
    std::vector<int64_t> split;  // reducescatter: every rank's share
    int64_t count = 0;
    int dtype = 0, root = 0, reduce_op = 0;
  };
  Clock::time_point Due(int src, int dst, int tag);  // mu_ held
  void Finish(Coll& c);                              // mu_ held: computes every rank's result

  const int size_;
  std::mutex mu_;
  std::mt19937_64 rng_;
  const int max_delay_us_;
  std::vector<std::deque<Msg>> inbox_;  // by destination, in send order
  std::vector<char> dead_;
  std::map<std::tuple<int, int, int>, Clock::time_point> last_due_;
  std::map<std::tuple<int, int, uint64_t>, Coll> colls_;  // by (set, channel, sequence number)
  // Process sets being made: id -> members arrived (AddSet waits until all have).
  std::map<int, int> making_;
  std::condition_variable made_;
};

class FakeBackend : public Backend {
 public:
  FakeBackend(std::shared_ptr<FakeWorld> world, int rank);
  const WorldInfo& world() const override { return info_; }
  void Send(int dst, int tag, Bytes msg, Callback done) override;
  void SendFrom(int dst, int tag, const void* data, size_t n, Callback done) override;
  void ReceiveInto(int src, int tag, void* data, size_t n, Callback done) override;
  bool Receive(const std::vector<int>& tags, int* tag, int* src, ByteVec* msg, Status* st) override;
  void Allreduce(void* buf, int64_t count, int dtype, int reduce_op, int scope, int set, Callback done) override;
  void Broadcast(void* buf, int64_t count, int dtype, int root, int scope, int set, Callback done) override;
  void Allgatherv(const void* send, int64_t count, void* recv, const std::vector<int64_t>& counts, int dtype,
                  int set, Callback done) override;
  void ReduceScatter(const void* send, void* recv, const std::vector<int64_t>& counts, int dtype, int reduce_op,
                     int set, Callback done) override;
  void Barrier(int set, Callback done) override;
  void AllreduceOn(int set, int channel, void* buf, int64_t count, int dtype, Callback done) override;
  Status AddSet(int id, const std::vector<int>& ranks) override;
  void RemoveSet(int id) override;
  bool Progress() override;
  size_t num_in_flight() const override;

 private:
  void Collective(FakeWorld::Coll mine, int set, Callback done, int channel = -1);
  struct Posted {
    int src, tag;
    void* data;
    size_t n;
    Callback done;
  };
  std::shared_ptr<FakeWorld> w_;
  WorldInfo info_;
  std::map<std::pair<int, int>, uint64_t> next_coll_;  // by (set, channel) (-1: the collectives' own order)
  std::map<int, std::vector<int>> sets_;  // process sets of this rank: id -> members
  using CollKey = std::tuple<int, int, uint64_t>;
  std::vector<std::pair<Callback, Status>> sent_;  // completions of sends, run in Progress
  std::deque<Posted> posted_;
  std::vector<std::pair<CollKey, Callback>> pending_colls_;  // (collective, completion)
};

}  // namespace testing
}  // namespace shoal
