"""`k3 export --format kimi`: any checkpoint k3 reads -> the released layout (k3.io.kimi), one tensor at a time.

Sources are streamed where their files allow it: a released folder tensor by tensor, a k3 training checkpoint or
packed MX export from its memory-mapped model.safetensors; other sources (distributed checkpoints, HF exports)
are loaded whole first. Routed experts of a model whose config packs them (qat.expert_weights mxfp4) are written
as compressed-tensors MXFP4, packed on the way when the source holds them in full precision. The folder is
written beside --out and renamed into place.
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
