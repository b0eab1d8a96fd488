"""The imports between k3's subpackages point down only: no cycle, and the declared layer order holds.

Every `import k3.x` and `from k3.x import ...` counts, at module level or inside a function (a lazy import
is still a dependency). A subpackage (k3/model/) or a top-level module (k3/config.py) is one node;
k3/__init__.py and k3/cli.py are the top and may import anything.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "k3"
TOP = {"__init__", "cli"}  # k3/__init__.py, k3/cli.py

# Each layer may import only from the layers before it (and from itself). A node missing here fails the test:
# a new part declares where it sits.
LAYERS = [
    {"fileio"},
    {"config", "cli_checks", "benchtools"},
    {"ops"},
    {"model"},
    {"data"},
    {"train"},
    {"parallel", "quant", "io", "serve"},
    {"plan", "ablate", "distill", "agentenv", "rl"},
]
# Imports allowed across one layer (siblings): importer -> importees.
SIBLINGS = {
    "io": {"parallel", "quant"},  # k3.load reads distributed (DCP) and packed-MX checkpoints; k3 export packs
    "serve": {"io"},  # the server loads any checkpoint k3.load reads
    "distill": {"agentenv"},  # MOPD's tool-use domain runs the agent environment
    "rl": {"agentenv", "distill"},  # GRPO over agentenv tasks, with distill's losses
}


def _node(module: str) -> str | None:
    """'k3.model.moe' -> 'model'; 'k3.config' -> 'config'; 'k3' -> None (the package itself)."""
    parts = module.split(".")
    if parts[0] != "k3" or len(parts) == 1:
        return None
    return parts[1]


def _imports(path: Path, package: str) -> list[tuple[str, int, str]]:
    """(imported k3 module, line number, source line) for each k3 import in a file, relative ones resolved."""
    text = path.read_text()
    lines = text.splitlines()
    found = []
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from k3 import config` imports k3.config
            names = [f"{module}.{a.name}" for a in node.names] if module == "k3" else [module]
        else:
            continue
        for name in names:
            if name == "k3" or name.startswith("k3."):
                found.append((name, node.lineno, lines[node.lineno - 1].strip()))
    return found


def import_graph() -> dict[tuple[str, str], list[str]]:
    """(importer node, imported node) -> ['k3/model/mla.py:12: from k3.quant.fake import ...', ...]."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC.parent)
        parts = list(rel.with_suffix("").parts)  # ['k3', 'model', 'mla']
        if len(parts) == 2 and parts[1] in TOP:
            continue
        src = parts[1]
        package = ".".join(parts[:-1])  # what a relative import is relative to (k3/model/__init__.py: k3.model)
        for module, lineno, line in _imports(path, package):
            dst = _node(module)
            if dst is None or dst == src:
                continue
            edges[(src, dst)].append(f"{rel.as_posix()}:{lineno}: {line}")
    return edges


def _cycles(edges) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    graph = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
        graph[b]
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _describe(edges, pairs) -> str:
    return "\n".join(f"  {a} -> {b}:\n" + "\n".join(f"    {w}" for w in edges[(a, b)]) for a, b in sorted(pairs))


def test_no_import_cycle_between_subpackages():
    edges = import_graph()
    report = []
    for comp in _cycles(edges):
        inside = [(a, b) for (a, b) in edges if a in comp and b in comp]
        report.append(f"cycle {{{', '.join(comp)}}}:\n" + _describe(edges, inside))
    assert not report, "import cycles between subpackages:\n" + "\n".join(report)


def test_imports_follow_the_layer_order():
    edges = import_graph()
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    nodes = {a for a, _ in edges} | {b for _, b in edges}
    missing = sorted(nodes - layer.keys())
    assert not missing, f"parts with no declared layer in tests/test_layering.py: {missing}"
    upward = [(a, b) for (a, b) in edges
              if layer[b] > layer[a] or (layer[b] == layer[a] and b not in SIBLINGS.get(a, ()))]
    assert not upward, "imports that point up (or sideways without a declared reason):\n" + _describe(edges, upward)


def test_model_imports_nothing_above_it():
    edges = import_graph()
    bad = [(a, b) for (a, b) in edges if a in ("ops", "model") and b in
           ("train", "serve", "quant", "io", "parallel", "data", "distill", "rl", "agentenv", "plan", "ablate")]
    assert not bad, _describe(edges, bad)


def test_the_walk_sees_lazy_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from k3.serve.sampling import x\n    import k3.quant.fake\n")
    assert [m for m, _, _ in _imports(f, "k3.model")] == ["k3.serve.sampling", "k3.quant.fake"]
    g = tmp_path / "n.py"
    g.write_text("from . import fake\nfrom ..ops import mx\nfrom k3 import config\n")
    assert [m for m, _, _ in _imports(g, "k3.quant")] == ["k3.quant", "k3.ops", "k3.config"]
