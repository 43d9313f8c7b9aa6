/* Plain CPU torch tensors, read and made without torch's Python API.
 *
 * A small extension compiled against the installed torch on first import
 * (bindings/torch/torch_tensors.cc, built by shoal/_build.py once per torch version) hands
 * this table to the C entry points (bindings/python/native_entry.cc) in a capsule of this
 * name. Without it (no C++ compiler) they read tensors through torch's Python API. */
#ifndef SHOAL_TORCH_TENSORS_H
#define SHOAL_TORCH_TENSORS_H

#include <stdint.h>

#define SHOAL_TORCH_TENSORS "shoal.torch_tensors.v1"

typedef struct {
  /* 1, with the core's dtype code, address and shape, if `tensor` (a torch.Tensor or
   * Parameter, a PyObject*) is on the CPU, strided, contiguous, without a lazy negation or
   * conjugation, not functionalized or Python-dispatched (nor is this thread), not to be
   * recorded by autograd (no requires_grad, or grad mode off), of a dtype the core has and
   * with at most `max_dims` dimensions; else 0. Never raises. */
  int (*read)(void* tensor, int32_t* dtype, void** data, int32_t* ndim, int64_t* shape, int32_t max_dims);
  /* A new contiguous CPU tensor of the core's dtype code and shape (a new PyObject*
   * reference) and its address in *data; null with a Python error set on failure. */
  void* (*empty)(int32_t dtype, int32_t ndim, const int64_t* shape, void** data);
} shoal_torch_tensors;

#endif
