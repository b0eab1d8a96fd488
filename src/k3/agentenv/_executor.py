"""In-sandbox executor for one episode: file tools and commands, one JSON request per line.

This file is never imported by k3. Its source is passed to `python3 -I -S -c` *inside* the sandbox
(argv: ROOT CONFIG_JSON), so it must use the standard library only. Everything it says is untrusted
by the host: an agent command running as the same user may kill or confuse it, which only ends the
agent's own episode (a broken episode scores 0).
"""
import base64
import json
import os
import re
import resource
import select
import signal
import stat
import subprocess
import sys
import tempfile
import time

ROOT = os.path.realpath(sys.argv[1])
CFG = json.loads(sys.argv[2])


def harden():
    """Hard limits on this process and everything it starts; no core dumps; not ptrace-able."""
    for name, key in (("RLIMIT_AS", "mem_bytes"), ("RLIMIT_FSIZE", "fsize_bytes"),
                      ("RLIMIT_NOFILE", "nofile"), ("RLIMIT_CORE", None)):
        value = 0 if key is None else int(CFG[key])
        resource.setrlimit(getattr(resource, name), (value, value))
    try:  # PR_SET_DUMPABLE=0: agent processes (same uid) cannot open /proc/<us>/fd or ptrace us
        import ctypes
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
    except Exception:
        pass
    os.umask(0o022)


def child_limits():
    os.setsid()
    n = int(CFG["nproc"])
    resource.setrlimit(resource.RLIMIT_NPROC, (n, n))
    c = int(CFG["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (c, c))


def kill_leftovers(pgid=None):
    """Kill the command's process group and, inside a PID namespace, every other process too."""
    if pgid is not None:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass
    # kill(-1) reaches every process we may signal except ourselves and the namespace init; only
    # safe when we are certain to be alone in our own PID namespace (bwrap: we are pid 2).
    if CFG.get("pidns") and os.getpid() <= 3:
        # one pass suffices: a SIGKILLed process never runs user code again, and a fork racing
        # with the kill fails on the pending fatal signal; the second pass is belt and braces
        for _ in range(2):
            try:
                os.kill(-1, signal.SIGKILL)
            except OSError:  # ESRCH: nothing left to signal
                break
    while True:  # reap our own children
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break


def resolve(path):
    """File tools stay inside the workspace; symlinks resolve inside the sandbox anyway."""
    if not isinstance(path, str) or not path or "\x00" in path:
        raise ValueError("path must be a non-empty string")
    full = os.path.normpath(path if os.path.isabs(path) else os.path.join(ROOT, path))
    real = os.path.realpath(full)
    if real != ROOT and not real.startswith(ROOT + os.sep):
        raise ValueError("path %r is outside the workspace %s; file tools only work inside it "
                         "(use the command tool for other paths)" % (path, ROOT))
    return real


def open_regular(path, flags, shown):
    """A file descriptor of the regular file at `path`. Opened non-blocking: opening a FIFO the agent handed to a
    file tool blocked this process (and the episode) until the host gave up on it."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise ValueError("%s is not a regular file (a directory, FIFO, socket or device); the file tools work "
                         "on regular files only" % shown)
    fd = os.open(path, flags | os.O_NONBLOCK, 0o644)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("%s is not a regular file; the file tools work on regular files only" % shown)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def op_init(req):
    for f in req["files"]:
        p = resolve(f["path"])
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as fh:
            fh.write(base64.b64decode(f["data"]))
        os.chmod(p, int(f.get("mode", 0o644)) & 0o777)
    return {"ok": True, "files": len(req["files"])}


def op_read(req):
    """Lines offset .. offset+limit-1 of a file, at most read_bytes of them (a line longer than that is cut and
    says so); the whole file is scanned for its line count, so any part of it can be read."""
    p = resolve(req["path"])
    fd = open_regular(p, os.O_RDONLY, req["path"])
    offset = 1 if req.get("offset") is None else int(req["offset"])
    limit = 2000 if req.get("limit") is None else int(req["limit"])
    if offset < 1 or limit < 1:
        raise ValueError("the first line and the number of lines must be >= 1")
    cap, used, chunk, cut, full, total = int(CFG["read_bytes"]), 0, [], False, False, 0
    with os.fdopen(fd, "rb") as fh:
        for total, raw in enumerate(fh, 1):
            if offset <= total < offset + limit and not full:
                if used + len(raw) > cap:  # the byte cap: end on the line before, or cut a first line alone
                    full = True
                    if chunk:
                        continue
                    raw, cut = raw[:cap], True
                used += len(raw)
                chunk.append(raw.decode("utf-8", "replace"))
    last = offset + len(chunk) - 1  # the last line shown (whole, or cut when `cut`)
    return {"ok": True, "first_line": offset, "lines": chunk, "total_lines": total, "last_line": last,
            "cut_line": last if cut else None, "truncated": cut or last < total}


def op_write(req):
    p = resolve(req["path"])
    if os.path.isdir(p):
        raise ValueError("%s is a directory" % req["path"])
    os.makedirs(os.path.dirname(p), exist_ok=True)
    data = req["content"].encode("utf-8")
    with os.fdopen(open_regular(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, req["path"]), "wb") as fh:
        fh.write(data)
    return {"ok": True, "bytes": len(data)}


def op_edit(req):
    p = resolve(req["path"])
    with os.fdopen(open_regular(p, os.O_RDONLY, req["path"]), "rb") as fh:
        text = fh.read().decode("utf-8")
    old, new = req["old"], req["new"]
    if not old:
        raise ValueError("old text must not be empty")
    n = text.count(old)
    if n == 0:
        raise ValueError("old text not found in %s; read the file and copy the text exactly"
                         % req["path"])
    if n > 1 and not req.get("replace_all"):
        raise ValueError("old text occurs %d times in %s; include more context to make it unique, "
                         "or ask the edit tool to replace every occurrence" % (n, req["path"]))
    text = text.replace(old, new) if req.get("replace_all") else text.replace(old, new, 1)
    with os.fdopen(open_regular(p, os.O_WRONLY | os.O_TRUNC, req["path"]), "wb") as fh:
        fh.write(text.encode("utf-8"))
    return {"ok": True, "replacements": n if req.get("replace_all") else 1}


def op_search(req):
    try:
        rx = re.compile(req["pattern"])
    except re.error as e:
        raise ValueError("bad regular expression: %s" % e)
    base = resolve(req.get("path") or ".")
    glob = req.get("glob")
    import fnmatch
    matches, limit = [], 200
    if os.path.isfile(base):
        walk = [(os.path.dirname(base), [], [os.path.basename(base)])]
    else:
        walk = os.walk(base)
    for dirpath, dirnames, filenames in walk:
        dirnames.sort()
        for name in sorted(filenames):
            if glob and not fnmatch.fnmatch(name, glob):
                continue
            fp = os.path.join(dirpath, name)
            try:
                st = os.lstat(fp)
                if not stat.S_ISREG(st.st_mode) or st.st_size > 2_000_000:
                    continue
                with open(fp, "rb") as fh:
                    data = fh.read()
            except OSError:
                continue
            if b"\x00" in data[:8192]:
                continue
            rel = os.path.relpath(fp, ROOT)
            for i, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
                m = rx.search(line)
                if m:
                    if len(line) > 300:  # a window around the match, its cuts marked
                        a = max(0, min(m.start() - 100, len(line) - 300))
                        line = ("..." if a else "") + line[a:a + 300] + ("..." if a + 300 < len(line) else "")
                    matches.append("%s:%d:%s" % (rel, i, line))
                    if len(matches) >= limit:
                        return {"ok": True, "matches": matches, "truncated": True}
    return {"ok": True, "matches": matches, "truncated": False}


def _whole_chars_end(buf):
    """len(buf) without a UTF-8 character that the end of buf cuts short."""
    for back in range(1, min(4, len(buf)) + 1):
        b = buf[-back]
        if b < 0x80:
            return len(buf)
        if b >= 0xC0:  # the lead byte of the last character: whole if its sequence fits in what is left
            need = 2 if b < 0xE0 else 3 if b < 0xF0 else 4
            return len(buf) if back >= need else len(buf) - back
    return len(buf)


# one argv string is capped at 128 KiB (the kernel's MAX_ARG_STRLEN): a longer command is run from a script file
LONG_COMMAND_BYTES = 100_000


def op_run(req):
    cmd = req["command"]
    if not isinstance(cmd, str) or not cmd.strip():
        raise ValueError("command must be a non-empty string")
    data = cmd.encode("utf-8", "surrogateescape")
    if len(data) <= LONG_COMMAND_BYTES:
        return _run_command(["/bin/bash", "-c", cmd], req)
    fd, script = tempfile.mkstemp(prefix=".k3-command-", suffix=".sh")  # (E2BIG: a big write failed under codex)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return _run_command(["/bin/bash", script], req)
    finally:
        os.unlink(script)


def _run_command(argv, req):
    cap = float(CFG["command_timeout_s"])
    timeout = min(float(req.get("timeout") or cap), cap)
    env = dict(CFG["env"])
    start = time.monotonic()
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=child_limits, close_fds=True)
    fd = proc.stdout.fileno()
    limit = int(CFG["output_bytes"])
    head, tail, total = bytearray(), bytearray(), 0
    deadline, timed_out, exited_at = start + timeout, False, None
    while True:
        now = time.monotonic()
        if now >= deadline:
            timed_out = proc.poll() is None
            break
        if exited_at is None and proc.poll() is not None:
            exited_at = now
        if exited_at is not None and now - exited_at > 0.05:
            break  # background processes may hold the pipe open; they are killed below
        r, _, _ = select.select([fd], [], [], min(0.05, deadline - now))
        if not r:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        total += len(chunk)
        if len(head) < limit // 2:
            take = limit // 2 - len(head)
            head += chunk[:take]
            chunk = chunk[take:]
        tail += chunk
        if len(tail) > limit // 2:
            del tail[: len(tail) - limit // 2]
    rc = None
    if not timed_out:
        # the output can end before the command does (coreutils close stdout before they exit): wait for
        # its real exit status first, so that neither the kill below (-9) nor kill_leftovers' reaping (which
        # would leave proc.wait() a status of 0) decides the exit code
        try:
            rc = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    if rc is None:
        # timed out: kill the command, then take its status before kill_leftovers' reaping can (a status
        # reaped there is lost, and proc.wait() would then report 0)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.kill()
        try:
            rc = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            rc = None
    # RLIMIT_CPU kills with SIGXCPU at the soft limit and SIGKILL at the hard one (equal here); the
    # command's own CPU time (this process's only reaped child so far) tells that kill from others
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
    cpu_limited = (not timed_out and rc in (-signal.SIGKILL, -signal.SIGXCPU)
                   and cpu >= 0.9 * float(CFG["cpu_s"]))
    kill_leftovers(proc.pid)
    proc.stdout.close()
    dropped = total - len(head) - len(tail)
    if dropped > 0:
        # the cuts fall on whole UTF-8 characters: a character split by a cut goes with the dropped bytes
        # (at most 3 bytes on each side) instead of showing as U+FFFD
        keep = _whole_chars_end(head)
        skip = 0
        while skip < min(3, len(tail)) and 0x80 <= tail[skip] < 0xC0:
            skip += 1
        dropped += len(head) - keep + skip
        head, tail = head[:keep], tail[skip:]
    if dropped > 0:
        text = head.decode("utf-8", "replace") + "\n[... %d bytes truncated ...]\n" % dropped + \
            tail.decode("utf-8", "replace")
    else:  # nothing dropped: head and tail are one byte string (a character may straddle them)
        text = (head + tail).decode("utf-8", "replace")
    return {"ok": True, "exit_code": rc, "output": text, "timed_out": timed_out,
            "cpu_limited": cpu_limited, "truncated_bytes": max(0, dropped),
            "duration_s": round(time.monotonic() - start, 4)}


def _let_owner(path, st, bits):
    """Give the owner `bits` on `path` (the agent may have taken them away; everything here is ours): an
    entry the export cannot read would otherwise vanish from what the verifier grades."""
    mode = stat.S_IMODE(st.st_mode)
    if mode & bits != bits:
        os.chmod(path, mode | bits)


def op_export(req):
    try:
        return _export()
    except OSError as e:
        return {"ok": False, "error": "the workspace cannot be read completely for verification: %s" % e}


def _export():
    entries, total = [], 0
    max_bytes, max_files = int(CFG["export_bytes"]), int(CFG["export_files"])
    _let_owner(ROOT, os.lstat(ROOT), 0o700)

    def unreadable(e):
        raise e

    for dirpath, dirnames, filenames in os.walk(ROOT, onerror=unreadable):
        dirnames.sort()
        for name in sorted(dirnames) + sorted(filenames):
            fp = os.path.join(dirpath, name)
            rel = os.path.relpath(fp, ROOT)
            st = os.lstat(fp)
            mode = stat.S_IMODE(st.st_mode)  # as the agent left it: that is what is exported
            if stat.S_ISLNK(st.st_mode):
                entries.append({"path": rel, "type": "symlink", "target": os.readlink(fp)})
            elif stat.S_ISDIR(st.st_mode):
                _let_owner(fp, st, 0o700)  # before os.walk descends into it
                entries.append({"path": rel, "type": "dir", "mode": mode})
            elif stat.S_ISREG(st.st_mode):
                _let_owner(fp, st, 0o400)
                total += st.st_size
                if total > max_bytes:
                    return {"ok": False, "error": "workspace holds more than %d bytes of files; "
                            "it cannot be exported for verification" % max_bytes}
                with open(fp, "rb") as fh:
                    data = fh.read()
                entries.append({"path": rel, "type": "file", "mode": mode,
                                "data": base64.b64encode(data).decode("ascii")})
            else:
                entries.append({"path": rel, "type": "other"})
            if len(entries) > max_files:
                return {"ok": False, "error": "workspace holds more than %d entries; it cannot be "
                        "exported for verification" % max_files}
    return {"ok": True, "entries": entries}


OPS = {"init": op_init, "read": op_read, "write": op_write, "edit": op_edit, "search": op_search,
       "run": op_run, "export": op_export}


def main():
    harden()
    out = sys.stdout.buffer
    for raw in sys.stdin.buffer:
        try:
            req = json.loads(raw)
            op = req.get("op")
            if op == "exit":
                out.write(b'{"ok": true}\n')
                out.flush()
                return
            if op not in OPS:
                raise ValueError("unknown op %r" % op)
            reply = OPS[op](req)
        except Exception as e:  # every failure becomes a message to the host, never a crash
            reply = {"ok": False, "error": "%s: %s" % (type(e).__name__, e)}
        out.write(json.dumps(reply).encode("utf-8") + b"\n")
        out.flush()


main()
