"""GPU checks and timings in one run: what the CPU suite cannot show (fla's Triton KDA, torch._grouped_mm,
MX on the device, a training step under bf16 autocast).

    python benchmarks/gpu.py --json [--out FILE]      # on a CUDA machine; writes runs/bench/gpu.json or FILE
    python benchmarks/gpu.py --device cpu --quick     # dry run of the script's logic (small shapes)

Each section runs in its own process under its own time limit (`LIMITS`, or `--section-timeout` for all, each cut
to what is left of `--budget`) and records its own error or timeout instead of stopping the run; the sections
that need fla's Triton kernels run last. Nothing measured is lost to a limit: a section saves its rows as it
finishes them (a timed-out section returns those, marked "partial"), the JSON is written after every section,
and a SIGTERM (e.g. from `timeout`) writes it before the run stops. fla autotunes every kernel over its configs
on first use of each (dtype, head count, head dim): about 2,800 configs over ~200 kernels, several minutes per
new shape, which no section limit allows. So by default
(`--fla-autotune pinned`) every fla autotuner keeps one config, the one with the fewest pipeline stages and
smallest blocks (the least shared memory, so it fits where any does): Triton then compiles it without
benchmarking. fla's results do not depend on the config, its speed does: pinned fla times are an upper bound
on fla's tuned times (`--fla-autotune full` tunes, given the time). Children run with
`FLA_DISABLE_BACKEND_DISPATCH=1` (fla's plain Triton path, no just-in-time TileLang/nvcc backends) and
unbuffered, stdout and stderr merged, so a cut-off section's tail shows where it was. Sections:
- peaks: bf16 and fp32 (tf32 off) matmul rates and device-to-device copy bandwidth, the ceilings below.
- kda_check: fla's Triton `chunk_kda` (what `k3.ops.kda.kda` dispatches to on CUDA) and k3's pure-torch
  `chunk_kda` on the device, forward, final state and gradients, against k3's naive recurrence in fp64.
- kda_speed: forward and forward+backward times of fla Triton (bf16), k3 torch chunk (fp32 and bf16 inputs; it
  computes in fp32, with TF32 matmuls here as fla's fp32 dots use TF32) and fla naive_chunk (small shape).
- moe_check / moe_speed: the MoE layer at mini widths in bf16, grouped (torch._grouped_mm) vs the
  per-expert loop, outputs against an fp32 reference; and routed experts at the full k3 widths
  (latent 3584, ffn 3072; 32 experts on one GPU, as under expert parallelism) as a fraction of bf16 peak.
- model_check: the tiny model on the device: prefill + single-token decode (fla's fused recurrent KDA, the
  MLA latent cache) equals one full forward; the mini model's logits on the device equal the CPU's.
- train_step: the Trainer on `mini` (bf16 autocast on CUDA), a few steps on random tokens: finite losses,
  the first step's time (compilation) and the steady step time.
- mx: k3's MX quantizer on the device, bit-exact against torchao's to_mx, and its speed against it.
Timings are CUDA-event medians after warm-up. Speed ratios come from the same process run.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import traceback

_T_IMPORT = time.perf_counter()  # before torch: the --budget counts the imports and CUDA init too

import torch
import torch.nn.functional as F

from k3.benchtools import bench_out, machine, write_result


def progress(msg: str) -> None:
    """A line on stderr with the time: a section cut off by its limit leaves these in its output_tail."""
    print(f"{time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)


def cuda_ms(fn, reps: int, warm: int = 3, device=None) -> dict:
    """Median / min milliseconds of fn() over reps (CUDA events on a GPU, perf_counter on CPU)."""
    for _ in range(warm):
        fn()
    ts = []
    cuda = device is not None and device.type == "cuda"
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            ts.append(1e3 * (time.perf_counter() - t0))
    return {"median_ms": statistics.median(ts), "min_ms": min(ts), "reps": reps}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp64 (NaN anywhere gives inf)."""
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def pin_fla_autotune() -> dict:
    """Give every fla Triton autotuner a single config (fewest stages, then smallest blocks, then 4 warps), so
    first use compiles one variant and benchmarks none. Returns {"autotuners": n, "configs_before": m}."""
    import gc

    import fla.ops.kda  # noqa: F401  (imports create the autotuners)
    import fla.ops.kda.chunk_bwd  # noqa: F401
    from triton.runtime.autotuner import Autotuner

    def cost(c):
        blocks = sum(v for v in c.kwargs.values() if isinstance(v, int) and not isinstance(v, bool))
        return (c.num_stages or 0, blocks, abs((c.num_warps or 4) - 4))

    n = before = 0
    for a in gc.get_objects():
        if isinstance(a, Autotuner) and getattr(a.fn, "fn", a.fn).__module__.startswith("fla."):
            n, before = n + 1, before + len(a.configs)
            if len(a.configs) > 1:
                a.configs = [min(a.configs, key=cost)]
    return {"autotuners": n, "configs_before": before}


def fla_setup(dev, out: dict) -> None:
    """Before a section's first fla call: pin fla's autotuning unless --fla-autotune full (CUDA only)."""
    import os

    mode = os.environ.get("K3_FLA_AUTOTUNE", "pinned")
    out["fla_autotune"] = mode
    if dev.type == "cuda" and mode == "pinned":
        out["fla_autotune_pinned"] = pin_fla_autotune()


_PARTIAL: tuple[str, str] | None = None  # child mode: (part file, section name) that save_partial writes


def save_partial(out: dict) -> None:
    """Inside a section: write what it has measured so far to the child's part file, so that a section cut off
    by its time limit still returns the rows it finished (marked "partial")."""
    if _PARTIAL is not None:
        path, name = _PARTIAL
        write_result(path, {name: {**out, "partial": True}})


def guarded(out: dict, key: str, fn) -> None:
    """out[key] = fn(), or the error it raised: one failing check inside a section must not hide the others."""
    try:
        out[key] = fn()
    except Exception as e:  # noqa: BLE001
        out[key] = {"error": f"{type(e).__name__}: {e}", "traceback": _trace()}
    save_partial(out)


def _trace() -> str:
    """The innermost frames of the exception being handled (where fla, Triton or a kernel raised)."""
    return traceback.format_exc()[-TAIL:]


def section(results: dict, name: str, fn, dev, quick) -> None:
    t0 = time.perf_counter()
    try:
        results[name] = fn(dev, quick)
        if dev.type == "cuda":
            results[name]["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    except Exception as e:  # noqa: BLE001 - one broken section must not hide the others
        saved = read_part(*_PARTIAL) if _PARTIAL is not None else {}  # the rows it finished before it raised
        saved.pop("partial", None)
        results[name] = {**saved, "error": f"{type(e).__name__}: {e}", "traceback": _trace()}
    results[name]["section_s"] = round(time.perf_counter() - t0, 2)
    print(f"[{name}] {time.perf_counter() - t0:.1f}s {'ERROR ' + results[name]['error'] if 'error' in results[name] else 'ok'}",
          flush=True)


# ---------------------------------------------------------------------------------------------- peaks
def peaks(dev, quick):
    n = 1024 if quick else 8192
    out = {}
    for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        if dev.type == "cpu" and dt == torch.bfloat16:
            continue
        a, b = torch.randn(n, n, device=dev, dtype=dt), torch.randn(n, n, device=dev, dtype=dt)
        t = cuda_ms(lambda: a @ b, 5 if quick else 20, device=dev)
        out[f"{name}_matmul_tflops"] = 2 * n**3 / (t["median_ms"] * 1e-3) / 1e12
    if dev.type == "cuda":
        x = torch.empty(2**30 if not quick else 2**24, dtype=torch.uint8, device=dev)
        y = torch.empty_like(x)
        t = cuda_ms(lambda: y.copy_(x), 20, device=dev)
        out["copy_tb_per_s"] = 2 * x.numel() / (t["median_ms"] * 1e-3) / 1e12
    out["n"] = n
    return out


# ---------------------------------------------------------------------------------------------- KDA
def kda_inputs(B, T, H, K, V, dev, dtype, grad=False, seed=0):
    """Random KDA inputs made on the device itself (no host-side generation and copy of large tensors)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    kw = dict(generator=g, device=dev)
    q = torch.randn(B, T, H, K, **kw)
    k = F.normalize(torch.randn(B, T, H, K, **kw), dim=-1)
    v = torch.randn(B, T, H, V, **kw)
    gate = F.logsigmoid(torch.randn(B, T, H, K, **kw))
    beta = torch.rand(B, T, H, **kw)
    h0 = 0.1 * torch.randn(B, H, K, V, **kw)
    xs = [x.to(dtype).requires_grad_(grad) for x in (q, k, v, gate, beta)]
    return xs, h0


def kda_check(dev, quick):
    from k3.ops.kda import chunk_kda, choose_impl, kda, naive_recurrent_kda

    B, T, H, K, V = (1, 200, 2, 32, 32) if quick else (2, 1000, 4, 128, 128)  # T not a multiple of 64
    xs, h0 = kda_inputs(B, T, H, K, V, dev, torch.float32, grad=True)
    w = torch.randn(B, T, H, V, device=dev)
    ref_in = [x.detach().double().requires_grad_() for x in xs]
    o_ref, s_ref = naive_recurrent_kda(*ref_in, initial_state=h0.double(), output_final_state=True)
    (o_ref * w.double()).sum().backward()
    g_ref = [x.grad for x in ref_in]
    out = {"shape": [B, T, H, K, V]}
    guarded(out, "dispatch", lambda: choose_impl(xs[0]))
    fla_setup(dev, out)

    def grads_of(fn):
        def run():
            for x in xs:
                x.grad = None
            t0 = time.perf_counter()
            o, s = fn(*xs, initial_state=h0.clone(), output_final_state=True)
            (o * w).sum().backward()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            return {"first_call_s": time.perf_counter() - t0, "o_rel_err": rel(o, o_ref),
                    "state_rel_err": rel(s, s_ref),
                    "grad_rel_err": {n: rel(x.grad, gr) for n, x, gr in zip("q k v g beta".split(), xs, g_ref)}}
        return run

    progress("kda_check: k3_torch_chunk")
    guarded(out, "k3_torch_chunk", grads_of(chunk_kda))
    if dev.type == "cuda":
        def bf16_inputs():  # bf16 inputs through fla's chunk_kda, as training under autocast feeds it
            xb = [x.detach().bfloat16() for x in xs]
            with torch.no_grad():
                o, s = kda(*xb, initial_state=h0.clone(), output_final_state=True)
            return {"o_rel_err": rel(o, o_ref), "state_rel_err": rel(s, s_ref)}

        def decode():  # one token at a time through the default dispatch (fla fused_recurrent) from the state
            with torch.no_grad():
                state, steps = h0.clone(), []
                for t in range(min(T, 64)):
                    o_t, state = kda(*[x.detach()[:, t:t + 1] for x in xs], initial_state=state,
                                     output_final_state=True)
                    steps.append(o_t)
            return rel(torch.cat(steps, 1), o_ref[:, :len(steps)])

        progress("kda_check: bf16 through the default dispatch (fla compiles its kernels here)")
        guarded(out, "dispatch_bf16_inputs", bf16_inputs)
        progress("kda_check: decode, 64 steps")
        guarded(out, "decode_64_steps_o_rel_err", decode)
        progress("kda_check: fp32 with gradients through the default dispatch (another compile)")
        guarded(out, "dispatch_default", grads_of(lambda *a, **kw: kda(*a, **kw)))
    return out


def kda_speed(dev, quick):
    from fla.ops.kda.naive import naive_chunk_kda

    from k3.ops.kda import chunk_kda, kda

    shapes = [(1, 512, 2, 64, 64)] if quick else [(1, 4096, 4, 128, 128), (8, 8192, 16, 128, 128)]
    out = {"tf32": dev.type == "cuda"}
    fla_setup(dev, out)
    torch.backends.cuda.matmul.allow_tf32 = True  # k3's chunk form computes in fp32; fla's fp32 dots use TF32
    for shape in shapes:
        B, T, H, K, V = shape
        row = {}
        for dtype in (torch.float32, torch.bfloat16):
            if dev.type == "cpu" and dtype == torch.bfloat16:
                continue
            contenders = {"k3_torch_chunk": chunk_kda}
            if dev.type == "cuda" and dtype == torch.bfloat16:  # training feeds fla bf16
                contenders["fla_triton_chunk"] = lambda *a: kda(*a, impl="fla")
            if T * B <= 4096:  # fla's naive chunk form is a Python loop over chunks: the small shape only
                contenders["fla_naive_chunk"] = naive_chunk_kda
            xs, _ = kda_inputs(B, T, H, K, V, dev, dtype, grad=True)
            w = torch.randn(B, T, H, V, device=dev, dtype=dtype)
            for name, fn in contenders.items():
                progress(f"kda_speed: {name} {dtype} {shape}")

                def fwd():
                    with torch.no_grad():
                        fn(*xs)

                def fwd_bwd():
                    for x in xs:
                        x.grad = None
                    o = fn(*xs)[0]
                    (o * w).sum().backward()

                reps = 3 if quick or name == "fla_naive_chunk" else 10
                f = cuda_ms(fwd, reps, warm=2, device=dev)
                fb = cuda_ms(fwd_bwd, reps, warm=2, device=dev)
                row[f"{name}.{str(dtype)[6:]}"] = {"forward_ms": f["median_ms"], "fwd_bwd_ms": fb["median_ms"],
                                                   "forward_tokens_per_s": B * T / (f["median_ms"] * 1e-3)}
                out["B{}_T{}_H{}_K{}_V{}".format(*shape)] = row
                save_partial(out)
        fla_, ours = row.get("fla_triton_chunk.bfloat16"), row.get("k3_torch_chunk.bfloat16")
        if fla_ and ours:
            row["fla_triton_over_k3_torch_forward.bfloat16"] = ours["forward_ms"] / fla_["forward_ms"]
            row["fla_triton_over_k3_torch_fwd_bwd.bfloat16"] = ours["fwd_bwd_ms"] / fla_["fwd_bwd_ms"]
        naive, ours = row.get("fla_naive_chunk.float32"), row.get("k3_torch_chunk.float32")
        if naive and ours:
            row["k3_torch_chunk_speedup_vs_fla_naive_chunk.float32"] = naive["forward_ms"] / ours["forward_ms"]
        out["B{}_T{}_H{}_K{}_V{}".format(*shape)] = row
    return out


# ---------------------------------------------------------------------------------------------- MoE
def moe_check(dev, quick):
    from k3.config import get_config
    from k3.model.moe import MoE

    cfg = get_config("tiny" if quick else "mini")
    torch.manual_seed(0)
    moe = MoE(cfg).to(dev)
    N = 512 if quick else 4096
    x = torch.randn(1, N, cfg.d_model, device=dev)
    out = {}
    with torch.no_grad():
        moe.impl = "loop"
        ref = moe(x)  # fp32 loop: the reference (the naive per-token form is checked against it on CPU)
        mb = moe.to(torch.bfloat16)
        for impl in ("grouped", "loop"):
            mb.impl = impl
            out[f"{impl}_bf16_rel_err_vs_fp32_loop"] = rel(mb(x.bfloat16()), ref)
        moe.float()
    # gradients: grouped bf16 vs fp32 loop
    grads = {}
    for impl, dt in (("loop", torch.float32), ("loop_bf16", torch.bfloat16), ("grouped", torch.bfloat16)):
        m = moe.to(dt)
        m.impl = impl.split("_")[0]
        m.zero_grad(set_to_none=True)
        xi = x.detach().to(dt).requires_grad_()
        m(xi).float().pow(2).mean().backward()
        grads[impl] = {"x": xi.grad.float().clone(), "w1": m.experts.w1.grad.float().clone(),
                       "w_down": m.w_down.weight.grad.float().clone() if m.latent else None}
    moe.float()
    out["grouped_bf16_grad_rel_err_vs_fp32_loop"] = {
        k: rel(grads["grouped"][k], grads["loop"][k]) for k in grads["loop"] if grads["loop"][k] is not None}
    # the same routing and dtype: grouped and loop differ only in summation order
    out["grouped_bf16_grad_rel_err_vs_bf16_loop"] = {
        k: rel(grads["grouped"][k], grads["loop_bf16"][k]) for k in grads["loop"] if grads["loop"][k] is not None}
    from k3.model.moe import _grouped_backend
    out["auto_backend_bf16"] = _grouped_backend(x.bfloat16().view(N, -1), torch.ones(cfg.n_experts, dtype=torch.long),
                                               moe.experts.w1, moe.experts.w2)
    return out


def moe_speed(dev, quick):
    from k3.config import get_config
    from k3.model.moe import MoE

    out = {}
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = get_config("tiny" if quick else "mini")
    torch.manual_seed(0)
    moe = MoE(cfg).to(dev, dt)
    N = 512 if quick else 4096
    x = torch.randn(1, N, cfg.d_model, device=dev, dtype=dt)
    dy = torch.randn_like(x)
    layer = {}
    backends = ["auto", "bmm", "slices"] + (["grouped_mm"] if dev.type == "cuda" else [])
    out["mini_layer"] = {"tokens": N, "dtype": str(dt), "n_experts": cfg.n_experts, "top_k": cfg.n_active_experts,
                         "impls": layer}
    for impl, backend in [("loop", "auto")] + [("grouped", b) for b in backends]:
        def timed(impl=impl, backend=backend):
            moe.impl, moe.experts.backend = impl, backend

            def fwd():
                with torch.no_grad():
                    moe(x)

            def fwd_bwd():
                moe.zero_grad(set_to_none=True)
                moe(x.detach().requires_grad_()).backward(dy)

            return {"forward_ms": cuda_ms(fwd, 10, device=dev)["median_ms"],
                    "fwd_bwd_ms": cuda_ms(fwd_bwd, 10, device=dev)["median_ms"]}
        guarded(layer, f"{impl}.{backend}", timed)  # one failing variant (a kernel, OOM) keeps the others
    loop = layer["loop.auto"]
    for k, v in layer.items():
        if "error" not in v and "error" not in loop:
            v["forward_speedup_vs_loop"] = loop["forward_ms"] / v["forward_ms"]
            v["fwd_bwd_speedup_vs_loop"] = loop["fwd_bwd_ms"] / v["fwd_bwd_ms"]
    if "fwd_bwd_speedup_vs_loop" in layer.get("grouped.auto", {}):
        out["mini_layer"]["speedup_vs_loop"] = layer["grouped.auto"]["fwd_bwd_speedup_vs_loop"]
    save_partial(out)
    guarded(out, "k3_width_experts", lambda: _k3_width_experts(dev, dt, quick))
    return out


def _k3_width_experts(dev, dt, quick) -> dict:
    from k3.model.moe import RoutedExperts

    # full-width routed experts: 32 local experts (896 over 28 EP ranks), latent 3584, ffn 3072
    E, dim, ffn, k = (8, 256, 128, 2) if quick else (32, 3584, 3072, 4)
    Nk = 1024 if quick else 16384
    with torch.device(dev):  # initialised on the device: no 4 GB of fp32 weights drawn on the host first
        ex = RoutedExperts(E, dim, ffn).to(dt)
    z = torch.randn(Nk, dim, device=dev, dtype=dt)
    experts = torch.rand(Nk, E, device=dev).argsort(-1)[:, :k]  # k distinct experts per token
    weights = torch.softmax(torch.randn(Nk, k, device=dev), -1)
    flops = 3 * 2 * Nk * k * dim * ffn
    res = {"experts": E, "dim": dim, "ffn": ffn, "tokens": Nk, "top_k": k, "forward_flops": flops}
    for impl in ("grouped", "loop"):
        ex.impl = impl

        def fwd():
            with torch.no_grad():
                ex(z, weights, experts)

        def fwd_bwd():
            ex.zero_grad(set_to_none=True)
            ex(z.detach().requires_grad_(), weights, experts).float().sum().backward()

        f, fb = cuda_ms(fwd, 10, device=dev), cuda_ms(fwd_bwd, 10, device=dev)
        res[impl] = {"forward_ms": f["median_ms"], "fwd_bwd_ms": fb["median_ms"],
                     "forward_tflops": flops / (f["median_ms"] * 1e-3) / 1e12,
                     "fwd_bwd_tflops": 3 * flops / (fb["median_ms"] * 1e-3) / 1e12}
    res["grouped_fwd_bwd_speedup_vs_loop"] = res["loop"]["fwd_bwd_ms"] / res["grouped"]["fwd_bwd_ms"]
    return res


# ---------------------------------------------------------------------------------------------- model
def model_check(dev, quick):
    from k3.config import get_config
    from k3.model.transformer import K3Model

    out = {}
    fla_setup(dev, out)
    torch.manual_seed(0)
    m = K3Model(get_config("tiny")).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() >= 2 and "attnres" not in name:
                p.normal_(0, 1.0 / p.shape[-1] ** 0.5)
    m = m.to(dev)
    progress("model_check: tiny prefill + decode")
    ids = torch.randint(0, m.config.vocab_size, (2, 90), device=dev)
    with torch.no_grad():
        full = m(ids)
        cache = m.new_cache()
        steps = [m(ids[:, :70], cache)] + [m(ids[:, t:t + 1], cache) for t in range(70, 90)]
    out["tiny_prefill_decode_vs_full_max_abs"] = (torch.cat(steps, 1) - full).abs().max().item()
    out["tiny_full_logits_max_abs"] = full.abs().max().item()
    out["tiny_prefill_decode_vs_full_rel"] = rel(torch.cat(steps, 1), full)
    out["tiny_cache_nbytes"] = cache.nbytes()
    save_partial(out)
    torch.manual_seed(0)
    mm = K3Model(get_config("tiny" if quick else "mini")).eval()
    ids = torch.randint(0, mm.config.vocab_size, (2, 300))
    with torch.no_grad():
        cpu = mm(ids)
        gpu = mm.to(dev)(ids.to(dev)).cpu()
    out["mini_device_vs_cpu_logits_rel_err"] = rel(gpu, cpu)
    return out


# ---------------------------------------------------------------------------------------------- training
def train_step(dev, quick):
    """The real Trainer on the device (bf16 autocast on CUDA: fla's KDA, grouped experts, AttnRes, MLA):
    a few AdamW steps of mini on random tokens; every loss finite, step times after the first."""
    from k3.benchtools import RandomTokens
    from k3.config import get_config
    from k3.train.trainer import TrainConfig, Trainer

    out = {}
    fla_setup(dev, out)
    config = get_config("tiny" if quick else "mini")
    B, T, steps = (2, 64, 3) if quick else (16, 1024, 6)
    tc = TrainConfig(steps=steps, batch_size=B, seq_len=T, device=dev.type, warmup_steps=1, measure_mfu=False,
                     record_attnres=False)
    trainer = Trainer(config, tc, RandomTokens(config.vocab_size))
    recs = []
    for i in range(steps):
        progress(f"train_step: step {i + 1} of {steps}")
        recs.append(trainer.train_step())
        out["losses"] = [r["loss"] for r in recs]
        out["step_time_s"] = [r["step_time_s"] for r in recs]
        save_partial(out)
    times = [r["step_time_s"] for r in recs[1:]]
    out.update({"preset": config.name, "batch": B, "seq_len": T, "autocast": "bf16" if dev.type == "cuda" else None,
                "losses": [r["loss"] for r in recs], "all_finite": all(math.isfinite(r["loss"]) for r in recs),
                "first_step_s": recs[0]["step_time_s"], "step_s_median": statistics.median(times),
                "tokens_per_s": B * T / statistics.median(times)})
    return out


# ---------------------------------------------------------------------------------------------- MX
def mx(dev, quick):
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    from k3.ops.mx import quantize_mx

    n = 1024 if quick else 8192
    out = {}
    x = torch.randn(n, n, device=dev) * torch.logspace(-6, 6, n, device=dev)[:, None]
    special = x[:64].clone()
    special[0] = 0
    special[1, ::7] = float("nan")
    special[2, ::5] = float("inf")
    special[3] *= 1e-40
    for fmt, dt in (("mxfp4", torch.float4_e2m1fn_x2), ("mxfp8", torch.float8_e4m3fn)):
        row = {}
        for name, t in (("random", x), ("special", special)):
            codes, scales = quantize_mx(t, fmt)
            s_ref, d_ref = to_mx(t.contiguous(), dt, 32)
            d_ref = d_ref.view(torch.uint8)
            if fmt == "mxfp4":  # torchao packs two codes per byte: compare unpacked codes
                d_ref = torch.stack([d_ref & 15, d_ref >> 4], -1).flatten(-2)
            row[f"{name}_scale_mismatches"] = int((scales != s_ref.view(torch.uint8).view(scales.shape)).sum())
            row[f"{name}_code_mismatches"] = int((codes != d_ref.view(codes.shape)).sum())
        # packed, as torchao's to_mx packs two FP4 codes per byte: both sides write the same bytes
        ours = cuda_ms(lambda: quantize_mx(x, fmt, packed=True), 10, device=dev)["median_ms"]
        theirs = cuda_ms(lambda: to_mx(x, dt, 32), 10, device=dev)["median_ms"]
        row.update({"k3_ms": ours, "torchao_ms": theirs, "speedup_vs_torchao_to_mx": theirs / ours,
                    "k3_gb_per_s_read": x.numel() * 4 / (ours * 1e-3) / 1e9})
        out[fmt] = row
    out["shape"] = [n, n]
    return out


SECTIONS = {"peaks": peaks, "moe_check": moe_check, "moe_speed": moe_speed, "mx": mx,
            # the sections below go through fla's Triton kernels, which compile (and autotune) on first use
            "kda_check": kda_check, "kda_speed": kda_speed, "model_check": model_check, "train_step": train_step}


# seconds each section may take (about 9 minutes in all); --section-timeout sets one limit for every section
LIMITS = {"peaks": 30, "moe_check": 50, "moe_speed": 90, "mx": 40, "kda_check": 120, "model_check": 75,
          "train_step": 75, "kda_speed": 110}


TAIL = 2000  # characters of a failed section's output kept in the JSON
_RUNNING: tuple[str, str] | None = None  # (part file, section) of the section running in a child now
CHILD_SCRIPT = __file__  # what a section's child process runs (the tests point it at a wrapper)


def run_isolated(name: str, args, timeout: float) -> dict:
    """One section in a child process with a wall-clock limit, so a section that hangs or spends its time
    compiling kernels costs its own limit, not the rest of the run."""
    import os
    import subprocess
    import sys
    import tempfile

    global _RUNNING
    with tempfile.TemporaryDirectory() as tmp:
        part = f"{tmp}/{name}.json"
        _RUNNING = (part, name)  # what a SIGTERM handler reads back before the run stops
        cmd = [sys.executable, CHILD_SCRIPT, "--only", name, "--device", args.device, "--part", part]
        if args.quick:
            cmd.append("--quick")
        t0 = time.perf_counter()
        # Triton prints each autotuning result (on stdout): with stdout and stderr merged and unbuffered, a
        # section that times out shows in its tail whether it was compiling, tuning or computing
        env = {**os.environ, "TRITON_PRINT_AUTOTUNING": os.environ.get("TRITON_PRINT_AUTOTUNING", "1"),
               "PYTHONUNBUFFERED": "1", "FLA_DISABLE_BACKEND_DISPATCH": "1", "K3_FLA_AUTOTUNE": args.fla_autotune}
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                                  env=env)
        except subprocess.TimeoutExpired as e:
            tail = (e.stdout or b"")[-TAIL:]
            tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
            print(f"[{name}] TIMEOUT after {timeout:.0f}s", flush=True)
            # the rows the section finished before its limit (save_partial), with the timeout beside them
            return {**read_part(part, name), "error": f"timeout: the section did not finish in {timeout:.0f} s",
                    "output_tail": tail, "section_s": round(time.perf_counter() - t0, 2)}
        _RUNNING = None
        got = read_part(part, name)
        if not got or got.get("partial"):
            got = {**got, "error": f"child exited {proc.returncode} without a result",
                   "output_tail": proc.stdout[-TAIL:],
                   "section_s": round(time.perf_counter() - t0, 2)}
        if "error" in got:
            print(f"[{name}] ERROR {got['error']}", flush=True)
        return got


def read_part(path: str, name: str) -> dict:
    """A child's part file for one section ({} when it wrote none)."""
    import json

    try:
        with open(path) as f:
            return json.load(f)[name]
    except (OSError, ValueError, KeyError):
        return {}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="small shapes")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu for a dry run")
    ap.add_argument("--out", default=None,
                    help="write the JSON here, after every section and when the run is terminated (default "
                         "runs/bench/gpu.json; quick or CPU runs: runs/bench/quick/gpu.json)")
    ap.add_argument("--budget", type=float, default=570.0,
                    help="seconds the whole run may take (default 570): each section's limit is cut to what is "
                         "left, and a section with under 15 s left is skipped and says so")
    ap.add_argument("--only", default=None, help="comma-separated sections to run: " + ",".join(SECTIONS))
    ap.add_argument("--section-timeout", type=float, default=None,
                    help="seconds every section may take (default: each its own, " +
                         ", ".join(f"{k} {v}" for k, v in LIMITS.items()) + ")")
    ap.add_argument("--fla-autotune", choices=("pinned", "full"), default="pinned",
                    help="pinned (default): one config per fla kernel, compiled without benchmarking; full: "
                         "fla's own autotuning (minutes per new shape)")
    ap.add_argument("--part", default=None, help=argparse.SUPPRESS)  # child mode: write the sections here
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu.py: no CUDA device here; run with --device cpu --quick for a dry run")
    wanted = args.only.split(",") if args.only else list(SECTIONS)
    unknown = [w for w in wanted if w not in SECTIONS]
    if unknown:
        raise SystemExit(f"gpu.py: unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if args.part:  # child: run the sections in this process
        global _PARTIAL
        _PARTIAL = (args.part, wanted[0]) if len(wanted) == 1 else None
        results = {}
        for name in wanted:
            section(results, name, SECTIONS[name], dev, args.quick)
        write_result(args.part, results)
        return results
    results = {"benchmark": "gpu", "quick": args.quick, "device": str(dev),
               "machine": machine(cuda_capability=list(torch.cuda.get_device_capability()) if dev.type == "cuda" else None)}
    from importlib.metadata import PackageNotFoundError, version

    for lib, dist in (("fla", "fla-core"), ("torchao", "torchao"), ("triton", "triton")):
        try:
            results["machine"][lib] = version(dist)
        except PackageNotFoundError:
            results["machine"][lib] = "not installed"
    results["fla_autotune"] = args.fla_autotune
    if dev.type == "cuda":  # the fla sections fall back to k3's own kernels without it: say so up front
        import k3.ops.kda as kda_ops

        results["machine"]["fla_usable"] = kda_ops._fla_kda() is not None
        if not results["machine"]["fla_usable"]:
            results["machine"]["fla_import_error"] = kda_ops._fla_import_error
    out = args.out or bench_out("gpu", args.quick or dev.type != "cuda")
    t_start = _T_IMPORT  # the budget counts from process start: imports and CUDA init are inside the limit

    def terminated(signum, _frame):  # e.g. `timeout` ran out: keep what finished, then stop
        results["terminated"] = f"signal {signum} after {time.perf_counter() - t_start:.0f} s"
        if _RUNNING is not None:  # the rows the running section has saved so far
            part, name = _RUNNING
            results[name] = {**read_part(part, name), "error": "terminated while running"}
        for name in wanted:  # a section that had not started (or the signal came between two) says so
            results.setdefault(name, {"error": "not run: terminated"})
        write_result(out, results)
        raise SystemExit(128 + signum)

    import signal

    signal.signal(signal.SIGTERM, terminated)
    for name in wanted:
        left = args.budget - (time.perf_counter() - t_start)
        if left < 15:
            results[name] = {"error": f"skipped: {left:.0f} s of the --budget {args.budget:.0f} s left"}
            print(f"[{name}] SKIPPED ({left:.0f} s left)", flush=True)
        else:
            results[name] = run_isolated(name, args, min(args.section_timeout or LIMITS[name], left - 5))
            if "error" not in results[name]:
                print(f"[{name}] {results[name].get('section_s', '?')}s ok", flush=True)
        write_result(out, results)  # what finished survives a run cut short
    write_result(out, results, args.json)
    return results


if __name__ == "__main__":
    main()
