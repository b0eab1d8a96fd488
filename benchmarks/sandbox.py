"""Sandbox cost: bwrap start+teardown and verified episodes vs the same programs as plain subprocesses.

    python benchmarks/sandbox.py [--json] [--repeats 15] [--episodes 16] [--quick]

Measures, in one process run, interleaving sandboxed and plain runs so machine load hits both alike:
  start_teardown_ms      bwrap running /usr/bin/true vs plain /usr/bin/true (median)
  session_ms             episode sandbox start (executor up, workspace copied) + close, vs plain
  episode_ms             one verified episode (reference solution of pyfix-median, react dialect:
                         executor sandbox + 5 actions + export + fresh verification sandbox), vs plain
  overhead_ms_per_episode  episode_ms.bwrap - episode_ms.plain (target <= 50 ms); the verification
                         sandbox is started while the episode runs (the default); the `_cold_verifier`
                         keys give the same measurement without that
  episodes_per_s         verified episodes per second with 2 worker processes, sandboxed and plain
Writes runs/bench/sandbox.json atomically (--quick: runs/bench/quick/sandbox.json).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from k3.agentenv.policies import make_policy
from k3.agentenv.rollout import EpisodeConfig, run_episode, run_rollouts
from k3.agentenv.sandbox import Session, _popen_kwargs, bwrap_argv, check_sandbox, default_config
from k3.agentenv.tasks import load_task, load_tasks, tasks_root
from k3.benchtools import bench_out, positive_int
from k3.fileio import atomic_write_text

TARGET_MS = 50.0


def _median_ms(samples):
    return round(statistics.median(samples) * 1000, 2)


def _time(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench(repeats: int, episodes: int) -> dict:
    box, plain = default_config(), default_config(isolation="none")
    check_sandbox(box)
    task = load_task(tasks_root() / "pyfix-median")
    files = task.workspace_files()
    true_box = lambda: subprocess.run(bwrap_argv(box, ["/usr/bin/true"]), check=True, **_popen_kwargs(box))
    true_plain = lambda: subprocess.run(["/usr/bin/true"], check=True)

    def session(cfg):
        s = Session(files, cfg)
        s.close()

    ecfg = {(c.isolation, pre): EpisodeConfig(dialects=("react",), augment=False, sandbox=c,
                                              prestart_verifier=pre)
            for c in (box, plain) for pre in (True, False)}

    def episode(cfg, prestart=True):
        rec = run_episode(task, make_policy({"kind": "reference"}, task), 0, ecfg[(cfg.isolation, prestart)])
        if rec["reward"] != 1.0:
            raise RuntimeError(f"benchmark episode failed: {rec['status']} {rec['error']}")

    for fn in (true_box, true_plain, lambda: session(box), lambda: session(plain),
               lambda: episode(box), lambda: episode(plain)):  # warm caches
        fn()
    raw = {k: [] for k in ("true_box", "true_plain", "sess_box", "sess_plain", "ep_box", "ep_plain",
                           "cold_box", "cold_plain")}
    for _ in range(repeats):
        raw["true_box"].append(_time(true_box))
        raw["true_plain"].append(_time(true_plain))
        raw["sess_box"].append(_time(lambda: session(box)))
        raw["sess_plain"].append(_time(lambda: session(plain)))
        raw["ep_box"].append(_time(lambda: episode(box)))
        raw["ep_plain"].append(_time(lambda: episode(plain)))
        raw["cold_box"].append(_time(lambda: episode(box, prestart=False)))
        raw["cold_plain"].append(_time(lambda: episode(plain, prestart=False)))

    tasks = load_tasks("pyfix-median,sqlite-archive-old,files-unique-sorted,files-organize")
    eps = {}
    for name, cfg in (("bwrap", box), ("plain", plain)):
        t = time.perf_counter()
        recs = run_rollouts(tasks, {"kind": "reference"}, episodes, workers=2,
                            config=EpisodeConfig(sandbox=cfg))
        dt = time.perf_counter() - t
        if any(r["reward"] != 1.0 for r in recs):
            raise RuntimeError(f"{name} rollout had failed episodes")
        eps[name] = round(episodes / dt, 2)

    ep_box, ep_plain = _median_ms(raw["ep_box"]), _median_ms(raw["ep_plain"])
    overhead = round(ep_box - ep_plain, 2)
    try:
        bwrap_version = subprocess.run([box.bwrap, "--version"], capture_output=True, text=True).stdout.strip()
    except OSError:
        bwrap_version = None
    try:
        from importlib.metadata import version
        torch_version = version("torch")
    except Exception:
        torch_version = None
    return {
        "benchmark": "sandbox",
        "start_teardown_ms": {"bwrap": _median_ms(raw["true_box"]), "plain": _median_ms(raw["true_plain"])},
        "session_ms": {"bwrap": _median_ms(raw["sess_box"]), "plain": _median_ms(raw["sess_plain"])},
        "episode_ms": {"bwrap": ep_box, "plain": ep_plain},
        "overhead_ms_per_episode": overhead,
        # the same without starting the verification sandbox during the episode
        "episode_ms_cold_verifier": {"bwrap": _median_ms(raw["cold_box"]),
                                     "plain": _median_ms(raw["cold_plain"])},
        "overhead_ms_per_episode_cold_verifier": round(_median_ms(raw["cold_box"])
                                                       - _median_ms(raw["cold_plain"]), 2),
        "target_ms": TARGET_MS,
        "meets_target": overhead <= TARGET_MS,
        "episodes_per_s": {"bwrap": eps["bwrap"], "plain": eps["plain"], "workers": 2,
                           "episodes": episodes},
        "repeats": repeats,
        "episode": {"task": task.id, "dialect": "react", "actions": len(task.solution),
                    "sandboxes_per_episode": 2},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
                    "python": platform.python_version(), "sandbox_python": box.python,
                    "bwrap": bwrap_version, "torch": torch_version},
        "limits": box.limits.__dict__,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--repeats", type=positive_int, default=15)
    ap.add_argument("--episodes", type=positive_int, default=16)
    ap.add_argument("--quick", action="store_true", help="3 repeats, 4 episodes; writes runs/bench/quick/sandbox.json")
    ap.add_argument("--out", default=None, help="output JSON (default runs/bench/sandbox.json, or quick/ with --quick)")
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = bench_out("sandbox", args.quick)
    res = bench(3, 4) if args.quick else bench(args.repeats, args.episodes)
    atomic_write_text(Path(args.out), json.dumps(res, indent=1) + "\n")
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        print(f"start+teardown  bwrap {res['start_teardown_ms']['bwrap']} ms   plain {res['start_teardown_ms']['plain']} ms")
        print(f"session         bwrap {res['session_ms']['bwrap']} ms   plain {res['session_ms']['plain']} ms")
        print(f"episode         bwrap {res['episode_ms']['bwrap']} ms   plain {res['episode_ms']['plain']} ms")
        print(f"overhead/episode {res['overhead_ms_per_episode']} ms (target <= {TARGET_MS}); "
              f"cold verifier {res['overhead_ms_per_episode_cold_verifier']} ms")
        print(f"episodes/s (2 workers)  bwrap {res['episodes_per_s']['bwrap']}  plain {res['episodes_per_s']['plain']}")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
