"""A task family a small model can learn: pick the tool and the command that does the job, in any harness.

Three kinds of ordinary AgentENV task (`k3.agentenv.tasks.write_task`: checksummed, verified by physical
checks), each solved by one `run` call and `finish`: `calc` (evaluate expr.txt into answer.txt), `count` (count
the lines of data.txt holding word.txt's word) and `update` (set an item's qty in app.db from change.txt). The
facts live in workspace files, never in the instruction, so what a policy learns is tool intent, not copying.
Tasks are pure functions of `(kind, split, index)`; `train` and `heldout` draw from disjoint pools. Every task
carries its reference solution (`hidden/solution.json`), from which `demos.py` makes the warm start. The
commands, checks and why the facts are not in the instruction: docs/rl.md ("The task family").
"""
from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

from k3.agentenv.tasks import load_task, sha256_bytes, write_task

KINDS = ("calc", "count", "update")
SPLITS = ("train", "heldout")
MAX_STEPS = 4  # two calls solve every task; two more leave room to recover from a bad call

# disjoint vocabularies per split: a held-out task never reuses a training word or item
WORDS = {
    "train": ["lemon", "apple", "cherry", "grape", "melon", "peach", "plum", "mango", "olive", "pear",
              "lime", "fig", "kiwi", "date", "guava", "papaya"],
    "heldout": ["quince", "banana", "apricot", "walnut", "almond", "cashew", "hazel", "pecan"],
}
FILLER = ["red", "blue", "green", "stone", "river", "cloud", "paper", "glass", "wood", "iron",
          "salt", "sand", "wind", "rain", "snow", "leaf"]
ITEMS = {
    "train": ["bolt", "nut", "screw", "washer", "nail", "rivet", "hinge", "spring", "gear", "chain",
              "valve", "clamp", "pin", "hook", "latch", "pulley"],
    "heldout": ["bearing", "bracket", "gasket", "piston", "socket", "flange", "sprocket", "axle"],
}


def _rng(kind: str, split: str, index: int) -> random.Random:
    return random.Random(f"k3-rl-family-{kind}-{split}-{index}")


def task_id(kind: str, split: str, index: int) -> str:
    return f"rl-{kind}-{'t' if split == 'train' else 'h'}{index:04d}"


def _check_args(kind: str, split: str, index: int) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown task kind {kind!r}; choose from {', '.join(KINDS)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose from {', '.join(SPLITS)}")
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"task index {index!r} must be an integer >= 0")


def _sha(text: str) -> dict:
    return {"sha256": sha256_bytes(text.encode())}


def _number_check(value: int) -> dict:
    """answer.txt holds `value`, give or take surrounding whitespace (the instruction only says "write the
    number"): read by a Python that imports nothing from the workspace (-I -S)."""
    return {"id": "answer", "kind": "command", "label": "F2P",
            "argv": ["python3", "-I", "-S", "-c", "import sys; sys.stdout.write(open('answer.txt').read().strip())"],
            "expect": {"stdout": str(value)}}


COMMANDS = {  # one fixed command per kind: the tool reads the facts from the workspace
    "calc": "echo $(( $(cat expr.txt) )) > answer.txt",
    "count": "grep -c -f word.txt data.txt > answer.txt",
    "update": "read name qty < change.txt && sqlite3 app.db \"UPDATE items SET qty = $qty WHERE name = '$name'\"",
}
INSTRUCTIONS = {  # each ends with the file the command must read, right before the policy's turn
    "calc": "Compute the value of an arithmetic expression with the shell and write the number to answer.txt. "
            "The expression is in expr.txt.",
    "count": "Count with the shell how many lines of data.txt contain a word, and write the count to answer.txt. "
             "The word is in word.txt.",
    "update": "Apply a change to the table items of the SQLite database app.db with the sqlite3 command. "
              "The change (an item name and its new qty) is in change.txt.",
}


def _stale(task, spec: dict) -> bool:
    """A task directory written by another version of this family (any field of the spec, or the step limit)."""
    import hashlib

    files = (task.manifest.get("workspace") or {}).get("files") or {}
    want = {path: hashlib.sha256(text.encode("utf-8")).hexdigest() for path, text in spec.get("workspace", {}).items()}
    return (task.instruction != spec["instruction"] or task.solution != tuple(spec["solution"])
            or task.checks != tuple(spec["checks"]) or task.title != spec["title"] or task.family != spec["family"]
            or task.max_steps != MAX_STEPS or {p: f.get("sha256") for p, f in files.items()} != want
            or _generated(task) != spec.get("generate", {}))


def _generated(task) -> dict:
    """{file: the SQL script it is built from} of a task directory's generated workspace files."""
    out = {}
    for name, how in ((task.manifest.get("workspace") or {}).get("generate") or {}).items():
        try:
            out[name] = (Path(task.root) / how["sqlite_script"]).read_text(encoding="utf-8")
        except (OSError, KeyError, TypeError, UnicodeDecodeError):
            out[name] = None  # unreadable: stale
    return out


def task_spec(kind: str, split: str, index: int) -> dict:
    """Everything `write_task` needs for one task (a pure function of its arguments)."""
    _check_args(kind, split, index)
    rng = _rng(kind, split, index)
    tid = task_id(kind, split, index)
    solution = [{"tool": "run", "command": COMMANDS[kind]}, {"tool": "finish", "summary": "done"}]
    common = dict(id=tid, instruction=INSTRUCTIONS[kind], solution=solution)
    if kind == "calc":
        lo, hi = (12, 69) if split == "train" else (71, 99)  # disjoint operands per split
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        return dict(common, family="files", title="Evaluate expr.txt",
                    workspace={"expr.txt": f"{a} * {b}\n"}, checks=[_number_check(a * b)])
    if kind == "count":
        word = rng.choice(WORDS[split])
        n_lines = rng.randint(8, 16)
        hits = rng.randint(1, n_lines - 2)
        rows = [True] * hits + [False] * (n_lines - hits)
        rng.shuffle(rows)
        lines = []
        for has in rows:
            words = [rng.choice(FILLER) for _ in range(rng.randint(2, 4))]
            if has:
                words.insert(rng.randint(0, len(words)), word)
            lines.append(" ".join(words))
        data = "\n".join(lines) + "\n"
        return dict(common, family="files", title="Count the lines with a word",
                    workspace={"data.txt": data, "word.txt": f"{word}\n"},
                    checks=[_number_check(hits),
                            {"id": "data", "kind": "file", "label": "P2P", "path": "data.txt",
                             "expect": _sha(data)}])
    names = rng.sample(ITEMS[split], 4)
    qty = {n: rng.randint(1, 60) for n in names}
    target = rng.choice(names)
    new = rng.choice([q for q in range(1, 100) if q != qty[target]])
    script = ("CREATE TABLE items (name TEXT PRIMARY KEY, qty INTEGER NOT NULL);\n"
              + "".join(f"INSERT INTO items VALUES ('{n}', {qty[n]});\n" for n in names))
    rows = [[n, new if n == target else qty[n]] for n in sorted(names)]
    return dict(common, family="sqlite", title="Apply change.txt to app.db",
                workspace={"change.txt": f"{target} {new}\n"}, generate={"app.db": script},
                checks=[{"id": "rows", "kind": "sql", "label": "F2P", "db": "app.db",
                         "sql": "SELECT name, qty FROM items ORDER BY name", "expect": {"rows": rows}},
                        # the rows must be stored: not a view, trigger or generated column that computes them
                        {"id": "schema", "kind": "sql_schema", "label": "P2P", "db": "app.db",
                         "expect": {"tables": ["items"], "forbid": ["view", "trigger"]}}])


def build_tasks(out_dir: str | os.PathLike, split: str, n_per_kind: int, kinds=KINDS) -> list:
    """Write `n_per_kind` tasks of each kind of `split` under out_dir/<split>/ (idempotent) and load them,
    interleaved by kind (calc 0, count 0, update 0, calc 1, ...)."""
    if isinstance(n_per_kind, bool) or not isinstance(n_per_kind, int) or n_per_kind < 1:
        raise ValueError(f"n_per_kind = {n_per_kind!r} must be a positive integer")
    root = Path(out_dir) / split
    tasks = []
    for i in range(n_per_kind):
        for kind in kinds:
            spec = task_spec(kind, split, i)
            d = root / spec["id"]
            try:
                task = load_task(d)  # written earlier by the same code: reuse it (checksums checked)
            except ValueError:
                task = None
            if task is None or _stale(task, spec):
                if d.exists():  # made by another version of this family: replace it whole
                    shutil.rmtree(d)
                write_task(root, limits={"max_steps": MAX_STEPS}, **spec)
                task = load_task(d)
            tasks.append(task)
    return tasks
