// The CPU kernels of the registered torch ops shoal::allreduce, shoal::broadcast and
// shoal::neighbor_allreduce (bindings/torch/_ops.py), which torch.compile's graphs call: the
// dispatcher hands them the schema's arguments, already checked and resolved when the
// graph was traced, so a plain tensor goes to the core in one call as the eager entry
// points' do (native_entry.cc). Anything else (another tensor type, an argument out of
// range) calls the Python kernel given at creation, which converts, computes
// or raises exactly as before (docs/design.md §2).
#include <climits>
#include <utility>

#include "native.h"

namespace shoal_py {
namespace {

PyObject* Fallback(const Native& st, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  return PyObject_Vectorcall(st.fallback.ptr(), args, nargs, kwnames);
}

// `v` as an int in [lo, hi] if it is an exact int there.
bool IntIn(PyObject* v, long long lo, long long hi, long long* out) {
  if (!PyLong_CheckExact(v)) return false;
  int overflow = 0;
  *out = PyLong_AsLongLongAndOverflow(v, &overflow);
  if (overflow || *out < lo || *out > hi) return false;
  return true;
}

bool IsBool(PyObject* v) { return v == Py_True || v == Py_False; }

// A list of exact ints in int32's range (Ranks) or of exact floats (Weights) into `out`.
bool Ranks(PyObject* list, std::vector<int32_t>* out) {
  if (!PyList_CheckExact(list)) return false;
  const Py_ssize_t n = PyList_GET_SIZE(list);
  out->resize(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    long long r = 0;
    if (!IntIn(PyList_GET_ITEM(list, i), INT32_MIN, INT32_MAX, &r)) return false;
    (*out)[i] = static_cast<int32_t>(r);
  }
  return true;
}

bool Weights(PyObject* list, std::vector<double>* out) {
  if (!PyList_CheckExact(list)) return false;
  const Py_ssize_t n = PyList_GET_SIZE(list);
  out->resize(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* w = PyList_GET_ITEM(list, i);
    if (!PyFloat_CheckExact(w)) return false;
    (*out)[i] = PyFloat_AS_DOUBLE(w);
  }
  return true;
}

PyObject* Zero() {
  static PyObject* const zero = PyLong_FromLong(0);
  return zero;
}

PyObject* One() {
  static PyObject* const one = PyFloat_FromDouble(1.0);
  return one;
}

// Horovod's scaling of `d` (as shoal._horovod.scaling asks for it in the Python kernels):
// the factors (exact floats), and for integer tensors always (Horovod's truncation).
void Scaling(PyObject* pre, PyObject* post, shoal_op_desc* d) {
  d->prescale_factor = PyFloat_AS_DOUBLE(pre);
  d->postscale_factor = PyFloat_AS_DOUBLE(post);
  d->horovod_scaling = d->prescale_factor != 1.0 || d->postscale_factor != 1.0 || !IsFloat(d->input.dtype);
}

// shoal::allreduce(Tensor tensor, int reduce_op, bool local, str name, int process_set=0,
// float prescale=1.0, float postscale=1.0).
PyObject* KernelAllreduce(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  static const char* const kParams[] = {"tensor", "reduce_op", "local", "name", "process_set", "prescale", "postscale"};
  constexpr Py_ssize_t kN = 7;
  auto* st = *static_cast<Native**>(PyModule_GetState(self));
  PyObject* a[kN] = {nullptr, nullptr, nullptr, nullptr, Zero(), One(), One()};
  bool given[kN] = {};
  const bool simple = Parse(args, nargs, kwnames, kParams, kN, a, given) && given[0] && given[1] && given[2] &&
                      given[3];
  return Guard([&]() -> PyObject* {
    Input in;
    long long rop = -1, pset = -1;
    const char* name = simple && IsBool(a[2]) && IntIn(a[1], 0, INT_MAX, &rop) && IntIn(a[4], 0, INT32_MAX, &pset) &&
                       PlainInput(*st, a[0], true, &in) ? PlainName(a[3]) : nullptr;
    bool known = false;  // one of the codes of shoal._ops.REDUCE_OP_CODES
    Py_ssize_t pos = 0;
    PyObject *op, *code;
    while (name && !known && PyDict_Next(st->ops.ptr(), &pos, &op, &code))
      known = PyLong_CheckExact(code) && PyLong_AsLongLong(code) == rop;
    if (!known || !PyFloat_CheckExact(a[5]) || !PyFloat_CheckExact(a[6])) return Fallback(*st, args, nargs, kwnames);
    shoal_op_desc d;
    py::object out = Describe(*st, a[0], in, SHOAL_OP_ALLREDUCE, name, &d);
    d.reduce_op = static_cast<int>(rop);
    d.scope = a[2] == Py_True ? SHOAL_SCOPE_MACHINE : SHOAL_SCOPE_WORLD;
    d.process_set = static_cast<int32_t>(pset);
    Scaling(a[5], a[6], &d);
    return Finish(*st, d, a[0], std::move(out));
  });
}

// shoal::broadcast(Tensor tensor, int root_rank, str name, int process_set=0).
PyObject* KernelBroadcast(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  static const char* const kParams[] = {"tensor", "root_rank", "name", "process_set"};
  constexpr Py_ssize_t kN = 4;
  auto* st = *static_cast<Native**>(PyModule_GetState(self));
  PyObject* a[kN] = {nullptr, nullptr, nullptr, Zero()};
  bool given[kN] = {};
  const bool simple = Parse(args, nargs, kwnames, kParams, kN, a, given) && given[0] && given[1] && given[2];
  return Guard([&]() -> PyObject* {
    Input in;
    long long root = -1, pset = -1;
    const char* name = simple && IntIn(a[1], 0, shoal_size() - 1, &root) && IntIn(a[3], 0, INT32_MAX, &pset) &&
                       PlainInput(*st, a[0], true, &in) ? PlainName(a[2]) : nullptr;
    if (!name) return Fallback(*st, args, nargs, kwnames);
    shoal_op_desc d;
    py::object out = Describe(*st, a[0], in, SHOAL_OP_BROADCAST, name, &d);
    d.root_rank = static_cast<int32_t>(root);
    d.scope = SHOAL_SCOPE_WORLD;
    d.process_set = static_cast<int32_t>(pset);
    return Finish(*st, d, a[0], std::move(out));
  });
}

// shoal::neighbor_allreduce(Tensor tensor, float self_weight, int[] recv_ranks,
// float[] recv_weights, int[] send_ranks, float[] send_weights, bool uniform,
// bool topo_check, str name): the lists as shoal._ops.neighbor_args resolved them.
PyObject* KernelNeighborAllreduce(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  static const char* const kParams[] = {"tensor", "self_weight", "recv_ranks", "recv_weights", "send_ranks",
                                        "send_weights", "uniform", "topo_check", "name"};
  constexpr Py_ssize_t kN = 9;
  auto* st = *static_cast<Native**>(PyModule_GetState(self));
  PyObject* a[kN] = {};
  bool given[kN] = {};
  bool simple = Parse(args, nargs, kwnames, kParams, kN, a, given);
  for (Py_ssize_t i = 0; i < kN; ++i) simple = simple && given[i];
  return Guard([&]() -> PyObject* {
    Input in;
    NeighborArgs peers;
    const char* name = simple && PyFloat_CheckExact(a[1]) && IsBool(a[6]) && IsBool(a[7]) &&
                       Ranks(a[2], &peers.recv_ranks) && Weights(a[3], &peers.recv_weights) &&
                       Ranks(a[4], &peers.send_ranks) && Weights(a[5], &peers.send_weights) &&
                       PlainInput(*st, a[0], false, &in) ? PlainName(a[8]) : nullptr;
    if (!name) return Fallback(*st, args, nargs, kwnames);
    peers.self_weight = PyFloat_AS_DOUBLE(a[1]);
    peers.uniform = a[6] == Py_True;
    peers.topo_check = a[7] == Py_True;
    shoal_op_desc d;
    py::object out = Describe(*st, a[0], in, SHOAL_OP_NEIGHBOR_ALLREDUCE, name, &d);
    SetPeers(&d, peers);
    return Finish(*st, d, a[0], std::move(out));
  });
}

PyCFunction Fn(PyObject* (*call)(PyObject*, PyObject* const*, Py_ssize_t, PyObject*)) {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(call));
}

}  // namespace

void DefineRegisteredKernels(py::module_& m) {
  // `fallback`: the Python kernel (its __name__ names the C function); `torch`: as for
  // native_allreduce (bindings/torch/_adapter.py: TORCH_API); `ops`: {ReduceOp: core code}.
  auto make = [](PyObject* (*call)(PyObject*, PyObject* const*, Py_ssize_t, PyObject*)) {
    return [call](py::object fallback, const std::string& doc, const std::string& module, py::object torch,
                  py::dict ops) {
      auto name = fallback.attr("__name__").cast<std::string>();
      return MakeNative(name, Fn(call), NewNative(std::move(fallback), std::move(ops), std::move(torch), false, false),
                        doc, module);
    };
  };
  m.def("native_kernel_allreduce", make(KernelAllreduce), py::arg("fallback"), py::arg("doc"), py::arg("module"),
        py::arg("torch"), py::arg("ops"));
  m.def("native_kernel_broadcast", make(KernelBroadcast), py::arg("fallback"), py::arg("doc"), py::arg("module"),
        py::arg("torch"), py::arg("ops") = py::dict());
  m.def("native_kernel_neighbor_allreduce", make(KernelNeighborAllreduce), py::arg("fallback"), py::arg("doc"),
        py::arg("module"), py::arg("torch"), py::arg("ops") = py::dict());
}

}  // namespace shoal_py
