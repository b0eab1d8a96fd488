"""Tokenizer: byte-level BPE with fixed special ids, lossless round trips, clear vocab-size errors."""
import pytest

from k3.data.corpus import open_corpus
from k3.data.tokenizer import MIN_VOCAB_SIZE, SPECIAL_TOKENS, Tokenizer, load_tokenizer, train_tokenizer

VOCAB = 512


@pytest.fixture(scope="module")
def texts():
    return [t for _, t in open_corpus().documents("train", max_bytes=200_000)]


@pytest.fixture(scope="module")
def tok(texts, tmp_path_factory):
    return train_tokenizer(texts, VOCAB, path=tmp_path_factory.mktemp("tok"))


def test_vocab_size_and_special_ids_are_fixed(tok):
    assert tok.vocab_size == VOCAB
    assert len(SPECIAL_TOKENS) == 17 and len(set(SPECIAL_TOKENS)) == 17
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.special_id(s) == i and tok.token_to_id(s) == i and tok.id_to_token(i) == s
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    assert tok.special_id("effort:high") == SPECIAL_TOKENS.index("<|effort:high|>")
    with pytest.raises(ValueError, match="unknown special token"):
        tok.special_id("nope")


def test_special_tokens_encode_as_single_tokens(tok):
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.encode(s) == [i]
        assert tok.decode([i]) == s
    ids = tok.encode("<|user|>hi<|end|><|assistant|><|think|>x<|/think|>y<|end|>")
    assert ids[0] == tok.special_id("user") and tok.special_id("/think") in ids
    # corpus text: the same characters are plain bytes, never a special id, and still round-trip
    plain = tok.encode("a <|eos|> b", allow_special=False)
    assert not set(plain) & set(range(len(SPECIAL_TOKENS)))
    assert tok.decode(plain) == "a <|eos|> b"
    assert tok.encode_batch(["x <|eos|>"], allow_special=False)[0] == tok.encode("x <|eos|>", allow_special=False)


def test_round_trip_unicode_and_whitespace(tok):
    samples = ["héllo wörld — naïve café", "日本語のテキスト", "emoji 🎉🐍 ZWJ 👩‍💻", "\t  tabs\r\nCRLF\n\n  ",
               "def f(x):\n    return x ** 2  # ∑", "", " leading space", "\x00\x7f control"]
    for s in samples:
        assert tok.decode(tok.encode(s)) == s
    assert tok.decode_batch(tok.encode_batch(samples)) == samples
    assert tok.encode("x", bos=True, eos=True) == [tok.bos_id, *tok.encode("x"), tok.eos_id]
    assert all(0 <= i < tok.vocab_size for ids in tok.encode_batch(samples) for i in ids)


def test_bpe_compresses_training_like_text(tok, texts):
    bpt = tok.bytes_per_token(texts[:5])
    assert 1.5 < bpt < 8  # merges happened (bytes alone would be 1.0)
    with pytest.raises(ValueError, match="non-empty"):
        tok.bytes_per_token([""])


def test_save_load_round_trip_and_determinism(tok, texts, tmp_path):
    loaded = load_tokenizer(tok.path.parent)
    assert loaded.fingerprint == tok.fingerprint and loaded.vocab_size == VOCAB
    assert loaded.encode(texts[0]) == tok.encode(texts[0])
    again = train_tokenizer(texts, VOCAB, path=tmp_path / "again.json")
    assert again.fingerprint == tok.fingerprint  # training is deterministic
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.json"]  # no temp files left behind


def test_vocab_too_small_or_unreachable(texts):
    with pytest.raises(ValueError, match=f"--vocab-size >= {MIN_VOCAB_SIZE}"):
        train_tokenizer(texts[:1], MIN_VOCAB_SIZE - 1)
    tiny = ["ab ab ab abc"] * 3
    with pytest.raises(ValueError, match="supports only .* tokens, fewer than vocab_size = 4096"):
        train_tokenizer(tiny, 4096)
    short = train_tokenizer(tiny, 4096, allow_short=True)
    assert MIN_VOCAB_SIZE <= short.vocab_size < 4096
    assert short.decode(short.encode("abc ü")) == "abc ü"
    exact = train_tokenizer(texts[:1], MIN_VOCAB_SIZE)  # bytes + specials only: always reachable
    assert exact.vocab_size == MIN_VOCAB_SIZE
    assert exact.decode(exact.encode("ü日🎉")) == "ü日🎉"  # every byte is in the vocab


def test_load_errors(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer at"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        load_tokenizer(tmp_path)


def test_foreign_tokenizer_is_rejected(tmp_path):
    from tokenizers import Tokenizer as HF
    from tokenizers import models, pre_tokenizers, trainers

    hf = HF(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel()
    hf.train_from_iterator(["some text"] * 3, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|eos|>"],
                                                                   show_progress=False))
    (tmp_path / "tokenizer.json").write_text(hf.to_str())
    with pytest.raises(ValueError, match="special token <\\|bos\\|> at id None"):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="retrain"):
        Tokenizer(hf)


def test_text_with_a_lone_surrogate_is_a_clear_error(tmp_path):
    """`k3 sample --prompt $'ab\\xff'` reaches encode as 'ab\\udcff' (Python's surrogate escape): tokenizers raised a
    TypeError ("TextInputSequence must be str") and the CLI printed a traceback."""
    from k3.data.tokenizer import train_tokenizer

    tok = train_tokenizer(["plain text for a tokenizer"] * 40, 300, path=tmp_path / "t.json", allow_short=True)
    with pytest.raises(ValueError, match=r"lone surrogate at character 2 \('ab' before it\)"):
        tok.encode("ab\udcff")
    with pytest.raises(ValueError, match="must be a str, got bytes"):
        tok.encode(b"ab")
    assert tok.decode(tok.encode("ab")) == "ab"


def test_ids_outside_the_vocabulary_and_non_integers_are_named(tok):
    """tokenizers drops an id past the end without a word ('' for [V]) and int() truncated 1.5 to a special."""
    import numpy as np
    import torch

    V = tok.vocab_size
    for bad in ([V], [-1], [3, V + 7]):
        with pytest.raises(ValueError, match=rf"token id -?\d+ is outside this tokenizer's vocabulary \[0, {V}\)"):
            tok.decode(bad)
    with pytest.raises(ValueError, match=r"must be integers, got 1.5"):
        tok.decode([1.5])
    with pytest.raises(ValueError, match="outside"):
        tok.decode_batch([[1], [V]])
    with pytest.raises(ValueError, match="outside"):
        tok.id_to_token(-1)
    ids = tok.encode("def f(x): return x")
    text = tok.decode(ids)
    assert tok.decode(torch.tensor(ids)) == tok.decode(np.array(ids)) == tok.decode([np.int64(i) for i in ids]) == text
    assert tok.id_to_token(torch.tensor(ids[0])) == tok.id_to_token(ids[0])
    with pytest.raises(ValueError, match="got one string"):
        tok.encode_batch("abc")
    with pytest.raises(ValueError, match="item 1 is int 3"):
        tok.encode_batch(["a", 3])


def test_a_build_killed_between_the_tokenizer_and_its_settings_is_built_again(tmp_path, monkeypatch):
    """`k3 rl warmstart` and `k3 distill teachers` wrote the tokenizer, then its settings: a kill between the two
    left a tokenizer with no record, reused from then on whatever --vocab-size asked (or beside the previous
    build's record). `install_tokenizer` removes the tokenizer first, records, then saves: a failure at any point
    leaves no tokenizer, so the next run builds it again."""
    from k3.data import tokenizer as tkz
    from k3.data.tokenizer import install_tokenizer, reuse_built_tokenizer, train_tokenizer

    path = tmp_path / "tokenizer.json"
    old = train_tokenizer(["def f(x):\n    return x + 1\n"] * 20, 300, allow_short=True)
    install_tokenizer(old, path, {"vocab_size": 300})
    assert reuse_built_tokenizer(path, {"vocab_size": 300}, False, "")
    new = train_tokenizer(["class A:\n    pass\n"] * 20, 280, allow_short=True)

    def die(*a, **k):
        raise KeyboardInterrupt("killed")

    for where in ("record_tokenizer_settings", "save"):
        target = tkz if where == "record_tokenizer_settings" else tkz.Tokenizer
        with monkeypatch.context() as m:
            m.setattr(target, where, die)
            with pytest.raises(KeyboardInterrupt):
                install_tokenizer(new, path, {"vocab_size": 280})
        assert not path.exists()  # nothing to reuse: the next run builds it
        assert not reuse_built_tokenizer(path, {"vocab_size": 300}, False, "")
    install_tokenizer(new, path, {"vocab_size": 280})
    assert reuse_built_tokenizer(path, {"vocab_size": 280}, False, "")
    with pytest.raises(ValueError, match="other settings"):
        reuse_built_tokenizer(path, {"vocab_size": 300}, False, "")
    install_tokenizer(new, path, None)  # given as a file: no record of settings it was not built from
    assert not (tmp_path / tkz.SETTINGS_FILE).exists() and path.is_file()
