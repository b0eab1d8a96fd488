"""`k3 ablate`: matched small-scale ablations of the K3 design choices, cached and resumable."""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from k3.fileio import loads_json

DEFAULT_DATA = "runs/data"


def parse_sets(items: list[str]) -> dict:
    """['attnres=full', 'n_experts=16'] -> {'attnres': 'full', 'n_experts': 16}; unknown fields are an error."""
    from k3.config import K3Config, K3ConfigError

    fields = K3Config.__dataclass_fields__
    out = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or key not in fields:
            raise K3ConfigError(f"--set {item!r}: expected FIELD=VALUE with FIELD one of {sorted(fields)}")
        try:
            out[key] = loads_json(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def _scale(args):
    from k3.ablate.suites import SCALES

    scale = SCALES["quick" if args.quick else "full"]
    if args.steps is not None:
        if args.steps < 1:
            raise ValueError(f"--steps {args.steps} must be >= 1")
        scale = scale.replace(steps=args.steps)
    if args.seeds is not None:
        if args.seeds < 1:
            raise ValueError(f"--seeds {args.seeds} must be >= 1 (3 or more for a mean ± std and a verdict)")
        scale = scale.replace(seeds=tuple(range(args.seeds)))
    return scale


def cmd_list(scale, names, user_set) -> int:
    from k3.ablate.runner import qat_status
    from k3.ablate.suites import PROBE, PROBE_CLAIMS, build_groups
    from k3.model.accounting import build_meta, count_params

    base = scale.base_config(user_set)
    groups = build_groups(base, names, user_set)  # a bad combination fails before anything is printed
    c = count_params(build_meta(base))
    lines = [f"base: {base.name} {base.pattern}, d_model {base.d_model}, {c['total']:,} params "
             f"({c['active']:,} active); {scale.steps} steps x {scale.batch_size} x {scale.seq_len} tokens, "
             f"seeds {list(scale.seeds)}"]
    for g in groups:
        lines.append(f"\n{g.name}: {g.title}  (baseline {g.baseline})")
        for v in g.variants:
            cfg = base.replace(**v.overrides)
            extra = f"PTQ of {v.ptq_of}, " if v.ptq_of else ""
            lines.append(f"  {v.label:<16} {extra}{v.overrides or '(base config)'}  "
                         f"active params {count_params(build_meta(cfg))['active']:,}")
        for cl in g.claims:
            lines.append(f"  claim {cl.id}: {cl.text} [{cl.source}]")
        if g.name == "precision" and (why := qat_status(base)):
            lines.append(f"  skipped now: {why}")
    if PROBE in names:
        p = scale.probe
        lines.append(f"\nprobe: needle retrieval, {p.n_keys} needles, train length {p.train_len}, eval lengths "
                     f"{list(p.eval_lengths)}, {p.steps} steps x {p.batch_size}")
        for cl in PROBE_CLAIMS:
            lines.append(f"  claim {cl.id}: {cl.text} [{cl.source}]")
    print("\n".join(lines))  # all of it computed first: an error leaves no partial listing on stdout
    return 0


ABLATE_FILES = {"results.json", "results.md", "runs", "plots"}  # what `k3 ablate` writes into --out


def _check_out(out: Path) -> None:
    """--out is new, empty or an earlier `k3 ablate` output, before any data work: a file failed only after the data
    was built, and another tool's folder (a teacher matrix, a training run) got results and runs written into it."""
    from k3.cli_checks import output_dir

    output_dir("--out", out)
    if out.is_dir():
        names = {p.name for p in out.iterdir() if not p.name.startswith(".")}
        if names and not names & ABLATE_FILES:
            shown = ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
            raise ValueError(f"--out {out} holds files k3 ablate did not write ({shown}); give a new or empty "
                             "directory, or the --out of an earlier k3 ablate")


def cmd_ablate(args: argparse.Namespace) -> int:
    from k3.ablate.report import write_report
    from k3.ablate.runner import auto_jobs, data_fingerprint, plan_runs, run_plan
    from k3.ablate.suites import PROBE, build_groups, select

    only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only is not None else None
    if only == []:
        raise ValueError(f"--only {args.only!r} names no ablation; give a comma-separated subset of the suite, "
                         "or drop --only to run all of it")
    names = select(args.suite, only)
    user_set = parse_sets(args.set)
    scale = _scale(args)
    if args.list:
        return cmd_list(scale, names, user_set)
    base = scale.base_config(user_set)
    build_groups(base, names, user_set)  # bad combinations fail before any data work
    if any(n != PROBE for n in names) and scale.seq_len > base.max_context:
        raise ValueError(f"the {scale.name} suite trains on sequences of {scale.seq_len} tokens, more than max_context "
                         f"= {base.max_context}; raise max_context in --set to at least {scale.seq_len} or drop it")
    _check_out(Path(args.out or ("runs/ablate-quick" if args.quick else "runs/ablate")))
    if args.jobs is not None and args.jobs < 0:
        raise ValueError(f"--jobs {args.jobs} must be >= 0 (0 = the cores the load average leaves free)")
    import torch

    torch.set_num_threads(1)  # one thread per run; parallelism comes from --jobs
    if not getattr(args, "verbose", False):
        import logging

        logging.getLogger("k3.train").setLevel(logging.WARNING)  # one line per checkpoint would bury the bar
    jobs = args.jobs or auto_jobs()
    out = Path(args.out or ("runs/ablate-quick" if args.quick else "runs/ablate"))
    t0 = time.perf_counter()
    data_fp, data_dir = {}, None
    if any(n != PROBE for n in names):
        from k3.data import DEFAULT_VOCAB_SIZE, prepare_data

        base = scale.base_config(user_set)
        # another vocabulary gets a directory of its own: rebuilding --data in place would replace the data
        # (and strand the checkpoints) of everything else that reads it (k3 demo, the benchmarks)
        data = args.data if base.vocab_size == DEFAULT_VOCAB_SIZE else f"{Path(args.data)}-v{base.vocab_size}"
        files = prepare_data(data, vocab_size=base.vocab_size, progress=not args.quiet and sys.stderr.isatty(),
                             replace=False)
        data_fp, data_dir = data_fingerprint(files), str(Path(data).resolve())
    plan = plan_runs(scale, names, data_fp, user_set)
    for g, why in plan.skipped.items():
        print(f"k3 ablate: skipping {g}: {why}", file=sys.stderr)
    n_runs = len(plan.unique_specs())
    print(f"k3 ablate: suite {args.suite} ({scale.name} scale): {', '.join(names)}; {n_runs} distinct runs, "
          f"{len(scale.seeds)} seeds, {jobs} job(s); cache in {out / 'runs'}", file=sys.stderr)
    if user_set and PROBE in names:
        print("k3 ablate: --set changes the LM runs' base config; the probe builds its own small models and "
              "ignores it", file=sys.stderr)
    failures: dict[str, dict] = {}
    results = run_plan(plan, out, data_dir, jobs=jobs, progress=not args.quiet, desc=f"ablate {scale.name}",
                       failures=failures)
    wall = time.perf_counter() - t0

    from k3.ablate.report import aggregate, format_ci, json_safe

    summary = aggregate(plan, results)
    summary["failed"] = sorted(failures.values(), key=lambda f: f["run"])
    executed = [r["seconds"] for r in results.values()]
    summary["meta"] = {
        "suite": args.suite, "scale": scale.name, "ablations": names, "seeds": list(scale.seeds),
        "base_config": scale.base_config(user_set).to_dict(), "user_set": user_set,
        "train": {k: v for k, v in scale.train_settings(0).items() if k != "seed"},
        "probe": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(scale.probe).items()},
        "data": data_fp, "jobs": jobs, "wall_s": round(wall, 1), "run_seconds_sum": round(sum(executed), 1),
        "runs": n_runs, "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                                    "torch": torch.__version__,
                                    "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    import shlex
    asked = [f"--suite {args.suite}"] + (["--quick"] if args.quick else []) + \
        [f"--{k} {shlex.quote(str(getattr(args, k)))}" for k in ("only", "seeds", "steps")
         if getattr(args, k) is not None] + [f"--set {shlex.quote(x)}" for x in args.set] + \
        ([f"--data {shlex.quote(str(args.data))}"] if str(args.data) != DEFAULT_DATA else [])  # what shapes results
    header = (f"## k3 ablate {' '.join(asked)}\n\n"
              f"{n_runs} runs, seeds {list(scale.seeds)}, {jobs} job(s), {wall / 60:.1f} min wall "
              f"({sum(executed) / 60:.1f} min of run time, cached runs included), {summary['meta']['date']}.\n")
    paths = write_report(summary, out, header)
    if args.json:
        print(json.dumps(json_safe(summary), indent=2, default=str))
    else:
        for name, g in {**summary["groups"], **({PROBE: summary["probe"]} if "probe" in summary else {})}.items():
            if "skipped" in g:
                print(f"{name:<10} skipped: {g['skipped']}")
                continue
            for c in g["claims"]:
                print(f"{name:<10} {c['verdict']:<13} {c['id']}  ({c['a']} - {c['b']} {c['metric']}: "
                      f"{format_ci(c['diff_mean'], c['ci95'])})")
        print(f"results   {paths['markdown']}  {paths['json']}")
        print(f"plots     {'  '.join(str(p) for p in paths['plots'])}")
        print(f"time      {wall / 60:.1f} min wall, {len(results)} runs")
    if failures:
        print(f"k3 ablate: {len(failures)} run(s) failed; the report treats their seeds as missing, and the same "
              "command retries them (finished runs stay cached):", file=sys.stderr)
        for f in summary["failed"]:
            print(f"  {f['run']}: {f['error']}", file=sys.stderr)
        return 1
    return 0


def register(sub) -> None:
    from k3.ablate.suites import ALL_ABLATIONS, SUITES

    p = sub.add_parser(
        "ablate", help="matched small-scale ablations of K3's design choices (cached, resumable)",
        description="Train matched variants (same data, tokens and seeds) of a mini-shaped K3 model for each "
                    "design choice, run the long-context probe, and write OUT/results.md, OUT/results.json and "
                    "OUT/plots/*.png with a verdict per claim. Finished runs are cached under OUT/runs/ and an "
                    "interrupted suite resumes where it stopped.")
    p.add_argument("--suite", default="core", help=f"suite to run (valid: {', '.join(SUITES)}; default core)")
    p.add_argument("--only", default=None, metavar="A,B",
                   help=f"comma-separated subset of the suite (valid: {', '.join(ALL_ABLATIONS)})")
    p.add_argument("--quick", action="store_true", help="a reduced suite (tiny model, 2 seeds): a smoke test")
    p.add_argument("--seeds", type=int, default=None, help="seeds per variant (default 3; 2 with --quick)")
    p.add_argument("--steps", type=int, default=None,
                   help="training steps per LM run (default 300; 30 with --quick); the probe keeps its own")
    p.add_argument("--jobs", type=int, default=0,
                   help="runs in parallel, one CPU thread each (default 0: the cores the load average leaves free)")
    p.add_argument("--set", metavar="FIELD=VALUE", action="append", default=[],
                   help="override a field of the base config (not one an ablation varies), e.g. --set mla_heads=4")
    p.add_argument("--data", default=DEFAULT_DATA,
                   help=f"tokenized data, made if missing (default {DEFAULT_DATA}; with --set vocab_size=N other than "
                        "the default, DATA-vN)")
    p.add_argument("--out", default=None, help="output directory (default runs/ablate, runs/ablate-quick)")
    p.add_argument("--list", action="store_true", help="print the ablations, variants and claims, run nothing")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_ablate)
