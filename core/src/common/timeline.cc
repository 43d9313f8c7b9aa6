#include "common/timeline.h"

#include <sstream>

namespace shoal {

std::string JsonEscape(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') { out += '\\'; out += static_cast<char>(c); }
    else if (c < 0x20) { char b[8]; std::snprintf(b, sizeof b, "\\u%04x", c); out += b; }
    else out += static_cast<char>(c);
  }
  return out;
}

bool Timeline::Open(const std::string& path, int rank) {
  MutexLock lock(mu_);
  file_ = std::fopen(path.c_str(), "w");
  if (!file_) return false;
  enabled_ = true;
  rank_ = rank;
  std::fprintf(file_, "[\n{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": %d, \"args\": {\"name\": \"rank %d\"}}",
               rank, rank);
  std::fflush(file_);
  return true;
}

void Timeline::Close() {
  MutexLock lock(mu_);
  if (!file_) return;
  std::fputs("\n]\n", file_);
  std::fclose(file_);
  file_ = nullptr;
  enabled_ = false;
}

int64_t Timeline::Micros(TimePoint t) const {
  // Wall-clock microseconds, so traces of different ranks share one time axis.
  auto wall = std::chrono::system_clock::now() - (std::chrono::steady_clock::now() - t);
  return std::chrono::duration_cast<std::chrono::microseconds>(wall.time_since_epoch()).count();
}

int Timeline::Track(const std::string& tensor) {
  auto it = tracks_.find(tensor);
  if (it != tracks_.end()) return it->second;
  int tid = static_cast<int>(tracks_.size()) + 1;
  tracks_[tensor] = tid;
  std::ostringstream e;
  e << "{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": " << rank_ << ", \"tid\": " << tid
    << ", \"args\": {\"name\": \"" << JsonEscape(tensor) << "\"}}";
  Write(e.str());
  return tid;
}

void Timeline::Write(const std::string& event) {
  std::fputs(",\n", file_);
  std::fputs(event.c_str(), file_);
  dirty_ = true;
}

void Timeline::Span(const std::string& tensor, const char* phase, TimePoint start, TimePoint end,
                    const std::string& args) {
  MutexLock lock(mu_);
  if (!file_) return;
  int tid = Track(tensor);
  std::ostringstream e;
  e << "{\"name\": \"" << phase << "\", \"ph\": \"X\", \"pid\": " << rank_ << ", \"tid\": " << tid
    << ", \"ts\": " << Micros(start) << ", \"dur\": "
    << std::chrono::duration_cast<std::chrono::microseconds>(end - start).count()
    << ", \"args\": {\"tensor\": \"" << JsonEscape(tensor) << "\"" << (args.empty() ? "" : ", ") << args << "}}";
  Write(e.str());
}

void Timeline::Begin(const std::string& tensor, const std::string& activity) {
  MutexLock lock(mu_);
  if (!file_) return;
  int tid = Track(tensor);
  std::ostringstream e;
  e << "{\"name\": \"" << JsonEscape(activity) << "\", \"ph\": \"B\", \"pid\": " << rank_ << ", \"tid\": " << tid
    << ", \"ts\": " << Micros(std::chrono::steady_clock::now()) << "}";
  Write(e.str());
}

void Timeline::End(const std::string& tensor) {
  MutexLock lock(mu_);
  if (!file_) return;
  int tid = Track(tensor);
  std::ostringstream e;
  e << "{\"ph\": \"E\", \"pid\": " << rank_ << ", \"tid\": " << tid
    << ", \"ts\": " << Micros(std::chrono::steady_clock::now()) << "}";
  Write(e.str());
}

void Timeline::FlushEvery(std::chrono::milliseconds period) {
  if (!enabled_) return;
  const TimePoint now = std::chrono::steady_clock::now();
  if (now - last_flush_ <= period) return;
  last_flush_ = now;
  Flush();
}

void Timeline::Flush() {
  MutexLock lock(mu_);
  if (file_ && dirty_) {
    std::fflush(file_);
    dirty_ = false;
  }
}

}  // namespace shoal
