"""The fifth tier: disk. Tokens/s and memory of a model served with its routed experts streamed from disk
(k3.io.stream) on one machine, from four rates of that machine.

Per decoded token (batch 1), every MoE layer runs top-k routed experts. A cache of C experts out of N on disk
hits with probability h = C / N when routing is spread evenly (LRU under independent uniform choices; skewed
routing hits more, so this is a floor). With
    active = moe_layers * k * expert_bytes          (packed MXFP4 bytes the experts of one token hold)
    miss   = (1 - h) * active                       (bytes read from disk per token)
    t_trunk   = trunk bytes read per token / mem_gbps   (every non-expert matrix but the embedding, once)
    t_experts = active / expert_gbps                    (dequantizing and applying the packed experts)
    t_disk    = miss / disk_gbps
without prefetch the three add up; with the lookahead prefetch, the share `lookahead` of the misses is read by
the background thread while the previous layer computes, the rest on demand (the compute waits for them), and
the one disk serves both, so
    t = max(t_trunk + t_experts + (1 - lookahead) * t_disk, t_disk)
Prefetch never costs time in this model; a wrong guess also reads an expert nobody uses (measured in
benchmarks/stream.py), which it leaves out: where the disk is the wall, that is a floor on t. Memory: the trunk in `dense_precision`, the expert cache (the
rest of `ram`), and the dequantization workspace of one layer's k experts in fp32.
"""
from __future__ import annotations

from k3.config import K3Config
from k3.model.accounting import build_meta, component_of, element_bytes

GB = 1e9


def stream_plan(config: K3Config, ram_gb: float, disk_gbps: float, mem_gbps: float = 16.0,
                expert_gbps: float = 0.2, dense_precision: str = "bf16", lookahead: float = 0.5,
                overhead_gb: float = 0.5) -> dict:
    """Prediction for `config` served streamed on a machine with `ram_gb` of RAM (see the module docstring)."""
    for name, v in (("ram_gb", ram_gb), ("disk_gbps", disk_gbps), ("mem_gbps", mem_gbps),
                    ("expert_gbps", expert_gbps)):
        if not v > 0:
            raise ValueError(f"{name} = {v} must be > 0")
    if not 0 <= lookahead <= 1:
        raise ValueError(f"lookahead = {lookahead} is a share of the misses: give a value in [0, 1]")
    model = build_meta(config)
    eb = element_bytes(dense_precision)
    trunk = read = 0.0
    for name, p in model.named_parameters():
        comp = component_of(model, name)
        if comp == "moe_routed":
            continue
        nbytes = p.numel() * eb
        if dense_precision == "fp8":  # as k3.io.stream's fp8 trunk stores it: a matrix's rows get an fp32 scale,
            # the embedding and MLA's wkv_b (read by value in the absorbed decode) and the vectors stay bf16
            fp8 = p.dim() == 2 and comp != "embedding" and not name.endswith("wkv_b.weight")
            nbytes = p.numel() + 4 * p.shape[0] if fp8 else p.numel() * 2
        trunk += nbytes
        if comp != "embedding":  # decode reads one row of the embedding, all of every other matrix
            read += nbytes
    moe = model.moe_layers()
    dim, ffn, k = moe[0].experts.dim, moe[0].experts.ffn, config.n_active_experts
    expert_bytes = 3 * dim * ffn * element_bytes("mxfp4")
    workspace = k * 3 * dim * ffn * 4
    n_total = len(moe) * config.n_experts
    on_disk = n_total * expert_bytes
    cache = ram_gb * GB - overhead_gb * GB - trunk - workspace
    need = trunk + workspace + k * expert_bytes + overhead_gb * GB
    out = {"config": config.name, "ram_gb": ram_gb, "disk_gbps": disk_gbps, "mem_gbps": mem_gbps,
           "expert_gbps": expert_gbps, "dense_precision": dense_precision, "lookahead": lookahead,
           "overhead_gb": overhead_gb, "trunk_gb": trunk / GB, "experts_on_disk_gb": on_disk / GB,
           "expert_mb": expert_bytes / 1e6, "moe_layers": len(moe), "active_experts": k,
           "workspace_gb": workspace / GB, "min_ram_gb": need / GB, "fits": cache >= k * expert_bytes}
    if not out["fits"]:
        out["advice"] = (f"the trunk ({trunk / GB:.2f} GB in {dense_precision}) + one layer's {k} experts and their "
                         f"workspace need {need / GB:.2f} GB (with {overhead_gb:g} GB for the runtime), more than "
                         f"{ram_gb:g} GB: give more RAM"
                         + (" or a smaller trunk precision (--dense-precision fp8)" if eb > 1 else ""))
        return out
    hit = min(1.0, cache / on_disk)
    active = len(moe) * k * expert_bytes
    miss = (1 - hit) * active
    t_trunk, t_experts, t_disk = read / (mem_gbps * GB), active / (expert_gbps * GB), miss / (disk_gbps * GB)
    serial = t_trunk + t_experts + t_disk
    overlapped = max(t_trunk + t_experts + (1 - lookahead) * t_disk, t_disk)
    out.update(cache_gb=cache / GB, hit_rate=hit, active_bytes_per_token=active, bytes_read_per_token=miss,
               trunk_s=t_trunk, experts_s=t_experts, disk_s=t_disk, s_per_token_no_prefetch=serial,
               s_per_token_prefetch=overlapped, tokens_per_s_no_prefetch=1 / serial,
               tokens_per_s_prefetch=1 / overlapped, ram_used_gb=(trunk + workspace + cache) / GB + overhead_gb)
    return out


def format_stream_plan(r: dict) -> str:
    lines = [f"k3 plan --stream-experts: {r['config']} on one machine, {r['ram_gb']:g} GB RAM, disk "
             f"{r['disk_gbps']:g} GB/s, trunk reads {r['mem_gbps']:g} GB/s, experts applied {r['expert_gbps']:g} "
             f"GB/s (packed)", ""]

    def row(name, value):
        lines.append(f"  {name:<48}{value:>20}")

    row(f"trunk ({r['dense_precision']}), resident", f"{r['trunk_gb']:,.2f} GB")
    row(f"routed experts on disk (MXFP4, {r['moe_layers']} MoE layers)", f"{r['experts_on_disk_gb']:,.2f} GB")
    row("one expert (w1, w3, w2 packed)", f"{r['expert_mb']:,.2f} MB")
    row(f"dequantization workspace ({r['active_experts']} experts, fp32)", f"{r['workspace_gb']:,.3f} GB")
    row("least RAM that runs it", f"{r['min_ram_gb']:,.2f} GB")
    if not r["fits"]:
        lines += ["", f"does not fit: {r['advice']}"]
        return "\n".join(lines)
    row("expert cache", f"{r['cache_gb']:,.2f} GB")
    row("cache hit rate (even routing: a floor)", f"{r['hit_rate']:.1%}")
    row("packed expert bytes a token uses", f"{r['active_bytes_per_token'] / 1e6:,.1f} MB")
    row("bytes read from disk per token", f"{r['bytes_read_per_token'] / 1e6:,.1f} MB")
    lines += ["", "where a token's time goes"]
    row("trunk matrices", f"{r['trunk_s']:,.3f} s")
    row("experts (dequantize + apply)", f"{r['experts_s']:,.3f} s")
    row("disk reads", f"{r['disk_s']:,.3f} s")
    row("tokens/s, no prefetch (serial)", f"{r['tokens_per_s_no_prefetch']:,.3f}")
    row(f"tokens/s, prefetch ({r['lookahead']:.0%} of misses guessed)", f"{r['tokens_per_s_prefetch']:,.3f}")
    return "\n".join(lines)
