"""Adapter for numpy arrays and any buffer-protocol object (CPU memory)."""
import numpy as np

from ._ops import DTYPE_CODES


# By dtype object: `dtype.name` and `__array_interface__` cost microseconds each, a
# noticeable part of a small op. (numpy has no bfloat16; ml_dtypes' is found by name.)
_CODES = {np.dtype(n): c for n, c in DTYPE_CODES.items() if n != "bfloat16"}


class NumpyAdapter:
    name = "numpy"
    module = "shoal"
    # Plain arrays go to the core from C in these (shoal._api).
    native = ("allreduce", "allreduce_", "allreduce_nonblocking", "allreduce_nonblocking_",
              "broadcast", "broadcast_", "broadcast_nonblocking", "broadcast_nonblocking_",
              "neighbor_allreduce", "neighbor_allreduce_nonblocking")
    torch_api = None

    @staticmethod
    def _code(a):
        code = _CODES.get(a.dtype)
        if code is None:
            code = DTYPE_CODES.get(a.dtype.name)
            if code is None:
                raise ValueError(f"dtype {a.dtype} is not supported; use one of {sorted(DTYPE_CODES)}")
        return code

    def describe(self, a):
        # The array itself stands for its address: the core reads it through the buffer
        # protocol (ndarray.ctypes.data costs ~2 us, a noticeable part of a small op).
        return a, self._code(a), a.shape

    def device(self, a):
        return 0, 0, 0  # (device type, device id, stream): host memory

    def prepare(self, tensor, inplace, op, need_output=True):
        if not inplace and type(tensor) is np.ndarray and tensor.flags.c_contiguous \
                and tensor.dtype.isnative and tensor.dtype in _CODES:
            return tensor, (np.empty_like(tensor) if need_output else None)  # the common case
        a = tensor if isinstance(tensor, np.ndarray) else np.asarray(tensor)
        self._code(a)
        if inplace:
            if not isinstance(tensor, np.ndarray) or not a.flags.c_contiguous or not a.flags.writeable:
                raise ValueError(f"{op}: in-place ops need a writeable C-contiguous numpy array")
            if not a.dtype.isnative:
                raise ValueError(f"{op}: in-place ops need native byte order, got {a.dtype.str}")
            return a, a
        if not a.dtype.isnative:  # the core computes in native byte order
            a = a.astype(a.dtype.newbyteorder("="))
        src = a if a.flags.c_contiguous else a.copy(order="C")
        return src, (np.empty_like(src) if need_output else None)

    # Window ops (shoal/_win.py): the registered tensor is written in place.
    def check_window_tensor(self, a, op):
        if not isinstance(a, np.ndarray) or not a.flags.c_contiguous or not a.flags.writeable \
                or not a.dtype.isnative:
            raise ValueError(f"{op}: needs a writeable, C-contiguous numpy array in native byte order")
        self._code(a)

    def contiguous(self, a, op):
        a = np.asarray(a)
        self._code(a)
        return a if a.flags.c_contiguous and a.dtype.isnative else np.ascontiguousarray(a, a.dtype.newbyteorder("="))

    def clone(self, a):
        return a.copy()

    def is_device(self, a):
        return False

    def from_bytes(self, data, shape, like):
        return data.view(like.dtype).reshape(shape)

    def int32(self, values):
        """A list of ints as the framework's int32 tensor (alltoall's received splits)."""
        return np.array(values, dtype=np.int32)


ADAPTER = NumpyAdapter()
