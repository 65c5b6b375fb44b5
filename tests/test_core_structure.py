"""The structure rules of ``parallel/`` (issue 33, design/one-engine.md), checked statically.

* strategy folders (dp, zero, tp, pp, cp, ep) never import each other — what two strategies
  share lives in ``params``, ``layout`` or ``comm``; :data:`PENDING` (edges still allowed) is
  empty since the pipeline became a runner (``parallelize`` composes its stage);
* the engines (``nn.Module`` classes that define the step's ``forward_backward``, and their
  subclasses at any depth) are the ones listed in :data:`ENGINES`: exactly ``ParallelModel``
  and ``Local`` (the gradient syncs are plain objects, the pipelines runners; the test fails
  on a new engine);
* no class declares the norm's axes (``def norm_axes`` only in ``params.py``, where
  :meth:`~shardwise.parallel.params.Held.norm_axes` derives them from the held gradients);
* the reduce dtype table ``REDUCE_DTYPES`` is assigned in exactly one module;
* no class registry: no ``__new__`` / ``__init_subclass__`` in ``parallel/`` (ZeRO-3 is built
  by a call the reader can follow, :func:`shardwise.parallel.zero.zero_sync`);
* the loss is defined at most :data:`MAX_LOSSES` times in at most :data:`MAX_LOSS_FILES` files
  (:func:`loss_definitions`: a loss function's class, or a module-level loss-sum function; the
  engines only delegate to their ``loss_fn``). 19 in 11 files at cc2136c (design/one-engine.md);
* EP and HSDP are data on the parameter: at most :data:`MAX_BRANCH_SITES` branch sites each in
  the strategy folders dp, zero, tp, pp, cp (:func:`branch_sites` defines a site);
* a reader opens at most :data:`READ_BOUNDS` files of ``parallel/`` from ``parallelize()`` to
  see PP 1F1B, ZeRO-3 or TP whole (the issue's targets; measured by running the layout:
  tests/workers/reading_cases.py).

Each static checker is also run on a planted violation (a fake package in ``tmp_path``) and must
fail.
"""

import ast
import re
from pathlib import Path

import pytest

from conftest import run_world

SRC = Path(__file__).resolve().parents[1] / "src" / "shardwise"
STRATEGIES = ("dp", "zero", "tp", "pp", "cp", "ep")
# (importing folder, imported folder) edges still there, to be removed by the pipeline runner
PENDING: set = set()
# engine classes: the two to keep, then those pending (gradient syncs, the pipeline engines)
ENGINES = {"model.py:ParallelModel", "model.py:Local"}
MAX_LOSSES, MAX_LOSS_FILES = 6, 4  # issue 33's targets
LOSS_MEMBERS = ("loss_sum", "loss_sum_and_count", "loss")
# files of parallel/ a reader opens from parallelize() to see the layout whole (issue 33)
READ_BOUNDS = {"pp_1f1b": 8, "zero3": 9, "tp": 9}
MAX_BRANCH_SITES = 3  # per dimension (EP, HSDP), issue 33's target


def _imported_modules(f: Path, pkg_root: Path) -> list[tuple[str, int]]:
    """Dotted modules (from the package's root name) that ``f`` imports anywhere, with lines."""
    parts = list(f.relative_to(pkg_root.parent).with_suffix("").parts)
    here = parts[:-1]  # the package the file is in (an __init__ is in its own package)
    out = []
    for node in ast.walk(ast.parse(f.read_text(), str(f))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out += [(f"{target}.{a.name}", node.lineno) for a in node.names]
    return out


def strategy_edges(pkg_root: Path) -> dict[tuple[str, str], list[str]]:
    """{(folder, other folder): ["file:line", ...]} for every import between strategy folders
    of ``pkg_root``/parallel (relative or absolute, at any depth of the file)."""
    par = pkg_root / "parallel"
    prefix = f"{pkg_root.name}.parallel."
    edges: dict = {}
    for f in sorted(par.rglob("*.py")):
        rel = f.relative_to(par).parts
        if len(rel) < 2 or rel[0] not in STRATEGIES:
            continue
        for mod, line in _imported_modules(f, pkg_root):
            if not mod.startswith(prefix):
                continue
            other = mod[len(prefix):].split(".")[0]
            if other in STRATEGIES and other != rel[0]:
                edges.setdefault((rel[0], other), []).append(f"{f.relative_to(par)}:{line}")
    return edges


def definitions(pkg_root: Path, names, *, outside: str = "") -> list[str]:
    """Every ``def`` of one of ``names`` in ``parallel/`` (except in the file ``outside``)."""
    par = pkg_root / "parallel"
    return [f"{f.relative_to(par)}:{n.lineno}" for f in sorted(par.rglob("*.py"))
            if str(f.relative_to(par)) != outside
            for n in ast.walk(ast.parse(f.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name in names]


def engine_classes(pkg_root: Path) -> set[str]:
    """{"file:Class"} of every class in ``parallel/`` that is an engine: an ``nn.Module``
    subclass defining ``forward_backward`` (the step's entry), or a class derived from one
    through other classes of ``parallel/`` (bases matched by name)."""
    par = pkg_root / "parallel"
    bases = {}
    engines = set()
    for f in sorted(par.rglob("*.py")):
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, ast.ClassDef):
                names = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")
                         for b in n.bases]
                bases[n.name] = (names, str(f.relative_to(par)))
                if "Module" in names and any(isinstance(m, ast.FunctionDef)
                                             and m.name == "forward_backward" for m in n.body):
                    engines.add(n.name)
    grew = True
    while grew:
        new = {c for c, (names, _) in bases.items()
               if c not in engines and any(b in engines for b in names)}
        engines |= new
        grew = bool(new)
    return {f"{bases[c][1]}:{c}" for c in engines}


def loss_definitions(pkg_root: Path) -> list[str]:
    """"file:name" of every loss definition in ``parallel/``: a class that defines one of
    :data:`LOSS_MEMBERS` or whose name ends in ``Loss`` (the engines excluded: they delegate to
    their ``loss_fn``), and every module-level function whose name contains ``loss_sum``."""
    par = pkg_root / "parallel"
    engines = {e.split(":")[1] for e in engine_classes(pkg_root)}
    out = []
    for f in sorted(par.rglob("*.py")):
        for n in ast.parse(f.read_text()).body:
            if isinstance(n, ast.ClassDef) and n.name not in engines and (
                    n.name.endswith("Loss") or any(isinstance(m, ast.FunctionDef)
                                                   and m.name in LOSS_MEMBERS for m in n.body)):
                out.append(f"{f.relative_to(par)}:{n.name}")
            elif isinstance(n, ast.FunctionDef) and "loss_sum" in n.name:
                out.append(f"{f.relative_to(par)}:{n.name}")
    return out


def norm_axes_declarations(pkg_root: Path) -> list[str]:
    """Every ``def norm_axes`` in ``parallel/`` outside ``params.py``."""
    return definitions(pkg_root, ("norm_axes",), outside="params.py")


def assignments(pkg_root: Path, name: str) -> list[str]:
    """Modules of ``pkg_root`` that assign ``name`` at module level."""
    out = []
    for f in sorted(pkg_root.rglob("*.py")):
        for n in ast.parse(f.read_text()).body:
            targets = (n.targets if isinstance(n, ast.Assign)
                       else [n.target] if isinstance(n, ast.AnnAssign) else [])
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                out.append(str(f.relative_to(pkg_root)))
    return out


def _names_ep(word: str) -> bool:
    low = word.lower()
    return bool(set(re.split(r"[_.:\s]+", low)) & {"ep", "edp"}) or "expert" in low \
        or "moe" in low


def _names_hsdp(word: str) -> bool:
    low = word.lower()
    if low in ("replicate_axis", "is_replicate"):  # the record's field; DTensor's Replicate
        return False
    return any(w in low for w in ("hsdp", "dp_replicate", "dp_shard")) \
        or "replicate" in re.split(r"[_.:\s]+", low)


def branch_sites(pkg_root: Path) -> dict[str, list[str]]:
    """{"EP": [...], "HSDP": [...]} of "file:line" for every branch site in the strategy folders
    dp, zero, tp, pp, cp of ``pkg_root``/parallel (ep/ is EP's own code; HSDP's own code is
    ``topology.py``, ``layout.py`` and ``params.reduce_groups``, outside the folders).

    A *decision* is the test of an ``if``/``elif``/``while``, of a conditional expression or of
    a comprehension's ``if``, or a comparison or ``and``/``or`` expression elsewhere (a flag
    such as ``hsdp = topo.dp_replicate > 1``). It is an EP site if it names expert parallelism
    or a mixture of experts — an identifier, attribute or string whose lower-case parts (split
    at ``_ . :``) include "ep" or "edp", or that contains "expert" or "moe" — and an HSDP site
    if it names HSDP: "hsdp", "dp_replicate", "dp_shard", or a part "replicate". Not a site: a
    decision on the parameter record's generic ``replicate_axis`` / ``grad_axis``
    (``params.Placement``, ``ReduceGroup``, ``FlatShards``), which is how a sync reads EP and
    HSDP as data, and DTensor's ``is_replicate()`` (a tp placement)."""
    par = pkg_root / "parallel"
    out: dict[str, list[str]] = {"EP": [], "HSDP": []}
    for f in sorted(par.rglob("*.py")):
        rel = f.relative_to(par)
        if len(rel.parts) < 2 or rel.parts[0] not in ("dp", "zero", "tp", "pp", "cp"):
            continue
        tree = ast.parse(f.read_text())
        tests = [t for n in ast.walk(tree) for t in (
            [n.test] if isinstance(n, (ast.If, ast.While, ast.IfExp))
            else n.ifs if isinstance(n, ast.comprehension) else [])]
        inside = {id(x) for t in tests for x in ast.walk(t)}
        for n in ast.walk(tree):
            if isinstance(n, (ast.Compare, ast.BoolOp)) and id(n) not in inside:
                tests.append(n)
                inside |= {id(x) for x in ast.walk(n)}
        for t in tests:
            words = [n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute)
                     else n.value for n in ast.walk(t)
                     if isinstance(n, (ast.Name, ast.Attribute))
                     or (isinstance(n, ast.Constant) and isinstance(n.value, str))]
            for kind, names in (("EP", _names_ep), ("HSDP", _names_hsdp)):
                if any(names(w) for w in words):
                    out[kind].append(f"{rel}:{t.lineno}")
    return {k: sorted(v) for k, v in out.items()}


def test_strategy_folders_do_not_import_each_other():
    edges = strategy_edges(SRC)
    new = {e: w for e, w in edges.items() if e not in PENDING}
    assert not new, f"imports between strategy folders: {new}"
    gone = PENDING - set(edges)
    assert not gone, f"{sorted(gone)} no longer imported: remove them from PENDING"


def test_engine_classes_only_shrink():
    found = engine_classes(SRC)
    assert not found - ENGINES, f"new engine classes: {sorted(found - ENGINES)}"
    assert not ENGINES - found, f"{sorted(ENGINES - found)} are gone: remove them from ENGINES"


def test_no_class_declares_the_norm_axes():
    assert norm_axes_declarations(SRC) == []


def test_no_class_registry():
    assert definitions(SRC, ("__new__", "__init_subclass__")) == []


def test_the_loss_is_defined_in_few_places():
    found = loss_definitions(SRC)
    files = {d.split(":")[0] for d in found}
    assert len(found) <= MAX_LOSSES and len(files) <= MAX_LOSS_FILES, found


def test_the_reduce_dtype_table_is_written_once():
    assert assignments(SRC, "REDUCE_DTYPES") == ["parallel/params.py"]


def test_ep_and_hsdp_are_data_on_the_parameter():
    # today: EP pp/split.py:99-100 (the torch pipeline's MoE refusal), zero/formulas.py (the
    # expert term of ZeRO's byte formula); HSDP none (the syncs read ReduceGroup.replicate_axis)
    sites = branch_sites(SRC)
    for kind, where in sites.items():
        assert len(where) <= MAX_BRANCH_SITES, f"{kind} branch sites: {where}"


def test_planted_violations_fail(tmp_path):
    pkg = tmp_path / "shardwise"
    for d in ("parallel/zero", "parallel/dp", "parallel/tp"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "parallel" / "__init__.py").write_text("")
    (pkg / "parallel" / "params.py").write_text(
        "REDUCE_DTYPES = {}\nclass Held:\n    def norm_axes(self):\n        return ()\n")
    (pkg / "parallel" / "zero" / "a.py").write_text(
        "def f():\n    from ..dp import GradBuckets\n"  # lazy, still an edge
        "import shardwise.parallel.tp.dtensor\nfrom ..params import Held\n")
    (pkg / "parallel" / "tp" / "b.py").write_text(
        "REDUCE_DTYPES = {}\nclass E:\n    def norm_axes(self):\n        return ('tp',)\n"
        "    def __new__(cls):\n        return super().__new__(cls)\n"
        "class T(nn.Module):\n    def forward_backward(self):\n        pass\n"
        "class U(T):\n    pass\nclass R:\n    def forward_backward(self):\n        pass\n")
    assert set(strategy_edges(pkg)) == {("zero", "dp"), ("zero", "tp")}
    assert norm_axes_declarations(pkg) == ["tp/b.py:3"]
    assert definitions(pkg, ("__new__", "__init_subclass__")) == ["tp/b.py:5"]
    assert assignments(pkg, "REDUCE_DTYPES") == ["parallel/params.py", "parallel/tp/b.py"]
    assert engine_classes(pkg) == {"tp/b.py:T", "tp/b.py:U"}
    (pkg / "parallel" / "tp" / "c.py").write_text(
        "class StageLoss:\n    pass\nclass V:\n    def loss_sum_and_count(self):\n        pass\n"
        "def loss_sum(out, mb):\n    pass\n")
    assert loss_definitions(pkg) == ["tp/c.py:StageLoss", "tp/c.py:V", "tp/c.py:loss_sum"]
    (pkg / "parallel" / "dp" / "c.py").write_text(
        "def f(topo, u, g):\n"
        "    if topo.size('ep') > 1:\n        pass\n"                      # EP, line 2
        "    hsdp = getattr(topo, 'dp_replicate', 1) > 1\n"                 # HSDP, line 4
        "    x = [p for p in u if is_moe(p)]\n"                             # EP, line 5
        "    y = 'a' if u.axis == 'dp_shard' else 'b'\n"                    # HSDP, line 6
        "    if g.replicate_axis is not None and g.grad_axis:\n        pass\n"  # the record
        "    return 'edp' if g.axis == topo.shard_axis else x\n")          # not in the test
    assert branch_sites(pkg) == {"EP": ["dp/c.py:2", "dp/c.py:5"],
                                 "HSDP": ["dp/c.py:4", "dp/c.py:6"]}


@pytest.mark.timeout(300)
def test_a_reader_opens_few_files_to_see_a_layout_whole(tmp_path):
    """Each layout of :data:`READ_BOUNDS` built and stepped on 2 ranks: the ``parallel/`` files
    whose functions ran from ``parallelize()`` or the engine (the layout's refusals aside),
    over both ranks, are at most the bound."""
    run_world(Path(__file__).parent / "workers" / "reading_cases.py", tmp_path, nproc=2)
    for case, bound in READ_BOUNDS.items():
        ranks = sorted(tmp_path.glob(f"{case}_rank*.txt"))
        assert len(ranks) == 2, ranks
        files = set().union(*(set(r.read_text().split()) for r in ranks))
        assert "apply.py" in files and "model.py" in files, files  # the measure sees the path
        assert len(files) <= bound, f"{case}: {len(files)} files > {bound}: {sorted(files)}"
