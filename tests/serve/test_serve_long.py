"""Long context: a chunked prefill leaves exactly the predicted cache (latents grow, KDA states do not),
chunked prefill equals one forward, and the decode benchmark's random caches have a real prefill's shapes."""
import importlib.util
from pathlib import Path

import pytest
import torch

from k3.config import get_config
from k3.model.accounting import cache_bytes
from k3.model.cache import KDACache, MLACache
from k3.model.transformer import K3Model

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def predicted_bytes(cfg, tokens: int, batch: int = 1) -> int:
    """fp32 cache from the config: per MLA layer tokens x (kv_lora_rank latent + qk_rope_head_dim shared key), plus
    per KDA layer the recurrent state H x K x V (V = K) and the short-conv tail over q, k, v: 3HK x (conv_size - 1)."""
    H, K, W = cfg.kda_heads, cfg.kda_head_dim, cfg.kda_conv_size
    kda = H * K * K + 3 * H * K * (W - 1)
    per_token = cfg.mla_kv_lora_rank + cfg.qk_rope_head_dim
    return 4 * batch * (cfg.n_mla_layers * tokens * per_token + cfg.n_kda_layers * kda)


def test_long_preset_has_k3_layer_pattern_and_a_1m_context():
    cfg = get_config("long")
    assert cfg.pattern == "KKKM" and cfg.max_context >= 1_048_576
    assert cfg.mla_heads * (cfg.mla_qk_head_dim + cfg.mla_v_head_dim) <= 16  # keeps the quadratic part small


@torch.no_grad()
def test_chunked_prefill_cache_is_the_predicted_bytes_and_kda_state_is_constant():
    cfg = get_config("long")
    model = K3Model(cfg).eval()
    cache = model.new_cache()
    g = torch.Generator().manual_seed(0)
    kda_bytes, done = set(), 0
    for n in [1024] * 8 + [333]:  # 8,525 tokens
        model(torch.randint(17, cfg.vocab_size, (1, n), generator=g), cache)
        done += n
        measured = cache.nbytes()
        want = predicted_bytes(cfg, done)
        assert abs(measured - want) <= 0.01 * want, (done, measured, want)
        assert measured == cache_bytes(cfg, done, latent="fp32", conv="fp32", state="fp32")["total"]
        kda_bytes.add(sum(s.nbytes() for s in cache.slots if isinstance(s, KDACache)))
        latents = [s.latent for s in cache.slots if isinstance(s, MLACache)]
        assert [tuple(t.shape) for t in latents] == [(1, done, cfg.mla_kv_lora_rank + cfg.qk_rope_head_dim)] \
            * cfg.n_mla_layers
    assert len(kda_bytes) == 1 and kda_bytes.pop() == predicted_bytes(cfg, 0)
    assert cache.seen_tokens == done
    # the growth is exactly the MLA cache: 4 bytes x (64 + 8) values per token per MLA layer
    assert predicted_bytes(cfg, done) - predicted_bytes(cfg, 0) == 4 * done * (64 + 8) * cfg.n_mla_layers


@pytest.mark.parametrize("preset", ["long", "tiny"])
@torch.no_grad()
def test_chunked_prefill_logits_equal_one_forward(preset):
    cfg = get_config(preset)
    model = K3Model(cfg).eval()
    ids = torch.randint(17, cfg.vocab_size, (2, 150), generator=torch.Generator().manual_seed(1))
    full = model(ids)
    cache = model.new_cache()
    parts, start = [], 0
    for n in (1, 7, 16, 17, 64, 1, 44):  # recurrent (<= 16) and chunked KDA paths; MLA with and without past
        parts.append(model(ids[:, start:start + n], cache))
        start += n
    assert start == ids.shape[1]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_decode_benchmark_random_cache_matches_a_real_prefill():
    dec = _bench("decode")
    cfg = get_config("long")
    for config in (cfg, dec.all_mla(cfg)):
        model = K3Model(config).eval()
        real = dec.prefill_cache(model, 3000, chunk=1024, generator=torch.Generator().manual_seed(0))
        fake = dec.fill_cache(model, 3000, generator=torch.Generator().manual_seed(1))
        assert dec.slot_signature(real) == dec.slot_signature(fake)
        assert real.nbytes() == fake.nbytes() == predicted_bytes(config, 3000)
        assert real.seen_tokens == fake.seen_tokens == 3000
        nxt = dec.decode_step(model, fake, torch.tensor([[20]]))
        assert nxt.shape == (1, 1) and fake.seen_tokens == 3001
    assert dec.all_mla(cfg).pattern == "MMMM" and dec.all_mla(cfg).d_model == cfg.d_model


def test_benchmark_scripts_smoke(tmp_path):
    dec = _bench("decode").main(["--quick", "--out", str(tmp_path / "decode.json")])
    assert (tmp_path / "decode.json").is_file()
    assert dec["value_check"]["shapes_and_bytes_match"] and [r["context"] for r in dec["rows"]] == [256, 1024]
    assert all(0 < r["cache_ratio"] < 1 and r["speedup"] > 0 for r in dec["rows"])
    lc = _bench("long_context").run("long", tokens=4096, chunk=512, decode_tokens=2, samples=4, progress=False,
                                     progress_path=None)
    assert lc["cache_rel_error"] < 0.01 and lc["kda_state_bytes_constant"]
    assert lc["cache_bytes"] == predicted_bytes(get_config("long"), 4096 + 2)
    assert len(lc["samples"]) >= 4 and lc["peak_rss_bytes"] >= lc["base_rss_bytes"] > 0
