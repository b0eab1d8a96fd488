"""`k3 export --format kimi` (the released layout, k3.io.kimi) and `k3 export --format mx` (packed MX experts).

`export_kimi`: any checkpoint k3 reads -> the released layout, one tensor at a time. Sources are streamed where
their files allow it: a released folder tensor by tensor, a k3 training checkpoint or packed MX export from its
memory-mapped model.safetensors; other sources (distributed checkpoints, HF exports) are loaded whole first.
Routed experts of a model whose config packs them (qat.expert_weights mxfp4) are written as compressed-tensors
MXFP4, packed on the way when the source holds them in full precision. The folder is written beside --out and
renamed into place.

`export_mx`: a training checkpoint -> a k3 checkpoint whose routed experts are MX codes + scales (k3.quant.export).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch

from k3.config import K3Config
from k3.fileio import atomic_dir
from k3.io.kimi import (KIMI_TYPES, CheckpointFormatError, Tensors, _resolve_names, is_kimi_folder, kimi_config,
                        kimi_tensors, read_config, released_type, tensor_map, token_ids, write_safetensors)
from k3.model.qat import qat_format
from k3.ops.mx.fake import BLOCK
from k3.quant.export import EXPORT_KEY, EXPORT_VERSION, pack_model
from k3.train import checkpoint as ckpt

log = logging.getLogger(__name__)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tiktoken.model",
                   "chat_template.jinja", "generation_config.json")


def _released_source(path: Path):
    """(config, get, token ids) of a released folder, read tensor by tensor."""
    d, config = read_config(path)
    packed = bool(config.qat.get("expert_weights"))
    entries = {e.k3: e for e in tensor_map(config, d["model_type"], packed)}
    tensors = Tensors(path)
    chosen = _resolve_names(list(entries.values()), tensors, path)

    def get(name: str) -> torch.Tensor:
        e = entries[name]
        return e.to_k3([tensors.get(chosen[n]) for n in e.names])

    return config, get, token_ids(d)


def _k3_source(path: Path):
    """(config, get, manifest) streaming from a single-process k3 checkpoint or packed MX export; None if the
    checkpoint is of another kind (distributed)."""
    from safetensors import safe_open

    from k3.train.checkpoint import MANIFEST, latest_checkpoint, read_manifest

    found = path if (path / MANIFEST).is_file() else latest_checkpoint(path)
    if found is None or not (found / "model.safetensors").is_file():
        return None
    manifest = read_manifest(found, verify=True)
    config = K3Config.from_dict(manifest["config"])
    handle = safe_open(str(found / "model.safetensors"), framework="pt")
    names = set(handle.keys())
    aliases = manifest.get("model_aliases") or {}
    packed_cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(name: str) -> torch.Tensor:
        name = aliases.get(name, name)
        if name in names:
            return handle.get_tensor(name)
        base, _, part = name.rpartition("_")  # experts.w1_codes from a full-precision experts.w1: pack it here
        if part in ("codes", "scales") and base in names:
            from k3.quant.export import pack_expert_weight

            if base not in packed_cache:
                packed_cache.clear()
                packed_cache[base] = pack_expert_weight(handle.get_tensor(base), config.qat["expert_weights"], base)
            return packed_cache[base][0 if part == "codes" else 1]
        raise CheckpointFormatError(f"{found / 'model.safetensors'}: no tensor {name}; the checkpoint does not "
                                    "match its manifest's config")

    return config, get, manifest


def _loaded_source(path: Path):
    from k3.io import load_with_manifest
    from k3.quant.export import pack_expert_weight

    model, manifest = load_with_manifest(path)
    state = model.state_dict()
    config = model.config

    def get(name: str) -> torch.Tensor:
        if name in state:
            return state[name]
        base, _, part = name.rpartition("_")
        codes, scales = pack_expert_weight(state[base], config.qat["expert_weights"], base)
        return codes if part == "codes" else scales

    return config, get, manifest


def _write_tokenizer(src: Path, manifest: dict | None, config: K3Config, tmp: Path) -> str | None:
    """Tokenizer files beside the weights: a released source's own, or the k3 tokenizer the manifest names."""
    if is_kimi_folder(src):
        copied = [f for f in TOKENIZER_FILES if (src / f).is_file()]
        for f in copied:
            shutil.copyfile(src / f, tmp / f)
        return ", ".join(copied) or None
    named = ((manifest or {}).get("data") or {}).get("tokenizer")
    if not named:
        return None
    from k3.data.tokenizer import load_tokenizer
    from k3.io.hf import check_tokenizer, to_hf_tokenizer

    try:
        tok = load_tokenizer(named)
    except ValueError as e:
        log.warning("the checkpoint names tokenizer %s, which does not load (%s): exporting without it", named, e)
        return None
    check_tokenizer(tok, config)
    to_hf_tokenizer(tok, model_max_length=config.max_context).save_pretrained(tmp)
    return "tokenizer.json"


def export_kimi(src: str | os.PathLike, out: str | os.PathLike, model_type: str | None = None,
                dtype: torch.dtype | None = None, overwrite: bool = False,
                max_shard_bytes: int = 1 << 30) -> tuple[Path, dict]:
    """Write `src` (anything k3.load reads) to `out` in the released layout; returns (out, info)."""
    src, out = Path(src), Path(out)
    if model_type is not None and model_type not in KIMI_TYPES:
        raise ValueError(f"model_type {model_type!r}: use one of {', '.join(KIMI_TYPES)}")
    if not src.exists():
        raise ValueError(f"{src}: no such file or directory; give a k3 checkpoint, a k3 export or a released folder")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not (overwrite and is_kimi_folder(out)):
        fix = ("it is not an earlier Kimi export (no released config.json): give an --out of its own" if overwrite
               else "pass --overwrite to replace an earlier export there")
        raise ValueError(f"{out} exists and is not empty; {fix}")
    if src.resolve() == out.resolve():
        raise ValueError(f"--out {out} is the source itself; write the export elsewhere")
    ids, manifest = None, None
    if is_kimi_folder(src):
        config, get, ids = _released_source(src)
    else:
        found = _k3_source(src) if src.is_dir() else None
        config, get, manifest = found if found is not None else _loaded_source(src)
    mt = model_type or released_type(config)
    cfg_json = kimi_config(config, mt, ids)  # refuses what the layout cannot hold, before anything is written
    if dtype is not None:
        cfg_json.get("text_config", cfg_json)["torch_dtype"] = str(dtype).removeprefix("torch.")
    with atomic_dir(out) as tmp:
        (tmp / "config.json").write_text(json.dumps(cfg_json, indent=2) + "\n", encoding="utf-8")
        write_safetensors(kimi_tensors(config, get, mt, dtype), tmp, max_shard_bytes)
        tok = _write_tokenizer(src, manifest, config, tmp)
    return out, {"model_type": mt, "tokenizer": tok, "mxfp4_experts": bool(config.qat.get("expert_weights")),
                 "shards": sorted(p.name for p in out.glob("*.safetensors"))}


def export_mx(ckpt_path: str | os.PathLike, out: str | os.PathLike, activations: str = "keep",
              overwrite: bool = False) -> Path:
    """Pack a training checkpoint's routed experts; returns the written step directory.

    The exported config is the checkpoint's with `qat.expert_weights` set (mxfp4 unless the checkpoint
    already names a format) and, unless `activations` is 'keep', `qat.activations` set to it; the exported
    model computes exactly what K3Model(that config) computes with the checkpoint's weights (QAT, or PTQ
    for a full-precision checkpoint).
    """
    from k3.io.trained import load_trained_model
    from k3.model.transformer import K3Model

    if activations not in ("keep", "mxfp8", "mxfp4", "none"):
        raise ValueError(f"--activations {activations!r}: use keep, mxfp8, mxfp4 or none")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; the export is a checkpoint directory: give a directory")
    held = [p for _, p in ckpt.step_dirs(out)] if out.is_dir() else []
    other = sorted(p.name for p in out.iterdir() if p not in held and p.name != ckpt.LATEST
                   and not p.name.startswith((".step_", f".{ckpt.LATEST}."))) if out.is_dir() else []
    # (.step_* folders and .latest.*.tmp files: what a save killed part way leaves; the next save removes them)
    if other:  # e.g. a training run's folder: its checkpoint/ beside a step_* export would confuse `--ckpt OUT`
        raise ValueError(f"--out {out} holds {', '.join(other[:3])}{' ...' if len(other) > 3 else ''}, which an "
                         "MX export does not write; give the export an --out of its own (a new or empty directory)")
    trained = [p for p in held if not _is_export(p)]
    if trained:  # --overwrite replaces earlier exports only, never training state (nor the checkpoint read here)
        raise ValueError(f"{out} holds training checkpoint(s) {[p.name for p in trained][:3]}, which --overwrite "
                         "does not replace; give an --out of its own for the export")
    if held and not overwrite:
        raise ValueError(f"{out} already holds an export; pass --overwrite or another --out")
    src, manifest = load_trained_model(ckpt_path)
    if EXPORT_KEY in manifest.get("extra", {}):
        raise ValueError(f"{manifest['path']} is already a packed MX export")
    qat = dict(src.config.qat or {})
    fmt = qat_format(src.config, "expert_weights") or "mxfp4"
    qat["expert_weights"] = fmt
    if activations != "keep":
        qat["activations"] = activations
    config = src.config.replace(qat=qat)
    if not any(config.is_moe_layer(i) for i in range(config.n_layers)):
        raise ValueError(f"{manifest['path']} has no routed experts to pack (every layer's FFN is dense): an MX "
                         "export holds packed routed experts; use the checkpoint as it is, or --format hf")
    model = K3Model(config)
    model.load_state_dict(src.state_dict())
    del src
    pack_model(model)
    n_params = sum(3 * m.experts.n_experts * m.experts.dim * m.experts.ffn for m in model.moe_layers())
    n_bytes = sum(t.numel() * t.element_size() for m in model.moe_layers() for t in m.experts.packed_tensors())
    other = {str(t.dtype).removeprefix("torch.") for n, t in model.state_dict().items() if ".experts." not in n}
    info = {
        "version": EXPORT_VERSION, "expert_weights": fmt, "block_size": BLOCK, "scale": "e8m0 (uint8)",
        "codes": "mxfp4: 2 E2M1 codes per byte, even element in the low nibble" if fmt == "mxfp4"
        else "mxfp8: 1 E4M3 byte per element",
        "layout": "experts.wN_codes / wN_scales hold wN transposed: [E, n_out, n_in/2 or n_in] and "
                  "[E, n_out, n_in/32], blocks of 32 along the reduction dim n_in",
        "other_tensors": sorted(other), "routed_expert_params": n_params, "routed_expert_bytes": n_bytes,
        "routed_bits_per_param": 8 * n_bytes / n_params if n_params else None,
        "source": {"checkpoint": manifest["path"], "step": manifest["step"], "qat": manifest["config"].get("qat")},
    }
    path = ckpt.save_checkpoint(out, int(manifest["step"]), model, None, config, data_state=manifest.get("data"),
                                extra={EXPORT_KEY: info, **{k: v for k, v in manifest.get("extra", {}).items()
                                                            if k in ("tokens", "tokenizer_sha256")}},
                                keep_last=1)
    for old in held:  # all earlier exports (checked above); pruning keeps a higher step than the new one
        if old != path:
            shutil.rmtree(old, ignore_errors=True)
    log.debug("exported %s -> %s (%s routed experts, %.3f bits/param)", manifest["path"], path, fmt,
             info["routed_bits_per_param"] or 0)
    return path


def _is_export(step_dir: Path) -> bool:
    try:
        return EXPORT_KEY in ckpt.read_manifest(step_dir, verify=False).get("extra", {})
    except (OSError, ValueError):  # unreadable: not known to be an export, so not ours to replace
        return False
