"""Export keeps a model folder's tokenizer whole (issue 50), and an import → export round trip with
no optimizer step in between gives the original's next-token distributions.

The folders are tests/hf_chat_fixtures.py's Llama 3.2, Qwen2.5, Mistral v0.3 and GPT-2 folders
(each family's real chat template, special tokens and generation_config.json eos list; a tiny
random model; built here once per module, no download), with their weights redrawn at the scale
tests/test_hf_families.py uses (matrices ~0.1, norms in [0.5, 1.5)), so that the next-token
distributions are far from uniform and a misplaced tensor shows.

* The round trip: the folder imported into our model (``load_hf_weights``, as ``--init-from-hf``
  does), written as training writes a checkpoint (DCP ``model`` dict + ``meta.json``, as
  tests/test_hf_llama3.py), exported with ``export_hf``: no optimizer step, so the exported
  tensors are bitwise the original's (checked).
* The train-start copy: one CLI run (``--task sft``, 1 step) from a copy of the Llama folder,
  which is then deleted: export ships ``RUN/tokenizer/``.

Checked in transformers against the original folder: (a) ``apply_chat_template`` ids of every
conversation of examples/chat_sample.jsonl, BOS/EOS/PAD, the generation_config eos list,
config.json's bos/eos/pad ids, every tokenizer file byte for byte; (b) ``generate`` stops at each
id of the family's eos list (a processor forces that id at the third new token: generation must
end there, which it does only because the exported generation_config lists it; with the tokenizer's
single EOS instead, the Llama and Qwen extra stop ids do not end it); (c) KL(original ‖ round trip)
≤ 1e-9 on real text (chat conversations rendered by the template and a stretch of the Python
stdlib's source) and max |Δlogits| within the parity rule (|Δ| ≤ ATOL + RTOL·|ref|,
:mod:`shardwise.parity`), for the exported folder and for our imported model.
"""

import dataclasses
import json
import shutil
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import run_cli

transformers = pytest.importorskip("transformers", reason="the hf extra: pip install -e '.[hf]'")

sys.path.insert(0, str(Path(__file__).parent))
import hf_chat_fixtures as fx  # noqa: E402

from shardwise.config import TrainConfig  # noqa: E402
from shardwise.data.hf_tokenizer import TOKENIZER_FILES  # noqa: E402
from shardwise.errors import ShardwiseConfigError  # noqa: E402
from shardwise.interop.hf import (  # noqa: E402
    export_hf,
    hf_to_llama_config,
    load_hf_weights,
    model_for,
    read_hf_config,
)
from shardwise.parity import ATOL, RTOL, kl_divergence  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
KL_BOUND = 1e-9
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _randomize(folder: Path, seed: int) -> None:
    """Redraw the folder's weights in place (model.safetensors only; every other file kept)."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for name, t in sorted(state.items()):
        if name.endswith("bias"):
            state[name] = torch.randn(t.shape, generator=g) * 0.1
        elif t.dim() == 1:
            state[name] = torch.rand(t.shape, generator=g) + 0.5
        else:
            state[name] = torch.randn(t.shape, generator=g) * 0.1
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _round_trip(root: Path, src: Path):
    """HF folder → our model → a checkpoint written as training writes it → export_hf. Returns
    (our imported model, the exported folder)."""
    import torch.distributed.checkpoint as dcp

    cfg = hf_to_llama_config(read_hf_config(src))
    ours = model_for(cfg).eval()
    load_hf_weights(ours, src)
    step = root / "run" / "checkpoints" / "step_1"
    dcp.save({"model": {k: v.detach() for k, v in ours.named_parameters()}},
             checkpoint_id=str(step), no_dist=True)
    run = dataclasses.replace(TrainConfig(), init_from_hf=str(src))  # --tokenizer bpe: the folder's
    (step / "meta.json").write_text(json.dumps({"step": 1, "config": dataclasses.asdict(run),
                                                "model_config": dataclasses.asdict(cfg)}))
    (step.parent / "latest").write_text("step_1\n")
    return ours, export_hf(root / "run", root / "hf")


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """family → (original folder, our imported model, exported folder)."""
    root = tmp_path_factory.mktemp("export_tok")
    out = {}
    for i, family in enumerate(fx.FAMILIES):
        src = fx.write_model_folder(root / family / "src", family)
        _randomize(src, seed=10 + i)
        out[family] = (src, *_round_trip(root / family, src))
    return out


def _tok(folder):
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def _model(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder),
                                                             dtype=torch.float32).eval()


def _chat_ids(tok, conv, **kw) -> list[int]:
    return list(tok.apply_chat_template(conv, tokenize=True, **kw)["input_ids"])


def assert_same_tokenizer(src: Path, out: Path) -> None:
    """(a): the exported folder's tokenizer is the original's, as transformers loads it."""
    for name in TOKENIZER_FILES:  # every file as it is
        assert (out / name).is_file() == (src / name).is_file(), name
        if (src / name).is_file():
            assert (out / name).read_bytes() == (src / name).read_bytes(), name
    a, b = _tok(src), _tok(out)
    assert (b.bos_token_id, b.eos_token_id, b.pad_token_id) == (
        a.bos_token_id, a.eos_token_id, a.pad_token_id)
    assert b.chat_template == a.chat_template
    if a.chat_template:
        for conv in fx.conversations():
            assert _chat_ids(b, conv) == _chat_ids(a, conv)
            assert _chat_ids(b, conv[:-1], add_generation_prompt=True) == _chat_ids(
                a, conv[:-1], add_generation_prompt=True)
    else:  # GPT-2: no template (apply_chat_template raises for both); plain text
        text = "\n".join(m["content"] for m in fx.conversations()[0])
        assert b(text)["input_ids"] == a(text)["input_ids"]
    gen = [json.loads((f / "generation_config.json").read_text()) for f in (src, out)]
    assert gen[1] == gen[0] and isinstance(gen[0]["eos_token_id"], list)
    cfg = [json.loads((f / "config.json").read_text()) for f in (src, out)]
    assert {k: cfg[1].get(k, "absent") for k in SPECIAL_IDS} == {
        k: cfg[0].get(k, "absent") for k in SPECIAL_IDS}


@pytest.mark.parametrize("family", fx.FAMILIES)
def test_export_ships_the_folders_tokenizer_whole(families, family):
    src, _, out = families[family]
    assert_same_tokenizer(src, out)
    # the model generates with the folder's eos list and config ids
    a, b = _model(src), _model(out)
    assert b.generation_config.eos_token_id == a.generation_config.eos_token_id
    assert b.generation_config.bos_token_id == a.generation_config.bos_token_id
    assert [getattr(b.config, k) for k in SPECIAL_IDS] == [getattr(a.config, k)
                                                           for k in SPECIAL_IDS]


class ForceAt(transformers.LogitsProcessor):
    """Greedy, except that the ``k``-th new token (0-based) is ``token``."""

    def __init__(self, prompt_len: int, k: int, token: int):
        self.at, self.token = prompt_len + k, token

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] == self.at:
            scores = torch.full_like(scores, -float("inf"))
            scores[:, self.token] = 0.0
        return scores


def _generate(model, prompt: list[int], **kw) -> list[int]:
    x = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=24, **kw)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", ["llama3", "qwen2.5", "mistral"])
def test_generate_on_the_export_stops_at_each_of_the_familys_stop_ids(families, family):
    """(b): forced to emit a stop id at its third new token, ``generate`` with the exported
    folder's own generation_config ends right there (its first stop id), for every id of the
    family's eos list; the ids beside the tokenizer's EOS (Llama's <|end_of_text|>, <|eom_id|>,
    Qwen's <|endoftext|>) end it only through that list."""
    src, _, out = families[family]
    tok, model = _tok(out), _model(out)
    prompt = _chat_ids(tok, fx.conversations()[0][:-1], add_generation_prompt=True)
    stops = model.generation_config.eos_token_id
    assert stops == json.loads((src / "generation_config.json").read_text())["eos_token_id"]
    for stop in stops:
        new = _generate(model, prompt, logits_processor=[ForceAt(len(prompt), 2, stop)])
        first = next(j for j, t in enumerate(new) if t in stops)
        assert first <= 2 and len(new) == first + 1, (stop, new)
        if stop != tok.eos_token_id and len(new) == 3:  # forced, not met earlier: the list
            single = _generate(model, prompt, logits_processor=[ForceAt(len(prompt), 2, stop)],
                               eos_token_id=tok.eos_token_id)
            assert single[2] == stop and len(single) > 3, (stop, single)


def _real_text(tok) -> list[list[int]]:
    """Chat conversations rendered by the template (GPT-2: their text) and a stretch of the
    Python stdlib's source (textwrap.py), as token ids of the original tokenizer."""
    convs = fx.conversations()[:4]
    seqs = ([_chat_ids(tok, c) for c in convs] if tok.chat_template else
            [tok("\n".join(m["content"] for m in c))["input_ids"] for c in convs])
    source = Path(textwrap.__file__).read_text()[:3000]
    seqs.append(tok(source)["input_ids"])
    return [s[:512] for s in seqs]  # the fixtures' context


@pytest.mark.parametrize("family", fx.FAMILIES)
def test_round_trip_kl_divergence_and_logits(families, family, capsys):
    """(c): original folder vs import → export (no step): the exported tensors are bitwise the
    original's; KL(original ‖ round trip) ≤ 1e-9 and |Δlogits| within the parity rule, for the
    exported folder in transformers and for our imported model."""
    src, ours, out = families[family]
    a, b = _model(src), _model(out)
    want = a.state_dict()
    for k, v in b.state_dict().items():
        assert torch.equal(v, want[k]), k
    logits = {"orig": [], "export": [], "ours": []}
    with torch.no_grad():
        for ids in _real_text(_tok(src)):
            x = torch.tensor([ids])
            logits["orig"].append(a(x).logits[0])
            logits["export"].append(b(x).logits[0])
            logits["ours"].append(ours(x)[0])
    ref = torch.cat(logits["orig"])  # [positions, vocab]
    assert ref.shape[0] > 500 and float(ref.std()) > 0.5  # real text, far from uniform
    for name in ("export", "ours"):
        got = torch.cat(logits[name])
        kl = kl_divergence(ref, got)
        diff = (got - ref).abs()
        with capsys.disabled():
            print(f"\n{family} {name}: KL(original ‖ {name}) = {kl:.3g}, max |Δlogits| = "
                  f"{float(diff.max()):.3g} over {ref.shape[0]} positions")
        assert abs(kl) <= KL_BOUND, (name, kl)
        assert bool((diff <= ATOL + RTOL * ref.abs()).all()), (name, float(diff.max()))


@pytest.mark.timeout(120)
def test_the_run_folder_copy_is_exported_after_the_source_folder_is_gone(families, cache_dir,
                                                                         tmp_path):
    """A real CLI run (--task sft, 1 step) from a copy of the Llama folder: rank 0 saves the
    tokenizer files, generation_config.json and config.json into RUN/tokenizer/ at the start; the
    source folder is then deleted, and export ships the copy, equal to the original."""
    orig = families["llama3"][0]
    src = tmp_path / "llama3"
    shutil.copytree(orig, src)
    run = tmp_path / "run"
    p = run_cli(["train", "--task", "sft", "--init-from-hf", src, "--data", fx.CHAT, "--dp", "1",
                 "--steps", "1", "--seq-len", "128", "--global-batch", "2", "--micro-batch", "2",
                 "--eval-sequences", "2", "--sample-tokens", "0", "--out", run], cache_dir,
                timeout=100)
    assert p.returncode == 0, p.stdout
    copy = run / "tokenizer"
    assert sorted(f.name for f in copy.iterdir()) == sorted(
        f.name for f in src.iterdir() if f.name != "model.safetensors")
    shutil.rmtree(src)
    p = run_cli(["export", "--checkpoint", run, "--to", "hf", tmp_path / "hf"], cache_dir,
                timeout=60)
    assert p.returncode == 0, p.stdout
    assert_same_tokenizer(orig, tmp_path / "hf")


def test_without_a_copy_a_gone_folder_is_refused_naming_the_flag(families, tmp_path):
    """A run whose tokenizer folder is gone, with no RUN/tokenizer/ (an earlier version's run):
    export refuses instead of training a BPE that would give the ids other meanings; with
    ``--tokenizer DIR`` it ships that folder's files."""
    orig = families["qwen2.5"][0]
    src = tmp_path / "qwen"
    shutil.copytree(orig, src)
    _round_trip(tmp_path / "first", src)
    shutil.rmtree(src)
    with pytest.raises(ShardwiseConfigError, match=r"is gone or holds no tokenizer now, and the "
                       r"run folder has no tokenizer/ copy.*--tokenizer DIR"):
        export_hf(tmp_path / "first" / "run", tmp_path / "hf")
    out = export_hf(tmp_path / "first" / "run", tmp_path / "hf", tokenizer=str(orig))
    assert_same_tokenizer(orig, out)


def test_export_tokenizer_file_keeps_the_own_tokenizer_path(families, tmp_path):
    """``export --tokenizer FILE.json`` (a bare tokenizers file, no tokenizer_config.json beside
    it) still ships that file with our tokenizer_config.json, one EOS for BOS and EOS."""
    src = families["gpt2"][0]
    bare = tmp_path / "bare" / "tokenizer.json"
    bare.parent.mkdir()
    shutil.copyfile(src / "tokenizer.json", bare)
    out = export_hf(families["gpt2"][2].parent / "run", tmp_path / "hf", tokenizer=str(bare))
    shipped, given = (json.loads(f.read_text()) for f in (out / "tokenizer.json", bare))
    assert shipped["model"] == given["model"]  # its vocabulary and merges (re-serialised)
    tc = json.loads((out / "tokenizer_config.json").read_text())
    assert tc["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tc["eos_token"] == tc["bos_token"] == "<|endoftext|>"
    assert not (out / "chat_template.jinja").exists()


def test_the_copy_is_kept_when_unchanged_and_removed_for_our_own_tokenizer(families, tmp_path):
    """save_run_tokenizer: a resumed run with the same folder rewrites nothing; a run whose
    tokenizer is not a folder's removes a copy an earlier run left."""
    from shardwise.data import ByteTokenizer
    from shardwise.data.hf_tokenizer import HFFolderTokenizer
    from shardwise.interop.hf_tokenizer_copy import save_run_tokenizer

    tok = HFFolderTokenizer(families["mistral"][0])
    copy = save_run_tokenizer(tok, tmp_path)
    assert copy == tmp_path / "tokenizer" and (copy / "config.json").is_file()
    stamp = {f.name: f.stat().st_mtime_ns for f in copy.iterdir()}
    assert save_run_tokenizer(tok, tmp_path) == copy
    assert {f.name: f.stat().st_mtime_ns for f in copy.iterdir()} == stamp
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer"]  # no .tmp/.old left
    assert save_run_tokenizer(ByteTokenizer(), tmp_path) is None and not copy.exists()
