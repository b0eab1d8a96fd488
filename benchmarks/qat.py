"""PTQ vs QAT: does training through the MX fake quant recover the loss that quantizing afterwards costs?

    python benchmarks/qat.py [--json] [--quick] [--preset mini] [--steps N] [--seeds 0,1,2]
                             [--settings k3,harshest,harshest_head] [--ptq-only harsh]
                             [--qat-start F [--qat-lr-scale S] [--qat-kd W] [--diagnose]] [--gptq N] [--resume]
                             [--merge A.json ...]

Same data, schedule and token budget for every run, on the tokenized standard-library corpus (runs/data, made
here if missing). For each seed:
  fp32   train in full precision with that seed -> validation loss
  PTQ    that seed's fp32 weights loaded into a model built with the setting (nothing retrained) -> val loss;
         PTQ - fp32 is paired: same weights, no training noise
  QAT    train from scratch with the setting (fake quant + straight-through estimator), same seed -> val loss;
         with --qat-start F, QAT takes over the fp32 run's full training state (weights, optimizer moments,
         balancing bias, RNG) after F x steps and trains the remaining steps with the setting: the same token
         budget and schedule, QAT as the fine-tuning end of pretraining (as LLM-QAT, arXiv 2305.17888, starts
         from a trained model), and the first F x steps are shared with the fp32 run instead of re-drawn;
         --qat-lr-scale S runs that QAT phase at S times the fp32 run's learning rate (same schedule shape);
         --qat-kd W trains it by distillation from the same seed's final fp32 model (LLM-QAT's recipe):
         (1 - W) x CE + W x KL(fp32 || student), with a control run fp32_kd (the same distillation, no quant)
         --diagnose also evaluates the QAT run's weights without quantization (QAT - fp32 = (that - fp32) +
         (QAT - that)) and tracks how the quantized weights change step by step (CodeTracker)
  --gptq N  PTQ and QAT once more with the block linears' (and a quantized head's) weights rounded by GPTQ
         (k3.quant.gptq, arXiv 2210.17323) instead of to nearest, calibrated on the run's own last N training
         batches: no new tokens, no gradient steps
Per setting: mean and sample std over seeds of PTQ - fp32 and of QAT - fp32, and
recovery = (mean PTQ - mean QAT) / (mean PTQ - mean fp32): the fraction of the PTQ degradation that QAT wins
back (target >= 0.8). QAT - fp32 carries training noise (two trainings), PTQ - fp32 does not, so a recovery is
only as good as qat_gap_sem is small against the degradation: recovery_low / recovery_high are the recovery with
the QAT gap moved up / down by 2 standard errors. verdict: "met" when recovery_low >= 0.8, "not met" when
recovery_high < 0.8, "inconclusive" otherwise and whenever the mean PTQ degradation is not more than 2 standard
errors above 0 (runs before this rule recorded "met" on the mean recovery alone, and "inconclusive" for every
miss).
The seed spread is the mean |fp32(seed i) - fp32(seed j)| over seed pairs (one seed: a second fp32 run with
seed + 1, unless --no-seed-spread).
Settings: 'k3' = routed-expert weights MXFP4 + their input activations MXFP8 (K3's); 'harsh' = that plus every
other linear layer in the blocks (weights MXFP4, inputs MXFP8); 'harshest' = all of those with MXFP4 activations
(W4A4); 'harshest_head' = harshest with the output head W4A4 too, i.e. literally every linear layer;
'harsh_head' = harsh with the output head W4A8 too: every linear layer's weights MXFP4, every input MXFP8.
'head_w4' / 'head_a8' = the output head alone, its weight in MXFP4 / its input in MXFP8, nothing else quantized:
where harsh_head's cost comes from.
--ptq-only settings get the PTQ evaluation only (cheap: no training), to show how much quantizing costs.
The default model is `mini-s`, a mini-shaped model scaled down so that each run takes minutes on a shared
2-core CPU; `--preset mini` runs the real mini (about 4x slower per step). Validation uses the whole split.
Writes runs/bench/qat.json (--quick: runs/bench/quick/qat.json) atomically, after every seed (a stopped run leaves the seeds it finished; --resume
keeps them and runs only the missing seeds, so more seeds can be added to a finished run the same way; --merge
A.json B.json keeps the seeds of other files of the same experiment, e.g. seeds split over two processes; a file
that also ran PTQ-only settings not named in --ptq-only is accepted, those figures left out).
"""
from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from k3.benchtools import bench_out
from k3.config import PRESETS, K3Config, get_config
from k3.data import DEFAULT_VOCAB_SIZE, prepare_data
from k3.fileio import atomic_write_json
from k3.model.transformer import K3Model
from k3.model.moe import RoutedExperts
from k3.model.qat import QATLinear
from k3.ops.mx.fake import fake_quant
from k3.quant.gptq import GPTQLinear, gptq_linears_, gptq_roundable
from k3.train.trainer import TrainConfig, Trainer
from k3.train.batches import evaluate

ROOT = Path(__file__).resolve().parents[1]
# name -> (config.qat, format of the output head's weight, of its input); the head is outside config.qat's reach
# (the library keeps it full precision), so this benchmark wraps it in a QATLinear itself
SETTINGS = {
    "k3": ({"expert_weights": "mxfp4", "activations": "mxfp8"}, None, None),
    "harsh": ({"expert_weights": "mxfp4", "activations": "mxfp8", "linears": "mxfp4"}, None, None),
    "harshest": ({"expert_weights": "mxfp4", "activations": "mxfp4", "linears": "mxfp4"}, None, None),
    "harshest_head": ({"expert_weights": "mxfp4", "activations": "mxfp4", "linears": "mxfp4"}, "mxfp4", "mxfp4"),
    "harsh_head": ({"expert_weights": "mxfp4", "activations": "mxfp8", "linears": "mxfp4"}, "mxfp4", "mxfp8"),
    "head_w4": ({}, "mxfp4", None),
    "head_a8": ({}, None, "mxfp8"),
}
RECOVERY_TARGET = 0.8
# mini's structure (KDA + MLA, block AttnRes, LatentMoE with a shared expert, 8192-token vocab), smaller widths
MINI_S = dict(name="mini-s", d_model=128, n_layers=4, kda_heads=2, kda_head_dim=64, kda_gate_rank=32, mla_heads=2,
              mla_q_lora_rank=64, mla_kv_lora_rank=64, mla_qk_head_dim=64, mla_v_head_dim=64, attnres_sources=3,
              dense_ffn=384, moe_latent_dim=64, n_experts=32, n_active_experts=4, expert_ffn=128, shared_ffn=256)


def base_config(preset: str, quick: bool = False):
    if quick:  # the tokenized corpus is shared: keep its 8192-token vocabulary
        return get_config("tiny", vocab_size=DEFAULT_VOCAB_SIZE)
    if preset == "mini-s":
        return K3Config.from_dict({**PRESETS["mini"], **MINI_S})
    return get_config(preset)


def quantize_head(model: K3Model, setting: str) -> K3Model:
    """Wrap model.head in a QATLinear sharing its weight when the setting quantizes the head's weight or input;
    the optimizer, built before, holds the same Parameter, so training goes on."""
    _, weight, act = SETTINGS[setting]
    if weight is not None or act is not None:
        model.head = QATLinear(model.head, weight, act)
    return model


def quantized_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor, str]]:
    """(name, parameter, MX format) of every weight `model` fake-quantizes: the QATLinears' weights (head
    included when wrapped) and the routed experts' w1, w3, w2; all are quantized in blocks along dim 1."""
    out = []
    for mname, m in model.named_modules():
        if isinstance(m, QATLinear) and m.weight_format:
            out.append((f"{mname}.weight", m.weight, m.weight_format))
        elif isinstance(m, RoutedExperts) and m.weight_format:
            out += [(f"{mname}.{w}", getattr(m, w), m.weight_format) for w in ("w1", "w3", "w2")]
    return out


class CodeTracker:
    """--diagnose: how the quantized weights move during the QAT phase. After every optimizer step it compares
    each weight's quantized values (element code and block scale together) with those after the step before:
    `changes` counts the elements whose quantized value changed, `reverts` those that changed back to the value
    of two steps ago (a weight oscillating between two grid points, as Nagel et al., arXiv 2203.11086, and
    TetraJet, arXiv 2502.20853, describe)."""

    def __init__(self, model: torch.nn.Module):
        self.weights = quantized_weights(model)
        self.n = sum(p.numel() for _, p, _ in self.weights)
        self.start = self.prev = self._quantized()
        self.before: list[torch.Tensor] | None = None
        self.changes: list[int] = []
        self.reverts: list[int] = []

    @torch.no_grad()
    def _quantized(self) -> list[torch.Tensor]:
        return [fake_quant(p.detach(), fmt, dim=1) for _, p, fmt in self.weights]

    def __call__(self) -> None:
        now = self._quantized()
        self.changes.append(sum(int((a != b).sum()) for a, b in zip(now, self.prev)))
        self.reverts.append(0 if self.before is None else
                            sum(int(((a != b) & (a == c)).sum()) for a, b, c in zip(now, self.prev, self.before)))
        self.before, self.prev = self.prev, now

    def summary(self) -> dict:
        k = min(5, len(self.changes))
        changed = sum(int((a != b).sum()) for a, b in zip(self.prev, self.start))
        return {"quantized_weights": self.n, "steps": len(self.changes),
                "change_rate_first5": sum(self.changes[:k]) / k / self.n if k else None,
                "change_rate_last5": sum(self.changes[-k:]) / k / self.n if k else None,
                "revert_share": sum(self.reverts) / sum(self.changes) if sum(self.changes) else None,
                "changed_over_phase": changed / self.n}


def _run_steps(trainer: Trainer, until: int, losses: list[float], desc: str = "train", after_step=None,
               records: list[dict] | None = None) -> None:
    """Train up to step `until`, with a progress bar on stderr (a line every 30 s when stderr is a file);
    `after_step()` is called after every optimizer step; `records` (if given) collects each step's record."""
    from tqdm.auto import tqdm

    tty = sys.stderr.isatty()
    with tqdm(total=until, initial=trainer.step, desc=desc, unit="step", file=sys.stderr, dynamic_ncols=tty,
              mininterval=0.5 if tty else 30.0, disable=until <= trainer.step) as bar:
        while trainer.step < until:
            rec = trainer.train_step()
            losses.append(rec["loss"])
            if records is not None:
                records.append(rec)
            if after_step is not None:
                after_step()
            bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
            bar.update(1)


def _record(trainer: Trainer, losses: list[float], train_s: float, files, args, tokens_timed: int) -> dict:
    """tokens_timed: the tokens trained within train_s (a continued run times only its own steps)."""
    tail = losses[-10:]
    rec = {"train_loss_last10": sum(tail) / len(tail), "tokens": trainer.tokens, "train_s": round(train_s, 1),
           "tokens_per_s": round(tokens_timed / train_s, 1) if train_s > 0 else None}
    rec.update(val(trainer.model, files, args))
    return rec


class DistillTrainer(Trainer):
    """QAT with distillation from the full-precision model (LLM-QAT's recipe, arXiv 2305.17888): the objective
    is (1 - w) * CE(student, next token) + w * KL(teacher || student), per token, temperature 1, on the same
    batches. The teacher is frozen and evaluated without quantization."""

    def __init__(self, *a, teacher: torch.nn.Module, kd_weight: float, **kw):
        super().__init__(*a, **kw)
        self.teacher, self.kd_weight = teacher.eval(), kd_weight

    def loss_fn(self, logits, x, y):
        logits = logits.float().reshape(-1, logits.shape[-1])
        with torch.no_grad():
            t_logp = F.log_softmax(self.teacher(x).float().reshape(-1, logits.shape[-1]), dim=-1)
        kl = F.kl_div(F.log_softmax(logits, dim=-1), t_logp, log_target=True, reduction="batchmean")
        if self.kd_weight == 1.0:
            return kl
        return (1.0 - self.kd_weight) * F.cross_entropy(logits, y.reshape(-1)) + self.kd_weight * kl


def make_trainer(config, files, args, seed: int, setting: str | None = None,
                 teacher: torch.nn.Module | None = None) -> Trainer:
    # doc_mask off: the recorded QAT, forms, stability and MoE-contribution runs trained across document
    # boundaries, and these comparisons are about other things (benchmarks/doc_mask.py measures the masking)
    tc = TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                     warmup_steps=args.warmup_steps, seed=seed, measure_mfu=False, record_attnres=False,
                     doc_mask=False)
    if setting is not None:
        config = config.replace(qat=SETTINGS[setting][0])
    if teacher is None:
        trainer = Trainer(config, tc, files.train, None)  # no periodic eval: one full-split eval at the end
    else:
        trainer = DistillTrainer(config, tc, files.train, None, teacher=teacher, kd_weight=args.qat_kd)
    if setting is not None:
        quantize_head(trainer.model, setting)  # trainer.forward is the model itself (no compile here)
        if getattr(args, "qat_gptq", False):  # QAT through GPTQ rounding; GPTQLinear shares the parameters
            for name, m in list(trainer.model.named_modules()):
                if gptq_roundable(m) and in_gptq_scope(name, args):
                    parent, _, attr = name.rpartition(".")
                    setattr(trainer.model.get_submodule(parent) if parent else trainer.model, attr, GPTQLinear(m))
    return trainer


def post_hoc_gptq(args, setting: str | None) -> bool:
    """--gptq without --qat-gptq: a QAT run is evaluated once more with its weights GPTQ-rounded after training
    (callers that build their own args, e.g. benchmarks/moe_contrib.py, have neither flag)."""
    return setting is not None and bool(getattr(args, "gptq", 0)) and not getattr(args, "qat_gptq", False)


def in_gptq_scope(name: str, args) -> bool:
    """--gptq-scope: 'all' QATLinears, or only the output 'head'."""
    return args.gptq_scope == "all" or name == "head"


def train_run(config, files, args, label: str, seed: int, setting: str | None = None,
              snapshot_at: int | None = None) -> tuple[K3Model, dict, dict | None]:
    """Train `args.steps` steps -> (model, record, snapshot). With snapshot_at, the complete training state
    after that many steps (weights, balancing buffers, optimizer moments, RNG) is kept for `continue_run`."""
    trainer = make_trainer(config, files, args, seed, setting)
    losses: list[float] = []
    snapshot = None
    t0 = time.perf_counter()
    if snapshot_at is not None:
        _run_steps(trainer, snapshot_at, losses, f"seed {seed} {label}")
        snapshot = {"step": trainer.step, "tokens": trainer.tokens, "losses": list(losses),
                    "model": copy.deepcopy(trainer.model.state_dict()),
                    "optimizer": copy.deepcopy(trainer.optimizer.state_dict()),
                    "rng": torch.get_rng_state()}
    _run_steps(trainer, args.steps, losses, f"seed {seed} {label}")
    rec = _record(trainer, losses, time.perf_counter() - t0, files, args, trainer.tokens)
    if post_hoc_gptq(args, setting) and (g := gptq_record(trainer.model, files, args, seed)) is not None:
        rec["gptq"] = g  # QAT from scratch; this model is not used after
    print(f"seed {seed} {label}: {json.dumps(rec)}", file=sys.stderr, flush=True)
    return trainer.model, rec, snapshot


def continue_run(config, files, args, label: str, seed: int, snapshot: dict, setting: str | None,
                 teacher: torch.nn.Module | None = None) -> dict:
    """QAT for the end of the budget: a model built with `setting` takes over the fp32 run's state at
    snapshot["step"] and trains the remaining steps with fake quant. The first steps are the fp32 run's own,
    so QAT - fp32 carries only the noise of the last steps. setting None continues in fp32 (the test that
    the hand-over is exact: it must reproduce the fp32 run). teacher: train those steps by distillation from
    it (DistillTrainer, weight args.qat_kd)."""
    trainer = make_trainer(config, files, args, seed, setting, teacher)
    trainer.model.load_state_dict(snapshot["model"])
    # a copy: Optimizer.load_state_dict keeps the given state tensors and steps them in place, so without it
    # this run's moments (which have seen the batches after the snapshot) would leak into the next hand-over
    trainer.optimizer.load_state_dict(copy.deepcopy(snapshot["optimizer"]))
    for g in trainer.optimizer.param_groups:  # --qat-lr-scale: the QAT phase's learning rate, relative
        g["peak_lr"] = g.get("peak_lr", g["lr"]) * args.qat_lr_scale
    trainer.step, trainer.tokens = snapshot["step"], snapshot["tokens"]
    torch.set_rng_state(snapshot["rng"])
    losses = list(snapshot["losses"])
    tracker = CodeTracker(trainer.model) if getattr(args, "diagnose", False) and setting is not None else None
    t0 = time.perf_counter()
    _run_steps(trainer, args.steps, losses, f"seed {seed} {label}", tracker)
    rec = _record(trainer, losses, time.perf_counter() - t0, files, args, trainer.tokens - snapshot["tokens"])
    rec["qat_from_step"] = snapshot["step"]
    if tracker is not None:  # the same trained weights evaluated without any quantization
        latent = K3Model(config)
        latent.load_state_dict(trainer.model.state_dict())
        rec["diagnosis"] = {"latent_val_loss": val(latent, files, args)["val_loss"], **tracker.summary()}
    if teacher is not None:
        rec["objective"] = f"{1 - args.qat_kd:g} x CE + {args.qat_kd:g} x KL(fp32 || student)"
    if post_hoc_gptq(args, setting) and (g := gptq_record(trainer.model, files, args, seed)) is not None:
        rec["gptq"] = g  # last: it overwrites the trained weights
    print(f"seed {seed} {label}: {json.dumps(rec)}", file=sys.stderr, flush=True)
    return rec


def calibration_batches(files, args, seed: int) -> list[torch.Tensor]:
    """--gptq N: the inputs of the run's own last N training batches (tokens inside the budget, no new data)."""
    return [files.train.get_batch(i, args.batch_size, args.seq_len, seed)[0]
            for i in range(max(0, args.steps - args.gptq), args.steps)]


def gptq_record(model, files, args, seed: int) -> dict:
    """--gptq: round the model's QATLinear weights with GPTQ (in place) and evaluate it again; None for a
    setting without QATLinears (k3: routed experts only, which keep round-to-nearest)."""
    if not any(gptq_roundable(m) and in_gptq_scope(n, args) for n, m in model.named_modules()):
        return None
    t0 = time.perf_counter()
    rep = gptq_linears_(model, calibration_batches(files, args, seed), only=lambda n: in_gptq_scope(n, args))
    layers = rep["layers"].values()
    rtn = sum(v["rtn_error"] for v in layers)
    out = {"calibration_tokens": rep["calibration_tokens"], "gptq_s": round(time.perf_counter() - t0, 1),
           "layers": len(layers), "output_error_ratio": sum(v["gptq_error"] for v in layers) / rtn if rtn else None}
    out.update(val(model, files, args))
    return out


def val(model, files, args) -> dict:
    t0 = time.perf_counter()
    loss = evaluate(model, files.val, args.eval_batches, args.batch_size, args.seq_len)
    return {"val_loss": loss, "eval_s": round(time.perf_counter() - t0, 1)}


def ptq(fp32_model, setting: str, files, args, seed: int) -> dict:
    """PTQ exactly as defined: build the model with the setting, load the fp32-trained weights, evaluate.
    --gptq: then also with the weights rounded by GPTQ instead of to nearest (record key "gptq")."""
    model = quantize_head(K3Model(fp32_model.config.replace(qat=SETTINGS[setting][0])), setting)
    model.load_state_dict(fp32_model.state_dict())
    rec = val(model, files, args)
    if args.gptq and (g := gptq_record(model, files, args, seed)) is not None:
        rec["gptq"] = g
    return rec


def mean_std_sem(xs: list[float]) -> tuple[float, float | None, float | None]:
    """Mean, sample standard deviation and standard error of the mean (None for one value)."""
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, None, None
    s = statistics.stdev(xs)
    return m, s, s / math.sqrt(len(xs))


def verdict(d_mean: float, d_sem: float | None, recovery: float | None, low: float | None,
            high: float | None) -> str:
    """The recovery target, read both ways: "met" when even the pessimistic recovery (the QAT gap 2 standard
    errors higher) reaches RECOVERY_TARGET, "not met" when even the optimistic one (2 SE lower) stays below it,
    "inconclusive" otherwise, and whenever the PTQ degradation is not clearly above 0 (a ratio over noise). The QAT
    gap carries the noise of its own training runs, which the paired PTQ degradation does not."""
    if d_sem is None:
        return "inconclusive: one seed gives no standard error; run --seeds 0,1,2"
    if not d_mean > 2 * d_sem or low is None:  # (low is None when the mean degradation is not above 0)
        return (f"inconclusive: PTQ degradation {d_mean:.4g} is not more than 2 standard errors "
                f"(2 x {d_sem:.2g}) above 0")
    span = f"recovery {recovery:.2f}, {low:.2f} to {high:.2f} within 2 SE of the QAT gap"
    if low >= RECOVERY_TARGET:
        return f"met: {span}"
    if high < RECOVERY_TARGET:
        return f"not met: {span}, below {RECOVERY_TARGET}"
    return f"inconclusive: {span}, which straddles {RECOVERY_TARGET}"


def summarize(degradations: list[float], gaps: list[float] | None, spread: float | None) -> dict:
    """Per-seed PTQ - fp32 (paired) and QAT - fp32 (paired by seed) -> means, stds, SEMs, recovery, verdict.

    gaps None: a PTQ-only setting (no recovery, no verdict on it)."""
    d_mean, d_std, d_sem = mean_std_sem(degradations)
    out = {"ptq_degradation": d_mean, "ptq_degradation_std": d_std, "ptq_degradation_sem": d_sem,
           "ptq_degradation_per_seed": degradations,
           "ptq_degradation_over_seed_spread": d_mean / spread if spread else None,
           "ptq_degradation_z": d_mean / d_sem if d_sem else None}
    if gaps is None:
        return out
    g_mean, g_std, g_sem = mean_std_sem(gaps)
    recovery = (d_mean - g_mean) / d_mean if d_mean > 0 else None
    low = (d_mean - g_mean - 2 * g_sem) / d_mean if d_mean > 0 and g_sem is not None else None
    high = (d_mean - g_mean + 2 * g_sem) / d_mean if d_mean > 0 and g_sem is not None else None
    out.update({"qat_gap": g_mean, "qat_gap_std": g_std, "qat_gap_sem": g_sem, "qat_gap_per_seed": gaps,
                "recovery": recovery, "recovery_low": low, "recovery_high": high,
                "verdict": verdict(d_mean, d_sem, recovery, low, high)})
    return out


def kd_control(runs: dict, done: list[str], name: str, degradations: list[float]) -> dict:
    """With --qat-kd, distillation may help by itself. The control run (fp32_kd: the same distillation steps
    without quantization) separates that: QAT measured against it instead of against the fp32 run."""
    own = [runs[s]["fp32_kd"]["val_loss"] - runs[s]["fp32"]["val_loss"] for s in done]
    gaps = [runs[s][f"qat_{name}"]["val_loss"] - runs[s]["fp32_kd"]["val_loss"] for s in done]
    d_mean = statistics.fmean(degradations)
    g_mean, g_std, g_sem = mean_std_sem(gaps)
    return {"kd_control_gain_per_seed": own, "kd_control_gain": statistics.fmean(own),
            "qat_gap_vs_kd_control_per_seed": gaps, "qat_gap_vs_kd_control": g_mean,
            "qat_gap_vs_kd_control_sem": g_sem,
            "recovery_vs_kd_control": (d_mean - g_mean) / d_mean if d_mean > 0 else None}


def diagnosis(runs: dict, done: list[str], name: str) -> dict:
    """--diagnose, per setting: the QAT gap split into the QAT weights' own fp32 quality (latent - fp32) and
    what quantizing them costs (QAT - latent), and the means over seeds of the code-change statistics."""
    d = [runs[s][f"qat_{name}"]["diagnosis"] for s in done]
    latent = [x["latent_val_loss"] - runs[s]["fp32"]["val_loss"] for x, s in zip(d, done)]
    own = [runs[s][f"qat_{name}"]["val_loss"] - x["latent_val_loss"] for x, s in zip(d, done)]
    out = {"latent_gap_per_seed": latent, "own_quant_cost_per_seed": own}
    for key, xs in (("latent_gap", latent), ("own_quant_cost", own)):
        out[key], _, out[f"{key}_sem"] = mean_std_sem(xs)
    for key in ("change_rate_first5", "change_rate_last5", "revert_share", "changed_over_phase"):
        vals = [x[key] for x in d if x[key] is not None]
        out[key] = statistics.fmean(vals) if vals else None
    return out


def _mean_or_none(xs) -> float | None:
    xs = list(xs)
    return None if any(x is None for x in xs) else statistics.fmean(xs)


def gptq_summary(runs: dict, done: list[str], name: str, degradations: list[float], trained: bool,
                 in_loop: bool = False) -> dict:
    """--gptq, per setting: PTQ and QAT with GPTQ rounding, against fp32 and against round-to-nearest PTQ.
    in_loop (--qat-gptq): the QAT runs were trained through GPTQ rounding, and their own val loss is the one."""
    fp32 = {s: runs[s]["fp32"]["val_loss"] for s in done}
    deg = [runs[s][f"ptq_{name}"]["gptq"]["val_loss"] - fp32[s] for s in done]
    d_mean, _, d_sem = mean_std_sem(deg)
    rtn = statistics.fmean(degradations)
    out = {"ptq_degradation": d_mean, "ptq_degradation_sem": d_sem, "ptq_degradation_per_seed": deg,
           "ptq_recovery": (rtn - d_mean) / rtn if rtn > 0 else None,
           "ptq_output_error_ratio": _mean_or_none(runs[s][f"ptq_{name}"]["gptq"]["output_error_ratio"]
                                                   for s in done)}
    if trained:
        qat = {s: runs[s][f"qat_{name}"] if in_loop else runs[s][f"qat_{name}"]["gptq"] for s in done}
        gaps = [qat[s]["val_loss"] - fp32[s] for s in done]
        rule = summarize(degradations, gaps, None)  # the script's rule, with the GPTQ-rounded QAT gaps
        g_mean = rule["qat_gap"]
        out.update({"qat_gap": g_mean, "qat_gap_sem": rule["qat_gap_sem"], "qat_gap_per_seed": gaps,
                    "recovery_vs_rtn_ptq": rule["recovery"], "recovery_vs_rtn_ptq_low": rule["recovery_low"],
                    "verdict_vs_rtn_ptq": rule["verdict"],
                    "recovery_vs_gptq_ptq": (d_mean - g_mean) / d_mean if d_mean > 0 else None,
                    "qat_through_gptq": in_loop})
        if not in_loop:
            out["qat_output_error_ratio"] = _mean_or_none(qat[s]["output_error_ratio"] for s in done)
    return out


def machine() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": sys.version.split()[0],
            "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def names_of(spec: str, flag: str) -> list[str]:
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if set(names) - set(SETTINGS):
        raise SystemExit(f"{flag} {spec!r}: use a comma-separated subset of {', '.join(SETTINGS)}")
    return names


def add_run_args(ap: argparse.ArgumentParser) -> None:
    """The model, training budget, seeds and data options shared by the scripts that train like this one
    (benchmarks/moe_contrib.py): the same flags give the same fp32 runs."""
    ap.add_argument("--preset", default="mini-s", help="mini-s (default), mini, or any preset")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per training run (default 200)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup-steps", type=int, default=10)
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated training seeds (default 0,1,2)")
    ap.add_argument("--eval-batches", type=int, default=None, help="validation batches (default: the whole split)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: the machine is shared)")
    ap.add_argument("--data", default=str(ROOT / "runs" / "data"))


def finish_run_args(args: argparse.Namespace, name: str) -> argparse.Namespace:
    """After parsing add_run_args' flags (plus --quick and --out): the default output file for benchmark `name`,
    the thread count, and the budget (--quick: 4 steps of 2 x 32 tokens, 2 validation batches; else 200 steps)."""
    args.out = args.out or str(bench_out(name, args.quick))
    torch.set_num_threads(args.threads)
    if args.quick:
        args.steps, args.batch_size, args.seq_len = args.steps or 4, 2, 32
        args.eval_batches = args.eval_batches or 2
    args.steps = args.steps or 200
    return args


def parse_seeds(spec: str) -> list[int]:
    """'0,1,2' -> [0, 1, 2]; anything else (non-integers, repeats, nothing) exits with a message."""
    try:
        seeds = [int(s) for s in spec.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"--seeds {spec!r}: use comma-separated integers, e.g. --seeds 0,1,2") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise SystemExit(f"--seeds {spec!r}: give one or more distinct integers, e.g. --seeds 0,1,2")
    return seeds


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="tiny model, a few steps: a smoke test of the script")
    add_run_args(ap)
    ap.add_argument("--settings", default="k3,harshest,harshest_head",
                    help=f"PTQ + QAT, comma-separated, of {', '.join(SETTINGS)}")
    ap.add_argument("--ptq-only", default="harsh", help="settings given the PTQ evaluation only ('' for none)")
    ap.add_argument("--no-seed-spread", action="store_true", help="one seed: skip the second fp32 run (seed + 1)")
    ap.add_argument("--qat-start", type=float, default=0.0,
                    help="fraction of the steps trained in fp32 before QAT takes over (default 0: QAT from "
                         "scratch; e.g. 0.8: the fp32 run's state at 80%% of the steps, then QAT for the rest)")
    ap.add_argument("--qat-lr-scale", type=float, default=1.0,
                    help="with --qat-start: multiply the learning rate of the QAT phase by this (default 1: the "
                         "fp32 run's schedule; e.g. 0.3)")
    ap.add_argument("--qat-kd", type=float, default=0.0,
                    help="with --qat-start: train the QAT phase by distillation from the same seed's final fp32 "
                         "model, objective (1 - W) x CE + W x KL(fp32 || student) (default 0: plain CE; 1: pure "
                         "distillation); also runs the control 'fp32_kd', the same steps distilled without "
                         "quantization")
    ap.add_argument("--diagnose", action="store_true",
                    help="with --qat-start: track how the quantized weights change during the QAT phase and also "
                         "evaluate the QAT weights without quantization (one more validation pass per QAT run)")
    ap.add_argument("--gptq", type=int, default=0, metavar="N",
                    help="also evaluate every PTQ and QAT model with its QATLinear weights (block linears, and the "
                         "head where quantized) rounded by GPTQ instead of to nearest, calibrated on the run's own "
                         "last N training batches (default 0: off; e.g. 16)")
    ap.add_argument("--gptq-scope", choices=("all", "head"), default="all",
                    help="the QATLinears --gptq and --qat-gptq round: all of them (default) or the output head only")
    ap.add_argument("--qat-gptq", action="store_true",
                    help="QAT through GPTQ rounding: in the QAT runs, the QATLinears in --gptq-scope use their "
                         "weights rounded by GPTQ with the inputs seen so far (k3.quant.gptq.GPTQLinear) instead of "
                         "to nearest, straight-through; their plain val loss is then that; give --gptq N for the "
                         "PTQ comparison with the same rounding (--diagnose still tracks round-to-nearest values)")
    ap.add_argument("--out", default=None,
                    help="result JSON (default runs/bench/qat.json; with --quick runs/bench/quick/qat.json)")
    ap.add_argument("--resume", action="store_true",
                    help="keep the seeds already in --out (same model, budget and settings) and run only the others")
    ap.add_argument("--merge", nargs="+", default=(), metavar="JSON",
                    help="also keep the seeds of these result files (runs of the same experiment, e.g. seeds split "
                         "over two processes); every file must have measured the same thing")
    args = finish_run_args(ap.parse_args(argv), "qat")
    seeds = parse_seeds(args.seeds)
    if not 0.0 <= args.qat_start < 1.0:
        raise SystemExit(f"--qat-start {args.qat_start}: give a fraction in [0, 1), e.g. 0.8 (0 = QAT from scratch)")
    args.qat_from_step = round(args.qat_start * args.steps)
    qat_from = args.qat_from_step or None
    if not args.qat_lr_scale > 0 or (args.qat_lr_scale != 1.0 and qat_from is None):
        raise SystemExit(f"--qat-lr-scale {args.qat_lr_scale}: give a factor > 0, with --qat-start > 0 (it scales "
                         "the learning rate of the QAT phase that continues the fp32 run)")
    if not 0.0 <= args.qat_kd <= 1.0 or (args.qat_kd and qat_from is None):
        raise SystemExit(f"--qat-kd {args.qat_kd}: give a weight in (0, 1] with --qat-start > 0 (the QAT phase "
                         "distils from the final fp32 model of the same seed), or 0 for none")
    if args.qat_gptq and not args.gptq:
        raise SystemExit("--qat-gptq: give --gptq N too (e.g. --gptq 40), the calibration batches of the PTQ "
                         "comparison with the same rounding")
    if args.gptq < 0 or args.gptq > args.steps:
        raise SystemExit(f"--gptq {args.gptq}: give a number of calibration batches in [0, {args.steps}] (the "
                         "run's own last training batches), e.g. 16; 0 turns it off")
    if args.diagnose and qat_from is None:
        raise SystemExit("--diagnose follows the QAT phase that continues the fp32 run: give --qat-start, e.g. 0.8")
    if qat_from is not None and qat_from >= args.steps:
        raise SystemExit(f"--qat-start {args.qat_start} of {args.steps} steps leaves no QAT step; lower it")
    names, ptq_names = names_of(args.settings, "--settings"), names_of(args.ptq_only, "--ptq-only")
    ptq_names = [n for n in ptq_names if n not in names]
    if not names and not ptq_names:
        raise SystemExit("--settings and --ptq-only are both empty: name at least one setting")
    config = base_config(args.preset, args.quick)
    # runs/data holds the default vocabulary; another vocabulary gets its own directory, never a rebuild of it
    data = args.data if config.vocab_size == DEFAULT_VOCAB_SIZE else f"{args.data}-v{config.vocab_size}"
    files = prepare_data(data, vocab_size=config.vocab_size)
    t_start = time.perf_counter()
    machine_before = machine()
    runs: dict[str, dict] = resumed_runs(Path(args.out), config, args, names, ptq_names, seeds) if args.resume else {}
    for path in map(Path, args.merge):
        if not path.exists():
            raise SystemExit(f"--merge: {path} does not exist; give result files written by this script")
        for s, r in resumed_runs(path, config, args, names, ptq_names, seeds, "--merge").items():
            if s in runs and _losses(runs[s]) != _losses(r):
                raise SystemExit(f"--merge: seed {s} of {path} differs from the same seed kept from another "
                                 "file; the runs are deterministic, so these files measured different things")
            runs[s] = r
    kept = sorted(int(x) for x in runs)
    result: dict = {}
    for seed in seeds:
        if str(seed) in runs:
            print(f"seed {seed}: kept from {args.out}", file=sys.stderr, flush=True)
            continue
        r = runs[str(seed)] = {}
        fp32_model, r["fp32"], snapshot = train_run(config, files, args, "fp32", seed, snapshot_at=qat_from)
        for name in ptq_names + names:
            r[f"ptq_{name}"] = ptq(fp32_model, name, files, args, seed)
            print(f"seed {seed} ptq_{name}: {json.dumps(r[f'ptq_{name}'])}", file=sys.stderr, flush=True)
        teacher = fp32_model if args.qat_kd else None  # --qat-kd: the same seed's final fp32 model teaches
        del fp32_model
        if len(seeds) == 1 and not args.no_seed_spread:
            _, r["fp32_seed+1"], _ = train_run(config, files, args, "fp32_seed+1", seed + 1)
        if teacher is not None:  # the control: the same distillation steps without quantization
            r["fp32_kd"] = continue_run(config, files, args, "fp32_kd", seed, snapshot, None, teacher)
        for name in names:
            if snapshot is None:
                _, r[f"qat_{name}"], _ = train_run(config, files, args, f"qat_{name}", seed, setting=name)
            else:
                r[f"qat_{name}"] = continue_run(config, files, args, f"qat_{name}", seed, snapshot, name, teacher)
        del teacher
        result = report(runs, names, ptq_names, config, files, args, argv, t_start, machine_before, kept)
        atomic_write_json(Path(args.out), result)
    if not result:  # every seed was kept from the earlier run: nothing new was written yet
        result = report(runs, names, ptq_names, config, files, args, argv, t_start, machine_before, kept)
        atomic_write_json(Path(args.out), result)
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result, names, ptq_names)
        print(f"wrote {args.out}")
    return result


def _losses(run: dict) -> dict:
    """A seed's measured losses, without its timings (which differ between two runs of the same thing)."""
    return {k: v.get("val_loss") for k, v in run.items()}


def resumed_runs(path: Path, config, args, names: list[str], ptq_names: list[str], seeds: list[int],
                 flag: str = "--resume") -> dict:
    """The finished seeds of an earlier run written to `path`, when it measured the same thing: same model
    config, training budget (steps, batch, schedule, QAT start) and settings. Anything else is an error that
    names the difference, never a silent mix of two experiments."""
    if not path.exists():
        return {}
    prev = json.loads(path.read_text())
    want = {"config": config.to_dict(), "steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
            "lr": args.lr, "warmup_steps": args.warmup_steps, "qat_from_step": args.qat_from_step,
            "qat_lr_scale": args.qat_lr_scale, "qat_kd": args.qat_kd, "gptq": args.gptq,
            "gptq_scope": args.gptq_scope, "qat_gptq": args.qat_gptq, "settings": sorted(names), "ptq_only": sorted(ptq_names), "quick": args.quick}
    have = {"config": prev.get("config"), **{k: prev.get("budget", {}).get(k) for k in
            ("steps", "batch_size", "seq_len", "lr", "warmup_steps", "qat_from_step")},
            "qat_lr_scale": prev.get("budget", {}).get("qat_lr_scale", 1.0),
            "qat_kd": prev.get("budget", {}).get("qat_kd", 0.0),
            "gptq": prev.get("budget", {}).get("gptq", 0),
            "gptq_scope": prev.get("budget", {}).get("gptq_scope", "all"),
            "qat_gptq": prev.get("budget", {}).get("qat_gptq", False),
            "settings": sorted(n for n, v in prev.get("settings", {}).items() if v.get("trained")),
            "ptq_only": sorted(n for n, v in prev.get("settings", {}).items() if not v.get("trained")),
            "quick": prev.get("quick")}
    # --merge may take a file that also evaluated PTQ of other settings: those extra figures are left out
    extra = set(have["ptq_only"]) - set(want["ptq_only"]) if flag == "--merge" else set()
    if extra and set(want["ptq_only"]) <= set(have["ptq_only"]):
        have["ptq_only"] = want["ptq_only"]
    diff = [k for k in want if want[k] != have[k]]
    if diff:
        fix = "pass another --out or drop --resume" if flag == "--resume" else f"leave {path} out of --merge"
        raise SystemExit(f"{flag}: {path} measured something else (differs in {', '.join(diff)}); {fix}")
    drop = {f"ptq_{n}" for n in extra}
    return {s: {k: v for k, v in r.items() if k not in drop}
            for s, r in prev.get("runs", {}).items() if int(s) in seeds}


def report(runs, names, ptq_names, config, files, args, argv, t_start, machine_before, kept=()) -> dict:
    """The JSON record of the seeds finished so far (`kept`: seeds taken from an earlier run by --resume)."""
    done = list(runs)
    fp32 = [runs[s]["fp32"]["val_loss"] for s in done]
    if len(done) > 1:
        spread = statistics.fmean(abs(a - b) for a, b in itertools.combinations(fp32, 2))
    elif "fp32_seed+1" in runs[done[0]]:
        spread = abs(runs[done[0]]["fp32_seed+1"]["val_loss"] - fp32[0])
    else:
        spread = None
    settings = {}
    for name in names + ptq_names:
        deg = [runs[s][f"ptq_{name}"]["val_loss"] - runs[s]["fp32"]["val_loss"] for s in done]
        gaps = [runs[s][f"qat_{name}"]["val_loss"] - runs[s]["fp32"]["val_loss"] for s in done] \
            if name in names else None
        qat, head, head_act = SETTINGS[name]
        settings[name] = {"qat": qat, "head": head, "head_input": head_act, "trained": name in names,
                          **summarize(deg, gaps, spread)}
        if gaps is not None and all("fp32_kd" in runs[s] for s in done):
            settings[name].update(kd_control(runs, done, name, deg))
        if gaps is not None and all("diagnosis" in runs[s][f"qat_{name}"] for s in done):
            settings[name]["diagnosis"] = diagnosis(runs, done, name)
        if all("gptq" in runs[s][f"ptq_{name}"] for s in done):
            settings[name]["gptq"] = gptq_summary(runs, done, name, deg, gaps is not None, args.qat_gptq)
    fp32_mean, fp32_std, _ = mean_std_sem(fp32)
    val_windows = (files.val.n_tokens - 1) // args.seq_len
    return {
        "benchmark": "qat",
        "quick": args.quick,
        "model": config.name,
        "config": config.to_dict(),
        "params": sum(p.numel() for p in K3Model(config).parameters()),
        "budget": {"steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
                   "tokens": args.steps * args.batch_size * args.seq_len, "lr": args.lr,
                   "warmup_steps": args.warmup_steps, "optimizer": "adamw", "qat_start": args.qat_start,
                   "qat_lr_scale": args.qat_lr_scale, "qat_kd": args.qat_kd,
                   "qat_from_step": args.qat_from_step, "gptq": args.gptq,
                   "gptq_scope": args.gptq_scope, "qat_gptq": args.qat_gptq},
        "seeds": [int(s) for s in done],
        "val_tokens": (args.eval_batches * args.batch_size if args.eval_batches else val_windows) * args.seq_len,
        "runs": runs,
        "settings": settings,
        "fp32_val_loss_mean": fp32_mean,
        "fp32_val_loss_std": fp32_std,
        "seed_spread": spread,
        "definitions": {
            "ptq_degradation": "mean over seeds of PTQ val loss - fp32 val loss (same weights), nats/token",
            "qat_gap": "mean over seeds of QAT val loss - fp32 val loss (same seed), nats/token; with "
                       "qat_from_step > 0 the QAT run is the fp32 run up to that step, fake-quantized after it",
            "recovery": "(ptq_degradation - qat_gap) / ptq_degradation: from the means",
            "recovery_low": "recovery with qat_gap + 2 * qat_gap_sem in place of qat_gap",
            "kd_control_gain": "with qat_kd > 0: mean over seeds of fp32_kd val loss - fp32 val loss, where fp32_kd "
                               "is the fp32 run's QAT phase distilled without quantization (what distillation "
                               "does by itself)",
            "recovery_vs_kd_control": "(ptq_degradation - mean(QAT - fp32_kd)) / ptq_degradation",
            "latent_gap": "with --diagnose: mean over seeds of the QAT run's weights evaluated without quantization "
                          "- fp32 val loss",
            "own_quant_cost": "with --diagnose: mean over seeds of QAT val loss - that latent val loss (what "
                              "quantizing the QAT weights costs; latent_gap + own_quant_cost = qat_gap)",
            "change_rate_first5 / _last5": "with --diagnose: share of the quantized weights whose quantized value "
                                           "changed per optimizer step, over the first / last 5 QAT steps",
            "revert_share": "with --diagnose: share of those changes that went back to the value of two steps before",
            "changed_over_phase": "with --diagnose: share of quantized weights whose value differs at the end of "
                                  "the QAT phase from its start",
            "gptq.*": "with --gptq N: the same models with their QATLinear weights rounded by GPTQ (calibrated on "
                       "the run's last N training batches) instead of to nearest; gptq.ptq_degradation and "
                       "gptq.qat_gap as above; gptq.recovery_vs_rtn_ptq = (ptq_degradation - gptq.qat_gap) / "
                       "ptq_degradation; gptq.recovery_vs_gptq_ptq = (gptq.ptq_degradation - gptq.qat_gap) / "
                       "gptq.ptq_degradation; gptq.verdict_vs_rtn_ptq: the verdict rule below applied to "
                       "gptq.qat_gap against round-to-nearest PTQ; output_error_ratio: GPTQ's / round-to-nearest's summed "
                       "tr((W - Q) H (W - Q)^T) on the calibration inputs",
            "verdict": f"with ptq_degradation > 2 * ptq_degradation_sem: met when recovery_low >= {RECOVERY_TARGET}, "
                       f"not met when recovery_high < {RECOVERY_TARGET}, else inconclusive",
            "_std / _sem": "sample standard deviation over seeds / that divided by sqrt(number of seeds)",
            "seed_spread": "mean |fp32 val loss (seed i) - fp32 val loss (seed j)| over seed pairs (one seed: "
                           "against seed + 1): training noise"},
        "command": "python benchmarks/qat.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "seeds_kept_from_earlier_run": list(kept),
        "total_s": round(time.perf_counter() - t_start, 1),                   # this invocation's seeds only
        "machine": machine_before,
        "loadavg_1m_after": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def print_table(result: dict, names: list[str], ptq_names: list[str]) -> None:
    def pm(m, s):
        return f"{m:+.4f}" + ("" if s is None else f" ± {s:.4f}")

    print(f"{result['model']}, {result['budget']['tokens']:,} training tokens per run, "
          f"{result['val_tokens']:,} validation tokens, seeds {result['seeds']}")
    spread = result["seed_spread"]
    print(f"fp32 val loss {pm(result['fp32_val_loss_mean'], result['fp32_val_loss_std'])[1:]}"
          + ("" if spread is None else f", seed spread {spread:.4f}"))
    for name in names + ptq_names:
        r = result["settings"][name]
        line = f"{name}: PTQ - fp32 {pm(r['ptq_degradation'], r['ptq_degradation_std'])}"
        if r["trained"]:
            rec = "n/a" if r["recovery"] is None else f"{r['recovery']:.2f}"
            line += f", QAT - fp32 {pm(r['qat_gap'], r['qat_gap_std'])}, recovery {rec}, {r['verdict']}"
            if "kd_control_gain" in r:
                rk = r["recovery_vs_kd_control"]
                line += (f"; distillation alone (fp32_kd - fp32) {r['kd_control_gain']:+.4f}, QAT - fp32_kd "
                         f"{r['qat_gap_vs_kd_control']:+.4f}, recovery against it "
                         f"{'n/a' if rk is None else f'{rk:.2f}'}")
        if "diagnosis" in r:
            d = r["diagnosis"]
            line += (f"; QAT weights unquantized - fp32 {d['latent_gap']:+.4f}, quantizing them costs "
                     f"{d['own_quant_cost']:+.4f}; {d['changed_over_phase']:.1%} of quantized values changed, "
                     f"{d['change_rate_first5']:.2%} -> {d['change_rate_last5']:.2%} per step, "
                     f"{'n/a' if d['revert_share'] is None else format(d['revert_share'], '.1%')} of changes reverted")
        if "gptq" in r:
            g = r["gptq"]
            line += f"; with GPTQ rounding: PTQ - fp32 {g['ptq_degradation']:+.4f}"
            if "qat_gap" in g:
                rv = g["recovery_vs_rtn_ptq"]
                line += (f", QAT - fp32 {g['qat_gap']:+.4f}, recovery against round-to-nearest PTQ "
                         f"{'n/a' if rv is None else f'{rv:.2f}'}, {g['verdict_vs_rtn_ptq']}")
        print(line)


if __name__ == "__main__":
    main()
