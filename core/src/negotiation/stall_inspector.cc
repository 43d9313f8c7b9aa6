#include "negotiation/stall_inspector.h"

#include <algorithm>
#include <sstream>

namespace shoal {
namespace {

std::string Seconds(double s) {
  std::ostringstream o;
  o << s;
  return o.str();
}

}  // namespace

StallInspector::StallInspector(const Config& cfg, Stats* stats)
    : warn_(cfg.stall_check_time > 0 ? cfg.stall_check_time : cfg.stall_shutdown_time),
      kill_(cfg.stall_shutdown_time), stats_(stats) {}

bool StallInspector::Due(Clock::time_point now) {
  if (warn_ <= 0 && kill_ <= 0) return false;
  if (now - last_ < std::chrono::milliseconds(200)) return false;
  last_ = now;
  return true;
}

std::vector<Response> StallInspector::Check(Coordinator& c, const ProcessSet* set, double now) {
  std::vector<Response> aborts;
  for (auto& s : c.Stalled(now, std::min(warn_, kill_ > 0 ? kill_ : warn_))) {
    // Process set agreements end in an error even without SHOAL_STALL_SHUTDOWN_TIME: a
    // rank that never calls add/remove_process_set fails the call everywhere.
    const double end = kill_ > 0 || s.name != kSetsAgreement ? kill_ : warn_;
    const std::string what = "'" + s.name + "' waited " + std::to_string(static_cast<int>(s.waited)) +
                             " s: submitted by ranks " + RankList(s.ready) + "; missing ranks " + RankList(s.missing);
    if (end > 0 && s.waited >= end) {
      ++stats_->stalls;
      Response r = c.Abort(s.name, "stalled op " + what + " (" +
                                       (kill_ > 0 ? "SHOAL_STALL_SHUTDOWN_TIME=" : "SHOAL_STALL_CHECK_TIME=") +
                                       Seconds(end) + " s)");
      r.set = set ? set->id : 0;
      aborts.push_back(std::move(r));
    } else if (s.waited >= warn_ && warned_.insert(SetKey(set ? set->id : 0, s.name)).second) {
      ++stats_->stalls;
      Log(LOG_WARNING, "stall: " + what);
    }
  }
  return aborts;
}

std::vector<std::pair<EntryPtr, Status>> StallInspector::Check(NeighborExchange& n, Clock::time_point now) {
  std::vector<std::pair<EntryPtr, Status>> failed;
  for (auto& wt : n.Waiting()) {
    const EntryPtr& e = wt.first;
    // From its start here: a long negotiation or vote before it is the coordinator's to
    // judge, and peers negotiated alike start within a cycle of each other.
    const double waited = std::chrono::duration<double>(now - e->t_comm_start).count();
    const std::string what = std::string(OpName(e->sig.op)) + " '" + e->name + "' waited " +
                             std::to_string(static_cast<int>(waited)) +
                             (wt.second.empty() ? " s for ranks " + RankList(e->send_ranks) + " to take its data"
                                                : " s for ranks " + RankList(wt.second));
    if (kill_ > 0 && waited >= kill_) {
      ++stats_->stalls;
      n.Drop(e);
      failed.push_back({e, Status::Error(SHOAL_ABORTED, "stalled op " + what + " (SHOAL_STALL_SHUTDOWN_TIME)")});
    } else if (waited >= warn_ && !e->stall_warned) {
      e->stall_warned = true;
      ++stats_->stalls;
      Log(LOG_WARNING, "stall: " + what);
    }
  }
  // Neighbor data that nobody here wants: the senders' lists disagree with ours.
  for (auto& w : n.Unmatched(now, warn_))
    Log(LOG_WARNING, "rank " + std::to_string(w.first) + " sent '" + w.second +
                         "' to this rank, which has not used it for " + std::to_string(static_cast<int>(warn_)) +
                         " s (send and receive lists disagree?)");
  return failed;
}

void StallInspector::ForgetSet(int set) {
  std::string name;
  for (auto it = warned_.begin(); it != warned_.end();) it = KeyInSet(*it, set, &name) ? warned_.erase(it) : std::next(it);
}

}  // namespace shoal
