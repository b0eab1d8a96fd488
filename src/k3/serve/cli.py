"""`k3 serve`: an OpenAI-compatible HTTP server for a trained checkpoint."""
from __future__ import annotations

import argparse
import os
import sys


def cmd_serve(args: argparse.Namespace) -> int:
    from k3.train.cli import set_threads
    from k3.train.device import resolve_device
    from k3.train.precision import resolve_precision

    # every check (checkpoint, config, tokenizer) runs before the port opens
    for name in ("max_batch", "prefill_chunk", "default_max_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} = {getattr(args, name)} must be >= 1")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue = {args.max_queue} must be >= 0")
    if args.prefix_cache_bytes < 0 or args.prefix_block < 1:
        raise ValueError(f"--prefix-cache-bytes = {args.prefix_cache_bytes} must be >= 0 (0: off) and "
                         f"--prefix-block = {args.prefix_block} >= 1")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port = {args.port} must be in 1..65535")
    try:
        import uvicorn

        from k3.serve.server import create_app, load_for_serving
    except ModuleNotFoundError as e:
        raise ValueError(f"`k3 serve` needs the serving extras ({e.name} is missing): "
                         "pip install 'k3[serve]'") from None
    from k3.data.chat import chat_format
    from k3.serve.engine import Engine

    threads = set_threads(args.threads)
    stream = {}
    if args.stream_experts:  # checked before anything is read
        from k3.io.stream import parse_bytes

        if args.ram_budget is None:
            raise ValueError("--stream-experts needs --ram-budget (e.g. 8GB): the RAM for the trunk and the expert cache")
        stream = dict(experts="stream", ram_budget=parse_bytes(args.ram_budget, "--ram-budget"),
                      prefetch=not args.no_prefetch, trunk=args.trunk)
        if args.trunk == "fp8":  # the rest (embedding, norms, MLA's wkv_b) in bf16, as `k3 plan` counts it
            import torch

            stream["dtype"] = torch.bfloat16
    elif args.ram_budget is not None or args.trunk is not None:
        raise ValueError(f"{'--ram-budget' if args.ram_budget is not None else '--trunk'} applies to streamed "
                         "experts; add --stream-experts (or drop it)")
    device = resolve_device("cpu" if stream else args.device)
    model, tokenizer, manifest = load_for_serving(args.ckpt, args.tokenizer, args.config, device, **stream)
    if stream and args.precision == "auto":  # the probe measured k3's own layers, not the streamed released model
        precision, precision_reason = "fp32", "auto with --stream-experts: fp32 (--precision bf16 to choose bf16)"
    else:
        precision, precision_reason = resolve_precision(args.precision, device)
    fmt = chat_format(args.chat_format)
    if fmt.check_tokenizer is not None:
        try:
            fmt.check_tokenizer(tokenizer)
        except ValueError as e:
            raise ValueError(f"--chat-format {args.chat_format}: {e}") from None
    socks = _bind(args.host, args.port)  # a busy port is a one-line error too, not uvicorn's traceback
    name = args.model_name or f"k3-{model.config.name}"
    engine = Engine(model, tokenizer, max_batch=args.max_batch, max_queue=args.max_queue,
                    prefill_chunk=args.prefill_chunk, prefix_cache_bytes=args.prefix_cache_bytes,
                    prefix_block=args.prefix_block, precision=precision)
    app = create_app(engine, name, default_max_tokens=args.default_max_tokens,
                     api_key=args.api_key or os.environ.get("K3_API_KEY") or None, worker_threads=threads,
                     chat_format_name=args.chat_format)
    print(f"k3 serve: {name} from {manifest['path']} (step {manifest.get('step')}), context "
          f"{model.config.max_context}, batch {args.max_batch}, queue {args.max_queue}, {threads} thread(s), "
          f"{precision} ({precision_reason}), prefix "
          f"cache {f'{args.prefix_cache_bytes / 2**20:,.0f} MiB' if args.prefix_cache_bytes else 'off'}; "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5))
    try:
        server.run(sockets=socks)
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it shut down on (uvicorn.run swallows it the same way)
        pass
    finally:
        for sock in socks:
            sock.close()
    return 0


def _bind(host: str, port: int) -> list:
    """Sockets bound to every address `host` resolves to (as asyncio's create_server binds them): a busy port or
    an address this machine does not have is a one-line error."""
    import errno
    import socket

    socks = []
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, addr in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # the IPv4 address binds on its own
            sock.bind(addr)
    except OSError as e:
        for sock in socks:
            sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ValueError(f"--port {port}: {host}:{port} is already in use; pick another --port") from None
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror or e}); check --host and --port") from None
    return socks


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a checkpoint over an OpenAI-compatible HTTP API",
                       description="OpenAI-compatible server: /v1/models, /v1/completions, /v1/chat/completions "
                                   "(streaming with stream=true), /health.")
    p.add_argument("--ckpt", default="runs/train/checkpoint",
                   help="checkpoint dir or root (default runs/train/checkpoint)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the one the checkpoint names)")
    p.add_argument("--config", default=None, metavar="FILE.json",
                   help="refuse to start unless the checkpoint was trained with this config")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-name", default=None, help="model id in the API (default k3-<preset name>)")
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together (default 8)")
    p.add_argument("--max-queue", type=int, default=32,
                   help="requests waiting for a batch slot; beyond that the server answers 429 (default 32)")
    p.add_argument("--prefill-chunk", type=int, default=512, help="prompt tokens per prefill chunk (default 512)")
    p.add_argument("--prefix-cache-bytes", type=int, default=1 << 30,
                   help="bytes of cached prefixes (MLA latents, KDA snapshots) kept for reuse, LRU; 0 turns "
                        "prefix caching off (default 1 GiB)")
    p.add_argument("--prefix-block", type=int, default=256,
                   help="tokens between KDA state snapshots: prefixes are reused up to a multiple of this or a "
                        "cached prompt's end (default 256)")
    p.add_argument("--chat-format", choices=("k3", "kimi-k3"), default="k3",
                   help="chat template and reply parser: k3's own (default) or Kimi K3's released format (XTML), "
                        "which needs a tokenizer that reserves its tokens (docs/serving.md)")
    p.add_argument("--default-max-tokens", type=int, default=256,
                   help="chat reply length when the request gives no max_tokens (default 256)")
    p.add_argument("--stream-experts", action="store_true",
                   help="keep the routed experts of a released MXFP4 folder on disk and read them as used, through a "
                        "cache bounded by --ram-budget (CPU; docs/serving.md)")
    p.add_argument("--ram-budget", default=None, metavar="SIZE",
                   help="with --stream-experts: RAM for the trunk and the expert cache together, e.g. 8GB")
    p.add_argument("--no-prefetch", action="store_true",
                   help="with --stream-experts: no lookahead prefetch of the next layer's experts")
    p.add_argument("--trunk", choices=("fp8",), default=None,
                   help="with --stream-experts: keep the trunk's matrices in fp8 (e4m3, a scale per row) and the rest "
                        "in bf16: the released K3's trunk in 58 GB instead of 113")
    p.add_argument("--api-key", default=None, help="require this bearer key on /v1 (default: $K3_API_KEY, else none)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for the model (default: torch's choice)")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                   help="fp32, bf16 (autocast over the fp32 weights), or auto (default): bf16 on CUDA, and on a CPU "
                        "only where a probe on this host, cached per host, measures it faster")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(func=cmd_serve)
