"""Packed MX export: same logits as the fake-quant model, 4.25 bits per routed-expert parameter, clear errors."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3.cli import main
from k3.config import get_config
from k3.io.export import export_mx
from k3.model.transformer import K3Model
from k3.quant.export import EXPORT_KEY, EXPORT_VERSION, PackedRoutedExperts, load_packed, pack_model
from k3.quant.sizes import checkpoint_bytes
from k3.train import checkpoint as ckpt
from k3.io.trained import load_trained_model

K3_QAT = {"expert_weights": "mxfp4", "activations": "mxfp8"}


def _ckpt(tmp_path, qat, name="ck"):
    """A tiny checkpoint whose routed experts matter to the logits (at init they barely do), saved as the
    trainer saves."""
    torch.manual_seed(0)
    cfg = get_config("tiny", qat=qat)
    m = K3Model(cfg)
    with torch.no_grad():
        for moe in m.moe_layers():
            moe.router.bias.normal_(std=0.1)  # persistent buffers travel too
            for w in (moe.experts.w1, moe.experts.w3, moe.experts.w2, moe.w_down.weight, moe.w_up.weight):
                w.normal_(std=0.25)
    ckpt.save_checkpoint(tmp_path / name, 7, m, None, cfg, data_state={"tokenizer": "tok.json"})
    return tmp_path / name, cfg


@pytest.mark.parametrize("qat", [K3_QAT, {**K3_QAT, "linears": "mxfp4"}, {}], ids=["qat", "linears", "fp32"])
def test_packed_logits_equal_fake_quant_model(tmp_path, qat):
    src, cfg = _ckpt(tmp_path, qat)
    out = export_mx(src, tmp_path / "ex", activations="keep" if qat else "mxfp8")
    packed, manifest = load_packed(tmp_path / "ex")
    assert manifest["data"]["tokenizer"] == "tok.json" and manifest["step"] == 7 and out.name == "step_000007"
    for moe in packed.moe_layers():
        assert isinstance(moe.experts, PackedRoutedExperts)
        assert not any(p.dtype != torch.float32 for p in moe.experts.parameters())  # no fp32 expert copy
    # the fake-quant reference: the checkpoint's weights in a model built from the export's config (for the
    # fp32 checkpoint that is PTQ: fp32-trained weights, qat config)
    fq_cfg = get_config("tiny", qat=qat or K3_QAT)
    assert packed.config == fq_cfg
    fq = K3Model(fq_cfg)
    ckpt.load_checkpoint(src, fq, restore_rng=False)
    x = torch.randint(0, cfg.vocab_size, (2, 24))
    with torch.no_grad():
        a, b = fq.eval()(x), packed(x)
        plain, _ = load_trained_model(src)
        c = plain(x)
    assert (a - b).abs().max() <= 1e-5 * a.abs().max()
    if not qat:
        assert (a - c).abs().max() > 1e-4  # and PTQ really differs from the fp32 model
    for impl in ("naive", "loop"):  # every compute path runs from the packed weights
        for moe in packed.moe_layers():
            moe.impl = impl
        with torch.no_grad():
            assert (packed(x[:1, :6]) - a[:1, :6]).abs().max() <= 1e-5 * a.abs().max()


def test_storage_is_4_25_bits_per_routed_parameter(tmp_path):
    src, cfg = _ckpt(tmp_path, K3_QAT)
    path = export_mx(src, tmp_path / "ex")
    stored = load_file(str(path / "model.safetensors"))
    experts = {n: t for n, t in stored.items() if ".experts." in n}
    assert experts and all(t.dtype == torch.uint8 for t in experts.values())
    assert not any(n.endswith((".w1", ".w2", ".w3")) for n in stored)
    n_params = sum(p.numel() for n, p in K3Model(cfg).named_parameters() if ".experts." in n)
    n_bytes = sum(t.numel() * t.element_size() for t in experts.values())
    assert 8 * n_bytes / n_params == 4.25
    assert {t.dtype for n, t in stored.items() if ".experts." not in n} == {torch.float32}
    # the by-component byte accounting uses the same layout as the file
    sizes = checkpoint_bytes(cfg)["by_component"]
    assert sizes["moe_routed"]["mx_rest_fp32"] == n_bytes
    assert sizes["total"]["mx_rest_fp32"] == sum(t.numel() * t.element_size() for t in stored.values())
    assert sizes["moe_routed"]["params"] == n_params


def test_mxfp8_experts_and_cached_dequant(tmp_path):
    src, _ = _ckpt(tmp_path, {"expert_weights": "mxfp8"})
    export_mx(src, tmp_path / "ex")
    packed, _ = load_packed(tmp_path / "ex")
    fq, _ = load_trained_model(src)
    x = torch.randint(0, 512, (1, 10))
    e = packed.moe_layers()[0].experts
    e.cache = True
    with torch.no_grad():
        assert torch.equal(packed(x), fq(x)) and e._cached is not None
        first = e._cached[1][0]
        packed(x)
        assert e._cached[1][0] is first  # reused while the buffers are unchanged
        e.w1_codes.zero_()
        assert not torch.equal(e.expert_weights()[0], first)


def _tamper(export_dir, fn):
    step = ckpt.latest_checkpoint(export_dir)
    tensors = load_file(str(step / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(step / "model.safetensors"))


def _tamper_manifest(export_dir, fn):
    path = ckpt.latest_checkpoint(export_dir) / ckpt.MANIFEST
    manifest = json.loads(path.read_text())
    fn(manifest)
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("case", ["scale_shape", "codes_dtype", "nan_scale", "missing", "stray", "version",
                                  "block_size", "format", "config", "hash", "truncated"])
def test_mismatched_export_is_a_clear_error(tmp_path, case):
    src, cfg = _ckpt(tmp_path, K3_QAT)
    ex = tmp_path / "ex"
    export_mx(src, ex)
    name = "layers.1.ffn.experts.w2_scales"
    kwargs = {}
    if case == "scale_shape":
        _tamper(ex, lambda t: t.__setitem__(name, t[name][:, :, :1].contiguous()))
        want = [name, "expert_ffn=64"]
    elif case == "codes_dtype":
        _tamper(ex, lambda t: t.__setitem__("layers.2.ffn.experts.w1_codes",
                                            t["layers.2.ffn.experts.w1_codes"].float()))
        want = ["layers.2.ffn.experts.w1_codes", "F32"]
    elif case == "nan_scale":
        _tamper(ex, lambda t: t[name].view(-1).__setitem__(3, 0xFF))
        want = [name, "0xFF"]
    elif case == "missing":
        _tamper(ex, lambda t: t.pop(name))
        want = [name, "missing"]
    elif case == "stray":
        _tamper(ex, lambda t: t.__setitem__("layers.1.ffn.experts.w4_codes", t[name].clone()))
        want = ["unexpected routed-expert tensor", "layers.1.ffn.experts.w4_codes"]
    elif case == "version":
        _tamper_manifest(ex, lambda m: m["extra"][EXPORT_KEY].__setitem__("version", 99))
        want = ["version 99", f"reads version {EXPORT_VERSION}"]
    elif case == "block_size":
        _tamper_manifest(ex, lambda m: m["extra"][EXPORT_KEY].__setitem__("block_size", 16))
        want = ["block_size 16", "block 32"]
    elif case == "format":
        _tamper_manifest(ex, lambda m: m["extra"][EXPORT_KEY].__setitem__("expert_weights", "mxfp8"))
        want = ["qat.expert_weights is 'mxfp4' but the export says 'mxfp8'"]
    elif case == "config":
        kwargs["config"] = get_config("tiny", qat=K3_QAT, expert_ffn=96)
        want = ["expert_ffn"]
    elif case == "truncated":
        file = ckpt.latest_checkpoint(ex) / "model.safetensors"
        size = file.stat().st_size
        with open(file, "r+b") as f:
            f.truncate(size // 2)
        want = [f"{size // 2} bytes where the manifest says {size}", "truncated", "k3 export --format mx"]
    else:
        step = ckpt.latest_checkpoint(ex)
        with open(step / "model.safetensors", "r+b") as f:  # flip one bit of the last tensor's data
            f.seek(-1, 2)
            last = f.read(1)[0]
            f.seek(-1, 2)
            f.write(bytes([last ^ 1]))
        want = ["sha256"]
    with pytest.raises(ValueError) as err:
        load_packed(ex, **kwargs)
    for w in want:
        assert w in str(err.value)


def test_export_refuses_bad_requests(tmp_path):
    src, _ = _ckpt(tmp_path, K3_QAT)
    export_mx(src, tmp_path / "ex")
    with pytest.raises(ValueError, match="overwrite"):
        export_mx(src, tmp_path / "ex")
    with pytest.raises(ValueError, match="already a packed"):
        export_mx(tmp_path / "ex", tmp_path / "ex2")
    # --overwrite replaces an earlier export, never training state: not into the source's own root
    before = sorted(p.name for p in src.iterdir())
    with pytest.raises(ValueError, match="training checkpoint.*does not replace"):
        export_mx(src, src, overwrite=True)
    with pytest.raises(ValueError, match="training checkpoint.*does not replace"):  # it said "pass --overwrite"
        export_mx(src, src)
    assert sorted(p.name for p in src.iterdir()) == before
    # a training run's folder (checkpoint/, metrics, plots): the export beside them would be what `--ckpt RUN` reads
    run = tmp_path / "run"
    (run / "checkpoint").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="holds checkpoint, metrics.jsonl, which an MX export does not write"):
        export_mx(src, run, overwrite=True)
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint", "metrics.jsonl"]
    with pytest.raises(ValueError, match="is a file"):
        export_mx(src, run / "metrics.jsonl")
    assert export_mx(src, tmp_path / "ex", overwrite=True).name == "step_000007"
    # an export killed just before its `latest` was renamed into place leaves `.latest.PID-*.tmp`: every later
    # export into that folder was refused as "holds .latest....tmp, which an MX export does not write"
    (tmp_path / "ex" / ".latest.999999999-abc.tmp").write_text("step_000007\n")
    assert export_mx(src, tmp_path / "ex", overwrite=True).name == "step_000007"
    assert not (tmp_path / "ex" / ".latest.999999999-abc.tmp").exists()
    # an export of an earlier step replaces a later one whole, rather than leaving it beside the new one
    export_mx(src, tmp_path / "later")
    m = K3Model(get_config("tiny", qat=K3_QAT))
    ckpt.save_checkpoint(tmp_path / "early", 3, m, None, m.config)
    assert export_mx(tmp_path / "early", tmp_path / "later", overwrite=True).name == "step_000003"
    assert [p.name for _, p in ckpt.step_dirs(tmp_path / "later")] == ["step_000003"]
    from k3.io.hf import export_hf

    with pytest.raises(ValueError, match=f"packed MX export.*instead \\({src}"):  # HF wants fp32 experts
        export_hf(tmp_path / "ex", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    with pytest.raises(ValueError, match="training checkpoint"):
        load_packed(src)
    m = K3Model(get_config("tiny"))
    with pytest.raises(ValueError, match="expert_weights"):
        pack_model(m)
    odd = get_config("tiny", moe_latent_dim=16, qat=K3_QAT)  # QAT pads the blocks; packing cannot
    ckpt.save_checkpoint(tmp_path / "odd", 1, K3Model(odd), None, odd)
    with pytest.raises(ValueError, match="multiple of 32"):
        export_mx(tmp_path / "odd", tmp_path / "ex3")
    # no routed experts at all: refused before anything is written (it wrote the export, then the CLI crashed)
    dense = get_config("tiny", n_dense_layers=get_config("tiny").n_layers)
    ckpt.save_checkpoint(tmp_path / "dense", 1, K3Model(dense), None, dense)
    with pytest.raises(ValueError, match="no routed experts to pack"):
        export_mx(tmp_path / "dense", tmp_path / "ex4")
    assert not (tmp_path / "ex4").exists()


def test_export_keeps_the_tokenizer_fingerprint_of_rl_and_distill_checkpoints(tmp_path):
    """`k3 rl` / `k3 distill` checkpoints name their tokenizer by fingerprint only (extra.tokenizer_sha256, the
    tokenizer.json in the experiment's root); the export dropped it, so `k3 sample` on the export did not find the
    tokenizer, and took another one of the same size without a word."""
    from k3.data.corpus import open_corpus
    from k3.data.tokenizer import train_tokenizer
    from k3.io.trained import checkpoint_tokenizer

    texts = [t for _, t in open_corpus().documents("train", max_bytes=150_000)]
    tok = train_tokenizer(texts, 512, path=tmp_path / "root")
    other = train_tokenizer(texts[1:], 512, path=tmp_path / "other")
    m = K3Model(get_config("tiny", qat=K3_QAT))
    ckpt.save_checkpoint(tmp_path / "root" / "run" / "checkpoint", 7, m, None, m.config, data_state={"next_step": 7},
                         extra={"tokens": 10, "tokenizer_sha256": tok.fingerprint})
    out = export_mx(tmp_path / "root" / "run" / "checkpoint", tmp_path / "root" / "export")
    _, manifest = load_trained_model(out)  # as `k3 sample` / `k3 eval` read it
    assert manifest["extra"]["tokenizer_sha256"] == tok.fingerprint and manifest["extra"]["tokens"] == 10
    assert checkpoint_tokenizer(manifest, 512).fingerprint == tok.fingerprint  # found beside the experiment
    assert other.fingerprint != tok.fingerprint
    with pytest.raises(ValueError, match="is not the one the model's training data was tokenized with"):
        checkpoint_tokenizer(manifest, 512, other.path)

@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_export_refuses_non_finite_expert_weights(tmp_path, bad):
    """NaN packed to the scale code 0xFF, which load refused with advice to re-export (which could not help);
    inf packed silently into a block of +-inf weights."""
    torch.manual_seed(0)
    cfg = get_config("tiny", qat=K3_QAT)
    m = K3Model(cfg)
    with torch.no_grad():
        m.moe_layers()[1].experts.w3[2, 0, 5] = bad
    ckpt.save_checkpoint(tmp_path / "ck", 1, m, None, cfg)
    with pytest.raises(ValueError, match=r"MoE layer 1 .*routed-expert w3 holds 1 non-finite value.*expert 2"):
        export_mx(tmp_path / "ck", tmp_path / "ex")
    assert not any((tmp_path / "ex").glob("step_*"))


def test_packed_model_builds_without_fp32_experts_and_follows_to_dtype(tmp_path):
    from k3.quant.export import build_packed_model

    src, cfg = _ckpt(tmp_path, K3_QAT)
    model = build_packed_model(get_config("tiny", qat=K3_QAT))
    assert not any(p.is_meta for p in [*model.parameters(), *model.buffers()])
    assert not any(".experts.w" in n and not n.endswith(("_codes", "_scales")) for n, _ in model.named_parameters())
    export_mx(src, tmp_path / "ex")
    packed, _ = load_packed(tmp_path / "ex")
    x = torch.randint(0, cfg.vocab_size, (1, 12))
    w32 = packed.moe_layers()[0].experts.expert_weights()
    with torch.no_grad():
        a = packed(x)
        b = packed.bfloat16()(x)  # it raised: the dequantized weights stayed fp32 while the rest was cast
    w16 = packed.moe_layers()[0].experts.expert_weights()
    assert b.dtype == torch.bfloat16 and all(torch.equal(u.bfloat16(), v) for u, v in zip(w32, w16))  # exact in bf16
    assert (a - b.float()).norm() <= 0.25 * a.norm()  # bf16 rounding elsewhere (these test weights amplify it: 0.11)


def test_cli_export_then_eval(tmp_path, tiny_data_dir, capsys):
    run = tmp_path / "run"
    args = ["--preset", "tiny", "--batch-size", "2", "--seq-len", "16", "--eval-batches", "1", "-q",
            "--data", str(tiny_data_dir), "--steps", "2", "--eval-every", "0"]
    assert main(["train", *args, "--out", str(run), "--qat"]) == 0
    manifest = json.loads((ckpt.latest_checkpoint(run / "checkpoint") / "manifest.json").read_text())
    assert manifest["config"]["qat"] == K3_QAT
    capsys.readouterr()
    assert main(["export", "--format", "mx", str(run / "checkpoint"), "--out", str(tmp_path / "ex")]) == 0
    assert "4.250 bits/param" in capsys.readouterr().out
    scores = []
    for where in (run / "checkpoint", tmp_path / "ex"):
        assert main(["eval", "--ckpt", str(where), "--batch-size", "2", "--max-batches", "2", "--json"]) == 0
        scores.append(json.loads(capsys.readouterr().out)["val_loss"])
    assert scores[0] == pytest.approx(scores[1], rel=1e-6, abs=1e-6)
    assert main(["sample", "--ckpt", str(tmp_path / "ex"), "--prompt", "def ", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("def ")
    assert main(["export", "--format", "gguf", str(run / "checkpoint"), "--out", str(tmp_path / "e2")]) == 2
    assert "use one of mx, hf" in capsys.readouterr().err
    assert main(["quant-bytes", "--preset", "tiny", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["by_component"]["moe_routed"]["params"] > 0
