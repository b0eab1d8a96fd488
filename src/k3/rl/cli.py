"""`k3 rl`: agentic RL (GRPO on verified AgentENV rewards) — warm start, train, eval, plot, --demo.

An experiment lives in one root directory:

    ROOT/tokenizer.json   ROOT/tasks/{train,heldout}/   ROOT/demos.jsonl
    ROOT/warmstart/       supervised warm start (checkpoint/, metrics.jsonl)
    ROOT/<run>/           a GRPO run (checkpoint/, metrics.jsonl), e.g. swap and fixed
    ROOT/eval.json        held-out success of each model under the training and the unseen harness
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from k3.cli_checks import MATPLOTLIB_PLOTS, add_flags, at_least, from_args, output_file, output_png, seed as seed_type
from k3.data.tokenizer import check_vocab_size
from k3.fileio import loads_json

DEFAULT_ROOT = "runs/rl/exp"


class _Bar:
    """tqdm over optimizer steps, fed by the loop's records."""

    def __init__(self, total: int, desc: str, keys: tuple, enabled: bool = True):
        self.total, self.desc, self.keys, self.enabled, self.bar = total, desc, keys, enabled, None

    def __call__(self, rec: dict) -> None:
        if not self.enabled or rec.get("kind") != "train":
            return
        from tqdm.auto import tqdm
        if self.bar is None:
            self.bar = tqdm(total=self.total, initial=rec["step"] - 1, unit="step", desc=self.desc,
                            dynamic_ncols=True, file=sys.stderr)
        self.bar.update(rec["step"] - self.bar.n)
        self.bar.set_postfix({k: f"{rec[k]:.3f}" for k in self.keys if isinstance(rec.get(k), (int, float))},
                             refresh=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


_JSON_HELP = "print the result as indented JSON (without it: the same JSON on one line)"


# ---------------------------------------------------------------------------------------------- flag checks
# run before any work (collecting demonstrations, building the tokenizer, loading models), each naming its flag
def _check_run_flags(args):
    """The flags `_common` adds (warm start and GRPO); returns the loop's validated config."""
    if args.resume and args.overwrite:
        raise ValueError("--resume continues the run and --overwrite starts it over; give one")
    return _loop_config(args)


def _check_name(flag: str, name: str) -> None:
    """A stage or run name is one directory under --root, never a path out of it."""
    if not name or name in (".", "..") or "/" in name:
        raise ValueError(f"{flag} {name!r} must be a plain directory name under --root (no '/', not '.' or '..'), "
                         "e.g. swap")


def _names(flag: str, text: str) -> list[str]:
    """The names of a comma-separated flag, at least one."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError(f"{flag} {text!r} names nothing; give at least one (comma-separated)")
    return names


def _check_fresh(run: Path, args, other: str) -> None:
    """A run directory that holds a checkpoint is continued (--resume) or replaced (--overwrite), never both or
    neither; `other` is the flag that picks another directory."""
    from k3.train import checkpoint as ckpt
    held = ckpt.latest_checkpoint(run / "checkpoint") is not None
    if args.resume and not held:
        raise ValueError(f"--resume: no checkpoint in {run / 'checkpoint'}; run without --resume to start")
    if not args.resume and not args.overwrite and held:
        raise ValueError(f"{run} already holds a checkpoint; pass --resume to continue it, --overwrite to start over, "
                         f"or {other}")


# TrainConfig's flags of `k3 rl warmstart` and `k3 rl train` (GRPOConfig's are `k3 rl train`'s too)
LOOP_FLAGS = ("steps", "lr", "warmup_steps", "decay_frac", "grad_clip", "ckpt_every", "keep_last", "seed")


def _loop_config(args):
    """The loop's config from the flags, over the post-training defaults (k3.train.config.POST_TRAINING)."""
    from k3.train.config import POST_TRAINING, TrainConfig
    return from_args(TrainConfig, args, only=LOOP_FLAGS, defaults=POST_TRAINING)


def _tokenizer(root: Path):
    from k3.data.tokenizer import load_tokenizer
    path = root / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{path} does not exist; run `k3 rl warmstart --root {root}` first")
    return load_tokenizer(path)


def _load(root: Path, name: str, tokenizer):
    """The latest checkpoint of ROOT/<name> (a stage or a run; callers check first that it holds one with
    `_check_models`), checked against the experiment's tokenizer."""
    from k3.io.trained import load_trained_model, trained_tokenizer_hash
    model, manifest = load_trained_model(root / name / "checkpoint")
    if trained_tokenizer_hash(manifest) not in (None, tokenizer.fingerprint):
        raise ValueError(f"{root / name / 'checkpoint'} was trained with another tokenizer than "
                         f"{root / 'tokenizer.json'}")
    return model, manifest


def _check_models(root: Path, names: list[str], max_tokens: int | None = None, other: str = "--models") -> None:
    """Every model named holds a checkpoint, and `max_tokens` leaves room for a prompt in its context, before the
    first is evaluated (a typo, or a run killed in its first save, is not found after minutes of work)."""
    from k3.train.checkpoint import latest_checkpoint, read_manifest

    found = {n: latest_checkpoint(root / n / "checkpoint") if (root / n / "checkpoint").is_dir() else None
             for n in names}
    missing = [n for n, step in found.items() if step is None]
    if missing:
        raise ValueError(f"no checkpoint for {', '.join(missing)} under {root}; train {', '.join(map(repr, missing))} "
                         f"first (k3 rl warmstart / k3 rl train --name NAME), or name another {other}")
    for name, step in found.items():
        ctx = int(read_manifest(step, verify=False)["config"]["max_context"])
        if max_tokens is not None and max_tokens >= ctx:  # every episode would be excluded, measuring nothing
            raise ValueError(f"--max-tokens {max_tokens} does not fit {name}'s context of {ctx} tokens with any "
                             f"prompt; give a value well below {ctx}")


def _tokenizer_settings(args) -> dict:
    return {"vocab_size": args.vocab_size, "tokenizer_prompts": args.tokenizer_prompts,
            "demos": {"tasks_per_kind": args.tasks_per_kind, "demos_per_task": args.demos_per_task,
                      "seed": args.seed, "harness": args.demo_harness}}


def _reuse_tokenizer(root: Path, args) -> bool:
    """Whether ROOT/tokenizer.json (built once per experiment from the demonstrations) is reused: the flags that
    made it (recorded beside it) are the same. A different --vocab-size, --tokenizer-prompts or demonstration set
    is refused here, before the demonstrations are collected (they would replace ROOT/demos.jsonl), or, with
    --overwrite, rebuilds it."""
    from k3.data.tokenizer import reuse_built_tokenizer
    return reuse_built_tokenizer(root / "tokenizer.json", _tokenizer_settings(args), args.overwrite,
                                 f"Pass the same flags to reuse it, or --overwrite to rebuild it (runs under {root} "
                                 "trained with the old tokenizer will then refuse to load), or use another --root")


def _warmstart_tokenizer(root: Path, demos: list, args, make_tokenizer, reuse: bool):
    from k3.data.tokenizer import install_tokenizer
    if reuse:
        return _tokenizer(root)
    tok = make_tokenizer(None, demos, args.vocab_size, args.tokenizer_prompts)
    install_tokenizer(tok, root / "tokenizer.json", _tokenizer_settings(args))
    return tok


# files that mark a directory as another tool's: a k3 rl --root never holds them
_FOREIGN = {"teachers.json": "a `k3 distill teachers` matrix", "data.json": "a `k3 tokenize` data folder",
            ".k3-data": "a `k3 tokenize` data folder", "metrics.jsonl": "a training run",
            "summary.json": "a `k3 demo` or ablation run"}


def _report_kind(report: dict) -> str:
    """"eval" or "intent": which command wrote a report (an eval report lists its harnesses)."""
    return "eval" if "harnesses" in report else "intent"


def _check_report_out(root: Path, out: Path, kind: str) -> None:
    """A report's --out: a file path, not one of the experiment's own files (demonstrations, tokenizer), and, when
    it exists, an earlier report of the same command (`k3 rl eval` or `k3 rl intent`) that may be replaced."""
    from k3.data.tokenizer import SETTINGS_FILE
    output_file("--out", out)
    own = {(root / n).resolve() for n in ("demos.jsonl", "tokenizer.json", SETTINGS_FILE)}
    if out.resolve() in own:
        raise ValueError(f"--out {out} is one of the experiment's own files; the report would replace it: give "
                         "another path")
    if out.is_file():
        try:
            earlier = loads_json(out.read_text(encoding="utf-8"))
        except (OSError, ValueError, UnicodeDecodeError):
            earlier = None
        if not isinstance(earlier, dict) or "models" not in earlier:
            raise ValueError(f"--out {out} exists and is not an earlier k3 rl report; the report would replace it: "
                             "give another path")
        if _report_kind(earlier) != kind:
            raise ValueError(f"--out {out} holds a `k3 rl {_report_kind(earlier)}` report; this `k3 rl {kind}` report "
                             "would replace it: give another path")


def _check_root(root: Path) -> None:
    """ROOT is an rl experiment's (or new): one of another tool would get demonstrations, tasks and a tokenizer
    written into it (and --overwrite would replace that tool's tokenizer)."""
    if root.exists() and not root.is_dir():
        raise ValueError(f"--root {root} is a file; give a directory")
    for name, what in _FOREIGN.items():
        if (root / name).exists():
            raise ValueError(f"--root {root} holds {name}: it is {what}, not a k3 rl experiment; give k3 rl a "
                             "--root of its own")


# ---------------------------------------------------------------------------------------------- commands
def cmd_warmstart(args) -> dict:
    from k3.config import PRESETS, get_config
    from k3.rl.train import demo_pool, make_tokenizer, new_model, run_warmstart
    from k3.train.cli import set_threads
    lcfg = _check_run_flags(args)
    at_least(args, 1, "--workers", "--batch", "--tasks-per-kind", "--demos-per-task", "--n-layers", "--max-context")
    at_least(args, 0, "--tokenizer-prompts", "--short-prompt-steps")
    check_vocab_size(args.vocab_size)
    if args.preset not in PRESETS:
        raise ValueError(f"--preset {args.preset!r} is not a preset; choose one of {', '.join(sorted(PRESETS))}")
    overrides = {k: v for k, v in (("n_layers", args.n_layers), ("layer_pattern", args.layer_pattern)) if v}
    get_config(args.preset, max_context=args.max_context, **overrides)  # the model's settings, before any work
    set_threads(args.threads)
    root = Path(args.root)
    _check_root(root)
    _check_fresh(root / "warmstart", args, "another --root")
    reuse = _reuse_tokenizer(root, args)
    t0 = time.perf_counter()
    demos = demo_pool(root, args.tasks_per_kind, args.demos_per_task, args.seed, workers=args.workers,
                      harness=args.demo_harness)
    if not demos:
        raise ValueError("no demonstration verified; check `k3 agentenv check`")
    tok = _warmstart_tokenizer(root, demos, args, make_tokenizer, reuse)
    print(f"{len(demos)} demonstrations, tokenizer {tok.vocab_size} tokens ({time.perf_counter() - t0:.1f}s)",
          file=sys.stderr)
    model = new_model(args.preset, tok, args.max_context, args.seed, **overrides)
    bar = _Bar(args.steps, "warm start", ("loss",), not args.quiet)
    try:
        records = run_warmstart(model, tok, demos, lcfg, root / "warmstart", batch_size=args.batch,
                                context_loss_weight=args.context_loss_weight,
                                short_prompt_steps=args.short_prompt_steps, resume=args.resume,
                                overwrite=args.overwrite, on_record=bar, graceful_interrupt=args.graceful)
    finally:
        bar.close()
    train = [r for r in records if r.get("kind") == "train"]
    return {"stage": "warmstart", "steps": train[-1]["step"] if train else None,
            "loss": train[-1]["loss"] if train else None, "demos": len(demos)}


def _grpo_config(args):
    from k3.rl.train import GRPOConfig
    return from_args(GRPOConfig, args)


def cmd_train(args) -> dict:
    from k3.rl.family import build_tasks
    from k3.rl.train import run_grpo
    from k3.train.cli import set_threads
    lcfg = _check_run_flags(args)
    _check_name("--name", args.name)
    _check_name("--init", args.init)
    from k3.data.tokenizer import SETTINGS_FILE
    own = {"warmstart", "tasks", "demos.jsonl", "tokenizer.json", SETTINGS_FILE, "eval.json", "intent.json",
           "reward.png"}
    if args.name in own:  # a run's checkpoint and metrics would land in (or replace) the experiment's own files
        raise ValueError(f"--name {args.name} is one of the experiment's own files or stages under --root "
                         f"({', '.join(sorted(own))}); name the run something else, e.g. swap")
    if args.init == args.name:
        raise ValueError(f"--init {args.init} and --name {args.name} are the same run: pass --resume (with the --init "
                         "it started from) to continue it, or another --name to train a new run from it")
    at_least(args, 1, "--tasks-per-kind")
    set_threads(args.threads)
    root = Path(args.root)
    _check_root(root)
    gcfg = _grpo_config(args)
    _check_fresh(root / args.name, args, "another --name")
    tok = _tokenizer(root)
    # a --max-tokens no prompt fits beside: every episode excluded, steps that train nothing
    _check_models(root, [args.init], gcfg.max_tokens, other="--init")
    model, manifest = _load(root, args.init, tok)
    ref = None
    if gcfg.beta > 0:
        ref, _ = _load(root, args.init, tok)
        ref.eval().requires_grad_(False)
    tasks = build_tasks(root / "tasks", "train", args.tasks_per_kind)
    bar = _Bar(args.steps, f"grpo {args.name}", ("reward_mean", "loss"), not args.quiet)
    try:
        records = run_grpo(model, tok, tasks, gcfg, lcfg, root / args.name,
                           init=_init_tag(root, args, manifest, gcfg.beta), ref_model=ref, resume=args.resume,
                           overwrite=args.overwrite, on_record=bar, graceful_interrupt=args.graceful)
    finally:
        bar.close()
    train = [r for r in records if r.get("kind") == "train" and r.get("reward_mean") is not None]
    if args.resume and not train:
        from k3.train.checkpoint import latest_checkpoint, read_manifest

        found = latest_checkpoint(root / args.name / "checkpoint")
        done = read_manifest(found, verify=False)["step"] if found else None
        if done is not None and done >= args.steps:  # as `k3 train --resume` says it
            print(f"{args.name} is already at step {done}: nothing to train; raise --steps above {done} to go on",
                  file=sys.stderr)
    return {"run": args.name, "steps": train[-1]["step"] if train else None,
            "reward_first": train[0]["reward_mean"] if train else None,
            "reward_last": train[-1]["reward_mean"] if train else None}


def _init_tag(root: Path, args, init_manifest: dict, beta: float) -> str:
    """The init a GRPO run records (NAME@STEP) and a resume must match. Without a KL term (beta 0) a resume never
    uses the init model (the run's own checkpoint holds the weights), so an init trained on since does not block
    it: the tag the run recorded stands. With beta > 0 it is the KL reference, and a moved one is refused."""
    tag = f"{args.init}@{init_manifest['step']}"
    if not (args.resume and beta == 0):
        return tag
    from k3.train.checkpoint import latest_checkpoint, read_manifest

    latest = latest_checkpoint(root / args.name / "checkpoint")
    recorded = (read_manifest(latest, verify=False).get("data") or {}).get("init") if latest else None
    return recorded if isinstance(recorded, str) and recorded.rpartition("@")[0] == args.init else tag


def cmd_eval(args) -> dict:
    from k3.rl.family import build_tasks
    from k3.rl.harness import episode_config
    from k3.rl.train import evaluate, wilson, write_json
    from k3.train.cli import set_threads
    names, harnesses = _names("--models", args.models), _names("--harness", args.harness)
    for h in harnesses:
        episode_config(h, args.fixed_dialect)  # an unknown harness or dialect, before any model is evaluated
    at_least(args, 1, "--n-per-kind", "--variants", "--max-tokens")
    root = Path(args.root)
    out = Path(args.out) if args.out else root / "eval.json"
    _check_report_out(root, out, "eval")
    set_threads(args.threads)
    tok = _tokenizer(root)
    _check_models(root, names, args.max_tokens)
    held = build_tasks(root / "tasks", "heldout", args.n_per_kind)
    report = {"tasks": len(held), "variants": args.variants, "harnesses": harnesses, "models": {}}
    for name in names:
        model, manifest = _load(root, name, tok)
        entry = {"step": manifest["step"]}
        for h in harnesses:
            t0 = time.perf_counter()
            table, trajs = evaluate(model, tok, held, h, args.variants, seed=args.seed, max_tokens=args.max_tokens,
                                    fixed_dialect=args.fixed_dialect, max_turns=args.max_turns)
            a = table["all"]
            k = round(a["success"] * a["usable"]) if a["success"] is not None else 0
            entry[h] = {"success": a["success"], "usable": a["usable"], "episodes": a["episodes"],
                        "ci95": wilson(k, a["usable"]), "excluded": a["excluded"],
                        "by": {key: v["success"] for key, v in table.items() if key != "all"},
                        "seconds": round(time.perf_counter() - t0, 1)}
            ci = entry[h]["ci95"]
            print(f"{name:12s} {h:7s} " + (f"success {a['success']:.3f} ({k}/{a['usable']}, 95% CI {ci[0]:.2f}-"
                                             f"{ci[1]:.2f})" if ci else "no usable episode (success not measured)"),
                  file=sys.stderr)
        report["models"][name] = entry
    write_json(out, report)
    return report


def cmd_intent(args) -> dict:
    """Teacher-forced command choice per task kind on demonstrations (does the policy read the instruction?)."""
    import random
    from k3.rl.train import command_choice, read_demos, write_json
    from k3.train.cli import set_threads
    names = _names("--models", args.models)
    at_least(args, 1, "--n")
    root = Path(args.root)
    out = Path(args.out) if args.out else root / "intent.json"
    _check_report_out(root, out, "intent")
    set_threads(args.threads)
    tok = _tokenizer(root)
    _check_models(root, names)
    path = root / "demos.jsonl"
    if not path.is_file():
        raise ValueError(f"{path} does not exist; run `k3 rl warmstart --root {root}` first")
    demos = read_demos(path)[1]
    if args.dialect:
        demos = [d for d in demos if d["dialect"] == args.dialect]
    random.Random(args.seed).shuffle(demos)
    demos = demos[:args.n]
    if not demos:
        raise ValueError(f"no demonstrations{' in dialect ' + args.dialect if args.dialect else ''} under {root}")
    report = {"demos": len(demos), "dialect": args.dialect, "models": {}}
    for name in names:
        model, manifest = _load(root, name, tok)
        report["models"][name] = {"step": manifest["step"], **command_choice(model, tok, demos)}
        rows = report["models"][name]["p"]
        print(f"{name:12s} step {manifest['step']:5d} " + "  ".join(
            f"{k}: " + "/".join(f"{rows[k][c]:.2f}" for c in rows[k]) for k in rows), file=sys.stderr)
    write_json(out, report)
    return report


def cmd_plot(args) -> dict:
    from k3.rl.plots import plot_rewards, read_eval_report, reward_curve
    root = Path(args.root)
    runs = {n.strip(): root / n.strip() / "metrics.jsonl" for n in args.runs.split(",") if n.strip()}
    missing = [name for name, path in runs.items() if not path.is_file()]
    if missing or not runs:
        raise ValueError(f"no training metrics for run(s) {', '.join(missing) or '(none given)'} under {root}; "
                         "name runs trained with `k3 rl train --name NAME` (--runs NAME,...)")
    empty = [name for name, path in runs.items() if not reward_curve(path)[0]]
    if empty:  # the plot had axes and a legend and no curve
        raise ValueError(f"run(s) {', '.join(empty)} under {root} hold no reward records (an SFT stage such as "
                         "warmstart has none, nor a GRPO run none of whose episodes was usable); name GRPO runs that "
                         "trained (--runs NAME,...)")
    eval_path = Path(args.eval) if getattr(args, "eval", None) else root / "eval.json"
    if getattr(args, "eval", None) and not eval_path.is_file():
        raise ValueError(f"{eval_path} does not exist; write it with `k3 rl eval --out {eval_path}`")
    out = Path(args.out) if args.out else root / "reward.png"
    output_png("--out", out, "reward.png", MATPLOTLIB_PLOTS)
    report = read_eval_report(eval_path) if eval_path.is_file() else None
    path = plot_rewards(runs, out, report=report)
    return {"plot": str(path)}


DEMO = {  # bounded so the whole pipeline runs in well under 15 minutes on 2 CPU cores
    "tasks_per_kind": 16, "demos_per_task": 2, "tokenizer_prompts": 100, "warm_steps": 300, "warm_batch": 4,
    "grpo_steps": 8, "groups": 2, "group_size": 4, "eval_per_kind": 2,
}


DEMO_MARK = "demo.json"  # written into a --demo root: the next demo may start it over


def _check_demo_root(root: Path, explicit: bool) -> None:
    """The demo starts over, deleting what its root holds: a --root given by hand must be new, empty or an earlier
    demo's (it wiped an experiment of `k3 rl warmstart` / `train` given there); the default root is the demo's own."""
    from k3.fileio import atomic_write_json

    _check_root(root)
    if explicit and root.is_dir() and any(root.iterdir()) and not (root / DEMO_MARK).is_file():
        raise ValueError(f"--root {root} holds an experiment that `k3 rl --demo` did not make, and the demo starts "
                         "over, deleting its checkpoints: give the demo a new or empty --root")
    root.mkdir(parents=True, exist_ok=True)
    atomic_write_json(root / DEMO_MARK, {"made_by": "k3 rl --demo"})


def cmd_demo(args) -> dict:
    """Warm start, GRPO with dialects swapped per episode, held-out evaluation (training and unseen harness), plot."""
    import argparse
    root = Path(args.root or "runs/rl/demo")
    _check_demo_root(root, explicit=args.root is not None)
    t0 = time.perf_counter()
    common = dict(root=str(root), threads=args.threads, seed=args.seed, quiet=args.quiet, workers=2,
                  resume=False, overwrite=True, keep_last=2, grad_clip=1.0, max_context=4096,
                  fixed_dialect="react", max_tokens=96, max_turns=None,
                  graceful=False)  # the demo has no --resume: a stop ends it at once, as SIGTERM's default does
    warm = argparse.Namespace(**common, preset="tiny", n_layers=None, layer_pattern="MKKK",
                              tokenizer_prompts=DEMO["tokenizer_prompts"],
                              demo_harness="canonical",
                              tasks_per_kind=DEMO["tasks_per_kind"],
                              demos_per_task=DEMO["demos_per_task"], vocab_size=1024, steps=DEMO["warm_steps"],
                              batch=DEMO["warm_batch"], lr=3e-3, warmup_steps=20, decay_frac=0.1, ckpt_every=0,
                              context_loss_weight=0.0, short_prompt_steps=0)
    # the recipe of docs/rl.md's evidence runs: dialects swapped per episode (their own tool names: renamed
    # ones give a warm start this small almost no success to learn from), episodes weighed equally, a KL term
    train = argparse.Namespace(**common, init="warmstart", name="grpo", harness="canonical",
                               tasks_per_kind=DEMO["tasks_per_kind"], steps=DEMO["grpo_steps"],
                               groups_per_step=DEMO["groups"], group_size=DEMO["group_size"], temperature=1.0,
                               updates_per_batch=1, eps_low=0.2, eps_high=0.28, beta=0.04, agg="sequence",
                               scale_rewards=True, lr=3e-4, warmup_steps=2, decay_frac=0.0,
                               ckpt_every=DEMO["grpo_steps"] // 2, micro_batch=0)
    try:
        out = {"warmstart": cmd_warmstart(warm)}
        out["grpo"] = cmd_train(train)
    except KeyboardInterrupt as e:  # the demo has no --resume: it starts over (the stage's advice does not apply)
        where = getattr(e, "where", "")
        raise KeyboardInterrupt(f"{where}; " * bool(where) + "`k3 rl --demo` starts over when run again") from None
    ev = argparse.Namespace(**common, models="warmstart,grpo", harness="canonical,unseen",
                            n_per_kind=DEMO["eval_per_kind"], variants=1, out=None)
    report = cmd_eval(ev)
    out["eval"] = {m: {h: report["models"][m][h]["success"] for h in report["harnesses"]} for m in report["models"]}
    out["plot"] = cmd_plot(argparse.Namespace(root=str(root), runs="grpo", out=None, eval=None))["plot"]
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


# ---------------------------------------------------------------------------------------------- parser
def _common(p, steps: int, lr: float, ckpt_every: int, warmup: int) -> None:
    from k3.train.config import TrainConfig

    p.add_argument("--root", default=DEFAULT_ROOT, help=f"experiment directory (default {DEFAULT_ROOT})")
    # --warmup is --warmup-steps' older spelling, which k3 rl's commands still take
    add_flags(p, TrainConfig, only=LOOP_FLAGS, defaults={"steps": steps, "lr": lr, "warmup_steps": warmup,
                                                         "decay_frac": 0.0, "ckpt_every": ckpt_every})
    p.add_argument("--threads", type=int, default=0, help="CPU threads (default: torch's choice)")
    p.add_argument("--workers", type=int, default=4, help="parallel sandboxes when collecting demonstrations")
    p.add_argument("--resume", action="store_true", help="continue the run from its latest checkpoint")
    p.add_argument("--overwrite", action="store_true", help="start over, deleting the run's checkpoints")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help=_JSON_HELP)



def register(subparsers) -> None:
    p = subparsers.add_parser("rl", help="agentic RL: GRPO on verified AgentENV rewards",
                              description=__doc__.splitlines()[0])
    p.add_argument("--demo", action="store_true",
                   help="bounded end-to-end run: warm start, GRPO with swapped dialects, held-out eval, plot")
    p.add_argument("--root", default=None, help="experiment directory for --demo (default runs/rl/demo)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--seed", type=seed_type, default=0)
    p.add_argument("-q", "--quiet", action="store_true")
    p.add_argument("--json", action="store_true", help=_JSON_HELP)
    sub = p.add_subparsers(dest="rl_command", metavar="SUBCOMMAND")
    p.set_defaults(func=lambda a: _run(cmd_demo, a) if a.demo else (p.print_help(), 2)[1])

    w = sub.add_parser("warmstart", help="tokenizer, tasks, demonstrations in several dialects, supervised warm start")
    _common(w, steps=300, lr=3e-3, ckpt_every=50, warmup=10)
    w.add_argument("--preset", default="tiny", help="model preset (vocab size comes from the tokenizer)")
    w.add_argument("--n-layers", type=int, default=None, help="layers (default: the preset's)")
    w.add_argument("--layer-pattern", default=None,
                   help="K/M per layer, e.g. MKKK (default: the preset's; see docs/rl.md on what tiny can learn)")
    w.add_argument("--max-context", type=int, default=4096)
    w.add_argument("--tokenizer-prompts", type=int, default=400,
                   help="system prompts of drawn training harnesses in the tokenizer's training text")
    w.add_argument("--vocab-size", type=int, default=1024)
    w.add_argument("--tasks-per-kind", type=int, default=16, help="training tasks per kind (calc, count, update)")
    w.add_argument("--demos-per-task", type=int, default=8, help="demonstrations per task, each in a drawn harness")
    w.add_argument("--batch", type=int, default=4, help="episodes per step")
    w.add_argument("--demo-harness", choices=("canonical", "swap"), default="canonical",
                   help="canonical: demonstrations in the four dialects with their own tool names; swap: renamed too")
    w.add_argument("--context-loss-weight", type=float, default=0.0,
                   help="weight of the cross-entropy on context tokens (prompt, tool outputs) beside the replies'")
    w.add_argument("--short-prompt-steps", type=int, default=0,
                   help="curriculum: the first N steps train on the episodes without their system prompt, where "
                        "a small model learns to choose its command from the instruction (docs/rl.md)")
    w.set_defaults(graceful=True, func=lambda a: _run(cmd_warmstart, a))

    t = sub.add_parser("train", help="GRPO from a checkpoint of the experiment")
    _common(t, steps=100, lr=1e-3, ckpt_every=10, warmup=0)
    t.add_argument("--init", default="warmstart", help="stage or run under ROOT to start from (default warmstart)")
    t.add_argument("--name", default="swap", help="run directory under ROOT")
    t.add_argument("--tasks-per-kind", type=int, default=16)
    from k3.rl.train import GRPOConfig

    add_flags(t, GRPOConfig)  # --groups, --group-size, ... --no-std: GRPOConfig's fields
    t.set_defaults(graceful=True, func=lambda a: _run(cmd_train, a))

    e = sub.add_parser("eval", help="greedy success on held-out tasks under the training and the unseen harness")
    e.add_argument("--root", default=DEFAULT_ROOT)
    e.add_argument("--models", default="warmstart", help="comma-separated stages/runs under ROOT")
    e.add_argument("--harness", default="swap,canonical,unseen", help="comma-separated: swap, canonical, fixed, unseen")
    e.add_argument("--fixed-dialect", default="react")
    e.add_argument("--n-per-kind", type=int, default=8, help="held-out tasks per kind")
    e.add_argument("--variants", type=int, default=2, help="harness variants per task")
    e.add_argument("--max-tokens", type=int, default=96)
    e.add_argument("--max-turns", type=int, default=None, help="turns per episode (default: the task's limit)")
    e.add_argument("--seed", type=seed_type, default=1)
    e.add_argument("--threads", type=int, default=0)
    e.add_argument("--out", default=None, help="report path (default ROOT/eval.json)")
    e.add_argument("--json", action="store_true", help=_JSON_HELP)
    e.add_argument("-q", "--quiet", action="store_true")
    e.set_defaults(func=lambda a: _run(cmd_eval, a))

    it = sub.add_parser("intent", help="does the policy read the instruction? teacher-forced command choice per kind")
    it.add_argument("--root", default=DEFAULT_ROOT)
    it.add_argument("--models", default="warmstart", help="comma-separated stages/runs under ROOT")
    it.add_argument("--n", type=int, default=48, help="demonstrations (drawn from ROOT/demos.jsonl)")
    it.add_argument("--dialect", default=None, help="only demonstrations in this dialect (e.g. react)")
    it.add_argument("--seed", type=seed_type, default=0)
    it.add_argument("--threads", type=int, default=0)
    it.add_argument("--out", default=None, help="report path (default ROOT/intent.json)")
    it.add_argument("--json", action="store_true", help=_JSON_HELP)
    it.set_defaults(func=lambda a: _run(cmd_intent, a))

    pl = sub.add_parser("plot", help="mean verified reward over GRPO steps (and held-out success, if evaluated)")
    pl.add_argument("--root", default=DEFAULT_ROOT)
    pl.add_argument("--runs", default="swap,fixed")
    pl.add_argument("--out", default=None, help="PNG path (default ROOT/reward.png)")
    pl.add_argument("--eval", default=None, help="eval report for the right panel (default ROOT/eval.json, if any)")
    pl.add_argument("--json", action="store_true", help=_JSON_HELP)
    pl.set_defaults(func=lambda a: _run(cmd_plot, a))


def _run(fn, args) -> int:
    out = fn(args)
    if getattr(args, "json", False):
        print(json.dumps(out, indent=1))
    else:
        print(json.dumps(out))
    return 0
