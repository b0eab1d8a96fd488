"""MX formats: bit-exact against torchao's to_mx, fast path against the grid-enumerating reference,
packing, dequantization, storage bits and errors."""
import math

import pytest
import torch

from k3.ops.mx import (
    MX_FORMATS,
    dequantize_mx,
    dequantize_mx_reference,
    fake_quantize_mx,
    mx_bits_per_element,
    pack_fp4,
    quantize_mx,
    quantize_mx_reference,
    unpack_fp4,
)

FMTS = ["mxfp4", "mxfp8"]
NAN, INF = float("nan"), float("inf")


def torchao_to_mx(x, fmt, block_size=32):
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor", reason="torchao is the MX reference")
    dt = {"mxfp4": torch.float4_e2m1fn_x2, "mxfp8": torch.float8_e4m3fn}[fmt]
    scale, data = mx.to_mx(x.contiguous(), dt, block_size)
    return data.view(torch.uint8), scale.view(torch.uint8)


def assert_same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    bad = (a != b).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} mismatches, first at {bad[:5].tolist()}"


def nextafter(x, direction):
    return torch.nextafter(x, torch.full_like(x, direction))


def adversarial(fmt):
    """[rows, 32] fp32 blocks that poke at every special case of the scale and element rules."""
    f = MX_FORMATS[fmt]
    grid = torch.tensor(sorted({abs(v) for v, _ in _grid(f)}))
    mids = (grid[1:] + grid[:-1]) / 2  # ties between neighbours, exact in fp32
    rows = []

    def block(values, amax=None):
        b = torch.zeros(32)
        v = torch.as_tensor(values, dtype=torch.float32).flatten()[:31]
        b[1 : 1 + v.numel()] = v
        b[0] = amax if amax is not None else 2.0**f.emax  # pins the scale to X = 1
        rows.append(b)

    for lo in range(0, mids.numel(), 31):  # ties, just above, just below, negative
        m = mids[lo : lo + 31]
        for vals in (m, nextafter(m, INF), nextafter(m, -INF), -m):
            block(vals)
    top = f.max_normal
    # past the largest normal but below 2^(emax+1): the block's scale stays, these saturate
    block([top, nextafter(torch.tensor(top), INF), top * 1.1, (2 * 2.0**f.emax) * 0.999, -top * 1.1])
    for k in (-130, -127, -126, -125, -124, -120, -60, 0, 60, 100, 126, 127):  # power-of-two amax
        rows.append(torch.randn(32) * 2.0**k)
        rows.append(torch.full((32,), 2.0**k) * torch.tensor([1.0, -1.0]).repeat(16))
    rows.append(torch.zeros(32))
    rows.append(-torch.zeros(32))
    rows.append(torch.full((32,), 1e-45))  # smallest fp32 subnormal
    rows.append(torch.linspace(-1e-38, 1e-38, 32))  # subnormal amax
    big = torch.randn(32) * 1e-3
    big[7] = 3.0e38  # one huge value: the rest flush to zero
    rows.append(big)
    big = torch.randn(32)
    big[31] = -1e6
    rows.append(big)
    rows.append(torch.full((32,), torch.finfo(torch.float32).max))
    for special in ([NAN], [-NAN], [INF], [-INF], [INF, -INF], [NAN, INF], [-INF, NAN, 1.0, -2.0]):
        b = torch.randn(32)
        b[: len(special)] = torch.tensor(special)
        rows.append(b[torch.randperm(32)])
    return torch.stack(rows)


def _grid(f):
    from k3.ops.mx.formats import _finite_grid

    return _finite_grid(f)


def finite_lanes(x, scales, block_size=32):
    """Mask of elements whose code means something: all of them except inside NaN blocks."""
    return (scales != 0xFF).repeat_interleave(block_size, -1).reshape(x.shape)


# ---------------------------------------------------------------------------------------------
# bit-exact against torchao


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("scale", [1e-30, 1e-3, 1.0, 7.0, 1e4, 1e30])
def test_random_matches_torchao(fmt, scale):
    x = torch.randn(64, 512) * scale
    codes, scales = quantize_mx(x, fmt, packed=True)
    ref_codes, ref_scales = torchao_to_mx(x, fmt)
    assert_same_bits(scales, ref_scales)
    assert_same_bits(codes, ref_codes)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adversarial_matches_torchao(fmt, dtype):
    x = adversarial(fmt).to(dtype)
    codes, scales = quantize_mx(x, fmt, packed=True)
    ref_codes, ref_scales = torchao_to_mx(x, fmt)
    assert_same_bits(scales, ref_scales)
    assert_same_bits(codes, ref_codes)
    assert (scales == 0xFF).sum() == 4 and (scales == 0).any()  # the NaN blocks and a zero block


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("block_size", [16, 64])
def test_other_block_sizes_and_shapes_match_torchao(fmt, block_size):
    x = torch.randn(3, 5, 256) * 10
    codes, scales = quantize_mx(x, fmt, block_size, packed=True)
    ref_codes, ref_scales = torchao_to_mx(x, fmt, block_size)
    assert scales.shape == (3, 5, 256 // block_size)
    assert_same_bits(scales, ref_scales)
    assert_same_bits(codes, ref_codes)


def test_chunk_boundaries_match_torchao(monkeypatch):
    import k3.ops.mx.formats as F

    monkeypatch.setattr(F, "_CHUNK_ELEMS", 96)  # 3 blocks per chunk: many chunks, worker threads
    x = adversarial("mxfp4")[:40].reshape(10, 128)
    for fmt in FMTS:
        codes, scales = quantize_mx(x, fmt, packed=True)
        ref_codes, ref_scales = torchao_to_mx(x, fmt)
        assert_same_bits(scales, ref_scales)
        assert_same_bits(codes, ref_codes)
        out = dequantize_mx(codes, scales, fmt)
        ref = dequantize_mx_reference(unpack_fp4(codes) if fmt == "mxfp4" else codes, scales, fmt)
        assert torch.equal(out.isnan(), ref.isnan())
        assert_same_bits(out.nan_to_num().view(torch.int32), ref.nan_to_num().view(torch.int32))


def test_fp8_clamp_fallback_for_non_saturating_casts(monkeypatch):
    """Older torch casts did not saturate; the explicit clamp path must give the same bytes."""
    import k3.ops.mx.formats as F

    x = adversarial("mxfp8")
    expected = quantize_mx(x, "mxfp8")
    monkeypatch.setattr(F, "_fp8_cast_saturates", lambda: False)
    got = quantize_mx(x, "mxfp8")
    assert_same_bits(got[0], expected[0])
    assert_same_bits(got[1], expected[1])


# ---------------------------------------------------------------------------------------------
# fast path against the reference


@pytest.mark.parametrize("fmt", FMTS)
def test_fast_matches_reference_on_adversarial_blocks(fmt):
    x = adversarial(fmt)
    codes, scales = quantize_mx(x, fmt)
    ref_codes, ref_scales = quantize_mx_reference(x, fmt)
    assert_same_bits(scales, ref_scales)
    keep = finite_lanes(x, scales)
    assert_same_bits(codes[keep], ref_codes[keep])


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fast_matches_reference_random(fmt, dtype):
    x = (torch.randn(8, 128) * torch.logspace(-4, 4, 8).unsqueeze(-1)).to(dtype)
    codes, scales = quantize_mx(x, fmt)
    ref_codes, ref_scales = quantize_mx_reference(x, fmt)
    assert_same_bits(scales, ref_scales)
    assert_same_bits(codes, ref_codes)


def test_every_e2m1_rounding_decision():
    """Sweep |y| over [0, 9] in steps of 1/256 with the scale pinned to 1 (ties land on the grid)."""
    y = torch.arange(0, 9 * 256 + 1, dtype=torch.float32) / 256
    y = torch.cat([y, -y, nextafter(y, INF), nextafter(y, -INF)])
    y = y[: y.numel() // 31 * 31].reshape(-1, 31)
    x = torch.cat([torch.full((y.shape[0], 1), 4.0), y], dim=1)  # amax 4 -> X = 2^(2-2) = 1
    x = torch.where(x.abs() > 7.99, x.sign() * 7.99, x)  # keep amax in [4, 8) so X stays 1
    codes, scales = quantize_mx(x, "mxfp4")
    assert (scales == 127).all()
    ref_codes, _ = quantize_mx_reference(x, "mxfp4")
    assert_same_bits(codes, ref_codes)
    # spot-check the tie rule by hand: 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2, 2.5->2, 3.5->4, 5->4
    ties = torch.tensor([[4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0] + [0.0] * 23])
    assert quantize_mx(ties, "mxfp4")[0][0, 1:9].tolist() == [0, 2, 2, 4, 4, 6, 6, 7]


# ---------------------------------------------------------------------------------------------
# packing, dequantization, bits


def test_pack_unpack_round_trip_and_nibble_order():
    codes = torch.randint(0, 16, (4, 6, 64), dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.shape == (4, 6, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_fp4(packed), codes)
    assert pack_fp4(torch.tensor([0x1, 0xA], dtype=torch.uint8)).item() == 0xA1  # low nibble first
    x = torch.randn(16, 128)
    unpacked, s1 = quantize_mx(x, "mxfp4")
    packed, s2 = quantize_mx(x, "mxfp4", packed=True)
    assert torch.equal(pack_fp4(unpacked), packed) and torch.equal(s1, s2)


@pytest.mark.parametrize("fmt", FMTS)
def test_dequantize_matches_reference(fmt):
    x = adversarial(fmt)
    codes, scales = quantize_mx(x, fmt)
    out = dequantize_mx(codes, scales, fmt)
    ref = dequantize_mx_reference(codes, scales, fmt)
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    keep = ~torch.isnan(out)
    assert_same_bits(out[keep].view(torch.int32), ref[keep].view(torch.int32))  # signed zeros too
    if fmt == "mxfp4":
        assert torch.equal(dequantize_mx(pack_fp4(codes), scales, fmt).view(torch.int32), out.view(torch.int32))


@pytest.mark.parametrize("fmt", FMTS)
def test_dequantize_matches_torchao(fmt):
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor", reason="torchao is the MX reference")
    x = torch.randn(32, 256) * 3
    dt = {"mxfp4": torch.float4_e2m1fn_x2, "mxfp8": torch.float8_e4m3fn}[fmt]
    scale, data = mx.to_mx(x, dt, 32)
    theirs = mx.to_dtype(data, scale, dt, 32, torch.float32)
    ours = dequantize_mx(data.view(torch.uint8), scale, fmt)  # float8_e8m0fnu scales accepted
    assert_same_bits(ours.view(torch.int32), theirs.view(torch.int32))


@pytest.mark.parametrize("fmt", FMTS)
def test_dequantize_values_and_error_bound(fmt):
    f = MX_FORMATS[fmt]
    x = torch.randn(64, 256)
    codes, scales = quantize_mx(x, fmt)
    xq = dequantize_mx(codes, scales, fmt)
    X = torch.exp2(scales.float() - 127).repeat_interleave(32, -1)
    assert ((xq / X).abs() <= f.max_normal).all()
    # relative step of the element grid is 2^-mbits; saturation costs at most (2^(emax+1) - max)X
    err = (xq - x).abs()
    bound = torch.maximum(x.abs() * 2.0 ** -(f.mbits + 1), X * 2.0 ** (1 - f.bias - f.mbits - 1))
    bound = torch.maximum(bound, (2.0 ** (f.emax + 1) - f.max_normal) * X)
    assert (err <= bound).all()
    fq = fake_quantize_mx(x, fmt)
    assert torch.equal(fq, xq) and torch.equal(fake_quantize_mx(fq, fmt), fq)  # idempotent
    assert fake_quantize_mx(x.bfloat16(), fmt).dtype == torch.bfloat16
    assert dequantize_mx(codes, scales, fmt, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_documented_special_cases():
    x = torch.zeros(6, 32)
    x[1] = 2.0**-125  # scale code 0, but torchao divides by 2^-126: decodes to half
    x[5] = 2.0**-124  # scale code 1: exact again
    x[2, 3] = INF
    x[2, 4] = -INF
    x[3, 0] = NAN
    x[4] = -0.0
    codes, scales = quantize_mx(x, "mxfp4")
    assert scales.flatten().tolist() == [0, 0, 253, 0xFF, 0, 1]
    assert codes[0].eq(0).all() and codes[4].eq(8).all()  # zero block; negative zeros keep the sign
    out = dequantize_mx(codes, scales, "mxfp4")
    assert out[1].eq(2.0**-126).all() and out[5].eq(2.0**-124).all()
    assert out[2, 3] == INF and out[2, 4] == -INF  # +-6 * 2^126 overflows fp32
    assert torch.isnan(out[3]).all()
    c8, s8 = quantize_mx(x, "mxfp8")
    assert s8[2].item() == 247 and c8[2, 3].item() == 0x7E and c8[2, 4].item() == 0xFE
    assert c8[3, 0].item() == 0x7F and torch.isnan(dequantize_mx(c8, s8, "mxfp8")[3]).all()


@pytest.mark.parametrize("fmt,bits", [("mxfp4", 4.25), ("mxfp8", 8.25)])
def test_bits_per_element_from_storage(fmt, bits):
    x = torch.randn(128, 1024)
    codes, scales = quantize_mx(x, fmt, packed=True)
    stored_bits = 8 * (codes.numel() * codes.element_size() + scales.numel() * scales.element_size())
    assert stored_bits / x.numel() == bits == mx_bits_per_element(fmt, 32)
    assert mx_bits_per_element("mxfp4", 16) == 4.5


def test_non_contiguous_and_empty_inputs():
    x = torch.randn(64, 96)
    for fmt in FMTS:
        a = quantize_mx(x.t(), fmt)
        b = quantize_mx(x.t().contiguous(), fmt)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        codes, scales = quantize_mx(torch.empty(0, 64), fmt, packed=True)
        assert codes.shape == (0, 64 if fmt == "mxfp8" else 32) and scales.shape == (0, 2)
        assert dequantize_mx(codes, scales, fmt).shape == (0, 64)
        for shape in ((0, 64), (3, 0), (2, 0, 32)):  # fake quant of an empty batch (an EP rank given no rows)
            assert fake_quantize_mx(torch.empty(shape), fmt).shape == shape


# ---------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: quantize_mx(torch.randn(4, 48), "mxfp4"), "multiple of block_size 32.*pad"),
        (lambda: quantize_mx(torch.randint(0, 5, (4, 32)), "mxfp4"), "float32, bfloat16 or float16"),
        (lambda: quantize_mx(torch.randn(4, 32, dtype=torch.float64), "mxfp8"), "x.float"),
        (lambda: quantize_mx(torch.randn(4, 32), "mxfp6"), "unsupported MX format"),
        (lambda: quantize_mx(torch.randn(4, 32), "mxfp4", 24), "power of two"),
        (lambda: quantize_mx(torch.randn(4, 32), "mxfp4", True), "block_size"),
        (lambda: quantize_mx(torch.tensor(1.0), "mxfp4"), "at least one dimension"),
        (lambda: quantize_mx([1.0] * 32, "mxfp4"), "torch.Tensor"),
        (lambda: dequantize_mx(torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8), "mxfp8"),
         "does not match"),
        (lambda: dequantize_mx(torch.zeros(4, 32, dtype=torch.int32), torch.zeros(4, 1, dtype=torch.uint8), "mxfp4"),
         "uint8"),
        (lambda: dequantize_mx(torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(4, 1), "mxfp4"), "E8M0"),
        (lambda: dequantize_mx(torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8), "mxfp4",
                               dtype=torch.int8), "floating"),
        (lambda: dequantize_mx([0] * 32, torch.zeros(1, dtype=torch.uint8), "mxfp8"), "torch.Tensors"),
        (lambda: dequantize_mx(torch.full((1, 32), 200, dtype=torch.uint8), torch.zeros(1, 1, dtype=torch.uint8),
                               "mxfp4"), "4-bit"),  # was an IndexError from the lookup table
        (lambda: dequantize_mx(torch.zeros(1, 32, dtype=torch.uint8), torch.tensor(3, dtype=torch.uint8), "mxfp4"),
         "need a last dim"),
        (lambda: pack_fp4(torch.zeros(3, dtype=torch.uint8)), "even"),
        (lambda: pack_fp4(torch.full((2,), 16, dtype=torch.uint8)), "0..15"),
    ],
)
def test_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_reference_is_not_trivially_the_fast_path():
    """Guard that the reference really enumerates the grid: check a few codes by hand."""
    x = torch.tensor([[256.0, 1.0, 0.0017, 300.0, 449.0, -3.25, 2.0**-10, 2.0**-10 * 3] + [0.0] * 24])
    codes, scales = quantize_mx_reference(x, "mxfp8")
    assert scales.item() == 127  # floor(log2 256) - 8 = 0
    # 1.0 = 0.0111.000; 0.0017 -> subnormal 1*2^-9 (0x01); 300 -> 288 = 0.1111.001 (0x79) ... RNE
    # 449 -> saturates to 448 = 0x7E; -3.25 = 1.1000.101; 2^-10 ties to 0; 3*2^-10 ties to 2*2^-9
    assert codes[0, :8].tolist() == [0x78, 0x38, 0x01, 0x79, 0x7E, 0xC5, 0x00, 0x02]
    assert math.isclose(dequantize_mx_reference(codes, scales, "mxfp8")[0, 3].item(), 288.0)
