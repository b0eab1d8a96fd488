import json

import pytest

from k3.agentenv.policies import ScriptedPolicy
from k3.agentenv.rollout import EpisodeConfig, format_summary, run_episode, run_rollouts, summarize
from k3.agentenv.tasks import load_task, load_tasks, tasks_root
from k3.cli import main


def test_parallel_rollouts_write_jsonl(sandbox, tmp_path):
    tasks = load_tasks("pyfix-median,sqlite-trim-names,files-organize")
    out = tmp_path / "r.jsonl"
    recs = run_rollouts(tasks, {"kind": "reference"}, 6, workers=2, seed=3, out=out,
                        config=EpisodeConfig(sandbox=sandbox))
    lines = [json.loads(l) for l in out.read_text().splitlines()]
    assert len(lines) == 6 and not list(tmp_path.glob(".*.tmp"))
    assert sorted(r["seed"] for r in lines) == list(range(3, 9))
    for r in lines:
        assert r["reward"] == 1.0 and r["status"] == "finished"
        assert r["transcript"][0]["role"] == "system" and r["dialect"] in r["variant"]["dialect"]
        assert r["verifier"]["checks"] and r["task_checksum"]
    table = format_summary(summarize(recs))
    assert "family:pyfix" in table and "all:all" in table


def test_broken_sandbox_scores_zero(sandbox):
    task = load_task(tasks_root() / "pyfix-median")
    sol = list(task.solution[:-1]) + [{"tool": "run", "command": "kill -9 -1"}]
    rec = run_episode(task, ScriptedPolicy(sol), 0, EpisodeConfig(sandbox=sandbox))
    assert rec["status"] == "sandbox_error" and rec["reward"] == 0.0
    assert rec["scoring"] == "counted" and rec["exclusion"] is None  # the agent broke it: the 0 counts


RUN_SCRIPT = """
import sys
from k3.agentenv.rollout import run_rollouts
from k3.agentenv.tasks import load_tasks
run_rollouts(load_tasks("pyfix-median,files-organize"), {"kind": "reference"}, 8, workers=1, seed=0, out=sys.argv[1])
"""


def test_a_killed_run_keeps_its_finished_episodes_and_resumes(sandbox, tmp_path):
    """SIGKILL of a run lost every episode (they sat in a temporary file the next run deleted): each is appended and
    fsynced as it finishes, and resume runs only the others; a line cut short by the kill is dropped."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "r.jsonl"
    p = subprocess.Popen([sys.executable, "-c", RUN_SCRIPT, str(out)], start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not out.exists() or out.read_bytes().count(b"\n") < 3):
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    kept = out.read_bytes()
    kept = kept[:kept.rfind(b"\n") + 1]
    n = kept.count(b"\n")
    assert 3 <= n < 8, n
    out.write_bytes(kept + b'{"task_id": "pyfix-med')  # what a kill in the middle of a write leaves
    tasks = load_tasks("pyfix-median,files-organize")
    recs = run_rollouts(tasks, {"kind": "reference"}, 8, workers=1, seed=0, out=out, resume=True)
    assert [r["episode"] for r in recs] == list(range(8)) and all(r["reward"] == 1.0 for r in recs)
    data = out.read_bytes()
    assert data.startswith(kept) and data.count(b"\n") == 8  # the finished ones kept as they were, none redone
    assert sorted(json.loads(line)["episode"] for line in data.splitlines()) == list(range(8))
    with pytest.raises(ValueError, match="another run"):  # other seeds: not this run's episodes
        run_rollouts(tasks, {"kind": "reference"}, 8, workers=1, seed=1, out=out, resume=True)
    assert out.read_bytes() == data


def test_cli_resume(sandbox, tmp_path, capsys):
    out = tmp_path / "cli.jsonl"
    args = ["agentenv", "run", "--tasks", "files-greet-exec", "--policy", "reference", "--episodes", "2",
            "--workers", "1", "--out", str(out)]
    assert main(args) == 0
    first = out.read_bytes()
    assert main(args + ["--resume"]) == 0 and out.read_bytes() == first  # nothing left to run
    text = capsys.readouterr().out
    assert "excluded: 0 of 2 episodes (0.0%)" in text
    out.write_bytes(b"[" * 100_000 + b"]" * 100_000 + b"\n")
    assert main(args + ["--resume"]) == 2
    err = capsys.readouterr().err
    assert "not a trajectory record (nested deeper than" in err and "Traceback" not in err


def test_cli(sandbox, tmp_path, capsys):
    out = tmp_path / "cli.jsonl"
    assert main(["agentenv", "run", "--tasks", "files-greet-exec", "--policy", "reference",
                 "--episodes", "2", "--workers", "1", "--out", str(out), "--dialects", "kimi,codex"]) == 0
    text = capsys.readouterr().out
    assert "family:files" in text and len(out.read_text().splitlines()) == 2
    assert {json.loads(l)["dialect"] for l in out.read_text().splitlines()} <= {"kimi", "codex"}
    assert main(["agentenv", "tasks", "--select", "sqlite"]) == 0
    assert "11 tasks: sqlite 11" in capsys.readouterr().out
    assert main(["agentenv", "run", "--tasks", "nope"]) == 2
    assert "no task matches" in capsys.readouterr().err
    assert main(["agentenv", "run", "--dialects", "cobol"]) == 2
    assert main(["agentenv", "run", "--tasks", "pyfix-median", "--episodes", "0"]) == 2
    assert main(["agentenv", "run", "--policy", "http"]) == 2
    for bad in ("0", "-1"):  # 0 used to mean the task's own limit, -1 an episode of no steps
        assert main(["agentenv", "run", "--tasks", "pyfix-median", "--max-steps", bad]) == 2
        assert "max_steps" in capsys.readouterr().err
    assert main(["agentenv", "redteam", "--list"]) == 0


def test_ray_rollouts_match_process_pool(sandbox, tmp_path):
    # a real local Ray instance (2 CPUs); the same seeds give the same variants and verified rewards
    tasks = load_tasks("pyfix-median,files-organize")
    cfg = EpisodeConfig(sandbox=sandbox)
    ray_recs = run_rollouts(tasks, {"kind": "reference"}, 3, workers=2, seed=5, config=cfg, backend="ray",
                            out=tmp_path / "ray.jsonl")
    local = run_rollouts(tasks, {"kind": "reference"}, 3, workers=1, seed=5, config=cfg)
    assert [r["reward"] for r in ray_recs] == [1.0, 1.0, 1.0]
    assert [(r["task_id"], r["seed"], r["variant"]) for r in ray_recs] == \
        [(r["task_id"], r["seed"], r["variant"]) for r in local]
    assert len((tmp_path / "ray.jsonl").read_text().splitlines()) == 3


def test_unknown_backend():
    import pytest

    with pytest.raises(ValueError, match="backend 'dask' is unknown"):
        run_rollouts(load_tasks("pyfix-median"), {"kind": "noop"}, 1, backend="dask")


def test_a_killed_run_takes_its_pool_workers_with_it(sandbox, tmp_path):
    """SIGKILL of `k3 agentenv run --workers 2` (the OOM killer, `kill -9`) left both workers running episodes for
    nobody, re-parented to init; they now die with the run (PR_SET_PDEATHSIG), and the pool's helper with them."""
    import os
    import signal
    import subprocess
    import sys
    import time

    def children(pid: int) -> list[int]:
        found = []
        for d in os.listdir("/proc"):
            try:
                if d.isdigit() and int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(d))
            except (OSError, IndexError, ValueError):
                pass
        return found

    def alive(pid: int) -> bool:
        try:
            return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    run = subprocess.Popen([sys.executable, "-m", "k3.cli", "agentenv", "run", "--tasks", "files", "--episodes",
                            "500", "--workers", "2", "--out", str(tmp_path / "r.jsonl")],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(kids) < 3 and time.monotonic() < deadline:  # two workers and multiprocessing's resource tracker
            assert run.poll() is None
            time.sleep(0.2)
            kids = children(run.pid)
        assert len(kids) >= 3, kids
        time.sleep(1.0)  # the workers are inside episodes
        run.send_signal(signal.SIGKILL)
        run.wait(30)
        deadline = time.monotonic() + 20
        while any(alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [k for k in kids if alive(k)], "processes of the killed run outlived it"
    finally:
        run.kill()
        for k in kids:
            if alive(k):
                os.kill(k, signal.SIGKILL)


def _kill_a_worker_while(run):
    """Run `run()` in a thread and SIGKILL one of its pool's worker processes once they are up."""
    import multiprocessing as mp
    import os
    import signal
    import threading
    import time

    box = {}
    t = threading.Thread(target=lambda: box.setdefault("records", run()))
    t.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(mp.active_children()) < 2:
        time.sleep(0.05)
    os.kill(mp.active_children()[0].pid, signal.SIGKILL)
    t.join(300)
    return box["records"]


def test_a_killed_worker_reruns_the_unfinished_episodes(sandbox, tmp_path, caplog, monkeypatch):
    """A worker killed mid-run (OOM killer, kill -9) broke the pool and every unfinished episode became worker_error;
    they run again on a fresh pool, none recorded twice. Past MAX_POOL_RESTARTS they are worker_error records, and
    a run of nothing else exits 1 naming them."""
    import k3.agentenv.rollout as rollout

    tasks = load_tasks("pyfix-median,files-organize")
    cfg = EpisodeConfig(sandbox=sandbox)
    recs = _kill_a_worker_while(lambda: run_rollouts(tasks, {"kind": "reference"}, 6, workers=2, seed=0, config=cfg))
    assert sorted(r["seed"] for r in recs) == list(range(6))
    assert all(r["status"] == "finished" and r["reward"] == 1.0 for r in recs), [r["status"] for r in recs]
    assert "a rollout worker died" in caplog.text
    monkeypatch.setattr(rollout, "MAX_POOL_RESTARTS", 0)
    recs = _kill_a_worker_while(lambda: run_rollouts(tasks, {"kind": "reference"}, 6, workers=2, seed=0, config=cfg))
    assert len(recs) == 6 and any(r["status"] == "worker_error" for r in recs)
    from k3.agentenv.cli import error_report
    assert any(line.startswith("worker_error in") for line in error_report(recs))


def test_a_file_name_with_a_backslash_is_verified(sandbox):
    """A backslash is an ordinary character in a POSIX file name: a solved task beside a file named 'x\\y' scores 1
    (the export refused the name, and the episode was a sandbox error that RL drops)."""
    task = load_task(tasks_root() / "pyfix-median")
    sol = list(task.solution[:-1]) + [{"tool": "run", "command": "touch 'x\\y'"}, task.solution[-1]]
    rec = run_episode(task, ScriptedPolicy(sol), 0, EpisodeConfig(sandbox=sandbox))
    assert rec["status"] == "finished" and rec["reward"] == 1.0, rec.get("error")
