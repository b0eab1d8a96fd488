"""Physical verification: the reward is the verified outcome of hidden checks, and nothing else.

After an episode its sandbox is torn down (every process in it dies with its PID namespace) and
its final workspace is exported as data. Then:

- host checks (`file`, `absent`, `json_file`, `tree`, `executable`) look at that data directly;
  the host never opens a path the agent controlled, so symlinks lead nowhere;
- sandbox checks (`python`, `sql`, `sql_schema`, `command`) run in a *fresh* sandbox, beside a fresh
  copy of the workspace, through `_probe.py`, which reports observations only.

Expectations never leave this process. Every check must produce an observation (none missing,
skipped or reported twice) and every observation must match exactly (types included) for reward 1.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import math
import posixpath
import time
from dataclasses import dataclass, field
from pathlib import Path

from k3.fileio import loads_json

from .sandbox import (Probe, SandboxConfig, SandboxError, SandboxStartError, SandboxTimeout, default_config,
                      run_probe)
from .tasks import CHECK_KINDS, SQL_KINDS, Task, check_relpath

log = logging.getLogger(__name__)
_HERE = Path(__file__).resolve().parent


@dataclass
class Entry:
    type: str                 # file | dir | symlink | other
    mode: int = 0
    data: bytes = b""
    target: str = ""


COUNTED, EXCLUDED = "counted", "excluded"
# the failures the agent cannot cause; every other outcome, errors included, is a reward that counts
EXCLUSIONS = ("sandbox_start", "host_resources", "verifier_bug")


@dataclass
class VerifyResult:
    reward: float
    passed: bool
    checks: list[dict] = field(default_factory=list)   # {id, kind, label, ok, reason}
    error: str | None = None
    # "start" (the sandbox failed before the workspace reached it), "timeout" (out of time), "sandbox" (it died or
    # answered nonsense) or "verifier" (the host's judging raised)
    error_kind: str | None = None
    duration_s: float = 0.0
    # COUNTED: the reward stands, 0 after any error the workspace may have caused (a kill, a hang, a forged or
    # oversized report); EXCLUDED: it says nothing about the answer, for the reason in `exclusion` (EXCLUSIONS)
    scoring: str = COUNTED
    exclusion: str | None = None
    control: str | None = None  # after an error: what the same checks gave on the task's clean workspace

    def summary(self) -> str:
        bad = [c for c in self.checks if not c["ok"]]
        if self.error:
            return f"error: {self.error}"
        return "all checks passed" if not bad else "; ".join(f"{c['id']}: {c['reason']}" for c in bad[:5])

    def to_json(self) -> dict:
        return {"reward": self.reward, "passed": self.passed, "error": self.error, "error_kind": self.error_kind,
                "scoring": self.scoring, "exclusion": self.exclusion, "control": self.control,
                "duration_s": round(self.duration_s, 4), "checks": self.checks}


def snapshot_from_export(entries: list, max_bytes: int | None = None) -> dict[str, Entry]:
    """Validate an export (untrusted) into {path: Entry}; raises SandboxError on anything odd."""
    out: dict[str, Entry] = {}
    total = 0
    if not isinstance(entries, list):
        raise SandboxError("export is not a list")
    for e in entries:
        if not isinstance(e, dict):
            raise SandboxError("export entry is not an object")
        try:
            path = check_relpath(e.get("path"), "export", backslash=True)
        except ValueError as err:
            raise SandboxError(str(err)) from err
        if path in out:
            raise SandboxError(f"export lists {path!r} twice")
        parent = posixpath.dirname(path)
        if parent and (parent not in out or out[parent].type != "dir"):
            raise SandboxError(f"export entry {path!r} is not under a directory listed before it")
        t = e.get("type")
        if t == "file":
            try:
                data = base64.b64decode(e.get("data", ""), validate=True)
            except (binascii.Error, TypeError) as err:
                raise SandboxError(f"export entry {path!r} has bad data") from err
            total += len(data)
            if max_bytes is not None and total > max_bytes:
                raise SandboxError(f"exported workspace exceeds {max_bytes} bytes")
            out[path] = Entry("file", int(e.get("mode", 0o644)) & 0o7777, data)
        elif t == "dir":
            out[path] = Entry("dir", int(e.get("mode", 0o755)) & 0o7777)
        elif t == "symlink":
            target = e.get("target")
            if not isinstance(target, str) or "\x00" in target or len(target) > 4096:
                raise SandboxError(f"export entry {path!r} has a bad symlink target")
            out[path] = Entry("symlink", target=target)
        elif t == "other":
            out[path] = Entry("other")
        else:
            raise SandboxError(f"export entry {path!r} has unknown type {t!r}")
    return out


def snapshot_from_files(files: dict[str, tuple[bytes, int]]) -> dict[str, Entry]:
    out: dict[str, Entry] = {}
    for rel, (data, mode) in sorted(files.items()):
        parts = rel.split("/")
        for i in range(1, len(parts)):
            out.setdefault("/".join(parts[:i]), Entry("dir", 0o755))
        out[rel] = Entry("file", mode, data)
    return dict(sorted(out.items()))


def export_entries(snap: dict[str, Entry]) -> list[dict]:
    out = []
    for path, e in snap.items():
        d = {"path": path, "type": e.type}
        if e.type == "file":
            d.update(mode=e.mode, data=base64.b64encode(e.data).decode())
        elif e.type == "dir":
            d["mode"] = e.mode
        elif e.type == "symlink":
            d["target"] = e.target
        out.append(d)
    return out


def snapshot_digest(snap: dict[str, Entry]) -> str:
    h = hashlib.sha256()
    for path, e in sorted(snap.items()):
        h.update(json.dumps([path, e.type, e.mode if e.type == "file" else 0, e.target]).encode())
        h.update(hashlib.sha256(e.data).digest())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# comparison


def same(a, b, tol: float = 0.0) -> bool:
    """Structural equality with exact JSON types (True != 1, 1 != 1.0); floats within tol."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        if math.isnan(a) or math.isnan(b):
            return False
        return a == b or (tol > 0 and abs(a - b) <= tol)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y, tol) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k], tol) for k in a)
    return a == b


def _short(v, n=120) -> str:
    s = json.dumps(v, ensure_ascii=False) if not isinstance(v, str) else repr(v)
    return s if len(s) <= n else s[: n - 1] + "…"


def judge_host(c: dict, snap: dict[str, Entry]) -> tuple[bool, str]:
    kind, path = c["kind"], c["path"]
    e = snap.get(path)
    if kind == "absent":
        return (e is None, "ok" if e is None else f"{path} still exists")
    if e is None:
        return False, f"{path} does not exist"
    if kind == "executable":
        ok = e.type == "file" and bool(e.mode & 0o100)
        return ok, "ok" if ok else f"{path} is not an executable regular file"
    if kind == "tree":
        if e.type != "dir":
            return False, f"{path} is not a directory"
        prefix = path + "/"
        got = sorted(p[len(prefix):] for p, x in snap.items()
                     if p.startswith(prefix) and x.type != "dir")
        want = sorted(c["expect"]["files"])
        return (got == want, "ok" if got == want else
                f"files under {path}: got {_short(got)}, expected {_short(want)}")
    if e.type != "file":
        return False, f"{path} is a {e.type}, not a regular file"
    if kind == "file":
        digest = hashlib.sha256(e.data).hexdigest()
        ok = digest == c["expect"]["sha256"]
        return ok, "ok" if ok else f"{path} content differs (sha256 {digest[:12]}…, {len(e.data)} bytes)"
    if kind == "json_file":
        try:  # bounded: a file 100,000 levels deep was a RecursionError in this process
            got = loads_json(e.data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as err:
            return False, f"{path} is not valid JSON ({err})"
        ok = same(got, c["expect"]["value"])
        return ok, "ok" if ok else f"{path} holds {_short(got)}"
    raise AssertionError(kind)


def _fold(name) -> str:
    """SQLite compares identifiers ASCII-case-insensitively ('Orders' is orders); a name the agent wrote into the
    schema by hand may not even be a string."""
    return name.lower() if isinstance(name, str) else repr(name)


def _judge_schema(objects: list, virtual: list, generated: dict, exp: dict) -> tuple[bool, str]:
    """The schema as SQLite loads it: every object's kind comes from its SQL (the runner's sql_kind), which is what
    SQLite executes; the `type` column is a label that `writable_schema` can set to anything, so a label that
    names another kind than the SQL ('table' on a CREATE TRIGGER) is tampering. Kinds and names compare
    case-insensitively ('Trigger' is a trigger)."""
    kinds: list[tuple[str, str]] = []  # (kind, folded name)
    for o in objects:
        if not (isinstance(o, list) and len(o) == 4 and isinstance(o[0], str) and o[3] in SQL_KINDS + (None,)):
            return False, f"schema not reported (object {_short(o)})"
        label, kind = o[0].lower(), o[3]
        if kind is None:  # no CREATE statement (an automatic index): the label is all there is
            kind = label
        elif label != kind.split()[-1]:  # 'virtual table' is labelled 'table'
            return False, f"schema object {_short(o[1])} is labelled {o[0]!r} but its SQL creates a {kind} " \
                          "(a hand-edited schema)"
        kinds.append((kind, _fold(o[1])))
    virtual = {_fold(n) for n in virtual}
    generated = {_fold(n): cols for n, cols in generated.items()}
    for t in exp.get("tables", []):
        found = sorted(k for k, n in kinds if n == _fold(t) and k != "index" and k != "trigger")
        if found != ["table"]:
            return False, f"{t} is {'missing' if not found else 'a ' + ' and a '.join(found)}, not a table"
        if _fold(t) in virtual:
            return False, f"{t} is a virtual table, not a table that stores its rows"
        if generated.get(_fold(t)):
            return False, (f"{t} has generated column(s) {generated[_fold(t)]}: values computed from an expression, "
                           "not stored data")
    forbid = {str(k).lower() for k in exp.get("forbid", [])}
    bad = sorted(f"{k} {n}" for k, n in kinds if k in forbid)
    if bad:
        return False, f"forbidden schema objects present: {bad}"
    return True, "ok"


def judge_observation(c: dict, obs) -> tuple[bool, str]:
    if not isinstance(obs, dict):
        return False, "no observation (the check did not run)"
    if "error" in obs:
        return False, str(obs["error"])[:300]
    kind, exp = c["kind"], c["expect"]
    if kind == "python":
        if obs.get("timeout"):
            return False, "timed out"
        if "raises" in exp:
            mro = obs.get("mro") if isinstance(obs.get("mro"), list) else []
            ok = "raises" in obs and (obs["raises"] == exp["raises"] or exp["raises"] in mro)
            return ok, "ok" if ok else (f"expected {exp['raises']}, got "
                                        + (f"{obs.get('raises')}" if "raises" in obs
                                           else f"value {_short(obs.get('value'))}"))
        if "value" not in obs:
            return False, f"raised {obs.get('raises')}: {str(obs.get('message'))[:200]}"
        ok = same(obs["value"], exp["value"], float(exp.get("tol", 0.0)))
        return ok, "ok" if ok else f"got {_short(obs['value'])}"
    if kind == "sql":
        if "rows" not in obs:
            return False, "query returned no rows field"
        ok = same(obs["rows"], exp["rows"], float(exp.get("tol", 0.0)))
        return ok, "ok" if ok else f"rows differ (got {len(obs['rows'])} rows: {_short(obs['rows'][:3])}…)"
    if kind == "sql_schema":
        objects = obs.get("objects")
        if not isinstance(objects, list):
            return False, "schema not reported"
        if obs.get("integrity") != ["ok"]:
            return False, f"integrity_check failed: {_short(obs.get('integrity'))}"
        virtual = obs.get("virtual_tables")
        generated = obs.get("generated_columns")
        if not isinstance(virtual, list) or not isinstance(generated, dict):
            return False, "schema not reported (virtual tables, generated columns)"
        return _judge_schema(objects, virtual, generated, exp)
    if kind == "command":
        if obs.get("timed_out"):
            return False, "command timed out"
        if obs.get("stdout_truncated"):
            return False, "command output exceeded the cap"
        want_rc = exp.get("exit_code", 0)
        if obs.get("exit_code") != want_rc:
            return False, f"exit code {obs.get('exit_code')}, expected {want_rc}; stderr: " \
                          f"{str(obs.get('stderr', ''))[-200:]!r}"
        got = str(obs.get("stdout", ""))
        ok = got.rstrip("\n") == exp["stdout"].rstrip("\n")
        return ok, "ok" if ok else f"stdout {_short(got)}"
    raise AssertionError(kind)


def _runners() -> dict[str, str]:
    return {"python": (_HERE / "_case_runner.py").read_text(),
            "sql": (_HERE / "_sql_runner.py").read_text()}


def _public(c: dict) -> dict:
    """What of a check may enter the verification sandbox: everything except expectations."""
    ws = c.get("workspace")
    if ws is not None and (not isinstance(ws, str) or not ws or "/" in ws or ws in (".", "..")
                           or ws.startswith(".")):
        raise ValueError(f"check {c.get('id')!r}: workspace {ws!r} must name one top-level directory")
    return {k: v for k, v in c.items() if k not in ("expect", "label", "note")}


def needs_sandbox(task: Task) -> bool:
    return any(CHECK_KINDS[c["kind"]][0] == "sandbox" for c in task.checks)


def control_snapshot(task: Task) -> dict[str, Entry]:
    """The task's clean starting workspace, which no agent touched (empty for a task built in memory)."""
    try:
        return snapshot_from_files(task.workspace_files())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def verify(task: Task, snap: dict[str, Entry], cfg: SandboxConfig | None = None,
           probe: Probe | None = None, control: bool = True) -> VerifyResult:
    """Run every hidden check of `task` against a final workspace snapshot.

    `probe`: a verification sandbox started earlier (see rollout.run_episode); else a new one.

    Fails closed. An error scores 0 and counts: once the workspace is in the sandbox, its code can kill the probe,
    hang it, flood it or forge its reports, and a policy must not learn that breaking verification beats failing
    it. Excluded are only failures the agent cannot cause: a sandbox that fails before the workspace reaches it
    (tried twice; `host_resources` when the host could not start a process), and, with `control`, an error that
    the same checks on the task's clean starting workspace give as well (a bug of ours, `verifier_bug`).
    """
    t0 = time.monotonic()
    cfg = cfg or default_config()
    try:
        res = _verify(task, snap, cfg, probe)
    except Exception as e:  # the host's judging raised on this workspace: an episode, never the run, ends here
        log.warning("verifying %s raised %s: %s", task.id, type(e).__name__, e)
        res = VerifyResult(reward=0.0, passed=False, error=f"the verifier raised {type(e).__name__}: {e}",
                           error_kind="verifier",
                           checks=[{"id": c["id"], "kind": c["kind"], "label": c.get("label"), "ok": False,
                                    "reason": "not judged (the verifier raised)"} for c in task.checks])
    if res.error is not None and res.exclusion is None and control:
        ctl = verify(task, control_snapshot(task), cfg, control=False)
        if ctl.error is not None:
            res.scoring, res.exclusion, res.control = EXCLUDED, "verifier_bug", f"failed too: {ctl.error}"
        else:
            res.control = "clean (the error is this workspace's)"
    res.duration_s = time.monotonic() - t0
    return res


def _verify(task: Task, snap: dict[str, Entry], cfg: SandboxConfig, probe: Probe | None) -> VerifyResult:
    results: dict[str, tuple[bool, str]] = {}
    sandboxed = [c for c in task.checks if CHECK_KINDS[c["kind"]][0] == "sandbox"]
    for c in task.checks:
        if CHECK_KINDS[c["kind"]][0] == "host":
            results[c["id"]] = judge_host(c, snap)
    error = error_kind = exclusion = None
    if sandboxed:
        payload = {"entries": export_entries(snap), "runners": _runners(),
                   "checks": [_public(c) for c in sandboxed]}
        obs = {}
        for attempt in (0, 1):  # a probe that fails before it holds the workspace gets one fresh successor
            try:
                reply = run_probe(payload, cfg, probe=probe if attempt == 0 else None)
                obs = reply.get("observations") if reply.get("ok") else None
                if not isinstance(obs, dict):
                    raise SandboxError(f"verification probe failed: {str(reply.get('error', reply))[:300]}")
                error = error_kind = exclusion = None
                break
            except SandboxStartError as e:
                error, obs, error_kind = str(e), {}, "start"
                exclusion = "host_resources" if e.host_resources else "sandbox_start"
            except SandboxError as e:
                error, obs = str(e), {}
                error_kind = "timeout" if isinstance(e, SandboxTimeout) else "sandbox"
                break
        for c in sandboxed:
            results[c["id"]] = judge_observation(c, obs.get(c["id"]))
    elif probe is not None:
        probe.close()
    checks = [{"id": c["id"], "kind": c["kind"], "label": c.get("label"),
               "ok": results[c["id"]][0], "reason": results[c["id"]][1]} for c in task.checks]
    # all of them ran and all passed; a probe error is never a pass
    passed = error is None and len(checks) == len(task.checks) > 0 and all(c["ok"] for c in checks)
    return VerifyResult(reward=1.0 if passed else 0.0, passed=passed, checks=checks, error=error,
                        error_kind=error_kind, scoring=EXCLUDED if exclusion else COUNTED, exclusion=exclusion)
