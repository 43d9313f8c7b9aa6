"""Gossip compressors: a float tensor into a smaller payload of bytes, and back; one
implementation for numpy arrays (`shoal`, `shoal.keras`) and torch tensors (`shoal.torch`,
on the tensor's device).

The interface a researcher implements (three methods, shown by `Compressor`):

* ``payload_bytes(numel, dtype)``: the size in bytes of `encode`'s payload for a 1-D
  tensor of `numel` elements of `dtype`. Receivers split the payloads they gather with it,
  so it must depend on nothing else.
* ``encode(x)``: 1-D floating tensor -> 1-D uint8 tensor of the same framework (numpy
  array or torch tensor, on x's device) of exactly ``payload_bytes(x.numel(), x.dtype)``
  bytes.
* ``decode(payload, numel, dtype)``: the payload -> 1-D tensor of `numel` elements of
  `dtype` (the payload's framework and device): Q(x), the compressed value of x.

Payloads travel as what they are (packed integers, indices and values), so the bytes on
the wire drop by the compression ratio; `stats()["bytes_sent"]` counts them. The built-in
compressors run as array operations of the input's own framework, through `_Arrays` below
(torch: on the tensor's device, no host round trip for CUDA tensors). Used by
`CompressedGossip` (CHOCO-SGD's error feedback) and the decentralized optimizers'
`compression=` (docs/design.md §21).
"""
import functools
import math

import numpy as np

__all__ = ["Compressor", "Identity", "Cast", "Int8", "Int4", "TopK", "RandomK", "by_name", "arrays_of"]


class _NumpyArrays:
    """The array operations the compressors and the gossip use, on numpy arrays."""
    uint8, int8, int16, int32, int64, float32 = (np.uint8, np.int8, np.int16, np.int32, np.int64, np.float32)

    @staticmethod
    def dtype(d):
        return np.dtype(d)

    @staticmethod
    def itemsize(d):
        return np.dtype(d).itemsize

    @staticmethod
    def is_floating(x):
        return np.issubdtype(x.dtype, np.floating) or x.dtype.name == "bfloat16"

    @staticmethod
    def flat(x):
        return np.ascontiguousarray(x).reshape(-1)

    @staticmethod
    def zeros(n, dtype, like):
        return np.zeros(n, dtype)

    @staticmethod
    def zeros_like(x):
        return np.zeros_like(x)

    @staticmethod
    def copy(x):
        return x.copy()

    @staticmethod
    def all_finite(x):
        if x.size == 0:
            return True
        lo, hi = x.min(), x.max()  # nan propagates through both; two passes, no mask
        return bool(np.isfinite(np.float64(lo)) and np.isfinite(np.float64(hi)))

    @staticmethod
    def to(x, dtype):
        return x.astype(dtype)

    @staticmethod
    def bytes_of(x):
        return np.ascontiguousarray(x).reshape(-1).view(np.uint8)

    @staticmethod
    def view(data, dtype):
        """uint8 `data` viewed as `dtype` (copied first where its offset does not align)."""
        if data.ctypes.data % np.dtype(dtype).itemsize:
            data = data.copy()
        return data.view(dtype)

    @staticmethod
    def cat(parts):
        return np.concatenate(parts)

    @staticmethod
    def empty_bytes(n, like):
        return np.empty(n, np.uint8)

    @staticmethod
    def blocks(x, c, chunk):
        """x as float32 [c, chunk], zero-padded (a view where nothing needs converting)."""
        if x.dtype == np.float32 and x.shape[0] == c * chunk:
            return x.reshape(c, chunk)
        padded = np.zeros(c * chunk, np.float32)
        padded[:x.shape[0]] = x
        return padded.reshape(c, chunk)

    @staticmethod
    def row_absmax(blocks):
        return np.maximum(blocks.max(axis=1), -blocks.min(axis=1))

    @staticmethod
    def quantize(blocks, scale, limit):
        """round(blocks / scale) (to nearest even), clipped to ±limit: float32 [c, chunk]."""
        q = blocks / np.where(scale > 0, scale, np.float32(1.0))[:, None]
        np.rint(q, out=q)
        return np.clip(q, -limit, limit, out=q)

    @staticmethod
    def dequantize(q, scale, numel, dtype):
        out = np.multiply(q, scale[:, None], dtype=np.float32).reshape(-1)[:numel]
        return out if out.dtype == dtype else out.astype(dtype)

    @staticmethod
    def add_scaled(y, x, alpha):
        """y += alpha * x, in place."""
        y += alpha * x
        return y

    @staticmethod
    def scaled(x, alpha):
        return alpha * x

    @staticmethod
    def lerp(x, d, alpha):
        """x + alpha * d, a new array."""
        return x + alpha * d

    @staticmethod
    def stack_cols(a, b):
        return np.stack([a, b], axis=1)

    @staticmethod
    def topk_abs(x, k):
        return np.argpartition(np.abs(x.astype(np.float64)), x.size - k)[x.size - k:]

    @staticmethod
    def randperm(n, k, gens, seed, like):
        gen = gens.get("numpy")
        if gen is None:
            gen = gens["numpy"] = np.random.default_rng(seed)
        return gen.permutation(n)[:k]

    @staticmethod
    def cast16(x, wire):
        """Round-to-nearest-even to float16 or bfloat16 (wire "fp16"/"bf16"): its bytes."""
        if wire == "fp16":
            return x.astype(np.float16).view(np.uint8)
        bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
        rounded = (bits + (((bits >> 16) & 1) + 0x7FFF).astype(np.uint32)) >> 16
        return rounded.astype(np.uint16).view(np.uint8)

    @classmethod
    def uncast16(cls, data, wire, dtype):
        if wire == "fp16":
            return cls.view(data, np.float16).astype(dtype)
        return (cls.view(data, np.uint16).astype(np.uint32) << 16).view(np.float32).astype(dtype)


class _TorchArrays:
    """The same operations on torch tensors, on the tensor's device."""

    def __init__(self):
        import torch
        self.torch = torch
        self.uint8, self.int8, self.int16, self.int32, self.int64, self.float32 = (
            torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float32)

    def dtype(self, d):
        return d

    def itemsize(self, d):
        return self.torch.empty((), dtype=d).element_size()

    def is_floating(self, x):
        return x.is_floating_point()

    def flat(self, x):
        return x.detach().reshape(-1)

    def zeros(self, n, dtype, like):
        return self.torch.zeros(n, dtype=dtype, device=like.device)

    def zeros_like(self, x):
        return self.torch.zeros_like(x)

    def copy(self, x):
        return x.clone()

    def all_finite(self, x):
        if x.numel() == 0:
            return True
        lo, hi = self.torch.aminmax(x)  # nan propagates; one pass, no mask
        return bool(self.torch.isfinite(lo) & self.torch.isfinite(hi))

    def to(self, x, dtype):
        return x.to(dtype)

    def bytes_of(self, x):
        return x.contiguous().view(self.torch.uint8).reshape(-1)

    def view(self, data, dtype):
        if data.storage_offset() % self.itemsize(dtype):
            data = data.clone()
        return data.view(dtype)

    def cat(self, parts):
        return self.torch.cat(parts)

    def empty_bytes(self, n, like):
        return self.torch.empty(n, dtype=self.torch.uint8, device=like.device)

    def blocks(self, x, c, chunk):
        if x.dtype == self.torch.float32 and x.shape[0] == c * chunk:
            return x.view(c, chunk)
        padded = self.torch.zeros(c * chunk, dtype=self.torch.float32, device=x.device)
        padded[:x.shape[0]] = x
        return padded.view(c, chunk)

    def row_absmax(self, blocks):
        lo, hi = self.torch.aminmax(blocks, dim=1)  # one pass, no |x| copy
        return self.torch.maximum(hi, -lo)

    def quantize(self, blocks, scale, limit):
        q = blocks / self.torch.where(scale > 0, scale, 1.0)[:, None]
        return q.round_().clamp_(-limit, limit)

    def dequantize(self, q, scale, numel, dtype):
        out = self.torch.empty(q.shape, dtype=self.torch.float32, device=q.device)
        out.copy_(q).mul_(scale[:, None])
        out = out.view(-1)[:numel]
        return out if out.dtype == dtype else out.to(dtype)

    def add_scaled(self, y, x, alpha):
        return y.add_(x, alpha=alpha)

    def scaled(self, x, alpha):
        return x.mul(alpha)

    def lerp(self, x, d, alpha):
        return self.torch.add(x, d, alpha=alpha)

    def stack_cols(self, a, b):
        return self.torch.stack([a, b], dim=1)

    def topk_abs(self, x, k):
        return self.torch.topk(x.abs(), k, sorted=False).indices

    def randperm(self, n, k, gens, seed, like):
        gen = gens.get(like.device)
        if gen is None:
            gen = gens[like.device] = self.torch.Generator(device=like.device)
            gen.manual_seed(seed)
        return self.torch.randperm(n, generator=gen, device=like.device)[:k]

    def cast16(self, x, wire):
        return self.bytes_of(x.to(self.torch.float16 if wire == "fp16" else self.torch.bfloat16))

    def uncast16(self, data, wire, dtype):
        return self.view(data, self.torch.float16 if wire == "fp16" else self.torch.bfloat16).to(dtype)


_NUMPY = _NumpyArrays()


@functools.lru_cache(maxsize=None)
def _torch():
    """The _TorchArrays, made at first use (torch is imported then)."""
    return _TorchArrays()


def arrays_of(x):
    """The array operations of `x`'s framework: numpy arrays, else torch tensors."""
    return _NUMPY if isinstance(x, np.ndarray) else _torch()


def _itemsize(dtype):
    """Bytes per element of a numpy or torch dtype."""
    return _torch().itemsize(dtype) if type(dtype).__module__.startswith("torch") else np.dtype(dtype).itemsize


def _wire_of(wire):
    """"fp16" or "bf16" from a name, a numpy dtype or a torch dtype; ValueError otherwise."""
    name = str(wire).replace("torch.", "")
    found = {"float16": "fp16", "fp16": "fp16", "half": "fp16", "bfloat16": "bf16", "bf16": "bf16"}.get(name)
    if found is None:
        raise ValueError(f"Cast: wire dtype must be float16 or bfloat16, got {wire}")
    return found


class Compressor:
    """The interface (see the module docstring). `lossless`: decode(encode(x)) == x exactly
    for every x of the dtypes the compressor is used with."""
    lossless = False

    def payload_bytes(self, numel, dtype):
        raise NotImplementedError

    def encode(self, x):
        raise NotImplementedError

    def decode(self, payload, numel, dtype):
        raise NotImplementedError

    def __repr__(self):
        return type(self).__name__


class Identity(Compressor):
    """No compression: the tensor's own bytes (lossless)."""
    lossless = True

    def payload_bytes(self, numel, dtype):
        return numel * _itemsize(dtype)

    def encode(self, x):
        return arrays_of(x).bytes_of(x)

    def decode(self, payload, numel, dtype):
        a = arrays_of(payload)
        return a.copy(a.view(payload, a.dtype(dtype)))


class Cast(Compressor):
    """Travels cast to `wire` (float16 or bfloat16: "fp16", "bf16", or the numpy/torch
    dtype): 2 bytes per element, round to nearest even; lossless for tensors already of
    that dtype."""

    def __init__(self, wire):
        self.wire = wire
        self._wire = _wire_of(wire)

    def payload_bytes(self, numel, dtype):
        return 2 * numel

    def encode(self, x):
        return arrays_of(x).cast16(x, self._wire)

    def decode(self, payload, numel, dtype):
        return arrays_of(payload).uncast16(payload, self._wire, dtype)

    def __repr__(self):
        return f"Cast({self.wire})"


class _Quantized(Compressor):
    """Symmetric uniform quantization to `bits` per element with one float32 scale per
    chunk of `chunk` elements (scale = max|x| of the chunk / levels); rounds to nearest, so
    the error per element is at most scale / 2."""
    bits = 8

    def __init__(self, chunk=256):
        if not isinstance(chunk, int) or chunk <= 0 or chunk % 2:
            raise ValueError(f"{type(self).__name__}: chunk must be a positive even int, got {chunk!r}")
        self.chunk = chunk
        self.levels = 2 ** (self.bits - 1) - 1  # 127 or 7: symmetric around 0

    def _chunks(self, numel):
        return math.ceil(numel / self.chunk)

    def payload_bytes(self, numel, dtype):
        c = self._chunks(numel)
        return 4 * c + c * self.chunk * self.bits // 8

    def encode(self, x):
        # Few passes over x: it is a model's worth of parameters every step (docs/design.md §21).
        a = arrays_of(x)
        c = self._chunks(x.shape[0])
        blocks = a.blocks(x, c, self.chunk)
        scale = a.row_absmax(blocks) / self.levels
        payload = a.empty_bytes(self.payload_bytes(x.shape[0], x.dtype), x)
        a.view(payload[:4 * c], a.float32)[:] = scale
        # a subnormal scale can round past the levels: clipped
        self._pack(a, a.quantize(blocks, scale, self.levels), payload[4 * c:])
        return payload

    def decode(self, payload, numel, dtype):
        a = arrays_of(payload)
        c = self._chunks(numel)
        scale = a.view(payload[:4 * c], a.float32)
        return a.dequantize(self._unpack(a, payload[4 * c:], c), scale, numel, a.dtype(dtype))

    def _pack(self, a, q, out):
        a.view(out, a.int8).reshape(q.shape)[:] = q  # exact: q holds integers in int8's range

    def _unpack(self, a, data, c):
        return a.view(data, a.int8).reshape(c, self.chunk)

    def __repr__(self):
        return f"{type(self).__name__}(chunk={self.chunk})"


class Int8(_Quantized):
    """8-bit quantization with a per-chunk scale: about 26 % of float32's bytes."""
    bits = 8


class Int4(_Quantized):
    """4-bit quantization (two values per byte) with a per-chunk scale: about 14 % of
    float32's bytes."""
    bits = 4

    def _pack(self, a, q, out):
        u = a.to(q.reshape(-1) + 8, a.uint8)  # -7..7 -> 1..15
        out[:] = u[0::2] | (u[1::2] << 4)

    def _unpack(self, a, data, c):
        both = a.stack_cols(data & 0xF, data >> 4).reshape(-1)
        return (a.to(both, a.int16) - 8).reshape(c, self.chunk)


class _Sparse(Compressor):
    """k = ceil(ratio * numel) elements: their values in the tensor's dtype, then their
    indices as int32."""

    def __init__(self, ratio):
        if not (isinstance(ratio, (int, float)) and 0 < ratio <= 1):
            raise ValueError(f"{type(self).__name__}: ratio must be in (0, 1], got {ratio!r}")
        self.ratio = float(ratio)

    def _k(self, numel):
        return max(1, math.ceil(self.ratio * numel))

    def payload_bytes(self, numel, dtype):
        return self._k(numel) * (4 + _itemsize(dtype))

    def encode(self, x):
        a = arrays_of(x)
        idx = self._indices(a, x, self._k(x.shape[0]))
        return a.cat([a.bytes_of(x[idx]), a.bytes_of(a.to(idx, a.int32))])

    def decode(self, payload, numel, dtype):
        a = arrays_of(payload)
        k = self._k(numel)
        split = payload.shape[0] - 4 * k
        out = a.zeros(numel, a.dtype(dtype), payload)
        out[a.to(a.view(payload[split:], a.int32), a.int64)] = a.view(payload[:split], a.dtype(dtype))
        return out

    def __repr__(self):
        return f"{type(self).__name__}({self.ratio})"


class TopK(_Sparse):
    """The k elements of largest magnitude (Stich et al. 2018; biased, contractive)."""

    def _indices(self, a, x, k):
        return a.topk_abs(x, k)


class RandomK(_Sparse):
    """k elements chosen uniformly at random (a generator of its own per device, seeded
    with `seed`)."""

    def __init__(self, ratio, seed=0):
        super().__init__(ratio)
        self.seed = seed
        self._gen = {}

    def _indices(self, a, x, k):
        return a.randperm(x.shape[0], k, self._gen, self.seed, x)


def by_name(spec):
    """A compressor from its name: "none", "fp16", "bf16", "int8", "int4", "topk:R",
    "randomk:R" (R the kept fraction, e.g. "topk:0.01"); a Compressor passes through.
    Raises ValueError for an unknown name."""
    if isinstance(spec, Compressor):
        return spec
    name, _, arg = str(spec).partition(":")
    simple = {"none": Identity, "fp16": lambda: Cast("fp16"), "bf16": lambda: Cast("bf16"), "int8": Int8,
              "int4": Int4}
    if name in simple and not arg:
        return simple[name]()
    if name in ("topk", "randomk") and arg:
        try:
            ratio = float(arg)
        except ValueError:
            ratio = None
        if ratio is not None:
            return TopK(ratio) if name == "topk" else RandomK(ratio)
    raise ValueError(f"unknown compressor {spec!r}: use none, fp16, bf16, int8, int4, topk:R or randomk:R "
                     "(R in (0, 1]), or a shoal.compression.Compressor")
