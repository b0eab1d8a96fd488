"""Load a model k3 trained (a checkpoint directory, a run root, a distributed or an MX-packed checkpoint)
and the tokenizer it reads."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from k3.config import K3Config
from k3.train import checkpoint as ckpt
from k3.fileio import loads_json


def _holds_distributed_checkpoint(path) -> bool:
    return ckpt.latest_distributed(path) is not None


def _recorded_tokenizer_nearby(manifest: dict) -> str | None:
    """For checkpoints that record only their tokenizer's sha256 (`k3 rl`, `k3 distill`: extra.tokenizer_sha256):
    the tokenizer.json with that fingerprint in a directory above the checkpoint (an experiment root keeps it
    there, e.g. ROOT/tokenizer.json beside ROOT/<run>/checkpoint/), else None."""
    from k3.data import load_tokenizer

    want = (manifest.get("extra") or {}).get("tokenizer_sha256")
    if not want or not manifest.get("path"):
        return None
    for parent in list(Path(manifest["path"]).resolve().parents)[:4]:
        candidate = parent / "tokenizer.json"
        if candidate.is_file():
            try:
                if load_tokenizer(candidate).fingerprint == want:
                    return str(candidate)
            except ValueError:
                continue
    return None


def trained_tokenizer_hash(manifest: dict) -> str | None:
    """The fingerprint of the tokenizer a checkpoint's model was trained with, where its manifest records one:
    `k3 train` in the data state (data.tokenizer_hash), `k3 rl` / `k3 distill` in extra.tokenizer_sha256."""
    return (manifest.get("data") or {}).get("tokenizer_hash") or (manifest.get("extra") or {}).get("tokenizer_sha256")


def checkpoint_tokenizer(manifest: dict, vocab_size: int, tokenizer_path=None):
    """The tokenizer a trained model reads: `tokenizer_path`, else the one its manifest names; refused when its
    size is not the model's or it is not the tokenizer the training data was tokenized with (same size, other
    ids would give wrong text without any error)."""
    from k3.data import load_tokenizer

    data = manifest.get("data") or {}
    tok_path = tokenizer_path or data.get("tokenizer") or _recorded_tokenizer_nearby(manifest)
    if not tok_path:
        raise ValueError(f"the checkpoint {manifest.get('path')} does not name its tokenizer; pass --tokenizer PATH")
    try:
        tokenizer = load_tokenizer(tok_path)
    except ValueError as err:
        if tokenizer_path is not None:
            raise
        raise ValueError(f"{err}. That is the tokenizer the checkpoint names; pass --tokenizer PATH to the "
                         "tokenizer.json the model was trained with") from None
    if tokenizer.vocab_size != vocab_size:
        raise ValueError(f"tokenizer {tok_path} has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                         f"{vocab_size}; pass the tokenizer the model was trained with")
    trained = trained_tokenizer_hash(manifest)
    if not trained and data.get("data_dir") and (Path(data["data_dir"]) / "train.json").is_file():
        trained = loads_json((Path(data["data_dir"]) / "train.json").read_text()).get("tokenizer_hash")
    if trained and trained != tokenizer.fingerprint:
        raise ValueError(f"tokenizer {tok_path} is not the one the model's training data was tokenized with "
                         f"(fingerprint {tokenizer.fingerprint[:12]}..., trained with {trained[:12]}...); pass "
                         "that tokenizer.json" + (f" (the checkpoint names {data['tokenizer']})" if data.get("tokenizer")
                                                  and str(data["tokenizer"]) != str(tok_path) else ""))
    return tokenizer


def _hf_export_type(path: Path) -> str | None:
    """config.json's model_type when `path` holds an HF transformers directory (k3's is "k3")."""
    try:
        return loads_json((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def load_trained_model(path: str | os.PathLike, device: str | torch.device = "cpu"):
    """(K3Model, manifest) from a checkpoint directory or a root holding `latest`; config from the manifest.

    Distributed (DCP) checkpoints of `k3 train --nproc N` load too, whole, into one process."""
    from k3.model.transformer import K3Model

    path = Path(path)
    if not (path / ckpt.MANIFEST).is_file() and _holds_distributed_checkpoint(path):  # from `k3 train --nproc N`
        from k3.parallel import checkpoint as pckpt

        model = K3Model(K3Config.from_dict(pckpt.read_meta(path)["config"]))
        meta = pckpt.load_model_weights(path, model)
        return model.to(device).eval(), pckpt.as_manifest(meta)
    found = path if (path / ckpt.MANIFEST).is_file() else ckpt.latest_checkpoint(path)
    if found is None and _hf_export_type(path) == "k3":
        raise ValueError(f"{path} is a Hugging Face transformers export (k3 export --format hf): load it with "
                         "transformers (import k3.io.hf, then AutoModelForCausalLM.from_pretrained; docs/serving.md). "
                         "k3 eval, sample and serve read the k3 checkpoint it was exported from")
    if found is None:
        inner = path / "checkpoint"
        hint = (f"; {inner} holds one: pass that" if _holds_distributed_checkpoint(inner)
                or ckpt.latest_checkpoint(inner) else "")
        raise ValueError(f"no checkpoint at {path}; train one with `k3 train --out DIR` (it writes DIR/checkpoint) "
                         "or `k3 demo` (runs/demo/checkpoint)"
                         + hint)
    manifest = ckpt.read_manifest(found, verify=False)
    if "mx_export" in manifest.get("extra", {}):  # written by `k3 export --format mx`: packed routed experts
        from k3.quant.export import load_packed

        return load_packed(found, device)
    config = K3Config.from_dict(manifest["config"])
    model = K3Model(config)
    manifest = ckpt.load_checkpoint(found, model, config=config, restore_rng=False)
    return model.to(device).eval(), manifest
