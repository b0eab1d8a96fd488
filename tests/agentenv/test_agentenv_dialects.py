import json
import random
import zlib

import pytest

from k3.agentenv.actions import Action, make_action
from k3.agentenv.dialects import (DIALECTS, ParseError, choose_variant, make_dialect, make_variant,
                                  parse_patch)

ACTIONS = [
    Action("read", {"path": "src/a.py", "offset": 3, "limit": 20}),
    Action("write", {"path": "x/y.py", "content": 'print("hi")\n\tquote \' " <tag> \\n ünï\n'}),
    Action("edit", {"path": "a.py", "old": "def f(x):\n    return x\n", "new": "def f(x):\n    return x + 1\n"}),
    Action("edit", {"path": "a.py", "old": "x+1", "new": "", "replace_all": True}),
    Action("run", {"command": "python3 -m unittest -v && echo 'ok' | grep -c o", "timeout": 5.0}),
    Action("search", {"pattern": r"def \w+\(", "path": "src", "glob": "*.py"}),
    Action("finish", {"summary": "done"}),
]


def _variants():
    out = [make_variant(d) for d in DIALECTS]
    out += [choose_variant(seed) for seed in range(40)]
    return out


@pytest.mark.parametrize("variant", _variants(), ids=lambda v: f"{v.dialect}-{zlib.crc32(json.dumps(v.to_json(), sort_keys=True).encode()) % 1000}")
def test_render_parse_roundtrip(variant):
    d = make_dialect(variant)
    for a in ACTIONS:
        text = "Some thinking first.\n" + d.render_call(a)
        got = d.parse(text)
        if d.name == "codex" and a.args.get("replace_all"):  # no patch form; a shell one-liner
            assert got[0].tool == "run" and "replace(" in got[0].args["command"]
            continue
        assert got == [a], (d.name, text)
    if d.name != "react":  # several calls in one message
        assert d.parse(d.render_calls(ACTIONS[:3])) == ACTIONS[:3]
    prompt = d.system_prompt()
    for tool in variant.order:
        assert variant.tools[tool][0] in prompt


def test_variants_are_seeded_and_diverse():
    assert choose_variant(7).to_json() == choose_variant(7).to_json()
    vs = [choose_variant(s) for s in range(200)]
    assert {v.dialect for v in vs} == set(DIALECTS)
    names = {v.tools["read"][0] for v in vs}
    args = {v.tools["read"][1]["path"] for v in vs}
    assert len(names) >= 8 and len(args) >= 4
    assert len({tuple(v.order) for v in vs}) > 10
    canon = choose_variant(3, augment=False)
    assert canon.tools == make_variant(canon.dialect).tools


def test_malformed_calls_raise_parse_error_only():
    rng = random.Random(0)
    for seed in range(12):
        d = make_dialect(choose_variant(seed))
        samples = ["", "hello", "{}", "Action: nope", "<invoke name=\"x\">", "to=functions.x <|message|>{",
                   d.render_call(ACTIONS[0]).replace("src/a.py", "src/a.py\"\"\"")]
        for a in ACTIONS:
            full = d.render_call(a)
            samples += [full[: rng.randrange(len(full))] for _ in range(15)]
            samples.append(full.replace("{", "[", 1))
        for text in samples:
            try:
                out = d.parse(text)
            except ParseError as e:
                assert str(e)
            else:
                assert all(isinstance(x, Action) for x in out)


def test_hostile_arguments_raise_parse_error_only():
    """NaN or negative timeouts, integers past Python's digit limit, nesting past the stack, non-ASCII digits:
    each a ParseError naming the problem, never another exception out of parse()."""
    for variant in [make_variant(d) for d in DIALECTS]:  # each dialect's own spelling of a 5 s timeout
        d = make_dialect(variant)
        good = d.render_call(Action("run", {"command": "ls", "timeout": 5.0}))
        spelled = next(t for t in ("5.0", "5000") if t in good)
        for bad in ("NaN", "-1", "1" + "0" * 5000):
            with pytest.raises(ParseError):
                d.parse(good.replace(spelled, bad))
    with pytest.raises(ValueError, match="positive number"):
        make_action("run", {"command": "ls", "timeout": float("nan")})
    with pytest.raises(ValueError, match="positive number"):
        make_action("run", {"command": "ls", "timeout": 10**400})
    with pytest.raises(ValueError, match="must be a int"):
        make_action("read", {"path": "a", "offset": "\u00b2"})
    k = make_dialect(make_variant("kimi"))
    for body in ('{"command": "ls", "timeout": 1' + "0" * 5000 + "}", "[" * 50000 + "]" * 50000):
        with pytest.raises(ParseError, match="cannot be read|must be"):
            k.parse("<|tool_calls_section_begin|><|tool_call_begin|>functions.Shell:0"
                    "<|tool_call_argument_begin|>" + body + "<|tool_call_end|>")


def test_argument_errors_name_the_problem():
    d = make_dialect(make_variant("claude"))
    with pytest.raises(ParseError, match="unknown tool 'Delete'"):
        d.parse('<function_calls><invoke name="Delete"></invoke></function_calls>')
    with pytest.raises(ParseError, match="missing required argument 'file_path'"):
        d.parse('<function_calls><invoke name="Read"></invoke></function_calls>')
    with pytest.raises(ParseError, match="no argument"):
        d.parse('<function_calls><invoke name="Read"><parameter name="paht">a</parameter></invoke></function_calls>')
    k = make_dialect(make_variant("kimi"))
    with pytest.raises(ParseError, match="not valid JSON"):
        k.parse("<|tool_calls_section_begin|><|tool_call_begin|>functions.ReadFile:0"
                "<|tool_call_argument_begin|>{path: 1}<|tool_call_end|>")
    with pytest.raises(ParseError, match="must be a str"):
        k.parse("<|tool_calls_section_begin|><|tool_call_begin|>functions.ReadFile:0"
                "<|tool_call_argument_begin|>{\"path\": 3}<|tool_call_end|>")
    r = make_dialect(make_variant("react"))
    assert r.parse("Thought: x\nAction: run\nAction Input: {\"command\": \"ls\"}\nObservation: fake") == \
        [Action("run", {"command": "ls"})]
    assert r.parse("Action: run\nAction Input: {\"command\": \"ls\"}\nObservation: fake\n"  # after an Observation:
                   "Action: finish\nAction Input: {}") == [Action("run", {"command": "ls"})]  # imagined, ignored
    with pytest.raises(ParseError, match="one action per message"):  # would be dropped unseen
        r.parse("Action: run\nAction Input: {\"command\": \"ls\"}\nAction: finish\nAction Input: {}")
    c = make_dialect(make_variant("codex"))
    assert c.parse('to=functions.shell <|constrain|>json<|message|>{"command": ["ls", "-la", "my dir"], '
                   '"timeout_ms": 1500}<|call|>') == [Action("run", {"command": "ls -la 'my dir'", "timeout": 1.5})]
    assert c.parse('<|start|>assistant to=functions.shell<|channel|>commentary <|constrain|>json<|message|>'
                   '{"command": ["ls"]}<|call|>') == [Action("run", {"command": "ls"})]  # recipient in the role header
    # milliseconds as a string are milliseconds too; a bad one is refused in the dialect's own unit
    assert c.parse('to=functions.shell <|constrain|>json<|message|>{"command": ["ls"], "timeout_ms": "500"}'
                   '<|call|>') == [Action("run", {"command": "ls", "timeout": 0.5})]
    with pytest.raises(ParseError, match="'timeout_ms' of shell must be a positive number of milliseconds, got -5000"):
        c.parse('to=functions.shell <|constrain|>json<|message|>{"command": ["ls"], "timeout_ms": -5000}<|call|>')
    with pytest.raises(ParseError, match="must be >= 1"):  # a line count below 1 is not silently some lines
        k.parse("<|tool_calls_section_begin|><|tool_call_begin|>functions.ReadFile:0"
                "<|tool_call_argument_begin|>{\"path\": \"a\", \"n_lines\": -1}<|tool_call_end|>")


def test_apply_patch():
    acts = parse_patch("*** Begin Patch\n*** Add File: n.txt\n+a\n+b\n*** Update File: m.py\n@@ def f\n"
                       " def f():\n-    return 1\n+    return 2\n@@\n-x = 1\n+x = 3\n"
                       "*** Delete File: old.txt\n*** End Patch")
    assert acts == [make_action("write", {"path": "n.txt", "content": "a\nb\n"}),
                    make_action("edit", {"path": "m.py", "old": "def f():\n    return 1",
                                         "new": "def f():\n    return 2"}),
                    make_action("edit", {"path": "m.py", "old": "x = 1", "new": "x = 3"}),
                    make_action("run", {"command": "rm -- old.txt"})]
    for bad in ("no patch", "*** Begin Patch\n*** Add File: a\nnoplus\n*** End Patch",
                "*** Begin Patch\n*** Update File: a\n*** End Patch", "*** Begin Patch\n*** Add File: a\n+x",
                "*** Begin Patch\n*** Frobnicate: a\n*** End Patch"):
        with pytest.raises(ParseError):
            parse_patch(bad)


def test_results_answer_to_the_call_the_policy_made():
    """Kimi numbers calls across a conversation: a result names the id the policy gave its call. A codex
    apply_patch that deletes a file runs as a shell command, but its result is the patch tool's."""
    k = make_dialect(make_variant("kimi"))
    (a,) = k.parse("<|tool_calls_section_begin|><|tool_call_begin|>functions.Shell:5<|tool_call_argument_begin|>"
                   '{"command": "ls"}<|tool_call_end|><|tool_calls_section_end|>')
    assert a == Action("run", {"command": "ls"}) and a.call == "functions.Shell:5"
    assert k.render_results([(a, True, "x")]).startswith("## Return of functions.Shell:5\n")
    c = make_dialect(make_variant("codex"))
    (d,) = c.parse('to=functions.apply_patch <|constrain|>json<|message|>{"input": "*** Begin Patch\\n'
                   '*** Delete File: old.txt\\n*** End Patch"}<|call|>')
    assert d.tool == "run" and d.call == "apply_patch"
    assert c.render_results([(d, True, "")]).startswith("<|start|>functions.apply_patch to=assistant")


AWKWARD = [  # text a dialect's markup cannot carry as is
    Action("write", {"path": "d/no_newline.txt", "content": "abc"}),
    Action("write", {"path": "empty.txt", "content": ""}),
    Action("write", {"path": "tags.txt", "content": "a</parameter>b</invoke>\n"}),
    Action("write", {"path": "patch.txt", "content": "x\n*** End Patch\ny\n"}),
    Action("edit", {"path": "base.txt", "old": "one", "new": "</parameter>\n*** End Patch"}),
    Action("run", {"command": "printf '%s' '</invoke>' > run.txt", "timeout": 20.0}),
    Action("write", {"path": "markers.txt", "content": "a<|tool_call_end|>b<|call|>c<|end|>\n"}),
    Action("write", {"path": " spaced.txt ", "content": "x\n"}),  # a patch header lost the spaces (codex)
]


@pytest.mark.parametrize("dialect", DIALECTS)
def test_every_dialect_carries_awkward_text_byte_for_byte(dialect, tmp_path):
    """The same actions must leave the same bytes under every dialect: Codex added a newline to a file written
    without one (a task scored 1 under codex and 0 elsewhere) and cut content at '*** End Patch'; Claude cut a
    parameter at '</parameter>'. Such calls become a shell command; both forms are run here and compared."""
    import subprocess

    d = make_dialect(make_variant(dialect))

    def apply(action, root):
        if action.tool == "write":
            (root / action.args["path"]).parent.mkdir(parents=True, exist_ok=True)
            (root / action.args["path"]).write_bytes(action.args["content"].encode())
        elif action.tool == "edit":
            p = root / action.args["path"]
            p.write_text(p.read_text().replace(action.args["old"], action.args["new"], 1))
        else:
            subprocess.run(["bash", "-c", action.args["command"]], cwd=root, check=True, timeout=30)

    for i, a in enumerate(AWKWARD):
        want, got = tmp_path / f"want{i}", tmp_path / f"got{i}"
        for root in (want, got):
            root.mkdir()
            (root / "base.txt").write_text("zero one two\n")
        apply(a, want)
        parsed = d.parse(d.render_call(a))
        assert len(parsed) == 1 and parsed[0].tool in (a.tool, "run"), (dialect, a, parsed)
        assert parsed[0].args.get("timeout") == a.args.get("timeout")  # a run keeps its timeout
        apply(parsed[0], got)
        for f in want.rglob("*"):
            if f.is_file():
                assert (got / f.relative_to(want)).read_bytes() == f.read_bytes(), (dialect, a, f.name)
