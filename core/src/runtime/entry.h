// One submitted op, from enqueue to completion.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "common/common.h"

namespace shoal {

struct GpuOp;       // gpu/staging.h
struct Stages;      // ops/stages.cc
struct ShardedRun;  // neighbor/sharded_exchange.h
struct ProcessSet;  // process_sets/process_sets.h

using Clock = std::chrono::steady_clock;

struct TensorRef {
  void* data = nullptr;
  int device_type = SHOAL_DEVICE_CPU;
  int device_id = 0;
  void* stream = nullptr;       // CUDA: producer stream (GPU backends)
  void* ready_event = nullptr;  // CUDA: event recorded after the producer
};

struct Entry {
  int64_t handle = 0;
  std::string name;
  Signature sig;
  // The process set that runs it (0: every rank) and, for another, its members, and the
  // name's key in the runtime's tables (SetKey: names are scoped per set).
  int set = 0;
  std::shared_ptr<const ProcessSet> pset;
  std::string set_key;
  const std::string& key() const { return set ? set_key : name; }
  TensorRef input, output;
  // neighbor_allreduce
  std::vector<int> recv_ranks, send_ranks;
  std::vector<double> recv_weights, send_weights;
  double self_weight = 1.0;
  bool uniform = true;
  bool topo_check = false;
  // allreduce, reducescatter: Horovod's scaling (shoal_op_desc), 1.0 when not asked for.
  bool horovod_scaling = false;
  double prescale = 1.0, postscale = 1.0;
  int64_t step = 0;  // how many ops of this name this rank ran before (neighbor message matching)
  std::string reject;  // non-empty: a call refused at the call here; its peers get this error
  int reject_code = 0;
  std::shared_ptr<GpuOp> gpu;  // CUDA tensors: device pointers and staging state
  // A stage of a multi-stage op (hierarchical): the op and its stages still to run.
  std::shared_ptr<Stages> stages;
  // Elements this entry moves when they are not its signature's (-1: the signature's): a
  // part of a sharded exchange (its slice of the op's tensor, whose shape the signature
  // keeps for the peers' checks), or 0 for a stage that only negotiates.
  int64_t span = -1;
  // A part of a sharded exchange (neighbor/sharded_exchange.h): the run it belongs to and
  // its index there.
  std::shared_ptr<ShardedRun> sharded;
  int part = -1;
  // alltoall: rows of dim 0 this rank sends to each rank; once run, the rows it received.
  std::vector<int64_t> splits, recv_splits;
  // A member of a grouped op (ops/groups.cc): the group's name, step and size, and
  // this member's place in it (-1: not a member).
  std::string group;
  int64_t group_step = 0;
  int group_index = -1, group_size = 0;
  ByteVec joined_input;  // a joined rank's contribution (the reduction's identity)

  Clock::time_point enqueued = Clock::now();
  // Phase boundaries for the timeline (unset: time_point{}).
  Clock::time_point t_negotiated, t_copy_start, t_copy_end, t_comm_start, t_comm_end, t_peers_ready,
      t_reduce_start, t_reduce_end;
  bool stall_warned = false;
  std::atomic<bool> waited{false};  // a thread waits for it (Wait)
  bool probed = false;              // a cached op: its long wait was told to the coordinator
  std::atomic<int> sends_pending{0};  // messages with this entry's data not yet sent
  bool direct_sends = false;          // some leave from input memory: finish only once sent
  Status send_error;                  // of a direct send
  // Completion (Submissions::Complete): `status` is written once, before `done`, so a thread
  // that reads `done` true reads the final status.
  std::atomic<bool> done{false};
  Status status;
  shoal_callback callback = nullptr;  // optional completion callback (C ABI)
  void* callback_arg = nullptr;
  void* result = nullptr;  // core-allocated output (allgather), malloc'ed; see shoal_take_result
  size_t result_nbytes = 0;
  std::vector<int64_t> result_shape;

  ~Entry() { std::free(result); }

  size_t nbytes() const { return span < 0 ? sig.nbytes() : static_cast<size_t>(span) * DtypeSize(sig.dtype); }
  int64_t count() const { return span < 0 ? NumElements(sig.shape) : span; }
};

using EntryPtr = std::shared_ptr<Entry>;

// Where an op ends (Scheduler::Finish): its status, counters, handle and callback.
class Finisher {
 public:
  virtual void Finish(const EntryPtr& e, const Status& st) = 0;

 protected:
  ~Finisher() = default;
};

}  // namespace shoal
