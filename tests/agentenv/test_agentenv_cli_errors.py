"""`k3 agentenv` flag and path errors: one line, exit 2, before any work; nothing of the user's is lost."""
import json

import pytest

from k3.cli import main


def _err(capsys, *argv):
    code = main(["agentenv", *argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def test_rebuild_keeps_directories_it_did_not_write(tmp_path, capsys):
    d = tmp_path / "tasks"
    assert main(["agentenv", "tasks", "--rebuild", "--dir", str(d), "--select", "pyfix-median"]) == 0
    notes = d / "pyfix-median" / "notes.txt"
    notes.write_text("mine")
    code, err = _err(capsys, "tasks", "--rebuild", "--dir", str(d))
    assert code == 2 and "pyfix-median" in err and "notes.txt" in err and "--force" in err
    assert notes.read_text() == "mine"  # refused before anything was removed
    own = d / "sqlite-restock"
    (own / "task.json").unlink()  # a same-named directory without the tool's manifest
    code, err = _err(capsys, "tasks", "--rebuild", "--dir", str(d))
    assert code == 2 and "(and 1 more task directories)" in err
    assert main(["agentenv", "tasks", "--rebuild", "--dir", str(d), "--force", "--json"]) == 0
    assert not notes.exists() and (own / "task.json").is_file()
    capsys.readouterr()
    # a directory the rebuild wrote (and nothing else) is replaced without --force
    assert main(["agentenv", "tasks", "--rebuild", "--dir", str(d), "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) >= 30
    code, err = _err(capsys, "tasks", "--force")
    assert code == 2 and "--force only applies to --rebuild" in err


def test_tasks_dir_says_what_is_wrong(tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("")
    code, err = _err(capsys, "tasks", "--dir", str(f))
    assert code == 2 and "is a file, not a directory" in err and "does not exist" not in err
    code, err = _err(capsys, "tasks", "--rebuild", "--dir", str(f))
    assert code == 2 and "is a file, not a directory" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    code, err = _err(capsys, "tasks", "--dir", str(empty))
    assert code == 2 and "holds no tasks" in err and f"--rebuild --dir {empty}" in err
    code, err = _err(capsys, "tasks", "--dir", str(tmp_path / "nope"))
    assert code == 2 and "does not exist" in err


@pytest.fixture
def no_episodes(monkeypatch):
    """Fail the test if any episode (or checkpoint load, or sandbox check) starts."""
    import k3.agentenv.policies as policies
    import k3.agentenv.rollout as rollout
    import k3.agentenv.sandbox as sandbox

    def boom(*a, **k):
        raise AssertionError("work started before the flags were checked")

    monkeypatch.setattr(rollout, "run_rollouts", boom)
    monkeypatch.setattr(policies, "_load_k3", boom)
    monkeypatch.setattr(sandbox, "check_sandbox", boom)


@pytest.mark.parametrize("bad", ["-1", "nan", "inf"])
def test_run_checks_the_temperature_up_front(tmp_path, capsys, no_episodes, bad):
    for policy in (["--policy", "k3", "--ckpt", str(tmp_path / "ckpt")],
                   ["--policy", "http", "--base-url", "http://127.0.0.1:9/v1", "--model", "m"]):
        code, err = _err(capsys, "run", "--tasks", "sqlite-restock", *policy, "--temperature", bad,
                         "--out", str(tmp_path / "r.jsonl"))
        assert code == 2 and "--temperature" in err and ">= 0" in err, err
    assert not (tmp_path / "r.jsonl").exists()


@pytest.mark.parametrize("url", ["notaurl", "ftp://host/v1", "http://", "http://h:port/v1"])
def test_run_checks_the_base_url_up_front(tmp_path, capsys, no_episodes, url):
    code, err = _err(capsys, "run", "--tasks", "sqlite-restock", "--policy", "http", "--base-url", url,
                     "--model", "x", "--out", str(tmp_path / "r.jsonl"))
    assert code == 2 and f"--base-url {url!r}" in err and "http://localhost:8000/v1" in err


def test_run_refuses_flags_the_policy_does_not_use(tmp_path, capsys, no_episodes):
    code, err = _err(capsys, "run", "--tasks", "sqlite-restock", "--policy", "reference", "--ckpt", "X")
    assert code == 2 and "--policy reference does not use --ckpt" in err
    code, err = _err(capsys, "run", "--policy", "noop", "--temperature", "0.5", "--max-tokens", "9")
    assert code == 2 and "does not use --temperature, --max-tokens; drop them" in err
    code, err = _err(capsys, "run", "--policy", "http", "--base-url", "http://h/v1", "--model", "m",
                     "--ckpt", "X", "--tokenizer", "t.json")
    assert code == 2 and "--policy http does not use --ckpt, --tokenizer" in err
    code, err = _err(capsys, "run", "--policy", "k3", "--ckpt", "X", "--base-url", "http://h/v1")
    assert code == 2 and "--policy k3 does not use --base-url" in err
    # the backend's flag too: without --backend ray the episodes ran locally, the address unused and unsaid
    code, err = _err(capsys, "run", "--tasks", "sqlite-restock", "--ray-address", "127.0.0.1:6379")
    assert code == 2 and "--ray-address is for --backend ray (this run's backend is process)" in err


def test_a_ray_address_where_nothing_listens_fails_at_once():
    """Ray retried a dead address for minutes with warnings; one connection attempt says so."""
    import socket
    import time

    from k3.agentenv.rollout import _check_ray_address

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        with pytest.raises(ValueError, match=f"nothing answers at 127.0.0.1:{port}.*ray start --head"):
            _check_ray_address(address)
    assert time.monotonic() - t0 < 10
    with socket.socket() as s:  # a listening port passes; "auto" is Ray's to resolve
        s.bind(("127.0.0.1", 0))
        s.listen()
        _check_ray_address(f"127.0.0.1:{s.getsockname()[1]}")
    _check_ray_address("auto")


def test_pool_workers_share_the_cores(monkeypatch):
    """Each spawned rollout worker took every core for torch (a k3 policy's model), N workers oversubscribing the
    machine N times; the pool's initializer gives each its share."""
    import os

    import torch

    from k3.agentenv.rollout import _pool_worker_init

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        _pool_worker_init(1)
        assert os.environ["OMP_NUM_THREADS"] == "1" and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_run_checks_out_up_front(tmp_path, capsys, no_episodes):
    code, err = _err(capsys, "run", "--tasks", "sqlite-restock", "--out", str(tmp_path))
    assert code == 2 and "is a directory" in err and ".tmp" not in err
    (tmp_path / "f").write_text("")
    code, err = _err(capsys, "run", "--tasks", "sqlite-restock", "--out", str(tmp_path / "f" / "r.jsonl"))
    assert code == 2 and "is a file, not a directory" in err


def test_redteam_list_honours_json_quick_and_only(capsys):
    from k3.agentenv.redteam import ATTACKS

    assert main(["agentenv", "redteam", "--list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [a["name"] for a in listed] == [a.name for a in ATTACKS]
    assert {"name", "category", "task", "quick"} <= set(listed[0])
    assert main(["agentenv", "redteam", "--list", "--quick", "--json"]) == 0
    assert [a["name"] for a in json.loads(capsys.readouterr().out)] == [a.name for a in ATTACKS if a.quick]
    name = ATTACKS[0].name
    assert main(["agentenv", "redteam", "--list", "--only", name]) == 0
    assert capsys.readouterr().out.split()[0] == name
    code, err = _err(capsys, "redteam", "--list", "--only", ",")
    assert code == 2 and "names no attack" in err
    code, err = _err(capsys, "redteam", "--list", "--only", "nope")
    assert code == 2 and "unknown attack(s) ['nope']" in err
    # an attack outside the quick set with --quick: nothing to run, refused (a report of 0 attempts read "ok")
    slow = next(a.name for a in ATTACKS if not a.quick)
    code, err = _err(capsys, "redteam", "--quick", "--only", slow)
    assert code == 2 and f"no attack to run: {slow} is not in the quick set" in err


def test_run_says_why_episodes_failed(tmp_path, capsys, monkeypatch):
    """policy_error / sandbox_error episodes: the summary counts them, stderr says why (each message once)."""
    import k3.agentenv.rollout as rollout
    import k3.agentenv.sandbox as sandbox
    from k3.agentenv.cli import error_report

    def fake_rollouts(tasks, spec, n, **kw):
        base = {"task_id": "t", "family": "sqlite", "dialect": "react", "reward": 0.0, "steps": 1,
                "duration_s": 0.1, "parse_errors": 0}
        return [dict(base, status="policy_error", error="HTTP 400: context_length_exceeded"),
                dict(base, status="policy_error", error="HTTP 400: context_length_exceeded"),
                dict(base, status="sandbox_error", error="bwrap: no permission"),
                dict(base, status="finished", error=None)]

    monkeypatch.setattr(rollout, "run_rollouts", fake_rollouts)
    monkeypatch.setattr(sandbox, "check_sandbox", lambda: "ok")
    code = main(["agentenv", "run", "--tasks", "sqlite-restock", "--policy", "noop", "--episodes", "4",
                 "--out", str(tmp_path / "r.jsonl")])
    err = capsys.readouterr().err
    assert code == 0  # some episodes finished
    assert "policy_error in 2 episodes: HTTP 400: context_length_exceeded" in err
    assert "sandbox_error in 1 episode: bwrap: no permission" in err
    many = [{"status": "policy_error", "error": f"e{i}"} for i in range(5)]
    lines = error_report(many, limit=3)
    assert len(lines) == 4 and lines[-1].startswith("... and 2 other error messages")
    assert error_report([{"status": "finished"}]) == []

