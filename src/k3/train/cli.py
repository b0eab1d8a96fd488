"""`k3 train` and `k3 demo`: thin commands over k3.train and k3.data.

`k3 train --nproc N` (and --ep/--fsdp/--pp) is k3.parallel.cli's: it adds those flags to this parser and runs
the distributed run, or this command when there is one process.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from k3.cli_checks import add_flags, from_args
from k3.data.cli import parse_bytes
from k3.model.cli import add_config_args, config_from_args

DEFAULT_DATA = "runs/data"
# no trailing space: the tokenizer joins a space to the word after it, so a prompt ending in " " leaves a lone
# space token that the model rarely saw before a word, and the sample starts with a second space
DEMO_PROMPTS = ("def", "import os\n", "class Config:\n    def __init__(self")
DEMO_MARK = ".k3-demo"  # in a demo's --out: the demo may replace what it finds there


# ---------------------------------------------------------------------- shared helpers
def load_data_dir(path: str | Path):
    """DataFiles from a `k3 tokenize` output directory, with errors that say what to run."""
    from k3.data import load_data

    path = Path(path)
    if not path.exists():
        raise ValueError(f"--data {path} does not exist; make it with `k3 tokenize --out {path}` "
                         "(add --data TEXT_DIR to tokenize your own text)")
    if not path.is_dir():
        raise ValueError(f"--data {path} is a file; pass the directory written by `k3 tokenize --out DIR`, "
                         f"or tokenize it first: `k3 tokenize --data {path} --out {DEFAULT_DATA}`")
    if not any(path.iterdir()):
        raise ValueError(f"--data {path} is empty; fill it with `k3 tokenize --out {path}`")
    if not (path / "train.json").is_file():
        raise ValueError(f"--data {path} holds no tokenized dataset (train.json); if it is raw text, run "
                         f"`k3 tokenize --data {path} --out {DEFAULT_DATA}` and pass --data {DEFAULT_DATA}")
    files = load_data(path)
    for split in ("train", "val"):
        ds = getattr(files, split)
        if ds.n_tokens == 0:
            raise ValueError(f"--data {path}: the {split} split is empty; give more text to `k3 tokenize`")
    return files


class Progress:
    """A tqdm bar fed by the trainer's callbacks: loss and tokens/s per step, a line per evaluation."""

    def __init__(self, trainer, desc: str = "train", enabled: bool = True, header: str | None = None):
        self.trainer, self.desc, self.enabled, self.header = trainer, desc, enabled, header
        self.bar = None

    def on_step(self, rec: dict) -> None:
        if not self.enabled:
            return
        from tqdm.auto import tqdm

        if self.bar is None:
            if self.header:  # once training has started: not before an error that stops the run at once
                print(self.header, file=sys.stderr)
            self.bar = tqdm(total=self.trainer.tc.steps, initial=rec["step"] - 1, unit="step", desc=self.desc,
                            dynamic_ncols=True, file=sys.stderr)
        if self.bar.total != self.trainer.tc.steps:
            self.bar.total = self.trainer.tc.steps
        self.bar.update(rec["step"] - self.bar.n)
        self.bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}", refresh=True)

    def on_eval(self, rec: dict) -> None:
        msg = f"step {rec['step']}: val loss {rec['val_loss']:.4f}, ppl {rec['val_ppl']:.2f}"
        if "val_bpb" in rec:
            msg += f", {rec['val_bpb']:.4f} bits/byte"
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        elif self.enabled:
            print(msg, file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _train_config(args, **over):
    """The validated TrainConfig of `k3 train`'s flags (single-process and distributed)."""
    from k3.train.config import TrainConfig

    return from_args(TrainConfig, args, **over)


def _data_info(files) -> dict:
    return {"data_dir": str(Path(files.out_dir).resolve()), "tokenizer": str(Path(files.tokenizer.path).resolve()),
            # what a resume compares: the same tokenizer and training tokens, wherever the directory now is
            "tokenizer_hash": files.tokenizer.fingerprint, "train_tokens": len(files.train)}


def _bytes_per_token(ds) -> float | None:
    return ds.manifest.get("bytes_per_token") if hasattr(ds, "manifest") else None


def set_threads(n: int | None, auto: bool = False) -> int:
    """Intra-op CPU threads: `n` if given; with `auto`, the cores left free by those busy now (at least 1).
    Returns the thread count (`choose_threads` also says why)."""
    return choose_threads(n, auto)[0]


def choose_threads(n: int | None, auto: bool = False) -> tuple[int, str]:
    """set_threads, returning (threads, why they were chosen).

    On a machine shared with other jobs, more threads than free cores make every op wait on the slowest
    thread (measured on the shared 2-core dev machine at load ~5: a `mini` step took 3-90 s with 2 threads,
    4-6.5 s with 1)."""
    import os

    import torch

    from k3.train import device

    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        raise ValueError(f"--threads {n}: give a positive number of CPU threads (0 or none: the default)")
    if n:
        torch.set_num_threads(n)
        return torch.get_num_threads(), f"--threads {n} given"
    if auto:
        cores = os.cpu_count() or 1
        busy, what = device.busy_now()
        if busy is None:
            return torch.get_num_threads(), "torch's default for this machine"
        free = max(1, min(torch.get_num_threads(), int(cores - busy + 0.5)))
        torch.set_num_threads(free)
        return torch.get_num_threads(), f"{cores} cores, {what} leaves {free} free (--threads N to choose)"
    return torch.get_num_threads(), "torch's default for this machine"


def _with_qat(config, args):
    """`--qat [SPEC]` sets config.qat: K3's MXFP4 expert weights + MXFP8 expert activations, the items the config
    already holds (--set qat=... or --config), then SPEC's items."""
    if getattr(args, "qat", None) is None:
        return config
    from k3.model.qat import parse_qat

    return config.replace(qat=parse_qat(args.qat, config.qat))


# ---------------------------------------------------------------------- k3 train
def check_resume_flags(args: argparse.Namespace) -> None:
    if args.resume and args.overwrite:
        raise ValueError("--resume continues the run in --out and --overwrite deletes it: give one of them")


def cmd_train(args: argparse.Namespace) -> int:
    from k3.train.plots import plot_all
    from k3.train.trainer import Trainer

    check_resume_flags(args)
    config = _with_qat(config_from_args(args), args)
    tc = _train_config(args)
    set_threads(args.threads)
    files = load_data_dir(args.data)
    trainer = Trainer(config, tc, files.train, files.val, args.out, bytes_per_token=_bytes_per_token(files.val),
                      data_info=_data_info(files), overwrite=args.overwrite)
    progress = Progress(trainer, desc=f"train {config.name}", enabled=not args.quiet,
                        header=f"precision {trainer.tc.precision}: {trainer.precision_reason}")
    try:
        result = trainer.fit(resume=args.resume, on_step=progress.on_step, on_eval=progress.on_eval,
                             graceful_interrupt=True)
    finally:
        progress.close()
    plots = plot_all(args.out)
    if not result.losses and result.stopped_early:
        print(f"the time budget ({args.max_minutes} min) ended before the first step; raise --max-minutes")
    elif not result.losses and result.interrupted:
        print(f"stopped before step {result.steps_done + 1}: nothing trained in this run")
    elif not result.losses:  # a resumed run that was already at --steps
        print(f"already at step {result.steps_done} ({result.tokens:,} tokens): nothing to train; raise --steps "
              "to continue")
    else:
        done = len(result.losses)
        this_call = f" ({done} in this run, from step {result.steps_done - done})" if done != result.steps_done else ""
        why = " (time budget reached)" if result.stopped_early else " (interrupted)" if result.interrupted else ""
        print(f"trained to step {result.steps_done}{this_call}, {result.tokens:,} tokens in all, in "
              f"{result.elapsed_s / 60:.1f} min{why}; last train loss {result.losses[-1]:.4f}")
    if result.val:
        v = result.val[-1]
        at = f" (at step {v['step']})" if v.get("step") != result.steps_done else ""  # e.g. after a stop signal
        print(f"validation loss {v['val_loss']:.4f}" + (f", {v['val_bpb']:.4f} bits/byte" if "val_bpb" in v else "")
              + at)
    print(f"metrics    {Path(args.out) / 'metrics.jsonl'}")
    print(f"plots      {', '.join(str(p) for p in plots.values())}")
    print(f"checkpoint {result.checkpoint or 'none written'}")
    if result.interrupted:
        print(interruption_message(result, trainer.tc.steps, args.out), file=sys.stderr)
        return 130
    return 0


def interruption_message(result, steps: int, out) -> str:
    """What a `k3 train` stopped by a signal left, and how to go on (single-process and distributed runs)."""
    if result.checkpoint is None:
        return "interrupted before the first step: nothing was saved; the same command starts over"
    resume = f"`k3 train ... --out {out} --resume` continues from step {result.steps_done}"
    if not result.losses:
        return f"interrupted before step {result.steps_done + 1}: {resume}"
    if result.steps_done >= steps:
        return f"interrupted during the run's last step ({result.steps_done}): the run is complete and saved"
    return f"interrupted: {resume}"


# ---------------------------------------------------------------------- sampling (k3 demo; k3 sample is k3.io.cli's)
def check_sampling(temperature: float, top_p: float, max_new_tokens: int,
                   tokens_flag: str = "--max-new-tokens") -> None:
    """The sampling flags' ranges, each named (NaN and infinity are refused: they fail inside the sampler)."""
    import math

    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"--temperature {temperature} must be a finite number >= 0 (0 = greedy)")
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise ValueError(f"--top-p {top_p} must be in (0, 1] (1 = no nucleus cut)")
    if max_new_tokens < 1:
        raise ValueError(f"{tokens_flag} {max_new_tokens} must be >= 1")


def generate_text(model, tokenizer, prompt: str, max_new_tokens: int = 64, temperature: float = 0.8,
                  top_p: float = 0.95, seed: int = 0, skip_special: bool = True) -> str:
    """Continue `prompt` (an empty prompt starts a new document) and cut at the first <|eos|>. Special tokens
    the model writes (<|end|>, <|tool_call|>, ...) are left out of the text unless `skip_special` is False, as
    the server's completions route does by default (`skip_special_tokens`)."""
    import torch

    check_sampling(temperature, top_p, max_new_tokens)
    ids = tokenizer.encode(prompt, allow_special=False) if prompt else [tokenizer.eos_id]
    if len(ids) + max_new_tokens > model.config.max_context:
        raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds max_context = "
                         f"{model.config.max_context}")
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(torch.tensor([ids], device=device), max_new_tokens, temperature=temperature,
                         top_p=top_p, generator=gen)[0, len(ids):].tolist()
    if tokenizer.eos_id in out:
        out = out[:out.index(tokenizer.eos_id)]
    return prompt + tokenizer.decode(out, skip_special=skip_special)


# ---------------------------------------------------------------------- k3 demo
def cmd_demo(args: argparse.Namespace) -> int:
    from k3.data import prepare_data
    from k3.model.accounting import count_params
    from k3.fileio import atomic_write_text
    from k3.train.metrics import bits_per_byte, unigram_loss
    from k3.train.plots import plot_all
    from k3.train.config import TrainConfig
    from k3.train.trainer import Trainer, _check_writable
    from k3.train.batches import eval_batches

    t_start = time.perf_counter()
    threads, threads_reason = choose_threads(args.threads, auto=True)
    if not args.minutes > 0:
        raise ValueError(f"--minutes = {args.minutes} must be positive")
    if args.max_steps < 1:
        raise ValueError(f"--max-steps {args.max_steps} must be a positive integer")
    check_sampling(0.8, 0.95, args.sample_tokens, "--sample-tokens")  # checked now, not after training
    out = Path(args.out)
    config = config_from_args(args)
    if args.sample_tokens >= config.max_context:
        raise ValueError(f"--sample-tokens {args.sample_tokens} leaves no room for a prompt in max_context = "
                         f"{config.max_context}; give fewer")
    tc = from_args(TrainConfig, args, defaults=dict(eval_every=0, eval_at_start=True, keep_last=2),
                   steps=args.max_steps, max_minutes=args.minutes, fit_steps_to_budget=True)
    _check_demo_dirs(Path(args.data), out)
    _check_writable(out)
    atomic_write_text(out / DEMO_MARK, "written by k3 demo, which replaces this directory's run when it starts\n")
    for name in ("summary.json", "samples.txt"):  # the last demo's results, which this run replaces
        (out / name).unlink(missing_ok=True)
    tty = sys.stderr.isatty()
    print(f"k3 demo: data in {args.data} (tokenizer + packed train/val splits; reused when present)", file=sys.stderr)
    try:
        files = prepare_data(args.data, vocab_size=config.vocab_size, max_bytes=args.max_bytes, progress=tty,
                             replace=False)
    except ValueError as e:  # its advice names k3 tokenize's flags; say which of the demo's do the same
        raise ValueError(f"{e} (in k3 demo the vocabulary is the config's: --set vocab_size=N; the text is "
                         "capped by --max-bytes)") from None
    bpt = _bytes_per_token(files.val)
    longest = max(len(files.tokenizer.encode(p, allow_special=False)) if p else 1 for p in DEMO_PROMPTS)
    if longest + args.sample_tokens > config.max_context:  # known now, before training, not after it
        raise ValueError(f"--sample-tokens {args.sample_tokens} plus the longest sample prompt ({longest} tokens) "
                         f"exceeds max_context = {config.max_context}; give --sample-tokens "
                         f"{config.max_context - longest} or fewer")

    # the unigram baseline on exactly the validation targets the model is scored on
    targets = [y for _, y in eval_batches(files.val, args.batch_size, args.seq_len, args.eval_batches)]
    unigram = unigram_loss(files.train.tokens, config.vocab_size, targets)

    trainer = Trainer(config, tc, files.train, files.val, out, bytes_per_token=bpt, data_info=_data_info(files),
                      overwrite=True)
    # after training: the samples (timed here on the untrained model: decoding costs the same trained), plots and
    # summary, with room to spare; the trainer budgets its own final evaluation and save
    reserve = min(AFTER_TRAINING_S + 2.0 * len(DEMO_PROMPTS) * args.sample_tokens * _decode_seconds(trainer.model),
                  6.0 * args.minutes)
    spent = time.perf_counter() - t_start
    budget_min = (args.minutes * 60 - spent - reserve) / 60
    if budget_min * 60 < 5:
        raise ValueError(f"--minutes {args.minutes} leaves {budget_min * 60:.0f}s for training after preparing the "
                         f"data ({spent:.0f}s); give more minutes")
    tc.max_minutes = budget_min
    counts = count_params(trainer.model)
    print(f"k3 demo: training {config.name} ({counts['total'] / 1e6:.1f}M parameters, {counts['active'] / 1e6:.1f}M "
          f"active) for about {budget_min:.1f} min on {trainer.device}; batch {tc.batch_size} x {tc.seq_len} tokens, "
          f"{tc.optimizer}, lr {tc.lr}", file=sys.stderr)
    print(f"k3 demo: {threads} CPU thread(s): {threads_reason}", file=sys.stderr)
    print(f"k3 demo: precision {trainer.tc.precision}: {trainer.precision_reason}", file=sys.stderr)
    progress = Progress(trainer, desc=f"demo {config.name}", enabled=True)
    try:
        result = trainer.fit(on_step=progress.on_step, on_eval=progress.on_eval, graceful_interrupt=True)
    finally:
        progress.close()
    if result.interrupted:  # the checkpoint is saved; samples, plots and the summary are skipped
        if result.checkpoint is None:
            print("k3 demo: interrupted before the first step; nothing was saved", file=sys.stderr)
        else:
            print(f"k3 demo: interrupted at step {result.steps_done}; its checkpoint is in {out / 'checkpoint'} (a "
                  "new k3 demo starts over; `k3 sample`/`k3 eval --ckpt` read it)", file=sys.stderr)
        return 130
    if not result.losses:  # nothing trained, nothing saved: no samples, plots or summary to show
        raise ValueError(f"--minutes {args.minutes}: the time budget ended before the first training step (with its "
                         f"final evaluation and save) could run on this machine; raise --minutes")

    samples = []
    for i, prompt in enumerate(DEMO_PROMPTS):
        text = generate_text(trainer.model, files.tokenizer, prompt, args.sample_tokens, 0.8, 0.95, args.seed + i)
        samples.append(f"=== prompt {prompt!r} (temperature 0.8, top-p 0.95, seed {args.seed + i})\n{text}\n")
    atomic_write_text(out / "samples.txt", "\n".join(samples))
    plots = plot_all(out, baseline=unigram)

    start, end = result.val[0], result.val[-1]
    summary = {
        "model": config.name, "params": counts["total"], "active_params": counts["active"],
        "steps": result.steps_done, "tokens": result.tokens, "train_minutes": round(result.elapsed_s / 60, 2),
        "total_minutes": round((time.perf_counter() - t_start) / 60, 2), "batch_size": tc.batch_size,
        "seq_len": tc.seq_len, "optimizer": tc.optimizer, "bytes_per_token_val": bpt,
        "val_tokens_scored": sum(y.numel() for y in targets),
        "val_loss_start": start["val_loss"], "val_loss_end": end["val_loss"],
        "val_bpb_start": bits_per_byte(start["val_loss"], bpt), "val_bpb_end": bits_per_byte(end["val_loss"], bpt),
        "unigram_loss": unigram, "unigram_bpb": bits_per_byte(unigram, bpt),
        "last_train_loss": result.losses[-1] if result.losses else None,
        "planned_steps": trainer.tc.steps, "stopped_by_time_budget": result.stopped_early,
        "checkpoint": result.checkpoint, "threads": threads, "threads_reason": threads_reason,
        "precision": trainer.tc.precision, "precision_reason": trainer.precision_reason,
    }
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    print(f"\nk3 demo: {summary['steps']} steps, {summary['tokens']:,} tokens in {summary['train_minutes']:.1f} min "
          f"(whole demo {summary['total_minutes']:.1f} min)")
    print(f"validation bits per byte: start {summary['val_bpb_start']:.3f} -> end {summary['val_bpb_end']:.3f}; "
          f"unigram baseline {summary['unigram_bpb']:.3f} (train-split token frequencies, same val tokens)")
    print(f"metrics     {out / 'metrics.jsonl'}")
    print(f"plots       {plots['loss']}  {plots['experts']}  {plots['attnres']}")
    print(f"samples     {out / 'samples.txt'}")
    print(f"checkpoint  {result.checkpoint}")
    print(f"summary     {out / 'summary.json'}")
    print(f"next: k3 sample --ckpt {out / 'checkpoint'} --prompt 'def'   |   k3 eval --ckpt {out / 'checkpoint'}")
    return 0


AFTER_TRAINING_S = 10.0  # the demo's plots and summary, with room: ~3 s on the 2-core development machine


def _decode_seconds(model, tokens: int = 8) -> float:
    """Seconds per sampled token of `model.generate` on this host (the second of two timed calls)."""
    import torch

    start = torch.zeros(1, 1, dtype=torch.long, device=next(model.parameters()).device)
    for _ in range(2):
        t0 = time.perf_counter()
        model.generate(start, tokens).tolist()  # on an accelerator, .tolist() waits for the tokens
        dt = time.perf_counter() - t0
    return dt / tokens


def _check_demo_dirs(data: Path, out: Path) -> None:
    """The demo tokenizes the standard library into --data and replaces the run in --out: refuse directories
    that hold something else (another corpus's data; a `k3 train` run), so nothing of the user's is lost."""
    from k3.data.corpus import STDLIB_SOURCE
    from k3.data.dataset import held_source, same_corpus

    if data.is_file() or out.is_file():
        raise ValueError(f"{data if data.is_file() else out} is a file; the demo needs directories for --data and "
                         "--out")
    source = held_source(data)  # None: nothing there, or damaged (prepare_data rebuilds it)
    # any Python's standard library (an earlier demo, maybe under another interpreter) is the demo's to replace
    if source is not None and not same_corpus(source, STDLIB_SOURCE + " "):
        raise ValueError(f"--data {data} holds data tokenized from {source}; the demo tokenizes the Python "
                         "standard library and would replace it: give the demo a --data of its own")
    ran = [p for p in (out / "checkpoint", out / "metrics.jsonl") if p.exists()]
    if ran and not (out / DEMO_MARK).is_file() and not (out / "summary.json").is_file():
        raise ValueError(f"--out {out} holds a run that is not a demo's ({ran[0].name}); the demo starts over in "
                         "its --out and would delete it: give the demo an --out of its own")


# ---------------------------------------------------------------------- registration
# TrainConfig's flags each command takes (k3.cli_checks.flag: one name and help per setting)
TRAIN_FLAGS = ("steps", "batch_size", "seq_len", "accum", "lr", "optimizer", "warmup_steps", "decay_frac",
               "max_minutes", "eval_every", "eval_batches", "ckpt_every", "keep_last", "seed", "doc_mask",
               "activation_checkpointing", "compile", "device", "precision")
DEMO_FLAGS = ("batch_size", "seq_len", "lr", "optimizer", "warmup_steps", "decay_frac", "eval_batches", "ckpt_every",
              "seed", "doc_mask", "precision")
PRECISION_HELP = ("fp32, bf16 (autocast; weights and optimizer state stay fp32), or auto (default): bf16 only where a "
                  "probe on this host, cached per host, measures a training step faster")


def _add_threads(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads (default: torch's choice; the demo uses the cores the load average leaves free)")


def register(sub) -> None:
    p = sub.add_parser("train", help="train a model on tokenized data (see `k3 tokenize`)",
                       description="Train a K3 model. Writes OUT/metrics.jsonl, OUT/checkpoint/step_XXXXXX/ and, "
                                   "in a single process, OUT/{loss,experts,attnres}.png.")
    add_config_args(p, default="mini")
    p.add_argument("--data", default=DEFAULT_DATA, help=f"directory written by `k3 tokenize` (default {DEFAULT_DATA})")
    p.add_argument("--out", default="runs/train", help="output directory (default runs/train)")
    from k3.train.config import TrainConfig

    add_flags(p, TrainConfig, only=TRAIN_FLAGS,
              defaults={"steps": 1000, "seq_len": 256, "eval_every": 100, "precision": "auto"},
              helps={"warmup_steps": "LR warmup steps (default 5%% of --steps)", "precision": PRECISION_HELP})
    _add_threads(p)
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint's latest step")
    p.add_argument("--overwrite", action="store_true", help="start over even if OUT already has a checkpoint")
    p.add_argument("--qat", nargs="?", const="", default=None, metavar="KEY=FMT,...",
                   help="quantization-aware training: routed-expert weights MXFP4 and their input activations MXFP8; "
                        "optional overrides, e.g. --qat linears=mxfp4 or --qat activations=none "
                        "(keys expert_weights, activations, linears; formats mxfp4, mxfp8, none)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train)  # k3.parallel.cli adds --nproc/--ep/--fsdp/--pp and wraps it

    p = sub.add_parser("demo", help="tokenize the embedded corpus, train `mini` for a few minutes, report",
                       description="The end-to-end demo: tokenizer + datasets from the Python standard library, "
                                   "a time-bounded training run, plots, samples and bits per byte vs a unigram "
                                   "baseline, all under --out.")
    add_config_args(p, default="mini")
    p.add_argument("--minutes", type=float, default=10.0, help="wall-clock budget for the whole demo (default 10)")
    p.add_argument("--data", default=DEFAULT_DATA, help=f"where the tokenized data lives (default {DEFAULT_DATA})")
    p.add_argument("--out", default="runs/demo", help="output directory (default runs/demo)")
    add_flags(p, TrainConfig, only=DEMO_FLAGS,
              defaults={"batch_size": 8, "lr": 2e-3, "warmup_steps": 10, "eval_batches": 16, "precision": "auto"},
              helps={"precision": PRECISION_HELP})
    _add_threads(p)
    p.add_argument("--max-steps", type=int, default=100_000, help="cap on steps (the time budget decides)")
    p.add_argument("--sample-tokens", type=int, default=80, help="tokens per sample in samples.txt")
    p.add_argument("--max-bytes", type=parse_bytes, default=None,
                   help="cap on corpus bytes per split, e.g. 5MB (default: all)")
    p.set_defaults(func=cmd_demo)
