"""AttnRes ops: the naive mix against a per-token loop, and the two-phase form against the naive one."""
import math

import pytest
import torch

from k3.ops.attnres import attnres_mix, blockwise_mix, merged_weights, phase1, phase2

EPS = 1e-6


def loop_reference(sources, query, norm_weight, eps=EPS):
    """h_l = sum_i softmax_i(w^T (g * v_i / rms(v_i))) v_i, one token at a time in Python floats."""
    S, B, T, D = sources.shape
    h = torch.zeros(B, T, D, dtype=torch.float64)
    weights = torch.zeros(B, T, S, dtype=torch.float64)
    g = norm_weight if norm_weight is not None else torch.ones(D)
    for b in range(B):
        for t in range(T):
            logits = []
            for s in range(S):
                v = sources[s, b, t].double()
                k = v / math.sqrt(float((v * v).mean()) + eps) * g.double()
                logits.append(float(query.double() @ k))
            top = max(logits)
            e = [math.exp(x - top) for x in logits]
            for s in range(S):
                weights[b, t, s] = e[s] / sum(e)
                h[b, t] += weights[b, t, s] * sources[s, b, t].double()
    return h.float(), weights.float()


def test_naive_matches_per_token_loop():
    src = torch.randn(3, 2, 3, 8)
    q, g = torch.randn(8), torch.rand(8) + 0.5
    h, w = attnres_mix(src, q, g, EPS)
    h_ref, w_ref = loop_reference(src, q, g)
    torch.testing.assert_close(h, h_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-5)
    assert h.shape == (2, 3, 8) and w.shape == (2, 3, 3)


@pytest.mark.parametrize("mix", ["naive", "blockwise"])
def test_zero_query_is_uniform_mean(mix):
    src = torch.randn(5, 2, 4, 8)
    q = torch.zeros(8)
    h, w = attnres_mix(src, q) if mix == "naive" else blockwise_mix(src[:3], q, extra=src[3:])
    torch.testing.assert_close(w, torch.full((2, 4, 5), 1 / 5), atol=1e-7, rtol=0)
    torch.testing.assert_close(h, src.mean(0), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("mix", ["naive", "blockwise"])
def test_single_source_is_returned_unchanged(mix):
    src = torch.randn(1, 2, 3, 8)
    q = torch.randn(8) * 3
    h, w = attnres_mix(src, q) if mix == "naive" else blockwise_mix(src, q)
    torch.testing.assert_close(h, src[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(w, torch.ones(2, 3, 1))


def test_keys_are_rms_normalised():
    """Scaling a source leaves its logit alone (RMSNorm on keys) but scales its value in the mix."""
    src = torch.randn(3, 2, 3, 8)
    q = torch.randn(8)
    scaled = src.clone()
    scaled[1] *= 100.0
    h, w = attnres_mix(src, q, eps=1e-12)
    h2, w2 = attnres_mix(scaled, q, eps=1e-12)
    torch.testing.assert_close(w2, w, atol=1e-6, rtol=1e-5)
    expected = h + 99.0 * w[..., 1:2] * src[1]
    torch.testing.assert_close(h2, expected, atol=1e-4, rtol=1e-5)


def test_norm_weight_folds_into_query():
    src = torch.randn(4, 2, 3, 8)
    q, g = torch.randn(8), torch.randn(8)
    h, w = attnres_mix(src, q, g)
    h2, w2 = attnres_mix(src, q * g, None)
    torch.testing.assert_close(h, h2, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(w, w2, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("S,K,Q,scale,dtype", [
    (1, 0, 3, 1.0, torch.float32), (1, 1, 4, 1.0, torch.float32), (3, 1, 4, 2.0, torch.float32),
    (4, 3, 2, 1.0, torch.float32), (2, 1, 3, 30.0, torch.float64), (2, 2, 3, 300.0, torch.float64),
])
def test_blockwise_matches_naive_forward_and_backward(S, K, Q, scale, dtype):
    """fp32 at tolerance 1e-5. Scales 30 and 300 put logits in the hundreds and thousands, where exp()
    without the running max overflows; there fp32 rounding of the logits alone (ulp(300) ~ 3e-5) moves
    the weights by more than 1e-5 in ANY implementation, so those cases run in fp64 and must agree to
    1e-10: the two-phase algebra is exact, the tolerance is only rounding."""
    B, T, D = 2, 3, 16
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    src = torch.randn(S, B, T, D, dtype=dtype, requires_grad=True)
    extra = torch.randn(K, B, T, D, dtype=dtype, requires_grad=True)
    queries = (torch.randn(Q, D, dtype=dtype) * scale).requires_grad_()
    norms = (torch.rand(Q, D, dtype=dtype) + 0.5).requires_grad_()
    probe = torch.randn(Q, B, T, D, dtype=dtype)
    leaves = [src, extra, queries, norms]

    def run(impl):
        hs, ws = [], []
        if impl == "blockwise":
            stats = phase1(src, queries, norms, EPS)
            for i in range(Q):
                one = stats.select(i)
                out = phase2(one, queries[i], norms[i], extra if K else None, EPS)
                hs.append(out.h)
                ws.append(merged_weights(one.logits, out.logits, out.m, out.l))
        else:
            for i in range(Q):
                h, w = attnres_mix(torch.cat([src, extra]), queries[i], norms[i], EPS)
                hs.append(h)
                ws.append(w)
        h = torch.stack(hs)
        grads = torch.autograd.grad((h * probe).sum(), leaves, allow_unused=True)
        return h.detach(), torch.stack(ws), grads

    h_b, w_b, g_b = run("blockwise")
    h_n, w_n, g_n = run("naive")
    assert torch.isfinite(h_b).all()
    assert h_b.dtype == dtype
    torch.testing.assert_close(h_b, h_n, atol=tol, rtol=tol)
    torch.testing.assert_close(w_b, w_n, atol=tol, rtol=tol)
    for name, a, b in zip(["sources", "extra", "queries", "norms"], g_b, g_n):
        if a is None and b is None:
            continue
        a = torch.zeros_like(b) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=lambda m: f"grad of {name}: {m}")


def test_huge_logits_stay_finite():
    """Logits in the thousands: the online max keeps both phases finite and equal to the naive mix."""
    src, extra = torch.randn(3, 2, 3, 16), torch.randn(2, 2, 3, 16)
    q = torch.randn(16) * 1000
    h_b, w_b = blockwise_mix(src, q, None, extra)
    h_n, w_n = attnres_mix(torch.cat([src, extra]), q)
    assert torch.isfinite(h_b).all() and torch.isfinite(w_b).all()
    assert w_n.max(-1).values.min() > 0.99  # the mix is (nearly) one-hot here
    torch.testing.assert_close(h_b, h_n, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w_b, w_n, atol=1e-5, rtol=1e-5)


def test_phase1_batches_queries_independently():
    """Row i of a batched phase 1 equals phase 1 of query i alone."""
    src = torch.randn(3, 2, 2, 8)
    queries, norms = torch.randn(4, 8), torch.rand(4, 8)
    stats = phase1(src, queries, norms)
    for i in range(4):
        alone = phase1(src, queries[i:i + 1], norms[i:i + 1]).select(0)
        for a, b in zip(stats.select(i), alone):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_tokens_are_mixed_independently_so_T1_works():
    src = torch.randn(3, 2, 5, 8)
    extra = torch.randn(1, 2, 5, 8)
    q, g = torch.randn(8), torch.rand(8)
    h_all, _ = blockwise_mix(src, q, g, extra)
    for t in range(5):
        h_t, w_t = blockwise_mix(src[:, :, t:t + 1], q, g, extra[:, :, t:t + 1])
        assert h_t.shape == (2, 1, 8) and w_t.shape == (2, 1, 4)
        torch.testing.assert_close(h_t, h_all[:, t:t + 1], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(attnres_mix(torch.cat([src, extra])[:, :, t:t + 1], q, g)[0], h_t,
                                   atol=1e-6, rtol=1e-6)


def test_bad_shapes_raise_value_error_naming_the_shape():
    src = torch.randn(3, 2, 4, 8)
    with pytest.raises(ValueError, match=r"\[S, B, T, D\]"):
        attnres_mix(src[0], torch.zeros(8))
    with pytest.raises(ValueError, match=r"S >= 1"):
        attnres_mix(src[:0], torch.zeros(8))
    with pytest.raises(ValueError, match=r"query must have shape \[D\] = \[8\]"):
        attnres_mix(src, torch.zeros(7))
    with pytest.raises(ValueError, match=r"norm_weight must have shape \[D\] = \[8\]"):
        attnres_mix(src, torch.zeros(8), torch.ones(2, 8))
    with pytest.raises(ValueError, match=r"queries must have shape \[Q, D\]"):
        phase1(src, torch.zeros(8))
    with pytest.raises(ValueError, match=r"sources must be a float tensor \[S, B, T, D\], got dtype torch.int64"):
        attnres_mix(src.long(), torch.zeros(8))
    with pytest.raises(ValueError, match=r"query must be a float tensor, got dtype torch.int64"):
        attnres_mix(src, torch.zeros(8, dtype=torch.long))
    with pytest.raises(ValueError, match=r"sources must be a float tensor"):
        phase1(src.long(), torch.zeros(2, 8))
    with pytest.raises(ValueError, match=r"norm_weights must have shape \[2, D\] = \[2, 8\]"):
        phase1(src, torch.zeros(2, 8), torch.ones(3, 8))
    stats = phase1(src, torch.zeros(2, 8))
    with pytest.raises(ValueError, match=r"select"):
        phase2(stats, torch.zeros(8))
    with pytest.raises(ValueError, match=r"extra must have shape \[K, B, T, D\] = \[K, 2, 4, 8\]"):
        phase2(stats.select(0), torch.zeros(8), extra=torch.randn(1, 2, 3, 8))
