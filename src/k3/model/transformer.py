"""The K3 model: embedding -> layers (KDA or Gated MLA, then dense MLP or LatentMoE) -> head.

Depth is mixed by Block Attention Residuals: every sublayer reads a learned softmax mix of earlier
representations (`AttnRes`), instead of a plain residual sum. Layer i's token mixer is chosen by the
config's layer pattern (K = KDA, M = Gated MLA); its channel mixer is a dense gated MLP (SiTU-GLU in K3) for the first
`n_dense_layers` layers and (Latent)MoE otherwise. Parallelism is applied from outside (k3.parallel).
"""
from __future__ import annotations

import torch
from torch import nn

from k3.config import KDA, K3Config
from k3.model.attnres import AttnRes
from k3.model.cache import HybridCache
from k3.model.kda import KimiDeltaAttention
from k3.model.mla import GatedMLA
from k3.ops.glu import glu_for
from k3.model.moe import GatedMLP, MoE
from k3.model.sampling import SamplingParams, sample_next
from k3.model.segments import Segments
from k3.model.qat import apply_linear_qat


class Block(nn.Module):
    """One K3 layer: pre-norm token mixer and pre-norm channel mixer. The residual wiring lives in AttnRes."""

    def __init__(self, config: K3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.kind = config.pattern[layer_idx]
        self.attn_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.mixer = (KimiDeltaAttention if self.kind == KDA else GatedMLA)(config, layer_idx)
        self.ffn_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.ffn = MoE(config) if config.is_moe_layer(layer_idx) else GatedMLP(config.d_model, config.dense_ffn, config.init_std, glu_for(config))


class K3Model(nn.Module):
    def __init__(self, config: K3Config):
        super().__init__()
        self.config = config.validate()
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.attnres = AttnRes(config)
        self.norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight
        if self.embed.weight.device.type != "meta":
            nn.init.normal_(self.embed.weight, std=config.init_std)
            if not config.tie_embeddings:
                nn.init.normal_(self.head.weight, std=config.init_std)
        apply_linear_qat(self, config)  # QAT of the other linears when config.qat has "linears"; else a no-op

    # ------------------------------------------------------------------ forward
    def new_cache(self) -> HybridCache:
        return HybridCache.for_config(self.config)

    def _check_ids(self, input_ids: torch.Tensor) -> None:
        """Token ids must lie in [0, vocab_size). On CPU a ValueError names the id; on an accelerator the check is
        an asynchronous device assert (no host sync per forward); inside torch.compile it is skipped."""
        V = self.config.vocab_size
        fix = "use the tokenizer the model was trained with (its vocab_size must match the config)"
        if not input_ids.numel() or input_ids.is_meta or torch.compiler.is_compiling():
            return
        if input_ids.device.type != "cpu":
            torch._assert_async(((input_ids >= 0) & (input_ids < V)).all(),
                                f"input_ids holds a token id outside the vocabulary [0, {V}); {fix}")
            return
        lo, hi = (int(v) for v in torch.aminmax(input_ids))
        if lo < 0 or hi >= V:
            raise ValueError(f"input_ids holds token id {lo if lo < 0 else hi}, outside the vocabulary [0, {V}); {fix}")

    def hidden_states(self, input_ids: torch.Tensor, cache: HybridCache | None = None,
                      doc_ids: torch.Tensor | None = None, doc_caches: list[HybridCache] | None = None) -> torch.Tensor:
        """input_ids [B, T] -> final normed hidden states [B, T, d_model]. `doc_ids` [B, T]: see `forward`.
        `doc_caches` (with doc_ids): one fresh cache per document, in row-major order, each filled as a prefill of
        its document alone would fill it (the engine's packed prefill of several prompts)."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 \
                or input_ids.dtype not in (torch.long, torch.int32, torch.int64):
            got = f"{tuple(input_ids.shape)} {input_ids.dtype}" if isinstance(input_ids, torch.Tensor) \
                else type(input_ids).__name__
            raise ValueError(f"input_ids must be an integer tensor [B, T], got {got}")
        if 0 in input_ids.shape:
            raise ValueError(f"input_ids is {tuple(input_ids.shape)}: need at least one sequence of at least one "
                             "token, [B, T] with B, T >= 1")
        self._check_ids(input_ids)
        if cache is not None and len(cache) != len(self.layers):
            raise ValueError(f"cache has {len(cache)} slots but the model has {len(self.layers)} layers; "
                             "make it with model.new_cache()")
        if cache is not None:
            cache.check(self.config, input_ids.shape[0])
        T = input_ids.shape[1]
        seen = cache.seen_tokens if cache is not None else 0
        if seen + T > self.config.max_context:
            raise ValueError(f"sequence of {seen + T} tokens exceeds max_context = {self.config.max_context}")
        segments = None
        if doc_ids is not None:
            if not isinstance(doc_ids, torch.Tensor) or tuple(doc_ids.shape) != tuple(input_ids.shape) \
                    or doc_ids.is_floating_point() or doc_ids.is_complex() or doc_ids.dtype == torch.bool:
                got = f"{tuple(doc_ids.shape)} {doc_ids.dtype}" if isinstance(doc_ids, torch.Tensor) \
                    else type(doc_ids).__name__
                raise ValueError(f"doc_ids must be an integer tensor shaped like input_ids {tuple(input_ids.shape)} "
                                 f"(one document label per token), got {got}")
            if cache is not None:
                raise ValueError("doc_ids with a cache: a cached sequence is one document; prefill each "
                                 "document with its own cache")
            segments = Segments.from_doc_ids(doc_ids.to(input_ids.device), self.config.kda_conv_size - 1)
            if doc_caches is not None:
                if len(doc_caches) != len(segments.runs) or any(len(c) != len(self.layers) or c.seen_tokens
                                                                for c in doc_caches):
                    raise ValueError(f"doc_caches must be {len(segments.runs)} fresh caches (one per document, from "
                                     "model.new_cache()), in the order the documents appear")
        elif doc_caches is not None:
            raise ValueError("doc_caches needs doc_ids: the documents the caches are for")
        x = self.embed(input_ids)
        ar = self.attnres
        state = ar.start(x)
        saved = None if cache is None else cache.snapshot()
        try:
            for i, block in enumerate(self.layers):
                h = ar.mix(state, 2 * i)
                if segments is not None:
                    slots = None if doc_caches is None else [c[i] for c in doc_caches]
                    y = block.mixer(block.attn_norm(h), segments=segments, doc_slots=slots)
                else:
                    y = block.mixer(block.attn_norm(h), cache=None if cache is None else cache[i])
                ar.push(state, 2 * i, y)
                h = ar.mix(state, 2 * i + 1)
                ar.push(state, 2 * i + 1, block.ffn(block.ffn_norm(h)))
        except BaseException:  # a layer failed (or Ctrl-C): the cache stays as it was, not half advanced
            if saved is not None:
                cache.restore(saved)
            raise
        for c, (_, s, e) in zip(doc_caches or [], segments.runs if segments is not None else []):
            c.seen_tokens = e - s
        if cache is not None:
            cache.seen_tokens += T
            if cache.row_tokens is not None:
                cache.row_tokens = [n + T for n in cache.row_tokens]
        return self.norm(ar.final(state))

    def forward(self, input_ids: torch.Tensor, cache: HybridCache | None = None,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, vocab]. With a cache, the tokens continue the cached sequence.
        doc_ids [B, T] (integers, no cache): the document of each token, for rows that pack several; no token
        sees another document's (KDA's state restarts, the short conv and MLA stop at each boundary), so each
        document's logits are those it gets alone (k3.model.segments)."""
        h = self.hidden_states(input_ids, cache) if doc_ids is None else self.hidden_states(input_ids, cache, doc_ids)
        return self.head(h)

    # ------------------------------------------------------------------ introspection
    def moe_layers(self) -> list[MoE]:
        return [b.ffn for b in self.layers if isinstance(b.ffn, MoE)]

    def aux_loss(self) -> torch.Tensor | float:
        """Sum of the routers' balance losses from the last forward (0 unless balancing = aux_loss)."""
        losses = [m.router.aux_loss for m in self.moe_layers() if getattr(m.router, "aux_loss", None) is not None]
        return torch.stack(losses).sum() if losses else 0.0

    def update_balancing(self) -> None:
        """Apply the routers' balancing updates (bias / quantile); call once per optimizer step."""
        for m in self.moe_layers():
            m.router.update_balancing()

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, generator: torch.Generator | None = None) -> torch.Tensor:
        """Minimal cached sampling loop: prefill once, then one token at a time. [B, T] -> [B, T + new]."""
        if not isinstance(input_ids, torch.Tensor):
            raise ValueError(f"input_ids must be an integer tensor [B, T], got {type(input_ids).__name__}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens = {max_new_tokens!r} is invalid: must be an integer >= 0")
        SamplingParams(max_tokens=1, temperature=temperature, top_p=top_p).validate()
        total = input_ids.shape[-1] + max(max_new_tokens - 1, 0)
        if total > self.config.max_context:
            raise ValueError(f"{input_ids.shape[-1]} prompt tokens + max_new_tokens = {max_new_tokens} need a "
                             f"context of {total} (the last token is not fed back), over max_context = "
                             f"{self.config.max_context}; lower max_new_tokens or shorten the prompt")
        cache = self.new_cache()
        logits = self(input_ids, cache)[:, -1]
        out = [input_ids]
        for i in range(max_new_tokens):
            nxt = sample_next(logits, temperature, top_p, generator)
            out.append(nxt)
            if i + 1 < max_new_tokens:  # the last token needs no forward of its own
                logits = self(nxt, cache)[:, -1]
        return torch.cat(out, dim=1)
