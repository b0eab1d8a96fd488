"""Checkpoints: safetensors for model and optimizer state, a JSON manifest, atomic commits, keep-last-N.

    step_000100/  model.safetensors  optimizer.safetensors  manifest.json
    latest        one line: the name of the newest complete step directory

A save is written into a hidden temporary directory, renamed into place, and only then named by `latest`;
pruning never removes the step `latest` names, so a crash at any point leaves the previous checkpoint complete
and pointed to. Loading verifies every file's sha256 and the config, naming the file and field that disagree.
The manifest's fields and the optimizer state's layout: docs/training.md ("Checkpoints").
"""
from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import random
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from k3.fileio import atomic_write_text, default_mode, loads_json, pid_alive
from k3.fileio import fsync_dir as _fsync_dir

log = logging.getLogger(__name__)

FORMAT = "k3-checkpoint/1"
MODEL_FILE, OPTIM_FILE, MANIFEST = "model.safetensors", "optimizer.safetensors", "manifest.json"
LATEST = "latest"
DCP_META = "k3.json"  # the meta file of a distributed (k3.parallel) checkpoint
_STEP_RE = re.compile(r"^step_(\d{6,})$")


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, corrupted or does not match what is loading it."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def k3_version() -> str:
    try:
        from importlib.metadata import version

        return version("k3")
    except Exception:  # not installed as a distribution (e.g. run from a source tree)
        return "unknown"


# ---------------------------------------------------------------------- RNG state
def rng_state() -> dict:
    py = random.getstate()
    npst = np.random.get_state()
    state = {
        "torch_cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [npst[0], npst[1].tolist(), int(npst[2]), int(npst[3]), float(npst[4])],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch_cpu"])), dtype=torch.uint8))
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)
                                      for s in state["torch_cuda"]])


# ---------------------------------------------------------------------- state dict <-> (tensors, JSON)
def flatten_state(obj: Any, tensors: dict[str, torch.Tensor], prefix: str = "") -> Any:
    """Replace every tensor in a nested dict/list/tuple by {"__tensor__": key}, collecting it in `tensors`.

    Dict keys keep their type (optimizer state is keyed by int), tuples stay tuples.
    """
    if isinstance(obj, torch.Tensor):
        key = prefix or "tensor"
        tensors[key] = obj.detach().to("cpu").contiguous()
        return {"__tensor__": key}
    if isinstance(obj, dict):
        return {"__dict__": [[k, flatten_state(v, tensors, f"{prefix}.{k}" if prefix else str(k))]
                             for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        items = [flatten_state(v, tensors, f"{prefix}.{i}" if prefix else str(i)) for i, v in enumerate(obj)]
        return {"__tuple__": items} if isinstance(obj, tuple) else items
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store {type(obj).__name__} at {prefix!r} in a checkpoint")


def unflatten_state(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            key = obj["__tensor__"]
            if key not in tensors:
                raise CheckpointError(f"{OPTIM_FILE}: tensor {key!r} named by the manifest is missing")
            return tensors[key]
        if "__dict__" in obj:
            return {k: unflatten_state(v, tensors) for k, v in obj["__dict__"]}
        if "__tuple__" in obj:
            return tuple(unflatten_state(v, tensors) for v in obj["__tuple__"])
        raise CheckpointError(f"{MANIFEST}: unexpected optimizer skeleton entry {sorted(obj)}")
    if isinstance(obj, list):
        return [unflatten_state(v, tensors) for v in obj]
    return obj


def _model_tensors(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """state_dict (parameters and persistent buffers, e.g. router balancing biases) without aliases.

    Tied weights appear twice in a state_dict; safetensors refuses shared storage, so the second name is
    recorded as an alias of the first.
    """
    tensors, aliases, seen = {}, {}, {}
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride())) if t.numel() else None
        if key is not None and key in seen:
            aliases[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        tensors[name] = t.detach().to("cpu").contiguous()
    return tensors, aliases


# ---------------------------------------------------------------------- listing
def step_dirs(root: str | os.PathLike) -> list[tuple[int, Path]]:
    root = Path(root)
    if not root.is_dir():
        return []
    out = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_RE.match(p.name))]
    return sorted(out)


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The directory `latest` names; if that is missing (a crash mid-overwrite), the newest step dir that
    has a manifest. None if there is no checkpoint."""
    root = Path(root)
    pointer = root / LATEST
    if pointer.is_file():
        name = pointer.read_text().strip()
        if _STEP_RE.match(name) and (root / name / MANIFEST).is_file():
            return root / name
        if not (root / name / DCP_META).is_file():  # a distributed checkpoint (k3.parallel's meta) is complete;
            # its callers say what to do with it, so no warning about a crash here
            log.warning("%s names %r, which is not a complete checkpoint; using the newest complete one", pointer,
                        name)
    for _, p in reversed(step_dirs(root)):
        if (p / MANIFEST).is_file():
            return p
    return None


# ---------------------------------------------------------------------- save
def latest_distributed(root: str | os.PathLike) -> Path | None:
    """Of a distributed (DCP) checkpoint root: the step directory `latest` names; if that is not complete (a crash while a step was rewritten), the
    newest complete one; `root` itself when it is a step directory; None when there is no checkpoint."""
    root = Path(root)
    f = root / LATEST
    named = None
    if f.is_file():
        named = root / f.read_text().strip()
        if (named / DCP_META).is_file():
            return named
    if (root / DCP_META).is_file():
        return root
    steps = sorted((p for p in root.glob("step_*") if p.name[5:].isdigit() and (p / DCP_META).is_file()),
                   key=lambda p: int(p.name[5:]))
    if not steps:
        return None  # not a distributed checkpoint (a single-process root has the same `latest` file)
    if named is not None:
        log.warning("%s names %s, which is not a complete distributed checkpoint; using the newest complete one, "
                    "%s", f, named.name, steps[-1].name)
    return steps[-1]


def save_checkpoint(root: str | os.PathLike, step: int, model: torch.nn.Module, optimizer=None,
                    config=None, data_state: dict | None = None, extra: dict | None = None,
                    keep_last: int = 3) -> Path:
    """Write `root/step_{step:06d}/` atomically, then point `latest` at it, then prune to `keep_last`."""
    if keep_last < 1:
        raise ValueError(f"keep_last = {keep_last} must be >= 1 (the newest checkpoint is always kept)")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(root)
    name = f"step_{step:06d}"
    final = root / name
    tmp = root / f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        files = {}
        tensors, aliases = _model_tensors(model)
        _save_tensors(tensors, tmp / MODEL_FILE)
        files[MODEL_FILE] = _file_entry(tmp / MODEL_FILE)
        skeleton = None
        if optimizer is not None:
            opt_tensors: dict[str, torch.Tensor] = {}
            skeleton = flatten_state(optimizer.state_dict(), opt_tensors)
            _save_tensors(opt_tensors, tmp / OPTIM_FILE)
            files[OPTIM_FILE] = _file_entry(tmp / OPTIM_FILE)
        manifest = {
            "format": FORMAT,
            "k3_version": k3_version(),
            "torch_version": torch.__version__,
            "step": step,
            "config": config.to_dict() if hasattr(config, "to_dict") else config,
            "rng": rng_state(),
            "data": data_state or {},
            "extra": extra or {},
            "model_aliases": aliases,
            "optimizer": skeleton,
            "files": files,
        }
        with open(tmp / MANIFEST, "w") as f:  # last: a directory with a manifest is complete
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        old = None
        if final.exists():  # re-saving a step (e.g. after a resume): move the old copy aside first
            old = root / f".{name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic_write_text(root / LATEST, name + "\n")
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    _prune(root, keep_last, protect=name)
    log.info("saved checkpoint %s", final)
    return final


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file(tensors, str(path))
    default_mode(path)  # safetensors creates it 0600
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _file_entry(path: Path) -> dict:
    return {"sha256": sha256_file(path), "bytes": path.stat().st_size}


def _remove_stale_temporaries(root: Path) -> None:
    """Leftovers of a save that crashed (a `.step_*.tmp-*` / `.old-*` dir) are never a valid checkpoint."""
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith(".step_") and (".tmp-" in p.name or ".old-" in p.name):
            pid = p.name.rsplit(".tmp-", 1)[-1].split("-")[0] if ".tmp-" in p.name else ""
            if pid.isdigit() and int(pid) != os.getpid() and pid_alive(int(pid)):
                continue  # another live process is saving here right now
            log.info("removing incomplete checkpoint %s", p)
            shutil.rmtree(p, ignore_errors=True)


def _prune(root: Path, keep_last: int, protect: str) -> None:
    dirs = step_dirs(root)
    for _, p in dirs[:-keep_last] if len(dirs) > keep_last else []:
        if p.name != protect:
            shutil.rmtree(p, ignore_errors=True)


# ---------------------------------------------------------------------- load
def read_manifest(ckpt: str | os.PathLike, verify: bool | str = True) -> dict:
    """Parse and (by default) verify a checkpoint directory's manifest and file hashes; verify="model" checks
    every file but the optimizer state (for loading the model alone)."""
    ckpt = Path(ckpt)
    path = ckpt / MANIFEST
    if not ckpt.is_dir():
        raise CheckpointError(f"checkpoint {ckpt} does not exist or is not a directory")
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; {ckpt} is not a complete checkpoint")
    try:
        manifest = loads_json(path.read_text())  # a JSONDecodeError past absurd nesting
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e}); the checkpoint is corrupted") from None
    way_out = (f"the checkpoint is corrupted: delete {ckpt} and resume from an earlier step (`latest` falls back "
               "to the newest complete one), or start a new run")
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path}: a JSON {type(manifest).__name__}, not a manifest object; {way_out}")
    for key in ("format", "step", "files", "config"):
        if key not in manifest:
            raise CheckpointError(f"{path}: field {key!r} is missing; {way_out}")
    if manifest["format"] != FORMAT:
        raise CheckpointError(f"{path}: field 'format' is {manifest['format']!r}, expected {FORMAT!r}")
    step = manifest["step"]
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"{path}: field 'step' is {step!r}, not a step count; {way_out}")
    for key in ("config", "rng", "data", "extra", "model_aliases"):  # objects where present (config: or null,
        value = manifest.get(key, {})  # as a checkpoint saved without a config records it)
        if not isinstance(value, dict) and not (key == "config" and value is None):
            raise CheckpointError(f"{path}: field {key!r} is {type(value).__name__}, not an object; {way_out}")
    if not all(isinstance(a, str) and isinstance(t, str) for a, t in manifest.get("model_aliases", {}).items()):
        raise CheckpointError(f"{path}: field 'model_aliases' must map tensor names to tensor names; {way_out}")
    files = manifest["files"]
    if not (isinstance(files, dict) and MODEL_FILE in files and all(
            isinstance(e, dict) and {"bytes", "sha256"} <= set(e) for e in files.values())):
        raise CheckpointError(f"{path}: field 'files' must list {MODEL_FILE} and give every file's bytes and "
                              f"sha256; {way_out}")
    if verify:
        for fname, entry in files.items():
            fpath = ckpt / fname
            if fname == OPTIM_FILE and verify == "model":  # reading the model only: the optimizer may be gone
                continue
            if not fpath.is_file():
                raise CheckpointError(f"{fpath}: missing (listed in the manifest)")
            size = fpath.stat().st_size
            if size != entry["bytes"]:
                raise CheckpointError(f"{fpath}: size {size} bytes, manifest says {entry['bytes']}; the file is "
                                      f"truncated: {way_out}")
            digest = sha256_file(fpath)
            if digest != entry["sha256"]:
                raise CheckpointError(f"{fpath}: sha256 {digest[:16]}... does not match the manifest's "
                                      f"{entry['sha256'][:16]}...; {way_out}")
    return manifest


def check_config(manifest_config: dict | None, config, where: str = MANIFEST) -> None:
    """Raise naming the first field where the checkpoint's config and `config` differ."""
    if config is None or manifest_config is None:
        return
    want = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    if hasattr(type(config), "from_dict"):
        try:  # read the saved config as K3Config reads it: fields added since then get their saved-era value
            manifest_config = type(config).from_dict(manifest_config).to_dict()
        except Exception:  # not a valid config of this class: compare the raw fields, naming the first difference
            pass
    for key in sorted(set(want) | set(manifest_config)):
        if key == "name":
            continue
        a, b = manifest_config.get(key, "<absent>"), want.get(key, "<absent>")
        if a != b:
            raise CheckpointError(f"{where}: config field {key!r} is {a!r} in the checkpoint but {b!r} in the "
                                  "model being loaded; load with the checkpoint's config (its manifest.json)")


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module | None = None, optimizer=None,
                    config=None, restore_rng: bool = True, map_location: str | torch.device = "cpu") -> dict:
    """Load a checkpoint directory (or a root holding `latest`) into model/optimizer; returns the manifest.

    Verifies every file's hash first and the config against `config` (if given); restores RNG states.
    """
    path = Path(path)
    if not (path / MANIFEST).is_file() and ((path / LATEST).is_file() or step_dirs(path)):
        found = latest_checkpoint(path)
        if found is None:
            raise CheckpointError(f"{path}: no complete checkpoint in this directory")
        path = found
    manifest = read_manifest(path, verify=True if optimizer is not None else "model")
    check_config(manifest.get("config"), config, str(path / MANIFEST))
    if model is not None:
        tensors = _load_tensors(path / MODEL_FILE, map_location)
        for alias, target in manifest.get("model_aliases", {}).items():
            tensors[alias] = tensors[target]
        own = model.state_dict()
        missing, unexpected = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
        if missing or unexpected:
            raise CheckpointError(f"{path / MODEL_FILE}: does not match the model: missing {missing[:5]}"
                                  f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                                  f"{'...' if len(unexpected) > 5 else ''}")
        for k, t in tensors.items():
            if tuple(t.shape) != tuple(own[k].shape):
                raise CheckpointError(f"{path / MODEL_FILE}: tensor {k!r} has shape {tuple(t.shape)}, the model "
                                      f"expects {tuple(own[k].shape)}")
        model.load_state_dict(tensors, strict=True)
    if optimizer is not None:
        if manifest.get("optimizer") is None or OPTIM_FILE not in manifest["files"]:
            raise CheckpointError(f"{path}: has no optimizer state ({OPTIM_FILE}); cannot resume training from it")
        state = unflatten_state(manifest["optimizer"], _load_tensors(path / OPTIM_FILE, map_location))
        try:
            optimizer.load_state_dict(state)
        except (ValueError, KeyError, RuntimeError) as e:
            raise CheckpointError(f"{path / OPTIM_FILE}: does not fit this optimizer ({e})") from None
    if restore_rng and "rng" in manifest:
        try:
            set_rng_state(manifest["rng"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path / MANIFEST}: field 'rng' is not a saved random state ({type(e).__name__}: "
                                  f"{e}); the checkpoint is corrupted: resume from an earlier step or start over") from None
    manifest["path"] = str(path)
    return manifest


def _load_tensors(path: Path, map_location) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path), device=str(map_location))
    except Exception as e:  # safetensors raises its own error types for malformed headers
        raise CheckpointError(f"{path}: cannot be read as safetensors ({e})") from None
