// shoal.neighbor_allreduce and shoal.allreduce for numpy arrays as C functions. A small
// op's Python layers (dispatch, weight resolution, argument conversion) cost as much CPU as
// its exchange, and on shared cores CPU is latency; so the common case (a C-contiguous
// array, plain arguments, weights seen before) runs without them. Anything else calls the
// Python implementation given at creation, which converts, resolves or raises exactly as
// before.
#include <cstring>
#include <unordered_map>
#include <utility>

#include "module.h"

namespace shoal_py {
namespace {

// The one cache of resolved neighbor_allreduce arguments (shoal._ops.neighbor_args and
// the native path both use it): the resolver's result by key, for arguments made only of
// plain ints and floats (a one-peer schedule repeats log2(n) sets). Never destroyed: it
// holds Python objects at interpreter exit.
struct Remembered {
  py::object resolve;  // shoal._ops._remembered(self_weight, src, dst, check, kept) -> dict
  std::unordered_map<std::string, std::pair<py::object, const NeighborArgs*>> by_key;
};
auto* g_remembered = new Remembered();
constexpr size_t kMaxResolved = 1024;

// The state of one native function: its Python fallback, and for allreduce the Sum and
// Average objects of `op=`.
struct Native {
  py::object fallback, sum, average;
};

// The core's dtype code of `x` if the one-call path can take it (an ndarray, not a
// subclass: the general path returns the input's type; C-contiguous, aligned, native byte
// order; float16/32/64, and with `any` also the integer types and bool), else -1.
int PlainDtype(PyObject* x, bool any = false) {
  if (Py_TYPE(x) != py::detail::npy_api::get().PyArray_Type_) return -1;
  const auto* a = py::detail::array_proxy(x);
  constexpr int kNeed = py::detail::npy_api::NPY_ARRAY_C_CONTIGUOUS_ | py::detail::npy_api::NPY_ARRAY_ALIGNED_;
  if ((a->flags & kNeed) != kNeed) return -1;
  const auto* d = py::detail::array_descriptor_proxy(a->descr);
  if (d->byteorder != '=' && d->byteorder != '|') return -1;  // numpy spells native '='
  switch (d->type) {
    case 'e': return SHOAL_FLOAT16;
    case 'f': return SHOAL_FLOAT32;
    case 'd': return SHOAL_FLOAT64;
  }
  if (!any) return -1;
  switch (d->type) {
    case 'b': return SHOAL_INT8;
    case 'B': return SHOAL_UINT8;
    case 'h': return SHOAL_INT16;
    case '?': return SHOAL_BOOL;
    case 'i': return SHOAL_INT32;  // C int, long, long long (numpy's type characters)
    case 'l': return sizeof(long) == 8 ? SHOAL_INT64 : SHOAL_INT32;
    case 'q': return SHOAL_INT64;
    default: return -1;
  }
}

// The arguments of a vectorcall by parameter position (defaults where not given); false
// for more arguments than parameters, an unknown keyword or one given twice.
bool Parse(PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames, const char* const* params,
           Py_ssize_t n, PyObject** a, bool* given) {
  if (nargs > n) return false;
  for (Py_ssize_t i = 0; i < nargs; ++i) a[i] = args[i], given[i] = true;
  const Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  for (Py_ssize_t k = 0; k < nkw; ++k) {
    PyObject* kw = PyTuple_GET_ITEM(kwnames, k);
    Py_ssize_t i = 0;
    while (i < n && PyUnicode_CompareWithASCIIString(kw, params[i]) != 0) ++i;
    if (i == n || given[i]) return false;
    a[i] = args[nargs + k], given[i] = true;
  }
  return true;
}

// The UTF-8 of a plain `name` argument ("" for None), or null (then Python decides).
const char* PlainName(PyObject* name) {
  if (name == Py_None) return "";
  if (!PyUnicode_CheckExact(name)) return nullptr;
  Py_ssize_t len = 0;
  const char* s = PyUnicode_AsUTF8AndSize(name, &len);
  if (!s) PyErr_Clear();  // e.g. a lone surrogate: Python reports it
  else if (std::strlen(s) != static_cast<size_t>(len)) s = nullptr;  // a NUL
  return s;
}

// A new array like `x`, and the op's description with `x` as input and it as output.
py::array Describe(PyObject* x, int dtype, int op, const char* name, std::vector<int64_t>* shape, shoal_op_desc* d) {
  const auto* arr = py::detail::array_proxy(x);
  shape->assign(arr->dimensions, arr->dimensions + arr->nd);
  py::array out(py::reinterpret_borrow<py::dtype>(arr->descr), std::vector<py::ssize_t>(shape->begin(), shape->end()));
  *d = shoal_op_desc{};
  d->op = op;
  d->name = name;
  d->input.data = arr->data;
  d->input.dtype = dtype;
  d->input.ndim = static_cast<int32_t>(shape->size());
  d->input.shape = shape->data();
  d->output = d->input;
  d->output.data = out.mutable_data();
  return out;
}

// Runs a native entry's body, turning C++ exceptions into Python ones.
template <typename F> PyObject* Guard(F&& body) {
  try {
    return body();
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const py::builtin_exception& e) {
    e.set_error();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

// Blocking neighbor_allreduce of `x` (PlainDtype(x) == dtype) into a new array.
py::object Run(PyObject* x, int dtype, const char* name, const NeighborArgs& a) {
  std::vector<int64_t> shape;
  shoal_op_desc d;
  py::array out = Describe(x, dtype, SHOAL_OP_NEIGHBOR_ALLREDUCE, name, &shape, &d);
  SetPeers(&d, a);
  Submit(d, true, py::make_tuple(py::handle(x), out));
  return out;
}

template <typename T> void Put(std::string* key, T v) { key->append(reinterpret_cast<const char*>(&v), sizeof v); }

bool PutRank(std::string* key, PyObject* r) {
  if (!PyLong_CheckExact(r)) return false;
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(r, &overflow);
  if (overflow) return false;
  Put(key, v);
  return true;
}

bool PutWeight(std::string* key, PyObject* w) {
  if (!PyFloat_CheckExact(w)) return false;
  Put(key, PyFloat_AS_DOUBLE(w));
  return true;
}

bool PutWeights(std::string* key, PyObject* dict) {
  Put(key, PyDict_GET_SIZE(dict));
  Py_ssize_t pos = 0;
  PyObject *r, *w;
  while (PyDict_Next(dict, &pos, &r, &w))
    if (!PutRank(key, r) || !PutWeight(key, w)) return false;
  return true;
}

// A key for dynamic-mode arguments made only of exact ints (ranks), floats (weights) and
// a bool, else false: other types go through the resolver every call, as in Python.
bool DynamicKey(PyObject* self_weight, PyObject* src, PyObject* dst, PyObject* check, std::string* key) {
  if (dst == Py_None || !PyFloat_CheckExact(self_weight) || !PyDict_CheckExact(src)) return false;
  if (check != Py_True && check != Py_False) return false;
  Put(key, PyFloat_AS_DOUBLE(self_weight));
  Put(key, check == Py_True);
  if (!PutWeights(key, src)) return false;
  if (PyDict_CheckExact(dst)) {
    Put(key, 'd');
    return PutWeights(key, dst);
  }
  if (!PyList_CheckExact(dst) && !PyTuple_CheckExact(dst)) return false;
  Put(key, 'l');
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(dst);
  Put(key, n);
  PyObject** items = PySequence_Fast_ITEMS(dst);
  for (Py_ssize_t i = 0; i < n; ++i)
    if (!PutRank(key, items[i])) return false;
  return true;
}

// The resolver's dict for (self_weight, src_weights, dst_weights, enable_topo_check) in
// `*dict`, remembered when the arguments are plain; returns its "native" NeighborArgs.
const NeighborArgs* Resolve(PyObject* const* w, py::object* dict) {
  auto& st = *g_remembered;
  if (!st.resolve) throw std::runtime_error("shoal._ops has not registered its neighbor_args resolver");
  std::string key;
  const bool plain = DynamicKey(w[0], w[1], w[2], w[3], &key);
  if (plain) {
    auto it = st.by_key.find(key);
    if (it != st.by_key.end()) {
      // Held for the call: another thread may clear the cache while this one, without
      // the GIL, enqueues from these lists.
      *dict = it->second.first;
      return it->second.second;
    }
  }
  *dict = st.resolve(py::handle(w[0]), py::handle(w[1]), py::handle(w[2]), py::handle(w[3]), plain);
  const auto* args = (*dict)["native"].cast<const NeighborArgs*>();
  if (plain) {
    if (st.by_key.size() >= kMaxResolved) st.by_key.clear();
    st.by_key.emplace(std::move(key), std::make_pair(*dict, args));
  }
  return args;
}

// neighbor_allreduce(tensor, self_weight=None, src_weights=None, dst_weights=None,
//                    enable_topo_check=True, name=None), vectorcall convention.
PyObject* Call(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  static const char* const kParams[] = {"tensor", "self_weight", "src_weights", "dst_weights",
                                        "enable_topo_check", "name"};
  constexpr Py_ssize_t kN = 6;
  auto* st = *static_cast<Native**>(PyModule_GetState(self));
  PyObject* a[kN] = {nullptr, Py_None, Py_None, Py_None, Py_True, Py_None};
  bool given[kN] = {};
  const bool simple = Parse(args, nargs, kwnames, kParams, kN, a, given);
  return Guard([&]() -> PyObject* {
    const int dtype = simple && given[0] ? PlainDtype(a[0]) : -1;
    const char* name = dtype >= 0 ? PlainName(a[5]) : nullptr;
    if (dtype < 0 || !name) return PyObject_Vectorcall(st->fallback.ptr(), args, nargs, kwnames);
    py::object keep;
    const NeighborArgs* resolved = nullptr;
    try {
      resolved = Resolve(a + 1, &keep);
    } catch (py::error_already_set& e) {
      // Bad arguments: the Python path raises the same error and tells the peers
      // (shoal_reject), which wait for this call.
      if (!e.matches(PyExc_ValueError) && !e.matches(PyExc_TypeError)) throw;
      return PyObject_Vectorcall(st->fallback.ptr(), args, nargs, kwnames);
    }
    return Run(a[0], dtype, name, *resolved).release().ptr();
  });
}

// allreduce(tensor, average=None, is_hierarchical_local=False, name=None, op=None),
// vectorcall convention: BlueFog's average= or Horovod's op= (shoal._ops.reduce_op).
PyObject* CallAllreduce(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  static const char* const kParams[] = {"tensor", "average", "is_hierarchical_local", "name", "op"};
  constexpr Py_ssize_t kN = 5;
  auto* st = *static_cast<Native**>(PyModule_GetState(self));
  PyObject* a[kN] = {nullptr, Py_None, Py_False, Py_None, Py_None};
  bool given[kN] = {};
  const bool simple = Parse(args, nargs, kwnames, kParams, kN, a, given);
  return Guard([&]() -> PyObject* {
    const int dtype = simple && given[0] ? PlainDtype(a[0], true) : -1;
    const char* name = dtype >= 0 ? PlainName(a[3]) : nullptr;
    PyObject *average = a[1], *local = a[2], *op = a[4];
    int rop = -1;
    if (op == Py_None) rop = average == Py_False ? SHOAL_REDUCE_SUM : SHOAL_REDUCE_AVERAGE;
    else if (op == st->sum.ptr()) rop = SHOAL_REDUCE_SUM;
    else if (op == st->average.ptr()) rop = SHOAL_REDUCE_AVERAGE;
    const bool plain = name && rop >= 0 && (average == Py_None || average == Py_True || average == Py_False) &&
                       (local == Py_True || local == Py_False) &&
                       (op == Py_None || average == Py_None || (average == Py_True) == (rop == SHOAL_REDUCE_AVERAGE));
    if (!plain) return PyObject_Vectorcall(st->fallback.ptr(), args, nargs, kwnames);
    std::vector<int64_t> shape;
    shoal_op_desc d;
    py::array out = Describe(a[0], dtype, SHOAL_OP_ALLREDUCE, name, &shape, &d);
    d.reduce_op = rop;
    d.scope = local == Py_True ? SHOAL_SCOPE_MACHINE : SHOAL_SCOPE_WORLD;
    Submit(d, true, py::make_tuple(py::handle(a[0]), out));
    return out.release().ptr();
  });
}

// A built-in function `name` of module `module` calling `call` with a Native state.
py::object MakeNative(const char* name, PyCFunction call, Native* state, const std::string& doc,
                      const std::string& module) {
  // The function's state is a module object (so it prints as a built-in function) whose
  // C state is the Native. Both live as long as the process: they may hold Python objects
  // at interpreter exit, so they are never destroyed.
  auto* def = new PyMethodDef{name, call, METH_FASTCALL | METH_KEYWORDS, strdup(doc.c_str())};
  auto* mdef = new PyModuleDef{PyModuleDef_HEAD_INIT, strdup(module.c_str()), nullptr, sizeof(Native *),
                               nullptr, nullptr, nullptr, nullptr, nullptr};
  auto self = py::reinterpret_steal<py::object>(PyModule_Create(mdef));
  if (!self) throw py::error_already_set();
  *static_cast<Native**>(PyModule_GetState(self.ptr())) = state;
  auto mod = py::str(module);
  PyObject* f = PyCFunction_NewEx(def, self.ptr(), mod.ptr());
  if (!f) throw py::error_already_set();
  self.release();  // kept forever with its state
  return py::reinterpret_steal<py::object>(f);
}

}  // namespace

void DefineNeighborNative(py::module_& m) {
  py::class_<NeighborArgs>(m, "NeighborArgs")
      .def(py::init<>())
      .def(py::init([](std::vector<int32_t> recv, std::vector<int32_t> send, std::vector<double> recv_w,
                       std::vector<double> send_w, double self_weight, bool uniform, bool topo_check) {
             return NeighborArgs{std::move(recv), std::move(send), std::move(recv_w), std::move(send_w),
                                 self_weight, uniform, topo_check};
           }),
           py::arg("recv_ranks"), py::arg("send_ranks"), py::arg("recv_weights"), py::arg("send_weights"),
           py::arg("self_weight"), py::arg("uniform"), py::arg("topo_check"))
      .def_readonly("recv_ranks", &NeighborArgs::recv_ranks)
      .def_readonly("send_ranks", &NeighborArgs::send_ranks)
      .def_readonly("recv_weights", &NeighborArgs::recv_weights)
      .def_readonly("send_weights", &NeighborArgs::send_weights)
      .def_readonly("self_weight", &NeighborArgs::self_weight)
      .def_readonly("uniform", &NeighborArgs::uniform)
      .def_readonly("topo_check", &NeighborArgs::topo_check);
  m.def("set_neighbor_resolver", [](py::object fn) { g_remembered->resolve = std::move(fn); });
  m.def("neighbor_args", [](py::object self_weight, py::object src, py::object dst, py::object check) {
    PyObject* w[4] = {self_weight.ptr(), src.ptr(), dst.ptr(), check.ptr()};
    py::object dict;
    Resolve(w, &dict);
    return dict;
  });
  m.def("forget_neighbor_args", [] { g_remembered->by_key.clear(); });
  m.def("native_neighbor_allreduce", [](py::object fallback, const std::string& doc, const std::string& module) {
    return MakeNative("neighbor_allreduce", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(Call)),
                      new Native{std::move(fallback), {}, {}}, doc, module);
  });
  m.def("native_allreduce", [](py::object fallback, const std::string& doc, const std::string& module,
                               py::object sum, py::object average) {
    return MakeNative("allreduce", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(CallAllreduce)),
                      new Native{std::move(fallback), std::move(sum), std::move(average)}, doc, module);
  });
}

}  // namespace shoal_py
