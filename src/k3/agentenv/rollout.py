"""Episodes and rollouts: policy <-> dialect <-> sandbox, then verification in a fresh sandbox.

An episode ends when the policy calls finish (then it is verified), runs out of steps, fails to
answer, or breaks the sandbox; only a finished episode is verified, so a broken episode never
counts as a success. Rollouts run episodes in a local process pool, or as Ray tasks (`backend="ray"`:
a local Ray instance, or a cluster by address, for more than one machine), and append one JSON line per
finished episode, fsynced, so a killed run keeps what it finished and `resume` carries on from there.

Every record says whether its reward counts (`scoring`): fail closed, anything the agent wrote or ran may
have caused (a sandbox it broke mid-episode, a workspace too big to export, a verifier it killed, hung or
fed a forged report) is a reward of 0 that counts. Only failures it cannot cause are `excluded`, with the
reason in `exclusion` (EXCLUSIONS); `summarize` reports the exclusion rate.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import multiprocessing as mp
import hashlib
import os
import time
from collections import defaultdict
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from k3.fileio import fsync_dir, loads_json, remove_stale_temporaries

from .actions import execute
from .dialects import DIALECTS, ParseError, choose_variant, make_dialect
from .policies import EpisodeInfo, Policy, make_policy
from .sandbox import Probe, SandboxConfig, SandboxError, SandboxStartError, SandboxUnavailable, Session, default_config
from .tasks import Task, load_task
from .verify import COUNTED, EXCLUDED, needs_sandbox, snapshot_from_export, verify
from .verify import EXCLUSIONS as VERIFY_EXCLUSIONS

log = logging.getLogger(__name__)

# why an episode measured nothing: the verifier's reasons, the policy's own machinery failing (an exception, not
# a bad answer) and a rollout worker that died
EXCLUSIONS = VERIFY_EXCLUSIONS + ("policy", "worker")


@dataclass(frozen=True)
class EpisodeConfig:
    dialects: tuple = DIALECTS
    augment: bool = True
    max_steps: int | None = None           # None: the task's own limit
    max_message_chars: int = 200_000       # a longer policy message is an error, not an action
    prestart_verifier: bool = True         # start the (fresh, isolated) verification sandbox early
    sandbox: SandboxConfig = field(default_factory=default_config)
    variant_fn: Callable | None = None     # seed -> Variant, instead of choose_variant(seed, dialects, augment)

    def __post_init__(self) -> None:
        if self.max_steps is not None and (isinstance(self.max_steps, bool) or not isinstance(self.max_steps, int)
                                           or self.max_steps < 1):
            raise ValueError(f"max_steps = {self.max_steps!r} must be a positive integer (or None: the task's own)")


def run_episode(task: Task, policy: Policy, seed: int = 0,
                config: EpisodeConfig | None = None) -> dict:
    """One episode; returns the trajectory record (JSON-ready)."""
    cfg = config or EpisodeConfig()
    variant = cfg.variant_fn(seed) if cfg.variant_fn else choose_variant(seed, cfg.dialects, cfg.augment)
    dialect = make_dialect(variant)
    transcript = [{"role": "system", "content": dialect.system_prompt()},
                  {"role": "user", "content": f"Task: {task.title}\n\n{task.instruction}"}]
    actions_log: list[dict] = []
    status, error, steps, parse_errors = "max_steps", None, 0, 0
    max_steps = task.max_steps if cfg.max_steps is None else cfg.max_steps
    t0 = time.monotonic()
    snap = None
    exclusion = None  # set only for a failure the agent cannot have caused
    try:
        policy.begin_episode(EpisodeInfo(task.id, task.family, seed, dialect))
    except Exception as e:  # a policy that cannot start is a broken episode
        return _record(task, policy, seed, variant, transcript, actions_log, "policy_error",
                       f"begin_episode failed: {type(e).__name__}: {e}", 0, 0, None, t0, cfg, "policy")
    try:
        session = Session(task.workspace_files(), cfg.sandbox)
    except (SandboxStartError, SandboxUnavailable) as e:  # before the agent's first action
        return _record(task, policy, seed, variant, transcript, actions_log, "sandbox_error", str(e), 0, 0, None,
                       t0, cfg, "host_resources" if getattr(e, "host_resources", False) else "sandbox_start")
    probe = None
    try:
        if cfg.prestart_verifier and needs_sandbox(task):
            probe = Probe(cfg.sandbox)  # starts now, receives the workspace only after teardown
    except Exception:  # noqa: BLE001 - SandboxUnavailable too (a failed fork): verify later, never leak the session
        probe = None
    try:
        finished = False
        while steps < max_steps and not finished:
            steps += 1
            try:
                text = policy.act([dict(m) for m in transcript])
            except Exception as e:  # the policy's machinery (a server, an engine) failed, not its answer
                status, error, exclusion = "policy_error", f"{type(e).__name__}: {e}", "policy"
                break
            if not isinstance(text, str) or not text.strip():
                status, error = "policy_error", "the policy returned nothing"
                break
            if len(text) > cfg.max_message_chars:
                transcript.append({"role": "assistant", "content": text[: cfg.max_message_chars]})
                transcript.append({"role": "user", "content": dialect.render_error(
                    f"message longer than {cfg.max_message_chars} characters was ignored")})
                parse_errors += 1
                continue
            transcript.append({"role": "assistant", "content": text})
            try:
                actions = dialect.parse(text)
            except ParseError as e:
                parse_errors += 1
                actions_log.append({"step": steps, "parse_error": str(e)})
                transcript.append({"role": "user", "content": dialect.render_error(str(e))})
                continue
            results = []
            for a in actions:
                if a.tool == "finish":
                    finished = True
                    actions_log.append({"step": steps, "action": a.to_json()})
                    break
                ok, obs = execute(session, a)
                actions_log.append({"step": steps, "action": a.to_json(), "ok": ok,
                                    "observation": obs[:2000]})
                results.append((a, ok, obs))
            if results:
                transcript.append({"role": "user", "content": dialect.render_results(results)})
        if finished:
            snap = snapshot_from_export(session.export(), cfg.sandbox.limits.export_bytes)
            status = "finished"
    except SandboxError as e:  # mid-episode or at export (too big, too many files): it counts, as a 0
        status, error = "sandbox_error", str(e)
    except Exception as e:  # our harness failed on what the agent wrote: a bug to fix, and a 0 that counts
        log.exception("episode of %s (seed %d): the harness raised", task.id, seed)
        status, error = "harness_error", f"{type(e).__name__}: {e}"
    except BaseException:
        if probe is not None:
            probe.close()
        raise
    finally:
        session.close()  # the episode's sandbox (and every process in it) is gone before verifying
    result = None
    try:
        if snap is not None:
            result = verify(task, snap, cfg.sandbox, probe=probe)
    finally:
        if probe is not None and not probe.used:
            probe.close()
    return _record(task, policy, seed, variant, transcript, actions_log, status, error, steps,
                   parse_errors, result, t0, cfg, exclusion)


def _record(task, policy, seed, variant, transcript, actions_log, status, error, steps,
            parse_errors, result, t0, cfg, exclusion=None) -> dict:
    reward = result.reward if (result is not None and status == "finished") else 0.0
    if result is not None and status == "finished":
        exclusion = result.exclusion
    return {"task_id": task.id, "family": task.family, "task_checksum": task.checksum,
            "seed": seed, "dialect": variant.dialect, "variant": variant.to_json(),
            "policy": getattr(policy, "name", type(policy).__name__), "status": status,
            "error": error, "steps": steps, "parse_errors": parse_errors, "reward": reward,
            "scoring": EXCLUDED if exclusion else COUNTED, "exclusion": exclusion,
            "verifier": result.to_json() if result is not None else None,
            "isolation": cfg.sandbox.isolation, "duration_s": round(time.monotonic() - t0, 4),
            "actions": actions_log, "transcript": transcript}


# ---------------------------------------------------------------------------------------------


def _worker(job: tuple) -> dict:
    task_dir, policy_spec, seed, cfg = job
    task = load_task(task_dir)
    try:
        policy = make_policy(policy_spec, task)
    except ValueError as e:
        policy = None
        err = str(e)
    if policy is None:
        return {"task_id": task.id, "family": task.family, "seed": seed, "status": "policy_error",
                "error": err, "reward": 0.0, "dialect": None, "steps": 0, "scoring": EXCLUDED, "exclusion": "policy"}
    return run_episode(task, policy, seed, cfg)


BACKENDS = ("process", "ray")


def _pool_worker_init(threads: int, parent: int | None = None) -> None:
    """A pool worker's share of the cores for torch (a `k3` policy runs its model there): each worker used all
    of them, so N workers oversubscribed the machine N times (two workers ran 7x slower than one on 2 cores).
    On Linux the worker also dies with `parent` (PR_SET_PDEATHSIG): a run killed with SIGKILL, which cannot
    clean up, left its workers running episodes for nobody."""
    import sys

    os.environ["OMP_NUM_THREADS"] = str(threads)  # read when torch is first imported
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)
    if parent is not None and sys.platform.startswith("linux"):
        import ctypes
        import signal

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1: PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:  # the parent died before the call: nobody will collect this worker's work
            os._exit(1)


def _check_ray_address(address: str) -> None:
    """A HOST:PORT (or ray://HOST:PORT) where nothing listens: Ray retried the connection for minutes, printing
    warnings; one connection attempt with a timeout says so at once. 'auto' and other forms go to Ray as they are."""
    import socket

    hostport = address[len("ray://"):] if address.startswith("ray://") else address
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as e:
        raise ValueError(f"--ray-address {address}: nothing answers at {host}:{port} ({e.strerror or e}); start the "
                         "cluster there (`ray start --head`), fix the address, or drop --ray-address for a local "
                         "Ray instance") from None


MAX_POOL_RESTARTS = 2  # fresh process pools after workers died, per run


def run_rollouts(tasks: list[Task], policy_spec: dict, episodes: int, *, workers: int = 2,
                 seed: int = 0, out: str | os.PathLike | None = None,
                 config: EpisodeConfig | None = None, progress: bool = False,
                 backend: str = "process", ray_address: str | None = None, resume: bool = False) -> list[dict]:
    """`episodes` episodes round-robin over `tasks` (episode i: task i mod n, seed seed+i).

    backend 'process': a local pool of `workers` processes (1 = in this process); 'ray': one Ray task per
    episode on the cluster at `ray_address`, or on a local instance with `workers` CPUs when it is None.
    Every worker needs bubblewrap and the task directory at the same path (a shared filesystem).

    `out`: each finished episode is appended there (write + fsync), with its index (`episode`) and the run's
    identity (`run_id`). `resume`: keep the episodes `out` already holds for this same run and run only the
    others (without it, `out` starts empty). Returns every episode's record, resumed ones included."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is unknown; use one of {BACKENDS}")
    if episodes <= 0:
        raise ValueError(f"--episodes must be positive, got {episodes}")
    if not tasks:
        raise ValueError("no tasks selected")
    if workers <= 0:
        raise ValueError(f"--workers must be positive, got {workers}")
    cfg = config or EpisodeConfig()
    jobs = [(str(tasks[i % len(tasks)].root), policy_spec, seed + i, cfg) for i in range(episodes)]
    records: list[dict | None] = [None] * episodes
    run_id = _run_id(tasks, policy_spec, episodes, seed, cfg)
    if out and resume and Path(out).is_file():
        for i, rec in _finished_episodes(Path(out), tasks, seed, episodes, run_id).items():
            records[i] = rec
        log.info("resuming %s: %d of %d episodes already finished", out, sum(r is not None for r in records),
                 episodes)
    todo = [i for i in range(episodes) if records[i] is None]
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=episodes, initial=episodes - len(todo), desc="episodes", unit="ep")
    writer = _JsonlWriter(out, append=resume) if out else None

    def done(i: int, result) -> None:
        if isinstance(result, BaseException):  # a crashed worker is a broken episode, not a success
            t = tasks[i % len(tasks)]
            result = {"task_id": t.id, "family": t.family, "seed": seed + i, "status": "worker_error",
                      "error": f"{type(result).__name__}: {result}", "reward": 0.0, "dialect": None, "steps": 0,
                      "scoring": EXCLUDED, "exclusion": "worker"}
        result["episode"], result["run_id"] = i, run_id
        records[i] = result
        _emit(writer, bar, result)

    try:
        if backend == "ray":
            _run_ray([(i, jobs[i]) for i in todo], done, workers, ray_address)
        elif workers == 1:
            for i in todo:
                try:
                    result = _worker(jobs[i])
                except Exception as e:  # as in a pool: this episode's record says why, the run goes on
                    log.exception("episode %d raised", i)
                    result = e
                done(i, result)
        elif todo:
            ctx = mp.get_context("spawn")  # no fork of a process that holds threads and pipes
            threads = max(1, (os.cpu_count() or 1) // workers)
            restarts = 0
            while todo:
                # a worker that dies (killed, out of memory) breaks the whole pool and fails every episode not yet
                # finished: those run again on a fresh pool (none was recorded, so none is sampled twice), up to
                # MAX_POOL_RESTARTS times; after that they are worker_error records
                with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_pool_worker_init,
                                            initargs=(threads, os.getpid())) as pool:
                    futs = {pool.submit(_worker, jobs[i]): i for i in todo}
                    todo = []
                    for fut in cf.as_completed(futs):
                        try:
                            result = fut.result()
                        except BrokenProcessPool as e:
                            if restarts < MAX_POOL_RESTARTS:
                                todo.append(futs[fut])
                                continue
                            result = e
                        except Exception as e:
                            result = e
                        done(futs[fut], result)
                if todo:
                    restarts += 1
                    log.warning("a rollout worker died; running the %d unfinished episode(s) on a new pool (%d/%d)",
                                len(todo), restarts, MAX_POOL_RESTARTS)
    finally:
        if bar:
            bar.close()
        if writer:
            writer.close()
    return [r for r in records if r is not None]


def _run_id(tasks: list[Task], policy_spec: dict, episodes: int, seed: int, cfg: EpisodeConfig) -> str:
    """What makes two runs the same run (resume continues only its own): tasks, policy, episodes, seed, harness."""
    spec = {k: v for k, v in policy_spec.items() if k != "api_key"}  # a secret, and not what the run is
    ident = {"tasks": [[t.id, t.checksum] for t in tasks], "policy": spec, "episodes": episodes, "seed": seed,
             "dialects": list(cfg.dialects), "augment": cfg.augment, "max_steps": cfg.max_steps,
             "max_message_chars": cfg.max_message_chars}
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _finished_episodes(path: Path, tasks: list[Task], seed: int, episodes: int, run_id: str) -> dict[int, dict]:
    """The episodes a run that was stopped (or killed) wrote to `path`, by index. The last line may be cut short by a
    kill mid-write: it is an episode still in flight, dropped here (and cut off the file). Anything else that is
    not a record of this run is an error: resume would mix two runs."""
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    fix = (f"pass another --out for this run, or drop --resume to start {path} over")
    out: dict[int, dict] = {}
    for n, line in enumerate(data[:end].split(b"\n")[:-1], 1):
        try:
            rec = loads_json(line)
        except ValueError as e:
            raise ValueError(f"{path}:{n}: not a trajectory record ({str(e)[:200]}); {fix}") from None
        i = rec.get("episode") if isinstance(rec, dict) else None
        if not isinstance(i, int) or rec.get("run_id") != run_id:
            raise ValueError(f"{path}:{n}: an episode of another run (other tasks, policy, episodes, seed or "
                             f"harness options, or a file written before runs could resume); {fix}")
        if not (0 <= i < episodes) or rec.get("task_id") != tasks[i % len(tasks)].id or rec.get("seed") != seed + i:
            raise ValueError(f"{path}:{n}: episode {i} does not match this run's episode {i}; {fix}")
        if i in out:
            raise ValueError(f"{path}:{n}: episode {i} is recorded twice; {fix}")
        out[i] = rec
    if end < len(data):
        log.warning("%s: dropping a last line cut short (%d bytes: an episode in flight when the run stopped)",
                    path, len(data) - end)
        with open(path, "r+b") as f:
            f.truncate(end)
            os.fsync(f.fileno())
    return out


def _run_ray(jobs: list[tuple[int, tuple]], done, workers: int, address: str | None) -> None:
    """One Ray task per (index, job); results are handed to `done(i, record_or_exception)` as they finish."""
    try:
        import ray
    except ImportError as e:
        raise ValueError("backend 'ray' needs the ray package: pip install 'k3[agent]'") from e
    started = not ray.is_initialized()
    if started:
        kwargs = dict(include_dashboard=False, log_to_driver=False, configure_logging=False)
        if address:
            _check_ray_address(address)
            ray.init(address=address, **kwargs)
        else:
            ray.init(num_cpus=workers, **kwargs)
    try:
        remote = ray.remote(num_cpus=1, max_retries=0)(_worker)  # a retried episode would be a second sample
        index = {remote.remote(job): i for i, job in jobs}
        pending = list(index)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                try:
                    result = ray.get(ref)
                except Exception as e:  # RayTaskError, a lost worker, ...
                    result = e
                done(index[ref], result)
    finally:
        if started:
            ray.shutdown()


def _emit(writer, bar, rec):
    if writer:
        writer.write(rec)
    if bar:
        bar.update(1)
        bar.set_postfix(reward=rec.get("reward"))


class _JsonlWriter:
    """Appends one line per finished episode to the target, each written whole and fsynced before the next: a run
    killed even by SIGKILL keeps every episode it finished (the log is the one file k3 does not replace
    atomically: a replace at the end lost them all). Without `append` the file starts empty."""

    def __init__(self, path, append: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(self.path)  # left by earlier versions, which wrote a temporary file
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if append else os.O_TRUNC)
        self.fd = os.open(self.path, flags | os.O_CLOEXEC, 0o666)
        os.fsync(self.fd)
        fsync_dir(self.path.parent)  # the file itself survives a crash

    def write(self, rec):
        # ASCII escapes: a lone surrogate from a policy cannot break it
        data = memoryview((json.dumps(rec) + "\n").encode())
        while data:
            data = data[os.write(self.fd, data):]
        os.fsync(self.fd)

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def is_excluded(r: dict) -> bool:
    """Whether a record's reward says nothing about the answer. Records without the label (written before it
    existed) count, as the run wrote them."""
    return r.get("scoring") == EXCLUDED


def summarize(records: list[dict]) -> dict:
    """Per family and per dialect: episodes, success rate (mean reward of the counted episodes; None when none
    counts), exclusions and their rate, mean steps, statuses."""
    groups = defaultdict(list)
    for r in records:
        groups[("family", r.get("family"))].append(r)
        groups[("dialect", r.get("dialect"))].append(r)
        groups[("all", "all")].append(r)
    out = {}
    for (kind, key), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        statuses = defaultdict(int)
        for r in rs:
            statuses[r.get("status")] += 1
        counted = [r for r in rs if not is_excluded(r)]
        out[f"{kind}:{key}"] = {
            "episodes": len(rs),
            "success": sum(r.get("reward", 0) for r in counted) / len(counted) if counted else None,
            "excluded": len(rs) - len(counted), "exclusion_rate": (len(rs) - len(counted)) / len(rs),
            "mean_steps": sum(r.get("steps", 0) for r in rs) / len(rs),
            "mean_s": sum(r.get("duration_s", 0) for r in rs) / len(rs),
            "statuses": dict(statuses)}
    return out


def format_summary(summary: dict) -> str:
    rows = [("group", "episodes", "success", "excluded", "steps", "sec/ep", "statuses")]
    for k, v in summary.items():
        rows.append((k, str(v["episodes"]), "-" if v["success"] is None else f"{v['success']:.3f}",
                     f"{v['excluded']} ({v['exclusion_rate']:.1%})", f"{v['mean_steps']:.1f}",
                     f"{v['mean_s']:.2f}", ", ".join(f"{s}={n}" for s, n in sorted(v["statuses"].items()))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
