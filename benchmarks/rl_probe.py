"""What a tiny k3 model learns from scratch in a few hundred CPU steps: two probes, per layer pattern.

    python benchmarks/rl_probe.py [--json] [--quick] [--patterns KKKM,MKKK,MMMM]

The agentic RL family (docs/rl.md) needs a policy that conditions its reply on a word of the instruction
(which command the task asks for) and, for harder families, copies a string from its context (a tool name,
a number). Each probe trains `tiny` (vocabulary 64, fp32, one thread, AdamW 3e-3, batch 8) on synthetic
sequences, with the loss only on the answer tokens, and reports the mean answer loss over the last 50
steps against chance:

- `condition`: a class marker (1 of 3) 20 random tokens before a query token; the answer is a token that
  depends on the class. Chance: ln 3.
- `copy`: four random digits after marker A, six random tokens, marker B; the answer is the four digits
  again. Chance: ln 10 per digit.

All patterns see the same batches (one generator seed) in one run. Writes runs/bench/rl_probe.json
(--quick: runs/bench/quick/rl_probe.json, which never reaches the table).
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time

import torch
import torch.nn.functional as F

from k3.benchtools import bench_out
from k3.config import get_config
from k3.fileio import atomic_write_json
from k3.model.transformer import K3Model


def condition_batch(g: torch.Generator, B: int = 8, gap: int = 20):
    k = torch.randint(0, 3, (B, 1), generator=g)
    x = torch.cat([torch.randint(20, 64, (B, 5), generator=g), 4 + k, torch.randint(20, 64, (B, gap), generator=g),
                   torch.full((B, 1), 2), 10 + k], 1)
    mask = torch.zeros_like(x, dtype=torch.bool)
    mask[:, -1] = True
    return x, mask


def copy_batch(g: torch.Generator, B: int = 8, prefix: int = 20):
    d = torch.randint(4, 14, (B, 4), generator=g)
    x = torch.cat([torch.randint(20, 64, (B, prefix), generator=g), torch.full((B, 1), 1), d,
                   torch.randint(20, 64, (B, 6), generator=g), torch.full((B, 1), 2), d], 1)
    mask = torch.zeros_like(x, dtype=torch.bool)
    mask[:, -4:] = True
    return x, mask


PROBES = {"condition": (condition_batch, math.log(3)), "copy": (copy_batch, math.log(10))}


def train_probe(pattern: str, probe: str, steps: int, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = K3Model(get_config("tiny", vocab_size=64, layer_pattern=pattern))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    make, chance = PROBES[probe]
    g = torch.Generator().manual_seed(seed)
    losses = []
    t0 = time.perf_counter()
    for _ in range(steps):
        x, mask = make(g)
        lp = F.log_softmax(model(x)[:, :-1].float(), -1).gather(-1, x[:, 1:, None])[..., 0]
        loss = -(lp * mask[:, 1:]).sum() / mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    final = sum(losses[-50:]) / len(losses[-50:])
    return {"final_loss": round(final, 4), "chance": round(chance, 4), "over_chance": round(final / chance, 4),
            "steps": steps, "seconds": round(time.perf_counter() - t0, 1),
            "curve": [round(sum(losses[i:i + 50]) / len(losses[i:i + 50]), 4) for i in range(0, steps, 50)]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="100 steps per probe (a smoke run)")
    ap.add_argument("--patterns", default="KKKM,MKKK,MMMM")
    ap.add_argument("--condition-steps", type=int, default=300)
    ap.add_argument("--copy-steps", type=int, default=600)
    args = ap.parse_args()
    torch.set_num_threads(1)
    steps = {"condition": 100 if args.quick else args.condition_steps, "copy": 100 if args.quick else args.copy_steps}
    result = {"machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": 1},
              "settings": {"preset": "tiny", "vocab_size": 64, "batch": 8, "lr": 3e-3, "steps": steps},
              "patterns": {}}
    for pattern in [p.strip() for p in args.patterns.split(",") if p.strip()]:
        result["patterns"][pattern] = {probe: train_probe(pattern, probe, steps[probe]) for probe in PROBES}
        print(pattern, {k: v["over_chance"] for k, v in result["patterns"][pattern].items()}, file=sys.stderr)
    default = result["patterns"].get("KKKM")
    if default:
        result["tiny_default"] = {probe: default[probe]["over_chance"] for probe in PROBES}
    atomic_write_json(bench_out("rl_probe", args.quick), result)
    if args.json:
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
