// The C ABI's window functions (shoal_win_*) over the process's runtime's window queue
// (windows/windows.h).
#include <algorithm>
#include <string>
#include <vector>

#include "api/process_runtime.h"
#include "windows/windows.h"

using shoal::Runtime;
using shoal::Status;
using namespace shoal::api;

extern "C" {

int shoal_win_enqueue(const shoal_win_desc* d, int64_t* handle, char* err, size_t len) {
  Status st;
  auto rt = Usable(&st);
  if (!rt) return Report(st, err, len);
  if (!rt->windows()) return Report(NotInitialized(), err, len);
  if (rt->Lost()) return Report(Status::Error(SHOAL_RANK_LOST, std::string("window op: ") + Runtime::kLostRank), err, len);
  shoal::WinArgs a;
  a.name = d->name ? d->name : "";
  a.data = d->tensor.data;
  a.dtype = d->tensor.dtype;
  a.shape.assign(d->tensor.shape, d->tensor.shape + std::max(d->tensor.ndim, 0));
  const int size = rt->world().size;
  for (int i = 0; i < d->n; ++i) {
    // win_create is collective: it checks its lists on every rank (the peers waiting in it
    // must hear of a bad one); the other ops are this rank's own.
    if ((d->ranks[i] < 0 || d->ranks[i] >= size) && d->op != SHOAL_WIN_CREATE)
      return Report(Status::Error(SHOAL_INVALID_ARGUMENT, "window op: rank " + std::to_string(d->ranks[i]) +
                                  " is outside [0, " + std::to_string(size) + ")"), err, len);
    a.ranks.push_back(d->ranks[i]);
    a.weights.push_back(d->weights ? d->weights[i] : 1.0);
  }
  a.send.assign(d->send_ranks, d->send_ranks + std::max(d->n_send, 0));
  a.self_weight = d->self_weight;
  a.uniform = d->uniform;
  a.zero_init = d->zero_init;
  a.require_mutex = d->require_mutex;
  a.reset = d->reset;
  a.with_p = d->with_p;
  a.for_self = d->for_self;
  a.clone = d->clone;
  if (d->refused) {
    a.refused = d->refused;
    a.refused_code = d->refused_code == SHOAL_INVALID_TYPE ? SHOAL_INVALID_TYPE : SHOAL_INVALID_ARGUMENT;
  }
  static const char* kDtypes = "float16, bfloat16, float32, float64, int32, int64";
  if (d->op != SHOAL_WIN_FREE && d->op != SHOAL_WIN_LOCK && d->op != SHOAL_WIN_UNLOCK && d->op != SHOAL_WIN_GET &&
      a.refused.empty() &&
      (a.dtype < SHOAL_FLOAT16 || a.dtype > SHOAL_INT64 || a.dtype == SHOAL_INT8 || a.dtype == SHOAL_UINT8 || a.dtype == SHOAL_INT16)) {
    const std::string why = std::string(d->op == SHOAL_WIN_CREATE ? "win_create: " : "") + "window ops support " + kDtypes;
    // win_create is collective: the peers waiting in it hear of the refusal.
    if (d->op != SHOAL_WIN_CREATE) return Report(Status::Error(SHOAL_INVALID_ARGUMENT, why), err, len);
    a.refused = why;
    a.refused_code = SHOAL_INVALID_ARGUMENT;
  }
  std::function<Status(shoal::WindowEngine&)> job;
  switch (d->op) {
    case SHOAL_WIN_CREATE: job = [a](shoal::WindowEngine& w) { return w.Create(a); }; break;
    case SHOAL_WIN_FREE: job = [a](shoal::WindowEngine& w) { return w.Free(a.name); }; break;
    case SHOAL_WIN_PUT: job = [a](shoal::WindowEngine& w) { return w.Put(a, false); }; break;
    case SHOAL_WIN_ACCUMULATE: job = [a](shoal::WindowEngine& w) { return w.Put(a, true); }; break;
    case SHOAL_WIN_GET: job = [a](shoal::WindowEngine& w) { return w.Get(a); }; break;
    case SHOAL_WIN_UPDATE: job = [a](shoal::WindowEngine& w) { return w.Update(a); }; break;
    case SHOAL_WIN_LOCK: job = [a](shoal::WindowEngine& w) { return w.Mutex(a, true); }; break;
    case SHOAL_WIN_UNLOCK: job = [a](shoal::WindowEngine& w) { return w.Mutex(a, false); }; break;
    default: return Report(Status::Error(SHOAL_INVALID_ARGUMENT, "unknown window op " + std::to_string(d->op)), err, len);
  }
  if (rt->timeline().enabled() && (d->op == SHOAL_WIN_PUT || d->op == SHOAL_WIN_ACCUMULATE || d->op == SHOAL_WIN_GET)) {
    // BlueFog's activity names: ENQUEUE_WIN_<OP> from the call to the end, WIN_<OP> while it
    // runs (MPI_WIN_<OP> before BlueFog's 2020 rename, what its timeline test reads).
    const char* what = d->op == SHOAL_WIN_PUT ? "WIN_PUT" : d->op == SHOAL_WIN_GET ? "WIN_GET" : "WIN_ACCUMULATE";
    shoal::Timeline* tl = &rt->timeline();
    auto submitted = std::chrono::steady_clock::now();
    job = [inner = std::move(job), tl, what, submitted, name = a.name](shoal::WindowEngine& w) {
      auto start = std::chrono::steady_clock::now();
      Status s = inner(w);
      auto end = std::chrono::steady_clock::now();
      tl->Span(name, ("ENQUEUE_" + std::string(what)).c_str(), submitted, end);
      tl->Span(name, what, start, end);
      tl->Span(name, ("MPI_" + std::string(what)).c_str(), start, end);
      return s;
    };
  }
  try {
    // Puts, gets and updates without mutexes never wait on another rank's choices.
    const bool quick = !a.require_mutex && (d->op == SHOAL_WIN_PUT || d->op == SHOAL_WIN_ACCUMULATE ||
                                            d->op == SHOAL_WIN_GET || d->op == SHOAL_WIN_UPDATE);
    *handle = rt->windows()->Submit(std::move(job), quick, d->op == SHOAL_WIN_CREATE);
  } catch (const shoal::ArgumentError& ex) {
    return Report(Status::Error(ex.code, ex.what()), err, len);
  }
  return SHOAL_OK;
}

int shoal_win_poll(int64_t handle) {
  auto rt = Current();
  return rt && rt->windows() ? rt->windows()->Poll(handle) : -SHOAL_UNKNOWN_HANDLE;
}

int shoal_win_wait_for(int64_t handle, int64_t timeout_ms, char* err, size_t len) {
  Status st;
  auto rt = Usable(&st);
  if (!rt) return Report(st, err, len);
  if (!rt->windows()) return Report(NotInitialized(), err, len);
  return Report(rt->windows()->Wait(handle, timeout_ms), err, len);
}

int shoal_win_release(int64_t handle) {
  auto rt = Current();
  return rt && rt->windows() && rt->windows()->Release(handle) ? SHOAL_OK : SHOAL_UNKNOWN_HANDLE;
}

int shoal_win_versions(const char* name, int32_t* ranks, int64_t* versions, int32_t cap, int32_t* n,
                       char* err, size_t len) {
  Status st;
  auto rt = Usable(&st);
  if (!rt) return Report(st, err, len);
  if (!rt->windows()) return Report(NotInitialized(), err, len);
  // Jobs own what they write: a waiter may stop waiting after a lost rank (windows.h).
  auto out = std::make_shared<std::pair<std::vector<int>, std::vector<int64_t>>>();
  std::string nm = name;
  st = rt->windows()->Run([out, nm](shoal::WindowEngine& w) { return w.Versions(nm, &out->first, &out->second); });
  if (!st.ok()) return Report(st, err, len);
  const auto& [r, v] = *out;
  *n = static_cast<int32_t>(r.size());
  for (size_t i = 0; i < r.size() && static_cast<int32_t>(i) < cap; ++i) {
    ranks[i] = r[i];
    versions[i] = v[i];
  }
  return SHOAL_OK;
}

int shoal_win_associated_p(const char* name, double* p, char* err, size_t len) {
  Status st;
  auto rt = Usable(&st);
  if (!rt) return Report(st, err, len);
  if (!rt->windows()) return Report(NotInitialized(), err, len);
  auto out = std::make_shared<double>(0.0);
  std::string nm = name;
  st = rt->windows()->Run([out, nm](shoal::WindowEngine& w) { return w.AssociatedP(nm, out.get()); });
  if (st.ok()) *p = *out;
  return Report(st, err, len);
}

int shoal_win_names(char* buf, size_t len) {
  Status st0;
  auto rt = Usable(&st0);
  if (!rt) return -Report(st0, buf, len);
  if (!rt->windows()) return -Report(NotInitialized(), buf, len);
  auto names = std::make_shared<std::vector<std::string>>();
  Status st = rt->windows()->Run([names](shoal::WindowEngine& w) {
    *names = w.Names();
    return Status::Ok();
  });
  if (!st.ok()) return -Report(st, buf, len);
  std::string out;
  for (auto& n : *names) out += n + "\n";
  Report(Status::Error(0, out), buf, len);
  return static_cast<int>(out.size() + 1);  // bytes needed, with the terminator
}

}  // extern "C"
