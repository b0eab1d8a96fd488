"""Quantization-aware training and packed MX export.

    fake      fake-quant with a straight-through estimator; what `config.qat` switches on
    export    `k3 export --format mx`: packed MXFP4 routed experts, and the model that runs from them
    sizes     checkpoint bytes by component and precision, from the real (meta) modules
"""
from k3.quant.fake import DEFAULT_QAT, QAT_KEYS, QATLinear, apply_linear_qat, fake_quant, parse_qat, qat_format

__all__ = ["DEFAULT_QAT", "QAT_KEYS", "QATLinear", "apply_linear_qat", "fake_quant", "parse_qat", "qat_format"]
