"""Distributed `k3 train` (--nproc/--ep/--fsdp/--pp) and `k3 mesh` (how a job's ranks would be laid out).

`k3 train --nproc N ...` outside torchrun re-launches itself as
`python -m k3.parallel.torchrun --standalone --nproc-per-node N -m k3.cli train ...` (the same arguments; that
module is torchrun, `torch.distributed.run`, ending without a traceback when a signal stops it);
inside torchrun (RANK / WORLD_SIZE set) `k3 train` runs k3.parallel.train.ParallelTrainer on the mesh.
`k3 train` itself is k3.train.cli's single-process command: `register` adds the layout flags to its parser and
routes it through `cmd_train` here.
"""
from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys


def add_parallel_args(p: argparse.ArgumentParser, mesh: bool = False) -> None:
    """The layout flags of `k3 train`; `mesh`: those `k3 mesh` reads (it lays ranks out, it launches nothing)."""
    g = p.add_argument_group("layout" if mesh else "distributed (torch.distributed; gloo on CPU, NCCL on CUDA)")
    g.add_argument("--nproc", type=int, default=1,
                   help="world size to lay out" if mesh else "processes on this machine; > 1 re-launches via torchrun")
    g.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (routed experts sharded over them)")
    g.add_argument("--fsdp", type=int, default=0, help="FSDP2 shard ranks for the non-expert weights (0 = all)")
    g.add_argument("--pp", type=int, default=1,
                   help="pipeline stages (GPipe over the --accum micro-batches; world = pp x data-parallel ranks)")
    if mesh:
        return
    g.add_argument("--ep-redundant", type=int, default=0, metavar="N",
                   help="N redundant expert slots per EP rank (needs --ep > 1): with --resume, experts are placed "
                        "and hot ones replicated from the loads the checkpoint observed (EPLB-style); on a new run, "
                        "from uniform loads (this also lets --ep leave a remainder of n_experts)")


def _check_expert_parallel(args, dims) -> None:
    """--ep and --ep-redundant against the config, before any process starts."""
    from k3.model.cli import config_from_args

    n = getattr(args, "ep_redundant", 0) or 0
    if n < 0:
        raise ValueError(f"--ep-redundant {n} must be >= 0")
    if n and dims.ep <= 1:
        raise ValueError(f"--ep-redundant {n} adds expert replicas on expert-parallel ranks: it needs --ep > 1")
    config = config_from_args(args)
    if config.n_dense_layers < config.n_layers and config.n_experts % dims.ep and not n:
        raise ValueError(f"n_experts = {config.n_experts} is not divisible by --ep {dims.ep}: pick an --ep that divides "
                         f"it, or add --ep-redundant 1 (each rank then holds {-(-config.n_experts // dims.ep) + 1} "
                         "expert slots, the spare ones replicas)")


def _dims(nproc: int, args):
    from k3.parallel.mesh import ParallelDims

    for flag, v in (("--nproc", nproc), ("--ep", args.ep), ("--pp", args.pp)):  # named as flags, not fields
        if v < 1:
            raise ValueError(f"{flag} {v} must be a positive integer")
    if args.fsdp < 0:
        raise ValueError(f"--fsdp {args.fsdp} must be >= 0 (0 = shard over all data-parallel ranks)")

    return ParallelDims(nproc, ep=args.ep, fsdp=args.fsdp, pp=args.pp)


def cmd_train(args: argparse.Namespace) -> int:
    """`k3 train`: the distributed run (a torchrun re-launch, or one rank of it) when the flags or the environment
    ask for one, else k3.train.cli's single-process command."""
    from k3.train.cli import check_resume_flags, cmd_train as train_one_process

    check_resume_flags(args)
    code = maybe_run_parallel(args)  # --nproc/--ep/--fsdp/--pp: torchrun re-launch, or one rank of it
    return train_one_process(args) if code is None else code


def maybe_run_parallel(args: argparse.Namespace) -> int | None:
    """None when this is a plain single-process `k3 train`; otherwise the exit code of the distributed run."""
    from k3.parallel.launch import in_torchrun, torchrun_command

    nproc = getattr(args, "nproc", 1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if in_torchrun() and world > 1:
        return run_parallel_train(args, world)
    if nproc < 1:
        raise ValueError(f"--nproc {nproc} must be >= 1")
    if nproc == 1:
        if getattr(args, "ep", 1) != 1 or getattr(args, "pp", 1) != 1 or getattr(args, "fsdp", 0) > 1:
            raise ValueError("--ep/--fsdp/--pp need several processes: add --nproc N (or launch with torchrun)")
        if getattr(args, "ep_redundant", 0):
            raise ValueError("--ep-redundant adds expert replicas on expert-parallel ranks: it needs --nproc N "
                             "--ep E with E > 1")
        if getattr(args, "resume", False) and getattr(args, "out", None) and _holds_dcp(args.out):
            return run_parallel_train(args, 1)  # a distributed checkpoint continues in a world of one
        return None
    _check_expert_parallel(args, _dims(nproc, args))  # a mesh that does not factor fails here, before launch
    import torch

    has = "cuda" if torch.cuda.is_available() else "cpu"  # what init_distributed will pick (NCCL or gloo)
    if getattr(args, "device", "auto") not in ("auto", has):
        raise ValueError(f"--device {args.device}: a distributed run here computes on {has} (the backend is chosen "
                         "from what the machine has); drop --device")
    _check_before_launch(args, _dims(nproc, args))
    argv = _without_nproc(sys.argv[1:])  # torchrun's own parser would take --nproc for --nproc-per-node
    if "train" not in argv:
        raise ValueError("the --nproc re-launch reads the command line; run `k3 train --nproc N ...` from a shell")
    cmd = torchrun_command(nproc, argv)
    print("launching: " + " ".join(cmd), file=sys.stderr)
    return run_forwarding_signals(cmd)


def run_forwarding_signals(cmd: list[str], timeout: float | None = None) -> int:
    """Run `cmd` (torchrun) and wait for it, passing on a SIGINT, SIGTERM, SIGHUP or SIGQUIT that a process sent to
    this one alone: `kill PID`, a supervisor's terminate(), `docker stop`. subprocess.call left torchrun and its ranks
    training with nobody in charge then. torchrun stays in this process group, so what the terminal sends to the
    whole group (Ctrl-C, Ctrl-Z, a hang-up) reaches it and the ranks directly, as it did, and is not sent twice: the
    signals are taken synchronously (sigtimedwait), and one that the kernel sent (si_code > 0, the terminal) is not
    forwarded. Returns the child's exit code, or when it ended after a signal: 130 for SIGINT and SIGTERM (the ranks
    save the step in progress and stop, an interruption as in a single-process run), 128 + the signal otherwise.
    `timeout` (tests): past it the child is killed and subprocess.TimeoutExpired raised."""
    import signal
    import time

    if not hasattr(signal, "sigtimedwait"):  # not Linux: no siginfo to tell who sent a signal
        return subprocess.call(cmd, timeout=timeout)
    taken = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, taken)
    got: list[int] = []
    try:
        # the child starts with this process's mask as it was, not with these signals blocked
        proc = subprocess.Popen(cmd, preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_SETMASK, mask))
        deadline = None if timeout is None else time.monotonic() + timeout
        while proc.poll() is None:
            info = signal.sigtimedwait(taken, 0.2)
            if info is not None:
                got.append(info.si_signo)
                if info.si_code <= 0:  # SI_USER / SI_QUEUE / SI_TKILL: sent by a process, to this one
                    try:
                        proc.send_signal(info.si_signo)
                    except ProcessLookupError:
                        pass
            if deadline is not None and time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise subprocess.TimeoutExpired(cmd, timeout)
        rc = proc.returncode
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    if got and rc != 0:
        name = signal.Signals(got[0]).name
        print(f"k3 train: the distributed run was stopped ({name}); --resume continues from its last checkpoint (the "
              "ranks save the step they are in when they stop, unless torchrun's shutdown timeout ends them first: "
              "TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s by default)", file=sys.stderr)
        return 130 if got[0] in (signal.SIGINT, signal.SIGTERM) else 128 + got[0]
    return rc


def _check_before_launch(args: argparse.Namespace, dims) -> None:
    """What every rank checks first (config, train settings, --data, --out's checkpoint), checked once before
    torchrun starts: a rank's error would otherwise come once per rank and then torchrun's own traceback.
    The ranks still check all of it."""
    from pathlib import Path

    from k3.model.cli import config_from_args
    from k3.parallel import checkpoint as pckpt
    from k3.parallel.pipeline import stage_layers
    from k3.parallel.train import check_parallel_settings, check_resume_meta
    from k3.train import checkpoint as ckpt
    from k3.train.cli import _data_info, _train_config, _with_qat, load_data_dir
    from k3.train.trainer import _check_writable

    config = _with_qat(config_from_args(args), args)
    tc = _train_config(args)
    stage_layers(config.n_layers, dims.pp)  # a --pp that cannot split the layers
    files = load_data_dir(args.data)
    check_parallel_settings(config, tc, dims, files.train)
    if not getattr(args, "out", None):
        return
    _check_writable(Path(args.out))
    root = Path(args.out) / "checkpoint"
    dcp = pckpt.latest(root) is not None
    single = not dcp and ckpt.latest_checkpoint(root) is not None  # (its lookup warns on a DCP directory)
    if args.resume and not dcp:
        if single:
            raise ValueError(f"{root} holds a single-process checkpoint, not a distributed one; resume it without "
                             "--nproc (or start a new distributed run with another --out)")
        raise ValueError(f"--resume: no checkpoint found in {root}; drop --resume to start a new run, or pass the "
                         "--out of the run to continue")
    if not args.resume and (dcp or single) and not args.overwrite:
        raise ValueError(f"{root} already holds a checkpoint; pass --resume to continue it, --overwrite to start "
                         "over, or another --out")
    if args.resume:  # before --ep-redundant places experts from the checkpoint's loads (for its own expert count)
        check_resume_meta(pckpt.read_meta(root), config, tc, _data_info(files))


def _holds_dcp(out) -> bool:
    from pathlib import Path

    from k3.parallel.checkpoint import latest

    return latest(Path(out) / "checkpoint") is not None


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def run_parallel_train(args: argparse.Namespace, world: int) -> int:
    """One rank of a torchrun job: build the mesh, train, save (DCP), print the summary on rank 0."""
    import torch.distributed as dist

    from k3.model.cli import config_from_args
    from k3.parallel.mesh import build_context, init_distributed
    from k3.parallel.train import ParallelTrainer
    from k3.train.cli import (Progress, _data_info, _train_config, _with_qat, interruption_message, load_data_dir,
                              set_threads)

    dims = _dims(world, args)
    config = _with_qat(config_from_args(args), args)
    tc = _train_config(args)
    set_threads(args.threads or 1)
    if world == 1 and not dist.is_initialized():
        import tempfile

        store = tempfile.mkdtemp(prefix="k3-store-")
        init_distributed(init_method=f"file://{store}/store", rank=0, world_size=1)
    else:
        init_distributed()
    try:
        ctx = build_context(dims)
        if ctx.rank != 0:
            logging.getLogger("k3").setLevel(logging.WARNING)  # one rank tells the story
        if getattr(args, "device", "auto") not in ("auto", ctx.device.type):
            raise ValueError(f"--device {args.device}: this distributed run computes on {ctx.device.type} (the "
                             f"{'NCCL' if ctx.device.type == 'cuda' else 'gloo'} backend, chosen from what the machine "
                             "has); drop --device")
        files = load_data_dir(args.data)
        if files.val is not None and ctx.rank == 0:
            logging.getLogger("k3").warning(
                "distributed runs do not evaluate during training yet (--eval-every is not used); evaluate the "
                "checkpoint with `k3 eval --ckpt %s/checkpoint`", args.out)
        _check_expert_parallel(args, dims)
        placements = None
        if args.ep_redundant:
            from pathlib import Path

            from k3.parallel.checkpoint import read_meta
            from k3.parallel.train import placements_from_loads

            if args.resume:
                from k3.parallel.train import check_resume_meta

                meta = read_meta(Path(args.out) / "checkpoint")
                check_resume_meta(meta, config, tc, _data_info(files))  # its loads are for its own experts
                if not meta.get("expert_loads"):
                    raise ValueError(f"{meta['path']} records no expert loads to place experts from; resume once "
                                     "without --ep-redundant and use the next checkpoint")
                loads = meta["expert_loads"]
            else:  # a new run: nothing observed yet, so every expert counts the same
                n_moe = sum(config.is_moe_layer(i) for i in range(config.n_layers))
                loads = [[1.0] * config.n_experts for _ in range(n_moe)]
            placements = placements_from_loads(loads, dims.ep, args.ep_redundant)
        trainer = ParallelTrainer(config, tc, files.train, ctx, out_dir=args.out, overwrite=args.overwrite,
                                  placements=placements, data_info=_data_info(files))
        progress = Progress(trainer, desc=f"train {config.name} x{world}", enabled=ctx.rank == 0 and not args.quiet)
        try:
            result = trainer.fit(resume=args.resume, on_step=progress.on_step, graceful_interrupt=True)
        finally:
            progress.close()
        if ctx.rank == 0:
            done = len(result.losses)
            if not done:
                print(f"already at step {result.steps_done}: nothing to train; raise --steps to continue")
            else:
                this_call = f" ({done} in this run)" if done != result.steps_done else ""
                why = " (interrupted)" if result.interrupted else ""
                print(f"trained to step {result.steps_done}{this_call}, {result.tokens:,} tokens in all, on {world} "
                      f"ranks ({dims.describe()}) in {result.elapsed_s / 60:.1f} min{why}; last train loss "
                      f"{result.losses[-1]:.4f}")
            print(f"checkpoint {result.checkpoint} (torch.distributed.checkpoint; resumes on any rank count; "
                  "k3 eval / sample / export read it as it is)")
            if result.interrupted:
                print(interruption_message(result, trainer.tc.steps, args.out), file=sys.stderr, flush=True)
    finally:
        dist.destroy_process_group()
    return 130 if result.interrupted else 0


def stage_param_counts(model, ranges: list[range]) -> list[tuple[int, int]]:
    """(routed-expert, other) parameters each pipeline stage holds, as `prune_to_stage` splits the model: its layers,
    the embedding on the first stage, the final norm and head on the last, the AttnRes parameters on every one."""
    from k3.model.accounting import component_of

    stage_of = {i: k for k, r in enumerate(ranges) for i in r}
    out = [[0, 0] for _ in ranges]
    for name, p in model.named_parameters():
        top = name.split(".")[0]
        if top == "layers":
            held = [stage_of[int(name.split(".")[1])]]
        elif top == "embed":
            held = [0]
        elif top in ("norm", "head"):
            held = [len(ranges) - 1]
        else:  # attnres: every stage
            held = range(len(ranges))
        routed = component_of(model, name) == "moe_routed"
        for k in held:
            out[k][0 if routed else 1] += p.numel()
    return [tuple(x) for x in out]


def cmd_mesh(args: argparse.Namespace) -> int:
    """Print the layout of `--nproc` ranks: groups, experts per rank, parameters per rank."""
    from k3.model.accounting import a2a_bytes_per_token, build_meta, format_count, pipeline_sources
    from k3.model.cli import config_from_args
    from k3.parallel.pipeline import stage_layers
    from k3.parallel.placement import contiguous_placement
    from k3.config import divisors

    dims = _dims(args.nproc, args)
    config = config_from_args(args)
    moe = config.n_dense_layers < config.n_layers
    if moe and config.n_experts % dims.ep:
        fits = [e for e in divisors(config.n_experts) if dims.dp % e == 0]  # both conditions: advice that works
        raise ValueError(f"n_experts = {config.n_experts} is not divisible by --ep {dims.ep}: k3 mesh shows the "
                         f"contiguous expert layout, so pick an --ep that divides it and the {dims.dp} data-parallel ranks ({', '.join(map(str, fits))}); "
                         "`k3 train --ep-redundant N` can place a remainder")
    ranges = stage_layers(config.n_layers, dims.pp)  # a --pp that cannot split the layers fails here
    starts = [r.start for r in ranges[1:]]
    model = build_meta(config)
    stages = stage_param_counts(model, ranges)
    if moe:
        contiguous_placement(config.n_experts, dims.ep)
    full = max(range(dims.pp), key=lambda i: stages[i][0] / dims.ep + stages[i][1] / dims.fsdp_size)
    routed, other = stages[full]
    where = f" on the fullest pipeline stage ({full})" if dims.pp > 1 else ""
    lines = [dims.describe(),
             f"{config.name}: {config.n_experts} experts -> {config.n_experts // dims.ep} per EP rank; routed expert "
             f"params per rank {format_count(routed / dims.ep, '.3g')}, other params per rank "
             f"{format_count(other / dims.fsdp_size, '.3g')} (FSDP shard){where}"]
    if dims.pp > 1:
        lines.append("per stage (routed / other, before EP and FSDP): " + ", ".join(
            f"{i}: {format_count(r, '.3g')} / {format_count(o, '.3g')}" for i, (r, o) in enumerate(stages)))
    lines.append(f"all-to-all payload per token per MoE layer (forward, bf16): {a2a_bytes_per_token(config):,.0f} bytes"
                 if dims.ep > 1 else "all-to-all: none (--ep 1: every rank holds all of its stage's experts)")
    if dims.pp > 1:
        lines.append("AttnRes sources crossing each stage boundary: " +
                     ", ".join(f"layer {s}: {pipeline_sources(model, s)}" for s in starts))
    print("\n".join(lines))  # all checked and computed first: an error leaves no partial layout on stdout
    return 0


def register(sub) -> None:
    from k3.model.cli import add_config_args

    p = sub.add_parser("mesh", help="show how N ranks split into pipeline / FSDP / expert-parallel groups")
    add_config_args(p, default="k3")
    add_parallel_args(p, mesh=True)
    p.set_defaults(func=cmd_mesh)

    train = sub.choices["train"]  # registered by k3.train.cli, an earlier part
    add_parallel_args(train)
    train.set_defaults(func=cmd_train)
