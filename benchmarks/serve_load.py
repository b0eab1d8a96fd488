"""Load test of `k3 serve`: N concurrent streaming clients on 127.0.0.1; latency, time to first token,
tokens/s and errors, for the continuous-batching server against the same server with --max-batch 1.

    python benchmarks/serve_load.py [--json] [--quick] [--preset tiny|mini] [--clients 8] [--requests 16]

Both servers are real `k3 serve` processes (one model thread each) started side by side on a randomly
initialised model of the preset (or --ckpt/--tokenizer), warmed up, then loaded alternately for
--repeats rounds; tokens/s and the batched/unbatched ratio are medians over the rounds, latency
percentiles are over every request of every round. Each request is a /v1/completions stream with a
fixed prompt of --prompt-tokens token ids, greedy, `ignore_eos` and --max-tokens, so every request
generates exactly that many tokens (a different count is an error). Time to first token is the time to
the first streamed chunk that carries text. Concurrency stays within max_batch + max_queue, so any error
is a failure; a last phase sends twice that many requests at once to the batched server and counts the
429s, which are expected there (any other status is an error). Everything is bounded by --requests,
--max-tokens and --timeout, and nothing but 127.0.0.1 is contacted.
For reference the same prompts also go through an in-process Engine at both batch sizes (`engine_only`),
and the CPU time of the server's threads and of the client is recorded (`cpu_s`): together they show
what HTTP, SSE and the client cost on top of the model.
Writes runs/bench/serve_load.json atomically.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from k3.benchtools import bench_out, loadavg, machine, write_result

HOST = "127.0.0.1"  # localhost only, by design
MODEL = "bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def prepare(args, work: Path) -> tuple[Path, Path, int]:
    """(checkpoint root, tokenizer.json, vocab size): the given ones, or a random-init model + a quick tokenizer."""
    if args.ckpt:
        from k3.serve.server import load_for_serving

        model, tok, _ = load_for_serving(args.ckpt, args.tokenizer)
        return Path(args.ckpt), Path(tok.path), model.config.vocab_size
    from k3.config import get_config
    from k3.data.corpus import open_corpus
    from k3.data.tokenizer import load_tokenizer, train_tokenizer
    from k3.model.transformer import K3Model
    from k3.train.checkpoint import save_checkpoint

    config = get_config(args.preset)
    if args.tokenizer:
        tok = load_tokenizer(args.tokenizer)
    else:  # enough text for the vocabulary; a load test does not care how good the merges are
        max_bytes = 300_000 if config.vocab_size <= 1024 else 4_000_000
        texts = [t for _, t in open_corpus().documents("train", max_bytes=max_bytes)]
        tok = train_tokenizer(texts, config.vocab_size, path=work / "tokenizer", allow_short=False)
    torch.manual_seed(0)
    model = K3Model(config)
    root = work / "checkpoint"
    save_checkpoint(root, 0, model, config=config, data_state={"tokenizer": str(tok.path)})
    return root, Path(tok.path), config.vocab_size


class Server:
    def __init__(self, ckpt: Path, tokenizer: Path, max_batch: int, max_queue: int, threads: int):
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.max_batch, self.max_queue = max_batch, max_queue
        cmd = [sys.executable, "-m", "k3.cli", "serve", "--ckpt", str(ckpt), "--tokenizer", str(tokenizer),
               "--host", HOST, "--port", str(self.port), "--max-batch", str(max_batch), "--max-queue",
               str(max_queue), "--threads", str(threads), "--log-level", "warning", "--model-name", MODEL,
               "--device", "cpu"]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"k3 serve exited: {self.proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"k3 serve on {self.url} did not come up in {timeout:.0f}s")

    def cpu_by_thread(self) -> dict[str, float] | None:
        """CPU seconds (user + system) per thread of the server process; None off Linux."""
        tasks = Path(f"/proc/{self.proc.pid}/task")
        if not tasks.is_dir():
            return None
        out, tick = {}, os.sysconf("SC_CLK_TCK")
        for t in tasks.iterdir():
            try:
                fields = (t / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # the thread ended in between
                continue
            out[t.name] = (int(fields[11]) + int(fields[12])) / tick
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def one_stream(client, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, usage, status, done = None, None, None, False
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            status = resp.status_code
            if status != 200:
                await resp.aread()
                return {"ok": False, "status": status}
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"ok": False, "status": "stream_error"}
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if ttft is None and any(c.get("text") for c in chunk.get("choices", [])):
                    ttft = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - every failure is counted, none stops the run
        return {"ok": False, "status": type(e).__name__}
    latency = time.perf_counter() - t0
    ok = done and usage is not None and usage["completion_tokens"] == max_tokens
    return {"ok": ok, "status": status if ok else "incomplete", "latency_s": latency, "ttft_s": ttft or latency,
            "tokens": usage["completion_tokens"] if usage else 0}


async def load(url: str, prompts: list[list[int]], clients: int, max_tokens: int, timeout: float) -> dict:
    """`clients` workers pull from the prompt list until it is empty; returns per-request records + wall time."""
    import httpx

    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    records: list[dict] = []

    async def worker(client):
        while not queue.empty():
            records.append(await one_stream(client, url, queue.get_nowait(), max_tokens))

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(worker(client) for _ in range(clients))), timeout)
        wall = time.perf_counter() - t0
    good = [r for r in records if r["ok"]]
    return {"records": records, "wall_s": wall, "tokens": sum(r["tokens"] for r in good),
            "tokens_per_s": sum(r["tokens"] for r in good) / wall, "errors": len(records) - len(good)}


async def overload(url: str, n: int, prompt: list[int], max_tokens: int, timeout: float) -> dict:
    import httpx

    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=n + 4)) as client:
        async def one():
            try:
                return (await client.post(url + "/v1/completions", json=body)).status_code
            except Exception as e:  # noqa: BLE001
                return type(e).__name__
        codes = await asyncio.wait_for(asyncio.gather(*(one() for _ in range(n))), timeout)
        health = (await client.get(url + "/health")).status_code
    return {"sent": n, "ok": codes.count(200), "rejected_429": codes.count(429),
            "other_errors": sum(1 for c in codes if c not in (200, 429)), "health_after": health}


def engine_only(ckpt: Path, prompts: list[list[int]], max_batch: int, max_tokens: int, repeats: int) -> dict:
    """The same work through an in-process Engine (no HTTP): what the server adds on top of the model."""
    from k3.serve.engine import Engine
    from k3.model.sampling import SamplingParams
    from k3.io.trained import load_trained_model

    model, _ = load_trained_model(ckpt)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    Engine(model, max_batch=max_batch).generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    rates: dict[str, list[float]] = {"batched": [], "max_batch_1": []}
    for r in range(repeats):
        order = [("batched", max_batch), ("max_batch_1", 1)]
        for name, b in order if r % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            reqs = Engine(model, max_batch=b, max_queue=len(prompts)).generate(prompts, params)
            rates[name].append(sum(len(q.output_ids) for q in reqs) / (time.perf_counter() - t0))
    return {"batched_tokens_per_s": statistics.median(rates["batched"]),
            "max_batch_1_tokens_per_s": statistics.median(rates["max_batch_1"]),
            "speedup_vs_max_batch_1": statistics.median(a / b for a, b in zip(rates["batched"], rates["max_batch_1"]))}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def summary(rounds: list[dict]) -> dict:
    recs = [r for rd in rounds for r in rd["records"] if r["ok"]]
    lat, ttft = [r["latency_s"] for r in recs], [r["ttft_s"] for r in recs]
    return {
        "tokens_per_s": statistics.median(rd["tokens_per_s"] for rd in rounds),
        "tokens_per_s_rounds": [rd["tokens_per_s"] for rd in rounds],
        "latency_p50_s": pct(lat, 0.5) if lat else None, "latency_p99_s": pct(lat, 0.99) if lat else None,
        "ttft_p50_s": pct(ttft, 0.5) if ttft else None, "ttft_p99_s": pct(ttft, 0.99) if ttft else None,
        "requests": sum(len(rd["records"]) for rd in rounds), "errors": sum(rd["errors"] for rd in rounds),
        "error_kinds": sorted({str(r["status"]) for rd in rounds for r in rd["records"] if not r["ok"]}),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="a few short requests, one round (smoke test)")
    ap.add_argument("--preset", default="tiny", choices=("tiny", "mini"))
    ap.add_argument("--ckpt", default=None, help="serve this checkpoint instead of a random-init preset")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    ap.add_argument("--requests", type=int, default=16, help="requests per round (default 16)")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-queue", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="rounds per server (default 3)")
    ap.add_argument("--threads", type=int, default=1, help="model threads per server (default 1)")
    ap.add_argument("--timeout", type=float, default=600.0, help="cap in seconds on each load phase")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.max_tokens, args.repeats = min(args.requests, 8), min(args.max_tokens, 8), 1
    if args.clients > args.max_batch + args.max_queue:
        raise SystemExit(f"--clients {args.clients} exceeds max_batch + max_queue = {args.max_batch + args.max_queue}: "
                         "that load is expected to see 429s; raise --max-queue")
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory(prefix="k3-serve-load-") as tmp:
        ckpt, tok_path, vocab = prepare(args, Path(tmp))
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(17, vocab, (args.prompt_tokens,), generator=g).tolist() for _ in range(args.requests)]
        m_before = machine()
        engine = engine_only(ckpt, prompts, args.max_batch, args.max_tokens, args.repeats)
        servers = {"batched": Server(ckpt, tok_path, args.max_batch, args.max_queue, args.threads),
                   "max_batch_1": Server(ckpt, tok_path, 1, args.max_queue + args.max_batch, args.threads)}
        try:
            for s in servers.values():
                s.wait_ready(180)
            for s in servers.values():  # warm-up: first-call allocations, imports on the request path
                asyncio.run(load(s.url, prompts[:2], 2, 4, args.timeout))
            rounds: dict[str, list] = {k: [] for k in servers}
            cpu: dict[str, dict] = {k: {"busiest_thread_s": 0.0, "other_threads_s": 0.0, "client_s": 0.0,
                                        "wall_s": 0.0} for k in servers}
            for r in range(args.repeats):
                order = list(servers) if r % 2 == 0 else list(servers)[::-1]
                for name in order:
                    before, c0 = servers[name].cpu_by_thread(), time.process_time()
                    rounds[name].append(asyncio.run(load(servers[name].url, prompts, args.clients, args.max_tokens,
                                                         args.timeout)))
                    after = servers[name].cpu_by_thread()
                    cpu[name]["client_s"] += time.process_time() - c0
                    cpu[name]["wall_s"] += rounds[name][-1]["wall_s"]
                    if before is not None and after is not None:
                        used = sorted((after[t] - before.get(t, 0.0) for t in after), reverse=True)
                        cpu[name]["busiest_thread_s"] += used[0] if used else 0.0
                        cpu[name]["other_threads_s"] += sum(used[1:])
            n_over = 2 * (args.max_batch + args.max_queue)
            over = asyncio.run(overload(servers["batched"].url, n_over, prompts[0], args.max_tokens, args.timeout))
        finally:
            for s in servers.values():
                s.stop()

    runs = {k: summary(v) for k, v in rounds.items()}
    ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(rounds["batched"], rounds["max_batch_1"])
              if b["tokens_per_s"] > 0]
    b = runs["batched"]
    result = {
        "benchmark": "serve_load", "quick": args.quick,
        "model": args.ckpt or f"{args.preset} (random init)",
        "shapes": {"clients": args.clients, "requests_per_round": args.requests, "prompt_tokens": args.prompt_tokens,
                   "max_tokens": args.max_tokens, "max_batch": args.max_batch, "max_queue": args.max_queue,
                   "repeats": args.repeats, "threads_per_server": args.threads},
        "tokens_per_s": b["tokens_per_s"], "latency_p50_s": b["latency_p50_s"], "latency_p99_s": b["latency_p99_s"],
        "ttft_p50_s": b["ttft_p50_s"], "ttft_p99_s": b["ttft_p99_s"],
        "errors": b["errors"] + runs["max_batch_1"]["errors"],
        "speedup_vs_max_batch_1": statistics.median(ratios) if ratios else None,
        "runs": runs, "overload": over, "engine_only": engine, "cpu_s": cpu,
        "definitions": {
            "tokens_per_s": "completion tokens of successful requests / wall time of a round, median over rounds",
            "latency": "request sent -> [DONE], percentiles over all requests of all rounds",
            "ttft": "request sent -> first streamed chunk with text",
            "speedup_vs_max_batch_1": "median over rounds of tokens/s(max_batch) / tokens/s(max_batch 1)",
            "errors": "failed or short requests while concurrency <= max_batch + max_queue (must be 0)",
            "engine_only": "the same prompts through an in-process Engine, no HTTP, same thread count",
            "cpu_s": "CPU seconds over all rounds: the server's busiest thread (the model), its other threads "
                     "(HTTP event loop and the rest), the client process; wall_s is the rounds' wall time",
        },
        "machine": m_before, "loadavg_1m_after": loadavg(),
    }
    out_path = write_result(bench_out("serve_load", args.quick), result, args.json)
    if not args.json:
        for name, r in runs.items():
            print(f"{name}: {r['tokens_per_s']:.0f} tokens/s, latency p50 {r['latency_p50_s']:.2f}s p99 "
                  f"{r['latency_p99_s']:.2f}s, ttft p50 {r['ttft_p50_s']:.2f}s p99 {r['ttft_p99_s']:.2f}s, "
                  f"errors {r['errors']}")
        print(f"engine only (no HTTP): {engine['batched_tokens_per_s']:.0f} vs "
              f"{engine['max_batch_1_tokens_per_s']:.0f} tokens/s, {engine['speedup_vs_max_batch_1']:.2f}x")
        print(f"batched / max_batch 1 throughput: {result['speedup_vs_max_batch_1']:.2f}x; overload "
              f"{over['sent']} at once: {over['ok']} ok, {over['rejected_429']} x 429, {over['other_errors']} other")
        print(f"wrote {out_path}")
    return result


if __name__ == "__main__":
    main()
