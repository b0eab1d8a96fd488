"""Plan, run and cache the ablation runs.

Every run is a `RunSpec` (kind, config, train settings, seed, data) whose SHA-256 is its cache key; the run's
directory `OUT/runs/<key>/` holds `result.json` once it is complete (written atomically, last), so a finished
run is never repeated and an interrupted suite picks up where it stopped (a training run resumes from its own
checkpoints, exactly on CPU). Kinds: `train` (the trainer on the tokenized text: validation loss, bits / byte,
expert load), `ptq` (a trained run's final weights evaluated with `qat` set) and `probe` (k3.ablate.probe).
Runs execute in this process (jobs = 1) or in `jobs` worker processes, one CPU thread each (docs/ablations.md).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from k3.ablate import probe as probe_mod
from k3.ablate.suites import PROBE, QAT_RECIPE, Group, Scale, build_groups, moe_payload
from k3.config import K3Config
from k3.fileio import atomic_write_bytes, atomic_write_json, loads_json

log = logging.getLogger(__name__)

CACHE_VERSION = 1  # bump when a change to this module changes what a cached result means
RESULT, WEIGHTS = "result.json", "model.safetensors"
LOAD_TAIL = 0.2  # share of the last training steps whose expert load is averaged
# Mid-run checkpoints (for resume): every quarter of a run, but not more often than every 20 steps; a
# checkpoint costs a few hundred ms and a short run is cheaper to repeat than to save.
CHECKPOINTS_PER_RUN, MIN_CKPT_INTERVAL = 4, 20


@dataclass(frozen=True)
class RunSpec:
    kind: str  # train | ptq | probe
    config: dict
    train: dict
    seed: int
    data: dict  # fingerprint of the tokenized data, or the probe task and its evaluation
    source: str | None = None  # ptq: key of the trained run whose weights are quantized

    @property
    def key(self) -> str:
        blob = json.dumps({"cache_version": CACHE_VERSION, **dataclasses.asdict(self)}, sort_keys=True,
                          default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:20]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class PlanEntry:
    group: str
    variant: str
    seed: int
    spec: RunSpec


@dataclass
class Plan:
    groups: list[Group]
    entries: list[PlanEntry] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # group -> why it did not run
    weights_needed: set[str] = field(default_factory=set)  # train keys whose weights a ptq run reads

    def unique_specs(self) -> dict[str, RunSpec]:
        out: dict[str, RunSpec] = {}
        for e in self.entries:
            out.setdefault(e.spec.key, e.spec)
        return out


# ---------------------------------------------------------------------------------------------- data
def data_fingerprint(files) -> dict:
    """What the text data is, independent of where it lives: the request, the tokenizer and the sizes."""
    return {"request": files.info.get("request"), "tokenizer_hash": files.tokenizer.fingerprint,
            "train_tokens": files.train.n_tokens, "val_tokens": files.val.n_tokens}


_DATA_CACHE: dict[str, object] = {}


def _load_files(data_dir: str):
    if data_dir not in _DATA_CACHE:
        from k3.data import load_data

        _DATA_CACHE[data_dir] = load_data(data_dir)
    return _DATA_CACHE[data_dir]


# ---------------------------------------------------------------------------------------------- QAT check
def qat_status(base: K3Config) -> str | None:
    """None if building the model with `qat` set changes its forward; otherwise why the precision group
    cannot run. Compared with the same weights (the fp32 state loaded as PTQ does), so a QAT module that
    only changes the parameter init order does not count as quantizing."""
    from k3.model.transformer import K3Model

    torch.manual_seed(0)
    ref = K3Model(base).eval()
    try:
        q = K3Model(base.replace(qat=QAT_RECIPE)).eval()
        load_into(q, ref.state_dict())
    except Exception as e:  # any failure here means QAT is not usable yet
        return f"needs QAT (k3.quant): building the model with qat = {QAT_RECIPE} failed ({e})"
    x = torch.randint(0, base.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        if torch.equal(ref(x), q(x)):
            return (f"needs QAT (k3.quant): a model built with qat = {QAT_RECIPE} computes exactly the fp32 "
                    "forward, so config.qat has no effect yet; PTQ/QAT numbers would be fp32 numbers")
    return None


def load_into(model: torch.nn.Module, state: dict) -> None:
    """Load fp32 weights into a (possibly quantizing) model: every saved tensor must be used, and the model
    may only add buffers (quantizer state), never parameters the fp32 run did not train."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    params = {n for n, _ in model.named_parameters()}
    new_params = [m for m in missing if m in params]
    if unexpected or new_params:
        raise ValueError(f"the quantized model does not match the fp32 weights: unused saved tensors "
                         f"{unexpected[:5]}, untrained parameters {new_params[:5]}")


# ---------------------------------------------------------------------------------------------- planning
def plan_runs(scale: Scale, names: list[str], data_fp: dict, user_set: dict | None = None,
              seeds: tuple[int, ...] | None = None) -> Plan:
    """Every (group, variant, seed) of the selected ablations as a RunSpec; the precision group is
    skipped (with the reason) while config.qat has no effect."""
    base = scale.base_config(user_set)
    groups = build_groups(base, names, user_set)
    seeds = tuple(seeds if seeds is not None else scale.seeds)
    plan = Plan(groups)
    for g in groups:
        if g.name == "precision":
            why = qat_status(base)
            if why:
                plan.skipped[g.name] = why
                continue
        for seed in seeds:
            keys = {}
            for v in g.variants:  # sources first: a ptq variant names an earlier variant
                cfg = base.replace(**v.overrides).to_dict()
                train = scale.train_settings(seed)
                if v.ptq_of:
                    src = keys[v.ptq_of]
                    spec = RunSpec("ptq", cfg, train, seed, data_fp, source=src)
                    plan.weights_needed.add(src)
                else:
                    spec = RunSpec("train", cfg, train, seed, data_fp)
                keys[v.label] = spec.key
                plan.entries.append(PlanEntry(g.name, v.label, seed, spec))
    if PROBE in names:
        p = scale.probe
        pdata = {"task": dataclasses.asdict(probe_mod.task_of(p)), "eval_lengths": list(p.eval_lengths),
                 "eval_batches": p.eval_batches, "eval_batch_size": p.eval_batch_size}
        if p.train_len < probe_mod.task_of(p).min_length() or min(p.eval_lengths) < probe_mod.task_of(p).min_length():
            raise ValueError(f"probe lengths must be >= {probe_mod.task_of(p).min_length()} (the needles and their queries)")
        for seed in seeds:
            for label, pattern in probe_mod.probe_patterns(p.n_layers).items():
                train = dict(steps=p.steps, batch_size=p.batch_size, seq_len=p.train_len, lr=p.lr, seed=seed,
                             device="cpu", measure_mfu=False, record_attnres=False)
                spec = RunSpec("probe", probe_mod.probe_config(p, pattern).to_dict(), train, seed, pdata)
                plan.entries.append(PlanEntry(PROBE, label, seed, spec))
    return plan


def run_dir(out: Path, key: str) -> Path:
    return Path(out) / "runs" / key


def cached_result(out: Path, spec: RunSpec, need_weights: bool = False) -> dict | None:
    d = run_dir(out, spec.key)
    try:
        res = loads_json((d / RESULT).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if res.get("key") != spec.key:
        return None
    if "trainer" in res and res["trainer"] != resolved_train(spec):
        return None  # trained under other trainer defaults (k3 changed since): rerun it
    if need_weights and not (d / WEIGHTS).is_file():
        return None  # rerun to get the weights back (training is deterministic on CPU)
    return res


# ---------------------------------------------------------------------------------------------- execution
def evaluate_with_load(model, dataset, batches: int, batch_size: int, seq_len: int, seed: int = 0) -> tuple[float, float | None]:
    """The trainer's `evaluate` (mean CE, nats / token) plus the routers' max / mean expert load over the
    same batches, averaged over MoE layers (None for a model without MoE)."""
    from k3.train.batches import evaluate

    moes = model.moe_layers() if hasattr(model, "moe_layers") else []
    counts: list[torch.Tensor | None] = [None] * len(moes)

    def hook(i):
        def fn(mod, inp, out):
            c = torch.bincount(out[1].reshape(-1), minlength=mod.n_experts).float()
            counts[i] = c if counts[i] is None else counts[i] + c
        return fn

    handles = [m.router.register_forward_hook(hook(i)) for i, m in enumerate(moes)]
    try:
        loss = evaluate(model, dataset, batches, batch_size, seq_len, seed=seed)
    finally:
        for h in handles:
            h.remove()
    ratios = [float(c.max() / c.mean()) for c in counts if c is not None and float(c.mean()) > 0]
    return loss, (sum(ratios) / len(ratios) if ratios else None)


def _trainer(spec: RunSpec, train_data, d: Path):
    from k3.train import checkpoint as ckpt
    from k3.train.trainer import TrainConfig, Trainer

    steps = spec.train["steps"]
    every = max(MIN_CKPT_INTERVAL, steps // CHECKPOINTS_PER_RUN)
    tc = TrainConfig(**spec.train, ckpt_every=every if every < steps else 0, keep_last=1, eval_every=0)
    trainer = Trainer(K3Config.from_dict(spec.config), tc, train_data, None, d)
    resume = ckpt.latest_checkpoint(trainer.ckpt_dir) is not None
    if resume:
        log.info("resuming %s from its checkpoint", d.name)
    return trainer, resume


def _curve(d: Path) -> tuple[list[float], list[float]]:
    from k3.train.metrics import read_metrics

    recs = [r for r in read_metrics(d / "metrics.jsonl") if r.get("kind") == "train"]
    return ([round(r["loss"], 5) for r in recs],
            [r.get("expert_load_max_mean_overall") for r in recs])


def resolved_train(spec: RunSpec) -> dict | None:
    """Every trainer setting the run used, the defaults the spec leaves out included (JSON form): the cache
    key hashes only the spec, so a result is checked against these too."""
    if spec.kind == "ptq":
        return None
    from k3.train.trainer import TrainConfig

    return loads_json(json.dumps(dataclasses.asdict(TrainConfig(**spec.train)), default=str))


def _finish(d: Path, res: dict) -> dict:
    atomic_write_json(d / RESULT, res)
    shutil.rmtree(d / "checkpoint", ignore_errors=True)
    return res


def _save_weights(model, path: Path) -> None:
    from safetensors.torch import save

    atomic_write_bytes(path, save({k: v.contiguous() for k, v in model.state_dict().items()}))


def execute(spec: RunSpec, out: str | os.PathLike, data_dir: str | None, save_weights: bool = False,
            on_step: Callable[[dict], None] | None = None) -> dict:
    """Run one spec to completion (resuming its checkpoint if any) and write its result.json."""
    from k3.model.accounting import count_params
    from k3.train.metrics import bits_per_byte

    d = run_dir(Path(out), spec.key)
    d.mkdir(parents=True, exist_ok=True)
    atomic_write_json(d / "spec.json", {"key": spec.key, **spec.to_dict()})
    t0 = time.perf_counter()
    res: dict = {"key": spec.key, "kind": spec.kind, "seed": spec.seed, "trainer": resolved_train(spec)}
    config = K3Config.from_dict(spec.config)

    if spec.kind == "probe":
        task = probe_mod.RecallTask(**spec.data["task"])
        trainer, resume = _trainer(spec, probe_mod.RecallData(task), d)
        trainer.fit(resume=resume, on_step=on_step)
        res["accuracy"] = {str(L): probe_mod.recall_accuracy(trainer.model, task, L, spec.data["eval_batches"],
                                                             spec.data["eval_batch_size"])
                           for L in spec.data["eval_lengths"]}
        res["train_len"] = spec.train["seq_len"]
        res["train_loss"], _ = _curve(d)
        res["seconds"] = round(time.perf_counter() - t0, 2)
        return _finish(d, res)

    files = _load_files(data_dir)
    bpt = files.val.manifest.get("bytes_per_token")
    tr = spec.train
    if spec.kind == "train":
        trainer, resume = _trainer(spec, files.train, d)
        trainer.fit(resume=resume, on_step=on_step)
        model = trainer.model
        losses, loads = _curve(d)
        tail = [x for x in loads[-max(1, math.ceil(LOAD_TAIL * len(loads))):] if x is not None]
        res["train_loss"] = losses
        res["load_max_mean"] = sum(tail) / len(tail) if tail else None
        res["tokens"] = trainer.tokens
        res["flops_per_token"] = trainer.flops_per_token
        if save_weights:
            _save_weights(model, d / WEIGHTS)
    elif spec.kind == "ptq":
        from safetensors.torch import load_file

        from k3.model.transformer import K3Model

        src = run_dir(Path(out), spec.source) / WEIGHTS
        if not src.is_file():
            raise ValueError(f"PTQ needs the fp32 weights at {src}; rerun the suite (it retrains that run)")
        model = K3Model(config)
        load_into(model, load_file(src))
    else:
        raise ValueError(f"run kind {spec.kind!r} is unknown; use train, ptq or probe")
    loss, load_val = evaluate_with_load(model, files.val, tr["eval_batches"], tr["batch_size"], tr["seq_len"],
                                        seed=tr["seed"])
    counts = count_params(model)
    res.update(val_loss=loss, val_bpb=bits_per_byte(loss, bpt) if bpt else None, load_max_mean_val=load_val,
               active_params=counts["active"], total_params=counts["total"],
               moe_payload=moe_payload(config) if model.moe_layers() else None,
               seconds=round(time.perf_counter() - t0, 2))
    return _finish(d, res)  # PTQ has no training steps, so no training-tail load: only load_max_mean_val


def _worker_init() -> None:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)


def _execute_in_worker(spec_dict: dict, out: str, data_dir: str | None, save_weights: bool) -> dict:
    return execute(RunSpec(**spec_dict), out, data_dir, save_weights)


def auto_jobs() -> int:
    """The CPU cores other work leaves free now (k3.train.device.busy_cores; the load average where /proc/stat is
    missing), at least 1, at most the core count."""
    from k3.train.device import busy_now

    n = os.cpu_count() or 1
    busy, _ = busy_now()
    return n if busy is None else max(1, min(n, int(n - busy + 0.5)))


def run_plan(plan: Plan, out: str | os.PathLike, data_dir: str | None, jobs: int = 1, progress: bool = True,
             desc: str = "ablate", failures: dict[str, dict] | None = None) -> dict[str, dict]:
    """Execute every spec of `plan` that is not cached; returns key -> result for those that finished.

    A run that raises (diverged, a PTQ whose trained run failed, ...) does not stop the others: it is left out
    of the results (its seed counts as missing), not cached, and recorded in `failures` (key -> {"run",
    "error"}); the next invocation retries it."""
    failures = {} if failures is None else failures
    from tqdm.auto import tqdm

    out = Path(out)
    specs = plan.unique_specs()
    results: dict[str, dict] = {}
    todo: list[list[RunSpec]] = [[], []]  # trained runs first, then the PTQ evaluations that read them
    for key, spec in specs.items():
        res = cached_result(out, spec, need_weights=key in plan.weights_needed)
        if res is not None:
            results[key] = res
        else:
            todo[spec.kind == "ptq"].append(spec)
    # a trained run that runs again (stale, or never finished) makes its PTQ evaluations stale too, and its old
    # weights must not stand in for the new ones if the new run fails
    retrain = {s.key for s in todo[0]}
    for s in todo[0]:
        (run_dir(out, s.key) / WEIGHTS).unlink(missing_ok=True)
    for key, spec in specs.items():
        if spec.kind == "ptq" and spec.source in retrain and key in results:
            del results[key]
            todo[1].append(spec)
    label = {e.spec.key: f"{e.group}/{e.variant} s{e.seed}" for e in plan.entries}
    bar = tqdm(total=len(specs), initial=len(results), unit="run", desc=desc, disable=not progress,
               dynamic_ncols=True)
    bar.set_postfix_str(f"{len(results)} cached")
    try:
        for phase in todo:
            if jobs <= 1 or len(phase) <= 1:
                for spec in phase:
                    steps = spec.train["steps"]
                    shown = [0.0]

                    def on_step(rec, name=label[spec.key], steps=steps, shown=shown):
                        now = time.monotonic()
                        if now - shown[0] >= 1.0 or rec["step"] == steps:  # at most one redraw a second
                            shown[0] = now
                            bar.set_postfix_str(f"{name} step {rec['step']}/{steps} loss {rec['loss']:.3f}")

                    bar.set_postfix_str(label[spec.key])
                    try:
                        results[spec.key] = execute(spec, out, data_dir, spec.key in plan.weights_needed, on_step)
                    except Exception as e:  # noqa: BLE001 - one run's failure is reported, the suite goes on
                        _failed(failures, spec.key, label[spec.key], e)
                    bar.update(1)
            else:
                import multiprocessing as mp
                from concurrent.futures import ProcessPoolExecutor, as_completed

                with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn"),
                                         initializer=_worker_init) as pool:
                    futs = {pool.submit(_execute_in_worker, s.to_dict(), str(out), data_dir,
                                        s.key in plan.weights_needed): s for s in phase}
                    for f in as_completed(futs):
                        s = futs[f]
                        try:
                            results[s.key] = f.result()
                            bar.set_postfix_str(f"done {label[s.key]}")
                        except Exception as e:  # noqa: BLE001
                            _failed(failures, s.key, label[s.key], e)
                        bar.update(1)
    finally:
        bar.close()
    return results


def _failed(failures: dict, key: str, run: str, err: BaseException) -> None:
    msg = f"{type(err).__name__}: {err}"
    failures[key] = {"run": run, "error": msg}
    log.warning("run %s failed (%s); the suite goes on without it", run, msg)
