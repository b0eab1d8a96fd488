"""Atomic file writes: readers see the old file or the new one, never a partial one.

Every file k3 writes (tokenizers, datasets, checkpoints, metrics, plots, tasks, benchmark results)
goes through `atomic_open`: a temporary file beside the target, fsync, `os.replace`, then an fsync of
the directory so the rename itself survives a crash. On any error the temporary file is removed and the
target is left as it was. A process killed in between (SIGKILL, power loss) leaves its temporary file,
named `.TARGET.PID-*.tmp`; the next write of the same target removes those of processes that are gone.

JSON that a user, a checkpoint or an agent supplies is read with `loads_json` / `read_json`, which refuse absurd
nesting with an error message instead of a RecursionError.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
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


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, owned by someone else
        return True
    return True


def writer_pid(name: str, prefix: str) -> int | None:
    """The process id a temporary's name carries after `prefix` (`PREFIX<pid>-...`); None when it carries none."""
    pid = name[len(prefix):].split("-", 1)[0] if name.startswith(prefix) else ""
    return int(pid) if pid.isdigit() else None


def remove_stale_temporaries(path: str | os.PathLike) -> None:
    """Remove the temporary files that writers of `path` killed before their rename left beside it (their process
    is gone); those of a live process, this one included, are its writes in progress."""
    path = Path(path)
    prefix = f".{path.name}."
    try:
        names = [n for n in os.listdir(path.parent) if n.startswith(prefix) and n.endswith(".tmp")]
    except OSError:
        return
    for name in names:
        pid = writer_pid(name, prefix)
        if pid is not None and pid != os.getpid() and not pid_alive(pid):
            with contextlib.suppress(OSError):
                os.unlink(path.parent / name)


def temp_prefix(path: Path) -> str:
    """The name prefix of a temporary file beside `path`: it names this process, so a leftover can be told from a
    write in progress (`remove_stale_temporaries`)."""
    return f".{path.name}.{os.getpid()}-"


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary file beside `path` for writing; on a clean exit it replaces `path`."""
    assert "w" in mode, f"atomic_open writes whole files; mode {mode!r} must contain 'w'"
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=temp_prefix(path), suffix=".tmp")
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


@contextlib.contextmanager
def atomic_dir(out: str | os.PathLike) -> Iterator[Path]:
    """A fresh folder beside `out` (`.OUT.tmp-PID-*`) to write into; when the block ends without an error its files
    get open()'s mode and it takes `out`'s place (an earlier `out` is moved aside to `.OUT.old-PID-*`, then
    removed), so `out` is always the old folder or the complete new one. On an error the new folder is removed."""
    import shutil
    import uuid

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    old = None
    try:
        yield tmp
        for f in tmp.iterdir():  # safetensors creates its files 0600
            if f.is_file():
                default_mode(f)
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            os.rename(out, old)
        os.rename(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------- bounded JSON reads
# json.loads recurses once per nesting level: a file (a manifest, a config, a task, an agent's workspace) a few
# thousand levels deep raised RecursionError, a traceback instead of an error message. No honest file comes near
# this depth; the deepest report the sandbox sends (64 Python levels, each up to 3 JSON ones) stays below it.
MAX_JSON_DEPTH = 256
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_JSON_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')
_NOT_BRACKET = re.compile(r'[^\[\]{}]+')
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


class JSONTooDeep(json.JSONDecodeError):
    """JSON nested deeper than the limit. A JSONDecodeError (so a ValueError): every reader that names a file that
    is not valid JSON names this one the same way."""


def json_depth_error(text: str, max_depth: int = MAX_JSON_DEPTH) -> JSONTooDeep | None:
    """The error for `text` if its arrays and objects nest deeper than `max_depth`, else None; linear time."""
    if text.count("[") + text.count("{") <= max_depth:  # most documents: no scan at all
        return None
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    if max(itertools.accumulate(map(_STEP.__getitem__, brackets)), default=0) <= max_depth:
        return None
    depth = 0
    for m in _JSON_TOKEN.finditer(text):  # only for the error: where the limit was passed
        depth += _STEP.get(m.group(), 0)
        if depth > max_depth:
            return JSONTooDeep(f"nested deeper than {max_depth} levels (arrays/objects within each other)",
                               text, m.start())
    return None


def loads_json(data: str | bytes, max_depth: int = MAX_JSON_DEPTH):
    """json.loads that refuses nesting deeper than `max_depth` with JSONTooDeep (a json.JSONDecodeError) instead of
    recursing into a RecursionError."""
    text = data.decode(json.detect_encoding(data), "surrogatepass") if isinstance(data, (bytes, bytearray)) else data
    err = json_depth_error(text, max_depth)
    if err is not None:
        raise err
    return json.loads(text)


def read_json(path: str | os.PathLike, what: str = "file", max_depth: int = MAX_JSON_DEPTH):
    """The JSON value in `path`; a file that cannot be read or is not (bounded) JSON is a one-line ValueError."""
    try:
        return loads_json(Path(path).read_bytes(), max_depth)
    except OSError as e:
        raise ValueError(f"{path}: cannot read the {what} ({e.strerror or e})") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path}: the {what} is not valid JSON ({e})") from None
