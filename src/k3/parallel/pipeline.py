"""Pipeline stages over explicit send/recv, carrying the Block AttnRes sources between stages.

With Attention Residuals a stage boundary cannot pass one hidden state: later sublayers mix every earlier
source, so what crosses it is the AttnRes state, a small int64 header and one stacked [n_sources, B, T, D] tensor
whose gradient travels back (`k3.model.accounting.pipeline_sources` counts the sources). A stage runs
`K3Model.hidden_states`' layer loop over its range, so the model stays free of parallelism; the schedule is GPipe.
`prune_to_stage` keeps what a stage runs under the whole model's parameter names (checkpoints are layout-free);
the AttnRes parameters stay on every stage and their gradients are summed over stages (`stage_shared_params`).
Why, and the bytes: docs/distributed.md ("Pipeline stages and Block AttnRes", "Pipeline training").
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3.model.attnres import AttnResState
from k3.model.segments import Segments
from k3.parallel import comm

__all__ = ["stage_layers", "StageLayers", "prune_to_stage", "stage_shared_params", "PipelineStage", "run_gpipe"]

HEADER = 6  # n_completed, n_current, AttnRes step, block start, B, T



def check_tied_stages(config, n_stages: int) -> None:
    """Tied embeddings cannot be split over pipeline stages: one matrix would live on the first and the last."""
    if config.tie_embeddings and n_stages > 1:
        raise ValueError("tie_embeddings shares one matrix between the first stage (embedding) and the last "
                         "(head), which pipeline training does not reduce across stages; use --pp 1 or "
                         "--set tie_embeddings=false")

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


class StageLayers(nn.Module):
    """A stage's blocks under their global layer indices: parameter names stay `layers.<i>....` as in the
    whole model. Iterates over the blocks in order; `[i]` takes global layer i."""

    def __init__(self, blocks: dict[int, nn.Module]):
        super().__init__()
        for i, b in sorted(blocks.items()):
            self.add_module(str(i), b)

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, i: int) -> nn.Module:
        if str(i) not in self._modules:
            raise IndexError(f"layer {i} is not on this pipeline stage (it holds layers {list(self._modules)})")
        return self._modules[str(i)]


class _Elsewhere(nn.Module):
    """Stands in for a module that another pipeline stage holds (no parameters)."""

    def __init__(self, what: str):
        super().__init__()
        self.what = what

    def forward(self, *args, **kwargs):
        raise ValueError(f"{self.what} lives on another pipeline stage")


def prune_to_stage(model, stage: int, n_stages: int) -> range:
    """Keep only what stage `stage` of `n_stages` runs (in place): its layers, the embedding on the first
    stage, the final norm and head on the last, the AttnRes parameters on all. Returns the layer range.
    The settings are checked before (`k3.parallel.train.check_parallel_settings`: --pp, tied embeddings)."""
    assert 0 <= stage < n_stages, f"stage {stage} is outside 0 .. {n_stages - 1}"
    assert not isinstance(model.layers, StageLayers), "the model is already pruned to a pipeline stage"
    layers = stage_layers(model.config.n_layers, n_stages)[stage]
    model.layers = StageLayers({i: model.layers[i] for i in layers})
    if stage > 0:
        model.embed = _Elsewhere("the embedding")
    if stage < n_stages - 1:
        model.norm, model.head = _Elsewhere("the final norm"), _Elsewhere("the output head")
    return layers


def stage_shared_params(model) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) held by every stage: the AttnRes pseudo-queries and key norms."""
    return [(n, p) for n, p in model.named_parameters() if n.startswith("attnres.")]


class PipelineStage:
    """One stage of a K3Model: layers `stage_layers(...)[stage]`, plus the embedding (first stage) or the
    final mix, norm and head (last stage). `ranks[s]` is the global rank running stage s.

    The model's forward becomes this stage's (first stage: input_ids [B, T]; others: the received sources
    [n, B, T, D] and their header), so that module hooks (FSDP2) run around it."""

    def __init__(self, model, stage: int, n_stages: int, ranks: list[int] | None = None, group=None):
        assert 0 <= stage < n_stages, f"stage {stage} is outside 0 .. {n_stages - 1}"
        self.model, self.stage, self.n_stages = model, stage, n_stages
        self.layers = stage_layers(model.config.n_layers, n_stages)[stage]
        self.ranks = list(ranks) if ranks is not None else list(range(n_stages))
        self.group = group
        self.first, self.last = stage == 0, stage == n_stages - 1
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        self._sent: list[torch.Tensor] = []  # per micro-batch: the stacked sources sent downstream
        self._recv: list[torch.Tensor] = []  # per micro-batch: the received sources (leaf, requires grad)
        self._aux: list = []  # per micro-batch: this stage's routers' balance loss (or 0.0)
        self.stage_bytes: list[int] = []  # payload bytes sent downstream per micro-batch
        model.forward = self._run

    # ------------------------------------------------------------------ forward
    def _run(self, x: torch.Tensor, header: list[int] | None = None, doc_ids: torch.Tensor | None = None):
        """The stage's layers: x is input_ids [B, T] (first stage) or the sources [n, B, T, D]. Returns
        logits [B, T, V] (last stage) or (sources [n', B, T, D], header of the state they form)."""
        model, ar = self.model, self.model.attnres
        if self.first:
            state = ar.start(model.embed(x))
        else:
            n_completed, n_current, step, block_start, B, T = header
            parts = list(x.unbind(0))
            # phase-1 statistics of an open block are recomputed from the received sources (exact)
            state = AttnResState(completed=parts[:n_completed], current=parts[n_completed:], step=step,
                                 block_start=block_start, stats=None, shape=(B, T, x.shape[-1]))
        segments = None if doc_ids is None else Segments.from_doc_ids(doc_ids, model.config.kda_conv_size - 1)
        for i in self.layers:
            block = model.layers[i]
            h = ar.mix(state, 2 * i)
            y = block.mixer(block.attn_norm(h)) if segments is None else block.mixer(block.attn_norm(h), segments=segments)
            ar.push(state, 2 * i, y)
            h = ar.mix(state, 2 * i + 1)
            ar.push(state, 2 * i + 1, block.ffn(block.ffn_norm(h)))
        if self.last:
            return model.head(model.norm(ar.final(state)))
        B, T = state.shape[0], state.shape[1]
        return torch.stack(state.completed + state.current), [len(state.completed), len(state.current), state.step,
                                                               state.block_start, B, T]

    def forward(self, input_ids: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """First stage: input_ids [B, T]. Returns logits [B, T, V] on the last stage, else None. `doc_ids` [B, T]:
        the documents of a packed batch (see K3Model.forward), given to every stage."""
        if self.first:
            assert input_ids is not None, "the first stage needs input_ids"
            out = self.model(input_ids, doc_ids=doc_ids)
        else:
            out = self.model(*self._receive(), doc_ids=doc_ids)
        aux = self.model.aux_loss()
        self._aux.append(aux if isinstance(aux, torch.Tensor) and aux.requires_grad else None)
        if self.last:
            return out
        self._send(*out)
        return None

    def _send(self, payload: torch.Tensor, header: list[int]) -> None:
        dst = self.ranks[self.stage + 1]
        comm.send(torch.tensor(header, dtype=torch.long, device=self.device), dst, self.group, tag="pp_header")
        comm.send(payload.detach(), dst, self.group, tag="pp_activations")
        self.stage_bytes.append(payload.numel() * payload.element_size())
        self._sent.append(payload)

    def _receive(self) -> tuple[torch.Tensor, list[int]]:
        src = self.ranks[self.stage - 1]
        header = torch.empty(HEADER, dtype=torch.long, device=self.device)
        comm.recv(header, src, self.group, tag="pp_header")
        n_completed, n_current, _, _, B, T = header.tolist()
        payload = torch.empty(n_completed + n_current, B, T, self.model.config.d_model, dtype=self.dtype,
                              device=self.device)
        comm.recv(payload, src, self.group, tag="pp_activations")
        payload.requires_grad_(True)
        self._recv.append(payload)
        return payload, header.tolist()

    # ------------------------------------------------------------------ backward
    def backward(self, loss: torch.Tensor | None = None, aux_scale: float = 1.0) -> None:
        """Backward of the oldest outstanding micro-batch: the last stage passes its loss; others receive
        the gradient of what they sent. This stage's routers' balance loss (x aux_scale) joins in. Sends
        the gradient of the received sources upstream."""
        aux = self._aux.pop(0)
        outputs, grads = [], []
        if aux is not None:
            outputs.append(aux * aux_scale)
            grads.append(None)
        if self.last:
            assert loss is not None, "the last stage's backward needs the micro-batch loss"
            outputs.append(loss)
            grads.append(None)
        else:
            sent = self._sent.pop(0)
            grad = torch.empty_like(sent)
            comm.recv(grad, self.ranks[self.stage + 1], self.group, tag="pp_grads")
            outputs.append(sent)
            grads.append(grad)
        torch.autograd.backward(outputs, grads)
        if not self.first:
            received = self._recv.pop(0)
            g = received.grad if received.grad is not None else torch.zeros_like(received)
            comm.send(g, self.ranks[self.stage - 1], self.group, tag="pp_grads")


def run_gpipe(stage: PipelineStage, micro_inputs: list, micro_targets: list, on_forward=None,
              micro_docs: list | None = None) -> list:
    """GPipe forward+backward over micro-batches; returns per-micro-batch losses on the last stage (mean CE
    / n_micro each, so gradients equal one step on the concatenated batch), [] elsewhere. Routers' balance
    losses count 1 / n_micro each, as in the single-process step. `on_forward(m)` runs after micro-batch
    m's forward (e.g. to read the routers' loads). `micro_docs`: each micro-batch's document ids (every stage
    masks at the same boundaries)."""
    n = len(micro_inputs)
    losses = []
    for m in range(n):
        logits = stage.forward(micro_inputs[m] if stage.first else None,
                               doc_ids=None if micro_docs is None else micro_docs[m])
        if on_forward is not None:
            on_forward(m)
        if stage.last:
            y = micro_targets[m]
            losses.append(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1)) / n)
    for m in range(n):
        stage.backward(losses[m] if stage.last else None, aux_scale=1.0 / n)
    return [float(l.detach()) for l in losses]
