// Negotiation state machine (runs on rank 0, owns no communication).
//
// Every rank reports the ops it is ready to run; once all ranks have reported a
// name, the coordinator validates their signatures and emits one Response that all
// ranks apply in the same order. This fixes one global order for collectives even
// when ranks submit in different orders, and turns any disagreement into the same
// error on every rank. Pure logic: unit-tested with fake ranks in one process.
#pragma once
#include <map>
#include <string>
#include <vector>

#include "common/common.h"

namespace shoal {

struct Request {
  std::string name;
  Signature sig;
  int64_t step = 0;    // how many ops of this name the rank submitted before
  std::string reject;  // non-empty: the rank rejected this call at the call, with this error
  int32_t reject_code = 0;  // and this status code
  // Neighbor ops with a topology check: this rank's send and receive ranks.
  bool topo_check = false;
  std::vector<int> send, recv;
  bool known = false;  // and this rank's pattern was checked before (neighbor/checked_patterns.h)
  // A cached allreduce (negotiation/response_cache.cc) whose round has waited long on this rank: not an
  // op to run, only news for the stall check, which then names the ranks that are missing.
  bool probe = false;
  int32_t set = 0;  // the process set whose coordinator it is for (process_sets/process_sets.h; 0: every rank)
  std::vector<int64_t> splits{};     // alltoall: rows to each rank
  std::vector<Signature> members{};  // a grouped op (sig.op has SHOAL_GROUPED): its ops, in order
  // Names of this set the rank proposes to retire (sorted), with its call count of each
  // (idle names; negotiation/names.cc); in a vote (sig.op kOpRetire), those it froze.
  std::vector<std::string> retire{};
  std::vector<int64_t> retire_calls{};
};

struct Response {
  // ERROR: ranks disagree (or a stall); REJECTED: a rank refused the call at the call
  // (a ValueError everywhere); LEFT: a rank left the job.
  enum Kind : int32_t { EXECUTE = 0, ERROR = 1, REJECTED = 2, LEFT = 3 };
  int32_t kind = EXECUTE;
  int32_t set = 0;  // the process set it is for (its names are scoped by it)
  int32_t op = 0;
  std::vector<std::string> names;  // > 1 only for a fused allreduce batch
  std::string error;
  int64_t step = -1;  // ERROR: the step of the names it fails (-1: whatever is pending)
  int32_t code = 0;   // REJECTED: the status code of the refusal
  // allgather: first dimension of each rank's tensor, per name (a grouped allgather: per
  // member); alltoall: every rank's splits (first_dims[q][r]: rows rank q sends to rank r)
  std::vector<std::vector<int64_t>> first_dims;
  // EXECUTE of a grouped op: how many consecutive members run as one collective (fused
  // allreduces; gathers one each), in member order.
  std::vector<int32_t> chunks;
  // EXECUTE of an allreduce batch: >= 0 when every rank caches the batch on this
  // collective channel after running it (negotiation/response_cache.cc).
  int32_t channel = -1;
  bool repeat = false;  // Validate: every name was seen before with this signature (not sent)
  // EXECUTE of a checked neighbor op: every rank's pattern was checked before, so the
  // name's later calls skip the coordinator (neighbor/checked_patterns.h).
  bool trusted = false;
  // EXECUTE of a collective: the ranks that joined (Horovod's join) without submitting some
  // of its names; they run it on identity buffers of `sigs` (one per name). Of a join: the
  // rank that joined last.
  std::vector<int> joined;
  std::vector<Signature> sigs;
  // op kOpRetire (negotiation/names.cc), no names: the names every rank proposed with the same
  // count (each rank votes on them); names {the vote}: those every rank froze (forget them).
  std::vector<std::string> retired;
};

struct Stall {
  std::string name;
  std::vector<int> ready, missing;
  double waited = 0;
};

ByteVec EncodeRequests(const std::vector<Request>& reqs);
std::vector<Request> DecodeRequests(const char* p, size_t n);
ByteVec EncodeResponses(const std::vector<Response>& resps);
std::vector<Response> DecodeResponses(const char* p, size_t n);

class Coordinator {
 public:
  // `channels`: how many collective channels cached batches may use (0: no caching).
  // `world_ranks`: for a process set's coordinator, the world rank of each of its `size`
  // members (Add's `rank` is an index in it; errors and stalls name world ranks).
  Coordinator(int size, int64_t fusion_threshold, int channels = 0, std::vector<int> world_ranks = {})
      : size_(size), fusion_threshold_(fusion_threshold), world_(std::move(world_ranks)) {
    for (int c = channels; c-- > 0;) free_channels_.push_back(c);
  }

  void Add(int rank, const Request& req, double now);
  // Responses for names that every rank has reported since the last call.
  std::vector<Response> TakeResponses();
  std::vector<Stall> Stalled(double now, double older_than) const;
  // Drop a pending name and return the error every rank that reported it must see.
  Response Abort(const std::string& name, const std::string& message);
  // `rank` left the job: every pending name fails now, every later one on arrival.
  std::vector<Response> Leave(int rank);
  bool any_left() const { return !left_.empty(); }
  bool any_joined() const { return num_joined_ > 0; }
  // The batch cached on `channel` died on this rank (so on every rank): the channel is free.
  void ReleaseChannel(int channel) { free_channels_.push_back(channel); }
  // The broadcast `name` cached on `channel` died: the channel is free once every rank has
  // submitted the name again (each has passed its last round then; docs/design.md §20).
  void ReleaseAfter(const std::string& name, int channel) { release_after_[name] = channel; }
  // Rank 0's round of a cached batch completed, with `name` at `step`: probes of it are stale.
  void RoundDone(const std::string& name, int64_t step);
  void ForgetRounds(const std::vector<std::string>& names) {
    for (auto& n : names) rounds_done_.erase(n);
  }
  size_t num_pending() const { return pending_.size(); }
  int64_t negotiations() const { return negotiations_; }

 private:
  struct Pending {
    std::vector<Request> req;
    std::vector<bool> have;
    int count = 0;
    double first_seen = 0;
    bool probe = false;  // only probes: dropped once complete
    bool complete = false;  // in complete_
    bool vote = false;      // a vote to retire names: every rank's driver sends one (joined or not)
  };
  // Every rank has submitted the name or joined.
  bool Ready(const Pending& p) const;
  void AddJoin(int rank, const Request& req);
  Response Validate(const std::string& name, const Pending& p);
  // One op's checks over every rank's request (an empty name: a rank that joined instead);
  // `cache`: use and fill the first-sight cache.
  Response ValidateOne(const std::string& name, const std::vector<Request>& req, bool cache);
  // A grouped op (coordinator_group.cc): the number of members, then each member's checks;
  // any error fails the whole group. Fills `chunks`.
  Response ValidateGroup(const std::string& name, const Pending& p);
  static bool Cacheable(const Signature& sig);
  static constexpr int64_t kMaxCachedBytes = 256 << 10;  // cached batches: at most this much data
  std::string CheckEdges(const std::vector<Request>& req) const;
  // The names on every list with the same call count; none while a rank has left or joined.
  std::vector<std::string> Agreed(const std::vector<const Request*>& lists) const;
  void Propose(int rank, const Request& req);  // files a rank's proposal; all filed: the answer

  int World(int index) const { return world_.empty() ? index : world_[index]; }

  int size_;
  int64_t fusion_threshold_;
  std::vector<int> world_;
  std::map<std::string, Pending> pending_;
  std::vector<std::string> complete_;  // in order of completion
  static constexpr size_t kValidatedNames = 1 << 16;
  std::map<std::string, Signature> validated_;  // first-sight cache (at most kValidatedNames)
  // Calls rejected at the call on some rank, by name: (step, error). Ranks that submit
  // that step later get the error at once. Forgotten once every rank is past that step
  // (refused it, was told, or waits in a later one), so a name whose steps restart (a
  // retired name whose vote another coordinator ran) meets no stale refusal; bounded: the
  // oldest are forgotten.
  struct Refusal {
    Response r;
    std::vector<char> past;  // by rank
    int count = 0;
  };
  std::map<std::string, Refusal> rejected_;
  std::vector<std::string> rejected_order_;
  void Past(const std::string& name, int rank);
  std::vector<int> left_;  // ranks that left the job
  // Horovod's join in progress: by rank, joined; the join's name; the rank that joined last.
  std::vector<char> joined_;
  int num_joined_ = 0, last_joined_ = -1;
  std::string join_name_;
  std::vector<Response> early_;  // errors decided in Add, sent with the next responses
  std::string LeftError(const std::string& name, int op) const;
  int64_t negotiations_ = 0;
  std::vector<int> free_channels_;  // collective channels no cached batch uses
  std::map<std::string, int> release_after_;  // ReleaseAfter's channels, by name
  std::map<std::string, int64_t> rounds_done_;  // cached names: the last step rank 0 completed
  std::vector<Request> proposals_;  // by rank: its latest proposal to retire names (until answered)
  int num_proposals_ = 0;
};

}  // namespace shoal
