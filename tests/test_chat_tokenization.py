"""Issue 50: our rows are the ids the model's own tooling produces.

For tokenizer folders of four families built locally with their real chat templates and special
tokens (tests/hf_chat_fixtures.py), every conversation of examples/chat_sample.jsonl:

* our SFT row's ids equal transformers' ``apply_chat_template(messages, tokenize=True)`` of the
  folder (a fresh ``AutoTokenizer``), padded with the folder's PAD (its EOS where it has none);
* our labels are the next token exactly where transformers' assistant mask says so, the mask
  computed by transformers on a copy of the template with ``{% generation %}`` marks added (the
  copy renders the same text, checked), while our rows come from the real, unmarked template
  (the segment rule); and the targets cover, by hand, exactly each assistant turn's content and
  the family's end-of-turn marker;
* DPO rows, standard and conversational, equal TRL's ``DPOTrainer`` tokenization of the pairs.

Nothing here downloads: the vocabularies are trained here, the templates are files in
tests/fixtures/chat_templates/.
"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra: pip install -e '.[hf]'")

import hf_chat_fixtures as F  # noqa: E402
from shardwise.data.chat import BUILTIN_TEMPLATE, HFChatTemplate  # noqa: E402
from shardwise.data.hf_tokenizer import HFFolderTokenizer  # noqa: E402
from shardwise.data.sft import prepare_sft_data  # noqa: E402
from shardwise.errors import ShardwiseConfigError  # noqa: E402

pytestmark = pytest.mark.timeout(300)
SEQ = 400  # every conversation fits: no truncation, nothing dropped
END = {"llama3": "<|eot_id|>", "qwen2.5": "<|im_end|>\n", "mistral": "</s>",
       "gpt2": "<|endoftext|>"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    out = {}
    for fam in F.FAMILIES:
        out[fam] = F.write_tokenizer_folder(root / fam, fam)
        if fam != "gpt2":
            out[fam, "marked"] = F.write_tokenizer_folder(root / f"{fam}_marked", fam, "marked")
    return out


def _records_file(tmp_path):
    f = tmp_path / "chat.jsonl"
    f.write_text(F.CHAT.read_text())
    return f


def _split(n, val_every=20):
    return [i for i in range(n) if i % val_every != val_every - 1], \
        [i for i in range(n) if i % val_every == val_every - 1]


@pytest.mark.parametrize("family", F.FAMILIES)
def test_sft_rows_equal_apply_chat_template_and_the_assistant_mask(folders, tmp_path, family,
                                                                   cache_dir):
    convs = F.conversations()
    data = prepare_sft_data(_records_file(tmp_path), str(folders[family]), seq_len=SEQ,
                            cache_dir=cache_dir)
    ref_tok = transformers.AutoTokenizer.from_pretrained(folders[family])
    if family == "gpt2":  # no template of its own: ours, whose marks are the generation
        assert ref_tok.chat_template is None and data.stats["template"].startswith("the built-in")
        mask_tok, kw = ref_tok, {"chat_template": BUILTIN_TEMPLATE}
    else:
        assert data.stats["mask_rule"] == "the segment rule"  # the real template has no marks
        mask_tok, kw = transformers.AutoTokenizer.from_pretrained(folders[family, "marked"]), {}
    pad = ref_tok.pad_token_id if ref_tok.pad_token_id is not None else ref_tok.eos_token_id
    train, val = _split(len(convs))
    rows = [(data.train[k], data.train_labels[k], convs[i]) for k, i in enumerate(train)] + \
           [(data.val[k], data.val_labels[k], convs[i]) for k, i in enumerate(val)]
    assert len(rows) == len(convs) == data.stats["train_examples"] + data.stats["val_examples"]
    for tokens, labels, msgs in rows:
        ids = ref_tok.apply_chat_template(msgs, tokenize=True, return_dict=True,
                                          **kw)["input_ids"]
        marked = mask_tok.apply_chat_template(msgs, tokenize=True, return_dict=True,
                                              return_assistant_tokens_mask=True, **kw)
        assert mask_tok.apply_chat_template(msgs, tokenize=False, **kw) == \
            ref_tok.apply_chat_template(msgs, tokenize=False, **kw)  # the marks add no text
        assert marked["input_ids"] == ids
        n = len(ids)
        assert tokens[:n].tolist() == ids and (tokens[n:] == pad).all()
        want = [ids[t + 1] if marked["assistant_masks"][t + 1] else -100 for t in range(n - 1)]
        assert labels[:n - 1].tolist() == want and (labels[n - 1:] == -100).all()
        _assert_targets_are_the_assistant_turns(ref_tok, msgs, ids, want, family, kw)


def _assert_targets_are_the_assistant_turns(tok, msgs, ids, labels, family, kw):
    """By hand: the text the target tokens cover is, turn by turn, the assistant's content
    (as the template writes it: Llama and Mistral trim it) and the family's end marker."""
    text = tok.apply_chat_template(msgs, tokenize=False, **kw)
    offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    target = [False] + [lb != -100 for lb in labels]  # token t + 1 is a target
    runs, cur = [], ""
    for t, (a, b) in enumerate(offsets):
        if target[t]:
            cur += text[a:b]
        elif cur:
            runs.append(cur)
            cur = ""
    runs += [cur] if cur else []
    strip = family in ("llama3", "mistral")
    want = [(m["content"].strip() if strip else m["content"]) + END[family]
            for m in msgs if m["role"] == "assistant"]
    assert [r.lstrip(" ") if family == "mistral" else r for r in runs] == want, (runs, want)


def test_literal_special_token_text_is_read_as_transformers_reads_it(folders):
    """Special-token text inside a message is a special token in the chat row, as transformers'
    apply_chat_template makes it (its default, sanitize_control_tokens=False); in plain text
    (LM documents) it stays text, so a document cannot forge an EOS."""
    tok = HFFolderTokenizer(folders["llama3"])
    msgs = [{"role": "user", "content": "Say <|eot_id|> twice"},
            {"role": "assistant", "content": "<|eot_id|><|eot_id|>"}]
    ids, mask = HFChatTemplate(tok).row(msgs, "x")
    ref = transformers.AutoTokenizer.from_pretrained(folders["llama3"])
    assert ids == ref.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"]
    eot = ref.convert_tokens_to_ids("<|eot_id|>")
    assert ids.count(eot) == 1 + 3 + 2  # the system turn's, the message's 3, two turn ends
    assert eot not in tok.encode("Say <|eot_id|> twice")


@pytest.mark.parametrize("family", F.FAMILIES)
def test_each_family_has_its_own_special_tokens(folders, family):
    """BOS/EOS/PAD as transformers reads them; stop ids = generation_config's eos list + EOS;
    no <|endoftext|> assumption (Llama 3 has none)."""
    tok = HFFolderTokenizer(folders[family])
    ref = transformers.AutoTokenizer.from_pretrained(folders[family])
    gen = transformers.GenerationConfig.from_pretrained(folders[family])
    assert (tok.bos_id, tok.eos_id) == (ref.bos_token_id, ref.eos_token_id)
    assert tok.pad_id == (ref.pad_token_id if ref.pad_token_id is not None else ref.eos_token_id)
    eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
    assert set(tok.stop_ids) == {ref.eos_token_id, *eos}
    assert tok.vocab_size == len(ref)


def test_lm_documents_end_with_the_folders_eos(folders, tmp_path, cache_dir):
    """--task lm on a Llama 3 folder: each document's ids then the folder's EOS (<|eot_id|>)."""
    from shardwise.data import prepare_lm_data

    docs = ["def f(x):\n    return x + 1\n", "The capital of France is Paris.",
            "What is 23 + 5? 28."] * 3
    f = tmp_path / "docs.jsonl"
    f.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    data = prepare_lm_data(str(f), str(folders["llama3"]), seq_len=8, val_every=3,
                           cache_dir=cache_dir)
    ref = transformers.AutoTokenizer.from_pretrained(folders["llama3"])
    eot = ref.convert_tokens_to_ids("<|eot_id|>")
    assert data.tokenizer.eos_id == eot
    stream = data.train.flatten().tolist()  # rows of seq_len + 1, the remainder dropped
    train_docs = [d for i, d in enumerate(docs) if i % 3 != 2]
    want = [t for d in train_docs for t in ref(d, add_special_tokens=False)["input_ids"] + [eot]]
    assert stream == want[:len(stream)] and len(want) - len(stream) < 9


def test_a_template_that_moves_text_between_turns_is_refused_naming_the_line(folders,
                                                                            tmp_path):
    """A template whose prefix renderings are not prefixes of the conversation (here: each
    turn numbered from the end; a two-turn conversation) cannot give the segment rule's spans:
    one line naming FILE:LINE and the fix."""
    bad = ("{% for m in messages %}{{ (messages|length - loop.index)|string + m['content'] }}"
           "{{ eos_token }}{% endfor %}")
    tok = HFFolderTokenizer(folders["gpt2"])
    with pytest.raises(ShardwiseConfigError, match=r"f\.jsonl:7: .*generation"):
        HFChatTemplate(tok, template=bad).row(F.conversations()[2], "--data f.jsonl:7")


def test_dpo_rows_equal_trls_tokenization(folders, tmp_path, cache_dir):
    """Standard (string) pairs and conversational pairs through prepare_dpo_data equal the
    prompt / chosen / rejected ids of TRL's DPOTrainer dataset preparation on the same pairs."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from shardwise.data.dpo import prepare_dpo_data

    folder = folders["llama3"]
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1)
    model, ref_model = transformers.LlamaForCausalLM(cfg), transformers.LlamaForCausalLM(cfg)
    convs = [c for c in F.conversations() if c[-1]["role"] == "assistant"][:6]
    standard = [{"prompt": f"Q: {c[-2]['content']}\nA:", "chosen": " " + c[-1]["content"],
                 "rejected": " I do not know."} for c in convs]
    chat = [{"prompt": c[:-1], "chosen": [c[-1]],
             "rejected": [{"role": "assistant", "content": "I do not know."}]} for c in convs]
    for records in (standard, chat):
        f = tmp_path / "pairs.jsonl"
        f.write_text("".join(json.dumps(r) + "\n" for r in records))
        ours = prepare_dpo_data(f, str(folder), seq_len=SEQ, val_every=100, cache_dir=cache_dir)
        trainer = DPOTrainer(model=model, ref_model=ref_model, processing_class=tok,
                             train_dataset=Dataset.from_list(records),
                             args=DPOConfig(output_dir=str(tmp_path / "trl"), report_to=[],
                                            use_cpu=True, max_length=None))
        ds = trainer.train_dataset
        rows = torch.cat([ours.train, ours.val])
        labels = torch.cat([ours.train_labels, ours.val_labels])
        order = list(range(len(records) - 1)) + [len(records) - 1]  # the last one is val
        for k, i in enumerate(order):
            p = ds[i]["prompt_ids"]
            for j, key in enumerate(("chosen_ids", "rejected_ids")):
                full = p + ds[i][key]
                r, lb = rows[2 * k + j], labels[2 * k + j]
                assert r[:len(full)].tolist() == full, (i, key)
                want = [full[t + 1] if t + 1 >= len(p) else -100 for t in range(len(full) - 1)]
                assert lb[:len(full) - 1].tolist() == want, (i, key)


def test_the_sample_continues_the_template_and_stops_at_any_stop_id(folders, monkeypatch):
    """sample.txt of a chat SFT run: the prompt is the template's ids (special tokens as such),
    and the response ends at the first id of generation_config.json's eos list — here
    <|eom_id|>, which is not the tokenizer's EOS (<|eot_id|>)."""
    from types import SimpleNamespace

    from shardwise.train import workload as W

    tok = HFFolderTokenizer(folders["llama3"])
    prompt = HFChatTemplate(tok).prompt_ids([{"role": "user", "content": "Capital of France?"}])
    eom = tok.hf.convert_tokens_to_ids("<|eom_id|>")
    assert eom in tok.stop_ids and eom != tok.eos_id
    word = tok.hf("Paris", add_special_tokens=False)["input_ids"]
    monkeypatch.setattr(W, "generate", lambda model, ids, n, generator: torch.tensor(
        [ids[0].tolist() + word + [eom] + word]))
    fake = SimpleNamespace(data=SimpleNamespace(tokenizer=tok))
    text = W.LMWorkload.sample_text(fake, torch.nn.Linear(1, 1), SimpleNamespace(
        seed=0, sample_tokens=8), stop_at_eos=True, prompt_ids=prompt)
    assert text == tok.hf.decode(prompt + word, skip_special_tokens=False)
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\nParis")
