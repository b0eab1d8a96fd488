"""Long-context probe: needle retrieval (associative recall) at increasing lengths, all-KDA vs 3:1 vs all-MLA.

The claim (Kimi Linear, arXiv 2510.26692): KDA layers carry history in a fixed-size state and the periodic MLA
layers retrieve exactly from the whole context, so retrieval from far back should separate all-KDA from models
with MLA layers as the context grows. An episode of length L: every key once as a *pair token* (key, value) at a
random position among filler tokens, then SEP and the keys as queries in random order; the target is the blank
token except at the queries. Models train at `train_len` and are evaluated at every `eval_lengths` entry, the
longer ones putting the needles behind more filler than training showed. Why pair tokens and blank targets:
docs/ablations.md ("What is compared", "Design notes from building the probe").
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from k3.config import KDA, MLA, K3Config, get_config

BLANK, SEP = 0, 1
_PROBE_SALT = 0x70B3  # keeps the probe's streams apart from the text datasets'


@dataclass(frozen=True)
class RecallTask:
    n_keys: int = 8
    n_values: int = 8
    n_filler: int = 16

    @property
    def filler0(self) -> int:
        return 2

    @property
    def pair0(self) -> int:
        return self.filler0 + self.n_filler

    @property
    def query0(self) -> int:
        return self.pair0 + self.n_keys * self.n_values

    @property
    def value0(self) -> int:
        return self.query0 + self.n_keys

    @property
    def vocab_size(self) -> int:
        return self.value0 + self.n_values

    def min_length(self) -> int:
        return 2 * self.n_keys + 1

    def episodes(self, rng: np.random.Generator, batch_size: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) LongTensors [batch_size, length]; y is the value at query positions and BLANK elsewhere."""
        # the suite's plan (`plan_runs`) refuses lengths that cannot hold the needles and their queries
        assert length >= self.min_length(), f"probe length {length} is too short for {self.n_keys} needles"
        K, context = self.n_keys, length - 1 - self.n_keys
        x = np.empty((batch_size, length), dtype=np.int64)
        y = np.full((batch_size, length), BLANK, dtype=np.int64)
        for b in range(batch_size):
            values = rng.integers(0, self.n_values, K)
            x[b, :context] = self.filler0 + rng.integers(0, self.n_filler, context)
            at = np.sort(rng.choice(context, K, replace=False))
            x[b, at] = self.pair0 + np.arange(K) * self.n_values + values
            x[b, context] = SEP
            order = rng.permutation(K)
            x[b, context + 1:] = self.query0 + order
            y[b, context + 1:] = self.value0 + values[order]
        return torch.from_numpy(x), torch.from_numpy(y)


class RecallData:
    """The trainer's dataset interface over endless synthetic episodes: get_batch is a pure function of
    (seed, step), so runs are resumable and every architecture sees the same episodes."""

    def __init__(self, task: RecallTask):
        self.task = task
        self.vocab_size = task.vocab_size

    def __len__(self) -> int:
        return 1 << 40  # endless: every step draws fresh episodes

    def get_batch(self, step: int, batch_size: int, seq_len: int, seed: int = 0):
        rng = np.random.default_rng(np.random.SeedSequence([int(seed), int(step), _PROBE_SALT]))
        return self.task.episodes(rng, batch_size, seq_len)


def oracle_answers(task: RecallTask, x: torch.Tensor) -> torch.Tensor:
    """The reference solver: scan each sequence, remember every pair token, answer each query. [B, L] -> [B, L]
    (BLANK where no query)."""
    out = torch.full_like(x, BLANK)
    for b in range(x.shape[0]):
        memory = {}
        for t, tok in enumerate(x[b].tolist()):
            if task.pair0 <= tok < task.query0:
                key, value = divmod(tok - task.pair0, task.n_values)
                memory[key] = value
            elif task.query0 <= tok < task.value0 and tok - task.query0 in memory:
                out[b, t] = task.value0 + memory[tok - task.query0]
    return out


@torch.no_grad()
def recall_accuracy(model: torch.nn.Module, task: RecallTask, length: int, batches: int, batch_size: int,
                    seed: int = 12345) -> float:
    """Fraction of queries whose argmax prediction is the needle's value, on fixed evaluation episodes."""
    was = model.training
    model.eval()
    rng = np.random.default_rng(np.random.SeedSequence([seed, length, _PROBE_SALT]))
    hits = total = 0
    try:
        for _ in range(batches):
            x, y = task.episodes(rng, batch_size, length)
            pred = model(x).argmax(-1)
            q = y != BLANK
            hits += int((pred[q] == y[q]).sum())
            total += int(q.sum())
    finally:
        model.train(was)
    return hits / total


def probe_patterns(n_layers: int) -> dict[str, str]:
    """all-KDA, the Kimi Linear 3:1 rule (every 4th and the last layer MLA), all-MLA."""
    hybrid = get_config("tiny", n_layers=n_layers, attnres_sources=2).pattern
    return {"all-KDA": KDA * n_layers, "3:1": hybrid, "all-MLA": MLA * n_layers}


def probe_config(settings, pattern: str) -> K3Config:
    """A small dense K3 model for the probe: no MoE (the probe isolates sequence mixing), block AttnRes."""
    task = RecallTask(settings.n_keys, settings.n_values, settings.n_filler)
    n = settings.n_layers
    return get_config("tiny").replace(
        name="probe", vocab_size=task.vocab_size, d_model=settings.d_model, n_layers=n,
        layer_pattern=pattern, n_dense_layers=n, dense_ffn=2 * settings.d_model, attnres_sources=3 if n >= 2 else 2,
        max_context=max(max(settings.eval_lengths), settings.train_len), init_std=settings.init_std,
    )


def task_of(settings) -> RecallTask:
    return RecallTask(settings.n_keys, settings.n_values, settings.n_filler)
