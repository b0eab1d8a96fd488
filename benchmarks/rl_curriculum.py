"""Does the RL warm start learn to read the instruction when its first steps see short episodes?

    python benchmarks/rl_curriculum.py --root runs/rl/exp --sys none:400,full:200 --out runs/bench/rl_curriculum.json
    python benchmarks/rl_curriculum.py --root runs/rl/exp --sys full:600 --out runs/bench/rl_full_only.json

Trains `tiny` (MKKK) from scratch by SFT on the demonstrations of an experiment root (`k3 rl warmstart` writes
ROOT/demos.jsonl and ROOT/tokenizer.json), loss on the assistant's tokens only, AdamW lr 3e-3 (20 warmup
steps, then constant), grad clip 1, batch 8, one thread. `--sys` is a schedule of MODE:STEPS phases: `full` =
the episodes as recorded, `none` = the same episodes without their system prompt (about 150 tokens instead
of 500-1,200). Every `--every` steps it runs `k3.rl.train.command_choice` on 48 held-out demonstrations, in
each mode of the schedule: at the first token of the demonstrated command, the probability of each task
kind's command. `diag_<mode>` is the mean probability of the right command: 1/3 for a policy blind to the
instruction, 1 for one that reads it. Writes the records (with the full 3 x 3 tables) to --out, atomically,
after every evaluation.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from k3.data.tokenizer import load_tokenizer
from k3.distill.sft import PAD_ID, masked_ce
from k3.fileio import atomic_write_json
from k3.rl.demos import episode_tokens, pad_batch
from k3.rl.train import _seed, command_choice, new_model, without_system_prompt

MODES = ("full", "none")


def parse_schedule(spec: str) -> list[tuple[str, int]]:
    phases = []
    for part in spec.split(","):
        mode, _, n = part.partition(":")
        if mode not in MODES or not n.isdigit() or int(n) <= 0:
            raise SystemExit(f"--sys {spec!r}: give MODE:STEPS phases, MODE one of {MODES}, e.g. none:400,full:200")
        phases.append((mode, int(n)))
    return phases


def main() -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default="runs/rl/exp", help="experiment root with demos.jsonl and tokenizer.json")
    ap.add_argument("--sys", default="none:400,full:200", help="schedule of MODE:STEPS phases")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--pattern", default="MKKK")
    ap.add_argument("--out", default="runs/bench/rl_curriculum.json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    root = Path(a.root)
    for f in ("demos.jsonl", "tokenizer.json"):
        if not (root / f).is_file():
            raise SystemExit(f"{root / f} is missing; make it with `k3 rl warmstart --root {root}`")
    tok = load_tokenizer(root / "tokenizer.json")
    demos = [json.loads(line) for line in (root / "demos.jsonl").read_text().splitlines()][1:]
    phases = parse_schedule(a.sys)
    ends, total = [], 0
    for mode, n in phases:
        total += n
        ends.append((mode, total))

    def mode_at(step: int) -> str:
        return next(m for m, e in ends if step <= e)

    def edit(transcript, mode):
        return without_system_prompt(transcript) if mode == "none" else transcript

    modes = sorted({m for m, _ in phases})
    held = set(random.Random(0).sample(range(len(demos)), 48))
    train = {m: [episode_tokens(edit(d["transcript"], m), tok) for i, d in enumerate(demos) if i not in held]
             for m in modes}
    probe = {m: [dict(d, transcript=edit(d["transcript"], m)) for i, d in enumerate(demos) if i in held]
             for m in modes}
    model = new_model("tiny", tok, max_context=2048, layer_pattern=a.pattern)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    log, t0 = [], time.time()
    for step in range(1, total + 1):
        for group in opt.param_groups:
            group["lr"] = a.lr * min(1.0, step / 20)
        rng = random.Random(_seed("probe", step))
        pool = train[mode_at(step)]
        pick = [pool[rng.randrange(len(pool))] for _ in range(a.batch)]
        ids, mask = pad_batch([p[0] for p in pick], [p[1] for p in pick], PAD_ID)
        model.train()
        loss, _ = masked_ce(model(ids), ids, mask)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % a.every == 0 or step == total:
            rec = {"step": step, "mode": mode_at(step), "loss": float(loss.detach()), "s": round(time.time() - t0)}
            for m in modes:
                cc = command_choice(model, tok, probe[m])
                rec["diag_" + m] = sum(cc["p"][k][k] for k in cc["p"]) / len(cc["p"])
                rec["p_" + m] = cc["p"]
            log.append(rec)
            print(json.dumps({k: v for k, v in rec.items() if not k.startswith("p_")}), file=sys.stderr, flush=True)
            atomic_write_json(Path(a.out), {"benchmark": "rl_curriculum", "schedule": a.sys, "batch": a.batch,
                                            "lr": a.lr, "pattern": a.pattern, "records": log})
    return log


if __name__ == "__main__":
    main()
