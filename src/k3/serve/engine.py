"""Generation engine: chunked prefill and continuous batching over the hybrid cache.

Each `step()`, in order: drops cancelled requests; admits waiting ones while fewer than `max_batch` are in
flight; runs one prefill round (every request still reading its prompt feeds at most `prefill_chunk` tokens; new
prompts that fit one chunk run as one packed row, k3.model.segments, other pieces of equal length as one batch);
lets prefilled requests join the running batch (`HybridCache.merge`) and decodes one token for every running
row; drops finished rows (`HybridCache.select`). Every request samples with its own parameters and
`torch.Generator`, so its tokens do not depend on its batch-mates. Events stream to a per-request callback.
The scheduling (Orca's iteration-level batching, Sarathi's chunked prefill): docs/serving.md.
"""
from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from k3.data.tokenizer import SPECIAL_TOKENS
from k3.model.cache import HybridCache
from k3.model.sampling import SamplingParams, sample_row

log = logging.getLogger(__name__)

EOS_ID = SPECIAL_TOKENS.index("<|eos|>")


class EngineFull(RuntimeError):
    """Every batch slot and queue place is taken; retry later (HTTP 429)."""


class ContextLengthError(ValueError):
    """The prompt (plus max_tokens) does not fit the model's context."""


@dataclass
class TokenEvent:
    """One sampled token (or the end of a request). `text` is the newly visible text, possibly empty: text
    that could still turn into a stop sequence or an incomplete UTF-8 character is held back."""

    request: "Request"
    token_id: int | None
    text: str
    finish_reason: str | None = None  # stop | length | cancelled | error


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    on_event: Callable[[TokenEvent], None] | None = None
    id: str = ""
    output_ids: list[int] = field(default_factory=list)
    text: str = ""  # decoded output so far (stop sequence cut off once found)
    finish_reason: str | None = None
    error: str | None = None
    state: str = "waiting"  # waiting | prefill | running | finished
    t_submit: float = 0.0
    t_first_token: float | None = None
    t_done: float | None = None
    # engine-private
    cancelled: bool = False
    cache: HybridCache | None = None
    prefilled: int = 0
    pending: int | None = None  # last sampled token, not yet fed to the model
    generator: torch.Generator | None = None
    counts: torch.Tensor | None = None      # token counts over prompt + output (repetition penalty)
    out_counts: torch.Tensor | None = None  # over the output alone (frequency and presence penalties)
    _tail: list[int] = field(default_factory=list)  # sampled ids not yet decoded (incomplete UTF-8)
    _sent: int = 0  # characters of `text` already delivered in events
    _markers: list[tuple[int, int]] = field(default_factory=list)  # spans of kept special tokens in `text`
    _done: threading.Event = field(default_factory=threading.Event)

    @property
    def finished(self) -> bool:
        return self.state == "finished"

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)


class Engine:
    """Continuous-batching generator over a K3Model. Thread-safe `submit`/`cancel`; `step` from one thread."""

    def __init__(self, model, tokenizer=None, *, max_batch: int = 8, max_queue: int = 64,
                 prefill_chunk: int = 512, eos_id: int | None = None, packed_prefill: bool = True):
        for name, v, lo in (("max_batch", max_batch, 1), ("max_queue", max_queue, 0),
                            ("prefill_chunk", prefill_chunk, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} = {v!r} must be an integer >= {lo}")
        self.model = model.eval()
        self.config = model.config
        self.tokenizer = tokenizer
        if tokenizer is not None and tokenizer.vocab_size != self.config.vocab_size:
            raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                             f"{self.config.vocab_size}; serve the tokenizer the model was trained with")
        self.max_batch, self.max_queue, self.prefill_chunk = max_batch, max_queue, prefill_chunk
        self.packed_prefill = packed_prefill
        self.eos_id = eos_id if eos_id is not None else (tokenizer.eos_id if tokenizer is not None else EOS_ID)
        self.device = next(model.parameters()).device
        self.waiting: collections.deque[Request] = collections.deque()
        self.prefilling: list[Request] = []
        self.running: list[Request] = []
        self.joining: list[Request] = []  # prefilled, first token sampled, not yet merged into the batch
        self.batch: HybridCache | None = None  # one row per running request, in `running` order
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._ids = itertools.count()
        self.steps = 0

    # ------------------------------------------------------------------ public interface
    @property
    def max_context(self) -> int:
        return self.config.max_context

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError (ContextLengthError for length) for a request this engine cannot run."""
        params.validate(self.config.vocab_size)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop sequences need a tokenizer; make the Engine with one")
        if not prompt_ids:
            raise ValueError("the prompt is empty; give at least one token")
        V = self.config.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V for t in prompt_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {V})")
        n, m, ctx = len(prompt_ids), params.max_tokens, self.max_context
        if n + m > ctx:
            raise ContextLengthError(f"this model's maximum context length is {ctx} tokens, but {n + m} were "
                                     f"requested ({n} in the prompt, {m} to generate); shorten the prompt or "
                                     "lower max_tokens")

    def submit(self, prompt_ids: Iterable[int], params: SamplingParams | None = None,
               on_event: Callable[[TokenEvent], None] | None = None, request_id: str | None = None) -> Request:
        """Queue a request; raises ValueError for a bad request and EngineFull when slots and queue are taken."""
        prompt_ids = [int(t) if hasattr(t, "__index__") and not isinstance(t, bool) else t for t in prompt_ids]
        params = params if params is not None else SamplingParams()
        self.check_request(prompt_ids, params)
        req = Request(prompt_ids, params, on_event, request_id or f"req-{next(self._ids)}",
                      t_submit=time.perf_counter())
        with self._lock:
            if self.in_flight >= self.max_batch + self.max_queue:
                raise EngineFull(f"the engine is full ({self.max_batch} running, {self.max_queue} queued); retry later")
            self.waiting.append(req)
        self._wake.set()
        return req

    def cancel(self, req: Request) -> None:
        """Stop a request (from any thread); its slot frees at the next step."""
        req.cancelled = True
        self._wake.set()

    @property
    def in_flight(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.joining) + len(self.running)

    def has_work(self) -> bool:
        return self.in_flight > 0

    def wait_for_work(self, timeout: float | None = None) -> bool:
        """Block until a request arrives or is cancelled (or `timeout`); True when there is work."""
        if self.has_work():
            return True
        self._wake.wait(timeout)
        self._wake.clear()
        return self.has_work()

    def wake(self) -> None:
        self._wake.set()

    def stats(self) -> dict:
        batch = self.batch  # read once: the engine thread may swap it meanwhile
        return {"running": len(self.running), "prefilling": len(self.prefilling), "waiting": len(self.waiting),
                "max_batch": self.max_batch, "max_queue": self.max_queue, "steps": self.steps,
                "cache_bytes": batch.nbytes() if batch is not None else 0}

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 on_event: Callable[[TokenEvent], None] | None = None) -> list[Request]:
        """Run `prompts` to completion together (continuous batching if more than max_batch)."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} SamplingParams; give one per prompt or one")
        for p, sp in zip(prompts, plist):  # every request checked before any is queued
            self.check_request(list(p), sp)
        reqs = []
        for p, sp in zip(prompts, plist):
            while self.in_flight >= self.max_batch + self.max_queue:  # synchronous: make room by running
                self.step()
            reqs.append(self.submit(p, sp, on_event))
        while self.has_work():
            self.step()
        return reqs

    def fail_all(self, message: str) -> None:
        """End every request with finish_reason 'error' (after an unexpected failure inside a step)."""
        with self._lock:
            reqs = list(self.waiting) + self.prefilling + self.joining + self.running
            self.waiting.clear()
        self.prefilling, self.joining, self.running, self.batch = [], [], [], None
        for r in reqs:
            r.error = message
            self._finish(r, "error", None)

    # ------------------------------------------------------------------ one scheduling iteration
    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Admit, prefill one chunk round, decode one token for every running request. Returns finished ones."""
        self.steps += 1
        done: list[Request] = []
        self._drop_cancelled(done)
        with self._lock:
            while self.waiting and len(self.prefilling) + len(self.running) < self.max_batch:
                r = self.waiting.popleft()
                r.state, r.cache = "prefill", self.model.new_cache()
                self.prefilling.append(r)
        self.joining = self._prefill_round(done) if self.prefilling else []
        if self.joining:
            rows = ([self.batch] if self.batch is not None else []) + [r.cache for r in self.joining]
            self.batch = HybridCache.merge(rows)
            for r in self.joining:
                r.cache, r.state = None, "running"
            self.running.extend(self.joining)
            self.joining = []
        if self.running:
            self._decode(done)
        return done

    def _drop_cancelled(self, done: list[Request]) -> None:
        with self._lock:
            gone = [r for r in self.waiting if r.cancelled]
            if gone:
                self.waiting = collections.deque(r for r in self.waiting if not r.cancelled)
        gone += [r for r in self.prefilling if r.cancelled]
        self.prefilling = [r for r in self.prefilling if not r.cancelled]
        if any(r.cancelled for r in self.running):
            gone += [r for r in self.running if r.cancelled]
            self._keep_rows([i for i, r in enumerate(self.running) if not r.cancelled])
        for r in gone:
            self._finish(r, "cancelled", None)
            done.append(r)

    def _keep_rows(self, keep: list[int]) -> None:
        self.running = [self.running[i] for i in keep]
        self.batch = self.batch.select(keep) if keep else None

    def _prefill_round(self, done: list[Request]) -> list[Request]:
        ready: list[tuple[Request, torch.Tensor]] = []
        whole = [r for r in self.prefilling if r.prefilled == 0 and len(r.prompt_ids) <= self.prefill_chunk]
        if self.packed_prefill and len(whole) > 1:
            ready += self._packed_prefill(whole)
        groups: dict[tuple[int, bool], list[Request]] = collections.defaultdict(list)
        for r in self.prefilling:
            if self.packed_prefill and len(whole) > 1 and r in whole:
                continue
            n = min(self.prefill_chunk, len(r.prompt_ids) - r.prefilled)
            groups[(n, r.cache.batch_size is None)].append(r)
        for (n, _fresh), rs in groups.items():
            ids = torch.tensor([r.prompt_ids[r.prefilled:r.prefilled + n] for r in rs], device=self.device)
            cache = rs[0].cache if len(rs) == 1 else HybridCache.merge([r.cache for r in rs])
            h = self.model.hidden_states(ids, cache)  # [g, n, d]
            caches = [cache] if len(rs) == 1 else cache.split()
            last = [i for i, r in enumerate(rs) if r.prefilled + n == len(r.prompt_ids)]
            logits = self.model.head(h[last, -1]) if last else None  # [len(last), V]: only where a token is due
            for r, c in zip(rs, caches):
                r.cache, r.prefilled = c, r.prefilled + n
                r.cache.seen_tokens = r.prefilled
            for j, i in enumerate(last):
                ready.append((rs[i], logits[j]))
        joining = self.joining = []  # counted in in_flight while it fills: a request is never in no list
        for r, logits in ready:
            try:
                if r.params.penalised:
                    r.counts = torch.bincount(torch.tensor(r.prompt_ids),
                                              minlength=self.config.vocab_size).to(self.device)
                    r.out_counts = torch.zeros_like(r.counts)
                r.generator = torch.Generator(device=self.device)
                if r.params.seed is not None:
                    r.generator.manual_seed(r.params.seed % 2**64)  # any int: torch takes [0, 2^64)
                else:
                    r.generator.seed()
                finished = self._accept(r, sample_row(logits, r.params, r.counts, r.generator, r.out_counts))
            except Exception as e:  # noqa: BLE001 - this request's own failure ends it alone
                self.prefilling.remove(r)
                self._fail(r, e, done)
                continue
            if finished:
                done.append(r)
            else:
                joining.append(r)
            self.prefilling.remove(r)
        return joining

    def _packed_prefill(self, rs: list[Request]) -> list[tuple[Request, torch.Tensor]]:
        """New prompts that each fit one chunk, prefilled as one packed row [1, sum of lengths]: every prompt into
        its own fresh cache, as if alone; returns (request, logits at its last prompt token)."""
        ids = torch.tensor([[t for r in rs for t in r.prompt_ids]], device=self.device)
        doc_ids = torch.tensor([[i for i, r in enumerate(rs) for _ in r.prompt_ids]], device=self.device)
        caches = [self.model.new_cache() for _ in rs]
        h = self.model.hidden_states(ids, doc_ids=doc_ids, doc_caches=caches)  # [1, T, d]
        ends = torch.tensor([len(r.prompt_ids) for r in rs], device=self.device).cumsum(0) - 1
        logits = self.model.head(h[0, ends])
        for r, c in zip(rs, caches):
            r.cache, r.prefilled = c, len(r.prompt_ids)
        return list(zip(rs, logits))

    def _fail(self, r: Request, e: Exception, done: list[Request]) -> None:
        log.exception("request %s failed; the others go on", r.id)
        r.error = f"{type(e).__name__}: {e}"
        self._finish(r, "error", None)
        done.append(r)

    def _decode(self, done: list[Request]) -> None:
        ids = torch.tensor([[r.pending] for r in self.running], device=self.device)
        self.batch.seen_tokens = max(len(r.prompt_ids) + len(r.output_ids) - 1 for r in self.running)
        logits = self.model(ids, self.batch)[:, -1]  # [B, V]
        keep = []
        for i, r in enumerate(self.running):
            try:
                finished = self._accept(r, sample_row(logits[i], r.params, r.counts, r.generator, r.out_counts))
            except Exception as e:  # noqa: BLE001 - this request's own failure ends it alone
                self._fail(r, e, done)
                continue
            if finished:
                done.append(r)
            else:
                keep.append(i)
        if len(keep) < len(self.running):
            self._keep_rows(keep)

    # ------------------------------------------------------------------ tokens, text and finishing
    def _accept(self, r: Request, tok: int) -> bool:
        """Record a sampled token, stream its text; True when the request finished with it."""
        if r.t_first_token is None:
            r.t_first_token = time.perf_counter()
        r.output_ids.append(tok)
        r.pending = tok
        if r.counts is not None:
            r.counts[tok] += 1
            r.out_counts[tok] += 1
        p = r.params
        reason = None
        special = tok < len(SPECIAL_TOKENS)
        if (tok == self.eos_id and not p.ignore_eos) or tok in p.stop_token_ids:
            reason = "stop"  # the end token itself is not part of the text
        elif special and SPECIAL_TOKENS[tok] in p.stop:
            reason = "stop"  # a stop string that names a special token (e.g. "<|end|>") stops, kept or skipped
        elif not special:
            r._tail.append(tok)
        elif not p.skip_special_tokens and self.tokenizer is not None:
            # a kept special token (the chat markers) is text the caller never sees as such: the text before it is
            # complete, and no stop string may match inside its markup ("thin" in <|think|>)
            self._flush_text(r, final=True)
            start = len(r.text)
            r.text += self.tokenizer.decode([tok], skip_special=False)
            r._markers.append((start, len(r.text)))
        if reason is None and self._found_stop(r):
            reason = "stop"
        if reason is None and (len(r.output_ids) >= p.max_tokens
                               or len(r.prompt_ids) + len(r.output_ids) >= self.max_context):
            reason = "length"
        self._flush_text(r, final=reason is not None)
        if reason is not None:
            self._finish(r, reason, tok)
            return True
        self._emit(TokenEvent(r, tok, self._take_text(r, final=False)))
        return False

    def _flush_text(self, r: Request, final: bool) -> None:
        if self.tokenizer is None or not r._tail:
            return
        piece = self.tokenizer.decode(r._tail, skip_special=r.params.skip_special_tokens)
        if final or not piece.endswith("\ufffd"):  # an incomplete UTF-8 character waits for its next bytes
            r.text += piece
            r._tail = []

    def _found_stop(self, r: Request) -> bool:
        if not r.params.stop:
            return False
        self._flush_text(r, final=False)
        hits = []
        for s in r.params.stop:
            i = r.text.find(s, r._sent)
            while i >= 0 and any(a < i + len(s) and i < b for a, b in r._markers):  # inside a marker's markup
                i = r.text.find(s, i + 1)
            if i >= 0:
                hits.append(i)
        if not hits:
            return False
        r.text, r._tail = r.text[:min(hits)], []
        return True

    def _take_text(self, r: Request, final: bool) -> str:
        end = len(r.text)
        if not final:  # hold back what may be the start of a stop string, never a marker's markup
            end = max(end - _partial_stop(r.text, r.params.stop), r._markers[-1][1] if r._markers else 0)
        delta = r.text[r._sent:end]
        r._sent = max(r._sent, end)
        return delta

    def _finish(self, r: Request, reason: str, tok: int | None) -> None:
        r.finish_reason, r.state, r.t_done = reason, "finished", time.perf_counter()
        r.cache, r.counts, r.out_counts, r.generator = None, None, None, None
        self._emit(TokenEvent(r, tok, self._take_text(r, final=True), reason))
        r._done.set()

    def _emit(self, ev: TokenEvent) -> None:
        if ev.request.on_event is None:
            return
        try:
            ev.request.on_event(ev)
        except Exception:  # a broken consumer must not take the batch down with it
            log.exception("event callback of %s failed; cancelling it", ev.request.id)
            ev.request.cancelled = True


def _partial_stop(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is the start of some stop sequence (held back)."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
