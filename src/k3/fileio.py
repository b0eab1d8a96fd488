"""Atomic file writes: readers see the old file or the new one, never a partial one.

Every file k3 writes (tokenizers, datasets, checkpoints, metrics, plots, tasks, benchmark results)
goes through `atomic_open`: a temporary file beside the target, fsync, `os.replace`, then an fsync of
the directory so the rename itself survives a crash. On any error the temporary file is removed and the
target is left as it was.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import IO, Iterator

_UMASK = os.umask(0o022)
os.umask(_UMASK)


def default_mode(path: str | os.PathLike) -> None:
    """Give a file written by a library that creates it owner-only (safetensors makes 0600) the mode open()
    would have: 0666 less the umask."""
    os.chmod(path, 0o666 & ~_UMASK)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename inside `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary file beside `path` for writing; on a clean exit it replaces `path`."""
    if "w" not in mode:
        raise ValueError(f"atomic_open writes whole files; mode {mode!r} must contain 'w'")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        default_mode(tmp)  # mkstemp makes 0600; give the file the mode open() would
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_open(path, "w") as f:
        f.write(text)


def atomic_write_json(path: str | os.PathLike, obj, indent: int = 2) -> None:
    atomic_write_text(path, json.dumps(obj, indent=indent) + "\n")
