// The shoal_torch_tensors table (shoal/torch_tensors.h) over torch's C++ API. Reading a
// tensor's fields here costs tens of nanoseconds against about 1.5 us through its Python
// attributes; a new tensor costs about 1.1 us against 2.7 us for torch.from_numpy over a
// new array. Compiled against the installed torch on first import (shoal/_compiled.py);
// it only reads and makes tensors: every op stays in the core.
#include <Python.h>

#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/EmptyTensor.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/python_variable.h>

#include "shoal/c_api.h"
#include "shoal/torch_tensors.h"

namespace {

constexpr std::pair<c10::ScalarType, int32_t> kDtypes[] = {
    {c10::kHalf, SHOAL_FLOAT16}, {c10::kBFloat16, SHOAL_BFLOAT16}, {c10::kFloat, SHOAL_FLOAT32},
    {c10::kDouble, SHOAL_FLOAT64}, {c10::kChar, SHOAL_INT8},       {c10::kByte, SHOAL_UINT8},
    {c10::kShort, SHOAL_INT16},    {c10::kInt, SHOAL_INT32},       {c10::kLong, SHOAL_INT64},
    {c10::kBool, SHOAL_BOOL}};

// A CPU tensor whose memory is its data: strided, contiguous, no lazy negation or
// conjugation, not a functionalized or Python-dispatched one (which may have no memory).
bool Plain(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage() || !t.is_cpu() || t.layout() != c10::kStrided || !t.is_contiguous() ||
      t.is_neg() || t.is_conj())
    return false;
  const c10::DispatchKeySet keys = t.key_set();
  if (keys.has(c10::DispatchKey::Functionalize) || keys.has(c10::DispatchKey::Python)) return false;
  return t.numel() == 0 || t.data_ptr() != nullptr;
}

// No key on this thread that reroutes ops (functionalization, functorch's layers, ...).
bool PlainThread() {
  return (c10::impl::tls_local_dispatch_key_set().included_ - c10::default_included_set).empty();
}

int Read(void* tensor, int32_t* dtype, void** data, int32_t* ndim, int64_t* shape, int32_t max_dims) {
  try {  // anything unusual (a functorch wrapper without storage, say) is the Python path's
    const at::Tensor& t = THPVariable_Unpack(static_cast<PyObject*>(tensor));
    if (!Plain(t) || !PlainThread() || t.dim() > max_dims) return 0;
    if (t.requires_grad() && c10::GradMode::is_enabled()) return 0;
    *dtype = -1;
    for (const auto& [st, code] : kDtypes)
      if (st == t.scalar_type()) *dtype = code;
    if (*dtype < 0) return 0;
    *data = t.data_ptr();
    *ndim = static_cast<int32_t>(t.dim());
    for (int64_t i = 0; i < t.dim(); ++i) shape[i] = t.size(i);
    return 1;
  } catch (const std::exception&) {
    return 0;
  }
}

// Small outputs are kept and handed out again once nothing refers to them but this pool.
// A new tensor and its later release cost about 1.5 us of CPU, and on shared cores, where
// the call's first touches of torch's allocator come after a wait, as much latency as the
// exchange of a small tensor itself. A kept tensor is handed out again only when no
// reference of any kind is left (Python, weak, view, storage, autograd) and it is as it
// was made (class, memory, size, strides, no attributes, grad or autograd record;
// inference-ness as the caller's mode makes): no one can tell it is the same tensor,
// except that a dropped output lives on here (a weakref.finalize on it fires only when the
// pool lets it go). One that can never be handed out again is let go when nothing else
// holds it. Python code can run inside (a collection on an allocation, a finalizer on a
// release, another thread then): while the pool is in use, other calls make new tensors
// and leave it alone, and releases happen last.
constexpr size_t kKeptBytes = 16 << 10;  // per tensor: larger exchanges dwarf the allocation
constexpr size_t kKeptPerShape = 4, kKeptTotal = 256;  // at most 4 MiB held
struct Kept {
  PyObject* tensor;  // owned
  PyTypeObject* type;
  const c10::StorageImpl* storage;
  void* data;
  size_t nbytes;
};
struct Pool {
  std::unordered_map<std::string, std::vector<Kept>> by_shape;
  size_t total = 0;
  bool busy = false;
  PyObject* getweakrefcount = nullptr;
};
Pool* g_pool = new Pool();  // never destroyed: it holds Python objects at interpreter exit

std::string ShapeKey(int32_t dtype, int32_t ndim, const int64_t* shape) {
  std::string key(reinterpret_cast<const char*>(&dtype), sizeof dtype);
  key.append(reinterpret_cast<const char*>(shape), sizeof(int64_t) * ndim);
  return key;
}

enum class State { kFree, kSeen, kChanged };

bool AsMade(const Kept& k, const at::Tensor& t, c10::ScalarType st, c10::IntArrayRef sizes) {
  if (Py_TYPE(k.tensor) != k.type || !t.has_storage()) return false;
  const c10::Storage& s = t.storage();
  if (s.unsafeGetStorageImpl() != k.storage || t.data_ptr() != k.data || s.nbytes() != k.nbytes ||
      t.storage_offset() != 0 || t.scalar_type() != st || t.sizes() != sizes || !t.is_cpu() ||
      t.layout() != c10::kStrided || t.is_neg() || t.is_conj() || t.unsafeGetTensorImpl()->autograd_meta())
    return false;
  int64_t stride = 1;  // at::empty's strides, size-1 dimensions included
  for (int64_t d = t.dim() - 1; d >= 0; --d) {
    if (t.stride(d) != stride) return false;
    stride *= sizes[d];
  }
  return true;
}

// Whether kept tensor `k` (held by the pool alone in Python) can be an output of dtype `st`
// and shape `sizes` now (kFree), is still seen from elsewhere (kSeen), or never can be again.
State Check(const Kept& k, c10::ScalarType st, c10::IntArrayRef sizes) {
  try {
    const at::Tensor& t = THPVariable_Unpack(k.tensor);
    if (!AsMade(k, t, st, sizes)) return State::kChanged;
    if (t.use_count() != 1 || t.weak_use_count() != 1 || t.storage().use_count() != 1) return State::kSeen;
    if (t.is_inference() != c10::InferenceMode::is_enabled()) return State::kSeen;
  } catch (const std::exception&) {  // a data pointer it may not give, say
    return State::kChanged;
  }
  PyObject* dict = PyObject_GenericGetDict(k.tensor, nullptr);
  const bool bare = dict && PyDict_GET_SIZE(dict) == 0;
  Py_XDECREF(dict);
  PyErr_Clear();
  if (!bare) return State::kChanged;
  PyObject* weak = PyObject_CallOneArg(g_pool->getweakrefcount, k.tensor);
  const bool unseen = weak && PyLong_AsLong(weak) == 0;
  Py_XDECREF(weak);
  PyErr_Clear();
  // Python code may have run meanwhile (a collection, another thread): still ours alone?
  return !unseen ? State::kSeen : Py_REFCNT(k.tensor) == 1 ? State::kFree : State::kSeen;
}

PyObject* NewTensor(c10::ScalarType st, c10::IntArrayRef sizes, void** data) {
  try {
    // Not at::empty: the dispatcher's way there costs a third more.
    at::Tensor t = at::detail::empty_cpu(sizes, st);
    *data = t.data_ptr();
    return THPVariable_Wrap(std::move(t));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

// A kept tensor of the shape that is free, or a new one (kept if there is room). Runs with
// the pool marked busy; what it lets go is released at the end (finalizers may run then).
PyObject* FromPool(const std::string& key, c10::ScalarType st, c10::IntArrayRef sizes, void** data,
                   std::vector<PyObject*>* release) {
  auto it = g_pool->by_shape.find(key);
  std::vector<Kept>* kept = it == g_pool->by_shape.end() ? nullptr : &it->second;
  auto drop = [&](size_t i) {
    release->push_back((*kept)[i].tensor);
    (*kept)[i] = kept->back();
    kept->pop_back();
    --g_pool->total;
  };
  for (size_t i = 0; kept && i < kept->size();) {
    if (Py_REFCNT((*kept)[i].tensor) != 1) {
      ++i;
      continue;
    }
    const State state = Check((*kept)[i], st, sizes);
    if (state == State::kFree) {
      *data = (*kept)[i].data;
      Py_INCREF((*kept)[i].tensor);
      return (*kept)[i].tensor;
    }
    if (state == State::kChanged) drop(i);
    else ++i;
  }
  PyObject* out = NewTensor(st, sizes, data);
  if (!out) return nullptr;
  if (kept && kept->size() >= kKeptPerShape) {  // full: let go of one no Python code can reach
    for (size_t i = 0; i < kept->size(); ++i) {
      if (Py_REFCNT((*kept)[i].tensor) == 1) {
        drop(i);
        break;
      }
    }
  }
  if (g_pool->total < kKeptTotal && (!kept || kept->size() < kKeptPerShape)) {
    if (!kept) kept = &g_pool->by_shape[key];  // bounded: an entry only with a tensor in it
    const c10::Storage& s = THPVariable_Unpack(out).storage();
    Py_INCREF(out);
    kept->push_back({out, Py_TYPE(out), s.unsafeGetStorageImpl(), *data, s.nbytes()});
    ++g_pool->total;
  }
  return out;
}

void* Empty(int32_t dtype, int32_t ndim, const int64_t* shape, void** data) {
  for (const auto& [st, code] : kDtypes) {
    if (code != dtype) continue;
    const c10::IntArrayRef sizes(shape, ndim);
    if (g_pool->busy || c10::multiply_integers(sizes) * c10::elementSize(st) > kKeptBytes)
      return NewTensor(st, sizes, data);
    g_pool->busy = true;
    std::vector<PyObject*> release;
    PyObject* out = FromPool(ShapeKey(dtype, ndim, shape), st, sizes, data, &release);
    PyObject *type = nullptr, *value = nullptr, *tb = nullptr;
    if (!out) PyErr_Fetch(&type, &value, &tb);  // finalizers must not see or clear it
    for (PyObject* obj : release) Py_DECREF(obj);
    if (!out) PyErr_Restore(type, value, tb);
    g_pool->busy = false;
    return out;
  }
  PyErr_Format(PyExc_ValueError, "shoal.torch: no torch dtype for the core's dtype code %d", dtype);
  return nullptr;
}

const shoal_torch_tensors kTable{Read, Empty};

bool HasSizes(const at::Tensor& t, PyObject* shape) {
  if (!PyTuple_Check(shape) || PyTuple_GET_SIZE(shape) != t.dim()) return false;
  for (int64_t d = 0; d < t.dim(); ++d) {
    const long long size = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, d));
    if (size == -1 && PyErr_Occurred()) PyErr_Clear();
    if (size != t.size(d)) return false;
  }
  return true;
}

// flat_copy(flat, members, shapes, how) -> bool: one memcpy per member between a bucket's
// flat buffer and its members (bindings/torch/_buckets.py), where torch's copy_ costs about
// 1 us per tensor on the CPU: a third of what the optimizers add to a 160-tensor model's
// step. how 0 only checks, 1 copies the members into flat, 2 flat into the members (bumping
// their version counters, as copy_ does). Only if flat and every member are plain CPU
// Tensors or Parameters (contiguous, flat's dtype, the sizes in `shapes`, together flat's
// length), none is recorded by autograd, no member to be written is an inference tensor, and
// no torch function or dispatch mode or rerouting dispatch key is active; else nothing is copied and the result is
// False: the caller copies through torch, which raises what torch raises.
PyObject* FlatCopy(PyObject*, PyObject* args) {
  PyObject *flat_obj, *members, *shapes;
  int how;
  if (!PyArg_ParseTuple(args, "OO!O!i", &flat_obj, &PyList_Type, &members, &PyList_Type, &shapes, &how))
    return nullptr;
  const Py_ssize_t n = PyList_GET_SIZE(members);
  if (!THPVariable_CheckExact(flat_obj) || PyList_GET_SIZE(shapes) != n || how < 0 || how > 2) Py_RETURN_FALSE;
  try {
    if (at::impl::PythonTorchFunctionTLS::stack_len() > 0 || c10::impl::TorchDispatchModeTLS::any_modes_set() ||
        !PlainThread())
      Py_RETURN_FALSE;
    const at::Tensor& flat = THPVariable_Unpack(flat_obj);
    const bool recording = c10::GradMode::is_enabled();
    if (!Plain(flat) || flat.is_inference() || (recording && flat.requires_grad())) Py_RETURN_FALSE;
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* obj = PyList_GET_ITEM(members, i);
      if (!THPVariable_CheckExact(obj)) Py_RETURN_FALSE;
      const at::Tensor& t = THPVariable_Unpack(obj);
      if (!Plain(t) || t.scalar_type() != flat.scalar_type() || !HasSizes(t, PyList_GET_ITEM(shapes, i)))
        Py_RETURN_FALSE;
      if ((how == 2 && t.is_inference()) || (recording && t.requires_grad())) Py_RETURN_FALSE;
      total += t.numel();
    }
    if (total != flat.numel()) Py_RETURN_FALSE;
    if (how == 0) Py_RETURN_TRUE;
    char* at = static_cast<char*>(flat.data_ptr());
    for (Py_ssize_t i = 0; i < n; ++i) {
      const at::Tensor& t = THPVariable_Unpack(PyList_GET_ITEM(members, i));
      const size_t nbytes = t.numel() * t.element_size();
      if (how == 2) t.unsafeGetTensorImpl()->bump_version();  // as copy_ does, also when empty
      if (nbytes == 0) continue;
      if (how == 1) std::memmove(at, t.data_ptr(), nbytes);
      else std::memmove(t.data_ptr(), at, nbytes);
      at += nbytes;
    }
    if (how == 1) flat.unsafeGetTensorImpl()->bump_version();
    Py_RETURN_TRUE;
  } catch (const std::exception&) {
    PyErr_Clear();
    Py_RETURN_FALSE;
  }
}

PyMethodDef kMethods[] = {{"flat_copy", FlatCopy, METH_VARARGS, nullptr}, {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule{PyModuleDef_HEAD_INIT, "shoal_torch_tensors", nullptr, -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit_shoal_torch_tensors() {
  PyObject* weakref = PyImport_ImportModule("weakref");
  g_pool->getweakrefcount = weakref ? PyObject_GetAttrString(weakref, "getweakrefcount") : nullptr;
  Py_XDECREF(weakref);
  if (!g_pool->getweakrefcount) return nullptr;
  PyObject* m = PyModule_Create(&kModule);
  if (!m) return nullptr;
  PyObject* table = PyCapsule_New(const_cast<shoal_torch_tensors*>(&kTable), SHOAL_TORCH_TENSORS, nullptr);
  if (!table || PyModule_AddObject(m, "table", table) != 0) {
    Py_XDECREF(table);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
