"""MX block formats (OCP Microscaling Formats v1.0): MXFP4 (E2M1) and MXFP8 (E4M3), E8M0 scales.

A block of `block_size` (32 in the spec) consecutive elements along the last dim shares one scale
X = 2^(floor(log2(max_i |V_i|)) - emax_elem) (spec sec. 6.3; emax_elem 2 for E2M1, 8 for E4M3), stored as an
E8M0 byte (2^(code - 127), 0xFF = NaN). Elements are V_i / X rounded to nearest, ties to even, and clamped to the
largest normal (6 or 448). Storage: scales uint8 [..., n / block_size]; mxfp4 codes uint8 [..., n], one E2M1
code per element (bit 3 the sign), or two per byte with `packed=True` / `pack_fp4` (element 2i in the low
nibble); mxfp8 codes uint8 holding the E4M3 bits (`codes.view(torch.float8_e4m3fn)`).

Invariant: bit-exact with torchao 0.18 `to_mx(..., ScaleCalculationMode.FLOOR)` (tested), including where
torchao departs from the spec on tiny, NaN and Inf blocks (docs/quantization.md, "Special values and what we
match bit-exactly"). The fast path works through cache-sized chunks of blocks on a few worker threads; the
`*_reference` functions enumerate the element grid in Python and are the obviously-correct twins.
"""
from __future__ import annotations

import math
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache

import torch

__all__ = [
    "MX_FORMATS",
    "quantize_mx",
    "dequantize_mx",
    "fake_quantize_mx",
    "pack_fp4",
    "unpack_fp4",
    "mx_bits_per_element",
    "quantize_mx_reference",
    "dequantize_mx_reference",
]

E8M0_BIAS = 127
E8M0_NAN = 0xFF
_SUPPORTED_INPUT = (torch.float32, torch.bfloat16, torch.float16)
# Blocks per unit of work: 262,143 elements (1 MiB of fp32). Above torch's 32,768-element intra-op grain, so each
# op may also split across threads; below it, per-op dispatch dominated (docs/quantization.md, "Fast path").
_CHUNK_ELEMS = 262143


@dataclass(frozen=True)
class MXFormat:
    """One MX element format: `ebits` exponent bits, `mbits` mantissa bits, exponent `bias`."""

    name: str
    element: str
    ebits: int
    mbits: int
    bias: int
    emax: int  # exponent of the largest normal, the spec's emax_elem
    max_normal: float
    has_nan: bool  # E4M3 keeps S.1111.111 for NaN; E2M1 has no special values

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits


MX_FORMATS = {
    "mxfp4": MXFormat("mxfp4", "E2M1", ebits=2, mbits=1, bias=1, emax=2, max_normal=6.0, has_nan=False),
    "mxfp8": MXFormat("mxfp8", "E4M3", ebits=4, mbits=3, bias=7, emax=8, max_normal=448.0, has_nan=True),
}


# ----------------------------------------------------------------------------------------------
# validation


def _format(fmt) -> MXFormat:
    if isinstance(fmt, MXFormat):
        return fmt
    if not isinstance(fmt, str) or fmt.lower() not in MX_FORMATS:
        raise ValueError(f"unsupported MX format {fmt!r}; use one of {sorted(MX_FORMATS)}")
    return MX_FORMATS[fmt.lower()]


def _check_block_size(block_size) -> int:
    ok = isinstance(block_size, int) and not isinstance(block_size, bool)
    if not ok or block_size < 2 or block_size > 1024 or block_size & (block_size - 1):
        raise ValueError(
            f"unsupported block_size {block_size!r}: use a power of two in [2, 1024] "
            "(the OCP MX v1.0 formats use 32)"
        )
    return block_size


def _check_input(x, block_size: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"quantize_mx expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _SUPPORTED_INPUT:
        raise ValueError(
            f"quantize_mx needs a float32, bfloat16 or float16 tensor, got {x.dtype}; "
            "cast it with x.float() first (float64 would be rounded twice)"
        )
    if x.dim() == 0:
        raise ValueError("quantize_mx needs at least one dimension; blocks run along the last dim")
    n = x.shape[-1]
    if n % block_size:
        raise ValueError(
            f"last dim {n} of shape {tuple(x.shape)} is not a multiple of block_size {block_size}; "
            f"pad it with zeros to {-(-n // block_size) * block_size} (zeros never change a "
            "block's scale) and slice the result"
        )


def _scale_codes(scales: torch.Tensor) -> torch.Tensor:
    if scales.dtype == torch.float8_e8m0fnu:
        return scales.view(torch.uint8)
    if scales.dtype != torch.uint8:
        raise ValueError(f"scales must be uint8 E8M0 codes (or float8_e8m0fnu), got {scales.dtype}")
    return scales


# ----------------------------------------------------------------------------------------------
# fast path


@lru_cache(maxsize=None)
def _fp8_cast_saturates() -> bool:
    """Whether this torch's fp32 -> float8_e4m3fn cast clamps overflow and Inf to +-448."""
    probe = torch.tensor([500.0, -500.0, float("inf"), float("-inf")]).to(torch.float8_e4m3fn)
    return probe.view(torch.uint8).tolist() == [0x7E, 0xFE, 0x7E, 0xFE]


def _block_scales(a: torch.Tensor, f: MXFormat):
    """a: |x| as [B, k] fp32 -> (E8M0 codes [B] uint8, 1/divisor [B, 1] fp32, any NaN, any Inf).

    With e the fp32 exponent field of amax: code = max(e - emax_elem, 0), i.e. the unbiased
    floor(log2 amax) - emax clamped at -127, and 0xFF where amax is NaN. torchao divides by
    max(2^(code-127), 2^-126), so 1/divisor = 2^(min(127 - e + emax, 126)), built from its bits;
    NaN blocks get 1/divisor = 0 (torchao divides by +Inf), making finite elements signed zeros.
    """
    amax = a.amax(-1)
    e = amax.view(torch.int32) >> 23  # amax >= 0 (or +NaN), so no sign bit
    code = (e - f.emax).clamp_(min=0)
    inv = (254 + f.emax - e).clamp_(max=253).bitwise_left_shift_(23)
    has_nan = has_inf = False
    if int(e.max()) == 0xFF:  # Inf or NaN in some block: rare, so checked once per chunk
        nan = torch.isnan(amax)
        has_nan, has_inf = bool(nan.any()), bool(torch.isinf(amax).any())
        code.masked_fill_(nan, E8M0_NAN)
        inv.masked_fill_(nan, 0)
    return code.to(torch.uint8), inv.view(torch.float32).unsqueeze(-1), has_nan, has_inf


def _e2m1_magnitude(a: torch.Tensor) -> torch.Tensor:
    """a: |y| fp32 in [0, 8] (clobbered) -> int32 E2M1 magnitude codes 0..7, nearest-even.

    For a in binade e (2^e <= a < 2^(e+1)), adding M = 2^(max(e, 0) + 22) rounds a to the E2M1
    spacing 2^(max(e, 0) - 1) in one correctly rounded fp32 add; the bit distance from M counts
    those steps: code = bits(M + a) - bits(M) + 2*max(e, 0), clamped to 7 (= 6.0, saturation).
    """
    code = (a.view(torch.int32) & 0x7F800000).clamp_(min=0x3F800000)  # exponent field, >= 1.0's
    steps = (code - 0x3F800000).bitwise_right_shift_(22)  # 2*max(e, 0)
    code += 22 << 23  # bits of M
    code.view(torch.float32).add_(a)
    return code.add_(steps, alpha=-((1 << 22) - 1)).sub_(0x4A800000).clamp_(max=7)


def _e2m1_chunk(xc: torch.Tensor, f: MXFormat, out: torch.Tensor, pack: bool) -> torch.Tensor:
    """xc: [B, k] fp32 -> E2M1 codes written into out ([B, k], or [B, k/2] packed); returns scales."""
    a = xc.abs()
    scales, inv, has_nan, has_inf = _block_scales(a, f)
    if has_nan:
        # Signs and NaN codes come from y = x / X itself (Inf / Inf gives the platform's default
        # NaN); NaN lanes get torchao's integer rounding: ((m - (126 << 23) + ...) >> 22) & 0xFF.
        y = xc * inv
        yb = y.view(torch.int32)
        sign = (yb >> 28).bitwise_and_(8)
        m = yb & 0x7FFFFFFF
        nan_lane = m > 0x7F800000
        nan_code = ((m - (126 << 23) + 0x1FFFFF + ((m >> 22) & 1)) >> 22) & 0xFF
        a = y.abs_()
    else:
        a.mul_(inv)  # |x| * 2^-k == |x * 2^-k| exactly
        sign = (xc.view(torch.int32) >> 28).bitwise_and_(8)
    if has_nan or has_inf:
        a.clamp_(max=8.0)  # Inf -> 8 -> saturates; finite blocks already have |y| < 8
    code = _e2m1_magnitude(a)
    if has_nan:
        code = torch.where(nan_lane, nan_code, code)
    code = code.bitwise_or_(sign).to(torch.uint8)
    if pack:  # little-endian int16 view: byte 0 = element 2i, byte 1 = element 2i+1
        w = code.view(torch.int16)
        out.copy_(w.bitwise_right_shift(4).bitwise_or_(w))  # low byte = lo | hi << 4
    else:
        out.copy_(code)
    return scales


def _e4m3_chunk(xc: torch.Tensor, f: MXFormat, out: torch.Tensor) -> torch.Tensor:
    """xc: [B, k] fp32 -> E4M3 bit patterns written into out (uint8 [B, k]); returns scales."""
    a = xc.abs()
    scales, inv, _, _ = _block_scales(a, f)
    y = torch.mul(xc, inv, out=a)  # exact: inv is a power of two (0 for NaN blocks)
    if y.device.type != "cpu" or not _fp8_cast_saturates():  # the probe only speaks for CPU
        y.clamp_(-f.max_normal, f.max_normal)  # clamp keeps NaN
    out.view(torch.float8_e4m3fn).copy_(y)  # RNE, NaN -> S.1111.111
    return scales


def _parallel_chunks(work, nb: int, step: int, device: torch.device) -> None:
    """Run work(i0, i1) over block ranges. On CPU a few worker threads take chunk groups dynamically
    (torch releases the GIL inside ops, so the workers overlap); see _CHUNK_ELEMS for the chunk size."""
    if device.type != "cpu":
        work(0, nb)  # one chunk: device kernels want big launches
        return
    threads = torch.get_num_threads()
    group = 4 * step
    nested = threading.current_thread().name.startswith("k3-mx")  # never wait on our own pool
    if threads <= 1 or nb <= group or nested:
        for i in range(0, nb, step):
            work(i, min(i + step, nb))
        return

    def task(g0):
        for i in range(g0, min(g0 + group, nb), step):
            work(i, min(i + step, nb))

    for _ in _executor(threads).map(task, range(0, nb, group)):
        pass  # re-raises a worker's exception here


_POOL: tuple[int, int, ThreadPoolExecutor] | None = None


def _executor(threads: int) -> ThreadPoolExecutor:
    """One pool per process and thread count (a forked child must not reuse its parent's)."""
    global _POOL
    if _POOL is None or _POOL[:2] != (os.getpid(), threads):
        _POOL = (os.getpid(), threads, ThreadPoolExecutor(threads, thread_name_prefix="k3-mx"))
    return _POOL[2]


def quantize_mx(x: torch.Tensor, fmt: str, block_size: int = 32, *, packed: bool = False):
    """Quantize along the last dim into MX blocks.

    x: [..., n] float32/bfloat16/float16, n a multiple of block_size.
    Returns (codes, scales):
      codes: uint8 [..., n] (mxfp4: E2M1 code 0..15 per element; mxfp8: E4M3 bit pattern), or
             [..., n / 2] for mxfp4 with packed=True (low nibble = even element); packed is a
             no-op for mxfp8, whose codes are already one byte each.
      scales: uint8 E8M0 codes [..., n / block_size].
    Bit-exact with torchao `to_mx` (FLOOR scale mode); see the module docstring for specials.
    """
    f = _format(fmt)
    block_size = _check_block_size(block_size)
    _check_input(x, block_size)
    shape = x.shape
    with torch.no_grad():
        xb = x.detach().float().contiguous().view(-1, block_size)
        nb = xb.shape[0]
        scales = torch.empty(nb, dtype=torch.uint8, device=x.device)
        pack = packed and f.name == "mxfp4" and sys.byteorder == "little"
        width = block_size // 2 if pack else block_size
        codes = torch.empty(nb, width, dtype=torch.uint8, device=x.device)

        def work(i0: int, i1: int) -> None:
            xc, out = xb[i0:i1], codes[i0:i1]
            if f.name == "mxfp8":
                scales[i0:i1] = _e4m3_chunk(xc, f, out)
            else:
                scales[i0:i1] = _e2m1_chunk(xc, f, out, pack)

        _parallel_chunks(work, nb, max(1, _CHUNK_ELEMS // block_size), x.device)
    lead = shape[:-1]
    codes = codes.view(*lead, shape[-1] * width // block_size)
    if packed and f.name == "mxfp4" and not pack:  # big-endian hosts: pack the slow way
        codes = pack_fp4(codes)
    return codes, scales.view(*lead, shape[-1] // block_size)


@lru_cache(maxsize=None)
def _e2m1_values(device: torch.device) -> torch.Tensor:
    return _grid_values(MX_FORMATS["mxfp4"]).to(device=device, dtype=torch.float32)


@lru_cache(maxsize=None)
def _e2m1_pair_values(device: torch.device) -> torch.Tensor:
    """[256, 2] fp32: the two E2M1 values of every packed byte (low nibble first)."""
    lut = _grid_values(MX_FORMATS["mxfp4"]).float()
    b = torch.arange(256)
    return torch.stack([lut[b & 15], lut[b >> 4]], dim=-1).to(device)


def _scale_values(s: torch.Tensor) -> torch.Tensor:
    """E8M0 codes -> fp32 2^(s-127), built from bits (exact; code 0 is the subnormal 2^-127)."""
    bits = s.to(torch.int32) << 23
    bits = torch.where(s == 0, 0x00400000, bits)
    bits = torch.where(s == E8M0_NAN, 0x7FC00000, bits)
    return bits.view(torch.float32)


def dequantize_mx(codes: torch.Tensor, scales: torch.Tensor, fmt: str, block_size: int = 32,
                  dtype: torch.dtype = torch.float32, _trusted: bool = False) -> torch.Tensor:
    """Decode MX blocks: x = X * P.

    codes: uint8 [..., n] (or [..., n / 2] packed mxfp4; detected from the shapes; mxfp8 also
    accepts torch.float8_e4m3fn); scales: uint8 (or float8_e8m0fnu) E8M0 [..., n / block_size].
    Returns dtype [..., n]. Blocks with scale 0xFF and E4M3 NaN codes decode to NaN; products are
    formed in fp32 (overflow past fp32 gives Inf) and then cast to dtype.
    """
    f = _format(fmt)
    block_size = _check_block_size(block_size)
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if not (isinstance(codes, torch.Tensor) and isinstance(scales, torch.Tensor)):
        raise ValueError("dequantize_mx expects codes and scales as torch.Tensors (from quantize_mx)")
    s = _scale_codes(scales)
    if f.name == "mxfp8" and codes.dtype == torch.float8_e4m3fn:
        codes = codes.view(torch.uint8)
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8, got {codes.dtype}")
    if codes.dim() == 0 or s.dim() == 0:
        raise ValueError(f"codes and scales need a last dim (codes [..., n], scales [..., n / block_size]); got "
                         f"shapes {tuple(codes.shape)} and {tuple(s.shape)}")
    if codes.shape[:-1] != s.shape[:-1]:
        raise ValueError(f"codes {tuple(codes.shape)} and scales {tuple(s.shape)} differ in leading dims")
    n = s.shape[-1] * block_size
    packed = f.name == "mxfp4" and codes.shape[-1] * 2 == n and n > 0
    if codes.shape[-1] != n and not packed:
        raise ValueError(
            f"codes last dim {codes.shape[-1]} does not match scales last dim {s.shape[-1]} x "
            f"block_size {block_size} = {n}" + (" (or half that, packed)" if f.name == "mxfp4" else "")
        )
    # (not for codes quantize_mx just made, `_trusted`: a pass over them and, on a GPU, a host sync per QAT call)
    if f.name == "mxfp4" and not packed and not _trusted and codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"unpacked mxfp4 codes are 4-bit (0..15), got {int(codes.max())}; packed codes (two per "
                         f"byte) have a last dim of n / 2 = {n // 2}, not {codes.shape[-1]}")
    nb = s.numel()
    if nb == 0:  # no blocks (a zero-size dim): nothing to decode, and reshape(0, -1) is undefined
        return torch.empty(*s.shape[:-1], n, dtype=dtype, device=codes.device)
    sf = _scale_values(s.reshape(-1)).unsqueeze(-1)
    rows = codes.reshape(nb, -1)
    lut = _e2m1_pair_values(codes.device) if packed else _e2m1_values(codes.device).unsqueeze(-1)
    out = torch.empty(nb, block_size, dtype=torch.float32, device=codes.device)

    def work(i0: int, i1: int) -> None:
        c = rows[i0:i1]
        if f.name == "mxfp8":
            p = c.view(torch.float8_e4m3fn).float()
        else:  # a table lookup per code (or per packed byte -> two values)
            p = torch.nn.functional.embedding(c.reshape(-1).int(), lut).view(-1, block_size)
        torch.mul(p, sf[i0:i1], out=out[i0:i1])

    _parallel_chunks(work, nb, max(1, _CHUNK_ELEMS // block_size), codes.device)
    out = out.view(*s.shape[:-1], n)
    return out if dtype == torch.float32 else out.to(dtype)


def fake_quantize_mx(x: torch.Tensor, fmt: str, block_size: int = 32) -> torch.Tensor:
    """dequantize_mx(quantize_mx(x)) in x's dtype and shape; x: [..., n]. No gradient flows
    (the codes are integers); QAT wraps this in a straight-through estimator."""
    codes, scales = quantize_mx(x, fmt, block_size)
    return dequantize_mx(codes, scales, fmt, block_size, dtype=x.dtype, _trusted=True)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes [..., n] (values 0..15, n even) -> uint8 [..., n / 2]; element 2i goes to
    the low nibble and 2i+1 to the high nibble (torchao `pack_uint4` order)."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"pack_fp4 expects uint8 codes, got {codes.dtype}")
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last dim, got shape {tuple(codes.shape)}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError("pack_fp4 expects 4-bit codes (0..15); got a larger value")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., m] -> uint8 codes [..., 2m] (low nibble first); inverse of pack_fp4."""
    if packed.dtype != torch.uint8 or packed.dim() == 0:
        raise ValueError(f"unpack_fp4 expects a uint8 tensor with a last dim, got {packed.dtype}")
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).view(*packed.shape[:-1], -1)


def mx_bits_per_element(fmt: str, block_size: int = 32) -> float:
    """Storage bits per element including the shared 8-bit scale: 4.25 (mxfp4), 8.25 (mxfp8)."""
    return _format(fmt).bits + 8 / _check_block_size(block_size)


# ----------------------------------------------------------------------------------------------
# reference: the element grid enumerated from the encoding, nearest value picked in Python


def _decode_element(code: int, f: MXFormat) -> float:
    """Spec decoding of one element code (sec. 5.3): subnormal if the exponent field is 0."""
    sign = -1.0 if code >> (f.bits - 1) & 1 else 1.0
    e = (code >> f.mbits) & ((1 << f.ebits) - 1)
    m = code & ((1 << f.mbits) - 1)
    if f.has_nan and e == (1 << f.ebits) - 1 and m == (1 << f.mbits) - 1:
        return math.nan  # E4M3: S.1111.111
    if e == 0:
        return sign * 2.0 ** (1 - f.bias) * (m / 2**f.mbits)
    return sign * 2.0 ** (e - f.bias) * (1 + m / 2**f.mbits)


def _grid_values(f: MXFormat) -> torch.Tensor:
    return torch.tensor([_decode_element(c, f) for c in range(1 << f.bits)], dtype=torch.float64)


@lru_cache(maxsize=None)
def _finite_grid(f: MXFormat) -> tuple[tuple[float, int], ...]:
    """(value, code) for every non-negative finite element code, decoded from the bits."""
    grid = ((_decode_element(c, f), c) for c in range(1 << (f.bits - 1)))
    return tuple((v, c) for v, c in grid if not math.isnan(v))


def _encode_reference(y: float, negative: bool, f: MXFormat) -> int:
    """Nearest finite non-negative grid value to |y|, ties to the even code, sign bit on top.
    Past the largest normal the nearest value is the largest normal: the spec's saturation."""
    mag = abs(y)
    if math.isinf(mag):
        code = max(c for _, c in _finite_grid(f))
    else:
        code = min(_finite_grid(f), key=lambda vc: (abs(mag - vc[0]), vc[1] & 1))[1]
    return code | (int(negative) << (f.bits - 1))


def quantize_mx_reference(x: torch.Tensor, fmt: str, block_size: int = 32):
    """Slow twin of quantize_mx (unpacked codes), one block and one element at a time.

    For NaN blocks it returns scale 0xFF, signed zeros for finite elements and the NaN code
    (0x7F|s, E4M3) or the max code (0x7|s, E2M1, which has no NaN) for non-finite ones; the fast
    path's codes there follow torchao's arithmetic instead and carry no meaning (spec: block is NaN).
    """
    f = _format(fmt)
    block_size = _check_block_size(block_size)
    _check_input(x, block_size)
    flat = x.detach().float().reshape(-1, block_size).cpu()
    codes = torch.zeros(flat.shape, dtype=torch.uint8)
    scales = torch.zeros(flat.shape[0], dtype=torch.uint8)
    for b, block in enumerate(flat.tolist()):
        signs = [math.copysign(1.0, v) < 0 for v in block]
        if any(math.isnan(v) for v in block):
            scales[b] = E8M0_NAN
            top = (0x7F if f.has_nan else 0x7)
            for i, v in enumerate(block):
                mag = 0 if math.isfinite(v) else top
                codes[b, i] = mag | (int(signs[i]) << (f.bits - 1))
            continue
        amax = max(abs(v) for v in block)
        if amax == 0:
            floor_log2 = -E8M0_BIAS  # fp32 exponent field 0
        elif math.isinf(amax):
            floor_log2 = 128  # fp32 exponent field 255 (torchao); microxcaling would say NaN
        else:
            floor_log2 = math.frexp(amax)[1] - 1  # amax = m * 2^e, m in [0.5, 1)
        shared = max(floor_log2 - f.emax, -E8M0_BIAS)
        scales[b] = shared + E8M0_BIAS
        divisor = 2.0 ** max(shared, -126)  # torchao clamps the fp32 scale to the smallest normal
        for i, v in enumerate(block):
            codes[b, i] = _encode_reference(v / divisor, signs[i], f)
    lead = x.shape[:-1]
    return codes.view(*lead, x.shape[-1]), scales.view(*lead, x.shape[-1] // block_size)


def dequantize_mx_reference(codes: torch.Tensor, scales: torch.Tensor, fmt: str,
                            block_size: int = 32) -> torch.Tensor:
    """Slow twin of dequantize_mx for unpacked codes: X * P per element in Python floats -> fp32."""
    f = _format(fmt)
    s = _scale_codes(scales).reshape(-1).tolist()
    c = codes.view(torch.uint8).reshape(len(s), block_size).tolist()
    out = [
        [math.nan if sc == E8M0_NAN else _decode_element(p, f) * 2.0 ** (sc - E8M0_BIAS) for p in row]
        for sc, row in zip(s, c)
    ]
    return torch.tensor(out, dtype=torch.float32).view(*codes.shape[:-1], -1)
