"""Harness dialects: one action set, presented as the tool formats of different coding agents.

- `kimi`   Kimi-Code-like: ReadFile/WriteFile/StrReplaceFile/Shell/Grep, called with K2's
           `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>`.
- `claude` Claude-Code-like: Read/Write/Edit/Bash/Grep tool-use blocks,
           `<invoke name="Edit"><parameter name="file_path">…</parameter></invoke>`.
- `codex`  Codex-like: `shell` (argv list) and `apply_patch` (`*** Begin Patch` format) function
           calls in harmony form `to=functions.shell <|constrain|>json<|message|>{…}<|call|>`.
- `react`  plain ReAct text: `Action: name` / `Action Input: {json}` / `Observation: …`.

A `Variant` renames tools and arguments and shuffles their order (seeded, per episode) so a policy
learns the semantics rather than one spelling. Parsing never raises anything but `ParseError`, whose
message is sent back to the policy.
"""
from __future__ import annotations

import dataclasses
import json
import random
import re
import shlex
from dataclasses import dataclass

from .actions import ACTIONS, ARG_DESCRIPTIONS, DESCRIPTIONS, Action, ActionError, make_action


SHELL_ARG_BYTES = 100_000  # a program's argument stays under the kernel's 128 KiB per-string cap


def as_shell_action(a: Action) -> Action:
    """The same write / edit / run as a `run` of a command made only of letters, digits and a few punctuation
    marks (its arguments base64-encoded), for text a dialect's markup cannot carry (a closing tag in Claude's XML
    parameters, a file without a final newline or an '*** End Patch' line in Codex patches). The edit keeps the
    tool's rules: the old text must occur, once unless replace_all."""
    import base64

    if a.tool == "run":
        blob = base64.b64encode(a.args["command"].encode("utf-8")).decode()
        kept = {k: v for k, v in a.args.items() if k != "command"}  # the timeout stays the run's own
        return Action("run", {"command": f"bash -c \"$(echo {blob} | base64 -d)\"", **kept})
    blob = base64.b64encode(json.dumps(a.args, ensure_ascii=False).encode("utf-8")).decode()
    head = f"import base64, json, pathlib, sys; a = json.loads(base64.b64decode('{blob}')); p = pathlib.Path(a['path']); "
    if a.tool == "write":
        body = "p.parent.mkdir(parents=True, exist_ok=True); p.write_bytes(a['content'].encode())"
    elif a.tool == "edit":
        body = ("t = p.read_bytes().decode(); n = t.count(a['old']); "
                "sys.exit('old text not found in ' + a['path']) if not a['old'] or n == 0 else None; "
                "sys.exit('old text occurs %d times in %s' % (n, a['path'])) if n > 1 and not a.get('replace_all') "
                "else None; p.write_bytes((t.replace(a['old'], a['new']) if a.get('replace_all') "
                "else t.replace(a['old'], a['new'], 1)).encode())")
    else:
        raise ValueError(f"{a.tool} has no shell form")
    if len(head) + len(body) > SHELL_ARG_BYTES:  # past one argv string's 128 KiB cap: the script on stdin instead
        return Action("run", {"command": f"python3 - <<'K3_EOF'\n{head + body}\nK3_EOF"})  # (base64 has no '_')
    return Action("run", {"command": "python3 -c " + shlex.quote(head + body)})


class ParseError(ValueError):
    """The policy's text holds no well-formed tool call; the message explains the right form."""


# canonical names per dialect: abstract tool -> (tool name, {abstract arg: dialect arg})
CANONICAL = {
    "kimi": {
        "read": ("ReadFile", {"path": "path", "offset": "line_offset", "limit": "n_lines"}),
        "write": ("WriteFile", {"path": "path", "content": "content"}),
        "edit": ("StrReplaceFile", {"path": "path", "old": "old", "new": "new", "replace_all": "replace_all"}),
        "run": ("Shell", {"command": "command", "timeout": "timeout"}),
        "search": ("Grep", {"pattern": "pattern", "path": "path", "glob": "glob"}),
        "finish": ("Finish", {"summary": "summary"}),
    },
    "claude": {
        "read": ("Read", {"path": "file_path", "offset": "offset", "limit": "limit"}),
        "write": ("Write", {"path": "file_path", "content": "content"}),
        "edit": ("Edit", {"path": "file_path", "old": "old_string", "new": "new_string",
                          "replace_all": "replace_all"}),
        "run": ("Bash", {"command": "command", "timeout": "timeout"}),
        "search": ("Grep", {"pattern": "pattern", "path": "path", "glob": "glob"}),
        "finish": ("Done", {"summary": "summary"}),
    },
    "codex": {  # write/edit go through apply_patch; read/search also have their own functions
        "read": ("read_file", {"path": "file_path", "offset": "offset", "limit": "limit"}),
        "run": ("shell", {"command": "command", "timeout": "timeout_ms"}),
        "search": ("grep_files", {"pattern": "pattern", "path": "path", "glob": "include"}),
        "patch": ("apply_patch", {"input": "input"}),
        "finish": ("finish", {"summary": "summary"}),
    },
    "react": {
        "read": ("read_file", {"path": "path", "offset": "offset", "limit": "limit"}),
        "write": ("write_file", {"path": "path", "content": "content"}),
        "edit": ("edit_file", {"path": "path", "old": "old", "new": "new", "replace_all": "replace_all"}),
        "run": ("run", {"command": "command", "timeout": "timeout"}),
        "search": ("search", {"pattern": "pattern", "path": "path", "glob": "glob"}),
        "finish": ("finish", {"summary": "summary"}),
    },
}
DIALECTS = tuple(CANONICAL)
MS_TIMEOUT = {"claude", "codex"}   # these dialects take timeouts in milliseconds, like their originals

TOOL_ALIASES = {
    "read": ["read_file", "view_file", "open_file", "cat_file", "file_read", "show_file", "read"],
    "write": ["write_file", "create_file", "save_file", "put_file", "file_write", "write"],
    "edit": ["edit_file", "replace_in_file", "str_replace", "patch_text", "modify_file", "edit"],
    "run": ["run_command", "bash", "exec", "terminal", "sh", "execute", "run_shell"],
    "search": ["grep", "search_files", "find_text", "code_search", "rg", "search"],
    "finish": ["finish", "submit", "done", "complete_task", "end_task", "task_done"],
    "patch": ["apply_patch", "patch", "apply_diff", "edit_patch"],
}
ARG_ALIASES = {
    "path": ["path", "file_path", "filename", "file", "target", "filepath"],
    "offset": ["offset", "line_offset", "start_line", "from_line"],
    "limit": ["limit", "n_lines", "max_lines", "num_lines"],
    "content": ["content", "text", "body", "contents", "file_text"],
    "old": ["old", "old_string", "old_str", "search_text", "before"],
    "new": ["new", "new_string", "new_str", "replacement", "after"],
    "replace_all": ["replace_all", "all", "every", "global_replace"],
    "command": ["command", "cmd", "script", "command_line"],
    "timeout": ["timeout", "time_limit", "max_time", "deadline"],
    "pattern": ["pattern", "regex", "query", "expression"],
    "glob": ["glob", "include", "file_glob", "name_filter"],
    "summary": ["summary", "message", "result", "note"],
    "input": ["input", "patch", "diff", "changes"],
}


def _style(name: str, dialect: str) -> str:
    if dialect in ("kimi", "claude"):  # CamelCase tool names
        return "".join(p[:1].upper() + p[1:] for p in name.split("_"))
    return name


@dataclass(frozen=True)
class Variant:
    """Concrete names for one episode: abstract tool -> (name, {abstract arg: name}), plus order."""

    dialect: str
    tools: dict
    order: tuple
    augmented: bool = False

    def to_json(self) -> dict:
        return {"dialect": self.dialect, "augmented": self.augmented,
                "tools": {k: [v[0], v[1]] for k, v in self.tools.items()}, "order": list(self.order)}


def make_variant(dialect: str, rng: random.Random | None = None, augment: bool = False) -> Variant:
    if dialect not in CANONICAL:
        raise ValueError(f"unknown dialect {dialect!r}; choose from {DIALECTS}")
    canon = CANONICAL[dialect]
    if not augment or rng is None:
        return Variant(dialect, {k: (n, dict(a)) for k, (n, a) in canon.items()}, tuple(canon))
    tools, used = {}, set()
    for tool, (name, args) in canon.items():
        if rng.random() < 0.6:
            pool = [_style(n, dialect) for n in TOOL_ALIASES[tool]]
            pool = [n for n in pool if n not in used] or [name]
            name = rng.choice(pool)
        used.add(name)
        new_args, taken = {}, set()
        for arg, aname in args.items():
            if rng.random() < 0.5:
                pool = [n for n in ARG_ALIASES[arg] if n not in taken]
                aname = rng.choice(pool) if pool else aname
            if aname in taken:
                aname = arg if arg not in taken else aname + "_"
            taken.add(aname)
            new_args[arg] = aname
        tools[tool] = (name, new_args)
    order = list(canon)
    rng.shuffle(order)
    return Variant(dialect, tools, tuple(order), augmented=True)


def choose_variant(seed: int, dialects=DIALECTS, augment: bool = True) -> Variant:
    """The dialect and naming of one episode, a pure function of its seed."""
    rng = random.Random(f"k3-dialect-{seed}")
    dialects = tuple(dialects)
    for d in dialects:
        if d not in CANONICAL:
            raise ValueError(f"unknown dialect {d!r}; choose from {DIALECTS}")
    return make_variant(rng.choice(dialects), rng, augment)


PREAMBLE = ("You are a software engineering agent. You work inside a sandboxed Linux machine; the "
            "task's files are in /workspace, which is also the working directory. There is no "
            "network access. Use the tools described below, one step at a time, and read their "
            "results before continuing. When the task is complete, call the {finish} tool. After "
            "that, hidden checks decide whether the task was solved.\n")


class Dialect:
    name = "base"

    def __init__(self, variant: Variant):
        self.v = variant
        self.by_name = {name: tool for tool, (name, _) in variant.tools.items()}

    # ---- names
    def tool_name(self, tool: str) -> str:
        return self.v.tools[tool][0]

    def arg_name(self, tool: str, arg: str) -> str:
        return self.v.tools[tool][1][arg]

    def _decode_call(self, name: str, args) -> list[Action]:
        """Dialect-named call -> abstract actions; ParseError with a helpful message."""
        tool = self.by_name.get(name)
        if tool is None:
            raise ParseError(f"unknown tool {name!r}; available tools: "
                             f"{', '.join(self.tool_name(t) for t in self.v.order)}")
        if not isinstance(args, dict):
            raise ParseError(f"the arguments of {name} must be a JSON object")
        back = {dn: an for an, dn in self.v.tools[tool][1].items()}
        unknown = sorted(set(args) - set(back))
        if unknown:
            raise ParseError(f"{name} has no argument(s) {unknown}; its arguments are "
                             f"{sorted(back)}")
        abstract = {back[k]: v for k, v in args.items()}
        if tool == "patch":
            return self._patch_actions(abstract.get("input"))
        if tool == "run" and "timeout" in abstract and self.v.dialect in MS_TIMEOUT:
            t = abstract["timeout"]
            if isinstance(t, str):  # "500" means 500 ms here too, not 500 s after make_action's conversion
                try:
                    t = float(t)
                except ValueError:
                    pass
            if isinstance(t, (int, float)) and not isinstance(t, bool):
                if not t > 0:  # refused here, so the message shows the value as the policy wrote it
                    raise ParseError(f"argument {self.arg_name('run', 'timeout')!r} of {name} must be a positive "
                                     f"number of milliseconds, got {abstract['timeout']!r}")
                abstract["timeout"] = t / 1000.0
        if tool == "run" and isinstance(abstract.get("command"), list):
            abstract["command"] = _argv_to_command(abstract["command"])
        try:
            return [make_action(tool, abstract)]
        except ActionError as e:
            msg = str(e)
            for an, dn in self.v.tools[tool][1].items():
                msg = msg.replace(f"'{an}'", f"'{dn}'")
            raise ParseError(msg.replace(f" for {tool}", f" for {name}")
                             .replace(f" of {tool} ", f" of {name} ")) from None

    def _encode_args(self, a: Action) -> dict:
        names = self.v.tools[a.tool][1]
        out = {}
        for k, v in a.args.items():
            if k == "timeout" and self.v.dialect in MS_TIMEOUT:
                v = int(v * 1000)
            out[names[k]] = v
        return out

    def _patch_actions(self, text) -> list[Action]:
        raise ParseError("this dialect has no patch tool")

    # ---- rendering
    def tool_specs(self) -> list[dict]:
        specs = []
        for tool in self.v.order:
            name, args = self.v.tools[tool]
            if tool == "patch":
                props = {args["input"]: {"type": "string", "description":
                         "a patch: *** Begin Patch / *** Add File: P / *** Update File: P with "
                         "@@ hunks of ' ', '-', '+' lines / *** Delete File: P / *** End Patch"}}
                specs.append({"name": name, "description": "Create, edit or delete files with a "
                              "patch.", "parameters": {"type": "object", "properties": props,
                                                       "required": [args["input"]]}})
                continue
            props, req = {}, []
            arg_items = list(ACTIONS[tool].items())
            for arg, (typ, required) in arg_items:
                t = {str: "string", int: "integer", bool: "boolean"}.get(typ, "number")
                desc = ARG_DESCRIPTIONS[arg]
                if arg == "timeout" and self.v.dialect in MS_TIMEOUT:
                    desc = "timeout in milliseconds"
                if tool == "run" and arg == "command" and self.v.dialect == "codex":
                    props[args[arg]] = {"type": "array", "items": {"type": "string"},
                                        "description": "argv, e.g. [\"bash\", \"-lc\", \"ls\"]"}
                else:
                    props[args[arg]] = {"type": t, "description": desc}
                if required:
                    req.append(args[arg])
            specs.append({"name": name, "description": DESCRIPTIONS[tool],
                          "parameters": {"type": "object", "properties": props, "required": req}})
        return specs

    def system_prompt(self) -> str:
        return PREAMBLE.format(finish=self.tool_name("finish")) + "\n" + self.format_help()

    def format_help(self) -> str:
        raise NotImplementedError

    def render_call(self, a: Action, index: int = 0) -> str:
        raise NotImplementedError

    def render_calls(self, actions: list[Action]) -> str:
        return "\n".join(self.render_call(a, i) for i, a in enumerate(actions))

    def render_results(self, results: list[tuple[Action | None, bool, str]]) -> str:
        raise NotImplementedError

    def render_error(self, message: str) -> str:
        return self.render_results([(None, False, f"error: {message}")])

    def parse(self, text: str) -> list[Action]:
        raise NotImplementedError


def _argv_to_command(argv: list) -> str:
    if not all(isinstance(x, str) for x in argv) or not argv:
        raise ParseError("shell command must be a non-empty list of strings")
    if len(argv) == 3 and argv[0] in ("bash", "sh", "/bin/bash", "/bin/sh") and argv[1] in ("-c", "-lc"):
        return argv[2]
    return shlex.join(argv)


def _json_args(raw: str, name: str):
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise ParseError(f"the arguments of {name} are not valid JSON ({e.msg} at position {e.pos})") from None
    except (ValueError, RecursionError) as e:  # an integer past Python's digit limit, nesting past the stack
        raise ParseError(f"the arguments of {name} cannot be read ({type(e).__name__}: {e})"[:300]) from None


def _json_no_markers(args: dict) -> str:
    """JSON arguments with every '<|' written as the JSON escape '\\u003c|': a marker such as '<|tool_call_end|>'
    inside a file's content would otherwise end the call there. Any JSON parser reads the same text back."""
    return json.dumps(args, ensure_ascii=False).replace("<|", "\\u003c|")


class KimiDialect(Dialect):
    name = "kimi"
    CALL = re.compile(r"<\|tool_call_begin\|>\s*(.*?)\s*<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>",
                      re.S)

    def format_help(self) -> str:
        tools = json.dumps([{"type": "function", "function": s} for s in self.tool_specs()], indent=1)
        ex = self.render_call(Action("run", {"command": "ls"}), 0)
        return (f"# Tools\n{tools}\n\n# Calling tools\nWrap calls in a tool-calls section; each "
                f"call is functions.NAME:INDEX followed by JSON arguments, for example:\n{ex}\n"
                "Several calls may share one section; they run in order.")

    def render_call(self, a: Action, index: int = 0) -> str:
        return ("<|tool_calls_section_begin|>" + self._one(a, index) + "<|tool_calls_section_end|>")

    def _one(self, a: Action, index: int) -> str:
        return (f"<|tool_call_begin|>functions.{self.tool_name(a.tool)}:{index}"
                f"<|tool_call_argument_begin|>{_json_no_markers(self._encode_args(a))}"
                "<|tool_call_end|>")

    def render_calls(self, actions):
        return ("<|tool_calls_section_begin|>" + "".join(self._one(a, i) for i, a in enumerate(actions))
                + "<|tool_calls_section_end|>")

    def parse(self, text):
        calls = self.CALL.findall(text)
        if not calls:
            raise ParseError("no tool call found; call a tool like "
                             + self.render_call(Action("finish", {}), 0))
        out = []
        for ident, raw in calls:
            m = re.fullmatch(r"(?:functions\.)?([\w.-]+?)(?::(\d+))?", ident)
            if not m:
                raise ParseError(f"bad tool call id {ident!r}; use functions.NAME:INDEX")
            call = f"functions.{m.group(1)}:{m.group(2)}" if m.group(2) is not None else None
            out += [dataclasses.replace(a, call=call) for a in self._decode_call(m.group(1), _json_args(raw, m.group(1)))]
        return out

    def render_results(self, results):
        parts = []
        for i, (a, ok, text) in enumerate(results):
            if a is not None and a.call:  # the id the policy gave its call (Kimi numbers calls across turns)
                parts.append(f"## Return of {a.call}\n{text}")
                continue
            name = self.tool_name(a.tool) if a and a.tool in self.v.tools else "error"
            parts.append(f"## Return of functions.{name}:{i}\n{text}")
        return "\n\n".join(parts)


class ClaudeDialect(Dialect):
    name = "claude"
    INVOKE = re.compile(r'<invoke\s+name="([^"]*)"\s*>(.*?)</invoke>', re.S)
    PARAM = re.compile(r'<parameter\s+name="([^"]*)"\s*>(.*?)</parameter>', re.S)

    def format_help(self) -> str:
        fns = "\n".join(f"<function>{json.dumps(s)}</function>" for s in self.tool_specs())
        ex = self.render_call(Action("read", {"path": "README.txt"}))
        return ("In this environment you have access to a set of tools you can use to answer the "
                "user's request. You can invoke functions by writing a \"<function_calls>\" block "
                f"like this:\n{ex}\n\nHere are the functions available:\n<functions>\n{fns}\n</functions>")

    def _invoke(self, a: Action) -> str:
        if any(isinstance(v, str) and ("</parameter>" in v or "</invoke>" in v) for v in a.args.values()) \
                and a.tool in ("write", "edit", "run"):
            a = as_shell_action(a)  # a closing tag inside a raw parameter value would cut it short
        params = "".join(f'<parameter name="{k}">{v if isinstance(v, str) else json.dumps(v)}</parameter>\n'
                         for k, v in self._encode_args(a).items())
        return f'<invoke name="{self.tool_name(a.tool)}">\n{params}</invoke>\n'

    def render_call(self, a: Action, index: int = 0) -> str:
        return "<function_calls>\n" + self._invoke(a) + "</function_calls>"

    def render_calls(self, actions):
        return "<function_calls>\n" + "".join(self._invoke(a) for a in actions) + "</function_calls>"

    def parse(self, text):
        invokes = self.INVOKE.findall(text)
        if not invokes:
            raise ParseError("no tool call found; use a <function_calls> block such as\n"
                             + self.render_call(Action("finish", {})))
        out = []
        for name, body in invokes:
            tool = self.by_name.get(name)
            args = {}
            for pname, raw in self.PARAM.findall(body):
                args[pname] = self._coerce(tool, pname, raw)
            out += self._decode_call(name, args)
        return out

    def _coerce(self, tool, pname, raw):
        """Parameter text -> value; strings stay exactly as written, other types are parsed."""
        if tool is None:
            return raw
        back = {dn: an for an, dn in self.v.tools[tool][1].items()}
        arg = back.get(pname)
        spec = ACTIONS.get(tool, {}).get(arg)
        if spec is None or spec[0] is str:
            return raw
        try:
            return json.loads(raw.strip())
        except (ValueError, RecursionError):  # not JSON (or past the digit / nesting limits): the text itself
            return raw.strip()

    def render_results(self, results):
        out = ["<function_results>"]
        for a, ok, text in results:
            name = self.tool_name(a.tool) if a and a.tool in self.v.tools else "error"
            tag = "output" if ok else "error"
            out.append(f"<result>\n<name>{name}</name>\n<{tag}>{text}</{tag}>\n</result>")
        out.append("</function_results>")
        return "\n".join(out)


class CodexDialect(Dialect):
    name = "codex"
    # the recipient in the channel header or, also valid harmony, in the role header before <|channel|>
    CALL = re.compile(r"to=functions\.([\w.-]+)[^\n<]*?(?:<\|channel\|>[^\n<]*)?(?:<\|constrain\|>\s*\w+)?\s*"
                      r"<\|message\|>(.*?)<\|call\|>", re.S)

    def format_help(self) -> str:
        lines = ["# Tools", "", "## functions", "", "namespace functions {", ""]
        for s in self.tool_specs():
            props = s["parameters"]["properties"]
            req = set(s["parameters"]["required"])
            fields = ", ".join(f"{k}{'' if k in req else '?'}: "
                               f"{'string[]' if v['type'] == 'array' else v['type']}"
                               for k, v in props.items())
            lines += [f"// {s['description']}", f"type {s['name']} = (_: {{{fields}}}) => any;", ""]
        lines.append("} // namespace functions")
        ex = self.render_call(Action("run", {"command": "ls"}))
        return "\n".join(lines) + f"\n\nCall a function like this:\n{ex}"

    def _msg(self, name: str, args: dict) -> str:
        return (f"<|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json"
                f"<|message|>{_json_no_markers(args)}<|call|>")

    def render_call(self, a: Action, index: int = 0) -> str:
        if a.tool in ("write", "edit"):
            texts = [a.args["content"]] if a.tool == "write" else [a.args["old"], a.args["new"]]
            if (any("*** End Patch" in t for t in texts) or a.args.get("replace_all")
                    or (a.tool == "write" and not a.args["content"].endswith("\n"))
                    or a.args["path"] != a.args["path"].strip()):
                # a patch replaces one located hunk ("every occurrence" has no patch form), an Add File always
                # ends its content with a newline, '*** End Patch' ends any patch, and a patch header's path is
                # read without the spaces around it
                return self.render_call(as_shell_action(a))
            return self._msg(self.tool_name("patch"), {self.arg_name("patch", "input"): _render_patch(a)})
        args = self._encode_args(a)
        if a.tool == "run":
            args[self.arg_name("run", "command")] = ["bash", "-lc", a.args["command"]]
        return self._msg(self.tool_name(a.tool), args)

    def parse(self, text):
        calls = self.CALL.findall(text)
        if not calls:
            raise ParseError("no function call found; call a function like "
                             + self.render_call(Action("finish", {})))
        out = []
        for name, raw in calls:
            out += [dataclasses.replace(a, call=name) for a in self._decode_call(name, _json_args(raw, name))]
        return out

    def _patch_actions(self, text):
        return parse_patch(text)

    def render_results(self, results):
        out = []
        for a, ok, text in results:
            if a is not None and a.call:  # the function the policy called (apply_patch for a deleted file too)
                name = a.call
            else:
                name = self.tool_name(a.tool) if a and a.tool in self.v.tools else (
                    self.tool_name("patch") if a and a.tool in ("write", "edit") else "error")
            out.append(f"<|start|>functions.{name} to=assistant<|channel|>commentary<|message|>"
                       f"{json.dumps({'output': text, 'success': ok}, ensure_ascii=False)}<|end|>")
        return "\n".join(out)


def _render_patch(a: Action) -> str:
    p = a.args["path"]
    if a.tool == "write":
        body = a.args["content"]
        lines = body[:-1].split("\n") if body.endswith("\n") else body.split("\n")
        return "*** Begin Patch\n*** Add File: " + p + "\n" + "".join("+" + ln + "\n" for ln in lines) \
            + "*** End Patch"
    old, new = a.args["old"].split("\n"), a.args["new"].split("\n")
    return ("*** Begin Patch\n*** Update File: " + p + "\n@@\n" + "".join("-" + ln + "\n" for ln in old)
            + "".join("+" + ln + "\n" for ln in new) + "*** End Patch")


def parse_patch(text) -> list[Action]:
    """Codex `apply_patch` text -> write / edit / run(rm) actions."""
    if not isinstance(text, str) or "*** Begin Patch" not in text:
        raise ParseError("apply_patch input must start with '*** Begin Patch' and end with "
                         "'*** End Patch'")
    body = text.split("*** Begin Patch", 1)[1]
    if "*** End Patch" not in body:
        raise ParseError("apply_patch input is missing '*** End Patch'")
    body = body.split("*** End Patch", 1)[0]
    lines = body.split("\n")
    if lines and lines[0] == "":
        lines = lines[1:]
    if lines and lines[-1] == "":
        lines = lines[:-1]
    out: list[Action] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("*** Add File: "):
            path = line[len("*** Add File: "):].strip()
            i += 1
            content = []
            while i < len(lines) and not lines[i].startswith("*** "):
                if not lines[i].startswith("+"):
                    raise ParseError(f"Add File {path}: every content line must start with '+'")
                content.append(lines[i][1:])
                i += 1
            out.append(make_action("write", {"path": path, "content": "\n".join(content) + "\n"}))
        elif line.startswith("*** Delete File: "):
            path = line[len("*** Delete File: "):].strip()
            out.append(make_action("run", {"command": "rm -- " + shlex.quote(path)}))
            i += 1
        elif line.startswith("*** Update File: "):
            path = line[len("*** Update File: "):].strip()
            i += 1
            if i < len(lines) and lines[i].startswith("*** Move to:"):
                raise ParseError("'*** Move to:' is not supported; use the shell to move files")
            hunks: list[tuple[list, list]] = []
            old, new = None, None
            while i < len(lines) and not lines[i].startswith("*** "):
                ln = lines[i]
                if ln.startswith("@@"):
                    if old is not None and (old or new):
                        hunks.append((old, new))
                    old, new = [], []
                else:
                    if old is None:
                        old, new = [], []
                    if ln.startswith("-"):
                        old.append(ln[1:])
                    elif ln.startswith("+"):
                        new.append(ln[1:])
                    elif ln.startswith(" ") or ln == "":
                        old.append(ln[1:])
                        new.append(ln[1:])
                    else:
                        raise ParseError(f"Update File {path}: hunk line {ln[:40]!r} must start "
                                         "with ' ', '-' or '+'")
                i += 1
            if old is not None and (old or new):
                hunks.append((old, new))
            if not hunks:
                raise ParseError(f"Update File {path}: no hunks")
            for o, n in hunks:
                if not "\n".join(o):
                    raise ParseError(f"Update File {path}: a hunk needs context or '-' lines to "
                                     "locate the change")
                out.append(make_action("edit", {"path": path, "old": "\n".join(o), "new": "\n".join(n)}))
        elif line.strip() == "":
            i += 1
        else:
            raise ParseError(f"unexpected patch line {line[:60]!r}; expected '*** Add File:', "
                             "'*** Update File:' or '*** Delete File:'")
    if not out:
        raise ParseError("the patch changes nothing")
    return out


class ReactDialect(Dialect):
    name = "react"
    ACTION = re.compile(r"Action\s*:\s*([^\n]+?)\s*\n+\s*Action Input\s*:\s*", re.S)

    def format_help(self) -> str:
        lines = ["You have access to the following tools:"]
        for s in self.tool_specs():
            props = s["parameters"]["properties"]
            req = set(s["parameters"]["required"])
            args = ", ".join(f'"{k}" ({v["type"]}{"" if k in req else ", optional"}): {v["description"]}'
                             for k, v in props.items())
            lines.append(f"- {s['name']}: {s['description']} Input keys: {args}")
        names = ", ".join(self.tool_name(t) for t in self.v.order)
        return ("\n".join(lines) + "\n\nUse exactly this format, one action per message:\n"
                "Thought: what to do next\nAction: the tool name, one of [" + names + "]\n"
                "Action Input: the arguments as a JSON object\n"
                "Then wait for the Observation.")

    def render_call(self, a: Action, index: int = 0) -> str:
        return (f"Thought: next step.\nAction: {self.tool_name(a.tool)}\n"
                f"Action Input: {json.dumps(self._encode_args(a), ensure_ascii=False)}")

    def render_calls(self, actions):
        return self.render_call(actions[0]) if actions else ""

    def parse(self, text):
        m = self.ACTION.search(text)
        if not m:
            raise ParseError("no action found; answer with 'Action: <tool>' and "
                             "'Action Input: {json}' on the next line, e.g.\n"
                             + self.render_call(Action("finish", {})))
        name = m.group(1).strip().strip("`'\"")
        rest = text[m.end():].lstrip()
        try:
            args, end = json.JSONDecoder().raw_decode(rest)
        except json.JSONDecodeError as e:
            raise ParseError(f"Action Input of {name} is not valid JSON ({e.msg})") from None
        except (ValueError, RecursionError) as e:  # an integer past Python's digit limit, nesting past the stack
            raise ParseError(f"Action Input of {name} cannot be read ({type(e).__name__}: {e})"[:300]) from None
        # Text after an (imagined) Observation is ignored, as ReAct's stop sequence would cut it; a second
        # action before any Observation would be dropped unseen, so it is refused instead.
        after = rest[end:].split("Observation", 1)[0]
        if self.ACTION.search(after):
            raise ParseError("one action per message: this message holds more than one 'Action:'; send the first, "
                             "read its Observation, then send the next")
        return self._decode_call(name, args)

    def render_results(self, results):
        return "\n".join(f"Observation: {text}" for _, _, text in results)


_CLASSES = {"kimi": KimiDialect, "claude": ClaudeDialect, "codex": CodexDialect, "react": ReactDialect}


def make_dialect(variant: Variant) -> Dialect:
    return _CLASSES[variant.dialect](variant)
