"""Prefix caching on a multi-turn agent workload: time to first token and throughput, caching on vs off.

    python benchmarks/serve_prefix.py [--json] [--quick] [--preset mini] [--sessions 8] [--turns 6]
                                      [--system 4096] [--user 96] [--reply 32] [--block 256] [--threads 1]

The workload is what an agent harness or an RL rollout sends: `--sessions` sessions share a system prompt of
`--system` tokens; each runs `--turns` turns, and every turn resends the whole history (system prompt, earlier
messages and replies) plus a new message of `--user` tokens, then waits for a greedy reply of `--reply` tokens
before its next turn (a closed loop: the sessions start together and then drift apart). The engine
(k3.serve.engine, in process, no HTTP) runs `--sessions` requests at once, prefill chunk 512. The same
workload runs twice in one process, prefix cache off and then on (1 GiB budget, snapshots every `--block`
tokens); token ids are random and the model random-init `mini` with max_context raised to fit the history
(speed does not depend on the weights or the text). Reported per mode: time to first token (submit to first
token) p50/p99 over all requests, completion tokens/s and prompt tokens served/s over the wall time, prompt
tokens actually prefilled, and the prefix cache's counters; `ttft_p50_speedup` = off / on. The greedy
replies of the two runs are compared token for token (`replies_identical`).

The sessions run in step (they start together and their replies are equally long), so a turn's first token
also waits for the other sessions' prefills in the same engine step. `single` isolates one request: the second
turn of one session alone, its time to first token with its first turn cached and without.

A last, smaller measure is the forked prefill of n > 1 (`fork`): n = 8 completions of one prompt of
`--system` tokens, the engine's fork (one prefill) against 8 separate prefills, time to the last first token.
Writes runs/bench/serve_prefix.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from k3.benchtools import bench_out, machine, write_result
from k3.config import get_config
from k3.model.sampling import SamplingParams
from k3.model.transformer import K3Model
from k3.serve.engine import Engine

NO_EOS = -1  # no token ends a reply early: every reply is --reply tokens


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def workload(vocab: int, sessions: int, turns: int, system: int, user: int, seed: int = 0):
    """The system prompt and each session's user messages (random ids above the special tokens)."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(32, vocab, (n,), generator=g).tolist()  # noqa: E731
    return rand(system), [[rand(user) for _ in range(turns)] for _ in range(sessions)]


def run_sessions(engine: Engine, system: list[int], messages: list[list[list[int]]], reply: int) -> dict:
    """Closed-loop sessions: each submits its next turn as soon as its previous reply is done."""
    params = SamplingParams(max_tokens=reply, temperature=0)
    hist = [list(system) for _ in messages]
    turn = [0] * len(messages)
    live: dict[int, object] = {}
    done: list[tuple[int, int, object]] = []

    def submit(s: int) -> None:
        hist[s] = hist[s] + messages[s][turn[s]]
        live[s] = engine.submit(hist[s], params)

    t0 = time.perf_counter()
    for s in range(len(messages)):
        submit(s)
    while live:
        engine.step()
        for s, r in list(live.items()):
            if r.finished:
                if r.finish_reason != "length":
                    raise SystemExit(f"session {s} turn {turn[s]} ended with {r.finish_reason}: {r.error}")
                done.append((s, turn[s], r))
                del live[s]
                hist[s] = hist[s] + r.output_ids
                turn[s] += 1
                if turn[s] < len(messages[s]):
                    submit(s)
    wall = time.perf_counter() - t0
    ttft = [r.t_first_token - r.t_submit for _, _, r in done]
    completion = sum(len(r.output_ids) for _, _, r in done)
    prompt = sum(len(r.prompt_ids) for _, _, r in done)
    first_turn = [r.t_first_token - r.t_submit for _, t, r in done if t == 0]
    later = [r.t_first_token - r.t_submit for _, t, r in done if t > 0]
    return {
        "requests": len(done), "wall_s": wall,
        "ttft_p50_s": statistics.median(ttft), "ttft_p99_s": _pct(ttft, 0.99), "ttft_mean_s": statistics.fmean(ttft),
        "ttft_first_turn_p50_s": statistics.median(first_turn),
        "ttft_later_turns_p50_s": statistics.median(later) if later else None,
        "completion_tokens_per_s": completion / wall, "prompt_tokens_per_s": prompt / wall,
        "requests_per_s": len(done) / wall,
        "prompt_tokens": prompt, "completion_tokens": completion, "prefill_tokens": engine.prefill_tokens,
        "prompt_lengths": [min(len(r.prompt_ids) for *_, r in done), max(len(r.prompt_ids) for *_, r in done)],
        "prefix_cache": engine.stats().get("prefix_cache"),
        "_replies": {(s, t): r.output_ids for s, t, r in done},
    }


def single_measure(model, system: list[int], messages: list[list[int]], reply: int, chunk: int, block: int) -> dict:
    """One session's second turn alone: time to first token with its first turn cached, and without a cache."""
    params = SamplingParams(max_tokens=reply, temperature=0)
    out = {}
    for name, budget in (("off", 0), ("on", 1 << 30)):
        engine = Engine(model, prefill_chunk=chunk, eos_id=NO_EOS, prefix_cache_bytes=budget, prefix_block=block)
        first = engine.generate([system + messages[0]], params)[0]
        second = engine.generate([system + messages[0] + first.output_ids + messages[1]], params)[0]
        out[name] = {"ttft_s": second.t_first_token - second.t_submit, "cached_tokens": second.cached_tokens,
                     "prompt_tokens": len(second.prompt_ids)}
    return {**out, "ttft_speedup": out["off"]["ttft_s"] / out["on"]["ttft_s"]}


def fork_measure(model, prompt: list[int], n: int, chunk: int) -> dict:
    """n completions of one prompt: one forked prefill vs n prefills (time until every request has its first token)."""
    out = {}
    for name, fork in (("separate", False), ("forked", True)):
        engine = Engine(model, max_batch=n, prefill_chunk=chunk, eos_id=NO_EOS, fork_prefill=fork)
        params = [SamplingParams(max_tokens=2, temperature=0.8, seed=i) for i in range(n)]
        t0 = time.perf_counter()
        reqs = [engine.submit(prompt, p) for p in params]
        while engine.has_work():
            engine.step()
        out[name] = {"last_first_token_s": max(r.t_first_token for r in reqs) - t0,
                     "prefill_tokens": engine.prefill_tokens, "_tokens": [r.output_ids for r in reqs]}
    same = out["separate"].pop("_tokens") == out["forked"].pop("_tokens")
    return {"n": n, "prompt_tokens": len(prompt), **out, "same_tokens": same,
            "speedup": out["separate"]["last_first_token_s"] / out["forked"]["last_first_token_s"]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="tiny model, short prompts (a smoke run)")
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system", type=int, default=4096, help="shared system prompt tokens")
    ap.add_argument("--user", type=int, default=96, help="tokens of each new user message")
    ap.add_argument("--reply", type=int, default=32, help="tokens of each reply")
    ap.add_argument("--block", type=int, default=256, help="prefix cache snapshot interval")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if args.quick:
        args.preset, args.sessions, args.turns, args.system, args.user, args.reply, args.block = \
            "tiny", 3, 3, 160, 12, 4, 32
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    need = args.system + args.turns * (args.user + args.reply)
    base = get_config(args.preset)
    config = get_config(args.preset, max_context=max(base.max_context, 1 << (need - 1).bit_length()))
    model = K3Model(config).eval()
    system, messages = workload(config.vocab_size, args.sessions, args.turns, args.system, args.user)
    with torch.no_grad():  # warm up the kernels and allocator on a short run of both paths
        Engine(model, eos_id=NO_EOS, prefix_cache_bytes=1 << 20).generate(
            [system[:300], system[:200]], SamplingParams(max_tokens=2, temperature=0))
    modes = {}
    for name, budget in (("off", 0), ("on", 1 << 30)):
        engine = Engine(model, max_batch=args.sessions, prefill_chunk=args.chunk, eos_id=NO_EOS,
                        prefix_cache_bytes=budget, prefix_block=args.block)
        modes[name] = run_sessions(engine, system, messages, args.reply)
    off, on = modes["off"], modes["on"]
    replies_off, replies_on = off.pop("_replies"), on.pop("_replies")
    differing = sum(replies_off[k] != replies_on[k] for k in replies_off)
    single = single_measure(model, system, messages[0], args.reply, args.chunk, args.block)
    fork = fork_measure(model, system, min(8, args.sessions * 2), args.chunk)
    result = {
        "benchmark": "serve_prefix", "preset": config.name, "max_context": config.max_context,
        "sessions": args.sessions, "turns": args.turns, "system_tokens": args.system, "user_tokens": args.user,
        "reply_tokens": args.reply, "block": args.block, "prefill_chunk": args.chunk, "threads": args.threads,
        "off": off, "on": on,
        "ttft_p50_speedup": off["ttft_p50_s"] / on["ttft_p50_s"],
        "ttft_p99_speedup": off["ttft_p99_s"] / on["ttft_p99_s"],
        "throughput_speedup": on["completion_tokens_per_s"] / off["completion_tokens_per_s"],
        "prefill_tokens_saved": 1 - on["prefill_tokens"] / off["prefill_tokens"],
        "replies_identical": differing == 0, "replies_differing": differing,
        "single": single, "fork": fork,
        "machine": machine(threads=args.threads),
    }
    path = write_result(bench_out("serve_prefix", args.quick), result)
    if args.json:
        print(json.dumps(result))
    else:
        for name, m in modes.items():
            print(f"cache {name:3s}: TTFT p50 {m['ttft_p50_s']:.3f} s, p99 {m['ttft_p99_s']:.3f} s; "
                  f"{m['completion_tokens_per_s']:.1f} completion tokens/s, {m['prompt_tokens_per_s']:.0f} prompt "
                  f"tokens/s served; {m['prefill_tokens']:,} of {m['prompt_tokens']:,} prompt tokens prefilled; "
                  f"{m['wall_s']:.1f} s")
        print(f"TTFT p50 {result['ttft_p50_speedup']:.1f}x lower with the prefix cache (p99 "
              f"{result['ttft_p99_speedup']:.1f}x), throughput {result['throughput_speedup']:.2f}x; replies "
              f"identical: {result['replies_identical']}; one request alone {single['ttft_speedup']:.1f}x; "
              f"n={fork['n']} forked prefill {fork['speedup']:.2f}x; "
              f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
