"""`k3 agentenv ...`: tasks, sandbox check, rollouts, red team."""
from __future__ import annotations

import json
import os
import sys

from k3.cli_checks import output_jsonl, seed as seed_type


def register(subparsers) -> None:
    p = subparsers.add_parser("agentenv", help="agent environments: tasks, sandbox, rollouts, red team",
                              description=__doc__)
    sub = p.add_subparsers(dest="agentenv_command", metavar="SUBCOMMAND")
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])

    t = sub.add_parser("tasks", help="list, verify or rebuild the shipped tasks")
    t.add_argument("--select", default="all", help="'all', a family, task ids or globs, comma-separated")
    t.add_argument("--dir", default=None, help="task directory (default: the shipped tasks)")
    t.add_argument("--verify", action="store_true",
                   help="check in the sandbox that each task scores 0 untouched and 1 with its reference solution")
    t.add_argument("--rebuild", action="store_true",
                   help="regenerate the task directories from taskgen.py (a same-named directory is replaced only "
                        "if a rebuild wrote it and it holds nothing else)")
    t.add_argument("--force", action="store_true",
                   help="with --rebuild: replace same-named task directories even if they hold other files")
    t.add_argument("--workers", type=int, default=2)
    t.add_argument("--json", action="store_true")
    t.set_defaults(func=_tasks)

    c = sub.add_parser("check", help="check that the bubblewrap sandbox works here")
    c.set_defaults(func=_check)

    r = sub.add_parser("run", help="run episodes of a policy and write trajectories as JSONL")
    r.add_argument("--tasks", default="all", help="'all', a family, task ids or globs, comma-separated")
    r.add_argument("--policy", default="reference", choices=["reference", "noop", "http", "k3"])
    r.add_argument("--ckpt", default=None, help="checkpoint directory or root (k3 policy)")
    r.add_argument("--tokenizer", default=None, help="tokenizer.json (k3 policy; default: the one the checkpoint names)")
    r.add_argument("--max-tokens", type=int, default=None,
                   help="longest reply per turn (default 256 for the k3 policy, 2048 for http)")
    r.add_argument("--base-url", default=None, help="OpenAI-compatible base URL (http policy)")
    r.add_argument("--model", default=None, help="model name (http policy)")
    r.add_argument("--api-key-env", default=None,
                   help="environment variable holding the API key (http policy; default OPENAI_API_KEY)")
    r.add_argument("--temperature", type=float, default=None, help="sampling temperature (http and k3 policies; "
                                                                 "default 0, greedy)")
    r.add_argument("--episodes", type=int, default=None, help="episodes in all (default: one per task)")
    r.add_argument("--workers", type=int, default=2, help="parallel episodes (local processes or Ray CPUs)")
    r.add_argument("--backend", choices=["process", "ray"], default="process",
                   help="local process pool, or Ray tasks (a local instance, or --ray-address)")
    r.add_argument("--ray-address", default=None, help="address of a running Ray cluster (backend ray)")
    r.add_argument("--seed", type=seed_type, default=0)
    r.add_argument("--dialects", default=None, help="comma-separated subset of kimi,claude,codex,react")
    r.add_argument("--no-augment", action="store_true", help="canonical tool names only")
    r.add_argument("--max-steps", type=int, default=None)
    r.add_argument("--out", default="runs/agentenv/rollouts.jsonl",
                   help="trajectories as JSON lines, one appended (and synced) per finished episode")
    r.add_argument("--resume", action="store_true",
                   help="continue the run that wrote --out (killed or stopped): its finished episodes are kept, "
                        "only the others run; the other flags must be the same")
    r.add_argument("--json", action="store_true", help="print the summary as JSON")
    r.set_defaults(func=_run)

    rt = sub.add_parser("redteam", help="run the reward-hacking and escape attempts")
    rt.add_argument("--json", action="store_true", help="print the full report as JSON")
    rt.add_argument("--quick", action="store_true", help="only the representative subset")
    rt.add_argument("--only", default=None, help="comma-separated attack names")
    rt.add_argument("--list", action="store_true",
                    help="list the attacks (those --quick/--only select; as JSON with --json) and exit")
    rt.set_defaults(func=_redteam)


def _tasks(args) -> int:
    from .tasks import load_tasks, tasks_root
    if args.force and not args.rebuild:
        raise ValueError("--force only applies to --rebuild; drop it, or add --rebuild")
    if args.rebuild:
        from .taskgen import build_all
        out = args.dir or str(tasks_root())
        paths = build_all(out, force=args.force)
        # with --json, stdout holds only the JSON
        print(f"wrote {len(paths)} tasks to {out}", file=sys.stderr if args.json else sys.stdout)
    tasks = load_tasks(args.select, args.dir)
    rows = [{"id": t.id, "family": t.family, "checks": len(t.checks), "checksum": t.checksum[:12],
             "title": t.title} for t in tasks]
    if args.verify:
        from .rollout import run_rollouts
        from .sandbox import check_sandbox
        check_sandbox()
        noop = run_rollouts(tasks, {"kind": "noop"}, len(tasks), workers=args.workers, progress=True)
        ref = run_rollouts(tasks, {"kind": "reference"}, len(tasks), workers=args.workers, progress=True)
        for row, n, r in zip(rows, noop, ref):
            row["untouched"], row["reference"] = n["reward"], r["reward"]
            row["ok"] = n["reward"] == 0.0 and r["reward"] == 1.0
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for row in rows:
            extra = (f"  untouched={row['untouched']:.0f} reference={row['reference']:.0f} "
                     f"{'ok' if row['ok'] else 'FAIL'}") if args.verify else ""
            print(f"{row['id']:28s} {row['family']:7s} {row['checks']:3d} checks  {row['checksum']}{extra}")
        fams = {}
        for row in rows:
            fams[row["family"]] = fams.get(row["family"], 0) + 1
        print(f"{len(rows)} tasks: " + ", ".join(f"{k} {v}" for k, v in sorted(fams.items())))
    return 0 if all(r.get("ok", True) for r in rows) else 1


def _check(args) -> int:
    from .sandbox import check_sandbox
    print(check_sandbox())
    return 0


# (flag, its value (None when not given), the policies that use it)
_POLICY_FLAGS = [("--ckpt", lambda a: a.ckpt, ("k3",)), ("--tokenizer", lambda a: a.tokenizer, ("k3",)),
                 ("--base-url", lambda a: a.base_url, ("http",)), ("--model", lambda a: a.model, ("http",)),
                 ("--api-key-env", lambda a: a.api_key_env, ("http",)),
                 ("--temperature", lambda a: a.temperature, ("http", "k3")),
                 ("--max-tokens", lambda a: a.max_tokens, ("http", "k3"))]


def _run(args) -> int:
    from .dialects import DIALECTS
    from .policies import check_base_url, check_temperature
    from .rollout import EpisodeConfig, format_summary, run_rollouts, summarize
    from .sandbox import check_sandbox
    from .tasks import load_tasks
    unused = [flag for flag, value, users in _POLICY_FLAGS if value(args) is not None and args.policy not in users]
    if unused:
        raise ValueError(f"--policy {args.policy} does not use {', '.join(unused)}; drop "
                         f"{'it' if len(unused) == 1 else 'them'} (or pick the policy that does)")
    if args.ray_address is not None and args.backend != "ray":  # it ran the episodes locally, saying nothing
        raise ValueError(f"--ray-address is for --backend ray (this run's backend is {args.backend}); add "
                         "--backend ray, or drop --ray-address")
    temperature = 0.0 if args.temperature is None else args.temperature
    check_temperature(temperature, "--temperature", hi=1e4 if args.policy == "k3" else None)  # k3's sampler's limit
    if not args.resume:  # a resumed file is checked record by record (its last line may be cut short)
        output_jsonl("--out", args.out, "rollouts.jsonl")
    tasks = load_tasks(args.tasks)
    spec = {"kind": args.policy}
    if args.policy == "http":
        spec.update(base_url=args.base_url, model=args.model, temperature=temperature,
                    api_key=os.environ.get(args.api_key_env or "OPENAI_API_KEY"), max_tokens=args.max_tokens or 2048)
        if not args.base_url or not args.model:
            raise ValueError("--policy http needs --base-url and --model")
        check_base_url(args.base_url, "--base-url")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError(f"--max-tokens {args.max_tokens} must be >= 1")
    dialects = tuple(d.strip() for d in args.dialects.split(",")) if args.dialects else DIALECTS
    for d in dialects:
        if d not in DIALECTS:
            raise ValueError(f"unknown dialect {d!r}; choose from {', '.join(DIALECTS)}")
    if args.policy == "k3":
        if not args.ckpt:
            raise ValueError("--policy k3 needs --ckpt (a checkpoint directory or root)")
        from .policies import _load_k3
        model, _ = _load_k3(str(args.ckpt), None if args.tokenizer is None else str(args.tokenizer))  # fails here,
        ctx = model.config.max_context                                                             # not per episode
        if args.max_tokens is not None and args.max_tokens >= ctx:  # no prompt would leave room for the reply
            raise ValueError(f"--max-tokens {args.max_tokens} does not fit the model's context of {ctx} tokens with "
                             f"any prompt; give a value well below {ctx}")
        spec.update(ckpt=args.ckpt, tokenizer=args.tokenizer, temperature=temperature,
                    max_tokens=args.max_tokens or 256, seed=args.seed)
    if args.policy == "http":
        from .policies import OpenAIChatPolicy, PolicyError
        try:  # an unreachable server or another model fails here, not once per episode
            OpenAIChatPolicy(args.base_url, args.model, api_key=spec["api_key"]).check_endpoint()
        except PolicyError as e:
            raise ValueError(str(e)) from None
    check_sandbox()
    cfg = EpisodeConfig(dialects=dialects, augment=not args.no_augment, max_steps=args.max_steps)
    records = run_rollouts(tasks, spec, len(tasks) if args.episodes is None else args.episodes, workers=args.workers,
                           seed=args.seed, out=args.out, config=cfg, progress=True, backend=args.backend,
                           ray_address=args.ray_address, resume=args.resume)
    summary = summarize(records)
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(format_summary(summary))
        print(f"trajectories: {args.out}")
        n_ex = summary["all:all"]["excluded"]
        print(f"excluded: {n_ex} of {len(records)} episodes ({summary['all:all']['exclusion_rate']:.1%}) measured "
              "nothing (a failure the agent cannot cause); every other reward counts, errors as 0")
    for line in error_report(records):
        print(line, file=sys.stderr)
    if records and all(r.get("status") in ERROR_STATUSES for r in records):
        print("every episode ended in a policy, sandbox or worker error: nothing was measured", file=sys.stderr)
        return 1
    return 0


ERROR_STATUSES = ("policy_error", "sandbox_error", "harness_error", "worker_error")  # episodes that ended in an error


def error_report(records: list[dict], limit: int = 3) -> list[str]:
    """Why episodes ended in an error status (ERROR_STATUSES): each distinct message once, with its count.

    The summary table counts them; without this the reason is only in the trajectories file.
    """
    counts: dict[tuple[str, str], int] = {}
    for r in records:
        if r.get("status") in ERROR_STATUSES:
            key = (r["status"], str(r.get("error") or "no message recorded")[:400])
            counts[key] = counts.get(key, 0) + 1
    lines = [f"{status} in {n} episode{'s' if n > 1 else ''}: {msg}"
             for (status, msg), n in sorted(counts.items(), key=lambda kv: -kv[1])[:limit]]
    if len(counts) > limit:
        lines.append(f"... and {len(counts) - limit} other error messages (see the trajectories file)")
    return lines


def _redteam(args) -> int:
    from .redteam import ATTACKS, run_redteam
    names = [n.strip() for n in args.only.split(",") if n.strip()] if args.only is not None else None
    if names == []:
        raise ValueError(f"--only {args.only!r} names no attack; pass attack names (see `k3 agentenv redteam --list`)")
    if args.list:  # the attacks that the same flags would run
        unknown = sorted(set(names or ()) - {a.name for a in ATTACKS})
        if unknown:
            raise ValueError(f"unknown attack(s) {unknown}; see `k3 agentenv redteam --list`")
        attacks = [a for a in ATTACKS if (not names or a.name in names) and (not args.quick or a.quick)]
        if args.json:
            print(json.dumps([{"name": a.name, "category": a.category, "task": a.task, "quick": a.quick,
                               "note": a.note} for a in attacks], indent=1))
            return 0
        for a in attacks:
            print(f"{a.name:34s} {a.category:12s} {a.task:20s}{' quick' if a.quick else ''}")
        return 0
    report = run_redteam(names=names, quick=args.quick, progress=not args.json)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for r in report["results"]:
            print(f"{r['name']:34s} {r['task']:20s} reward={r['reward']} {r.get('scoring')} "
                  f"host_changed={r['host_changed']} leaked={r['leaked']}  {str(r.get('details'))[:90]}")
        for h in report["honest"]["results"]:
            print(f"honest {h['task']:27s} reward={h['reward']}")
        print(json.dumps({k: report[k] for k in ("attempts", "rewarded", "excluded", "host_changed", "leaked",
                                                  "ok")}))
    return 0 if report["ok"] else 1
