"""MX block formats: MXFP4 (E2M1) and MXFP8 (E4M3) with E8M0 scales, block 32 (OCP MX v1.0)."""
from k3.ops.mx.formats import (
    MX_FORMATS,
    MXFormat,
    dequantize_mx,
    dequantize_mx_reference,
    fake_quantize_mx,
    mx_bits_per_element,
    pack_fp4,
    quantize_mx,
    quantize_mx_reference,
    unpack_fp4,
)

__all__ = [
    "MX_FORMATS",
    "MXFormat",
    "dequantize_mx",
    "dequantize_mx_reference",
    "fake_quantize_mx",
    "mx_bits_per_element",
    "pack_fp4",
    "quantize_mx",
    "quantize_mx_reference",
    "unpack_fp4",
]
