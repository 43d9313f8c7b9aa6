"""ctypes view of the CUDA plugin's function table (core/src/cuda/cuda_api.h), for the GPU
kernel tests and benchmarks/gpu_kernels.py: they call the kernels on torch tensors directly.
The field order must match the header."""
import ctypes
import os

_err = ctypes.c_char_p
_p = ctypes.c_void_p
_FIELDS = [("abi_version", ctypes.c_int32), ("build", ctypes.c_char_p), ("has_nccl", ctypes.c_int32)]
_FIELDS += [(n, _p) for n in ("device_count", "set_device", "stream_create", "stream_destroy", "stream_sync",
                              "stream_wait_event", "capture", "event_create", "event_destroy", "event_record",
                              "event_query", "memcpy_async", "host_alloc", "host_free", "device_alloc",
                              "device_free")]
_FIELDS += [("combine", ctypes.CFUNCTYPE(_err, _p, _p, ctypes.POINTER(_p), ctypes.POINTER(ctypes.c_double),
                                         ctypes.c_int, ctypes.c_int, ctypes.c_double, ctypes.c_int,
                                         ctypes.c_int64, _p)),
            ("scale", ctypes.CFUNCTYPE(_err, _p, _p, ctypes.c_double, ctypes.c_int, ctypes.c_int,
                                       ctypes.c_int64, _p)),
            ("pack", ctypes.CFUNCTYPE(_err, _p, ctypes.POINTER(_p), ctypes.POINTER(ctypes.c_int64),
                                      ctypes.POINTER(ctypes.c_int64), ctypes.c_int, ctypes.c_int, _p))]


class Table(ctypes.Structure):
    _fields_ = _FIELDS


def plugin():
    """The table of shoal/libshoal_cuda.so; OSError if this build has no CUDA plugin."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libshoal_cuda.so")
    lib = ctypes.CDLL(path)
    lib.shoal_cuda_plugin.restype = ctypes.POINTER(Table)
    table = lib.shoal_cuda_plugin(1)
    if not table:
        raise OSError(f"{path}: ABI version mismatch")
    return table.contents


def check(err):
    if err:
        raise RuntimeError(err.decode())


def combine(t, out, self_, srcs, weights, uniform, self_weight, dtype_code, stream):
    """out = self_weight*self + sum_j weights[j]*srcs[j] (or the uniform mean) on `stream`."""
    ptrs = (_p * max(1, len(srcs)))(*[s.data_ptr() for s in srcs])
    w = (ctypes.c_double * max(1, len(srcs)))(*weights)
    check(t.combine(out.data_ptr(), self_.data_ptr(), ptrs, w, len(srcs), int(uniform), self_weight,
                    dtype_code, out.numel(), stream))


def pack(t, fused, parts, offsets, unpack, stream):
    n = len(parts)
    check(t.pack(fused.data_ptr(), (_p * n)(*[p.data_ptr() for p in parts]), (ctypes.c_int64 * n)(*offsets),
                 (ctypes.c_int64 * n)(*[p.numel() * p.element_size() for p in parts]), n, int(unpack), stream))
