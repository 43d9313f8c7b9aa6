// neighbor_allreduce, allreduce and broadcast (numpy arrays, torch tensors) as C functions.
// A small op's Python layers (dispatch, weight resolution, argument conversion) cost as
// much CPU as its exchange, and on shared cores CPU is latency; so the common case (a C-contiguous
// array, plain arguments, weights seen before) runs without them. Anything else calls the
// Python implementation given at creation, which converts, resolves or raises exactly as
// before.
#include <cstring>
#include <memory>
#include <unordered_map>
#include <utility>

#include "module.h"
#include "native.h"
#include "shoal/torch_tensors.h"

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

// Attribute names, interned once (never freed: the module lives as long as the process).
#define SHOAL_NAME(n) ([] { static PyObject* const s = PyUnicode_InternFromString(n); return s; }())

PyObject* Attr(PyObject* x, PyObject* name) {  // new reference, or null with the error cleared
  PyObject* v = PyObject_GetAttr(x, name);
  if (!v) PyErr_Clear();
  return v;
}

bool IsTrue(PyObject* v) {  // steals v
  const bool t = v == Py_True;
  Py_XDECREF(v);
  return t;
}

bool IsFalse(PyObject* v) {  // steals v
  const bool f = v == Py_False;
  Py_XDECREF(v);
  return f;
}

PyObject* CallMethod(PyObject* x, PyObject* name) {  // new reference, or null with the error cleared
  PyObject* v = PyObject_CallMethodNoArgs(x, name);
  if (!v) PyErr_Clear();
  return v;
}

// `x` as an Input if the one-call path can take it: a torch.Tensor or Parameter (not
// another subclass) on the CPU, dense, contiguous, without a lazy negation or conjugation
// (its memory would hold other values), that autograd need not record (no requires_grad,
// or grad mode off), of a dtype the core has (floating only unless `any`).
bool TorchInput(const TorchApi& t, PyObject* x, bool any, Input* in) {
  PyObject* tp = reinterpret_cast<PyObject*>(Py_TYPE(x));
  if (tp != t.tensor.ptr() && tp != t.parameter.ptr()) return false;
  if (t.direct) {
    int32_t ndim = 0;
    int64_t shape[kMaxDims];
    if (!t.direct->read(x, &in->dtype, &in->data, &ndim, shape, kMaxDims)) return false;
    in->shape.assign(shape, shape + ndim);
    return any || IsFloat(in->dtype);
  }
  PyObject* dt = Attr(x, SHOAL_NAME("dtype"));
  PyObject* entry = dt ? PyDict_GetItem(t.dtypes.ptr(), dt) : nullptr;  // borrowed
  Py_XDECREF(dt);
  if (!entry || !PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 2) return false;
  in->dtype = static_cast<int>(PyLong_AsLong(PyTuple_GET_ITEM(entry, 0)));
  in->numpy_dtype = PyTuple_GET_ITEM(entry, 1);
  if (!any && !IsFloat(in->dtype)) return false;
  if (!IsTrue(Attr(x, SHOAL_NAME("is_cpu")))) return false;
  PyObject* layout = Attr(x, SHOAL_NAME("layout"));
  Py_XDECREF(layout);
  if (layout != t.strided.ptr()) return false;
  if (IsTrue(Attr(x, SHOAL_NAME("requires_grad"))) && IsTrue(PyObject_CallNoArgs(t.is_grad_enabled.ptr()))) return false;
  if (!IsTrue(CallMethod(x, SHOAL_NAME("is_contiguous")))) return false;
  // (No is_conj(): only complex tensors carry a conjugation bit, and the core has no complex dtype.)
  if (!IsFalse(CallMethod(x, SHOAL_NAME("is_neg")))) return false;
  PyObject* ptr = CallMethod(x, SHOAL_NAME("data_ptr"));
  if (!ptr) return false;
  in->data = PyLong_AsVoidPtr(ptr);
  Py_DECREF(ptr);
  PyObject* shape = Attr(x, SHOAL_NAME("shape"));
  if (!shape || !PyTuple_Check(shape)) {
    Py_XDECREF(shape);
    return false;
  }
  in->shape.resize(PyTuple_GET_SIZE(shape));
  for (size_t i = 0; i < in->shape.size(); ++i) in->shape[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i));
  Py_DECREF(shape);
  return !PyErr_Occurred();
}

// A new output like `x` and its address: an array; for torch a tensor over a new array's
// memory (torch.from_numpy costs less than torch.empty_like), or from empty_like (bfloat16).
py::object NewOutput(const Native& st, PyObject* x, const Input& in, void** data) {
  const std::vector<py::ssize_t> shape(in.shape.begin(), in.shape.end());
  if (!st.torch) {
    py::array out(py::reinterpret_borrow<py::dtype>(py::detail::array_proxy(x)->descr), shape);
    *data = out.mutable_data();
    return std::move(out);
  }
  if (st.torch->direct) {
    auto out = py::reinterpret_steal<py::object>(static_cast<PyObject*>(
        st.torch->direct->empty(in.dtype, static_cast<int32_t>(in.shape.size()), in.shape.data(), data)));
    if (!out) throw py::error_already_set();
    return out;
  }
  if (in.numpy_dtype && in.numpy_dtype != Py_None) {
    py::array arr(py::reinterpret_borrow<py::dtype>(in.numpy_dtype), shape);
    *data = arr.mutable_data();
    return st.torch->from_numpy(arr);
  }
  py::object out = st.torch->empty_like(py::handle(x));
  *data = reinterpret_cast<void*>(out.attr("data_ptr")().cast<uintptr_t>());
  return out;
}

PyObject* ReturnSelf(PyObject* self, PyObject*) {
  Py_INCREF(self);
  return self;
}
// A nonblocking op's finish(): a C function bound to its output, returning it.
PyMethodDef kResultDef{"result", ReturnSelf, METH_NOARGS, nullptr};

}  // namespace

bool IsFloat(int dtype) {
  return dtype == SHOAL_FLOAT16 || dtype == SHOAL_BFLOAT16 || dtype == SHOAL_FLOAT32 || dtype == SHOAL_FLOAT64;
}

// `x` as an Input (numpy arrays: see PlainDtype; torch tensors: TorchInput), else false.
bool PlainInput(const Native& st, PyObject* x, bool any, Input* in) {
  if (st.torch) return TorchInput(*st.torch, x, any, in);
  in->dtype = PlainDtype(x, any);
  if (in->dtype < 0) return false;
  const auto* arr = py::detail::array_proxy(x);
  if (st.inplace && !(arr->flags & py::detail::npy_api::NPY_ARRAY_WRITEABLE_)) return false;
  in->data = arr->data;
  in->shape.assign(arr->dimensions, arr->dimensions + arr->nd);
  return true;
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

// The description of op `op` from `in` into a new output like `x`, or into `x` itself
// for an in-place op (returned).
py::object Describe(const Native& st, PyObject* x, const Input& in, int op, const char* name, shoal_op_desc* d) {
  void* out_data = in.data;
  py::object out = st.inplace ? py::reinterpret_borrow<py::object>(x) : NewOutput(st, x, in, &out_data);
  *d = shoal_op_desc{};
  d->op = op;
  d->name = name;
  d->input.data = in.data;
  d->input.dtype = in.dtype;
  d->input.ndim = static_cast<int32_t>(in.shape.size());
  d->input.shape = in.shape.data();
  d->output = d->input;
  d->output.data = out_data;
  return out;
}

// Enqueues `d` reading `x` into `out`. Blocking: waits and returns `out`. Nonblocking:
// the handle, with (keep, finish) attached as shoal._ops._submit attaches them.
PyObject* Finish(const Native& st, const shoal_op_desc& d, PyObject* x, py::object out) {
  py::tuple keep = py::make_tuple(py::handle(x), out);
  if (!st.nonblocking) {
    Submit(d, true, keep, py::none());
    return out.release().ptr();
  }
  auto finish = py::reinterpret_steal<py::object>(PyCFunction_New(&kResultDef, out.ptr()));
  if (!finish) throw py::error_already_set();
  return PyLong_FromLongLong(Submit(d, false, keep, finish));
}

// A built-in function `name` of module `module` calling `call` with a Native state.
py::object MakeNative(const std::string& name, PyCFunction call, Native* state, const std::string& doc,
                      const std::string& module) {
  // The function's state is a module object (so it prints as a built-in function) whose
  // C state is the Native. Both live as long as the process: they may hold Python objects
  // at interpreter exit, so they are never destroyed.
  auto* def = new PyMethodDef{strdup(name.c_str()), call, METH_FASTCALL | METH_KEYWORDS, strdup(doc.c_str())};
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

// The state of a native function (see Native); `torch`: None (numpy arrays) or, for torch
// tensors, an object with the attributes of TorchApi (bindings/torch/_adapter.py: TORCH_API).
Native* NewNative(py::object fallback, py::object ops, py::object torch, bool nonblocking, bool inplace) {
  auto* st = new Native{std::move(fallback), std::move(ops), nullptr, nonblocking, inplace};
  if (!torch.is_none()) {
    st->torch.reset(new TorchApi{torch.attr("tensor"), torch.attr("parameter"), torch.attr("dtypes"),
                                 torch.attr("strided"), torch.attr("empty_like"), torch.attr("is_grad_enabled"),
                                 torch.attr("from_numpy"), torch.attr("compiled")});
    if (!st->torch->compiled.is_none())
      st->torch->direct = static_cast<const shoal_torch_tensors*>(
          PyCapsule_GetPointer(st->torch->compiled.ptr(), SHOAL_TORCH_TENSORS));
    if (PyErr_Occurred()) throw py::error_already_set();
  }
  return st;
}

namespace {

// neighbor_allreduce of `x` (read as `in`) into a new output.
PyObject* Run(const Native& st, PyObject* x, const Input& in, const char* name, const NeighborArgs& a) {
  shoal_op_desc d;
  py::object out = Describe(st, x, in, SHOAL_OP_NEIGHBOR_ALLREDUCE, name, &d);
  SetPeers(&d, a);
  return Finish(st, d, x, std::move(out));
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
    Input in;
    const char* name = simple && given[0] && PlainInput(*st, a[0], false, &in) ? PlainName(a[5]) : nullptr;
    if (!name) return PyObject_Vectorcall(st->fallback.ptr(), args, nargs, kwnames);
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
    return Run(*st, a[0], in, name, *resolved);
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
    Input in;
    const char* name = simple && given[0] && PlainInput(*st, a[0], true, &in) ? PlainName(a[3]) : nullptr;
    PyObject *average = a[1], *local = a[2], *op = a[4];
    int rop = -1;
    if (op == Py_None) {
      rop = average == Py_False ? SHOAL_REDUCE_SUM : SHOAL_REDUCE_AVERAGE;
    } else if (PyObject* code = name ? PyDict_GetItemWithError(st->ops.ptr(), op) : nullptr) {  // borrowed
      rop = static_cast<int>(PyLong_AsLong(code));
    } else if (PyErr_Occurred()) {
      PyErr_Clear();  // an unhashable op: Python reports it
    }
    // average= goes with Sum and Average only (the fallback raises for the others).
    const bool average_ok = average == Py_None || op == Py_None ||
                            ((rop == SHOAL_REDUCE_SUM || rop == SHOAL_REDUCE_AVERAGE) &&
                             (average == Py_True) == (rop == SHOAL_REDUCE_AVERAGE));
    // An integer average goes to the fallback: an error for Shoal's names, Horovod's
    // truncated average for its surface (bindings/torch/_horovod.py).
    const bool plain = name && rop >= 0 && (rop != SHOAL_REDUCE_AVERAGE || IsFloat(in.dtype)) &&
                       (average == Py_None || average == Py_True || average == Py_False) &&
                       (local == Py_True || local == Py_False) && average_ok;
    if (!plain) return PyObject_Vectorcall(st->fallback.ptr(), args, nargs, kwnames);
    shoal_op_desc d;
    py::object out = Describe(*st, a[0], in, SHOAL_OP_ALLREDUCE, name, &d);
    d.reduce_op = rop;
    d.scope = local == Py_True ? SHOAL_SCOPE_MACHINE : SHOAL_SCOPE_WORLD;
    return Finish(*st, d, a[0], std::move(out));
  });
}

// broadcast(tensor, root_rank, name=None), vectorcall convention (and its in-place and
// nonblocking forms): an exact int root in [0, size()) takes the one-call path; any other
// root (bool, numpy integer, out of range) is the fallback's to convert or refuse.
PyObject* CallBroadcast(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  static const char* const kParams[] = {"tensor", "root_rank", "name"};
  constexpr Py_ssize_t kN = 3;
  auto* st = *static_cast<Native**>(PyModule_GetState(self));
  PyObject* a[kN] = {nullptr, nullptr, Py_None};
  bool given[kN] = {};
  const bool simple = Parse(args, nargs, kwnames, kParams, kN, a, given);
  return Guard([&]() -> PyObject* {
    Input in;
    const char* name = simple && given[0] && given[1] && PyLong_CheckExact(a[1]) && PlainInput(*st, a[0], true, &in)
                           ? PlainName(a[2]) : nullptr;
    int overflow = 0;
    const long long root = name ? PyLong_AsLongLongAndOverflow(a[1], &overflow) : -1;
    if (!name || overflow || root < 0 || root >= shoal_size())
      return PyObject_Vectorcall(st->fallback.ptr(), args, nargs, kwnames);
    shoal_op_desc d;
    py::object out = Describe(*st, a[0], in, SHOAL_OP_BROADCAST, name, &d);
    d.root_rank = static_cast<int32_t>(root);
    d.scope = SHOAL_SCOPE_WORLD;
    return Finish(*st, d, a[0], std::move(out));
  });
}

// synchronize(handle), vectorcall convention: shoal._ops.synchronize for a registered
// handle whose op completes without error; anything else (an unknown handle, a failed op,
// Ctrl-C) is the fallback's, which reports it and cleans up exactly as before.
PyObject* CallSynchronize(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  auto* st = *static_cast<Native**>(PyModule_GetState(self));
  auto fallback = [&] { return PyObject_Vectorcall(st->fallback.ptr(), args, nargs, kwnames); };
  if (nargs != 1 || kwnames || !PyLong_CheckExact(args[0])) return fallback();
  return Guard([&]() -> PyObject* {
    int overflow = 0;
    const int64_t h = PyLong_AsLongLongAndOverflow(args[0], &overflow);
    if (overflow) return fallback();
    if (!shoal_attached(h)) return fallback();  // unknown, or already synchronized: its ValueError
    char err[kErrLen];
    int rc;
    do {
      {
        py::gil_scoped_release nogil;
        rc = shoal_wait_for(h, 200, err, kErrLen);
      }
      if (rc == SHOAL_TIMEOUT && PyErr_CheckSignals() != 0) {
        if (shoal_poll(h) != 1) throw py::error_already_set();  // the op runs on: handle stays valid
        // Done meanwhile: the fallback cleans up, then the interruption is raised.
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        Py_XDECREF(fallback());
        PyErr_Restore(type, value, tb);
        return nullptr;
      }
    } while (rc == SHOAL_TIMEOUT);
    if (rc != SHOAL_OK) return fallback();
    // Taken (detached), so that of threads synchronizing it one finishes it: another may
    // have done so while this one waited without the GIL (then the fallback's ValueError).
    auto* entry = static_cast<PyObject*>(shoal_detach(h));
    if (!entry) return fallback();
    auto held = py::reinterpret_steal<py::object>(entry);
    PyObject* result = PyObject_CallNoArgs(PyTuple_GET_ITEM(held.ptr(), 1));
    shoal_release(h);
    return result;
  });
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
  // `torch`: None (numpy arrays) or, for torch tensors, an object with the attributes of
  // TorchApi (bindings/torch/_adapter.py: TORCH_API).
  // `nonblocking`: the form that returns the handle (else it waits and returns the result).
  auto state = [](py::object fallback, py::object ops, py::object torch, bool nonblocking = false,
                  bool inplace = false) {
    return NewNative(std::move(fallback), std::move(ops), std::move(torch), nonblocking, inplace);
  };
  auto fn = [](auto call) { return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(call)); };
  auto name = [](const py::object& fallback) { return fallback.attr("__name__").cast<std::string>(); };
  m.def("native_neighbor_allreduce", [=](py::object fallback, const std::string& doc, const std::string& module,
                                         py::object torch, bool nonblocking) {
    return MakeNative(name(fallback), fn(Call), state(fallback, py::dict(), std::move(torch), nonblocking), doc, module);
  }, py::arg("fallback"), py::arg("doc"), py::arg("module"), py::arg("torch") = py::none(),
     py::arg("nonblocking") = false);
  // `ops`: {ReduceOp object: core code} of the op= values the one-call path takes.
  m.def("native_allreduce", [=](py::object fallback, const std::string& doc, const std::string& module,
                                py::dict ops, py::object torch, bool nonblocking, bool inplace) {
    return MakeNative(name(fallback), fn(CallAllreduce), state(fallback, std::move(ops), std::move(torch), nonblocking,
                                                               inplace), doc, module);
  }, py::arg("fallback"), py::arg("doc"), py::arg("module"), py::arg("ops"),
     py::arg("torch") = py::none(), py::arg("nonblocking") = false, py::arg("inplace") = false);
  m.def("native_broadcast", [=](py::object fallback, const std::string& doc, const std::string& module,
                                py::object torch, bool nonblocking, bool inplace) {
    return MakeNative(name(fallback), fn(CallBroadcast), state(fallback, py::dict(), std::move(torch), nonblocking,
                                                               inplace), doc, module);
  }, py::arg("fallback"), py::arg("doc"), py::arg("module"), py::arg("torch") = py::none(),
     py::arg("nonblocking") = false, py::arg("inplace") = false);
  m.def("native_synchronize", [=](py::object fallback, const std::string& doc, const std::string& module) {
    return MakeNative(name(fallback), fn(CallSynchronize), state(fallback, py::dict(), py::none()), doc, module);
  }, py::arg("fallback"), py::arg("doc"), py::arg("module"));
}

}  // namespace shoal_py
