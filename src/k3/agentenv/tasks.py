"""Tasks: a directory per task with a manifest, the agent's starting files, and hidden checks.

Layout (format `k3-agentenv-task/1`; see docs/agentenv.md):

    <task_id>/
      task.json            manifest: id, family, title, instruction, workspace file list with
                           sha256/size/mode, generated files, the public index of checks (id, kind,
                           label), limits, hidden file list, and `checksum` over all of it
      workspace/...        the files copied into the agent's sandbox
      setup/...            inputs for generated workspace files (e.g. `app.sql` -> `app.db`)
      hidden/checks.json   the checks with their expectations — never enters any sandbox as a whole
      hidden/solution.json a reference solution as abstract actions (used by tests and red team)

`checksum` is the sha256 of the canonical JSON of task.json without the `checksum` key; since the
manifest lists the sha256 of every file, it covers the whole task.
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import posixpath
import sqlite3
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from k3.fileio import atomic_write_bytes, loads_json

FORMAT = "k3-agentenv-task/1"
FAMILIES = ("pyfix", "sqlite", "files")
CHECK_KINDS = {
    # kind: (runs where, required fields in hidden/checks.json besides id/kind)
    "python": ("sandbox", ("code", "expect")),
    "sql": ("sandbox", ("db", "sql", "expect")),
    "sql_schema": ("sandbox", ("db", "expect")),
    "command": ("sandbox", ("argv", "expect")),
    "file": ("host", ("path", "expect")),
    "absent": ("host", ("path",)),
    "json_file": ("host", ("path", "expect")),
    "tree": ("host", ("path", "expect")),
    "executable": ("host", ("path",)),
}
SQL_KINDS = ("table", "virtual table", "view", "index", "trigger")  # the schema objects sql_schema tells apart
LABELS = ("F2P", "P2P")  # fails before the fix and must pass after / passes before and must still pass
ACTION_TOOLS = ("read", "write", "edit", "run", "search", "finish")


def tasks_root() -> Path:
    return Path(__file__).resolve().parent / "tasks"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def compute_checksum(manifest: dict) -> str:
    return sha256_bytes(canonical({k: v for k, v in manifest.items() if k != "checksum"}))


def check_relpath(p: str, what: str, backslash: bool = False) -> str:
    """A relative, normalized POSIX path with no '..', no leading '/', no NUL. A backslash, an ordinary character in
    a POSIX name, is refused in what a task ships (kept portable) and allowed with `backslash` (a workspace the
    agent wrote, where a solved task with a file named 'x\\y' was a sandbox error, not a verified episode)."""
    if (not isinstance(p, str) or not p or "\x00" in p or p.startswith("/") or ("\\" in p and not backslash)
            or posixpath.normpath(p) != p or p == "." or p.split("/")[0] == ".."):
        raise ValueError(f"{what}: {p!r} is not a clean relative path (no '..', no leading '/')")
    return p


@dataclass(frozen=True)
class Task:
    id: str
    family: str
    title: str
    instruction: str
    root: Path
    manifest: dict = field(repr=False)
    checks: tuple = field(repr=False)
    solution: tuple = field(repr=False)

    @property
    def checksum(self) -> str:
        return self.manifest["checksum"]

    @property
    def max_steps(self) -> int:
        return int(self.manifest.get("limits", {}).get("max_steps", 30))

    def workspace_files(self) -> dict[str, tuple[bytes, int]]:
        """The starting workspace: shipped files (checked against the manifest) + generated ones."""
        out: dict[str, tuple[bytes, int]] = {}
        ws = self.manifest["workspace"]
        for rel, meta in ws["files"].items():
            data = (self.root / "workspace" / rel).read_bytes()
            if sha256_bytes(data) != meta["sha256"]:
                raise ValueError(f"task {self.id}: workspace/{rel} changed since the manifest was "
                                 "written (sha256 mismatch); regenerate the task with "
                                 "`k3 agentenv tasks --rebuild`")
            out[rel] = (data, int(meta.get("mode", 0o644)))
        for rel, gen in ws.get("generate", {}).items():
            script = (self.root / gen["sqlite_script"]).read_text()
            out[rel] = (build_sqlite(script), 0o644)
        return out


def build_sqlite(script: str) -> bytes:
    """Database bytes from an SQL script (trusted task data), built in memory."""
    conn = sqlite3.connect(":memory:")
    try:
        conn.executescript(script)
        conn.commit()
        if hasattr(conn, "serialize"):
            return conn.serialize()
    finally:
        conn.close()
    with tempfile.TemporaryDirectory(prefix="k3-task-db-") as d:  # python without serialize()
        path = os.path.join(d, "db")
        c = sqlite3.connect(path)
        c.executescript(script)
        c.commit()
        c.close()
        return Path(path).read_bytes()


def _listing(base: Path) -> set[str]:
    if not base.exists():
        return set()
    out = set()
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for f in filenames:
            if f.endswith(".pyc"):
                continue
            out.add(Path(dirpath, f).relative_to(base).as_posix())
    return out


def _validate_check(task_id: str, c: dict) -> None:
    if not isinstance(c, dict) or not isinstance(c.get("id"), str) or not c["id"]:
        raise ValueError(f"task {task_id}: every check in hidden/checks.json must be an object with a non-empty "
                         f"string id, got {c!r:.80}")
    where = f"task {task_id}: check {c['id']!r}"
    kind = c.get("kind")
    if kind not in CHECK_KINDS:
        raise ValueError(f"{where}: unknown kind {kind!r}; known kinds: {sorted(CHECK_KINDS)}")
    missing = [f for f in CHECK_KINDS[kind][1] if f not in c]
    if missing:
        raise ValueError(f"{where}: kind {kind} needs field(s) {missing}")
    if c.get("label") not in (None,) + LABELS:
        raise ValueError(f"{where}: label must be one of {LABELS}, got {c.get('label')!r}")
    for key in ("path", "db"):
        if key in c:
            check_relpath(c[key], f"{where}: {key}")
    exp = c.get("expect")
    if kind == "python" and not (isinstance(exp, dict) and len({"value", "raises"} & set(exp)) == 1):
        raise ValueError(f"{where}: python expect needs exactly one of 'value' or 'raises'")
    if kind == "sql" and not (isinstance(exp, dict) and isinstance(exp.get("rows"), list)):
        raise ValueError(f"{where}: sql expect needs 'rows' (a list)")
    if kind == "sql_schema":
        forbid = exp.get("forbid", []) if isinstance(exp, dict) else None
        if not (isinstance(forbid, list) and all(isinstance(k, str) and k.lower() in SQL_KINDS for k in forbid)):
            raise ValueError(f"{where}: sql_schema expect 'forbid' must list kinds of schema object, of {SQL_KINDS}")
    if kind == "command":
        if not (isinstance(c["argv"], list) and c["argv"] and all(isinstance(a, str) for a in c["argv"])):
            raise ValueError(f"{where}: argv must be a non-empty list of strings")
        if not (isinstance(exp, dict) and isinstance(exp.get("stdout"), str)):
            raise ValueError(f"{where}: command expect needs 'stdout' (a string)")
    if kind == "file" and not (isinstance(exp, dict) and isinstance(exp.get("sha256"), str)):
        raise ValueError(f"{where}: file expect needs 'sha256'")
    if kind == "tree" and not (isinstance(exp, dict) and isinstance(exp.get("files"), list)):
        raise ValueError(f"{where}: tree expect needs 'files' (a list of paths)")


def _validate_action(task_id: str, a) -> None:
    if not isinstance(a, dict) or a.get("tool") not in ACTION_TOOLS:
        raise ValueError(f"task {task_id}: hidden/solution.json has an action that is not one of "
                         f"{ACTION_TOOLS}: {a!r}")


def _json_object(path: Path, what: str) -> dict:
    """The JSON object in `path`; a file that cannot be read, is not JSON or holds another value is named."""
    try:
        obj = loads_json(path.read_text(encoding="utf-8"))  # refuses absurd nesting (a RecursionError before)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: {what} is not readable JSON ({e}); fix it or regenerate the task") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: {what} must be a JSON object, got {type(obj).__name__}")
    return obj


def _check_shapes(mpath: Path, m: dict) -> None:
    """task.json's nested fields have the types the loader and the runner read (a list where an object belongs
    was an AttributeError traceback; a non-integer max_steps or file mode failed only when the task ran)."""
    def need(ok: bool, field: str, want: str) -> None:
        if not ok:
            raise ValueError(f"{mpath}: {field} must be {want}; compare with a shipped task (docs/agentenv.md)")

    ws = m["workspace"]
    need(isinstance(ws, dict), "workspace", "an object with 'files' (and optionally 'generate')")
    for key in ("files", "generate"):
        entries = ws.get(key, {})
        need(isinstance(entries, dict) and all(isinstance(v, dict) for v in entries.values()),
             f"workspace.{key}", "an object of path -> object")
    for rel, meta in ws.get("files", {}).items():
        mode = meta.get("mode", 0o644)
        need(isinstance(mode, int) and not isinstance(mode, bool) and 0 <= mode <= 0o7777,
             f"workspace.files[{rel!r}].mode", "an integer file mode such as 420 (0o644)")
    need(isinstance(m["hidden"], dict) and all(isinstance(v, dict) for v in m["hidden"].values()), "hidden",
         "an object of path -> {'sha256': ...}")
    need(isinstance(m["verifier"], dict), "verifier", "an object with 'checks'")
    limits = m.get("limits", {})
    need(isinstance(limits, dict), "limits", "an object")
    steps = limits.get("max_steps", 30)
    need(isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1, "limits.max_steps",
         "a positive integer")


def load_task(path: str | os.PathLike) -> Task:
    """Load and validate one task directory; every problem is a ValueError naming the file and the fix."""
    try:
        return _load_task(Path(path))
    except (AttributeError, TypeError, KeyError) as e:  # a shape no check above foresaw: still name the task
        raise ValueError(f"{path}: the task's files are malformed ({type(e).__name__}: {e}); compare with a "
                         "shipped task (`k3 agentenv tasks --rebuild --dir DIR` writes them) and docs/agentenv.md") from None


def _load_task(root: Path) -> Task:
    mpath = root / "task.json"
    if not mpath.is_file():
        raise ValueError(f"{root}: no task.json — a task directory needs task.json, workspace/ "
                         "and hidden/checks.json (see docs/agentenv.md)")
    m = _json_object(mpath, "task.json")
    if m.get("format") != FORMAT:
        raise ValueError(f"{mpath}: format is {m.get('format')!r}, expected {FORMAT!r}")
    tid = m.get("id")
    for key in ("id", "family", "title", "instruction", "workspace", "verifier", "hidden", "checksum"):
        if key not in m:
            raise ValueError(f"{mpath}: missing key {key!r}")
    _check_shapes(mpath, m)
    if tid != root.name:
        raise ValueError(f"{mpath}: id {tid!r} does not match the directory name {root.name!r}")
    if m["family"] not in FAMILIES:
        raise ValueError(f"task {tid}: family {m['family']!r} is not one of {FAMILIES}")
    if not str(m["instruction"]).strip():
        raise ValueError(f"task {tid}: the instruction is empty")
    got = compute_checksum(m)
    if got != m["checksum"]:
        raise ValueError(f"task {tid}: checksum mismatch (manifest says {m['checksum'][:12]}…, "
                         f"content hashes to {got[:12]}…); the task was edited by hand or corrupted — "
                         "regenerate it with `k3 agentenv tasks --rebuild`")
    # every listed file exists with the listed hash; no unlisted files
    ws = m["workspace"]
    listed = set(ws.get("files", {}))
    present = _listing(root / "workspace")
    if listed != present:
        raise ValueError(f"task {tid}: workspace/ and task.json disagree — unlisted: "
                         f"{sorted(present - listed)}, missing: {sorted(listed - present)}")
    for rel, meta in ws["files"].items():
        check_relpath(rel, f"task {tid}: workspace file")
        data = (root / "workspace" / rel).read_bytes()
        if sha256_bytes(data) != meta.get("sha256") or len(data) != meta.get("size"):
            raise ValueError(f"task {tid}: workspace/{rel} does not match its sha256/size in "
                             "task.json; regenerate the task")
    hidden_listed = set(m["hidden"])
    hidden_present = {f"hidden/{p}" for p in _listing(root / "hidden")} | \
                     {f"setup/{p}" for p in _listing(root / "setup")}
    if hidden_listed != hidden_present:
        raise ValueError(f"task {tid}: hidden/ and setup/ disagree with task.json — unlisted: "
                         f"{sorted(hidden_present - hidden_listed)}, missing: "
                         f"{sorted(hidden_listed - hidden_present)}")
    for rel, meta in m["hidden"].items():
        if sha256_bytes((root / rel).read_bytes()) != meta.get("sha256"):
            raise ValueError(f"task {tid}: {rel} does not match its sha256 in task.json; "
                             "regenerate the task")
    for rel, gen in ws.get("generate", {}).items():
        check_relpath(rel, f"task {tid}: generated file")
        if gen.get("sqlite_script") not in m["hidden"]:
            raise ValueError(f"task {tid}: generated {rel} needs a listed setup script")
        if rel in listed:
            raise ValueError(f"task {tid}: {rel} is both shipped and generated")
    if "hidden/checks.json" not in m["hidden"]:
        raise ValueError(f"task {tid}: hidden/checks.json is missing — a task without hidden "
                         "checks cannot be verified")
    checks = _json_object(root / "hidden/checks.json", "hidden/checks.json").get("checks")
    if not isinstance(checks, list) or not checks:
        raise ValueError(f"task {tid}: hidden/checks.json has no checks")
    for c in checks:
        _validate_check(tid, c)
    ids = [c["id"] for c in checks]
    if len(set(ids)) != len(ids):
        raise ValueError(f"task {tid}: duplicate check ids in hidden/checks.json")
    public = m["verifier"].get("checks")
    if public != [{"id": c["id"], "kind": c["kind"], "label": c.get("label")} for c in checks]:
        raise ValueError(f"task {tid}: the verifier spec in task.json does not list exactly the "
                         "checks in hidden/checks.json (same ids, kinds, labels, order)")
    files = set(listed) | set(ws.get("generate", {}))
    for c in checks:
        if c["kind"] in ("sql", "sql_schema") and c["db"] not in files:
            raise ValueError(f"task {tid}: check {c['id']} queries {c['db']}, which is not a "
                             "workspace file")
    solution: list = []
    if "hidden/solution.json" in m["hidden"]:
        solution = _json_object(root / "hidden/solution.json", "hidden/solution.json").get("actions", [])
        if not isinstance(solution, list):
            raise ValueError(f"task {tid}: hidden/solution.json's actions must be a list")
        for a in solution:
            _validate_action(tid, a)
    return Task(id=tid, family=m["family"], title=m["title"], instruction=m["instruction"],
                root=root, manifest=m, checks=tuple(checks), solution=tuple(solution))


def discover(root: str | os.PathLike | None = None) -> list[Path]:
    base = Path(root) if root else tasks_root()
    if base.exists() and not base.is_dir():
        raise ValueError(f"task directory {base} is a file, not a directory; pass the directory that holds the tasks")
    if not base.is_dir():
        raise ValueError(f"task directory {base} does not exist; pass the directory that holds the tasks, or "
                         f"write the shipped tasks there with `k3 agentenv tasks --rebuild --dir {base}`")
    found = sorted(p for p in base.iterdir() if p.is_dir() and (p / "task.json").exists())
    if not found:
        raise ValueError(f"task directory {base} holds no tasks (no subdirectory with a task.json); write the "
                         f"shipped tasks there with `k3 agentenv tasks --rebuild --dir {base}`, or pass another one")
    return found


def load_tasks(selector: str | list[str] = "all", root: str | os.PathLike | None = None) -> list[Task]:
    """Tasks matching a selector: 'all', family names, task ids or globs, comma-separated."""
    if isinstance(selector, str):
        selector = [s.strip() for s in selector.split(",") if s.strip()]
    dirs = discover(root)
    chosen: list[Path] = []
    for sel in selector or ["all"]:
        if os.path.sep in sel and Path(sel).is_dir():
            hits = [Path(sel)] if (Path(sel) / "task.json").exists() else discover(sel)
        elif sel == "all":
            hits = dirs
        elif sel in FAMILIES:
            hits = [d for d in dirs if _json_object(d / "task.json", "task.json").get("family") == sel]
        else:
            hits = [d for d in dirs if fnmatch.fnmatch(d.name, sel)]
        if not hits:
            raise ValueError(f"no task matches {sel!r}; use 'all', a family ({', '.join(FAMILIES)}), "
                             "a task id or a glob (see `k3 agentenv tasks`)")
        chosen += [h for h in hits if h not in chosen]
    return [load_task(d) for d in chosen]


def write_task(out_dir: str | os.PathLike, *, id: str, family: str, title: str, instruction: str,
               workspace: dict[str, str | bytes | tuple], checks: list[dict],
               solution: list[dict], generate: dict[str, str] | None = None,
               limits: dict | None = None) -> Path:
    """Write a task directory with its manifest and checksum (files are written atomically).

    workspace: path -> text | bytes | (text|bytes, mode). generate: path -> SQL script text (stored
    as setup/<path without its suffix>.sql and built into the database when an episode starts).
    """
    root = Path(out_dir) / id
    files: dict[str, dict] = {}
    for rel, spec in sorted(workspace.items()):
        check_relpath(rel, f"task {id}: workspace file")
        data, mode = (spec if isinstance(spec, tuple) else (spec, 0o644))
        data = data.encode() if isinstance(data, str) else data
        atomic_write_bytes(root / "workspace" / rel, data)
        files[rel] = {"sha256": sha256_bytes(data), "size": len(data), "mode": mode}
    hidden: dict[str, dict] = {}
    gen_spec = {}
    for rel, script in sorted((generate or {}).items()):
        # the database's own path with .sql: two databases of one name in different folders keep their own scripts
        setup_rel = f"setup/{posixpath.splitext(rel)[0]}.sql"
        atomic_write_bytes(root / setup_rel, script.encode())
        hidden[setup_rel] = {"sha256": sha256_bytes(script.encode())}
        gen_spec[rel] = {"sqlite_script": setup_rel}
    for rel, obj in (("hidden/checks.json", {"checks": checks}),
                     ("hidden/solution.json", {"actions": solution})):
        data = json.dumps(obj, indent=1, sort_keys=True, ensure_ascii=False).encode() + b"\n"
        atomic_write_bytes(root / rel, data)
        hidden[rel] = {"sha256": sha256_bytes(data)}
    manifest = {
        "format": FORMAT, "id": id, "family": family, "title": title, "instruction": instruction,
        "workspace": {"files": files, "generate": gen_spec},
        "verifier": {"checks": [{"id": c["id"], "kind": c["kind"], "label": c.get("label")}
                                for c in checks]},
        "hidden": hidden, "limits": limits or {"max_steps": 30},
    }
    manifest["checksum"] = compute_checksum(manifest)
    atomic_write_bytes(root / "task.json",
                  json.dumps(manifest, indent=1, sort_keys=True, ensure_ascii=False).encode() + b"\n")
    return root

