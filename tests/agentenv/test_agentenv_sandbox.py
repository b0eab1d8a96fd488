import os
import socket
import time

import pytest

from k3.agentenv.actions import execute, make_action
from k3.agentenv.redteam import _processes
from k3.agentenv.sandbox import (Limits, Probe, SandboxConfig, SandboxError, SandboxUnavailable, Session,
                                 check_sandbox, default_config)

FILES = {"a.py": (b"def f(x):\n    return x + 1\n", 0o644), "d/b.txt": (b"one\ntwo\nthree\n", 0o644)}


def test_isolation_properties(sandbox, tmp_path):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    marker = f"k3-sbx-test-{os.getpid()}-{time.monotonic_ns()}"
    probe = Probe(sandbox)  # a verification sandbox started early must be invisible to the episode
    with Session(FILES, sandbox) as s:
        def sh(cmd):
            r = s.run(cmd)
            assert r["ok"], r
            return r["output"]
        assert sh("id -u; hostname").split() == ["1000", "sandbox"]
        # only the system directories and the sandbox's own mounts; no host home, repo or /var
        assert set(sh("ls /").split()) <= {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc",
                                          "sbin", "tmp", "usr", "workspace"}
        # own PID namespace: only bwrap's init, the executor, bash and ps (not the probe's sandbox)
        assert len(sh("ps -e --no-headers").splitlines()) <= 5

        status = sh("grep -E '^(CapEff|NoNewPrivs)' /proc/self/status")
        assert "0000000000000000" in status and "NoNewPrivs:\t1" in status
        # read-only system, read-only root, private writable /tmp and /workspace
        assert "Read-only file system" in sh("touch /usr/x 2>&1; touch /x 2>&1; true")
        sh(f"echo hi > /tmp/{marker}")
        assert not os.path.exists(f"/tmp/{marker}")
        # no network: the host's loopback listener is not reachable, outside is unreachable
        out = sh(f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), 1)\" 2>&1; "
                 "python3 -c \"import socket; socket.create_connection(('192.0.2.1', 9), 1)\" 2>&1; true")
        assert "Connection refused" in out and "unreachable" in out
        with pytest.raises(OSError):
            listener.accept()
        # the tmpfs workspace has its size limit
        assert sh("df -B1 --output=size /workspace | tail -1").strip() == str(sandbox.limits.workspace_bytes)
        with pytest.raises(SandboxError):
            s.run("kill -9 -1")  # kills everything it can see: only its own sandbox
    listener.close()
    reply = probe.run({"entries": [], "checks": [], "runners": {}})
    assert reply == {"ok": True, "observations": {}}  # untouched by the episode's kill -9 -1


def test_resource_limits(fast_sandbox):
    lim = fast_sandbox.limits
    with Session({}, fast_sandbox) as s:
        r = s.run("python3 -c \"import os\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
                  "            import time; time.sleep(5); os._exit(0)\n        n += 1\n"
                  "except OSError as e:\n    print('forks', n, e.errno)\"")
        forks = int(r["output"].split()[1])
        assert 0 < forks < lim.nproc and r["output"].split()[2] == "11", r
        r = s.run("python3 -c 'bytearray(1 << 30)' 2>&1 | tail -1")
        assert "MemoryError" in r["output"]
        r = s.run(f"head -c {lim.fsize_bytes + 4096} /dev/zero > big; echo rc=$?; stat -c %s big")
        assert int(r["output"].split()[-1]) == lim.fsize_bytes
        t = time.monotonic()
        r = s.run("sleep 100", timeout=1)
        assert r["timed_out"] and time.monotonic() - t < 3
        r = s.run("yes | head -c 5000000")
        assert r["truncated_bytes"] > 0 and len(r["output"]) < lim.output_bytes + 200
        s.run("sleep 300 & echo started")
        assert "sleep" not in s.run("ps -e -o comm")["output"]  # background work dies with its command
        r = s.run("while :; do :; done", timeout=30)  # capped at the configured command timeout
        # here the CPU limit equals the wall limit, so either may stop the loop first; both say so
        assert r["timed_out"] != r["cpu_limited"] and r["duration_s"] < lim.command_timeout_s + 2, r
        assert r["exit_code"] in (-9, -24)


def test_cpu_limit_reported(sandbox):
    """A CPU-bound command stopped by RLIMIT_CPU before its wall-clock timeout is reported as such."""
    lim = sandbox.limits.replace(cpu_s=1, command_timeout_s=20.0)
    cfg = SandboxConfig(**{**sandbox.__dict__, "limits": lim}).validate()
    with Session({}, cfg) as s:
        r = s.run("while :; do :; done")
        assert r["cpu_limited"] and not r["timed_out"] and r["exit_code"] in (-9, -24), r
        assert r["duration_s"] < 10
        r = s.run("sh -c 'kill -9 $$'")  # killed by a signal, but not by the CPU limit
        assert r["exit_code"] == -9 or r["exit_code"] == 137, r
        assert not r["cpu_limited"] and not r["timed_out"]
        ok, text = execute(s, make_action("run", {"command": "while :; do :; done"}))
        assert not ok and "CPU time limit" in text


def test_file_tools(sandbox):
    with Session(FILES, sandbox) as s:
        assert s.read("d/b.txt", offset=2, limit=1)["lines"] == ["two\n"]
        assert s.write("new/dir/c.txt", "x\n")["ok"]
        assert s.edit("a.py", "x + 1", "x + 2")["ok"]
        assert "return x + 2" in s.run("cat a.py")["output"]
        assert s.search(r"t\w+", "d")["matches"] == ["d/b.txt:2:two", "d/b.txt:3:three"]
        for bad in (s.edit("a.py", "nope", "x"), s.edit("d/b.txt", "e", "E"), s.read("/etc/hostname"),
                    s.read("../../usr/bin/python3"), s.read("d"), s.write("/tmp/x", "y"),
                    s.search("(unclosed", ".")):
            assert not bad["ok"] and bad["error"]
        entries = {e["path"]: e for e in s.export()}
        assert entries["a.py"]["type"] == "file" and entries["new/dir"]["type"] == "dir"


def test_teardown_leaves_no_process(sandbox):
    uid = sandbox.drop_to_uid if os.geteuid() == 0 else None
    before = frozenset(int(p.split()[0]) for p in _processes(uid, "sleep 300"))

    s = Session({}, sandbox)
    s.run("(setsid sleep 300 > /dev/null 2>&1 &); (nohup sleep 300 > /dev/null 2>&1 &)")
    ours = {p.split()[0] for p in _processes(uid, "sleep 300", before)}  # this sandbox's processes
    assert ours or uid is None  # alive while the sandbox is

    def left():  # of those, the ones still alive (other jobs' sandboxes run as the same uid: not counted)
        return [p for p in _processes(uid, "sleep 300", before) if p.split()[0] in ours]
    s.close()
    deadline = time.monotonic() + 10  # the loop ends as soon as they are gone; 10 s only for a starved host
    while left() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left()


def test_missing_bubblewrap_is_a_clear_error():
    with pytest.raises(SandboxUnavailable, match="apt-get install -y bubblewrap"):
        check_sandbox(SandboxConfig(bwrap="/nonexistent/bwrap"))
    with pytest.raises(SandboxUnavailable, match="does not exist"):
        check_sandbox(SandboxConfig(python="/nonexistent/python3"))


def test_bad_limits_are_rejected():
    with pytest.raises(ValueError, match="nproc"):
        Limits(nproc=0).validate()
    with pytest.raises(ValueError, match="mem_bytes"):
        Limits(mem_bytes=1 << 20).validate()
    with pytest.raises(ValueError, match="isolation"):
        SandboxConfig(isolation="docker").validate()


def test_insecure_baseline_runs_the_same_programs():
    cfg = default_config(isolation="none")
    with Session(FILES, cfg) as s:
        r = s.run("cat a.py; pwd")
        assert "return x + 1" in r["output"] and "k3-agentenv-insecure-" in r["output"]
        root = r["output"].split()[-1]
    assert not os.path.exists(root)  # its host temp dir is removed


def test_agent_commands_cannot_reach_the_executor(sandbox):
    """The executor (pid 2) is non-dumpable: no /proc/2/fd, no /proc/2/mem, no forged replies."""
    with Session({}, sandbox) as s:
        out = s.run("echo '{\"ok\": true, \"entries\": []}' > /proc/2/fd/1; cat /proc/2/environ; "
                    "python3 -c \"open('/proc/2/mem', 'rb')\"; true")["output"]
        assert out.count("Permission denied") == 3, out
        assert s.run("echo consistent")["output"] == "consistent\n"
        assert s.export() == []


def test_truncated_output_cuts_on_whole_characters(sandbox):
    """Head and tail of a long output keep whole UTF-8 characters: 3-byte characters across a cut that
    falls mid-character come out without U+FFFD, and the dropped count includes the cut character's bytes."""
    with Session({}, sandbox) as s:
        for ch in ("\u20ac", "\U0001f600", "\u00e9"):
            r = s.run(f"python3 -c \"import sys; sys.stdout.write({ch!r} * 20000)\"")
            out = r["output"]
            assert r["truncated_bytes"] > 0 and "\ufffd" not in out, (ch, out[:20], out[-20:])
            head, _, tail = out.partition("\n[... ")
            n = int(tail.split(" bytes truncated")[0])
            tail = tail.split("...]\n", 1)[1]
            assert set(head) == {ch} and set(tail) == {ch}
            assert len((head + tail).encode()) + n == 20000 * len(ch.encode())
        # not truncated, but longer than the head's half: the character across the halves' seam stays whole
        r = s.run("python3 -c \"import sys; sys.stdout.write('\u20ac' * 3000)\"")
        assert r["truncated_bytes"] == 0 and r["output"] == "\u20ac" * 3000


def test_exit_codes_are_the_commands_own(sandbox):
    """A command whose output ends before it exits (coreutils close stdout first; this script closes both
    streams, waits, then exits 3) reports its own exit status, not -9 from the cleanup kill nor 0 from a
    status reaped by the cleanup."""
    with Session(FILES, sandbox) as s:
        for cmd, want in [("ls", 0), ("ls /nonexistent", 2), ("cat a.py", 0), ("grep zzz a.py", 1),
                          ("exec 2>&-; sleep 0.2; exec >&-; sleep 0.1; exit 3", 3)]:
            for _ in range(3):
                r = s.run(cmd)
                assert r["ok"] and r["exit_code"] == want and not r["timed_out"], (cmd, r)


def test_a_timed_out_command_is_a_failure_with_the_kill_status(sandbox):
    """A command killed at its timeout reports -9 and fails; its status used to be lost to the cleanup's
    reaping at times and read as exit code 0, which the agent saw as a success."""
    from k3.agentenv.actions import execute, make_action

    with Session({}, sandbox) as s:
        for cmd in ["sleep 30", "while :; do :; done"] + ["sleep 30 & sleep 30"] * 16:  # the last lost it 3 in 10
            r = s.run(cmd, 0.3)
            assert r["timed_out"] and r["exit_code"] == -9, (cmd, r)
        ok, text = execute(s, make_action("run", {"command": "sleep 30", "timeout": 0.3}))
        assert not ok and text.startswith("exit code: -9 (killed: timed out")


def test_read_reaches_every_line_of_a_large_file_and_says_where_it_stops(sandbox):
    """A 10,000-line file (about 530 KB, twice the read size limit): any range can be read; a read that hits the
    limit ends on a whole line and names the next one; a line longer than the limit is cut and says so."""
    from k3.agentenv.actions import execute, make_action

    big = "".join(f"line {i} " + "x" * 45 + "\n" for i in range(1, 10_001)).encode()
    files = {"big.txt": (big, 0o644), "long.txt": (b"a" * (300 * 1024) + b"\nend\n", 0o644)}
    with Session(files, sandbox) as s:
        r = s.read("big.txt", offset=9000, limit=3)
        assert r["ok"] and r["total_lines"] == 10_000 and r["lines"][0].startswith("line 9000 ")
        r = s.read("big.txt")  # 2000 lines fit under the limit
        assert len(r["lines"]) == 2000 and r["truncated"] and r["cut_line"] is None
        r = s.read("big.txt", limit=10_000)  # the byte limit ends the read on a whole line
        n = len(r["lines"])
        assert 4000 < n < 10_000 and r["lines"][-1] == f"line {n} " + "x" * 45 + "\n" and r["last_line"] == n
        ok, text = execute(s, make_action("read", {"path": "big.txt", "limit": 10_000}))
        assert ok and text.endswith(f"[lines 1-{n} of 10000; read on from line {n + 1}]")
        ok, text = execute(s, make_action("read", {"path": "big.txt", "offset": 20_000}))
        assert ok and text == "(no lines in that range: the file has 10000 lines)"
        ok, text = execute(s, make_action("read", {"path": "long.txt"}))
        assert ok and "line 1 is cut" in text and "read on from line 2" in text
        assert s.read("big.txt", limit=-1)["ok"] is False  # the executor refuses it too
        long_line = "pad " * 200 + "needle" + " tail" * 100
        s.write("s.txt", long_line + "\n")
        (m,) = s.search("needle", "s.txt")["matches"]
        assert "needle" in m and m.startswith("s.txt:1:...") and m.endswith("...")


def test_a_command_past_the_argument_size_limit_runs(sandbox):
    """One argv string is capped at 128 KiB: a longer command (e.g. the shell form Codex's dialect gives a large
    write without a final newline) failed with E2BIG; it runs from a script file, which is gone afterwards."""
    from k3.agentenv.dialects import make_dialect, make_variant

    content = "x" * 150_000  # no final newline: Codex's patch cannot carry it, so it becomes a shell command
    d = make_dialect(make_variant("codex"))
    (action,) = d.parse(d.render_call(make_action("write", {"path": "big.txt", "content": content})))
    assert action.tool == "run" and len(action.args["command"]) > 128 * 1024
    with Session(FILES, sandbox) as s:
        ok, obs = execute(s, action)
        assert ok, obs
        r = s.run(f"wc -c < big.txt; printf '%s' '{'y' * 140_000}' | wc -c")
        assert r["ok"] and r["output"].split() == ["150000", "140000"], r
        r = s.run("ls -a \"${TMPDIR:-/tmp}\" | grep -c k3-command || true")  # the scripts were removed
        assert r["ok"] and r["output"].split() == ["0"], r
