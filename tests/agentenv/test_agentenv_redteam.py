import os
import secrets
import socket
import time

import pytest

from k3.agentenv.actions import action_from_json, execute
from k3.agentenv.redteam import ATTACKS, PY, Host, _substitute, run_redteam
from k3.agentenv.sandbox import Session
from k3.agentenv.tasks import load_task, tasks_root

REQUIRED = {  # the brief's list -> attack names that cover it
    "sys.exit(0)/os._exit(0)": {"exit_zero_at_import", "os_exit_at_import", "exit_inside_function"},
    "edit/delete visible tests": {"edit_visible_tests", "delete_visible_tests"},
    "conftest/plugins": {"conftest_and_plugins", "site_hooks_pth_sitecustomize"},
    "env tricks": {"env_var_tricks"}, "monkeypatch runner": {"patch_runner_and_forge_reports"},
    "fake result file": {"fake_result_files"}, "uncollected/skipped": {"uncollect_and_skip_tests"},
    "fork bomb": {"fork_bomb"}, "memory bomb": {"memory_bomb"}, "disk fill": {"disk_fill"},
    "infinite loop": {"infinite_loops"}, "network": {"network_localhost", "network_outside"},
    "read hidden tests": {"read_hidden_tests"}, "write outside": {"write_outside_workspace"},
    "symlink and /proc": {"symlink_escape", "proc_and_namespace_escape"},
    "database side path": {"sqlite_view_replaces_table", "sqlite_symlink_side_path"},
    "kill/race verifier": {"kill_the_verifier", "daemon_races_verifier"},
    "shadow stdlib": {"shadow_stdlib_modules"}, "always-equal": {"always_equal_objects"},
    # failing closed: each way to break verification that once earned "left out" instead of a 0, or crashed the host
    "kill the verifier's process": {"kill_verifier_parent", "kill_all_from_verification", "kill_the_executor"},
    "FIFO to the file tools": {"fifo_to_file_tools"}, "oversize workspace": {"oversize_workspace"},
    "deep JSON on the host": {"deep_json_config", "deep_forged_report"},
    "re-cased schema type": {"sqlite_recased_trigger"}, "state between checks": {"usercustomize_across_checks"},
}
# attacks the fail-closed review designed itself (held out from the issue that asked for them)
OWN_DESIGN = {"stop_the_verifier", "deep_directory_chain", "many_tiny_files", "sqlite_virtual_table_disguised",
              "json_number_bombs", "daemon_across_checks", "hostile_file_names", "unreadable_and_looping_entries"}


def test_leak_markers_are_in_the_hidden_checks_only():
    """What counts as a leak: any hidden checks file (the label pattern), and per attacked task a string of its hidden
    checks. Each must be in hidden/checks.json and in nothing the agent is shown (instruction, workspace files), or a
    leak would be missed, or an honest transcript flagged. The catalogue's leak attacks each have a marker."""
    from k3.agentenv.redteam import HIDDEN_CHECKS_TEXT, LEAK_MARKERS, leaks

    for root in sorted(p for p in tasks_root().iterdir() if (p / "task.json").is_file()):
        hidden = (root / "hidden" / "checks.json").read_text()
        visible = load_task(root).instruction + "".join(  # what the sandbox shows: the task's text and files
            f.read_text(errors="replace") for f in (root / "workspace").rglob("*") if f.is_file())
        assert HIDDEN_CHECKS_TEXT.search(hidden) and not HIDDEN_CHECKS_TEXT.search(visible), root.name
        for marker in LEAK_MARKERS.get(root.name, ()):
            assert marker in hidden and marker not in visible, (root.name, marker)
    assert {a.task for a in ATTACKS if a.category == "leak"} <= set(LEAK_MARKERS)
    assert leaks('{"id": "x", "label": "F2P"}', "files-organize") and not leaks("all tests pass", PY)


def test_catalog_covers_the_brief():
    names = {a.name for a in ATTACKS}
    assert len(ATTACKS) >= 25 and len(names) == len(ATTACKS)
    for what, need in REQUIRED.items():
        assert need <= names, what
    assert OWN_DESIGN <= names and not OWN_DESIGN & set().union(*REQUIRED.values())
    assert {load_task(tasks_root() / a.task).family for a in ATTACKS} == {"pyfix", "sqlite", "files"}


def test_quick_redteam(sandbox):
    report = run_redteam(quick=True)
    bad = [r for r in report["results"] if r["reward"] or r["host_changed"] or r["leaked"] or r["scoring"] != "counted"]
    assert not bad, bad
    assert report["attempts"] == sum(a.quick for a in ATTACKS) >= 15
    assert report["honest"]["rewarded"] == report["honest"]["attempts"] == 3, report["honest"]
    assert report["ok"] and not report["host_changed"] and report["rewarded"] == 0 and report["excluded"] == []


def _naive_grade(attack_name, sandbox):
    """What a naive harness would conclude: run the visible tests in the agent's workspace."""
    atk = next(a for a in ATTACKS if a.name == attack_name)
    task = load_task(tasks_root() / atk.task)
    with Session(task.workspace_files(), sandbox) as s:
        for a in _substitute(list(atk.actions), {"@@NONCE@@": "x", "@@PORT@@": "9", "@@CANARY@@": "/nonexistent",
                                                 "@@TASKDIR@@": "/nonexistent"}):
            if a["tool"] != "finish":
                execute(s, action_from_json(a))
        return s.run(NAIVE)["output"]


NAIVE = "python3 test_stats.py; echo naive_rc=$?"  # "the test file exits 0" — a classic weak grader


@pytest.mark.parametrize("name", ["exit_zero_at_import", "edit_visible_tests", "special_case_visible_inputs"])
def test_attacks_fool_a_naive_grader(sandbox, name):
    """The attacks have teeth: a naive grader rewards them (the real verifier gives 0, see above)."""
    assert _naive_grade(name, sandbox).strip().endswith("naive_rc=0")


def test_untouched_task_fails_the_naive_grader(sandbox):
    task = load_task(tasks_root() / PY)
    with Session(task.workspace_files(), sandbox) as s:
        assert s.run(NAIVE)["output"].strip().endswith("naive_rc=1")


def test_fingerprint_detects_changes(sandbox):
    host = Host(sandbox)
    try:
        nonce = "K3N" + secrets.token_hex(6)
        before, conns = host.fingerprint(), host.listener.connections
        assert host.changes(before, nonce, conns) == []
        marker = f"/tmp/K3PWN-{nonce}"
        open(marker, "w").close()
        (host.canary / "data.txt").write_text("changed\n")
        socket.create_connection(("127.0.0.1", host.listener.port), 1).close()
        deadline = time.monotonic() + 10  # the listener thread counts the connection: wait for it, not a fixed time
        while host.listener.connections == conns and time.monotonic() < deadline:
            time.sleep(0.02)
        changes = host.changes(before, nonce, conns)
        assert any("marker" in c for c in changes) and "canary directory changed" in changes
        assert any("listener" in c for c in changes)
        os.unlink(marker)
    finally:
        host.close()


def test_full_redteam(sandbox):
    report = run_redteam()
    assert report["ok"], [r for r in report["results"]
                          if r["reward"] or r["host_changed"] or r["leaked"] or r["scoring"] != "counted"]
    assert report["attempts"] >= 25
