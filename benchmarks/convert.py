"""Streaming conversion: peak memory of `k3 export --format kimi` on a released checkpoint larger than it holds.

    python benchmarks/convert.py [--json] [--quick] [--expert-gb 6] [--keep]

Builds a synthetic kimi_k3 folder (written by k3's own writer, MXFP4 routed experts as compressed-tensors
packs them, random values) shaped like K3 in everything but size: 3:1 KDA:MLA with a final MLA layer, Block
AttnRes, the Stable LatentMoE at half width with SiTU experts, the full-rank bounded KDA gates, the shared MLA
key. Its layer count is chosen so that the packed experts hold at least --expert-gb GB. Then it runs
`k3 export --format kimi SRC --out DST` in a child process and records the child's peak RSS (getrusage),
the wall time and the read + write throughput, compares every tensor of the first and last MoE layer of DST
with SRC bit for bit, and deletes both folders (unless --keep). The target: peak RSS under 2 GB plus one layer
(docs/benchmarks.md). Writes runs/bench/convert.json (--quick: runs/bench/quick/, a 0.05 GB model).
"""
from __future__ import annotations

import argparse
import json
import math
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from k3.benchtools import bench_out, machine, write_result
from k3.config import get_config
from k3.io.kimi import Tensors, kimi_config, kimi_tensors, tensor_map, write_safetensors
from k3.model.accounting import build_meta
from k3.quant.export import build_packed_model

ROOT = Path(__file__).resolve().parent.parent


def synthetic_config(expert_gb: float, quick: bool):
    """K3's forms and ratios at d_model 2048 (latent 1024, 256 experts of 1024, top-8), as many layers as the
    expert bytes need."""
    base = dict(d_model=2048, vocab_size=32768, kda_heads=16, kda_head_dim=128, kda_gate_rank=128,
                mla_heads=16, mla_q_lora_rank=384, mla_kv_lora_rank=512, mla_qk_head_dim=128, qk_rope_head_dim=64,
                mla_v_head_dim=128, dense_ffn=8192, moe_latent_dim=1024, n_experts=256, n_active_experts=8,
                expert_ffn=1024, n_shared_experts=2, shared_ffn=1024, norm_eps=1e-5, kda_norm_eps=1e-5,
                qat={"expert_weights": "mxfp4"}, balancing="quantile")
    if quick:
        base.update(d_model=256, vocab_size=4096, kda_heads=2, mla_heads=2, dense_ffn=512, moe_latent_dim=128,
                    n_experts=32, expert_ffn=128, shared_ffn=128, mla_q_lora_rank=64, mla_kv_lora_rank=64)
    per_layer = base["n_experts"] * 3 * base["moe_latent_dim"] * base["expert_ffn"] * 4.25 / 8
    moe_layers = max(3, math.ceil(expert_gb * 1e9 / per_layer))
    n = moe_layers + 1
    config = get_config("tiny", n_layers=n, attn_res_block_size=12, attnres_sources=math.ceil(n / 12) + 1, **base)
    return config.replace(name="k3-synthetic"), per_layer


def write_synthetic(config, out: Path) -> dict:
    """The folder, written tensor by tensor from random values of each k3 tensor's shape (one stacked expert
    weight in memory at a time)."""
    with torch.device("meta"):
        shapes = {k: (tuple(v.shape), v.dtype) for k, v in build_packed_model(config).state_dict().items()}
    g = torch.Generator().manual_seed(0)

    def get(name: str) -> torch.Tensor:
        shape, dtype = shapes[name]
        if dtype == torch.uint8:  # codes: any byte; scales: E8M0 around 2^-4
            return (torch.randint(0, 256, shape, dtype=torch.uint8, generator=g) if name.endswith("codes")
                    else torch.randint(118, 124, shape, dtype=torch.uint8, generator=g))
        return (0.02 * torch.randn(shape, generator=g)).to(torch.bfloat16)

    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(kimi_config(config, "kimi_k3"), indent=2))
    write_safetensors(kimi_tensors(config, get, "kimi_k3"), out)
    return {"bytes": sum(p.stat().st_size for p in out.glob("*.safetensors")),
            "shards": len(list(out.glob("*.safetensors")))}


def compare_layers(config, src: Path, dst: Path, layers: list[int]) -> int:
    a, b = Tensors(src), Tensors(dst)
    names = [n for e in tensor_map(config, "kimi_k3", True) for n in e.names
             if any(f".layers.{i}." in n for i in layers)]
    for n in names:
        if not torch.equal(a.get(n), b.get(n)):
            raise SystemExit(f"{n} differs between the source and the export")
    return len(names)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="a 0.05 GB model: a smoke test of the script")
    ap.add_argument("--expert-gb", type=float, default=6.0, help="packed routed-expert bytes of the source (GB)")
    ap.add_argument("--dir", default=None, help="where the two folders go (default: a temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the folders")
    args = ap.parse_args(argv)
    gb = 0.05 if args.quick else args.expert_gb
    config, per_layer = synthetic_config(gb, args.quick)
    work = Path(tempfile.mkdtemp(prefix="k3-convert-", dir=args.dir))
    src, dst = work / "src", work / "dst"
    try:
        t0 = time.perf_counter()
        made = write_synthetic(config, src)
        t_write = time.perf_counter() - t0
        cmd = [sys.executable, "-m", "k3.cli", "export", "--format", "kimi", str(src), "--out", str(dst)]
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True)
        t_export = time.perf_counter() - t0
        if r.returncode != 0:
            raise SystemExit(f"export failed ({r.returncode}): {r.stderr[-2000:]}")
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        moe = [i for i in range(config.n_layers) if config.is_moe_layer(i)]
        checked = compare_layers(config, src, dst, [moe[0], moe[-1]])
        out_bytes = sum(p.stat().st_size for p in dst.glob("*.safetensors"))
        with torch.device("meta"):
            model = build_meta(config)
        layer_bytes = per_layer + sum(p.numel() * 2 for n, p in model.named_parameters()
                                      if n.startswith(f"layers.{moe[0]}.") and ".experts." not in n)
        result = {
            "benchmark": "convert", "quick": args.quick, "config": config.to_dict(),
            "source_bytes": made["bytes"], "source_shards": made["shards"], "export_bytes": out_bytes,
            "expert_bytes": per_layer * len(moe), "largest_layer_bytes": layer_bytes,
            "peak_rss_bytes": peak, "peak_rss_gb": peak / 1e9,
            "target_bytes": 2e9 + layer_bytes, "within_target": peak < 2e9 + layer_bytes,
            "export_s": round(t_export, 1), "write_source_s": round(t_write, 1),
            "throughput_gb_s": round((made["bytes"] + out_bytes) / 1e9 / t_export, 3),
            "tensors_compared_bit_exact": checked, "command": "k3 export --format kimi SRC --out DST",
            "machine": machine(),
        }
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    path = write_result(bench_out("convert", args.quick), result)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"source {result['source_bytes'] / 1e9:.2f} GB ({result['expert_bytes'] / 1e9:.2f} GB MXFP4 experts); "
              f"export peak RSS {result['peak_rss_gb']:.2f} GB against a target of "
              f"{result['target_bytes'] / 1e9:.2f} GB; {result['export_s']} s, "
              f"{result['throughput_gb_s']} GB/s read + written; wrote {path}")
    return result


if __name__ == "__main__":
    main()
