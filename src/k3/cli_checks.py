"""Checks the commands run on their flags before any work, each raising a ValueError that names the flag."""
from __future__ import annotations

import argparse
from pathlib import Path


def at_least(args: argparse.Namespace, low: int, *flags: str) -> None:
    """Each integer --flag given (not None) is >= low."""
    for flag in flags:
        v = getattr(args, flag[2:].replace("-", "_"))
        if v is not None and v < low:
            raise ValueError(f"{flag} {v} must be " + ("a positive integer" if low == 1 else f"an integer >= {low}"))


def _parents_are_dirs(flag: str, path: Path) -> None:
    """The nearest existing parent of `path` is a directory (not a file that the path would have to go under)."""
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{flag} {path}: {parent} is a file, not a directory; give another path")
            break


def output_file(flag: str, path, example: str | None = None) -> None:
    """An output file path (None: not given) that can be written: not a directory, not under a file."""
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        hint = f" such as {p / example}" if example else ""
        raise ValueError(f"{flag} {path} is a directory; give a file path{hint}")
    _parents_are_dirs(flag, p)


PLOT_MAGIC = {".png": b"\x89PNG\r\n\x1a\n", ".svg": b"<", ".pdf": b"%PDF"}  # how each plot file starts
MATPLOTLIB_PLOTS = tuple(PLOT_MAGIC)  # where savefig takes the format from the suffix


def output_png(flag: str, path, example: str = "plot.png", suffixes: tuple[str, ...] = (".png",)) -> None:
    """A plot's path (None: not given): a writable file name with one of `suffixes` (matplotlib takes the format
    from it) that, when it exists, holds a plot of that format to replace, not a file of the user's."""
    if path is None:
        return
    output_file(flag, path, example)
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in suffixes:
        kinds = " or ".join(s[1:].upper() for s in suffixes)
        raise ValueError(f"{flag} {path}: the plot is written as {kinds}; give a file name ending in "
                         f"{' or '.join(suffixes)}")
    if p.is_file():
        with open(p, "rb") as f:
            head = f.read(8).lstrip() if suffix == ".svg" else f.read(8)
        if not head.startswith(PLOT_MAGIC[suffix]):
            raise ValueError(f"{flag} {path} exists and is not a {suffix[1:].upper()} plot; the plot would replace "
                             "it: give another path")


def output_jsonl(flag: str, path, example: str) -> None:
    """A JSON-lines output (None: not given) that, when it exists with content, holds JSON lines to replace, not
    another file of the user's."""
    if path is None:
        return
    output_file(flag, path, example)
    p = Path(path)
    if p.is_file() and p.stat().st_size:
        import json

        with open(p, "rb") as f:
            first = f.readline(1 << 20)
        if len(first) == 1 << 20 and not first.endswith(b"\n"):  # a long first record (a whole transcript)
            ok = first.startswith(b"{")
        else:
            try:
                ok = isinstance(json.loads(first), dict)
            except ValueError:  # JSONDecodeError and bytes that are not UTF-8
                ok = False
        if not ok:
            raise ValueError(f"{flag} {path} exists and does not hold JSON lines; the output would replace it: give "
                             "another path")


def output_dir(flag: str, path) -> None:
    """An output directory path (None: not given) that can be made or used: not a file, not under a file."""
    if path is None:
        return
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{flag} {path} is a file; give a directory")
    _parents_are_dirs(flag, p)


MAX_SEED = 2 ** 62  # room for the offsets added to a seed (seed + step, seed + sample index) below torch's 2^64


def seed(text: str) -> int:
    """argparse type of --seed: an integer in [0, 2^62) (torch.manual_seed overflowed on larger ones, with a message
    that named no flag)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= v < MAX_SEED:
        raise argparse.ArgumentTypeError(f"{v} is outside [0, 2^62): give a seed in that range")
    return v


def as_flags(make, flags: dict[str, str]):
    """make() -> a validated config; its ValueError reworded with the command's flags instead of the config's field
    names (`flags`: field -> flag), so an error names what the user typed."""
    import re

    try:
        return make()
    except ValueError as e:
        msg = str(e)
        for field, flag in flags.items():
            msg = re.sub(rf"\b{field} = ", f"{flag} ", msg)
            if "_" in field or field == "beta":  # identifiers, never words of the message's prose
                msg = re.sub(rf"(?<![\w-]){field}\b", flag, msg)
        raise ValueError(msg) from None
