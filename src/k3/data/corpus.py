"""Text corpora as iterables of `(doc_id, text)` documents, split train/validation by document.

The default corpus is embedded in every Python install: the standard library's `.py` sources (no
`site-packages`, no test suites, only UTF-8). Other text comes in through a `--data` spec: a directory (recursive
`*.txt`, `*.md`, `*.py`, `*.jsonl`), a glob, a text file, or a `.jsonl` file of objects with a string `"text"`
field (one document per line).

The split is a pure function of each document's id (its relative path, or `path:line` for JSONL): a keyed hash
maps the id to [0, 1) and ids below `val_fraction` are validation, on every call, machine and Python. Adding a
file never moves another across the split (unless no document hashed into validation, so the lowest-hashed one
stood in). Near-copies of training text leave validation when the data is packed (`prepare_data`), not here.
"""
from __future__ import annotations

import glob as globlib
import hashlib
import json
import logging
import os
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator
from k3.fileio import loads_json

log = logging.getLogger(__name__)

Document = tuple[str, str]  # (doc_id, text)

STDLIB = "stdlib"
STDLIB_SOURCE = "python-stdlib"  # how a stdlib corpus's description starts (then the Python version and path)
DEFAULT_VAL_FRACTION = 0.02
TEXT_SUFFIXES = (".txt", ".md", ".py", ".jsonl")
# Path components that mark a test suite (test/, tests/, idlelib/idle_test, lib2to3/tests, ctypes/test, ...).
STDLIB_TEST_DIRS = frozenset({"test", "tests", "idle_test"})
STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
SPLITS = ("train", "val", "all")


def split_fraction(doc_id: str) -> float:
    """Where `doc_id` falls in [0, 1); stable across processes (not Python's salted `hash`)."""
    digest = hashlib.blake2b(doc_id.encode("utf-8"), digest_size=8, person=b"k3-split").digest()
    return int.from_bytes(digest, "big") / 2.0**64


@dataclass(frozen=True)
class _Entry:
    doc_id: str
    path: Path
    line: int | None = None  # 1-based line of a JSONL document; None = the whole file is one document


def _content_digest(path: Path) -> bytes:
    """sha256 of a file's bytes; of its size and mtime when it cannot be read (the reader skips it too)."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    except OSError:
        try:
            st = path.stat()
        except OSError:
            return b"missing"
        return f"unreadable {st.st_size} {st.st_mtime_ns}".encode()
    return h.digest()


class Corpus:
    """A list of documents (known up front, read lazily) and their deterministic train/val split."""

    def __init__(self, entries: list[_Entry], description: str, val_fraction: float = DEFAULT_VAL_FRACTION):
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction = {val_fraction} must be in [0, 1); use e.g. 0.02 for 2% validation")
        if not entries:
            raise ValueError(f"corpus {description!r} has no documents; point --data at a directory, glob or "
                             f"file with non-empty {'/'.join(TEXT_SUFFIXES)} text")
        self.entries = entries
        self.description = description
        self.val_fraction = val_fraction
        frac = {e.doc_id: split_fraction(e.doc_id) for e in entries}
        val = {d for d, f in frac.items() if f < val_fraction}
        # A small corpus may hash nothing (or everything) into validation; keep both splits non-empty by
        # moving the single lowest-hashed (resp. highest-hashed) document, still a function of the ids only.
        if val_fraction > 0 and not val and len(frac) >= 2:
            val = {min(frac, key=frac.__getitem__)}
        if len(val) == len(frac) and len(frac) >= 2:
            val.discard(max(frac, key=frac.__getitem__))
        self._val = frozenset(val)
        self._fingerprint: str | None = None

    def __repr__(self) -> str:
        return f"Corpus({self.description!r}, {len(self.entries)} documents, {len(self._val)} validation)"

    def split_of(self, doc_id: str) -> str:
        return "val" if doc_id in self._val else "train"

    def doc_ids(self, split: str = "train") -> list[str]:
        return [e.doc_id for e in self._select(split)]

    def _select(self, split: str) -> list[_Entry]:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; use one of {SPLITS}")
        if split == "all":
            return list(self.entries)
        return [e for e in self.entries if self.split_of(e.doc_id) == split]

    def fingerprint(self) -> str:
        """Hash of the document list and the files' contents: changes when the corpus does, and only then
        (a copy that keeps size and mtime is still seen; a `touch` is not a change). Reads every file once
        per corpus object (its cost: docs/benchmarks.md, "Data"); a file that cannot be read, which the reader
        skips, counts by its size and mtime."""
        if self._fingerprint is None:
            h = hashlib.sha256(f"{self.description}|{self.val_fraction}".encode())
            # absolute paths: the same folder given as `corpus`, `./corpus` or its full path is the same corpus
            for path in sorted({e.path for e in self.entries}):
                h.update(f"|{os.path.abspath(path)}|".encode() + _content_digest(path))
            h.update(f"|{len(self.entries)}".encode())
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    def documents(self, split: str = "train", max_bytes: int | None = None) -> Iterator[Document]:
        """Yield `(doc_id, text)` for `split`; stop once `max_bytes` UTF-8 bytes were yielded (the last
        document is cut to fit). Raises ValueError if the split turns out empty."""
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes = {max_bytes} must be positive (or None for no cap)")
        selected = self._select(split)
        if not selected:
            raise ValueError(f"the {split!r} split of {self.description!r} is empty ({len(self.entries)} "
                             f"document(s) in all); add more documents (at least 2 give both splits one)")
        n = 0
        for doc in cap_bytes(self._read(selected), max_bytes):
            n += 1
            yield doc
        if n == 0:
            raise ValueError(f"the {split!r} split of {self.description!r} has no readable text (files empty or "
                             f"not UTF-8); check the --data path")

    def _read(self, entries: list[_Entry]) -> Iterator[Document]:
        i = 0
        while i < len(entries):
            e = entries[i]
            if e.line is None:
                i += 1
                try:  # bytes decoded as they are: "\r\n" and "\r" stay (read_text would turn them into "\n")
                    text = e.path.read_bytes().decode("utf-8")
                except UnicodeDecodeError:
                    log.warning("skipping %s: not UTF-8 text", e.path)
                    continue
                except OSError as err:  # vanished, unreadable: skipped like undecodable text, and said
                    log.warning("skipping %s: cannot be read (%s)", e.path, err.strerror or err)
                    continue
                yield e.doc_id, text
                continue
            # consecutive JSONL documents from one file: read the file once
            j = i
            wanted: dict[int, str] = {}
            while j < len(entries) and entries[j].path == e.path and entries[j].line is not None:
                wanted[entries[j].line] = entries[j].doc_id
                j += 1
            i = j
            yield from _read_jsonl(e.path, wanted)


def cap_bytes(documents: Iterable[Document], max_bytes: int | None) -> Iterator[Document]:
    """The non-empty `documents` until `max_bytes` UTF-8 bytes were yielded, the last one cut to fit."""
    used = 0
    for doc_id, text in documents:
        size = len(text.encode("utf-8"))
        cut = max_bytes is not None and used + size > max_bytes
        if cut:
            text = text.encode("utf-8")[: max_bytes - used].decode("utf-8", errors="ignore")
            size = len(text.encode("utf-8"))
        if text:
            used += size
            yield doc_id, text
        if cut or (max_bytes is not None and used >= max_bytes):
            return


def _read_jsonl(path: Path, wanted: dict[int, str]) -> Iterator[Document]:
    # lines end at "\n" only, as _jsonl_entries counts them: a lone "\r" inside a file is not a record boundary
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if lineno not in wanted:
                continue
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # a BOM may open the file
            except UnicodeDecodeError as err:
                log.warning("skipping %s:%d: not UTF-8 text (byte %d)", path, lineno, err.start)
                continue
            try:
                obj = loads_json(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg}); each line of a .jsonl corpus "
                                 f'must be one object like {{"text": "..."}}') from None
            text = obj.get("text") if isinstance(obj, dict) else None
            if not isinstance(text, str):
                raise ValueError(f'{path}:{lineno}: no string "text" field; each line of a .jsonl corpus must be '
                                 f'an object like {{"text": "..."}}')
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as err:  # a lone surrogate escape ("\ud800"): not text
                log.warning("skipping %s:%d: the text is not valid Unicode (%s)", path, lineno, err.reason)
                continue
            yield wanted[lineno], text


def _jsonl_entries(path: Path, name: str) -> list[_Entry]:
    entries = []
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                entries.append(_Entry(f"{name}:{lineno}", path, lineno))
    return entries


def _file_entries(files: list[tuple[str, Path]]) -> list[_Entry]:
    """`files` = sorted (relative name, path); JSONL files expand into one entry per non-blank line."""
    entries: list[_Entry] = []
    for name, path in files:
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:  # a file name in another encoding: documents are named by their UTF-8 path
            log.warning("skipping %s: its name is not UTF-8 (rename it to include it)",
                        os.fsencode(path).decode("utf-8", "backslashreplace"))
            continue
        try:
            if path.stat().st_size == 0:
                continue
        except OSError as err:  # a broken symlink, a file gone since the listing
            log.warning("skipping %s: %s", path, err.strerror or err)
            continue
        if path.suffix == ".jsonl":
            entries.extend(_jsonl_entries(path, name))
        else:
            entries.append(_Entry(name, path))
    return entries


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[tuple[str, Path]]:
    """Sorted `(relative posix path, path)` of the stdlib's `.py` sources, without site-packages and
    test suites. (Non-UTF-8 files are dropped when read.)"""
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise ValueError(f"the Python standard library was not found at {root}; pass --data with your own text")
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        dirnames[:] = [d for d in dirnames if d not in STDLIB_SKIP_DIRS and d not in STDLIB_TEST_DIRS]
        for fn in filenames:
            if fn.endswith(".py"):
                out.append(((rel_dir / fn).as_posix(), Path(dirpath) / fn))
    out.sort()
    return out


def _walk_dir(root: Path) -> list[tuple[str, Path]]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        for fn in filenames:
            if fn.endswith(TEXT_SUFFIXES) and not fn.startswith("."):
                p = Path(dirpath) / fn
                out.append((p.relative_to(root).as_posix(), p))
    out.sort()
    return out


def _glob_base(pattern: str) -> Path:
    """The directory part of a glob before its first wildcard; documents are named relative to it."""
    parts = Path(pattern).parts
    base = []
    for part in parts[:-1]:
        if globlib.has_magic(part):
            break
        base.append(part)
    return Path(*base) if base else Path(".")


def open_corpus(spec: str | os.PathLike | None = None, *, val_fraction: float = DEFAULT_VAL_FRACTION) -> Corpus:
    """The corpus named by a `--data` spec: None or "stdlib" (default), a directory, a glob, a text file
    or a `.jsonl` file."""
    if spec is None or str(spec) == STDLIB:
        root = stdlib_root()
        desc = f"{STDLIB_SOURCE} {platform.python_version()} ({root})"
        return Corpus(_file_entries(stdlib_files(root)), desc, val_fraction)
    s = os.path.expanduser(str(spec))
    if not s.strip():
        raise ValueError(f"--data {spec!r} is empty; give a directory, a glob or a file (or omit --data for the "
                         "built-in stdlib corpus)")
    path = Path(s)
    if globlib.has_magic(s) and not path.exists():
        # each file once ("**/**" lists a file under every way of reaching it)
        matches = sorted({Path(os.path.abspath(m)) for m in globlib.glob(s, recursive=True)})
        matches = [m for m in matches if m.is_file()]
        if not matches:
            raise ValueError(f"--data {spec!r}: the glob matches no files; check the pattern (quote it so the "
                             f"shell does not expand it) or pass a directory")
        base = _glob_base(os.path.abspath(s))
        files = sorted((os.path.relpath(m, base).replace(os.sep, "/"), m) for m in matches)
        # the absolute pattern: the same relative glob from another directory is another corpus
        return Corpus(_file_entries(files), f"glob {os.path.abspath(s)}", val_fraction)
    if not path.exists():
        raise ValueError(f"--data {spec!r}: no such file or directory; pass a directory, a glob, a .txt/.md/.py "
                         f"file or a .jsonl file (or omit --data for the built-in stdlib corpus)")
    if path.is_dir():
        files = _walk_dir(path)
        if not files:
            raise ValueError(f"--data {spec!r}: the directory has no {'/'.join(TEXT_SUFFIXES)} files")
        return Corpus(_file_entries(files), f"directory {path.resolve()}", val_fraction)
    entries = _file_entries([(path.name, path)])
    if not entries:
        raise ValueError(f"--data {spec!r}: the file is empty")
    kind = "jsonl" if path.suffix == ".jsonl" else "file"
    return Corpus(entries, f"{kind} {path.resolve()}", val_fraction)


def iter_documents(spec: str | None = None, split: str = "train", max_bytes: int | None = None,
                   val_fraction: float = DEFAULT_VAL_FRACTION) -> Iterator[Document]:
    """Shorthand for `open_corpus(spec).documents(split, max_bytes)`."""
    return open_corpus(spec, val_fraction=val_fraction).documents(split, max_bytes)
