"""Kimi K3's chat format (XTML), selectable beside k3's own: `k3 serve --chat-format kimi-k3`.

Four special tokens carry the structure (`k3.data.tokenizer.FORMAT_TOKENS`); tag names and attributes are
ordinary text between them. An element is `<|open|>tag attr="v"<|sep|>body<|close|>tag<|sep|>`, and each
top-level message ends with `<|end_of_msg|>`:

    <|open|>message role="system" type="tool-declare"<|sep|># Tools ... ```json\\n{tools}\\n```<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="system" type="thinking-effort"<|sep|>...`thinking_effort=max`.<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="user"<|sep|>{text}<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="assistant"<|sep|><|open|>think<|sep|>{reasoning}<|close|>think<|sep|>
        <|open|>response<|sep|>{text}<|close|>response<|sep|>
        <|open|>tools<|sep|><|open|>call tool="NAME" index="1"<|sep|>
            <|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>...<|close|>call<|sep|>
        <|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="tool" tool="NAME" index="1"<|sep|>{output}<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="assistant"<|sep|><|open|>think<|sep|>          <- the generation prompt

The source is the Kimi K3 chat template published with llama.cpp (`models/templates/Kimi-K3.jinja`, a port of the
release's reference renderer); docs/serving.md says what is followed and what is left out. Message text is
encoded with special tokens disabled, as in k3's own format. `CHAT_TEMPLATE` is the same format in Jinja for an
exported HF tokenizer (tests/data/test_chat_kimi.py compares the two).
"""
from __future__ import annotations

import json
import re

from k3.data.chat import ChatFormatError, ToolCall, _coalesce, _text, check_request
from k3.data.tokenizer import FORMAT_TOKENS
from k3.fileio import loads_json

OPEN, CLOSE, SEP, END_OF_MSG = FORMAT_TOKENS
EFFORTS = ("low", "medium", "high", "max")
DEFAULT_EFFORT = "max"  # the release's default when the request names none
ROLES = ("system", "developer", "user", "assistant", "tool")
TOOLS_HEAD = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n"
EFFORT_TEXT = ("`thinking_effort` guides on how much to think in your thinking channel (not including the response "
               "channel), supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked "
               "with `thinking_effort={}`.")


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    """`<|end_of_msg|>` ends the assistant's message (<|eos|> always ends)."""
    return (tokenizer.special_id(END_OF_MSG),)


def check_tokenizer(tokenizer) -> None:
    """ValueError unless `tokenizer` holds the format's four tokens at their reserved ids."""
    for tok in FORMAT_TOKENS:
        tokenizer.special_id(tok)


def _attr(value) -> str:
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def _xtml_type(v) -> str:
    if isinstance(v, bool):
        return "boolean"
    if v is None:
        return "null"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    return "object" if isinstance(v, dict) else "array"


class _Parts:
    """The rendered conversation as alternating special tokens and text (adjacent text merged)."""

    def __init__(self):
        self.items: list[tuple[bool, str]] = []  # (is_special, text)

    def special(self, tok: str) -> None:
        self.items.append((True, tok))

    def text(self, s: str) -> None:
        if not s:
            return
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ChatFormatError(f"messages hold text that is not valid Unicode ({e.reason} at position "
                                  f"{e.start})") from None
        if self.items and not self.items[-1][0]:
            self.items[-1] = (False, self.items[-1][1] + s)
        else:
            self.items.append((False, s))

    def open(self, tag: str, attrs=()) -> None:
        self.special(OPEN)
        self.text(tag + "".join(f' {k}="{_attr(v)}"' for k, v in attrs))
        self.special(SEP)

    def close(self, tag: str) -> None:
        self.special(CLOSE)
        self.text(tag)
        self.special(SEP)

    def message(self, attrs, body: str) -> None:
        self.open("message", attrs)
        self.text(body)
        self.close("message")
        self.special(END_OF_MSG)


def _arguments(call, where: str):
    """A call's arguments as a dict (the argument form), or a non-empty string (the json form), or None."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ChatFormatError(f"{where} must be {{'type': 'function', 'function': {{'name': str, 'arguments': str}}}}")
    args = fn.get("arguments", {})
    if isinstance(args, str):  # OpenAI sends a JSON string; an object is rendered argument by argument
        try:
            parsed = loads_json(args) if args.strip() else {}
        except json.JSONDecodeError:
            parsed = None
        return parsed if isinstance(parsed, dict) else (args if args.strip() else None)
    if not isinstance(args, dict):
        raise ChatFormatError(f"{where}.function.arguments must be a JSON object or its text")
    return args


def render_parts(messages, tools=None, reasoning_effort: str | None = None, add_generation_prompt: bool = True,
                 thinking: bool = True) -> list[tuple[bool, str]]:
    """The conversation as (is_special, text) pieces; `render` encodes them, `render_text` joins them."""
    check_request(messages, tools, reasoning_effort)
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ChatFormatError(f"messages[{i}] must be an object with role one of {', '.join(ROLES)}")
    out = _Parts()
    if tools:
        out.message([("role", "system"), ("type", "tool-declare")],
                    TOOLS_HEAD + json.dumps(tools, ensure_ascii=False, separators=(",", ":"), sort_keys=True) + "\n```")
    if thinking:
        out.message([("role", "system"), ("type", "thinking-effort")],
                    EFFORT_TEXT.format(reasoning_effort or DEFAULT_EFFORT))
    calls: list = []  # the last assistant message's tool calls: tool results are named and ordered by them
    tool_index = 0
    i = 0
    while i < len(messages):
        m, where = messages[i], f"messages[{i}]"
        role = "system" if m["role"] == "developer" else m["role"]
        name = [("name", m["name"])] if m.get("name") else []
        if role in ("system", "user"):
            out.message([("role", role)] + name, _text(m.get("content"), f"{where}.content"))
        elif role == "assistant":
            calls = m.get("tool_calls") or []
            if not isinstance(calls, list):
                raise ChatFormatError(f"{where}.tool_calls must be a list")
            tool_index = 0
            out.open("message", [("role", "assistant")] + name)
            if thinking:
                out.open("think")
                reasoning = _text(m.get("reasoning_content"), f"{where}.reasoning_content")
                if reasoning.strip():
                    out.text(reasoning)
                out.close("think")
            out.open("response")
            out.text(_text(m.get("content"), f"{where}.content"))
            out.close("response")
            if calls:
                out.open("tools")
                for j, call in enumerate(calls):
                    args = _arguments(call, f"{where}.tool_calls[{j}]")
                    out.open("call", [("tool", call["function"]["name"]), ("index", j + 1)])
                    if isinstance(args, dict):
                        for key, value in args.items():
                            out.open("argument", [("key", key), ("type", _xtml_type(value))])
                            out.text(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
                            out.close("argument")
                    elif args is not None:
                        out.open("json", [("type", "object")])
                        out.text(args)
                        out.close("json")
                    out.close("call")
                out.close("tools")
            out.close("message")
            out.special(END_OF_MSG)
        else:  # a run of tool results
            run = []
            while i < len(messages) and messages[i]["role"] == "tool":
                run.append((i, messages[i]))
                i += 1
            ids = [c.get("id") for c in calls if isinstance(c, dict)]
            resolved = all(_call_id(t) is not None and str(_call_id(t)) in map(str, filter(None, ids))
                           for _, t in run)
            if resolved:  # in the order of the calls, each named after its call
                ordered, seen = [], set()
                for c in calls:
                    cid = c.get("id")
                    if cid is None or str(cid) in seen:
                        continue
                    seen.add(str(cid))
                    ordered += [(k, t, c["function"]["name"]) for k, t in run if str(_call_id(t)) == str(cid)]
            else:
                ordered = [(k, t, None) for k, t in run]
            for k, t, tool_name in ordered:
                tool_index += 1
                if tool_name is None:
                    tool_name = t.get("tool") if "tool" in t else t.get("name")
                if tool_name is None and tool_index <= len(calls):
                    tool_name = ((calls[tool_index - 1] or {}).get("function") or {}).get("name")
                if tool_name is None:
                    raise ChatFormatError(f"messages[{k}] (a tool result) needs a tool name: a tool_call_id of the "
                                          "assistant's calls, or 'name'")
                out.message([("role", "tool"), ("tool", tool_name), ("index", tool_index)],
                            _text(t.get("content"), f"messages[{k}].content"))
            continue
        i += 1
    if add_generation_prompt:
        out.open("message", [("role", "assistant")])
        out.open("think" if thinking else "response")
    return out.items


def _call_id(m: dict):
    return m.get("tool_call_id", m.get("id"))


def render_text(messages, tools=None, reasoning_effort: str | None = None, add_generation_prompt: bool = True,
                thinking: bool = True) -> str:
    """The conversation as one string, as the Jinja template writes it."""
    return "".join(s for _, s in render_parts(messages, tools, reasoning_effort, add_generation_prompt, thinking))


def render(messages, tokenizer, tools=None, reasoning_effort: str | None = None,
           add_generation_prompt: bool = True, thinking: bool = True) -> list[int]:
    """Token ids of a conversation: format tokens by id, text with special tokens disabled."""
    ids: list[int] = []
    for special, s in render_parts(messages, tools, reasoning_effort, add_generation_prompt, thinking):
        if special:
            ids.append(tokenizer.special_id(s))
        else:
            ids.extend(tokenizer.encode(s, allow_special=False))
    return ids


# ---------------------------------------------------------------------- parsing the reply
_ATTR = re.compile(r'([\w-]+)="([^"]*)"')


def _header(text: str) -> tuple[str, dict]:
    """`call tool="x" index="1"` -> ("call", {"tool": "x", "index": "1"})."""
    tag = text.strip().split(" ", 1)[0]
    return tag, {k: v.replace("&quot;", '"').replace("&amp;", "&") for k, v in _ATTR.findall(text)}


def _value(raw: str, kind: str | None):
    if kind == "string":
        return raw
    try:
        return loads_json(raw)
    except json.JSONDecodeError:
        return raw  # not what its type said: the text itself, rather than nothing


class XtmlOutputParser:
    """Incremental split of a reply in Kimi K3's format into ('content' | 'reasoning', str) and ('tool_call',
    ToolCall); the same interface as `k3.data.chat.ChatOutputParser`.

    The reply starts inside the generation prompt's `think` element (`response` when thinking is off). Text in
    `think` is reasoning, in `response` (or loose in the message) content; each `call` in `tools` becomes a tool
    call, its `argument` elements the arguments object (typed by their `type`) or its `json` element the
    arguments text. Opening a section ends the one still open, however the model left it. `markers` as for
    ChatOutputParser: with it, only the format tokens the model generated count; a call left open at the end is
    given back as content, and markup out of place stays in the text.
    """

    def __init__(self, markers: list[tuple[int, int]] | None = None, thinking: bool = True):
        self.markers = markers
        self.buf = ""
        self.pos = 0  # offset of buf[0] in the whole reply
        self.stack = ["message", "think" if thinking else "response"]
        self.pending: str | None = None  # OPEN or CLOSE whose header (up to SEP) is being read
        self.header = ""
        self.call: dict | None = None  # {"name", "args", "json", "raw"} of the call being read
        self.arg: tuple[str, str | None] | None = None  # (key, type) of the argument being read
        self.value = ""
        self.tool_calls: list[ToolCall] = []

    def _next_marker(self) -> tuple[int, str] | None:
        if self.markers is not None:
            for a, b in self.markers:
                if a >= self.pos and b <= self.pos + len(self.buf):
                    tok = self.buf[a - self.pos:b - self.pos]
                    if tok in FORMAT_TOKENS:
                        return a - self.pos, tok
            return None
        hits = [(i, t) for t in FORMAT_TOKENS if (i := self.buf.find(t)) >= 0]
        return min(hits) if hits else None

    def feed(self, delta: str, final: bool = False) -> list[tuple[str, object]]:
        self.buf += delta
        out: list[tuple[str, object]] = []
        while True:
            hit = self._next_marker()
            if hit is None:
                keep = 0
                if self.markers is None and not final:  # a marker may be arriving in pieces: wait for it
                    keep = next((n for n in range(min(len(self.buf), 13), 0, -1)
                                 if any(t.startswith(self.buf[-n:]) for t in FORMAT_TOKENS)), 0)
                self._take(len(self.buf) - keep, out)
                break
            i, tok = hit
            self._take(i, out)
            self.buf, self.pos = self.buf[len(tok):], self.pos + len(tok)
            self._marker(tok, out)
        if final:
            if self.pending is not None:  # a tag never finished: its text stays
                self._route(self.pending + self.header, out, raw=False)
                self.pending, self.header = None, ""
            if self.call is not None:  # a call never closed: give its text back rather than lose it
                out.append(("content", self.call["raw"]))
                self.call = self.arg = None
        return _coalesce(out)

    def _take(self, n: int, out: list) -> None:
        s, self.buf, self.pos = self.buf[:n], self.buf[n:], self.pos + n
        if not s:
            return
        if self.pending is not None:
            self.header += s
            if self.call is not None:
                self.call["raw"] += s
        else:
            self._route(s, out)

    def _route(self, s: str, out: list, raw: bool = True) -> None:
        if raw and self.call is not None:  # (markup already in the call's text is routed with raw=False)
            self.call["raw"] += s
        top = self.stack[-1]
        if top == "argument" or top == "json":
            self.value += s
        elif top in ("call", "tools"):
            pass  # only whitespace belongs between a call's elements; it carries nothing
        else:
            out.append(("reasoning" if top == "think" else "content", s))

    def _marker(self, tok: str, out: list) -> None:
        if self.call is not None:
            self.call["raw"] += tok
        if tok in (OPEN, CLOSE):
            if self.pending is not None:  # the previous tag never got its SEP: keep it as text
                self._route(self.pending + self.header, out, raw=False)
            self.pending, self.header = tok, ""
        elif tok == SEP and self.pending is not None:
            kind, header = self.pending, self.header
            self.pending, self.header = None, ""
            if not self._tag(kind, header, out):
                self._route(kind + header + SEP, out, raw=False)
        elif tok != END_OF_MSG:  # a stray SEP: kept where it stands
            self._route(tok, out, raw=False)

    def _tag(self, kind: str, header: str, out: list) -> bool:
        """Apply one tag; False when it is out of place (the caller keeps it as text)."""
        tag, attrs = _header(header)
        st = self.stack
        if kind == OPEN:
            if tag in ("think", "response", "tools"):
                while len(st) > 1 and st[-1] != "message":  # a new section ends the open one
                    self._end(st[-1], out)
                st.append(tag)
            elif tag == "call" and st[-1] == "tools" and attrs.get("tool"):
                self.call = {"name": attrs["tool"], "args": {}, "json": None, "raw": OPEN + header + SEP}
                st.append(tag)
            elif tag in ("argument", "json") and st[-1] == "call" and (tag == "json" or "key" in attrs):
                self.arg, self.value = (attrs.get("key"), attrs.get("type")), ""
                st.append(tag)
            else:
                return False
            return True
        if tag not in st:
            return False
        while st[-1] != tag:
            self._end(st[-1], out)
        self._end(tag, out)
        return True

    def _end(self, tag: str, out: list) -> None:
        self.stack.pop()
        if tag == "argument" and self.call is not None and self.arg is not None:
            self.call["args"][self.arg[0]] = _value(self.value, self.arg[1])
        elif tag == "json" and self.call is not None:
            self.call["json"] = self.value
        elif tag == "call" and self.call is not None:
            c = self.call
            args = c["json"] if c["json"] is not None else json.dumps(c["args"], ensure_ascii=False)
            self.tool_calls.append(ToolCall(c["name"], args))
            out.append(("tool_call", self.tool_calls[-1]))
            self.call = None
        if tag in ("argument", "json"):
            self.arg, self.value = None, ""


def parse_reply(text: str, markers: list[tuple[int, int]] | None = None,
                thinking: bool = True) -> tuple[str, str, list[ToolCall]]:
    """(content, reasoning, tool calls) of a whole reply; `markers` as for XtmlOutputParser."""
    p = XtmlOutputParser(markers, thinking)
    content, reasoning = [], []
    for kind, v in p.feed(text, final=True):
        (content if kind == "content" else reasoning if kind == "reasoning" else []).append(v)
    return "".join(content), "".join(reasoning), p.tool_calls


# The same format as a Jinja template, for `tokenizer.apply_chat_template` on an exported HF tokenizer (named
# "kimi-k3" beside k3's own; `k3.io.hf.to_hf_tokenizer`). It uses transformers' `tojson` (which takes json.dumps'
# arguments). For text content and tool-call arguments given as objects it writes exactly `render_text`'s string
# (tests/data/test_chat_kimi.py); arguments given as a JSON string are written as a `json` element, where
# `render` parses an object string into `argument` elements first (as vLLM parses them before its template).
# Extra variables: `reasoning_effort` (low, medium, high, max; default max) and `thinking` (default true).
CHAT_TEMPLATE = (
    "{%- macro text(c) -%}"
    "{%- if c is none -%}{%- elif c is string -%}{{ c }}"
    "{%- else -%}{%- for part in c -%}{{ part['text'] }}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- macro attr(v) -%}{{ (v | string).replace('&', '&amp;').replace('\"', '&quot;') }}{%- endmacro -%}"
    "{%- macro message(attrs, body) -%}"
    "<|open|>message{%- for a in attrs %} {{ a[0] }}=\"{{ attr(a[1]) }}\"{%- endfor -%}<|sep|>"
    "{{ body }}<|close|>message<|sep|><|end_of_msg|>"
    "{%- endmacro -%}"
    "{%- macro xtml_type(v) -%}"
    "{%- if v is boolean -%}boolean{%- elif v is none -%}null{%- elif v is number -%}number"
    "{%- elif v is string -%}string{%- elif v is mapping -%}object{%- else -%}array{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set thinking = true if thinking is not defined else thinking -%}"
    "{%- set effort = reasoning_effort if reasoning_effort is defined and reasoning_effort else 'max' -%}"
    "{%- if tools -%}"
    "{{ message([('role', 'system'), ('type', 'tool-declare')], '# Tools\\nHere are the available tools, described "
    "in JSONSchema.\\n\\n```json\\n' + (tools | tojson(separators=(',', ':'), sort_keys=true)) + '\\n```') }}"
    "{%- endif -%}"
    "{%- if thinking -%}"
    "{{ message([('role', 'system'), ('type', 'thinking-effort')], '`thinking_effort` guides on how much to think in "
    "your thinking channel (not including the response channel), supported values include `low`, `medium`, `high`, "
    "and `max`.\\nNow the system is invoked with `thinking_effort=' + effort + '`.') }}"
    "{%- endif -%}"
    "{%- set st = namespace(calls=[], index=0) -%}"
    "{%- for m in messages -%}"
    "{%- set role = 'system' if m['role'] == 'developer' else m['role'] -%}"
    "{%- set name = [('name', m['name'])] if m['name'] else [] -%}"
    "{%- if role in ['system', 'user'] -%}"
    "{{ message([('role', role)] + name, text(m['content'])) }}"
    "{%- elif role == 'assistant' -%}"
    "{%- set st.calls = m['tool_calls'] or [] -%}{%- set st.index = 0 -%}"
    "<|open|>message role=\"assistant\"{%- for a in name %} name=\"{{ attr(a[1]) }}\"{%- endfor -%}<|sep|>"
    "{%- if thinking -%}<|open|>think<|sep|>"
    "{%- set r = text(m['reasoning_content']) -%}{%- if r | trim -%}{{ r }}{%- endif -%}"
    "<|close|>think<|sep|>{%- endif -%}"
    "<|open|>response<|sep|>{{ text(m['content']) }}<|close|>response<|sep|>"
    "{%- if st.calls -%}<|open|>tools<|sep|>"
    "{%- for call in st.calls -%}{%- set fn = call['function'] -%}"
    "<|open|>call tool=\"{{ attr(fn['name']) }}\" index=\"{{ loop.index }}\"<|sep|>"
    "{%- set args = fn['arguments'] if fn['arguments'] is defined else {} -%}"
    "{%- if args is mapping -%}"
    "{%- for key, value in args.items() -%}"
    "<|open|>argument key=\"{{ attr(key) }}\" type=\"{{ xtml_type(value) }}\"<|sep|>"
    "{{ value if value is string else value | tojson }}<|close|>argument<|sep|>"
    "{%- endfor -%}"
    "{%- elif args is string and args | trim -%}<|open|>json type=\"object\"<|sep|>{{ args }}<|close|>json<|sep|>"
    "{%- endif -%}"
    "<|close|>call<|sep|>"
    "{%- endfor -%}<|close|>tools<|sep|>{%- endif -%}"
    "<|close|>message<|sep|><|end_of_msg|>"
    "{%- elif role == 'tool' and (loop.first or messages[loop.index0 - 1]['role'] != 'tool') -%}"
    # a run of tool results: in the order of the calls when every result names one of them, else as given
    "{%- set run = namespace(msgs=[], resolved=0, done=false) -%}"
    "{%- for t in messages[loop.index0:] -%}"
    "{%- if not run.done -%}{%- if t['role'] != 'tool' -%}{%- set run.done = true -%}{%- else -%}"
    "{%- set run.msgs = run.msgs + [t] -%}"
    "{%- set cid = t['tool_call_id'] if t['tool_call_id'] is defined else t['id'] -%}"
    "{%- if cid is not none and cid is defined and (st.calls | selectattr('id', 'defined') | selectattr('id') "
    "| map(attribute='id') | map('string') | select('equalto', cid | string) | list) -%}"
    "{%- set run.resolved = run.resolved + 1 -%}{%- endif -%}"
    "{%- endif -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- set order = namespace(items=[], seen=[]) -%}"
    "{%- if run.resolved == run.msgs | length -%}"
    "{%- for c in st.calls -%}{%- if c['id'] is defined and c['id'] and (c['id'] | string) not in order.seen -%}"
    "{%- set order.seen = order.seen + [c['id'] | string] -%}"
    "{%- for t in run.msgs -%}"
    "{%- set cid = t['tool_call_id'] if t['tool_call_id'] is defined else t['id'] -%}"
    "{%- if (cid | string) == (c['id'] | string) -%}{%- set order.items = order.items + [(t, c['function']['name'])] -%}"
    "{%- endif -%}"
    "{%- endfor -%}{%- endif -%}{%- endfor -%}"
    "{%- else -%}{%- for t in run.msgs -%}{%- set order.items = order.items + [(t, none)] -%}{%- endfor -%}"
    "{%- endif -%}"
    "{%- for t, resolved_name in order.items -%}"
    "{%- set st.index = st.index + 1 -%}"
    "{%- set tool_name = resolved_name -%}"
    "{%- if tool_name is none -%}{%- set tool_name = t['tool'] if 'tool' in t else t['name'] -%}{%- endif -%}"
    "{%- if tool_name is none and st.index <= st.calls | length -%}"
    "{%- set tool_name = st.calls[st.index - 1]['function']['name'] -%}{%- endif -%}"
    "{%- if tool_name is none -%}{{ raise_exception('a tool result needs a tool name: a tool_call_id of the "
    "assistant\\'s calls, or name') }}{%- endif -%}"
    "{{ message([('role', 'tool'), ('tool', tool_name), ('index', st.index)], text(t['content'])) }}"
    "{%- endfor -%}"
    "{%- elif role != 'tool' -%}"
    "{{ raise_exception('messages[' ~ loop.index0 ~ '].role must be one of system, developer, user, assistant, "
    "tool') }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "<|open|>message role=\"assistant\"<|sep|><|open|>{{ 'think' if thinking else 'response' }}<|sep|>"
    "{%- endif -%}"
)
