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
* a reader opens exactly the files :data:`READ_ROUTES` names of ``parallel/`` from
  ``parallelize()`` to see PP 1F1B, ZeRO-3 or TP whole (measured by running the layout:
  tests/workers/reading_cases.py): a file joining a route is a decision written here.

Issue 52's targets (each checker tested on a planted violation and a planted clean package,
and asserted on the real tree):

* ``parallelize`` (``parallel/apply.py``) is at most :data:`MAX_PARALLELIZE_LINES` lines with at
  most :data:`MAX_PARALLELIZE_BRANCHES` conditionals (:func:`function_shape`: every ``if`` /
  ``elif`` statement, conditional expression and ``match`` case inside it, nested functions
  included; loops, comprehension filters and ``and``/``or`` are not counted);
* no meta-device branch in ``_pipeline``: no variable or parameter named ``meta`` or
  ``weights`` inside it (:func:`meta_names`: the full weights of a meta-device build are
  filled once by the sync after ``parallelize`` builds it, not tested in the pipeline);
* no strategy folder imports ``parallel/model.py`` (:func:`model_imports`: strategies import
  the protocols, ``sync.py`` and ``loss.py``);
* no parameter in ``parallel/`` named ``reduce_dtype``, and at most :data:`MAX_DTYPE_STRINGS`
  parameters annotated ``str`` whose name contains ``dtype`` (:func:`dtype_parameters`; 40 in
  16 files at fb12019): the precision travels as one record.

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
# files of parallel/ a reader opens from parallelize() to see the layout whole. Issue 33 bounded
# them at 8, 9, 9 files; issue 52 split the core by job: every route now crosses the same six
# core files — apply.py (the steps), engines.py (each engine's constructors), model.py (the
# engine), loss.py (the loss protocol), sync.py (the sync protocol), params.py — plus
# materialize.py (Values: where the parameters' values come from, decided once) and, at pp = 1,
# runner.py (the micro-batch loop, once inside model.py); the pipeline's schedules are split
# into the data model, the dispatcher and the loop placement's generators (the V ones unread).
# TP reads its options from the layout (``Layout.tp_options``, issue 52's TPOptions: one
# argument to tp/), so layout.py joins the tp route: 14 files there, 13 elsewhere
CORE_ROUTE = {"apply.py", "engines.py", "loss.py", "materialize.py", "model.py", "params.py",
              "sync.py"}
READ_ROUTES = {
    "pp_1f1b": CORE_ROUTE | {"pp/comms.py", "pp/loop_schedules.py", "pp/runner.py",
                             "pp/schedule_data.py", "pp/schedules.py", "pp/split.py"},
    "zero3": CORE_ROUTE | {"runner.py", "zero/__init__.py", "zero/flat.py", "zero/units.py",
                           "zero/zero.py", "zero/zero3.py"},
    "tp": CORE_ROUTE | {"layout.py", "runner.py", "numerics.py", "tp/apply.py", "tp/comms.py",
                        "tp/layers.py", "tp/loss.py"},
}
MAX_BRANCH_SITES = 3  # per dimension (EP, HSDP), issue 33's target
MAX_PARALLELIZE_LINES, MAX_PARALLELIZE_BRANCHES = 60, 6  # issue 52's targets
MAX_DTYPE_STRINGS = 5  # parameters ``*dtype*: str`` in parallel/ (issue 52; 40 at fb12019)
# on the real tree while issue 52's refactor is under way: remove the marker where it XPASSes


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


def _function(pkg_root: Path, file: str, name: str) -> ast.FunctionDef:
    """The module-level ``def name`` of ``pkg_root``/parallel/``file``; LookupError if it is
    gone (then the check has to be pointed at where that step moved, not pass unseen)."""
    tree = ast.parse((pkg_root / "parallel" / file).read_text())
    for n in tree.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name:
            return n
    raise LookupError(f"parallel/{file} has no function {name}: point the check at its "
                      "successor")


def function_shape(pkg_root: Path, file: str = "apply.py",
                   name: str = "parallelize") -> tuple[int, int]:
    """(lines, conditionals) of ``name`` in ``parallel/file``: lines ``end_lineno - lineno + 1``;
    conditionals the ``ast.If`` (an ``elif`` is one more), ``ast.IfExp`` and ``match`` cases
    anywhere inside it."""
    f = _function(pkg_root, file, name)
    branches = sum(isinstance(n, (ast.If, ast.IfExp, ast.match_case)) for n in ast.walk(f))
    return f.end_lineno - f.lineno + 1, branches


def meta_names(pkg_root: Path, file: str = "apply.py", name: str = "_pipeline") -> list[str]:
    """"identifier:line" of every variable (``ast.Name``) or parameter (``ast.arg``) named
    ``meta`` or ``weights`` inside ``name``: the meta-device decisions it would take."""
    f = _function(pkg_root, file, name)
    found = [(n.lineno, n.col_offset, n.id if isinstance(n, ast.Name) else n.arg)
             for n in ast.walk(f)
             if (isinstance(n, ast.Name) and n.id in ("meta", "weights"))
             or (isinstance(n, ast.arg) and n.arg in ("meta", "weights"))]
    return [f"{name}:{line}" for line, _, name in sorted(found)]


def model_imports(pkg_root: Path) -> list[str]:
    """"file:line" of every import of ``parallel/model.py`` (module or a name from it, relative
    or absolute, at any depth of the file) in a strategy folder."""
    par = pkg_root / "parallel"
    model = f"{pkg_root.name}.parallel.model"
    out = []
    for f in sorted(par.rglob("*.py")):
        rel = f.relative_to(par)
        if len(rel.parts) < 2 or rel.parts[0] not in STRATEGIES:
            continue
        out += [f"{rel}:{line}" for mod, line in _imported_modules(f, pkg_root)
                if mod == model or mod.startswith(model + ".")]
    return sorted(set(out))


def dtype_parameters(pkg_root: Path) -> tuple[list[str], list[str]]:
    """(parameters named ``reduce_dtype``, parameters annotated ``str`` — or ``"str"`` — whose
    name contains ``dtype``) of every function and lambda in ``parallel/``, as
    "file:line:name" (``str | None`` is not counted)."""
    par = pkg_root / "parallel"
    reduce, strings = [], []
    for f in sorted(par.rglob("*.py")):
        for n in ast.walk(ast.parse(f.read_text())):
            if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            a = n.args
            for arg in a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg)
                                                                 if x]:
                where = f"{f.relative_to(par)}:{n.lineno}:{arg.arg}"
                if arg.arg == "reduce_dtype":
                    reduce.append(where)
                ann = arg.annotation
                if "dtype" in arg.arg and ((isinstance(ann, ast.Name) and ann.id == "str") or (
                        isinstance(ann, ast.Constant) and ann.value == "str")):
                    strings.append(where)
    return reduce, strings


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
    assert assignments(SRC, "REDUCE_DTYPES") == ["precision.py"]


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


def test_parallelize_reads_as_its_steps():
    # 120 lines and 19 conditionals at fb12019; 34 and 2 at 97a1353
    lines, branches = function_shape(SRC)
    assert lines <= MAX_PARALLELIZE_LINES and branches <= MAX_PARALLELIZE_BRANCHES, \
        f"parallelize: {lines} lines, {branches} conditionals"


def test_no_meta_branch_in_the_pipeline():
    found = meta_names(SRC)  # 6 (weights) at fb12019, 0 at 97a1353
    assert not found, f"_pipeline decides on the meta-device build: {found}"


def test_strategies_do_not_import_the_engine_module():
    # 5 at fb12019: tp/loss.py, tp/mlp.py, tp/dtensor.py, pp/runner.py, pp/torch_runner.py
    # (PlainLoss and autocast); 0 since they moved to parallel/loss.py (97a1353)
    found = model_imports(SRC)
    assert not found, f"strategy folders import parallel/model.py: {found}"


def test_the_precision_is_not_threaded_as_strings():
    reduce, strings = dtype_parameters(SRC)  # 16 and 40 at fb12019
    assert not reduce, f"parameters named reduce_dtype: {reduce}"
    assert len(strings) <= MAX_DTYPE_STRINGS, f"{len(strings)} dtype strings: {strings}"


def _plant_issue_52(pkg: Path, *, clean: bool) -> None:
    """A fake package for the issue 52 checkers: violating every target, or (``clean``) meeting
    them all at their limits."""
    for d in ("parallel/tp", "parallel/pp"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "parallel" / "__init__.py").write_text("")
    (pkg / "parallel" / "model.py").write_text(
        "def helper(x, dtype: str = 'fp32', reduce_dtype: str = 'fp32'):\n    pass\n")
    n_if = MAX_PARALLELIZE_BRANCHES + (0 if clean else 1)
    ifs = ["    if a:\n        pass\n"] * (n_if - 2) + [
        "    x = 1 if a else 2\n", "    match a:\n        case 1:\n            pass\n"]
    body = "".join(ifs)
    pad = MAX_PARALLELIZE_LINES - 1 - body.count("\n") + (0 if clean else 1)
    pipeline = ("def _pipeline(model, topo, *, dtype: str = 'fp32'):\n    return model\n"
                if clean else
                "def _pipeline(model, topo, weights=None):\n    meta = weights is None\n"
                "    return meta\n")
    (pkg / "parallel" / "apply.py").write_text(
        "def parallelize(a):\n" + body + "    y = 0\n" * pad + pipeline)
    if clean:
        (pkg / "parallel" / "tp" / "a.py").write_text(
            "from ..sync import Sync\nfrom .. import loss\nimport shardwise.parallel.models\n"
            + "".join(f"def f{i}(x, dtype: str, out_dtype):\n    pass\n"
                      for i in range(MAX_DTYPE_STRINGS - 1)))
    else:
        (pkg / "parallel" / "tp" / "a.py").write_text(
            "from ..model import PlainLoss\n"
            "def f():\n    from .. import model\n    import shardwise.parallel.model\n")
        (pkg / "parallel" / "pp" / "b.py").write_text(
            "from shardwise.parallel.model import autocast\n"
            "g = lambda t, reduce_dtype: t\n"
            "def h(t, *, grad_dtype: str, dtype: 'str'):\n    pass\n")


def test_issue_52_checkers_on_planted_packages(tmp_path):
    """Each issue 52 checker fails on a planted violation and passes on a planted clean
    package (every target at its limit)."""
    bad = tmp_path / "bad" / "shardwise"
    _plant_issue_52(bad, clean=False)
    assert function_shape(bad) == (MAX_PARALLELIZE_LINES + 1, MAX_PARALLELIZE_BRANCHES + 1)
    start = MAX_PARALLELIZE_LINES + 2  # _pipeline's line in the planted apply.py
    assert meta_names(bad) == [f"weights:{start}", f"meta:{start + 1}",
                               f"weights:{start + 1}", f"meta:{start + 2}"]
    assert model_imports(bad) == ["pp/b.py:1", "tp/a.py:1", "tp/a.py:3", "tp/a.py:4"]
    reduce, strings = dtype_parameters(bad)
    assert reduce == ["model.py:1:reduce_dtype", "pp/b.py:2:reduce_dtype"]
    assert strings == ["model.py:1:dtype", "model.py:1:reduce_dtype", "pp/b.py:3:grad_dtype",
                       "pp/b.py:3:dtype"]
    clean = tmp_path / "clean" / "shardwise"
    _plant_issue_52(clean, clean=True)
    (clean / "parallel" / "model.py").write_text("def helper(x):\n    pass\n")
    assert function_shape(clean) == (MAX_PARALLELIZE_LINES, MAX_PARALLELIZE_BRANCHES)
    assert meta_names(clean) == []
    assert model_imports(clean) == []
    reduce, strings = dtype_parameters(clean)
    assert reduce == [] and len(strings) == MAX_DTYPE_STRINGS, strings
    (clean / "parallel" / "apply.py").write_text("def parallelise(a):\n    pass\n")
    with pytest.raises(LookupError, match="no function parallelize"):
        function_shape(clean)


@pytest.mark.timeout(300)
def test_a_reader_opens_the_route_written_here(tmp_path):
    """Each layout of :data:`READ_ROUTES` built and stepped on 2 ranks: the ``parallel/`` files
    whose functions ran from ``parallelize()`` or the engine (the layout's refusals aside),
    over both ranks, are exactly the route written there (no more than 13 files each, 14 for
    tp: ``Layout.tp_options``)."""
    run_world(Path(__file__).parent / "workers" / "reading_cases.py", tmp_path, nproc=2)
    for case, route in READ_ROUTES.items():
        ranks = sorted(tmp_path.glob(f"{case}_rank*.txt"))
        assert len(ranks) == 2, ranks
        files = set().union(*(set(r.read_text().split()) for r in ranks))
        assert "apply.py" in files and "model.py" in files, files  # the measure sees the path
        assert files == route, (case, "new:", sorted(files - route), "gone:",
                                sorted(route - files))
        assert len(route) <= (14 if case == "tp" else 13), (case, len(route))
