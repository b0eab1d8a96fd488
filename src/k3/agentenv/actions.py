"""The one action set every dialect maps to: read, write, edit, run, search, finish."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from .sandbox import Session

# tool -> {arg: (type, required)}
ACTIONS: dict[str, dict[str, tuple[type | tuple, bool]]] = {
    "read": {"path": (str, True), "offset": (int, False), "limit": (int, False)},
    "write": {"path": (str, True), "content": (str, True)},
    "edit": {"path": (str, True), "old": (str, True), "new": (str, True), "replace_all": (bool, False)},
    "run": {"command": (str, True), "timeout": ((int, float), False)},
    "search": {"pattern": (str, True), "path": (str, False), "glob": (str, False)},
    "finish": {"summary": (str, False)},
}
DESCRIPTIONS = {
    "read": "Read a text file in the workspace; returns numbered lines.",
    "write": "Create or overwrite a file in the workspace with the given content.",
    "edit": "Replace an exact, unique occurrence of old text with new text in a file.",
    "run": "Run a bash command in /workspace (no network); returns exit code and output.",
    "search": "Search files for a regular expression; returns path:line:text matches.",
    "finish": "Finish the task. Call this once the work is done; hidden tests run afterwards.",
}
ARG_DESCRIPTIONS = {
    "path": "file path, relative to /workspace or absolute inside it",
    "offset": "first line to return (1-based)", "limit": "number of lines to return",
    "content": "the complete new file content", "old": "exact text to replace",
    "new": "replacement text", "replace_all": "replace every occurrence (default false)",
    "command": "bash command line", "timeout": "timeout in seconds",
    "pattern": "regular expression (Python syntax)", "glob": "only files whose name matches",
    "summary": "one line on what was done",
}


class ActionError(ValueError):
    """A tool call the policy got wrong; the message goes back to the policy."""


@dataclass(frozen=True)
class Action:
    tool: str
    args: dict = field(default_factory=dict)
    # how the policy named the call that gave this action (a dialect's own call id or tool, e.g. kimi's
    # "functions.Shell:5" or codex's apply_patch for a deleted file), so its result can answer to that name;
    # not part of what the action does, so not compared
    call: str | None = field(default=None, compare=False)

    def to_json(self) -> dict:
        return {"tool": self.tool, **self.args}


def _finite(v) -> bool:
    try:
        return math.isfinite(v)
    except OverflowError:  # an integer too large for a float
        return False


def make_action(tool: str, args: dict) -> Action:
    if tool not in ACTIONS:
        raise ActionError(f"unknown action {tool!r}")
    if not isinstance(args, dict):
        raise ActionError(f"arguments of {tool} must be an object, got {type(args).__name__}")
    spec = ACTIONS[tool]
    unknown = sorted(set(args) - set(spec))
    if unknown:
        raise ActionError(f"unknown argument(s) {unknown} for {tool}")
    clean = {}
    for name, (typ, required) in spec.items():
        if name not in args or args[name] is None:
            if required:
                raise ActionError(f"missing required argument {name!r} for {tool}")
            continue
        v = args[name]
        if typ is int and isinstance(v, str) and re.fullmatch(r"-?[0-9]{1,18}", v.strip()):  # ASCII digits only
            v = int(v)
        if typ is bool and isinstance(v, str) and v.lower() in ("true", "false"):
            v = v.lower() == "true"
        if typ == (int, float) and isinstance(v, str):
            try:
                v = float(v)
            except ValueError:
                pass
        if isinstance(v, bool) and typ is not bool or not isinstance(v, typ):
            want = typ.__name__ if isinstance(typ, type) else "number"
            raise ActionError(f"argument {name!r} of {tool} must be a {want}, got {type(v).__name__}")
        if typ == (int, float) and not (_finite(v) and v > 0):  # the timeout: NaN or <= 0 would kill
            raise ActionError(f"argument {name!r} of {tool} must be a positive number, got {v!r}")
        if typ is int and v < 1:  # read's first line and line count
            raise ActionError(f"argument {name!r} of {tool} must be >= 1, got {v!r}")
        clean[name] = v
    return Action(tool, clean)


def action_from_json(d: dict) -> Action:
    d = dict(d)
    return make_action(d.pop("tool"), d)


def execute(session: Session, a: Action) -> tuple[bool, str]:
    """Run one non-finish action in the session; returns (ok, observation text)."""
    g = a.args.get
    if a.tool == "read":
        r = session.read(g("path"), g("offset"), g("limit"))
        if not r.get("ok"):
            return False, f"error: {r.get('error')}"
        first = r["first_line"]
        text = "".join(f"{first + i:>6}\t{line}" for i, line in enumerate(r["lines"]))
        total = r["total_lines"]
        if not text:
            return True, ("(empty file)" if total == 0 else
                          f"(no lines in that range: the file has {total} line{'s' if total != 1 else ''})")
        if r.get("cut_line"):
            text += (f"\n[line {r['cut_line']} is cut: one read returns at most the size limit; run a command "
                     "(e.g. cut or head -c) to see the rest of it]")
        if r.get("truncated"):
            nxt = r["last_line"] + 1
            text += (f"\n[lines {first}-{r['last_line']} of {total}" +
                     (f"; read on from line {nxt}]" if nxt <= total else "]"))
        return True, text
    if a.tool == "write":
        r = session.write(g("path"), g("content"))
        return (True, f"wrote {r['bytes']} bytes to {g('path')}") if r.get("ok") else (False, f"error: {r.get('error')}")
    if a.tool == "edit":
        r = session.edit(g("path"), g("old"), g("new"), bool(g("replace_all")))
        return ((True, f"edited {g('path')} ({r['replacements']} replacement(s))") if r.get("ok")
                else (False, f"error: {r.get('error')}"))
    if a.tool == "run":
        r = session.run(g("command"), g("timeout"))
        if not r.get("ok"):
            return False, f"error: {r.get('error')}"
        head = f"exit code: {r['exit_code']}"
        if r.get("timed_out"):
            head += f" (killed: timed out after {r['duration_s']:.1f}s)"
        elif r.get("cpu_limited"):
            head += " (killed: CPU time limit per command reached)"
        return r["exit_code"] == 0 and not r.get("timed_out"), head + "\n" + r["output"]
    if a.tool == "search":
        r = session.search(g("pattern"), g("path"), g("glob"))
        if not r.get("ok"):
            return False, f"error: {r.get('error')}"
        text = "\n".join(r["matches"]) or "no matches"
        if r.get("truncated"):
            text += "\n[more matches not shown]"
        return True, text
    raise ActionError(f"{a.tool} cannot be executed")
