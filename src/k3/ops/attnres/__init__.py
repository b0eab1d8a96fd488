"""Attention Residuals ops: `naive` (all sources materialised) and `blockwise` (two-phase, online softmax).

The model picks one through `AttnRes(config, impl=...)`; both are plain torch and run everywhere. A fused
CUDA path (e.g. the `flash-attn-res` Triton kernels, which take no key-norm weight: fold g into the
query, w * g) would be chosen here, in one place, when it is added.
"""
from k3.ops.attnres.blockwise import Phase1Stats, Phase2Out, blockwise_mix, merged_weights, phase1, phase2
from k3.ops.attnres.naive import attnres_logits, attnres_mix, rms_normalize

IMPLS = ("blockwise", "naive")

__all__ = [
    "IMPLS", "Phase1Stats", "Phase2Out", "attnres_logits", "attnres_mix", "blockwise_mix", "merged_weights",
    "phase1", "phase2", "rms_normalize",
]
