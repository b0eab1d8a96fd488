"""In-sandbox verification probe: recreate the final workspace, run check groups, report observations.

Never imported by k3: its source runs as `python3 -I -S -c` inside a *fresh* sandbox after the
episode's sandbox is gone (argv: ROOT CONFIG_JSON; stdin: one JSON payload). Standard library only.

It reports what it observed (return values, query rows, command output). It never sees the expected
values — they stay on the host — so whatever agent code running beside it does, it can only change
observations, and matching the hidden expectations means computing the right answers.
Each check group starts from a freshly written copy of the workspace, an empty /tmp (HOME), /dev/shm and
inputs directory, in a child process with its own limits and timeout, and every process left over is killed
before the next group: nothing one check's code leaves behind (a usercustomize.py in HOME, a daemon, a file)
reaches another. Python runs with -s -S (no user site, no `site`) and PYTHONNOUSERSITE=1.

Before it reads the payload it says {"ready": true}: a probe that fails before that line failed before anything
of the episode's reached it.
"""
import base64
import json
import os
import re
import resource
import select
import shutil
import signal
import stat
import subprocess
import sys
import time

ROOT = os.path.realpath(sys.argv[1])
CFG = json.loads(sys.argv[2])
PY = sys.executable or "/usr/bin/python3"
PYTHON_NAME = re.compile(r"python(3(\.\d+)?)?$")


def harden():
    for name, key in (("RLIMIT_AS", "mem_bytes"), ("RLIMIT_FSIZE", "fsize_bytes"),
                      ("RLIMIT_NOFILE", "nofile"), ("RLIMIT_CORE", None)):
        value = 0 if key is None else int(CFG[key])
        resource.setrlimit(getattr(resource, name), (value, value))
    try:
        import ctypes
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE=0: no ptrace, no /proc/<us>/fd
    except Exception:
        pass


def child_limits():
    os.setsid()
    n = int(CFG["nproc"])
    resource.setrlimit(resource.RLIMIT_NPROC, (n, n))
    c = int(CFG["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (c, c))


def kill_leftovers():
    if CFG.get("pidns") and os.getpid() <= 3:
        # one pass suffices: a SIGKILLed process never runs user code again, and a fork racing
        # with the kill fails on the pending fatal signal; the second pass is belt and braces
        for _ in range(2):
            try:
                os.kill(-1, signal.SIGKILL)
            except OSError:  # ESRCH: nothing left to signal
                break
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break


def clear(path):
    """Empty `path`. Code under test may have taken its own permissions away (a directory of mode 0, or 0555
    with files inside): every directory gets rwx first, and anything that still stays is an error, never a
    file carried into the next check."""
    st = os.lstat(path)
    if st.st_mode & stat.S_IRWXU != stat.S_IRWXU:
        os.chmod(path, stat.S_IMODE(st.st_mode) | stat.S_IRWXU)
    stack = [path]
    while stack:
        d = stack.pop()
        for e in os.scandir(d):
            if e.is_dir(follow_symlinks=False):
                os.chmod(e.path, stat.S_IRWXU)
                stack.append(e.path)
    for name in os.listdir(path):
        p = os.path.join(path, name)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, ignore_errors=True)
        else:
            try:
                os.unlink(p)
            except OSError:
                pass
    left = os.listdir(path)
    if left:
        raise RuntimeError("could not clear %s between checks (%d entries stay)" % (path, len(left)))


def fresh_env():
    """The environment of one check, with its scratch space emptied: HOME and TMPDIR (the same directory) and,
    alone in a PID namespace, /dev/shm."""
    env = dict(CFG["env"], PYTHONNOUSERSITE="1")
    for d in sorted({env["HOME"], env["TMPDIR"]} | ({"/dev/shm"} if CFG.get("pidns") else set())):
        if os.path.isdir(d):
            clear(d)
    return env


def materialize(entries):
    """Write the exported workspace (validated by the host) into an emptied ROOT (and empty the inputs
    directory); drop bytecode caches."""
    clear(ROOT)
    clear(CFG["inputs_dir"])
    for e in entries:
        p = os.path.join(ROOT, e["path"])
        parts = e["path"].split("/")
        if "__pycache__" in parts or e["path"].endswith(".pyc"):
            continue  # stale or hand-made bytecode would run instead of the source
        if e["type"] == "dir":
            os.makedirs(p, exist_ok=True)
            os.chmod(p, (e.get("mode", 0o755) & 0o777) | 0o700)
        elif e["type"] == "file":
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "wb") as fh:
                fh.write(base64.b64decode(e["data"]))
            os.chmod(p, e.get("mode", 0o644) & 0o777)
        elif e["type"] == "symlink":
            os.makedirs(os.path.dirname(p), exist_ok=True)
            os.symlink(e["target"], p)


def run_child(argv, stdin, timeout, *, result_fd=False, cwd=None, out_cap=65536, err_cap=4096):
    """Run argv with limits in a fresh environment (fresh_env); returns dict(exit_code, timed_out, stdout,
    stderr[, results])."""
    env = fresh_env()
    fds = {}
    rfd = wfd = None
    pass_fds = ()
    if result_fd:
        rfd, wfd = os.pipe()
        pass_fds = (wfd,)
        stdin = stdin.replace(b"__RESULT_FD__", str(wfd).encode())
    proc = subprocess.Popen(argv, cwd=cwd or ROOT, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=pass_fds,
                            preexec_fn=child_limits, close_fds=True)
    if wfd is not None:
        os.close(wfd)
    fds[proc.stdout.fileno()] = ("stdout", bytearray(), out_cap)
    fds[proc.stderr.fileno()] = ("stderr", bytearray(), err_cap)
    if rfd is not None:
        fds[rfd] = ("results", bytearray(), 4 << 20)
    total = {k: 0 for k in ("stdout", "stderr", "results")}
    pending = memoryview(stdin)
    infd = proc.stdin.fileno()
    os.set_blocking(infd, False)
    if not pending:
        proc.stdin.close()
        infd = None
    deadline = time.monotonic() + timeout
    timed_out, exited_at = False, None
    open_fds = set(fds)
    while open_fds:
        now = time.monotonic()
        if now >= deadline:
            timed_out = proc.poll() is None
            break
        if exited_at is None and proc.poll() is not None:
            exited_at = now
        if exited_at is not None and now - exited_at > 0.1:
            break
        wl = [infd] if infd is not None else []
        r, w, _ = select.select(list(open_fds), wl, [], min(0.05, deadline - now))
        if w:
            try:
                n = os.write(infd, pending[:65536])
                pending = pending[n:]
            except (BrokenPipeError, OSError):
                pending = pending[:0]
            if not pending:
                proc.stdin.close()
                infd = None
        for fd in r:
            chunk = os.read(fd, 65536)
            if not chunk:
                open_fds.discard(fd)
                continue
            name, buf, cap = fds[fd]
            total[name] += len(chunk)
            if len(buf) < cap:
                buf += chunk[: cap - len(buf)]
    rc = None
    if not timed_out:
        # output closed is not the process gone (coreutils close stdout before exiting): take its real
        # exit status before the kill (-9) or kill_leftovers' reaping (a lost status reads as 0) can
        try:
            rc = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    if rc is None:  # timed out: take the killed command's status before kill_leftovers' reaping can lose it
        proc.kill()
        try:
            rc = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            rc = None
    kill_leftovers()
    if rfd is not None:
        os.close(rfd)
    for s in (proc.stdout, proc.stderr, proc.stdin):
        try:
            s.close()
        except (OSError, ValueError):
            pass
    out = {"exit_code": rc, "timed_out": timed_out}
    for fd, (name, buf, cap) in fds.items():
        out[name] = bytes(buf).decode("utf-8", "replace")
        if total[name] > cap:
            out[name + "_truncated"] = total[name] - cap
    return out


def sub_entries(entries, top):
    """The entries under the top-level directory `top`, re-rooted there."""
    prefix = top + "/"
    return [dict(e, path=e["path"][len(prefix):]) for e in entries if e["path"].startswith(prefix)]


def python_group(checks, runners, entries):
    materialize(entries)
    # one budget for the whole group: honest cases take milliseconds, so a loop or a bomb in the
    # agent's code costs at most check_timeout_s (+1 s to start), not once per case
    limit = float(CFG["check_timeout_s"])
    payload = {"root": ROOT, "result_fd": "__RESULT_FD__",
               "cases": [{"id": c["id"], "code": c["code"],
                          "timeout": min(float(c.get("timeout", limit)), limit)} for c in checks]}
    timeout = limit + 1.0
    # not -I: its -E would drop the pinned PYTHONHASHSEED (the environment is the host's, not the agent's)
    flags = ["-s", "-S", "-P"] if sys.version_info >= (3, 11) else ["-s", "-S"]  # 3.10: the runner drops ''
    res = run_child([PY, *flags, "-c", runners["python"]], json.dumps(payload).encode(),
                    timeout, result_fd=True)
    obs, seen = {}, {}
    for line in res.get("results", "").splitlines():
        try:
            item = json.loads(line)
            cid = item["id"]
        except Exception:
            continue
        seen[cid] = seen.get(cid, 0) + 1
        obs[cid] = item
    wanted = {c["id"] for c in checks}
    out = {}
    for cid in wanted:
        if seen.get(cid, 0) > 1:
            out[cid] = {"error": "the case reported more than once (forged or corrupted report)"}
        elif cid in obs:
            item = dict(obs[cid])
            item.pop("id", None)
            out[cid] = item
        else:
            out[cid] = {"error": "the case did not report (process exited, crashed or timed out)",
                        "exit_code": res["exit_code"], "timed_out": res["timed_out"],
                        "stderr": res["stderr"][-1000:]}
    return out


def sql_group(db, checks, runners, entries):
    materialize(entries)
    payload = {"root": ROOT, "db": db,
               "queries": [{"id": c["id"], "kind": c["kind"], "sql": c.get("sql")} for c in checks]}
    res = run_child([PY, "-I", "-S", "-c", runners["sql"]], json.dumps(payload).encode(),
                    float(CFG["check_timeout_s"]), out_cap=8 << 20)
    try:
        obs = json.loads(res["stdout"])
    except Exception:
        obs = None
    out = {}
    for c in checks:
        if isinstance(obs, dict) and isinstance(obs.get(c["id"]), dict):
            out[c["id"]] = obs[c["id"]]
        else:
            out[c["id"]] = {"error": "the query runner did not report", "exit_code": res["exit_code"],
                            "timed_out": res["timed_out"], "stderr": res["stderr"][-1000:]}
    return out


def command_check(c, entries):
    materialize(entries)
    inputs = CFG["inputs_dir"]
    for rel, text in sorted(c.get("inputs", {}).items()):
        p = os.path.join(inputs, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "w") as fh:
            fh.write(text)
    argv = [a.replace("{inputs}", inputs).replace("{workspace}", ROOT) for a in c["argv"]]
    if PYTHON_NAME.match(os.path.basename(argv[0])):  # a task's python3 check: no user site, no `site` hooks
        argv[1:1] = ["-s", "-S"]
    cwd = inputs if c.get("cwd") == "inputs" else ROOT
    try:
        res = run_child(argv, c.get("stdin", "").encode(), float(c.get("timeout",
                        CFG["check_timeout_s"])), cwd=cwd)
    except OSError as e:  # e.g. the agent's script is missing or not executable
        return {"error": "could not start %s: %s" % (argv[0], e)}
    return {"exit_code": res["exit_code"], "timed_out": res["timed_out"], "stdout": res["stdout"],
            "stdout_truncated": res.get("stdout_truncated", 0), "stderr": res["stderr"][-1000:]}


def main():
    harden()
    sys.stdout.write('{"ready": true}\n')  # started: from here on the failures may be the workspace's doing
    sys.stdout.flush()
    payload = json.loads(sys.stdin.buffer.read())
    entries, checks, runners = payload["entries"], payload["checks"], payload["runners"]
    observations = {}
    # python checks run as one group per `workspace` (a top-level directory of the snapshot, or the whole of
    # it): each group in its own process, on a fresh copy of only its directory, made the workspace root, so
    # code under test in one group can neither see nor import nor signal another group's
    groups = {}
    for c in checks:
        if c["kind"] == "python":
            groups.setdefault(c.get("workspace") or "", []).append(c)
    for ws, group in sorted(groups.items()):
        observations.update(python_group(group, runners, sub_entries(entries, ws) if ws else entries))
    dbs = {}
    for c in checks:
        if c["kind"] in ("sql", "sql_schema"):
            dbs.setdefault(c["db"], []).append(c)
    for db, group in sorted(dbs.items()):
        observations.update(sql_group(db, group, runners, entries))
    for c in checks:
        if c["kind"] == "command":
            observations[c["id"]] = command_check(c, entries)
    kill_leftovers()
    sys.stdout.write(json.dumps({"ok": True, "observations": observations}) + "\n")
    sys.stdout.flush()


main()
