import base64
import hashlib
import json

import pytest

from k3.agentenv import verify as V
from k3.agentenv._case_runner import encode
from k3.agentenv.sandbox import SandboxError
from k3.agentenv.tasks import load_task, tasks_root
from k3.agentenv.verify import Entry, judge_host, same, snapshot_from_export, snapshot_from_files


def test_same_is_type_exact():
    assert same([1, {"a": 2.5}], [1, {"a": 2.5}])
    assert not same(True, 1) and not same(1, 1.0) and not same("1", 1)
    assert not same([1, 2], [1, 2, 3]) and not same({"a": 1}, {"a": 1, "b": 2})
    assert same(0.1 + 0.2, 0.3, tol=1e-9) and not same(0.1 + 0.2, 0.3)
    assert not same(float("nan"), float("nan"))


def test_encode_rejects_lookalikes():
    class S(str):
        def __eq__(self, other):
            return True

    class F(float):
        pass

    assert encode(S("x")) == {"$unserializable": f"{__name__}.test_encode_rejects_lookalikes.<locals>.S"}
    assert "$unserializable" in encode(F(2.5))
    assert encode((1, [2.0], {"k": None})) == {"$tuple": [1, [2.0], {"$dict": [["k", None]]}]}
    assert encode({2, 1}) == {"$set": [1, 2]} and encode(float("inf")) == {"$float": "inf"}
    assert encode(2 ** 80) == {"$int": str(2 ** 80)}


def _f(path, data=b"x", mode=0o644):
    return {"path": path, "type": "file", "mode": mode, "data": base64.b64encode(data).decode()}


@pytest.mark.parametrize("entries, message", [
    ([_f("../x")], "clean relative path"),
    ([_f("/etc/passwd")], "clean relative path"),
    ([_f("a"), _f("a")], "twice"),
    ([_f("a/b")], "not under a directory"),
    ([{"path": "l", "type": "symlink", "target": "/"}, _f("l/x")], "not under a directory"),
    ([{"path": "a", "type": "file", "data": "!!notbase64"}], "bad data"),
    ([{"path": "a", "type": "device"}], "unknown type"),
    ("nope", "not a list"),
])
def test_export_validation(entries, message):
    with pytest.raises(SandboxError, match=message):
        snapshot_from_export(entries)


def test_export_size_cap():
    with pytest.raises(SandboxError, match="exceeds"):
        snapshot_from_export([_f("a", b"x" * 100), _f("b", b"x" * 100)], max_bytes=150)


def test_host_checks():
    snap = snapshot_from_files({"out.txt": (b"hello\n", 0o644), "bin/run": (b"#!/bin/sh\n", 0o755),
                                "c.json": (b'{"a": [1, 2.0]}', 0o644)})
    snap["link"] = Entry("symlink", target="out.txt")
    sha = hashlib.sha256(b"hello\n").hexdigest()
    ok = lambda c: judge_host(c, snap)[0]
    assert ok({"kind": "file", "path": "out.txt", "expect": {"sha256": sha}})
    assert not ok({"kind": "file", "path": "link", "expect": {"sha256": sha}})  # links are not files
    assert not ok({"kind": "file", "path": "missing", "expect": {"sha256": sha}})
    assert ok({"kind": "absent", "path": "missing"}) and not ok({"kind": "absent", "path": "link"})
    assert ok({"kind": "executable", "path": "bin/run"}) and not ok({"kind": "executable", "path": "out.txt"})
    assert ok({"kind": "tree", "path": "bin", "expect": {"files": ["run"]}})
    assert ok({"kind": "json_file", "path": "c.json", "expect": {"value": {"a": [1, 2.0]}}})
    assert not ok({"kind": "json_file", "path": "c.json", "expect": {"value": {"a": [1, 2]}}})


def test_expectations_never_enter_the_sandbox(monkeypatch):
    task = load_task(tasks_root() / "pyfix-median")
    seen = {}

    def fake_probe(payload, cfg=None, timeout=None, probe=None):
        seen["payload"] = payload
        return {"ok": True, "observations": {}}

    monkeypatch.setattr(V, "run_probe", fake_probe)
    res = V.verify(task, snapshot_from_files(task.workspace_files()))
    text = json.dumps(seen["payload"]["checks"])
    assert "expect" not in text and "label" not in text
    assert {c["id"] for c in seen["payload"]["checks"]} == {c["id"] for c in task.checks}
    # nothing observed -> every check failed as "did not run", reward 0
    assert res.reward == 0.0 and all("did not run" in c["reason"] for c in res.checks)


def test_missing_or_broken_observations_never_pass(monkeypatch):
    task = load_task(tasks_root() / "pyfix-median")
    good = {c["id"]: ({"value": c["expect"]["value"]} if "value" in c["expect"]
                      else {"raises": c["expect"]["raises"], "mro": [c["expect"]["raises"]]})
            for c in task.checks}
    snap = snapshot_from_files(task.workspace_files())
    monkeypatch.setattr(V, "run_probe", lambda *a, **k: {"ok": True, "observations": dict(good)})
    assert V.verify(task, snap).reward == 1.0  # the judge itself accepts correct observations
    one_missing = dict(good)
    one_missing.pop(next(iter(one_missing)))
    monkeypatch.setattr(V, "run_probe", lambda *a, **k: {"ok": True, "observations": one_missing})
    assert V.verify(task, snap).reward == 0.0

    def dead(*a, **k):
        raise SandboxError("sandbox exited without answering")
    monkeypatch.setattr(V, "run_probe", dead)
    res = V.verify(task, snap)
    assert res.reward == 0.0 and "exited" in res.error
    monkeypatch.setattr(V, "run_probe", lambda *a, **k: {"ok": False, "error": "boom"})
    assert V.verify(task, snap).reward == 0.0


def test_an_unreadable_directory_cannot_hide_files_from_the_verifier(sandbox):
    """The agent hides the files it should delete in a directory it makes unreadable (mode 000): the export
    must still see them (it restores the owner's read bits first), so the task is not solved."""
    from k3.agentenv import ScriptedPolicy, load_tasks, run_episode
    from k3.agentenv.actions import Action

    task = load_tasks("files-delete-scratch")[0]
    hide = ("mkdir project/.keep && find project -name 'scratch_*' -not -path 'project/.keep/*' "
            "-exec mv {} project/.keep/ \\; && chmod 000 project/.keep")
    r = run_episode(task, ScriptedPolicy([Action("run", {"command": hide})]), seed=0)
    assert r["status"] == "finished" and r["reward"] == 0.0, r["verifier"]


def test_hidden_python_cases_see_the_pinned_hash_seed(sandbox, tmp_path):
    """What a set's order looked like in the episode (PYTHONHASHSEED=0) is what grading sees, every time."""
    from k3.agentenv.sandbox import Session
    from k3.agentenv.tasks import write_task

    src = "def tags(words):\n    return list(set(words))\n"
    with Session({"m.py": (src.encode(), 0o644)}, sandbox) as s:
        seen = s.run("python3 -c 'import m; print(m.tags([\"red\", \"green\", \"blue\", \"cyan\", \"teal\"]))'")
    root = write_task(tmp_path / "tasks", id="t-hash", family="pyfix", title="t", instruction="x",
                      workspace={"m.py": src},
                      checks=[{"id": "c", "kind": "python", "label": "F2P",
                               "code": "from m import tags\nresult = tags(['red', 'green', 'blue', 'cyan', 'teal'])",
                               "expect": {"value": json.loads(seen["output"].replace("'", '"'))}}], solution=[])
    task = load_task(root)
    snap = snapshot_from_files(task.workspace_files())
    assert [V.verify(task, snap, sandbox).reward for _ in range(4)] == [1.0] * 4


def test_command_checks_grade_the_real_exit_code(sandbox):
    """files-greet-exec expects exit code 0: a correct script that execs /usr/bin/printf (which closes its
    output before exiting) passes, and one that prints the right text but exits 7 after closing its output
    fails. Both were misgraded when the probe killed or reaped the child before waiting for it."""
    from k3.agentenv import ScriptedPolicy, load_tasks, run_episode
    from k3.agentenv.actions import Action

    task = load_tasks("files-greet-exec")[0]
    for script, reward in [('#!/bin/sh\nexec /usr/bin/printf "Hello, %s!\\n" "${1:-world}"\n', 1.0),
                           ('#!/bin/sh\necho "Hello, ${1:-world}!"\nexec 2>&-\nsleep 0.2\nexec >&-\nexit 7\n', 0.0)]:
        steps = [Action("write", {"path": "bin/greet", "content": script}),
                 Action("run", {"command": "chmod +x bin/greet"})]
        for seed in range(4):  # the misgrading was a race: several episodes
            r = run_episode(task, ScriptedPolicy(steps), seed=seed)
            assert r["status"] == "finished" and r["reward"] == reward, (script, seed, r["verifier"])


def test_a_check_workspace_must_be_one_top_level_directory():
    from k3.agentenv.verify import _public

    assert _public({"id": "c", "kind": "python", "workspace": "a0001"})["workspace"] == "a0001"
    for bad in ("../x", "a/b", ".", "", ".hidden", 3):
        with pytest.raises(ValueError, match="one top-level directory"):
            _public({"id": "c", "kind": "python", "workspace": bad})
