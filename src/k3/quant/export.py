"""Packed MX export: routed experts stored as MX codes + E8M0 scales, and the model that runs from them.

Layout of a `k3 export --format mx` directory (written by k3.io.export.export_mx): a k3 checkpoint (k3.train.checkpoint: `latest`,
`step_XXXXXX/{model.safetensors, manifest.json}`, hashed and written atomically) whose manifest carries
`extra.mx_export` and whose config has `qat.expert_weights` set. In model.safetensors, each MoE layer's
routed experts are six uint8 tensors (E experts, width dim, hidden ffn):

    experts.w1_codes [E, ffn, dim/2]  experts.w1_scales [E, ffn, dim/32]   (w1: gate, [E, dim, ffn] transposed)
    experts.w3_codes [E, ffn, dim/2]  experts.w3_scales [E, ffn, dim/32]   (w3: up)
    experts.w2_codes [E, dim, ffn/2]  experts.w2_scales [E, dim, ffn/32]   (w2: down, [E, ffn, dim] transposed)

Each weight is stored transposed so that its reduction dim is last: MX blocks of 32 run along it, as in QAT.
MXFP4 codes are two E2M1 codes per byte, the even element in the low nibble (`k3.ops.mx.pack_fp4`); with
`qat.expert_weights = mxfp8` the codes are E4M3 bytes [..., n]. Every other tensor is stored as the
checkpoint had it (float32 from CPU training). Loading rebuilds the model from the manifest's config with
`PackedRoutedExperts`, which dequantizes the codes on each forward; the values equal the fake-quant model's
weights bit for bit, so its logits equal those of the QAT (or PTQ) model built from the same config (in fp32;
cast to bf16, the fake-quant model quantizes the bf16-rounded weights and the packed one rounds the fp32 values).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from k3.config import K3Config
from k3.model.moe import RoutedExperts, routed_experts_on_meta
from k3.model.qat import qat_format
from k3.ops.glu import silu_glu
from k3.ops.mx import dequantize_mx, quantize_mx
from k3.ops.mx.fake import BLOCK
from k3.train import checkpoint as ckpt

EXPORT_KEY = "mx_export"
EXPORT_VERSION = 1
EXPERT_WEIGHTS = ("w1", "w3", "w2")


# ---------------------------------------------------------------------- one stacked expert weight
def packed_shapes(shape: tuple[int, int, int], fmt: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Stacked weight [E, n_in, n_out] -> (codes shape, scales shape) of its transposed MX storage."""
    E, n_in, n_out = shape
    if n_in % BLOCK:
        raise ValueError(f"an expert weight of shape {tuple(shape)} has reduction dim {n_in}, not a multiple of "
                         f"{BLOCK}; the packed export needs moe_latent_dim (or d_model) and expert_ffn divisible "
                         f"by {BLOCK}")
    width = n_in // 2 if fmt == "mxfp4" else n_in
    return (E, n_out, width), (E, n_out, n_in // BLOCK)


def pack_expert_weight(w: torch.Tensor, fmt: str, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, n_in, n_out] -> (codes, scales) uint8, blocks along n_in (see `packed_shapes`)."""
    packed_shapes(tuple(w.shape), fmt)  # the error for dims that do not tile
    finite = torch.isfinite(w.detach())
    if not bool(finite.all()):  # NaN becomes the scale code 0xFF (refused on load), inf a block of +-inf weights
        e = int((~finite).nonzero()[0, 0])
        raise ValueError(f"routed-expert {name} holds {int((~finite).sum())} non-finite value(s) (NaN or inf), the "
                         f"first in expert {e}; the checkpoint is damaged (a diverged run?): export an earlier one")
    return quantize_mx(w.detach().transpose(1, 2), fmt, BLOCK, packed=True)


def unpack_expert_weight(codes: torch.Tensor, scales: torch.Tensor, fmt: str) -> torch.Tensor:
    """(codes, scales) -> w [E, n_in, n_out] fp32; equals fake_quant(w, fmt, dim=1) bit for bit."""
    return dequantize_mx(codes, scales, fmt, BLOCK).transpose(1, 2)


class PackedRoutedExperts(RoutedExperts):
    """RoutedExperts whose weights live as MX codes and scales (uint8 buffers `w1_codes`, `w1_scales`, ...).

    Same forward as RoutedExperts (every impl), with `expert_weights()` dequantizing the buffers. By default
    that happens on every forward, so only the packed bytes stay resident; `cache = True` keeps the fp32
    weights after the first forward (until the buffers change).
    """

    def __init__(self, n_experts: int, dim: int, ffn: int, weight_format: str = "mxfp4",
                 act_format: str | None = None, device: torch.device | str | None = None, glu=silu_glu):
        torch.nn.Module.__init__(self)  # no fp32 parameters: RoutedExperts.__init__ would allocate them
        self.glu = glu
        if weight_format not in ("mxfp4", "mxfp8"):
            raise ValueError(f"packed experts need weight_format mxfp4 or mxfp8, got {weight_format!r}")
        self.n_experts, self.dim, self.ffn = n_experts, dim, ffn
        self.weight_format, self.act_format = weight_format, act_format
        self.impl, self.backend = "grouped", "auto"
        self.cache = False
        self._cached: tuple | None = None
        # not saved; follows model.to(dtype) (the uint8 buffers do not), so the weights come out in the model's dtype
        self.register_buffer("_dtype", torch.zeros(0, device=device), persistent=False)
        for name, shape in zip(EXPERT_WEIGHTS, ((n_experts, dim, ffn), (n_experts, dim, ffn), (n_experts, ffn, dim))):
            codes, scales = packed_shapes(shape, weight_format)
            self.register_buffer(f"{name}_codes", torch.zeros(codes, dtype=torch.uint8, device=device))
            self.register_buffer(f"{name}_scales", torch.zeros(scales, dtype=torch.uint8, device=device))

    @classmethod
    def from_experts(cls, experts: RoutedExperts, weight_format: str) -> "PackedRoutedExperts":
        """Quantize a RoutedExperts' fp32 weights into a packed twin (same impl, backend, act_format)."""
        new = cls(experts.n_experts, experts.dim, experts.ffn, weight_format, experts.act_format,
                  device=experts.w1.device, glu=experts.glu)
        new.impl, new.backend = experts.impl, experts.backend
        for name in EXPERT_WEIGHTS:
            codes, scales = pack_expert_weight(getattr(experts, name), weight_format, name)
            getattr(new, f"{name}_codes").copy_(codes)
            getattr(new, f"{name}_scales").copy_(scales)
        return new

    def packed_tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f"{n}_{part}") for n in EXPERT_WEIGHTS for part in ("codes", "scales")]

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dtype = self._dtype.dtype
        key = (dtype, *((t.data_ptr(), t._version) for t in self.packed_tensors()))
        if self._cached is not None and self._cached[0] == key:
            return self._cached[1]
        w = tuple(unpack_expert_weight(getattr(self, f"{n}_codes"), getattr(self, f"{n}_scales"),
                                       self.weight_format).to(dtype) for n in EXPERT_WEIGHTS)
        self._cached = (key, w) if self.cache else None
        return w

    def extra_repr(self) -> str:
        return (f"n_experts={self.n_experts}, dim={self.dim}, ffn={self.ffn}, weight_format={self.weight_format}, "
                f"act_format={self.act_format}")


# ---------------------------------------------------------------------- whole models
def pack_model(model) -> None:
    """In place: every MoE layer's routed experts -> PackedRoutedExperts in the config's expert_weights format."""
    fmt = qat_format(model.config, "expert_weights")
    if fmt is None:
        raise ValueError("pack_model needs config.qat.expert_weights (mxfp4 or mxfp8): the packed model must "
                         "equal a fake-quant model built from the same config")
    for i, moe in enumerate(model.moe_layers()):
        if not isinstance(moe.experts, PackedRoutedExperts):
            try:
                moe.experts = PackedRoutedExperts.from_experts(moe.experts, fmt)
            except ValueError as e:
                raise ValueError(f"MoE layer {i} (of {len(model.moe_layers())}): {e}") from None


def build_packed_model(config: K3Config):
    """A K3Model for `config` whose routed experts are zeroed PackedRoutedExperts, ready for load_state_dict."""
    from k3.model.transformer import K3Model

    fmt = qat_format(config, "expert_weights")
    if fmt is None:
        raise ValueError(f"{config.name}: a packed model needs config.qat.expert_weights (mxfp4 or mxfp8)")
    with routed_experts_on_meta():  # no fp32 routed experts allocated (and initialised) only to be replaced
        model = K3Model(config)
    for moe in model.moe_layers():
        e = moe.experts
        moe.experts = PackedRoutedExperts(e.n_experts, e.dim, e.ffn, fmt, e.act_format, glu=e.glu)
    return model


def _resolve(path: Path) -> Path | None:
    return path if (path / ckpt.MANIFEST).is_file() else ckpt.latest_checkpoint(path)


def load_packed(path: str | os.PathLike, device: str | torch.device = "cpu", config: K3Config | None = None):
    """(K3Model running from packed routed experts, manifest) from a `k3 export --format mx` directory.

    Checks, before reading any weights: the manifest is a packed export of a known version; every routed
    expert tensor is present with the dtype and shape the config implies (the error names the tensor and the
    config fields); no scale is the NaN code 0xFF. Then verifies file hashes and the config (`config`, if
    given, must equal the manifest's) and loads.
    """
    path = Path(path)
    found = _resolve(path)
    if found is None:
        raise ValueError(f"no packed export at {path}; write one with `k3 export --format mx CKPT --out {path}`")
    manifest = ckpt.read_manifest(found, verify=False)
    info = manifest.get("extra", {}).get(EXPORT_KEY)
    if info is None:
        raise ValueError(f"{found} is a training checkpoint, not a packed MX export; load it with "
                         "k3.io.trained.load_trained_model, or export it with `k3 export --format mx`")
    if info.get("version") != EXPORT_VERSION or info.get("block_size") != BLOCK:
        raise ValueError(f"{found / ckpt.MANIFEST}: extra.{EXPORT_KEY} has version {info.get('version')!r}, "
                         f"block_size {info.get('block_size')!r}; this k3 reads version {EXPORT_VERSION}, block 32")
    file_config = K3Config.from_dict(manifest["config"])
    fmt = qat_format(file_config, "expert_weights")
    if fmt != info.get("expert_weights"):
        raise ValueError(f"{found / ckpt.MANIFEST}: config qat.expert_weights is {fmt!r} but the export says "
                         f"{info.get('expert_weights')!r}; the manifest is inconsistent, export again")
    ckpt.check_config(manifest["config"], config, str(found / ckpt.MANIFEST))
    model = build_packed_model(file_config)
    _check_packed_file(found / ckpt.MODEL_FILE, model, file_config, fmt, manifest)
    manifest = ckpt.load_checkpoint(found, model, config=file_config, restore_rng=False)
    return model.to(device).eval(), manifest


REEXPORT = "re-export it from the training checkpoint: `k3 export --format mx CKPT --out DIR`"


def _check_packed_file(file: Path, model, config: K3Config, fmt: str, manifest: dict) -> None:
    from safetensors import safe_open

    if not file.is_file():
        raise ckpt.CheckpointError(f"{file}: missing; {REEXPORT}")
    want = {n: t for n, t in model.state_dict().items() if ".experts." in n}
    why = (f"n_experts={config.n_experts}, expert width {config.latent_dim} (moe_latent_dim / d_model), "
           f"expert_ffn={config.expert_ffn}, {fmt} in blocks of {BLOCK}")
    try:
        f = safe_open(str(file), "pt")
    except Exception as e:  # safetensors raises its own error types for malformed headers
        size, want_bytes = file.stat().st_size, (manifest.get("files") or {}).get(file.name, {}).get("bytes")
        why_not = (f"{size} bytes where the manifest says {want_bytes}: truncated or changed after export"
                   if want_bytes is not None and size != want_bytes else str(e))
        raise ckpt.CheckpointError(f"{file}: cannot be read as safetensors ({why_not}); {REEXPORT}") from None
    with f:
        names = set(f.keys())
        for name, t in want.items():
            if name not in names:
                raise ckpt.CheckpointError(f"{file}: packed tensor {name!r} is missing (expected uint8 "
                                           f"{list(t.shape)} for {why}); {REEXPORT}")
            sl = f.get_slice(name)
            dtype, shape = sl.get_dtype(), list(sl.get_shape())
            if dtype != "U8" or shape != list(t.shape):
                raise ckpt.CheckpointError(f"{file}: tensor {name!r} is {dtype} {shape}, but the config implies "
                                           f"uint8 {list(t.shape)} ({why}); the export does not match its "
                                           f"config: {REEXPORT}")
            if name.endswith("_scales") and bool((f.get_tensor(name) == 0xFF).any()):
                raise ckpt.CheckpointError(f"{file}: tensor {name!r} holds the E8M0 NaN code 0xFF: the weights "
                                           "it was exported from contained NaN")
        stray = sorted(n for n in names if ".experts." in n and n not in want)
        if stray:
            raise ckpt.CheckpointError(f"{file}: unexpected routed-expert tensor(s) {stray[:4]} for a {fmt} export "
                                       f"({why})")
