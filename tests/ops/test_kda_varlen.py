"""KDA over packed sequences (cu_seqlens): every implementation against each sequence run alone, forward and
backward, against fla's naive reference per sequence, and the boundary rules' errors."""
import pytest
import torch
import torch.nn.functional as F

from k3.ops.kda import kda, naive_recurrent_kda
from k3.ops.kda.varlen import naive_varlen_kda

fla_naive = pytest.importorskip("fla.ops.kda.naive")

LENGTHS = [1, 5, 70, 3, 130, 1]  # length-1 sequences, sequences shorter than a chunk, several chunks


def inputs(lengths=LENGTHS, H=2, K=16, V=8, seed=0, dtype=torch.float64):
    g_ = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q = F.normalize(torch.randn(1, T, H, K, generator=g_, dtype=dtype), dim=-1)
    k = F.normalize(torch.randn(1, T, H, K, generator=g_, dtype=dtype), dim=-1)
    v = torch.randn(1, T, H, V, generator=g_, dtype=dtype)
    g = F.logsigmoid(torch.randn(1, T, H, K, generator=g_, dtype=dtype))
    beta = torch.rand(1, T, H, generator=g_, dtype=dtype)
    init = torch.randn(len(lengths), H, K, V, generator=g_, dtype=dtype)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return [q, k, v, g, beta, init], cu


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("impl", ["naive", "chunk", "recurrent"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_packed_equals_each_sequence_alone_forward_and_backward(impl, dtype):
    xs, cu = inputs(dtype=dtype)
    leaves = [x.clone().requires_grad_(True) for x in xs]
    o, s = kda(*leaves[:5], initial_state=leaves[5], output_final_state=True, impl=impl, cu_seqlens=cu)
    ref_leaves = [x.clone().requires_grad_(True) for x in xs]
    ro, rs = naive_varlen_kda(naive_recurrent_kda, *ref_leaves[:5], cu, initial_state=ref_leaves[5],
                              output_final_state=True)
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    assert o.shape == ro.shape and s.shape == (len(LENGTHS), 2, 16, 8)
    assert rel(o, ro) < tol and rel(s, rs) < tol
    w1, w2 = torch.randn_like(o), torch.randn_like(s)
    ((o * w1).sum() + (s * w2).sum()).backward()
    ((ro * w1).sum() + (rs * w2).sum()).backward()
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), leaves, ref_leaves):
        assert rel(a.grad, b.grad) < tol, name


def test_no_information_crosses_a_boundary():
    xs, cu = inputs(dtype=torch.float64)
    o, _ = kda(*xs[:5], cu_seqlens=cu, impl="chunk")
    changed = [x.clone() for x in xs]
    a, b = int(cu[2]), int(cu[3])  # the third sequence
    for x in changed[:5]:
        x[:, a:b] = x[:, a:b].flip(1) * 0.5 + 0.1  # rewrite that sequence
    o2, _ = kda(*changed[:5], cu_seqlens=cu, impl="chunk")
    assert torch.equal(o[:, :a], o2[:, :a]) and torch.allclose(o[:, b:], o2[:, b:], rtol=0, atol=1e-12)
    assert not torch.allclose(o[:, a:b], o2[:, a:b])


def test_matches_fla_naive_reference_per_sequence():
    xs, cu = inputs(dtype=torch.float32)
    o, s = kda(*xs[:5], initial_state=xs[5], output_final_state=True, cu_seqlens=cu)
    ro, rs = naive_varlen_kda(fla_naive.naive_recurrent_kda, *xs[:5], cu, initial_state=xs[5],
                              output_final_state=True)
    assert rel(o, ro) < 1e-5 and rel(s, rs) < 1e-5


@pytest.mark.parametrize("cu,match", [
    (torch.tensor([0, 5, 3, 8], dtype=torch.int32), "strictly increasing"),
    (torch.tensor([0, 5, 5, 8], dtype=torch.int32), "strictly increasing"),
    (torch.tensor([1, 5, 8], dtype=torch.int32), "start at 0"),
    (torch.tensor([0, 5, 7], dtype=torch.int32), "end at T = 8"),
    (torch.tensor([0.0, 5.0, 8.0]), "int32"),
    (torch.tensor([[0, 8]], dtype=torch.int32), "1-D"),
    ([0, 8], "1-D tensor"),
])
def test_bad_boundaries_name_the_rule(cu, match):
    xs, _ = inputs(lengths=[5, 3], dtype=torch.float32)
    with pytest.raises(ValueError, match=match):
        kda(*xs[:5], cu_seqlens=cu)


def test_packed_rows_need_batch_one_and_a_state_per_sequence():
    xs, cu = inputs(lengths=[5, 3], dtype=torch.float32)
    two = [torch.cat([x, x]) for x in xs[:5]]
    with pytest.raises(ValueError, match="batch must be 1"):
        kda(*two, cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"initial_state must be \[N, H, K, V\] = \[2, 2, 16, 8\]"):
        kda(*xs[:5], initial_state=xs[5][:1], cu_seqlens=cu)


def test_buckets_bound_the_padding():
    from k3.ops.kda.varlen import MAX_PADDING, buckets

    for lengths in ([16, 32, 64, 128, 256, 512, 1024, 2048], [1, 5, 70, 3, 130, 1], [7] * 9, [300]):
        groups = buckets(lengths)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        for g in groups:
            longest = max(lengths[i] for i in g)
            assert len(g) == 1 or len(g) * longest <= MAX_PADDING * sum(lengths[i] for i in g)
    assert buckets([7] * 9) == [list(range(9))]  # equal lengths: one batch, no padding
