"""Released checkpoints: k3.load of tiny Kimi-Linear models that transformers 5.25.0 builds and saves offline,
parity with transformers, k3 export --format kimi both ways, K3's MXFP4 experts as compressed-tensors ships
them, and the errors of broken folders."""
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import k3
from k3.config import get_config
from k3.io.export import export_kimi
from k3.io.kimi import CheckpointFormatError
from k3.model.transformer import K3Model

transformers = pytest.importorskip("transformers")
from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402

SHAPES = {
    # q_lora null, one shared expert, the first layer dense, MLA every 4th
    "plain": dict(q_lora_rank=None, n_shared_experts=1, first_k_dense_replace=1, full=[4], layers=4),
    # q_lora set, two shared experts, two dense layers, MLA at 2 and 4
    "q_lora": dict(q_lora_rank=12, n_shared_experts=2, first_k_dense_replace=2, full=[2, 4], layers=5),
}


def kimi_linear(shape: str, seed: int = 0) -> KimiLinearForCausalLM:
    s = SHAPES[shape]
    L = s["layers"]
    cfg = KimiLinearConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=L,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=8, q_lora_rank=s["q_lora_rank"],
        qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, num_local_experts=4, num_experts_per_tok=2,
        n_shared_experts=s["n_shared_experts"], pad_token_id=0, bos_token_id=1, eos_token_id=2,
        first_k_dense_replace=s["first_k_dense_replace"],
        linear_attn_config={"kda_layers": [i for i in range(1, L + 1) if i not in s["full"]],
                            "full_attn_layers": s["full"], "num_heads": 2, "head_dim": 8, "short_conv_kernel_size": 4})
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(cfg).eval()
    with torch.no_grad():  # weights larger than the init, so that a misplaced tensor changes the logits
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 1 / p.shape[-1] ** 0.5)
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.normal_(0, 0.1)
    return model


@pytest.fixture(scope="module", params=list(SHAPES))
def released(request, tmp_path_factory):
    hf = kimi_linear(request.param)
    path = tmp_path_factory.mktemp(f"kimi-{request.param}")
    hf.save_pretrained(path)
    return hf, path


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def test_load_matches_transformers(released):
    hf, path = released
    model = k3.load(path)
    c = model.config
    assert not model.training and c.attnres == "none" and c.hidden_act == "silu" and c.moe == "standard"
    assert c.gate_lower_bound is None and not c.use_full_rank_gate and c.qk_rope_head_dim == 4
    ids = torch.randint(3, 96, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert rel(model(ids), hf(ids).logits) < 1e-5


def test_prefill_then_decode_equals_full_forward(released):
    _, path = released
    model = k3.load(path)
    ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        steps = [model(ids[:, :7], cache)] + [model(ids[:, t:t + 1], cache) for t in range(7, 12)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_greedy_tokens_equal_transformers_generate(released):
    hf, path = released
    model = k3.load(path)
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model.generate(ids, max_new_tokens=8)
        theirs = hf.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert ours.tolist() == theirs.tolist()


def test_export_kimi_linear_loads_in_transformers_bit_exact(released, tmp_path):
    hf, path = released
    out, info = export_kimi(path, tmp_path / "out")
    assert info["model_type"] == "kimi_linear"
    back = KimiLinearForCausalLM.from_pretrained(out).eval()
    want, got = hf.state_dict(), back.state_dict()
    assert set(want) == set(got)
    for k in want:
        assert torch.equal(want[k], got[k]), k
    # and from a model k3 trained: its own checkpoint in the Kimi-Linear forms
    model = k3.load(path)
    ids = torch.randint(3, 96, (1, 9))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, hf(ids).logits)
        assert rel(model(ids), back(ids).logits) < 1e-5


def test_meta_load_reads_no_tensor(released, tmp_path):
    _, path = released
    broken = tmp_path / "meta"
    shutil.copytree(path, broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors")  # never opened
    model = k3.load(broken, device="meta")
    assert next(model.parameters()).is_meta and model.config.n_layers == len(model.layers)


# ---------------------------------------------------------------------------------------------- kimi_k3
def k3_checkpoint(tmp: Path) -> tuple[K3Model, Path]:
    """A k3 training checkpoint of `tiny` (the released forms) with MXFP4 routed experts, QAT-style."""
    from k3.train.checkpoint import save_checkpoint

    torch.manual_seed(0)
    cfg = get_config("tiny", qat={"expert_weights": "mxfp4"}, kda_norm_eps=1e-6)  # one eps, as the release has
    model = K3Model(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 1 / p.shape[-1] ** 0.5) if p.dim() >= 2 else p.add_(0.3 * torch.randn_like(p))
        for m in model.moe_layers():
            m.router.bias.normal_(0, 0.1)
    root = tmp / "ckpt"
    save_checkpoint(root, 1, model, config=cfg)
    return model, root


def _released_view(model: K3Model, L: int) -> dict:
    """What the release calls each of K3's additions, written out by hand from the module tree (not from
    k3.io.kimi's table): a swapped pair of names there fails this."""
    P, ar = "language_model.model.", model.attnres
    out = {P + "output_attn_res_proj.weight": ar.pseudo_query[2 * L].reshape(1, -1),
           P + "output_attn_res_norm.weight": ar.key_norm[2 * L]}
    for i, block in enumerate(model.layers):
        s = f"{P}layers.{i}."
        out[s + "self_attention_res_proj.weight"] = ar.pseudo_query[2 * i].reshape(1, -1)
        out[s + "self_attention_res_norm.weight"] = ar.key_norm[2 * i]
        out[s + "mlp_res_proj.weight"] = ar.pseudo_query[2 * i + 1].reshape(1, -1)
        out[s + "mlp_res_norm.weight"] = ar.key_norm[2 * i + 1]
        if block.kind == "K":
            out[s + "self_attn.g_proj.weight"] = block.mixer.g_proj.weight
            out[s + "self_attn.f_a_proj.weight"] = block.mixer.alpha_down.weight
        else:
            out[s + "self_attn.g_proj.weight"] = block.mixer.w_gate.weight
        if hasattr(block.ffn, "latent_norm"):
            b = s + "block_sparse_moe."
            out[b + "routed_expert_down_proj.weight"] = block.ffn.w_down.weight
            out[b + "routed_expert_up_proj.weight"] = block.ffn.w_up.weight
            out[b + "routed_expert_norm.weight"] = block.ffn.latent_norm.weight
            out[b + "experts.3.w2.weight_packed"] = block.ffn.experts.w2_codes[3]
            out[b + "experts.1.w1.weight_scale"] = block.ffn.experts.w1_scales[1]
    return out


def _mismatches(folder: Path, view: dict) -> list[str]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return [k for k, v in view.items() if not torch.equal(f.get_tensor(k), v.detach())]


def test_kimi_k3_roundtrip_is_bit_exact_and_places_each_addition(tmp_path):
    from k3.quant.export import pack_model

    model, ckpt = k3_checkpoint(tmp_path)
    out, info = export_kimi(ckpt, tmp_path / "k3-release")
    assert info["model_type"] == "kimi_k3" and info["mxfp4_experts"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k3" and cfg["quantization_config"]["format"] == "mxfp4-pack-quantized"
    loaded = k3.load(out)
    packed = K3Model(model.config).eval()
    packed.load_state_dict(model.state_dict())
    pack_model(packed)  # what QAT's fake quant computes, packed as the release stores it
    assert not _mismatches(out, _released_view(packed, model.config.n_layers))
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded(ids), packed(ids))
        torch.testing.assert_close(loaded(ids), model(ids), atol=1e-5, rtol=1e-5)  # = the fake-quant model
    again, _ = export_kimi(out, tmp_path / "again")  # load -> export -> load
    a, b = load_file(out / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # a pair of same-shaped names swapped in the file is caught by the hand-written view
    swapped = tmp_path / "swapped"
    shutil.copytree(out, swapped)
    x, y = "language_model.model.layers.1.self_attention_res_proj.weight", "language_model.model.layers.1.mlp_res_proj.weight"
    a[x], a[y] = a[y], a[x]
    save_file(a, str(swapped / "model.safetensors"))
    assert set(_mismatches(swapped, _released_view(packed, model.config.n_layers))) == {x, y}


def test_mxfp4_experts_dequantize_as_compressed_tensors_does(tmp_path):
    ct = pytest.importorskip("compressed_tensors.compressors.nvfp4.helpers")
    from compressed_tensors.compressors.mx_utils import decompress_mx_scale

    _, ckpt = k3_checkpoint(tmp_path)
    out, _ = export_kimi(ckpt, tmp_path / "rel")
    model = k3.load(out)
    experts = model.moe_layers()[0].experts
    w1, w3, w2 = experts.expert_weights()  # k3's dequantization: [E, in, out]
    i = next(i for i, b in enumerate(model.layers) if b.ffn is model.moe_layers()[0])
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        for name, ours in (("w1", w1), ("w3", w3), ("w2", w2)):
            for e in range(experts.n_experts):
                key = f"language_model.model.layers.{i}.block_sparse_moe.experts.{e}.{name}"
                packed, scale = f.get_tensor(key + ".weight_packed"), f.get_tensor(key + ".weight_scale")
                m, n = packed.shape
                vals = ct.unpack_fp4_from_uint8(packed, m, 2 * n, dtype=torch.float32)
                s = decompress_mx_scale(scale).float().repeat_interleave(32, dim=1)
                assert torch.equal(vals * s, ours[e].T), (key, e)


# ---------------------------------------------------------------------------------------------- errors
@pytest.fixture
def folder(tmp_path):
    hf = kimi_linear("plain")
    hf.save_pretrained(tmp_path / "m")
    return tmp_path / "m"


def _edit_config(folder: Path, **changes):
    d = json.loads((folder / "config.json").read_text())
    d.update(changes)
    (folder / "config.json").write_text(json.dumps(d))


def test_unknown_model_type_and_inexpressible_field(folder):
    _edit_config(folder, model_type="kimi_linear", mla_use_nope=False)
    with pytest.raises(CheckpointFormatError, match=r"config.json: mla_use_nope = False .*rotary"):
        k3.load(folder)
    _edit_config(folder, model_type="llama")
    with pytest.raises(CheckpointFormatError, match=r"model_type 'llama' is not one k3 reads"):
        k3.load(folder)


def test_missing_extra_and_misshapen_tensors_are_listed(folder):
    t = load_file(folder / "model.safetensors")
    del t["model.layers.1.self_attn.dt_bias"]
    t["model.layers.9.surprise.weight"] = torch.zeros(2)
    save_file(t, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointFormatError, match=r"1 missing: \['model.layers.1.self_attn.dt_bias'\].*1 not part "
                                                    r"of the model.*model.layers.9.surprise.weight"):
        k3.load(folder)
    t = load_file(folder / "model.safetensors")
    t.pop("model.layers.9.surprise.weight")
    t["model.layers.1.self_attn.dt_bias"] = torch.zeros(15)
    save_file(t, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointFormatError, match=r"model.layers.1.self_attn.dt_bias has shape \(15,\).*wants \(16,\)"):
        k3.load(folder)


def test_truncated_shard_and_index_naming_a_missing_shard(folder):
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointFormatError, match=r"model.safetensors: the header describes \d+ bytes, the file holds \d+; it is truncated"):
        k3.load(folder)
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(CheckpointFormatError, match=r"names shard model-00002-of-00002.safetensors, which is not in"):
        k3.load(folder)


def test_export_refuses_before_writing(tmp_path, folder):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="exists and is not empty"):
        export_kimi(folder, tmp_path / "busy")
    assert [p.name for p in (tmp_path / "busy").iterdir()] == ["notes.txt"]
    with pytest.raises(CheckpointFormatError, match="kimi_linear cannot hold them"):
        _, ckpt = k3_checkpoint(tmp_path)
        export_kimi(ckpt, tmp_path / "x", model_type="kimi_linear")
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.tmp-*"))


def test_sharded_export_loads_the_same(tmp_path, folder):
    out, info = export_kimi(folder, tmp_path / "sharded", max_shard_bytes=20_000)
    assert len(info["shards"]) > 1 and (out / "model.safetensors.index.json").is_file()
    a, b = k3.load(folder), k3.load(out)
    ids = torch.randint(3, 96, (1, 7))
    with torch.no_grad():
        assert torch.equal(a(ids), b(ids))
    assert math.isclose(a.config.routed_scale, 2.446)


def test_direct_reader_equals_safetensors(tmp_path):
    """k3.io's plain-read safetensors reader (the streaming path) against safetensors' own safe_open."""
    from k3.io.kimi import SafetensorsFile

    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(3, 5, generator=g), "b": torch.randn(7, generator=g).bfloat16(),
               "c": torch.randint(0, 255, (4, 2), dtype=torch.uint8, generator=g), "empty": torch.zeros(0, 3),
               "i": torch.arange(6, dtype=torch.int64).reshape(2, 3)}
    save_file(tensors, str(tmp_path / "t.safetensors"))
    ours = SafetensorsFile(tmp_path / "t.safetensors")
    with safe_open(str(tmp_path / "t.safetensors"), framework="pt") as ref:
        assert set(ours.keys()) == set(ref.keys())
        for k in ref.keys():
            assert ours.get(k).dtype == ref.get_tensor(k).dtype and torch.equal(ours.get(k), ref.get_tensor(k)), k


def test_cli_commands_take_a_released_folder(tmp_path, capsys):
    """k3 export --format kimi from a k3 checkpoint, then k3 sample and the server's loader on the folder: the
    same greedy text as from the checkpoint itself, with the tokenizer the export ships."""
    from k3.cli import main
    from k3.data.corpus import open_corpus
    from k3.data.tokenizer import train_tokenizer
    from k3.serve.server import load_for_serving
    from k3.train.checkpoint import save_checkpoint

    texts = [t for _, t in open_corpus().documents("train", max_bytes=100_000)]
    tok = train_tokenizer(texts, 512, path=tmp_path / "tok")
    torch.manual_seed(0)
    model = K3Model(get_config("tiny", kda_norm_eps=1e-6))
    save_checkpoint(tmp_path / "ckpt", 1, model, config=model.config, data_state={"tokenizer": str(tok.path)})
    assert main(["export", "--format", "kimi", str(tmp_path / "ckpt"), "--out", str(tmp_path / "rel")]) == 0
    assert "kimi_k3" in capsys.readouterr().out and (tmp_path / "rel" / "tokenizer.json").is_file()
    texts = []
    for ckpt in (tmp_path / "ckpt", tmp_path / "rel"):
        assert main(["sample", "--ckpt", str(ckpt), "--prompt", "def f", "--max-new-tokens", "6",
                     "--temperature", "0"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].startswith("def f")
    served, served_tok, manifest = load_for_serving(tmp_path / "rel")
    assert manifest["model_type"] == "kimi_k3" and served_tok.fingerprint == tok.fingerprint
    assert main(["export", "--format", "kimi", str(tmp_path / "ckpt"), "--out", str(tmp_path / "rel"),
                 "--tokenizer", str(tok.path)]) == 2
    assert "do not apply to --format kimi" in capsys.readouterr().err
