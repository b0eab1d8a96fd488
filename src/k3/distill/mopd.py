"""MOPD: multi-teacher on-policy distillation of a (domain x effort) teacher matrix into one student.

Each step the student samples a completion for `per_cell` prompts of every cell (on-policy, under the cell's
thinking budget), and every completion token is trained towards the teacher of the prompt's cell with the
reverse KL: `full`, exact over the vocabulary at each position, or `sampled`, the one-sample estimator
-sg(log p_t - log p_s) log p_s, which skips forced tokens (the sampler wrote them, not the student). An optional
verifier reward adds REINFORCE on the domain checks. `mode = "off-policy"` is the baseline: completions sampled
from the teachers, learnt with cross-entropy. Sources, normalisation and baselines: docs/mopd.md ("MOPD").
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from k3.cli_checks import FieldError, flag
from k3.distill.domains import CELLS, DOMAIN_NAMES, Domain, cell_name, parse_cell, problem_rng
from k3.distill.effort import EFFORTS, THINKING_BUDGETS, build_prompt, check_budgets, check_effort
from k3.distill.loop import LoopConfig, StepLoop
from k3.distill.rollout import Rollout, merge_rollouts, sample
from k3.distill.sft import PAD_ID, masked_ce
from k3.model.moe import balancing_token_mask
from k3.fileio import loads_json

log = logging.getLogger(__name__)

TEACHERS_FILE = "teachers.json"
TEACHERS_FORMAT = "k3-mopd-teachers/1"
KL_KINDS = ("full", "sampled")
MODES = ("on-policy", "off-policy")


# ---------------------------------------------------------------------- losses
def reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Per-position KL(p_s || p_t) over the vocabulary: logits [..., V] -> [...]."""
    ls = F.log_softmax(student_logits.float(), dim=-1)
    lt = F.log_softmax(teacher_logits.float(), dim=-1)
    return (ls.exp() * (ls - lt)).sum(-1)


def reverse_kl_reference(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """The same, one position and one vocabulary entry at a time (slow; for tests)."""
    s2, t2 = student_logits.reshape(-1, student_logits.shape[-1]), teacher_logits.reshape(-1, teacher_logits.shape[-1])
    out = []
    for s, t in zip(s2, t2):
        zs = torch.logsumexp(s.double(), 0)
        zt = torch.logsumexp(t.double(), 0)
        total = torch.zeros((), dtype=torch.float64)
        for v in range(s.shape[0]):
            lps, lpt = s[v].double() - zs, t[v].double() - zt
            total = total + lps.exp() * (lps - lpt)
        out.append(total)
    return torch.stack(out).reshape(student_logits.shape[:-1]).float()


def sampled_reverse_kl_surrogate(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                                 tokens: torch.Tensor) -> torch.Tensor:
    """Per-position surrogate -sg(log p_t(x) - log p_s(x)) * log p_s(x); its gradient is the one-sample
    policy-gradient estimate of the reverse KL's. logits [..., V], tokens [...] -> [...]."""
    ls = F.log_softmax(student_logits.float(), dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
    lt = F.log_softmax(teacher_logits.float(), dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
    advantage = (lt - ls).detach()
    return -advantage * ls


def mopd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, rollout: Rollout,
              kl: str = "full") -> tuple[torch.Tensor, dict]:
    """Token-mean distillation loss over a rollout. logits [B, T, V] of rollout.ids; position t predicts
    ids[:, t + 1]. -> (loss, {"reverse_kl": exact mean KL per completion token, "kl_per_row": [B]})."""
    assert kl in KL_KINDS, f"kl = {kl!r}; MOPDConfig.validate allows {', '.join(KL_KINDS)}"
    s, t = student_logits[:, :-1], teacher_logits[:, :-1].detach()
    cmask = rollout.completion_mask[:, 1:]
    kl_pos = reverse_kl(s, t)  # [B, T-1]
    n = cmask.sum().clamp(min=1)
    if kl == "full":
        loss = (kl_pos * cmask).sum() / n
    else:
        smask = rollout.sampled_mask[:, 1:]
        loss = (sampled_reverse_kl_surrogate(s, t, rollout.ids[:, 1:]) * smask).sum() / smask.sum().clamp(min=1)
    with torch.no_grad():
        kl_rows = (kl_pos * cmask).sum(1) / cmask.sum(1).clamp(min=1)
    return loss, {"reverse_kl": float((kl_pos.detach() * cmask).sum() / n), "kl_per_row": kl_rows}


def reward_loss(student_logits: torch.Tensor, rollout: Rollout, rewards: torch.Tensor) -> torch.Tensor:
    """REINFORCE with the batch-mean baseline on the sampled tokens: -(r - mean r) * sum_t log p_s / tokens."""
    smask = rollout.sampled_mask[:, 1:]
    lp = F.log_softmax(student_logits[:, :-1].float(), dim=-1).gather(-1, rollout.ids[:, 1:, None]).squeeze(-1)
    adv = (rewards - rewards.mean())[:, None]
    return -(adv * lp * smask).sum() / smask.sum().clamp(min=1)


# ---------------------------------------------------------------------- the teacher matrix
class TeacherMatrix:
    """One teacher per (domain, effort) cell; several cells may share a model (the single-teacher baseline)."""

    def __init__(self, teachers: dict[tuple[str, str], torch.nn.Module],
                 sources: dict[tuple[str, str], str] | None = None,
                 identities: dict[tuple[str, str], dict] | None = None):
        assert teachers, "the teacher matrix is empty"
        self.teachers = dict(teachers)
        self.sources = dict(sources or {})
        self.identities = dict(identities or {})  # cell -> {"source", "step", "weights_sha256"} of its checkpoint
        for m in self.teachers.values():
            m.eval()
            for p in m.parameters():
                p.requires_grad_(False)

    def for_cell(self, cell: tuple[str, str]) -> torch.nn.Module:
        if cell not in self.teachers:
            raise ValueError(f"no teacher for cell {cell_name(*cell)}; the matrix has "
                             f"{', '.join(cell_name(*c) for c in self.teachers)}")
        return self.teachers[cell]

    def _groups(self, cells: Sequence[tuple[str, str]]) -> list[tuple[torch.nn.Module, list[int]]]:
        """Rows grouped by teacher model (a model shared by several cells runs once)."""
        groups: dict[int, tuple[torch.nn.Module, list[int]]] = {}
        for i, c in enumerate(cells):
            m = self.for_cell(c)
            groups.setdefault(id(m), (m, []))[1].append(i)
        return list(groups.values())

    @torch.no_grad()
    def logits(self, ids: torch.Tensor, cells: Sequence[tuple[str, str]]) -> torch.Tensor:
        """Each row's logits under its cell's teacher: ids [B, T] -> [B, T, V] (no graph)."""
        assert len(cells) == ids.shape[0], f"{ids.shape[0]} rows but {len(cells)} cells"
        out = None
        for m, rows in self._groups(cells):
            lg = m(ids[rows]).float()
            if out is None:
                out = lg.new_zeros(ids.shape[0], ids.shape[1], lg.shape[-1])
            out[rows] = lg
        return out

    def sample(self, prompts: Sequence[Sequence[int]], cells: Sequence[tuple[str, str]], budgets: Sequence[int],
               max_answer_tokens: int, temperature: float, seed: int) -> Rollout:
        """Each row sampled from its cell's teacher (the off-policy baseline's data)."""
        parts = []
        for k, (m, rows) in enumerate(self._groups(cells)):
            # one stream per (step seed, group): seed + 7919 k collided with the next step's (step_seed advances
            # by 7919 per step), so teacher k re-drew teacher k-1's numbers of the step before
            g = torch.Generator().manual_seed(stream_seed(seed, k))
            parts.append((rows, sample(m, [prompts[i] for i in rows], [budgets[i] for i in rows],
                                       max_answer_tokens, temperature, g)))
        return merge_rollouts(parts, len(prompts))


def read_teachers_file(teachers_dir: str | os.PathLike) -> dict:
    path = Path(teachers_dir) / TEACHERS_FILE
    if not path.is_file():
        raise ValueError(f"{path} not found; train the teacher matrix with `k3 distill teachers --out {teachers_dir}`")
    rebuild = f"rebuild it with `k3 distill teachers --out {teachers_dir} --overwrite`"
    try:
        info = loads_json(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); {rebuild}") from None
    if not isinstance(info, dict):
        raise ValueError(f"{path} holds a JSON {type(info).__name__}, not the object `k3 distill teachers` writes; "
                         f"{rebuild}")
    if info.get("format") != TEACHERS_FORMAT:
        raise ValueError(f"{path}: format is {info.get('format')!r}, expected {TEACHERS_FORMAT!r}; {rebuild}")
    def bad(key: str, expected: str) -> ValueError:
        have = f"has no {key!r}" if key not in info else f"has {key!r} = {info[key]!r}"
        return ValueError(f"{path} {have} (expected {expected}); {rebuild}")

    for key, expected in (("tokenizer", "a file name"), ("tokenizer_sha256", "a sha256"), ("base", "a directory name")):
        if not isinstance(info.get(key), str) or not info[key]:
            raise bad(key, expected)
    try:
        info["budgets"] = check_budgets(info["budgets"] if isinstance(info.get("budgets"), dict) else {})
    except ValueError:
        raise bad("budgets", "the thinking budgets, e.g. {'low': 8, 'medium': 16, 'high': 32}") from None
    teachers = info.get("teachers")
    if not isinstance(teachers, dict) or not all(isinstance(v, str) and v for v in teachers.values()):
        raise bad("teachers", "{cell: teacher directory}, e.g. {'arith/low': 'arith-low'}")
    for cell in teachers:
        try:
            parse_cell(cell)
        except ValueError as e:
            raise ValueError(f"{path} lists a teacher for {cell!r}, not a cell ({e}); {rebuild}") from None
    return info


def check_same_tokenizer(what: str, path, manifest: dict, tokenizer_sha256: str, vocab_size: int) -> None:
    """A distillation pair must share one tokenizer: the loss compares distributions id by id."""
    from k3.io.trained import trained_tokenizer_hash

    got = trained_tokenizer_hash(manifest)
    if got is None:
        raise ValueError(f"{what} ({path}) records no tokenizer (data.tokenizer_hash or extra.tokenizer_sha256 in its "
                         "manifest); distillation needs models trained with the student's tokenizer: train it with "
                         "`k3 distill teachers` or `k3 train`")
    if got != tokenizer_sha256:
        raise ValueError(f"{what} ({path}) was trained with tokenizer sha256 {got[:12]}... but the student uses "
                         f"{tokenizer_sha256[:12]}...; the reverse KL compares the two distributions token id by "
                         "token id, so teacher and student must share one tokenizer: retrain the teacher with the "
                         "student's (`k3 distill teachers --tokenizer PATH`)")
    vocab = manifest.get("config", {}).get("vocab_size")
    if vocab != vocab_size:
        raise ValueError(f"{what} ({path}) has vocab_size {vocab} but the student has {vocab_size}; they must share "
                         "one tokenizer and vocabulary")


def fine_tuned_from(manifest: dict) -> dict | None:
    """The identity of the base checkpoint a teacher was fine-tuned from (`checkpoint_identity`), as it records it."""
    return (manifest.get("data") or {}).get("base")


def current_base(teachers_dir: str | os.PathLike, info: dict) -> dict | None:
    """The identity of the teacher matrix's base checkpoint as it is now, or None without one."""
    from k3.train.checkpoint import latest_checkpoint, read_manifest

    latest = latest_checkpoint(Path(teachers_dir) / info.get("base", "base") / "checkpoint")
    return None if latest is None else checkpoint_identity(read_manifest(latest, verify=False))


def load_teacher_matrix(teachers_dir: str | os.PathLike, tokenizer_sha256: str, vocab_size: int,
                        single_effort: str | None = None,
                        cells: Sequence[tuple[str, str]] = CELLS) -> TeacherMatrix:
    """The teachers listed in TEACHERS_DIR/teachers.json, each checked against the student's tokenizer.
    `single_effort`: the single-teacher-per-domain baseline, every cell of a domain taught by that effort's
    teacher."""
    from k3.io.trained import load_trained_model

    info = read_teachers_file(teachers_dir)
    listed = info.get("teachers", {})
    base = current_base(teachers_dir, info)
    loaded: dict[str, torch.nn.Module] = {}
    teachers, sources, identities, ident = {}, {}, {}, {}
    for d, e in cells:
        src = cell_name(d, check_effort(single_effort) if single_effort else e)
        if src not in listed:
            raise ValueError(f"{Path(teachers_dir) / TEACHERS_FILE} lists no teacher for {src}; train it with "
                             f"`k3 distill teachers --out {teachers_dir} --cells {src}`, or leave the cell out with "
                             f"--cells (listed: {', '.join(sorted(listed)) or 'none'})")
        if src not in loaded:
            path = Path(teachers_dir) / listed[src] / "checkpoint"
            if not path.is_dir():
                raise ValueError(f"teacher {src}: {path} does not exist; retrain it with "
                                 f"`k3 distill teachers --out {teachers_dir} --cells {src}`")
            model, manifest = load_trained_model(path)
            check_same_tokenizer(f"teacher {src}", path, manifest, tokenizer_sha256, vocab_size)
            was = fine_tuned_from(manifest)
            if was is not None and base is not None and was != base:  # the student starts from the base as it is
                raise ValueError(f"teacher {src} ({path}) was fine-tuned from the base at step {was.get('step')}, but "
                                 f"the matrix's base has changed since (now step {base.get('step')}, other weights): "
                                 f"retrain it with `k3 distill teachers --out {teachers_dir} --cells {src} "
                                 "--overwrite` (the other cells' teachers fine-tuned from the current base stay "
                                 "listed), or leave it out with --cells")
            loaded[src], ident[src] = model, {"source": src, **checkpoint_identity(manifest)}
        teachers[(d, e)], sources[(d, e)], identities[(d, e)] = loaded[src], src, ident[src]
    return TeacherMatrix(teachers, sources, identities)


def checkpoint_identity(manifest: dict) -> dict:
    """What names a trained model's weights: its step and the sha256 of its weights file (from the manifest,
    which verified it on load); retraining or swapping a teacher changes it."""
    from k3.train.checkpoint import MODEL_FILE

    entry = (manifest.get("files") or {}).get(MODEL_FILE) or {}
    return {"step": manifest.get("step"), "weights_sha256": entry.get("sha256") if isinstance(entry, dict) else None}


# ---------------------------------------------------------------------- the MOPD run
@dataclass
class MOPDConfig:
    """MOPD's settings; those made with `flag()` are also `k3 distill mopd`'s flags, with this name, default and
    help (k3.cli_checks)."""

    mode: str = flag("on-policy", "on-policy = MOPD; off-policy = SFT on teacher samples (baseline)", choices=MODES)
    kl: str = flag("full", "full = exact reverse KL over the vocabulary; sampled = log-ratio reward estimator",
                   choices=KL_KINDS)
    per_cell: int = flag(2, "prompts per cell per step (default 2: batch 18)")
    cells: tuple = CELLS  # `k3 distill mopd --cells` parses its list
    temperature: float = flag(1.0, "sampling temperature (default 1: on-policy)")
    max_answer_tokens: int = flag(40)
    # > 0 adds the verifier reward (REINFORCE) to the distillation loss
    reward_coef: float = flag(0.0, "weight of the verifier reward (default 0: off)")
    budgets: dict = field(default_factory=lambda: dict(THINKING_BUDGETS))  # the teacher matrix's
    eval_n: int = flag(8, "evaluation problems per cell per evaluation (0: none)")  # held out, during training
    eval_seed: int = flag(0)

    def validate(self) -> "MOPDConfig":
        if self.mode not in MODES:
            raise FieldError("mode", f"{self.mode!r}; choose one of {', '.join(MODES)}")
        if self.kl not in KL_KINDS:
            raise FieldError("kl", f"{self.kl!r}; choose one of {', '.join(KL_KINDS)}")
        if not isinstance(self.per_cell, int) or self.per_cell < 1:
            raise FieldError("per_cell", f"{self.per_cell!r} must be a positive integer")
        if not self.cells:
            raise ValueError("cells is empty; distil at least one (domain, effort) cell")
        self.cells = tuple(tuple(c) for c in self.cells)
        for c in self.cells:
            parse_cell(cell_name(*c))
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise FieldError("temperature", f"{self.temperature} must be a number > 0 for on-policy sampling")
        if self.kl == "sampled" and self.mode == "on-policy" and self.temperature != 1.0:
            raise FieldError("kl", f"sampled with temperature = {self.temperature}: the sampled reverse-KL gradient is "
                             "unbiased only for samples from the student itself (temperature 1); use temperature = 1 "
                             "or kl = full", also=("temperature",))
        if not self.reward_coef >= 0:  # NaN too
            raise FieldError("reward_coef", f"{self.reward_coef} must be a number >= 0")
        if not isinstance(self.max_answer_tokens, int) or self.max_answer_tokens < 1:
            raise FieldError("max_answer_tokens", f"{self.max_answer_tokens!r} must be a positive integer")
        if self.reward_coef > 0 and self.mode != "on-policy":
            raise FieldError("reward_coef", f"{self.reward_coef}: the verifier reward needs on-policy samples; use "
                             "mode = on-policy", also=("mode",))
        if self.reward_coef > 0 and self.temperature != 1.0:
            raise FieldError("reward_coef", f"{self.reward_coef} with temperature = {self.temperature}: the REINFORCE "
                             "term's gradient uses the student's log-probs at temperature 1, unbiased only for samples "
                             "drawn at 1; use temperature = 1", also=("temperature",))
        if self.kl != "full" and self.mode != "on-policy":
            raise FieldError("kl", f"{self.kl} applies to on-policy distillation; the off-policy baseline trains on "
                             "the teachers' samples with cross-entropy: use kl = full or mode = on-policy",
                             also=("mode",))
        self.budgets = check_budgets(self.budgets)
        return self

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["cells"] = [cell_name(*c) for c in self.cells]
        return d


def step_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step * 7_919 + 17) % (2 ** 62)


def stream_seed(seed: int, k: int) -> int:
    """A generator seed for stream k of a step seeded `seed`, independent of every other (seed, k)."""
    import hashlib

    return int.from_bytes(hashlib.sha256(f"k3-mopd-stream:{seed}:{k}".encode()).digest()[:8], "little") % (2 ** 62)


def batch_problems(domains: dict[str, Domain], mc: MOPDConfig, seed: int, step: int):
    """The step's prompts: per_cell problems from every cell -> (problems, cells)."""
    problems, cells = [], []
    for d, e in mc.cells:
        for j in range(mc.per_cell):
            problems.append(domains[d].sample(problem_rng("mopd", seed, step, d, e, j)))
            cells.append((d, e))
    return problems, cells


def score(domains: dict[str, Domain], problems, answers, cells) -> torch.Tensor:
    """Verifier reward per row, each domain checked in one batch."""
    r = torch.zeros(len(problems))
    for d in DOMAIN_NAMES:
        rows = [i for i, c in enumerate(cells) if c[0] == d]
        if rows:
            r[rows] = torch.tensor(domains[d].check([problems[i] for i in rows], [answers[i] for i in rows]))
    return r


def mopd_step_fn(student: torch.nn.Module, teachers: TeacherMatrix, tokenizer, domains: dict[str, Domain],
                 mc: MOPDConfig, seed: int) -> Callable[[int], dict]:
    def step_fn(step: int) -> dict:
        problems, cells = batch_problems(domains, mc, seed, step)
        prompts = [build_prompt(p.text, e, tokenizer) for p, (_, e) in zip(problems, cells)]
        budgets = [mc.budgets[e] for _, e in cells]
        if mc.mode == "on-policy":
            ro = sample(student, prompts, budgets, mc.max_answer_tokens, mc.temperature,
                        torch.Generator().manual_seed(step_seed(seed, step)))
        else:
            ro = teachers.sample(prompts, cells, budgets, mc.max_answer_tokens, mc.temperature, step_seed(seed, step))
        student.train()
        with balancing_token_mask(student, ro.ids != PAD_ID):  # padding does not steer the routers' balance
            logits = student(ro.ids)
        aux = student.aux_loss() if hasattr(student, "aux_loss") else 0.0
        rec: dict = {}
        if mc.mode == "on-policy":
            loss, info = mopd_loss(logits, teachers.logits(ro.ids, cells), ro, mc.kl)
            rec["reverse_kl"] = info["reverse_kl"]
            rec["reverse_kl_by_cell"] = {cell_name(*c): round(float(info["kl_per_row"][[i for i, x in enumerate(cells)
                                                                                          if x == c]].mean()), 5)
                                         for c in mc.cells}
        else:
            loss, _ = masked_ce(logits, ro.ids, ro.completion_mask)
            rec["ce"] = float(loss.detach())
        if mc.reward_coef > 0:
            rewards = score(domains, problems, ro.answers(tokenizer), cells)
            rec["reward"] = float(rewards.mean())
            loss = loss + mc.reward_coef * reward_loss(logits, ro, rewards)
        rec["reasoning_tokens"] = {e: round(sum(r for r, (_, x) in zip(ro.reasoning_tokens, cells) if x == e)
                                            / max(1, sum(1 for _, x in cells if x == e)), 3)
                                   for e in EFFORTS if any(x == e for _, x in cells)}
        rec["forced_close"] = round(sum(ro.forced_close) / len(cells), 4)
        rec["completion_tokens"] = ro.n_completion_tokens
        return {"loss": loss + aux, "tokens": ro.n_completion_tokens, **rec}
    return step_fn


def run_mopd(student: torch.nn.Module, teachers: TeacherMatrix, tokenizer, domains: dict[str, Domain],
             mc: MOPDConfig, lc: LoopConfig, out_dir: str | os.PathLike | None, *, resume: bool = False,
             overwrite: bool = False, evaluate: Callable[[int], dict | None] | None = None,
             on_record: Callable[[dict], None] | None = None, manifest_extra: dict | None = None,
             graceful_interrupt: bool = False) -> list[dict]:
    """Distil `teachers` into `student` in place (see the module docstring); returns the run's records.
    `graceful_interrupt`: see `StepLoop.fit`."""
    mc.validate()
    missing = [cell_name(*c) for c in mc.cells if c not in teachers.teachers]
    if missing:
        raise ValueError(f"the teacher matrix has no teacher for {', '.join(missing)}")
    if student.config.vocab_size != tokenizer.vocab_size:
        raise ValueError(f"the student's vocab_size ({student.config.vocab_size}) is not its tokenizer's "
                         f"({tokenizer.vocab_size}); load the student trained with this tokenizer")
    teacher_ids = {cell_name(*c): teachers.identities.get(c, teachers.sources.get(c, "")) for c in mc.cells}
    if resume and out_dir is not None:
        from k3.train import checkpoint as ckpt

        latest = ckpt.latest_checkpoint(Path(out_dir) / "checkpoint")
        held = (ckpt.read_manifest(latest, verify=False).get("data") or {}).get("teachers") if latest else None
        if isinstance(held, dict) and held and all(isinstance(v, str) for v in held.values()):
            # a run from before teachers were recorded by their weights: only their names can be compared
            log.warning("%s records its teachers by name only; their weights cannot be checked", latest)
            teacher_ids = {cell_name(*c): teachers.sources.get(c, "") for c in mc.cells}
    resume_fields = {"mopd": {k: v for k, v in mc.to_dict().items() if k not in ("eval_n", "eval_seed")},
                     "teachers": teacher_ids}
    loop = StepLoop(student, lc, out_dir, {"kind": f"mopd-{mc.mode}", "tokenizer_sha256": tokenizer.fingerprint,
                                           **(manifest_extra or {})}, resume_fields)
    return loop.fit(mopd_step_fn(student, teachers, tokenizer, domains, mc, lc.seed), resume=resume,
                    overwrite=overwrite, evaluate=evaluate, on_record=on_record, graceful_interrupt=graceful_interrupt)
