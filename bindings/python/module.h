// Shared parts of the shoal._core module (core_module.cc, native_entry.cc).
#pragma once
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "shoal/c_api.h"

namespace py = pybind11;

namespace shoal_py {

constexpr size_t kErrLen = 4096;

// Raises the Python exception for a C ABI error code (ValueError or ShoalError).
[[noreturn]] void Raise(int code, const char* msg);
void Check(int code, const char* msg);
// A C ABI tensor over memory the caller keeps alive (an int address or a buffer object).
shoal_tensor MakeTensor(py::handle data, int dtype, const std::vector<int64_t>& shape, bool writable);
// Enqueues `d`. Blocking: waits (Ctrl-C aware), releases the handle and returns 0; `keep`
// (the objects owning the tensors' memory) stays referenced if the wait is interrupted.
// Nonblocking: attaches (keep, finish) to the handle (see Attach) and returns it.
int64_t Submit(const shoal_op_desc& d, bool block, const py::object& keep, const py::object& finish);
// Attaches `data` to op handle `h` (shoal_attach), the one registry of a handle's objects:
// shoal._ops.synchronize takes (objects kept alive, finish() -> result) from it.
void Attach(int64_t h, py::object data);

// A neighbor op's resolved lists (shoal._ops.neighbor_args' "native" entry): the one
// described form of a neighbor op's peers that enqueue and the native path take.
struct NeighborArgs {
  std::vector<int32_t> recv_ranks, send_ranks;
  std::vector<double> recv_weights, send_weights;
  double self_weight = 1.0;
  bool uniform = true, topo_check = false;
};
void SetPeers(shoal_op_desc* d, const NeighborArgs& a);
// Adds `poll_name(h)` (True once done; ValueError for an unknown handle) and `wait_name(h)`
// (Ctrl-C aware) over the C ABI's poll and wait_for of op or window handles (`what`).
void DefinePollWait(py::module_& m, const char* poll_name, const char* wait_name, const char* what,
                    int (*poll)(int64_t), int (*wait_for)(int64_t, int64_t, char*, size_t));
// Adds the window functions (windows_module.cc).
void DefineWindows(py::module_& m);
// Adds NeighborArgs, the remembered neighbor_args, native_neighbor_allreduce and
// native_allreduce (native_entry.cc).
void DefineNeighborNative(py::module_& m);
// Adds the registered torch ops' kernels native_kernel_allreduce, native_kernel_broadcast and
// native_kernel_neighbor_allreduce (registered_kernels.cc).
void DefineRegisteredKernels(py::module_& m);

}  // namespace shoal_py
