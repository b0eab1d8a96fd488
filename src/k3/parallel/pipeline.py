"""Pipeline stages over explicit send/recv, carrying the Block AttnRes sources between stages.

With Attention Residuals a stage boundary cannot pass one hidden state: every later sublayer mixes all
earlier *sources* (arXiv 2603.15031, sec. 3.2). What crosses the boundary before sublayer j is the AttnRes
state: with `attnres: full`, the embedding and every sublayer output so far (1 + j tensors [B, T, D]);
with `attnres: block`, the embedding, the finished block sums and the running partial sum of the open
block (1 + j // S + [j % S > 0] with S sublayers per block); with `none`, one residual stream. So the
bytes per micro-batch scale with the sources, not the layers, and Block AttnRes keeps them bounded by the
block count: the design's count is `k3.model.accounting.pipeline_sources` (AttnRes.n_sources(2 * layer)).

Schedule: GPipe (all micro-batch forwards, then the backwards in reverse). Each boundary message is a
small int64 header (source counts, AttnRes step, block start, B, T) and one stacked [n_sources, B, T, D]
tensor; gradients of that tensor travel back. The layer loop re-runs `K3Model.hidden_states` for a
range of layers (k3.model.transformer), so the model code stays free of parallelism.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from k3.model.attnres import AttnResState
from k3.parallel import comm

__all__ = ["stage_layers", "PipelineStage", "run_gpipe"]


def stage_layers(n_layers: int, n_stages: int) -> list[range]:
    """Contiguous layer ranges, as even as possible (earlier stages take the remainder)."""
    if n_stages < 1 or n_stages > n_layers:
        raise ValueError(f"pp = {n_stages} stages cannot split {n_layers} layers; use 1 <= pp <= {n_layers}")
    base, extra = divmod(n_layers, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


class PipelineStage:
    """One stage of a K3Model: layers `stage_layers(...)[stage]`, plus the embedding (first stage) or the
    final mix, norm and head (last stage). `ranks[s]` is the global rank running stage s."""

    def __init__(self, model, stage: int, n_stages: int, ranks: list[int] | None = None, group=None):
        if not 0 <= stage < n_stages:
            raise ValueError(f"stage {stage} is outside 0 .. {n_stages - 1}")
        self.model, self.stage, self.n_stages = model, stage, n_stages
        self.layers = stage_layers(len(model.layers), n_stages)[stage]
        self.ranks = list(ranks) if ranks is not None else list(range(n_stages))
        self.group = group
        self.first, self.last = stage == 0, stage == n_stages - 1
        self._sent: list[torch.Tensor] = []  # per micro-batch: the stacked sources sent downstream
        self._recv: list[torch.Tensor] = []  # per micro-batch: the received sources (leaf, requires grad)
        self.stage_bytes: list[int] = []  # payload bytes sent downstream per micro-batch

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """First stage: input_ids [B, T]. Returns logits [B, T, V] on the last stage, else None."""
        model, ar = self.model, self.model.attnres
        if self.first:
            if input_ids is None:
                raise ValueError("the first stage needs input_ids")
            state = ar.start(model.embed(input_ids))
        else:
            state = self._receive()
        for i in self.layers:
            block = model.layers[i]
            h = ar.mix(state, 2 * i)
            ar.push(state, 2 * i, block.mixer(block.attn_norm(h)))
            h = ar.mix(state, 2 * i + 1)
            ar.push(state, 2 * i + 1, block.ffn(block.ffn_norm(h)))
        if self.last:
            return model.head(model.norm(ar.final(state)))
        self._send(state)
        return None

    def _send(self, state: AttnResState) -> None:
        sources = state.completed + state.current
        payload = torch.stack(sources)  # [n_sources, B, T, D]
        B, T = state.shape[0], state.shape[1]
        header = torch.tensor([len(state.completed), len(state.current), state.step, state.block_start, B, T])
        dst = self.ranks[self.stage + 1]
        comm.send(header, dst, self.group, tag="pp_header")
        comm.send(payload.detach(), dst, self.group, tag="pp_activations")
        self.stage_bytes.append(payload.numel() * payload.element_size())
        self._sent.append(payload)

    def _receive(self) -> AttnResState:
        src = self.ranks[self.stage - 1]
        header = torch.empty(6, dtype=torch.long)
        comm.recv(header, src, self.group, tag="pp_header")
        n_completed, n_current, step, block_start, B, T = header.tolist()
        D = self.model.config.d_model
        dtype = self.model.embed.weight.dtype
        payload = torch.empty(n_completed + n_current, B, T, D, dtype=dtype)
        comm.recv(payload, src, self.group, tag="pp_activations")
        payload.requires_grad_(True)
        self._recv.append(payload)
        parts = list(payload.unbind(0))
        # phase-1 statistics of an open block are recomputed here from the received sources (exact)
        return AttnResState(completed=parts[:n_completed], current=parts[n_completed:], step=step,
                            block_start=block_start, stats=None, shape=(B, T, D))

    # ------------------------------------------------------------------ backward
    def backward(self, loss: torch.Tensor | None = None) -> None:
        """Backward of the oldest outstanding micro-batch: the last stage passes its loss; others receive
        the gradient of what they sent. Sends the gradient of the received sources upstream."""
        if self.last:
            if loss is None:
                raise ValueError("the last stage's backward needs the micro-batch loss")
            loss.backward()
        else:
            sent = self._sent.pop(0)
            grad = torch.empty_like(sent)
            comm.recv(grad, self.ranks[self.stage + 1], self.group, tag="pp_grads")
            torch.autograd.backward(sent, grad)
        if not self.first:
            received = self._recv.pop(0)
            g = received.grad if received.grad is not None else torch.zeros_like(received)
            comm.send(g, self.ranks[self.stage - 1], self.group, tag="pp_grads")


def run_gpipe(stage: PipelineStage, micro_inputs: list[torch.Tensor], micro_targets: list[torch.Tensor]) -> list:
    """GPipe forward+backward over micro-batches; returns per-micro-batch losses on the last stage (mean CE
    / n_micro each, so gradients equal one step on the concatenated batch), [] elsewhere."""
    n = len(micro_inputs)
    losses = []
    for m in range(n):
        logits = stage.forward(micro_inputs[m] if stage.first else None)
        if stage.last:
            y = micro_targets[m]
            losses.append(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1)) / n)
    for m in range(n):
        stage.backward(losses[m] if stage.last else None)
    return [float(l.detach()) for l in losses]
