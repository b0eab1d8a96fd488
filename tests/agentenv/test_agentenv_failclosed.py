"""AgentENV fails closed: whatever the agent writes or runs, breaking the sandbox or the verifier is a reward of 0
that counts (RL trains on it), never an episode left out; only failures the agent cannot cause are excluded."""
import json
import sqlite3
import time

import pytest

from k3.agentenv import verify as V
from k3.agentenv.policies import ScriptedPolicy
from k3.agentenv.redteam import ATTACKS, _substitute
from k3.agentenv.rollout import EpisodeConfig, run_episode
from k3.agentenv.sandbox import SandboxError, SandboxStartError
from k3.agentenv.tasks import Task, load_task, tasks_root
from k3.agentenv.verify import snapshot_from_files, verify
from k3.rl.rollout import classify


class P:  # what classify reads of a K3EnginePolicy: a policy whose own machinery did not fail
    context_exceeded, failure = False, None


def attack_episode(name, cfg, seed=0, **episode):
    atk = next(a for a in ATTACKS if a.name == name)
    actions = _substitute(list(atk.actions), {"@@NONCE@@": "x", "@@PORT@@": "9", "@@CANARY@@": "/nonexistent",
                                              "@@TASKDIR@@": "/nonexistent"})
    return run_episode(load_task(tasks_root() / atk.task), ScriptedPolicy(actions, per_turn=1), seed,
                       EpisodeConfig(sandbox=cfg, **episode))


def assert_counted_zero(rec):
    assert rec["reward"] == 0.0 and rec["scoring"] == "counted" and rec["exclusion"] is None, rec["error"]
    assert classify(rec, P())[0] is None  # RL trains on it as a 0


# (attack, status, what the record says about it)
VECTORS = [
    ("kill_verifier_parent", "finished", "sandbox exited without answering"),  # os.kill(os.getppid())
    ("kill_all_from_verification", "finished", "sandbox exited without answering"),  # kill -9 -1 there
    ("kill_the_executor", "sandbox_error", "sandbox exited without answering"),  # kill -9 -1 in the episode
    ("oversize_workspace", "sandbox_error", "holds more than"),
    ("many_tiny_files", "sandbox_error", "more than 5000 entries"),
    ("deep_json_config", "finished", "nested deeper than"),  # judged on the host
    ("deep_forged_report", "finished", "nested deeper than"),  # the host's read of the probe's reply
    ("infinite_loops", "finished", "did not report"),  # a hang in the code under test: the group's timeout
]


@pytest.mark.parametrize("name, status, says", VECTORS, ids=[v[0] for v in VECTORS])
def test_each_vector_scores_0_and_counts(fast_sandbox, name, status, says):
    rec = attack_episode(name, fast_sandbox)
    assert rec["status"] == status
    assert says in json.dumps([rec["error"], rec["verifier"]])
    assert_counted_zero(rec)
    v = rec["verifier"]
    if v and v["error"]:  # a verifier that failed on this workspace and ran cleanly on the task's own
        assert v["control"].startswith("clean") and v["scoring"] == "counted"


def test_a_fifo_handed_to_the_file_tools_does_not_block(fast_sandbox):
    """The executor opened the FIFO and blocked until the host's 30 s timeout ended the episode."""
    t0 = time.monotonic()
    rec = attack_episode("fifo_to_file_tools", fast_sandbox, dialects=("kimi",))  # its own write tool, not a shell
    assert time.monotonic() - t0 < 20 and rec["status"] == "finished"
    refused = [a for a in rec["actions"] if a.get("action", {}).get("tool") in ("edit", "write", "read")]
    assert len(refused) == 4 and all(not a["ok"] and "not a regular file" in a["observation"] for a in refused)
    assert_counted_zero(rec)


def test_a_verifier_hung_by_the_agent_counts(fast_sandbox):
    """SIGSTOP of the probe: the host's verification timeout, a 0 that counts."""
    cfg = fast_sandbox.__class__(**{**fast_sandbox.__dict__,
                                    "limits": fast_sandbox.limits.replace(verify_timeout_s=4.0)})
    rec = attack_episode("stop_the_verifier", cfg)
    assert rec["verifier"]["error_kind"] == "timeout" and rec["verifier"]["control"].startswith("clean")
    assert_counted_zero(rec)


def test_unparseable_verifier_output_counts_and_a_broken_verifier_is_excluded(sandbox, monkeypatch):
    """Nonsense from the probe on the agent's workspace is the agent's doing (its code shares the sandbox) unless the
    clean-workspace control fails too: then our verifier is broken and the episode is excluded."""
    task = load_task(tasks_root() / "pyfix-median")
    snap = snapshot_from_files(task.workspace_files())
    calls = []
    real = V.run_probe

    def garbled_once(payload, cfg=None, timeout=None, probe=None):
        calls.append(payload)
        if len(calls) == 1:
            raise SandboxError("sandbox answered something that is not JSON: b'\\x00garbage'")
        return real(payload, cfg, timeout=timeout, probe=probe)
    monkeypatch.setattr(V, "run_probe", garbled_once)
    res = verify(task, snap, sandbox)
    assert len(calls) == 2 and res.reward == 0.0 and res.error_kind == "sandbox"
    assert res.scoring == "counted" and res.exclusion is None and res.control.startswith("clean")

    def always_garbled(payload, cfg=None, timeout=None, probe=None):
        raise SandboxError("sandbox answered something that is not JSON: b'\\x00garbage'")
    monkeypatch.setattr(V, "run_probe", always_garbled)
    res = verify(task, snap, sandbox)
    assert res.scoring == "excluded" and res.exclusion == "verifier_bug" and "failed too" in res.control

    def host_raises(*a, **k):  # a bug in the host's judging: the episode, not the run, ends
        raise RecursionError("maximum recursion depth exceeded")
    monkeypatch.setattr(V, "run_probe", real)
    monkeypatch.setattr(V, "judge_observation", host_raises)
    res = verify(task, snap, sandbox)
    assert res.error_kind == "verifier" and res.exclusion == "verifier_bug" and res.reward == 0.0


@pytest.mark.parametrize("host_resources", [False, True])
def test_a_verifier_that_cannot_start_is_retried_then_excluded(sandbox, monkeypatch, host_resources):
    task = load_task(tasks_root() / "pyfix-median")
    calls = []

    def no_start(payload, cfg=None, timeout=None, probe=None):
        calls.append(probe)
        if probe is not None:
            probe.close()
        raise SandboxStartError("the verification sandbox did not start: fork failed", host_resources)
    monkeypatch.setattr(V, "run_probe", no_start)
    res = verify(task, snapshot_from_files(task.workspace_files()), sandbox)
    assert len(calls) == 2 and res.error_kind == "start" and res.scoring == "excluded"
    assert res.exclusion == ("host_resources" if host_resources else "sandbox_start") and res.control is None
    rec = {"status": "finished", "reward": 0.0, "scoring": res.scoring, "exclusion": res.exclusion,
           "verifier": res.to_json()}
    assert classify(rec, P()) == ("crashed", f"{res.exclusion}: verifier: {res.error}")


def test_a_sandbox_that_cannot_start_before_any_action_is_excluded(sandbox):
    from k3.agentenv.sandbox import default_config

    broken = default_config(bwrap="/nonexistent/bwrap")
    task = load_task(tasks_root() / "pyfix-median")
    rec = run_episode(task, ScriptedPolicy([{"tool": "finish", "summary": "x"}]), 0, EpisodeConfig(sandbox=broken))
    assert rec["status"] == "sandbox_error" and rec["steps"] == 0
    assert rec["scoring"] == "excluded" and rec["exclusion"] == "sandbox_start"
    assert classify(rec, P())[0] == "crashed"


# ---------------------------------------------------------------------------------------------- SQLite schema


def _db(plant: str | None, relabel: tuple[str, str] | None, sql_edit: tuple[str, str] | None = None) -> bytes:
    c = sqlite3.connect(":memory:")
    c.executescript("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT); CREATE TABLE log (x);"
                    "INSERT INTO t VALUES (1, 'a');" + (plant or ""))
    c.execute("PRAGMA writable_schema = ON")
    if relabel:
        c.execute("UPDATE sqlite_master SET type = ? WHERE name = ?", relabel[::-1])
    if sql_edit:
        c.execute("UPDATE sqlite_master SET sql = replace(sql, ?, ?)", sql_edit)
    c.commit()
    data = c.serialize()
    c.close()
    return data


def _schema_verdict(data: bytes, cfg, forbid=("trigger", "view", "index", "virtual table"), tables=("t", "log")):
    task = Task(id="schema", family="sqlite", title="", instruction="", root=tasks_root(), manifest={},
                checks=({"id": "schema", "kind": "sql_schema", "db": "app.db",
                         "expect": {"tables": list(tables), "forbid": list(forbid)}},), solution=())
    res = verify(task, snapshot_from_files({"app.db": (data, 0o644)}), cfg)
    assert res.error is None, res.error
    return res.reward, res.checks[0]["reason"]


PLANTED = [  # each kind of schema object, its `type` re-cased through writable_schema
    ("trigger", "CREATE TRIGGER wipe AFTER INSERT ON log BEGIN DELETE FROM t; END;", ("wipe", "Trigger"), None),
    ("view", "CREATE VIEW v AS SELECT * FROM t;", ("v", "VIEW"), None),
    ("index", "CREATE INDEX ix ON t (v);", ("ix", "Index"), None),
    ("virtual table", "CREATE VIRTUAL TABLE vt USING fts4(a);", ("vt", "Table"),
     ("CREATE VIRTUAL TABLE vt", "CREATE /* hidden */\nVIRTUAL TABLE vt")),
]


@pytest.mark.parametrize("kind, plant, relabel, sql_edit", PLANTED, ids=[p[0] for p in PLANTED])
def test_schema_checks_see_every_recased_kind(sandbox, kind, plant, relabel, sql_edit):
    """SQLite runs a schema row's SQL whatever its `type` says: a trigger labelled 'Trigger' deleted rows and
    passed a forbid list compared case-sensitively."""
    data = _db(plant, relabel, sql_edit)
    reward, reason = _schema_verdict(data, sandbox)
    assert reward == 0.0 and f"{kind} {relabel[0]}" in reason, reason
    assert _schema_verdict(data, sandbox, forbid=[]) == (1.0, "ok")  # the forbid list alone failed it


def test_schema_checks_pass_a_clean_schema_and_fold_case(sandbox):
    assert _schema_verdict(_db(None, None), sandbox) == (1.0, "ok")
    assert _schema_verdict(_db(None, None), sandbox, tables=("T", "LOG"))[0] == 1.0  # SQLite's names fold case
    vt = _db("DROP TABLE log; CREATE VIRTUAL TABLE log USING fts4(x);", None, ("CREATE VIRTUAL", "create\tvirtual"))
    reward, reason = _schema_verdict(vt, sandbox, forbid=[])
    assert reward == 0.0 and "log is a virtual table" in reason


def test_a_recased_trigger_no_longer_passes_the_shipped_task(fast_sandbox):
    rec = attack_episode("sqlite_recased_trigger", fast_sandbox)
    assert "forbidden schema objects present" in json.dumps(rec["verifier"]) and rec["status"] == "finished"
    assert_counted_zero(rec)


# ---------------------------------------------------------------------------------------------- check isolation

PLANT = r'''import os, site, sys, time
d = site.getusersitepackages()
os.makedirs(d, exist_ok=True)
with open(os.path.join(d, "usercustomize.py"), "w") as f:
    f.write("import os\nprint('HOOKED')\nos._exit(0)\n")
open(os.path.join(os.environ["TMPDIR"], "left-by-check-1"), "w").close()
open("/dev/shm/left-by-check-1", "w").close()
if os.fork() == 0:  # a daemon that would keep planting
    os.setsid()
    for _ in range(500):
        open(os.path.join(os.environ["HOME"], "daemon-was-here"), "w").close()
        time.sleep(0.01)
    os._exit(0)
time.sleep(0.1)
planted = os.path.exists(os.path.join(d, "usercustomize.py"))
'''

PROBE_CHILD = "import sys; print('usercustomize' in sys.modules)"


def test_each_check_starts_from_a_fresh_home_and_tmp(sandbox):
    """Check 1's code plants a usercustomize.py in HOME's user site, litters /tmp and /dev/shm and leaves a daemon;
    checks 2 and 3 (another python group, a command running python3 itself) see none of it."""
    checks = (
        {"id": "c1", "kind": "python", "workspace": "a", "code": "import plant\nresult = plant.planted",
         "expect": {"value": True}},
        {"id": "c2", "kind": "python", "workspace": "b",
         "code": "import os, subprocess, sys\nresult = [sorted(os.listdir(os.environ['HOME'])), "
                 "sorted(os.listdir('/dev/shm')), subprocess.run([sys.executable, '-c', " + repr(PROBE_CHILD) +
                 "], capture_output=True, text=True).stdout]",
         "expect": {"value": [[], [], "False\n"]}},
        {"id": "c3", "kind": "command", "argv": ["python3", "-c", "import os, sys; print('usercustomize' in "
                                                 "sys.modules, os.listdir(os.environ['HOME']), os.listdir('/dev/shm'))"],
         "expect": {"stdout": "False [] []\n"}},
    )
    task = Task(id="iso", family="pyfix", title="", instruction="", root=tasks_root(), manifest={}, checks=checks,
                solution=())
    files = {"a/plant.py": (PLANT.encode(), 0o644), "b/empty.py": (b"", 0o644)}
    res = verify(task, snapshot_from_files(files), sandbox)
    assert res.error is None and [c["ok"] for c in res.checks] == [True, True, True], res.summary()


# ---------------------------------------------------------------------------------------------- files a user supplies


def test_deeply_nested_task_files_are_a_one_line_error(tmp_path):
    import shutil

    from k3.agentenv.tasks import compute_checksum

    src = tasks_root() / "pyfix-median"
    for what in ("task.json", "hidden/checks.json"):
        root = tmp_path / what.replace("/", "_") / "pyfix-median"
        shutil.copytree(src, root)
        (root / what).write_text('{"a": ' * 50_000 + "1" + "}" * 50_000)
        if what != "task.json":  # keep the manifest's hashes right, so the nesting is what is refused
            import hashlib
            m = json.loads((root / "task.json").read_text())
            m["hidden"][what]["sha256"] = hashlib.sha256((root / what).read_bytes()).hexdigest()
            m["checksum"] = compute_checksum(m)
            (root / "task.json").write_text(json.dumps(m))
        with pytest.raises(ValueError, match="nested deeper than") as e:
            load_task(root)
        assert "\n" not in str(e.value) and what in str(e.value)


def test_a_model_cannot_opt_out_with_deeply_nested_tool_arguments():
    """An HTTP policy's tool call whose arguments nest 100,000 deep raised RecursionError out of act(): a
    policy_error, which is excluded. It is a malformed call now, which the episode answers and counts."""
    from k3.agentenv.dialects import choose_variant, make_dialect
    from k3.agentenv.policies import EpisodeInfo, OpenAIChatPolicy

    pol = OpenAIChatPolicy("http://127.0.0.1:9", "m")
    dialect = make_dialect(choose_variant(0, ("kimi",), False))
    pol.begin_episode(EpisodeInfo("t", "pyfix", 0, dialect))
    name = next(iter(dialect.by_name))
    call = {"function": {"name": name, "arguments": "[" * 100_000 + "]" * 100_000}}
    text = pol._text({"choices": [{"message": {"content": "", "tool_calls": [call]}}]})
    assert isinstance(text, str) and text
