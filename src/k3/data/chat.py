"""Chat template: OpenAI-style messages <-> token ids, with k3's reserved special tokens.

    <|system|>{system text}[\\n\\n# Tools\\n{tools as JSON}]<|end|>
    <|user|>{text}<|end|>
    <|assistant|>[<|think|>{reasoning}<|/think|>]{text}
                 [<|tool_call|>{"name": ..., "arguments": {...}}<|/tool_call|>]*<|end|>
    <|tool|><|tool_result|>{tool output}<|/tool_result|><|end|>
    <|assistant|>[<|effort:low|medium|high|>]        <- the generation prompt

Special tokens are inserted by id and message text is encoded with `allow_special=False`, so a user who
types "<|end|>" gets those bytes, never the token. The reply ends at `<|end|>`, `<|eos|>` or any role
token; `ChatOutputParser` splits it into content, reasoning (`<|think|>` ... `<|/think|>`) and tool calls.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from k3.data.tokenizer import RESERVED_TOKENS
from k3.fileio import loads_json

ROLES = ("system", "developer", "user", "assistant", "tool")
EFFORTS = ("low", "medium", "high")
THINK, END_THINK = "<|think|>", "<|/think|>"
TOOL_CALL, END_TOOL_CALL = "<|tool_call|>", "<|/tool_call|>"


class ChatFormatError(ValueError):
    """Messages that the template cannot render; `param` names the offending field."""

    def __init__(self, message: str, param: str = "messages"):
        super().__init__(message)
        self.param = param


STOP_TOKENS = ("<|end|>", "<|user|>", "<|system|>", "<|tool|>", "<|assistant|>")


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    """Tokens that end an assistant turn: <|end|> and the role tokens (a new turn); <|eos|> always ends."""
    return tuple(tokenizer.special_id(t) for t in STOP_TOKENS)


def _text(content, where: str) -> str:
    """The text of a message field (`where` names it: messages[i].content): a string or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ChatFormatError(f"{where}[{j}] must be {{'type': 'text', 'text': str}}; this model "
                                      "reads text only")
            parts.append(part["text"])
        return "".join(parts)
    raise ChatFormatError(f"{where} must be a string or a list of text parts, got {type(content).__name__}")


def _tool_call_json(call, where: str) -> str:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ChatFormatError(f"{where} must be {{'type': 'function', 'function': {{'name': str, 'arguments': str}}}}")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = loads_json(args) if args.strip() else {}
        except json.JSONDecodeError:
            pass  # kept as a string: the model sees what the caller sent
    return json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False)


def check_tools(tools) -> None:
    """ChatFormatError unless `tools` is None or a list of OpenAI function declarations."""
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise ChatFormatError("tools must be a list of {'type': 'function', 'function': {...}}", "tools")
    for i, t in enumerate(tools or []):
        fn = t.get("function")
        if t.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not fn["name"] or not isinstance(fn.get("parameters", {}), dict):
            raise ChatFormatError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': str, "
                                  "'description': str, 'parameters': {...}}}}} (a non-empty name; parameters "
                                  "a JSON Schema object)", "tools")


def check_request(messages, tools, reasoning_effort: str | None) -> None:
    """What every chat format refuses: no messages, malformed tools, an unknown reasoning effort."""
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    check_tools(tools)
    if reasoning_effort is not None and reasoning_effort not in EFFORTS:
        raise ChatFormatError(f"reasoning_effort = {reasoning_effort!r} must be one of {', '.join(EFFORTS)}",
                              "reasoning_effort")


def render(messages, tokenizer, tools=None, reasoning_effort: str | None = None,
           add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a conversation (and, by default, the start of the assistant's reply)."""
    check_request(messages, tools, reasoning_effort)
    sid = tokenizer.special_id
    ids: list[int] = []

    def text(s: str) -> None:
        if s:
            try:
                s.encode("utf-8")
            except UnicodeEncodeError as e:  # a lone surrogate ("\ud800"): not text the tokenizer can take
                raise ChatFormatError(f"messages hold text that is not valid Unicode ({e.reason} at position "
                                      f"{e.start})") from None
            ids.extend(tokenizer.encode(s, allow_special=False))

    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ChatFormatError(f"messages[{i}] must be an object with role one of {', '.join(ROLES)}")
    tools_text = f"# Tools\n{json.dumps(tools, ensure_ascii=False)}" if tools else ""
    if tools_text and not any(m["role"] in ("system", "developer") for m in messages):
        ids.append(sid("system"))
        text(tools_text)
        ids.append(sid("end"))
        tools_text = ""
    for i, m in enumerate(messages):
        where, role = f"messages[{i}]", m["role"]
        if role in ("system", "developer"):
            body = _text(m.get("content"), f"{where}.content")
            if tools_text:  # the tool list goes with the first system message
                body = f"{body}\n\n{tools_text}" if body else tools_text
                tools_text = ""
            ids.append(sid("system"))
            text(body)
        elif role == "user":
            if m.get("content") is None:
                raise ChatFormatError(f"{where}.content is missing")
            ids.append(sid("user"))
            text(_text(m["content"], f"{where}.content"))
        elif role == "assistant":
            ids.append(sid("assistant"))
            reasoning = m.get("reasoning_content")
            if reasoning:
                ids.append(sid(THINK))
                text(_text(reasoning, f"{where}.reasoning_content"))
                ids.append(sid(END_THINK))
            text(_text(m.get("content"), f"{where}.content"))
            calls = m.get("tool_calls") or []
            if not isinstance(calls, list):
                raise ChatFormatError(f"{where}.tool_calls must be a list")
            for j, call in enumerate(calls):
                ids.append(sid(TOOL_CALL))
                text(_tool_call_json(call, f"{where}.tool_calls[{j}]"))
                ids.append(sid(END_TOOL_CALL))
        else:  # tool
            if m.get("content") is None:
                raise ChatFormatError(f"{where}.content (the tool's output) is missing")
            ids.append(sid("tool"))
            ids.append(sid("tool_result"))
            text(_text(m["content"], f"{where}.content"))
            ids.append(sid("/tool_result"))
        ids.append(sid("end"))
    if add_generation_prompt:
        ids.append(sid("assistant"))
        if reasoning_effort:
            ids.append(sid(f"effort:{reasoning_effort}"))
    return ids



# The same format as a Jinja template, for `tokenizer.apply_chat_template` on an exported HF tokenizer
# (`k3.io.hf.to_hf_tokenizer` sets it). For text content and tool-call arguments given as objects it
# renders exactly what `render` encodes (tests/serve/test_serve_hf.py compares the ids). Two differences
# follow from a template producing a string rather than ids: text that spells a special token ("<|end|>")
# becomes that token when the string is tokenized, and arguments given as a JSON string are inserted as
# written, where `render` parses and re-serialises them. `render` is what the server uses.
CHAT_TEMPLATE = (
    "{%- macro text(c) -%}"
    "{%- if c is none -%}{%- elif c is string -%}{{ c }}"
    "{%- else -%}{%- for part in c -%}{{ part['text'] }}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set ns = namespace(tools='') -%}"
    "{%- if tools -%}{%- set ns.tools = '# Tools\\n' + (tools | tojson) -%}{%- endif -%}"
    "{%- if ns.tools and (messages | selectattr('role', 'in', ['system', 'developer']) | list | length) == 0 -%}"
    "<|system|>{{ ns.tools }}<|end|>{%- set ns.tools = '' -%}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] in ['system', 'developer'] -%}"
    "{%- set body = text(m['content']) -%}"
    "{%- if ns.tools -%}"
    "{%- set body = (body + '\\n\\n' + ns.tools) if body else ns.tools -%}{%- set ns.tools = '' -%}"
    "{%- endif -%}"
    "<|system|>{{ body }}"
    "{%- elif m['role'] == 'user' -%}<|user|>{{ text(m['content']) }}"
    "{%- elif m['role'] == 'assistant' -%}<|assistant|>"
    "{%- if m['reasoning_content'] -%}<|think|>{{ text(m['reasoning_content']) }}<|/think|>{%- endif -%}"
    "{{ text(m['content']) }}"
    "{%- for call in (m['tool_calls'] or []) -%}"
    "{%- set fn = call['function'] -%}"
    "{%- set args = fn['arguments'] if fn['arguments'] is defined else {} -%}"
    "<|tool_call|>{\"name\": {{ fn['name'] | tojson }}, \"arguments\": "
    "{%- if args is string -%}{{ ' ' + (args if args | trim else '{}') }}"
    "{%- else -%}{{ ' ' + (args | tojson) }}{%- endif -%}}<|/tool_call|>"
    "{%- endfor -%}"
    "{%- elif m['role'] == 'tool' -%}<|tool|><|tool_result|>{{ text(m['content']) }}<|/tool_result|>"
    "{%- else -%}{{ raise_exception('messages[' ~ loop.index0 ~ '].role must be one of system, developer, "
    "user, assistant, tool') }}"
    "{%- endif -%}"
    "<|end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>"
    "{%- if reasoning_effort -%}<|effort:{{ reasoning_effort }}|>{%- endif -%}"
    "{%- endif -%}"
)

@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else {"index": index, **d}


class ChatOutputParser:
    """Incremental split of the reply text into ('content' | 'reasoning', str) and ('tool_call', ToolCall).

    Feed text deltas as they stream. `markers`: the spans [start, end) of the text that the model wrote as special
    tokens (the engine's `Request._markers`, which grows as the reply does); only those act as markers, so a reply
    that spells "<|end|>" or "<|think|>" in ordinary characters keeps them as text. Without it (text of unknown
    origin), every marker spelling counts, and one split across deltas is held back until it is whole.
    Special tokens other than the think / tool-call markers carry no text and are dropped; a think or tool-call
    marker out of place (a call inside the reasoning, an end without its start) stays in the text where it stands.
    """

    def __init__(self, markers: list[tuple[int, int]] | None = None):
        self.mode = "content"  # content | reasoning | tool
        self.buf = ""
        self.pos = 0  # offset of buf[0] in the whole reply (the coordinates of `markers`)
        self.markers = markers
        self.tool_buf = ""
        self.tool_calls: list[ToolCall] = []

    def _consume(self, n: int, out: list) -> None:
        self._text(self.buf[:n], out)
        self.buf, self.pos = self.buf[n:], self.pos + n

    def feed(self, delta: str, final: bool = False) -> list[tuple[str, object]]:
        self.buf += delta
        out: list[tuple[str, object]] = []
        known = self.markers is not None
        while True:
            i = self.buf.find("<|")
            if i < 0:
                keep = 1 if self.buf.endswith("<") and not final and not known else 0  # "<" may start a marker
                self._consume(len(self.buf) - keep, out)
                break
            self._consume(i, out)
            marker = next((t for t in RESERVED_TOKENS if self.buf.startswith(t)), None)
            # with known spans only a special token the engine recorded there is a marker
            if marker is not None and (not known or (self.pos, self.pos + len(marker)) in self.markers):
                self.buf, self.pos = self.buf[len(marker):], self.pos + len(marker)
                self._marker(marker, out)
            elif not known and not final and any(t.startswith(self.buf) for t in RESERVED_TOKENS):
                break  # maybe the start of a marker: wait for more text
            else:
                self._consume(2, out)
        if final:
            if self.mode == "tool":  # an unterminated call: give the text back rather than lose it
                self._text_as(TOOL_CALL + self.tool_buf, "content", out)
                self.mode, self.tool_buf = "content", ""
        return _coalesce(out)

    def _text(self, s: str, out: list) -> None:
        if not s:
            return
        if self.mode == "tool":
            self.tool_buf += s
        else:
            self._text_as(s, self.mode, out)

    @staticmethod
    def _text_as(s: str, kind: str, out: list) -> None:
        out.append((kind, s))

    def _marker(self, marker: str, out: list) -> None:
        if marker == THINK and self.mode == "content":
            self.mode = "reasoning"
        elif marker == END_THINK and self.mode == "reasoning":
            self.mode = "content"
        elif marker == TOOL_CALL and self.mode == "content":
            self.mode, self.tool_buf = "tool", ""
        elif marker == END_TOOL_CALL and self.mode == "tool":
            call, raw = _parse_call(self.tool_buf), self.tool_buf
            self.mode, self.tool_buf = "content", ""
            if call is None:  # not a JSON call: keep the text visible instead of dropping it
                out.append(("content", TOOL_CALL + raw + END_TOOL_CALL))
            else:
                self.tool_calls.append(call)
                out.append(("tool_call", call))
        elif marker in (THINK, END_THINK, TOOL_CALL, END_TOOL_CALL):  # out of place (a call inside the reasoning,
            self._text(marker, out)  # a stray end): kept as text where it stands, not dropped


def _parse_call(text: str) -> ToolCall | None:
    try:
        obj = loads_json(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", {})
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _coalesce(items: list[tuple[str, object]]) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    for kind, v in items:
        if out and kind != "tool_call" and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + v)
        else:
            out.append((kind, v))
    return out


def parse_reply(text: str, markers: list[tuple[int, int]] | None = None) -> tuple[str, str, list[ToolCall]]:
    """(content, reasoning, tool calls) of a whole reply; `markers` as for ChatOutputParser."""
    p = ChatOutputParser(markers)
    content, reasoning = [], []
    for kind, v in p.feed(text, final=True):
        (content if kind == "content" else reasoning if kind == "reasoning" else []).append(v)
    return "".join(content), "".join(reasoning), p.tool_calls


# ---------------------------------------------------------------------- formats
CHAT_FORMATS = ("k3", "kimi-k3")  # k3's own (the default) and Kimi K3's (k3.data.chat_kimi)


@dataclass(frozen=True)
class ChatFormat:
    """What the server needs of a chat format: render messages to ids, the tokens that end a reply, and the
    parser that splits a reply into content, reasoning and tool calls."""
    name: str
    render: object  # (messages, tokenizer, tools, reasoning_effort) -> ids
    parser: object  # (markers) -> a parser with feed(delta, final) and tool_calls
    parse_reply: object  # (text, markers) -> (content, reasoning, tool calls)
    stop_token_ids: object  # tokenizer -> ids
    template: str  # the Jinja template of the same format
    check_tokenizer: object = None  # tokenizer -> None, ValueError when it lacks the format's tokens


def chat_format(name: str) -> ChatFormat:
    """The chat format called `name` (one of CHAT_FORMATS)."""
    if name == "k3":
        return ChatFormat("k3", render, ChatOutputParser, parse_reply, stop_token_ids, CHAT_TEMPLATE)
    if name == "kimi-k3":
        from k3.data import chat_kimi as k

        return ChatFormat("kimi-k3", k.render, k.XtmlOutputParser, k.parse_reply, k.stop_token_ids, k.CHAT_TEMPLATE,
                          k.check_tokenizer)
    raise ValueError(f"unknown chat format {name!r}; known: {', '.join(CHAT_FORMATS)}")
