"""Packed datasets: one tokenisation pass, memmapped reads, batches that depend only on (seed, step)."""
import json
import os
import shutil

import numpy as np
import pytest
import torch

from k3.cli import main
from k3.data.corpus import open_corpus
from k3.data.dataset import build_dataset, load_data, load_dataset, prepare_data, token_dtype
from k3.data.tokenizer import train_tokenizer


@pytest.fixture(scope="module")
def docs():
    return list(open_corpus().documents("train", max_bytes=150_000))


@pytest.fixture(scope="module")
def tok(docs):
    return train_tokenizer(docs, 512)


@pytest.fixture(scope="module")
def ds(docs, tok, tmp_path_factory):
    return build_dataset(docs, tok, tmp_path_factory.mktemp("ds"), "train", source="test")


def test_layout_dtype_and_doc_boundaries(ds, docs, tok):
    assert sorted(p.name for p in ds.bin_path.parent.iterdir()) == ["train.bin", "train.docs.npy", "train.json"]
    assert isinstance(ds.tokens, np.memmap) and ds.tokens.dtype == np.uint16
    m = json.loads(ds.manifest_path.read_text())
    assert m["n_tokens"] == len(ds) == ds.bin_path.stat().st_size // 2
    assert m["n_docs"] == ds.n_docs == len(docs) and m["tokenizer_hash"] == tok.fingerprint
    ends = list(ds.doc_starts[1:]) + [len(ds)]
    for (_, text), s, e in zip(docs, ds.doc_starts, ends):
        assert ds.tokens[e - 1] == tok.eos_id  # each document is followed by <|eos|>
        assert tok.decode(ds.tokens[s:e - 1]) == text
    assert int((np.asarray(ds.tokens) == tok.eos_id).sum()) == len(docs)


def test_document_ids_change_right_after_each_eos(ds, tok):
    """get_batch(docs=True): a window's document ids change exactly at the token after an <|eos|> (a document's
    eos is its own last token), for training windows and for the evaluation batches."""
    T, seen = 256, 0
    for step in range(20):
        x, y, d = ds.get_batch(step, 16, T, seed=1, docs=True)
        x2, y2 = ds.get_batch(step, 16, T, seed=1)
        assert torch.equal(x, x2) and torch.equal(y, y2) and d.shape == x.shape and d.dtype == torch.long
        change = d[:, 1:] != d[:, :-1]
        assert torch.equal(change, x[:, :-1] == tok.eos_id)
        seen += int(change.sum())
    assert seen > 0
    for xb, _, db in ds.iter_eval_batches(4, T, max_batches=3, docs=True):
        assert torch.equal(db[:, 1:] != db[:, :-1], xb[:, :-1] == tok.eos_id)


def test_token_dtype():
    assert token_dtype(512) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32 and token_dtype(163840) == np.uint32


class _BigVocab:
    """Stands in for a tokenizer with a vocabulary too large for uint16."""
    vocab_size, eos_id, fingerprint = 163840, 1, "big"

    def encode_batch(self, texts, eos=False, allow_special=True):
        return [[100_000 + len(t), 70_000] + ([self.eos_id] if eos else []) for t in texts]


def test_uint32_for_large_vocab(tmp_path):
    big = build_dataset([("a", "x"), ("b", "yy")], _BigVocab(), tmp_path)
    assert big.tokens.dtype == np.uint32
    assert list(big.tokens) == [100_001, 70_000, 1, 100_002, 70_000, 1]
    x, y = big.get_batch(0, 2, 5)
    assert x.max().item() == 100_002  # not wrapped around at 65536
    # 6 tokens, seq_len 3: only the window at 0 has its 4th (target) token; the one at 3 would run off the end
    assert big.n_eval_windows(3) == 1 and big.n_eval_windows(2) == 2
    (ex, ey), = big.iter_eval_batches(4, 3)
    assert ex.tolist() == [[100_001, 70_000, 1]] and ey.tolist() == [[70_000, 1, 100_002]]


def test_batches_depend_only_on_seed_and_step(ds):
    x, y = ds.get_batch(step=7, batch_size=4, seq_len=32, seed=3)
    assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.long
    ds.get_batch(step=8, batch_size=4, seq_len=32, seed=3)  # interleaved calls must not matter
    x2, y2 = load_dataset(ds.manifest_path.parent).get_batch(7, 4, 32, seed=3)  # a "resumed" reader
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, ds.get_batch(8, 4, 32, seed=3)[0])
    assert not torch.equal(x, ds.get_batch(7, 4, 32, seed=4)[0])
    starts = ds.batch_starts(7, 4, 32, seed=3)
    tokens = torch.from_numpy(np.asarray(ds.tokens, dtype=np.int64))
    for b, s in enumerate(starts):
        assert torch.equal(x[b], tokens[s:s + 32]) and torch.equal(y[b], tokens[s + 1:s + 33])
    # starts spread over the whole file and stay in range
    many = np.concatenate([ds.batch_starts(s, 16, 32) for s in range(50)])
    assert many.min() >= 0 and many.max() <= len(ds) - 33
    assert many.max() > len(ds) * 0.8 and many.min() < len(ds) * 0.2


def test_ranks_split_the_global_batch(ds):
    full = ds.batch_starts(5, 6, 16, seed=1)
    parts = [ds.batch_starts(5, 3, 16, seed=1, rank=r, world_size=2) for r in range(2)]
    assert np.array_equal(np.concatenate(parts), full)
    with pytest.raises(ValueError, match="rank"):
        ds.get_batch(0, 2, 16, rank=2, world_size=2)


def test_eval_batches_are_sequential_and_complete(ds):
    T, B = 64, 5
    batches = list(ds.iter_eval_batches(B, T))
    n = ds.n_eval_windows(T)
    assert sum(x.shape[0] for x, _ in batches) == n == (len(ds) - 1) // T
    assert all(x.shape[0] == B for x, _ in batches[:-1]) and 1 <= batches[-1][0].shape[0] <= B
    flat_x = torch.cat([x for x, _ in batches]).reshape(-1)
    flat_y = torch.cat([y for _, y in batches]).reshape(-1)
    tokens = torch.from_numpy(np.asarray(ds.tokens, dtype=np.int64))
    assert torch.equal(flat_x, tokens[:n * T]) and torch.equal(flat_y, tokens[1:n * T + 1])
    again = list(ds.iter_eval_batches(B, T, max_batches=2))
    assert len(again) == 2 and all(torch.equal(a[0], b[0]) for a, b in zip(again, batches))


def test_corpus_smaller_than_one_window_is_an_error(tok, tmp_path):
    small = build_dataset([("a", "tiny text")], tok, tmp_path)
    with pytest.raises(ValueError, match="fewer than seq_len \\+ 1"):
        small.get_batch(0, 1, len(small))
    with pytest.raises(ValueError, match="fewer than seq_len \\+ 1"):
        list(small.iter_eval_batches(1, len(small)))
    x, y = small.get_batch(0, 2, len(small) - 1)  # exactly one window fits
    assert torch.equal(x[0], x[1]) and x.shape == (2, len(small) - 1)
    with pytest.raises(ValueError, match="no documents to tokenise"):
        build_dataset([], tok, tmp_path, "empty")


def test_failed_build_leaves_no_partial_files(docs, tok, tmp_path):
    build_dataset(docs[:3], tok, tmp_path, "train")

    def broken():
        yield from docs[:3]
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        build_dataset(broken(), tok, tmp_path, "train")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert not [n for n in names if n.startswith(".") or n.endswith(".tmp")], names
    with pytest.raises(ValueError, match="no dataset manifest"):  # the old manifest is gone, not stale
        load_dataset(tmp_path)


def test_mismatched_tokenizer_and_truncated_file_are_detected(ds, docs, tmp_path):
    other = train_tokenizer(docs[:2], 300)
    with pytest.raises(ValueError, match="different tokenizer"):
        load_dataset(ds.manifest_path.parent, tokenizer=other)
    copy = tmp_path / "copy"
    shutil.copytree(ds.manifest_path.parent, copy)
    with open(copy / "train.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(ValueError, match="incomplete"):
        load_dataset(copy)


@pytest.mark.parametrize("damage", ["manifest_json", "manifest_key", "docs_empty", "docs_truncated", "dtype",
                                    "n_tokens", "tokenizer_hash", "bin_missing"])
def test_damaged_dataset_files_name_the_file_and_the_fix(ds, tmp_path, damage):
    copy = tmp_path / "copy"
    shutil.copytree(ds.manifest_path.parent, copy)
    manifest = copy / ds.manifest_path.name
    docs_file = copy / json.loads(manifest.read_text())["doc_starts"]
    if damage == "manifest_json":
        manifest.write_text(manifest.read_text()[:40])
        bad = manifest
    elif damage in ("manifest_key", "dtype", "n_tokens", "tokenizer_hash"):
        m = json.loads(manifest.read_text())
        if damage == "manifest_key":
            del m["dtype"]
        elif damage == "tokenizer_hash":
            del m["tokenizer_hash"]
        else:
            m[damage] = {"dtype": "bogus", "n_tokens": "abc"}[damage]
        manifest.write_text(json.dumps(m))
        bad = manifest
    elif damage == "bin_missing":
        (copy / json.loads(manifest.read_text())["bin"]).unlink()
        bad = copy / json.loads(manifest.read_text())["bin"]
    else:
        docs_file.write_bytes(b"" if damage == "docs_empty" else docs_file.read_bytes()[:20])
        bad = docs_file
    fix = "is missing.*" if damage == "bin_missing" else "damaged; "
    with pytest.raises(ValueError, match=f"{bad}.*{fix}rebuild it with `k3 tokenize --out {copy}`"):
        load_dataset(copy)


@pytest.fixture()
def text_dir(tmp_path, docs):
    d = tmp_path / "corpus"
    d.mkdir()
    for i, (_, text) in enumerate(docs[:12]):
        (d / f"doc{i:02d}.txt").write_text(text)
    return d


def test_prepare_data_builds_reuses_and_rebuilds(text_dir, tmp_path):
    out = tmp_path / "data"
    files = prepare_data(out, str(text_dir), vocab_size=512, decontaminate=0)  # its val file copies a train file
    assert not files.reused and files.train.n_docs + files.val.n_docs == 12 and files.val.n_docs >= 1
    assert files.info["request"]["vocab_size"] == 512 and files.info["tokenizer_bytes"] > 0
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [".k3-data", "data.json", "tokenizer.json", "train.bin", "train.docs.npy", "train.json",
         "val.bin", "val.docs.npy", "val.json"])
    again = prepare_data(out, str(text_dir), vocab_size=512, decontaminate=0)
    assert again.reused and again.tokenizer.fingerprint == files.tokenizer.fingerprint
    (text_dir / "doc99.txt").write_text("a new document changes the corpus fingerprint\n" * 20)
    assert not prepare_data(out, str(text_dir), vocab_size=512, decontaminate=0).reused
    loaded = load_data(out)
    assert torch.equal(loaded.train.get_batch(3, 2, 16)[0], load_data(out).train.get_batch(3, 2, 16)[0])
    # another corpus would replace this data (and strand checkpoints trained on it): refused unless forced
    other = tmp_path / "other"
    other.mkdir()
    for i in range(4):
        (other / f"o{i}.txt").write_text(f"another corpus, document {i}\n" * 30)
    before = (out / "train.bin").read_bytes()
    with pytest.raises(ValueError, match="holds data tokenized from directory .* use another directory, or "
                                         "`k3 tokenize --force`"):
        prepare_data(out, str(other), vocab_size=300)
    assert (out / "train.bin").read_bytes() == before
    # a rebuild of this corpus that fails (a vocabulary its text cannot support) leaves the data that was there
    # complete and usable (it was built in a staging folder, removed again), and keeps the guard
    names = sorted(p.name for p in out.iterdir())
    with pytest.raises(ValueError, match="supports only"):
        prepare_data(out, str(text_dir), vocab_size=60_000, decontaminate=0)
    assert sorted(p.name for p in out.iterdir()) == names and (out / "train.bin").read_bytes() == before
    assert prepare_data(out, str(text_dir), vocab_size=512, decontaminate=0).reused
    with pytest.raises(ValueError, match="holds data tokenized from directory"):
        prepare_data(out, str(other), vocab_size=280)
    assert "other" in prepare_data(out, str(other), vocab_size=280, force=True).info["request"]["source"]


def test_a_rebuild_killed_while_moving_in_is_not_loaded_as_data(text_dir, tmp_path):
    """A rebuild killed part way through moving its files in left a new train split beside the old validation
    split (and the old document starts): `load_data` read the mix without error and `k3 train` trained on it. Now
    a folder whose build did not finish is refused, and document starts of another build are named. The staging
    folder of a killed build is removed by the next build; one of a build still running is left alone."""
    import os
    import shutil

    import numpy as np

    out = tmp_path / "data"
    prepare_data(out, str(text_dir), vocab_size=512, decontaminate=0)
    (out / "data.json").unlink()  # as the rebuild leaves it until its files are in
    with pytest.raises(ValueError, match="holds a build that did not finish .* `k3 tokenize --out "):
        load_data(out)
    prepare_data(out, str(text_dir), vocab_size=512, decontaminate=0)
    starts = np.load(out / "val.docs.npy")
    np.save(out / "val.docs.npy", np.concatenate([starts, starts[-1:] + 10**6]))  # another build's, longer
    with pytest.raises(ValueError, match="val.docs.npy does not match .*val.json"):
        load_data(out)
    prepare_data(out, str(text_dir), vocab_size=512, decontaminate=0, force=True)
    dead = out / ".k3-build-999999999-abc"  # no such process
    live = out / f".k3-build-{os.getpid()}-abc"
    for d in (dead, live):
        d.mkdir()
    prepare_data(out, str(text_dir), vocab_size=512, decontaminate=0, force=True)
    assert not dead.exists() and live.is_dir()
    shutil.rmtree(live)


def test_cli_tokenize(text_dir, tmp_path, capsys):
    out = tmp_path / "cli"
    # the corpus's one validation file (__phello__/spam.py) is a copy of a training file: by default it is
    # left out, which leaves no validation split, and the error names the switch
    assert main(["tokenize", "--data", str(text_dir), "--vocab-size", "512", "--out", str(out),
                 "--max-bytes", "60KB", "-q"]) == 2
    assert "every validation document" in capsys.readouterr().err
    assert main(["tokenize", "--data", str(text_dir), "--vocab-size", "512", "--out", str(out),
                 "--max-bytes", "60KB", "-q", "--decontaminate", "0"]) == 0
    printed = capsys.readouterr().out
    assert str(out / "tokenizer.json") in printed and str(out / "train.bin") in printed
    assert load_data(out).info["request"]["max_bytes"] == 60_000
    assert main(["tokenize", "--data", str(tmp_path / "missing"), "--out", str(out), "-q"]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    assert main(["tokenize", "--data", str(text_dir), "--vocab-size", "100", "--out", str(out), "-q"]) == 2
    assert "--vocab-size >= 273" in capsys.readouterr().err


def test_validation_leaves_out_near_copies_of_training_text(tmp_path):
    rng = torch.Generator().manual_seed(0)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta", "lambda", "zeta"]

    def text(i: int) -> str:
        ids = torch.randint(0, len(words), (40, 5), generator=rng).tolist()
        return "".join(f"doc {i} line {j}: " + " ".join(words[w] for w in row) + "\n" for j, row in enumerate(ids))

    d = tmp_path / "corpus"
    d.mkdir()
    for i in range(40):
        (d / f"f{i:02d}.txt").write_text(text(i))
    corpus = open_corpus(str(d), val_fraction=0.2)
    val, train = corpus.doc_ids("val"), corpus.doc_ids("train")
    assert len(val) >= 3
    copy = val[0]  # a validation file that is 3/4 a training file: 30 of its 40 lines, plus 10 of its own
    (d / copy).write_text("".join((d / train[0]).read_text().splitlines(keepends=True)[:30]) + text(99)[:400])
    files = prepare_data(tmp_path / "data", str(d), vocab_size=300, val_fraction=0.2)
    assert [e["doc_id"] for e in files.info["val_excluded"]] == [copy]
    assert 0.7 < files.info["val_excluded"][0]["overlap"] < 0.9
    assert files.val.n_docs == len(val) - 1
    kept = prepare_data(tmp_path / "all", str(d), vocab_size=300, val_fraction=0.2, decontaminate=0)
    assert kept.info["val_excluded"] == [] and kept.val.n_docs == len(val)
    assert kept.train.n_tokens == files.train.n_tokens  # the training side is the same either way
    with pytest.raises(ValueError, match="decontaminate"):
        prepare_data(tmp_path / "x", str(d), decontaminate=1.5)
    # under a byte cap, the left-out document does not use up the cap: clean validation text fills it
    small = len((d / copy).read_bytes())  # the cap the first (left-out) document alone would use up
    capped = prepare_data(tmp_path / "capped", str(d), vocab_size=300, val_fraction=0.2, max_bytes=small)
    assert [e["doc_id"] for e in capped.info["val_excluded"]] == [copy] and capped.val.n_docs >= 1


def test_splits_that_would_be_empty_are_refused_before_any_work(tmp_path):
    one = tmp_path / "one.txt"
    one.write_text("a single file is a single document\n" * 50)
    with pytest.raises(ValueError, match=r"a text file is one document\); pass a directory"):
        prepare_data(tmp_path / "d1", str(one))
    d = tmp_path / "two"
    d.mkdir()
    for i in range(3):
        (d / f"{i}.txt").write_text(f"document {i}\n" * 30)
    with pytest.raises(ValueError, match="--val-fraction 0 leaves no validation split"):
        prepare_data(tmp_path / "d2", str(d), val_fraction=0)
    assert not (tmp_path / "d1").exists() and not (tmp_path / "d2").exists()


def test_data_built_from_a_relative_glob_before_globs_were_absolute_is_the_same_corpus():
    import os

    from k3.data.dataset import same_corpus
    assert same_corpus("glob txt/*.txt", f"glob {os.path.abspath('txt/*.txt')}")
    assert not same_corpus("glob other/*.txt", f"glob {os.path.abspath('txt/*.txt')}")


def test_corpus_fingerprint_follows_content_not_mtime(text_dir):
    """An edit that keeps a file's size and mtime (as `cp -p` of an edited copy does) changes the
    fingerprint; touching a file does not."""
    before = open_corpus(str(text_dir)).fingerprint()
    f = text_dir / "doc00.txt"
    st = f.stat()
    text = f.read_text()
    f.write_text(text.swapcase() if text.swapcase() != text else text[::-1])
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_size == st.st_size and f.stat().st_mtime_ns == st.st_mtime_ns
    edited = open_corpus(str(text_dir)).fingerprint()
    assert edited != before
    os.utime(f)  # a touch: same content, new mtime
    assert open_corpus(str(text_dir)).fingerprint() == edited


def test_corpus_fingerprint_does_not_depend_on_how_the_folder_is_spelled(text_dir, monkeypatch):
    """`--data corpus`, `--data ./corpus/` and the full path are one corpus: a relative spelling changed the
    fingerprint, and `k3 tokenize` rebuilt data it should have reused."""
    full = open_corpus(str(text_dir)).fingerprint()
    monkeypatch.chdir(text_dir.parent)
    for spelled in (text_dir.name, f"./{text_dir.name}/", f"{text_dir.name}/../{text_dir.name}"):
        assert open_corpus(spelled).fingerprint() == full, spelled


def test_files_of_the_same_names_that_k3_did_not_write_are_not_replaced(text_dir, tmp_path):
    """A directory holding a train.json (or tokenizer.json, ...) of the user's own is refused unless forced; a
    build of k3's own that failed part way is rebuilt without --force."""
    user = tmp_path / "userdir"
    user.mkdir()
    (user / "train.json").write_text('{"mine": true}')
    with pytest.raises(ValueError, match="not k3 data files"):
        prepare_data(user, str(text_dir), vocab_size=512, decontaminate=0)
    assert (user / "train.json").read_text() == '{"mine": true}'
    assert not prepare_data(user, str(text_dir), vocab_size=512, decontaminate=0, force=True).reused
    failed = tmp_path / "failed"
    prepare_data(failed, str(text_dir), vocab_size=512, decontaminate=0)
    for name in ("data.json", "train.json", "val.json"):  # as a build that stopped after its tokenizer leaves it
        (failed / name).unlink()
    assert not prepare_data(failed, str(text_dir), vocab_size=512, decontaminate=0).reused
    # the same, built by a version without the build marker; and a manifest whose source record is damaged
    (failed / ".k3-data").unlink()
    for name in ("data.json", "train.json", "val.json"):
        (failed / name).unlink()
    assert not prepare_data(failed, str(text_dir), vocab_size=512, decontaminate=0).reused
    # ... but a k3 tokenizer beside another tool's files (a `k3 distill teachers` root) is not a data build
    teachers = tmp_path / "teachers"
    teachers.mkdir()
    (teachers / "tokenizer.json").write_bytes((failed / "tokenizer.json").read_bytes())
    (teachers / "teachers.json").write_text("{}")
    with pytest.raises(ValueError, match="holds tokenizer.json, not k3 data files"):
        prepare_data(teachers, str(text_dir), vocab_size=512, decontaminate=0)
    assert sorted(p.name for p in teachers.iterdir()) == ["teachers.json", "tokenizer.json"]
    (failed / ".k3-data").unlink()
    (failed / "data.json").write_text('{"request": {"source": 5}}')
    for name in ("train.json", "val.json"):
        (failed / name).unlink()
    assert not prepare_data(failed, str(text_dir), vocab_size=512, decontaminate=0).reused


def test_a_file_that_cannot_be_read_counts_by_size_and_mtime(tmp_path):
    """The reader skips an unreadable file; the fingerprint must not fail on it either."""
    from k3.data.corpus import _content_digest

    d = tmp_path / "not-a-file"
    d.mkdir()  # open() fails on it, as on a file without read permission
    assert _content_digest(d).startswith(b"unreadable ")
    assert _content_digest(tmp_path / "gone") == b"missing"
    f = tmp_path / "a.txt"
    f.write_text("x" * 3_000_000)  # read in chunks
    import hashlib
    assert _content_digest(f) == hashlib.sha256(b"x" * 3_000_000).digest()


def test_an_input_data_directory_is_not_rebuilt_with_other_settings(text_dir, tmp_path):
    """k3 ablate / k3 demo --data D on data of the same corpus built with another vocabulary rebuilt D in place,
    stranding the checkpoints trained on it; with replace=False it is refused, naming the settings."""
    d = tmp_path / "d"
    prepare_data(d, str(text_dir), vocab_size=512, decontaminate=0)
    before = (d / "tokenizer.json").read_bytes()
    with pytest.raises(ValueError, match=r"other settings: vocab_size 512 \(asked: 600\).*give another --data"):
        prepare_data(d, str(text_dir), vocab_size=600, decontaminate=0, replace=False)
    assert (d / "tokenizer.json").read_bytes() == before
    assert prepare_data(d, str(text_dir), vocab_size=512, decontaminate=0, replace=False).reused  # same: reused
    assert not prepare_data(d, str(text_dir), vocab_size=600, decontaminate=0).reused  # k3 tokenize: rebuilt
    # a request recorded by an older k3 (without a key asked today) is rebuilt, not refused: nothing to compare
    manifest = json.loads((d / "data.json").read_text())
    del manifest["request"]["decontaminate"]
    (d / "data.json").write_text(json.dumps(manifest))
    assert not prepare_data(d, str(text_dir), vocab_size=600, decontaminate=0, replace=False).reused
    # ... but one whose recorded settings differ is refused all the same
    manifest = json.loads((d / "data.json").read_text())
    del manifest["request"]["decontaminate"]
    (d / "data.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"vocab_size 600 \(asked: 512\)"):
        prepare_data(d, str(text_dir), vocab_size=512, decontaminate=0, replace=False)
