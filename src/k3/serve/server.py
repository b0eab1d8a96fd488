"""OpenAI-compatible HTTP server over the generation engine (FastAPI + uvicorn).

Routes: GET /health, GET /v1/models, GET /v1/models/{id}, POST /v1/completions, POST /v1/chat/completions
(both with `stream` as server-sent events ending in `data: [DONE]`, and `usage` counts). One background
thread runs `Engine.step()`; handlers only validate, submit and wait on per-request event queues, so the
event loop never blocks on the model. Errors use OpenAI's shape, `{"error": {"message", "type", "param",
"code"}}`: 400 bad JSON / parameter / context length, 401 bad key, 404 unknown model or route, 429 when
every batch slot and queue place is taken, 503 when the engine thread is not running. A client that
disconnects (or closes an event stream) cancels its requests, which frees their slots at the next step.

Extensions beyond OpenAI's parameters (as vLLM spells them): `top_k`, `repetition_penalty`, `ignore_eos`,
`skip_special_tokens`; chat replies carry `reasoning_content` (DeepSeek's field name) for the
`<|think|>` part; `logprobs` / `top_logprobs` go up to 20 alternatives, as vLLM allows. GET /metrics gives the
engine's counters (prefix cache hits, tokens reused, bytes held) in Prometheus' text format. See
https://platform.openai.com/docs/api-reference for the wire format.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import math
import os
import threading
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from k3.data.tokenizer import SPECIAL_TOKENS
from k3.data.chat import ChatFormatError, chat_format
from k3.model.sampling import SamplingError, SamplingParams
from k3.serve.engine import MAX_LOGPROBS, ContextLengthError, Engine, EngineFull, Logprob, TokenEvent

log = logging.getLogger(__name__)

MAX_N = 16
COMMON_KEYS = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
               "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "user", "top_k",
               "repetition_penalty", "ignore_eos", "skip_special_tokens", "metadata", "store", "service_tier"}
COMPLETION_KEYS = COMMON_KEYS | {"prompt", "echo", "best_of", "suffix"}
CHAT_KEYS = COMMON_KEYS | {"messages", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls",
                           "reasoning_effort", "response_format", "top_logprobs", "functions", "function_call"}


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


# ---------------------------------------------------------------------- the engine thread
class EngineWorker:
    """Runs `engine.step()` in one daemon thread; an exception fails the in-flight requests, not the server."""

    def __init__(self, engine: Engine, threads: int | None = None):
        self.engine, self.threads = engine, threads
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="k3-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.engine.wake()
        self._thread.join(timeout)
        # the engine thread fails what is left as it exits; only a thread that is gone (or never ran) leaves it
        # to us: failing requests while it is still inside step() would change its lists under it
        if not self._thread.is_alive() and self.engine.has_work():
            self.engine.fail_all("the server is shutting down")

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def _run(self) -> None:
        if self.threads:
            import torch

            torch.set_num_threads(self.threads)
        while not self._stop.is_set():
            if not self.engine.wait_for_work(0.05):
                continue
            try:
                self.engine.step()
            except Exception as e:  # noqa: BLE001 - keep serving; the requests in flight get the error
                log.exception("engine step failed")
                self.engine.fail_all(f"internal error in the engine: {type(e).__name__}: {e}")
        if self.engine.has_work():  # stopped: nothing will serve what is left
            self.engine.fail_all("the server is shutting down")


# ---------------------------------------------------------------------- loading
def load_for_serving(ckpt: str | os.PathLike, tokenizer_path: str | os.PathLike | None = None,
                     config_path: str | os.PathLike | None = None, device: str = "cpu", **load_kw):
    """(model, tokenizer, manifest) with every mismatch found now, not at the first request; `load_kw` goes to
    k3.io.load_with_manifest (experts="stream", ram_budget=...)."""
    from k3.config import K3Config, is_complete_config, read_config_file
    from k3.train.checkpoint import check_config
    from k3.io import load_with_manifest
    from k3.io.trained import checkpoint_tokenizer

    if config_path is not None:  # read before the model is loaded: a bad file is named at once
        want = read_config_file(config_path)
    model, manifest = load_with_manifest(ckpt, device=device, **load_kw)
    if config_path is not None:
        # a partial file names the fields to check, the rest are the checkpoint's (a complete one stands alone)
        if not is_complete_config(want):
            want = {**(manifest.get("config") or {}), **want}
        check_config(manifest.get("config"), K3Config.from_dict(want), f"{manifest['path']}/manifest.json")
    return model, checkpoint_tokenizer(manifest, model.config.vocab_size, tokenizer_path), manifest


# ---------------------------------------------------------------------- request parsing
async def _json_body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, and integers past Python's digit limit
        raise bad(f"the request body is not valid JSON ({e})", code="invalid_json") from None
    except RecursionError:  # "[[[[..." thousands deep: the parser's recursion limit
        raise bad("the request body nests JSON arrays or objects too deeply to read", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", code="invalid_json")
    return body


def _check_keys(body: dict, allowed: set[str]) -> None:
    for key in body:
        if key not in allowed:
            raise bad(f"unrecognized request argument supplied: {key}", key, "unknown_parameter")


def _get(body: dict, name: str, kinds: tuple, default=None, what: str = ""):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
        raise bad(f"{name} = {v!r} is invalid: {what or 'wrong type'}", name)
    return v


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = _get(body, name, (int, float), default, f"must be a number in {'(' if lo_open else '['}{lo}, {hi}]")
    try:
        fv = float(v)
    except OverflowError:  # an integer literal too large for a float
        fv = math.inf
    if not math.isfinite(fv) or fv < lo or fv > hi or (lo_open and fv == lo):
        raise bad(f"{name} = {v!r} is invalid: must be a number in {'(' if lo_open else '['}{lo}, {hi}]", name)
    return float(v)


def _integer(body: dict, name: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    want = f"must be an integer >= {lo}" + (f" and <= {hi}" if hi is not None else "")
    v = _get(body, name, (int,), default, want)
    if v is not None and (v < lo or (hi is not None and v > hi)):
        raise bad(f"{name} = {v!r} is invalid: {want}", name)
    return v


def _sampling(body: dict, max_tokens: int | None) -> SamplingParams:
    """SamplingParams from the OpenAI fields; max_tokens None means 'fill in the default later'."""
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or len(stop) > 4
                             or not all(isinstance(s, str) and s for s in stop)):
        raise bad(f"stop = {stop!r} is invalid: must be a non-empty string or a list of up to 4 of them", "stop")
    if body.get("logit_bias"):
        raise bad("logit_bias is not supported by this server", "logit_bias", "unsupported_parameter")
    seed = _get(body, "seed", (int,), None, "must be an integer")
    p = SamplingParams(
        max_tokens=max_tokens or 1,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=_integer(body, "top_k", 0, 0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, 1e4, lo_open=True),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        stop=tuple(stop or ()), seed=seed,
        ignore_eos=bool(_get(body, "ignore_eos", (bool,), False, "must be true or false")),
        # vLLM's default: completion text leaves out special tokens unless asked for them
        skip_special_tokens=bool(_get(body, "skip_special_tokens", (bool,), True, "must be true or false")),
    )
    try:
        return p.validate()
    except SamplingError as e:
        raise bad(str(e), e.param) from None


def _max_tokens(body: dict, *names: str) -> int | None:
    given = [v for v in (_integer(body, name, None, 1) for name in names) if v is not None]  # each one checked
    return given[0] if given else None


def _stream_options(body: dict) -> bool:
    stream = _get(body, "stream", (bool,), False, "must be true or false")
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict) or set(opts) - {"include_usage", "include_obfuscation"}:
        raise bad("stream_options must be {'include_usage': bool}", "stream_options")
    if not stream:
        raise bad("stream_options is only allowed with stream = true", "stream_options")
    return _get(opts, "include_usage", (bool,), False, "must be true or false")


# ---------------------------------------------------------------------- the app
def create_app(engine: Engine, model_name: str = "k3", default_max_tokens: int = 256,
               api_key: str | None = None, worker_threads: int | None = None, chat_format_name: str = "k3") -> FastAPI:
    """A FastAPI app serving `engine` (which must have a tokenizer) under the model id `model_name`; chat messages
    in the format `chat_format_name` (k3's own, or "kimi-k3": `k3.data.chat.CHAT_FORMATS`)."""
    if engine.tokenizer is None:
        raise ValueError("the server needs an Engine with a tokenizer")
    if default_max_tokens < 1:
        raise ValueError(f"default_max_tokens = {default_max_tokens} must be >= 1")
    tok = engine.tokenizer
    token_text = _TokenText(tok)
    worker = EngineWorker(engine, worker_threads)
    created = int(time.time())
    chat = chat_format(chat_format_name)
    if chat.check_tokenizer is not None:
        chat.check_tokenizer(tok)
    chat_stops = chat.stop_token_ids(tok)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        try:
            yield
        finally:
            worker.stop()

    app = FastAPI(title="k3", lifespan=lifespan)
    app.state.engine, app.state.worker, app.state.model_name = engine, worker, model_name

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return APIError(500, f"internal server error: {type(exc).__name__}", "server_error").response()

    def check_auth(request: Request) -> None:
        # a plain check in each handler: an HTTP middleware would sit between the stream and disconnects
        # bytes (compare_digest refuses non-ASCII str): the header's raw bytes, which Starlette decoded as
        # Latin-1, against the key's UTF-8 bytes; the scheme is case-insensitive (RFC 7235)
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if api_key and not (scheme.lower() == "bearer" and hmac.compare_digest(
                token.strip().encode("latin-1", "replace"), api_key.encode("utf-8", "surrogateescape"))):
            raise APIError(401, "missing or wrong API key (send the header Authorization: Bearer KEY)",
                           code="invalid_api_key")

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "k3",
                "max_model_len": engine.max_context}

    @app.get("/health")
    async def health():
        body = {"status": "ok" if worker.alive else "unavailable", "model": model_name, **engine.stats()}
        return JSONResponse(body, status_code=200 if worker.alive else 503)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(_prometheus(engine.stats(), model_name), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        check_auth(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        check_auth(request)
        if model_id != model_name:
            raise APIError(404, f"the model {model_id!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        return model_card()

    def check_model(body: dict) -> None:
        m = body.get("model")
        if not isinstance(m, str) or not m:
            raise bad("model is required: a string naming the model (GET /v1/models lists it)", "model",
                      "missing_required_parameter" if m is None else "invalid_value")
        if m != model_name:
            raise APIError(404, f"the model {m!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")

    def fit(ids: list[int], params: SamplingParams, explicit: int | None, param: str) -> SamplingParams:
        ctx = engine.max_context
        room = ctx - len(ids)
        if room < 1:
            raise bad(f"this model's maximum context length is {ctx} tokens, but the prompt has {len(ids)} tokens "
                      "(no room left to generate); shorten it", param, "context_length_exceeded")
        if explicit is not None and explicit > room:
            raise bad(f"this model's maximum context length is {ctx} tokens, but {len(ids) + explicit} were "
                      f"requested ({len(ids)} in the prompt, {explicit} max_tokens); shorten the prompt or lower "
                      "max_tokens", param, "context_length_exceeded")
        return dataclasses.replace(params, max_tokens=explicit if explicit is not None
                                   else min(room, params.max_tokens))

    def submit_all(jobs: list[tuple[int, list[int], SamplingParams]], events: "_Events", **options) -> list:
        cap = engine.max_batch + engine.max_queue
        if len(jobs) > cap:  # could never fit, so not a 429 to retry
            raise bad(f"{len(jobs)} completions were requested at once (n x prompts), but this server holds at "
                      f"most {cap} requests; lower n or send fewer prompts per request", "n")
        reqs = []
        try:
            for index, ids, params in jobs:
                reqs.append(engine.submit(ids, params, events.callback(index), **options))
        except EngineFull as e:
            for r in reqs:
                engine.cancel(r)
            raise APIError(429, f"{e}", "requests", code="rate_limit_exceeded") from None
        except ContextLengthError as e:
            for r in reqs:
                engine.cancel(r)
            raise bad(str(e), "prompt", "context_length_exceeded") from None
        except ValueError as e:
            for r in reqs:
                engine.cancel(r)
            raise bad(str(e)) from None
        return reqs

    def check_worker() -> None:
        if not worker.alive:
            raise APIError(503, "the generation engine is not running; retry later", "server_error",
                           code="engine_unavailable")

    # ------------------------------------------------------------------ /v1/completions
    @app.post("/v1/completions")
    async def completions(request: Request):
        check_auth(request)
        body = await _json_body(request)
        _check_keys(body, COMPLETION_KEYS)
        check_model(body)
        check_worker()
        prompts = _completion_prompts(body.get("prompt", None), tok, engine.max_context)
        n = _integer(body, "n", 1, 1, MAX_N)
        best_of = _integer(body, "best_of", None, 1)
        if best_of is not None and best_of != n:
            raise bad("best_of other than n is not supported", "best_of", "unsupported_parameter")
        if body.get("suffix"):
            raise bad("suffix (insertion) is not supported", "suffix", "unsupported_parameter")
        logprobs = _integer(body, "logprobs", None, 0, MAX_LOGPROBS)  # OpenAI returns a logprobs object even for 0
        echo = bool(_get(body, "echo", (bool,), False, "must be true or false"))
        stream = bool(_get(body, "stream", (bool,), False, "must be true or false"))
        include_usage = _stream_options(body)
        # echo with max_tokens 0 scores the prompt and generates nothing (OpenAI's way to get prompt logprobs)
        explicit = _integer(body, "max_tokens", None, 0 if echo else 1)
        prompt_only = explicit == 0
        explicit = None if prompt_only else explicit
        base = _sampling(body, 16)
        jobs = []
        for pi, ids in enumerate(prompts):
            fitted = fit(ids, base, explicit, "prompt")
            for j in range(n):
                seed = None if base.seed is None else base.seed + j
                jobs.append((pi * n + j, ids, dataclasses.replace(fitted, seed=seed)))
        if prompt_only:
            jobs = [(i, ids, dataclasses.replace(p, max_tokens=1)) for i, ids, p in jobs]
        events = _Events(asyncio.get_running_loop(), final_only=not stream)
        reqs = submit_all(jobs, events, logprobs=logprobs, prompt_logprobs=logprobs if echo else None,
                          prompt_only=prompt_only)
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        prompt_tokens = sum(len(p) for p in prompts)
        raw = body.get("prompt")
        # a text prompt echoes as sent (an empty one is fed as <|eos|>, which is not the caller's text); token ids
        # echo as their decoded text
        texts = [raw] if isinstance(raw, str) else raw if all(isinstance(p, str) for p in raw) else None
        echoes = [(texts[i // n] if texts is not None else tok.decode(prompts[i // n])) if echo else ""
                  for i in range(len(reqs))]

        def usage() -> dict:
            c = sum(len(r.output_ids) for r in reqs)
            cached = sum(reqs[i].cached_tokens for i in range(0, len(reqs), n))  # each prompt once, as it counts
            return {"prompt_tokens": prompt_tokens, "completion_tokens": c, "total_tokens": prompt_tokens + c,
                    "prompt_tokens_details": {"cached_tokens": cached}}

        if stream:
            async def chunks():
                first = [True] * len(reqs)
                pending: list[list] = [[] for _ in reqs]  # logprobs of tokens whose text is not out yet
                offsets = [0] * len(reqs)
                async for index, ev in events.stream(len(reqs)):
                    if ev.finish_reason == "error":
                        yield _sse(APIError(500, ev.request.error or "generation failed", "server_error").body())
                        continue
                    if logprobs is not None:
                        if first[index] and echo:
                            pending[index] += ev.request.prompt_logprob_list
                        if ev.logprob is not None:
                            pending[index].append(ev.logprob)
                    text = (echoes[index] if first[index] else "") + ev.text
                    first[index] = False
                    if not text and ev.finish_reason is None:
                        continue
                    lp = None
                    if logprobs is not None:
                        lp, offsets[index] = _completion_logprobs(pending[index], token_text, offsets[index])
                        pending[index] = []
                    yield _sse({"id": rid, "object": "text_completion", "created": now, "model": model_name,
                                "choices": [{"index": index, "text": text, "logprobs": lp,
                                             "finish_reason": ev.finish_reason}],
                                **({"usage": None} if include_usage else {})})  # as OpenAI: null but the last
                if include_usage:
                    yield _sse({"id": rid, "object": "text_completion", "created": now, "model": model_name,
                                "choices": [], "usage": usage()})
                yield "data: [DONE]\n\n"

            return _CancellingStream(chunks(), lambda: [engine.cancel(r) for r in reqs])

        if not await events.wait_all(reqs, request, engine):
            return JSONResponse({}, status_code=499)  # the client is gone; nobody reads this
        _raise_failed(reqs)
        choices = [{"index": i, "text": echoes[i] + r.text, "finish_reason": r.finish_reason,
                    "logprobs": None if logprobs is None else _completion_logprobs(
                        (r.prompt_logprob_list if echo else []) + r.output_logprobs, token_text)[0]}
                   for i, r in enumerate(reqs)]
        return {"id": rid, "object": "text_completion", "created": now, "model": model_name, "choices": choices,
                "usage": usage()}

    # ------------------------------------------------------------------ /v1/chat/completions
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        check_auth(request)
        body = await _json_body(request)
        _check_keys(body, CHAT_KEYS)
        check_model(body)
        check_worker()
        want_logprobs = bool(_get(body, "logprobs", (bool,), False, "must be true or false"))
        top_logprobs = _integer(body, "top_logprobs", None, 0, MAX_LOGPROBS)
        if top_logprobs and not want_logprobs:
            raise bad("top_logprobs needs logprobs = true", "top_logprobs")
        logprobs = (top_logprobs or 0) if want_logprobs else None
        if body.get("functions") or body.get("function_call"):
            raise bad("functions / function_call are deprecated; use tools", "functions", "unsupported_parameter")
        fmt = body.get("response_format")
        if fmt is not None and fmt != {"type": "text"}:
            raise bad("only response_format {'type': 'text'} is supported", "response_format", "unsupported_parameter")
        tool_choice = body.get("tool_choice")
        if tool_choice not in (None, "auto", "none"):
            raise bad("tool_choice must be 'auto' or 'none' on this server", "tool_choice", "unsupported_parameter")
        tools = body.get("tools") if tool_choice != "none" else None
        n = _integer(body, "n", 1, 1, MAX_N)
        stream = bool(_get(body, "stream", (bool,), False, "must be true or false"))
        include_usage = _stream_options(body)
        explicit = _max_tokens(body, "max_completion_tokens", "max_tokens")
        base = _sampling(body, default_max_tokens)
        # the reply is parsed from its text with the special tokens in it (the think and tool-call markers; the
        # parser drops every other special token), so skip_special_tokens has nothing left to do here
        base = dataclasses.replace(base, stop_token_ids=tuple(sorted(set(base.stop_token_ids) | set(chat_stops))),
                                   skip_special_tokens=False)
        _check_text_fits(_content_bytes(body.get("messages")), tok, engine.max_context, "messages")
        _check_tool_messages(body.get("messages"))
        try:
            ids = chat.render(body.get("messages"), tok, tools, body.get("reasoning_effort"))
        except ChatFormatError as e:
            raise bad(str(e), e.param) from None
        fitted = fit(ids, base, explicit, "messages")
        jobs = [(j, ids, dataclasses.replace(fitted, seed=None if base.seed is None else base.seed + j))
                for j in range(n)]
        events = _Events(asyncio.get_running_loop(), final_only=not stream)
        reqs = submit_all(jobs, events, logprobs=logprobs)
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def usage() -> dict:
            c = sum(len(r.output_ids) for r in reqs)
            return {"prompt_tokens": len(ids), "completion_tokens": c, "total_tokens": len(ids) + c,
                    "prompt_tokens_details": {"cached_tokens": reqs[0].cached_tokens}}

        pending: list[list] = [[] for _ in reqs]  # logprobs of tokens not yet sent in a chunk

        def chunk(index: int, delta: dict, finish: str | None = None) -> str:
            lp = None
            if logprobs is not None:
                lp = {"content": [_chat_logprob(e, token_text) for e in pending[index]], "refusal": None}
                pending[index] = []
            return _sse({"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_name,
                         "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}],
                         **({"usage": None} if stream and include_usage else {})})  # as OpenAI: null but the last

        if stream:
            async def chunks():
                parsers = [chat.parser(r._markers) for r in reqs]
                for i in range(len(reqs)):
                    yield chunk(i, {"role": "assistant", "content": ""})
                async for index, ev in events.stream(len(reqs)):
                    if ev.finish_reason == "error":
                        yield _sse(APIError(500, ev.request.error or "generation failed", "server_error").body())
                        continue
                    if ev.logprob is not None:
                        pending[index].append(ev.logprob)
                    p = parsers[index]
                    for kind, value in p.feed(ev.text, final=ev.finish_reason is not None):
                        if kind == "tool_call":
                            yield chunk(index, {"tool_calls": [value.to_openai(len(p.tool_calls) - 1)]})
                        else:
                            yield chunk(index, {"content" if kind == "content" else "reasoning_content": value})
                    if ev.finish_reason is not None:
                        yield chunk(index, {}, _finish_reason(ev.finish_reason, p.tool_calls))
                if include_usage:
                    yield _sse({"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_name,
                                "choices": [], "usage": usage()})
                yield "data: [DONE]\n\n"

            return _CancellingStream(chunks(), lambda: [engine.cancel(r) for r in reqs])

        if not await events.wait_all(reqs, request, engine):
            return JSONResponse({}, status_code=499)
        _raise_failed(reqs)
        choices = []
        for i, r in enumerate(reqs):
            content, reasoning, calls = chat.parse_reply(r.text, r._markers)
            # as OpenAI: content is null beside tool calls that came without text
            msg = {"role": "assistant", "content": (content or None) if calls else content}
            if reasoning:
                msg["reasoning_content"] = reasoning
            if calls:
                msg["tool_calls"] = [c.to_openai() for c in calls]
            lp = None if logprobs is None else {
                "content": [_chat_logprob(e, token_text) for e in r.output_logprobs], "refusal": None}
            choices.append({"index": i, "message": msg, "logprobs": lp,
                            "finish_reason": _finish_reason(r.finish_reason, calls)})
        return {"id": rid, "object": "chat.completion", "created": now, "model": model_name, "choices": choices,
                "usage": usage()}

    return app


def _check_text_fits(nbytes: int, tok, max_context: int, param: str) -> None:
    """Text of `nbytes` bytes is at least nbytes / tok.max_token_bytes tokens: one that cannot leave room to generate
    is refused before it is tokenized (megabytes take seconds on the event loop, stalling every other request)."""
    least = -(-nbytes // tok.max_token_bytes)
    if least >= max_context:
        raise bad(f"this model's maximum context length is {max_context} tokens, but the {param} holds {nbytes:,} "
                  f"bytes of text, at least {least:,} tokens; shorten it", param, "context_length_exceeded")


def _check_tool_messages(messages) -> None:
    """What OpenAI refuses, refused here too: a tool message that names no tool call (`tool_call_id`), and tool-call
    arguments given as a string that is not JSON (an object is taken as it is)."""
    for i, m in enumerate(messages if isinstance(messages, list) else []):
        if not isinstance(m, dict):
            continue
        if m.get("role") == "tool" and not (isinstance(m.get("tool_call_id"), str) and m["tool_call_id"]):
            raise bad(f"messages[{i}].tool_call_id is missing: a tool message answers one tool call, named by its id",
                      "messages")
        calls = m.get("tool_calls") if m.get("role") == "assistant" else None
        for j, call in enumerate(calls if isinstance(calls, list) else []):
            fn = call.get("function") if isinstance(call, dict) else None
            args = fn.get("arguments") if isinstance(fn, dict) else None
            if isinstance(args, str) and args.strip():
                try:
                    json.loads(args)
                except (ValueError, RecursionError):
                    raise bad(f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON: give the "
                              "arguments as a JSON object serialised to a string", "messages") from None


def _content_bytes(messages) -> int:
    """UTF-8 bytes of the messages' content strings (part of what render() tokenizes, so a lower bound)."""
    n = 0
    for m in messages if isinstance(messages, list) else []:
        content = m.get("content") if isinstance(m, dict) else None
        parts = content if isinstance(content, list) else [content]
        for part in parts:
            text = part.get("text") if isinstance(part, dict) else part
            if isinstance(text, str):
                n += len(text.encode("utf-8", "surrogatepass"))
    return n


def _completion_prompts(prompt, tok, max_context: int) -> list[list[int]]:
    """OpenAI's four prompt forms: str, [str], [int], [[int]]. An empty prompt starts a new document."""
    def ids_of(text: str) -> list[int]:
        try:
            n = len(text.encode("utf-8"))
        except UnicodeEncodeError as e:  # a lone surrogate ("\ud800"): not text the tokenizer can take
            raise bad(f"prompt is not valid Unicode text ({e.reason} at position {e.start})", "prompt") from None
        _check_text_fits(n, tok, max_context, "prompt")
        return tok.encode(text) if text else [tok.eos_id]

    if prompt is None:
        raise bad("prompt is required", "prompt", "missing_required_parameter")
    if isinstance(prompt, str):
        return [ids_of(prompt)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [ids_of(p) for p in prompt]
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            prompt = [prompt]
        if all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
               for p in prompt):
            V = tok.vocab_size
            if any(not 0 <= t < V for p in prompt for t in p):
                raise bad(f"prompt token ids must lie in [0, {V})", "prompt")
            return [list(p) for p in prompt]
    raise bad("prompt must be a string, a list of strings, a list of token ids or a list of such lists", "prompt")


def _raise_failed(reqs) -> None:
    for r in reqs:
        if r.finish_reason == "error":
            raise APIError(500, r.error or "generation failed", "server_error")


def _finish_reason(reason: str, calls) -> str:
    """As OpenAI: "tool_calls" for a reply that called tools and ended by itself; a reply cut at max_tokens stays
    "length" with or without calls (its last call may be the one cut off)."""
    return "tool_calls" if calls and reason == "stop" else reason


# ---------------------------------------------------------------------- logprobs and metrics
_LOGPROB_FLOOR = -9999.0  # what OpenAI reports for a token of probability 0 (JSON has no -Infinity)


def _finite(v: float) -> float:
    return v if v >= _LOGPROB_FLOOR else _LOGPROB_FLOOR  # NaN compares False: floored too


class _TokenText:
    """A token's text and bytes for logprobs (OpenAI's `token` and `bytes`): the raw bytes of a byte-level BPE
    token, and as text their UTF-8 decoding, or, for a token that holds part of a character, `bytes:\\xNN..`, so
    that different tokens never share a text (completions key top_logprobs by it)."""

    def __init__(self, tok):
        self.tok, self._memo = tok, {}
        self._byte_of = _byte_level_decoder()

    def __call__(self, i: int) -> tuple[str, list[int]]:
        got = self._memo.get(i)
        if got is None:
            if i < len(SPECIAL_TOKENS):
                raw = SPECIAL_TOKENS[i].encode()
            else:
                piece = self.tok.id_to_token(i) or ""
                raw = (bytes(self._byte_of[c] for c in piece) if all(c in self._byte_of for c in piece)
                       else self.tok.decode([i]).encode("utf-8", "surrogatepass"))
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            got = self._memo[i] = (text, list(raw))
        return got


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (what tokenizers' ByteLevel pre-tokenizer maps bytes to), inverted."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _chat_logprob(e: Logprob, token_text: _TokenText) -> dict:
    def one(i: int, lp: float) -> dict:
        text, raw = token_text(i)
        return {"token": text, "logprob": _finite(lp), "bytes": raw}
    return {**one(e.token_id, e.logprob), "top_logprobs": [one(i, lp) for i, lp in e.top]}


def _completion_logprobs(entries: list, token_text: _TokenText, offset: int = 0) -> tuple[dict, int]:
    """OpenAI's completions logprobs object for `entries` and the text offset after them. `top_logprobs` maps token
    text to logprob: the alternatives and the chosen token; a prompt's first token has null for both."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        text = token_text(e.token_id)[0]
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if e.logprob is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_finite(e.logprob))
        top = {token_text(i)[0]: _finite(lp) for i, lp in e.top}
        top.setdefault(text, _finite(e.logprob))
        out["top_logprobs"].append(top)
    return out, offset


def _prometheus(stats: dict, model_name: str) -> str:
    """Engine counters in Prometheus' text exposition format."""
    label = '{model="' + model_name.replace("\\", "\\\\").replace('"', '\\"') + '"}'
    rows = [("k3_requests_running", "gauge", stats["running"]), ("k3_requests_waiting", "gauge", stats["waiting"]),
            ("k3_requests_prefilling", "gauge", stats["prefilling"]), ("k3_engine_steps_total", "counter", stats["steps"]),
            ("k3_batch_cache_bytes", "gauge", stats["cache_bytes"]),
            ("k3_prefill_tokens_total", "counter", stats["prefill_tokens"])]
    pc = stats.get("prefix_cache")
    if pc is not None:
        rows += [("k3_prefix_cache_lookups_total", "counter", pc["lookups"]),
                 ("k3_prefix_cache_hits_total", "counter", pc["hits"]),
                 ("k3_prefix_cache_tokens_looked_up_total", "counter", pc["tokens_looked_up"]),
                 ("k3_prefix_cache_tokens_reused_total", "counter", pc["tokens_reused"]),
                 ("k3_prefix_cache_evictions_total", "counter", pc["evictions"]),
                 ("k3_prefix_cache_bytes", "gauge", pc["bytes"]), ("k3_prefix_cache_max_bytes", "gauge", pc["max_bytes"]),
                 ("k3_prefix_cache_nodes", "gauge", pc["nodes"])]
    out = []
    for name, kind, value in rows:
        out += [f"# TYPE {name} {kind}", f"{name}{label} {value}"]
    return "\n".join(out) + "\n"


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _Events:
    """Engine events (from the engine thread) into an asyncio queue on the server's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, final_only: bool = False):
        self.loop, self.queue, self.final_only = loop, asyncio.Queue(), final_only

    def callback(self, index: int):
        def on_event(ev: TokenEvent) -> None:
            if ev.finish_reason is not None or not self.final_only:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, ev))
        return on_event

    async def stream(self, n: int):
        """(index, event) until all n requests finished."""
        left = n
        while left:
            index, ev = await self.queue.get()
            if ev.finish_reason is not None:
                left -= 1
            yield index, ev

    async def wait_all(self, reqs, request: Request, engine: Engine, poll_s: float = 0.1) -> bool:
        """Wait for every request to finish; False (and the requests cancelled) if the client went away.
        Make `self` with final_only=True, or token events keep the poll for a disconnect from running."""
        left = len(reqs)
        try:
            while left:
                try:
                    _, ev = await asyncio.wait_for(self.queue.get(), poll_s)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return False
                    continue
                if ev.finish_reason is not None:
                    left -= 1
            return True
        finally:
            if left:
                for r in reqs:
                    engine.cancel(r)


class _CancellingStream(StreamingResponse):
    """An SSE response that cancels its engine requests however it ends (done, error or disconnect)."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
