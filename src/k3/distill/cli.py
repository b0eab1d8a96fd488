"""`k3 distill teachers | mopd | eval | generate`: the teacher matrix, MOPD, the 9-cell table."""
from __future__ import annotations

import argparse
import copy
import json
import math
import sys
from pathlib import Path

from k3.cli_checks import (MATPLOTLIB_PLOTS, add_flags, at_least, from_args, output_dir, output_file, output_png,
                           seed as seed_type)
from k3.data.tokenizer import check_vocab_size
from k3.model.cli import add_config_args, config_from_args
from k3.fileio import loads_json

DEFAULT_TEACHERS = "runs/mopd/teachers"


# ---------------------------------------------------------------------- helpers
def _parse_budgets(text: str | None) -> dict[str, int]:
    from k3.distill.effort import THINKING_BUDGETS, check_budgets

    if not text:
        return dict(THINKING_BUDGETS)
    out = {}
    for item in text.split(","):
        k, sep, v = item.partition("=")
        if not sep or not v.strip().isdigit():
            raise ValueError(f"--budgets {text!r}: expected low=N,medium=N,high=N")
        out[k.strip()] = int(v)
    return check_budgets(out)


def _parse_cells(text: str | None):
    from k3.distill.domains import CELLS, parse_cell

    if not text or text == "all":
        return CELLS
    return tuple(parse_cell(c.strip()) for c in text.split(",") if c.strip())


# TrainConfig's flags of `k3 distill teachers` (each stage's loop) and `k3 distill mopd` (MOPDConfig's are its too)
TEACHERS_LOOP_FLAGS = ("steps", "lr", "warmup_steps", "ckpt_every", "seed")
MOPD_LOOP_FLAGS = ("steps", "lr", "warmup_steps", "token_budget", "eval_every", "ckpt_every", "seed")


def _check_rate(flag: str, value: float | None) -> None:
    if value is not None and not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{flag} {value} must be a positive number")


def _check_temperature(value: float, greedy_ok: bool) -> None:
    if not math.isfinite(value) or value < 0 or (value == 0 and not greedy_ok):
        raise ValueError(f"--temperature {value} must be a finite number " + (">= 0 (0: greedy)" if greedy_ok else
                         "> 0 (the student samples on-policy)"))


def _check_resume_overwrite(args: argparse.Namespace) -> None:
    if args.resume and args.overwrite:
        raise ValueError("--resume continues the run and --overwrite starts it over; give one")


def _run_metrics(flag: str, run) -> Path:
    """RUN/metrics.jsonl of a `k3 distill mopd` run named by --flag RUN, which must exist."""
    path = Path(run) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{flag} {run}: no {path}; give the --out directory of a `k3 distill mopd` run")
    return path


class _Bar:
    """A tqdm bar over optimizer steps fed by the loop's records; eval records become lines."""

    def __init__(self, total: int, desc: str, enabled: bool, keys=("loss",)):
        self.total, self.desc, self.enabled, self.keys = total, desc, enabled, keys
        self.bar = None

    def __call__(self, rec: dict) -> None:
        if rec.get("kind") == "eval":
            msg = f"{self.desc} step {rec['step']}: " + ", ".join(
                f"{k} {v:.3f}" for k, v in rec.items() if k.startswith("mean_") and isinstance(v, float))
            (self.bar.write if self.bar is not None else (lambda m: print(m, file=sys.stderr)))(msg)
            return
        if not self.enabled:
            return
        from tqdm.auto import tqdm

        if self.bar is None:
            self.bar = tqdm(total=self.total, initial=rec["step"] - 1, unit="step", desc=self.desc,
                            dynamic_ncols=True, file=sys.stderr)
        self.bar.update(rec["step"] - self.bar.n)
        self.bar.set_postfix({k: f"{rec[k]:.3f}" for k in self.keys if isinstance(rec.get(k), float)}, refresh=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _load_model(path, tokenizer, what: str, missing: str | None = None, tokenizer_flag: str | None = None):
    """(model, manifest) of a run dir (holding checkpoint/) or a checkpoint dir, checked against the tokenizer.
    `missing`: what to do when PATH holds no checkpoint (default: give another path). `tokenizer_flag`: the flag
    that named the tokenizer, for a model used on its own (no teacher to share it with)."""
    from k3.distill.mopd import check_same_tokenizer
    from k3.io import load_with_manifest
    from k3.io.trained import trained_tokenizer_hash

    path = Path(path)
    if (path / "checkpoint").is_dir():
        path = path / "checkpoint"
    fix = missing or "give a run directory (holding checkpoint/) or a checkpoint"
    if not path.exists():
        raise ValueError(f"{what} {path} does not exist; {fix}")
    try:
        model, manifest = load_with_manifest(path)
    except ValueError as e:
        if not str(e).startswith("no checkpoint at"):
            raise
        raise ValueError(f"{what}: no checkpoint at {path}; {fix}") from None
    if tokenizer_flag is None:
        check_same_tokenizer(what, path, manifest, tokenizer.fingerprint, tokenizer.vocab_size)
        return model, manifest
    got = trained_tokenizer_hash(manifest)
    if got != tokenizer.fingerprint or manifest.get("config", {}).get("vocab_size") != tokenizer.vocab_size:
        trained = f"tokenizer sha256 {got[:12]}..." if got else "a tokenizer it does not record"
        raise ValueError(f"{what} {path} was trained with {trained}, not the one of {tokenizer_flag} (sha256 "
                         f"{tokenizer.fingerprint[:12]}...); pass the tokenizer it was trained with (--teachers DIR "
                         "of its teacher matrix, or --tokenizer PATH)")
    return model, manifest


def _teachers_tokenizer(teachers_dir):
    from k3.data.tokenizer import load_tokenizer
    from k3.distill.mopd import read_teachers_file

    info = read_teachers_file(teachers_dir)
    tok_path = Path(teachers_dir) / info["tokenizer"]
    try:
        tok = load_tokenizer(tok_path)
    except ValueError:
        problem = "is not a valid k3 tokenizer" if tok_path.exists() else "does not exist"
        raise ValueError(f"the teachers' tokenizer {tok_path} {problem}; restore it or rebuild the teachers with "
                         f"`k3 distill teachers --out {teachers_dir} --overwrite`") from None
    if tok.fingerprint != info["tokenizer_sha256"]:
        raise ValueError(f"{Path(teachers_dir) / info['tokenizer']} changed since the teachers were trained (sha256 "
                         "differs from teachers.json); restore it or retrain with `k3 distill teachers --overwrite`")
    return info, tok


# ---------------------------------------------------------------------- k3 distill teachers
def cmd_teachers(args: argparse.Namespace) -> int:
    import torch

    from k3.data.tokenizer import load_tokenizer, train_tokenizer
    from k3.distill.domains import CELLS, cell_name, make_domains, problem_rng, sft_example, tokenizer_texts
    from k3.distill.mopd import TEACHERS_FILE, TEACHERS_FORMAT, read_teachers_file
    from k3.distill.sft import run_sft
    from k3.fileio import atomic_write_json
    from k3.model.transformer import K3Model
    from k3.train import checkpoint as ckpt
    from k3.train.cli import set_threads
    from k3.train.config import POST_TRAINING, TrainConfig

    _check_resume_overwrite(args)
    at_least(args, 1, "--base-steps", "--steps", "--batch-size", "--max-context")
    _check_rate("--lr", args.lr)
    _check_rate("--teacher-lr", args.teacher_lr)
    teacher_lr = args.lr if args.teacher_lr is None else args.teacher_lr

    def lc(steps: int, lr: float) -> TrainConfig:  # a stage's: --base-steps and --lr, or --steps and --teacher-lr
        return from_args(TrainConfig, args, only=TEACHERS_LOOP_FLAGS, defaults={**POST_TRAINING, "keep_last": 1},
                         steps=steps, lr=lr)

    lc(args.steps, teacher_lr)  # --warmup-steps, --ckpt-every, ... before any work
    output_dir("--out", args.out)
    config = config_from_args(args)
    config.replace(max_context=args.max_context)  # a bad --set or --max-context before the tokenizer is trained
    if not args.tokenizer:
        check_vocab_size(args.vocab_size)
    set_threads(args.threads)
    out = Path(args.out)
    budgets = _parse_budgets(args.budgets)
    cells = _parse_cells(args.cells)
    out.mkdir(parents=True, exist_ok=True)
    domains = make_domains()
    from k3.data.tokenizer import install_tokenizer, reuse_built_tokenizer

    tok_path = out / "tokenizer.json"
    want = {"vocab_size": args.vocab_size, "seed": args.seed}  # what a tokenizer built here is made from
    tok = None
    if args.tokenizer:
        tok = load_tokenizer(args.tokenizer)
        if tok_path.is_file() and load_tokenizer(tok_path).fingerprint != tok.fingerprint and not args.overwrite:
            raise ValueError(f"{tok_path} holds another tokenizer; teachers in one directory share one (pass "
                             "--overwrite to replace it and retrain everything, or another --out)")
        install_tokenizer(tok, tok_path, None)  # given, not built from settings: no record
    elif reuse_built_tokenizer(tok_path, want, args.overwrite, "Pass the same flags, --overwrite to rebuild it and "
                               "retrain every stage, or another --out", warn_unrecorded=False):
        tok = load_tokenizer(tok_path)  # built with these settings, given earlier, or from an older k3
    if tok is None:
        tok = train_tokenizer(tokenizer_texts(domains, seed=args.seed), args.vocab_size, allow_short=True)
        install_tokenizer(tok, tok_path, want)
        print(f"tokenizer  {tok_path} ({tok.vocab_size} tokens, trained on the three domains)")
    if any(s.startswith("vocab_size=") for s in args.set) and config.vocab_size != tok.vocab_size:
        raise ValueError(f"--set vocab_size={config.vocab_size} differs from the tokenizer's {tok.vocab_size}; drop it")
    config = config.replace(vocab_size=tok.vocab_size, max_context=args.max_context)
    extra = {"tokenizer_sha256": tok.fingerprint, "budgets": budgets}
    info_path = out / TEACHERS_FILE
    info = read_teachers_file(out) if info_path.is_file() and not args.overwrite else {}
    if info and info.get("tokenizer_sha256") != tok.fingerprint:
        raise ValueError(f"{info_path} was made with another tokenizer; pass --overwrite or another --out")
    if info and info.get("budgets") != budgets:
        raise ValueError(f"{info_path} has budgets {info.get('budgets')}, not {budgets}; pass the same --budgets, "
                         "--overwrite, or another --out")

    def stage(name: str, model, examples, steps: int, lr: float, stage_extra: dict) -> None:
        run = out / name
        latest = ckpt.latest_checkpoint(run / "checkpoint")
        if latest is not None and not args.overwrite:
            manifest = ckpt.read_manifest(latest, verify=False)
            want = {"seed": args.seed, "batch_size": args.batch_size, "lr": lr,
                    "warmup_steps": args.warmup_steps, **stage_extra}
            have = manifest.get("data") or {}
            changed = [f"{k} {have[k]!r} (now {v!r})" for k, v in want.items() if k in have and have[k] != v]
            if int(manifest["step"]) > steps:  # teachers.json would record fewer steps than it was trained for
                changed.append(f"steps {manifest['step']} (now {steps})")
            if changed:
                raise ValueError(f"{run} was trained with other settings: {'; '.join(changed)}. Pass the same flags, "
                                 "or --overwrite to retrain every stage")
            if int(manifest["step"]) >= steps:
                ckpt.load_checkpoint(latest, model, config=config, restore_rng=False)
                print(f"{name:<14} already trained ({manifest['step']} steps): {latest}")
                return
            if not args.resume:
                raise ValueError(f"{run} holds a partial run ({manifest['step']}/{steps} steps); pass --resume to "
                                 "continue it or --overwrite to start over")
        bar = _Bar(steps, name, not args.quiet, keys=("loss",))
        try:
            records = run_sft(model, examples, lc(steps, lr), run, resume=latest is not None and args.resume
                              and not args.overwrite, overwrite=args.overwrite,
                              manifest_extra={**extra, **stage_extra}, on_record=bar,
                              resume_fields={"batch_size": args.batch_size, **stage_extra}, graceful_interrupt=True)
        finally:
            bar.close()
        last = [r for r in records if r.get("kind") == "train"]
        print(f"{name:<14} {len(last)} steps, last loss {last[-1]['loss']:.4f}" if last else f"{name}: nothing to do")

    # the shared base: every cell's worked examples, mixed; the student starts here too
    torch.manual_seed(args.seed)
    base = K3Model(config)

    def base_examples(step: int):
        out_ = []
        for j in range(args.batch_size):
            rng = problem_rng("sft-base", args.seed, step, j)
            d, e = CELLS[rng.randrange(len(CELLS))]
            out_.append(sft_example(domains[d], domains[d].sample(rng), e, tok, budgets))
        return out_

    stage("base", base, base_examples, args.base_steps, args.lr, {"cell": "all"})
    from k3.distill.mopd import checkpoint_identity

    # each teacher records the base it was fine-tuned from: a base trained further makes it stale
    base_id = checkpoint_identity(ckpt.read_manifest(ckpt.latest_checkpoint(out / "base" / "checkpoint"), verify=False))
    listed = dict(info.get("teachers", {}))
    if args.overwrite and info_path.is_file():
        # --overwrite retrains the base and this run's cells; another cell's teacher stays listed while it was
        # fine-tuned from this very base (the base retrains to the same weights from the same flags); it was dropped
        from k3.distill.mopd import fine_tuned_from

        try:
            disk = read_teachers_file(out)
        except ValueError:
            disk = {}
        if disk.get("tokenizer_sha256") == tok.fingerprint and disk.get("budgets") == budgets:
            for cell, name in disk.get("teachers", {}).items():
                latest = ckpt.latest_checkpoint(out / name / "checkpoint")
                if latest is not None and fine_tuned_from(ckpt.read_manifest(latest, verify=False)) == base_id:
                    listed.setdefault(cell, name)
    for d, e in cells:
        name = f"{d}-{e}"
        teacher = copy.deepcopy(base)

        def examples(step: int, d=d, e=e):
            return [sft_example(domains[d], domains[d].sample(problem_rng("sft", args.seed, d, e, step, j)), e, tok,
                                budgets) for j in range(args.batch_size)]

        stage(name, teacher, examples, args.steps, teacher_lr, {"cell": cell_name(d, e), "base": base_id})
        # another process may have trained other cells of this directory meanwhile (--cells splits the matrix
        # over processes): keep what it listed, when it shares this run's tokenizer and budgets
        if info_path.is_file() and not args.overwrite:
            disk = loads_json(info_path.read_text())
            if disk.get("tokenizer_sha256") == tok.fingerprint and disk.get("budgets") == budgets:
                listed = {**disk.get("teachers", {}), **listed}
        listed[cell_name(d, e)] = name
        atomic_write_json(info_path, {"format": TEACHERS_FORMAT, "tokenizer": "tokenizer.json",
                                      "tokenizer_sha256": tok.fingerprint, "budgets": budgets,
                                      "config": config.to_dict(), "base": "base",
                                      "teachers": dict(sorted(listed.items())),
                                      "steps": {"base": args.base_steps, "teacher": args.steps},
                                      "batch_size": args.batch_size, "lr": args.lr, "teacher_lr": teacher_lr,
                                      "seed": args.seed})
    print(f"teachers   {info_path} ({len(listed)} cells)")
    return 0


# ---------------------------------------------------------------------- k3 distill mopd
def _eval_closure(out: Path, teachers, student, domains, tok, mc, args):
    """evaluate(step) for the loop: the student on eval_n evaluation problems per cell, gaps to the teachers
    (teachers scored once, cached in OUT/teacher_eval.json)."""
    from k3.distill.domains import cell_name, eval_problems
    from k3.distill.evaluate import effort_lengths, evaluate_cells, long_answers
    from k3.fileio import atomic_write_json

    if mc.eval_n <= 0:
        return None
    problems = {c: ps for c, ps in eval_problems(domains, mc.eval_n, mc.eval_seed).items() if c in mc.cells}
    if (msg := long_answers(problems, tok, mc.max_answer_tokens)) is not None:
        print(f"warning: {msg}", file=sys.stderr)
    key = {"eval_n": mc.eval_n, "eval_seed": mc.eval_seed, "budgets": mc.budgets,
           "max_answer_tokens": mc.max_answer_tokens,
           "teachers": {cell_name(*c): teachers.identities.get(c, teachers.sources.get(c, "")) for c in mc.cells},
           "teachers_dir": str(Path(args.teachers).resolve())}
    cache = out / "teacher_eval.json"
    teacher_res = None
    if cache.is_file():
        saved = loads_json(cache.read_text())
        if saved.get("key") == key:
            teacher_res = saved["result"]
    if teacher_res is None:
        print("scoring the teachers on the evaluation problems ...", file=sys.stderr)
        teacher_res = evaluate_cells({c: teachers.for_cell(c) for c in problems}, problems, domains, tok, mc.budgets,
                                     mc.max_answer_tokens)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(cache, {"key": key, "result": teacher_res})

    def evaluate(step: int) -> dict:
        res = evaluate_cells(student, problems, domains, tok, mc.budgets, mc.max_answer_tokens)
        scores = {c: round(v["score"], 4) for c, v in res.items()}
        gap = {c: round(v["score"] - teacher_res[c]["score"], 4) for c, v in res.items()}
        return {"scores": scores, "teacher_scores": {c: teacher_res[c]["score"] for c in res}, "gap": gap,
                "reasoning_tokens": {e: round(v, 3) for e, v in effort_lengths(res).items()},
                "mean_score": sum(scores.values()) / len(scores), "mean_gap": sum(gap.values()) / len(gap)}
    return evaluate


def _own_teachers(args, tok, shared, cells):
    """Each cell's own teacher, for the evaluation gaps of a --single-teacher run: the shared model where it is that
    cell's own, loaded otherwise; a cell without a usable teacher of its own keeps the shared one, with a warning."""
    from k3.distill.domains import cell_name
    from k3.distill.mopd import TeacherMatrix, load_teacher_matrix

    models, sources, identities = {}, {}, {}
    for c in cells:
        if shared.sources.get(c) == cell_name(*c):
            own = shared
        else:
            try:
                own = load_teacher_matrix(args.teachers, tok.fingerprint, tok.vocab_size, None, [c])
            except ValueError as e:
                print(f"warning: the evaluation gaps of {cell_name(*c)} are to the --single-teacher "
                      f"{args.single_teacher} teacher, not its own: {e}", file=sys.stderr)
                own = shared
        models[c], sources[c] = own.for_cell(c), own.sources.get(c)
        if c in own.identities:
            identities[c] = own.identities[c]
    return TeacherMatrix(models, sources, identities)


def cmd_mopd(args: argparse.Namespace) -> int:
    from k3.distill.domains import make_domains
    from k3.distill.evaluate import plot_gaps
    from k3.distill.mopd import MOPDConfig, load_teacher_matrix, run_mopd
    from k3.train.cli import set_threads
    from k3.train.config import POST_TRAINING, TrainConfig
    from k3.train.metrics import read_metrics

    _check_resume_overwrite(args)
    _check_temperature(args.temperature, greedy_ok=False)
    at_least(args, 0, "--eval-n")
    at_least(args, 1, "--steps", "--per-cell", "--max-answer-tokens")
    if not args.reward_coef >= 0:  # NaN too (it switched the reward off)
        raise ValueError(f"--reward-coef {args.reward_coef} must be a number >= 0 (0: no verifier reward)")
    output_dir("--out", args.out)
    if (Path(args.out) / "teachers.json").exists():  # the run's checkpoint and metrics would land in the matrix
        raise ValueError(f"--out {args.out} is a teacher matrix (it holds teachers.json); give the distillation run "
                         "an --out of its own")
    out_abs, teachers_abs = Path(args.out).resolve(), Path(args.teachers).resolve()
    if out_abs == teachers_abs or teachers_abs in out_abs.parents:  # its base or a teacher: replaced by the student
        raise ValueError(f"--out {args.out} is inside the teacher matrix {args.teachers} (its shared base or a "
                         "teacher, which the student's checkpoint would replace); give the distillation run an --out "
                         "of its own")
    if args.match_tokens and args.token_budget is not None:
        raise ValueError("--token-budget and --match-tokens both set the token budget; give one")
    match_metrics = _run_metrics("--match-tokens", args.match_tokens) if args.match_tokens else None
    matched = {}  # the token budget --match-tokens reads
    if match_metrics is not None:
        recs = [r for r in read_metrics(match_metrics) if r.get("kind") == "train"]
        if not recs:
            raise ValueError(f"--match-tokens {args.match_tokens}: its metrics.jsonl has no training records")
        matched = {"token_budget": int(recs[-1]["tokens"])}
    lc = from_args(TrainConfig, args, only=MOPD_LOOP_FLAGS, defaults=POST_TRAINING, **matched)
    set_threads(args.threads)
    info, tok = _teachers_tokenizer(args.teachers)
    mc = from_args(MOPDConfig, args, cells=_parse_cells(args.cells), budgets=dict(info["budgets"]))
    student_path = Path(args.student) if args.student else Path(args.teachers) / info["base"]
    student, _ = _load_model(student_path, tok, "student", None if args.student else "retrain the teachers' shared "
                             f"base with `k3 distill teachers --out {args.teachers}`, or pass --student RUN_DIR")
    room = student.config.max_context - max(mc.budgets.values()) - mc.max_answer_tokens - 2
    if room < 1:  # no prompt fits beside the longest thinking budget and the answer: every step would fail
        raise ValueError(f"--max-answer-tokens {mc.max_answer_tokens} with the teachers' largest thinking budget "
                         f"({max(mc.budgets.values())}) leaves no room for a prompt in the student's max_context = "
                         f"{student.config.max_context}; lower --max-answer-tokens")
    teachers = load_teacher_matrix(args.teachers, tok.fingerprint, tok.vocab_size, args.single_teacher, mc.cells)
    out = Path(args.out)
    domains = make_domains()
    # the gaps are to each cell's own teacher, as `k3 distill eval` reports them, also when one teacher per
    # domain does the teaching (--single-teacher); the shared teacher stands in only where a cell has none
    reference = teachers
    if args.single_teacher and mc.eval_n > 0:
        reference = _own_teachers(args, tok, teachers, mc.cells)
    evaluate = _eval_closure(out, reference, student, domains, tok, mc, args)
    keys = ("loss", "reverse_kl") if mc.mode == "on-policy" else ("loss",)
    bar = _Bar(lc.steps, f"mopd {mc.mode}", not args.quiet, keys=keys)
    try:
        records = run_mopd(student, teachers, tok, domains, mc, lc, out, resume=args.resume, overwrite=args.overwrite,
                           evaluate=evaluate, on_record=bar,
                           manifest_extra={"student_init": str(student_path), "single_teacher": args.single_teacher},
                           graceful_interrupt=True)
    finally:
        bar.close()
    train = [r for r in records if r.get("kind") == "train"]
    all_recs = read_metrics(out / "metrics.jsonl")
    if any(r.get("kind") == "eval" for r in all_recs):
        print(f"gap plot   {plot_gaps(all_recs, out / 'gap.png')}")
    if train:
        t = train[-1]
        print(f"{mc.mode} distillation: {t['step']} steps, {t['tokens']:,} completion tokens, "
              f"last loss {t['loss']:.4f}")
    evals = [r for r in all_recs if r.get("kind") == "eval"]
    if evals:
        print(f"evaluation mean score {evals[-1]['mean_score']:.3f} "
              f"(mean gap to teachers {evals[-1]['mean_gap']:+.3f}); "
              f"reasoning tokens {evals[-1]['reasoning_tokens']}")
    print(f"metrics    {out / 'metrics.jsonl'}")
    print(f"checkpoint {out / 'checkpoint'}")
    return 0


# ---------------------------------------------------------------------- k3 distill eval
def _model_names(args: argparse.Namespace) -> list[tuple[str, str]]:
    """--model NAME=PATH pairs; a name may not repeat, nor take the table's own columns (teacher, and base
    unless --no-base), whose results it would replace."""
    taken, out = {"teacher"} | (set() if args.no_base else {"base"}), []
    for item in args.model:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--model {item!r}: expected NAME=PATH (a run directory or checkpoint)")
        if name in taken:
            why = "names the teachers' column" if name == "teacher" else (
                "names the shared base's column (pass --no-base to use it)" if name == "base" and not args.no_base
                else "is given twice")
            raise ValueError(f"--model {item!r}: the name {name!r} {why}; pick another name")
        taken.add(name)
        out.append((name, path))
    return out


def cmd_eval(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from k3.distill.domains import cell_name, eval_problems, make_domains
    from k3.distill.evaluate import evaluate_cells, long_answers, markdown, plot_gaps, table
    from k3.distill.mopd import load_teacher_matrix
    from k3.fileio import atomic_write_json, atomic_write_text
    from k3.train.cli import set_threads
    from k3.train.metrics import read_metrics

    if args.plot and not args.gap_run:
        raise ValueError("--plot names the gap plot of --gap-run RUN_DIR; give --gap-run too")
    at_least(args, 1, "--n")
    for flag, path in (("--out", args.out), ("--markdown", args.markdown)):
        output_file(flag, path)
    output_png("--plot", args.plot, "gap.png", MATPLOTLIB_PLOTS)
    _model_names(args)
    gap_metrics = _run_metrics("--gap-run", args.gap_run) if args.gap_run else None
    if gap_metrics is not None and not any(r.get("kind") == "eval" and r.get("gap") for r in read_metrics(gap_metrics)):
        raise ValueError(f"--gap-run {args.gap_run}: the run has no evaluation records with teacher gaps (it was "
                         "trained with --eval-n 0); name a run trained with --eval-n > 0, or drop --gap-run")
    set_threads(args.threads)
    info, tok = _teachers_tokenizer(args.teachers)
    budgets = info["budgets"]
    domains = make_domains()
    named = []
    if not args.no_base:
        named.append(("base", Path(args.teachers) / info["base"]))
    for name, path in _model_names(args):
        named.append((name, Path(path)))
    fixes = {} if args.no_base else {0: "retrain the teachers' shared base with `k3 distill teachers --out "
                                         f"{args.teachers}`, or pass --no-base"}
    models = {name: _load_model(path, tok, f"model {name}", fixes.get(i))[0] for i, (name, path) in enumerate(named)}
    cells = _parse_cells(args.cells)
    teachers = load_teacher_matrix(args.teachers, tok.fingerprint, tok.vocab_size, cells=cells)
    problems = {c: ps for c, ps in eval_problems(domains, args.n, args.seed).items() if c in cells}
    if (msg := long_answers(problems, tok, args.max_answer_tokens)) is not None:
        print(f"warning: {msg}", file=sys.stderr)
    n_rows = sum(len(v) for v in problems.values()) * (1 + len(models))
    bar = tqdm(total=n_rows, unit="answer", desc="eval", disable=args.quiet, file=sys.stderr, dynamic_ncols=True)
    try:
        teacher_res = evaluate_cells({c: teachers.for_cell(c) for c in problems}, problems, domains, tok, budgets,
                                     args.max_answer_tokens, progress=bar.update)
        results = {name: evaluate_cells(m, problems, domains, tok, budgets, args.max_answer_tokens,
                                        progress=bar.update, teachers=teachers) for name, m in models.items()}
    finally:
        bar.close()
    report = table(teacher_res, results)
    report["settings"] = {"n_per_cell": args.n, "seed": args.seed, "budgets": budgets,
                          "teachers": str(args.teachers), "models": {n: str(p) for n, p in named},
                          "cells": [cell_name(*c) for c in problems]}
    report["details"] = {"teacher": teacher_res, **results}
    if args.gap_run:
        recs = read_metrics(gap_metrics)
        report["gap_plot"] = str(plot_gaps(recs, args.plot or Path(args.gap_run) / "gap.png"))
    if args.out:
        atomic_write_json(args.out, report)
    md = markdown(report)
    if args.markdown:
        atomic_write_text(args.markdown, md)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(md, end="")
        if args.out:
            print(f"json       {args.out}")
    return 0


# ---------------------------------------------------------------------- k3 distill generate
def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from k3.data.tokenizer import load_tokenizer
    from k3.distill.effort import THINKING_BUDGETS, prompt_from_text, split_completion
    from k3.distill.rollout import sample

    _check_temperature(args.temperature, greedy_ok=True)
    at_least(args, 1, "--max-answer-tokens")
    if args.teachers and args.tokenizer:
        raise ValueError("--teachers DIR brings its own tokenizer; give --teachers or --tokenizer, not both")
    if args.teachers:
        info, tok = _teachers_tokenizer(args.teachers)
        budgets = info["budgets"]
    elif args.tokenizer:
        tok, budgets = load_tokenizer(args.tokenizer), dict(THINKING_BUDGETS)
    else:
        raise ValueError("pass --teachers DIR (its tokenizer and budgets) or --tokenizer PATH")
    ids, effort = prompt_from_text(args.prompt, tok)
    source = f"--teachers {args.teachers}" if args.teachers else f"--tokenizer {args.tokenizer}"
    model, _ = _load_model(args.model, tok, "model", tokenizer_flag=source)
    ro = sample(model, [ids], [budgets[effort]], args.max_answer_tokens, args.temperature,
                torch.Generator().manual_seed(args.seed))
    reasoning, answer, closed = split_completion(ro.completion(0))
    print(json.dumps({"effort": effort, "budget": budgets[effort], "reasoning": tok.decode(reasoning),
                      "reasoning_tokens": ro.reasoning_tokens[0], "forced_close": ro.forced_close[0],
                      "answer": tok.decode(answer), "closed": closed}, indent=2))
    return 0


# ---------------------------------------------------------------------- k3 distill plot
def cmd_plot(args: argparse.Namespace) -> int:
    from k3.distill.evaluate import plot_gaps
    from k3.train.metrics import read_metrics

    output_png("--out", args.out, "gap.png", MATPLOTLIB_PLOTS)
    path = Path(args.run) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{path} not found; pass the --out directory of a `k3 distill mopd` run")
    print(plot_gaps(read_metrics(path), args.out or Path(args.run) / "gap.png"))
    return 0


# ---------------------------------------------------------------------- registration
def register(sub) -> None:
    top = sub.add_parser("distill", help="MOPD: a (domain x effort) teacher matrix distilled on-policy into one model",
                         description="Multi-teacher on-policy distillation (docs/mopd.md).")
    dsub = top.add_subparsers(dest="distill_command", metavar="SUBCOMMAND")
    top.set_defaults(func=lambda a: (top.print_help(), 2)[1])

    p = dsub.add_parser("teachers", help="train the shared base and one teacher per (domain, effort) cell by SFT",
                        description="Train a domain tokenizer (unless --tokenizer), a base model on every cell's "
                                    "worked examples, then one teacher per cell fine-tuned from the base on examples "
                                    "whose reasoning fits that effort's budget. Writes OUT/teachers.json.")
    add_config_args(p, default="mini")
    p.add_argument("--out", default=DEFAULT_TEACHERS, help=f"output directory (default {DEFAULT_TEACHERS})")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json to use (default: train one on the domains)")
    p.add_argument("--vocab-size", type=int, default=512, help="domain tokenizer size when training one (default 512)")
    p.add_argument("--max-context", type=int, default=256, help="model max_context (default 256)")
    p.add_argument("--budgets", default=None, help="thinking budgets, e.g. low=8,medium=16,high=32 (the default)")
    p.add_argument("--cells", default="all", help="comma-separated DOMAIN/EFFORT cells (default all 9)")
    p.add_argument("--base-steps", type=int, default=300, help="SFT steps of the shared base (default 300)")
    from k3.distill.mopd import MOPDConfig
    from k3.train.config import TrainConfig

    add_flags(p, TrainConfig, only=TEACHERS_LOOP_FLAGS, defaults={"steps": 150, "warmup_steps": 10},
              helps={"steps": "SFT steps per teacher, from the base (default %(default)s)",
                     "lr": "peak learning rate of the base (default %(default)s)",
                     "ckpt_every": "checkpoint every N steps of a stage, for --resume after a stop (default "
                                   "%(default)s: at the end)"})
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--teacher-lr", type=float, default=None,
                   help="peak learning rate of each teacher's fine-tune (default: --lr)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (default: torch's choice)")
    p.add_argument("--resume", action="store_true", help="continue partially trained stages")
    p.add_argument("--overwrite", action="store_true", help="retrain every stage from scratch")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_teachers)

    p = dsub.add_parser("mopd", help="distil the teacher matrix into a student (on-policy, or the off-policy baseline)",
                        description="The student samples on-policy under each cell's thinking budget; every token "
                                    "is trained with the reverse KL to its cell's teacher. Writes OUT/metrics.jsonl, "
                                    "OUT/checkpoint/, OUT/gap.png.")
    p.add_argument("--teachers", default=DEFAULT_TEACHERS,
                   help=f"`k3 distill teachers` output (default {DEFAULT_TEACHERS})")
    p.add_argument("--student", default=None, help="initial student (default: the teachers' shared base)")
    p.add_argument("--out", default="runs/mopd/student", help="output directory (default runs/mopd/student)")
    add_flags(p, MOPDConfig)  # --mode, --kl, --per-cell, --temperature, ... --eval-seed
    p.add_argument("--single-teacher", default=None, choices=("low", "medium", "high"),
                   help="baseline: one teacher per domain (that effort's) for every effort of the domain")
    p.add_argument("--cells", default="all", help="comma-separated DOMAIN/EFFORT cells (default all 9)")
    add_flags(p, TrainConfig, only=MOPD_LOOP_FLAGS,
              defaults={"steps": 150, "lr": 1e-3, "warmup_steps": 5, "eval_every": 25, "ckpt_every": 25},
              helps={"token_budget": "stop after this many completion tokens"})
    p.add_argument("--match-tokens", default=None, metavar="RUN_DIR",
                   help="stop at the completion tokens another run trained on (the off-policy baseline's budget)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue OUT's latest checkpoint (exactly)")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("-q", "--quiet", action="store_true")
    p.set_defaults(func=cmd_mopd)

    p = dsub.add_parser("eval", help="the 9-cell table: teacher, student and baselines, reasoning tokens per effort")
    p.add_argument("--teachers", default=DEFAULT_TEACHERS)
    p.add_argument("--model", action="append", default=[], metavar="NAME=PATH",
                   help="a model to score on every cell (run dir or checkpoint), e.g. mopd=runs/mopd/student")
    p.add_argument("--no-base", action="store_true", help="do not score the teachers' shared base")
    p.add_argument("--cells", default="all", help="comma-separated DOMAIN/EFFORT cells (default all 9)")
    p.add_argument("--n", type=int, default=32, help="evaluation problems per cell (default 32)")
    p.add_argument("--seed", type=seed_type, default=1, help="evaluation problem seed (default 1; training evals use 0)")
    p.add_argument("--max-answer-tokens", type=int, default=40)
    p.add_argument("--out", default=None, help="write the report JSON here")
    p.add_argument("--markdown", default=None, help="write the markdown table here")
    p.add_argument("--gap-run", default=None, help="an MOPD run dir: plot its student-minus-teacher gaps")
    p.add_argument("--plot", default=None, help="gap plot path (default GAP_RUN/gap.png)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("-q", "--quiet", action="store_true")
    p.set_defaults(func=cmd_eval)

    p = dsub.add_parser("plot", help="redraw a run's student-minus-teacher gap plot (RUN/gap.png)")
    p.add_argument("run", help="a `k3 distill mopd` output directory")
    p.add_argument("--out", default=None, help="PNG path (default RUN/gap.png)")
    p.set_defaults(func=cmd_plot)

    p = dsub.add_parser("generate",
                        help="answer one prompt that carries its effort token, e.g. '<|effort:low|> sum 3+4'")
    p.add_argument("--model", required=True, help="run dir or checkpoint")
    p.add_argument("--prompt", required=True)
    p.add_argument("--teachers", default=None, help="teachers dir (tokenizer and budgets); or --tokenizer")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--max-answer-tokens", type=int, default=40)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=seed_type, default=0)
    p.set_defaults(func=cmd_generate)
