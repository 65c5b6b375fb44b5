"""The package has no import cycle, lazy imports included (a function-level import hides a cycle
from Python but not from a reader: ``verify`` → ``bench_pp`` → ``bench_layout`` → ``verify`` was
one, before they moved to ``tools/``). Static: every ``import`` and ``from … import`` inside
``src/shardwise``, at any depth of the file, is an edge to the module it names (the submodule
when ``from pkg import sub`` names one); the test fails on any strongly connected component of
more than one module, or a module that imports itself, and names the edges that close it."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "shardwise"


def modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted module name → (file, is a package's ``__init__``)."""
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module → the package modules it imports anywhere in its file."""
    mods = modules(root)
    top = root.name
    graph = {m: set() for m in mods}
    for m, (f, is_pkg) in mods.items():
        here = m.split(".") if is_pkg else m.split(".")[:-1]
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                graph[m] |= {a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[:len(here) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.split(".")[0] != top:
                    continue
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    graph[m].add(sub if sub in mods else target)
        graph[m] &= set(mods)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node, or with a self-edge (Tarjan)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checker_finds_a_planted_cycle(tmp_path):
    pkg = tmp_path / "shardwise"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .sub.c import g\n")  # lazy, still an edge
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("import shardwise.a\n")
    (pkg / "d.py").write_text("from .a import x\nfrom .sub import c\n")  # outside the cycle
    assert cycles(import_graph(pkg)) == [["shardwise.a", "shardwise.b", "shardwise.sub.c"]]


def test_the_package_has_no_import_cycle():
    graph = import_graph(SRC)
    assert len(graph) > 50  # it read the package
    found = cycles(graph)
    detail = [f"{m} → {sorted(graph[m] & set(c))}" for c in found for m in c]
    assert not found, "import cycles:\n" + "\n".join(detail)


# The layers, top first (docs/architecture.md): a module may import its own layer or one below,
# never one above; a layer is the first name under ``shardwise`` (a folder or a top-level module).
LAYERS = [
    {"cli", "__main__"},
    {"tools"},
    {"train"},
    {"config"},
    {"checkpoint", "report", "plan", "viz", "interop", "learn", "parity", "parity_muon", "formulas", "flops"},
    {"parallel"},
    {"models", "data", "launch"},
    {"comm", "topology"},
    {"errors", "readers", "lazy", "precision"},
]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``"a → b"`` for every edge from a module to a module of a higher layer (:data:`LAYERS`);
    the package's own ``__init__`` is above every layer. A module in no layer is reported too
    (``"a: in no layer"``), so a new folder has to be placed."""
    rank = {name: i for i, layer in enumerate(LAYERS) for name in layer}

    def layer(m):
        parts = m.split(".")
        return -1 if len(parts) == 1 else rank.get(parts[1])

    out = [f"{m}: in no layer" for m in sorted(graph) if layer(m) is None]
    for m in sorted(graph):
        for t in sorted(graph[m]):
            if None not in (layer(m), layer(t)) and layer(t) < layer(m):
                out.append(f"{m} → {t}")
    return out


def test_the_checker_finds_a_planted_upward_import(tmp_path):
    pkg = tmp_path / "shardwise"
    for sub in ("plan", "train", "comm"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "train" / "loop.py").write_text("from ..plan import cost\nfrom ..comm import ops\n")
    (pkg / "plan" / "cost.py").write_text("from ..comm import ops\n")
    (pkg / "comm" / "ops.py").write_text("def f():\n    from ..plan.cost import g\n")  # lazy
    assert upward_imports(import_graph(pkg)) == ["shardwise.comm.ops → shardwise.plan.cost"]


def test_no_import_runs_up_the_layers():
    graph = import_graph(SRC)
    assert len(graph) > 50  # it read the package
    found = upward_imports(graph)
    assert not found, "imports that run up the layers (docs/architecture.md):\n" + \
        "\n".join(found)
