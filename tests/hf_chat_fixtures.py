"""Tokenizer and model folders of four families, built locally (no download): each with its
family's real chat template (tests/fixtures/chat_templates/, README there) and special tokens,
a small byte-level (Llama 3, Qwen2.5, GPT-2) or Metaspace (Mistral) BPE trained here, and
``generation_config.json`` as the family ships it. The vocabularies are ours; the special
tokens, their roles (BOS/EOS/PAD/stop ids), the post-processor's BOS and the templates are the
families'.

``marked_template(family)`` is the real template with ``{% generation %}`` marks added around
exactly the text the segment rule (shardwise.data.chat) calls the assistant's turn; the tests
check that it renders the same text as the real one, so the marks change nothing but the mask.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).parent
TEMPLATES = ROOT / "fixtures" / "chat_templates"
CHAT = ROOT.parent / "examples" / "chat_sample.jsonl"
FAMILIES = ("llama3", "qwen2.5", "mistral", "gpt2")

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>",
                   "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MISTRAL_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]

# what each family's tokenizer_config.json names (Llama 3.2 Instruct, Qwen2.5 Instruct,
# Mistral-7B-Instruct-v0.3, GPT-2) and generation_config.json's eos_token_id list
SPECIAL = {
    "llama3": dict(bos="<|begin_of_text|>", eos="<|eot_id|>", pad=None, unk=None,
                   gen_eos=["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]),
    "qwen2.5": dict(bos=None, eos="<|im_end|>", pad="<|endoftext|>", unk=None,
                    gen_eos=["<|im_end|>", "<|endoftext|>"]),
    "mistral": dict(bos="<s>", eos="</s>", pad=None, unk="<unk>", gen_eos=["</s>"]),
    "gpt2": dict(bos="<|endoftext|>", eos="<|endoftext|>", pad=None, unk="<|endoftext|>",
                 gen_eos=["<|endoftext|>"]),
}


def conversations() -> list[list[dict]]:
    """The ``messages`` of every record of examples/chat_sample.jsonl."""
    return [json.loads(line)["messages"] for line in CHAT.read_text().splitlines()
            if line.strip()]


def real_template(family: str) -> str | None:
    """The family's chat template as its folders ship it (GPT-2: none)."""
    name = {"llama3": "llama3_2.jinja", "qwen2.5": "qwen2_5.jinja",
            "mistral": "mistral_v3.jinja"}.get(family)
    return (TEMPLATES / name).read_text() if name else None


_MARKS = {  # (the real template's text, the same with the assistant's turn marked)
    "llama3": (
        "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
        "+ message['content'] | trim + '<|eot_id|>' }}",
        "{%- if message['role'] == 'assistant' %}"
        "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% generation %}"
        "{{- message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}{%- else %}"
        "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
        "+ message['content'] | trim + '<|eot_id|>' }}{%- endif %}"),
    "qwen2.5": (
        "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}",
        "{%- if message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}{% generation %}"
        "{{- message.content + '<|im_end|>' + '\\n' }}{% endgeneration %}{%- else %}"
        "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
        "{%- endif %}"),
    "mistral": (
        '{{- " " + message["content"]|trim + eos_token}}',
        '{% generation %}{{- " " + message["content"]|trim + eos_token}}{% endgeneration %}'),
}


def marked_template(family: str) -> str:
    """The real template with ``{% generation %}`` around the assistant's turn (module doc)."""
    real = real_template(family)
    old, new = _MARKS[family]
    assert real.count(old) == 1, f"{family}: the template changed; update _MARKS"
    return real.replace(old, new)


def _texts() -> list[str]:
    out = []
    for msgs in conversations():
        out += [m["content"] for m in msgs]
    return out * 4 + ["Below is an instruction that describes a task. The capital of Peru is "
                      "Lima. def main(): return 0"]


def build_tokenizer(family: str):
    """The family's ``transformers.PreTrainedTokenizerFast`` (module doc), not yet saved."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import trainers
    from transformers import PreTrainedTokenizerFast

    sp = SPECIAL[family]
    if family == "mistral":  # sentencepiece-style: ▁ for spaces, <unk> for unseen characters
        tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
        tok.normalizer = normalizers.Sequence([])
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
        trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=MISTRAL_SPECIALS,
                                      show_progress=False)
        tok.train_from_iterator(_texts(), trainer=trainer)
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(_texts(), trainer=trainer)
        tok.add_special_tokens({"llama3": LLAMA3_SPECIALS, "qwen2.5": QWEN_SPECIALS,
                                "gpt2": ["<|endoftext|>"]}[family])
    if sp["bos"] and family in ("llama3", "mistral"):  # tokenizer(text) adds BOS, as theirs
        bos = sp["bos"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    kw = {k: sp[k] for k in ("bos", "eos", "pad", "unk") if sp[k]}
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, **{f"{k}_token": v for k, v in kw.items()},
                                 model_max_length=4096, clean_up_tokenization_spaces=False)
    template = real_template(family)
    if template:
        hf.chat_template = template
    return hf


def write_tokenizer_folder(folder: Path, family: str, template: str | None = "real") -> Path:
    """The family's tokenizer files + ``generation_config.json`` into ``folder``.
    ``template``: ``"real"``, ``"marked"``, None (no chat template) or a Jinja string."""
    hf = build_tokenizer(family)
    if template == "marked":
        hf.chat_template = marked_template(family)
    elif template is None:
        hf.chat_template = None
    elif template != "real":
        hf.chat_template = template
    folder.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(folder))
    sp = SPECIAL[family]
    gen = {"eos_token_id": [hf.convert_tokens_to_ids(t) for t in sp["gen_eos"]]}
    if sp["bos"]:
        gen["bos_token_id"] = hf.convert_tokens_to_ids(sp["bos"])
    if sp["pad"]:
        gen["pad_token_id"] = hf.convert_tokens_to_ids(sp["pad"])
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return folder


def write_model_folder(folder: Path, family: str, template: str | None = "real", seed: int = 0,
                       **config) -> Path:
    """A tiny random model of the family (Llama 3.2-style: llama3 RoPE scaling, tied
    embeddings) with the family's tokenizer: a folder ``--init-from-hf`` and transformers load.
    ``config`` overrides the model config's fields."""
    import torch
    import transformers

    write_tokenizer_folder(folder, family, template)
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    sp = SPECIAL[family]
    ids = dict(vocab_size=len(tok), eos_token_id=tok.convert_tokens_to_ids(sp["eos"]),
               bos_token_id=tok.convert_tokens_to_ids(sp["bos"]) if sp["bos"] else None)
    if family == "gpt2":
        cfg = transformers.GPT2Config(**ids, n_embd=32, n_layer=2, n_head=4, n_positions=512,
                                      **config)
    else:
        common = dict(**ids, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
        if family == "llama3":
            cfg = transformers.LlamaConfig(**common, tie_word_embeddings=True, rope_parameters={
                "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}, **config)
        elif family == "qwen2.5":
            cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True, **config)
        else:
            cfg = transformers.MistralConfig(**common, sliding_window=None, **config)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.generation_config.eos_token_id = json.loads(
        (folder / "generation_config.json").read_text())["eos_token_id"]
    model.save_pretrained(str(folder))
    # save_pretrained rewrites generation_config.json from the model's: keep the family's
    gen = json.loads((folder / "generation_config.json").read_text())
    assert isinstance(gen.get("eos_token_id"), list), gen
    return folder
