"""ctypes view of the CUDA plugin's function table (core/cuda_plugin/cuda_api.h), for the GPU
tests and benchmarks/gpu_kernels.py, which call its entries directly, and for the torch
adapter's test-only fake-device switch. The field order and types follow the header;
`_core` exports the header's field offsets and size (`CUDA_API_FIELDS`, `CUDA_API_SIZE`,
`NCCL_PEER_FIELDS`), and this module checks its view against them at import, so a field
added, removed or reordered there fails here at once instead of calling the wrong entry.

The table is the one of the plugin file libshoal.so loads (`_core.gpu_plugin_path()`:
the real plugin, or the fake one with SHOAL_CUDA_PLUGIN=fake), so it is the same loaded
instance and shares its devices, streams and communicators with the core."""
import ctypes
import functools

from ._loader import _core

ABI_VERSION = _core.CUDA_ABI_VERSION

_err, _p, _i, _i64 = ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_pp, _pi64 = ctypes.POINTER(_p), ctypes.POINTER(_i64)


class NcclPeer(ctypes.Structure):
    _fields_ = [("peer", ctypes.c_int32), ("buf", _p), ("count", _i64)]


_F = ctypes.CFUNCTYPE
_FIELDS = [
    ("abi_version", ctypes.c_int32), ("build", ctypes.c_char_p), ("has_nccl", ctypes.c_int32),
    ("device_count", _F(_i, ctypes.POINTER(ctypes.c_char_p))),
    ("set_device", _F(_err, _i)),
    ("get_device", _F(_i)),
    ("stream_create", _F(_err, _i, _pp)),
    ("stream_destroy", _F(_err, _p)),
    ("stream_sync", _F(_err, _p)),
    ("stream_wait_event", _F(_err, _p, _p)),
    ("capture", _F(_err, _i, _p, _pp)),
    ("event_create", _F(_err, _i, _pp)),
    ("event_destroy", _F(_err, _p)),
    ("event_record", _F(_err, _p, _p)),
    ("event_query", _F(_err, _p, ctypes.POINTER(_i))),
    ("memcpy_async", _F(_err, _p, _p, ctypes.c_size_t, _p)),
    ("host_alloc", _F(_err, ctypes.c_size_t, _pp)),
    ("host_free", _F(_err, _p)),
    ("device_alloc", _F(_err, _i, ctypes.c_size_t, _pp)),
    ("device_free", _F(_err, _p)),
    ("combine", _F(_err, _p, _p, _pp, ctypes.POINTER(ctypes.c_double), _i, _i, ctypes.c_double, _i, _i64, _p)),
    ("scale", _F(_err, _p, _p, ctypes.c_double, _i, _i, _i64, _p)),
    ("pack", _F(_err, _p, _pp, _pi64, _pi64, _i, _i, _p)),
    ("nccl_unique_id", _F(_err, _p)),
    ("nccl_comm_init", _F(_err, _i, _i, _p, _i, _pp)),
    ("nccl_comm_destroy", _F(_err, _p)),
    ("nccl_check", _F(_err, _p)),
    ("nccl_allreduce", _F(_err, _p, _i64, _i, _i, _p, _p)),
    ("nccl_broadcast", _F(_err, _p, _i64, _i, _p, _p)),
    ("nccl_allgatherv", _F(_err, _p, _p, _pi64, _pi64, _i, _p, _p)),
    ("nccl_exchange", _F(_err, ctypes.POINTER(NcclPeer), _i, ctypes.POINTER(NcclPeer), _i, _p, _p)),
    ("nccl_comm_abort", _F(_err, _p)),
    ("nccl_reducescatter", _F(_err, _p, _p, _pi64, _i, _i, _i, _p, _p)),
    ("mpi_cuda_aware", _F(_i, ctypes.POINTER(ctypes.c_char_p))),
]


class Table(ctypes.Structure):
    _fields_ = _FIELDS


def _verify(struct, offsets, size=None):
    """Raise ImportError unless `struct`'s fields are the header's (names and offsets)."""
    mine = {name: getattr(struct, name).offset for name, _ in struct._fields_}
    if mine != dict(offsets) or (size is not None and ctypes.sizeof(struct) != size):
        differ = sorted(n for n in set(mine) | set(offsets) if mine.get(n) != offsets.get(n))
        raise ImportError(f"shoal._gpu: {struct.__name__} does not match core/cuda_plugin/cuda_api.h "
                          f"(fields {differ}); update its _fields_")


_verify(Table, _core.CUDA_API_FIELDS, _core.CUDA_API_SIZE)
_verify(NcclPeer, _core.NCCL_PEER_FIELDS)


@functools.lru_cache(maxsize=None)
def _load(path):
    lib = ctypes.CDLL(path)
    lib.shoal_cuda_plugin.restype = ctypes.POINTER(Table)
    table = lib.shoal_cuda_plugin(ABI_VERSION)
    if not table:
        raise OSError(f"{path}: ABI version mismatch (want {ABI_VERSION})")
    return lib, table.contents


def plugin():
    """The table of the plugin libshoal.so loads; OSError if that file is missing."""
    return _load(_core.gpu_plugin_path())[1]


def library():
    """The plugin as a ctypes library (the fake's test hooks are extra symbols)."""
    return _load(_core.gpu_plugin_path())[0]


def is_fake(build):
    """Whether `build` (a table's `build`, or `_core.gpu_support()[1]`) is the fake plugin's."""
    return (build.decode() if isinstance(build, bytes) else build).startswith("fake ")


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
