"""Prefix caching over the hybrid cache and forked prefills: caching on gives caching off's tokens and logits.

The on/off comparisons run the tiny model in fp64, where float rounding (different chunk splits, batch-mates)
is ~1e-14: a 1e-5 bound then fails only on a real error (a wrong KDA state or conv tail, a latent at the
wrong place), as the sensitivity test shows. fp32 runs check that greedy tokens match too.
"""
import pytest
import torch

from k3.model.cache import KDACache, MLACache
from k3.model.sampling import SamplingParams
from k3.serve.engine import Engine
from k3.serve.prefix_cache import PrefixCache

NO_EOS = -1
GREEDY = SamplingParams(max_tokens=4, temperature=0)


def _rand(g, n):
    return torch.randint(17, 512, (n,), generator=g).tolist()


@pytest.fixture
def model64(tiny_model_factory):
    return tiny_model_factory(seed=3).double()


def _engine(model, on: bool, **kw):
    kw = {"max_batch": 4, "prefill_chunk": 24, "prefix_block": 16, "eos_id": NO_EOS, "keep_logits": True, **kw}
    return Engine(model, prefix_cache_bytes=(kw.pop("budget", 1 << 30) if on else 0), **kw)


def _sessions(engine, system, turns, sessions, seed=0, stagger=True):
    """Interleaved multi-turn sessions: every session resends its history (system prompt, earlier prompts and
    replies) plus a new message; sessions join the running batch at different steps."""
    g = torch.Generator().manual_seed(seed)
    hist = [list(system) + _rand(g, 3 + s) for s in range(sessions)]
    out = []
    for turn in range(turns):
        reqs = []
        for s in range(sessions):
            hist[s] = hist[s] + _rand(g, 5 + (7 * s + 3 * turn) % 11)
            reqs.append(engine.submit(hist[s], GREEDY))
            if stagger:
                engine.step()
        while engine.has_work():
            engine.step()
        for s, r in enumerate(reqs):
            assert r.finish_reason == "length", r.error
            hist[s] = hist[s] + r.output_ids
            out.append(r)
    return out


def _same(off, on, atol=1e-5):
    for a, b in zip(off, on, strict=True):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(torch.stack(b.logits), torch.stack(a.logits), rtol=0, atol=atol)


@pytest.mark.parametrize("max_batch", [1, 3, 8])
def test_caching_on_equals_off_over_interleaved_sessions(model64, max_batch):
    g = torch.Generator().manual_seed(1)
    system = _rand(g, 37)  # not a multiple of the block: sessions share it up to inside a block
    off = _sessions(_engine(model64, False, max_batch=max_batch), system, turns=3, sessions=4)
    eng = _engine(model64, True, max_batch=max_batch)
    on = _sessions(eng, system, turns=3, sessions=4)
    _same(off, on)
    st = eng.stats()["prefix_cache"]
    assert st["hits"] >= 8 and st["tokens_reused"] > 0 and st["bytes"] > 0
    for i, r in enumerate(on[4:]):  # every later turn extends its session's earlier prompt: it starts at its end
        assert r.cached_tokens >= len(on[i].prompt_ids), (i, r.cached_tokens, len(on[i].prompt_ids))
    assert eng.prefill_tokens == sum(len(r.prompt_ids) - r.cached_tokens for r in on)


def test_fp32_greedy_tokens_match_with_batch_of_eight(tiny_model):
    g = torch.Generator().manual_seed(2)
    system = _rand(g, 50)
    off = _sessions(_engine(tiny_model, False, max_batch=8), system, turns=3, sessions=8, stagger=False)
    on = _sessions(_engine(tiny_model, True, max_batch=8), system, turns=3, sessions=8, stagger=False)
    _same(off, on, atol=1e-4)


def test_sessions_that_start_together_prefill_the_shared_prompt_once(model64):
    """Requests admitted in one step that share whole blocks: the later ones wait for the first to compute them
    and then start from its snapshot, instead of all prefilling the system prompt side by side."""
    g = torch.Generator().manual_seed(10)
    system = _rand(g, 53)  # three whole blocks of 16, then five tokens inside the fourth
    prompts = [system + _rand(g, 4 + i) for i in range(4)]
    eng = _engine(model64, True, max_batch=4)
    on = eng.generate(prompts, GREEDY)
    assert [r.cached_tokens for r in on] == [0, 48, 48, 48]
    st = eng.prefix.stats()
    assert (st["lookups"], st["hits"], st["tokens_reused"]) == (4, 3, 3 * 48)  # looking again is not a lookup
    assert eng.prefill_tokens == sum(len(p) for p in prompts) - 3 * 48
    _same(_engine(model64, False, max_batch=4).generate(prompts, GREEDY), on)


def test_prompts_diverging_inside_a_block_reuse_the_last_boundary(model64):
    g = torch.Generator().manual_seed(4)
    base = _rand(g, 60)
    eng, ref = _engine(model64, True), _engine(model64, False)
    first = eng.generate([base], GREEDY)[0]
    # diverges at 40 (inside the block 32..48): the snapshot at 32 is the longest usable one
    other = base[:40] + _rand(g, 9)
    r = eng.generate([other], GREEDY)[0]
    assert r.cached_tokens == 32
    # diverges right after the first prompt's end (60, inside the block 48..64): its end snapshot is used
    longer = base + _rand(g, 7)
    r2 = eng.generate([longer], GREEDY)[0]
    assert r2.cached_tokens == 60
    # a prompt that is a prefix of a cached one, ending inside a block
    short = base[:21]
    r3 = eng.generate([short], GREEDY)[0]
    assert r3.cached_tokens == 16
    _same(ref.generate([base, other, longer, short], GREEDY), [first, r, r2, r3])
    # the last token is always computed: an exact repeat reuses up to the boundary before its end
    assert eng.generate([base], GREEDY)[0].cached_tokens == 48


def test_eviction_under_pressure_keeps_the_budget_and_the_outputs(model64):
    g = torch.Generator().manual_seed(5)
    system = _rand(g, 40)
    probe = _engine(model64, True)
    _sessions(probe, system, turns=1, sessions=1)
    node_bytes = probe.prefix.bytes // max(probe.prefix.stats()["nodes"], 1)
    budget = 4 * node_bytes  # a few blocks: every new prompt pushes old ones out
    eng = _engine(model64, True, budget=budget)
    seen = []
    orig = eng.prefix._evict

    def watched():
        orig()
        seen.append(eng.prefix.bytes)
    eng.prefix._evict = watched
    on = _sessions(eng, system, turns=3, sessions=4)
    off = _sessions(_engine(model64, False), system, turns=3, sessions=4)
    _same(off, on)
    st = eng.stats()["prefix_cache"]
    assert st["evictions"] > 0 and max(seen) <= budget and st["hits"] > 0


def test_a_wrong_snapshot_changes_the_logits(model64):
    """The on/off comparisons can fail: reusing a KDA state or conv tail from the wrong place shows far above 1e-5."""
    g = torch.Generator().manual_seed(6)
    base = _rand(g, 50)
    ext = base + _rand(g, 6)
    want = _engine(model64, False).generate([ext], GREEDY)[0]
    for field in ("state", "conv_state"):
        eng = _engine(model64, True)
        eng.generate([base], GREEDY)
        node = max(eng.prefix._lru, key=lambda n: n.end)  # the snapshot at base's end (50)
        k = 0 if field == "conv_state" else 1
        node.kda[0] = tuple(t * 1.5 if j == k else t for j, t in enumerate(node.kda[0]))
        got = eng.generate([ext], GREEDY)[0]
        assert got.cached_tokens == 50
        assert (torch.stack(got.logits) - torch.stack(want.logits)).abs().max() > 1e-3, field


def test_match_gives_the_cache_of_a_direct_prefill(model64):
    g = torch.Generator().manual_seed(7)
    ids = _rand(g, 70)
    eng = _engine(model64, True)
    eng.generate([ids], GREEDY)
    n, cache = eng.prefix.match(ids + [20])
    assert n == 70 and cache.seen_tokens == 70
    direct = model64.new_cache()
    with torch.no_grad():
        model64(torch.tensor([ids]), direct)
    for a, b in zip(cache.slots, direct.slots):
        if isinstance(a, MLACache):
            assert a.key_mask is None
            torch.testing.assert_close(a.latent, b.latent, rtol=0, atol=1e-10)
        else:
            assert isinstance(a, KDACache)
            torch.testing.assert_close(a.state, b.state, rtol=0, atol=1e-10)
            torch.testing.assert_close(a.conv_state, b.conv_state, rtol=0, atol=1e-10)
    assert eng.prefix.match(_rand(g, 30)) == (0, None)
    assert eng.prefix.match(ids[:16]) == (0, None)  # the whole prompt is one block: its last token is computed


def test_lru_evicts_leaves_least_recently_used_first(tiny_model):
    """Unit test of the tree: with room for two prompts' blocks, touching one makes the other go first, and a
    node is never evicted before its children."""
    m = tiny_model
    pc = PrefixCache(m.config.pattern, block=8, max_bytes=1 << 40)

    def put(ids):
        c = m.new_cache()
        with torch.no_grad():
            for s in range(0, len(ids), 8):
                m(torch.tensor([ids[s:s + 8]]), c)
                pc.insert(ids, min(s + 8, len(ids)), c)

    a, b, c = list(range(20, 44)), list(range(100, 124)), list(range(200, 224))
    put(a)
    put(b)
    per_prompt = pc.bytes // 2
    pc.max_bytes = 2 * per_prompt + 1
    assert pc.match(a + [1])[0] == 24  # a is now more recent than b
    put(c)
    assert pc.match(b + [1])[0] == 0 and pc.match(a + [1])[0] == 24 and pc.match(c + [1])[0] == 24
    assert pc.bytes <= pc.max_bytes
    for node in pc._lru:  # every node's path is whole
        p = node
        while p.parent is not None:
            assert p.parent is pc.root or p.parent in pc._lru
            p = p.parent
    with pytest.raises(ValueError, match="block"):
        PrefixCache("KM", block=0)


def test_identical_prompts_share_one_prefill(tiny_model):
    """n requests with one prompt (the server's n > 1): one prefill, each samples from a fork of its cache."""
    g = torch.Generator().manual_seed(8)
    ids = _rand(g, 40)
    params = [SamplingParams(max_tokens=5, temperature=0.9, seed=s) for s in range(4)]
    forked = Engine(tiny_model, max_batch=4, prefill_chunk=16, eos_id=NO_EOS)
    got = forked.generate([ids] * 4, params)
    alone = Engine(tiny_model, max_batch=4, prefill_chunk=16, eos_id=NO_EOS, fork_prefill=False)
    want = alone.generate([ids] * 4, params)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    assert forked.prefill_tokens == len(ids) and alone.prefill_tokens == 4 * len(ids)
    assert [r.cached_tokens for r in got] == [0, 40, 40, 40]


def test_a_cancelled_leader_hands_its_prefill_to_a_follower(tiny_model):
    g = torch.Generator().manual_seed(9)
    ids = _rand(g, 50)
    eng = Engine(tiny_model, max_batch=4, prefill_chunk=16, eos_id=NO_EOS)
    lead = eng.submit(ids, GREEDY)
    eng.step()  # the leader has prefilled a piece
    f1, f2 = eng.submit(ids, GREEDY), eng.submit(ids, GREEDY)
    eng.step()
    assert f1._leader is lead and f2._leader is lead
    eng.cancel(lead)
    while eng.has_work():
        eng.step()
    want = Engine(tiny_model, eos_id=NO_EOS).generate([ids], GREEDY)[0].output_ids
    assert lead.finish_reason == "cancelled"
    assert f1.output_ids == want and f2.output_ids == want
    assert eng.prefill_tokens == len(ids)


def test_benchmark_smoke_run(load_benchmark):
    """benchmarks/serve_prefix.py --quick (tiny, 3 sessions x 3 turns): both modes run and agree."""
    res = load_benchmark("serve_prefix").main(["--quick"])
    assert res["replies_identical"] and res["fork"]["same_tokens"]
    assert res["on"]["prefill_tokens"] < res["off"]["prefill_tokens"] == res["off"]["prompt_tokens"]
    assert res["on"]["prefix_cache"]["hits"] > 0 and res["single"]["on"]["cached_tokens"] > 0
    assert res["ttft_p50_speedup"] > 0
