"""Routed experts streamed from disk: serve a model whose MXFP4 experts exceed the RAM.

    model = k3.load(path, experts="stream", ram_budget="8GB")

The trunk (everything but the routed experts) is resident. Each routed expert stays where the released folder
has it: six uint8 tensors (w1, w3, w2 codes and E8M0 scales), which the released writer lays out back to back,
so one expert is one read at the offsets the safetensors header gives. `ExpertCache` keeps the packed bytes of
the experts used last, bounded in bytes (LRU); the layer being computed pins its experts. A background thread
prefetches the next MoE layer's likely experts: when a layer's channel mixer starts, the next MoE layer's router
is applied to the same input (the lookahead router) and its top-k experts are read while this layer computes.
The real router still decides; a wrong guess costs a read, never a different output. `StreamedExperts` runs the
experts a batch needs, dequantized into a reused workspace, with the same kernels and order as the resident
`PackedRoutedExperts`, so logits equal the resident model's. Design, costs and measurements: docs/serving.md.
"""
from __future__ import annotations

import collections
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from k3.model.moe import _grouped_backend, grouped_glu
from k3.ops.mx.fake import BLOCK
from k3.ops.mx.formats import _e2m1_pair_values, _scale_values

log = logging.getLogger(__name__)

PARTS = ("w1_codes", "w1_scales", "w3_codes", "w3_scales", "w2_codes", "w2_scales")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_bytes(value, what: str = "ram_budget") -> int:
    """'8GB', '8 GiB', '512MB', 8e9 -> bytes (GB = 10^9, GiB = 2^30)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        n = float(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{what} = {value!r} is not a size; write e.g. 8GB, 512MB or 8GiB")
        n = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if n <= 0:
        raise ValueError(f"{what} = {value!r} must be more than 0 bytes")
    return int(n)


# ---------------------------------------------------------------------------------------------- disk
@dataclass
class _Span:
    fd: int
    offset: int
    nbytes: int
    shape: tuple[int, ...]


class ExpertStore:
    """Where each routed expert's six packed tensors lie in the folder's safetensors, and reads of them.

    `read(j, e)` returns the six uint8 tensors of expert e of MoE layer j (views of one buffer, filled by as few
    `preadv` calls as the spans allow: one for the released layout). With `drop_pages` (the default) the pages
    read are dropped from the OS page cache right after (posix_fadvise DONTNEED): the expert cache is the cache,
    and a second copy in the page cache would only take RAM from it (and make a measurement read RAM, not disk).
    """

    def __init__(self, tensors, names: list[list[list[str]]], drop_pages: bool = True):
        self.drop_pages = drop_pages
        self.fds = {name: os.open(f.path, os.O_RDONLY) for name, f in tensors.files.items()}
        self.spans: list[list[list[_Span]]] = []
        for layer in names:
            row = []
            for parts in layer:
                spans = []
                for n in parts:
                    f = tensors.files[tensors.where[n]]
                    m = f.meta[n]
                    b0, b1 = m["data_offsets"]
                    if m["dtype"] != "U8":
                        raise ValueError(f"{f.path}: {n} is {m['dtype']}, not the uint8 MXFP4 pack streaming reads")
                    spans.append(_Span(self.fds[tensors.where[n]], f.start + b0, b1 - b0, tuple(m["shape"])))
                row.append(spans)
            self.spans.append(row)
        self.expert_bytes = sum(s.nbytes for s in self.spans[0][0]) if self.spans else 0
        self.lock = threading.Lock()
        self.bytes_read = self.reads = 0
        self.read_s = 0.0

    def read(self, j: int, e: int, out: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """Expert e of MoE layer j, into `out` (uint8 [expert_bytes], a cache slot) or a new buffer."""
        spans = self.spans[j][e]
        buf = torch.empty(sum(s.nbytes for s in spans), dtype=torch.uint8) if out is None else out
        mv = memoryview(buf.numpy())
        # in file order, spans that follow each other coalesced into one read
        runs, pos, where = [], 0, {}
        for i in sorted(range(len(spans)), key=lambda i: (spans[i].fd, spans[i].offset)):
            s = spans[i]
            if runs and runs[-1][0] == s.fd and runs[-1][1] + runs[-1][2] == s.offset:
                runs[-1][2] += s.nbytes
            else:
                runs.append([s.fd, s.offset, s.nbytes, pos])
            where[i] = pos
            pos += s.nbytes
        t0 = time.perf_counter()
        for fd, off, n, at in runs:
            got = os.preadv(fd, [mv[at:at + n]], off)
            if got != n:
                raise OSError(f"short read of routed expert {e} of MoE layer {j}: {got} of {n} bytes; the checkpoint "
                              "file changed or is truncated")
            if self.drop_pages:
                os.posix_fadvise(fd, off, n, os.POSIX_FADV_DONTNEED)
        dt = time.perf_counter() - t0
        with self.lock:
            self.bytes_read += buf.numel()
            self.reads += len(runs)
            self.read_s += dt
        return tuple(buf[where[i]:where[i] + s.nbytes].view(s.shape) for i, s in enumerate(spans))

    def drop_page_cache(self) -> None:
        """Evict every checkpoint file from the OS page cache (the next read of any expert goes to the disk)."""
        for fd in self.fds.values():
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


# ---------------------------------------------------------------------------------------------- cache
class ExpertCache:
    """Packed experts, least recently used first out, at most `capacity` bytes (the layer being computed may pin
    more for the length of its forward). Demand reads happen in the caller; `prefetch` queues reads for a
    background thread, which drops a queue made stale by a newer lookahead. Counters: `stats()`."""

    def __init__(self, store: ExpertStore, capacity: int, prefetch: bool = True):
        self.store, self.capacity, self.prefetch_on = store, int(capacity), prefetch
        # one slab of fixed slots, one expert each (every expert has the same size): the cache's RAM is the slab,
        # however many reads come and go (a buffer per read left the heap fragmented, RSS growing past the bound)
        eb = max(1, store.expert_bytes)
        self.slab = torch.empty((self.capacity // eb) * eb, dtype=torch.uint8)
        self.free = list(range(self.capacity // eb))
        self.slot_of: dict = {}
        self.entries: collections.OrderedDict = collections.OrderedDict()
        self.bytes = 0
        self.pins: collections.Counter = collections.Counter()
        self.pending: dict = {}  # key -> Event, being read
        self.unused_prefetch: set = set()
        self.cv = threading.Condition()
        self.queue: collections.deque = collections.deque()
        self.counts = collections.Counter()
        self.peak_bytes = 0
        self._stop = False
        self._thread = None
        if prefetch:
            self._thread = threading.Thread(target=self._worker, name="k3-expert-prefetch", daemon=True)
            self._thread.start()

    # -- bookkeeping under self.cv
    def _evict_for(self, n: int, force: bool) -> bool:
        while self.bytes + n > self.capacity:
            victim = next((k for k in self.entries if not self.pins[k]), None)
            if victim is None:
                return force  # everything pinned: a demand read overflows for the moment, a prefetch gives up
            self.bytes -= sum(t.numel() for t in self.entries.pop(victim))
            self.free.append(self.slot_of.pop(victim))
            if victim in self.unused_prefetch:
                self.unused_prefetch.discard(victim)
                self.counts["prefetch_wasted"] += 1
        return True

    def _take_slot(self):
        """A free slot (evicting the least recently used unpinned expert if needed), or None."""
        while not self.free:
            victim = next((k for k in self.entries if not self.pins[k]), None)
            if victim is None:
                return None
            self.bytes -= sum(t.numel() for t in self.entries.pop(victim))
            self.free.append(self.slot_of.pop(victim))
            if victim in self.unused_prefetch:
                self.unused_prefetch.discard(victim)
                self.counts["prefetch_wasted"] += 1
        return self.free.pop()

    def _slot_view(self, slot):
        eb = self.store.expert_bytes
        return None if slot is None else self.slab[slot * eb:(slot + 1) * eb]

    def _insert(self, key, tensors, force: bool) -> bool:
        n = sum(t.numel() for t in tensors)
        if not self._evict_for(n, force):
            return False
        self.entries[key] = tensors
        self.bytes += n
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        return True

    def acquire(self, keys: list) -> list[tuple[torch.Tensor, ...]]:
        """The packed tensors of `keys` (read now where missing), pinned until `release(keys)`."""
        out = []
        for key in keys:
            with self.cv:
                self.pins[key] += 1
                while key in self.pending:  # a prefetch of it is under way: wait for it rather than read twice
                    self.counts["waited_on_prefetch"] += 1
                    self.cv.wait()
                if key in self.entries:
                    self.entries.move_to_end(key)
                    self.counts["hits"] += 1
                    if key in self.unused_prefetch:
                        self.unused_prefetch.discard(key)
                        self.counts["prefetch_used"] += 1
                    out.append(self.entries[key])
                    continue
                self.counts["misses"] += 1
                self.pending[key] = True
                slot = self._take_slot()  # None: every slot pinned; read into a buffer of its own, not cached
            try:
                t = self.store.read(*key, out=self._slot_view(slot))
            except BaseException:
                with self.cv:
                    del self.pending[key]
                    if slot is not None:
                        self.free.append(slot)
                    self.cv.notify_all()
                raise
            with self.cv:
                del self.pending[key]
                if slot is not None:
                    self.slot_of[key] = slot
                    self._insert(key, t, force=True)
                else:
                    self.counts["overflow_reads"] += 1
                self.cv.notify_all()
            out.append(t)
        return out

    def release(self, keys: list) -> None:
        with self.cv:
            for key in keys:
                self.pins[key] -= 1
                if not self.pins[key]:
                    del self.pins[key]
            self._evict_for(0, force=True)  # back under the capacity once nothing is pinned

    def prefetch(self, keys: list) -> None:
        if not self.prefetch_on:
            return
        with self.cv:
            self.queue.clear()  # a newer lookahead makes the older guesses stale
            self.queue.extend(k for k in keys if k not in self.entries and k not in self.pending)
            self.cv.notify_all()

    def _worker(self) -> None:
        while True:
            with self.cv:
                while not self.queue and not self._stop:
                    self.cv.wait()
                if self._stop:
                    return
                key = self.queue.popleft()
                if key in self.entries or key in self.pending:
                    continue
                slot = self._take_slot()
                if slot is None:  # every slot pinned by the layer being computed
                    self.counts["prefetch_dropped"] += 1
                    continue
                self.pending[key] = True
            try:
                t = self.store.read(*key, out=self._slot_view(slot))
            except Exception as e:  # noqa: BLE001  (the demand read of the same expert raises it where it is seen)
                log.warning("prefetch of routed expert %s failed: %s", key, e)
                t = None
            with self.cv:
                del self.pending[key]
                if t is not None:
                    self.slot_of[key] = slot
                    self._insert(key, t, force=False)
                    self.unused_prefetch.add(key)
                    self.counts["prefetched"] += 1
                else:
                    self.free.append(slot)
                self.cv.notify_all()

    def stats(self) -> dict:
        with self.cv:
            c = dict(self.counts)
        hits, misses = c.get("hits", 0), c.get("misses", 0)
        return {**{k: c.get(k, 0) for k in ("hits", "misses", "prefetched", "prefetch_used", "prefetch_wasted",
                                           "prefetch_dropped", "waited_on_prefetch", "overflow_reads")},
                "hit_rate": hits / (hits + misses) if hits + misses else 0.0, "cache_bytes": self.bytes,
                "peak_cache_bytes": self.peak_bytes, "capacity_bytes": self.capacity,
                "bytes_read": self.store.bytes_read, "reads": self.store.reads, "read_s": self.store.read_s}

    def reset_stats(self) -> None:
        with self.cv:
            self.counts.clear()
            self.unused_prefetch.clear()
        with self.store.lock:
            self.store.bytes_read = self.store.reads = 0
            self.store.read_s = 0.0

    def clear(self) -> None:
        """Forget every cached expert (not the counters)."""
        with self.cv:
            self.queue.clear()
            for k in [k for k in self.entries if not self.pins[k]]:
                self.bytes -= sum(t.numel() for t in self.entries.pop(k))
                self.free.append(self.slot_of.pop(k))
            self.unused_prefetch.clear()

    def close(self) -> None:
        with self.cv:
            self._stop = True
            self.cv.notify_all()
        if self._thread is not None:
            self._thread.join()
        self.store.close()


# ---------------------------------------------------------------------------------------------- experts
class _Workspace:
    """One reused fp32 buffer for dequantized experts: a fresh allocation per layer would page-fault its way in
    (a quarter of the dequantization's time here)."""

    def __init__(self):
        self.buf = torch.empty(0)

    def take(self, n: int) -> torch.Tensor:
        if self.buf.numel() < n:
            self.buf = torch.empty(n)
        return self.buf[:n]


def _dequant_into(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Packed MXFP4 codes [n, out, in/2] + E8M0 scales [n, out, in/32] -> `out` viewed [n, out, in] (fp32), the
    values `k3.ops.mx.dequantize_mx` gives, bit for bit (the same table and products)."""
    n_blocks = scales.numel()
    p = out.view(n_blocks, BLOCK)
    torch.index_select(_e2m1_pair_values(codes.device), 0, codes.reshape(-1).int(), out=p.view(-1, 2))
    p.mul_(_scale_values(scales.reshape(-1)).unsqueeze(-1))
    return out.view(*scales.shape[:-1], scales.shape[-1] * BLOCK)


class StreamedExperts(nn.Module):
    """RoutedExperts whose packed weights come from an `ExpertCache`: forward(x [N, dim], weights [N, k],
    experts [N, k]) -> [N, dim], as `PackedRoutedExperts` computes it (grouped path, same kernel choice,
    same combine), reading only the experts the batch routes to, at most `chunk` experts dequantized at once."""

    def __init__(self, cache: ExpertCache, layer: int, n_experts: int, dim: int, ffn: int, chunk: int,
                 workspace: _Workspace, act_format=None, glu=None):
        super().__init__()
        self.cache, self.layer, self.n_experts, self.dim, self.ffn = cache, layer, n_experts, dim, ffn
        self.chunk, self.workspace = max(1, chunk), workspace
        self.weight_format, self.act_format, self.glu = "mxfp4", act_format, glu
        self.impl, self.backend = "grouped", "auto"
        self.register_buffer("_dtype", torch.zeros(0), persistent=False)  # follows model.to(dtype)

    def quant_act(self, a: torch.Tensor) -> torch.Tensor:
        from k3.ops.mx.fake import fake_quant

        return fake_quant(a, self.act_format)

    def _weights(self, packed: list[tuple[torch.Tensor, ...]]):
        n, dim, ffn = len(packed), self.dim, self.ffn
        ws = self.workspace.take(n * 3 * dim * ffn)
        out = []
        for i, name in enumerate(("w1", "w3", "w2")):
            codes = torch.stack([p[2 * i] for p in packed])
            scales = torch.stack([p[2 * i + 1] for p in packed])
            w = _dequant_into(codes, scales, ws[i * n * dim * ffn:(i + 1) * n * dim * ffn]).transpose(1, 2)
            out.append(w if self._dtype.dtype == torch.float32 else w.to(self._dtype.dtype))
        return out

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        weights = weights.to(x.dtype)
        x = self.quant_act(x)
        N, k = experts.shape
        if N == 0:
            return x.new_zeros(0, self.dim)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.n_experts)
        xs = x[order // k]
        meta_w1 = torch.empty(self.dim, self.ffn, device="meta")
        meta_w2 = torch.empty(self.ffn, self.dim, device="meta")
        backend = self.backend if self.backend != "auto" else _grouped_backend(xs, counts, meta_w1, meta_w2)
        used = counts.nonzero().flatten().tolist()
        out_sorted = torch.empty(xs.shape[0], self.dim, dtype=x.dtype)
        row = 0
        for c0 in range(0, len(used), self.chunk):
            ids = used[c0:c0 + self.chunk]
            keys = [(self.layer, e) for e in ids]
            packed = self.cache.acquire(keys)
            try:
                w1, w3, w2 = self._weights(packed)
                cnt = counts[ids]
                n_rows = int(cnt.sum())
                out_sorted[row:row + n_rows] = grouped_glu(xs[row:row + n_rows], cnt, w1, w3, w2, backend,
                                                           act=self.quant_act, glu=self.glu)
                row += n_rows
            finally:
                self.cache.release(keys)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        out = out_sorted[inverse].view(N, k, self.dim)
        return torch.bmm(weights.unsqueeze(1), out).squeeze(1)

    def extra_repr(self) -> str:
        return f"layer={self.layer}, n_experts={self.n_experts}, dim={self.dim}, ffn={self.ffn}, streamed from disk"


# ---------------------------------------------------------------------------------------------- lookahead
def _lookahead_hook(cache: ExpertCache, layer: int, router):
    """A forward pre-hook for a channel mixer: apply the next MoE layer's router to this mixer's input and
    prefetch the experts it would choose (selection on s + b, as Router.forward selects)."""
    def hook(module, args):
        x = args[0]
        with torch.no_grad():
            s = router.scores(x).reshape(-1, router.n_experts) + router.bias.float()
            chosen = torch.unique(s.topk(router.top_k, dim=-1).indices).tolist()
        cache.prefetch([(layer, e) for e in chosen])
    return hook


# ---------------------------------------------------------------------------------------------- loading
def _tensor_bytes(t: torch.Tensor) -> int:
    if hasattr(t, "qdata"):  # torchao Float8Tensor: fp8 codes and per-row scales
        return t.qdata.numel() * t.qdata.element_size() + t.scale.numel() * t.scale.element_size()
    return t.numel() * t.element_size()


def _module_bytes(model: nn.Module) -> int:
    seen = {}
    for t in list(model.parameters()) + list(model.buffers()):
        seen[id(t)] = t  # a tied head counts once
    return sum(_tensor_bytes(t) for t in seen.values())


def _fp8_linear(model: nn.Module):
    """Which trunk matrices an fp8 trunk stores in fp8: every nn.Linear except MLA's wkv_b (its absorbed decode
    reads the weight's values directly) and a head tied to the embedding (the embedding is a lookup)."""
    tied = getattr(model, "head", None) is not None and model.head.weight is model.embed.weight

    def keep(module: nn.Module, name: str) -> bool:
        return (isinstance(module, nn.Linear) and not name.endswith("wkv_b")
                and not (tied and name.endswith("head")))
    return keep


def _fill_in_parts(model, entries, tensors, chosen, path, dtype, fp8: bool) -> None:
    """Materialize and fill the model one top-level part (embedding, each block, ...) at a time, each cast to
    `dtype` and, with `fp8`, its matrices quantized to fp8 (torchao Float8WeightOnlyConfig: e4m3 codes, a scale
    per row) before the next is read: the peak is the loaded trunk plus one block in full precision, not the
    whole trunk in bf16 (113 GB for the released K3, against 57 GB in fp8)."""
    from k3.io.kimi import CheckpointFormatError, _reset_unsaved

    keep = _fp8_linear(model)
    tied = model.head.weight is model.embed.weight
    parts = [(f"layers.{i}", b) for i, b in enumerate(model.layers)]
    parts += [(n, m) for n, m in model.named_children() if n != "layers"]
    by_part: dict = {n: [] for n, _ in parts}
    for e in entries:
        head = e.k3.split(".")[0]
        by_part[f"layers.{e.k3.split('.')[1]}" if head == "layers" else head].append(e)
    if fp8:
        from torchao.quantization import Float8WeightOnlyConfig, quantize_
    for name, part in parts:
        part.to_empty(device="cpu")
        if dtype is not None:
            part.to(dtype)
        state = part.state_dict()
        with torch.no_grad():
            for e in by_part[name]:
                t = e.to_k3([tensors.get(chosen[n]) for n in e.names])
                key = e.k3[len(name) + 1:]
                if tuple(t.shape) != tuple(state[key].shape):
                    raise CheckpointFormatError(f"{path}: {e.names[0]}: as k3's {e.k3} it has shape "
                                                f"{tuple(t.shape)}, config.json wants {tuple(state[key].shape)}")
                state[key].copy_(t)
        if fp8:
            quantize_(part, Float8WeightOnlyConfig(), filter_fn=lambda m, fqn, p=name: keep(m, f"{p}.{fqn}"))
    if tied:
        model.head.weight = model.embed.weight  # re-tie after the parts were materialized apart
    _reset_unsaved(model)


def min_budget(trunk_bytes: int, expert_bytes: int, expert_fp32_bytes: int, top_k: int) -> int:
    """The least RAM a streamed model runs in: the trunk, one token's experts of a layer packed, and their
    dequantized working copy."""
    return trunk_bytes + top_k * (expert_bytes + expert_fp32_bytes)


def load_streaming(path: str | os.PathLike, ram_budget, dtype: torch.dtype | None = None, prefetch: bool = True,
                   drop_pages: bool = True, trunk: str | None = None):
    """K3Model (eval mode) from a released-layout folder with MXFP4 routed experts, the experts streamed from the
    folder's files (see the module docstring). `ram_budget`: bytes (or '8GB') for the trunk, the expert cache
    and the dequantization workspace together; a budget below `min_budget` is refused with the numbers.
    The model's `expert_cache` attribute is the ExpertCache (stats(), reset_stats(), clear(), close()).
    `trunk="fp8"` stores the trunk's matrices in fp8 (e4m3, a scale per row; computed in `dtype`), half of bf16:
    what fits the released K3's trunk (57 GB) in a 64 GB machine."""
    from k3.io.kimi import CheckpointFormatError, Tensors, _converted_shape, _resolve_names, read_config, tensor_map
    from k3.quant.export import build_packed_model

    budget = parse_bytes(ram_budget)
    if trunk not in (None, "fp8"):
        raise ValueError(f"trunk = {trunk!r}: give None (the trunk in `dtype`) or 'fp8'")
    path = Path(path)
    d, config = read_config(path)
    if config.qat.get("expert_weights") != "mxfp4":
        raise CheckpointFormatError(f"{path}: streamed experts need MXFP4-packed routed experts (K3's release, "
                                    "quantization_config mxfp4-pack-quantized); this folder stores them unpacked: "
                                    "load it resident (experts='resident'), or export it with "
                                    "`k3 export --format kimi` from an MXFP4 QAT checkpoint")
    mt = d["model_type"]
    with torch.device("meta"):
        model = build_packed_model(config)
    entries = tensor_map(config, mt, True)
    tensors = Tensors(path)
    chosen = _resolve_names(entries, tensors, path)
    moe_idx = [i for i in range(config.n_layers) if config.is_moe_layer(i)]
    pat = re.compile(r"layers\.(\d+)\.ffn\.experts\.(w[123]_(?:codes|scales))$")
    names = {i: {} for i in moe_idx}
    trunk_entries = []
    for e in entries:
        m = pat.search(e.k3)
        if m:
            names[int(m.group(1))][m.group(2)] = [chosen[n] for n in e.names]
        else:
            trunk_entries.append(e)
    want = dict(model.state_dict(keep_vars=True))
    for e in entries:  # every shape, the experts' too, before any data
        got = _converted_shape(e, [tensors.shape(chosen[n]) for n in e.names])
        if got is not None and tuple(want[e.k3].shape) != got:
            raise CheckpointFormatError(f"{path}: {e.names[0]}{' ...' if len(e.names) > 1 else ''} has shape "
                                        f"{got} as k3's {e.k3}, but config.json wants {tuple(want[e.k3].shape)}")
    per_expert = [[[names[i][p][ex] for p in PARTS] for ex in range(config.n_experts)] for i in moe_idx]
    store = ExpertStore(tensors, per_expert, drop_pages=drop_pages)
    moes = model.moe_layers()
    dim, ffn = moes[0].experts.dim, moes[0].experts.ffn
    elt = (dtype or torch.float32).itemsize
    fp8_weights = set()
    if trunk == "fp8":
        keep = _fp8_linear(model)
        fp8_weights = {f"{n}.weight" for n, m in model.named_modules() if keep(m, n)}

    def nbytes(n, t):
        if n in fp8_weights:
            return t.numel() + t.shape[0] * 4  # e4m3 codes + an fp32 scale per row
        return t.numel() * (elt if t.is_floating_point() else t.element_size())
    trunk_bytes = sum(nbytes(n, t) for n, t in model.state_dict().items() if ".experts." not in n)
    fp32_expert = 3 * dim * ffn * 4
    need = min_budget(trunk_bytes, store.expert_bytes, fp32_expert, config.n_active_experts)
    if budget < need:
        store.close()
        raise ValueError(
            f"ram_budget {budget / 1e9:.2f} GB is below what {config.name} needs to run streamed: the trunk "
            f"{trunk_bytes / 1e9:.2f} GB + one token's {config.n_active_experts} experts of a layer "
            f"({config.n_active_experts} x {store.expert_bytes / 1e6:.2f} MB packed + "
            f"{fp32_expert / 1e6:.2f} MB dequantized) = {need / 1e9:.2f} GB; give at least "
            f"{need / 1e9:.2f} GB (--ram-budget), or a smaller trunk ("
            + ("dtype bf16 halves it, trunk='fp8' / --trunk fp8 quarters it)" if trunk is None else "there is none)"))
    chunk = config.n_active_experts
    capacity = budget - trunk_bytes - chunk * fp32_expert
    cache = ExpertCache(store, capacity, prefetch=prefetch)
    workspace = _Workspace()
    for j, moe in enumerate(moes):
        e = moe.experts
        moe.experts = StreamedExperts(cache, j, e.n_experts, e.dim, e.ffn, chunk, workspace, e.act_format, e.glu)
    _fill_in_parts(model, trunk_entries, tensors, chosen, path, dtype, fp8=trunk == "fp8")
    if prefetch:  # the next MoE layer's experts, guessed when each channel mixer starts
        for li, block in enumerate(model.layers):
            nxt = [j for j, i in enumerate(moe_idx) if i > li]
            if nxt:
                block.ffn.register_forward_pre_hook(_lookahead_hook(cache, nxt[0], moes[nxt[0]].router))
    model.expert_cache = cache
    model.stream_info = {"ram_budget": budget, "trunk_bytes": _module_bytes(model), "expert_bytes": store.expert_bytes,
                         "experts_on_disk_bytes": store.expert_bytes * config.n_experts * len(moe_idx),
                         "cache_capacity": capacity, "workspace_bytes": chunk * fp32_expert,
                         "min_budget": need, "prefetch": prefetch, "trunk": trunk or str(dtype or torch.float32)}
    log.info("streaming %s: trunk %.2f GB resident, %.2f GB of experts on disk, cache %.2f GB",
             config.name, trunk_bytes / 1e9, model.stream_info["experts_on_disk_bytes"] / 1e9, capacity / 1e9)
    return model.eval()
