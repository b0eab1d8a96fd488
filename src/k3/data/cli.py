"""`k3 tokenize`: train the tokenizer and pack the train/val token datasets into one directory."""
from __future__ import annotations

import argparse
import re
import sys

_UNITS = {"": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """'20MB' -> 20_000_000, '512KiB' -> 524_288, '1000' -> 1000."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; use e.g. 20MB, 500KB, 1GiB or a byte count")
    n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive size")
    return n


def cmd_tokenize(args: argparse.Namespace) -> int:
    from k3.data.dataset import prepare_data

    files = prepare_data(
        args.out, args.data, vocab_size=args.vocab_size, max_bytes=args.max_bytes,
        tokenizer_max_bytes=args.tokenizer_max_bytes, val_fraction=args.val_fraction,
        progress=not args.quiet and sys.stderr.isatty(), force=args.force, decontaminate=args.decontaminate,
    )
    req, t = files.info.get("request", {}), files.info.get("timings", {})
    print(f"source     {req.get('source', args.data or 'stdlib')}" + ("  (reused, nothing rebuilt)" if files.reused else ""))
    print(f"tokenizer  {files.tokenizer.path}  vocab {files.tokenizer.vocab_size}, trained on "
          f"{files.info.get('tokenizer_bytes', 0):,} bytes in {t.get('tokenizer_s', 0):.1f}s")
    for split, ds in (("train", files.train), ("val", files.val)):
        m = ds.manifest
        print(f"{split:<10} {ds.bin_path}  {ds.n_tokens:,} tokens ({m['dtype']}), {ds.n_docs} docs, "
              f"{m['bytes_per_token']:.2f} bytes/token, built in {t.get(f'{split}_s', 0):.1f}s")
    gone = files.info.get("val_excluded") or []
    if gone:
        print(f"left out  {len(gone)} validation document(s) mostly made of training lines: "
              + ", ".join(f"{e['doc_id']} ({e['overlap']:.0%})" for e in gone[:6]) + (" ..." if len(gone) > 6 else ""))
    return 0


def register(sub) -> None:
    p = sub.add_parser("tokenize", help="train the byte-level BPE tokenizer and pack train/val token datasets",
                       description="Train the tokenizer on the train split and write tokenizer.json, "
                                   "train.bin/val.bin with JSON manifests, and data.json into --out.")
    p.add_argument("--data", metavar="SPEC", default=None,
                   help="a directory (recursive .txt/.md/.py/.jsonl), a quoted glob, or a .jsonl file with a 'text' "
                        "field per line; a single text file is one document, too few to split into train and "
                        "validation (default: the Python standard library sources)")
    p.add_argument("--vocab-size", type=int, default=8192, help="tokenizer vocabulary size (default 8192)")
    p.add_argument("--out", default="runs/data", help="output directory (default runs/data)")
    p.add_argument("--max-bytes", type=parse_bytes, default=None,
                   help="cap on the text read per split, e.g. 5MB (default: no cap)")
    p.add_argument("--tokenizer-max-bytes", type=parse_bytes, default=20_000_000,
                   help="text the tokenizer is trained on: the first N bytes of the train split (default 20MB)")
    p.add_argument("--val-fraction", type=float, default=0.02, help="share of documents held out (default 0.02)")
    p.add_argument("--decontaminate", type=float, default=0.5, metavar="SHARE",
                   help="leave out validation documents whose text is at least this share lines found verbatim in "
                        "the training split (default 0.5; 0 keeps all)")
    p.add_argument("--force", action="store_true",
                   help="rebuild even if --out already holds this data, or replace data of another corpus there")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_tokenize)
