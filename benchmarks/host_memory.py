"""Host memory at start-up from a Hugging Face folder: each rank's peak RSS (issue 39).

Writes an HF folder of a preset (random weights: the preset's own init, fp32 safetensors, one
file per 2 GB, ``config.json`` from :func:`shardwise.interop.hf.llama_to_hf_config`), then for
each layout starts a 4-rank world (``python -m shardwise.launch``, forked gloo workers, as
``shardwise train`` starts them) that does what ``shardwise train --init-from-hf DIR`` does
before its first step, and records each rank's peak RSS (``getrusage ru_maxrss``) once the
engine exists:

* ``meta`` (today's train): the model built on the meta device, the init's RNG draws replayed,
  ``parallelize(..., weights=hf_weight_stream(...))``: each rank fills only what it holds;
* ``whole`` (the build before issue 39): the model built whole on every rank,
  ``load_hf_weights``, then ``parallelize``. Skipped where it would not fit this machine
  (estimated 5 × 4Ψ per rank, the measured ratio of the issue's 75 M-parameter run); where
  only one such rank fits, a 1-rank world measures it (every rank of the old build peaks the
  same, before ``parallelize`` cuts the model).

The formula it is held to, per rank: 4Ψ_rank (what the layout leaves on the rank, counted
exactly from the built engine: the parameters, Ψ/N for dp = N ZeRO-3, tp = N and pp = N up to
the replicated norms and the uneven stage split; and ZeRO-3's gradient slices, another Ψ/N,
which it allocates up front) + the largest single tensor (4 bytes each)
+ the import floor (the same world's peak with the ``tiny`` preset, which holds ~0 bytes of
model). Exit 1 when a rank of a ``meta`` run exceeds 1.2 × it.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/host_memory.py [--preset llama-1b]
        [--layouts dp=4,zero=3 tp=4 pp=4] [--set d_model=768 n_layers=8] [--dir DIR]
        [--json out.json]

``--run`` (issue 53): a whole ``shardwise train --init-from-hf`` run per layout instead (a few
steps, then the final save and sample), 4 ranks, the folder written with the byte tokenizer
(vocabulary 257) so that train can read it. ``train`` records each phase's peak apart
(``host_memory.json`` "phases", :func:`shardwise.train.device.phase_peaks`: the peak RSS,
reset between phases, and the RSS where each window starts, so "save's own" = the save's peak
minus the RSS it started from, "sample's own" the same for the sample; on CUDA also
``max_memory_allocated``, the device; on CPU the device
*is* the host, and only the host is reported). Held to, per rank: the save's peak ≤ the
steps' peak + the largest tensor (4 bytes an element: a save holds one tensor more, at most),
and, for ``dp=n,zero=3`` in fp32, the steps and the sample each within their formula above a
``tiny`` run's floor (:func:`phase_formulas`; benchmarks/README.md "the steps' peak"). The
issue's figure, the whole run within the floor + 2 × the model's bytes (16Ψ/4 = 4Ψ of model
state, the model's own size, plus one gathered block), is reported beside them, not held: the
steps hold the root and four blocks' worth (two gathered, a block's gradients, one
reduce-scatter input in flight) over the state, not one, and the allocator keeps RSS the
formulas do not count (benchmarks/README.md). Flags it does not know go to ``train``
unchanged (e.g. ``--param-dtype bf16 --offload optimizer``); a flag ``train`` refuses stops the
benchmark with ``train``'s one-line refusal (exit 2).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/host_memory.py --run --preset llama-1b \
        --set d_model=1024 n_heads=16 n_kv_heads=4 d_ff=2624 n_layers=6 --layouts dp=4,zero=3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def write_hf_folder(preset: str, out: Path, vocab: int, tokenizer: bool = False,
                    **overrides) -> tuple[int, int]:
    """The preset as an HF folder (skipped when ``out`` has it); returns (Ψ, largest tensor's
    elements). ``tokenizer``: also the byte tokenizer's ``tokenizer.json`` (vocab must be
    257), which ``train --init-from-hf`` reads."""
    from safetensors.torch import save_file

    from shardwise.interop.hf import llama_to_hf_config, ours_to_hf
    from shardwise.models.meta import build_on_meta

    torch.manual_seed(0)
    model, plan = build_on_meta(preset, vocab_size=vocab, **overrides)
    shapes = [p.numel() for p in model.parameters()]
    if (out / "config.json").is_file():
        return sum(shapes), max(shapes)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer:
        from shardwise.interop.hf_export import byte_tokenizer_json

        byte_tokenizer_json().save(str(out / "tokenizer.json"))
        (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    hf_cfg = llama_to_hf_config(model.config)
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=1))
    files, part, size, index = 0, {}, 0, {}

    def flush():
        nonlocal files, part, size
        if part:
            name = f"model-{files:05d}.safetensors"
            save_file(part, str(out / name), metadata={"format": "pt"})
            index.update({k: name for k in part})
            files, part, size = files + 1, {}, 0

    for name, full in plan.stream():  # one tensor at a time, renamed as HF names it
        for k, t in ours_to_hf({name: full}, model.config).items():
            part[k] = t.contiguous()
            size += t.numel() * 4
        if size > 2 * 2**30:
            flush()
    flush()
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(shapes) * 4}, "weight_map": index}, indent=1))
    return sum(shapes), max(shapes)


def worker(folder: str, layout: str, mode: str, out: str) -> None:
    """One rank: train's start-up from the HF folder, then the peak RSS of every rank."""
    import resource

    import torch.distributed as dist

    from shardwise.interop.hf import hf_model_overrides, hf_weight_stream, load_hf_weights
    from shardwise.models import build_model
    from shardwise.models.meta import build_on_meta
    from shardwise.parallel.apply import Layout, parallelize
    from shardwise.topology import Topology, init_distributed

    init_distributed("cpu", timeout_s=1800)
    kw = dict(x.split("=") for x in layout.split(",")) if layout else {}
    kw = {k: int(v) for k, v in kw.items()}
    topo = Topology(kw.get("pp", 1), kw.get("dp", 1), kw.get("tp", 1), timeout_s=1800)
    overrides = hf_model_overrides(folder)
    preset = Path(folder).name.split("@")[0]  # the folder is named after its preset
    vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
    overrides.pop("vocab_size", None)
    torch.manual_seed(0)
    if mode == "meta":
        model, plan = build_on_meta(preset, vocab_size=vocab, **overrides)
        plan.replay_draws()  # the init's draws, as train replays them
        engine = parallelize(model, topo, Layout(**kw), weights=hf_weight_stream(model, folder))
    else:
        model = build_model(preset, vocab_size=vocab, **overrides)
        load_hf_weights(model, folder)
        engine = parallelize(model, topo, Layout(**kw))
    held = _held_elements(engine)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rec = torch.tensor([peak, held], dtype=torch.int64)
    allr = [torch.zeros(2, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(allr, rec)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"peak_rss_bytes": [int(r[0]) for r in allr],
                                         "held_elements": [int(r[1]) for r in allr]}))
    dist.barrier()
    dist.destroy_process_group()


def _held_elements(engine) -> int:
    """fp32 elements of the storage a rank's engine holds for the model state at start-up: its
    parameters, or a ZeRO sync's parameter slices and the gradient slices it allocates up
    front (each storage once; a freed unit buffer holds none)."""
    seen, total = set(), 0
    tensors = list(engine.module.parameters())
    for u in getattr(engine.parts[0], "units", ()):
        if hasattr(u, "shard"):  # the explicit ZeRO's flat buffers (FSDP2's units are modules)
            tensors += [u.full, u.shard, u.shard_grad]
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes() // 4
    return total


def run_world(folder: Path, layout: str, mode: str, nproc: int = 4) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "rec.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        p = subprocess.run([sys.executable, "-m", "shardwise.launch", "--nproc", str(nproc),
                            __file__,
                            "--worker", str(folder), layout, mode, str(out)], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if p.returncode != 0:
            raise SystemExit(f"{layout} {mode}: the world failed:\n{p.stdout[-3000:]}")
        return json.loads(out.read_text())


# -- --run: a whole train run, its phases apart (issue 53) ----------------------------------------
TRAIN = ["--steps", "3", "--seq-len", "64", "--global-batch", "4", "--micro-batch", "1",
         "--eval-sequences", "4", "--timeout", "1800"]


class Refused(Exception):
    """``train`` refused the flags (exit 2): its one-line message."""


def train_phases(folder: Path, layout: str, extra: list[str]) -> dict:
    """``shardwise train --init-from-hf folder`` under ``layout`` ("dp=4,zero=3" → ``--dp 4
    --zero 3``) with ``extra`` flags, 4 ranks: its ``host_memory.json`` phases. Raises
    :class:`Refused` with train's refusal line when it exits 2."""
    flags = [x for k, v in (kv.split("=") for kv in layout.split(",")) for x in (f"--{k}", v)]
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "shardwise", "train", "--init-from-hf", str(folder),
               *flags, *TRAIN, "--out", str(Path(d) / "run"), *extra]
        p = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"},
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if p.returncode == 2:
            lines = [x for x in p.stdout.splitlines() if x.strip()]
            raise Refused(lines[-1] if lines else "exit 2")
        if p.returncode != 0:
            raise SystemExit(f"{layout}: train failed:\n{p.stdout[-3000:]}")
        return json.loads((Path(d) / "run" / "host_memory.json").read_text())["phases"]


def zero3_units(preset: str, sets: dict) -> tuple[int, int]:
    """(root, largest block) in elements: explicit ZeRO-3's units, the blocks ``layers.<i>``
    and the root (the rest: embedding, final norm, output head), vocabulary 257."""
    from shardwise.models.meta import build_on_meta

    model, _ = build_on_meta(preset, vocab_size=257, **sets)
    blocks: dict[str, int] = {}
    for fqn, p in model.named_parameters():
        key = fqn.split(".")[1] if fqn.startswith("layers.") else "root"
        blocks[key] = blocks.get(key, 0) + p.numel()
    root = blocks.pop("root", 0)
    return root, max(blocks.values())


def phase_formulas(layout: str, extra: list[str], psi: int, root: int, block: int) -> dict:
    """Bytes above the floor that the steps and the sample hold, for ``dp=n,zero=3`` in fp32
    (no extra flags; other layouts: {}), benchmarks/README.md "the steps' peak":
    steps 16Ψ/n + 4·(R + 2B) gathered (root, the unit computing, the one prefetched) + 4B (the
    unit's own gradients before they are packed) + 4B (one reduce-scatter input in flight:
    ``ZeroSync._launch_reduce`` waits for it before packing the next);
    sample 16Ψ/n + 4·(R + 2B) (ZeRO-3 samples through its sharded forward: the root, the unit
    computing and the one prefetched, ``Zero3Sync.sampling_model_for``).
    With ``--no-prefetch`` (the only extra flag modelled) one gathered block fewer in each:
    steps 16Ψ/n + 4·(R + 3B), sample 16Ψ/n + 4·(R + B)."""
    kw = dict(kv.split("=") for kv in layout.split(","))
    if set(extra) - {"--no-prefetch"} or set(kw) != {"dp", "zero"} or kw["zero"] != "3":
        return {}
    state, gathered = 16 * psi / int(kw["dp"]), 1 if "--no-prefetch" in extra else 2
    return {"steps": state + 4 * (root + (gathered + 2) * block),
            "sample": state + 4 * (root + gathered * block)}


def run_mode(a, extra: list[str], base: Path, name: str, sets: dict) -> int:
    """``--run``: each layout's phases against the module docstring's bounds."""
    psi, largest = write_hf_folder(a.preset, base / (name + "@bytes"), 257, tokenizer=True,
                                   **sets)
    root, block = zero3_units(a.preset, sets)
    write_hf_folder("tiny", base / "tiny@bytes", 257, tokenizer=True, n_layers=4, n_heads=8,
                    n_kv_heads=4)
    model, one = 4 * psi, 4 * largest
    rows, ok = [], True
    for layout in a.layouts:
        want = phase_formulas(layout, extra, psi, root, block)
        try:
            # the first run tokenizes the corpus into the cache (its own peak): a warm-up
            train_phases(base / "tiny@bytes", layout, extra)
            tiny = train_phases(base / "tiny@bytes", layout, extra)
            big = train_phases(base / (name + "@bytes"), layout, extra)
        except Refused as e:
            print(f"train refused {' '.join(extra) or 'the run'}: {e}")
            return 2
        for r in range(len(big["startup"]["host"])):
            floor = max(v["host"][r] for v in tiny.values())
            ph = {k: v["host"][r] for k, v in big.items()}
            dev = ({k: v["device"][r] for k, v in big.items()}
                   if big["startup"].get("device") else None)
            # what the save itself added: its peak over the RSS it started from
            save_own = ph["save"] - big["steps"]["host_now"][r]
            sample_own = ph["sample"] - big["save"]["host_now"][r]  # the same for the sample
            run_peak = max(ph.values())
            save_ok = ph["save"] <= ph["steps"] + one
            run_ok = run_peak - floor <= 2 * model  # the 2×, reported only
            # each phase within its formula (README "the steps' peak"), where one is stated
            held = {k: (ph[k] - floor) / f for k, f in want.items()}
            ok &= save_ok and all(v <= 1 for v in held.values())
            rows.append(dict(layout=layout, rank=r, floor=floor, phases=ph, device=dev,
                             save_own=save_own, sample_own=sample_own, formulas=want,
                             vs_formula=held,
                             above_floor=(run_peak - floor) / model, save_ok=save_ok,
                             run_ok=run_ok))
    print(f"{name}: Ψ = {psi:,} parameters ({model / 2**20:,.0f} MiB fp32), largest tensor "
          f"{one / 2**20:,.0f} MiB; floor: a tiny run's peak, same layout; "
          f"{'device = host (CPU)' if rows and rows[0]['device'] is None else 'device: CUDA max_memory_allocated'}; "
          f"extra train flags: {' '.join(extra) or 'none'}\n")
    if root:
        print(f"ZeRO-3 units: root {4 * root / 2**20:,.1f} MiB, largest block "
              f"{4 * block / 2**20:,.1f} MiB\n")
    print("| layout | rank | floor | start-up | steps | save | sample | save's own | sample's "
          "own | run peak "
          "− floor (× model; the issue's ≤ 2) | save ≤ steps + one tensor | steps − floor "
          "(× formula) | sample − floor (× formula) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for x in rows:
        ph = x["phases"]
        print(f"| {x['layout']} | {x['rank']} | {x['floor'] / 2**20:,.0f} | "
              + " | ".join(f"{ph[k] / 2**20:,.0f}" for k in ("startup", "steps", "save",
                                                               "sample"))
              + f" | {x['save_own'] / 2**20:,.0f} | {x['sample_own'] / 2**20:,.0f} | "
              f"{x['above_floor']:.2f} | "
              f"{'yes' if x['save_ok'] else 'NO'} | "
              + " | ".join(f"{x['vs_formula'][k]:.2f}" if k in x["vs_formula"] else "—"
                           for k in ("steps", "sample")) + " |")
        if x["device"] is not None:
            print("|  | device | | " + " | ".join(f"{x['device'][k] / 2**20:,.0f}" for k in
                                                  ("startup", "steps", "save", "sample"))
                  + " | | | | | | |")
    if a.json:
        Path(a.json).write_text(json.dumps({"preset": a.preset, "sets": sets, "psi": psi,
                                            "largest": largest, "extra": extra, "rows": rows},
                                           indent=1))
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-1b")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--layouts", nargs="+", default=["dp=4,zero=3", "tp=4", "pp=4"])
    ap.add_argument("--set", nargs="*", default=[], metavar="FIELD=INT",
                    help="override preset fields, e.g. d_model=768 n_layers=8")
    ap.add_argument("--dir", default=None, help="where the HF folders go (kept for reruns)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--run", action="store_true",
                    help="a whole train run per layout: start-up, steps, save, sample apart; "
                         "other flags go to train")
    a, extra = ap.parse_known_args()
    if extra and not a.run:
        ap.error(f"unknown flags {extra}: train flags go through with --run only")
    base = Path(a.dir or tempfile.gettempdir()) / "shardwise-host-memory"
    sets = {k: int(v) for k, v in (x.split("=") for x in a.set)}
    name = a.preset + ("@" + "_".join(f"{k}{v}" for k, v in sets.items()) if sets else "")
    if a.run:
        return run_mode(a, extra, base, name, sets)
    psi, largest = write_hf_folder(a.preset, base / name, a.vocab, **sets)
    # the floor: a model of ~0 bytes that every layout accepts (4 layers for pp = 4, 4 kv heads
    # for tp = 4)
    write_hf_folder("tiny", base / "tiny", 256, n_layers=4, n_heads=8, n_kv_heads=4)
    avail = _mem_available()
    rows, ok = [], True
    need = 5 * 4 * psi  # a rank's whole build, by the measured ratio (5 × 4Ψ)
    # where 4 whole builds at once do not fit, one rank alone (each of the 4 would peak the
    # same: every rank builds and loads the whole model before parallelize cuts it; alone,
    # with no layout to build, llama-1b measured 2.06 × 4Ψ: the model + the loaded weights)
    one = (run_world(base / name, "", "whole", nproc=1)["peak_rss_bytes"][0]
           if 4 * need >= 0.8 * avail and 2.5 * 4 * psi < 0.8 * avail else None)
    for layout in a.layouts:
        floor = max(run_world(base / "tiny", layout, "meta")["peak_rss_bytes"])
        meta = run_world(base / name, layout, "meta")
        whole = run_world(base / name, layout, "whole") if 4 * need < 0.8 * avail else None
        for r, (peak, held) in enumerate(zip(meta["peak_rss_bytes"], meta["held_elements"])):
            formula = 4 * held + 4 * largest + floor
            ok &= peak <= 1.2 * formula
            rows.append(dict(layout=layout, rank=r, peak=peak, held_bytes=4 * held,
                             formula=formula, ratio=peak / formula,
                             whole=whole["peak_rss_bytes"][r] if whole else None,
                             whole_one_rank=one))
    print(f"{name}: Ψ = {psi:,} parameters ({4 * psi / 2**30:.2f} GiB fp32), largest "
          f"tensor {4 * largest / 2**20:.0f} MiB; import floor measured per layout (tiny)\n")
    print("| layout | rank | peak RSS (MiB) | held params (MiB) | formula (MiB) | peak/formula "
          "| whole build (MiB) |")
    print("|---|---|---|---|---|---|---|")
    for x in rows:
        w = (f"{x['whole'] / 2**20:,.0f}" if x["whole"] else
             f"{one / 2**20:,.0f} (one rank alone; 4 would not fit)" if one else
             "not run (would not fit)")
        print(f"| {x['layout']} | {x['rank']} | {x['peak'] / 2**20:,.0f} | "
              f"{x['held_bytes'] / 2**20:,.0f} | {x['formula'] / 2**20:,.0f} | "
              f"{x['ratio']:.2f} | {w} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"preset": a.preset, "psi": psi, "rows": rows},
                                           indent=1))
    return 0 if ok else 1


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:6])
    else:
        sys.exit(main())
