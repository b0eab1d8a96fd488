import pytest
import torch

from k3.config import get_config
from k3.model.cache import KDACache, MLACache
from k3.model.transformer import K3Model


def _model(**over):
    torch.manual_seed(0)
    cfg = get_config("tiny", **over)
    m = K3Model(cfg).eval()
    # larger weights than the training init so a wrong cache path shows up far above the tolerance
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() >= 2 and "attnres" not in name:
                p.normal_(0, 1.0 / p.shape[-1] ** 0.5)
    return m


@pytest.mark.parametrize("over", [{}, {"attnres": "full"}, {"attnres": "none"}, {"moe": "standard"},
                                  {"layer_pattern": "MMMM"}, {"layer_pattern": "KKKK"}])
def test_prefill_then_decode_equals_full_forward(over):
    m = _model(**over)
    ids = torch.randint(0, m.config.vocab_size, (2, 23))
    with torch.no_grad():
        full = m(ids)
        cache = m.new_cache()
        steps = [m(ids[:, :15], cache)]
        for t in range(15, 23):
            steps.append(m(ids[:, t:t + 1], cache))
    got = torch.cat(steps, dim=1)
    assert full.abs().max() > 1.0  # the check is not trivially small
    torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-4)
    assert cache.seen_tokens == 23


def test_cache_holds_constant_kda_state_and_growing_latent():
    m = _model()
    cfg = m.config
    cache = m.new_cache()
    with torch.no_grad():
        m(torch.randint(0, cfg.vocab_size, (1, 10)), cache)
    n10 = cache.nbytes()
    with torch.no_grad():
        m(torch.randint(0, cfg.vocab_size, (1, 5)), cache)
    kda = [s for s in cache.slots if isinstance(s, KDACache)]
    mla = [s for s in cache.slots if isinstance(s, MLACache)]
    assert len(kda) == 3 and len(mla) == 1
    kda_bytes = sum(s.nbytes() for s in kda)
    assert kda[0].state.shape == (1, cfg.kda_heads, cfg.kda_head_dim, cfg.kda_head_dim)
    # only the MLA cache grows: 5 more tokens x (kv_lora_rank + qk_rope_head_dim) x 4 bytes
    assert cache.nbytes() - n10 == 5 * cfg.mla_cache_dim * 4
    assert cache.nbytes() == kda_bytes + 15 * cfg.mla_cache_dim * 4


def test_cache_nbytes_is_the_memory_it_holds():
    """After a prefill of many chunks, each KDA state owns its storage: a view into the chunk form's stacked
    states kept the whole [chunks + 1] buffer alive while nbytes() counted one state."""
    m = _model()
    cache = m.new_cache()
    with torch.no_grad():
        m(torch.randint(0, m.config.vocab_size, (2, 600)), cache)
    held, seen = 0, set()
    for s in cache.slots:
        for t in ((s.conv_state, s.state) if isinstance(s, KDACache) else (s.latent,)):
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                held += st.nbytes()
    assert held == cache.nbytes()


def test_training_step_reduces_loss_and_all_params_get_grads():
    torch.manual_seed(0)
    m = K3Model(get_config("tiny")).train()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    ids = torch.randint(0, 64, (4, 32))
    losses = []
    for _ in range(12):
        logits = m(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        (loss + m.aux_loss()).backward()
        if not losses:
            missing = [n for n, p in m.named_parameters() if p.grad is None]
            assert not missing, missing
        opt.step()
        m.update_balancing()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


def test_generate_greedy_is_deterministic_and_matches_argmax():
    m = _model()
    ids = torch.randint(0, m.config.vocab_size, (1, 6))
    out = m.generate(ids, max_new_tokens=5)
    assert out.shape == (1, 11)
    with torch.no_grad():
        nxt = m(out[:, :-1])[:, -1].argmax(-1)
    assert nxt.item() == out[0, -1].item()
    # one forward per new token but the last: the prefill samples the first, each decode step the next
    calls = []
    hook = m.register_forward_hook(lambda mod, args, out: calls.append(tuple(args[0].shape)))
    try:
        m.generate(ids, max_new_tokens=3)
    finally:
        hook.remove()
    assert calls == [(1, 6), (1, 1), (1, 1)]
    # so a prompt may fill the context up to the last generated token
    short = m.generate(torch.zeros(1, m.config.max_context - 2, dtype=torch.long), max_new_tokens=2)
    assert short.shape == (1, m.config.max_context)


def test_bad_inputs():
    m = _model()
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        m(torch.zeros(2, 3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="integer tensor"):
        m(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="integer tensor"):
        m([[1, 2]])
    for empty in ((1, 0), (0, 3)):
        with pytest.raises(ValueError, match="at least one sequence of at least one token"):
            m(torch.zeros(*empty, dtype=torch.long))
    V = m.config.vocab_size
    for bad in (V, -1):
        with pytest.raises(ValueError, match=rf"token id {bad}, outside the vocabulary \[0, {V}\)"):
            m(torch.tensor([[1, bad, 2]]))
    m(torch.tensor([[0, V - 1]]))  # both ends of the vocabulary are fine
    with pytest.raises(ValueError, match="max_context"):
        m(torch.zeros(1, m.config.max_context + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="new_cache"):
        m(torch.zeros(1, 3, dtype=torch.long), cache=type(m.new_cache())([]))


@pytest.mark.parametrize("pattern", ["KKKK", "KKKM"])
def test_merged_rows_split_back_to_their_own_lengths(pattern):
    """Rows of 3 and 10 tokens merged, then split: each keeps its own length, also without an MLA latent to
    read it from (a KDA-only cache said 10 for both, and refused to continue the short row near max_context)."""
    from k3.model.cache import HybridCache

    torch.manual_seed(0)
    m = K3Model(get_config("tiny", layer_pattern=pattern, max_context=12)).eval()
    a, b = m.new_cache(), m.new_cache()
    ids = torch.randint(0, 512, (1, 8))
    with torch.no_grad():
        m(ids[:, :3], a)
        m(torch.randint(0, 512, (1, 10)), b)
        merged = HybridCache.merge([a, b])
        assert merged.seen_tokens == 10 and merged.tokens_per_row() == [3, 10]
        rows = merged.split()
        assert [r.seen_tokens for r in rows] == [3, 10] and rows[0].row_tokens is None
        got = m(ids[:, 3:], rows[0])  # 3 + 5 <= 12
        full = m(ids)
    torch.testing.assert_close(got, full[:, 3:], rtol=1e-4, atol=1e-4)


def test_a_cache_of_another_layer_pattern_is_refused():
    m = K3Model(get_config("tiny")).eval()
    other = K3Model(get_config("tiny", layer_pattern="KKKK")).new_cache()
    with pytest.raises(ValueError, match=r"cache slot \d is a KDACache, but layer \d is MLA"):
        m(torch.randint(0, 512, (1, 4)), other)
    for kind, wrong, name in (("M", KDACache, "MLA"), ("K", MLACache, "KDA")):  # one slot of the other kind
        cache = m.new_cache()
        i = m.config.pattern.index(kind)
        cache.slots[i] = wrong()
        with pytest.raises(ValueError, match=rf"cache slot {i} is a {wrong.__name__}, but layer {i} is {name}"):
            m(torch.randint(0, 512, (1, 4)), cache)


def _state(cache):
    return [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in vars(s).items()} for s in cache.slots]


def _same_state(a, b):
    return all(x.keys() == y.keys() and all(
        (x[k] is None and y[k] is None) or (isinstance(x[k], torch.Tensor) and torch.equal(x[k], y[k]))
        for k in x) for x, y in zip(a, b))


def test_a_cache_of_another_model_batch_or_dtype_fails_before_any_slot_moves():
    """A cache filled by a model of other widths (or another batch) is refused with a ValueError naming the slot
    before any layer runs; one of another dtype fails in its MLA layer, and the KDA slots before it are rolled
    back: the cache is left exactly as it was, not with some states advanced."""
    torch.manual_seed(0)
    cfg = get_config("tiny")
    m = K3Model(cfg).eval()
    ids = torch.randint(0, 512, (2, 5))
    with torch.no_grad():
        other = K3Model(cfg.replace(mla_kv_lora_rank=16)).eval()
        c = other.new_cache()
        other(ids, c)
        before = _state(c)
        with pytest.raises(ValueError, match=r"cache slot 3 \(MLACache.latent\) is \(2, 5, 32\).*need \(2, 5, 48\)"):
            m(ids[:, :1], c)
        assert _same_state(before, _state(c)) and c.seen_tokens == 5
        mine = m.new_cache()
        m(ids, mine)
        with pytest.raises(ValueError, match=r"cache slot 0 \(KDACache.conv_state\).*a batch of 1"):
            m(ids[:1, :1], mine)
        wide = m.new_cache()
        K3Model(cfg.replace(kda_head_dim=16)).eval()(ids, wide)
        with pytest.raises(ValueError, match=r"cache slot 0 \(KDACache"):
            m(ids[:, :1], wide)

        double = m.new_cache()
        m.double()(ids, double)
        m.float()
        before = _state(double)
        with pytest.raises(ValueError, match="latent is torch.float64 but this layer computes torch.float32"):
            m(ids[:, :1], double)
        assert _same_state(before, _state(double)) and double.seen_tokens == 5  # KDA slots 0-2 rolled back
        # and the intact cache still decodes like a fresh float64 model would
        m.double()
        torch.testing.assert_close(m(ids[:, :1], double), m(torch.cat([ids, ids[:, :1]], 1))[:, -1:])
        m.float()


def test_merge_and_select_refuse_what_they_cannot_do():
    from k3.model.cache import HybridCache

    torch.manual_seed(0)
    cfg = get_config("tiny")
    a, b = K3Model(cfg).eval(), K3Model(cfg.replace(mla_kv_lora_rank=16)).eval()
    ca, cb = a.new_cache(), b.new_cache()
    with torch.no_grad():
        a(torch.randint(0, 512, (1, 3)), ca)
        b(torch.randint(0, 512, (1, 3)), cb)
    with pytest.raises(ValueError, match=r"cache slot 3 differs between the caches.*merge caches of one model"):
        HybridCache.merge([ca, cb])
    with pytest.raises(ValueError, match="non-empty list of row indices"):
        ca.select([])
    with pytest.raises(ValueError, match=r"rows \[5\] outside the cache's rows 0..0"):
        ca.select([5])
    assert ca.select([0]).seen_tokens == 3


def test_generate_checks_its_arguments_before_the_prefill():
    m = _model()
    ids = torch.randint(0, m.config.vocab_size, (1, 4))
    for kwargs, msg in [({"max_new_tokens": -1}, "max_new_tokens = -1"), ({"max_new_tokens": 2.5}, "max_new_tokens"),
                        ({"max_new_tokens": 2, "top_p": 0.0}, "top_p = 0.0"),
                        ({"max_new_tokens": 2, "temperature": float("nan")}, "temperature = nan"),
                        ({"max_new_tokens": 2, "temperature": -1.0}, "temperature = -1.0")]:
        calls = []
        hook = m.register_forward_hook(lambda mod, args, out: calls.append(1))
        try:
            with pytest.raises(ValueError, match=msg):
                m.generate(ids, **kwargs)
        finally:
            hook.remove()
        assert not calls, kwargs
    with pytest.raises(ValueError, match="input_ids must be an integer tensor"):
        m.generate([[1, 2]], max_new_tokens=m.config.max_context)  # an AttributeError on .shape before
    n = m.config.max_context - 4 + 2
    with pytest.raises(ValueError, match=rf"max_new_tokens = {n}.*over max_context = {m.config.max_context}"):
        m.generate(ids, max_new_tokens=n)
    assert m.generate(ids, max_new_tokens=0).shape == (1, 4)
