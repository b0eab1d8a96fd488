"""KDA op: our naive / chunk / recurrent paths against fla's references, forward and backward, fp32."""
import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import k3.ops.kda as kda_mod
from k3.ops.kda import chunk_kda, choose_impl, fused_recurrent_kda, kda, naive_recurrent_kda

import fla.ops.kda.naive as fla_naive  # noqa: E402  (the reference; a dev dependency)

@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny ops: with 2 threads on a shared 2-core box each parallel region can stall ~12 ms (seen here:
    the same test took 0.2 s on 1 thread and 5 s on 2). Correctness does not depend on the thread count."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


OURS = {"naive": naive_recurrent_kda, "chunk": chunk_kda, "recurrent": fused_recurrent_kda}
TOL = 1e-5


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref|: relative to the tensor's scale, so near-zero entries do not blow it up."""
    return ((a.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


def make_inputs(B=2, T=64, H=2, K=16, V=24, decay="mild", dtype=torch.float32):
    q = torch.randn(B, T, H, K, dtype=dtype)
    k = F.normalize(torch.randn(B, T, H, K, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, V, dtype=dtype)
    if decay == "mild":
        g = F.logsigmoid(torch.randn(B, T, H, K, dtype=dtype) + 3)           # ~ -0.05 per step
    elif decay == "strong":
        g = -5 * torch.rand(B, T, H, K, dtype=dtype)                            # down to -5 per step
    elif decay == "spiky":                                                      # mostly mild, rare wipes
        g = -0.1 * torch.rand(B, T, H, K, dtype=dtype) - 40 * (torch.rand(B, T, H, K, dtype=dtype) < 0.03)
    else:
        raise AssertionError(decay)
    beta = torch.rand(B, T, H, dtype=dtype)
    h0 = torch.randn(B, H, K, V, dtype=dtype)
    return q, k, v, g, beta, h0


def run_with_grads(fn, inputs, w_o, w_s, **kw):
    leaves = [x.clone().requires_grad_(True) for x in inputs]
    q, k, v, g, beta, h0 = leaves
    o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)
    ((o * w_o).sum() + (s * w_s).sum()).backward()
    return o.detach(), s.detach(), [x.grad for x in leaves]


NAMES = ["q", "k", "v", "g", "beta", "initial_state"]


@pytest.mark.parametrize("T", [1, 64, 100])
@pytest.mark.parametrize("decay", ["mild", "strong", "spiky"])
def test_ours_match_fla_naive_recurrent_fwd_bwd(T, decay):
    inputs = make_inputs(T=T, decay=decay)
    w_o, w_s = torch.randn(2, T, 2, 24), torch.randn(2, 2, 16, 24)
    o_ref, s_ref, g_ref = run_with_grads(fla_naive.naive_recurrent_kda, inputs, w_o, w_s)
    for name, fn in OURS.items():
        o, s, grads = run_with_grads(fn, inputs, w_o, w_s)
        assert rel_err(o, o_ref) < TOL, (name, "o")
        assert rel_err(s, s_ref) < TOL, (name, "final state")
        for x, gr, gref in zip(NAMES, grads, g_ref):
            assert rel_err(gr, gref) < TOL, (name, "grad", x, rel_err(gr, gref))


def test_chunk_matches_fla_naive_chunk():
    """fwd + bwd at mild decay; forward only at strong decay, where fla's naive_chunk_kda overflows in its
    backward (exp of positive masked exponents gives inf * 0 = nan); naive_recurrent covers those grads."""
    inputs = make_inputs(B=1, T=64, decay="mild")
    w_o, w_s = torch.randn(1, 64, 2, 24), torch.randn(1, 2, 16, 24)
    o_ref, s_ref, g_ref = run_with_grads(fla_naive.naive_chunk_kda, inputs, w_o, w_s)
    o, s, grads = run_with_grads(chunk_kda, inputs, w_o, w_s)
    assert rel_err(o, o_ref) < TOL and rel_err(s, s_ref) < TOL
    for x, gr, gref in zip(NAMES, grads, g_ref):
        assert rel_err(gr, gref) < TOL, (x, rel_err(gr, gref))

    q, k, v, g, beta, h0 = make_inputs(T=128, decay="strong")
    o_ref, s_ref = fla_naive.naive_chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert rel_err(o, o_ref) < TOL and rel_err(s, s_ref) < TOL


@pytest.mark.parametrize("chunk_size,sub", [(16, None), (24, None), (64, 4), (64, 64), (32, 8), (5, None), (9, None)])
def test_chunk_sizes_agree(chunk_size, sub):
    """Every chunk / sub-chunk split (incl. one sub-chunk = the whole chunk) computes the same thing."""
    q, k, v, g, beta, h0 = make_inputs(T=77, decay="strong")
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                     chunk_size=chunk_size, sub_chunk_size=sub)
    assert rel_err(o, o_ref) < TOL and rel_err(s, s_ref) < TOL


def test_auto_sub_chunk_size_follows_the_decay():
    """Typical gates get the largest sub-chunks, strong decay small ones (no exact fallback needed), and any
    choice computes the same thing: with strong decay at sub-chunk 16 the exact diagonal blocks run."""
    from k3.ops.kda.chunk import _auto_sub_chunk_size

    typical = F.logsigmoid(torch.randn(1, 200, 2, 16))                      # ~ -0.8 per step
    assert _auto_sub_chunk_size(typical, 64, 30.0) == 32
    assert _auto_sub_chunk_size(-5 * torch.rand(1, 200, 2, 16), 64, 30.0) == 8
    assert _auto_sub_chunk_size(torch.full((1, 5, 1, 4), -40.0), 64, 30.0) == 2  # nothing avoids the fallback
    assert _auto_sub_chunk_size(typical, 16, 30.0) == 8                       # sub-chunks stay below the chunk
    inputs = make_inputs(T=100, decay="strong")
    w_o, w_s = torch.randn(2, 100, 2, 24), torch.randn(2, 2, 16, 24)
    o_ref, s_ref, g_ref = run_with_grads(naive_recurrent_kda, inputs, w_o, w_s)
    for sub in (16, 32, None):
        o, s, grads = run_with_grads(chunk_kda, inputs, w_o, w_s, sub_chunk_size=sub)
        assert rel_err(o, o_ref) < TOL and rel_err(s, s_ref) < TOL, sub
        for x, gr, gref in zip(NAMES, grads, g_ref):
            assert rel_err(gr, gref) < TOL, (sub, x)


def test_auto_chunk_size_shrinks_with_the_sub_chunk_and_stays_exact():
    """chunk_size=None: two sub-chunks per chunk (C = 2c), 64 for typical gates, smaller under strong decay (a
    trained model's KDA gates reach -100 per token and below), but never so small that a sequence needs more
    than MAX_AUTO_CHUNKS sequential chunks. Every choice computes what the naive recurrence does, gradients
    included, on gates as strong as a trained model's."""
    from k3.ops.kda.chunk import MAX_AUTO_CHUNKS, _auto_chunk_sizes

    assert _auto_chunk_sizes(F.logsigmoid(torch.randn(1, 200, 2, 16)), 30.0) == (64, 32)
    assert _auto_chunk_sizes(-5 * torch.rand(1, 200, 2, 16), 30.0) == (16, 8)
    assert _auto_chunk_sizes(torch.full((2, 128, 1, 4), -40.0), 30.0) == (4, 2)
    long = torch.full((1, 4096, 1, 4), -40.0)
    assert _auto_chunk_sizes(long, 30.0) == (4096 // MAX_AUTO_CHUNKS, 2)     # the floor: 256 chunks of 16
    assert _auto_chunk_sizes(torch.empty(1, 8, 1, 4, device="meta"), 30.0) == (64, 32)
    from k3.ops.kda.chunk import _auto_sub_chunk_size
    for x in (long, -3 * torch.rand(1, 4096, 1, 4), -8 * torch.rand(3, 300, 2, 4)):  # the floor: c as for that C
        C, c = _auto_chunk_sizes(x, 30.0)
        assert C >= 2 * c and c == _auto_sub_chunk_size(x, C, 30.0), (C, c)
    for decay in ("strong", "spiky", "trained"):
        inputs = list(make_inputs(T=77, decay="strong" if decay == "trained" else decay))
        if decay == "trained":
            inputs[3] = -12 * (0.5 + torch.rand_like(inputs[3])) - 150 * (torch.rand_like(inputs[3]) < 0.05)
        w_o, w_s = torch.randn(2, 77, 2, 24), torch.randn(2, 2, 16, 24)
        ref = run_with_grads(naive_recurrent_kda, inputs, w_o, w_s)
        got = run_with_grads(chunk_kda, inputs, w_o, w_s)
        c64 = run_with_grads(chunk_kda, inputs, w_o, w_s, chunk_size=64)
        for name, a, b, old in zip(["o", "state", *NAMES], [got[0], got[1], *got[2]], [ref[0], ref[1], *ref[2]],
                                   [c64[0], c64[1], *c64[2]]):
            if decay == "trained" and name == "g":
                # under such decay dL/dg is a sum of O(1) terms cancelling to ~1e-3: fp32 rounding leaves ~1e-7
                # absolute in it with any chunk size (64 included), so the bound is absolute here
                assert (a - b).abs().max() < 1e-6 and (old - b).abs().max() < 1e-6, (a - b).abs().max()
                continue
            assert rel_err(a, b) < TOL, (decay, name, rel_err(a, b))
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_kda(*make_inputs(T=8)[:5], chunk_size=0)


@pytest.mark.parametrize("decay", ["mild", "strong"])
@pytest.mark.parametrize("block", [1, 3, None])
def test_chunk_blocks_match_naive_fwd_bwd(decay, block):
    """Chunks in blocks (the state handed from block to block; 5 chunks here, so blocks of 1 and 3 split them
    and the CPU default of 8 does not) compute what the naive recurrence does, gradients included, and
    what all chunks at once (chunk_block=0) compute."""
    inputs = make_inputs(T=300, decay=decay)
    w_o, w_s = torch.randn(2, 300, 2, 24), torch.randn(2, 2, 16, 24)
    ref = run_with_grads(naive_recurrent_kda, inputs, w_o, w_s)
    got = run_with_grads(chunk_kda, inputs, w_o, w_s, chunk_size=64, chunk_block=block)
    whole = run_with_grads(chunk_kda, inputs, w_o, w_s, chunk_size=64, chunk_block=0)
    for a, b, c in zip([got[0], got[1], *got[2]], [ref[0], ref[1], *ref[2]], [whole[0], whole[1], *whole[2]]):
        assert rel_err(a, b) < TOL and rel_err(a, c) < TOL


def test_chunk_block_must_be_a_count():
    q, k, v, g, beta, _ = make_inputs(T=70)
    with pytest.raises(ValueError, match="chunk_block"):
        chunk_kda(q, k, v, g, beta, chunk_block=-1)


def test_chunk_no_grad_loop_equals_autograd_loop():
    """Without autograd the sequential part writes into preallocated buffers; it must compute bit for bit
    what the autograd path (lists + stack) computes."""
    q, k, v, g, beta, h0 = make_inputs(T=150, decay="mild")
    with torch.no_grad():
        o1, s1 = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    o2, s2 = chunk_kda(*leaves[:5], initial_state=leaves[5], output_final_state=True)
    assert o2.requires_grad and torch.equal(o1, o2.detach()) and torch.equal(s1, s2.detach())


@pytest.mark.parametrize("decay", ["mild", "spiky"])
def test_chunk_gradcheck_fp64(decay):
    """Finite differences through the whole chunk path, both the centred and the exact-diagonal branch."""
    inputs = make_inputs(B=1, T=11, H=1, K=4, V=3, decay=decay, dtype=torch.float64)
    if decay == "spiky":
        inputs[3][0, 2, 0, :] = -45.0                                        # force an exact diagonal block
    leaves = [x.clone().requires_grad_(True) for x in inputs]

    def f(q, k, v, g, beta, h0):
        return chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=4)

    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)


def test_no_overflow_under_extreme_decay():
    q, k, v, g, beta, h0 = make_inputs(T=130, decay="strong")
    g = g * 30                                                                  # down to -150 per step
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_err(o, o_ref) < TOL and rel_err(s, s_ref) < TOL


def test_a_decay_of_minus_infinity_forgets_exactly():
    """alpha = 0 (g = -inf) at some steps: the naive form forgets the state there; the chunk form gave NaN."""
    q, k, v, g, beta, h0 = make_inputs(T=130)
    g = g.clone()
    g[:, 5] = float("-inf")
    g[:, 70, :, :3] = float("-inf")
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_err(o, o_ref) < TOL and rel_err(s, s_ref) < TOL


def test_defaults_no_state_and_scale():
    q, k, v, g, beta, _ = make_inputs(T=70)
    o_ref, s_ref = fla_naive.naive_recurrent_kda(q, k, v, g, beta, scale=0.3)
    for fn in OURS.values():
        o, s = fn(q, k, v, g, beta, scale=0.3)
        assert s is None and rel_err(o, o_ref) < TOL


def test_recurrent_leaves_initial_state_alone():
    q, k, v, g, beta, h0 = make_inputs(T=3)
    before = h0.clone()
    for fn in OURS.values():
        fn(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert torch.equal(h0, before)


def test_dispatch_choices(monkeypatch, caplog):
    assert choose_impl(torch.zeros(1, 16, 1, 4)) == "recurrent"
    assert choose_impl(torch.zeros(1, 17, 1, 4)) == "chunk"
    fake_cuda = SimpleNamespace(is_cuda=True, shape=(1, 100, 1, 4))
    assert choose_impl(fake_cuda) == "fla"                                    # fla is installed here
    import sys
    import types

    class Broken(types.ModuleType):  # fla present but failing to import, as with a Triton it does not support
        def __getattr__(self, name):
            raise RuntimeError("unsupported Triton")

    monkeypatch.setitem(sys.modules, "fla.ops.kda", Broken("fla.ops.kda"))
    monkeypatch.setattr(kda_mod, "_warned_no_fla", False)
    with caplog.at_level(logging.WARNING, logger="k3.ops.kda"):
        assert choose_impl(fake_cuda) == "chunk"
    assert "fla is not usable (RuntimeError: unsupported Triton)" in caplog.text


@pytest.mark.parametrize("T,impl", [(5, "recurrent"), (40, "chunk")])
def test_dispatch_runs_the_chosen_impl(T, impl):
    q, k, v, g, beta, h0 = make_inputs(T=T)
    o, s = kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o2, s2 = OURS[impl](q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert torch.equal(o, o2) and torch.equal(s, s2)
    for name in OURS:
        o3, _ = kda(q, k, v, g, beta, initial_state=h0, impl=name)
        assert rel_err(o3, o) < TOL


def test_dispatch_rejects_bad_impl():
    q, k, v, g, beta, _ = make_inputs(T=4)
    with pytest.raises(ValueError, match="impl must be one of"):
        kda(q, k, v, g, beta, impl="triton")
    with pytest.raises(ValueError, match="CUDA"):
        kda(q, k, v, g, beta, impl="fla")


def test_bad_shapes_name_the_expected_shape():
    q, k, v, g, beta, h0 = make_inputs(B=2, T=4, H=2, K=16, V=24)
    cases = [
        (dict(q=q[0]), r"q must be \[B, T, H, K\]"),
        (dict(k=k[..., :8]), r"k must be \[B, T, H, K\]"),
        (dict(v=v[:, :3]), r"v must be \[B, T, H, V\]"),
        (dict(g=g[:, :, :1]), r"g must be \[B, T, H, K\]"),
        (dict(beta=beta[..., None]), r"beta must be \[B, T, H\]"),
        (dict(initial_state=h0.transpose(-1, -2)), r"initial_state must be \[B, H, K, V\]"),
        (dict(beta=(beta > 0.5).long()), "floating-point"),
    ]
    for change, msg in cases:
        args = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0) | change
        with pytest.raises(ValueError, match=msg):
            kda(**args)


@pytest.mark.parametrize("name", list(OURS))
def test_an_empty_sequence_passes_the_state_through(name):
    q, k, v, g, beta, h0 = make_inputs(T=64)
    q, k, v, g, beta = (x[:, :0] for x in (q, k, v, g, beta))
    o, s = OURS[name](q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.shape == (2, 0, 2, 24) and torch.equal(s, h0)
    o, s = OURS[name](q, k, v, g, beta, output_final_state=True)
    assert torch.equal(s, torch.zeros_like(h0))


@pytest.mark.parametrize("name", list(OURS))
@pytest.mark.parametrize("grad", [False, True])
def test_kernels_keep_their_precision_under_autocast(name, grad):
    """Under bf16 autocast the kernels still compute in fp32 and return an fp32 state (the cache's promise);
    without the guard the chunk form crashed without grad and ran its recurrence in bf16 with it."""
    inputs = make_inputs(T=100)
    o_ref, s_ref = naive_recurrent_kda(*inputs[:5], initial_state=inputs[5], output_final_state=True)
    q, k, v, g, beta, h0 = (x.clone().requires_grad_(grad) for x in inputs)
    with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16):
        o, s = OURS[name](q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    assert rel_err(o, o_ref) < TOL and rel_err(s, s_ref) < TOL


def test_chunk_form_runs_on_the_meta_device():
    q, k, v, g, beta, h0 = (x.to("meta") for x in make_inputs(T=100))
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.is_meta and o.shape == (2, 100, 2, 24) and s.shape == (2, 2, 16, 24)
