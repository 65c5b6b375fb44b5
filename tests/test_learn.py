"""The learner's track (src/shardwise/learn/): each script trains like one process and issues
the bytes the framework's ledger books for the same layout.

One world of 4 ranks (tests/workers/learn_cases.py) runs every script at n = 4 (fsdp_tp at
X = 2 × Y = 2), three deliberately broken copies, and the framework's explicit engine on the
same MLP (dp = 4, ZeRO-3 over 4, pp = 4 1F1B, tp = 4, dp = 2 × tp = 2 ZeRO-3). Here:

* parameters: every step's loss, gradients and parameters, assembled to full shape from the
  ranks' shards, against :func:`shardwise.parity.reference_run` on the framework's plain
  ``StackedMLP`` holding the scripts' initial weights (``nn.Linear`` stores W transposed), by
  docs/parity.md's rule (:func:`shardwise.parity.compare`);
* bytes: per rank and tag, one step of a script = one step of the framework's ledger (dp, fsdp,
  pp, tp, fsdp_tp), and for TP and FSDP+TP also = the textbook formula written out here. The
  loss and norm bookkeeping (tags ``loss``, ``grad_norm``) is left out: the framework
  all-reduces the counted elements and the clipping norm, which the scripts skip;
* broken copies (a missing gradient all-reduce in dp, a wrong shard in fsdp, a missing f in
  tp) fail the parity rule;
* one script under ``torchrun``, one under ``shardwise learn``, and a bad ``--nproc``.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardwise import parity
from shardwise.learn import _common as C
from shardwise.models.mlp import MLPConfig, StackedMLP

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from conftest import load_pt, ROOT, run_cli, run_world  # noqa: E402
import learn_cases as W  # noqa: E402

N, X, Y = 4, 2, 2  # the world; fsdp_tp's mesh
LEARN = ROOT / "src" / "shardwise" / "learn"
# (script, the line to change, what it becomes, the broken copy's name)
BROKEN = {
    "dp": ("        dist.all_reduce(flat)  # sends 2(n−1)/n · 4Ψ bytes\n", "\n"),
    "fsdp": ("t.chunk(n)[rank].clone()", "t.chunk(n)[(rank + 1) % n].clone()"),
    "tp": ("        dist.all_reduce(grad)  # ∂In[B, D] {U_Y}", "        # ∂In[B, D] {U_Y}"),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("learn")
    for name, (old, new) in BROKEN.items():
        src = (LEARN / f"{name}.py").read_text()
        assert src.count(old) == 1, f"{name}.py changed: update BROKEN"
        src = src.replace(old, new).replace(f'"{name}", out)', f'"broken_{name}", out)')
        (out / f"broken_{name}.py").write_text(src)
    run_world(W.__file__, out, nproc=N)
    return out


@pytest.fixture(scope="module")
def reference():
    """parity.reference_run on the plain StackedMLP with the scripts' initial weights."""
    torch.manual_seed(0)
    model = StackedMLP(MLPConfig(d_model=C.D, d_ff=C.F, n_layers=C.L))
    with torch.no_grad():
        for blk, p in zip(model.layers, C.init_params()):
            blk.w_in.weight.copy_(p["w_in"].T)
            blk.w_in.bias.copy_(p["b_in"])
            blk.w_out.weight.copy_(p["w_out"].T)
            blk.w_out.bias.copy_(p["b_out"])
    batches = [dict(zip(("inputs", "targets"), C.batch(s))) for s in range(C.STEPS)]
    return parity.reference_run(model, batches, lrs=[C.LR] * C.STEPS, weight_decay=0.1,
                                betas=(0.9, 0.95), eps=1e-8, max_norm=0.0)


def _load(out, name):
    return [load_pt(out / f"{name}_rank{r}.pt") for r in range(N)]


def _full(name: str, ranks: list[dict], kind: str, t: int) -> dict:
    """Step t's gradients or parameters (``kind``), whole, in our names (layers.i.w_in …)."""
    per = [r[kind][t] for r in ranks]
    if name == "dp":
        return per[0]
    if name == "fsdp":
        return {k: torch.cat([p[k] for p in per]) for k in per[0]}
    if name.startswith("pp"):
        return {k: v for p in per for k, v in p.items()}
    if name == "fsdp_tp":  # rank = x·Y + y: the X slices of each TP shard, then as tp
        per = [{k: torch.cat([per[x * Y + y][k] for x in range(X)]) for k in per[0]}
               for y in range(Y)]
    out = {}
    for k in per[0]:
        dim = 1 if k.endswith("w_in") else 0
        out[k] = per[0][k] if k.endswith("b_out") else torch.cat([p[k] for p in per], dim)
    return out


def _plain(ours: dict) -> dict:
    """Our names and layout → StackedMLP's (``nn.Linear``: weight [out, in])."""
    out = {}
    for k, v in ours.items():
        i, w = k.split(".")[1], k.split(".")[2]
        lin, kind = ("w_in" if w.endswith("in") else "w_out"), w[0]
        out[f"layers.{i}.{lin}.{'weight' if kind == 'w' else 'bias'}"] = \
            v.T if kind == "w" else v
    return out


def _report(out, name, reference):
    ranks, layout = _load(out, name), name.removeprefix("broken_")
    mine = {"loss": ranks[0]["losses"],
            "grads": [_plain(_full(layout, ranks, "grads", t)) for t in range(C.STEPS)],
            "params": [_plain(_full(layout, ranks, "params", t)) for t in range(C.STEPS)]}
    return parity.compare(mine, reference, where=name)


@pytest.mark.parametrize("name", ["dp", "fsdp", "tp", "fsdp_tp", "pp_gpipe", "pp_1f1b"])
def test_script_trains_like_one_process(results, reference, name):
    rep = _report(results, name, reference)
    assert rep.ok, "\n".join(rep.failures[:5])
    assert rep.max_loss_diff < 1e-5  # the loss each rank printed is the whole batch's


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_copy_fails(results, reference, name):
    rep = _report(results, f"broken_{name}", reference)
    assert not rep.ok, f"broken {name} passed the parity rule"


def _per_step(out, name) -> list[dict]:
    """Each rank's bytes per tag in one step (the scripts' steps are alike)."""
    res = []
    for r in _load(out, name):
        tags = {}
        for rec in r["ledger"]:
            tags[rec["tag"]] = tags.get(rec["tag"], 0.0) + rec["bytes"] / C.STEPS
        res.append(tags)
    return res


STRATEGY_TAGS = ("grad", "param", "pp_fwd", "pp_bwd", "tp_fwd", "tp_bwd")


@pytest.mark.parametrize("name,case", [("dp", "dp"), ("fsdp", "zero3"), ("pp_1f1b", "pp"),
                                       ("pp_gpipe", "pp"), ("tp", "tp"), ("fsdp_tp", "fsdp_tp")])
def test_bytes_equal_the_framework_ledger(results, name, case):
    for r, mine in enumerate(_per_step(results, name)):
        fw = load_pt(results / f"fw_{case}_rank{r}.pt")
        want = {t: b for t, b in fw.items() if t in STRATEGY_TAGS and b}
        got = {t: b for t, b in mine.items() if t in STRATEGY_TAGS and b}
        assert got == pytest.approx(want, rel=1e-12), (r, got, want)
        assert want  # the framework moved something under these tags


def test_tp_bytes_equal_the_textbook_formula(results):
    """Megatron TP, one g (forward) per block and one f (backward) per block but the first
    (nothing upstream needs ∂In): 2(n−1)/n · 4·B·D each."""
    one = 2 * (N - 1) / N * 4 * C.B * C.D
    for mine in _per_step(results, "tp"):
        assert mine == pytest.approx({"tp_fwd": C.L * one, "tp_bwd": (C.L - 1) * one})


def test_fsdp_tp_bytes_equal_the_textbook_formula(results):
    """Over X: the FSDP bytes of my TP shard (gathered in forward and backward, gradients
    reduce-scattered), Ψ_tp = 2·D·F/Y + F/Y + D per block; over Y: TP's f/g on B/X rows."""
    psi = 2 * C.D * C.F // Y + C.F // Y + C.D
    fsdp = (X - 1) / X * 4 * psi * C.L
    tp = 2 * (Y - 1) / Y * 4 * (C.B // X) * C.D
    for mine in _per_step(results, "fsdp_tp"):
        assert mine == pytest.approx({"param": 2 * fsdp, "grad": fsdp, "tp_fwd": C.L * tp,
                                      "tp_bwd": (C.L - 1) * tp, "loss": 2 * (X - 1) / X * 8})


def test_collectives_primer_checks_itself(results):
    """The primer asserts ring = torch on every rank; here its sends: 2(n−1) chunks of S/n."""
    S = 4 * 4 * N
    for r in _load(results, "collectives"):
        assert [rec["bytes"] for rec in r["ledger"]] == [S / N] * (2 * (N - 1))


def _torchrun(module: str, nproc: int, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", str(nproc), "-m", module, *args],
                          capture_output=True, text=True, timeout=240, env=env)


def test_runs_under_torchrun():
    """One script the way the README starts it with torchrun (~30 s here: new interpreters)."""
    p = _torchrun("shardwise.learn.pp", 2, "--schedule", "gpipe")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "rank 0 runs F0 F1 F2 F3 B0 B1 B2 B3" in p.stdout, p.stdout
    assert "pp_gpipe: loss" in p.stdout and "send            pp_fwd" in p.stdout, p.stdout


def test_shardwise_learn_command(cache_dir):
    p = run_cli(["learn", "fsdp", "--nproc", "2"], cache_dir)
    assert p.returncode == 0, p.stdout
    assert "all_gather      param" in p.stdout and "reduce_scatter  grad" in p.stdout, p.stdout
    assert "fsdp: loss" in p.stdout


def test_bad_nproc_is_one_line_and_exit_2(cache_dir):
    p = run_cli(["learn", "tp", "--nproc", "3"], cache_dir)
    assert p.returncode == 2, p.stdout
    assert p.stdout.strip() == ("shardwise learn: error: tp=3 must divide the hidden size F=32: "
                                "use --nproc 2, 4 or 8"), p.stdout


def test_scripts_import_only_torch_and_the_helper():
    """Readable in one sitting: torch, the standard library's argparse/os/sys and the helper
    only (never shardwise.parallel or shardwise.comm), and at most 150 lines each."""
    import ast

    allowed = {"__future__", "argparse", "os", "sys", "torch", "shardwise.learn._common"}
    for f in sorted(LEARN.glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module]
            else:
                continue
            for name in names:
                assert name in allowed or name.split(".")[0] in allowed - {"shardwise"}, \
                    f"{f.name} imports {name}"
        assert len(f.read_text().splitlines()) <= 150, f"{f.name} is over 150 lines"
    import re  # the README's Learn table gives each script's length: keep it true

    shown = re.findall(r"\]\(src/shardwise/learn/(\w+\.py)\) \((\d+)\)",
                       (ROOT / "README.md").read_text())
    assert len(shown) == 6, shown
    for name, lines in shown:
        assert len((LEARN / name).read_text().splitlines()) == int(lines), name


def test_the_docs_quote_the_scripts_as_they_are():
    """Each strategy page quotes its script's key lines (a ```python block opening with
    ``# src/shardwise/learn/NAME.py``, or the framework's, ``# src/shardwise/parallel/[DIR/]
    NAME.py``): every quoted line is a line of that file, so the quotes cannot go stale."""
    import re

    quoted = 0
    for page in sorted((ROOT / "docs").glob("*.md")):
        for block in re.finditer(r"```python\n# (src/shardwise/(?:learn|parallel(?:/\w+)?)/\w+\.py)"
                                 r"\n(.*?)```",
                                 page.read_text(), re.S):
            lines = {ln.strip() for ln in (ROOT / block.group(1)).read_text().splitlines()}
            for line in block.group(2).splitlines():
                assert line.strip() in lines, f"{page.name} quotes {block.group(1)}: {line!r}"
                quoted += 1
    assert quoted >= 30, quoted


def test_the_readme_trace_output_is_current(cache_dir):
    """The README's sample of ``shardwise trace --dp 2`` is what the command prints now, all
    but the ``ms`` column (wall time). On a mismatch the message holds the fresh output."""
    import re

    text = (ROOT / "README.md").read_text()
    block = re.search(r"Real output \(tests/test_learn\.py.*?```\n(.*?)```", text, re.S).group(1)
    p = run_cli(["trace", "--dp", "2"], cache_dir)
    assert p.returncode == 0, p.stdout
    fresh = [ln for ln in p.stdout.splitlines() if ln.startswith("[rank 0]")]

    def strip_ms(lines):  # a record row ends with its ms; the other rows stay whole
        return [re.sub(r"^(\[rank 0\]\s+\d+ .*?)\s+[\d.]+$", r"\1", ln) for ln in lines]

    assert strip_ms(block.splitlines()) == strip_ms(fresh), "\n".join(fresh)


def test_trace_rank_flag_and_issue_order(cache_dir):
    """``trace --rank all`` under 1F1B: each rank's rows in the order it issued them (rank 0
    sends F0 and F1 before it posts B0's receive: p − 1 = 1 warm-up forward, then F1 B0 …),
    and the bubble beside its formula; a rank outside the world is one line, exit 2."""
    p = run_cli(["trace", "--pp", "2", "--schedule", "1f1b", "--microbatches", "4", "--model",
                 "mlp-tiny", "--rank", "all", "--out", "runs/trace"],
                cache_dir)
    assert p.returncode == 0, p.stdout
    assert "rank 0's collectives, in the order it issued them" in p.stdout, p.stdout
    assert "rank 1's collectives, in the order it issued them" in p.stdout, p.stdout
    rank0 = p.stdout.split("rank 1's collectives")[0]
    rows = [ln.split() for ln in rank0.splitlines()]  # [rank 0] # op axis n tag …
    pp_rows = [f"{w[3]} {w[6]}" for w in rows if len(w) > 6 and w[6] in ("pp_fwd", "pp_bwd")]
    assert pp_rows == [
        "send pp_fwd", "send pp_fwd", "recv pp_bwd", "send pp_fwd", "recv pp_bwd",
        "send pp_fwd", "recv pp_bwd", "recv pp_bwd"], pp_rows
    assert "formula (p−1)/(m+p−1) = (2−1)/(4+2−1) = 0.200" in p.stdout, p.stdout
    bad = run_cli(["trace", "--dp", "2", "--rank", "2"], cache_dir)
    assert bad.returncode == 2 and "--rank 2: this layout has ranks 0 … 1" in bad.stdout


def test_trace_says_which_unit_and_direction_each_zero3_collective_serves(cache_dir):
    """``trace --dp 2 --zero 3`` on mlp-tiny (4 blocks, no root parameters): in issue order,
    the param all-gathers are blocks 0 … 3 for forward, then 3 … 0 for backward (each gathered
    again: reshard after forward), and the grad reduce-scatters blocks 3 … 0, each row noting
    its unit and pass (the ``for`` column, from the ledger's notes at launch)."""
    p = run_cli(["trace", "--dp", "2", "--zero", "3", "--model", "mlp-tiny", "--micro-batch",
                 "4", "--out", "runs/trace"], cache_dir)
    assert p.returncode == 0, p.stdout
    assert "for (block/unit, direction)" in p.stdout, p.stdout
    rows = [ln.split() for ln in p.stdout.splitlines()]  # [rank 0] # op axis n tag … ms for
    gathers = [" ".join(w[14:16]) for w in rows if len(w) > 15 and w[3] == "all_gather"
               and w[6] == "param"]
    scatters = [" ".join(w[14:16]) for w in rows if len(w) > 15 and w[3] == "reduce_scatter"]
    assert gathers == [f"layers.{i} fwd" for i in range(4)] + \
        [f"layers.{i} bwd" for i in (3, 2, 1, 0)], gathers
    assert scatters == [f"layers.{i} grads" for i in (3, 2, 1, 0)], scatters
