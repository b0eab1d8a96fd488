"""The RL pipeline: tokenizer and tasks, supervised warm start, GRPO, evaluation.

Both training stages run on `k3.distill.loop.StepLoop` (schedule, clipping, checkpoints, metrics JSONL,
exact resume). Everything random in a step is a function of `(seed, step)`: which tasks, which harness
variant each group sees, each episode's sampling seed. Rollouts are a pure function of the weights and
those seeds (`rollout.LockstepEngine`), so a resumed run repeats the steps an uninterrupted one takes.

With `updates_per_batch = mu > 1`, one batch of rollouts serves mu optimizer steps: the first step's
log-probs (detached) are the old policy's, and the clipped ratio limits how far the later steps move.
A run can then only resume at a multiple of mu (checkpoints are saved there).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from k3.agentenv.dialects import choose_variant, make_dialect
from k3.agentenv.rollout import run_episode
from k3.agentenv.sandbox import SandboxConfig
from k3.cli_checks import FieldError, flag
from k3.distill.loop import LoopConfig, StepLoop
from k3.distill.sft import PAD_ID, masked_ce
from k3.fileio import atomic_write_json, loads_json
from k3.model.moe import balancing_token_mask
from k3.rl.demos import collect_demos, episode_tokens, pad_batch
from k3.rl.family import KINDS, build_tasks
from k3.rl.grpo import AGGREGATIONS, group_advantages, grpo_loss, token_logprobs
from k3.rl.harness import episode_config
from k3.rl.rollout import EXCLUDE_REASONS, Job, Trajectory, run_jobs, success_table

log = logging.getLogger(__name__)


def _seed(*parts) -> int:
    return int.from_bytes(hashlib.sha256("-".join(map(str, parts)).encode()).digest()[:8], "little") >> 1


# ---------------------------------------------------------------------------------------- setup
def make_tokenizer(out: str | os.PathLike | None, demo_records: Sequence[dict], vocab_size: int = 1024,
                   n_prompts: int = 400):
    """Byte-level BPE on the training harnesses' system prompts and the demonstrations' messages, saved as
    OUT/tokenizer.json (`out` None: not saved). The unseen harness's names are not in its training text (they
    still encode, byte by byte)."""
    from k3.data.tokenizer import train_tokenizer
    texts = [make_dialect(choose_variant(s)).system_prompt() for s in range(n_prompts)]
    texts += [m["content"] for r in demo_records for m in r["transcript"][1:]]
    return train_tokenizer(texts, vocab_size, path=None if out is None else Path(out) / "tokenizer.json",
                           allow_short=True)


def read_demos(path: str | os.PathLike) -> tuple[dict | None, list[dict]]:
    """ROOT/demos.jsonl -> (the settings line, the demonstrations); a damaged file is a ValueError naming it."""
    path = Path(path)
    try:
        rows = [loads_json(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is damaged ({e}); delete it and `k3 rl warmstart` collects the demonstrations "
                         "again (the same flags give the same ones)") from None
    if rows and not (all(isinstance(r, dict) for r in rows) and "n_tasks_per_kind" in rows[0]
                     and all("transcript" in r for r in rows[1:])):
        raise ValueError(f"{path} does not hold k3 rl demonstrations; delete it and `k3 rl warmstart` collects "
                         "them again")
    return (rows[0] if rows else None), rows[1:]


def demo_pool(out: str | os.PathLike, n_tasks_per_kind: int, demos_per_task: int, seed: int = 0,
              workers: int = 4, sandbox: SandboxConfig | None = None, harness: str = "canonical") -> list[dict]:
    """Demonstrations (verified episodes) over the training tasks, each in a harness drawn from `harness`
    (canonical: the four dialects, their own names; swap: also renamed); cached in OUT/demos.jsonl so
    later stages and runs share them."""
    path = Path(out) / "demos.jsonl"
    meta = {"n_tasks_per_kind": n_tasks_per_kind, "demos_per_task": demos_per_task, "seed": seed,
            "harness": harness}
    if path.exists():
        held_meta, held = read_demos(path)
        if held_meta == meta:
            return held
    tasks = build_tasks(Path(out) / "tasks", "train", n_tasks_per_kind)
    jobs = [(t, _seed("demo", seed, t.id, k)) for t in tasks for k in range(demos_per_task)]
    cfg = episode_config(harness, **({"sandbox": sandbox} if sandbox else {}))
    records = collect_demos([t for t, _ in jobs], [s for _, s in jobs], cfg, workers=workers)
    keep = [{k: r[k] for k in ("task_id", "family", "seed", "dialect", "variant", "reward", "transcript")}
            for r in records]
    from k3.fileio import atomic_write_text
    atomic_write_text(path, "".join(json.dumps(x) + "\n" for x in [meta] + keep))
    return keep


def new_model(preset: str, tokenizer, max_context: int = 2048, seed: int = 0, **overrides):
    from k3.config import get_config
    from k3.model.transformer import K3Model
    torch.manual_seed(seed)
    return K3Model(get_config(preset, vocab_size=tokenizer.vocab_size, max_context=max_context, **overrides))


# ---------------------------------------------------------------------------------------- warm start
def sft_step_fn(model, examples: Sequence[tuple[list[int], list[bool]]], batch_size: int, seed: int,
                context_loss_weight: float = 0.0, short_examples: Sequence[tuple[list[int], list[bool]]] = (),
                short_prompt_steps: int = 0) -> Callable:
    """Cross-entropy on the tokens a policy writes (assistant turns), whole multi-turn episodes per row.

    `context_loss_weight` w > 0 adds w times the mean cross-entropy of every other token (system prompt,
    instruction, tool outputs), the "prompt loss weight" of fine-tuning APIs. A model trained from scratch
    first learns the local format of the calls; the context is where it can learn to look things up (the
    tool names a spec defines reappear in its example call, the task's numbers reappear in its restatement),
    which the calls need.

    `short_prompt_steps` N > 0 is a curriculum: the first N steps (0..N-1) draw from `short_examples` (the same episodes
    without their system prompt, about 150 tokens instead of 500-1,200), later steps from `examples`. In the
    short episodes the instruction is near every command, and a small model learns to choose the command
    from it; it keeps that choice once the system prompt is back (docs/rl.md, "Curriculum")."""
    if not examples:
        raise ValueError("the warm start has no demonstrations; collect some first")
    if short_prompt_steps < 0 or (short_prompt_steps and not short_examples):
        raise ValueError(f"short_prompt_steps = {short_prompt_steps} needs short_examples and must be >= 0")
    if not (context_loss_weight >= 0 and math.isfinite(context_loss_weight)):
        raise ValueError(f"context_loss_weight = {context_loss_weight} must be a number >= 0")

    def step_fn(step: int) -> dict:
        rng = random.Random(_seed("k3-rl-sft", seed, step))
        pool = short_examples if step < short_prompt_steps else examples            # steps are 0-based
        pick = [pool[rng.randrange(len(pool))] for _ in range(batch_size)]
        ids, mask = pad_batch([p[0] for p in pick], [p[1] for p in pick], PAD_ID)
        model.train()
        with balancing_token_mask(model, ids != PAD_ID):  # padding does not steer the routers' balance
            logits = model(ids)
        loss, n = masked_ce(logits, ids, mask)
        out = {"ce": float(loss.detach()), "tokens": n}
        if context_loss_weight > 0:
            lengths = torch.tensor([len(p[0]) for p in pick])
            context = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]) & ~mask
            ce_context, _ = masked_ce(logits, ids, context)
            loss = loss + context_loss_weight * ce_context
            out["ce_context"] = float(ce_context.detach())
        aux = model.aux_loss() if hasattr(model, "aux_loss") else 0.0
        return {"loss": loss + aux, **out}
    return step_fn


def without_system_prompt(transcript: Sequence[dict]) -> list[dict]:
    """The episode as the curriculum's short examples see it: every message but the system prompt."""
    return [m for m in transcript if m["role"] != "system"]


def run_warmstart(model, tokenizer, demos: Sequence[dict], config: LoopConfig, out_dir, *, batch_size: int = 8,
                  context_loss_weight: float = 0.0, short_prompt_steps: int = 0, resume: bool = False,
                  overwrite: bool = False, on_record=None, graceful_interrupt: bool = False) -> list[dict]:
    examples, short, shortest = [], [], None
    for r in demos:
        ids, mask = episode_tokens(r["transcript"], tokenizer)
        shortest = len(ids) if shortest is None else min(shortest, len(ids))
        if len(ids) <= model.config.max_context:
            examples.append((ids, mask))
            if short_prompt_steps:
                short.append(episode_tokens(without_system_prompt(r["transcript"]), tokenizer))
    if demos and not examples:
        raise ValueError(f"all {len(demos)} demonstrations are longer than the model's max_context "
                         f"({model.config.max_context} tokens); raise --max-context to at least {shortest} (the "
                         "shortest demonstration)")
    if len(examples) < len(demos):
        log.warning("%d demonstrations longer than the context were left out", len(demos) - len(examples))
    loop = StepLoop(model, config, out_dir, {"kind": "rl-warmstart", "tokenizer_sha256": tokenizer.fingerprint},
                    {"tokenizer_sha256": tokenizer.fingerprint, "batch_size": batch_size, "demos": len(examples),
                     "context_loss_weight": context_loss_weight, "short_prompt_steps": short_prompt_steps})
    return loop.fit(sft_step_fn(model, examples, batch_size, config.seed, context_loss_weight, short,
                                short_prompt_steps), resume=resume, overwrite=overwrite, on_record=on_record,
                     graceful_interrupt=graceful_interrupt)


# ---------------------------------------------------------------------------------------- GRPO
@dataclass
class GRPOConfig:
    """GRPO's settings; each is also a `k3 rl train` flag (k3.cli_checks.flag), with this name, default and help."""

    groups_per_step: int = flag(4, "tasks per step", name="--groups")
    group_size: int = flag(4, "rollouts per task (G)")
    temperature: float = flag(1.0)
    top_p: float = 1.0  # not a flag: GRPO's log-probs are of the whole distribution (validate)
    max_tokens: int = flag(96, "longest reply per turn")  # the longest demonstrated call is under 80 tokens
    updates_per_batch: int = flag(1, "optimizer steps per batch of rollouts (mu)")
    eps_low: float = flag(0.2)
    eps_high: float = flag(0.28)  # DAPO's clip-higher
    beta: float = flag(0.0, "KL coefficient to the initial model (0: none)")  # 0: no reference forward
    agg: str = flag("token", choices=AGGREGATIONS)
    scale_rewards: bool = flag(True, "advantages without dividing by the group's std", name="--no-std")
    harness: str = flag("swap", "swap: dialect and tool names drawn per episode; canonical: dialect drawn, canonical "
                        "names; fixed: one dialect, canonical names", choices=("swap", "canonical", "fixed"))
    fixed_dialect: str = flag("react", "the dialect of --harness fixed")
    max_turns: int | None = flag(None, "turns per episode (default: the task's limit)")
    micro_batch: int = flag(0, "episodes per forward/backward (0: all of a step's at once); lowers peak memory, "
                            "same gradient; may differ between a run and its resume")

    def validate(self) -> "GRPOConfig":
        for name in ("groups_per_step", "group_size", "max_tokens", "updates_per_batch"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise FieldError(name, f"{v!r} must be a positive integer")
        if isinstance(self.micro_batch, bool) or not isinstance(self.micro_batch, int) or self.micro_batch < 0:
            raise FieldError("micro_batch", f"{self.micro_batch!r} must be an integer >= 0 (0: one forward for all "
                             "of a step's episodes)")
        if self.group_size < 2:
            raise FieldError("group_size", f"{self.group_size}: group-relative advantages need at least 2 rollouts "
                             "per task")
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise FieldError("temperature", f"{self.temperature} must be > 0: GRPO learns from sampled rollouts")
        if self.top_p != 1.0:
            raise FieldError("top_p", f"{self.top_p}: GRPO's ratios and KL use log-probs of the whole distribution "
                             "(at the sampling temperature), so nucleus-truncated rollouts would be off-policy; "
                             "use top_p = 1 and control the spread with temperature")
        _check_max_turns(self.max_turns)
        if self.agg not in AGGREGATIONS:
            raise FieldError("agg", f"{self.agg!r} must be one of {AGGREGATIONS}")
        if self.harness not in ("swap", "canonical", "fixed"):
            raise FieldError("harness", f"{self.harness!r} must be swap, canonical or fixed (the unseen harness is "
                             "for evaluation only)")
        episode_config(self.harness, self.fixed_dialect)  # checks the dialect
        if not 0 < self.eps_low < 1:
            raise FieldError("eps_low", f"{self.eps_low} must be in (0, 1)")
        if not self.eps_high > 0:
            raise FieldError("eps_high", f"{self.eps_high} must be > 0")
        if not self.beta >= 0:
            raise FieldError("beta", f"{self.beta} must be >= 0 (0: no KL term)")
        return self


class GRPOTrainer:
    """`step_fn(step)` for StepLoop: rollouts (every mu steps), group advantages, the GRPO loss."""

    def __init__(self, model, tokenizer, tasks: Sequence, config: GRPOConfig, seed: int = 0, ref_model=None,
                 episode_fn: Callable = run_episode, sandbox: SandboxConfig | None = None):
        self.model, self.tokenizer, self.tasks = model, tokenizer, list(tasks)
        self.cfg, self.seed, self.ref_model, self.episode_fn = config.validate(), seed, ref_model, episode_fn
        if not self.tasks:
            raise ValueError("GRPO needs training tasks")
        if self.cfg.beta > 0 and ref_model is None:
            raise ValueError("beta > 0 needs a reference model")
        self.episode_config = episode_config(self.cfg.harness, self.cfg.fixed_dialect, max_steps=self.cfg.max_turns,
                                             **({"sandbox": sandbox} if sandbox else {}))
        self._batch: dict | None = None

    def jobs(self, step: int) -> list[Job]:
        """Which tasks, harness variants and sampling seeds the rollouts of `step` use."""
        rng = random.Random(_seed("k3-rl-tasks", self.seed, step))
        out = []
        for g in range(self.cfg.groups_per_step):
            task = self.tasks[rng.randrange(len(self.tasks))]
            variant_seed = _seed("k3-rl-variant", self.seed, step, g)  # one harness per group: one prompt
            for k in range(self.cfg.group_size):
                out.append(Job(task, variant_seed, _seed("k3-rl-sample", self.seed, step, g, k), group=g))
        return out

    def rollouts(self, step: int) -> list[Trajectory]:
        return run_jobs(self.model, self.tokenizer, self.jobs(step), self.episode_config,
                        temperature=self.cfg.temperature, top_p=self.cfg.top_p, max_tokens=self.cfg.max_tokens,
                        episode_fn=self.episode_fn)

    def _prepare(self, step: int) -> dict:
        t0 = time.perf_counter()
        trajs = self.rollouts(step)
        rollout_s = time.perf_counter() - t0
        usable = [t for t in trajs if t.excluded is None]
        by_group: dict[int, list[Trajectory]] = {}
        for t in usable:
            by_group.setdefault(t.group, []).append(t)
        kept = [t for g in sorted(by_group) if len(by_group[g]) >= 2 for t in by_group[g]]
        dropped_groups = sum(len(v) < 2 for v in by_group.values()) + \
            len({t.group for t in trajs}) - len(by_group)
        adv = group_advantages([t.reward for t in kept], [t.group for t in kept], self.cfg.scale_rewards)
        counted = [(t, a) for t, a in zip(kept, adv) if t.n_sampled > 0]
        # the loss is normalised over every counted episode (its tokens, or its count), as the objective says;
        # with no KL term a zero-advantage episode adds nothing above that line, so it skips the forward
        rows = [(t, a) for t, a in counted if abs(a) > 1e-6 or self.cfg.beta > 0]
        batch = {"step": step, "trajs": trajs, "rows": rows, "rollout_s": rollout_s, "dropped_groups": dropped_groups,
                 "norm_tokens": sum(t.n_sampled for t, _ in counted), "norm_seqs": len(counted)}
        m = self.cfg.micro_batch or max(len(rows), 1)
        batch["chunks"] = []
        for i in range(0, len(rows), m):
            part = rows[i:i + m]
            ids, mask = pad_batch([t.ids for t, _ in part], [t.policy_mask for t, _ in part], PAD_ID)
            mask = mask[:, 1:]
            batch["chunks"].append({"ids": ids, "mask": mask, "adv": torch.tensor([a for _, a in part]),
                                    "tokens": int(mask.sum()), "seqs": int((mask.sum(1) > 0).sum()),
                                    "old_logp": None, "ref_logp": None})
        return batch

    def _loss_and_backward(self, b: dict) -> tuple[torch.Tensor, dict]:
        """The GRPO loss of all of a batch's episodes, one forward and backward per chunk of `micro_batch`
        episodes, each chunk's loss weighted by its share (of sampled tokens, or of sequences), so the
        accumulated gradient is that of the whole batch in one pass."""
        model, cfg = self.model, self.cfg
        n_tok, n_seq = b["norm_tokens"], b["norm_seqs"]  # over every counted episode, forwarded or not
        total, tokens, sums = 0.0, 0, {}
        # the routers' balance loss is a mean over the forwarded chunks (tied groups skip the forward, so their
        # share of the GRPO normaliser must not scale it down)
        fwd = sum(c["tokens"] if cfg.agg == "token" else c["seqs"] for c in b["chunks"])
        for c in b["chunks"]:
            # the log-probs of the distribution that sampled: logits / temperature (as verl and TRL do)
            with balancing_token_mask(model, c["ids"] != PAD_ID):  # padding does not steer the balance
                logp = token_logprobs(model(c["ids"]) / cfg.temperature, c["ids"])
            if c["old_logp"] is None:
                c["old_logp"] = logp.detach()  # the policy that sampled = the weights at the batch's first step
            if cfg.beta > 0 and c["ref_logp"] is None:
                with torch.no_grad():
                    c["ref_logp"] = token_logprobs(self.ref_model(c["ids"]) / cfg.temperature, c["ids"])
            loss, st = grpo_loss(logp, c["old_logp"], c["adv"], c["mask"], eps_low=cfg.eps_low, eps_high=cfg.eps_high,
                                 ref_logp=c["ref_logp"], beta=cfg.beta, agg=cfg.agg)
            w = c["tokens"] / n_tok if cfg.agg == "token" else c["seqs"] / n_seq
            aux = model.aux_loss() if hasattr(model, "aux_loss") else 0.0
            part = loss * w + aux * ((c["tokens"] if cfg.agg == "token" else c["seqs"]) / fwd)
            part.backward()
            total += float(part.detach())
            tokens += st["tokens"]
            for k in ("clip_frac", "ratio_mean", "kl"):
                if k in st:
                    sums[k] = sums.get(k, 0.0) + st[k] * st["tokens"]
        return torch.tensor(total), {"tokens": tokens, **{k: v / tokens for k, v in sums.items()}}

    def step_fn(self, step: int) -> dict:
        mu = self.cfg.updates_per_batch
        first = step - step % mu
        if self._batch is None or self._batch["step"] != first:
            if step != first:
                raise ValueError(f"cannot resume GRPO at step {step}: with updates_per_batch = {mu} a run resumes "
                                 f"only at a multiple of {mu} (its rollouts are gone); resume from such a checkpoint")
            self._batch = self._prepare(step)
        b = self._batch
        model = self.model
        model.train()
        stats, done = {}, False
        if b["chunks"]:
            loss, stats = self._loss_and_backward(b)
            done = True
        else:  # nothing to learn from in this batch (every group tied, or excluded): no update at all
            loss = torch.zeros(())
        return {"loss": loss, "backward_done": done, "skip_update": not done, "tokens": stats.pop("tokens", 0),
                **stats, **self._rollout_metrics(b, step == first)}

    def _rollout_metrics(self, b: dict, fresh: bool) -> dict:
        trajs = b["trajs"]
        usable = [t for t in trajs if t.excluded is None]
        rec = {"episodes": len(trajs), "usable": len(usable), "trained_episodes": len(b["rows"]),
               "reward_mean": (sum(t.reward for t in usable) / len(usable)) if usable else None,
               "dropped_groups": b["dropped_groups"], "rollout_s": round(b["rollout_s"], 3), "fresh_rollouts": fresh,
               **{f"excluded_{r}": sum(t.excluded == r for t in trajs) for r in EXCLUDE_REASONS},
               "parse_errors_mean": sum(t.parse_errors for t in trajs) / len(trajs),
               "turns_mean": sum(t.steps for t in trajs) / len(trajs)}
        for kind in KINDS:
            ks = [t.reward for t in usable if t.kind == kind]
            if ks:
                rec[f"reward_{kind}"] = sum(ks) / len(ks)
        if fresh:
            rec["episode_log"] = [t.summary() for t in trajs]
        return rec


def run_grpo(model, tokenizer, tasks: Sequence, gconfig: GRPOConfig, lconfig: LoopConfig, out_dir, *,
             init: str, ref_model=None, resume: bool = False, overwrite: bool = False, on_record=None,
             episode_fn: Callable = run_episode, sandbox: SandboxConfig | None = None,
             evaluate: Callable | None = None, graceful_interrupt: bool = False) -> list[dict]:
    """GRPO on `model` in place; OUT/metrics.jsonl, OUT/checkpoint (which names its tokenizer).
    `graceful_interrupt`: see `StepLoop.fit`."""
    mu = gconfig.updates_per_batch
    if lconfig.ckpt_every % mu or lconfig.steps % mu:
        raise ValueError(f"--ckpt-every ({lconfig.ckpt_every}) and --steps ({lconfig.steps}) must be multiples of "
                         f"--updates-per-batch ({mu}), so every checkpoint can be resumed")
    trainer = GRPOTrainer(model, tokenizer, tasks, gconfig, lconfig.seed, ref_model, episode_fn, sandbox)
    fields = {"tokenizer_sha256": tokenizer.fingerprint, "init": str(init), "tasks": [t.id for t in trainer.tasks][:4] +
              [len(trainer.tasks)], **{k: v for k, v in dataclasses.asdict(gconfig).items() if k != "micro_batch"}}
    loop = StepLoop(model, lconfig, out_dir, {"kind": "rl-grpo", "tokenizer_sha256": tokenizer.fingerprint}, fields)
    return loop.fit(trainer.step_fn, resume=resume, overwrite=overwrite, on_record=on_record, evaluate=evaluate,
                    graceful_interrupt=graceful_interrupt)


def _check_max_turns(max_turns) -> None:
    if max_turns is not None and (isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1):
        raise ValueError(f"--max-turns {max_turns!r} must be a positive integer (leave it out for the task's own "
                         "limit)")


# ---------------------------------------------------------------------------------------- evaluation
def evaluate(model, tokenizer, tasks: Sequence, harness: str, n_variants: int = 1, seed: int = 1, *,
             max_tokens: int = 96, chunk: int = 24, fixed_dialect: str = "react", max_turns: int | None = None,
             sandbox: SandboxConfig | None = None) -> tuple[dict, list[Trajectory]]:
    """Greedy episodes of every task under `n_variants` harness variants each -> (success table, trajectories).
    Seeds (so variants) are the same for every model evaluated with the same arguments."""
    _check_max_turns(max_turns)
    cfg = episode_config(harness, fixed_dialect, max_steps=max_turns, **({"sandbox": sandbox} if sandbox else {}))
    jobs = [Job(t, _seed("k3-rl-eval", seed, harness, t.id, k), 0, group=i)
            for i, (t, k) in enumerate((t, k) for t in tasks for k in range(n_variants))]
    trajs: list[Trajectory] = []
    for i in range(0, len(jobs), chunk):
        trajs += run_jobs(model, tokenizer, jobs[i:i + chunk], cfg, temperature=0.0, max_tokens=max_tokens)
    return success_table(trajs), trajs


def wilson(k: float, n: int, z: float = 1.96) -> tuple[float, float] | None:
    """95% Wilson score interval of a success rate k/n; None without episodes (JSON has no NaN)."""
    if n == 0:
        return None
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    # clamped to contain p: at k = 0 or n, rounding can put c - h (or c + h) a hair past it
    return (max(0.0, min(p, c - h)), min(1.0, max(p, c + h)))


def write_json(path, obj) -> None:
    atomic_write_json(Path(path), obj)


# ---------------------------------------------------------------------------------------- tool intent
def command_position(ids: Sequence[int], policy_mask: Sequence[bool], tokenizer, kind: str) -> int | None:
    """Index of the first token of `kind`'s command inside the policy's own tokens (its first call), or
    None when the tokens do not contain it."""
    from k3.rl.family import COMMANDS
    head = tokenizer.encode(COMMANDS[kind])[:2]
    for i in range(len(ids) - len(head) + 1):
        if policy_mask[i] and list(ids[i:i + len(head)]) == head:
            return i
    return None


def command_choice(model, tokenizer, demos: Sequence[dict]) -> dict:
    """Which command the policy starts to write, teacher-forced on demonstrations: at the first token of the
    demonstrated command, the probability of each kind's command's first token, averaged over the
    demonstrations of each task kind -> {"p": {task kind: {command kind: p}}, "demos": n, "skipped": n}.
    A policy that reads the instruction puts its mass on the diagonal; one blind to it has equal rows
    (and then, with the kinds balanced, an expected reward of at most 1/3 whatever its preferences)."""
    from k3.rl.family import COMMANDS
    first = {k: tokenizer.encode(c)[0] for k, c in COMMANDS.items()}
    if len(set(first.values())) < len(first):
        raise ValueError("the commands of the kinds start with the same token; command_choice cannot tell them apart")
    sums: dict[str, dict[str, float]] = {}
    counts: dict[str, int] = {}
    skipped = 0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for d in demos:
                kind = d["task_id"].split("-")[1]
                ids, mask = episode_tokens(d["transcript"], tokenizer)
                pos = command_position(ids, mask, tokenizer, kind) if kind in COMMANDS else None
                if pos is None or pos == 0:
                    skipped += 1
                    continue
                p = torch.softmax(model(torch.tensor([ids[:pos]]))[0, -1].float(), -1)
                row = sums.setdefault(kind, dict.fromkeys(first, 0.0))
                for k, t in first.items():
                    row[k] += float(p[t])
                counts[kind] = counts.get(kind, 0) + 1
    finally:
        model.train(was_training)
    return {"p": {k: {c: v / counts[k] for c, v in row.items()} for k, row in sorted(sums.items())},
            "demos": sum(counts.values()), "skipped": skipped}
