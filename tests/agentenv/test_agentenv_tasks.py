import json
import shutil
from concurrent.futures import ThreadPoolExecutor
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest

from k3.agentenv.rollout import EpisodeConfig, run_rollouts
from k3.agentenv.taskgen import build_all
from k3.agentenv.tasks import FAMILIES, compute_checksum, load_task, load_tasks, tasks_root, write_task
from k3.agentenv.verify import snapshot_from_files, verify

REPO = Path(__file__).resolve().parents[2]


def test_shipped_tasks_cover_three_families():
    tasks = load_tasks("all")
    assert len(tasks) >= 30
    by_family = {f: [t for t in tasks if t.family == f] for f in FAMILIES}
    assert all(len(v) >= 5 for v in by_family.values()), {k: len(v) for k, v in by_family.items()}
    for t in tasks:
        assert t.checks and t.solution and t.instruction.strip()
        assert {c["label"] for c in t.checks} <= {"F2P", "P2P"}
        assert any(c["label"] == "F2P" for c in t.checks), t.id  # something must change


def test_rebuilding_reproduces_the_shipped_checksums(tmp_path):
    build_all(tmp_path)
    shipped = {t.id: t.checksum for t in load_tasks("all")}
    rebuilt = {t.id: t.checksum for t in load_tasks("all", tmp_path)}
    assert rebuilt == shipped


def test_package_data_globs_cover_every_task_file():
    conf = tomllib.loads((REPO / "pyproject.toml").read_text())
    globs = conf["tool"]["setuptools"]["package-data"]["k3"]
    base = REPO / "src" / "k3"
    missing = [str(p.relative_to(base)) for p in tasks_root().rglob("*")
               if p.is_file() and "__pycache__" not in p.parts
               and not any(fnmatch(str(p.relative_to(base)), g) or fnmatch(p.name, g.split("/")[-1])
                           for g in globs)]
    assert not missing, f"task files a wheel would not ship: {missing[:5]}"


def _copy(tid, tmp_path):
    dst = tmp_path / tid
    shutil.copytree(tasks_root() / tid, dst)
    return dst


def _rewrite_manifest(root, fn):
    m = json.loads((root / "task.json").read_text())
    fn(m)
    m["checksum"] = compute_checksum(m)
    (root / "task.json").write_text(json.dumps(m))


def test_bad_tasks_give_clear_errors(tmp_path):
    root = _copy("pyfix-median", tmp_path)
    m = json.loads((root / "task.json").read_text())
    m["instruction"] += " (edited)"
    (root / "task.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match="checksum mismatch"):
        load_task(root)

    root = _copy("pyfix-slugify", tmp_path)
    (root / "workspace" / "textutils.py").write_text("tampered\n")
    with pytest.raises(ValueError, match="does not match its sha256"):
        load_task(root)

    root = _copy("pyfix-chunk", tmp_path)
    (root / "workspace" / "extra.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="unlisted"):
        load_task(root)

    root = _copy("pyfix-roman", tmp_path)
    (root / "hidden" / "checks.json").unlink()
    with pytest.raises(ValueError, match="missing"):
        load_task(root)

    root = _copy("pyfix-lru", tmp_path)
    _rewrite_manifest(root, lambda m: m["verifier"]["checks"].pop())
    with pytest.raises(ValueError, match="does not list exactly the checks"):
        load_task(root)

    root = _copy("sqlite-restock", tmp_path)
    _rewrite_manifest(root, lambda m: m["workspace"].update(generate={}))
    with pytest.raises(ValueError, match="not a workspace file"):
        load_task(root)

    with pytest.raises(ValueError, match="no task.json"):
        load_task(tmp_path)
    with pytest.raises(ValueError, match="no task matches"):
        load_tasks("no-such-task")


@pytest.mark.parametrize("check, message", [
    ({"id": "a", "kind": "telepathy"}, "unknown kind"),
    ({"id": "a", "kind": "python", "code": "result = 1", "expect": {}}, "exactly one of"),
    ({"id": "a", "kind": "file", "path": "../x", "expect": {"sha256": "0"}}, "clean relative path"),
    ({"id": "a", "kind": "command", "argv": "ls", "expect": {"stdout": ""}}, "argv"),
    ({"id": "a", "kind": "python", "code": "result = 1", "expect": {"value": 1}, "label": "X"}, "label"),
])
def test_malformed_checks_are_rejected(tmp_path, check, message):
    write_task(tmp_path, id="t", family="files", title="t", instruction="do it",
               workspace={"a.txt": "x\n"}, checks=[check], solution=[])
    with pytest.raises(ValueError, match=message):
        load_task(tmp_path / "t")


def test_every_task_discriminates(sandbox):
    """SWE-bench semantics per task: untouched -> F2P fail, P2P pass, reward 0; reference -> 1."""
    tasks = load_tasks("all")
    with ThreadPoolExecutor(2) as pool:  # verification waits on sandbox processes, not the GIL
        untouched = list(pool.map(lambda t: verify(t, snapshot_from_files(t.workspace_files()), sandbox),
                                  tasks))
    for t, res in zip(tasks, untouched):
        assert res.reward == 0.0 and res.error is None, (t.id, res.summary())
        for c in res.checks:
            assert c["ok"] == (c["label"] == "P2P"), (t.id, c)
    recs = run_rollouts(tasks, {"kind": "reference"}, len(tasks), workers=2,
                        config=EpisodeConfig(sandbox=sandbox))
    bad = [(r["task_id"], r["dialect"], r["status"], r.get("error"),
            r["verifier"] and [c for c in r["verifier"]["checks"] if not c["ok"]]) for r in recs
           if r["reward"] != 1.0]
    assert not bad, bad
    assert {r["dialect"] for r in recs} == {"kimi", "claude", "codex", "react"}


def _rehash_hidden(root):
    from k3.agentenv.tasks import sha256_bytes

    def fn(m):
        for rel, meta in m["hidden"].items():
            meta["sha256"] = sha256_bytes((root / rel).read_bytes())
    _rewrite_manifest(root, fn)


@pytest.mark.parametrize("damage, message", [
    (lambda r: (r / "task.json").write_text("[]"), r"task.json: task.json must be a JSON object, got list"),
    (lambda r: (r / "task.json").write_bytes(b"\xff{}"), r"task.json: task.json is not readable JSON"),
    (lambda r: _rewrite_manifest(r, lambda m: m.update(workspace=[])), r"workspace must be an object"),
    (lambda r: _rewrite_manifest(r, lambda m: m.update(verifier=None)), r"verifier must be an object"),
    (lambda r: _rewrite_manifest(r, lambda m: m.update(limits=[])), r"limits must be an object"),
    (lambda r: _rewrite_manifest(r, lambda m: m.update(limits={"max_steps": "abc"})), r"limits.max_steps must be"),
    (lambda r: _rewrite_manifest(r, lambda m: m.update(limits={"max_steps": -3})), r"limits.max_steps must be"),
    (lambda r: _rewrite_manifest(r, lambda m: next(iter(m["workspace"]["files"].values())).update(mode="rw")),
     r"workspace.files\[.*\].mode must be an integer"),
    (lambda r: ((r / "hidden/checks.json").write_text("[1, 2]"), _rehash_hidden(r)),
     r"hidden/checks.json must be a JSON object, got list"),
    (lambda r: ((r / "hidden/checks.json").write_text('{"checks": \n'), _rehash_hidden(r)),
     r"hidden/checks.json is not readable JSON"),
    (lambda r: ((r / "hidden/checks.json").write_text('{"checks": [1]}'), _rehash_hidden(r)),
     r"must be an object with a non-empty string id, got 1"),
    (lambda r: ((r / "hidden/solution.json").write_text("[]"), _rehash_hidden(r)),
     r"hidden/solution.json must be a JSON object"),
])
def test_malformed_task_files_name_the_file_and_field(tmp_path, damage, message):
    """A custom task with a list where an object belongs, bad JSON or a non-integer limit: a ValueError naming the
    file and field (there were AttributeError tracebacks, bare JSON messages and errors only at run time)."""
    root = _copy("pyfix-median", tmp_path)
    damage(root)
    with pytest.raises(ValueError, match=message):
        load_task(root)


def test_a_shape_no_check_foresees_still_names_the_task(tmp_path, monkeypatch):
    import k3.agentenv.tasks as tasks_mod

    root = _copy("pyfix-median", tmp_path)
    monkeypatch.setattr(tasks_mod, "_check_shapes", lambda *a: None)
    _rewrite_manifest(root, lambda m: m.update(verifier=[]))
    with pytest.raises(ValueError, match=r"pyfix-median: the task's files are malformed \(AttributeError"):
        load_task(root)


def test_generated_databases_of_one_name_keep_their_own_scripts(tmp_path):
    """live/app.db and backup/app.db were both built from setup/app.sql, the script written last: each now has the
    script at its own path (a database at the top level keeps setup/<name>.sql, as the shipped tasks have)."""
    import sqlite3

    root = write_task(tmp_path, id="two-dbs", family="sqlite", title="t", instruction="copy rows",
                      workspace={"note.txt": "x\n"},
                      generate={"live/app.db": "CREATE TABLE t(x); INSERT INTO t VALUES ('live');",
                                "backup/app.db": "CREATE TABLE t(x); INSERT INTO t VALUES ('backup');",
                                "top.db": "CREATE TABLE t(x); INSERT INTO t VALUES ('top');"},
                      checks=[{"id": "q", "kind": "sql", "label": "P2P", "db": "top.db", "sql": "SELECT x FROM t",
                               "expect": {"rows": [["top"]]}}], solution=[])
    task = load_task(root)
    assert task.manifest["workspace"]["generate"]["top.db"] == {"sqlite_script": "setup/top.sql"}
    for rel, (data, _) in task.workspace_files().items():
        if rel.endswith(".db"):
            (tmp_path / "x.db").write_bytes(data)
            with sqlite3.connect(tmp_path / "x.db") as db:
                assert db.execute("SELECT x FROM t").fetchall() == [(rel.split("/")[0].removesuffix(".db"),)], rel
            (tmp_path / "x.db").unlink()
