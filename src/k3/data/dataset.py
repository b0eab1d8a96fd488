"""Packed token datasets: documents tokenised once into one flat token file, read back through `np.memmap`.

On disk, for a dataset named `train` in `out_dir` (each file written atomically):
  train.bin        every document's tokens, each followed by `<|eos|>`, as uint16 (vocab <= 65536) or uint32
  train.docs.npy   int64 offset of each document's first token (`doc_starts`)
  train.json       the manifest (n_tokens, n_docs, dtype, tokenizer fingerprint, source), written last, so a
                   manifest on disk always describes complete files

Training batches are a pure function of (seed, step) (`np.random.SeedSequence([seed, step, _BATCH_SALT])`), so a
resumed run reads exactly the tokens an uninterrupted one would. Validation reads fixed, non-overlapping windows
from the start of the split, in order.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

import numpy as np

from k3.data.corpus import DEFAULT_VAL_FRACTION, Document, cap_bytes, open_corpus
from k3.data.tokenizer import (
    DEFAULT_TOKENIZER_MAX_BYTES,
    DEFAULT_VOCAB_SIZE,
    SPECIAL_TOKENS,
    TOKENIZER_FILE,
    Tokenizer,
    load_tokenizer,
    train_tokenizer,
)
from k3.fileio import atomic_open, atomic_write_text, loads_json, pid_alive, writer_pid

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

DATASET_FORMAT = 1
DATA_MANIFEST = "data.json"
DATA_MARK = ".k3-data"  # written before a build starts: the directory's files are k3's, even if the build failed
STAGE_PREFIX = ".k3-build-"  # a build in progress (a folder inside the data directory, moved in when complete)
DEFAULT_DECONTAMINATE = 0.5  # validation documents this much made of training lines are left out
_BATCH_SALT = 0x6B33  # keeps these streams apart from any other SeedSequence([seed, step]) in k3


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 holds ids 0..65535, i.e. any vocab of at most 65536 tokens; larger vocabs need uint32."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


class PackedDataset:
    """A flat token file with document boundaries; `get_batch` for training, `iter_eval_batches` for eval."""

    def __init__(self, manifest_path: str | os.PathLike):
        self.manifest_path = Path(manifest_path)
        if not self.manifest_path.is_file():
            raise ValueError(f"no dataset manifest at {self.manifest_path}; build it with `k3 tokenize --out "
                             f"{self.manifest_path.parent}`")
        rebuild = f"rebuild it with `k3 tokenize --out {self.manifest_path.parent}`"
        try:
            self.manifest = m = loads_json(self.manifest_path.read_text(encoding="utf-8"))  # bounded nesting
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{self.manifest_path} is not valid JSON ({e}): the dataset is damaged; "
                             f"{rebuild}") from None
        if not isinstance(m, dict) or m.get("format") != DATASET_FORMAT:
            got = m.get("format") if isinstance(m, dict) else type(m).__name__
            raise ValueError(f"{self.manifest_path} has dataset format {got!r}, this k3 reads "
                             f"{DATASET_FORMAT}; {rebuild}")
        missing = [k for k in ("bin", "dtype", "n_tokens", "doc_starts", "tokenizer_hash") if k not in m]
        if missing:
            raise ValueError(f"{self.manifest_path} lacks {missing}: the dataset is damaged; {rebuild}")
        root = self.manifest_path.parent
        try:
            self.bin_path = root / str(m["bin"])
            self.dtype = np.dtype(m["dtype"])
            if self.dtype.kind not in "ui" or isinstance(m["n_tokens"], bool):
                raise TypeError(f"dtype {self.dtype} is not an integer type")
            self.n_tokens = int(m["n_tokens"])
            if self.n_tokens < 0 or self.n_tokens != m["n_tokens"]:
                raise ValueError(f"n_tokens {m['n_tokens']!r} is not a token count")
        except (TypeError, ValueError) as e:
            raise ValueError(f"{self.manifest_path}: {e}: the dataset is damaged; {rebuild}") from None
        expected = self.n_tokens * self.dtype.itemsize
        if not self.bin_path.is_file():
            raise ValueError(f"{self.bin_path} is missing (named by {self.manifest_path}); {rebuild}")
        actual = self.bin_path.stat().st_size
        if actual != expected:
            raise ValueError(f"{self.bin_path} has {actual} bytes, the manifest says {expected} "
                             f"({self.n_tokens} x {self.dtype}); the dataset is incomplete: rebuild it with "
                             f"`k3 tokenize`")
        self.tokens = np.memmap(self.bin_path, dtype=self.dtype, mode="r", shape=(self.n_tokens,))
        try:
            self.doc_starts: np.ndarray = np.load(root / m["doc_starts"])
        except (OSError, ValueError, EOFError) as e:
            raise ValueError(f"{root / m['doc_starts']} cannot be read ({type(e).__name__}: {e}): the dataset is "
                             f"damaged; {rebuild}") from None
        # another build's document starts (a rebuild interrupted while its files were moved in) load without error
        n_docs = m.get("n_docs")
        starts = self.doc_starts
        if (starts.ndim != 1 or (isinstance(n_docs, int) and len(starts) != n_docs)
                or (len(starts) and (starts.min() < 0 or starts.max() >= max(self.n_tokens, 1)))):
            raise ValueError(f"{root / m['doc_starts']} does not match {self.manifest_path} ({len(starts)} document "
                             f"starts for {n_docs} documents of {self.n_tokens} tokens): the dataset is damaged; "
                             f"{rebuild}")

    # ------------------------------------------------------------------ facts
    def __len__(self) -> int:
        return self.n_tokens

    @property
    def n_docs(self) -> int:
        return len(self.doc_starts)

    @property
    def tokenizer_hash(self) -> str:
        return self.manifest["tokenizer_hash"]

    def __repr__(self) -> str:
        return (f"PackedDataset({self.manifest.get('name')!r}, {self.n_tokens:,} tokens, {self.n_docs} docs, "
                f"{self.dtype}, {str(self.manifest_path.parent)!r})")

    def check_tokenizer(self, tokenizer: Tokenizer) -> None:
        if tokenizer.fingerprint != self.tokenizer_hash:
            raise ValueError(f"{self.manifest_path} was built with a different tokenizer than {tokenizer.path or 'the one given'}; "
                             f"rebuild the data with `k3 tokenize` (or point at the matching tokenizer.json)")

    def check_seq_len(self, seq_len: int) -> None:
        """A window needs seq_len + 1 tokens (inputs plus the shifted targets)."""
        if not isinstance(seq_len, (int, np.integer)) or seq_len <= 0:
            raise ValueError(f"seq_len = {seq_len!r} must be a positive integer")
        if self.n_tokens < seq_len + 1:
            raise ValueError(f"dataset {self.manifest_path} has {self.n_tokens} tokens, fewer than seq_len + 1 = "
                             f"{seq_len + 1} needed for one window; lower --seq-len or give more text (--data)")

    # ------------------------------------------------------------------ training batches
    def batch_starts(self, step: int, batch_size: int, seq_len: int, seed: int = 0,
                     rank: int = 0, world_size: int = 1) -> np.ndarray:
        """Window starts for `step`: rank `rank`'s slice of the global batch of batch_size * world_size."""
        self.check_seq_len(seq_len)
        for name, v in (("step", step), ("seed", seed), ("rank", rank)):
            if not isinstance(v, (int, np.integer)) or v < 0:
                raise ValueError(f"{name} = {v!r} must be a non-negative integer")
        if batch_size <= 0 or world_size <= 0 or rank >= world_size:
            raise ValueError(f"need batch_size > 0 and 0 <= rank < world_size; got batch_size={batch_size}, "
                             f"rank={rank}, world_size={world_size}")
        state = np.random.SeedSequence([int(seed), int(step), _BATCH_SALT]).generate_state(
            batch_size * world_size, dtype=np.uint64)
        # n_windows <= 2**32 << 2**64, so the modulo bias is far below anything measurable
        starts = (state % np.uint64(self.n_tokens - seq_len)).astype(np.int64)
        return starts[rank * batch_size:(rank + 1) * batch_size]

    def _windows(self, starts: Iterable[int], seq_len: int, docs: bool = False) -> tuple[torch.Tensor, ...]:
        import torch  # lazily: `k3 tokenize` never needs it

        starts = np.asarray(list(starts), dtype=np.int64)
        w = np.stack([np.asarray(self.tokens[s:s + seq_len + 1], dtype=np.int64) for s in starts])
        x, y = torch.from_numpy(w[:, :-1].copy()), torch.from_numpy(w[:, 1:].copy())
        return (x, y, self.window_doc_ids(starts, seq_len)) if docs else (x, y)

    def window_doc_ids(self, starts: Iterable[int], seq_len: int) -> torch.Tensor:
        """[len(starts), seq_len] long: the document of each input token of the windows starting at `starts` (a
        document's closing <|eos|> is its own last token, so the next document begins after it)."""
        import torch

        pos = np.asarray(list(starts), dtype=np.int64)[:, None] + np.arange(seq_len, dtype=np.int64)[None, :]
        return torch.from_numpy(np.searchsorted(self.doc_starts, pos, side="right").astype(np.int64))

    def get_batch(self, step: int, batch_size: int, seq_len: int, seed: int = 0,
                  rank: int = 0, world_size: int = 1, docs: bool = False) -> tuple[torch.Tensor, ...]:
        """(inputs, targets), LongTensors [batch_size, seq_len], targets = inputs shifted by one token; with
        `docs`, also the document ids of the inputs (`window_doc_ids`). The content depends only on (seed, step)
        (and the rank's slice): resumable by construction."""
        return self._windows(self.batch_starts(step, batch_size, seq_len, seed, rank, world_size), seq_len, docs)

    # ------------------------------------------------------------------ evaluation batches
    def n_eval_windows(self, seq_len: int) -> int:
        self.check_seq_len(seq_len)
        return (self.n_tokens - 1) // seq_len

    def iter_eval_batches(self, batch_size: int, seq_len: int, max_batches: int | None = None,
                          docs: bool = False) -> Iterator[tuple[torch.Tensor, ...]]:
        """Non-overlapping windows from token 0 on, in order; the last batch may be smaller."""
        n = self.n_eval_windows(seq_len)
        if batch_size <= 0:
            raise ValueError(f"batch_size = {batch_size} must be positive")
        starts = np.arange(n, dtype=np.int64) * seq_len
        for b, i in enumerate(range(0, n, batch_size)):
            if max_batches is not None and b >= max_batches:
                return
            yield self._windows(starts[i:i + batch_size], seq_len, docs)


def build_dataset(documents: Iterable[Document], tokenizer: Tokenizer, out_dir: str | os.PathLike,
                  name: str = "train", *, source: str = "", progress: bool = False, total: int | None = None,
                  chunk_docs: int = 64, extra: dict | None = None, shown_dir: Path | None = None) -> PackedDataset:
    """Tokenise `documents` once (each followed by `<|eos|>`) into `out_dir/{name}.bin` + manifest. `shown_dir`: the
    directory the log line names (where a staged build will end up)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = out_dir / f"{name}.json"
    # the manifest marks a complete dataset: drop any old one before touching its files
    manifest_path.unlink(missing_ok=True)
    dtype = token_dtype(tokenizer.vocab_size)
    eos = tokenizer.eos_id
    doc_starts: list[int] = []
    n_tokens = n_bytes = 0
    t0 = time.perf_counter()

    from tqdm.auto import tqdm

    bar = tqdm(total=total, unit="doc", desc=f"tokenize {name}", disable=not progress)
    try:
        with atomic_open(out_dir / f"{name}.bin", "wb") as f:
            chunk: list[str] = []

            def flush() -> None:
                nonlocal n_tokens
                # corpus text is data: "<|eos|>" written in a file is bytes, not a document boundary
                for ids in tokenizer.encode_batch(chunk, eos=True, allow_special=False):
                    doc_starts.append(n_tokens)
                    f.write(np.asarray(ids, dtype=dtype).tobytes())
                    n_tokens += len(ids)
                bar.update(len(chunk))
                chunk.clear()

            for _doc_id, text in documents:
                chunk.append(text)
                n_bytes += len(text.encode("utf-8"))
                if len(chunk) >= chunk_docs:
                    flush()
            if chunk:
                flush()
            if n_tokens == 0:
                raise ValueError(f"no documents to tokenise for dataset {name!r} ({source or 'no source'}); "
                                 f"check --data")
    finally:
        bar.close()
    with atomic_open(out_dir / f"{name}.docs.npy", "wb") as f:
        np.save(f, np.asarray(doc_starts, dtype=np.int64))
    manifest = {
        "format": DATASET_FORMAT, "name": name, "bin": f"{name}.bin", "doc_starts": f"{name}.docs.npy",
        "dtype": dtype.name, "n_tokens": n_tokens, "n_docs": len(doc_starts), "n_bytes": n_bytes,
        "bytes_per_token": n_bytes / n_tokens, "vocab_size": tokenizer.vocab_size, "eos_id": eos,
        "tokenizer_hash": tokenizer.fingerprint, "source": source, **(extra or {}),
    }
    atomic_write_text(manifest_path, json.dumps(manifest, indent=2) + "\n")
    log.info("%s: %s tokens from %d documents (%.2f bytes/token) in %.1fs",
             manifest_path if shown_dir is None else Path(shown_dir) / manifest_path.name, f"{n_tokens:,}",
             len(doc_starts), n_bytes / n_tokens, time.perf_counter() - t0)
    return PackedDataset(manifest_path)


def load_dataset(out_dir: str | os.PathLike, name: str = "train", tokenizer: Tokenizer | None = None) -> PackedDataset:
    """Open `out_dir/{name}.json`; with `tokenizer`, also check it is the one the tokens were made with."""
    ds = PackedDataset(Path(out_dir) / f"{name}.json")
    if tokenizer is not None:
        ds.check_tokenizer(tokenizer)
    return ds


# ---------------------------------------------------------------------- decontamination
def _lines(text: str) -> list[str]:
    return [s for s in (line.strip() for line in text.splitlines()) if s]


def _remember_lines(documents: Iterable[Document], seen: set[int]) -> Iterator[Document]:
    """Pass `documents` through, adding a hash of every non-blank (stripped) line to `seen`."""
    for doc_id, text in documents:
        seen.update(hash(s) for s in _lines(text))
        yield doc_id, text


def line_overlap(text: str, seen: set[int]) -> float:
    """Share of `text`'s non-blank characters on lines that occur verbatim (stripped) in `seen`."""
    lines = _lines(text)
    total = sum(len(s) for s in lines)
    return sum(len(s) for s in lines if hash(s) in seen) / total if total else 0.0


def _decontaminated(documents: Iterable[Document], seen: set[int], threshold: float,
                    excluded: list[dict]) -> Iterator[Document]:
    """`documents` without those whose line_overlap with the training text is >= threshold (recorded)."""
    for doc_id, text in documents:
        share = line_overlap(text, seen)
        if share >= threshold:
            excluded.append({"doc_id": doc_id, "overlap": round(share, 4)})
            log.info("validation: leaving out %s, %.0f%% of its text is lines of the training split", doc_id,
                     100 * share)
            continue
        yield doc_id, text


# ---------------------------------------------------------------------- the whole data step
@dataclass
class DataFiles:
    out_dir: Path
    tokenizer: Tokenizer
    train: PackedDataset
    val: PackedDataset
    info: dict = field(default_factory=dict)  # the request, corpus description and timings (data.json)
    reused: bool = False


def load_data(out_dir: str | os.PathLike) -> DataFiles:
    """Tokenizer + train/val datasets written by `prepare_data` / `k3 tokenize`, checked to match."""
    out_dir = Path(out_dir)
    info_path = out_dir / DATA_MANIFEST
    if (out_dir / DATA_MARK).is_file() and not info_path.is_file():
        # a build removes data.json before it moves its files in and writes it last: without it the folder may
        # mix two builds' files (a new train split beside the old validation split), which load without error
        raise ValueError(f"{out_dir} holds a build that did not finish (no {DATA_MANIFEST}); rebuild it: run the "
                         f"`k3 tokenize --out {out_dir} ...` that built it again")
    tok = load_tokenizer(out_dir / TOKENIZER_FILE)
    info = {}
    if info_path.is_file():  # a description of how the data was made; training does not need it
        try:
            info = loads_json(info_path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            log.warning("%s is not valid JSON (%s); going on without it (`k3 tokenize --force` rewrites it)",
                        info_path, e)
    return DataFiles(out_dir, tok, load_dataset(out_dir, "train", tok), load_dataset(out_dir, "val", tok), info)


def held_source(data_dir: str | os.PathLike) -> str | None:
    """The corpus description recorded in DATA_DIR/data.json, or None (no data there, or unreadable)."""
    def split_source(d: dict):  # a split records "<corpus> [train]"
        src = d.get("source")
        return src.rsplit(" [", 1)[0] if isinstance(src, str) and src.endswith("]") else src

    for name, get in ((DATA_MANIFEST, lambda d: d.get("request", {}).get("source")),
                      ("train.json", split_source), ("val.json", split_source)):
        # data.json is removed while a directory is rebuilt: a build that failed leaves the splits' own record
        try:
            source = get(loads_json((Path(data_dir) / name).read_text(encoding="utf-8")))
        except (OSError, ValueError, UnicodeDecodeError, AttributeError):
            continue
        if isinstance(source, str):
            return source
    return None


_DATA_FILE_NAMES = {DATA_MARK, DATA_MANIFEST, TOKENIZER_FILE} | {f"{split}{ext}" for split in ("train", "val")
                                                                  for ext in (".bin", ".json", ".docs.npy")}


def _written_by_k3(data_dir: Path) -> bool:
    """Whether a directory's files are k3's data files even without a readable source record: the build marker
    (written before a build starts), or a manifest, split record or tokenizer of k3's shape (a build interrupted
    or damaged under a version without the marker)."""
    if (data_dir / DATA_MARK).is_file():
        return True
    for name, keys in ((DATA_MANIFEST, ("request",)), ("train.json", ("n_tokens", "tokenizer_hash")),
                       ("val.json", ("n_tokens", "tokenizer_hash"))):
        try:
            d = loads_json((data_dir / name).read_text(encoding="utf-8"))
        except (OSError, ValueError, UnicodeDecodeError):
            continue
        if isinstance(d, dict) and all(k in d for k in keys):
            return True
    try:
        tok = (data_dir / TOKENIZER_FILE).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    # a k3 tokenizer alone says little: `k3 distill teachers` and `k3 rl` roots hold one too, beside their own files
    return all(t in tok for t in SPECIAL_TOKENS) and all(
        p.name in _DATA_FILE_NAMES or p.name.startswith(".") for p in data_dir.iterdir())  # "." : atomic-write temps


def same_corpus(a: str, b: str) -> bool:
    """Two corpus descriptions name the same corpus; any Python's standard library counts as one."""
    from k3.data.corpus import STDLIB_SOURCE

    def norm(d: str) -> str:  # globs recorded before they were made absolute: read against this directory
        return f"glob {os.path.abspath(d[5:])}" if d.startswith("glob ") else d

    return norm(a) == norm(b) or (a.startswith(STDLIB_SOURCE + " ") and b.startswith(STDLIB_SOURCE + " "))


def prepare_data(out_dir: str | os.PathLike, spec: str | None = None, *, vocab_size: int = DEFAULT_VOCAB_SIZE,
                 max_bytes: int | None = None, tokenizer_max_bytes: int = DEFAULT_TOKENIZER_MAX_BYTES,
                 val_fraction: float = DEFAULT_VAL_FRACTION, progress: bool = False,
                 force: bool = False, decontaminate: float = DEFAULT_DECONTAMINATE,
                 replace: bool = True) -> DataFiles:
    """Train the tokenizer on the train split (first `tokenizer_max_bytes`), then pack train and val
    (each capped at `max_bytes` if given). Reuses `out_dir` when it already holds this exact request.

    `decontaminate`: a validation document whose non-blank text is at least this share made of lines that
    occur verbatim in the packed training text is left out of validation (a generated near-copy of a training
    file, e.g. one codec table of a family, would otherwise score as if unseen); the ids and shares go to
    data.json `val_excluded`. 0 keeps every validation document. Costs a set of one hash per distinct
    training line (about 70 bytes each).

    `replace`: False for callers whose data directory is an input (k3 demo, k3 ablate): a complete build of
    the same corpus with other settings (vocabulary, caps) is refused, naming them, rather than rebuilt in
    place, which would strand the checkpoints trained on it. A build of an older corpus version, or one recorded by
    an older k3 (a request without today's keys), is rebuilt."""
    out_dir = Path(out_dir)
    if not 0.0 <= decontaminate <= 1.0:
        raise ValueError(f"decontaminate = {decontaminate} must be in [0, 1] (0: keep every validation document)")
    corpus = open_corpus(spec, val_fraction=val_fraction)
    n_train, n_val = len(corpus.doc_ids("train")), len(corpus.doc_ids("val"))
    if not n_val or not n_train:
        why = ("--val-fraction 0 leaves no validation split; use a fraction > 0, e.g. 0.02" if val_fraction == 0
               else f"{corpus.description} holds {len(corpus.entries)} document(s) (a text file is one document); "
                    "pass a directory, a glob or a .jsonl file with at least 2 documents")
        raise ValueError(f"the {'validation' if not n_val else 'training'} split would be empty: {why}")
    request = {
        "format": DATASET_FORMAT, "source": corpus.description, "corpus_fingerprint": corpus.fingerprint(),
        "vocab_size": vocab_size, "max_bytes": max_bytes, "tokenizer_max_bytes": tokenizer_max_bytes,
        "val_fraction": val_fraction, "decontaminate": decontaminate,
    }
    held = held_source(out_dir)
    if not force and held is not None and not same_corpus(held, corpus.description):
        raise ValueError(f"{out_dir} holds data tokenized from {held}; tokenizing {corpus.description} there would "
                         "replace it (and strand the checkpoints trained on it): use another directory, or "
                         "`k3 tokenize --force` to replace it")
    if not force and held is None and not _written_by_k3(out_dir):
        ours = [n for n in sorted(_DATA_FILE_NAMES - {DATA_MARK}) if (out_dir / n).exists()]
        if ours:
            raise ValueError(f"{out_dir} holds {', '.join(ours)}, not k3 data files (no data record there); building "
                             "the data there would replace them: use another directory, or `k3 tokenize --force` to "
                             "replace them")
    if not force and (out_dir / DATA_MANIFEST).is_file():
        try:
            files = load_data(out_dir)
            held_request = files.info.get("request")
            if held_request == request:
                log.info("%s already holds this data (same corpus, vocab and caps); reusing it", out_dir)
                files.reused = True
                return files
        except (ValueError, OSError, KeyError, json.JSONDecodeError) as err:
            log.info("rebuilding %s: %s", out_dir, err)
        else:
            skip = ("format", "corpus_fingerprint", "source")  # a newer version of the same corpus is rebuilt
            # compare the settings both requests record; a key only today's has (recorded by an older k3, which
            # could not ask for it) is no difference of its own: with the rest equal, the data is rebuilt
            held = held_request if isinstance(held_request, dict) else {}
            diff = [f"{k} {held[k]!r} (asked: {v!r})" for k, v in request.items()
                    if k not in skip and k in held and held[k] != v]
            if not replace and diff:
                raise ValueError(f"{out_dir} holds data built with other settings: {', '.join(diff)}; building this "
                                 "data there would replace it and strand the checkpoints trained on it: give "
                                 "another --data (a new directory is built), or rebuild this one with k3 tokenize")
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / DATA_MARK, "data built by k3 (k3 tokenize / k3 train); rebuilt in place\n")
    # built in a staging folder and moved in only when complete: a build that fails (or is interrupted) leaves
    # the data that was there as it was
    _remove_stale_stages(out_dir)
    stage = Path(tempfile.mkdtemp(prefix=f"{STAGE_PREFIX}{os.getpid()}-", dir=out_dir))
    try:
        info = _build(stage, corpus, request, vocab_size, max_bytes, tokenizer_max_bytes, decontaminate, progress,
                      shown_dir=out_dir)
        (out_dir / DATA_MANIFEST).unlink(missing_ok=True)  # from here until it is written, a half-moved folder
        for f in sorted(stage.iterdir(), key=lambda f: f.name == TOKENIZER_FILE):  # reads as no complete build
            os.replace(f, out_dir / f.name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    atomic_write_text(out_dir / DATA_MANIFEST, json.dumps(info, indent=2) + "\n")
    return load_data(out_dir)


def _remove_stale_stages(out_dir: Path) -> None:
    """Staging folders of builds whose process is gone (killed): named `.k3-build-PID-*`, they are left alone while
    that process runs (a build beside this one)."""
    for stage in out_dir.glob(f"{STAGE_PREFIX}*"):
        pid = writer_pid(stage.name, STAGE_PREFIX)
        if stage.is_dir() and not (pid is not None and pid_alive(pid)):
            shutil.rmtree(stage, ignore_errors=True)


def _build(out_dir: Path, corpus, request: dict, vocab_size: int, max_bytes: int | None, tokenizer_max_bytes: int,
           decontaminate: float, progress: bool, shown_dir: Path | None = None) -> dict:
    """Tokenizer and both splits written into `out_dir`; returns the data record (data.json) to write with them."""
    t0 = time.perf_counter()
    tok_bytes = tokenizer_max_bytes if max_bytes is None else min(max_bytes, tokenizer_max_bytes)
    tok = train_tokenizer(corpus.documents("train", max_bytes=tok_bytes), vocab_size,
                          path=out_dir / TOKENIZER_FILE, progress=progress)
    t_tok = time.perf_counter() - t0
    timings = {"tokenizer_s": round(t_tok, 3)}
    seen: set[int] = set()
    excluded: list[dict] = []
    for split in ("train", "val"):
        t1 = time.perf_counter()
        if decontaminate > 0 and split == "val":  # filter first, then cap: the cap fills up with clean text
            docs = cap_bytes(_decontaminated(corpus.documents(split), seen, decontaminate, excluded), max_bytes)
        else:
            docs = corpus.documents(split, max_bytes=max_bytes)
            if decontaminate > 0:
                docs = _remember_lines(docs, seen)
        if split == "val":
            docs = _not_empty(docs, corpus.description, excluded, decontaminate)
        build_dataset(
            docs, tok, out_dir, split,
            source=f"{corpus.description} [{split}]", progress=progress, total=len(corpus.doc_ids(split)),
            extra={"split": split, "max_bytes": max_bytes, "corpus_fingerprint": corpus.fingerprint()},
            shown_dir=shown_dir,
        )
        timings[f"{split}_s"] = round(time.perf_counter() - t1, 3)
    return {"request": request, "timings": timings, "tokenizer_hash": tok.fingerprint,
            "tokenizer_bytes": tok.trained_bytes, "val_excluded": excluded}


def _not_empty(documents: Iterable[Document], description: str, excluded: list[dict],
               threshold: float) -> Iterator[Document]:
    n = 0
    for doc in documents:
        n += 1
        yield doc
    if n == 0 and excluded:
        raise ValueError(f"every validation document of {description} is at least {threshold:.0%} lines of the "
                         f"training split ({len(excluded)} left out); "
                         + ("raise --decontaminate (1 keeps all but exact copies, 0 keeps everything)" if threshold < 1
                            else "--decontaminate 0 keeps every document")
                         + " or give more distinct text")
