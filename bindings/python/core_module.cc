// pybind11 module shoal._core: a thin layer over the C ABI of libshoal.so.
// Tensors arrive as (address, dtype code, shape); the Python side keeps them alive.
#include "cuda_api.h"
#include "module.h"
#include <optional>

namespace shoal_py {

py::object g_shoal_error;

[[noreturn]] void Raise(int code, const char* msg) {
  switch (code) {
    case SHOAL_INVALID_ARGUMENT:
    case SHOAL_DUPLICATE_NAME:
    case SHOAL_UNKNOWN_HANDLE:
    case SHOAL_NOT_INITIALIZED:
      throw py::value_error(msg);
    case SHOAL_INVALID_TYPE:
      throw py::type_error(msg);
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

// Enqueues `d`; with `block`, also waits for it and releases its handle (one call and one
// GIL release for a blocking op whose result is its output tensor) and returns 0.
// `keep`: the objects owning the tensors' memory, held if the wait is interrupted.
int64_t Submit(const shoal_op_desc& d, bool block, const py::object& keep) {
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
  if (!block) return handle;
  try {
    WaitInterruptibly([handle](char* e) { return shoal_wait_for(handle, 200, e, kErrLen); }, wait_rc, err);
  } catch (...) {
    if (shoal_in_use(handle) == 1) g_lingering->emplace_back(handle, keep);
    else shoal_release(handle);
    throw;
  }
  shoal_release(handle);
  return 0;
}

void SetPeers(shoal_op_desc* d, const std::vector<int32_t>& recv_ranks, const std::vector<double>& recv_weights,
              double self_weight, bool uniform, const std::vector<int32_t>& send_ranks,
              const std::vector<double>& send_weights, bool topo_check) {
  d->n_recv = static_cast<int32_t>(recv_ranks.size());
  d->recv_ranks = recv_ranks.data();
  d->recv_weights = recv_weights.empty() ? nullptr : recv_weights.data();
  d->self_weight = self_weight;
  d->uniform = uniform;
  d->n_send = static_cast<int32_t>(send_ranks.size());
  d->send_ranks = send_ranks.data();
  d->send_weights = send_weights.empty() ? nullptr : send_weights.data();
  d->topo_check = topo_check;
}

// Any op, from its parts (the shoal._ops path).
int64_t Enqueue(int op, const std::string& name, py::handle input, int dtype,
                const std::vector<int64_t>& shape, py::handle output, int reduce_op, int root,
                const std::vector<int32_t>& recv_ranks, const std::vector<double>& recv_weights,
                double self_weight, bool uniform, const std::vector<int32_t>& send_ranks,
                const std::vector<double>& send_weights, int scope, bool topo_check, int device_type,
                int device_id, uintptr_t stream, bool block, py::object keep) {
  shoal_op_desc d{};
  d.op = op;
  d.name = name.c_str();
  d.input = MakeTensor(input, dtype, shape, false);
  d.input.device_type = device_type;
  d.input.device_id = device_id;
  d.input.stream = reinterpret_cast<void*>(stream);
  d.output = d.input;
  d.output.data = output.is(input) ? d.input.data : Address(output, true);
  d.reduce_op = reduce_op;
  d.root_rank = root;
  d.scope = scope;
  SetPeers(&d, recv_ranks, recv_weights, self_weight, uniform, send_ranks, send_weights, topo_check);
  return Submit(d, block, keep.is_none() ? py::object(py::make_tuple(input, output)) : keep);
}

int64_t WinEnqueue(int op, const std::string& name, py::handle data, int dtype,
                   const std::vector<int64_t>& shape, const std::vector<int32_t>& ranks,
                   const std::vector<double>& weights, const std::vector<int32_t>& send_ranks,
                   double self_weight, bool uniform, bool zero_init, bool require_mutex, bool reset,
                   bool with_p, bool for_self, bool clone) {
  shoal_win_desc d{};
  d.op = op;
  d.name = name.c_str();
  d.tensor = MakeTensor(data, dtype, shape, false);  // writability is checked in shoal/_win.py
  d.n = static_cast<int32_t>(ranks.size());
  d.ranks = ranks.data();
  d.weights = weights.empty() ? nullptr : weights.data();
  d.n_send = static_cast<int32_t>(send_ranks.size());
  d.send_ranks = send_ranks.data();
  d.self_weight = self_weight;
  d.uniform = uniform;
  d.zero_init = zero_init;
  d.require_mutex = require_mutex;
  d.reset = reset;
  d.with_p = with_p;
  d.for_self = for_self;
  d.clone = clone;
  int64_t handle = 0;
  char err[kErrLen];
  Check(shoal_win_enqueue(&d, &handle, err, kErrLen), err);
  return handle;
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
  m.def("leave", [] {
    py::gil_scoped_release nogil;
    shoal_leave();
  });
  m.def("reject", [](int op, std::optional<std::string> name, bool type_error, const std::string& message) {
    py::gil_scoped_release nogil;
    shoal_reject(op, name ? name->c_str() : nullptr, type_error ? SHOAL_INVALID_TYPE : SHOAL_INVALID_ARGUMENT,
                 message.c_str());
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
  m.def("enqueue", &Enqueue, py::arg("op"), py::arg("name"), py::arg("input"), py::arg("dtype"),
        py::arg("shape"), py::arg("output"), py::arg("reduce_op") = 0, py::arg("root") = 0,
        py::arg("recv_ranks") = std::vector<int32_t>{}, py::arg("recv_weights") = std::vector<double>{},
        py::arg("self_weight") = 1.0, py::arg("uniform") = true,
        py::arg("send_ranks") = std::vector<int32_t>{}, py::arg("send_weights") = std::vector<double>{},
        py::arg("scope") = 0, py::arg("topo_check") = false, py::arg("device_type") = 0,
        py::arg("device_id") = 0, py::arg("stream") = 0, py::arg("block") = false,
        py::arg("keep") = py::none());
  DefineNeighborNative(m);
  m.def("in_use", [](int64_t h) { return shoal_in_use(h) == 1; });
  m.def("poll", [](int64_t h) {
    int r = shoal_poll(h);
    if (r < 0) Raise(-r, ("unknown handle " + std::to_string(h)).c_str());
    return r == 1;
  });
  m.def("wait", [](int64_t h) {
    WaitInterruptibly([h](char* err) { return shoal_wait_for(h, 200, err, kErrLen); });
  });
  m.def("win_enqueue", &WinEnqueue, py::arg("op"), py::arg("name"), py::arg("data") = py::int_(0),
        py::arg("dtype") = 2, py::arg("shape") = std::vector<int64_t>{},
        py::arg("ranks") = std::vector<int32_t>{}, py::arg("weights") = std::vector<double>{},
        py::arg("send_ranks") = std::vector<int32_t>{}, py::arg("self_weight") = 1.0,
        py::arg("uniform") = false, py::arg("zero_init") = false, py::arg("require_mutex") = false,
        py::arg("reset") = false, py::arg("with_p") = false, py::arg("for_self") = false, py::arg("clone") = false);
  m.def("win_poll", [](int64_t h) {
    int r = shoal_win_poll(h);
    if (r < 0) Raise(-r, ("unknown window handle " + std::to_string(h)).c_str());
    return r == 1;
  });
  m.def("win_wait", [](int64_t h) {
    WaitInterruptibly([h](char* err) { return shoal_win_wait_for(h, 200, err, kErrLen); });
  });
  m.def("win_release", [](int64_t h) { shoal_win_release(h); });
  m.def("win_versions", [](const std::string& name) {
    char err[kErrLen];
    std::vector<int32_t> ranks(shoal_size() > 0 ? shoal_size() : 1);
    std::vector<int64_t> v(ranks.size());
    int32_t n = 0;
    int rc;
    {
      py::gil_scoped_release nogil;
      rc = shoal_win_versions(name.c_str(), ranks.data(), v.data(), static_cast<int32_t>(ranks.size()), &n, err, kErrLen);
    }
    Check(rc, err);
    py::dict d;
    for (int32_t i = 0; i < n; ++i) d[py::int_(ranks[i])] = v[i];
    return d;
  });
  m.def("win_associated_p", [](const std::string& name) {
    char err[kErrLen];
    double p = 0;
    int rc;
    {
      py::gil_scoped_release nogil;
      rc = shoal_win_associated_p(name.c_str(), &p, err, kErrLen);
    }
    Check(rc, err);
    return p;
  });
  m.def("win_names", [] {
    std::vector<char> buf(4096);
    int rc;
    for (;;) {
      {
        py::gil_scoped_release nogil;
        rc = shoal_win_names(buf.data(), buf.size());
      }
      if (rc < 0) Raise(-rc, buf.data());
      if (static_cast<size_t>(rc) <= buf.size()) break;
      buf.resize(rc);
    }
    std::vector<std::string> names;
    std::string s(buf.data()), cur;
    for (char c : s) {
      if (c == '\n') { names.push_back(cur); cur.clear(); } else cur += c;
    }
    return names;
  });
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
  m.attr("CUDA_ABI_VERSION") = SHOAL_CUDA_ABI_VERSION;  // of the plugin table (shoal/_gpu.py)
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
