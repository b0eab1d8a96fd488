"""HF transformers integration: Auto classes, safetensors round trip, generate() against K3Model.generate,
the tokenizer as PreTrainedTokenizerFast, checkpoint export, and clear errors for mismatches."""
import json
import os

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast  # noqa: E402

from k3.config import get_config  # noqa: E402
from k3.data.corpus import open_corpus  # noqa: E402
from k3.data.tokenizer import SPECIAL_TOKENS, load_tokenizer, train_tokenizer  # noqa: E402
from k3.model.transformer import K3Model  # noqa: E402
from k3.io.hf import (K3ForCausalLM, K3GenerationCache, K3HFConfig, check_tokenizer, export_hf,  # noqa: E402
                         load_hf, to_hf_tokenizer)
from k3.train.checkpoint import save_checkpoint  # noqa: E402

VOCAB = 512  # tiny's vocab_size


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    texts = [t for _, t in open_corpus().documents("train", max_bytes=100_000)]
    return train_tokenizer(texts, VOCAB, path=tmp_path_factory.mktemp("tok"))


def k3_model(**overrides) -> K3Model:
    """A tiny model whose router biases are not all zero, so the persistent buffers matter in a round trip."""
    model = K3Model(get_config("tiny", **overrides)).eval()
    with torch.no_grad():
        for moe in model.moe_layers():
            moe.router.bias.uniform_(-0.05, 0.05)
    return model


def prompt(b: int = 1, t: int = 9, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(len(SPECIAL_TOKENS), VOCAB, (b, t), generator=g)  # no special ids (no pad in the mask)


def test_auto_classes_resolve_k3():
    cfg = AutoConfig.for_model("k3", **get_config("tiny").to_dict())
    assert isinstance(cfg, K3HFConfig) and cfg.model_type == "k3"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (64, 4, VOCAB)
    assert cfg.to_k3() == get_config("tiny")
    model = AutoModelForCausalLM.from_config(cfg)
    assert isinstance(model, K3ForCausalLM)
    ref = K3Model(get_config("tiny")).eval()
    ref.load_state_dict({k.removeprefix("model."): v for k, v in model.state_dict().items()})
    ids = prompt(2, 7)
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, ref(ids))


@pytest.mark.parametrize("tie", [False, True])
def test_save_pretrained_round_trip_has_identical_logits(tmp_path, tie):
    src = K3ForCausalLM.from_k3(k3_model(tie_embeddings=tie)).eval()
    src.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file() and not list(tmp_path.glob("*.bin"))
    stored = json.loads((tmp_path / "config.json").read_text())
    assert stored["model_type"] == "k3" and stored["n_layers"] == 4 and stored["tie_embeddings"] is tie
    assert isinstance(AutoConfig.from_pretrained(tmp_path), K3HFConfig)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(loaded, K3ForCausalLM) and not loaded.training
    assert loaded.model.config == src.model.config
    for (name, a), b in zip(src.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    if tie:
        assert loaded.model.head.weight.data_ptr() == loaded.model.embed.weight.data_ptr()
    ids = prompt(2, 11)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, src(ids).logits)


def test_generate_greedy_equals_k3_generate_and_uses_the_hybrid_cache():
    hf = K3ForCausalLM.from_k3(k3_model(), eos_token_id=None).eval()
    seen = []
    inner = hf.model.hidden_states
    hf.model.hidden_states = lambda ids, cache=None: (seen.append((ids.shape[1], type(cache))), inner(ids, cache))[1]
    ids = prompt(2, 9)
    out = hf.generate(ids, max_new_tokens=12, do_sample=False)
    hf.model.hidden_states = inner
    ref = hf.model.generate(ids, 12)
    assert out.shape == (2, 21) and torch.equal(out, ref)
    # one prefill of the whole prompt, then one token per step through k3's cache
    assert [n for n, _ in seen] == [9] + [1] * 11 and all(c is K3GenerationCache for _, c in seen)


def test_generate_takes_a_plain_k3_cache_and_refuses_a_too_long_request_up_front():
    m = k3_model()
    hf = K3ForCausalLM.from_k3(m, eos_token_id=None).eval()
    ids = prompt(1, 6)
    cache = m.new_cache()  # K3Model's plain HybridCache, as the error messages suggest
    assert torch.equal(hf.generate(ids, cache=cache, max_new_tokens=4, do_sample=False),
                       hf.generate(ids, max_new_tokens=4, do_sample=False))
    L = m.config.max_context
    calls = []
    inner = hf.model.hidden_states
    hf.model.hidden_states = lambda x, cache=None: (calls.append(x.shape[1]), inner(x, cache))[1]
    with pytest.raises(ValueError, match="prompt \\+ max_new_tokens needs"):
        hf.generate(prompt(1, L - 3), max_new_tokens=8, do_sample=False)
    assert calls == []  # refused before any forward
    hf.model.hidden_states = inner
    assert hf.generate(prompt(1, L - 4), max_new_tokens=4, do_sample=False).shape == (1, L)
    with pytest.raises(ValueError, match=f"needs {L + 1} positions"):  # one more than fits, as k3's engine says
        hf.generate(prompt(1, L - 4), max_new_tokens=5, do_sample=False)


def test_generate_with_chunked_prefill_and_continuing_from_a_returned_cache():
    hf = K3ForCausalLM.from_k3(k3_model(), eos_token_id=None).eval()
    ids = prompt(2, 11, seed=4)
    ref = hf.model.generate(ids, 7)
    assert torch.equal(hf.generate(ids, max_new_tokens=7, do_sample=False, prefill_chunk_size=4), ref)
    first = hf.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    assert isinstance(first.cache, K3GenerationCache) and first.cache.get_seq_length() == 11 + 3
    more = hf.generate(first.sequences, cache=first.cache, max_new_tokens=3, do_sample=False)
    assert torch.equal(more, ref)
    with pytest.raises(ValueError, match="not supported"):
        hf.generate(ids, max_new_tokens=2, cache_implementation="static")
    # modes that roll the cache back: refused by name (they failed inside transformers with an AttributeError)
    for kw in ({"assistant_model": hf}, {"prompt_lookup_num_tokens": 3}):
        with pytest.raises(ValueError, match=f"{next(iter(kw))}: assisted and prompt-lookup decoding"):
            hf.generate(ids[:1], max_new_tokens=2, do_sample=False, **kw)


def test_generate_stops_at_eos_like_the_reference():
    hf = K3ForCausalLM.from_k3(k3_model()).eval()
    ids = prompt(1, 9, seed=3)
    ref = hf.model.generate(ids, 16)[0, 9:].tolist()
    eos = ref[4]  # pretend the 5th greedy token is the end of sequence
    out = hf.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=eos)[0, 9:].tolist()
    assert out == ref[:ref.index(eos) + 1]


def test_beam_search_with_cache_equals_beam_search_without():
    hf = K3ForCausalLM.from_k3(k3_model(), eos_token_id=None).eval()
    ids = prompt(1, 6, seed=2)
    kw = dict(max_new_tokens=6, num_beams=3, do_sample=False, num_return_sequences=3)
    cached = hf.generate(ids, **kw)
    plain = hf.generate(ids, use_cache=False, **kw)  # every step re-reads the whole sequence
    assert torch.equal(cached, plain)


def test_beam_search_prefills_each_distinct_prompt_once():
    """generate(num_beams=k) copies the prompt into k rows; the first forward computes each distinct prompt once
    and copies its states, with the same beams, scores and logits as computing every row."""
    hf = K3ForCausalLM.from_k3(k3_model(), eos_token_id=None).eval()
    ids = torch.cat([prompt(1, 7, seed=3), prompt(1, 7, seed=4)])  # two prompts, three beams each
    kw = dict(max_new_tokens=5, num_beams=3, do_sample=False, num_return_sequences=3, output_scores=True,
              return_dict_in_generate=True)
    rows, real = [], hf.model.hidden_states

    def counting(input_ids, cache=None, *a, **k):
        rows.append(tuple(input_ids.shape))
        return real(input_ids, cache, *a, **k)

    hf.model.hidden_states = counting
    shared = hf.generate(ids, **kw)
    assert rows[0] == (2, 7) and all(r[1] == 1 for r in rows[1:])  # the prefill: 2 rows, not 6
    rows.clear()
    hf.share_prefill = False
    every = hf.generate(ids, **kw)
    assert rows[0] == (6, 7)
    assert torch.equal(shared.sequences, every.sequences)
    assert torch.allclose(shared.sequences_scores, every.sequences_scores, atol=1e-5)
    for a, b in zip(shared.scores, every.scores):
        assert torch.allclose(a, b, atol=1e-4)


def test_forward_loss_padding_and_cache_errors():
    hf = K3ForCausalLM.from_k3(k3_model()).eval()
    ids = prompt(2, 8)
    out = hf(ids, labels=ids, use_cache=False)
    want = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    assert out.cache is None and torch.allclose(out.loss, want)
    # HF Trainer's gradient accumulation passes the whole batch's target count: the loss is then the sum over
    # this micro-batch's targets divided by it (the argument was refused as unsupported)
    summed = hf(ids, labels=ids, use_cache=False, num_items_in_batch=torch.tensor(40)).loss
    assert torch.allclose(summed, want * ids[:, 1:].numel() / 40)
    # prefill + continuation through the returned cache equals one forward; past_key_values is an alias
    a = hf(ids[:, :5], use_cache=True)
    b = hf(ids[:, 5:], past_key_values=a.cache)
    assert torch.allclose(torch.cat([a.logits, b.logits], 1), out.logits, atol=1e-5)
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    with pytest.raises(ValueError, match="padded"):
        hf(ids, attention_mask=mask)
    from transformers import DynamicCache

    with pytest.raises(ValueError, match="hybrid cache"):
        hf(ids, cache=DynamicCache())


def test_tokenizer_round_trip_as_pretrained_tokenizer_fast(tok, tmp_path):
    to_hf_tokenizer(tok, model_max_length=2048).save_pretrained(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert isinstance(hf, PreTrainedTokenizerFast) and len(hf) == tok.vocab_size
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (tok.bos_id, tok.eos_id, tok.pad_id)
    assert [hf.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert set(SPECIAL_TOKENS) <= set(hf.all_special_tokens)
    samples = ["def f(x):\n    return x ** 2", "héllo wörld — 日本語 🎉", "<|user|>hi<|end|><|assistant|><|think|>x",
               "  leading\tand trailing  \n", ""]
    for s in samples:
        assert hf(s)["input_ids"] == tok.encode(s), s
        assert hf.decode(hf(s)["input_ids"]) == s
    check_tokenizer(hf, vocab_size=VOCAB)


def test_an_hf_exports_tokenizer_is_the_tokenizer_it_came_from(tok, tmp_path):
    """save_pretrained adds a post-processor that adds nothing: loaded back into k3, the exported tokenizer.json
    has the fingerprint datasets and checkpoints recorded (it was refused as another tokenizer); one that adds a
    token does not."""
    import json as _json

    from tokenizers import Tokenizer as RawTokenizer
    to_hf_tokenizer(tok).save_pretrained(tmp_path / "hf")
    spec = _json.loads((tmp_path / "hf" / "tokenizer.json").read_text())
    assert spec["post_processor"] is not None and tok.hf.post_processor is None
    back = load_tokenizer(tmp_path / "hf")
    assert back.fingerprint == tok.fingerprint and back.encode("x = 1\n") == tok.encode("x = 1\n")
    spec["post_processor"]["single"].insert(0, {"SpecialToken": {"id": "<|bos|>", "type_id": 0}})
    spec["post_processor"]["special_tokens"] = {"<|bos|>": {"id": "<|bos|>", "ids": [0], "tokens": ["<|bos|>"]}}
    (tmp_path / "bos.json").write_text(_json.dumps(spec))
    bos = load_tokenizer(tmp_path / "bos.json")
    assert bos.hf.encode("x").ids[0] == 0 and bos.fingerprint != tok.fingerprint
    assert RawTokenizer.from_str(tok.hf.to_str()).to_str() == tok.hf.to_str()



CONVERSATIONS = [
    ([{"role": "user", "content": "hi"}], None, None),
    ([{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo — 日本語"}], None, "high"),
    ([{"role": "system", "content": "be brief"}, {"role": "user", "content": "run it"}],
     [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}], None),
    ([{"role": "user", "content": [{"type": "text", "text": "two "}, {"type": "text", "text": "parts"}]}],
     None, None),
    ([{"role": "user", "content": "list files"},  # tools with no system message: a system turn of their own
      {"role": "assistant", "content": None, "reasoning_content": "use ls",
       "tool_calls": [{"type": "function", "function": {"name": "ls", "arguments": {"path": ".", "n": [1, 2]}}},
                      {"type": "function", "function": {"name": "pwd", "arguments": {}}}]},
      {"role": "tool", "content": "a.py\nb.py"}, {"role": "assistant", "content": "two files"}],
     [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}], "low"),
    ([{"role": "developer", "content": ""}, {"role": "user", "content": "x"},   # tools join the first system turn
      {"role": "system", "content": "second"}],
     [{"type": "function", "function": {"name": "f", "description": "ünïcode"}}], None),
    ([{"role": "system", "content": "s"}, {"role": "assistant", "content": "a",
      "tool_calls": [{"function": {"name": "g", "arguments": '{"q": "v"}'}}]}], None, None),
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_hf_chat_template_renders_the_ids_of_render(tok, tmp_path, add_generation_prompt):
    from k3.data.chat import render
    to_hf_tokenizer(tok).save_pretrained(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)  # the template survives a save and load
    for messages, tools, effort in CONVERSATIONS:
        want = render(messages, tok, tools, effort, add_generation_prompt=add_generation_prompt)
        got = hf.apply_chat_template(messages, tools=tools, reasoning_effort=effort, tokenize=True,
                                     add_generation_prompt=add_generation_prompt, return_dict=False)
        assert got == want, (messages, hf.decode(got), tok.decode(want))
    with pytest.raises(Exception, match="role must be one of"):
        hf.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)

def test_export_hf_from_a_training_checkpoint(tok, serve_tokenizer, tmp_path):
    model = k3_model()
    save_checkpoint(tmp_path / "ckpt", 7, model, config=model.config,
                    data_state={"tokenizer": str(tok.path), "tokenizer_hash": tok.fingerprint})
    # another tokenizer of the same size would export silently with other token ids
    assert serve_tokenizer.vocab_size == tok.vocab_size and serve_tokenizer.fingerprint != tok.fingerprint
    with pytest.raises(ValueError, match="is not the one the checkpoint's training data was tokenized with"):
        export_hf(tmp_path / "ckpt", tmp_path / "wrong", tokenizer_path=serve_tokenizer.path)
    out = export_hf(tmp_path / "ckpt", tmp_path / "hf")  # tokenizer found through the manifest
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= \
        {p.name for p in out.iterdir()}
    umask = os.umask(0o022)
    os.umask(umask)
    files = [p for p in out.rglob("*") if p.is_file()]  # (named chat templates sit in a folder of their own)
    assert {p.name: p.stat().st_mode & 0o777 for p in files} == \
        {p.name: 0o666 & ~umask for p in files}  # safetensors made model.safetensors 0600
    assert (out / "additional_chat_templates" / "kimi-k3.jinja").is_file()
    hf, hf_tok = load_hf(out)
    # generate() stops where the server does: <|eos|>, <|end|> and the role tokens
    assert set(hf.generation_config.eos_token_id) == {SPECIAL_TOKENS.index(t) for t in
                                                      ("<|eos|>", "<|end|>", "<|user|>", "<|system|>", "<|tool|>",
                                                       "<|assistant|>")}
    ids = prompt(1, 10)
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, model(ids))
    assert hf_tok("x = 1")["input_ids"] == tok.encode("x = 1")
    # re-export into the same directory replaces it whole
    export_hf(tmp_path / "ckpt", out, tokenizer_path=tok.path)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    # the export's own tokenizer is the training tokenizer too
    export_hf(tmp_path / "ckpt", tmp_path / "hf2", tokenizer_path=out)


def test_k3_export_format_hf_cli(tok, tmp_path, capsys):
    from k3.cli import main
    model = k3_model()
    save_checkpoint(tmp_path / "ckpt", 3, model, config=model.config, data_state={"tokenizer": str(tok.path)})
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"), "--format", "hf"]) == 0
    hf, _ = load_hf(tmp_path / "hf")
    ids = prompt(1, 6)
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, model(ids))
    # an existing export is not replaced without --overwrite; --tokenizer belongs to the hf format
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"), "--format", "hf"]) != 0
    assert "--overwrite" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"), "--format", "hf",
                 "--overwrite", "--tokenizer", str(tok.path)]) == 0
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "mx"), "--tokenizer", str(tok.path)]) != 0
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf2"), "--format", "hf",
                 "--activations", "mxfp8"]) == 2
    assert "--activations applies to --format mx only" in capsys.readouterr().err
    # k3's own commands read the export too (k3.load): sample with the tokenizer it ships; eval needs --data
    capsys.readouterr()
    assert main(["sample", "--ckpt", str(tmp_path / "hf"), "--prompt", "def", "--max-new-tokens", "4",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("def")
    assert main(["eval", "--ckpt", str(tmp_path / "hf")]) == 2
    assert "does not name its data; pass --data DIR" in capsys.readouterr().err


def test_mismatched_weights_or_tokenizer_fail_at_load_time(tok, tmp_path):
    src = K3ForCausalLM.from_k3(k3_model())
    src.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "mla_kv_lora_rank": 16}))
    with pytest.raises(ValueError, match=r"do not match .*wkv_a.weight: stored \(48, 64\), config wants \(32, 64\)"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "n_layers": 8}))
    with pytest.raises(ValueError, match="missing .*model.attnres"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(ValueError, match="not a k3 model"):
        K3ForCausalLM.from_pretrained(tmp_path)
    # a tokenizer with another vocabulary size than the model: refused at export, before any file is written
    big = K3Model(get_config("tiny", vocab_size=1024))
    save_checkpoint(tmp_path / "ckpt2", 1, big, config=big.config, data_state={"tokenizer": str(tok.path)})
    with pytest.raises(ValueError, match="512 tokens but the model's vocab_size is 1024"):
        export_hf(tmp_path / "ckpt2", tmp_path / "never")
    assert not (tmp_path / "never").exists()
    # the export replaces its --out whole: never a directory that is not an earlier HF export (a training run)
    before = sorted(p.name for p in (tmp_path / "ckpt2").iterdir())
    with pytest.raises(ValueError, match="not an earlier HF export"):
        export_hf(tmp_path / "ckpt2", tmp_path / "ckpt2")
    assert sorted(p.name for p in (tmp_path / "ckpt2").iterdir()) == before
    # a tokenizer without k3's special tokens
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models

    raw = PreTrainedTokenizerFast(tokenizer_object=RawTokenizer(models.BPE()))
    with pytest.raises(ValueError, match="special token"):
        check_tokenizer(raw)
