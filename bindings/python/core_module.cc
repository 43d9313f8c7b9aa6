// pybind11 module shoal._core: a thin layer over the C ABI of libshoal.so.
// Tensors arrive as (address, dtype code, shape); the Python side keeps them alive.
#include "cuda_plugin/cuda_api.h"
#include "module.h"
#include <algorithm>
#include <cstring>
#include <optional>

namespace shoal_py {

py::object g_shoal_error;
py::object g_neighbor_pattern_error;  // ShoalError and ValueError
py::object g_rank_lost_error;         // ShoalError: fault-tolerant mode, a rank died
// shoal._fault's recovery, run before a RankLostError is raised (never destroyed: it may be
// the last reference to a Python function at interpreter exit)
auto* g_on_rank_lost = new py::object();

[[noreturn]] void Raise(int code, const char* msg) {
  switch (code) {
    case SHOAL_INVALID_ARGUMENT:
    case SHOAL_DUPLICATE_NAME:
    case SHOAL_UNKNOWN_HANDLE:
    case SHOAL_NOT_INITIALIZED:
      throw py::value_error(msg);
    case SHOAL_INVALID_TYPE:
      throw py::type_error(msg);
    case SHOAL_NEIGHBOR_MISMATCH:
      PyErr_SetString(g_neighbor_pattern_error.ptr(), msg);
      throw py::error_already_set();
    case SHOAL_RANK_LOST: {
      // Every survivor recovers (collective over them) at its first such error, then raises
      // it (docs/design.md §16): the hook returns the exception to raise.
      py::object error = *g_on_rank_lost ? (*g_on_rank_lost)(py::str(msg)) : g_rank_lost_error(py::str(msg));
      PyErr_SetObject(g_rank_lost_error.ptr(), error.ptr());
      throw py::error_already_set();
    }
    default:
      PyErr_SetString(g_shoal_error.ptr(), msg);
      throw py::error_already_set();
  }
}

void Check(int code, const char* msg) {
  if (code != SHOAL_OK) Raise(code, msg);
}

// A tensor's memory: an int address (torch's data_ptr()), or any object exporting a
// C-contiguous buffer (numpy arrays; reading it here is ~10x cheaper than ndarray.ctypes).
void* Address(py::handle obj, bool writable) {
  if (PyLong_Check(obj.ptr())) return reinterpret_cast<void*>(obj.cast<uintptr_t>());
  Py_buffer view;
  if (PyObject_GetBuffer(obj.ptr(), &view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) != 0)
    throw py::error_already_set();
  void* p = view.buf;
  PyBuffer_Release(&view);
  return p;
}

// A tensor of the C ABI over memory the Python side keeps alive (CPU unless the caller
// sets the device fields).
shoal_tensor MakeTensor(py::handle data, int dtype, const std::vector<int64_t>& shape, bool writable) {
  shoal_tensor t{};
  t.data = Address(data, writable);
  t.dtype = dtype;
  t.ndim = static_cast<int32_t>(shape.size());
  t.shape = shape.data();
  return t;
}

// Waits (driving the op or sleeping) in 200 ms slices without the GIL, checking for
// Ctrl-C between them; `rc` is the result of a first slice already waited.
template <typename F> void WaitInterruptibly(F wait_for, int rc = SHOAL_TIMEOUT, const char* first_err = "") {
  char err[kErrLen];
  const char* msg = first_err;
  while (rc == SHOAL_TIMEOUT) {
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    {
      py::gil_scoped_release nogil;
      rc = wait_for(err);
    }
    msg = err;
  }
  Check(rc, msg);
}

// Blocking ops that left while the core may still use their tensors (wait interrupted by
// Ctrl-C; failed while a send from their memory was in flight): their Python objects stay
// referenced until shoal_in_use says otherwise. (Never destroyed: it may hold objects at
// interpreter exit.)
auto* g_lingering = new std::vector<std::pair<int64_t, py::object>>();

void ReleaseLingering() {
  auto& v = *g_lingering;
  for (size_t i = 0; i < v.size();) {
    if (shoal_in_use(v[i].first) != 1) {  // done, or unknown after shutdown
      shoal_release(v[i].first);
      v.erase(v.begin() + i);
    } else {
      ++i;
    }
  }
}

void Linger(int64_t handle, py::object keep) { g_lingering->emplace_back(handle, std::move(keep)); }

// Drops a Python object attached to a handle, in whichever thread ends the handle (it
// holds no lock of the core then): the GIL is taken for it. Once the interpreter is
// finalizing the object is left alone.
void DropObject(void* p) {
#if PY_VERSION_HEX >= 0x030D0000
  if (!Py_IsInitialized() || Py_IsFinalizing()) return;
#else
  if (!Py_IsInitialized() || _Py_IsFinalizing()) return;
#endif
  PyGILState_STATE gil = PyGILState_Ensure();
  Py_DECREF(static_cast<PyObject*>(p));
  PyGILState_Release(gil);
}

void Attach(int64_t h, py::object data) {
  PyObject* p = data.release().ptr();
  if (shoal_attach(h, p, DropObject) != SHOAL_OK) {
    Py_DECREF(p);
    Raise(SHOAL_UNKNOWN_HANDLE, ("unknown handle " + std::to_string(h)).c_str());
  }
}

// Enqueues `d`; with `block`, also waits for it and releases its handle (one call and one
// GIL release for a blocking op whose result is its output tensor) and returns 0.
// `keep`: the objects owning the tensors' memory, held if the wait is interrupted;
// without `block`, (keep, finish) is attached to the handle.
int64_t Submit(const shoal_op_desc& d, bool block, const py::object& keep, const py::object& finish) {
  if (!g_lingering->empty()) ReleaseLingering();
  int64_t handle = 0;
  char err[kErrLen];
  int rc, wait_rc = SHOAL_TIMEOUT;
  {
    py::gil_scoped_release nogil;  // the core may start the op right away
    rc = shoal_enqueue(&d, &handle, err, kErrLen);
    if (rc == SHOAL_OK && block) wait_rc = shoal_wait_for(handle, 200, err, kErrLen);
  }
  Check(rc, err);
  if (!block) {
    Attach(handle, py::make_tuple(keep, finish));
    return handle;
  }
  try {
    WaitInterruptibly([handle](char* e) { return shoal_wait_for(handle, 200, e, kErrLen); }, wait_rc, err);
  } catch (...) {
    if (shoal_in_use(handle) == 1) Linger(handle, keep);
    else shoal_release(handle);
    throw;
  }
  shoal_release(handle);
  return 0;
}

void SetPeers(shoal_op_desc* d, const NeighborArgs& a) {
  d->n_recv = static_cast<int32_t>(a.recv_ranks.size());
  d->recv_ranks = a.recv_ranks.data();
  d->recv_weights = a.recv_weights.empty() ? nullptr : a.recv_weights.data();
  d->self_weight = a.self_weight;
  d->uniform = a.uniform;
  d->n_send = static_cast<int32_t>(a.send_ranks.size());
  d->send_ranks = a.send_ranks.data();
  d->send_weights = a.send_weights.empty() ? nullptr : a.send_weights.data();
  d->topo_check = a.topo_check;
}

// The desc of one tensor op (its shape must outlive the desc).
shoal_op_desc Describe(int op, py::handle input, int dtype, const std::vector<int64_t>& shape, py::handle output,
                       int reduce_op, int scope, int device_type, int device_id, uintptr_t stream,
                       int process_set) {
  shoal_op_desc d{};
  d.op = op;
  d.input = MakeTensor(input, dtype, shape, false);
  d.input.device_type = device_type;
  d.input.device_id = device_id;
  d.input.stream = reinterpret_cast<void*>(stream);
  d.output = d.input;
  d.output.data = output.is(input) ? d.input.data : Address(output, true);
  d.reduce_op = reduce_op;
  d.scope = scope;
  d.process_set = process_set;
  return d;
}

// Horovod's scaling on a desc: `scaling` is None or (prescale_factor, postscale_factor).
void SetScaling(shoal_op_desc* d, const std::optional<std::pair<double, double>>& scaling) {
  if (!scaling) return;
  d->horovod_scaling = 1;
  d->prescale_factor = scaling->first;
  d->postscale_factor = scaling->second;
}

// Any op, from its parts (the shoal._ops path); `peers`: a neighbor op's lists (None: no
// peers); `splits`: an alltoall's rows per rank (None: even); `process_set`: the set's id
// (0: every rank); `scaling`: Horovod's (see SetScaling).
int64_t Enqueue(int op, const std::string& name, py::handle input, int dtype, const std::vector<int64_t>& shape,
                py::handle output, const NeighborArgs* peers, int reduce_op, int root, int scope, int device_type,
                int device_id, uintptr_t stream, bool block, py::object keep, py::object finish,
                const std::optional<std::vector<int64_t>>& splits, int process_set,
                const std::optional<std::pair<double, double>>& scaling) {
  static const NeighborArgs kNoPeers{};
  shoal_op_desc d =
      Describe(op, input, dtype, shape, output, reduce_op, scope, device_type, device_id, stream, process_set);
  d.name = name.c_str();
  d.root_rank = root;
  SetPeers(&d, peers ? *peers : kNoPeers);
  if (splits) {
    d.n_splits = static_cast<int32_t>(splits->size());
    d.splits = splits->data();
  }
  SetScaling(&d, scaling);
  return Submit(d, block, keep.is_none() ? py::object(py::make_tuple(input, output)) : keep, finish);
}

// A grouped op (shoal_enqueue_group): `tensors` is a list of (input, dtype, shape, output,
// device type, device id, stream); returns the members' handles. `scaling` as Enqueue's,
// for every member.
std::vector<int64_t> EnqueueGroup(int op, const std::string& name, const py::list& tensors, int reduce_op, int scope,
                                  int process_set, const std::optional<std::pair<double, double>>& scaling) {
  if (!g_lingering->empty()) ReleaseLingering();
  const size_t n = tensors.size();
  std::vector<std::vector<int64_t>> shapes(n);
  std::vector<shoal_op_desc> descs(n);
  for (size_t i = 0; i < n; ++i) {
    py::tuple t = tensors[i].cast<py::tuple>();
    shapes[i] = t[2].cast<std::vector<int64_t>>();
    descs[i] = Describe(op, t[0], t[1].cast<int>(), shapes[i], t[3], reduce_op, scope, t[4].cast<int>(),
                        t[5].cast<int>(), t[6].cast<uintptr_t>(), process_set);
    SetScaling(&descs[i], scaling);
  }
  std::vector<int64_t> handles(n);
  char err[kErrLen];
  int rc;
  {
    py::gil_scoped_release nogil;  // the core may start the ops right away
    rc = shoal_enqueue_group(name.c_str(), descs.data(), static_cast<int32_t>(n), nullptr, nullptr, handles.data(),
                             err, kErrLen);
  }
  Check(rc, err);
  return handles;
}

// `poll(h)` (True once done; ValueError for an unknown handle) and `wait(h)` (Ctrl-C aware)
// over the C ABI's functions for op or window handles.
void DefinePollWait(py::module_& m, const char* poll_name, const char* wait_name, const char* what,
                    int (*poll)(int64_t), int (*wait_for)(int64_t, int64_t, char*, size_t)) {
  const std::string unknown = std::string("unknown ") + what + " ";
  m.def(poll_name, [poll, unknown](int64_t h) {
    int r = poll(h);
    if (r < 0) Raise(-r, (unknown + std::to_string(h)).c_str());
    return r == 1;
  });
  m.def(wait_name, [wait_for](int64_t h) {
    WaitInterruptibly([h, wait_for](char* err) { return wait_for(h, 200, err, kErrLen); });
  });
}

// The C ABI's codes and the CUDA plugin table's layout, so Python never restates them.
void DefineConstants(py::module_& m) {
  using namespace pybind11::literals;
  m.attr("OPS") = py::dict("allreduce"_a = int(SHOAL_OP_ALLREDUCE), "broadcast"_a = int(SHOAL_OP_BROADCAST),
                           "allgather"_a = int(SHOAL_OP_ALLGATHER), "barrier"_a = int(SHOAL_OP_BARRIER),
                           "neighbor_allreduce"_a = int(SHOAL_OP_NEIGHBOR_ALLREDUCE),
                           "neighbor_allgather"_a = int(SHOAL_OP_NEIGHBOR_ALLGATHER),
                           "reducescatter"_a = int(SHOAL_OP_REDUCESCATTER), "alltoall"_a = int(SHOAL_OP_ALLTOALL),
                           "hierarchical_neighbor_allreduce"_a = int(SHOAL_OP_HIERARCHICAL_NEIGHBOR_ALLREDUCE));
  m.attr("GROUPED") = SHOAL_GROUPED;  // or'ed into an op code: its grouped form
  m.attr("DTYPES") = py::dict("float16"_a = int(SHOAL_FLOAT16), "bfloat16"_a = int(SHOAL_BFLOAT16),
                              "float32"_a = int(SHOAL_FLOAT32), "float64"_a = int(SHOAL_FLOAT64),
                              "int8"_a = int(SHOAL_INT8), "uint8"_a = int(SHOAL_UINT8), "int16"_a = int(SHOAL_INT16),
                              "int32"_a = int(SHOAL_INT32), "int64"_a = int(SHOAL_INT64), "bool"_a = int(SHOAL_BOOL));
  m.attr("REDUCE_OPS") = py::dict("sum"_a = int(SHOAL_REDUCE_SUM), "average"_a = int(SHOAL_REDUCE_AVERAGE),
                                  "min"_a = int(SHOAL_REDUCE_MIN), "max"_a = int(SHOAL_REDUCE_MAX),
                                  "product"_a = int(SHOAL_REDUCE_PRODUCT));
  m.attr("SCOPES") = py::dict("world"_a = int(SHOAL_SCOPE_WORLD), "machine"_a = int(SHOAL_SCOPE_MACHINE));
  m.attr("GRAPHS") = py::dict("ranks"_a = int(SHOAL_GRAPH_RANKS), "machines"_a = int(SHOAL_GRAPH_MACHINES));
  m.attr("DEVICE_TYPES") = py::dict("cpu"_a = int(SHOAL_DEVICE_CPU), "cuda"_a = int(SHOAL_DEVICE_CUDA));
  m.attr("WIN_OPS") = py::dict("create"_a = int(SHOAL_WIN_CREATE), "free"_a = int(SHOAL_WIN_FREE),
                               "put"_a = int(SHOAL_WIN_PUT), "accumulate"_a = int(SHOAL_WIN_ACCUMULATE),
                               "get"_a = int(SHOAL_WIN_GET), "update"_a = int(SHOAL_WIN_UPDATE),
                               "lock"_a = int(SHOAL_WIN_LOCK), "unlock"_a = int(SHOAL_WIN_UNLOCK));
  m.attr("CUDA_ABI_VERSION") = SHOAL_CUDA_ABI_VERSION;  // of the plugin table (shoal/_gpu.py)
  // {field: byte offset} and the size of shoal_cuda_api: shoal/_gpu.py checks its ctypes
  // view against them, so a reordered or resized header fails at import, not in a call.
  py::dict fields;
#define SHOAL_FIELD(f) fields[#f] = offsetof(shoal_cuda_api, f)
  SHOAL_FIELD(abi_version); SHOAL_FIELD(build); SHOAL_FIELD(has_nccl); SHOAL_FIELD(device_count);
  SHOAL_FIELD(set_device); SHOAL_FIELD(get_device); SHOAL_FIELD(stream_create); SHOAL_FIELD(stream_destroy);
  SHOAL_FIELD(stream_sync); SHOAL_FIELD(stream_wait_event); SHOAL_FIELD(capture); SHOAL_FIELD(event_create);
  SHOAL_FIELD(event_destroy); SHOAL_FIELD(event_record); SHOAL_FIELD(event_query); SHOAL_FIELD(memcpy_async);
  SHOAL_FIELD(host_alloc); SHOAL_FIELD(host_free); SHOAL_FIELD(device_alloc); SHOAL_FIELD(device_free);
  SHOAL_FIELD(combine); SHOAL_FIELD(scale); SHOAL_FIELD(pack); SHOAL_FIELD(nccl_unique_id);
  SHOAL_FIELD(nccl_comm_init); SHOAL_FIELD(nccl_comm_destroy); SHOAL_FIELD(nccl_check); SHOAL_FIELD(nccl_allreduce);
  SHOAL_FIELD(nccl_broadcast); SHOAL_FIELD(nccl_allgatherv); SHOAL_FIELD(nccl_exchange); SHOAL_FIELD(nccl_comm_abort);
  SHOAL_FIELD(nccl_reducescatter); SHOAL_FIELD(mpi_cuda_aware);
#undef SHOAL_FIELD
  m.attr("CUDA_API_FIELDS") = fields;
  m.attr("CUDA_API_SIZE") = sizeof(shoal_cuda_api);
  m.attr("NCCL_PEER_FIELDS") = py::dict("peer"_a = offsetof(shoal_nccl_peer, peer),
                                        "buf"_a = offsetof(shoal_nccl_peer, buf),
                                        "count"_a = offsetof(shoal_nccl_peer, count));
}

}  // namespace shoal_py

using namespace shoal_py;

PYBIND11_MODULE(_core, m) {
  m.doc() = "Shoal runtime (C++ core over MPI); use the shoal package, not this module.";
  g_shoal_error = py::reinterpret_borrow<py::object>(
      py::exception<std::runtime_error>(m, "ShoalError", PyExc_RuntimeError).ptr());
  m.attr("ShoalError").attr("__doc__") =
      "A runtime failure of a Shoal op: ranks disagree (shape, dtype, op, root), a peer "
      "stalled or died, or Shoal was shut down. Subclass of RuntimeError.";
  {
    py::tuple bases = py::make_tuple(g_shoal_error, py::handle(PyExc_ValueError));
    g_neighbor_pattern_error = py::reinterpret_steal<py::object>(PyErr_NewExceptionWithDoc(
        "shoal._core.NeighborPatternError",
        "A dynamic neighbor op whose send and receive ranks disagree (enable_topo_check), on "
        "every rank: a ShoalError, and a ValueError as BlueFog raised it.",
        bases.ptr(), nullptr));
    if (!g_neighbor_pattern_error) throw py::error_already_set();
    m.attr("NeighborPatternError") = g_neighbor_pattern_error;
  }

  m.def("init", [] {
    char err[kErrLen];
    int rc;
    {
      py::gil_scoped_release nogil;
      rc = shoal_init(err, kErrLen);
    }
    Check(rc, err);
  });
  m.def("shutdown", [] {
    py::gil_scoped_release nogil;
    shoal_shutdown();
  });
  m.def("finalize_mpi", [] {
    py::gil_scoped_release nogil;
    shoal_finalize_mpi();
  });
  m.def("abort", [](int code) {
    py::gil_scoped_release nogil;
    shoal_abort(code);
  });
  {
    py::tuple bases = py::make_tuple(g_shoal_error);
    g_rank_lost_error = py::reinterpret_steal<py::object>(PyErr_NewExceptionWithDoc(
        "shoal._core.RankLostError",
        "Fault-tolerant mode: a rank of the job died while this op needed the job. The survivors "
        "have recovered when it is raised (shoal.RankLostError documents the rest).",
        bases.ptr(), nullptr));
    if (!g_rank_lost_error) throw py::error_already_set();
    m.attr("RankLostError") = g_rank_lost_error;
  }
  m.def("set_rank_lost_hook", [](py::object hook) { *g_on_rank_lost = std::move(hook); });
  // Fault-tolerant mode: shrink to the survivors and start the next runtime (collective over
  // them); the lost ranks, numbered as before ([] if the runtime had lost none).
  m.def("recover", [] {
    int32_t lost[4096];
    int32_t n = 0;
    char err[kErrLen];
    int rc;
    {
      py::gil_scoped_release nogil;
      rc = shoal_recover(lost, 4096, &n, err, kErrLen);
    }
    Check(rc, err);
    return std::vector<int32_t>(lost, lost + std::min<int32_t>(n, 4096));
  });
  m.def("rank_lost", [] { return shoal_rank_lost() == 1; });
  m.def("leave", [] {
    py::gil_scoped_release nogil;
    shoal_leave();
  });
  // `failed`: not an argument error but a failure of an earlier stage (ShoalError on the peers).
  m.def("reject", [](int op, std::optional<std::string> name, bool type_error, const std::string& message,
                     bool failed, int process_set) {
    py::gil_scoped_release nogil;
    shoal_reject(op, name ? name->c_str() : nullptr,
                 failed ? SHOAL_ABORTED : type_error ? SHOAL_INVALID_TYPE : SHOAL_INVALID_ARGUMENT, message.c_str(),
                 process_set);
  }, py::arg("op"), py::arg("name"), py::arg("type_error"), py::arg("message"), py::arg("failed") = false,
     py::arg("process_set") = 0);
  // Process sets (shoal/process_sets.py): blocking, collective over every rank. `refusal`:
  // this rank's TypeError text (every rank raises it).
  m.def("add_process_set", [](const std::vector<int32_t>& ranks, const std::string& refusal) {
    char err[kErrLen];
    int32_t id = 0;
    int rc;
    {
      py::gil_scoped_release nogil;
      rc = shoal_add_process_set(ranks.data(), static_cast<int32_t>(ranks.size()),
                                 refusal.empty() ? nullptr : refusal.c_str(), &id, err, kErrLen);
    }
    Check(rc, err);
    return id;
  }, py::arg("ranks"), py::arg("refusal") = "");
  m.def("remove_process_set", [](int32_t id, const std::string& refusal) {
    char err[kErrLen];
    int rc;
    {
      py::gil_scoped_release nogil;
      rc = shoal_remove_process_set(id, refusal.empty() ? nullptr : refusal.c_str(), err, kErrLen);
    }
    Check(rc, err);
  }, py::arg("id"), py::arg("refusal") = "");
  m.def("process_set_ranks", [](int32_t id) -> py::object {  // None for an unknown set
    std::vector<int32_t> ranks(shoal_size() > 0 ? shoal_size() : 1);
    const int n = shoal_process_set_ranks(id, ranks.data(), static_cast<int32_t>(ranks.size()));
    if (n < 0) return py::none();
    ranks.resize(n);
    return py::cast(ranks);
  });
  m.def("forked", [] { return shoal_forked() != 0; });
  m.def("is_initialized", [] { return shoal_is_initialized() != 0; });
  m.def("rank", &shoal_rank);
  m.def("size", &shoal_size);
  m.def("local_rank", &shoal_local_rank);
  m.def("local_size", &shoal_local_size);
  m.def("machine_rank", &shoal_machine_rank);
  m.def("machine_size", &shoal_machine_size);
  m.def("is_homogeneous", [] { return shoal_is_homogeneous() == 1; });
  m.def("mpi_threads_supported", [] { return shoal_mpi_threads_supported() == 1; });
  m.def("mpi_library_version", [] {
    char buf[8192];
    shoal_mpi_library_version(buf, sizeof buf);
    return std::string(buf);
  });
  DefineConstants(m);
  // The core's static topologies (shoal.basics.set_topology / set_machine_topology).
  m.def("set_topology", [](int graph, int32_t nodes, std::vector<int32_t> src, std::vector<int32_t> dst,
                           std::vector<double> weights, bool weighted) {
    if (src.size() != dst.size() || src.size() != weights.size()) throw py::value_error("topology: edge lists differ in length");
    char err[kErrLen];
    int64_t version = 0;
    Check(shoal_set_topology(graph, nodes, static_cast<int64_t>(src.size()), src.data(), dst.data(), weights.data(),
                             weighted, &version, err, kErrLen), err);
    return version;
  });
  // {"version", "weighted", "recv", "recv_weights", "send", "self_weight"} (lists ascending), or
  // None while the graph was never set.
  m.def("topology_plan", [](int graph) -> py::object {
    using namespace pybind11::literals;
    char err[kErrLen];
    shoal_topology_info info{};
    std::vector<int32_t> recv(64), send(64);
    std::vector<double> weights(64);
    for (;;) {
      Check(shoal_topology_plan(graph, static_cast<int32_t>(recv.size()), recv.data(), weights.data(), send.data(),
                                &info, err, kErrLen), err);
      const size_t need = std::max(info.n_recv, info.n_send);
      if (need <= recv.size()) break;
      recv.resize(need), send.resize(need), weights.resize(need);
    }
    if (info.version == 0) return py::none();
    recv.resize(info.n_recv), weights.resize(info.n_recv), send.resize(info.n_send);
    return py::dict("version"_a = info.version, "weighted"_a = info.weighted != 0, "recv"_a = py::tuple(py::cast(recv)),
                    "recv_weights"_a = py::tuple(py::cast(weights)), "send"_a = py::tuple(py::cast(send)),
                    "self_weight"_a = info.self_weight);
  });
  m.def("enqueue", &Enqueue, py::arg("op"), py::arg("name"), py::arg("input"), py::arg("dtype"),
        py::arg("shape"), py::arg("output"), py::kw_only(), py::arg("peers") = py::none(),
        py::arg("reduce_op") = 0, py::arg("root") = 0, py::arg("scope") = 0, py::arg("device_type") = 0,
        py::arg("device_id") = 0, py::arg("stream") = 0, py::arg("block") = false, py::arg("keep") = py::none(),
        py::arg("finish") = py::none(),
        py::arg("splits") = py::none(), py::arg("process_set") = 0, py::arg("scaling") = py::none());
  m.def("enqueue_group", &EnqueueGroup, py::arg("op"), py::arg("name"), py::arg("tensors"), py::kw_only(),
        py::arg("reduce_op") = 0, py::arg("scope") = 0, py::arg("process_set") = 0, py::arg("scaling") = py::none());
  m.def("received_splits", [](int64_t h) {  // of a completed alltoall
    std::vector<int64_t> v(shoal_size() > 0 ? shoal_size() : 1);
    int32_t n = 0;
    Check(shoal_received_splits(h, v.data(), static_cast<int32_t>(v.size()), &n), "no alltoall result for this handle");
    v.resize(std::min<size_t>(v.size(), static_cast<size_t>(n)));
    return v;
  });
  // Keeps `keep` referenced until the core no longer uses `handle`'s memory (a failed op
  // with a send in flight), then releases the handle: the one registry of such tensors.
  m.def("linger", &Linger);
  // attach(h, data) / attached(h): a handle's Python objects, kept by the core with it
  // (shoal_attach); attached gives None for an unknown handle.
  m.def("attach", &Attach);
  m.def("attached", [](int64_t h) -> py::object {
    void* p = shoal_attached(h);  // not dropped meanwhile: that needs the GIL, held here
    return p ? py::reinterpret_borrow<py::object>(static_cast<PyObject*>(p)) : py::object(py::none());
  });
  // detach(h): the attached object, taken (None if none): of threads finishing one handle,
  // one gets it.
  m.def("detach", [](int64_t h) -> py::object {
    void* p = shoal_detach(h);
    return p ? py::reinterpret_steal<py::object>(static_cast<PyObject*>(p)) : py::object(py::none());
  });
  m.def("next_handle", &shoal_next_handle);
  DefineNeighborNative(m);
  DefineRegisteredKernels(m);
  m.def("in_use", [](int64_t h) { return shoal_in_use(h) == 1; });
  DefinePollWait(m, "poll", "wait", "handle", &shoal_poll, &shoal_wait_for);
  DefineWindows(m);
  m.def("take_result", [](int64_t h) {
    void* data = nullptr;
    size_t nbytes = 0;
    int32_t ndim = 0;
    int64_t shape[32];
    Check(shoal_take_result(h, &data, &nbytes, &ndim, shape), "no result for this handle");
    py::capsule owner(data, [](void* p) { shoal_free_buffer(p); });
    py::array_t<uint8_t> bytes({static_cast<py::ssize_t>(nbytes)}, {1}, static_cast<uint8_t*>(data), owner);
    return py::make_tuple(bytes, std::vector<int64_t>(shape, shape + ndim));
  });
  m.def("join", [] {  // shoal._ops.join: blocks (interruptibly); the last rank to join
    int64_t handle = 0;
    char err[kErrLen];
    int rc, wait_rc = SHOAL_TIMEOUT;
    {
      py::gil_scoped_release nogil;
      rc = shoal_enqueue_join(&handle, err, kErrLen);
      if (rc == SHOAL_OK) wait_rc = shoal_wait_for(handle, 200, err, kErrLen);
    }
    Check(rc, err);
    try {
      WaitInterruptibly([handle](char* e) { return shoal_wait_for(handle, 200, e, kErrLen); }, wait_rc, err);
    } catch (...) {
      shoal_release(handle);
      throw;
    }
    void* data = nullptr;
    size_t nbytes = 0;
    int32_t ndim = 0, last = -1;
    int64_t shape[32];
    rc = shoal_take_result(handle, &data, &nbytes, &ndim, shape);
    if (rc == SHOAL_OK && data && nbytes == sizeof(last)) std::memcpy(&last, data, sizeof(last));
    shoal_free_buffer(data);
    shoal_release(handle);
    Check(rc, "join: no result");
    return last;
  });
  m.def("release", [](int64_t h) { shoal_release(h); });
  m.def("stats", [] {
    char buf[kErrLen];
    Check(shoal_stats(buf, kErrLen), buf);
    py::dict d;
    std::string s(buf);
    size_t at = 0;
    while (at < s.size()) {
      size_t eol = s.find('\n', at), eq = s.find('=', at);
      if (eol == std::string::npos) eol = s.size();
      d[py::str(s.substr(at, eq - at))] = std::stoll(s.substr(eq + 1, eol - eq - 1));
      at = eol + 1;
    }
    return d;
  });
  m.def("reset_stats", &shoal_reset_stats);
  m.def("gpu_support", [] {
    char buf[kErrLen];
    int ok = shoal_gpu_support(buf, kErrLen);
    return py::make_tuple(ok == 1, std::string(buf));
  });
  m.def("gpu_plugin_path", [] {
    char buf[4096];
    shoal_gpu_plugin_path(buf, sizeof buf);
    return std::string(buf);
  });
  m.def("timeline_start_activity", [](const std::string& t, const std::string& a) {
    return shoal_timeline_start_activity(t.c_str(), a.c_str()) == 1;
  });
  m.def("timeline_end_activity", [](const std::string& t) { return shoal_timeline_end_activity(t.c_str()) == 1; });
}
