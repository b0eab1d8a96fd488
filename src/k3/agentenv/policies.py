"""Policies: anything with `act(transcript) -> str`.

The transcript is a list of chat messages `{"role": "system"|"user"|"assistant", "content": str}`;
the policy answers with the text of its next message, in the episode's dialect. Scripted policies
(reference solutions, red-team attacks, tests) render abstract actions through that dialect;
`OpenAIChatPolicy` asks an OpenAI-compatible server; `CallablePolicy` wraps any function, e.g. the
local k3 generation engine once it exists.
"""
from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable

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


class OpenAIChatPolicy(Policy):
    """POST {base_url}/chat/completions with the transcript; returns the assistant text.

    Native `tool_calls` in the response are rendered into the episode's dialect, so servers that
    parse tool calls themselves still work. Retries transient errors; raises PolicyError otherwise.
    """

    def __init__(self, base_url: str, model: str, api_key: str | None = None,
                 temperature: float = 0.0, max_tokens: int = 2048, timeout_s: float = 120.0,
                 retries: int = 2, extra: dict | None = None):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url {base_url!r} must start with http:// or https://")
        self.base_url = base_url.rstrip("/")
        self.model, self.api_key = model, api_key
        self.temperature, self.max_tokens = temperature, max_tokens
        self.timeout_s, self.retries, self.extra = timeout_s, retries, extra or {}
        self.name = f"http:{model}"
        self._dialect: Dialect | None = None

    def begin_episode(self, info: EpisodeInfo) -> None:
        self._dialect = info.dialect

    def act(self, transcript):
        body = {"model": self.model, "messages": transcript, "temperature": self.temperature,
                "max_tokens": self.max_tokens, **self.extra}
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.base_url + "/chat/completions",
                                     data=json.dumps(body).encode(), headers=headers, method="POST")
        last = None
        for attempt in range(self.retries + 1):
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    data = json.loads(resp.read(16 << 20))
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
                fn = c.get("function", {})
                try:
                    args = json.loads(fn.get("arguments") or "{}")
                except json.JSONDecodeError:
                    args = {}
                tool = self._dialect.by_name.get(fn.get("name"))
                if tool is None or tool == "patch":
                    rendered.append(f"[tool call {fn.get('name')!r} with {fn.get('arguments')!r}]")
                    continue
                try:
                    actions = self._dialect._decode_call(fn.get("name"), args)
                    rendered.append(self._dialect.render_calls(actions))
                except ValueError as e:
                    rendered.append(f"[malformed tool call {fn.get('name')!r}: {e}]")
            text = (text + "\n" + "\n".join(rendered)).strip()
        return text


def make_policy(spec: dict, task=None) -> Policy:
    """Policies by description (picklable, for worker processes): reference | noop | http."""
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
    raise ValueError(f"unknown policy {kind!r}; use reference, noop or http")
