"""The CUDA plugin's kernels against torch on the GPU (skip without one): weighted and
uniform combine in every floating dtype, scaling, fusion pack/unpack with odd offsets."""
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}


@pytest.fixture(scope="module")
def table():
    from shoal import _gpu
    return _gpu.plugin()


@pytest.mark.parametrize("dtype", list(CODES))
@pytest.mark.parametrize("n", [1, 7, 1000, 1 << 20])
@pytest.mark.parametrize("k", [0, 1, 3])
def test_combine(table, dtype, n, k):
    from shoal import _gpu
    g = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(n, device="cuda", generator=g).to(dtype)
    srcs = [torch.randn(n, device="cuda", generator=g).to(dtype) for _ in range(k)]
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    stream = torch.cuda.current_stream().cuda_stream
    for uniform in (True, False):
        w = [0.25 + j for j in range(k)]
        out = torch.empty_like(x)
        _gpu.combine(table, out, x, srcs, w, uniform, 0.5, CODES[dtype], stream)
        if uniform:
            want = (x.to(acc) + sum(s.to(acc) for s in srcs)) / (k + 1)
        else:
            want = 0.5 * x.to(acc) + sum(wj * s.to(acc) for wj, s in zip(w, srcs))
        tol = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-6, torch.float64: 1e-12}[dtype]
        torch.testing.assert_close(out.to(acc), want.to(dtype).to(acc), rtol=tol, atol=tol)
    # In place (out aliases self), unaligned start: the scalar path.
    y = x[1:].clone()
    ref = (y.to(acc) + sum(s[1:].to(acc) for s in srcs)) / (k + 1)
    _gpu.combine(table, y, y, [s[1:] for s in srcs], [1.0] * k, True, 1.0, CODES[dtype], stream)
    torch.testing.assert_close(y.to(acc), ref.to(dtype).to(acc), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", list(CODES))
def test_scale(table, dtype):
    from shoal import _gpu
    x = torch.arange(1001, device="cuda").to(dtype)
    out = torch.empty_like(x)
    stream = torch.cuda.current_stream().cuda_stream
    _gpu.check(table.scale(out.data_ptr(), x.data_ptr(), 4.0, 1, CODES[dtype], x.numel(), stream))
    assert torch.equal(out, (x.double() / 4).to(dtype))
    _gpu.check(table.scale(out.data_ptr(), x.data_ptr(), 0.5, 0, CODES[dtype], x.numel(), stream))
    assert torch.equal(out, (x.double() * 0.5).to(dtype))


def test_pack_unpack(table):
    from shoal import _gpu
    stream = torch.cuda.current_stream().cuda_stream
    parts = [torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda") for n in [3, 16, 1000, 77, 1 << 16] * 20]
    offsets, at = [], 0
    for p in parts:
        offsets.append(at)
        at += p.numel() + 5  # odd gaps: unaligned parts take the byte path
    fused = torch.zeros(at, dtype=torch.uint8, device="cuda")
    _gpu.pack(table, fused, parts, offsets, False, stream)
    for p, o in zip(parts, offsets):
        assert torch.equal(fused[o:o + p.numel()], p)
    back = [torch.empty_like(p) for p in parts]
    _gpu.pack(table, fused, back, offsets, True, stream)
    assert all(torch.equal(a, b) for a, b in zip(parts, back))
