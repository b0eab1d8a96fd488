"""Starting ranks: local process groups for tests and benchmarks, and the torchrun re-launch of `k3 train`.

`run_local(fn, nproc, *args)` starts `nproc` spawned processes on this machine, joins them into a gloo
group through a FileStore in a fresh temporary directory (no TCP port to pick, so no port race), calls
`fn(rank, world, *args)` in each with one intra-op thread, and returns the list of per-rank return values.
Any rank that raises or dies fails the whole call with that rank's error; ranks still running are killed;
a job that exceeds `timeout_s` is killed and reported (a hung collective must not hang the caller).
"""
from __future__ import annotations

import logging
import os
import pickle
import sys
import tempfile
import time
import traceback
from pathlib import Path

__all__ = ["run_local", "LocalJobError", "torchrun_command", "in_torchrun"]


class LocalJobError(RuntimeError):
    """A rank of a local job raised, died or timed out."""


def _entry(rank: int, world: int, store_dir: str, timeout_s: float, fn, args, kwargs) -> None:
    import torch
    import torch.distributed as dist

    from k3.parallel.mesh import init_distributed

    torch.set_num_threads(1)
    out = Path(store_dir) / f"result_{rank}.pkl"
    try:
        init_distributed("gloo", timeout_s=timeout_s, init_method=f"file://{store_dir}/store", rank=rank,
                         world_size=world)
        result = fn(rank, world, *args, **kwargs)
        out.write_bytes(pickle.dumps(("ok", result, time.process_time())))
    except BaseException as e:  # report to the parent, then die loudly so that peers stop too
        out.write_bytes(pickle.dumps(("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}", 0.0)))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


log = logging.getLogger(__name__)
LAST_CPU_S: list[float] = []  # CPU seconds each rank of the last successful run_local spent (diagnostics)

# Modules a forkserver imports once; every rank it forks then starts without paying for them again.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp",
           "k3.model.transformer", "k3.parallel.expert", "k3.parallel.train"]


def run_local(fn, nproc: int, *args, timeout_s: float = 120.0, collective_timeout_s: float = 60.0,
              start_method: str = "forkserver", **kwargs) -> list:
    """Run fn(rank, world, *args, **kwargs) on `nproc` local gloo ranks; per-rank results in rank order.

    `fn` must be importable by name (a module-level function). The default 'forkserver' start method
    imports torch and k3 once per calling process (a clean server process, so no threads are forked);
    'spawn' starts every rank from scratch."""
    import multiprocessing

    import torch.multiprocessing as mp

    if nproc < 1:
        raise ValueError(f"nproc = {nproc} must be >= 1")
    if start_method == "forkserver":
        multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory(prefix="k3-dist-") as d:
        ctx = mp.start_processes(_entry, args=(nproc, d, collective_timeout_s, fn, args, kwargs), nprocs=nproc,
                                 join=False, start_method=start_method)
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=0.2):
                if time.monotonic() > deadline:
                    raise LocalJobError(f"local job of {nproc} ranks did not finish within {timeout_s:.0f} s "
                                        "(a hung collective?); killed it")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            raise LocalJobError(_describe_failure(ctx, d, nproc, e)) from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        results, cpu = [], []
        for r in range(nproc):
            status, value, cpu_s = pickle.loads((Path(d) / f"result_{r}.pkl").read_bytes())
            if status != "ok":
                raise LocalJobError(_first_error(d, nproc) or value)
            results.append(value)
            cpu.append(cpu_s)
        LAST_CPU_S[:] = cpu
        log.debug("local job of %d ranks: %.1f CPU s in the ranks", nproc, sum(cpu))
        return results


def _describe_failure(ctx, d: str, nproc: int, exc: Exception) -> str:
    """Which ranks died without reporting an error (killed, os._exit, crashed), then the first reported error.
    A dead rank often makes a peer fail first ("connection reset"); naming the dead one says why."""
    deadline = time.monotonic() + 5.0
    for p in ctx.processes:  # join() already terminated the survivors; collect every exit code
        p.join(max(0.0, deadline - time.monotonic()))
    reported = {r for r in range(nproc) if (Path(d) / f"result_{r}.pkl").is_file()}
    dead = [f"rank {r} exited with code {p.exitcode} without reporting an error"
            for r, p in enumerate(ctx.processes)
            if r not in reported and p.exitcode not in (0, None) and p.exitcode != -15]
    first = _first_error(d, nproc) or str(exc)
    return "; ".join(dead + [first]) if dead else first


_FOLLOW_ON = ("connection closed by peer", "connection reset", "broken pipe", "timed out", "gloo")


def _first_error(d: str, nproc: int) -> str | None:
    """The error that most likely started it: a rank's own error before a peer's follow-on collective failure
    ("connection closed by peer"), and among those the one reported first."""
    errors = []
    for r in range(nproc):
        f = Path(d) / f"result_{r}.pkl"
        if f.is_file():
            try:
                status, value, _ = pickle.loads(f.read_bytes())
            except Exception:
                continue
            if status == "error":
                follow_on = any(s in str(value).split("\n", 1)[0].lower() for s in _FOLLOW_ON)
                errors.append((follow_on, f.stat().st_mtime_ns, r, value))
    return min(errors)[3] if errors else None


def in_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("WORLD_SIZE" in os.environ and "RANK" in os.environ)


def torchrun_command(nproc: int, argv: list[str]) -> list[str]:
    """`python -m k3.parallel.torchrun --standalone --nproc-per-node N -m k3.cli ARGV` (one machine): torchrun
    (torch.distributed.run) without its traceback when a signal stops it."""
    return [sys.executable, "-m", "k3.parallel.torchrun", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "k3.cli", *argv]
