"""One line of ``--help`` for every field of :class:`~shardwise.config.TrainConfig` (the flags of
``train`` and ``trace``). ``add_config_flags`` appends the choices and the subcommand's own
default; tests/test_cli_help.py fails on a flag missing here."""

FLAG_HELP = {
    "model": "model preset: tiny, small, base, llama-1b (Llama-style), moe-tiny, moe-small "
             "(mixture of experts), mlp, mlp-tiny (stacked MLP); --init-from-hf picks it itself",
    "n_layers": "override the preset's layer count (0 = the preset's)",
    "tie_embeddings": "share the input embedding with the output head",
    "dropout": "dropout probability on the residual branches (0 = off)",
    "init_from_hf": "start from a local Hugging Face model folder (Llama 3.x, Mistral, Qwen2/3, "
                    "GPT-2, Mixtral): its config.json decides the shape",
    "n_experts": "MoE: routed experts per MoE block (≥ 1; omit for the preset's)",
    "top_k": "MoE: experts each token is sent to (≥ 1; omit for the preset's)",
    "n_shared_experts": "MoE: always-on experts per block (DeepSeekMoE)",
    "moe_every": "MoE: block i is a MoE when i % N == 0 (≥ 1; omit for the preset's)",
    "capacity_factor": "MoE: c > 0 keeps at most ceil(c·k·s/E) token copies per expert per "
                       "sequence (the rest dropped); 0 = dropless",
    "aux_loss_coef": "MoE: α of the load-balancing loss (default: the HF folder's "
                     "router_aux_loss_coef with --init-from-hf, else 0.01)",
    "z_loss_coef": "MoE: β of the router z-loss (default: the HF folder's router_z_loss_coef "
                   "with --init-from-hf, else 0.001)",
    "dp": "data-parallel degree (no degree chosen: the world size; choosing any degree sets "
          "the unchosen ones to 1)",
    "tp": "tensor-parallel degree (splits attention heads and the MLP)",
    "pp": "pipeline-parallel degree (stages)",
    "cp": "context-parallel degree (ranks that split each sequence)",
    "cp_method": "context parallelism: ring (K/V passed around the ring) or allgather",
    "ep": "expert-parallel degree (ranks of dp × cp that share out the experts)",
    "dp_replicate": "HSDP: replicas of the ZeRO-sharded group (dp = dp_replicate × dp_shard)",
    "dp_shard": "HSDP: ranks each replica shards over (0 = dp / dp_replicate)",
    "zero": "ZeRO stage over the dp axis: 0 plain DP, 1 optimizer, 2 + gradients, 3 + "
            "parameters (FSDP)",
    "sp": "sequence parallelism: the norm regions' activations split along the sequence over "
          "the tp ranks (with --tp 2 or more)",
    "schedule": "pipeline schedule (with --pp > 1)",
    "microbatches": "pipeline microbatches per step (0 = derived from the batch and layout)",
    "virtual_stages": "model chunks per pp rank (0 = 2 for interleaved-1f1b, else 1)",
    "layers_per_stage": "explicit pipeline split, e.g. 3,3,2 (empty = balanced)",
    "engine": "explicit (shardwise's own collectives) or torch (DDP/FSDP2/DTensor/pipelining)",
    "collectives": "how collectives run: native (the backend's), ring, tree, or auto (α-β model)",
    "bucket_mb": "DP gradient bucket size, MiB",
    "overlap": "launch gradient collectives during backward",
    "prefetch": "ZeRO-3: all-gather the next unit while this one computes",
    "reshard_after_forward": "ZeRO-3: free gathered parameters after each forward",
    "data": "training data: a .txt/.jsonl/.parquet file or folder (lm), a .jsonl of alpaca "
            "records or chat messages (sft), of prompt/chosen/rejected (dpo); empty = the "
            "embedded corpus",
    "task": "lm (packed text), sft (instruction or chat records, loss on responses only), dpo "
            "(preference pairs)",
    "pack": "sft: put several examples in one row, attention kept within each (document mask, "
            "positions restarting per example)",
    "dpo_beta": "DPO: β of the sigmoid loss",
    "tokenizer": "bpe (train one, or the --init-from-hf folder's), bytes, or a tokenizer .json",
    "vocab_size": "BPE vocabulary size when training one",
    "seq_len": "tokens per sequence (row)",
    "global_batch": "sequences per optimizer step, all dp ranks together",
    "micro_batch": "sequences per forward/backward on one rank (derived when not given)",
    "steps": "optimizer steps",
    "lr": "peak learning rate (AdamW; linear warm-up, cosine decay)",
    "min_lr_ratio": "final learning rate as a fraction of --lr",
    "warmup_steps": "linear warm-up steps",
    "weight_decay": "AdamW weight decay (matrices only)",
    "beta1": "AdamW β1",
    "beta2": "AdamW β2",
    "optimizer": "adamw, or muon: Muon (orthogonalised momentum) on the hidden matrices, AdamW "
                 "on embeddings, head, norms and biases (docs/optimizers.md)",
    "grad_clip": "max global gradient L2 norm (0 = no clipping)",
    "seed": "seed of the initialisation and the data order",
    "dtype": "compute dtype: fp32, or bf16 autocast with fp32 master weights",
    "reduce_dtype": "dtype gradients are reduced in over dp",
    "param_dtype": "dtype the parameters are stored in (bf16: see --master-dtype)",
    "master_dtype": "with --param-dtype bf16: fp32 master weights, gradients and optimizer "
                    "state (Megatron), or none (everything bf16, the guide's FSDP recipe)",
    "offload": "host memory for the optimizer state and master weights (optimizer; the step "
               "runs there), and for ZeRO-3's parameter and gradient shards too (params: "
               "--zero 3)",
    "ac": "activation checkpointing per block",
    "compile": "torch.compile each transformer block",
    "peak_tflops": "MFU: peak dense TFLOP/s of one device (0 = table value or CPU probe)",
    "device": "device the ranks compute on: auto = CUDA when torch sees it (each rank the GPU "
              "of its LOCAL_RANK, NCCL), else CPU (gloo); cpu or cuda force it",
    "out": "run folder (empty = runs/<timestamp>)",
    "log_every": "log (and write metrics.jsonl) every N steps",
    "eval_every": "validation loss every N steps",
    "eval_sequences": "validation sequences per evaluation",
    "save_every": "checkpoint every N steps (0 = only the final one)",
    "keep": "keep only the K newest complete checkpoints (0 = all)",
    "resume": "auto (the newest checkpoint in --out) or a checkpoint/run folder; empty = fresh",
    "async_save": "write checkpoints in the background (dcp.async_save)",
    "allow_data_change": "--resume on data whose fingerprint differs, on purpose",
    "sample_tokens": "tokens sampled from the model at the end (0 = none)",
    "timeout": "process-group timeout, seconds",
    "max_restarts": "local launcher: restart every rank up to N times after a failure",
    "check_collectives": "compare collective fingerprints across ranks at each step, before "
                         "each collective, or not",
    "hang_after": "seconds a rank waits for its peers before it reports a hang (0 = half of "
                  "--timeout)",
    "wandb": "a Weights & Biases project: mirror metrics.jsonl there (offline unless "
             "WANDB_MODE=online; the folder is printed)",
}
