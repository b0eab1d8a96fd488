"""Policies: anything with `act(transcript) -> str`.

The transcript is a list of chat messages `{"role": "system"|"user"|"assistant", "content": str}`;
the policy answers with the text of its next message, in the episode's dialect. Scripted policies
(reference solutions, red-team attacks, tests) render abstract actions through that dialect;
`OpenAIChatPolicy` asks an OpenAI-compatible server (e.g. `k3 serve`); `K3EnginePolicy` runs a local k3
checkpoint through the generation engine and keeps the exact token ids of the episode (for RL);
`CallablePolicy` wraps any function.
"""
from __future__ import annotations

import functools
import hashlib
import http.client
import json
import logging
import math
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable

from k3.fileio import loads_json

from .actions import Action, action_from_json
from .dialects import Dialect

log = logging.getLogger(__name__)


class PolicyError(RuntimeError):
    """The policy failed to produce a message; the episode ends and scores 0."""


@dataclass(frozen=True)
class EpisodeInfo:
    task_id: str
    family: str
    seed: int
    dialect: Dialect


class Policy:
    name = "policy"

    def begin_episode(self, info: EpisodeInfo) -> None:
        """Called once before the first `act`; scripted policies learn the dialect here."""

    def act(self, transcript: list[dict]) -> str:
        raise NotImplementedError


class ScriptedPolicy(Policy):
    """Plays a fixed list of abstract actions (one per turn), then finishes."""

    def __init__(self, actions: list[Action | dict], name: str = "scripted", per_turn: int = 1):
        self.actions = [a if isinstance(a, Action) else action_from_json(a) for a in actions]
        self.name = name
        self.per_turn = per_turn
        self._dialect: Dialect | None = None
        self._i = 0

    def begin_episode(self, info: EpisodeInfo) -> None:
        self._dialect = info.dialect
        self._i = 0

    def act(self, transcript: list[dict]) -> str:
        if self._dialect is None:
            raise PolicyError("ScriptedPolicy.act called before begin_episode")
        if self._i >= len(self.actions):
            return self._dialect.render_call(Action("finish", {"summary": "script ended"}))
        n = 1 if self._dialect.name == "react" else self.per_turn
        batch = self.actions[self._i: self._i + n]
        self._i += len(batch)
        return "I will continue.\n" + self._dialect.render_calls(batch)


class TextPolicy(Policy):
    """Replies with fixed texts in order (for malformed-call tests), then repeats the last one."""

    def __init__(self, texts: list, name: str = "text"):
        self.texts, self.name, self._i = list(texts), name, 0

    def act(self, transcript):
        t = self.texts[min(self._i, len(self.texts) - 1)]
        self._i += 1
        return t


class CallablePolicy(Policy):
    def __init__(self, fn: Callable[[list[dict]], str], name: str = "callable"):
        self.fn, self.name = fn, name

    def act(self, transcript):
        return self.fn(transcript)


def check_base_url(base_url: str, flag: str = "base_url") -> None:
    """An endpoint URL: an http(s) scheme and a host, e.g. http://localhost:8000/v1."""
    import urllib.parse
    try:
        parts = urllib.parse.urlsplit(base_url)
        host, _ = parts.hostname, parts.port  # port: a non-numeric one raises here
    except ValueError as e:
        raise ValueError(f"{flag} {base_url!r} is not a valid URL ({e}); pass e.g. http://localhost:8000/v1") from None
    if parts.scheme not in ("http", "https") or not host:
        raise ValueError(f"{flag} {base_url!r} needs an http:// or https:// scheme and a host; "
                         "pass e.g. http://localhost:8000/v1")


def check_temperature(temperature: float, flag: str = "temperature", hi: float | None = None) -> None:
    """A sampling temperature: finite and >= 0 (0 is greedy), and at most `hi` where the sampler has a limit."""
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"{flag} {temperature} must be a finite number >= 0 (0 samples greedily)")
    if hi is not None and temperature > hi:
        raise ValueError(f"{flag} {temperature} must be at most {hi:g}")


class OpenAIChatPolicy(Policy):
    """POST {base_url}/chat/completions with the transcript; returns the assistant text.

    Native `tool_calls` in the response are rendered into the episode's dialect, so servers that
    parse tool calls themselves still work. Retries transient errors; raises PolicyError otherwise.
    """

    def __init__(self, base_url: str, model: str, api_key: str | None = None,
                 temperature: float = 0.0, max_tokens: int = 2048, timeout_s: float = 120.0,
                 retries: int = 2, extra: dict | None = None):
        check_base_url(base_url)
        self.base_url = base_url.rstrip("/")
        self.model, self.api_key = model, api_key
        self.temperature, self.max_tokens = temperature, max_tokens
        self.timeout_s, self.retries, self.extra = timeout_s, retries, extra or {}
        self.name = f"http:{model}"
        self._dialect: Dialect | None = None

    def begin_episode(self, info: EpisodeInfo) -> None:
        self._dialect = info.dialect

    def _headers(self) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def check_endpoint(self, timeout_s: float = 10.0) -> None:
        """Before any episode: the server answers and takes the model. Raises PolicyError naming the fix when it
        cannot be reached, or when `--model` is not in its GET /models list *and* a one-token chat request for it
        is refused (some servers list other names than the chat route takes: Ollama's ':latest' tags, Azure's
        deployments; some keys may chat but not list models). A server without a models route (404/405, or an
        answer that is not JSON) is asked the same one-token question: a web server that is not an OpenAI API
        (404 there, 501 for POST, HTML) is refused here instead of failing every episode."""
        headers = self._headers()
        req = urllib.request.Request(self.base_url + "/models", headers=headers, method="GET")
        ids: list = []
        ask = False  # the key may chat but not list models, or there is no models route: ask the chat route
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                data = json.loads(resp.read(4 << 20))
            listed = data.get("data") if isinstance(data, dict) else None
            ids = [m["id"] for m in listed if isinstance(m, dict) and isinstance(m.get("id"), str)] \
                if isinstance(listed, list) else []
        except urllib.error.HTTPError as e:
            if e.code >= 500 or e.code in (408, 429):
                return  # a server error: transient, for the episodes' retries
            ask = True  # 401/403 (a key that may chat but not list), 404/405 (no models route)
        except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException) as e:
            reason = getattr(e, "reason", e)  # HTTPException: something answers there, but not HTTP
            raise PolicyError(f"cannot reach {self.base_url} ({type(reason).__name__}: {reason}); start the server "
                              "first (e.g. `k3 serve --ckpt DIR --port 8000`) or pass its --base-url") from None
        except (json.JSONDecodeError, UnicodeDecodeError):
            ask = True
        if self.model in ids or not (ids or ask):  # listed, or a list of another shape: nothing to judge
            return
        # not listed, or the list refused: ask the chat route itself, for one token
        body = {"model": self.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        chat = urllib.request.Request(self.base_url + "/chat/completions", data=json.dumps(body).encode(),
                                      headers=headers, method="POST")
        try:
            with urllib.request.urlopen(chat, timeout=max(timeout_s, 60.0)) as resp:
                answer = resp.read(1 << 20)
        except urllib.error.HTTPError as e:
            if (e.code >= 500 and e.code != 501) or e.code in (408, 429):  # 501: no POST here at all
                return  # the server is up; a transient failure is for the episodes' retries
            said = e.read(300).decode("utf-8", "replace")
            fix = f"pass --model {ids[0]}" if ids else \
                "set the key's environment variable (--api-key-env NAME, default OPENAI_API_KEY)" \
                if e.code in (401, 403) else "pass the model name the server serves"
            served = f"; it lists {', '.join(map(str, ids))}" if ids else ""
            raise PolicyError(f"{self.base_url} refused a chat request for the model {self.model!r} "
                              f"(HTTP {e.code}: {said}){served}: {fix}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError, http.client.HTTPException):
            return  # up a moment ago: leave it to the episodes
        try:
            reply = json.loads(answer)
        except (json.JSONDecodeError, UnicodeDecodeError):
            reply = None
        if not (isinstance(reply, dict) and isinstance(reply.get("choices"), list)):
            raise PolicyError(f"{self.base_url}/chat/completions answered, but not as an OpenAI-compatible chat API "
                              f"({answer[:120].decode('utf-8', 'replace')!r}); pass the base URL of one, usually "
                              "ending in /v1")

    def act(self, transcript):
        body = {"model": self.model, "messages": transcript, "temperature": self.temperature,
                "max_tokens": self.max_tokens, **self.extra}
        req = urllib.request.Request(self.base_url + "/chat/completions",
                                     data=json.dumps(body).encode(), headers=self._headers(), method="POST")
        last = None
        for attempt in range(self.retries + 1):
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    data = loads_json(resp.read(16 << 20))  # a JSONDecodeError past absurd nesting
                return self._text(data)
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code}: {e.read(500).decode('utf-8', 'replace')}"
                if e.code < 500 and e.code != 429:
                    break
            except (urllib.error.URLError, TimeoutError, ConnectionError, json.JSONDecodeError) as e:
                last = f"{type(e).__name__}: {e}"
            time.sleep(min(2 ** attempt * 0.5, 5))
        raise PolicyError(f"policy endpoint {self.base_url} failed: {last}")

    def _text(self, data) -> str:
        try:
            msg = data["choices"][0]["message"]
        except (KeyError, IndexError, TypeError):
            raise PolicyError(f"endpoint reply has no choices[0].message: {str(data)[:200]}") from None
        text = msg.get("content") or ""
        calls = msg.get("tool_calls") or []
        if calls and self._dialect is not None:
            rendered = []
            for c in calls:
                fn = c.get("function") if isinstance(c, dict) else None
                fn = fn if isinstance(fn, dict) else {}
                raw = fn.get("arguments")
                if isinstance(raw, dict):  # some servers send the arguments as an object, not a JSON string
                    args = raw
                else:
                    try:
                        # the model wrote these: nesting past the limit is a malformed call, never a crash
                        args = loads_json(raw or "{}") if isinstance(raw, str) else None
                    except json.JSONDecodeError:
                        args = None
                if self._dialect.by_name.get(fn.get("name")) is None:
                    rendered.append(f"[tool call {fn.get('name')!r} with {raw!r}]")
                    continue
                try:
                    # decoded to actions and rendered back: a patch tool's call comes back as the dialect's
                    # patch call(s) for the same files
                    actions = self._dialect._decode_call(fn.get("name"), args)
                    rendered.append(self._dialect.render_calls(actions))
                except ValueError as e:
                    rendered.append(f"[malformed tool call {fn.get('name')!r}: {e}]")
            text = (text + "\n" + "\n".join(rendered)).strip()
        return text


class ContextExceeded(PolicyError):
    """The conversation no longer fits the model's context with room for a full reply."""


class K3EnginePolicy(Policy):
    """A k3 model answering through the generation engine (`k3.serve.engine`), with the chat template of
    `k3.data.chat`: the episode's system prompt (the dialect's tool specs) and messages are rendered to
    token ids, and the reply is sampled until `<|end|>`, `<|eos|>` or a role token.

    The policy keeps the episode's token ids exactly as the model saw and sampled them (`ids`, with
    `policy_mask` True at sampled tokens): the first turn renders the whole transcript, later turns
    append only the new messages after the model's own sampled tokens, never a re-encoding of its text.
    A reply that stopped without `<|end|>` (a role token, `<|eos|>`, the length limit) gets a closing
    `<|end|>` that is not marked as sampled.

    `generate(prompt_ids, SamplingParams) -> (output_ids, text, finish_reason)` is how tokens are made;
    by default a private `Engine` over `model`. RL passes a shared, batching one. Turn seeds are a pure
    function of (seed, episode seed, turn), so a temperature > 0 episode is reproducible.
    """

    def __init__(self, model=None, tokenizer=None, *, generate=None, max_context: int | None = None,
                 temperature: float = 0.0, top_p: float = 1.0, max_tokens: int = 256, seed: int = 0,
                 name: str = "k3"):
        if tokenizer is None:
            raise ValueError("K3EnginePolicy needs the tokenizer the model was trained with")
        if generate is None and model is None:
            raise ValueError("K3EnginePolicy needs a model (or a generate function)")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens = {max_tokens!r} must be a positive integer")
        from k3.data.chat import stop_token_ids
        from k3.model.sampling import SamplingParams
        self.model, self.tokenizer, self.name = model, tokenizer, name
        if max_context is None and model is None:
            raise ValueError("K3EnginePolicy with a generate function needs max_context")
        self.max_context = max_context or model.config.max_context
        self.temperature, self.top_p, self.max_tokens, self.seed = temperature, top_p, max_tokens, seed
        self._params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                      stop_token_ids=stop_token_ids(tokenizer)).validate(tokenizer.vocab_size)
        self._generate = generate or self._engine_generate
        self._end = tokenizer.special_id("end")
        self.begin_episode(None)

    @classmethod
    def from_checkpoint(cls, ckpt: str | os.PathLike, tokenizer: str | os.PathLike | None = None, **kw):
        model, tok = _load_k3(str(ckpt), None if tokenizer is None else str(tokenizer))
        return cls(model, tok, **kw)

    def begin_episode(self, info: EpisodeInfo | None) -> None:
        self._episode_seed = 0 if info is None else info.seed
        self.ids: list[int] = []
        self.policy_mask: list[bool] = []
        self.turns: list[dict] = []   # per reply: prompt length, sampled ids, finish reason
        self.failure: str | None = None  # set when the policy itself raised (context, engine error)
        self.context_exceeded = False
        self._known = 0  # transcript messages that `ids` covers, the model's last reply included
        self._last_text = None

    def _engine_generate(self, prompt_ids, params):
        from k3.serve.engine import Engine
        r = Engine(self.model, self.tokenizer, max_batch=1, max_queue=0).generate([prompt_ids], params)[0]
        return r.output_ids, r.text, r.finish_reason

    def _prompt(self, transcript: list[dict]) -> list[int]:
        from k3.data.chat import render
        k = self._known
        if (k and len(transcript) > k and transcript[k - 1].get("role") == "assistant"
                and transcript[k - 1].get("content") == self._last_text):
            new = render(transcript[k:], self.tokenizer)  # tool results etc. + the generation prompt
            self.ids += new
            self.policy_mask += [False] * len(new)
        else:  # a first turn, or a transcript this policy did not follow: render it whole
            self.ids = render(transcript, self.tokenizer)
            self.policy_mask = [False] * len(self.ids)
        return list(self.ids)

    def _turn_seed(self) -> int:
        h = hashlib.sha256(f"k3-policy-{self.seed}-{self._episode_seed}-{len(self.turns)}".encode()).digest()
        return int.from_bytes(h[:8], "little") >> 1

    def act(self, transcript):
        import dataclasses
        try:
            prompt = self._prompt(transcript)
        except ValueError as e:  # a message the chat template cannot render
            self.failure = f"{type(e).__name__}: {e}"
            raise PolicyError(f"cannot render the transcript: {e}") from None
        if len(prompt) + self.max_tokens >= self.max_context:  # the reply's closing <|end|> needs one more
            self.context_exceeded = True
            self.failure = "context"
            raise ContextExceeded(f"the conversation has {len(prompt)} tokens; with max_tokens = {self.max_tokens} "
                                  f"it exceeds the model's context of {self.max_context} tokens")
        params = dataclasses.replace(self._params, seed=self._turn_seed())
        try:
            out, text, finish = self._generate(prompt, params)
        except Exception as e:
            self.failure = f"{type(e).__name__}: {e}"
            raise PolicyError(f"generation failed: {type(e).__name__}: {e}") from e
        if finish == "error":
            self.failure = "engine error"
            raise PolicyError(f"generation failed: {text}")
        out = [int(t) for t in out]
        self.turns.append({"prompt_tokens": len(prompt), "output_ids": out, "finish_reason": finish})
        self.ids += out
        self.policy_mask += [True] * len(out)
        if not out or out[-1] != self._end:
            self.ids.append(self._end)
            self.policy_mask.append(False)
        self._known = len(transcript) + 1
        self._last_text = text
        return text


@functools.lru_cache(maxsize=2)
def _load_k3(ckpt: str, tokenizer: str | None):
    """(model, tokenizer) of a checkpoint, once per worker process."""
    from k3.serve.server import load_for_serving
    model, tok, _ = load_for_serving(ckpt, tokenizer, device="cpu")
    return model, tok


def make_policy(spec: dict, task=None) -> Policy:
    """Policies by description (picklable, for worker processes): reference | noop | http | k3."""
    kind = spec.get("kind")
    if kind == "reference":
        if task is None or not task.solution:
            raise ValueError(f"task {getattr(task, 'id', '?')} has no reference solution "
                             "(hidden/solution.json)")
        return ScriptedPolicy(list(task.solution), name="reference")
    if kind == "noop":
        return ScriptedPolicy([], name="noop")
    if kind == "http":
        if not spec.get("base_url") or not spec.get("model"):
            raise ValueError("the http policy needs --base-url and --model")
        return OpenAIChatPolicy(spec["base_url"], spec["model"], api_key=spec.get("api_key"),
                                temperature=float(spec.get("temperature", 0.0)),
                                max_tokens=int(spec.get("max_tokens", 2048)))
    if kind == "k3":
        if not spec.get("ckpt"):
            raise ValueError("the k3 policy needs --ckpt (a checkpoint directory or root)")
        return K3EnginePolicy.from_checkpoint(spec["ckpt"], spec.get("tokenizer"),
                                              temperature=float(spec.get("temperature", 0.0)),
                                              top_p=float(spec.get("top_p", 1.0)),
                                              max_tokens=int(spec.get("max_tokens", 256)),
                                              seed=int(spec.get("seed", 0)))
    raise ValueError(f"unknown policy {kind!r}; use reference, noop, http or k3")
