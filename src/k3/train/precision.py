"""Which arithmetic a run uses: fp32, or bf16 autocast where this host measures it faster.

On a CPU, bf16 is not reliably faster. Hosts without native bf16 ran it about 250x slower than fp32, and on a host
with avx512_bf16 a 1024x1024 matmul ran 2-3x faster in bf16 while k3's training step ran slower (casts around the
fp32 islands, many small expert matmuls). So `auto` measures a training step, not only a matmul: once per host
(CPU model, its bf16 flags, torch version and thread count), cached as JSON in the user cache
($K3_CACHE_DIR, else $XDG_CACHE_HOME/k3 or ~/.cache/k3, file precision.json). On CUDA `auto` is bf16.

Weights and optimizer state stay fp32 either way; autocast only lowers the arithmetic of the forward. The KDA state
recurrence, router scores, softmaxes, RMSNorm statistics and the losses stay fp32 (docs/training.md, Precision).
"""
from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import platform
import time
from pathlib import Path
from typing import Callable

import torch

__all__ = ["PRECISIONS", "MARGIN", "resolve_precision", "probe", "host_key", "cache_path", "read_cache",
           "store_probe"]

log = logging.getLogger(__name__)

PRECISIONS = ("auto", "fp32", "bf16")
# bf16 must make the step at least this much faster: below it, timing noise could flip the choice between runs
MARGIN = 1.1
CACHE_VERSION = 1
# the probe's training step has the demo's batch shape: with fewer tokens each expert's matmuls get a handful of
# rows, where bf16 gains little (mini, 2 threads: 2x64 tokens measured bf16 0.98-1.06x, 8x128 1.18-1.20x)
PROBE_BATCH, PROBE_SEQ_LEN = 8, 128
# CPU flags that decide how fast bf16 runs (native bf16 dot products, AMX tiles)
BF16_FLAGS = ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16")


# ---------------------------------------------------------------------- the host and its cache
def _cpu() -> tuple[str, list[str]]:
    """(CPU model name, the BF16_FLAGS it has)."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
                if model and flags:
                    break
    except OSError:  # not Linux: the platform's name for it, and torch's view of the vector units
        pass
    return model or platform.processor() or platform.machine(), [f for f in BF16_FLAGS if f in flags]


def _code_fingerprint() -> str:
    """A short hash of the model and op sources: the step the probe timed is k3's own code, so a change to it
    (a faster bf16 kernel, say) makes the cached choice stale."""
    import hashlib

    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for f in sorted(list((root / "model").rglob("*.py")) + list((root / "ops").rglob("*.py"))):
        h.update(f.relative_to(root).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def host_key(threads: int | None = None) -> str:
    """What the probe's result depends on: CPU model and bf16 flags, torch's CPU capability and version, threads,
    the version of k3's model code and the probe's step shape."""
    model, flags = _cpu()
    threads = torch.get_num_threads() if threads is None else threads
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except AttributeError:
        capability = "?"
    return (f"{model} [{' '.join(flags) or 'no bf16 flags'}] {capability} torch {torch.__version__}, {threads} "
            f"threads, k3 code {_code_fingerprint()}, probe step {PROBE_BATCH}x{PROBE_SEQ_LEN}")


def cache_path() -> Path:
    """$K3_CACHE_DIR/precision.json, else $XDG_CACHE_HOME/k3/precision.json, else ~/.cache/k3/precision.json."""
    root = os.environ.get("K3_CACHE_DIR")
    if not root:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "k3"
    return Path(root) / "precision.json"


def read_cache(path: Path | None = None) -> dict:
    """The cached probes by host key; {} when there is no cache, or it is unreadable or damaged (it is then
    rewritten by the next probe, not a reason to fail a run)."""
    path = cache_path() if path is None else path
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("ignoring the precision cache %s (%s); it is measured again", path, e)
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or not isinstance(data.get("hosts"), dict):
        return {}
    return {k: v for k, v in data["hosts"].items() if _valid(v)}


def _valid(rec) -> bool:
    """A probe's figures: both matmul times, and both step times (both None where the step was not run)."""
    def pos(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0

    if not isinstance(rec, dict) or not (pos(rec.get("matmul_fp32_s")) and pos(rec.get("matmul_bf16_s"))):
        return False
    steps = rec.get("step_fp32_s"), rec.get("step_bf16_s")
    return all(pos(v) for v in steps) or all(v is None for v in steps)


def store_probe(key: str, result: dict, path: Path | None = None) -> bool:
    """Add one host's probe to the cache, atomically; False (and a warning) where the cache cannot be written."""
    from k3.fileio import atomic_write_json

    path = cache_path() if path is None else path
    hosts = read_cache(path)
    hosts[key] = result
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {"version": CACHE_VERSION, "hosts": hosts})
    except OSError as e:
        log.warning("could not write the precision cache %s (%s): the next run measures again; set K3_CACHE_DIR "
                    "to a writable folder to keep it", path, e.strerror or e)
        return False
    return True


# ---------------------------------------------------------------------- the probe
def _interleaved(fn_a: Callable[[], float], fn_b: Callable[[], float], repeats: int, budget_s: float,
                 t0: float) -> tuple[list[float], list[float]]:
    """Interleaved timings of two runs (so load from other jobs falls on both alike): at least one each, more up
    to `repeats` while the probe is within its time budget."""
    a, b = [], []
    while len(a) < repeats and (not a or time.perf_counter() - t0 < budget_s):
        a.append(fn_a())
        b.append(fn_b())
    return a, b


def probe(*, matmul_size: int = 1024, batch: int = PROBE_BATCH, seq_len: int = PROBE_SEQ_LEN, n_layers: int = 4,
          repeats: int = 3, budget_s: float = 8.0) -> dict:
    """Measure fp32 against bf16 autocast on this CPU, at the current thread count: a square matmul, then a
    forward + backward training step of `mini`'s widths and layer kinds (`n_layers` = 4: three KDA layers and one
    MLA layer, mini's 3:1; the dense MLP, then MoE; batch x seq_len tokens). Each after one warm-up, interleaved,
    the fastest of up to `repeats` while within `budget_s` (a loaded machine gets fewer, never none): other jobs
    on the machine only ever add time, and on the shared dev machine single bf16 steps ranged 0.9-13 s. A bf16
    warm-up step over 3x the fp32 one decides at once (`repeats` 0). The step is
    skipped when the bf16 matmul is already slower (a host without native bf16: its step would take minutes).
    RNG state and grad mode are left as they were."""
    import torch.nn.functional as F

    from k3.config import get_config
    from k3.model.transformer import K3Model

    t0 = time.perf_counter()
    amp = {"fp32": contextlib.nullcontext, "bf16": lambda: torch.autocast("cpu", dtype=torch.bfloat16)}
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        torch.manual_seed(0)
        a, b = torch.randn(matmul_size, matmul_size), torch.randn(matmul_size, matmul_size)

        def matmul(prec: str) -> Callable[[], float]:
            x, y = (a, b) if prec == "fp32" else (a.bfloat16(), b.bfloat16())

            def run() -> float:
                t = time.perf_counter()
                for _ in range(3):
                    x @ y
                return (time.perf_counter() - t) / 3
            return run

        mm32, mm16 = matmul("fp32"), matmul("bf16")
        mm32(), mm16()  # warm-up: kernel selection, first-touch pages
        mm_a, mm_b = _interleaved(mm32, mm16, repeats, budget_s / 4, time.perf_counter())
        out = {"matmul_fp32_s": min(mm_a), "matmul_bf16_s": min(mm_b),
               "step_fp32_s": None, "step_bf16_s": None}
        shape = f"mini widths, {n_layers} layers, {batch}x{seq_len} tokens"
        if out["matmul_bf16_s"] <= out["matmul_fp32_s"]:
            config = get_config("mini", n_layers=n_layers, attnres_sources=min(5, n_layers + 1))
            model = K3Model(config).train()
            def step(prec: str) -> Callable[[], float]:
                def run() -> float:
                    # new tokens every step: the experts' matmul shapes change with the routing, as in training,
                    # and bf16 kernels are specialised per shape (the same batch again measured bf16 faster)
                    tokens = torch.randint(0, config.vocab_size, (batch, seq_len + 1))
                    t = time.perf_counter()
                    with amp[prec]():
                        logits = model(tokens[:, :-1])
                        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                               tokens[:, 1:].reshape(-1)) + model.aux_loss()
                    loss.backward()
                    model.zero_grad(set_to_none=True)
                    return time.perf_counter() - t
                return run

            s32, s16 = step("fp32"), step("bf16")
            w32, w16 = s32(), s16()
            if w16 > 3 * w32:  # clearly slower even against fp32's one-off first-step costs: no need to repeat
                st_a, st_b = [w32], [w16]
                out["repeats"] = 0
            else:
                st_a, st_b = _interleaved(s32, s16, repeats, budget_s, t0)
                out["repeats"] = len(st_a)
            out.update(step_fp32_s=min(st_a), step_bf16_s=min(st_b))
        else:
            shape += " (not run: the bf16 matmul was already slower)"
    out = {k: round(v, 6) if isinstance(v, float) else v for k, v in out.items()}
    out.update(step_shape=shape, matmul_size=matmul_size, threads=torch.get_num_threads(),
               probe_s=round(time.perf_counter() - t0, 2), measured_at=datetime.date.today().isoformat())
    return out


# ---------------------------------------------------------------------- the choice
def resolve_precision(requested: str, device: torch.device | str = "cpu", *,
                      probe_fn: Callable[[], dict] | None = None, use_cache: bool = True,
                      margin: float = MARGIN) -> tuple[str, str]:
    """`requested` (auto, fp32 or bf16) on `device` -> (fp32 or bf16, the reason, for logs and summaries).

    `auto` on a CPU: bf16 only where the probe measured a training step at least `margin` times faster (the
    cached probe of this host, else `probe_fn()` or `probe()`, then cached)."""
    if requested not in PRECISIONS:
        raise ValueError(f"precision {requested!r}: choose one of {', '.join(PRECISIONS)}")
    device = torch.device(device)
    if requested != "auto":
        note = (" (CUDA training runs under bf16 autocast regardless: k3.train.device.autocast)"
                if device.type == "cuda" and requested == "fp32" else "")
        return requested, f"--precision {requested} given{note}"
    if device.type == "cuda":
        return "bf16", "CUDA: bf16 autocast (the GPU's bf16 tensor cores), fp32 weights and optimizer state"
    if device.type != "cpu":
        return "fp32", f"{device.type}: no bf16 probe for this device"
    key = host_key()
    rec = read_cache().get(key) if use_cache else None
    cached = rec is not None
    if rec is None:
        log.info("k3: measuring fp32 against bf16 on this host (%d threads; once, then cached in %s)",
                 torch.get_num_threads(), cache_path() if use_cache else "memory only")
        rec = (probe_fn or probe)()
        if not _valid(rec):
            raise ValueError(f"the precision probe returned {rec!r}; it must give matmul_fp32_s, matmul_bf16_s, "
                             "step_fp32_s and step_bf16_s in seconds (both step times None when not run)")
        if use_cache:
            store_probe(key, rec)
    return decide(rec, margin, cached)


def decide(rec: dict, margin: float = MARGIN, cached: bool = False) -> tuple[str, str]:
    """(precision, reason) from a probe's figures."""
    mm = rec["matmul_fp32_s"] / rec["matmul_bf16_s"]
    when = f"probe of {rec.get('measured_at', 'unknown date')}{', cached' if cached else ''}"
    if rec.get("step_bf16_s") is None:
        return "fp32", (f"bf16 measured slower on this host: a matmul ran at {mm:.2f}x fp32's speed, so the "
                        f"training step was not tried ({when})")
    step = rec["step_fp32_s"] / rec["step_bf16_s"]
    if step >= margin:
        return "bf16", (f"bf16 measured faster on this host: a mini-shaped training step ran {step:.2f}x fp32's "
                        f"speed (a matmul {mm:.2f}x) ({when})")
    return "fp32", (f"bf16 measured no faster on this host: a mini-shaped training step ran at {step:.2f}x fp32's "
                    f"speed (a matmul {mm:.2f}x), below the {margin:g}x that bf16 needs ({when})")

