"""The run configuration's fields: :class:`TrainConfig` (one flat dataclass; every field is a
flag, ``seq_len`` ↔ ``--seq-len``), the fields with a fixed set of values (:data:`CHOICES`), and
which fields are never flags or may be derived (:data:`NOT_FLAGS`, :data:`DERIVABLE`).
"""

from __future__ import annotations

import dataclasses

from ..errors import ShardwiseConfigError


@dataclasses.dataclass
class TrainConfig:
    # model
    model: str = "small"  # preset: tiny | small | base (Llama-style) | mlp | mlp-tiny
    n_layers: int = 0  # override the preset's layer count (0 = the preset's)
    tie_embeddings: bool = True
    dropout: float = 0.0
    init_from_hf: str = ""  # a local HF folder (Llama, Mistral, Qwen2/3, GPT-2, Mixtral)
    # mixture of experts (--model moe-tiny | moe-small; models/moe.py): 0 = the preset's
    n_experts: int = 0  # routed experts per MoE block
    top_k: int = 0  # experts per token
    n_shared_experts: int = 0  # always-on experts (DeepSeekMoE)
    moe_every: int = 0  # block i is MoE when i % moe_every == 0 (the preset's: every block)
    capacity_factor: float = 0.0  # 0 = dropless; c > 0: at most ceil(c·k·s/E) copies per
    # expert per sequence (the rest dropped, counted in metrics.jsonl)
    aux_loss_coef: float = 0.01  # α of the load-balancing loss E·Σ f_i·P_i (per sequence)
    z_loss_coef: float = 0.001  # β of the router z-loss (ST-MoE)
    # layout (world size = dp × cp × tp × pp): DEFAULT_LAYOUT_RULE below. Unchosen degrees are
    # 1 and zero is 0; with no degree chosen, from_args sets dp to the world size
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1  # context parallelism: ranks that split each sequence (parallel/cp)
    cp_method: str = "ring"  # ring (K/V passed around the cp ring) | allgather (Llama 3)
    ep: int = 1  # expert parallelism: ranks of dp × cp that share out the experts (parallel/ep)
    # HSDP: dp = dp_replicate × dp_shard; ZeRO shards within dp_shard, replicas all-reduce the
    # shards (--dp-shard S alone: dp = dp_replicate × S; 0 = dp / dp_replicate)
    dp_replicate: int = 1
    dp_shard: int = 0
    zero: int = 0
    sp: bool = False
    schedule: str = "1f1b"
    microbatches: int = 0  # pipeline microbatches per step (0 = global batch / (dp × micro-batch);
    # not given with --micro-batch not given either: derived, see derive_batching)
    virtual_stages: int = 0  # model chunks per pp rank (0 = 2 for interleaved-1f1b, else 1)
    layers_per_stage: str = ""  # explicit pipeline split, e.g. "3,3,2" ("" = balanced)
    engine: str = "explicit"  # explicit | torch
    collectives: str = "native"  # native | ring | tree | auto: how comm/ops.py runs each
    # collective (the backend's own, or shardwise.comm.algorithms over isend/irecv)
    bucket_mb: float = 25.0  # DP gradient bucket size, MB
    overlap: bool = True  # launch gradient collectives during backward
    prefetch: bool = True  # ZeRO-3: all-gather the next unit while this one computes
    reshard_after_forward: bool = True  # ZeRO-3: free gathered parameters after each forward
    # data
    data: str = ""  # "" = the embedded default corpus (the stdlib's .py sources)
    pack: bool = False  # sft: several examples per row, block-diagonal attention (data/pack.py)
    task: str = "lm"  # lm (packed text) | sft (alpaca-style .jsonl, prompt tokens masked) |
    # dpo (prompt/chosen/rejected .jsonl beside a frozen reference: train/dpo.py)
    dpo_beta: float = 0.1  # --task dpo: β of the sigmoid DPO loss (Rafailov et al. 2023, eq. 7)
    tokenizer: str = "bpe"  # bpe | bytes | FILE.json
    vocab_size: int = 4096  # BPE vocabulary size when training one
    seq_len: int = 128
    global_batch: int = 16  # sequences per optimizer step, all dp ranks together
    micro_batch: int = 8  # sequences per forward/backward on one rank (not given: derived from
    # the layout, at most this default; see derive_batching)
    # optimisation
    optimizer: str = "adamw"  # adamw | muon (Muon on the hidden matrices, AdamW on the rest)
    steps: int = 200  # make train: 4 ranks on 2 CPU cores stay under ~3 min (300 did not)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # max global grad L2 norm; 0 = off
    seed: int = 0
    dtype: str = "fp32"  # fp32 | bf16 (autocast compute, fp32 master weights and grads)
    reduce_dtype: str = "fp32"  # fp32 | bf16: the dtype gradients are reduced in over dp
    param_dtype: str = "fp32"  # fp32 | bf16: the dtype the parameters are stored in
    master_dtype: str = "fp32"  # --param-dtype bf16: fp32 (fp32 master weights, gradients and
    # optimizer state: Megatron's 18 B/parameter) | none (bf16 parameters, gradients and state)
    offload: str = "none"  # none | optimizer (state, master weights, the step on the host) |
    # params (and ZeRO-3's parameter and gradient shards: --zero 3, parallel/zero/offload.py)
    ac: str = "none"  # activation checkpointing per block: none | selective | full
    compile: bool = False  # torch.compile each transformer block (models/compile.py)
    peak_tflops: float = 0.0  # MFU: peak dense TFLOP/s of one GPU / CPU core (0 = table/probe)
    device: str = "auto"  # auto | cpu | cuda (topology.resolve_device: CUDA if torch sees it)
    # run
    out: str = ""  # "" = runs/<timestamp>
    log_every: int = 10
    eval_every: int = 50
    eval_sequences: int = 64
    save_every: int = 0  # 0 = only the final checkpoint
    keep: int = 0  # keep only the K newest complete checkpoints (0 = keep all)
    resume: str = ""  # "" = start fresh; auto = newest complete checkpoint in --out; or a PATH
    async_save: bool = False  # write checkpoints in the background (dcp.async_save)
    allow_data_change: bool = False  # --resume on data whose fingerprint differs (on purpose)
    sample_tokens: int = 200
    timeout: float = 300.0  # process-group timeout, seconds
    max_restarts: int = 0  # local launcher: restart every rank up to N times after a failure
    # compare collective fingerprints across ranks: off | step (at every step boundary, through
    # the store; measured cost in docs/troubleshooting.md) | every (before each collective)
    check_collectives: str = "step"
    # a rank waiting longer than this (seconds) for its peers, in a collective or at the check,
    # writes RUN/flight/rank{r}.json and ends the run naming every rank's position; 0 = half
    # of --timeout (needs --check-collectives step or every)
    hang_after: float = 0.0
    wandb: str = ""  # a Weights & Biases project: mirror metrics.jsonl there (offline by default)
    # the fields above that :func:`derive_batching` chose, not the user ("micro_batch",
    # "microbatches", comma-separated): a run folder's config.toml read back with --config
    # derives them again for its layout instead of taking them as chosen. Not a flag
    derived: str = ""

    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    def microbatching(self) -> tuple[int, int]:
        """(sequences per micro-batch, micro-batches per rank per step). With pp > 1 and
        ``--microbatches M`` the micro-batch is global / (dp × M); otherwise ``--micro-batch``
        decides and M = global / (dp × micro-batch)."""
        local = self.global_batch // self.dp
        if self.pp > 1 and self.microbatches:
            return max(1, local // self.microbatches), self.microbatches
        return self.micro_batch, max(1, local // self.micro_batch)

    def model_overrides(self) -> dict:
        """Preset fields this config overrides (``--n-layers``; with ``--init-from-hf`` the HF
        folder's architecture, read from its config.json — see :mod:`shardwise.interop.hf`)."""
        over = {}
        if self.init_from_hf:
            from ..interop.hf import hf_model_overrides

            over = {k: v for k, v in hf_model_overrides(self.init_from_hf).items()
                    if k != "vocab_size"}
        over = {**over, **self.moe_overrides()}
        return {**over, "n_layers": self.n_layers} if self.n_layers else over

    def moe_overrides(self) -> dict:
        """The mixture-of-experts fields of an MoE preset this config sets ({} for a dense
        model): ``--n-experts``, ``--top-k``, ``--moe-every`` where given (> 0),
        ``--n-shared-experts``, ``--capacity-factor`` (0: dropless), the two coefficients."""
        from ..models import MOE_PRESETS

        if self.model not in MOE_PRESETS:
            return {}
        over = {k: getattr(self, k) for k in ("n_experts", "top_k", "moe_every")
                if getattr(self, k) > 0}
        return {**over, "n_shared_experts": self.n_shared_experts,
                "capacity_factor": self.capacity_factor or None,
                "aux_loss_coef": self.aux_loss_coef, "z_loss_coef": self.z_loss_coef}

    def model_layers(self) -> int:
        from ..models import preset_config

        return self.n_layers or preset_config(self.model, **self.model_overrides()).n_layers

    def stage_split(self) -> list[int] | None:
        """``--layers-per-stage "3,3,2"`` as a list (None when empty)."""
        if not self.layers_per_stage.strip():
            return None
        try:
            return [int(x) for x in self.layers_per_stage.split(",")]
        except ValueError:
            raise ShardwiseConfigError(f"--layers-per-stage {self.layers_per_stage!r}: write "
                                       "comma-separated layer counts, e.g. 3,3,2") from None

    def to_toml(self) -> str:
        """The effective config as TOML (``config.toml`` of a run)."""
        lines = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool):
                s = "true" if v else "false"
            elif isinstance(v, str):
                s = '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
            else:
                s = repr(v)
            lines.append(f"{f.name} = {s}")
        return "\n".join(lines) + "\n"


CHOICES = {
    "zero": (0, 1, 2, 3),
    "schedule": ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev"),
    "engine": ("explicit", "torch"),
    "dtype": ("fp32", "bf16"),
    "task": ("lm", "sft", "dpo"),
    "device": ("auto", "cpu", "cuda"),
    "reduce_dtype": ("fp32", "bf16"),
    "param_dtype": ("fp32", "bf16"),
    "master_dtype": ("fp32", "none"),
    "offload": ("none", "optimizer", "params"),
    "optimizer": ("adamw", "muon"),
    "ac": ("none", "selective", "full"),
    "check_collectives": ("off", "step", "every"),
}


# The one rule for the layout a run gets when it names none, stated once: `train --help` and
# `trace --help` print it, the README quotes it word for word, and config.flags.from_args
# implements it (tests/test_default_layout.py checks all three).
LOCAL_WORLD = 4  # ranks `shardwise train` spawns alone when no degree is chosen
DEFAULT_LAYOUT_RULE = (
    "Default layout: with no --dp, --tp, --pp or --cp (as a flag or in --config), the run is "
    "plain data parallelism over the whole world: dp = the world size (torchrun's WORLD_SIZE; "
    f"run alone, {LOCAL_WORLD} local ranks), tp = pp = cp = 1, ZeRO 0 unless --zero is given. "
    "Choosing any degree sets the unchosen ones to 1 and --zero to 0 unless given.")


NOT_FLAGS = ("derived",)  # fields set by from_args, never by a flag
DERIVABLE = ("micro_batch", "microbatches")  # fields derive_batching fills when not given
