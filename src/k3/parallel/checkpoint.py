"""Distributed checkpoints with torch.distributed.checkpoint (DCP): save sharded, resume on any rank count.

Layout under a root: `step_XXXXXX/` (DCP files + `k3.json`) and `latest`. Every rank writes into a hidden
`.step_XXXXXX.tmp/`; after a barrier rank 0 renames it into place and only then replaces `latest`, so a job that
dies mid-save leaves the previous checkpoint complete and named. State is stored in logical form under the whole
model's parameter names (experts as [E, ...], the optimizer state flattened per parameter name), so a checkpoint
resumes on another pp / dp / ep layout. Format k3-dcp/1 (optimizer state nested by parameter group) still loads.
How each kind of state is made logical: docs/distributed.md ("Distributed checkpoints", "Pipeline training").
"""
from __future__ import annotations

import logging
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.tensor import DTensor, Replicate, Shard

from k3.fileio import atomic_write_json, atomic_write_text, fsync_dir, read_json
from k3.parallel import comm
from k3.parallel.expert import ExpertParallel
from k3.train.checkpoint import DCP_META
from k3.train.checkpoint import latest_distributed as latest

log = logging.getLogger(__name__)

FORMAT = "k3-dcp/2"
FORMATS = ("k3-dcp/1", FORMAT)  # /1: optimizer state nested by parameter group (pp = 1 only)
META, LATEST = DCP_META, "latest"

__all__ = ["save", "load", "latest", "read_meta", "load_model_weights", "as_manifest"]


def _expert_fqns(model) -> dict[str, tuple[ExpertParallel, str]]:
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, ExpertParallel):
            for w in ("w1", "w3", "w2"):
                out[f"{name}.{w}"] = (m, w)
    return out


def _logical(t: torch.Tensor, m: ExpertParallel, ep_mesh) -> torch.Tensor:
    """This rank's slots of an expert tensor [S, ...] as a DTensor over the logical [E, ...] (no copy)."""
    shape = (m.n_experts, *t.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(t.detach(), ep_mesh, [Replicate(), Shard(0)], run_check=False, shape=shape,
                              stride=stride)


def _optim_slots(osd: dict, fqn: str) -> list[tuple[dict, str]]:
    """(dict, key) of every optimizer-state entry of parameter `fqn`, flattened or nested (k3-dcp/1)."""
    if isinstance(osd.get("state"), dict):
        return [(osd["state"][fqn], k) for k in osd["state"].get(fqn, {})]
    prefix = f"state.{fqn}."
    return [(osd, k) for k in osd if k.startswith(prefix)]


def _convert_experts(model, msd: dict, osd: dict, convert) -> tuple[dict, dict]:
    """Apply convert(t, m) to every expert tensor of the model / optimizer state dicts (step counters,
    0-dim, stay as they are); returns new dicts, leaving the optimizer's live state alone."""
    msd = dict(msd)
    osd = {**osd, "state": {k: dict(v) for k, v in osd["state"].items()}} if isinstance(osd.get("state"), dict) \
        else dict(osd)
    for fqn, (m, _) in _expert_fqns(model).items():
        msd[fqn] = convert(msd[fqn], m)
        for d, k in _optim_slots(osd, fqn):
            if isinstance(d[k], torch.Tensor) and d[k].dim() > 0:
                d[k] = convert(d[k], m)
    return msd, osd


def _wrap(model, ctx, msd: dict, osd: dict, gather_full: bool) -> tuple[dict, dict]:
    """Expert entries of the model / optimizer state dicts in logical form (for a load, `gather_full` False
    makes empty full-size targets for balanced placements)."""
    def logical(t, m):
        if m.placement.is_contiguous:
            return _logical(t, m, ctx.ep_mesh)
        return _gather(m, t) if gather_full else t.new_empty(m.n_experts, *t.shape[1:])

    return _convert_experts(model, msd, osd, logical)


def _gather(m: ExpertParallel, t: torch.Tensor) -> torch.Tensor:
    R, S = m.placement.n_ranks, m.placement.slots_per_rank
    full = t.new_empty(R * S, *t.shape[1:])
    comm.all_gather_single(full, t.detach().contiguous(), group=m.group, tag="ckpt_gather")
    return full[torch.tensor([r[0] for r in m.placement.replicas()])]


def _options(fmt: str) -> StateDictOptions:
    return StateDictOptions(flatten_optimizer_state_dict=fmt != "k3-dcp/1")


def _optims(optimizer) -> list:
    return list(optimizer.optimizers.values()) if hasattr(optimizer, "optimizers") else [optimizer]


def save(root, step: int, model, optimizer, ctx, meta: dict, keep_last: int = 3) -> Path:
    """Collective: every rank calls it. Returns the committed step directory."""
    root = Path(root)
    name = f"step_{step:06d}"
    tmp, final = root / f".{name}.tmp", root / name
    if ctx.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
    comm.barrier()
    msd = get_model_state_dict(model)
    osd = get_optimizer_state_dict(model, _optims(optimizer), options=_options(FORMAT))
    msd, osd = _wrap(model, ctx, msd, osd, gather_full=True)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp))
    comm.barrier()
    if ctx.rank == 0:
        atomic_write_json(tmp / META, {"format": FORMAT, "step": step, **meta})
        fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        fsync_dir(root)
        atomic_write_text(root / LATEST, name + "\n")
        steps = sorted((p for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit()),
                       key=lambda p: int(p.name[5:]))  # by number: step_1000000 sorts after step_999999
        for old in steps[:-keep_last] if keep_last > 0 else []:
            if old.name != name:
                shutil.rmtree(old, ignore_errors=True)
    comm.barrier()
    log.info("saved %s", final)
    return final


def read_meta(path) -> dict:
    found = latest(path)
    if found is None:
        raise ValueError(f"no distributed checkpoint in {path} (expected {LATEST} or {META}); train with --out "
                         "and --ckpt-every to write one")
    meta = read_json(found / META, "checkpoint meta file")  # a one-line ValueError when damaged or absurdly deep
    if meta.get("format") not in FORMATS:
        raise ValueError(f"{found / META}: format {meta.get('format')!r} is not one of {list(FORMATS)}")
    return {**meta, "path": str(found)}


def load(path, model, optimizer, ctx) -> dict:
    """Collective: load model and optimizer state in place from `path` (a step dir or a root)."""
    meta = read_meta(path)
    options = _options(meta["format"])
    msd = get_model_state_dict(model)
    # initialises empty optimizer state first
    osd = get_optimizer_state_dict(model, _optims(optimizer), options=options)
    msd, osd = _wrap(model, ctx, msd, osd, gather_full=False)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=meta["path"])
    # back to this rank's slots
    msd, osd = _convert_experts(model, msd, osd,
                                lambda t, m: t.to_local() if m.placement.is_contiguous else full_from(t, m))
    set_model_state_dict(model, msd)
    set_optimizer_state_dict(model, _optims(optimizer), osd, options=options)
    comm.barrier()
    return meta


def full_from(full: torch.Tensor, m: ExpertParallel) -> torch.Tensor:
    """Local slots [S, ...] of a logical [E, ...] expert tensor."""
    return full[torch.tensor(m.local)]


def load_model_weights(path, model) -> dict:
    """Load the model weights of a distributed checkpoint into a plain, single-process `model` (no process
    group: DCP reads every shard itself). The stored tensors are logical (whole FSDP parameters, experts as
    [E, ...]), named as in the unwrapped model, so K3Model(meta["config"]) takes them directly. Returns the
    checkpoint's metadata (k3.json plus `path`)."""
    meta = read_meta(path)
    own = model.state_dict()
    stored = {k.removeprefix("model."): v for k, v in
              dcp.FileSystemReader(meta["path"]).read_metadata().state_dict_metadata.items() if k.startswith("model.")}
    missing, unexpected = sorted(set(own) - set(stored)), sorted(set(stored) - set(own))
    if missing or unexpected:
        raise ValueError(f"{meta['path']}: the distributed checkpoint does not match the model: missing "
                         f"{missing[:5]}, unexpected {unexpected[:5]}; build the model from its k3.json config")
    for k, t in own.items():
        size = tuple(getattr(stored[k], "size", ()))
        if size != tuple(t.shape):
            raise ValueError(f"{meta['path']}: tensor {k!r} has shape {size}, the model expects {tuple(t.shape)}")
    target = {k: t.detach().clone() for k, t in own.items()}
    with warnings.catch_warnings():  # torch warns that it loads in one process, which is the point here
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": target}, checkpoint_id=meta["path"], no_dist=True)
    model.load_state_dict(target, strict=True)
    return meta


def as_manifest(meta: dict) -> dict:
    """A distributed checkpoint's metadata in the shape of a single-process manifest (what `k3 eval`, `k3 sample`
    and the exporters read: path, step, config, data, extra.tokens)."""
    from k3.train.config import RESUME_FIELDS

    train = meta.get("train") or {}
    data = {**{k: train[k] for k in RESUME_FIELDS if k in train}, **(meta.get("data") or {})}  # seq_len for k3 eval
    return {"format": meta["format"], "step": int(meta["step"]), "config": meta["config"],
            "data": data, "extra": {"tokens": meta.get("tokens", 0), "train": meta.get("train")},
            "path": meta["path"], "distributed": {"dims": meta.get("dims")}}
