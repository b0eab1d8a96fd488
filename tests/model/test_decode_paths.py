"""Decode fast paths (one token per row, no gradient) against the general paths they stand in for."""
import pytest
import torch

import k3.model.moe as moe
from k3.config import get_config
from k3.model.attnres import AttnRes
from k3.model.kda import KimiDeltaAttention
from k3.model import packing
from k3.model.moe import GatedMLP, RoutedExperts
from k3.model.transformer import K3Model
from k3.ops.attnres import attnres_mix
from k3.ops.attnres.decode import decode_key, decode_mix


def _experts(E=16, dim=32, ffn=48):
    torch.manual_seed(0)
    return RoutedExperts(E, dim, ffn, init_std=0.2)


@pytest.mark.parametrize("N", [1, 3, 8])
def test_few_token_experts_equal_the_grouped_and_naive_paths(N, monkeypatch):
    ex = _experts()
    x = torch.randn(N, 32)
    experts = torch.stack([torch.randperm(16)[:4] for _ in range(N)])
    experts[-1] = experts[0]  # tokens sharing experts: runs of several rows
    weights = torch.rand(N, 4)
    calls = []
    few = RoutedExperts._few_tokens
    monkeypatch.setattr(RoutedExperts, "_few_tokens", lambda self, *a: calls.append(1) or few(self, *a))
    with torch.inference_mode():
        fast = ex(x, weights, experts)
        assert calls, "the decode path was not taken"
        ref = ex._naive(x, weights, experts, *ex.expert_weights())
        monkeypatch.setattr(moe, "DECODE_MAX_SLOTS", 0)
        grouped = ex(x, weights, experts)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fast, grouped, rtol=1e-5, atol=1e-6)


def test_decode_pack_matches_the_unpacked_path_and_follows_weight_updates(monkeypatch):
    ex = _experts()
    x, experts, weights = torch.randn(2, 32), torch.tensor([[1, 5, 7, 2], [5, 0, 3, 9]]), torch.rand(2, 4)
    with torch.no_grad():
        unpacked = ex(x, weights, experts)
        assert ex._decode_pack(ex.w1, ex.w3, ex.w2) is None  # outside a serving session: never packed
        with packing.scope(packing.new_session()):
            packed = ex(x, weights, experts)
            assert ex._decode_pack(ex.w1, ex.w3, ex.w2) is not None
            torch.testing.assert_close(packed, unpacked, rtol=1e-6, atol=1e-7)
            monkeypatch.setattr(packing, "PACK_MAX_BYTES", 0)  # too big to copy: the two narrow products
            assert ex._decode_pack(ex.w1, ex.w3, ex.w2) is None
            monkeypatch.undo()
            ex.w3.mul_(-2.0)  # an in-place write that bumps the version counter: the pack is rebuilt
            ref = ex._naive(x, weights, experts, *ex.expert_weights())
            torch.testing.assert_close(ex(x, weights, experts), ref, rtol=1e-5, atol=1e-6)
            assert ex._decode_pack(ex.w3, ex.w1, ex.w2) is None  # not the stored weights (QAT's, a subclass's)


def test_packs_never_serve_training_or_evaluation_after_a_fused_optimizer_step():
    """torch's fused AdamW updates weights without bumping their version counters: a pack made before such a step
    must not be read after it. Outside a session nothing is packed; a new session repacks."""
    torch.manual_seed(0)
    mlp = GatedMLP(32, 64)
    x = torch.randn(3, 32)
    session = packing.new_session()
    with torch.no_grad(), packing.scope(session):
        mlp(x)  # the pack of the old weights
    for p in mlp.parameters():
        p.grad = torch.randn_like(p)
    versions = [p._version for p in mlp.parameters()]
    torch.optim.AdamW(mlp.parameters(), lr=0.1, fused=True).step()
    assert [p._version for p in mlp.parameters()] == versions  # why the session rule exists
    want = mlp.w2(mlp.glu(x @ mlp.w1.weight.T, x @ mlp.w3.weight.T))
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), want)  # evaluation: no pack
        with packing.scope(packing.new_session()):
            torch.testing.assert_close(mlp(x), want)  # a new session repacks


def test_engine_refresh_weights_after_an_in_place_update():
    from k3.model.sampling import SamplingParams
    from k3.serve.engine import Engine

    model = _mini_like()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = [[11, 12, 13, 14]]
    engine = Engine(model, max_batch=1)
    engine.generate(prompt, params)
    with torch.no_grad():
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 0.01
    torch.optim.AdamW(model.parameters(), lr=0.05, fused=True).step()
    engine.refresh_weights()
    got = engine.generate(prompt, params)[0]
    want = Engine(model, max_batch=1).generate(prompt, params)[0]
    assert got.output_ids == want.output_ids
    with torch.inference_mode():  # and the logits of a plain forward (no session) agree with the engine's path
        ids = torch.tensor([prompt[0] + want.output_ids[:-1]])
        assert model(ids)[0, -1].argmax().item() == want.output_ids[-1]


def test_few_token_experts_stay_off_when_gradients_are_needed():
    ex = _experts()
    x = torch.randn(2, 32)
    assert moe._few_slots(x, torch.zeros(2, 4, dtype=torch.long), ex.w1) is False  # weights require grad
    with torch.no_grad():
        assert moe._few_slots(x, torch.zeros(2, 4, dtype=torch.long), ex.w1) is True
        assert moe._few_slots(x, torch.zeros(17, 4, dtype=torch.long), ex.w1) is False  # 68 slots > 64


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_decode_mix_equals_naive(dtype, tol):
    g = torch.Generator().manual_seed(0)
    sources = [torch.randn(3, 1, 24, generator=g, dtype=dtype) * (i + 1) for i in range(4)]
    q, w = torch.randn(24, generator=g, dtype=dtype), torch.rand(24, generator=g, dtype=dtype) + 0.5
    h, weights = decode_mix([decode_key(s, 1e-6) for s in sources], sources, q, w)
    h_ref, weights_ref = attnres_mix(torch.stack(sources), q, w, 1e-6)
    torch.testing.assert_close(h, h_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(weights, weights_ref, rtol=tol, atol=tol)


def _mini_like(**over):
    torch.manual_seed(0)
    m = K3Model(get_config("tiny", **over)).eval()
    with torch.no_grad():  # non-trivial AttnRes queries, so that the mixes are not uniform
        for p in m.attnres.pseudo_query:
            p.normal_(std=0.5)
    return m


def test_model_decode_steps_equal_the_reference_paths(monkeypatch):
    """Prefill, then one token at a time: the fast paths (AttnRes decode mix, few-token experts, KDA's one-token
    step) give the logits of the general paths (naive AttnRes, grouped experts, KDA's sequence forward) and the
    same greedy tokens."""
    model = _mini_like()
    prompt = torch.randint(8, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))

    def run():
        cache, ids, logits = model.new_cache(), prompt, []
        with torch.inference_mode():
            for _ in range(6):
                out = model(ids, cache)[:, -1]
                logits.append(out)
                ids = out.argmax(-1, keepdim=True)
        return torch.stack(logits)

    fast = run()
    _general_paths(monkeypatch)
    ref = run()
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(fast.argmax(-1), ref.argmax(-1))


def _general_paths(monkeypatch):
    """Decode through the general paths: the grouped experts, the naive AttnRes mix, KDA's sequence form."""
    monkeypatch.setattr(moe, "DECODE_MAX_SLOTS", 0)
    monkeypatch.setattr(AttnRes, "_decode_mix", lambda self, state, j: _reference_mix(self, state, j))
    monkeypatch.setattr(KimiDeltaAttention, "_decodes", staticmethod(lambda T, cache, segments: False))


def _reference_mix(ar, state, j):
    q, g = ar.pseudo_query[j], ar.key_norm[j]
    h, _ = attnres_mix(torch.stack(state.completed + state.current), q, g, ar.eps)
    return h


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_kda_step_equals_the_recurrent_op_at_one_token(dtype, tol):
    from k3.ops.kda import fused_recurrent_kda, kda_step
    g = torch.Generator().manual_seed(0)
    B, H, K, V = 2, 3, 8, 5
    q, k = (torch.nn.functional.normalize(torch.randn(B, 1, H, K, generator=g, dtype=dtype), dim=-1) for _ in "qk")
    v = torch.randn(B, 1, H, V, generator=g, dtype=dtype)
    gate = -torch.rand(B, 1, H, K, generator=g, dtype=dtype)
    beta = torch.rand(B, 1, H, generator=g, dtype=dtype)
    state = torch.randn(B, H, K, V, generator=g, dtype=dtype)
    o_ref, s_ref = fused_recurrent_kda(q, k, v, gate, beta, initial_state=state, output_final_state=True)
    o, s = kda_step(q[:, 0], k[:, 0], v[:, 0], gate[:, 0], beta[:, 0], state)
    torch.testing.assert_close(o, o_ref[:, 0], rtol=tol, atol=tol)
    torch.testing.assert_close(s, s_ref, rtol=tol, atol=tol)


def test_model_decode_steps_under_cpu_bf16_autocast_stay_near_the_reference(monkeypatch):
    """The fast paths under CPU bf16 autocast (the serving precision a host may pick): logits within bf16 rounding of
    the general paths' (the KDA step keeps the conv and the recurrence in fp32, where the sequence path rounds the
    conv's output to bf16)."""
    model = _mini_like()
    prompt = torch.randint(8, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))

    def run():
        cache, ids, logits = model.new_cache(), prompt, []
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            for i in range(4):  # fixed next tokens: a near-tie in bf16 must not send the two runs apart
                logits.append(model(ids, cache)[:, -1].float())
                ids = prompt[:, i:i + 1]
        return torch.stack(logits)

    fast = run()
    _general_paths(monkeypatch)
    ref = run()
    assert (fast - ref).abs().max() <= 0.05 * ref.abs().max()
