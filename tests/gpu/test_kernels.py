"""The CUDA plugin's kernels against torch (real plugin on the GPU, skip without one; fake
plugin on CPU tensors, always): weighted and uniform combine in every floating dtype,
scaling, fusion pack/unpack with odd offsets."""
import pytest

torch = pytest.importorskip("torch")

CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}


@pytest.fixture(scope="module", params=["real", "fake"])
def plugin(request):
    """(table, device, stream): the real plugin on cuda, or the fake one on the CPU (its
    legacy default stream, NULL, is the host: results are there when the call returns)."""
    if request.param == "real" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SHOAL_CUDA_PLUGIN", request.param)
        from shoal import _gpu
        table = _gpu.plugin()
    assert _gpu.is_fake(table.build) == (request.param == "fake"), table.build
    if request.param == "fake":
        return table, "cpu", 0
    return table, "cuda", torch.cuda.current_stream().cuda_stream


@pytest.mark.parametrize("dtype", list(CODES))
@pytest.mark.parametrize("n", [1, 7, 1000, 1 << 20])
@pytest.mark.parametrize("k", [0, 1, 3])
def test_combine(plugin, dtype, n, k):
    from shoal import _gpu
    table, dev, stream = plugin
    if dev == "cpu" and n > 1000:
        pytest.skip("large sizes test the GPU kernels' grid; the fake runs the core's CPU loops")
    g = torch.Generator(device=dev).manual_seed(n + k)
    x = torch.randn(n, device=dev, generator=g).to(dtype)
    srcs = [torch.randn(n, device=dev, generator=g).to(dtype) for _ in range(k)]
    acc = torch.float64 if dtype == torch.float64 else torch.float32
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
def test_scale(plugin, dtype):
    from shoal import _gpu
    table, dev, stream = plugin
    x = torch.arange(1001, device=dev).to(dtype)
    out = torch.empty_like(x)
    _gpu.check(table.scale(out.data_ptr(), x.data_ptr(), 4.0, 1, CODES[dtype], x.numel(), stream))
    assert torch.equal(out, (x.double() / 4).to(dtype))
    _gpu.check(table.scale(out.data_ptr(), x.data_ptr(), 0.5, 0, CODES[dtype], x.numel(), stream))
    assert torch.equal(out, (x.double() * 0.5).to(dtype))


def test_pack_unpack(plugin):
    from shoal import _gpu
    table, dev, stream = plugin
    parts = [torch.randint(0, 255, (n,), dtype=torch.uint8, device=dev) for n in [3, 16, 1000, 77, 1 << 16] * 20]
    offsets, at = [], 0
    for p in parts:
        offsets.append(at)
        at += p.numel() + 5  # odd gaps: unaligned parts take the byte path
    fused = torch.zeros(at, dtype=torch.uint8, device=dev)
    _gpu.pack(table, fused, parts, offsets, False, stream)
    for p, o in zip(parts, offsets):
        assert torch.equal(fused[o:o + p.numel()], p)
    back = [torch.empty_like(p) for p in parts]
    _gpu.pack(table, fused, back, offsets, True, stream)
    assert all(torch.equal(a, b) for a, b in zip(parts, back))
