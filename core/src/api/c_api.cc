// The C ABI over the one Runtime of this process (its window functions: api/c_api_windows.cc).
#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>

#include <pthread.h>
#include <unistd.h>

#include "common/thread_annotations.h"
#include "engines/backend.h"
#include "gpu/staging.h"
#include "api/process_runtime.h"
#include "runtime/runtime.h"

using shoal::Runtime;
using shoal::Status;

namespace {

shoal::Mutex g_mu;  // init/shutdown
std::shared_ptr<Runtime> g_runtime GUARDED_BY(g_mu);  // the one runtime object
std::atomic<bool> g_fault_tolerant{false};  // the last runtime started in fault-tolerant mode
// Runtimes ended by a lost rank (fault-tolerant mode), kept while their handles may be waited.
std::vector<std::shared_ptr<Runtime>> g_retired GUARDED_BY(g_mu);

}  // namespace

namespace shoal::api {

std::shared_ptr<Runtime> Current() {
  shoal::MutexLock lock(g_mu);
  return g_runtime;
}

int Report(const Status& st, char* err, size_t len) {
  if (err && len) {
    size_t n = std::min(len - 1, st.message.size());
    std::memcpy(err, st.message.data(), n);
    err[n] = 0;
  }
  return st.code;
}

Status NotInitialized() {
  return Status::Error(SHOAL_NOT_INITIALIZED, "Shoal is not initialized; call shoal.init() first");
}

}  // namespace shoal::api

using namespace shoal::api;

namespace {

// Set in a child forked after init. Its copy of the runtime has no threads and shares
// the parent's MPI connections: it is kept (never destroyed) and never used to communicate.
// The child reads g_runtime without g_mu: it has one thread, and g_mu may have been held by
// a parent thread that does not exist in the child.
std::atomic<bool> g_forked{false};
pid_t g_parent_pid = 0;

void OnForkInChild() NO_THREAD_SAFETY_ANALYSIS {
  if (!g_runtime) return;
  g_forked = true;
  new std::shared_ptr<Runtime>(g_runtime);  // leaked on purpose: its destructor would join threads
}

Status Forked() NO_THREAD_SAFETY_ANALYSIS {  // in the forked child (above)
  return Status::Error(SHOAL_ABORTED, "Shoal cannot communicate from a process forked after shoal.init() "
                       "(this is pid " + std::to_string(getpid()) + ", a fork of pid " + std::to_string(g_parent_pid) +
                       ", rank " + std::to_string(g_runtime ? g_runtime->world().rank : -1) + "): its MPI state belongs to the parent. Communicate "
                       "from the parent (e.g. not in DataLoader workers), or start children with the "
                       "'spawn' method");
}

}  // namespace

std::shared_ptr<Runtime> shoal::api::Usable(Status* st) {
  if (g_forked) {
    *st = Forked();
    return nullptr;
  }
  auto rt = Current();
  if (!rt) *st = NotInitialized();
  return rt;
}

namespace {

// Starts the runtime over the job's communicator (MPI_COMM_WORLD, or the survivors').
Status StartRuntime() REQUIRES(g_mu) {
  try {
    shoal::Config cfg = shoal::Config::FromEnvironment();
    g_fault_tolerant = cfg.fault_tolerant;
    Status st;
    auto backend = shoal::CreateMpiBackend(cfg, &st);
    if (!st.ok()) return st;
    shoal::SetLogContext(backend->world().rank, cfg.log_level);
    shoal::Log(shoal::LOG_DEBUG, "configuration: " + cfg.ToString());
    if (!backend->world().threads_multiple)
      shoal::Log(shoal::LOG_WARNING, "MPI was initialised without MPI_THREAD_MULTIPLE; do not call MPI from other threads while Shoal runs");
    g_runtime = std::make_shared<Runtime>(cfg, std::move(backend));
    auto* stats = &g_runtime->stats();
    g_runtime->AttachWindows(std::make_unique<shoal::WindowQueue>(
        [cfg, stats](shoal::WindowCancel* cancel) { return shoal::CreateMpiWindows(cfg, stats, cancel); }));
    Runtime* rt = g_runtime.get();
    g_runtime->windows()->SetGone([rt] { return rt->departures().Message(); });
    if (cfg.fault_tolerant) g_runtime->windows()->SetLost([rt] { return rt->Lost(); });
  } catch (const std::exception& ex) {
    return Status::Error(SHOAL_INVALID_ARGUMENT, ex.what());
  }
  return Status::Ok();
}

// The runtime that issued `handle`: the current one, or one a lost rank ended (its ops
// report SHOAL_RANK_LOST until released); null if none.
std::shared_ptr<Runtime> Owner(int64_t handle) EXCLUDES(g_mu) {
  shoal::MutexLock lock(g_mu);
  if (g_runtime && (g_retired.empty() || g_runtime->submissions().Find(handle))) return g_runtime;
  for (auto& rt : g_retired)
    if (rt->submissions().Find(handle)) return rt;
  return g_runtime;
}

// Drops a retired runtime once none of its handles is left.
void ForgetRetiredIfDone(const std::shared_ptr<Runtime>& rt) EXCLUDES(g_mu) {
  shoal::MutexLock lock(g_mu);
  if (rt == g_runtime || rt->submissions().HandleCount() > 0) return;
  g_retired.erase(std::remove(g_retired.begin(), g_retired.end(), rt), g_retired.end());
}

template <typename F> int WorldField(F f) {
  auto rt = Current();
  return rt ? f(rt->world()) : -1;
}

}  // namespace

extern "C" {

int shoal_init(char* err, size_t len) {
  if (g_forked) return Report(Forked(), err, len);
  shoal::MutexLock lock(g_mu);
  if (g_runtime) return SHOAL_OK;
  static bool at_fork = (pthread_atfork(nullptr, nullptr, OnForkInChild), true);
  (void)at_fork;
  g_parent_pid = getpid();
  return Report(StartRuntime(), err, len);
}

int shoal_recover(int32_t* lost, int32_t capacity, int32_t* n_lost, char* err, size_t len) {
  *n_lost = 0;
  if (g_forked) return Report(Forked(), err, len);
  shoal::MutexLock lock(g_mu);
  if (!g_runtime) return Report(NotInitialized(), err, len);
  if (!g_runtime->Lost()) return SHOAL_OK;
  std::shared_ptr<Runtime> old;
  old.swap(g_runtime);
  old->Stop();  // its ops have failed with SHOAL_RANK_LOST; waiters drop their references
  g_retired.push_back(old);
  // Never destroyed: its abandoned window thread may still be in MPI and use it (its stats,
  // its timeline, its loss state).
  static auto* const abandoned = new std::vector<std::shared_ptr<Runtime>>();
  abandoned->push_back(old);
  // Shrink until a runtime starts: a rank may die (or end) while the survivors make the
  // next one's communicators. `alive`: the old numbering of each rank still in the job.
  std::vector<int> alive(old->world().size), gone;
  for (size_t r = 0; r < alive.size(); ++r) alive[r] = static_cast<int>(r);
  Status st;
  for (int attempt = 0; attempt < 16; ++attempt) {
    std::vector<int> now;
    st = shoal::ShrinkMpiJob(&now);
    if (!st.ok()) break;
    for (auto it = now.rbegin(); it != now.rend(); ++it) {  // descending: erasing keeps the rest in place
      gone.push_back(alive[*it]);
      alive.erase(alive.begin() + *it);
    }
    st = StartRuntime();
    if (st.code != SHOAL_RANK_LOST) break;
  }
  std::sort(gone.begin(), gone.end());
  *n_lost = static_cast<int32_t>(gone.size());
  for (int32_t i = 0; i < *n_lost && i < capacity; ++i) lost[i] = gone[i];
  return Report(st, err, len);
}

int shoal_rank_lost(void) {
  auto rt = Current();
  return rt && rt->Lost() ? 1 : 0;
}

int shoal_shutdown(void) {
  if (g_forked) return SHOAL_OK;
  std::shared_ptr<Runtime> rt;
  {
    shoal::MutexLock lock(g_mu);
    rt.swap(g_runtime);
    g_retired.clear();
  }
  if (rt) rt->Stop();  // wakes waiters with an error; they drop their references
  return SHOAL_OK;
}

int shoal_is_initialized(void) { return Current() ? 1 : 0; }
void shoal_finalize_mpi(void) {
  if (g_forked) return;
  shoal_shutdown();
  // Fault-tolerant mode: no MPI_Finalize. It waits for every live rank, and one may still
  // be recovering from a loss this rank never saw: it would wait for this one to join its
  // shrink, and both would wait forever. A process that ends is a loss the others survive.
  if (!g_fault_tolerant) shoal::FinalizeMpiIfOwned();
}

void shoal_abort(int exit_code) {
  if (g_forked) _exit(exit_code);  // the parent's job is not the child's to end
  shoal::AbortJob(exit_code);
}

void shoal_leave(void) {
  if (g_forked) return;
  if (auto rt = Current()) rt->Leave();
}

void shoal_reject(int op, const char* name, int code, const char* message, int32_t process_set) {
  if (g_forked) return;
  if (auto rt = Current()) rt->Reject(op, name, code, message ? message : "", process_set);
}

int shoal_add_process_set(const int32_t* ranks, int32_t n, const char* refusal, int32_t* id, char* err, size_t len) {
  Status st;
  auto rt = Usable(&st);
  if (!rt) return Report(st, err, len);
  std::string why = refusal ? refusal : "";
  if (why.empty() && (n < 0 || (n > 0 && !ranks))) why = "add_process_set: missing rank list";
  try {
    *id = rt->AddProcessSet(why.empty() ? std::vector<int>(ranks, ranks + n) : std::vector<int>{}, why);
  } catch (const shoal::ArgumentError& ex) {
    return Report(Status::Error(ex.code, ex.what()), err, len);
  }
  return SHOAL_OK;
}

int shoal_remove_process_set(int32_t id, const char* refusal, char* err, size_t len) {
  Status st;
  auto rt = Usable(&st);
  if (!rt) return Report(st, err, len);
  try {
    rt->RemoveProcessSet(id, refusal ? refusal : "");
  } catch (const shoal::ArgumentError& ex) {
    return Report(Status::Error(ex.code, ex.what()), err, len);
  }
  return SHOAL_OK;
}

int shoal_process_set_ranks(int32_t id, int32_t* ranks, int32_t capacity) {
  auto rt = Current();
  if (!rt) return -1;
  std::vector<int> all;
  if (id == 0) {
    for (int r = 0; r < rt->world().size; ++r) all.push_back(r);
  } else if (auto s = rt->FindSet(id)) {
    all = s->ranks;
  } else {
    return -1;
  }
  for (int32_t i = 0; i < capacity && i < static_cast<int32_t>(all.size()); ++i) ranks[i] = all[i];
  return static_cast<int>(all.size());
}

int shoal_forked(void) { return g_forked ? 1 : 0; }

int shoal_rank(void) { return WorldField([](auto& w) { return w.rank; }); }
int shoal_size(void) { return WorldField([](auto& w) { return w.size; }); }
int shoal_local_rank(void) { return WorldField([](auto& w) { return w.local_rank; }); }
int shoal_local_size(void) { return WorldField([](auto& w) { return w.local_size; }); }
int shoal_machine_rank(void) { return WorldField([](auto& w) { return w.machine_rank; }); }
int shoal_machine_size(void) { return WorldField([](auto& w) { return w.machine_size; }); }
int shoal_is_homogeneous(void) { return WorldField([](auto& w) { return w.homogeneous ? 1 : 0; }); }
int shoal_mpi_threads_supported(void) { return WorldField([](auto& w) { return w.threads_multiple ? 1 : 0; }); }

void shoal_mpi_library_version(char* buf, size_t len) {
  Report(Status::Error(0, shoal::MpiLibraryVersion()), buf, len);
}

int shoal_set_topology(int graph, int32_t n_nodes, int64_t n_edges, const int32_t* src, const int32_t* dst,
                       const double* weights, int weighted, int64_t* version, char* err, size_t len) {
  auto rt = Current();
  if (!rt) return Report(NotInitialized(), err, len);
  const shoal::WorldInfo& w = rt->world();
  const bool machines = graph == SHOAL_GRAPH_MACHINES;
  if (graph != SHOAL_GRAPH_RANKS && !machines)
    return Report(Status::Error(SHOAL_INVALID_ARGUMENT, "topology: unknown graph " + std::to_string(graph)), err, len);
  const int nodes = machines ? w.machine_size : w.size;
  if (n_nodes != nodes || n_edges < 0 || (n_edges > 0 && (!src || !dst || !weights)))
    return Report(Status::Error(SHOAL_INVALID_ARGUMENT, "topology: a graph over " + std::to_string(n_nodes) +
                                " nodes, but there are " + std::to_string(nodes) + (machines ? " machines" : " ranks")),
                  err, len);
  try {
    auto plan = shoal::PlanOf(nodes, {src, src + n_edges}, {dst, dst + n_edges}, {weights, weights + n_edges},
                              machines ? w.machine_rank : w.rank, weighted != 0);
    *version = rt->topologies().Set(graph, std::move(plan));
  } catch (const shoal::ArgumentError& ex) {
    return Report(Status::Error(ex.code, ex.what()), err, len);
  }
  return SHOAL_OK;
}

int shoal_topology_plan(int graph, int32_t capacity, int32_t* recv, double* recv_weights, int32_t* send,
                        shoal_topology_info* info, char* err, size_t len) {
  auto rt = Current();
  if (!rt) return Report(NotInitialized(), err, len);
  if (graph != SHOAL_GRAPH_RANKS && graph != SHOAL_GRAPH_MACHINES)
    return Report(Status::Error(SHOAL_INVALID_ARGUMENT, "topology: unknown graph " + std::to_string(graph)), err, len);
  const shoal::TopologyPlan p = rt->topologies().Get(graph);
  *info = shoal_topology_info{p.version, p.weighted ? 1 : 0, static_cast<int32_t>(p.recv.size()),
                              static_cast<int32_t>(p.send.size()), p.self_weight};
  for (int32_t k = 0; k < std::min<int32_t>(capacity, info->n_recv); ++k) {
    recv[k] = p.recv[k];
    recv_weights[k] = p.recv_weights[k];
  }
  for (int32_t k = 0; k < std::min<int32_t>(capacity, info->n_send); ++k) send[k] = p.send[k];
  return SHOAL_OK;
}

int shoal_enqueue_with_callback(const shoal_op_desc* desc, shoal_callback callback, void* arg,
                                int64_t* handle, char* err, size_t len) {
  Status st;
  auto rt = Usable(&st);
  if (!rt) return Report(st, err, len);
  try {
    *handle = rt->Enqueue(*desc, callback, arg);
  } catch (const shoal::ArgumentError& ex) {
    return Report(Status::Error(ex.code, ex.what()), err, len);
  }
  return SHOAL_OK;
}

int shoal_enqueue(const shoal_op_desc* desc, int64_t* handle, char* err, size_t len) {
  return shoal_enqueue_with_callback(desc, nullptr, nullptr, handle, err, len);
}

int shoal_enqueue_group(const char* name, const shoal_op_desc* descs, int32_t n, shoal_callback callback,
                        void* const* args, int64_t* handles, char* err, size_t len) {
  Status st;
  auto rt = Usable(&st);
  if (!rt) return Report(st, err, len);
  try {
    std::vector<int64_t> h = rt->EnqueueGroup(name, descs, n, callback, args);
    std::copy(h.begin(), h.end(), handles);
  } catch (const shoal::ArgumentError& ex) {
    return Report(Status::Error(ex.code, ex.what()), err, len);
  }
  return SHOAL_OK;
}

int shoal_enqueue_join(int64_t* handle, char* err, size_t len) {
  shoal_op_desc d{};
  d.op = shoal::kOpJoin;
  return shoal_enqueue(&d, handle, err, len);
}

int shoal_poll(int64_t handle) {
  auto rt = Owner(handle);
  return rt ? rt->submissions().Poll(handle) : -SHOAL_UNKNOWN_HANDLE;
}

int shoal_in_use(int64_t handle) {
  auto rt = Owner(handle);
  return rt ? rt->submissions().InUse(handle) : -SHOAL_UNKNOWN_HANDLE;
}

int shoal_wait_for(int64_t handle, int64_t timeout_ms, char* err, size_t len) {
  Status st;
  auto rt = Usable(&st);
  if (!rt) return Report(st, err, len);
  rt = Owner(handle);
  return Report(rt->Wait(handle, timeout_ms), err, len);
}

int shoal_wait(int64_t handle, char* err, size_t len) {
  Status st;
  auto rt = Usable(&st);
  if (!rt) return Report(st, err, len);
  rt = Owner(handle);
  return Report(rt->Wait(handle), err, len);
}

int shoal_take_result(int64_t handle, void** data, size_t* nbytes, int32_t* ndim, int64_t* shape) {
  auto rt = Owner(handle);
  auto e = rt ? rt->submissions().Find(handle) : nullptr;
  if (!e || !e->done) return SHOAL_UNKNOWN_HANDLE;
  *data = e->result;
  *nbytes = e->result_nbytes;
  *ndim = static_cast<int32_t>(e->result_shape.size());
  std::copy(e->result_shape.begin(), e->result_shape.end(), shape);
  e->result = nullptr;
  return SHOAL_OK;
}

void shoal_free_buffer(void* data) { std::free(data); }

int shoal_received_splits(int64_t handle, int64_t* splits, int32_t capacity, int32_t* n) {
  auto rt = Owner(handle);
  auto e = rt ? rt->submissions().Find(handle) : nullptr;
  if (!e || !e->done) return SHOAL_UNKNOWN_HANDLE;
  *n = static_cast<int32_t>(e->recv_splits.size());
  for (int32_t i = 0; i < *n && i < capacity; ++i) splits[i] = e->recv_splits[i];
  return SHOAL_OK;
}

int shoal_attach(int64_t handle, void* data, void (*drop)(void*)) {
  auto rt = Owner(handle);
  shoal::Submissions::Attached a(data, drop);
  if (rt && rt->submissions().Attach(handle, &a)) return SHOAL_OK;
  a.Disown();  // an unknown handle: the caller keeps `data`
  return SHOAL_UNKNOWN_HANDLE;
}

void* shoal_attached(int64_t handle) {
  auto rt = Owner(handle);
  return rt ? rt->submissions().AttachedTo(handle) : nullptr;
}

void* shoal_detach(int64_t handle) {
  auto rt = Owner(handle);
  return rt ? rt->submissions().Detach(handle) : nullptr;
}

int64_t shoal_next_handle(void) { return shoal::Submissions::NextHandle(); }

int shoal_release(int64_t handle) {
  auto rt = Owner(handle);
  if (!rt || !rt->submissions().Release(handle)) return SHOAL_UNKNOWN_HANDLE;
  ForgetRetiredIfDone(rt);
  return SHOAL_OK;
}

int shoal_timeline_start_activity(const char* tensor_name, const char* activity) {
  auto rt = Current();
  if (!rt || !rt->timeline().enabled()) return 0;
  rt->timeline().Begin(tensor_name, activity);
  return 1;
}

int shoal_timeline_end_activity(const char* tensor_name) {
  auto rt = Current();
  if (!rt || !rt->timeline().enabled()) return 0;
  rt->timeline().End(tensor_name);
  return 1;
}

int shoal_stats(char* buf, size_t len) {
  auto rt = Current();
  if (!rt) return Report(NotInitialized(), buf, len);
  return Report(Status::Error(0, rt->stats().ToString()), buf, len);
}

int shoal_gpu_support(char* buf, size_t len) {
  std::string why;
  const shoal_cuda_api* api = shoal::CudaPlugin(&why);
  Report(Status::Error(0, api ? api->build : why), buf, len);
  return api ? 1 : 0;
}

int shoal_gpu_plugin_path(char* buf, size_t len) {
  const std::string path = shoal::CudaPluginPath();
  Report(Status::Error(0, path), buf, len);
  return static_cast<int>(path.size() + 1);
}

void shoal_reset_stats(void) {
  if (auto rt = Current()) rt->stats().Reset();
}

}  // extern "C"
