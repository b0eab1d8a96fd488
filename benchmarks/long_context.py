"""Long context on CPU: a chunked prefill of 1,048,576 tokens through the `long` preset, then decode.

    python benchmarks/long_context.py [--json] [--tokens 1048576] [--chunk 256] [--decode-tokens 8]

The model has K3's layer pattern (KKKM: three KDA layers, one Gated MLA layer). Its cache after T tokens
is predicted from the config by `k3.model.accounting.cache_bytes` (fp32 here): T x (kv_lora_rank +
qk_rope_head_dim) x 4 bytes per MLA layer plus a constant state per KDA layer. The script measures the real cache (`HybridCache.nbytes`)
and the process RSS (/proc/self/statm, after glibc's malloc_trim so that free heap blocks the allocator
keeps do not count) after each 1/32 of the prefill, so the JSON shows whether resident
memory grows by the latent cache and nothing else: `rss_growth_over_cache` and the slope
`rss_bytes_per_token` vs `predicted_bytes_per_token`. Peak RSS (getrusage) is reported as well; above the
steady state it holds one chunk's attention working set (the [chunk, context] mask and the re-expanded
keys/values of the naive MLA prefill path), freed after each chunk. Token ids are random: cost and memory
do not depend on them. Progress goes to stderr and, atomically, to runs/long_context/progress.json;
the result to runs/bench/long_context.json (`--quick`: 8,192 tokens, to runs/bench/quick/).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import signal
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from k3.config import get_config
from k3.data.tokenizer import SPECIAL_TOKENS
from k3.benchtools import bench_out, loadavg, machine
from k3.fileio import atomic_write_json
from k3.model.accounting import cache_bytes
from k3.model.cache import KDACache, MLACache
from k3.model.transformer import K3Model

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "runs" / "bench" / "long_context.json"
PROGRESS = ROOT / "runs" / "long_context" / "progress.json"
MiB = 2**20


def _malloc_trim() -> bool:
    """Hand glibc's free heap pages back to the OS, so RSS counts live memory rather than the allocator's
    retained free blocks (which follow the size of recent transient buffers, not the cache)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


def rss_bytes(trim: bool = True) -> int:
    """Resident set size now (Linux /proc; falls back to the peak elsewhere), after malloc_trim by default."""
    if trim:
        _malloc_trim()
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return kib if sys.platform == "darwin" else kib * 1024


def predicted_cache_bytes(config, tokens: int, batch: int = 1) -> dict:
    """The hybrid cache after `tokens` tokens, from the config alone (fp32 latents, states and conv tails)."""
    return cache_bytes(config, tokens, batch, latent="fp32", conv="fp32", state="fp32")


def cache_parts(cache) -> dict:
    """Measured bytes of a HybridCache by kind."""
    mla = sum(s.nbytes() for s in cache.slots if isinstance(s, MLACache))
    kda = sum(s.nbytes() for s in cache.slots if isinstance(s, KDACache))
    return {"total": mla + kda, "mla_latent": mla, "kda": kda}


def random_ids(n: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(len(SPECIAL_TOKENS), vocab, (1, n), generator=generator)


def _slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys on xs."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


class Interrupted(Exception):
    """SIGTERM (e.g. from `timeout`) during the prefill: report what was measured so far."""


def _raise_interrupted(signum, frame):
    raise Interrupted(f"signal {signum}")


@torch.no_grad()
def run(preset: str = "long", tokens: int = 1_048_576, chunk: int = 256, decode_tokens: int = 8,
        samples: int = 32, seed: int = 0, progress: bool = True, progress_path: Path | None = PROGRESS) -> dict:
    config = get_config(preset)
    if tokens + decode_tokens > config.max_context:
        raise ValueError(f"{tokens} + {decode_tokens} tokens exceed {preset}'s max_context = {config.max_context}")
    if chunk < 1 or tokens < chunk:
        raise ValueError(f"--chunk must be in [1, --tokens], got chunk={chunk}, tokens={tokens}")
    torch.manual_seed(seed)
    model = K3Model(config).eval()
    gen = torch.Generator().manual_seed(seed)
    # warm up kernels and allocator pools on a throwaway cache, so the baseline below is the steady state
    warm = model.new_cache()
    model(random_ids(2 * chunk, config.vocab_size, gen), warm)
    model(random_ids(1, config.vocab_size, gen), warm)
    predicted_cache_bytes(config, 0)  # its first call imports modules (and their memory) once
    del warm
    gc.collect()

    cache = model.new_cache()
    base_rss, base_peak = rss_bytes(), peak_rss_bytes()
    every = max(1, (tokens // chunk) // samples)
    rows, kda_bytes_seen = [], set()
    t0 = time.perf_counter()
    bar = tqdm(total=tokens, unit="tok", unit_scale=True, disable=not progress, mininterval=10, file=sys.stderr,
               desc=f"prefill {preset}")
    done, i, logits, interrupted = 0, 0, None, None
    try:
        while done < tokens:
            n = min(chunk, tokens - done)
            logits = model(random_ids(n, config.vocab_size, gen), cache)[:, -1]
            done, i = done + n, i + 1
            bar.update(n)
            kda_bytes_seen.add(cache_parts(cache)["kda"])
            if i % every == 0 or done == tokens:
                parts = cache_parts(cache)
                predicted = predicted_cache_bytes(config, done)["total"]
                rows.append({"tokens": done, "elapsed_s": time.perf_counter() - t0,
                             "rss_untrimmed_bytes": rss_bytes(trim=False), "rss_bytes": rss_bytes(),
                             "cache_bytes": parts["total"], "mla_latent_bytes": parts["mla_latent"],
                             "kda_bytes": parts["kda"], "predicted_cache_bytes": predicted})
                bar.set_postfix(cache_MiB=f"{parts['total'] / MiB:.0f}", rss_MiB=f"{rows[-1]['rss_bytes'] / MiB:.0f}")
                if progress_path is not None:
                    atomic_write_json(progress_path, {"preset": preset, "tokens_target": tokens, "chunk": chunk,
                                                      "base_rss_bytes": base_rss, "peak_rss_bytes": peak_rss_bytes(),
                                                      "rows": rows})
    except (Interrupted, KeyboardInterrupt) as err:
        interrupted = str(err) or type(err).__name__  # the cache may be mid-chunk: report the last sample
    bar.close()
    if not rows:
        raise RuntimeError("interrupted before the first sample; nothing to report")
    last = rows[-1]
    prefill_s = last["elapsed_s"]
    after_rss, after_peak = last["rss_bytes"], peak_rss_bytes()

    step_s = []
    if interrupted is None:
        nxt = logits.argmax(-1, keepdim=True)
        for _ in range(decode_tokens):
            t = time.perf_counter()
            nxt = model(nxt, cache)[:, -1].argmax(-1, keepdim=True)
            step_s.append(time.perf_counter() - t)
    parts = cache_parts(cache) if interrupted is None else {
        "total": last["cache_bytes"], "mla_latent": last["mla_latent_bytes"], "kda": last["kda_bytes"]}
    cached_tokens = last["tokens"] + len(step_s)
    pred = predicted_cache_bytes(config, cached_tokens)

    xs = [r["tokens"] for r in rows]
    growth = after_rss - base_rss
    residual = [r["rss_bytes"] - base_rss - r["cache_bytes"] for r in rows]
    return {
        "benchmark": "long_context",
        "completed": interrupted is None,
        "interrupted_by": interrupted,
        "preset": preset,
        "config": config.to_dict(),
        "pattern": config.pattern,
        "tokens": last["tokens"],
        "tokens_target": tokens,
        "chunk": chunk,
        "decode_tokens": len(step_s),
        "prefill_s": prefill_s,
        "prefill_tokens_per_s": last["tokens"] / prefill_s,
        "decode_ms_per_token": 1e3 * statistics.median(step_s) if step_s else None,
        "decode_ms_per_token_all": [1e3 * s for s in step_s],
        "cached_tokens": cached_tokens,
        "cache_bytes": parts["total"],
        "cache_mla_latent_bytes": parts["mla_latent"],
        "cache_kda_bytes": parts["kda"],
        "predicted_cache_bytes": pred["total"],
        "predicted": pred,
        "predicted_by": "k3.model.accounting.cache_bytes(config, cached_tokens, latent=conv=state='fp32')",
        "cache_rel_error": abs(parts["total"] - pred["total"]) / pred["total"],
        "kda_state_bytes_constant": len(kda_bytes_seen) == 1,
        "kda_state_bytes_seen": sorted(kda_bytes_seen),
        "rss_measured_after_malloc_trim": _malloc_trim(),
        "base_rss_bytes": base_rss,
        "rss_after_prefill_bytes": after_rss,
        "rss_growth_bytes": growth,
        "rss_growth_over_cache": growth / last["cache_bytes"],
        "rss_residual_bytes_max_abs": max(abs(r) for r in residual),
        "rss_bytes_per_token": _slope(xs, [r["rss_bytes"] for r in rows]) if len(rows) > 2 else None,
        "predicted_bytes_per_token": config.n_mla_layers * config.mla_cache_dim * 4,
        "peak_rss_bytes": after_peak,
        "peak_rss_gib": after_peak / 2**30,
        "peak_over_base_bytes": after_peak - base_rss,
        "peak_before_prefill_bytes": base_peak,
        "samples": rows,
        "definitions": {
            "rss_growth_over_cache": "(RSS after prefill - RSS before) / measured cache bytes; 1.0 = memory grew "
                                     "by the cache and nothing else",
            "rss_bytes_per_token": "least-squares slope of RSS over the prefill samples; compare "
                                   "predicted_bytes_per_token = n_mla_layers x (kv_lora_rank + qk_rope_head_dim) x 4",
            "peak_rss_bytes": "getrusage ru_maxrss: the steady state plus one chunk's transient attention work",
        },
        "machine": machine(),
        "loadavg_1m_after": loadavg(),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--preset", default="long")
    ap.add_argument("--tokens", type=int, default=1_048_576)
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk (its attention mask is chunk x context)")
    ap.add_argument("--decode-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--quick", action="store_true",
                    help="8,192 tokens (a smoke test); writes runs/bench/quick/long_context.json")
    ap.add_argument("--out", type=Path, default=None, help=f"output JSON (default {OUT.relative_to(ROOT)})")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens = min(args.tokens, 8192)
    if args.out is None:
        args.out = bench_out("long_context", True) if args.quick else OUT
    torch.set_num_threads(args.threads)
    signal.signal(signal.SIGTERM, _raise_interrupted)
    result = run(args.preset, args.tokens, args.chunk, args.decode_tokens, progress=not args.no_progress,
                 progress_path=None if args.out != OUT else PROGRESS)
    out = args.out
    if not result["completed"] and out == OUT:  # never replace a complete result with a partial one
        out = PROGRESS.parent / "interrupted.json"
    atomic_write_json(out, result)
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "samples"}))
    else:
        if not result["completed"]:
            print(f"INTERRUPTED ({result['interrupted_by']}) after {result['tokens']:,} of "
                  f"{result['tokens_target']:,} tokens; the figures below are for that prefix")
        print(f"prefill {result['tokens']:,} tokens in {result['prefill_s']:.0f} s; cache "
              f"{result['cache_bytes'] / MiB:.1f} MiB (predicted {result['predicted_cache_bytes'] / MiB:.1f} MiB, "
              f"error {result['cache_rel_error']:.2e}); RSS grew {result['rss_growth_bytes'] / MiB:.1f} MiB "
              f"({result['rss_growth_over_cache']:.3f}x the cache); peak RSS {result['peak_rss_gib']:.2f} GiB; "
              f"decode {result['decode_ms_per_token'] or float('nan'):.1f} ms/token")
        print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
