"""Gossip compressors: a float tensor into a smaller payload of bytes, and back.

The interface a researcher implements (three methods, shown by `Compressor`):

* ``payload_bytes(numel, dtype)``: the size in bytes of `encode`'s payload for a 1-D
  tensor of `numel` elements of `dtype`. Receivers split the payloads they gather with it,
  so it must depend on nothing else.
* ``encode(x)``: 1-D floating tensor -> 1-D ``torch.uint8`` tensor of exactly
  ``payload_bytes(x.numel(), x.dtype)`` bytes, on x's device.
* ``decode(payload, numel, dtype)``: the payload -> 1-D tensor of `numel` elements of
  `dtype` on the payload's device: Q(x), the compressed value of x.

Payloads travel as what they are (packed integers, indices and values), so the bytes on
the wire drop by the compression ratio; `shoal.stats()["bytes_sent"]` counts them. Every
compressor here runs as torch operations on the tensor's device (no host round trip for
CUDA tensors). Used by `CompressedGossip` (CHOCO-SGD's error feedback) and the decentralized
optimizers' `compression=` (docs/design.md §21).
"""
import math

import torch

__all__ = ["Compressor", "Identity", "Cast", "Int8", "Int4", "TopK", "RandomK", "by_name"]


def _bytes_of(t):
    return t.contiguous().view(torch.uint8).reshape(-1)


def _as(data, dtype):
    """`data` (uint8) viewed as `dtype`; copied first where its offset does not align
    (payloads gathered from several ranks lie back to back)."""
    if data.storage_offset() % torch.empty((), dtype=dtype).element_size():
        data = data.clone()
    return data.view(dtype)


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
        return numel * torch.empty((), dtype=dtype).element_size()

    def encode(self, x):
        return _bytes_of(x)

    def decode(self, payload, numel, dtype):
        return _as(payload, dtype).clone()


class Cast(Compressor):
    """Travels cast to `wire` (torch.float16 or torch.bfloat16): 2 bytes per element,
    round to nearest; lossless for tensors already of that dtype."""

    def __init__(self, wire):
        if wire not in (torch.float16, torch.bfloat16):
            raise ValueError(f"Cast: wire dtype must be torch.float16 or torch.bfloat16, got {wire}")
        self.wire = wire

    def payload_bytes(self, numel, dtype):
        return 2 * numel

    def encode(self, x):
        return _bytes_of(x.to(self.wire))

    def decode(self, payload, numel, dtype):
        return _as(payload, self.wire).to(dtype)

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
        c = self._chunks(x.numel())
        padded = torch.zeros(c * self.chunk, dtype=torch.float32, device=x.device)
        padded[:x.numel()] = x
        blocks = padded.view(c, self.chunk)
        scale = blocks.abs().amax(dim=1) / self.levels
        q = torch.round(blocks / torch.where(scale > 0, scale, 1.0)[:, None])
        q = q.clamp_(-self.levels, self.levels).to(torch.int8)  # a subnormal scale can round past
        return torch.cat([_bytes_of(scale), self._pack(q)])

    def decode(self, payload, numel, dtype):
        c = self._chunks(numel)
        scale = _as(payload[:4 * c], torch.float32)
        q = self._unpack(payload[4 * c:], c)
        return (q.to(torch.float32) * scale[:, None]).reshape(-1)[:numel].to(dtype)

    def _pack(self, q):
        return _bytes_of(q)

    def _unpack(self, data, c):
        return data.view(torch.int8).view(c, self.chunk)

    def __repr__(self):
        return f"{type(self).__name__}(chunk={self.chunk})"


class Int8(_Quantized):
    """8-bit quantization with a per-chunk scale: about 26 % of float32's bytes."""
    bits = 8


class Int4(_Quantized):
    """4-bit quantization (two values per byte) with a per-chunk scale: about 14 % of
    float32's bytes."""
    bits = 4

    def _pack(self, q):
        u = (q.reshape(-1) + 8).to(torch.uint8)  # -7..7 -> 1..15
        return u[0::2] | (u[1::2] << 4)

    def _unpack(self, data, c):
        both = torch.stack([data & 0xF, data >> 4], dim=1).reshape(-1)
        return (both.to(torch.int16) - 8).view(c, self.chunk)


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
        return self._k(numel) * (4 + torch.empty((), dtype=dtype).element_size())

    def encode(self, x):
        idx = self._indices(x, self._k(x.numel()))
        return torch.cat([_bytes_of(x[idx]), _bytes_of(idx.to(torch.int32))])

    def decode(self, payload, numel, dtype):
        k = self._k(numel)
        split = payload.numel() - 4 * k
        out = torch.zeros(numel, dtype=dtype, device=payload.device)
        out[_as(payload[split:], torch.int32).to(torch.int64)] = _as(payload[:split], dtype)
        return out

    def __repr__(self):
        return f"{type(self).__name__}({self.ratio})"


class TopK(_Sparse):
    """The k elements of largest magnitude (Stich et al. 2018; biased, contractive)."""

    def _indices(self, x, k):
        return torch.topk(x.abs(), k, sorted=False).indices


class RandomK(_Sparse):
    """k elements chosen uniformly at random (a generator of its own, seeded with `seed`)."""

    def __init__(self, ratio, seed=0):
        super().__init__(ratio)
        self.seed = seed
        self._gen = {}

    def _indices(self, x, k):
        gen = self._gen.get(x.device)
        if gen is None:
            gen = self._gen[x.device] = torch.Generator(device=x.device)
            gen.manual_seed(self.seed)
        return torch.randperm(x.numel(), generator=gen, device=x.device)[:k]


def by_name(spec):
    """A compressor from its name: "none", "fp16", "bf16", "int8", "int4", "topk:R",
    "randomk:R" (R the kept fraction, e.g. "topk:0.01"); a Compressor passes through.
    Raises ValueError for an unknown name."""
    if isinstance(spec, Compressor):
        return spec
    name, _, arg = str(spec).partition(":")
    simple = {"none": Identity, "fp16": lambda: Cast(torch.float16), "bf16": lambda: Cast(torch.bfloat16),
              "int8": Int8, "int4": Int4}
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
                     "(R in (0, 1]), or a shoal.torch.compression.Compressor")
