// Per-rank Chrome-trace / Perfetto timeline (SHOAL_TIMELINE=prefix -> prefix<rank>.json).
//
// One event per line: "[" then "{...}" lines joined by ",\n"; shutdown appends "]". While
// the job runs (or after an abrupt exit) the file lacks the closing bracket and maybe a
// partial last line; shoal.timeline.load() repairs that. Each tensor name gets its own
// track (tid), named by a metadata event, so phases of one tensor line up.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <string>

#include "common/thread_annotations.h"

namespace shoal {

class Timeline {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;

  ~Timeline() { Close(); }
  bool Open(const std::string& path, int rank) EXCLUDES(mu_);
  void Close() EXCLUDES(mu_);
  bool enabled() const { return enabled_; }

  // A finished phase [start, end] of `tensor` (Chrome "X" event), args as a JSON object body.
  void Span(const std::string& tensor, const char* phase, TimePoint start, TimePoint end,
            const std::string& args = "") EXCLUDES(mu_);
  // User activities (nested per tensor): "B" and "E" events.
  void Begin(const std::string& tensor, const std::string& activity) EXCLUDES(mu_);
  void End(const std::string& tensor) EXCLUDES(mu_);
  void Flush() EXCLUDES(mu_);
  // Flush() if the last was longer ago than `period` (one thread: the progress driver).
  void FlushEvery(std::chrono::milliseconds period) EXCLUDES(mu_);

 private:
  int Track(const std::string& tensor) REQUIRES(mu_);
  void Write(const std::string& event) REQUIRES(mu_);
  int64_t Micros(TimePoint t) const;

  Mutex mu_;
  std::FILE* file_ GUARDED_BY(mu_) = nullptr;
  std::atomic<bool> enabled_{false};  // file_ is open: read per op without the lock
  int rank_ GUARDED_BY(mu_) = 0;
  std::map<std::string, int> tracks_ GUARDED_BY(mu_);
  bool dirty_ GUARDED_BY(mu_) = false;
  TimePoint last_flush_ = std::chrono::steady_clock::now();  // FlushEvery's thread only
};

std::string JsonEscape(const std::string& s);

}  // namespace shoal
