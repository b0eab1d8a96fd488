"""Streamed routed experts (k3.io.stream): a tiny kimi_k3 folder written locally in the released layout, loaded
resident and streamed through a cache that holds a fraction of its experts; logits, greedy tokens, the cache's
bound, the prefetch and the refused budget."""
import pytest
import torch

import k3
from k3.config import get_config
from k3.io.export import export_kimi
from k3.io.stream import PARTS, _dequant_into, parse_bytes
from k3.model.transformer import K3Model
from k3.quant.export import unpack_expert_weight


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from k3.train.checkpoint import save_checkpoint

    tmp = tmp_path_factory.mktemp("stream")
    torch.manual_seed(0)
    cfg = get_config("tiny", qat={"expert_weights": "mxfp4"}, kda_norm_eps=1e-6)
    model = K3Model(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 1 / p.shape[-1] ** 0.5) if p.dim() >= 2 else p.add_(0.3 * torch.randn_like(p))
        for m in model.moe_layers():
            m.router.bias.normal_(0, 0.1)
    from k3.data.corpus import open_corpus
    from k3.data.tokenizer import train_tokenizer

    texts = [t for _, t in open_corpus().documents("train", max_bytes=100_000)]
    tok = train_tokenizer(texts, cfg.vocab_size, path=tmp / "tok")  # shipped beside the export, for the server
    save_checkpoint(tmp / "ckpt", 1, model, config=cfg, data_state={"tokenizer": str(tok.path)})
    out, _ = export_kimi(tmp / "ckpt", tmp / "release")
    return out


def _budget(model, experts_cached: int) -> int:
    info = model.stream_info
    return info["ram_budget"] - info["cache_capacity"] + experts_cached * info["expert_bytes"]


def _streamed(folder, experts_cached=None, prefetch=True):
    big = k3.load(folder, experts="stream", ram_budget="1GB", prefetch=prefetch)
    if experts_cached is None:
        return big
    budget = _budget(big, experts_cached)
    big.expert_cache.close()
    return k3.load(folder, experts="stream", ram_budget=budget, prefetch=prefetch)


@pytest.mark.parametrize("prefetch", [True, False])
def test_streamed_equals_resident(folder, prefetch):
    resident = k3.load(folder)
    cfg = resident.config
    n_moe = len(resident.moe_layers())
    # a cache for about a third of the experts: every forward evicts and reads again
    streamed = _streamed(folder, experts_cached=max(cfg.n_active_experts, cfg.n_experts * n_moe // 3), prefetch=prefetch)
    try:
        ids = torch.randint(3, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            a, b = resident(ids), streamed(ids)
            assert (a - b).abs().max().item() <= 1e-6
            prompt = ids[:1, :5]
            ga = resident.generate(prompt, max_new_tokens=10)
            gb = streamed.generate(prompt, max_new_tokens=10)
        assert ga.tolist() == gb.tolist()
        s = streamed.expert_cache.stats()
        assert s["misses"] > 0 and s["hits"] > 0 and s["bytes_read"] > 0
        assert s["cache_bytes"] <= s["capacity_bytes"]  # back under the bound once nothing is pinned
        assert (s["prefetched"] > 0) == prefetch
    finally:
        streamed.expert_cache.close()


def test_one_read_per_expert_in_the_released_layout(folder):
    m = _streamed(folder)
    try:
        store = m.expert_cache.store
        store.read(0, 3)
        assert store.reads == 1 and store.bytes_read == store.expert_bytes
    finally:
        m.expert_cache.close()


def test_dequant_into_equals_the_resident_unpacking(folder):
    m = _streamed(folder)
    try:
        packed = m.expert_cache.store.read(1, 2)
        for i, w in enumerate(("w1", "w3", "w2")):
            codes, scales = packed[2 * i].unsqueeze(0), packed[2 * i + 1].unsqueeze(0)
            out = torch.empty(codes.numel() * 2)
            assert torch.equal(_dequant_into(codes, scales, out).transpose(1, 2),
                               unpack_expert_weight(codes, scales, "mxfp4")), w
        assert len(packed) == len(PARTS)
    finally:
        m.expert_cache.close()


def test_budget_below_trunk_plus_one_layer_is_refused(folder):
    m = _streamed(folder)
    need = m.stream_info["min_budget"]
    m.expert_cache.close()
    with pytest.raises(ValueError, match=r"below what .* needs .* trunk .* give at least"):
        k3.load(folder, experts="stream", ram_budget=need - 1)
    k3.load(folder, experts="stream", ram_budget=need).expert_cache.close()


def test_stream_needs_a_budget_and_parse_bytes():
    assert parse_bytes("8GB") == 8 * 10**9 and parse_bytes("1.5 GiB") == int(1.5 * 2**30) and parse_bytes(100) == 100
    for bad in ("eight", "-1GB", "0", "3 parsecs"):
        with pytest.raises(ValueError):
            parse_bytes(bad)
    with pytest.raises(ValueError, match="ram_budget"):
        k3.load(".", experts="stream")
    with pytest.raises(ValueError, match="released"):
        k3.load(".", experts="stream", ram_budget="1GB")


def test_serving_loads_streamed_and_the_flags_are_checked(folder, capsys):
    pytest.importorskip("fastapi")
    from k3.cli import main
    from k3.serve.engine import Engine
    from k3.serve.server import load_for_serving

    model, _, manifest = load_for_serving(folder, experts="stream", ram_budget="1GB")
    try:
        assert manifest["model_type"] == "kimi_k3" and model.expert_cache is not None
        ids = torch.tensor([[5, 6, 7]])
        with torch.no_grad():
            want = k3.load(folder).generate(ids, max_new_tokens=4)
            assert model.generate(ids, max_new_tokens=4).tolist() == want.tolist()
        assert Engine(model, None).model is model
    finally:
        model.expert_cache.close()
    assert main(["serve", "--ckpt", str(folder), "--ram-budget", "8GB"]) != 0
    assert "--stream-experts" in capsys.readouterr().err
    assert main(["serve", "--ckpt", str(folder), "--stream-experts"]) != 0
    assert "--ram-budget" in capsys.readouterr().err
    assert main(["serve", "--ckpt", str(folder), "--stream-experts", "--ram-budget", "1KB"]) != 0
    assert "give at least" in capsys.readouterr().err


def test_fp8_trunk_is_smaller_and_equals_its_dequantized_weights(folder, capsys):
    """trunk="fp8": the trunk's matrices stored as e4m3 with a scale per row (torchao), filled block by block.
    Under half the fp32 trunk's bytes here (the embedding stays), and its logits are the fp32 streamed model's
    with each of those matrices replaced by its dequantized fp8 value (this random model amplifies a 2.5% weight
    error into far more in the logits, so the reference applies the same rounding)."""
    ref = _streamed(folder)
    fp8 = k3.load(folder, experts="stream", ram_budget="1GB", trunk="fp8")
    try:
        assert fp8.stream_info["trunk"] == "fp8"
        assert fp8.stream_info["trunk_bytes"] < 0.5 * ref.stream_info["trunk_bytes"]
        quantized = {n: m.weight for n, m in fp8.named_modules()
                     if isinstance(m, torch.nn.Linear) and hasattr(m.weight, "qdata")}
        assert quantized and not any(n.endswith("wkv_b") for n in quantized)
        mods = dict(ref.named_modules())
        with torch.no_grad():
            for n, w in quantized.items():
                mods[n].weight.copy_(w.qdata.float() * w.scale)
            ids = torch.randint(3, fp8.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
            a, b = ref(ids), fp8(ids)
        assert (a - b).abs().max().item() <= 1e-4 * a.abs().max().item()
    finally:
        ref.expert_cache.close()
        fp8.expert_cache.close()
    with pytest.raises(ValueError, match="trunk"):
        k3.load(folder, trunk="fp8")
    with pytest.raises(ValueError, match="'fp8'"):
        k3.load(folder, experts="stream", ram_budget="1GB", trunk="fp4")
    from k3.cli import main

    assert main(["serve", "--ckpt", str(folder), "--trunk", "fp8"]) != 0
    assert "--stream-experts" in capsys.readouterr().err
