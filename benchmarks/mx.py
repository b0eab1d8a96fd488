"""MX formats: quantize throughput of k3's quantize_mx against torchao's to_mx, and the cost of
dequantizing packed expert weights before an fp32 GEMM.

    python benchmarks/mx.py [--json] [--quick] [--repeats N]

Also: a mini-shaped routed-expert layer run from packed MXFP4 weights (`k3.quant.export.PackedRoutedExperts`,
dequantized on each forward, or cached) against the same layer in fp32; and, on a CUDA GPU with hardware MX
GEMMs (sm_100+), an MXFP8 x MXFP8 torch._scaled_mm with E8M0 block scales (via torchao's MXTensor) against a
bf16 matmul. Elsewhere that section records why it was skipped.

Both quantizers produce the same bytes (checked here): for mxfp4 we time quantize_mx(packed=True)
because to_mx returns packed fp4. Each repeat times the two contenders back to back in alternating
order, and the speedup is the median of the per-repeat ratios, which holds up better than a ratio
of medians on a shared machine. Writes runs/bench/mx.json atomically.
"""
from __future__ import annotations

import argparse

import torch

from k3.ops.mx import dequantize_mx, quantize_mx
from k3.benchtools import bench_out, loadavg, machine as _machine, paired, write_result, positive_int

TORCHAO_DTYPE = {"mxfp4": torch.float4_e2m1fn_x2, "mxfp8": torch.float8_e4m3fn}


def bench_quantize(shape, repeats: int) -> dict:
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    x = torch.randn(*shape)
    n = x.numel()
    out = {}
    for fmt, dt in TORCHAO_DTYPE.items():
        ours = lambda: quantize_mx(x, fmt, packed=True)  # noqa: E731
        theirs = lambda: to_mx(x, dt, 32)  # noqa: E731
        codes, scales = ours()
        ref_scales, ref_codes = theirs()
        exact = torch.equal(scales, ref_scales.view(torch.uint8)) and torch.equal(
            codes, ref_codes.view(torch.uint8)
        )
        p = paired(ours, theirs, repeats)
        out[fmt] = {
            "bit_exact_vs_torchao": exact,
            "ours_elements_per_s": n / p["a_median_s"],
            "torchao_to_mx_elements_per_s": n / p["b_median_s"],
            "speedup_vs_torchao_to_mx": p["ratio_median"],
            "speedup_range": [p["ratio_min"], p["ratio_max"]],
            "ours_median_s": p["a_median_s"],
            "torchao_median_s": p["b_median_s"],
        }
    return out


def bench_gemm(tokens: int, d_in: int, d_out: int, repeats: int) -> dict:
    x = torch.randn(tokens, d_in)
    w = torch.randn(d_out, d_in) * 0.02  # [out, in]; blocks run along the reduction dim
    flops = 2 * tokens * d_in * d_out
    out = {}
    for fmt in TORCHAO_DTYPE:
        codes, scales = quantize_mx(w, fmt, packed=True)
        dq_mm = lambda: x @ dequantize_mx(codes, scales, fmt).T  # noqa: E731
        mm = lambda: x @ w.T  # noqa: E731
        p = paired(dq_mm, mm, repeats)
        out[fmt] = {
            "weight_bytes_packed": codes.numel() * codes.element_size() + scales.numel(),
            "weight_bytes_fp32": w.numel() * 4,
            "dequant_matmul_gflops": flops / p["a_median_s"] / 1e9,
            "fp32_matmul_gflops": flops / p["b_median_s"] / 1e9,
            # throughput(dequant + matmul) / throughput(fp32 matmul); < 1 means dequant costs time
            "dequant_matmul_over_fp32_matmul": p["ratio_median"],
            "ratio_range": [p["ratio_min"], p["ratio_max"]],
        }
    return out


def bench_experts(tokens: int, n_experts: int, top_k: int, dim: int, ffn: int, repeats: int) -> dict:
    """Routed experts forward (grouped impl) from packed MXFP4 codes vs from fp32 weights; same router output."""
    from k3.model.moe import RoutedExperts
    from k3.quant.export import PackedRoutedExperts

    fp32 = RoutedExperts(n_experts, dim, ffn, init_std=0.02)
    packed = PackedRoutedExperts.from_experts(fp32, "mxfp4")
    cached = PackedRoutedExperts.from_experts(fp32, "mxfp4")
    cached.cache = True
    x = torch.randn(tokens, dim)
    experts = torch.rand(tokens, n_experts).topk(top_k, dim=-1).indices
    weights = torch.softmax(torch.randn(tokens, top_k), -1)
    with torch.no_grad():
        p = paired(lambda: packed(x, weights, experts), lambda: fp32(x, weights, experts), repeats)
        c = paired(lambda: cached(x, weights, experts), lambda: fp32(x, weights, experts), repeats)
    stored = sum(t.numel() for t in packed.packed_tensors())
    return {
        "shape": {"tokens": tokens, "experts": n_experts, "top_k": top_k, "dim": dim, "ffn": ffn},
        "weight_bytes_packed": stored,
        "weight_bytes_fp32": 4 * 3 * n_experts * dim * ffn,
        "bits_per_param": 8 * stored / (3 * n_experts * dim * ffn),
        # throughput ratios t(fp32 layer) / t(packed layer); < 1 means the packed layer is slower
        "packed_over_fp32": p["ratio_median"],
        "packed_over_fp32_range": [p["ratio_min"], p["ratio_max"]],
        "cached_over_fp32": c["ratio_median"],
        "fp32_median_s": p["b_median_s"],
        "packed_median_s": p["a_median_s"],
        "cached_median_s": c["a_median_s"],
    }


def bench_cuda_mx(tokens: int, d_in: int, d_out: int, repeats: int) -> dict:
    """Hardware MX GEMM where torch has one: MXFP8 operands, E8M0 scales, torch._scaled_mm (sm_100+)."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    cap = torch.cuda.get_device_capability()
    name = torch.cuda.get_device_name()
    if cap < (10, 0):
        return {"skipped": f"{name} is sm_{cap[0]}{cap[1]}; torch's MX block-scaled GEMMs need sm_100 or newer",
                "device": name}
    try:
        from torchao.prototype.mx_formats.mx_tensor import MXTensor
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

        x = torch.randn(tokens, d_in, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(d_out, d_in, device="cuda", dtype=torch.bfloat16) * 0.02

        # the weight is quantized once, as a deployed model stores it; the activation on every call, as inference
        # must (the GEMM alone, both operands quantized beforehand, is timed too)
        b = MXTensor.to_mx(w, torch.float8_e4m3fn, 32, kernel_preference=KernelPreference.AUTO)
        a_fixed = MXTensor.to_mx(x, torch.float8_e4m3fn, 32, kernel_preference=KernelPreference.AUTO)

        def mx_mm():
            a = MXTensor.to_mx(x, torch.float8_e4m3fn, 32, kernel_preference=KernelPreference.AUTO)
            out = torch.mm(a, b.t())
            torch.cuda.synchronize()
            return out

        def mx_gemm_only():
            out = torch.mm(a_fixed, b.t())
            torch.cuda.synchronize()
            return out

        def bf16_mm():
            out = x @ w.t()
            torch.cuda.synchronize()
            return out

        ref = bf16_mm().float()
        err = (mx_mm().float() - ref).norm() / ref.norm()
        p = paired(mx_mm, bf16_mm, repeats)
        g = paired(mx_gemm_only, bf16_mm, repeats)
        flops = 2 * tokens * d_in * d_out
        return {"device": name, "shape": [tokens, d_in, d_out], "relative_error_vs_bf16": float(err),
                "mxfp8_scaled_mm_tflops": flops / p["a_median_s"] / 1e12,
                "mxfp8_gemm_only_tflops": flops / g["a_median_s"] / 1e12,
                "bf16_mm_tflops": flops / p["b_median_s"] / 1e12,
                "mxfp8_over_bf16": p["ratio_median"], "mxfp8_gemm_only_over_bf16": g["ratio_median"],
                "what": "mxfp8_scaled_mm: the activation quantized per call, the weight once (stored MX); "
                        "gemm_only: both quantized beforehand"}
    except Exception as e:  # a torch/torchao without the kernel for this device: say so in the JSON
        return {"skipped": f"hardware MX path failed: {type(e).__name__}: {e}", "device": name}


def machine() -> dict:
    try:
        import torchao

        ao = torchao.__version__
    except Exception:  # pragma: no cover - torchao is a dev dependency
        ao = None
    return _machine(torchao=ao)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="small shapes, for smoke tests")
    ap.add_argument("--repeats", type=positive_int, default=None)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    quant_shape = (512, 1024) if args.quick else (4096, 4096)
    gemm = (512, 256, 256) if args.quick else (4096, 256, 1024)
    repeats = args.repeats or (5 if args.quick else 9)

    machine_before = machine()
    q = bench_quantize(quant_shape, repeats)
    g = bench_gemm(*gemm, repeats)
    e = bench_experts(256 if args.quick else 1024, 64, 8, 128, 256, repeats)
    cuda = bench_cuda_mx(*((1024, 1024, 1024) if args.quick else (8192, 8192, 8192)), repeats)
    result = {
        "benchmark": "mx",
        "quick": args.quick,
        "shapes": {
            "quantize": list(quant_shape),
            "block_size": 32,
            "gemm_x": [gemm[0], gemm[1]],
            "gemm_w": [gemm[2], gemm[1]],
        },
        "repeats": repeats,
        "quantize": q,
        "speedup_vs_torchao_to_mx": min(v["speedup_vs_torchao_to_mx"] for v in q.values()),
        "gemm": g,
        "dequant_matmul_over_fp32_matmul": g["mxfp4"]["dequant_matmul_over_fp32_matmul"],
        "experts": e,
        "cuda_hardware_mx": cuda,
        "definitions": {
            "speedup_vs_torchao_to_mx": "median over repeats of t(to_mx)/t(quantize_mx), min over formats",
            "dequant_matmul_over_fp32_matmul": "median over repeats of t(fp32 matmul)/t(dequant packed "
            "mxfp4 weight + matmul), i.e. a throughput ratio; < 1 means slower than fp32",
            "experts.packed_over_fp32": "median over repeats of t(fp32 routed experts)/t(the same experts run "
            "from packed MXFP4, dequantized every forward); mini shapes: 64 experts, top-8, dim 128, ffn 256",
        },
        "machine": machine_before,
        "loadavg_1m_after": loadavg(),
    }
    out_path = write_result(bench_out("mx", args.quick), result, args.json)
    if not args.json:
        for fmt, v in q.items():
            print(f"{fmt}: quantize {v['ours_elements_per_s'] / 1e6:.1f} M el/s vs to_mx "
                  f"{v['torchao_to_mx_elements_per_s'] / 1e6:.1f} M el/s -> "
                  f"{v['speedup_vs_torchao_to_mx']:.2f}x (bit exact: {v['bit_exact_vs_torchao']})")
        for fmt, v in g.items():
            print(f"{fmt}: dequant+matmul {v['dequant_matmul_gflops']:.1f} GFLOP/s vs fp32 "
                  f"{v['fp32_matmul_gflops']:.1f} GFLOP/s -> {v['dequant_matmul_over_fp32_matmul']:.2f}")
        print(f"routed experts from packed mxfp4 ({e['bits_per_param']:.2f} bits/param): "
              f"{e['packed_over_fp32']:.2f}x fp32 throughput, cached {e['cached_over_fp32']:.2f}x")
        print(f"cuda hardware MX: {cuda.get('skipped') or cuda}")
        print(f"wrote {out_path}")
    return result


if __name__ == "__main__":
    main()
