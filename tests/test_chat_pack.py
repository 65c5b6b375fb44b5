"""Chat-format SFT (data/chat.py) and packed SFT (data/pack.py), in one process.

* The masked tokens are exactly the assistant turns, checked by hand on one multi-turn example
  of examples/chat_sample.jsonl, with the built-in template and with a folder's chat template
  rendered by transformers' ``apply_chat_template``.
* ``--pack``: the summed token loss, the token count and every gradient of the packed rows equal
  those of the same examples one per padded row (block-diagonal causal mask, positions restarting
  per example), for RoPE and for learned positions. Tolerance: the parity rule
  (:mod:`shardwise.parity`): both sides compute the same sums in other orders.
The layouts (dp, ZeRO-3, tp, pp) are tests/test_pack_layouts.py.
"""

import json
from pathlib import Path

import pytest
import torch

from shardwise.data import ByteTokenizer
from shardwise.data.chat import TemplateRenderer, encode_segments
from shardwise.data.pack import check_pack, first_fit, pack_examples, unpadded
from shardwise.data.sft import prepare_sft_data, record_segments
from shardwise.errors import ShardwiseConfigError
from shardwise.models import IGNORE_INDEX, Llama, LlamaConfig, lm_loss, positions_kw
from shardwise.parity import ATOL, RTOL

CHAT = Path(__file__).parent.parent / "examples" / "chat_sample.jsonl"
EOS = ByteTokenizer.eos_id
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def spelling_record():
    rec = json.loads(CHAT.read_text().splitlines()[2])  # user, assistant, user, assistant
    assert [m["role"] for m in rec["messages"]] == ["user", "assistant", "user", "assistant"]
    return rec


def targets(tokens, labels):
    """(input position, target id) pairs of a row, and the targets' bytes as text."""
    pos = [t for t in range(len(labels)) if labels[t] != IGNORE_INDEX]
    assert all(labels[t] == tokens[t + 1] for t in pos)
    return pos


def test_builtin_template_targets_exactly_the_assistant_turns_by_hand():
    rec = spelling_record()
    a1, a2 = rec["messages"][1]["content"], rec["messages"][3]["content"]
    tok = ByteTokenizer()
    tokens, labels, kept, n, cut = encode_segments(tok, record_segments(rec, EOS), 256)
    # the rendered row, written out by hand (module docstring of data/chat.py)
    u1, u2 = rec["messages"][0]["content"], rec["messages"][2]["content"]
    head1 = f"<|user|>\n{u1}\n<|assistant|>\n"
    mid = f"\n<|user|>\n{u2}\n<|assistant|>\n"
    want = (list(head1.encode()) + list(a1.encode()) + [EOS] + list(mid.encode())
            + list(a2.encode()) + [EOS] + [ord("\n")])
    assert tokens[:len(want)].tolist() == want and n == len(want) - 1 and not cut
    # targets: token j is a target iff it is an assistant byte or the EOS after it
    first = range(len(head1), len(head1) + len(a1) + 1)
    start2 = len(head1) + len(a1) + 1 + len(mid)
    second = range(start2, start2 + len(a2) + 1)
    expected = sorted(j - 1 for j in [*first, *second])  # label row t predicts token t + 1
    assert targets(tokens.tolist(), labels.tolist()) == expected
    assert kept == len(a1) + len(a2) + 2


def test_folder_chat_template_is_rendered_by_transformers_and_only_assistant_is_a_target(
        tmp_path):
    transformers = pytest.importorskip("transformers")
    from shardwise.interop.hf import write_tokenizer_files

    write_tokenizer_files(ByteTokenizer(), tmp_path, 256)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": CHATML}))
    rec = spelling_record()
    r = TemplateRenderer(tmp_path)
    whole = transformers.AutoTokenizer.from_pretrained(str(tmp_path)).apply_chat_template(
        rec["messages"], tokenize=False)
    tokens, labels, kept, n, _ = encode_segments(ByteTokenizer(),
                                                 r.segments(rec["messages"], "x:3"), 256)
    assert ByteTokenizer().decode(tokens[:n + 1].tolist()) == whole  # the template's own text
    got = bytes(tokens[t + 1] for t in targets(tokens.tolist(), labels.tolist())).decode()
    a1, a2 = rec["messages"][1]["content"], rec["messages"][3]["content"]
    assert got == f"{a1}<|im_end|>\n{a2}<|im_end|>\n"


def test_chat_data_errors_name_the_file_and_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"messages": [{"role": "user", "content": "hi"}, '
                 '{"role": "assistant", "content": "yo"}]}\n\n'
                 '{"messages": [{"role": "user", "content": "only a question"}]}\n')
    with pytest.raises(ShardwiseConfigError, match=r"bad.jsonl:3: no assistant message"):
        prepare_sft_data(f, "bytes", seq_len=64)
    f.write_text('{"messages": [{"role": "bot", "content": "x"}]}\n')
    with pytest.raises(ShardwiseConfigError, match=r"bad.jsonl:1: messages\[0\].*role"):
        prepare_sft_data(f, "bytes", seq_len=64)


def test_first_fit_and_row_layout_by_hand():
    # 5 opens row 0 (room 3), 4 opens row 1 (room 4), 3 fills row 0, 2 joins row 1, 6: new row
    assert first_fit([5, 4, 3, 2, 6], 8) == [[0, 2], [1, 3], [4]]
    p = pack_examples([torch.tensor([1, 2, 3]), torch.tensor([4, 5])],
                      [torch.tensor([2, 3, -100]), torch.tensor([5, 6])], 6, pad_id=9)
    assert p.input_ids.tolist() == [[1, 2, 3, 4, 5, 9]]
    assert p.labels.tolist() == [[2, 3, -100, 5, 6, -100]]
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 1, 0]]
    assert p.document_ids.tolist() == [[0, 0, 0, 1, 1, -1]]
    assert p.padding_fraction == pytest.approx(1 / 6)


@pytest.mark.parametrize("pos", ["rope", "learned"])
def test_packed_loss_count_and_gradients_equal_unpacked(pos):
    seq = 128
    data = prepare_sft_data(CHAT, "bytes", seq_len=seq)
    packed = pack_examples(*unpadded(data.train, data.train_labels, data.train_lengths), seq,
                           EOS)
    assert len(packed) < len(data.train) and packed.examples == len(data.train)
    assert packed.padding_fraction < data.stats["padding_fraction"]
    print(f"padding: one per row {data.stats['padding_fraction']:.1%}, packed "
          f"{packed.padding_fraction:.1%} ({len(data.train)} → {len(packed)} rows)")
    extra = {} if pos == "rope" else dict(pos="learned", norm="layer", mlp="gelu_tanh")
    cfg = LlamaConfig(vocab_size=257, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                      max_seq_len=seq, **extra)
    torch.manual_seed(0)
    model = Llama(cfg)
    runs = []
    for batch in ({"input_ids": data.train[:, :-1], "labels": data.train_labels},
                  {"input_ids": packed.input_ids, "labels": packed.labels,
                   "position_ids": packed.position_ids, "document_ids": packed.document_ids}):
        model.zero_grad()
        loss, count = lm_loss(model(batch["input_ids"], **positions_kw(batch)), batch["labels"])
        (loss / count).backward()  # as training does: the mean over the counted tokens
        runs.append((loss.detach(), int(count),
                     {n: p.grad.clone() for n, p in model.named_parameters()}))
    (lu, cu, gu), (lp, cp, gp) = runs
    assert cu == cp == data.stats["train_response_tokens"]
    torch.testing.assert_close(lp, lu, atol=ATOL, rtol=RTOL)
    for n in gu:
        d = (gp[n] - gu[n]).abs()
        assert bool((d <= ATOL + RTOL * gu[n].abs()).all()), (n, float(d.max()),
                                                                 d.nonzero()[:4].tolist())
    # without the document mask the packed rows compute something else: later examples of a
    # row attend to earlier ones (per-token losses differ far beyond round-off)
    with torch.no_grad():
        kw = positions_kw({"position_ids": packed.position_ids})
        right = model(packed.input_ids, **kw, documents=packed.document_ids)
        wrong = model(packed.input_ids, **kw)
    assert (right - wrong).abs().max() > 1e3 * ATOL


def test_pack_refused_where_a_layout_cannot_take_it():
    check_pack("sft", 1, "explicit")
    check_pack("sft", 2, "explicit")  # cp takes the document mask (test_cp_pack.py)
    with pytest.raises(ShardwiseConfigError, match="--engine torch --cp 2: .*takes no "
                                                   "attention mask.*use --engine explicit"):
        check_pack("sft", 2, "torch")
    with pytest.raises(ShardwiseConfigError, match="--engine torch"):
        check_pack("sft", 1, "torch")
    with pytest.raises(ShardwiseConfigError, match="--task sft"):
        check_pack("lm", 1, "explicit")
