// Per-rank Chrome-trace / Perfetto timeline (SHOAL_TIMELINE=prefix -> prefix<rank>.json).
//
// One event per line: "[" then "{...}" lines joined by ",\n"; shutdown appends "]". While
// the job runs (or after an abrupt exit) the file lacks the closing bracket and maybe a
// partial last line; shoal.timeline.load() repairs that. Each tensor name gets its own
// track (tid), named by a metadata event, so phases of one tensor line up.
#pragma once
#include <chrono>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>

namespace shoal {

class Timeline {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;

  ~Timeline() { Close(); }
  bool Open(const std::string& path, int rank);
  void Close();
  bool enabled() const { return file_ != nullptr; }

  // A finished phase [start, end] of `tensor` (Chrome "X" event), args as a JSON object body.
  void Span(const std::string& tensor, const char* phase, TimePoint start, TimePoint end,
            const std::string& args = "");
  // User activities (nested per tensor): "B" and "E" events.
  void Begin(const std::string& tensor, const std::string& activity);
  void End(const std::string& tensor);
  void Flush();

 private:
  int Track(const std::string& tensor);  // holds mu_
  void Write(const std::string& event);  // holds mu_
  int64_t Micros(TimePoint t) const;

  std::mutex mu_;
  std::FILE* file_ = nullptr;
  int rank_ = 0;
  TimePoint origin_;
  std::map<std::string, int> tracks_;
  bool dirty_ = false;
};

std::string JsonEscape(const std::string& s);

}  // namespace shoal
