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
