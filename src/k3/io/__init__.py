"""k3.load: one loader for every checkpoint k3 meets, and the converters to the released layouts.

    model = k3.load(path, dtype=None, device="cpu")     # K3Model in eval mode

`path` may be a k3 training checkpoint (`k3 train --out DIR` writes DIR/checkpoint; a step folder or a root with
`latest`; distributed ones too), a packed MX export (`k3 export --format mx`), a k3 HF export
(`k3 export --format hf`), or a folder in the released layout of Kimi-Linear (`model_type` kimi_linear) or
Kimi K3 (kimi_k3), single-file or sharded (k3.io.kimi). `device="meta"` gives the structure without reading
any tensor.

    model = k3.load(path, experts="stream", ram_budget="8GB")   # routed experts read from disk as used

streams the MXFP4 routed experts of a released folder from its files through a cache bounded in bytes, the rest
resident (k3.io.stream; docs/serving.md).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from k3.io.kimi import CheckpointFormatError, config_model_type, is_kimi_folder, load_kimi

__all__ = ["load", "load_with_manifest", "CheckpointFormatError", "is_kimi_folder"]


def load_with_manifest(path: str | os.PathLike, dtype: torch.dtype | None = None, device="cpu",
                       experts: str = "resident", ram_budget=None, prefetch: bool = True, trunk: str | None = None):
    """(K3Model in eval mode, manifest dict) for any checkpoint k3.load accepts. The manifest is k3's own for
    k3 checkpoints; for an export it records where the model came from (`source`, `model_type`)."""
    p = Path(path)
    mt = config_model_type(p) if p.is_dir() else None
    tok = p / "tokenizer.json"
    shipped = {"tokenizer": str(tok)} if tok.is_file() else {}  # an export's or a release's own tokenizer
    if experts not in ("resident", "stream"):
        raise ValueError(f"experts = {experts!r}: use 'resident' (all in memory) or 'stream' (read from disk)")
    if trunk is not None and experts != "stream":
        raise ValueError(f"trunk = {trunk!r} applies to a streamed model: add experts='stream' and a ram_budget")
    if experts == "stream":
        if ram_budget is None:
            raise ValueError("experts='stream' needs ram_budget (e.g. '8GB'): the RAM for the trunk and the expert "
                             "cache together")
        if mt not in ("kimi_linear", "kimi_k3") or str(device) != "cpu":
            raise ValueError(f"experts='stream' reads the MXFP4 routed experts of a released kimi_k3 folder on the "
                             f"CPU; {p} is {mt or 'not a released folder'} (device {device}): export it with "
                             "`k3 export --format kimi`, or load it with experts='resident'")
        from k3.io.stream import load_streaming

        model = load_streaming(p, ram_budget, dtype=dtype, prefetch=prefetch, trunk=trunk)
    elif mt in ("kimi_linear", "kimi_k3"):
        model = load_kimi(p, dtype=dtype, device=device)
    if mt in ("kimi_linear", "kimi_k3"):
        # what k3's commands read from a manifest: the path, no training step, the tokenizer shipped beside it
        return model, {"path": str(p), "step": None, "source": str(p), "model_type": mt,
                       "config": model.config.to_dict(), "data": shipped}
    if mt == "k3":
        from k3.io.hf import load_hf

        hf, _ = load_hf(p, device=device if str(device) != "meta" else "cpu")
        model = hf.model
        if dtype is not None:
            model.to(dtype)
        return model.eval(), {"path": str(p), "step": None, "source": str(p), "model_type": "k3",
                              "config": model.config.to_dict(), "data": shipped}
    if mt is not None:
        raise CheckpointFormatError(f"{p / 'config.json'}: model_type {mt!r} is not one k3 reads; give a k3 checkpoint, "
                                    "a k3 export or a released kimi_linear / kimi_k3 folder")
    if str(device) == "meta":
        from k3.config import K3Config
        from k3.model.transformer import K3Model
        from k3.train.checkpoint import latest_checkpoint, read_manifest

        found = p if (p / "manifest.json").is_file() else latest_checkpoint(p)
        if found is None:
            raise ValueError(f"no checkpoint at {p}")
        manifest = read_manifest(found, verify=False)
        with torch.device("meta"):
            return K3Model(K3Config.from_dict(manifest["config"])).eval(), manifest
    from k3.io.trained import load_trained_model

    model, manifest = load_trained_model(p, device=device)
    if dtype is not None:
        model.to(dtype)
    return model.eval(), manifest


def load(path: str | os.PathLike, dtype: torch.dtype | None = None, device="cpu", experts: str = "resident",
         ram_budget=None, prefetch: bool = True, trunk: str | None = None):
    """K3Model (eval mode) from any checkpoint k3 reads; see the module docstring."""
    return load_with_manifest(path, dtype=dtype, device=device, experts=experts, ram_budget=ram_budget,
                              prefetch=prefetch, trunk=trunk)[0]
