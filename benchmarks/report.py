"""Collate runs/bench/*.json into the measured table of docs/benchmarks.md.

Each benchmark script writes its own JSON; this script only reads them and rewrites the block between
the `<!-- bench:begin -->` and `<!-- bench:end -->` markers, so the prose around it stays hand-written.
Usage: python benchmarks/report.py [--bench-dir runs/bench] [--doc docs/benchmarks.md]
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from k3.fileio import atomic_write_text

# benchmark -> [(key path, label, target as text or "")]. Values come from runs/bench/NAME.json; a benchmark with no
# JSON there keeps the rows of the doc's current table, listed apart as carried over (see render).
HEADLINES = {
    "peaks": [
        ("fp32_gflops_1thread", "CPU fp32 2048^2 matmul GFLOP/s, 1 thread (the MFU rows divide by their own run's "
                                "`matmul_peak_gflops`, at that run's thread count)", ""),
        ("threads.2.fp32.median_gflops", "CPU fp32 2048^2 matmul GFLOP/s, 2 threads", ""),
        ("bf16_gflops_1thread", "CPU bf16 2048^2 matmul GFLOP/s, 1 thread", ""),
        ("bf16_over_fp32_1thread", "bf16 / fp32 matmul rate, 1 thread (host-dependent: AMX-bf16 here)", ""),
        ("threads.2.bf16_over_fp32", "bf16 / fp32 matmul rate, 2 threads", ""),
    ],
    "kda": [
        ("speedup_vs_fla_naive_chunk", "KDA chunk fwd vs fla naive_chunk_kda (B1 T4096 H4 K=V=128, typical gates "
                                       "g = logsigmoid(N(0,1)))", ">= 10x"),
        ("speedup_vs_fla_naive_recurrent", "KDA chunk fwd vs fla naive_recurrent_kda (typical gates)", ">= 4x"),
        ("strong_decay.speedup_vs_fla_naive_chunk", "KDA chunk fwd vs fla naive_chunk_kda, strong decay "
                                                    "g ~ -5 U(0,1) (smaller sub-chunks)", ">= 10x"),
        ("strong_decay.speedup_vs_fla_naive_recurrent", "KDA chunk fwd vs fla naive_recurrent_kda, strong decay",
         ">= 4x"),
        ("fwd_bwd_speedup_vs_fla_naive_chunk", "KDA chunk fwd+bwd vs fla naive_chunk_kda", ""),
        ("fwd_bwd_speedup_vs_fla_naive_recurrent", "KDA chunk fwd+bwd vs fla naive_recurrent_kda", ""),
        ("tokens_per_s.ours_chunk", "KDA chunk fwd tokens/s", ""),
        ("train_shape.init.speedup_auto_vs_c64", "KDA chunk fwd+bwd at mini's training shape (B8 T128 H4 K=V=64), "
                                                "freshly initialised gates: chunk size from the gates (8) vs 64", ""),
        ("train_shape.trained_like.speedup_auto_vs_c64", "same, gates as strong as a trained model's "
                                                        "(-12 U(0.5, 1.5)): chunk size 4 vs 64", ""),
        ("train_shape.typical.speedup_auto_vs_c64", "same, typical gates (both 64: noise)", ""),
    ],
    "kda-flush-denormal": [
        ("strong_decay.speedup_vs_fla_naive_chunk", "the same run with subnormal floats flushed to zero (both sides): "
                                                    "strong decay, vs fla naive_chunk_kda", ">= 10x"),
        ("strong_decay.speedup_vs_fla_naive_recurrent", "same, strong decay, vs fla naive_recurrent_kda", ">= 4x"),
        ("speedup_vs_fla_naive_recurrent", "same, typical gates, vs fla naive_recurrent_kda", ">= 4x"),
    ],
    "moe": [
        ("speedup_vs_loop", "MoE layer fwd+bwd, grouped vs per-expert loop (64 experts, top-8, 4096 tokens)", ">= 3x"),
        ("layer.forward.speedup_vs_loop", "MoE layer fwd, grouped vs per-expert loop", ""),
        ("fraction_of_matmul_peak", "MoE layer fwd+bwd, fraction of fp32 matmul peak", ""),
        ("layer.forward.fraction_of_matmul_peak", "MoE layer fwd, fraction of fp32 matmul peak", ""),
        ("small_batches.tokens_512.speedup_auto_vs_slices", "routed experts fwd+bwd at 512 tokens (mini's demo step): "
                                                             "the CPU's pick (grouped_mm) vs the slices loop", ""),
        ("small_batches.tokens_1024.speedup_auto_vs_slices", "same at 1024 tokens (the training benchmark's step)", ""),
    ],
    "mx": [
        ("quantize.mxfp4.speedup_vs_torchao_to_mx", "MXFP4 quantize vs torchao to_mx (4096x4096)", ">= 1x"),
        ("quantize.mxfp8.speedup_vs_torchao_to_mx", "MXFP8 quantize vs torchao to_mx", ">= 1x"),
        ("gemm.mxfp4.dequant_matmul_over_fp32_matmul", "packed MXFP4 dequant+matmul / fp32 matmul throughput", ""),
        ("experts.packed_over_fp32", "routed experts from packed MXFP4 / fp32 experts throughput (mini shapes)", ""),
    ],
    "qat": [
        ("settings.k3.ptq_degradation", "PTQ val loss - fp32, MXFP4 experts + MXFP8 activations (nats, seed mean)", ""),
        ("settings.k3.ptq_degradation_sem", "standard error of that mean (nats)", ""),
        ("settings.k3.recovery", "QAT recovery of that PTQ degradation (from the means; a ratio over a degradation "
                                 "within noise means nothing: the verdict row says whether it counts)", ""),
        ("settings.k3.verdict", "recovery target, K3's setting (met needs degradation > 2 SE)", "recovery >= 0.8"),
        ("settings.harsh.ptq_degradation", "PTQ val loss - fp32, all block linears W4A8 (nats, mean)", ""),
        ("settings.harshest.ptq_degradation", "PTQ val loss - fp32, all block linears W4A4 (nats, mean)", ""),
        ("settings.harshest.ptq_degradation_sem", "standard error of that mean (nats)", ""),
        ("settings.harshest.recovery", "QAT recovery of the W4A4 PTQ degradation", ">= 0.8"),
        ("settings.harshest.verdict", "recovery target, W4A4", "recovery >= 0.8"),
        ("settings.harshest_head.ptq_degradation", "PTQ val loss - fp32, W4A4 incl. output head (nats, mean)", ""),
        ("settings.harshest_head.ptq_degradation_sem", "standard error of that mean (nats)", ""),
        ("settings.harshest_head.recovery", "QAT recovery of the W4A4 + head PTQ degradation", ">= 0.8"),
        ("settings.harshest_head.verdict", "recovery target, W4A4 + head", "recovery >= 0.8"),
        ("seed_spread", "fp32 val loss, mean absolute difference between seeds (nats)", ""),
    ],
    "qat-harsh-start0.8": [
        ("settings.harsh.ptq_degradation", "PTQ val loss - fp32, all block linears W4A8 (nats, 8-seed mean)", ""),
        ("settings.harsh.qat_gap", "QAT (last 20% of the budget) val loss - fp32, same setting (nats)", ""),
        ("settings.harsh.recovery", "QAT recovery, all block linears W4A8", ">= 0.8"),
        ("settings.harsh.recovery_low", "same, QAT gap moved up by 2 SE", ""),
        ("settings.harsh_head.ptq_degradation", "PTQ val loss - fp32, every linear incl. head W4A8 (nats)", ""),
        ("settings.harsh_head.recovery", "QAT recovery, every linear incl. head W4A8", ">= 0.8"),
        ("settings.harsh_head.verdict", "recovery target, every linear W4A8", "recovery >= 0.8"),
    ],
    "qat-harsh-start0.9": [
        ("settings.harsh.qat_gap", "QAT (last 10% of the budget) val loss - fp32, all block linears W4A8 (nats, 8 seeds)", ""),
        ("settings.harsh.recovery", "QAT recovery, all block linears W4A8, QAT for the last 10%", ">= 0.8"),
    ],
    "qat-harsh-steps600-start0.8": [
        ("settings.harsh.recovery", "QAT recovery, all block linears W4A8, 600 steps (8 seeds)", ">= 0.8"),
        ("settings.harsh_head.recovery", "QAT recovery, every linear incl. head W4A8, 600 steps (8 seeds)", ">= 0.8"),
    ],
    "qat-mini-start0.8": [
        ("settings.harsh.ptq_degradation", "mini: PTQ val loss - fp32, all block linears W4A8 (nats, seed mean)", ""),
        ("settings.harsh.qat_gap", "mini: QAT (last 20% of the budget) val loss - fp32, same setting (nats)", ""),
        ("settings.harsh.recovery", "mini: QAT recovery, all block linears W4A8", ">= 0.8"),
        ("settings.harsh.recovery_low", "mini: same, QAT gap moved up by 2 SE", ""),
        ("settings.harsh_head.ptq_degradation", "mini: PTQ val loss - fp32, every linear incl. head W4A8 (nats)", ""),
        ("settings.harsh_head.qat_gap", "mini: QAT val loss - fp32, every linear incl. head W4A8 (nats)", ""),
        ("settings.harsh_head.recovery", "mini: QAT recovery, every linear incl. head W4A8", ">= 0.8"),
        ("settings.harsh_head.recovery_low", "mini: same, QAT gap moved up by 2 SE", ""),
        ("settings.harsh_head.verdict", "mini: recovery target, every linear W4A8", "recovery >= 0.8"),
        ("settings.k3.ptq_degradation", "mini: PTQ val loss - fp32, K3's setting (nats, seed mean)", ""),
    ],
    "qat-mini-start0.8-seeds8-15": [
        ("settings.harsh.ptq_degradation", "mini, new seeds 8-15: PTQ val loss - fp32, all block linears W4A8 (nats)", ""),
        ("settings.harsh.qat_gap", "mini, seeds 8-15: QAT (last 20%) val loss - fp32, same setting (nats)", ""),
        ("settings.harsh.recovery", "mini, seeds 8-15: QAT recovery, all block linears W4A8", ">= 0.8"),
        ("settings.harsh.verdict", "mini, seeds 8-15: recovery target, all block linears W4A8", "recovery >= 0.8"),
        ("settings.harsh_head.ptq_degradation", "mini, seeds 8-15: PTQ val loss - fp32, every linear W4A8 (nats)", ""),
        ("settings.harsh_head.qat_gap", "mini, seeds 8-15: QAT val loss - fp32, every linear W4A8 (nats)", ""),
        ("settings.harsh_head.recovery", "mini, seeds 8-15: QAT recovery, every linear incl. head W4A8", ">= 0.8"),
    ],
    "qat-mini-start0.8-seeds0-15": [
        ("settings.harsh.recovery", "mini, seeds 0-15 pooled: QAT recovery, all block linears W4A8", ">= 0.8"),
        ("settings.harsh.recovery_low", "mini, seeds 0-15 pooled: same, QAT gap moved up by 2 SE", ""),
        ("settings.harsh_head.recovery", "mini, seeds 0-15 pooled: QAT recovery, every linear incl. head W4A8", ">= 0.8"),
        ("settings.harsh_head.recovery_low", "mini, seeds 0-15 pooled: same, QAT gap moved up by 2 SE", ""),
    ],
    "qat-diagnose": [
        ("settings.harsh_head.recovery", "mini-s, seeds 0-3: QAT recovery, every linear incl. head W4A8", ">= 0.8"),
        ("settings.harsh_head.diagnosis.latent_gap", "same: QAT weights evaluated unquantized - fp32 (nats)", ""),
        ("settings.harsh_head.diagnosis.own_quant_cost", "same: QAT val loss - those weights unquantized (nats)", ""),
        ("settings.harsh_head.diagnosis.revert_share", "same: share of quantized-value changes that revert within 2 steps", ""),
        ("settings.harsh.recovery", "mini-s, seeds 0-3: QAT recovery, all block linears W4A8 (not replicated on seeds 16-23)", ">= 0.8"),
        ("settings.harsh.recovery_low", "same, QAT gap moved up by 2 SE", ""),
    ],
    "qat-diagnose-seeds16-23": [
        ("settings.harsh.recovery", "mini-s, new seeds 16-23: QAT recovery, all block linears W4A8", ">= 0.8"),
        ("settings.harsh.verdict", "same: recovery target (the replication of seeds 0-3)", "recovery >= 0.8"),
        ("settings.harsh_head.recovery", "mini-s, seeds 16-23: QAT recovery, every linear incl. head W4A8", ">= 0.8"),
    ],
    "qat-diagnose-pooled": [
        ("settings.harsh_head.diagnosis.latent_gap", "mini-s, 12 seeds, every linear W4A8: QAT weights unquantized - fp32 (nats)", ""),
        ("settings.harsh_head.diagnosis.own_quant_cost", "same: QAT val loss - those weights unquantized (nats)", ""),
        ("settings.harsh_head.ptq_degradation", "same: PTQ val loss - fp32 (nats)", ""),
        ("settings.harsh.diagnosis.own_quant_cost", "mini-s, 12 seeds, all block linears W4A8: QAT - its weights unquantized (nats)", ""),
        ("settings.harsh.ptq_degradation", "same: PTQ val loss - fp32 (nats)", ""),
    ],
    "qat-diagnose-kdaeps-seeds24-31": [
        ("fp32_val_loss_mean", "mini-s with kda_norm_eps 1e-4, seeds 24-31: fp32 val loss", ""),
        ("settings.harsh_head.ptq_degradation", "same, every linear W4A8: PTQ val loss - fp32 (nats)", ""),
        ("settings.harsh_head.qat_gap", "same: QAT (last 40 of 200 steps) val loss - fp32 (nats)", ""),
        ("settings.harsh_head.recovery", "same: recovery", ">= 0.8"),
        ("settings.harsh_head.diagnosis.latent_gap", "same: QAT weights unquantized - fp32 (nats)", ""),
        ("settings.harsh_head.diagnosis.own_quant_cost", "same: QAT val loss - those weights unquantized (nats)", ""),
    ],
    "qat-head-split": [
        ("settings.head_w4.ptq_degradation", "mini-s seeds 0-1 (current val split): PTQ of the head's weight alone in MXFP4 - fp32 (nats)", ""),
        ("settings.head_a8.ptq_degradation", "same: PTQ of the head's input alone in MXFP8 - fp32 (nats)", ""),
        ("settings.harsh_head.ptq_degradation", "same: PTQ of every linear W4A8 - fp32 (nats)", ""),
        ("settings.head_w4.recovery", "same: QAT (last 40 of 200 steps) recovery, head weight alone", ">= 0.8"),
        ("settings.harsh_head.recovery", "same: QAT recovery, every linear W4A8", ">= 0.8"),
    ],
    "qat-gptq-screen": [
        ("settings.harsh_head.ptq_degradation", "mini-s seeds 0-1, every linear W4A8: PTQ val loss - fp32 (nats)", ""),
        ("settings.harsh_head.gptq.ptq_degradation", "same, PTQ with GPTQ rounding (16 calibration batches) - fp32 (nats)", ""),
        ("settings.harsh_head.qat_gap", "same: QAT (last 40 of 200 steps) val loss - fp32 (nats)", ""),
        ("settings.harsh_head.gptq.qat_gap", "same: QAT, then GPTQ rounding - fp32 (nats)", ""),
        ("settings.harsh_head.gptq.recovery_vs_rtn_ptq", "same: QAT + GPTQ recovery against round-to-nearest PTQ", ">= 0.8"),
        ("settings.harsh.gptq.ptq_degradation", "same seeds, block linears W4A8: PTQ with GPTQ - fp32 (nats)", ""),
    ],
    "qat-gptq-head-loop-screen": [
        ("settings.harsh_head.gptq.ptq_degradation", "mini-s seeds 0-1, every linear W4A8: PTQ, head GPTQ-rounded (40 batches) - fp32 (nats)", ""),
        ("settings.harsh_head.gptq.qat_gap", "same: QAT trained through the GPTQ-rounded head - fp32 (nats)", ""),
        ("settings.harsh_head.gptq.recovery_vs_rtn_ptq", "same: recovery against round-to-nearest PTQ", ">= 0.8"),
    ],
    "qat-gptq-mini-screen": [
        ("settings.harsh_head.ptq_degradation", "mini (kda_norm_eps 1e-4) seeds 16-17, every linear W4A8: PTQ val loss - fp32 (nats)", ""),
        ("settings.harsh_head.recovery", "same: plain QAT (last 40 of 200 steps) recovery", ">= 0.8"),
        ("settings.harsh_head.gptq.ptq_recovery", "same: PTQ with GPTQ rounding, share of PTQ's cost removed", ""),
        ("settings.harsh_head.gptq.recovery_vs_rtn_ptq", "same: QAT, then GPTQ: recovery against round-to-nearest PTQ", ">= 0.8"),
    ],
    "qat-released-k3-seeds40-45": [
        ("fp32_val_loss_mean", "mini-s, the released forms, pre-registered seeds 40-45: fp32 val loss", ""),
        ("settings.k3.ptq_degradation", "same, K3's setting (MXFP4 expert weights, MXFP8 expert inputs): PTQ val "
                                        "loss - fp32 (nats)", ""),
        ("settings.k3.ptq_degradation_sem", "standard error of that PTQ cost (nats)", ""),
        ("settings.k3.qat_gap", "same: QAT (last 40 of 200 steps) val loss - fp32 (nats)", ""),
        ("settings.k3.verdict", "same: the pre-registered rule", "recovery >= 0.8"),
    ],
    "qat-mini-kdaeps-seeds18-25": [
        ("fp32_val_loss_mean", "mini (kda_norm_eps 1e-4), pre-registered seeds 18-25: fp32 val loss", ""),
        ("settings.harsh_head.ptq_degradation", "same, every linear W4A8: PTQ val loss - fp32 (nats)", ""),
        ("settings.harsh_head.qat_gap", "same: QAT (last 40 of 200 steps) val loss - fp32 (nats)", ""),
        ("settings.harsh_head.recovery", "same: recovery", ">= 0.8"),
        ("settings.harsh_head.recovery_low", "same, QAT gap moved up by 2 SE", ""),
        ("settings.harsh_head.verdict", "same: the pre-registered rule", "recovery >= 0.8"),
    ],
    "qat-gptq-mini-seeds26-33": [
        ("settings.harsh_head.ptq_degradation", "mini, pre-registered seeds 26-33, every linear W4A8: PTQ val loss - fp32 (nats)", ""),
        ("settings.harsh_head.gptq.ptq_degradation", "same: PTQ with GPTQ rounding (40 batches) - fp32 (nats)", ""),
        ("settings.harsh_head.gptq.qat_gap", "same: QAT (last 40 of 200 steps), then GPTQ - fp32 (nats)", ""),
        ("settings.harsh_head.gptq.recovery_vs_rtn_ptq", "same: QAT then GPTQ, recovery against round-to-nearest PTQ", ">= 0.8"),
        ("settings.harsh_head.gptq.recovery_vs_gptq_ptq", "same: recovery against GPTQ PTQ", "> 0"),
        ("settings.harsh_head.gptq.verdict_vs_rtn_ptq", "same: the pre-registered rule's first condition", "recovery >= 0.8"),
        ("settings.harsh_head.recovery", "same runs, plain QAT (round-to-nearest) recovery (secondary)", ">= 0.8"),
    ],
    "qat-kd0.5-harsh_head": [
        ("settings.harsh_head.kd_control_gain", "distillation alone (W=0.5) val loss - fp32, no quantization (nats)", ""),
        ("settings.harsh_head.recovery", "QAT-KD (W=0.5) recovery against fp32, every linear W4A8", ">= 0.8"),
        ("settings.harsh_head.recovery_vs_kd_control", "same, against the distillation control", ""),
    ],
    "forms": [
        ("released.val_bpb.mean", "mini, released forms (bounded full-rank-gated KDA, shared MLA key, SiTU, latent "
                                  "norm): validation bits/byte after 150 steps (3 seeds)", ""),
        ("earlier.val_bpb.mean", "same, k3's earlier forms (Kimi-Linear gates, no shared key, SwiGLU, no latent norm)",
         ""),
        ("released_minus_earlier.val_bpb.mean", "released - earlier, paired by seed (bits/byte)", ""),
        ("released_minus_earlier.val_bpb.sem", "standard error of that difference", ""),
        ("released.cost_no_routed.mean", "released forms: validation loss cost of zeroing every routed path (nats)", ""),
        ("earlier.cost_no_routed.mean", "earlier forms: the same cost (nats)", ""),
        ("released.min_log_decay.mean", "released forms: most negative per-token KDA log-decay of the trained gates", ""),
        ("earlier.min_log_decay.mean", "earlier forms: the same", ""),
        ("released.kda_share.mean", "released forms: KDA op fwd+bwd / whole training step", ""),
        ("earlier.kda_share.mean", "earlier forms: the same", ""),
        ("released.tokens_per_s.mean", "released forms: training tokens/s over the runs (1 thread, beside other "
                                       "jobs; forms-throughput below interleaves the two)", ""),
        ("earlier.tokens_per_s.mean", "earlier forms: the same", ""),
    ],
    "forms-throughput": [
        ("variants.released.tokens_per_s", "mini training tokens/s, released forms (steps interleaved with the "
                                           "earlier forms' on the same batches, 1 thread)", ""),
        ("variants.earlier.tokens_per_s", "same, earlier forms", ""),
        ("released_over_earlier_tokens_per_s", "released / earlier training tokens/s", ""),
    ],
    "forms-loo-a": [
        ("released_minus_released-no-kda_gate.val_bpb.mean", "mini seed 0, 150 steps: val bits/byte, released - "
                                                             "released with Kimi-Linear's unbounded gate", ""),
        ("released_minus_released-no-output_gate.val_bpb.mean", "same, - released with the earlier low-rank output "
                                                                "gate", ""),
        ("released_minus_released-no-mla_key.val_bpb.mean", "same, - released without the shared MLA key", ""),
    ],
    "forms-loo-b": [
        ("released_minus_released-no-situ.val_bpb.mean", "same, - released with SwiGLU instead of SiTU", ""),
        ("released_minus_released-no-latent_norm.val_bpb.mean", "same, - released without the latent norm", ""),
    ],
    "prefill_packed": [
        ("packed_over_one_at_a_time", "prefill of 8 prompts of 16-2048 tokens on mini: packed row vs one at a time "
                                      "(prompt tokens/s ratio, 1 thread)", ">= 2x"),
        ("packed_over_padded", "same, packed row vs one batch padded to the longest prompt", ""),
        ("tokens_per_s.packed", "packed prefill, prompt tokens/s", ""),
        ("fixed_cost_per_call_s", "one forward call's fixed cost (intercept of prefill time against prompt length, s)",
         ""),
        ("packing_bound", "the most packing can give here: one-at-a-time time over it less 7 calls' fixed cost", ""),
    ],
    "beam_prefill": [
        ("shared_speedup", "HF generate, 4 beams, 1024-token prompt on mini: prefill each distinct prompt once vs "
                           "every beam (time ratio, 1 thread)", ""),
    ],
    "doc_mask": [
        ("doc_mask.val_bpb_masked.mean", "mini, 120 steps x 8 x 256, 3 seeds: val bits/byte trained with document "
                                         "masking (k3 train's default), documents read alone", ""),
        ("no_doc_mask.val_bpb_masked.mean", "same, trained across document boundaries (--no-doc-mask)", ""),
        ("masked_minus_not.val_bpb_masked.mean", "paired difference masked - not (bits/byte)", ""),
        ("masked_minus_not.val_bpb_packed.mean", "same, both read across boundaries at evaluation", ""),
        ("step_time_ratio.mean", "training step time, masked / not (interleaved step by step)", ""),
        ("windows_with_a_boundary", "share of training windows holding a document boundary", ""),
    ],
    "stream": [
        ("experts_on_disk_bytes", "k3.load(experts='stream'), synthetic kimi_k3 shaped like K3 (896 experts, top-16, "
                                  "d 1024): MXFP4 routed-expert bytes on disk", ""),
        ("disk_over_budget", "experts on disk / RAM budget (4 GB)", ">= 3"),
        ("prefetch.tokens_per_s", "decode tokens/s, lookahead prefetch on", ""),
        ("predicted.tokens_per_s_prefetch", "the same, predicted by k3.plan.stream from the calibrated rates", ""),
        ("no_prefetch.tokens_per_s", "decode tokens/s, no prefetch", ""),
        ("predicted.tokens_per_s_no_prefetch", "the same, predicted", ""),
        ("predicted_over_measured.tokens_per_s_prefetch", "tokens/s predicted / measured, prefetch on", "0.75-1.25"),
        ("predicted_over_measured.tokens_per_s_no_prefetch", "tokens/s predicted / measured, no prefetch",
         "0.75-1.25"),
        ("prefetch_speedup", "tokens/s with prefetch / without (same run, blocks interleaved)", ""),
        ("no_prefetch.hit_rate", "expert cache hit rate, no prefetch (plan: cache / experts on disk)", ""),
        ("predicted.hit_rate", "the same, predicted", ""),
        ("prefetch.hit_rate", "expert cache hit rate, prefetch on", ""),
        ("no_prefetch.bytes_read_per_token", "bytes read from disk per token, no prefetch", ""),
        ("no_prefetch.disk_read_gbps", "disk read throughput of those reads (GB/s; page cache dropped)", ""),
        ("lookahead_measured", "share of missed experts the lookahead router guessed", ""),
        ("peak_rss_gb", "peak RSS of the streamed run (GB; limit: budget + trunk)", "< rss_limit_gb"),
    ],
    "convert": [
        ("source_bytes", "k3 export --format kimi, synthetic kimi_k3 (K3's forms, d 2048, 16 layers): source bytes "
                         "(6.42 GB of them MXFP4 routed experts)", ""),
        ("peak_rss_gb", "peak RSS of the export (GB; target: under 2 GB plus one layer)", "< 2.51"),
        ("export_s", "export wall time (s), reading and writing every tensor once", ""),
        ("throughput_gb_s", "bytes read + written per second (GB/s)", ""),
        ("tensors_compared_bit_exact", "tensors of the first and last MoE layer compared with the source, bit-exact",
         ""),
    ],
    "moe_contrib": [
        ("val_loss.mean", "mini-s, 200 steps: val loss (seed mean)", ""),
        ("cost_no_routed.mean", "mini-s, 200 steps: val loss without the routed experts - with them (nats, seed mean)", ""),
        ("cost_no_routed.sem", "standard error of that mean (nats)", ""),
        ("cost_no_shared.mean", "mini-s, 200 steps: val loss without the shared expert - with it (nats, seed mean)", ""),
        ("routed_rms_over_input", "mini-s: routed-path output RMS / MoE input RMS", ""),
        ("shared_rms_over_input", "mini-s: shared-expert output RMS / MoE input RMS", ""),
    ],
    "moe_contrib-steps600": [
        ("cost_no_routed.mean", "mini-s, 600 steps: val loss without the routed experts - with them (nats)", ""),
        ("cost_no_shared.mean", "mini-s, 600 steps: val loss without the shared expert - with it (nats)", ""),
    ],
    "moe_contrib-routed_scale2.827": [
        ("val_loss.mean", "mini-s, 200 steps, routed_scale 2.827 (k3's, mini has 1.0): val loss (seed mean)", ""),
        ("cost_no_routed.mean", "same model: val loss without the routed experts - with them (nats)", ""),
    ],
    "moe_contrib-no_shared": [
        ("val_loss.mean", "mini-s, 200 steps, no shared expert: val loss (seed mean)", ""),
        ("cost_no_routed.mean", "same model: val loss without the routed experts - with them (nats)", ""),
    ],
    "moe_contrib-one_latent": [
        ("cost_no_routed.mean", "mini-s, 200 steps, one routed expert top-1 in latent space, no shared: cost of removing it (nats)", ""),
    ],
    "moe_contrib-one_standard": [
        ("cost_no_routed.mean", "same, one routed expert at full width (moe=standard): cost of removing it (nats)", ""),
    ],
    "moe_contrib-mini": [
        ("cost_no_routed.mean", "mini, 200 steps: val loss without the routed experts - with them (nats)", ""),
        ("cost_no_shared.mean", "mini, 200 steps: val loss without the shared expert - with it (nats)", ""),
        ("routed_rms_over_input", "mini: routed-path output RMS / MoE input RMS", ""),
        ("shared_rms_over_input", "mini: shared-expert output RMS / MoE input RMS", ""),
    ],
    "stability-kda_norm_eps": [
        ("summary.v0.val_loss_mean", "mini, 200 steps, KDA output norm eps 1e-6: val loss (4 seeds, 16 batches)", ""),
        ("summary.v1.val_loss_mean", "same, eps 1e-4 (`kda_norm_eps` default): val loss", ""),
        ("summary.v1.minus_reference.mean", "eps 1e-4 - eps 1e-6, paired by seed (nats)", ""),
        ("summary.v1.minus_reference.sem", "standard error of that difference (nats)", ""),
        ("summary.v0.spike_steps_total", "steps with grad norm > 10 before clipping, eps 1e-6 (all seeds)", ""),
        ("summary.v1.spike_steps_total", "same, eps 1e-4", ""),
    ],
    "balancing": [
        ("methods.none.load_max_over_mean", "expert load max/mean over the last 40 of 200 steps, no balancing", ""),
        ("methods.aux_loss.load_max_over_mean", "same, aux loss, coefficient 1e-4 (the config default)", ""),
        ("methods.aux_loss@1e-2.load_max_over_mean", "same, aux loss, coefficient 1e-2", ""),
        ("methods.bias.load_max_over_mean", "same, aux-loss-free bias, gamma 1e-3 (DeepSeek-V3's; a bias moves at "
                                            "most 0.2 in 200 steps)", ""),
        ("methods.bias@1e-2.load_max_over_mean", "same, aux-loss-free bias, gamma 1e-2", ""),
        ("methods.quantile.load_max_over_mean", "same, Quantile Balancing as released (histogram, 1000 bins over "
                                                "[min b - 1, max b + 1]; no step size)", ""),
        ("methods.quantile@100.load_max_over_mean", "same, Quantile Balancing, histogram of 100 bins", ""),
        ("methods.quantile_exact.load_max_over_mean", "same, Quantile Balancing, exact quantile by sorting (k3's "
                                                      "earlier form)", ""),
        ("methods.none.final_loss", "final train loss (mean of the last 20 steps), no balancing (nats)", ""),
        ("methods.aux_loss@1e-2.final_loss", "same, aux loss 1e-2", ""),
        ("methods.bias@1e-2.final_loss", "same, bias gamma 1e-2", ""),
        ("methods.quantile.final_loss", "same, Quantile Balancing (histogram, 1000 bins)", ""),
        ("methods.quantile_exact.final_loss", "same, Quantile Balancing (exact)", ""),
    ],
    "sandbox": [
        ("overhead_ms_per_episode", "sandbox overhead per verified episode vs plain subprocess (ms)", "<= 50"),
        ("overhead_ms_per_episode_cold_verifier", "same, verifier sandbox not pre-started (ms)", ""),
        ("start_teardown_ms.bwrap", "bubblewrap start + teardown (ms)", ""),
        ("episodes_per_s.bwrap", "verified episodes/s, 2 workers", ""),
    ],
    "decode": [
        ("decode_speedup_vs_all_mla_256k", "decode step at 256k context, all-MLA time / hybrid time (long preset)", ">= 3x"),
        ("cache_ratio_vs_all_mla_256k", "cache bytes at 256k context, hybrid / all-MLA", "<= 0.3"),
        ("hybrid_tokens_per_s_256k", "hybrid decode tokens/s at 256k context (batch 1)", ""),
        ("all_mla_tokens_per_s_256k", "all-MLA decode tokens/s at 256k context (batch 1)", ""),
        ("engine_over_dense_decode_b1", "k3 engine decode tokens/s / an equal-active HF Llama's, mini, batch 1",
         ">= 0.8"),
        ("engine_over_dense_decode_b8", "same, batch 8", ""),
    ],
    "decode_peer": [
        ("engine_over_dense_decode_b1", "k3 engine decode tokens/s / an equal-active HF Llama's, mini, batch 1",
         ">= 0.8"),
        ("engine_over_dense_decode_b8", "same, batch 8", ""),
        ("batches.1.k3_engine_tokens_per_s", "k3 engine decode tokens/s, mini, batch 1, 1 thread", ""),
        ("batches.1.llama_tokens_per_s", "HF Llama (16.46M, d 256 x 8) decode tokens/s, batch 1, 1 thread", ""),
        ("batches.8.k3_engine_tokens_per_s", "k3 engine decode tokens/s, mini, batch 8", ""),
        ("batches.8.llama_tokens_per_s", "HF Llama decode tokens/s, batch 8", ""),
    ],
    "long_context": [
        ("tokens", "tokens prefilled (chunked) through the long preset on CPU", ">= 1048576"),
        ("cache_rel_error", "cache bytes vs predicted, relative error", "<= 0.01"),
        ("rss_growth_over_cache", "RSS growth during prefill / cache bytes", "~1"),
        ("peak_rss_gib", "peak RSS (GiB)", ""),
        ("prefill_s", "prefill time (s)", ""),
        ("decode_ms_per_token", "decode ms/token after the prefill", ""),
    ],
    "serve_load": [
        ("tokens_per_s", "k3 serve tiny, 8 streaming clients, completion tokens/s", ""),
        ("speedup_vs_max_batch_1", "k3 serve tokens/s, continuous batching (8) / max_batch 1", ""),
        ("latency_p50_s", "k3 serve request latency p50 (s; batched server, 48 requests)", ""),
        ("latency_p99_s", "k3 serve request latency p99 (s; of 48 requests this is the slowest)", ""),
        ("ttft_p50_s", "k3 serve time to first token p50 (s; batched server)", ""),
        ("ttft_p99_s", "k3 serve time to first token p99 (s; of 48 requests the slowest)", ""),
        ("errors", "k3 serve errors below the queue bound", "0"),
        ("overload.other_errors", "k3 serve non-429 errors at 2x the queue bound", "0"),
        ("engine_only.speedup_vs_max_batch_1", "in-process engine tokens/s, batch 8 / batch 1 (no HTTP)", ""),
    ],
    "serve_prefix": [
        ("ttft_p50_speedup", "mini, 8 agent sessions x 6 turns, 4,096-token shared system prompt: time to first token "
                             "p50, prefix cache off / on (1 thread)", ">= 5x"),
        ("ttft_p99_speedup", "same, time to first token p99, off / on", ""),
        ("on.ttft_p50_s", "time to first token p50 with the prefix cache (s)", ""),
        ("off.ttft_p50_s", "time to first token p50 without it (s)", ""),
        ("on.ttft_p99_s", "time to first token p99 with the prefix cache (s)", ""),
        ("off.ttft_p99_s", "time to first token p99 without it (s)", ""),
        ("throughput_speedup", "completion tokens/s, prefix cache on / off", ""),
        ("on.completion_tokens_per_s", "completion tokens/s with the prefix cache", ""),
        ("prefill_tokens_saved", "share of prompt tokens not prefilled with the prefix cache", ""),
        ("replies_identical", "greedy replies identical with the cache on and off", "True"),
        ("single.ttft_speedup", "one session's second turn alone (4,320 tokens, 4,192 cached): time to first token "
                                "off / on", ""),
        ("fork.speedup", "n = 8 completions of one 4,096-token prompt: forked prefill vs 8 prefills, time to the "
                         "last first token", ""),
    ],
    "ep": [
        ("latent_payload_ratio", "EP all-to-all bytes/token/MoE layer, LatentMoE / standard MoE (mini, 2 ranks)", "0.5"),
        ("bytes_per_token_per_moe_layer.latent.forward", "LatentMoE EP bytes/token/MoE layer, forward (fp32)", ""),
        ("rank_load_max_over_mean_before", "EP rank load max/mean on Zipf routing, contiguous experts (hot "
                                           "experts all on rank 0: the worst case)", ""),
        ("rank_load_max_over_mean_shuffled", "same batch, experts in one random order over the ranks", ""),
        ("rank_load_max_over_mean_random_order_median", "expected, median over 200 random orders", ""),
        ("rank_load_max_over_mean_after", "EP rank load max/mean on Zipf routing, EPLB placement + replicas", "<= 1.1"),
        ("block_over_full_stage_bytes", "pipeline stage bytes per micro-batch, Block / Full AttnRes (tiny, 2 stages)", "= sources ratio"),
    ],
    "train": [
        ("tokens_per_s", "mini training tokens/s (fp32 CPU)", ""),
        ("mfu", "mini training MFU vs measured fp32 matmul peak", ">= 0.20"),
        ("bf16_over_fp32_step", "mini step, bf16 autocast / fp32 speed (1 thread, batch 8 x 128, interleaved pairs)",
         ">= 1.4"),
        ("bf16_matmul_over_fp32", "2048^2 matmul, bf16 / fp32 rate (same run, 1 thread)", ""),
    ],
    "train_precision_val": [
        ("precision_val.summary.fp32.mean", "mini validation loss after 200 steps, fp32 (nats/token, mean of seeds "
                                            "0-2)", ""),
        ("precision_val.summary.bf16.mean", "the same, bf16 autocast", ""),
        ("precision_val.summary.bf16_minus_fp32_mean", "bf16 - fp32 (mean over seeds)", ""),
        ("precision_val.summary.within_seed_spread", "difference within the larger seed std", "True"),
    ],
    "peers": [
        ("best.k3.val_bpb", "k3 mini, validation bits/byte after the per-run budget at its best lr of the sweep (the "
                            "demo's data, batch, schedule, document masking and validation tokens)", ""),
        ("best.llama.val_bpb", "HF Llama of mini's active parameter count, same data, loop, budget and tokens: "
                               "bits/byte at its best lr", ""),
        ("k3_minus_llama_bpb", "k3 mini - Llama, best against best (bits/byte; negative: k3 ahead)", ""),
        ("best.k3.lr", "k3 mini's best peak lr of the sweep", ""),
        ("best.llama.lr", "the Llama's best peak lr of the sweep", ""),
        ("best.k3.tokens_per_s", "k3 mini training tokens/s (that run)", ""),
        ("best.llama.tokens_per_s", "Llama training tokens/s (that run)", ""),
        ("llama_over_k3_tokens_per_s", "Llama / k3 mini training tokens/s", ""),
    ],
    "cpu_step": [
        ("over_fast.neither", "mini training step without / with the fused SiTU and the allocator tuning (demo shape "
                              "8 x 128, 2 threads, fp32, one Trainer, variants in turn)", ""),
        ("over_fast.ref_glu", "same, composed SiTU / fused (allocator tuned in both)", ""),
        ("over_fast.default_alloc", "same, glibc's default allocator / tuned (fused SiTU in both)", ""),
        ("step_s.fast", "that step with both fixes (s)", ""),
        ("glu_op.composed_over_fused", "SiTU forward + backward on [8192, 256], composed / fused time", ""),
    ],
    "demo_sweep": [
        ("best.val_bpb_fixed", "k3 demo, best point of the lr x batch x precision sweep: validation bits/byte "
                               "(scored on batch-4 windows, the same tokens for every point)", "<= 1.70"),
        ("best.val_bpb_end", "the same point, the demo's own figure (its batch's windows)", ""),
        ("best.lr", "that point's peak lr", ""),
        ("best.batch_size", "that point's batch size", ""),
        ("best.precision", "that point's precision", ""),
        ("best.steps", "that point's steps in the budget", ""),
    ],
    "demo_sweep_prec": [
        ("points.lr0.002-b8-bf16.val_bpb_end", "k3 demo at its defaults (lr 2e-3, batch 8) in bf16: validation "
                                               "bits/byte in the 10 minutes", "<= 1.70"),
        ("points.lr0.002-b8-fp32.val_bpb_end", "the same in fp32, run next to it", ""),
        ("points.lr0.002-b8-bf16.steps", "bf16's steps in the budget", ""),
        ("points.lr0.002-b8-fp32.steps", "fp32's steps in the budget", ""),
    ],
    "gpu": [
        ("peaks.bf16_matmul_tflops", "GPU bf16 8192^3 matmul TFLOP/s (the ceiling for the rows below)", ""),
        ("peaks.fp32_matmul_tflops", "GPU fp32 8192^3 matmul TFLOP/s (tf32 off)", ""),
        ("peaks.copy_tb_per_s", "GPU device-to-device copy TB/s (read + write)", ""),
        ("moe_speed.mini_layer.speedup_vs_loop", "GPU MoE layer fwd+bwd bf16, grouped vs per-expert loop (mini, 4096 tokens)", ">= 3x"),
        ("moe_speed.k3_width_experts.grouped.fwd_bwd_tflops", "GPU routed experts fwd+bwd TFLOP/s at k3 widths (32 experts, top-4)", ""),
        ("kda_check.dispatch_default.o_rel_err", "GPU fla Triton chunk_kda fp32 output vs fp64 naive recurrence (rel; fla's dots use TF32)", "<= 5e-3"),
        ("kda_speed.B8_T8192_H16_K128_V128.fla_triton_over_k3_torch_fwd_bwd.bfloat16", "GPU KDA fwd+bwd, k3 torch chunk time / fla Triton time (B8 T8192 H16, bf16 inputs; k3 computes in fp32/TF32, fla in bf16)", ""),
        ("model_check.tiny_prefill_decode_vs_full_rel", "GPU tiny prefill + decode vs full forward, logits (rel)", "<= 5e-3"),
        ("train_step.tokens_per_s", "GPU mini training tokens/s (Trainer, bf16 autocast, AdamW, batch 16 x 1024)", ""),
    ],
    "rl_probe": [
        ("patterns.KKKM.condition.over_chance", "tiny KKKM from scratch: answer loss / chance, class marker 20 tokens back", ""),
        ("patterns.MKKK.condition.over_chance", "tiny MKKK: the same conditioning probe", ""),
        ("patterns.KKKM.copy.over_chance", "tiny KKKM: answer loss / chance, copy 4 digits from 11 tokens back", ""),
        ("patterns.MKKK.copy.over_chance", "tiny MKKK: the same copy probe", ""),
        ("patterns.MMMM.copy.over_chance", "tiny MMMM (all Gated MLA): the same copy probe", ""),
    ],
}


def lookup(d: dict, path: str):
    """d's value at a dotted path; a key that itself holds dots (a sweep point named `lr0.002-b8-bf16`) matches
    whole, the longest such key first."""
    if not path:
        return d
    if not isinstance(d, dict):
        return None
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        key = ".".join(parts[:i])
        if key in d:
            v = lookup(d[key], ".".join(parts[i:]))
            if v is not None:
                return v
    return None


def fmt(v) -> str:
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        return f"{v:,.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def machine_line(d: dict) -> str:
    m = d.get("machine", {})
    bits = [str(m.get(k)) for k in ("platform", "cpu_count", "cpus", "cuda") if m.get(k) is not None]
    torch_v = d.get("torch") or m.get("torch")
    if torch_v:
        bits.append(f"torch {torch_v}")
    return ", ".join(bits)


def previous(block: str) -> tuple[dict, dict]:
    """The rows and machine line per benchmark of the table now in the doc."""
    rows, machines = {}, {}
    for line in block.splitlines():
        if line.startswith("| ") and not line.startswith(("| benchmark ", "|---")):
            rows.setdefault(line.split("|")[1].strip(), []).append(line)
        elif line.startswith("- `"):
            machines[line[3:].split("`", 1)[0]] = line
    return rows, machines


KEPT = "[earlier run, no JSON kept]"  # the label prefix of a row carried over from the doc's own table


def _kept_rows(name: str, lines: list[str]) -> list[str]:
    """An earlier run's rows of a benchmark with no JSON here: its measured values, under today's labels and
    targets (a row whose key is no longer a headline is dropped), so a changed definition reaches them too."""
    defined = {key: (label, target) for key, label, target in HEADLINES.get(name, [])}
    out = []
    for line in lines:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        m = re.search(r"\(`([^`]+)`\)$", cells[1]) if len(cells) == 4 else None
        if m and m.group(1) in defined:
            label, target = defined[m.group(1)]
            label = f"{KEPT} {label}"
            out.append(f"| {name} | {label} (`{m.group(1)}`) | {cells[2]} | {target} |")
    return out


def render(bench_dir: Path, old_block: str = "") -> str:
    """The table from runs/bench/*.json; a benchmark without a JSON here keeps its rows from `old_block`
    (the doc's current table), so that a partial rerun never drops figures measured earlier."""
    header = ["| benchmark | measure | value | target |", "|---|---|---:|---|"]
    rows, kept = list(header), []
    machines = []
    old_rows, old_machines = previous(old_block)
    have = {p.stem for p in bench_dir.glob("*.json")}
    # machine lines are kept also for runs with no rows of their own: docs quote figures from them
    for name in sorted(have | (set(old_rows) & set(HEADLINES)) | set(old_machines)):
        if name not in have:
            kept.extend(_kept_rows(name, old_rows.get(name, [])))
            if name in old_machines:
                line = old_machines[name]
                machines.append(line if line.endswith("(earlier run)") else f"{line} (earlier run)")
            continue
        d = json.loads((bench_dir / f"{name}.json").read_text())
        for key, label, target in HEADLINES.get(name, []):
            v = lookup(d, key)
            if v is not None:
                rows.append(f"| {name} | {label} (`{key}`) | {fmt(v)} | {target} |")
        if machine_line(d):
            machines.append(f"- `{name}`: {machine_line(d)}")
    if kept:  # apart from the measured table: these values cannot be checked against a file
        rows += ["", "Carried over from earlier runs whose JSON files were not kept (the values as measured then, "
                 "under today's labels and targets; they cannot be checked against a file):", "", *header, *kept]
    return "\n".join(rows + ["", "Machines as recorded in each JSON:"] + machines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench-dir", default="runs/bench", type=Path)
    ap.add_argument("--doc", default="docs/benchmarks.md", type=Path)
    args = ap.parse_args()
    if not any(args.bench_dir.glob("*.json")):
        raise SystemExit(f"no benchmark JSON in {args.bench_dir}; run `make bench` first")
    text = args.doc.read_text()
    begin, end = "<!-- bench:begin -->", "<!-- bench:end -->"
    if begin not in text or end not in text:
        raise SystemExit(f"{args.doc} lacks the {begin} / {end} markers")
    head, rest = text.split(begin, 1)
    old, tail = rest.split(end, 1)
    new = f"{head}{begin}\n{render(args.bench_dir, old)}\n{end}{tail}"
    atomic_write_text(args.doc, new)
    print(f"updated {args.doc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
