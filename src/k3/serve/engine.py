"""Generation engine: chunked prefill and continuous batching over the hybrid cache.

Each `step()`, in order: drops cancelled requests; admits waiting ones while fewer than `max_batch` are in
flight; runs one prefill round (every request still reading its prompt feeds at most `prefill_chunk` tokens; new
prompts that fit one chunk run as one packed row, k3.model.segments, other pieces of equal length as one batch);
lets prefilled requests join the running batch (`HybridCache.merge`) and decodes one token for every running
row; drops finished rows (`HybridCache.select`). Every request samples with its own parameters and
`torch.Generator`, so its tokens do not depend on its batch-mates. Events stream to a per-request callback.
The scheduling (Orca's iteration-level batching, Sarathi's chunked prefill): docs/serving.md.

With a prefix cache (`prefix_cache_bytes` > 0, k3.serve.prefix_cache) an admitted request starts from the longest
snapshotted prefix of its prompt (or waits while an earlier request computes whole blocks they share), and prefill
pieces end at the cache's block boundaries so that each one leaves a snapshot. A request whose prompt equals one
still prefilling waits for it and forks its cache (n > 1).
Logprobs, when asked for, are log_softmax of the logits the token was sampled from: after the penalties,
divided by the temperature (1 when greedy), before top-k and top-p.
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

from k3.data.tokenizer import RESERVED_TOKENS, SPECIAL_TOKENS
from k3.model import packing
from k3.model.cache import HybridCache
from k3.model.sampling import SamplingParams, apply_penalties, sample_row
from k3.serve.prefix_cache import PrefixCache
from k3.train.device import autocast

log = logging.getLogger(__name__)

EOS_ID = SPECIAL_TOKENS.index("<|eos|>")
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs


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
    logprob: "Logprob | None" = None  # the token's, when the request asked for logprobs


@dataclass
class Logprob:
    """A token's log-probability and the `top` most likely tokens at its position, as (id, logprob); logprob None
    for a prompt's first token, which nothing predicts."""

    token_id: int
    logprob: float | None
    top: list[tuple[int, float]]


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
    logprobs: int | None = None  # alternatives to report per sampled token (0..20); None: no logprobs
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (completions' echo)
    prompt_only: bool = False  # score the prompt and stop: nothing is generated
    output_logprobs: list[Logprob] = field(default_factory=list)
    prompt_logprob_list: list[Logprob] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache (or a forked prefill)
    logits: list[torch.Tensor] = field(default_factory=list)  # raw logits per sampled token (Engine(keep_logits))
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
    _leader: "Request | None" = None  # the request with the same prompt whose prefill this one forks
    _seen_inserts: int = -1  # the prefix cache's insert count when this request last looked in it
    _followers: list["Request"] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.state == "finished"

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)


class Engine:
    """Continuous-batching generator over a K3Model. Thread-safe `submit`/`cancel`; `step` from one thread."""

    def __init__(self, model, tokenizer=None, *, max_batch: int = 8, max_queue: int = 64,
                 prefill_chunk: int = 512, eos_id: int | None = None, packed_prefill: bool = True,
                 prefix_cache_bytes: int = 0, prefix_block: int = 256, fork_prefill: bool = True,
                 keep_logits: bool = False, precision: str = "fp32"):
        for name, v, lo in (("max_batch", max_batch, 1), ("max_queue", max_queue, 0),
                            ("prefill_chunk", prefill_chunk, 1), ("prefix_cache_bytes", prefix_cache_bytes, 0),
                            ("prefix_block", prefix_block, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} = {v!r} must be an integer >= {lo}")
        if precision not in ("fp32", "bf16"):  # the model's forwards run under its autocast (k3.train.precision)
            raise ValueError(f"precision = {precision!r}: give fp32 or bf16 (resolve auto with "
                             "k3.train.precision.resolve_precision)")
        self.precision = precision
        self.model = model.eval()
        self.config = model.config
        self.tokenizer = tokenizer
        if tokenizer is not None and tokenizer.vocab_size != self.config.vocab_size:
            raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                             f"{self.config.vocab_size}; serve the tokenizer the model was trained with")
        self.max_batch, self.max_queue, self.prefill_chunk = max_batch, max_queue, prefill_chunk
        self.packed_prefill = packed_prefill
        self.prefix = PrefixCache(self.config.pattern, prefix_block, prefix_cache_bytes) if prefix_cache_bytes else None
        self.fork_prefill, self.keep_logits = fork_prefill, keep_logits
        self.prefill_tokens = 0  # prompt tokens run through the model (not taken from a cache or a fork)
        self.eos_id = eos_id if eos_id is not None else (tokenizer.eos_id if tokenizer is not None else EOS_ID)
        # ids below this are special tokens (k3's, and Kimi K3's format tokens where the tokenizer reserves them)
        self.n_special = getattr(tokenizer, "n_special", len(SPECIAL_TOKENS))
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
        self._packing = packing.new_session()  # this engine's packed weight copies (k3.model.packing)

    # ------------------------------------------------------------------ public interface
    @property
    def max_context(self) -> int:
        return self.config.max_context

    def check_request(self, prompt_ids: list[int], params: SamplingParams, logprobs: int | None = None,
                      prompt_logprobs: int | None = None, prompt_only: bool = False) -> None:
        """Raise ValueError (ContextLengthError for length) for a request this engine cannot run."""
        params.validate(self.config.vocab_size)
        for name, v in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_LOGPROBS):
                raise ValueError(f"{name} = {v!r} is invalid: must be an integer in [0, {MAX_LOGPROBS}] or None")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop sequences need a tokenizer; make the Engine with one")
        if not prompt_ids:
            raise ValueError("the prompt is empty; give at least one token")
        V = self.config.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V for t in prompt_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {V})")
        n, m, ctx = len(prompt_ids), 0 if prompt_only else params.max_tokens, self.max_context
        if n + m > ctx:
            raise ContextLengthError(f"this model's maximum context length is {ctx} tokens, but {n + m} were "
                                     f"requested ({n} in the prompt, {m} to generate); shorten the prompt or "
                                     "lower max_tokens")

    def submit(self, prompt_ids: Iterable[int], params: SamplingParams | None = None,
               on_event: Callable[[TokenEvent], None] | None = None, request_id: str | None = None, *,
               logprobs: int | None = None, prompt_logprobs: int | None = None, prompt_only: bool = False) -> Request:
        """Queue a request; raises ValueError for a bad request and EngineFull when slots and queue are taken.
        `logprobs` / `prompt_logprobs`: report each sampled / prompt token's logprob and that many alternatives;
        `prompt_only`: generate nothing (with prompt_logprobs: score the prompt)."""
        prompt_ids = [int(t) if hasattr(t, "__index__") and not isinstance(t, bool) else t for t in prompt_ids]
        params = params if params is not None else SamplingParams()
        self.check_request(prompt_ids, params, logprobs, prompt_logprobs, prompt_only)
        req = Request(prompt_ids, params, on_event, request_id or f"req-{next(self._ids)}",
                      t_submit=time.perf_counter(), logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                      prompt_only=bool(prompt_only))
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
        out = {"running": len(self.running), "prefilling": len(self.prefilling), "waiting": len(self.waiting),
               "max_batch": self.max_batch, "max_queue": self.max_queue, "steps": self.steps,
               "cache_bytes": batch.nbytes() if batch is not None else 0, "prefill_tokens": self.prefill_tokens}
        if self.prefix is not None:
            out["prefix_cache"] = self.prefix.stats()
        return out

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 on_event: Callable[[TokenEvent], None] | None = None, **options) -> list[Request]:
        """Run `prompts` to completion together (continuous batching if more than max_batch). `options`: submit's
        logprobs, prompt_logprobs, prompt_only, for every prompt."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} SamplingParams; give one per prompt or one")
        for p, sp in zip(prompts, plist):  # every request checked before any is queued
            self.check_request(list(p), sp, **options)
        reqs = []
        for p, sp in zip(prompts, plist):
            while self.in_flight >= self.max_batch + self.max_queue:  # synchronous: make room by running
                self.step()
            reqs.append(self.submit(p, sp, on_event, **options))
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
        with autocast(self.device, self.precision, training=False), packing.scope(self._packing):
            return self._step()

    def refresh_weights(self) -> None:
        """Call after changing the model's weights in place while this engine lives (an optimizer step between
        rollouts): the next step rebuilds the packed weight copies it decodes with (k3.model.packing), which cannot
        see a write that leaves the tensors' version counters alone (torch's fused AdamW)."""
        self._packing = packing.new_session()

    def _step(self) -> list[Request]:
        self.steps += 1
        done: list[Request] = []
        self._drop_cancelled(done)
        with self._lock:
            while self.waiting and len(self.prefilling) + len(self.running) < self.max_batch:
                self._admit(self.waiting.popleft())
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

    def _admit(self, r: Request) -> None:
        """Into the prefill list: forking the prefill of an identical prompt, or from the longest cached prefix."""
        r.state = "prefill"
        if r.prompt_logprobs is not None:
            r.prompt_logprob_list = [Logprob(r.prompt_ids[0], None, [])]  # nothing predicts the first token
        leader = None
        if self.fork_prefill and r.prompt_logprobs is None and not r.prompt_only:
            leader = next((q for q in self.prefilling if q._leader is None and not q.prompt_only
                           and q.prompt_ids == r.prompt_ids), None)
        if leader is not None:
            r._leader = leader
            leader._followers.append(r)
        else:
            r.cache = self.model.new_cache()
            if self.prefix is not None and r.prompt_logprobs is None:  # prompt logprobs need every position's logits
                n, cache = self.prefix.match(r.prompt_ids)
                r._seen_inserts = self.prefix.inserts
                if n:
                    r.cache, r.prefilled, r.cached_tokens = cache, n, n
        self.prefilling.append(r)

    def _hand_over(self, r: Request) -> None:
        """A leader that leaves before its prefill ends hands it, as far as it got, to its first follower."""
        heirs = [f for f in r._followers if not f.cancelled]
        r._followers = []
        if heirs:
            heir = heirs[0]
            heir._leader, heir._followers = None, heirs[1:]
            heir.cache, heir.prefilled, heir.cached_tokens = r.cache, r.prefilled, r.cached_tokens
            for f in heir._followers:
                f._leader = heir

    def _drop_cancelled(self, done: list[Request]) -> None:
        with self._lock:
            gone = [r for r in self.waiting if r.cancelled]
            if gone:
                self.waiting = collections.deque(r for r in self.waiting if not r.cancelled)
        gone += [r for r in self.prefilling if r.cancelled]
        self.prefilling = [r for r in self.prefilling if not r.cancelled]
        for r in gone:
            if r._followers:
                self._hand_over(r)
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
        B = self.prefix.block if self.prefix is not None else None
        active = [r for r in self.prefilling if r._leader is None]  # followers wait for their leader's prefill
        if self.prefix is not None:
            active = self._share_prefixes(active)
        fits = self.prefill_chunk if B is None else min(self.prefill_chunk, B)  # with a prefix cache: no block inside
        whole = [r for r in active if r.prefilled == 0 and len(r.prompt_ids) <= fits]
        packed = self.packed_prefill and len(whole) > 1
        if packed:
            ready += self._packed_prefill(whole)
        # each request feeds up to prefill_chunk tokens this round; with a prefix cache in several pieces that end
        # at block boundaries, where it takes a snapshot
        budget = {id(r): self.prefill_chunk for r in active if not (packed and r in whole)}
        todo = [r for r in active if id(r) in budget]
        while todo:
            ready += self._prefill_pieces(todo, budget, B)
            todo = [r for r in todo if budget[id(r)] > 0 and r.prefilled < len(r.prompt_ids)]
        return self._finish_prefill(ready, done)

    def _share_prefixes(self, active: list[Request]) -> list[Request]:
        """Requests that have computed nothing of their own yet take what the prefix cache gained since they last
        looked, and wait while an earlier request is still computing the blocks they share with it (so that
        sessions that start together with one system prompt prefill it once). Returns those that go on."""
        B, go = self.prefix.block, []
        for i, r in enumerate(active):
            if r.prefilled != r.cached_tokens or r.prompt_logprobs is not None:
                go.append(r)
                continue
            if r._seen_inserts != self.prefix.inserts:
                r._seen_inserts = self.prefix.inserts
                n, cache = self.prefix.match(r.prompt_ids, longer_than=r.prefilled, again=True)
                if n:
                    r.cache, r.prefilled, r.cached_tokens = cache, n, n
            if not any(q.prefilled < _shared_blocks(r.prompt_ids, q.prompt_ids, B, r.prefilled) for q in active[:i]):
                go.append(r)
        return go

    def _prefill_pieces(self, rs: list[Request], budget: dict[int, int], B: int | None) -> list[tuple]:
        """One forward per group of equal-length next pieces; returns (request, logits) for prompts now done."""
        ready = []
        groups: dict[tuple[int, bool], list[Request]] = collections.defaultdict(list)
        for r in rs:
            n = min(budget[id(r)], len(r.prompt_ids) - r.prefilled)
            if B is not None:
                n = min(n, B - r.prefilled % B)
            budget[id(r)] -= n
            groups[(n, r.cache.batch_size is None)].append(r)
        for (n, _fresh), rs in groups.items():
            ids = torch.tensor([r.prompt_ids[r.prefilled:r.prefilled + n] for r in rs], device=self.device)
            cache = rs[0].cache if len(rs) == 1 else HybridCache.merge([r.cache for r in rs])
            h = self.model.hidden_states(ids, cache)  # [g, n, d]
            self.prefill_tokens += n * len(rs)
            for i, r in enumerate(rs):
                if r.prompt_logprobs is not None:
                    self._score_prompt(r, h[i], r.prefilled)
            caches = [cache] if len(rs) == 1 else cache.split()
            last = [i for i, r in enumerate(rs) if r.prefilled + n == len(r.prompt_ids)]
            logits = self.model.head(h[last, -1]) if last else None  # [len(last), V]: only where a token is due
            for r, c in zip(rs, caches):
                r.cache, r.prefilled = c, r.prefilled + n
                r.cache.seen_tokens = r.prefilled
                if B is not None and (r.prefilled % B == 0 or r.prefilled == len(r.prompt_ids)):
                    self.prefix.insert(r.prompt_ids, r.prefilled, r.cache)
            for j, i in enumerate(last):
                ready.append((rs[i], logits[j]))
        return ready

    def _finish_prefill(self, ready: list[tuple[Request, torch.Tensor]], done: list[Request]) -> list[Request]:
        forked = []
        for r, logits in ready:  # followers take the leader's cache and logits: one prefill for identical prompts
            forked.append((r, logits))
            for f in r._followers:
                if f.state == "prefill" and not f.cancelled:
                    f._leader, f.cache, f.prefilled, f.cached_tokens = None, r.cache, r.prefilled, len(f.prompt_ids)
                    forked.append((f, logits))
            r._followers = []
        ready = forked
        joining = self.joining = []  # counted in in_flight while it fills: a request is never in no list
        for r, logits in ready:
            if r.prompt_only:  # scored, nothing to generate
                self.prefilling.remove(r)
                self._finish(r, "length", None)
                done.append(r)
                continue
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
                finished = self._accept(r, *self._sample(r, logits))
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
        self.prefill_tokens += ids.shape[1]
        ends = torch.tensor([len(r.prompt_ids) for r in rs], device=self.device).cumsum(0) - 1
        logits = self.model.head(h[0, ends])
        start = 0
        for r, c in zip(rs, caches):
            if r.prompt_logprobs is not None:
                self._score_prompt(r, h[0, start:start + len(r.prompt_ids)], 0)
            start += len(r.prompt_ids)
            r.cache, r.prefilled = c, len(r.prompt_ids)
            if self.prefix is not None:
                self.prefix.insert(r.prompt_ids, r.prefilled, c)
        return list(zip(rs, logits))

    # ------------------------------------------------------------------ sampling and logprobs
    def _sample(self, r: Request, logits: torch.Tensor) -> tuple[int, Logprob | None]:
        """The request's next token from logits [V] (as k3.model.sampling.sample_row draws it) and, when asked for,
        its logprob over the distribution it was drawn from (before top-k / top-p)."""
        if self.keep_logits:
            r.logits.append(logits.detach().cpu().clone())
        p = r.params
        tok = sample_row(logits, p, r.counts, r.generator, r.out_counts)
        if r.logprobs is None:
            return tok, None
        if r.counts is not None:
            logits = apply_penalties(logits, r.counts, p, r.out_counts)
        return tok, _logprobs(_log_softmax(logits[None], p.temperature), [tok], r.logprobs)[0]

    def _score_prompt(self, r: Request, h: torch.Tensor, start: int) -> None:
        """Prompt logprobs from hidden states h [n, d] of prompt positions start.. : each position scores the
        prompt's next token."""
        end = min(start + h.shape[0], len(r.prompt_ids) - 1)
        if end <= start:
            return
        lp = _log_softmax(self.model.head(h[:end - start]), r.params.temperature)
        r.prompt_logprob_list += _logprobs(lp, r.prompt_ids[start + 1:end + 1], r.prompt_logprobs)

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
                finished = self._accept(r, *self._sample(r, logits[i]))
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
    def _accept(self, r: Request, tok: int, lp: Logprob | None = None) -> bool:
        """Record a sampled token, stream its text; True when the request finished with it."""
        if r.t_first_token is None:
            r.t_first_token = time.perf_counter()
        r.output_ids.append(tok)
        if lp is not None:
            r.output_logprobs.append(lp)
        r.pending = tok
        if r.counts is not None:
            r.counts[tok] += 1
            r.out_counts[tok] += 1
        p = r.params
        reason = None
        special = tok < self.n_special
        if (tok == self.eos_id and not p.ignore_eos) or tok in p.stop_token_ids:
            reason = "stop"  # the end token itself is not part of the text
        elif special and RESERVED_TOKENS[tok] in p.stop:
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
            self._finish(r, reason, tok, lp)
            return True
        self._emit(TokenEvent(r, tok, self._take_text(r, final=False), logprob=lp))
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

    def _finish(self, r: Request, reason: str, tok: int | None, lp: Logprob | None = None) -> None:
        r.finish_reason, r.state, r.t_done = reason, "finished", time.perf_counter()
        r.cache, r.counts, r.out_counts, r.generator = None, None, None, None
        self._emit(TokenEvent(r, tok, self._take_text(r, final=True), reason, lp))
        r._done.set()

    def _emit(self, ev: TokenEvent) -> None:
        if ev.request.on_event is None:
            return
        try:
            ev.request.on_event(ev)
        except Exception:  # a broken consumer must not take the batch down with it
            log.exception("event callback of %s failed; cancelling it", ev.request.id)
            ev.request.cancelled = True


def _shared_blocks(a: list[int], b: list[int], block: int, start: int) -> int:
    """Tokens in whole blocks that a and b share from the start, within a[:-1] (0 if not beyond `start`)."""
    limit, i = min(len(a) - 1, len(b)), 0
    while i + block <= limit and a[i:i + block] == b[i:i + block]:
        i += block
    return i if i > start else 0


def _log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits [k, V] -> logprobs [k, V] at `temperature` (greedy requests: 1, the model's own distribution)."""
    x = logits.float()
    if temperature > 0:
        x = x.clamp(-torch.finfo(torch.float32).max, torch.finfo(torch.float32).max) / temperature
    return torch.log_softmax(x, dim=-1)


def _logprobs(lp: torch.Tensor, tokens: list[int], top: int) -> list[Logprob]:
    """One Logprob per row of lp [k, V]: token tokens[i]'s value and the row's `top` best."""
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
    if not top:
        return [Logprob(t, c, []) for t, c in zip(tokens, chosen)]
    vals, idx = lp.topk(top, dim=-1)
    return [Logprob(t, c, list(zip(i, v))) for t, c, i, v in zip(tokens, chosen, idx.tolist(), vals.tolist())]


def _partial_stop(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is the start of some stop sequence (held back)."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
