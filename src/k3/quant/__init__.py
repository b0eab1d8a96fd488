"""Quantized weights: packed MX routed experts, GPTQ rounding, checkpoint bytes.

    export    packed MXFP4 routed experts (`k3 export --format mx` writes them), and the model that runs from them
    gptq      GPTQ rounding onto the MX grid
    sizes     checkpoint bytes by component and precision, from the real (meta) modules

QAT itself, what `config.qat` switches on, is part of the model (k3.model.qat) over the op k3.ops.mx.fake.
"""
