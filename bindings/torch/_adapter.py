"""Adapter from torch tensors to the core's (address, dtype code, shape, device, stream).

CUDA tensors go with the caller's current stream: the core records an event there at
enqueue (so a producer kernel still running is waited for) and, at completion, makes that
stream wait for the result (so later work on it is ordered after the op). Work on other
streams must be ordered with the current stream as usual in torch.

Test only: SHOAL_FAKE_DEVICE=1 (with SHOAL_CUDA_PLUGIN=fake) describes CPU tensors as CUDA
tensors of fake device local_rank % device count, on its legacy default stream, so the
whole GPU code path runs on CPUs in CI (docs/design.md §12)."""
import functools
import os
import types

import numpy as np
import torch

from shoal._ops import DTYPE_CODES

from . import _tensors

_CODES = {getattr(torch, name): code for name, code in DTYPE_CODES.items()}


class TorchAdapter:
    name = "torch"
    module = "shoal.torch"
    # Plain tensors go to the core from C in these (shoal._api); blocking allreduce,
    # broadcast and neighbor_allreduce are bindings/torch/_ops.py's (torch.library ops,
    # autograd).
    native = ("allreduce_", "allreduce_nonblocking", "allreduce_nonblocking_", "broadcast_",
              "broadcast_nonblocking", "broadcast_nonblocking_", "neighbor_allreduce_nonblocking")

    @staticmethod
    def _check(t, op):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _CODES:
            raise ValueError(f"{op}: dtype {t.dtype} is not supported; use one of {sorted(DTYPE_CODES)}")
        if t.layout != torch.strided:
            raise ValueError(f"{op}: {t.layout} tensors are not supported; use a dense tensor")
        if t.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{op}: {t.device} tensors are not supported; use a CPU or CUDA tensor")

    def describe(self, t):
        return t.data_ptr(), _CODES[t.dtype], tuple(t.shape)

    def device(self, t):
        """(device type, device ordinal, current stream) of the enqueue: (0, 0, 0) for host
        memory, (1, ordinal, stream) for a CUDA tensor."""
        if not t.is_cuda:
            return (1, _fake_device(), 0) if _FAKE else (0, 0, 0)
        return 1, t.device.index, torch.cuda.current_stream(t.device).cuda_stream

    def prepare(self, tensor, inplace, op, need_output=True):
        self._check(tensor, op)
        if inplace:
            if tensor.requires_grad and torch.is_grad_enabled():
                raise ValueError(f"{op}: in-place ops cannot be recorded by autograd; use the "
                                 "out-of-place op or torch.no_grad()")
            if not tensor.is_contiguous():
                raise ValueError(f"{op}: in-place ops need a contiguous tensor; call .contiguous() first")
            return tensor, tensor
        src = tensor.detach().resolve_neg().contiguous()  # a lazy negation's memory holds -x
        return src, (torch.empty_like(src) if need_output else None)

    # Window ops (shoal/_win.py): the registered tensor is written in place (through its
    # memory, so autograd does not see it: BlueFog's `.data` semantics).
    def check_window_tensor(self, t, op):
        self._check(t, op)
        if not t.is_contiguous():
            raise ValueError(f"{op}: needs a contiguous tensor; call .contiguous() first")

    def contiguous(self, t, op):
        self._check(t, op)
        return t.detach().resolve_neg().contiguous()

    def clone(self, t):
        return t.detach().clone()

    # Window ops on CUDA tensors stage through host memory.
    def is_device(self, t):
        self._check(t, "window op")
        return t.device.type != "cpu"

    def to_host(self, t):
        return t.detach().to("cpu").contiguous()  # waits for the current stream

    def copy_into(self, dst, src):
        with torch.no_grad():
            dst.copy_(src)

    def to_device_like(self, t, like):
        return t.to(like.device)

    def from_bytes(self, data, shape, like):
        if data.size == 0:
            return torch.empty(shape, dtype=like.dtype, device=like.device)
        # Core-allocated results (gathers) are in host memory; a CUDA input gets them back
        # on its device, copied on the current stream.
        return torch.from_numpy(data).view(like.dtype).reshape(shape).to(like.device)

    def int32(self, values):
        """A list of ints as an int32 CPU tensor (alltoall's received splits, as Horovod's)."""
        return torch.tensor(values, dtype=torch.int32)


_FAKE = os.environ.get("SHOAL_FAKE_DEVICE") == "1"
if _FAKE:  # CPU tensors described as CUDA ones: the C functions would take them as host memory
    TorchAdapter.native = ()
# torch's API as the C functions read it (bindings/python/native_entry.cc, TorchApi): the
# plain tensor types, {dtype: (core code, numpy dtype of the same memory or None)},
# torch.strided, torch.empty_like, torch.is_grad_enabled, torch.from_numpy, and the
# compiled tensor access (_tensors.py; None: the Python API's attributes instead).
TorchAdapter.torch_api = types.SimpleNamespace(
    tensor=torch.Tensor, parameter=torch.nn.Parameter,
    dtypes={getattr(torch, n): (c, None if n == "bfloat16" else np.dtype(n)) for n, c in DTYPE_CODES.items()},
    strided=torch.strided, empty_like=torch.empty_like, is_grad_enabled=torch.is_grad_enabled,
    from_numpy=torch.from_numpy, compiled=None if _FAKE else _tensors.table())


@functools.lru_cache(maxsize=None)
def _fake_device():
    from shoal import _gpu, basics
    table = _gpu.plugin()
    if not _gpu.is_fake(table.build):
        raise ValueError("SHOAL_FAKE_DEVICE=1 needs the fake device plugin (SHOAL_CUDA_PLUGIN=fake)")
    return basics.local_rank() % table.device_count(None)


ADAPTER = TorchAdapter()
