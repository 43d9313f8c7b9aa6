// The native entries' shared parts (native_entry.cc: the public entry points;
// registered_kernels.cc: the kernels of the registered torch ops).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "module.h"
#include "shoal/torch_tensors.h"

namespace shoal_py {

// torch's API as the torch entry points use it (Shoal is not compiled against torch,
// docs/design.md §2): the tensor and Parameter types, {dtype: (core code, numpy dtype or
// None)}, torch.strided, torch.empty_like, torch.is_grad_enabled and torch.from_numpy;
// and, where bindings/torch/torch_tensors.cc could be built for the installed torch, its
// table, which reads and makes plain tensors without the Python API (null: not built).
struct TorchApi {
  py::object tensor, parameter, dtypes, strided, empty_like, is_grad_enabled, from_numpy, compiled;
  const shoal_torch_tensors* direct = nullptr;
};
constexpr int32_t kMaxDims = 32;

// The state of one native function: its Python fallback, for allreduce the {ReduceOp
// object: core code} of `op=` (shoal._ops.REDUCE_OP_CODES), for torch tensors (instead of
// numpy arrays) torch's API, and whether it is a nonblocking form (it returns the handle,
// with (objects kept alive, finish() -> result) attached as shoal._ops._submit attaches them).
struct Native {
  py::object fallback, ops;
  std::unique_ptr<TorchApi> torch;
  bool nonblocking = false;
  bool inplace = false;  // the result overwrites the input (allreduce_, allreduce_nonblocking_)
};

// An input the one-call path can take: dtype code, address and shape.
struct Input {
  int dtype = -1;
  void* data = nullptr;
  std::vector<int64_t> shape;
  PyObject* numpy_dtype = nullptr;  // torch: the numpy dtype of the output's memory (None: no numpy twin)
};

bool IsFloat(int dtype);
// `x` as an Input if the one-call path can take it (floating dtypes only unless `any`).
bool PlainInput(const Native& st, PyObject* x, bool any, Input* in);
// The arguments of a vectorcall by parameter position (defaults where not given); false
// for more arguments than parameters, an unknown keyword or one given twice.
bool Parse(PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames, const char* const* params,
           Py_ssize_t n, PyObject** a, bool* given);
// The UTF-8 of a plain `name` argument ("" for None), or null (then Python decides).
const char* PlainName(PyObject* name);
// The description of op `op` from `in` into a new output like `x` (or `x` itself in place).
py::object Describe(const Native& st, PyObject* x, const Input& in, int op, const char* name, shoal_op_desc* d);
// Enqueues `d` reading `x` into `out`: blocking, returns `out`; else the handle.
PyObject* Finish(const Native& st, const shoal_op_desc& d, PyObject* x, py::object out);
// A built-in function `name` of module `module` calling `call` with the state `state`.
py::object MakeNative(const std::string& name, PyCFunction call, Native* state, const std::string& doc,
                      const std::string& module);
// A native function's state (never destroyed: it may hold Python objects at exit).
Native* NewNative(py::object fallback, py::object ops, py::object torch, bool nonblocking, bool inplace);

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

}  // namespace shoal_py
