"""HF transformers integration: `K3HFConfig`, `K3ForCausalLM`, tokenizer export, checkpoint conversion.

    import k3.io.hf                      # registers model_type "k3" with AutoConfig / AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)   # a PreTrainedTokenizerFast with k3's special tokens
    out = model.generate(**tok("def f(x):", return_tensors="pt"), max_new_tokens=32)

The model wraps `k3.model.transformer.K3Model` unchanged (weights are stored under `model.`), so an HF
directory and a k3 checkpoint hold the same tensors. Generation uses k3's hybrid cache rather than a
`transformers.DynamicCache`: KDA layers keep a constant-size recurrent state and MLA layers a latent cache,
neither of which is a per-layer (key, value) pair. `K3ForCausalLM` therefore declines HF's default cache
(as HF's own recurrent models do); `generate()` starts from an empty `K3GenerationCache` (a HybridCache with
the members generate reads) and threads it from step to step. The forward takes it as `cache=` (transformers
5's name; `past_key_values=` is an alias), starts one itself when called with `use_cache` and none, and
returns it in `outputs.cache`. Batches must be unpadded (all-ones attention mask): a padded position would
enter the KDA state.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import (AutoConfig, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel,
                          PreTrainedTokenizerFast)
from transformers.modeling_outputs import CausalLMOutputWithPast

from k3.config import K3Config
from k3.data.tokenizer import RESERVED_TOKENS, SPECIAL_TOKENS, Tokenizer, load_tokenizer
from k3.data.chat import CHAT_TEMPLATE, STOP_TOKENS
from k3.fileio import atomic_dir, loads_json, pid_alive, writer_pid
from k3.model.cache import HybridCache, KDACache, MLACache
from k3.model.moe import Router
from k3.model.transformer import K3Model

log = logging.getLogger(__name__)

MODEL_TYPE = "k3"
K3_FIELDS = tuple(f.name for f in dataclasses.fields(K3Config))
BOS, EOS, PAD = (SPECIAL_TOKENS.index(t) for t in ("<|bos|>", "<|eos|>", "<|pad|>"))


# ---------------------------------------------------------------------- config
class K3HFConfig(PretrainedConfig):
    """Every `K3Config` field as a flat attribute (config.json carries all of them), plus HF's common names
    (`hidden_size`, `num_hidden_layers`, ...) mapped onto k3's. `to_k3()` gives back the validated K3Config."""

    model_type = MODEL_TYPE
    attribute_map = {
        "hidden_size": "d_model",
        "num_hidden_layers": "n_layers",
        "max_position_embeddings": "max_context",
        "num_attention_heads": "mla_heads",
        "tie_word_embeddings": "tie_embeddings",
    }

    def __init__(self, bos_token_id: int | None = BOS, eos_token_id: int | None = EOS,
                 pad_token_id: int | None = PAD, use_cache: bool = True, **kwargs):
        k3 = {name: kwargs.pop(name) for name in K3_FIELDS if name in kwargs}
        for name in [k for k in kwargs if k in self.attribute_map]:
            k3.setdefault(self.attribute_map[name], kwargs.pop(name))
        cfg = K3Config.from_dict(k3)  # validates: a bad config.json fails here, naming the field
        super().__init__(**kwargs)
        for name in K3_FIELDS:
            setattr(self, name, getattr(cfg, name))
        self.bos_token_id, self.eos_token_id, self.pad_token_id = bos_token_id, eos_token_id, pad_token_id
        self.use_cache = use_cache

    @classmethod
    def from_k3(cls, config: K3Config, **kwargs) -> "K3HFConfig":
        return cls(**config.to_dict(), **kwargs)

    def to_k3(self) -> K3Config:
        return K3Config.from_dict({name: getattr(self, name) for name in K3_FIELDS})

    def to_diff_dict(self) -> dict:
        # Every k3 field is written, default or not, so a saved model does not change when k3's defaults do.
        d = super().to_diff_dict()
        d.update(self.to_k3().to_dict())
        return d


# ---------------------------------------------------------------------- cache
class K3GenerationCache(HybridCache):
    """k3's HybridCache with the few members `transformers.generate` reads from a cache object."""

    is_compileable = False  # shapes grow every step (MLA latents), so no static-shape compilation
    is_croppable = False    # a KDA state cannot be rolled back by dropping tokens

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        reorder_cache(self, beam_idx)


def reorder_cache(cache: HybridCache, beam_idx: torch.LongTensor) -> None:
    """Beam search: row b of every state becomes row beam_idx[b] (all states are [B, ...])."""
    for slot in cache.slots:
        if isinstance(slot, KDACache):
            slot.conv_state = None if slot.conv_state is None else slot.conv_state.index_select(0, beam_idx)
            slot.state = None if slot.state is None else slot.state.index_select(0, beam_idx)
        elif isinstance(slot, MLACache) and slot.latent is not None:
            slot.latent = slot.latent.index_select(0, beam_idx)
            if getattr(slot, "key_mask", None) is not None:  # rows merged from caches of different lengths
                slot.key_mask = slot.key_mask.index_select(0, beam_idx)


# ---------------------------------------------------------------------- model
class K3ForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = K3HFConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    _tied_weights_keys = {"model.head.weight": "model.embed.weight"}  # only used when tie_word_embeddings

    def __init__(self, config: K3HFConfig):
        super().__init__(config)
        self.model = K3Model(config.to_k3())
        self.post_init()

    @classmethod
    def from_k3(cls, model: K3Model, **config_kwargs) -> "K3ForCausalLM":
        """Wrap an existing K3Model (its tensors are shared, not copied)."""
        config = K3HFConfig.from_k3(model.config, **config_kwargs)
        with torch.device("meta"):
            hf = cls(config)
        hf.model = model
        return hf

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # a DynamicCache cannot hold KDA states; see _prepare_cache_for_generation

    def generate(self, *args, **kwargs):
        """transformers' generate(), refusing up front the modes that roll the cache back (a KDA state cannot drop
        tokens): assisted / prompt-lookup decoding failed inside transformers with an AttributeError."""
        config = kwargs.get("generation_config") or self.generation_config
        asked = [name for name, on in (
            ("assistant_model", kwargs.get("assistant_model") is not None),
            ("prompt_lookup_num_tokens", kwargs.get("prompt_lookup_num_tokens",
                                                    getattr(config, "prompt_lookup_num_tokens", None)) is not None),
            ("assistant_early_exit", kwargs.get("assistant_early_exit",
                                                getattr(config, "assistant_early_exit", None)) is not None)) if on]
        if asked:
            raise ValueError(f"{', '.join(asked)}: assisted and prompt-lookup decoding drop rejected tokens from the "
                             "cache, which a KDA state cannot undo; generate without them (greedy, sampling and beam "
                             "search work)")
        return super().generate(*args, **kwargs)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, *args, **kwargs) -> None:
        """generate() hook: start from an empty K3GenerationCache (so `prefill_chunk_size` works) unless the
        caller passed a cache to continue from, which must be k3's."""
        cache = model_kwargs.get("cache")
        if cache is not None and not isinstance(cache, HybridCache):
            raise ValueError(f"cache must be k3's hybrid cache (model.new_cache()), got {type(cache).__name__}")
        if cache is not None and not isinstance(cache, K3GenerationCache):
            cache.__class__ = K3GenerationCache  # a plain one from K3Model.new_cache(): same state, generate's members
        # the longest sequence the cache will hold (prompt + new tokens - 1, as transformers passes it in
        # max_cache_length): the whole sequence, one more, must fit max_context as in k3's engine; refused before
        # any work, not after some tokens were made and lost
        longest = kwargs.get("max_cache_length", args[-1] if args else None)
        limit = self.model.config.max_context
        if isinstance(longest, int) and not isinstance(longest, bool) and longest + 1 > limit:
            raise ValueError(f"prompt + max_new_tokens needs {longest + 1} positions but max_context is {limit}; "
                             "shorten the prompt or lower max_new_tokens")
        if generation_config.cache_implementation is not None:
            raise ValueError(f"cache_implementation={generation_config.cache_implementation!r} is not supported: "
                             "K3 generates with its own hybrid cache (KDA states + MLA latents)")
        if cache is None and generation_config.use_cache is not False:
            model_kwargs["cache"] = self.new_cache()

    def _init_weights(self, module: torch.nn.Module) -> None:
        # K3Model initialises itself; from_pretrained only has to give the non-persistent router
        # statistics real zeros (everything persistent is loaded, and a missing tensor is an error).
        if isinstance(module, Router):
            with torch.no_grad():
                module._load_acc.zero_()

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed

    def set_input_embeddings(self, value: torch.nn.Module) -> None:
        self.model.embed = value

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.model.head

    def set_output_embeddings(self, value: torch.nn.Module) -> None:
        self.model.head = value

    def new_cache(self) -> K3GenerationCache:
        return K3GenerationCache.for_config(self.model.config)

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                cache: HybridCache | None = None, use_cache: bool | None = None,
                labels: torch.LongTensor | None = None, logits_to_keep: int = 0,
                inputs_embeds: torch.Tensor | None = None, return_dict: bool | None = None,
                **kwargs) -> CausalLMOutputWithPast:
        """input_ids [B, T] -> logits [B, T, vocab] (the last `logits_to_keep` positions if > 0).

        With a cache (given, or made here when `use_cache`), the tokens continue the cached sequence and the
        cache is returned in `outputs.cache`. `labels` [B, T] give the next-token loss (-100 = ignored).
        """
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        kwargs.pop("position_ids", None)  # positions come from the KDA recurrence (MLA is NoPE)
        # HF Trainer (gradient accumulation): the loss is the sum over the micro-batch's target tokens divided by
        # the whole batch's count, so that accumulated micro-batches average over tokens, not over micro-batches
        n_items = kwargs.pop("num_items_in_batch", None)
        if kwargs.pop("output_attentions", False) or kwargs.pop("output_hidden_states", False):
            raise ValueError("K3ForCausalLM does not return attentions or per-layer hidden states; "
                             "call model.model.hidden_states(input_ids) for the final hidden states")
        unknown = sorted(k for k, v in kwargs.items() if v is not None)
        if unknown:
            raise ValueError(f"K3ForCausalLM.forward got unsupported argument(s) {unknown}")
        if inputs_embeds is not None or input_ids is None:
            raise ValueError("K3ForCausalLM takes input_ids [B, T]; inputs_embeds is not supported")
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("K3ForCausalLM does not support padded batches (attention_mask has zeros): a padded "
                             "position would enter the KDA recurrent state; generate each prompt on its own "
                             "(or batch prompts of equal length)")
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if cache is None and use_cache:
            cache = self.new_cache()
        if cache is not None and not isinstance(cache, HybridCache):
            raise ValueError(f"cache must be k3's hybrid cache (model.new_cache()), got {type(cache).__name__}; "
                             "transformers' DynamicCache cannot hold KDA states")
        h = self._prefill_shared(input_ids, cache) if self._shares_prefill(input_ids, cache) else \
            self.model.hidden_states(input_ids, cache)
        logits = self.model.head(h[:, -logits_to_keep:] if logits_to_keep else h)
        loss = None
        if labels is not None:
            if logits_to_keep:
                raise ValueError("labels need logits for every position; leave logits_to_keep = 0")
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100,
                                   reduction="mean" if n_items is None else "sum")
            loss = loss if n_items is None else loss / n_items
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache)

    # Beam search (and num_return_sequences) copy the prompt into every row before the first forward; computing
    # each distinct prompt once and copying its states is the same result for a fraction of the prefill.
    share_prefill = True

    def _shares_prefill(self, input_ids: torch.Tensor, cache: HybridCache | None) -> bool:
        return (self.share_prefill and cache is not None and cache.seen_tokens == 0 and input_ids.shape[0] > 1
                and input_ids.shape[1] > 1 and not torch.is_grad_enabled())

    def _prefill_shared(self, input_ids: torch.Tensor, cache: HybridCache) -> torch.Tensor:
        """The prefill of rows that repeat: each distinct row once, then its states and outputs copied to the
        rows that hold it (a fresh cache is filled as the full batch would fill it)."""
        unique, inverse = torch.unique(input_ids, dim=0, return_inverse=True)
        if unique.shape[0] == input_ids.shape[0]:
            return self.model.hidden_states(input_ids, cache)
        h = self.model.hidden_states(unique, cache)
        reorder_cache(cache, inverse)
        return h.index_select(0, inverse)

    def _reorder_cache(self, cache: HybridCache, beam_idx: torch.LongTensor) -> HybridCache:
        reorder_cache(cache, beam_idx)  # any HybridCache, also a plain one from K3Model.new_cache()
        return cache

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs) -> "K3ForCausalLM":
        """transformers' from_pretrained, but weights that do not fit the config are an error (naming the
        tensors) before anything is loaded, not a warning after."""
        want_info = kwargs.pop("output_loading_info", False)
        path = Path(pretrained_model_name_or_path)
        if path.is_dir() and (path / "config.json").is_file():
            config = kwargs.get("config")
            if not isinstance(config, K3HFConfig):

                model_type = loads_json((path / "config.json").read_text()).get("model_type")
                if model_type != MODEL_TYPE:
                    raise ValueError(f"{path / 'config.json'} has model_type {model_type!r}, not {MODEL_TYPE!r}: "
                                     "it is not a k3 model (export one with k3.io.hf.export_hf)")
                config = K3HFConfig.from_pretrained(path)
            check_weights(path, config)
        try:
            model, info = super().from_pretrained(pretrained_model_name_or_path, *args, output_loading_info=True,
                                                  **kwargs)
        except RuntimeError as err:
            if "mismatch" not in str(err).lower():
                raise
            raise ValueError(f"the weights in {pretrained_model_name_or_path} do not fit its config.json ({err}); "
                             "export the checkpoint again with k3.io.hf.export_hf") from None
        check_loading_info(info, pretrained_model_name_or_path)
        return (model, info) if want_info else model


def _mismatch_error(where, missing, unexpected, mismatched) -> ValueError:
    parts = [f"{label} {v[:5]}{'...' if len(v) > 5 else ''}" for label, v in
             (("missing", missing), ("unexpected", unexpected), ("shape-mismatched", mismatched)) if v]
    return ValueError(f"the weights in {where} do not match the model its config.json describes: "
                      f"{', '.join(parts)}; the weights come from a different config — export the checkpoint "
                      "again with k3.io.hf.export_hf")


def check_weights(path: str | os.PathLike, config: K3HFConfig) -> None:
    """Compare the safetensors headers in `path` (one file or an index of shards) with the tensors the config
    implies; raise ValueError naming the first differences. Reads headers only."""

    from safetensors import safe_open

    path = Path(path)
    index = path / "model.safetensors.index.json"
    files = sorted(set(loads_json(index.read_text())["weight_map"].values())) if index.is_file() else \
        (["model.safetensors"] if (path / "model.safetensors").is_file() else [])
    if not files:
        raise ValueError(f"{path} holds no model.safetensors; export the checkpoint with k3.io.hf.export_hf")
    stored = {}
    for name in files:
        with safe_open(str(path / name), framework="pt") as f:
            stored.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in K3ForCausalLM(config).state_dict().items()}
    if config.tie_embeddings:
        stored.setdefault("model.head.weight", stored.get("model.embed.weight"))
    missing, unexpected = sorted(set(want) - set(stored)), sorted(set(stored) - set(want))
    mismatched = sorted(f"{k}: stored {stored[k]}, config wants {want[k]}" for k in set(want) & set(stored)
                        if stored[k] != want[k])
    if missing or unexpected or mismatched:
        raise _mismatch_error(path, missing, unexpected, mismatched)


def check_loading_info(info: dict, where) -> None:
    """Raise ValueError if from_pretrained reported missing, unexpected or mismatched tensors."""
    def names(key):
        return sorted(k if isinstance(k, str) else str(k[0]) for k in (info.get(key) or []))

    missing, unexpected, mismatched = names("missing_keys"), names("unexpected_keys"), names("mismatched_keys")
    if missing or unexpected or mismatched:
        raise _mismatch_error(where, missing, unexpected, mismatched)


def register() -> None:
    """Make AutoConfig / AutoModelForCausalLM resolve model_type "k3" (done on import)."""
    AutoConfig.register(MODEL_TYPE, K3HFConfig, exist_ok=True)
    AutoModelForCausalLM.register(K3HFConfig, K3ForCausalLM, exist_ok=True)


register()


# ---------------------------------------------------------------------- tokenizer
def to_hf_tokenizer(tokenizer: Tokenizer, model_max_length: int | None = None) -> PreTrainedTokenizerFast:
    """A PreTrainedTokenizerFast over the same `tokenizers` model: identical ids, k3's special tokens kept
    (bos/eos/pad named as such, the rest as extra special tokens), and k3's chat format as its chat template; a
    tokenizer that reserves Kimi K3's format tokens also gets that format as the template named "kimi-k3"
    (`apply_chat_template(..., chat_template="kimi-k3")`). It adds no BOS/EOS of its own, like `Tokenizer.encode`
    without bos/eos."""
    from tokenizers import Tokenizer as RawTokenizer

    named = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}
    extra = [t for t in RESERVED_TOKENS[:tokenizer.n_special] if t not in named.values()]
    template = CHAT_TEMPLATE
    if tokenizer.n_special > len(SPECIAL_TOKENS):
        from k3.data.chat_kimi import CHAT_TEMPLATE as KIMI_K3_TEMPLATE

        template = {"default": CHAT_TEMPLATE, "kimi-k3": KIMI_K3_TEMPLATE}
    hf = PreTrainedTokenizerFast(
        tokenizer_object=RawTokenizer.from_str(tokenizer.hf.to_str()), **named,
        extra_special_tokens=extra, clean_up_tokenization_spaces=False, chat_template=template,
        **({"model_max_length": model_max_length} if model_max_length else {}),
    )
    check_tokenizer(hf, vocab_size=tokenizer.vocab_size)
    return hf


def check_tokenizer(tokenizer, config: K3Config | K3HFConfig | None = None, vocab_size: int | None = None) -> None:
    """Raise ValueError unless `tokenizer` (k3 or HF) has k3's special tokens at their ids and the model's
    vocabulary size; call it at start-up so a mismatch never waits for the first request."""
    size = tokenizer.vocab_size if isinstance(tokenizer, Tokenizer) else len(tokenizer)
    want = vocab_size if vocab_size is not None else (config.vocab_size if config is not None else None)
    if want is not None and size != want:
        raise ValueError(f"the tokenizer has {size} tokens but the model's vocab_size is {want}; use the tokenizer "
                         "the model was trained with (the checkpoint manifest names it under data.tokenizer)")
    for i, tok in enumerate(SPECIAL_TOKENS):
        got = tokenizer.token_to_id(tok) if isinstance(tokenizer, Tokenizer) else tokenizer.convert_tokens_to_ids(tok)
        if got != i:
            raise ValueError(f"the tokenizer has special token {tok} at id {got}, k3 models expect {i}; it is not "
                             "a k3 tokenizer (make one with `k3 tokenize`)")


# ---------------------------------------------------------------------- conversion
def _is_hf_export(path: Path) -> bool:
    try:
        return loads_json((path / "config.json").read_text()).get("model_type") == MODEL_TYPE
    except (OSError, ValueError, AttributeError):
        return False


def _recover_killed_export(out: Path) -> None:
    """What an export killed part way left beside `out` (its process gone): its unfinished `.OUT.tmp-PID-*`
    folder is removed; the previous export it had moved aside (`.OUT.old-PID-*`) goes back to `out` if the kill
    came before the new one took its place, and is removed otherwise."""
    for kind in (".tmp-", ".old-"):
        for d in sorted(out.parent.glob(f".{out.name}{kind}*")):
            pid = writer_pid(d.name, f".{out.name}{kind}")
            if not d.is_dir() or pid is None or pid_alive(pid):
                continue
            if kind == ".old-" and not out.exists():
                log.warning("restoring %s: an export that replaced it was killed before the new one was in place", out)
                os.rename(d, out)
            else:
                shutil.rmtree(d, ignore_errors=True)


def export_hf(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike,
              tokenizer_path: str | os.PathLike | None = None) -> Path:
    """Convert a k3 training checkpoint (a step directory, or a root holding `latest`) into an HF directory:
    config.json, model.safetensors, generation_config.json and, when a tokenizer is found (the argument,
    else the one the checkpoint's manifest names), the tokenizer files. The directory is written beside
    `out_dir` and renamed into place, so `out_dir` is either the old export or the complete new one."""
    from k3.io import load_with_manifest
    from k3.quant.export import EXPORT_KEY

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not _is_hf_export(out):
        raise ValueError(f"{out} is not empty and not an earlier HF export of a k3 model (no config.json with "
                         f"model_type {MODEL_TYPE!r}); the export replaces the whole directory, so give it an --out "
                         "of its own")
    model, manifest = load_with_manifest(ckpt_dir)
    if EXPORT_KEY in manifest.get("extra", {}):
        src = manifest["extra"][EXPORT_KEY].get("source", {}).get("checkpoint")
        raise ValueError(f"{manifest['path']} is a packed MX export; the HF format holds full-precision expert "
                         f"weights: export the training checkpoint it was packed from instead ({src})")
    tok = None
    named = tokenizer_path or (manifest.get("data") or {}).get("tokenizer")
    if named is not None:
        try:
            tok = load_tokenizer(named)
        except ValueError as err:
            hint = "" if tokenizer_path else (" (the path the checkpoint's manifest names; pass --tokenizer PATH, "
                                              "tokenizer_path in Python)")
            raise ValueError(f"{err}{hint}") from None
        check_tokenizer(tok, model.config)
        trained = (manifest.get("data") or {}).get("tokenizer_hash")
        if trained and getattr(tok, "fingerprint", trained) != trained:
            raise ValueError(f"tokenizer {named} is not the one the checkpoint's training data was tokenized with "
                             f"(fingerprint {tok.fingerprint[:12]}..., the checkpoint's {trained[:12]}...): "
                             "the exported model would read other token ids; pass the training tokenizer")
    else:
        log.warning("no tokenizer given and the checkpoint names none: exporting the model only")
    hf = K3ForCausalLM.from_k3(model)
    # generate() stops where the server does: <|eos|>, the end of a turn, or the start of a new one.
    hf.generation_config.eos_token_id = [EOS] + [SPECIAL_TOKENS.index(t) for t in STOP_TOKENS]
    out.parent.mkdir(parents=True, exist_ok=True)
    _recover_killed_export(out)
    with atomic_dir(out) as tmp:
        hf.save_pretrained(tmp, safe_serialization=True)
        if tok is not None:
            to_hf_tokenizer(tok, model_max_length=model.config.max_context).save_pretrained(tmp)
    log.debug("exported %s (step %s) to %s", manifest.get("path", ckpt_dir), manifest.get("step"), out)
    return out


def load_hf(path: str | os.PathLike, device: str | torch.device = "cpu"):
    """(K3ForCausalLM, PreTrainedTokenizerFast or None) from an HF directory, checked against each other."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} holds no config.json; export a checkpoint with k3.io.hf.export_hf")
    model = K3ForCausalLM.from_pretrained(path).to(device).eval()
    tok = None
    if (path / "tokenizer.json").is_file():
        tok = AutoTokenizer.from_pretrained(path)
        check_tokenizer(tok, model.config)
    return model, tok
