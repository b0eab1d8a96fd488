"""Load balancing on a small MoE stack: none vs aux_loss vs bias vs quantile, same data, same seed.

    python benchmarks/balancing.py [--json] [--steps N] [--quick] [--aux-coef C] [--methods none,bias@1e-2,...]

Quantile Balancing runs in both estimators: `quantile` is the release's (Megatron-LM PR #6637: histograms of
r = alpha - s, 1000 bins over [min b - 1, max b + 1]; `quantile@N` for N bins), `quantile_exact` k3's earlier
one (the quantile by sorting, exact in one process).

Task: next-token prediction on a first-order Markov chain over a Zipf-skewed vocabulary: after token t the
next token is succ[t] (a fixed random map) with probability 1/2, else a draw from Zipf(1.1). Frequent
tokens dominate the batches, so a freshly initialised router already sends them to "their" experts and the
load starts skewed. The best achievable loss is the chain's conditional entropy, reported as `loss_floor`.

Model: learnable embedding -> L x (x + MoE(RMSNorm(x))) -> RMSNorm -> linear readout; every MoE is
`k3.model.moe.MoE` (LatentMoE, one shared expert), trained with AdamW. After every optimizer step the
routers' `update_balancing()` runs, as the trainer does. Per method we report the final loss (mean of the
last 10% of steps), the load imbalance max/mean (tokens of the busiest expert over the average; 1.0 is
perfect), averaged over the last 20% of steps and over layers, and the wall time. Writes
runs/bench/balancing.json atomically.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from k3.config import get_config
from k3.model.moe import MoE
from k3.benchtools import bench_out, machine, write_result, positive_int

METHODS = ("none", "aux_loss", "bias", "quantile", "quantile_exact")
# the default runs: each method at the config's default (bias: DeepSeek-V3's gamma 1e-3; aux: 1e-4, DeepSeek-V3's
# coefficient for its complementary sequence-wise loss), and the two tunable ones at a stronger setting too, since
# 200 steps of gamma 1e-3 move a bias by at most 0.2 (a short run handicaps them at the defaults)
DEFAULT_RUNS = "none,aux_loss,aux_loss@1e-2,bias,bias@1e-2,quantile,quantile@100,quantile_exact"
KNOB = {"aux_loss": "aux_loss_coef", "bias": "bias_update_rate", "quantile": "quantile_bins"}


class MarkovZipf:
    """Tokens from a Markov chain whose marginal is Zipf-skewed; `floor` is its conditional entropy (nats)."""

    def __init__(self, vocab: int, follow: float = 0.5, zipf_s: float = 1.1, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
        self.zipf = (ranks ** -zipf_s) / (ranks ** -zipf_s).sum()
        self.succ = torch.randperm(vocab, generator=g)
        self.P = (1 - follow) * self.zipf.expand(vocab, vocab).clone()
        self.P[torch.arange(vocab), self.succ] += follow  # P[t, u] = p(next = u | current = t)
        pi = self.zipf.clone()  # stationary distribution by power iteration
        for _ in range(200):
            pi = pi @ self.P
        self.pi = pi
        self.floor = float(-(pi[:, None] * self.P * self.P.clamp_min(1e-300).log()).sum())
        self.follow = follow

    def batch(self, b: int, t: int, g: torch.Generator) -> torch.Tensor:
        """[b, t + 1] token ids: each step follows succ w.p. `follow`, else an independent Zipf draw."""
        cdf = self.zipf.cumsum(0)
        z = torch.searchsorted(cdf, torch.rand(b, t + 1, generator=g, dtype=torch.float64)).clamp_(max=len(cdf) - 1)
        follow = torch.rand(b, t + 1, generator=g) < self.follow
        x = torch.empty(b, t + 1, dtype=torch.long)
        x[:, 0] = torch.multinomial(self.pi.float(), b, replacement=True, generator=g)
        for i in range(t):
            x[:, i + 1] = torch.where(follow[:, i + 1], self.succ[x[:, i]], z[:, i + 1])
        return x


class MoEStack(nn.Module):
    def __init__(self, cfg, n_layers: int):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.norms = nn.ModuleList(nn.RMSNorm(cfg.d_model) for _ in range(n_layers))
        self.moes = nn.ModuleList(MoE(cfg) for _ in range(n_layers))
        self.norm = nn.RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        nn.init.normal_(self.embed.weight, std=1.0)
        nn.init.normal_(self.head.weight, std=cfg.init_std)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for norm, moe in zip(self.norms, self.moes):
            x = x + moe(norm(x))
        return self.head(self.norm(x))


def parse_run(spec: str) -> tuple[str, float | None]:
    """'bias' or 'bias@1e-2' (the method at another aux_loss_coef / bias_update_rate / quantile_bins) ->
    (method, value)."""
    method, _, value = spec.partition("@")
    if method not in METHODS or (value and method not in KNOB):
        raise ValueError(f"{spec!r}: use one of {', '.join(METHODS)}, or {' / '.join(KNOB)}@VALUE")
    try:
        if value and method == "quantile":
            if int(value) < 2:
                raise ValueError
            return method, int(value)
        return method, (float(value) if value else None)
    except ValueError:
        raise ValueError(f"{spec!r}: {value!r} is not a number") from None


def train(spec: str, cfg, batches: list, steps: int, n_layers: int, batch: int, seq: int, lr: float) -> dict:
    torch.manual_seed(0)
    method, value = parse_run(spec)
    estimator = {"quantile_exact": dict(balancing="quantile", quantile_estimator="exact"),
                 "quantile": dict(quantile_estimator="histogram")}.get(method, {})
    cfg = cfg.replace(**{"balancing": method, **estimator}, **({KNOB[method]: value} if value is not None else {}))
    model = MoEStack(cfg, n_layers)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses, imbalance = [], []
    t0 = time.perf_counter()
    for step in range(steps):
        ids = batches[step]
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1))
        total = loss
        if method == "aux_loss":
            total = total + sum(m.router.aux_loss for m in model.moes)
        opt.zero_grad(set_to_none=True)
        total.backward()
        opt.step()
        for m in model.moes:
            m.router.update_balancing()
        losses.append(loss.item())
        imbalance.append([(m.router.last_load.max() / m.router.last_load.float().mean()).item() for m in model.moes])
    wall = time.perf_counter() - t0
    tail_loss = losses[-max(1, steps // 10):]
    tail_imb = imbalance[-max(1, steps // 5):]
    per_layer = [statistics.mean(row[i] for row in tail_imb) for i in range(n_layers)]
    return {
        "final_loss": statistics.mean(tail_loss),
        "load_max_over_mean": statistics.mean(per_layer),
        "load_max_over_mean_per_layer": per_layer,
        "load_max_over_mean_first_step": statistics.mean(imbalance[0]),
        "loss_curve": [round(statistics.mean(losses[i:i + max(1, steps // 10)]), 4)
                       for i in range(0, steps, max(1, steps // 10))],
        "imbalance_curve": [round(statistics.mean(statistics.mean(r) for r in imbalance[i:i + max(1, steps // 10)]), 3)
                            for i in range(0, steps, max(1, steps // 10))],
        "bias_abs_max": max(m.router.bias.abs().max().item() for m in model.moes),
        **({KNOB[method]: getattr(cfg, KNOB[method])} if method in KNOB else {}),
        "wall_s": wall,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--steps", type=positive_int, default=200)
    ap.add_argument("--quick", action="store_true", help="30 steps, for a smoke test")
    ap.add_argument("--aux-coef", type=float, default=None, help="override aux_loss_coef (config default 1e-4)")
    ap.add_argument("--methods", default=DEFAULT_RUNS,
                    help=f"comma-separated runs: a method ({', '.join(METHODS)}), or aux_loss@COEF / bias@GAMMA "
                         f"(default {DEFAULT_RUNS})")
    ap.add_argument("--threads", type=positive_int, default=1,
                    help="torch threads (default 1: these ops are small, and on a shared CPU extra threads "
                         "mostly wait at barriers)")
    args = ap.parse_args(argv)
    for spec in args.methods.split(","):
        try:
            parse_run(spec)
        except ValueError as e:
            ap.error(f"--methods: {e}")
    torch.set_num_threads(args.threads)
    steps = 30 if args.quick else args.steps
    vocab, n_layers, batch, seq, lr = 512, 2, 16, 128, 3e-3
    over = dict(vocab_size=vocab, d_model=64, moe_latent_dim=32, n_experts=16, n_active_experts=2,
                expert_ffn=64, n_shared_experts=1, shared_ffn=64)
    if args.aux_coef is not None:
        over["aux_loss_coef"] = args.aux_coef
    cfg = get_config("tiny", **over)
    data = MarkovZipf(vocab)
    g = torch.Generator().manual_seed(1)
    batches = [data.batch(batch, seq, g) for _ in range(steps)]  # the same batches for every method
    results = {}
    for method in args.methods.split(","):
        results[method] = train(method, cfg, batches, steps, n_layers, batch, seq, lr)
        if not args.json:
            r = results[method]
            print(f"{method:14s} loss {r['final_loss']:.4f}  load max/mean {r['load_max_over_mean']:.2f} "
                  f"(step 0: {r['load_max_over_mean_first_step']:.2f})  {r['wall_s']:.0f} s")
    out = {
        "benchmark": "balancing",
        "steps": steps,
        "setup": {"vocab": vocab, "layers": n_layers, "batch": batch, "seq": seq, "tokens_per_step": batch * seq,
                  "lr": lr, "optimizer": "AdamW", "d_model": cfg.d_model, "latent_dim": cfg.latent_dim,
                  "n_experts": cfg.n_experts, "top_k": cfg.n_active_experts, "expert_ffn": cfg.expert_ffn,
                  "bias_update_rate": cfg.bias_update_rate, "aux_loss_coef": cfg.aux_loss_coef,
                  "data": "Markov chain, succ[t] w.p. 1/2 else Zipf(1.1)", "seed": 0},
        "loss_floor": data.floor,
        "unigram_entropy": float(-(data.pi * data.pi.clamp_min(1e-300).log()).sum()),
        "methods": results,
        "machine": machine(),
    }
    out_path = write_result(bench_out("balancing", args.quick), out, args.json)
    if not args.json:
        print(f"loss floor (conditional entropy) {data.floor:.4f}; wrote {out_path}")
    return out


if __name__ == "__main__":
    main()
