"""``shardwise verify --param-dtype bf16 [--master-dtype fp32|none] [--offload optimizer|params]``:
each layout with that storage against one process with the **same** storage
(``Local(model, precision, offload)``, docs/parity.md §7), by the rule §7 states for it
(:func:`rule_of`), and the ledger against the formula every step, the host ↔ device copies
(``offload_d2h``, ``offload_h2d``) included.

The rules (§7): ``bitwise`` — one micro-batch per rank over dp ≤ 2 (DP, ZeRO-1/2/3, FSDP2
ZeRO-2/3 under the guide's recipe): losses, every gradient and parameter equal, every step;
``step 1`` — Megatron's recipe with dp > 2, HSDP or pp (no tp): the first step's loss and fp32
main gradients within §2's rule (under pp all but the tied embedding, folded apart on two
stages); ``ledger`` — tp (each rank rounds its partial matmul to bf16), the MLP under pp
(:func:`rule_of`) and the guide's recipe beyond the bitwise case: no rule against one process
is derived, only ledger = formula. The
runs do not clip (the norm is not bitwise, §7; a clip coefficient would carry its round-off
into every update).

The torch engine's form of Megatron's recipe (an fp32 model under FSDP2's
``MixedPrecisionPolicy(param_dtype=bf16)``, :func:`~shardwise.parallel.storage.fsdp2_masters`)
is compared with the same one process whose fp32 masters start at the fp32 init (its
parameters against the reference's masters); ``--offload params`` on the torch engine (FSDP2's
``CPUOffloadPolicy``: the same arithmetic on the host) with the one process without offload, and
its copies are FSDP2's own, not booked (formula only, docs/precision-memory-mfu.md).
"""

from __future__ import annotations

import torch

from ..errors import ShardwiseConfigError
from ..formulas import step_bytes_formula
from ..parallel.apply import parallelize
from ..parallel.layout import Layout
from ..parallel.model import Local
from ..parallel.storage import check_storage, fsdp2_masters, fsdp2_state
from ..parity import ATOL, RTOL
from ..precision import Precision
from ..train.step import train_step
from .verify_layouts import step_traffic

OFFLOAD_TAGS = ("offload_d2h", "offload_h2d")
RULE = ("bf16 storage against one process with the same storage (docs/parity.md §7): bitwise "
        "(loss, every gradient and parameter, every step) with one micro-batch per rank over "
        "dp ≤ 2 (the torch engine's FSDP2 form of Megatron's recipe: against masters started "
        "at the fp32 init); Megatron's recipe with dp > 2, HSDP or pp: step 1's loss and main "
        f"gradients within |Δ| ≤ {ATOL:g} + {RTOL:g}·|ref| (pp: but the tied embedding); tp, "
        "the MLP's pp and the guide's recipe otherwise: ledger only (no rule derived); no "
        "clipping; ledger = formula every step, offload copies included (the torch engine's "
        "--offload params: FSDP2's copies, not booked)")


def storage_of(args) -> tuple[Precision, str] | None:
    """(precision, offload) of verify's ``--param-dtype``/``--master-dtype``/``--offload``;
    None for the default fp32 storage without offload (verify's plain rule)."""
    param = getattr(args, "param_dtype", "fp32")
    offload = getattr(args, "offload", "none")
    if param == "fp32" and offload == "none":
        return None
    return Precision.stored(param, getattr(args, "master_dtype", "fp32"), compute="fp32"), offload


def storage_applies(layout: Layout, engine: str, storage) -> bool:
    """Whether ``train`` runs ``layout`` on ``engine`` with this storage
    (:func:`~shardwise.parallel.storage.check_storage`, the one rule)."""
    try:
        check_storage(layout, *storage, engine)
    except ShardwiseConfigError:
        return False
    return True


def rule_of(layout: Layout, precision: Precision, model: str) -> str:
    """"bitwise" | "step 1" | "ledger": the §7 rule of ``layout`` for ``model`` (verify runs
    one micro-batch per rank without pp: :func:`micro_batches`). The MLP under pp: ledger only —
    its residual stream is fp32 (fp32 data + bf16 outputs) and crosses a stage boundary in the
    parameters' dtype (:mod:`~shardwise.parallel.pp.runner`), rounded where the reference's is
    not (the Llama's stream is bf16 throughout: its boundary is exact)."""
    if layout.pp == layout.tp == layout.dp_replicate == 1 and layout.dp <= 2:
        return "bitwise"
    mlp_pp = layout.pp > 1 and model.startswith("mlp")
    if precision.master_dtype is not None and layout.tp == 1 and not mlp_pp:
        return "step 1"
    return "ledger"


def storage_row(layout: Layout, storage, row: dict) -> dict:
    """``row`` (verify's JSON row) with, under bf16 storage / offload, its ``rule``
    (:func:`rule_of`) and, where that is "ledger", NaN for the differences it does not measure."""
    if storage is None:
        return row
    rule = rule_of(layout, storage[0], row["model"])
    if rule == "ledger":
        row |= {k: float("nan") for k in ("max_loss_diff", "max_grad_diff", "max_param_diff",
                                          "diff_over_tolerance")}
    return row | {"rule": rule}


def micro_batches(layout: Layout, n_micro: int) -> int:
    """Micro-batches per rank under bf16 storage: one without a pipeline (§7's bitwise case:
    rank r's micro-batch is the reference's r-th), else the pipeline's ``n_micro``."""
    return n_micro if layout.pp > 1 else 1


def _record(engine, res, rec) -> None:
    rec["loss"].append(float(res.loss))
    rec["grads"].append({n: g.detach().clone() for n, g in engine.named_full_gradients().items()})
    rec["params"].append({n: p.detach().clone()
                          for n, p in engine.named_full_parameters().items()})


def _run(engine, opt, sched, batches, topo, rec, check=None) -> None:
    for step, mbs in enumerate(batches):
        res = train_step(engine, mbs, opt, topo, scheduler=sched, zero_grad=False)
        _record(engine, res, rec)
        if check is not None:
            check(step)


def run_storage_case(build, work, layout, engine_name, topo, cfg, micro_batch, n_micro, steps,
                     storage, model: str) -> tuple[torch.Tensor, dict, str]:
    """One verify case with bf16 storage / offload: ``build(wrap)`` →
    (model, engine, optimizer, scheduler) as :func:`.verify.build_case`. Returns (verify's
    10-vector: max loss diff, max gradient diff, max parameter diff, failed, ledger's worst
    |measured / formula − 1|, 0, 0, 0, the largest |Δ| / (ATOL + RTOL·|ref|), 0; this rank's
    traffic; the rule). Raises AssertionError with the first failure."""
    precision, offload = storage
    rule = rule_of(layout, precision, model)
    global_batch = micro_batch * n_micro * layout.dp
    _, engine, opt, sched = build(lambda m: parallelize(m, topo, layout, engine=engine_name,
                                                        seed=cfg.seed, precision=precision,
                                                        offload=offload))
    booked = offload != "none" and not fsdp2_state(engine)  # FSDP2's copies: formula only
    sampler = work.sampler(global_batch, topo.size("dp"), topo.index("dp"), cfg.seed)
    mine = {"loss": [], "grads": [], "params": []}
    dev = [0.0]
    seq_len = work.data.train.shape[1] - 1 if work.kind == "lm" else 1

    def ledger(step):
        f = step_bytes_formula(engine, topo, micro_steps=n_micro,
                               sequences=global_batch // layout.dp, seq_len=seq_len)
        measured = topo.ledger.step_bytes()
        dev[0] = max(dev[0], abs(measured / f["total"] - 1.0) if f["total"] else
                     float(measured != 0))
        for tag in OFFLOAD_TAGS:  # the host ↔ device copies, each against its formula
            led, want = topo.ledger.step_bytes(tag), f.get(tag, 0.0)
            assert led == want and (want > 0) == booked, (step, tag, led, want)

    _run(engine, opt, sched, [work.batches(sampler.next_local_batch(), micro_batch)
                              for _ in range(steps)], topo, mine, ledger)
    vec = torch.zeros(10, dtype=torch.float64)
    vec[4] = dev[0]
    if rule != "ledger":
        ref = {"loss": [], "grads": [], "params": []}
        init = {}  # the fp32 init: FSDP2's masters (torch engine, Megatron's recipe)

        def one_process(m):  # the torch engine's offload: FSDP2's, the same arithmetic
            init.update((n, p.detach().clone()) for n, p in m.named_parameters())
            return Local(m, precision, offload if engine_name == "explicit" else "none")

        _, local, ropt, rsched = build(one_process)
        masters = fsdp2_masters(precision, engine_name)
        named = dict(local.module.named_parameters())
        if masters:  # MasterAdamW keeps the master it is given
            for n, p in named.items():
                ropt.state[p]["master"] = init[n].to(p.device)

        def as_masters(step):  # compare the fp32 parameters with the reference's masters
            ref["params"][-1] = {n: ropt.state[p]["master"].clone() for n, p in named.items()}

        rsampler = work.sampler(global_batch, 1, 0, cfg.seed)
        _run(local, ropt, rsched, [work.batches(rsampler.next_local_batch(), micro_batch)
                                   for _ in range(steps if rule == "bitwise" else 1)], None, ref,
             as_masters if masters else None)
        vec[[0, 1, 2, 8]] = torch.tensor(_compare(mine, ref, rule, layout), dtype=torch.float64)
    vec[3] = float(vec[4] >= 1e-9 or (rule == "bitwise" and bool(vec[[0, 1, 2]].any()))
                   or vec[8] > 1)
    return vec, {"bytes": step_traffic(topo.ledger), "losses": mine["loss"]}, rule


def _compare(mine, ref, rule, layout) -> list[float]:
    """[max loss diff, max gradient diff, max parameter diff, max |Δ| / (ATOL + RTOL·|ref|)] of
    this rank's names against the reference: every step (bitwise) or step 1 (the fp32 rule;
    a pipeline's tied embedding left out, §7)."""
    loss = grad = param = ratio = 0.0
    for t in range(len(ref["loss"])):
        d = abs(mine["loss"][t] - ref["loss"][t])
        loss, ratio = max(loss, d), max(ratio, d / (ATOL + RTOL * abs(ref["loss"][t])))
        skip = {"tok_embeddings.weight"} if layout.pp > 1 else set()
        for n, g in mine["grads"][t].items():
            if n in skip:
                continue
            r = ref["grads"][t][n]
            if rule == "bitwise":
                assert g.dtype == r.dtype, (n, g.dtype, r.dtype)
            diff = (g.double() - r.double()).abs()
            grad = max(grad, float(diff.max()))
            ratio = max(ratio, float((diff / (ATOL + RTOL * r.double().abs())).max()))
        if rule == "bitwise":
            for n, p in mine["params"][t].items():
                q = ref["params"][t][n]
                assert p.dtype == q.dtype, (n, p.dtype, q.dtype)
                param = max(param, float((p.double() - q.double()).abs().max()))
    return [loss, grad, param, ratio]
