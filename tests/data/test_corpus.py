"""Corpus: the embedded stdlib corpus, its deterministic by-file split, and `--data` specs."""
import json
import subprocess
import sys

import pytest

from k3.data.corpus import open_corpus, split_fraction, stdlib_files


@pytest.fixture(scope="module")
def stdlib():
    return open_corpus()


def test_stdlib_split_is_deterministic_disjoint_and_covers_everything(stdlib):
    train, val = stdlib.doc_ids("train"), stdlib.doc_ids("val")
    again = open_corpus()
    assert again.doc_ids("train") == train and again.doc_ids("val") == val
    assert train and val
    assert not set(train) & set(val)
    assert sorted(train + val) == sorted(stdlib.doc_ids("all"))
    assert 0.005 < len(val) / (len(train) + len(val)) < 0.06  # ~2% of files
    assert train == sorted(train)


def test_split_is_stable_across_processes():
    # Python's hash() is salted per process; the split must not be.
    code = "from k3.data.corpus import open_corpus; print(','.join(open_corpus().doc_ids('val')))"
    out = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={"PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert len(out) == 1
    assert out.pop().strip() == ",".join(open_corpus().doc_ids("val"))


def test_stdlib_excludes_tests_and_site_packages(stdlib):
    ids = stdlib.doc_ids("all")
    assert "json/decoder.py" in ids and "os.py" in ids
    for d in ids:
        parts = d.split("/")
        assert not {"test", "tests", "idle_test", "site-packages"} & set(parts[:-1]), d
        assert d.endswith(".py")
    assert len(ids) == len(stdlib_files()) - sum(1 for _, p in stdlib_files() if p.stat().st_size == 0)


def test_documents_are_files_and_max_bytes_caps(stdlib):
    docs = list(stdlib.documents("val"))
    assert [d for d, _ in docs] == stdlib.doc_ids("val")
    capped = list(stdlib.documents("train", max_bytes=10_000))
    assert sum(len(t.encode()) for _, t in capped) == 10_000  # the last file is cut to fit exactly
    full = [t for _, (_, t) in zip(range(len(capped)), stdlib.documents("train"))]
    assert [t for _, t in capped[:-1]] == full[:-1]  # a prefix of the split, in order ...
    assert full[-1].startswith(capped[-1][1]) and len(capped) > 1  # ... with the last document cut


def test_split_fraction_is_a_fixed_function():
    assert split_fraction("os.py") == split_fraction("os.py")
    assert 0 <= split_fraction("a") < 1 and split_fraction("a") != split_fraction("b")


def _tree(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "a.txt").write_text("alpha text")
    (tmp_path / "b.md").write_text("# beta")
    (tmp_path / "sub" / "c.py").write_text("x = 'ç日本'\n")
    (tmp_path / "sub" / "skip.bin").write_bytes(b"\x00\x01")
    (tmp_path / ".hidden" / "h.txt").write_text("hidden")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    return tmp_path


def test_directory_spec(tmp_path):
    c = open_corpus(str(_tree(tmp_path)))
    assert c.doc_ids("all") == ["a.txt", "b.md", "latin1.txt", "sub/c.py"]
    assert c.doc_ids("train") and c.doc_ids("val")  # both splits kept non-empty even for 4 files
    texts = dict(c.documents("all"))
    assert texts == {"a.txt": "alpha text", "b.md": "# beta", "sub/c.py": "x = 'ç日本'\n"}  # latin1 skipped


def test_glob_spec(tmp_path):
    _tree(tmp_path)
    c = open_corpus(str(tmp_path / "**" / "*.py"))
    assert c.doc_ids("all") == ["sub/c.py"]
    with pytest.raises(ValueError, match="matches no files"):
        open_corpus(str(tmp_path / "*.nothing"))


def test_jsonl_spec(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps({"text": f"doc {i} ü"}) for i in range(50)) + "\n\n")
    c = open_corpus(str(p))
    assert len(c.doc_ids("all")) == 50
    assert c.doc_ids("val") and c.doc_ids("train")
    got = dict(c.documents("all"))
    assert got["d.jsonl:7"] == "doc 6 ü"
    assert sorted(dict(c.documents("train")) | dict(c.documents("val"))) == sorted(got)


def test_jsonl_lines_end_at_newlines_only(tmp_path):
    # a "\r" inside the file ends no record: the ids counted and the records read agree (CRLF files work)
    p = tmp_path / "crlf.jsonl"
    p.write_bytes(b"".join(json.dumps({"text": f"doc {i}"}).encode() + b"\r\n" for i in range(6)))
    assert dict(open_corpus(str(p)).documents("all")) == {f"crlf.jsonl:{i + 1}": f"doc {i}" for i in range(6)}
    p.write_bytes(b"".join(json.dumps({"text": f"doc {i}"}).encode() + b"\r" for i in range(6)))
    with pytest.raises(ValueError, match="crlf.jsonl:1: not valid JSON"):  # one line holding six records
        list(open_corpus(str(p)).documents("all"))


def test_unreadable_files_are_skipped_with_a_warning(tmp_path, caplog):
    for i in range(3):
        (tmp_path / f"{i}.txt").write_text(f"document {i}\n")
    (tmp_path / "gone.txt").symlink_to(tmp_path / "nowhere.txt")
    with caplog.at_level("WARNING"):
        c = open_corpus(str(tmp_path))
        assert sorted(dict(c.documents("all"))) == ["0.txt", "1.txt", "2.txt"]
    assert "gone.txt" in caplog.text


def test_jsonl_without_text_is_an_error(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "ok"}\n{"content": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: no string \"text\" field"):
        list(open_corpus(str(p)).documents("all"))
    p.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not valid JSON"):
        list(open_corpus(str(p)).documents("all"))


def test_missing_and_empty_are_errors(tmp_path):
    with pytest.raises(ValueError, match="no such file or directory"):
        open_corpus(str(tmp_path / "nope"))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.bin").write_bytes(b"1")
    with pytest.raises(ValueError, match="has no .txt"):
        open_corpus(str(tmp_path / "d"))
    (tmp_path / "d" / "e.txt").write_text("")
    with pytest.raises(ValueError, match="no documents"):
        open_corpus(str(tmp_path / "d"))
    (tmp_path / "one.txt").write_text("only one document")
    with pytest.raises(ValueError, match="'val' split .* is empty"):
        list(open_corpus(str(tmp_path / "one.txt")).documents("val"))
    with pytest.raises(ValueError, match="unknown split"):
        open_corpus(str(tmp_path / "one.txt")).doc_ids("test")


def test_text_files_keep_their_line_endings(tmp_path):
    """CRLF and lone CR reach the tokenizer as written (reading in text mode turned both into LF)."""
    (tmp_path / "a.txt").write_bytes(b"x\r\ny\rz\n")
    (tmp_path / "b.txt").write_bytes(b"plain\n")
    docs = dict(open_corpus(str(tmp_path), val_fraction=0.5).documents("train")) | \
        dict(open_corpus(str(tmp_path), val_fraction=0.5).documents("val"))
    assert docs["a.txt"] == "x\r\ny\rz\n"


def test_jsonl_lines_that_are_not_text_are_skipped_by_line(tmp_path, caplog):
    """One non-UTF-8 line or a lone surrogate escape no longer fails the whole corpus without a file name: the
    line is skipped and named; a byte-order mark at the start is accepted."""
    (tmp_path / "c.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "first"}\n{"text": "caf\xe9"}\n'
                                       b'{"text": "bad \\ud800"}\n' + b"".join(b'{"text": "doc %d"}\n' % i
                                                                             for i in range(6)))
    c = open_corpus(str(tmp_path / "c.jsonl"), val_fraction=0.3)
    texts = [t for split in ("train", "val") for _, t in c.documents(split)]
    assert "first" in texts and sorted(texts) == sorted(["first"] + [f"doc {i}" for i in range(6)])
    assert "c.jsonl:2: not UTF-8" in caplog.text and "c.jsonl:3: the text is not valid Unicode" in caplog.text


def test_glob_lists_each_file_once_and_is_recorded_absolute(tmp_path, monkeypatch):
    (tmp_path / "g" / "sub").mkdir(parents=True)
    for name in ("g/a.txt", "g/sub/b.txt", "g/sub/c.txt"):
        (tmp_path / name).write_text(f"{name}\n")
    monkeypatch.chdir(tmp_path)
    c = open_corpus("g/**/**/*.txt")
    assert len(c.entries) == 3  # "**/**" reached sub/b.txt twice
    assert c.description == f"glob {tmp_path / 'g/**/**/*.txt'}"  # the same relative glob elsewhere is another corpus


def test_tokenizer_training_cuts_very_long_lines_and_refuses_a_huge_vocabulary():
    from k3.data.tokenizer import LONG_LINE, MAX_VOCAB_SIZE, _cut_long_lines, train_tokenizer

    normal = "def f():\n    return 1\n" * 1000
    assert list(_cut_long_lines(normal)) == [normal]  # unchanged: the standard library's lines are short
    pieces = list(_cut_long_lines("head\n" + "x" * (2 * LONG_LINE + 5) + "\ntail"))
    assert pieces == ["head\n", "x" * LONG_LINE, "x" * LONG_LINE, "x" * 5, "tail"]
    with pytest.raises(ValueError, match="too large"):
        train_tokenizer(["text"], MAX_VOCAB_SIZE + 1)


def test_a_file_name_that_is_not_utf8_is_skipped_and_named(tmp_path, caplog):
    """A name in another encoding (a surrogate escape in Python) stopped the whole corpus with an encode error that
    named no file."""
    import os

    d = tmp_path / "d"
    d.mkdir()
    with open(os.path.join(os.fsencode(d), b"caf\xe9.txt"), "wb") as f:
        f.write(b"text\n" * 5)
    for i in range(4):
        (d / f"f{i}.txt").write_text(f"doc {i}\n")
    for spec in (str(d), str(d / "*.txt")):
        c = open_corpus(spec, val_fraction=0.3)
        names = [n for split in ("train", "val") for n, _ in c.documents(split)]
        assert sorted(names) == [f"f{i}.txt" for i in range(4)]
        assert c.fingerprint()
    assert "caf\\xe9.txt: its name is not UTF-8" in caplog.text
