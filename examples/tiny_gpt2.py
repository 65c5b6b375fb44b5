"""Make a tiny GPT-2 folder and an alpaca-style file to fine-tune it on, with nothing downloaded.

    python -m examples.tiny_gpt2 OUT_DIR [--records 400] [--vocab 512] [--seed 0]

writes ``OUT_DIR/alpaca.jsonl`` (instruction/input/output records of four small tasks: add two
numbers, reverse a word, upper-case a word, name a number's parity) and ``OUT_DIR/gpt2/``: a
randomly initialised ``GPT2LMHeadModel`` (n_embd 64, 4 layers, 4 heads, 256 positions; built by
transformers, ``save_pretrained``) with a byte-level BPE ``tokenizer.json`` trained on the
records by the ``tokenizers`` library (``<|endoftext|>`` as EOS, GPT-2's). Then::

    shardwise train --task sft --init-from-hf OUT_DIR/gpt2 --data OUT_DIR/alpaca.jsonl \\
        --dp 2 --steps 50 --seq-len 96

The guide's command, on a model small enough for a CPU. Needs the ``hf`` extra (transformers).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = ("apple", "river", "stone", "cloud", "tiger", "paper", "green", "light", "music",
         "table", "water", "horse", "bread", "chair", "dream", "smile", "ocean", "plant")


def records(n: int, seed: int) -> list[dict]:
    """``n`` alpaca-style records of four deterministic tasks (a model can learn them)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            a, b = rng.randint(0, 50), rng.randint(0, 50)
            out.append({"instruction": "Add the two numbers.", "input": f"{a} and {b}",
                        "output": f"{a} + {b} = {a + b}."})
        elif kind == 1:
            w = rng.choice(WORDS)
            out.append({"instruction": "Reverse the word.", "input": w, "output": w[::-1]})
        elif kind == 2:
            w = rng.choice(WORDS)
            out.append({"instruction": "Write the word in capital letters.", "input": w,
                        "output": w.upper()})
        else:
            k = rng.randint(0, 99)
            out.append({"instruction": "Is the number even or odd?", "input": str(k),
                        "output": f"{k} is {'even' if k % 2 == 0 else 'odd'}."})
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--records", type=int, default=400)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from shardwise.data.sft import PROMPT_WITH_INPUT

    args.out.mkdir(parents=True, exist_ok=True)
    rows = records(args.records, args.seed)
    data = args.out / "alpaca.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))

    # a GPT-2-style byte-level BPE trained on the records' full texts
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((PROMPT_WITH_INPUT.format(**r) + r["output"] for r in rows),
                            trainer=trainer)
    eos = tok.token_to_id("<|endoftext|>")

    torch.manual_seed(args.seed)
    cfg = transformers.GPT2Config(vocab_size=tok.get_vocab_size(), n_positions=256, n_embd=64,
                                  n_layer=4, n_head=4, bos_token_id=eos, eos_token_id=eos)
    folder = args.out / "gpt2"
    transformers.GPT2LMHeadModel(cfg).save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
        "bos_token": "<|endoftext|>", "model_max_length": 256}, indent=2))
    print(f"wrote {data} ({len(rows)} records) and {folder} (vocab {tok.get_vocab_size()}, "
          f"{sum(p.numel() for p in transformers.GPT2LMHeadModel(cfg).parameters()):,} "
          "parameters)")


if __name__ == "__main__":
    main()
