"""What a run trains on: packed text for the Llama-style models (``--task lm``), alpaca-style
instruction records with the prompt masked (``--task sft``, :mod:`shardwise.data.sft`), or the
synthetic regression set for the stacked-MLP model. All expose the same small interface to the
loop; :func:`load_workload` picks one from ``--model`` and ``--task``.

With ``--init-from-hf DIR`` the model's vocabulary is the HF model's (``vocab_size`` in its
config.json, which must hold every id of the tokenizer), and ``--tokenizer bpe`` (the default)
means the folder's own ``tokenizer.json`` when it has one."""

from __future__ import annotations

import os

import torch

from ..config import TrainConfig
from ..data import DistributedSampler, prepare_lm_data
from ..errors import ShardwiseConfigError
from ..models import IGNORE_INDEX, MLP_PRESETS, MLPConfig, generate, regression_data


class LMWorkload:
    """Packed token sequences ``[n, seq_len + 1]`` (inputs ``[:, :-1]``, labels ``[:, 1:]``)."""

    kind = "lm"

    def __init__(self, cfg: TrainConfig):
        spec = tokenizer_spec(cfg.tokenizer, cfg.init_from_hf)
        self.data = prepare_lm_data(cfg.data or None, spec, cfg.vocab_size, cfg.seq_len,
                                    min_train_sequences=cfg.global_batch)
        self.vocab_size = model_vocab(cfg.init_from_hf, spec, self.data.vocab_size)
        self.num_train, self.num_val = len(self.data.train), len(self.data.val)
        src = cfg.data or "embedded stdlib corpus"
        self.description = (f"{src} ({self.num_train:,} train / {self.num_val:,} val sequences, "
                            f"tokenizer {cfg.tokenizer}, vocab {self.vocab_size})")

    def model_overrides(self, cfg: TrainConfig) -> dict:
        return {"tie_embeddings": cfg.tie_embeddings, "dropout": cfg.dropout,
                **cfg.model_overrides()}

    def sampler(self, global_batch, dp_size, dp_rank, seed) -> DistributedSampler:
        return DistributedSampler(self.num_train, global_batch, dp_size, dp_rank, seed)

    def batches(self, indices: torch.Tensor, micro_batch: int, split: str = "train") -> list[dict]:
        """Rows ``indices`` of ``split`` cut into micro-batches (the last may be smaller)."""
        rows = (self.data.train if split == "train" else self.data.val).index_select(0, indices)
        return [{"input_ids": c[:, :-1].contiguous(), "labels": c[:, 1:].contiguous()}
                for c in rows.split(micro_batch)]

    def sample_text(self, model, cfg: TrainConfig, prompt: str = "def ",
                    stop_at_eos: bool = False, prompt_ids: list[int] | None = None) -> str:
        """A short continuation of ``prompt`` (or of ``prompt_ids``, a chat prompt with the
        template's special tokens) sampled from ``model`` (seeded, so reproducible); with
        ``stop_at_eos`` cut at the first stop id it samples (an SFT response ends there: the
        EOS, and for a model folder's tokenizer also generation_config.json's eos ids)."""
        tok = self.data.tokenizer
        ids = torch.tensor([prompt_ids or tok.encode(prompt)], dtype=torch.long,
                           device=next(model.parameters()).device)
        g = torch.Generator(device=ids.device).manual_seed(cfg.seed)
        out = generate(model, ids, cfg.sample_tokens, generator=g)[0].tolist()
        new = out[ids.shape[1]:]
        stops = set(getattr(tok, "stop_ids", (tok.eos_id,)))
        first = next((j for j, t in enumerate(new) if t in stops), None)
        if stop_at_eos and first is not None:
            out = out[:ids.shape[1] + first]
        if prompt_ids:  # show the template's own tokens (<|start_header_id|>, [INST], ...)
            return tok.hf.decode(out, skip_special_tokens=False)
        return tok.decode(out)


class RegressionWorkload:
    """Synthetic regression for the stacked-MLP model: ``{"inputs", "targets"}`` rows [b, D]."""

    kind = "regression"
    vocab_size = 0

    def __init__(self, cfg: TrainConfig, num_train: int = 4096, num_val: int = 512,
                 overrides: dict | None = None):
        mcfg = MLPConfig(**{**MLP_PRESETS[cfg.model], **(overrides or {})})
        data = regression_data(mcfg, num_train + num_val, seed=cfg.seed)
        self.train = {k: v[:num_train] for k, v in data.items()}
        self.val = {k: v[num_train:] for k, v in data.items()}
        self.num_train, self.num_val = num_train, num_val
        self.description = f"synthetic regression (D={mcfg.d_model}, {num_train} samples)"

    def model_overrides(self, cfg: TrainConfig) -> dict:
        return cfg.model_overrides()

    def sampler(self, global_batch, dp_size, dp_rank, seed) -> DistributedSampler:
        return DistributedSampler(self.num_train, global_batch, dp_size, dp_rank, seed)

    def batches(self, indices, micro_batch, split="train"):
        src = self.train if split == "train" else self.val
        rows = {k: v.index_select(0, indices) for k, v in src.items()}
        return [dict(zip(rows, parts)) for parts in zip(*(v.split(micro_batch)
                                                           for v in rows.values()))]

    def sample_text(self, model, cfg):
        return None


def tokenizer_spec(tokenizer: str, init_from_hf: str = "") -> str:
    """``--tokenizer``, except that with ``--init-from-hf DIR`` the default ``bpe`` means the
    folder's own tokenizer (the folder: its ids, special tokens and chat template, as
    transformers loads them; :class:`~shardwise.data.hf_tokenizer.HFFolderTokenizer`).

    Raises :class:`ShardwiseConfigError` when that folder has no tokenizer a new BPE could stand
    in for (its ids would mean nothing to the model) unless ``--tokenizer`` names one, and for a
    folder with only GPT-2's slow-tokenizer files."""
    if tokenizer != "bpe" or not init_from_hf:
        return tokenizer
    from ..data.hf_tokenizer import is_tokenizer_folder

    if os.path.isfile(os.path.join(init_from_hf, "tokenizer.json")):
        return init_from_hf
    if all(os.path.isfile(os.path.join(init_from_hf, f)) for f in ("vocab.json", "merges.txt")):
        raise ShardwiseConfigError(
            f"--init-from-hf {init_from_hf}: the folder has vocab.json + merges.txt but no "
            "tokenizer.json, and a new BPE would not mean the model's ids: write it with "
            "python -c \"from transformers import AutoTokenizer as T; "
            f"T.from_pretrained('{init_from_hf}').save_pretrained('{init_from_hf}')\", "
            "or pass --tokenizer FILE.json")
    if is_tokenizer_folder(init_from_hf):  # tokenizer.model only: transformers converts it
        return init_from_hf
    raise ShardwiseConfigError(
        f"--init-from-hf {init_from_hf}: the folder has no tokenizer (tokenizer.json), and a BPE "
        "trained here would give ids that mean nothing to the model: copy the model's "
        "tokenizer files into the folder, or pass --tokenizer DIR|FILE.json|bytes to choose one "
        "knowing its ids must match the model's")


def model_vocab(init_from_hf: str, tokenizer: str, tokenizer_vocab: int) -> int:
    """Rows of the model's embedding: the tokenizer's vocabulary (``tokenizer`` its spec, for
    the message), or with ``--init-from-hf`` the HF model's (which must cover every tokenizer
    id; else :class:`ShardwiseConfigError`)."""
    if not init_from_hf:
        return tokenizer_vocab
    from ..interop.hf import hf_model_overrides

    hf_vocab = hf_model_overrides(init_from_hf)["vocab_size"]
    if tokenizer_vocab > hf_vocab:
        raise ShardwiseConfigError(
            f"--init-from-hf {init_from_hf}: the tokenizer ({tokenizer}) has "
            f"{tokenizer_vocab} ids but the model only {hf_vocab} embeddings: use the model's own "
            "tokenizer (--tokenizer DIR/tokenizer.json)")
    return hf_vocab


class SFTWorkload(LMWorkload):
    """Alpaca or chat records, prompt targets masked (see :mod:`shardwise.data.sft`,
    :mod:`shardwise.data.chat`): ``input_ids`` [b, seq_len], ``labels`` [b, seq_len] with
    ``IGNORE_INDEX`` on prompt and padding positions, so the loss is the mean over response
    tokens of the global batch. One example per padded row, or with ``--pack`` several per row
    (:mod:`shardwise.data.pack`: the batches also carry ``position_ids`` and ``document_ids``,
    and a sequence of ``--global-batch`` is a packed row)."""

    kind = "lm"

    def __init__(self, cfg: TrainConfig):
        from ..data.sft import prepare_sft_data

        spec = tokenizer_spec(cfg.tokenizer, cfg.init_from_hf)
        self.data = prepare_sft_data(cfg.data, spec, cfg.vocab_size, cfg.seq_len,
                                     template_dir=cfg.init_from_hf or None)
        self.vocab_size = model_vocab(cfg.init_from_hf, spec, self.data.vocab_size)
        self.packed = None
        st = self.data.stats
        if cfg.pack:
            from ..data.pack import pack_examples, unpadded

            d = self.data
            pad = getattr(d.tokenizer, "pad_id", d.tokenizer.eos_id)
            self.packed = {
                split: pack_examples(*unpadded(tok, lab, n), cfg.seq_len, pad)
                for split, tok, lab, n in (("train", d.train, d.train_labels, d.train_lengths),
                                           ("val", d.val, d.val_labels, d.val_lengths))}
            self.num_train, self.num_val = len(self.packed["train"]), len(self.packed["val"])
            rows = (f"{st['train_examples']:,} train examples packed into {self.num_train:,} rows "
                    f"({self.packed['train'].padding_fraction:.0%} padding, was "
                    f"{st['padding_fraction']:.0%} one per row)")
        else:
            self.num_train, self.num_val = len(self.data.train), len(self.data.val)
            rows = (f"{self.num_train:,} train / {self.num_val:,} val examples, one per padded "
                    f"sequence: {st['padding_fraction']:.0%} padding")
        if self.num_train < cfg.global_batch:
            what = "packed rows" if cfg.pack else "training examples"
            raise ShardwiseConfigError(
                f"--global-batch {cfg.global_batch} needs {cfg.global_batch} {what} but "
                f"--data {cfg.data} gives {self.num_train}: lower --global-batch or add records")
        fmt = st.get("format", "alpaca")
        self.description = (
            f"SFT {cfg.data} ({fmt}" + (f", {st['template']}, labels by {st['mask_rule']}"
                                        if fmt == "chat" else "")
            + f"; {rows}; {st['train_dropped']} dropped (prompt > seq-len), {st['truncated']} "
            f"truncated; tokenizer {spec}, vocab {self.data.vocab_size})")

    def padding_fraction(self) -> float:
        """Share of the training rows' positions that are padding (compute spent on nothing)."""
        if self.packed is not None:
            return self.packed["train"].padding_fraction
        return self.data.stats["padding_fraction"]

    def batches(self, indices: torch.Tensor, micro_batch: int, split: str = "train") -> list[dict]:
        """Rows ``indices`` of ``split``: ``{"input_ids", "labels"}`` micro-batches (packed:
        also ``position_ids`` and ``document_ids``)."""
        if self.packed is not None:
            p = self.packed[split]
            cols = {"input_ids": p.input_ids, "labels": p.labels, "position_ids": p.position_ids,
                    "document_ids": p.document_ids}
            rows = {k: v.index_select(0, indices) for k, v in cols.items()}
            return [dict(zip(rows, parts)) for parts in zip(*(v.split(micro_batch)
                                                               for v in rows.values()))]
        rows = (self.data.train if split == "train" else self.data.val).index_select(0, indices)
        labels = (self.data.train_labels if split == "train"
                  else self.data.val_labels).index_select(0, indices)
        return [{"input_ids": r[:, :-1].contiguous(), "labels": lb.contiguous()}
                for r, lb in zip(rows.split(micro_batch), labels.split(micro_batch))]

    def sample_text(self, model, cfg: TrainConfig, prompt: str | None = None) -> str:
        """The model's response to the first validation prompt (seeded), up to its first stop
        id; a chat prompt of a model folder's tokenizer is its template's ids."""
        ids = self.data.prompt_ids[0] if self.data.prompt_ids and prompt is None else None
        return super().sample_text(model, cfg, prompt=prompt or self.data.prompts[0],
                                   stop_at_eos=True, prompt_ids=ids)


class PairSampler(DistributedSampler):
    """A :class:`~shardwise.data.DistributedSampler` over *pairs* whose epoch counts are given
    in rows (two per pair), like every other workload's sequences."""

    def epoch_counts(self) -> dict[str, int]:
        return {k: 2 * v if k != "steps_per_epoch" else v
                for k, v in super().epoch_counts().items()}


class DPOWorkload(LMWorkload):
    """Preference pairs (:mod:`shardwise.data.dpo`): rows ``[2n, seq_len + 1]``, pair ``i`` in
    rows ``2i`` (chosen) and ``2i + 1`` (rejected). ``--global-batch`` and ``--micro-batch``
    count rows (sequences), so each must hold whole pairs (:func:`shardwise.config.validate`);
    the sampler draws ``global_batch / 2`` pairs a step, ``global_batch / (2·dp)`` per dp rank.
    The frozen reference and what the loop does with it are :mod:`.dpo`'s
    (:class:`~.dpo.DPOReference`, which the loop keeps in ``reference``)."""

    kind = "lm"

    def __init__(self, cfg: TrainConfig):
        from ..data.dpo import prepare_dpo_data

        spec = tokenizer_spec(cfg.tokenizer, cfg.init_from_hf)
        self.data = prepare_dpo_data(cfg.data, spec, cfg.vocab_size, cfg.seq_len)
        self.vocab_size = model_vocab(cfg.init_from_hf, spec, self.data.vocab_size)
        self.num_train, self.num_val = len(self.data.train), len(self.data.val)  # rows
        self.beta, self.reference = cfg.dpo_beta, None  # reference: set by the loop
        if self.num_train < cfg.global_batch:
            raise ShardwiseConfigError(
                f"--global-batch {cfg.global_batch} sequences = {cfg.global_batch // 2} pairs a "
                f"step, but --data {cfg.data} has {self.num_train // 2} training pairs: lower "
                "--global-batch or add records")
        st = self.data.stats
        self.description = (
            f"DPO {cfg.data} ({st['train_pairs']:,} train / {st['val_pairs']:,} val pairs, two "
            f"padded rows each: {st['response_fraction']:.0%} response targets, "
            f"{st['truncated']} responses truncated; β = {self.beta}; tokenizer "
            f"{spec}, vocab {self.data.vocab_size})")

    def sampler(self, global_batch, dp_size, dp_rank, seed) -> DistributedSampler:
        return PairSampler(self.num_train // 2, global_batch // 2, dp_size, dp_rank, seed)

    def batches(self, indices: torch.Tensor, micro_batch: int, split: str = "train") -> list[dict]:
        """Pairs ``indices`` of ``split`` as ``{"input_ids", "labels"}`` micro-batches of
        ``micro_batch`` rows (``micro_batch / 2`` pairs; the last may hold fewer), chosen and
        rejected adjacent. Raises ShardwiseConfigError for an odd ``micro_batch``."""
        if micro_batch % 2:
            raise ShardwiseConfigError(f"a DPO micro-batch of {micro_batch} rows would split a "
                                       "(chosen, rejected) pair: choose an even --micro-batch")
        rows = torch.stack([2 * indices, 2 * indices + 1], 1).flatten()  # [c0, r0, c1, r1, …]
        tokens = (self.data.train if split == "train" else self.data.val).index_select(0, rows)
        labels = (self.data.train_labels if split == "train"
                  else self.data.val_labels).index_select(0, rows)
        return [{"input_ids": r[:, :-1].contiguous(), "labels": lb.contiguous()}
                for r, lb in zip(tokens.split(micro_batch), labels.split(micro_batch))]

    def sample_text(self, model, cfg: TrainConfig, prompt: str | None = None) -> str:
        """The model's continuation of the first validation prompt (seeded); with a model
        folder's tokenizer the prompt's own ids (TRL's), cut at the first stop id."""
        ids = self.data.prompt_ids[0] if self.data.prompt_ids and prompt is None else None
        return super().sample_text(model, cfg, prompt=prompt or self.data.prompts[0],
                                   stop_at_eos=ids is not None, prompt_ids=ids)


def load_workload(cfg: TrainConfig):
    """The data for ``cfg.model`` and ``cfg.task``: regression for the MLP, SFT records for
    ``--task sft``, preference pairs for ``--task dpo``, else packed text. Raises
    ShardwiseConfigError on bad data (before any collective: it reads files and the token cache
    only)."""
    if cfg.model in MLP_PRESETS:
        return RegressionWorkload(cfg)
    if cfg.task == "sft":
        return SFTWorkload(cfg)
    if cfg.task == "dpo":  # preference pairs (the frozen reference: train/dpo.py)
        return DPOWorkload(cfg)
    return LMWorkload(cfg)


class SyntheticLMWorkload(LMWorkload):
    """Random token sequences for parity checks (no files): vocab ``vocab_size`` (default 67, which
    no small dp/tp degree divides), and labels masked with :data:`IGNORE_INDEX` over a random
    prefix of each sequence, so sequences count very different numbers of tokens (from
    ``seq_len`` down to 1) — the case where a mean of per-rank means would be wrong."""

    def __init__(self, vocab_size: int = 67, seq_len: int = 16, num_train: int = 256,
                 num_val: int = 32, seed: int = 0):
        from types import SimpleNamespace

        g = torch.Generator().manual_seed(seed + 99)
        rows = torch.randint(0, vocab_size, (num_train + num_val, seq_len + 1), generator=g)
        self.data = SimpleNamespace(train=rows[:num_train], val=rows[num_train:], tokenizer=None)
        self.masked = torch.randint(0, seq_len, (num_train + num_val,), generator=g)
        self.vocab_size, self.num_train, self.num_val = vocab_size, num_train, num_val
        self.description = f"synthetic tokens (vocab {vocab_size}, seq {seq_len})"

    def batches(self, indices, micro_batch, split="train"):
        out = super().batches(indices, micro_batch, split)
        offset = 0 if split == "train" else self.num_train
        masked = self.masked[indices + offset]
        pos = torch.arange(out[0]["labels"].shape[1]) if out else None
        for mb, m in zip(out, masked.split(micro_batch)):
            mb["labels"] = mb["labels"].masked_fill(pos[None, :] < m[:, None], IGNORE_INDEX)
        return out

    def sample_text(self, model, cfg):
        return None
