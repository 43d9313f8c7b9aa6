"""Gossip compressors (shoal.compression, also shoal.torch.compression) in one process:
round trips (bit-exact for the lossless ones, within the stated bound for the lossy ones)
for every compressor and floating dtype, on torch tensors and numpy arrays (the same
payload bytes for the same values), payload sizes, names; and compressed gossip's edge
bookkeeping. The multi-rank checks run tests/workers/compressed_gossip.py (torch; numpy
through shoal.keras in tests/workers/tf_ops.py)."""
import math

import numpy as np
import pytest
import torch

from conftest import Job, worker_checks
from shoal.torch import compression as C
from shoal.torch.compressed_gossip import CompressedGossip

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
COMPRESSORS = ["none", "fp16", "bf16", "int8", "int4", "topk:0.1", "randomk:0.25"]


def sample(dtype, n=1000):
    return (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", COMPRESSORS)
def test_round_trip(spec, dtype):
    c = C.by_name(spec)
    x = sample(dtype)
    payload = c.encode(x)
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    assert payload.numel() == c.payload_bytes(x.numel(), dtype)
    y = c.decode(payload, x.numel(), dtype)
    assert y.dtype == dtype and y.shape == x.shape
    if spec == "none" or (spec == "fp16" and dtype == torch.float16) or (spec == "bf16" and dtype == torch.bfloat16):
        assert torch.equal(y, x)  # lossless: bit-exact
    elif spec in ("fp16", "bf16"):
        eps = {"fp16": 2 ** -11, "bf16": 2 ** -8}[spec]  # half an ulp, relative
        assert torch.all((y.double() - x.double()).abs() <= eps * x.double().abs() + 1e-30)
    elif spec.startswith("int"):
        levels = 127 if spec == "int8" else 7
        xd = x.double().reshape(-1)
        for start in range(0, xd.numel(), 256):  # at most half a step of each chunk's scale
            chunk = xd[start:start + 256]
            bound = chunk.abs().max() / levels / 2 * (1 + 1e-6) + _rounding(dtype, chunk)
            assert (y.double()[start:start + 256] - chunk).abs().max() <= bound
    else:
        k = math.ceil(float(spec.split(":")[1]) * x.numel())
        kept = y != 0
        assert kept.sum() <= k and torch.equal(y[kept], x[kept])  # values kept exactly, the rest 0
        if spec.startswith("topk"):
            assert y.abs().max() == x.abs().max()
            dropped = x[~kept].abs()
            assert dropped.numel() == 0 or dropped.max() <= x[kept].abs().min()


NUMPY_DTYPES = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}
try:  # numpy's bfloat16 (TensorFlow's ml_dtypes), where installed
    import ml_dtypes
    NUMPY_DTYPES[torch.bfloat16] = ml_dtypes.bfloat16
except ImportError:
    pass


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", COMPRESSORS)
def test_numpy_arrays_compress_as_torch_tensors(spec, dtype):
    """The same compressor on a numpy array of the same values: the same payload size,
    the same bytes (but sparse index order and random-k's draw) and the same decoded values."""
    if dtype not in NUMPY_DTYPES:
        pytest.skip("numpy has no bfloat16 here (ml_dtypes, which TensorFlow installs, is missing)")
    c = C.by_name(spec)
    x = sample(dtype)
    xn = x.double().numpy().astype(NUMPY_DTYPES[dtype])
    assert torch.equal(torch.from_numpy(xn.astype(np.float64)), x.double())  # the same values
    pn, pt = c.encode(xn), c.encode(x)
    assert isinstance(pn, np.ndarray) and pn.dtype == np.uint8 and pn.ndim == 1
    assert pn.shape[0] == pt.numel() == c.payload_bytes(xn.shape[0], xn.dtype)
    yn = c.decode(pn, xn.shape[0], xn.dtype)
    assert isinstance(yn, np.ndarray) and yn.dtype == xn.dtype and yn.shape == xn.shape
    yn64 = torch.from_numpy(yn.astype(np.float64))
    if spec.startswith("randomk"):
        kept = yn64 != 0
        assert 0 < kept.sum() <= pt.numel() and torch.equal(yn64[kept], x.double()[kept])
        return
    yt64 = c.decode(pt, x.numel(), dtype).double()
    if spec.startswith("topk"):  # ties in |x| may be broken differently: the same magnitudes kept
        kept = yn64 != 0
        assert torch.equal(yn64[kept], x.double()[kept])
        assert torch.equal(yn64.abs().sort().values, yt64.abs().sort().values)
        return
    assert np.array_equal(pn, pt.numpy()), spec  # byte for byte
    assert torch.equal(yn64, yt64)


def _rounding(dtype, chunk):
    # the result is rounded once more to the tensor's dtype
    return chunk.abs().max() * {torch.float16: 2 ** -11, torch.bfloat16: 2 ** -8}.get(dtype, 2 ** -24)


def test_int8_and_int4_payloads_are_a_quarter_and_an_eighth():
    n = 1 << 16
    assert C.Int8().payload_bytes(n, torch.float32) / (4 * n) == pytest.approx(0.25 + 1 / 256)
    assert C.Int4().payload_bytes(n, torch.float32) / (4 * n) == pytest.approx(0.125 + 1 / 256)
    assert C.TopK(0.01).payload_bytes(n, torch.float32) == math.ceil(0.01 * n) * 8


def test_zero_chunks_and_odd_lengths_round_trip():
    for c in (C.Int8(chunk=4), C.Int4(chunk=4)):
        x = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, -2.0, 0.5])
        y = c.decode(c.encode(x), x.numel(), x.dtype)
        assert torch.equal(y[:4], torch.zeros(4)) and y.shape == x.shape
        assert (y - x).abs().max() <= 2.0 / c.levels / 2 + 1e-7


@pytest.mark.parametrize("bad", ["int7", "topk", "topk:0", "topk:1.5", "randomk:x", "fp32"])
def test_unknown_names_are_refused(bad):
    with pytest.raises(ValueError, match="unknown compressor|ratio must be in"):
        C.by_name(bad)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        C.Int8(chunk=3)
    with pytest.raises(ValueError):
        C.Cast(torch.float32)
    with pytest.raises(ValueError):
        CompressedGossip("int8", gamma=0)


def test_destinations_sent_different_updates_are_refused():
    g = CompressedGossip("int8", name="cg")
    flat = torch.ones(8)
    shared = g._copy_for([1, 2], flat)  # a static pair of destinations: one copy
    assert g._copy_for([1, 2], flat) is shared
    own = g._copy_for([1], flat)  # then one of them alone: its own copy from then on
    assert own is not shared and torch.equal(own, shared) and g._sent[2] is shared
    with pytest.raises(ValueError, match="different updates"):
        g._copy_for([1, 2], flat)


@pytest.mark.parametrize("check", worker_checks("compressed_gossip.py"))
@pytest.mark.parametrize("ranks", [2, 4])
def test_compressed_gossip(ranks, check):
    Job(ranks, "compressed_gossip.py").check(check)
