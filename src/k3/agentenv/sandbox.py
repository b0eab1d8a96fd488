"""Bubblewrap sandbox: one fresh, isolated filesystem per episode and per verification.

Each sandbox is one `bwrap` process with its own user, PID, network, IPC, UTS and cgroup namespaces,
a read-only `/usr` (plus the merged-usr symlinks), size-limited private tmpfs mounts for `/workspace`,
`/tmp` and `/dev/shm`, a read-only root, no capabilities, no new privileges and no nested user
namespaces. Inside it a small stdlib-only program (`_executor.py` for episodes, `_probe.py` for
verification) talks JSON lines over stdin/stdout; it sets hard rlimits on itself and per-command
rlimits (CPU, processes) on its children, and kills every leftover process after each command.

When the host process is root, bwrap is started as an unprivileged uid (65534 by default): as root,
RLIMIT_NPROC is not enforced, so a fork bomb would be unbounded.

Nothing the programs inside say is trusted: the host only uses their replies as data (observations)
that it compares against expectations that never enter a sandbox.
"""
from __future__ import annotations

import base64
import dataclasses
import errno
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from k3.fileio import MAX_JSON_DEPTH, loads_json

log = logging.getLogger(__name__)

_HERE = Path(__file__).resolve().parent
MiB = 1 << 20


class SandboxUnavailable(ValueError):
    """bubblewrap is missing or cannot create namespaces here; the message says what to do.

    `host_resources`: the host could not start a process (out of memory, processes or file descriptors)."""

    host_resources: bool = False


class SandboxError(RuntimeError):
    """The sandbox died, timed out or replied nonsense; the episode it served is broken."""


class SandboxTimeout(SandboxError):
    """The sandbox did not answer in time: possibly the work it was given (code it ran) rather than the sandbox."""


class SandboxStartError(SandboxError):
    """The sandbox failed before it held anything of the episode's (no workspace, no agent code): whatever went
    wrong, the agent cannot have caused it, so the episode measured nothing (see rollout.EXCLUSIONS)."""

    def __init__(self, message: str, host_resources: bool = False):
        super().__init__(message)
        self.host_resources = host_resources


# errnos of a host that cannot start another process: its shortage, not the sandbox's or the agent's doing
HOST_RESOURCE_ERRNOS = frozenset({errno.EAGAIN, errno.ENOMEM, errno.EMFILE, errno.ENFILE, errno.ENOSPC})
# most nesting the host parses in a sandbox's reply (observations are at most 64 Python levels deep, 3 JSON each)
REPLY_MAX_DEPTH = MAX_JSON_DEPTH


@dataclass(frozen=True)
class Limits:
    """Resource limits for one sandbox. Per-process limits are rlimits; sizes are tmpfs sizes."""

    cpu_s: int = 10                    # RLIMIT_CPU per command process
    mem_bytes: int = 512 * MiB         # RLIMIT_AS per process
    nproc: int = 32                    # RLIMIT_NPROC for the sandbox user (inside its user namespace)
    fsize_bytes: int = 16 * MiB        # RLIMIT_FSIZE: largest file a process may write
    nofile: int = 256                  # RLIMIT_NOFILE
    workspace_bytes: int = 64 * MiB    # tmpfs size of /workspace
    tmp_bytes: int = 32 * MiB          # tmpfs size of /tmp
    shm_bytes: int = 8 * MiB           # tmpfs size of /dev/shm
    command_timeout_s: float = 10.0    # wall clock per command (the policy may ask for less)
    output_bytes: int = 16 * 1024      # command output kept (head and tail)
    read_bytes: int = 256 * 1024       # most bytes of lines one read returns (any part of a file can be read)
    export_bytes: int = 32 * MiB       # largest workspace that can be exported for verification
    export_files: int = 5000           # most files/dirs in an exported workspace
    check_timeout_s: float = 10.0      # wall clock per verification check group
    verify_timeout_s: float = 60.0     # wall clock for a whole verification sandbox

    def validate(self) -> "Limits":
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"sandbox limit {f.name}={v!r} must be a positive number")
        if self.mem_bytes < 64 * MiB:
            raise ValueError(f"sandbox limit mem_bytes={self.mem_bytes} is below 64 MiB; python3 "
                             "cannot start in less — raise it")
        if self.nproc < 4:
            raise ValueError(f"sandbox limit nproc={self.nproc} is below 4; a shell needs a few "
                             "processes — raise it")
        return self

    def replace(self, **kw) -> "Limits":
        return dataclasses.replace(self, **kw).validate()


@dataclass(frozen=True)
class SandboxConfig:
    """Where and how sandboxes run.

    isolation: "bwrap" (the sandbox) or "none" (plain subprocesses in a host temp dir: an insecure
    baseline for benchmarks only — it isolates nothing and must never run untrusted policies).
    """

    isolation: str = "bwrap"
    bwrap: str = "bwrap"
    python: str = "/usr/bin/python3"
    drop_to_uid: int = 65534           # host uid bwrap runs as when the host process is root
    drop_to_gid: int = 65534
    inner_uid: int = 1000
    limits: Limits = field(default_factory=Limits)

    def validate(self) -> "SandboxConfig":
        if self.isolation not in ("bwrap", "none"):
            raise ValueError(f"unknown sandbox isolation {self.isolation!r}; use 'bwrap' "
                             "(or 'none', an insecure baseline for benchmarks only)")
        if not os.path.isabs(self.python):
            raise ValueError(f"sandbox python {self.python!r} must be an absolute path under /usr")
        self.limits.validate()
        return self


def default_config(**kw) -> SandboxConfig:
    """SandboxConfig with K3_SANDBOX_PYTHON / K3_SANDBOX_BWRAP applied (explicit arguments win)."""
    for env, key in (("K3_SANDBOX_PYTHON", "python"), ("K3_SANDBOX_BWRAP", "bwrap")):
        if os.environ.get(env) and key not in kw:
            kw[key] = os.environ[env]
    return SandboxConfig(**kw).validate()


# ---------------------------------------------------------------------------------------------
# bwrap command line

SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
WORKSPACE = "/workspace"
INPUTS = "/check"


def _bound_roots() -> list[str]:
    return ["/usr"] + [p for p in SYSTEM_LINKS if os.path.isdir(p) and not os.path.islink(p)]


def _masks() -> list[str]:
    """Directories holding task data that happen to be under a bound system path get a tmpfs."""
    out = []
    for p in {str(_HERE.parent), str(_HERE)}:  # k3/ and k3/agentenv/ (tasks, hidden checks)
        if any(p == r or p.startswith(r + "/") for r in _bound_roots()):
            out.append(p)
    return sorted(out)


_DISABLE_USERNS: bool | None = None


def _supports_disable_userns(bwrap: str) -> bool:
    global _DISABLE_USERNS
    if _DISABLE_USERNS is None:
        try:
            out = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10)
            _DISABLE_USERNS = "--disable-userns" in (out.stdout + out.stderr)
        except OSError:
            _DISABLE_USERNS = False
    return _DISABLE_USERNS


def bwrap_argv(cfg: SandboxConfig, command: list[str], *, inputs: bool = False) -> list[str]:
    lim = cfg.limits
    a = [cfg.bwrap, "--unshare-all", "--unshare-user", "--uid", str(cfg.inner_uid),
         "--gid", str(cfg.inner_uid), "--hostname", "sandbox", "--die-with-parent",
         "--new-session", "--cap-drop", "ALL", "--clearenv"]
    if _supports_disable_userns(cfg.bwrap):
        a.append("--disable-userns")
    a += ["--ro-bind", "/usr", "/usr"]
    for p in SYSTEM_LINKS:
        if os.path.islink(p):
            a += ["--symlink", os.readlink(p), p]
        elif os.path.isdir(p):
            a += ["--ro-bind", p, p]
    if os.path.isdir("/etc/alternatives"):  # awk, editors and friends are symlinks through here
        a += ["--ro-bind", "/etc/alternatives", "/etc/alternatives"]
    a += ["--proc", "/proc", "--dev", "/dev",
          "--size", str(lim.shm_bytes), "--tmpfs", "/dev/shm",
          "--size", str(lim.workspace_bytes), "--perms", "0755", "--tmpfs", WORKSPACE,
          "--size", str(lim.tmp_bytes), "--perms", "1777", "--tmpfs", "/tmp"]
    if inputs:
        a += ["--size", str(lim.fsize_bytes), "--tmpfs", INPUTS]
    for m in _masks():  # empty, tiny and read-only: a mask must not become a place to write
        a += ["--size", "4096", "--perms", "0555", "--tmpfs", m, "--remount-ro", m]
    a += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", WORKSPACE, "--"]
    return a + command


def sandbox_env(home: str, tmp: str) -> dict[str, str]:
    # pinned so grading is reproducible (TZ, hash seed, locale were classic sources of flakiness)
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": tmp, "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8", "TZ": "UTC", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1",
            "TERM": "dumb", "USER": "agent"}


def _popen_kwargs(cfg: SandboxConfig) -> dict:
    kw: dict = {"cwd": "/", "env": {"PATH": "/usr/bin:/bin"}, "close_fds": True,
                "start_new_session": True}
    if cfg.isolation == "bwrap" and os.geteuid() == 0:
        kw.update(user=cfg.drop_to_uid, group=cfg.drop_to_gid, extra_groups=[])
    return kw


_PREFLIGHT: dict[tuple, str] = {}


def check_sandbox(cfg: SandboxConfig | None = None) -> str:
    """Start one sandbox and run the sandbox python in it; raise SandboxUnavailable with the fix.

    Returns a one-line description of the isolation in use. Cached per configuration.
    """
    cfg = (cfg or default_config()).validate()
    key = (cfg.isolation, cfg.bwrap, cfg.python, cfg.drop_to_uid, cfg.drop_to_gid, cfg.inner_uid)  # what it checks
    if key in _PREFLIGHT:
        return _PREFLIGHT[key]
    if not os.path.exists(cfg.python):
        raise SandboxUnavailable(f"sandbox python {cfg.python} does not exist; install python3 "
                                 "(apt-get install -y python3) or set K3_SANDBOX_PYTHON to a "
                                 "python3 under /usr")
    if cfg.isolation == "none":
        _PREFLIGHT[key] = "none (INSECURE baseline: no isolation)"
        return _PREFLIGHT[key]
    if shutil.which(cfg.bwrap) is None:
        raise SandboxUnavailable(
            "bubblewrap (bwrap) is not installed, and agentenv refuses to run untrusted code "
            "without it. Install it: `apt-get install -y bubblewrap` (Debian/Ubuntu), "
            "`dnf install bubblewrap` (Fedora); `make setup` does this on Debian.")
    probe = "import sqlite3, json, resource, os; print(os.getpid(), os.getuid())"
    argv = bwrap_argv(cfg, [cfg.python, "-I", "-S", "-c", probe])
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30,
                             **_popen_kwargs(cfg))
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SandboxUnavailable(f"could not start bubblewrap: {e}") from e
    if out.returncode != 0:
        raise SandboxUnavailable(
            "bubblewrap is installed but cannot create a sandbox here "
            f"(exit {out.returncode}: {out.stderr.strip()[-300:]}). It needs unprivileged user "
            "namespaces (sysctl kernel.unprivileged_userns_clone=1 / user.max_user_namespaces>0) "
            "and, in containers, a seccomp profile that allows unshare/mount.")
    pid, uid = out.stdout.split()
    if pid != "2" or uid != str(cfg.inner_uid):
        raise SandboxUnavailable(f"bubblewrap started but isolation looks wrong (pid {pid}, "
                                 f"uid {uid}); refusing to run untrusted code")
    _PREFLIGHT[key] = (f"{cfg.bwrap} (bubblewrap): user/pid/net/ipc/uts namespaces, read-only system, "
                       f"private tmpfs, host uid {_popen_kwargs(cfg).get('user', os.geteuid())}")
    return _PREFLIGHT[key]


# ---------------------------------------------------------------------------------------------
# processes


def _program(name: str) -> str:
    return (_HERE / name).read_text()


# The program's source travels as the first stdin line (keeps argv and `ps` short); the rest of stdin
# is the program's own protocol.
_BOOT = ("import sys,json;exec(compile(json.loads(sys.stdin.buffer.readline()),"
         "'<k3-sandbox-program>','exec'))")


class _Proc:
    """A sandboxed program with JSON-line stdio, a drained stderr tail and a hard kill."""

    def __init__(self, cfg: SandboxConfig, program: str, prog_cfg: dict, *, inputs: bool = False):
        self.cfg = cfg
        self.tmpdir: str | None = None
        if cfg.isolation == "bwrap":
            root = WORKSPACE
            prog_cfg = dict(prog_cfg, pidns=True, inputs_dir=INPUTS, env=sandbox_env("/tmp", "/tmp"))
            argv = bwrap_argv(cfg, [cfg.python, "-I", "-S", "-c", _BOOT, root,
                                    json.dumps(prog_cfg)], inputs=inputs)
        else:  # insecure baseline: same programs, plain subprocess, host temp dir
            self.tmpdir = tempfile.mkdtemp(prefix="k3-agentenv-insecure-")
            root = os.path.join(self.tmpdir, "workspace")
            for d in ("workspace", "tmp", "check"):
                os.mkdir(os.path.join(self.tmpdir, d))
            tmp = os.path.join(self.tmpdir, "tmp")
            prog_cfg = dict(prog_cfg, pidns=False, inputs_dir=os.path.join(self.tmpdir, "check"),
                            env=sandbox_env(tmp, tmp))
            argv = [cfg.python, "-I", "-S", "-c", _BOOT, root, json.dumps(prog_cfg)]
        try:
            self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, **_popen_kwargs(cfg))
        except OSError as e:
            self._cleanup_dir()
            err = SandboxUnavailable(f"could not start the sandbox ({argv[0]}): {e}")
            err.host_resources = e.errno in HOST_RESOURCE_ERRNOS
            raise err from e
        self._buf = bytearray()
        self._err = bytearray()
        self._err_thread = threading.Thread(target=self._drain_err, daemon=True)
        self._err_thread.start()
        try:
            self.send_raw(json.dumps(_program(program)).encode() + b"\n")
        except SandboxError:
            self.kill()
            raise

    def _drain_err(self):
        try:
            while True:
                chunk = self.p.stderr.read1(65536) if hasattr(self.p.stderr, "read1") else b""
                if not chunk:
                    return
                self._err += chunk
                if len(self._err) > 8192:
                    del self._err[:-8192]
        except (OSError, ValueError):
            return

    def stderr_tail(self) -> str:
        return bytes(self._err[-2000:]).decode("utf-8", "replace").strip()

    def send(self, obj: dict) -> None:
        self.send_raw(json.dumps(obj).encode() + b"\n")

    def send_raw(self, data: bytes) -> None:
        try:
            self.p.stdin.write(data)
            self.p.stdin.flush()
        except (BrokenPipeError, OSError, ValueError) as e:
            raise SandboxError(f"sandbox is gone ({e}); stderr: {self.stderr_tail()}") from e

    def recv(self, timeout: float, max_bytes: int) -> dict:
        deadline = time.monotonic() + timeout
        fd = self.p.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise SandboxTimeout(f"sandbox did not answer within {timeout:.1f}s")
            r, _, _ = select.select([fd], [], [], left)
            if not r:
                continue
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                self.kill()
                raise SandboxError("sandbox exited without answering"
                                   + (f"; stderr: {self.stderr_tail()}" if self.stderr_tail() else ""))
            self._buf += chunk
            if len(self._buf) > max_bytes:
                self.kill()
                raise SandboxError(f"sandbox answer exceeds {max_bytes} bytes")
        line, _, rest = bytes(self._buf).partition(b"\n")
        self._buf = bytearray(rest)
        try:  # bounded: a forged reply thousands of levels deep raised RecursionError here, in the host
            reply = loads_json(line, REPLY_MAX_DEPTH)
        except (ValueError, RecursionError) as e:
            self.kill()
            raise SandboxError(f"sandbox answered something that is not JSON ({str(e)[:200]}): {line[:200]!r}") from e
        if not isinstance(reply, dict):
            self.kill()
            raise SandboxError("sandbox answer is not a JSON object")
        return reply

    def kill(self) -> None:
        if self.p.poll() is None:
            try:  # bwrap runs as another uid; killing our direct child is always permitted
                os.killpg(self.p.pid, signal.SIGKILL)
            except OSError:
                try:
                    self.p.kill()
                except OSError:
                    pass
        try:
            self.p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.warning("sandbox process %d did not exit after SIGKILL", self.p.pid)
        for s in (self.p.stdin, self.p.stdout):
            try:
                s.close()
            except OSError:
                pass
        self._err_thread.join(timeout=2)
        try:
            self.p.stderr.close()
        except OSError:
            pass
        self._cleanup_dir()

    def _cleanup_dir(self):
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None


def _exec_cfg(lim: Limits) -> dict:
    return {"mem_bytes": lim.mem_bytes, "fsize_bytes": lim.fsize_bytes, "nofile": lim.nofile,
            "nproc": lim.nproc, "cpu_s": lim.cpu_s, "command_timeout_s": lim.command_timeout_s,
            "output_bytes": lim.output_bytes, "read_bytes": lim.read_bytes,
            "export_bytes": lim.export_bytes, "export_files": lim.export_files,
            "check_timeout_s": lim.check_timeout_s}


class Session:
    """One episode's sandbox: file tools and commands against a private copy of the workspace.

    >>> with Session(files) as s: s.run("python3 -m unittest")
    """

    def __init__(self, files: dict[str, tuple[bytes, int]], cfg: SandboxConfig | None = None):
        self.cfg = (cfg or default_config()).validate()
        check_sandbox(self.cfg)
        self.limits = self.cfg.limits
        self.closed = True
        try:  # nothing of the agent's is inside yet: any failure here is a start failure
            self._proc = _Proc(self.cfg, "_executor.py", _exec_cfg(self.limits))
            self.closed = False
            payload = [{"path": p, "data": base64.b64encode(d).decode(), "mode": m}
                       for p, (d, m) in sorted(files.items())]
            reply = self._call({"op": "init", "files": payload}, timeout=30)
            if not reply.get("ok"):
                raise SandboxError(f"could not copy the workspace into the sandbox: {reply.get('error')}")
        except (SandboxError, SandboxUnavailable) as e:
            self.close()
            raise SandboxStartError(str(e), getattr(e, "host_resources", False)) from e

    def _call(self, req: dict, timeout: float, max_bytes: int = 4 * MiB) -> dict:
        if self.closed:
            raise SandboxError("sandbox session is closed")
        self._proc.send(req)
        return self._proc.recv(timeout, max_bytes)

    def read(self, path: str, offset: int | None = None, limit: int | None = None) -> dict:
        return self._call({"op": "read", "path": path, "offset": offset, "limit": limit}, 30)

    def write(self, path: str, content: str) -> dict:
        return self._call({"op": "write", "path": path, "content": content}, 30)

    def edit(self, path: str, old: str, new: str, replace_all: bool = False) -> dict:
        return self._call({"op": "edit", "path": path, "old": old, "new": new,
                           "replace_all": replace_all}, 30)

    def search(self, pattern: str, path: str | None = None, glob: str | None = None) -> dict:
        return self._call({"op": "search", "pattern": pattern, "path": path, "glob": glob}, 60)

    def run(self, command: str, timeout: float | None = None) -> dict:
        t = min(timeout or self.limits.command_timeout_s, self.limits.command_timeout_s)
        return self._call({"op": "run", "command": command, "timeout": t}, t + 15)

    def export(self) -> list[dict]:
        """The final workspace as entries {path, type, mode, data(b64) | target}; untrusted data."""
        reply = self._call({"op": "export"}, 60, max_bytes=int(self.limits.export_bytes * 1.4) + MiB)
        if not reply.get("ok"):
            raise SandboxError(f"workspace export failed: {reply.get('error')}")
        entries = reply.get("entries")
        if not isinstance(entries, list):
            raise SandboxError("workspace export is malformed")
        return entries

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._proc.kill()  # PID namespace teardown kills every process left inside

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Probe:
    """A fresh verification sandbox, started ahead of time and used once.

    It may be started while the episode runs (hiding its start-up latency): it lives in sibling
    namespaces the episode cannot see or signal, and it receives the workspace only after the
    episode's sandbox is gone.
    """

    def __init__(self, cfg: SandboxConfig | None = None):
        self.cfg = (cfg or default_config()).validate()
        check_sandbox(self.cfg)
        try:
            self._proc = _Proc(self.cfg, "_probe.py", _exec_cfg(self.cfg.limits), inputs=True)
        except (SandboxError, SandboxUnavailable) as e:
            raise SandboxStartError(f"the verification sandbox did not start: {e}",
                                    getattr(e, "host_resources", False)) from e
        self.used = False

    def run(self, payload: dict, timeout: float | None = None) -> dict:
        """Send the payload, return the probe's reply (untrusted observations); closes the sandbox.

        SandboxStartError when the probe never said it was ready: it failed before the workspace reached it."""
        if self.used:
            raise SandboxError("a verification sandbox is used once")
        self.used = True
        timeout = timeout or self.cfg.limits.verify_timeout_s
        data = json.dumps(payload).encode() + b"\n"
        proc = self._proc
        try:
            ready = proc.recv(30.0, 4096)
            if ready != {"ready": True}:
                raise SandboxError(f"the verification sandbox said {str(ready)[:100]!r}, not that it is ready")
        except SandboxError as e:
            proc.kill()
            raise SandboxStartError(f"the verification sandbox did not start: {e}") from e

        def feed():
            try:
                proc.p.stdin.write(data)
                proc.p.stdin.flush()
                proc.p.stdin.close()
            except (OSError, ValueError):
                pass

        writer = threading.Thread(target=feed, daemon=True)
        writer.start()
        try:
            return proc.recv(timeout, max_bytes=16 * MiB)
        finally:
            proc.kill()
            writer.join(timeout=5)

    def close(self) -> None:
        self.used = True
        self._proc.kill()


def run_probe(payload: dict, cfg: SandboxConfig | None = None, timeout: float | None = None,
              probe: Probe | None = None) -> dict:
    """Run the verification probe in a fresh sandbox: payload in, observations out (untrusted)."""
    return (probe or Probe(cfg)).run(payload, timeout)
