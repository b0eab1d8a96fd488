"""Byte-level BPE (HF `tokenizers`), with k3's special tokens reserved at fixed ids 0..16 (and Kimi K3's four
chat-format tokens at 17..20 in tokenizers trained since they were added).

Byte-level means every string round-trips exactly (any Unicode, any whitespace) and there is no unknown
token: the 256 byte symbols are always in the vocabulary. `SPECIAL_TOKENS` is the one list of reserved
tokens; their ids are their positions in it, so a chat template or a loss mask can rely on them.
`FORMAT_TOKENS` follow them (`RESERVED_TOKENS`): the structural tokens of Kimi K3's chat format
(`k3.data.chat_kimi`). A tokenizer trained before has BPE tokens at 17..20; it keeps loading with its ids
and serves k3's own format only (`Tokenizer.n_special` says which kind a tokenizer is).

Training on the full stdlib corpus is bounded by `DEFAULT_TOKENIZER_MAX_BYTES` (the first ~20 MB of the
train split, in sorted file order), which bounds BPE training's time (docs/benchmarks.md, "Data").
"""
from __future__ import annotations

import hashlib
import json
import logging
import operator
import os
from pathlib import Path
from typing import Iterable, Iterator, Sequence

log = logging.getLogger(__name__)

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|bos|>", "<|eos|>", "<|pad|>",
    "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>",
    "<|tool_call|>", "<|/tool_call|>",
    "<|tool_result|>", "<|/tool_result|>",
    "<|think|>", "<|/think|>",
    "<|effort:low|>", "<|effort:medium|>", "<|effort:high|>",
)
# Kimi K3's chat format (XTML): tag names and attributes are ordinary text between these four tokens.
FORMAT_TOKENS: tuple[str, ...] = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")
RESERVED_TOKENS: tuple[str, ...] = SPECIAL_TOKENS + FORMAT_TOKENS
from k3.fileio import atomic_write_text, loads_json  # noqa: E402

N_BYTES = 256
MIN_VOCAB_SIZE = N_BYTES + len(SPECIAL_TOKENS)
MAX_VOCAB_SIZE = 1 << 20
DEFAULT_VOCAB_SIZE = 8192
DEFAULT_TOKENIZER_MAX_BYTES = 20_000_000
TOKENIZER_FILE = "tokenizer.json"
# The post-processor transformers' `save_pretrained` writes when a tokenizer has none: each sequence as it is.
_ADDS_NOTHING = {"type": "TemplateProcessing",
                 "single": [{"Sequence": {"id": "A", "type_id": 0}}],
                 "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                 "special_tokens": {}}


# ---------------------------------------------------------------------- the tokenizer
class Tokenizer:
    """A thin wrapper over a `tokenizers.Tokenizer` with k3's special tokens."""

    def __init__(self, hf, path: str | os.PathLike | None = None):
        self.hf = hf
        self.path = Path(path) if path is not None else None
        self._check_specials()
        # FORMAT_TOKENS count only where all of them sit at their reserved ids (an older tokenizer has BPE there)
        n = len(SPECIAL_TOKENS)
        self.n_special = len(RESERVED_TOKENS) if all(
            self.hf.token_to_id(t) == n + i for i, t in enumerate(FORMAT_TOKENS)) else n
        self._plain = None  # a copy that encodes special-token strings as ordinary text
        self.trained_bytes: int | None = None  # set by train_tokenizer

    def _check_specials(self) -> None:
        for i, tok in enumerate(SPECIAL_TOKENS):
            got = self.hf.token_to_id(tok)
            if got != i:
                where = f" in {self.path}" if self.path else ""
                raise ValueError(f"tokenizer{where} has special token {tok} at id {got}, expected {i}; it was not "
                                 f"made by k3 (or by an older k3): retrain it with `k3 tokenize`")

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    @property
    def max_token_bytes(self) -> int:
        """Bytes of text the longest token stands for (a byte-level token's string has one character per byte):
        a text of n bytes is at least ceil(n / max_token_bytes) tokens, known without encoding it."""
        if getattr(self, "_max_token_bytes", None) is None:
            self._max_token_bytes = max(len(t.encode("utf-8")) for t in self.hf.get_vocab(with_added_tokens=True))
        return self._max_token_bytes

    @property
    def fingerprint(self) -> str:
        """sha256 of the serialised tokenizer; datasets record it to detect a tokenizer swap.

        A post-processor that adds no tokens is hashed as none: transformers' `save_pretrained` writes one
        into an HF export's tokenizer.json, which gives exactly the ids of the tokenizer it was exported from.
        """
        text = self.hf.to_str()
        if self.hf.post_processor is not None:
            from tokenizers import Tokenizer as HFTokenizer

            spec = loads_json(text)
            if spec.get("post_processor") == _ADDS_NOTHING:
                spec["post_processor"] = None
                text = HFTokenizer.from_str(json.dumps(spec)).to_str()
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    def special_id(self, name: str) -> int:
        """Id of a special token, by full form (`"<|eos|>"`) or short name (`"eos"`, `"effort:high"`)."""
        tok = name if name.startswith("<|") else f"<|{name}|>"
        known = RESERVED_TOKENS[:self.n_special]
        if tok in known:
            return known.index(tok)
        if tok in FORMAT_TOKENS:
            raise ValueError(f"this tokenizer has no {tok}: it was trained before k3 reserved Kimi K3's chat-format "
                             "tokens (ids 17..20); retrain it with `k3 tokenize` to use that format")
        raise ValueError(f"unknown special token {name!r}; known: {', '.join(known)}")

    @property
    def bos_id(self) -> int:
        return self.special_id("bos")

    @property
    def eos_id(self) -> int:
        return self.special_id("eos")

    @property
    def pad_id(self) -> int:
        return self.special_id("pad")

    def _encoder(self, allow_special: bool):
        if allow_special:
            return self.hf
        if self._plain is None:
            from tokenizers import Tokenizer as HFTokenizer

            self._plain = HFTokenizer.from_str(self.hf.to_str())
            self._plain.encode_special_tokens = True
        return self._plain

    def encode(self, text: str, *, bos: bool = False, eos: bool = False, allow_special: bool = True) -> list[int]:
        """Token ids of `text`. With `allow_special=False`, strings such as "<|eos|>" inside `text` are
        encoded as plain bytes (use this for untrusted or corpus text)."""
        try:
            ids = self._encoder(allow_special or "<|" not in text).encode(text, add_special_tokens=False).ids
        except TypeError:  # tokenizers' "TextInputSequence must be str": a lone surrogate (bytes not UTF-8)
            if not isinstance(text, str):
                raise ValueError(f"the text to encode must be a str, got {type(text).__name__}") from None
            bad = next((i for i, ch in enumerate(text) if 0xD800 <= ord(ch) <= 0xDFFF), None)
            if bad is None:
                raise
            raise ValueError(f"the text is not valid Unicode: a lone surrogate at character {bad} "
                             f"({text[max(0, bad - 10):bad]!r} before it), e.g. bytes that are not UTF-8 on the "
                             "command line; pass UTF-8 text") from None
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_batch(self, texts: Sequence[str], *, bos: bool = False, eos: bool = False,
                     allow_special: bool = True) -> list[list[int]]:
        if isinstance(texts, str):
            raise ValueError("encode_batch takes a list of texts, got one string (it would be split into its "
                             "characters); use encode(text) or encode_batch([text])")
        texts = list(texts)
        for n, t in enumerate(texts):
            if not isinstance(t, str):
                raise ValueError(f"encode_batch takes a list of strings; item {n} is {type(t).__name__} {t!r}")
        # The plain encoder is slower, and only matters for texts that contain "<|" (every special does).
        plain = [] if allow_special else [i for i, t in enumerate(texts) if "<|" in t]
        out = _ids(self.hf, texts)
        if plain:
            for i, ids in zip(plain, _ids(self._encoder(False), [texts[i] for i in plain])):
                out[i] = ids
        if bos or eos:
            pre, post = ([self.bos_id] if bos else []), ([self.eos_id] if eos else [])
            out = [pre + ids + post for ids in out]
        return out

    def _ids(self, ids: Iterable[int]) -> list[int]:
        """Integer ids in [0, vocab_size) (a ValueError names the first that is not: the tokenizers library drops an
        id past the end without a word, and a float would be truncated)."""
        if hasattr(ids, "tolist"):  # a tensor or an array
            ids = ids.tolist()
        out, V = [], self.vocab_size
        for i in ids:
            try:
                j = operator.index(i)
            except TypeError:
                raise ValueError(f"token ids must be integers, got {i!r} ({type(i).__name__})") from None
            if not 0 <= j < V:
                raise ValueError(f"token id {j} is outside this tokenizer's vocabulary [0, {V}); was it made with "
                                 "another tokenizer?")
            out.append(j)
        return out

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        return self.hf.decode(self._ids(ids), skip_special_tokens=skip_special)

    def decode_batch(self, batch: Iterable[Iterable[int]], *, skip_special: bool = False) -> list[str]:
        return self.hf.decode_batch([self._ids(ids) for ids in batch], skip_special_tokens=skip_special)

    def id_to_token(self, i: int) -> str | None:
        return self.hf.id_to_token(self._ids([i])[0])

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def bytes_per_token(self, texts: Iterable[str] | str) -> float:
        """UTF-8 bytes per token over `texts` (the compression ratio; higher is better)."""
        if isinstance(texts, str):
            texts = [texts]
        texts = list(texts)
        n_bytes = sum(len(t.encode("utf-8")) for t in texts)
        n_tokens = sum(len(ids) for ids in self.encode_batch(texts, allow_special=False))
        if n_tokens == 0:
            raise ValueError("bytes_per_token needs non-empty text")
        return n_bytes / n_tokens

    def save(self, path: str | os.PathLike) -> Path:
        """Write `tokenizer.json` atomically (`path` may be a directory or a file name)."""
        path = Path(path)
        if path.suffix != ".json":
            path = path / TOKENIZER_FILE
        atomic_write_text(path, self.hf.to_str(pretty=True))
        self.path = path
        return path

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, path={str(self.path) if self.path else None!r})"


def _ids(hf, texts: list[str]) -> list[list[int]]:
    fast = getattr(hf, "encode_batch_fast", hf.encode_batch)  # no offsets: faster where available
    return [e.ids for e in fast(texts, add_special_tokens=False)]


SETTINGS_FILE = "tokenizer.settings.json"  # beside a tokenizer built from settings: what it was built from


def reuse_built_tokenizer(tok_path: str | os.PathLike, want: dict, overwrite: bool, fix: str,
                          warn_unrecorded: bool = True) -> bool:
    """Whether the tokenizer at `tok_path` is to be loaded as it is: True when it exists and was built with `want`
    (the settings recorded beside it) or no settings were recorded (an older one, or one given as a file); False
    when it has to be built (none there, or other settings and `overwrite`). Other settings without `overwrite`
    raise ValueError naming them, then `fix`. A new build is saved with its settings by `install_tokenizer`."""
    tok_path = Path(tok_path)
    settings = tok_path.parent / SETTINGS_FILE
    if not tok_path.is_file():
        return False
    if not settings.is_file():
        if warn_unrecorded:
            log.warning("reusing %s, whose settings were not recorded", tok_path)
        return True
    have = loads_json(settings.read_text())
    if have == want:
        return True
    if overwrite:
        return False
    diff = ", ".join(f"{k} {have.get(k)!r} (asked: {v!r})" for k, v in want.items() if have.get(k) != v)
    raise ValueError(f"{tok_path} was built with other settings: {diff}. {fix}")


def record_tokenizer_settings(tok_path: str | os.PathLike, want: dict) -> None:
    import json

    atomic_write_text(Path(tok_path).parent / SETTINGS_FILE, json.dumps(want, indent=1) + "\n")


def install_tokenizer(tok: "Tokenizer", tok_path: str | os.PathLike, settings: dict | None) -> None:
    """Save `tok` at `tok_path` with the settings it was built from recorded beside it (None: a tokenizer given as
    a file, whose record is removed). In this order, a process killed at any point leaves either no tokenizer
    (the next run builds it again) or the tokenizer beside its own record: written the other way round, a kill
    between the two files left a new tokenizer with no record (reused from then on whatever the flags asked) or
    beside the previous one's."""
    tok_path = Path(tok_path)
    tok_path.unlink(missing_ok=True)
    if settings is None:
        (tok_path.parent / SETTINGS_FILE).unlink(missing_ok=True)
    else:
        record_tokenizer_settings(tok_path, settings)
    tok.save(tok_path)


LONG_LINE = 10_000  # characters: the BPE trainer's time grows with the square of one unbroken run's length


def _cut_long_lines(text: str) -> Iterator[str]:
    """`text` for the tokenizer trainer, with any line longer than LONG_LINE cut into pieces of that length (one
    unbroken line of a few hundred thousand characters stalls the trainer for minutes). Text without such lines
    passes unchanged."""
    if len(text) <= LONG_LINE or all(len(line) <= LONG_LINE for line in text.split("\n")):
        yield text
        return
    kept: list[str] = []
    for line in text.split("\n"):
        if len(line) <= LONG_LINE:
            kept.append(line)
            continue
        if kept:
            yield "\n".join(kept) + "\n"
            kept = []
        for i in range(0, len(line), LONG_LINE):
            yield line[i:i + LONG_LINE]
    if kept:
        yield "\n".join(kept)


def _texts(documents: Iterable) -> Iterator[str]:
    for d in documents:
        yield d if isinstance(d, str) else d[1]


def check_vocab_size(vocab_size) -> None:
    """A vocabulary size a tokenizer can be trained to (ValueError naming --vocab-size otherwise); commands call it
    before the work that precedes training the tokenizer."""
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size = {vocab_size!r} is too small: byte-level BPE needs {N_BYTES} byte tokens + "
                         f"{len(SPECIAL_TOKENS)} special tokens = {MIN_VOCAB_SIZE}; use --vocab-size >= "
                         f"{MIN_VOCAB_SIZE} (e.g. 8192)")
    if vocab_size > MAX_VOCAB_SIZE:
        raise ValueError(f"vocab_size = {vocab_size:,} is too large: at most {MAX_VOCAB_SIZE:,} (K3's vocabulary is "
                         "163,840); the trainer would allocate memory for every entry up front")


def train_tokenizer(documents: Iterable, vocab_size: int = DEFAULT_VOCAB_SIZE, *,
                    path: str | os.PathLike | None = None, min_frequency: int = 2,
                    allow_short: bool = False, progress: bool = False) -> Tokenizer:
    """Train byte-level BPE on `documents` (strings or `(doc_id, text)` pairs) and optionally save it.

    The caller bounds the time by bounding the text (e.g. `corpus.documents(max_bytes=...)`). If the text
    cannot support `vocab_size` tokens (too few distinct pairs seen `min_frequency` times), the trainer stops
    short: that is an error unless `allow_short`, in which case it is logged and the smaller vocab kept.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    check_vocab_size(vocab_size)
    # the format tokens are reserved whenever the vocabulary has room (all but the 4 smallest sizes)
    reserved = RESERVED_TOKENS if vocab_size >= N_BYTES + len(RESERVED_TOKENS) else SPECIAL_TOKENS
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, show_progress=progress,
        special_tokens=list(reserved), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    n_bytes = 0

    def counted() -> Iterator[str]:
        nonlocal n_bytes
        for t in _texts(documents):
            n_bytes += len(t.encode("utf-8"))
            yield from _cut_long_lines(t)

    hf.train_from_iterator(counted(), trainer=trainer)
    if n_bytes == 0:
        raise ValueError("cannot train a tokenizer on an empty corpus; check --data")
    tok = Tokenizer(hf)
    tok.trained_bytes = n_bytes
    got = tok.vocab_size
    if got < vocab_size:
        msg = (f"the training text ({n_bytes:,} bytes) supports only {got} tokens, fewer than vocab_size = "
               f"{vocab_size}: lower --vocab-size to {got} or less, or give more text (--data, --max-bytes, --tokenizer-max-bytes)")
        if not allow_short:
            raise ValueError(msg)
        log.warning("%s; keeping %d tokens", msg, got)
    log.info("trained byte-level BPE: %d tokens from %s bytes", got, f"{n_bytes:,}")
    if path is not None:
        tok.save(path)
    return tok


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load a k3 tokenizer from `tokenizer.json` or a directory containing one."""
    from tokenizers import Tokenizer as HFTokenizer

    path = Path(path)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise ValueError(f"no tokenizer at {path}; build one with `k3 tokenize --out {path.parent}`")
    try:
        hf = HFTokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception on malformed JSON
        raise ValueError(f"{path} is not a valid tokenizer.json ({err}); rebuild it with `k3 tokenize`") from None
    return Tokenizer(hf, path)
