"""Tasks follow the tokenizer (issue 35 ask 1): ``prepend_bos=None`` does what the checkpoint's tokenizer does on
its own, True / False force it; the CLI's ``--bos auto|yes|no``, its first line and the JSON say which.

Two tiny GPT-2 checkpoints with the SAME weights differ only in their tokenizer: one prepends ``<|endoftext|>``
(id 0) on its own (``add_bos_token=True``, as Llama's and Gemma's tokenizers do), the other adds nothing (as
GPT-2's and SmolLM2's). TransformerLens reloads both with ``add_bos_token=True``, so the bridge's own
``model.tokenizer(text)`` is no guide: what the checkpoint's tokenizer does is recorded at load."""

import json

import pytest
import torch

import qkcircuits as qk
from qkcircuits._foundation.model_cache import forget, recall, remember
from qkcircuits._foundation.own_tokenizer import own_affixes, special_affixes
from qkcircuits.cli import main

from _tiny import bpe_tokenizer, gpt2_bos_dir, gpt2_dir, tiny_gguf, tiny_llama_gqa

NAMES = ["Maria", "town", "old", "new", "them", "would", "asked", "their"]
IOI = dict(n=4, seed=1, names=NAMES, places=["dra"], objects=["har"], frames=qk.tasks.FRAMES[:1])


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return qk.load(str(gpt2_dir(tmp_path_factory)), verbose=False)


@pytest.fixture(scope="module")
def with_bos(tmp_path_factory):
    return qk.load(str(gpt2_bos_dir(tmp_path_factory)), verbose=False)


def test_what_the_tokenizer_adds_is_read_from_the_checkpoint(plain, with_bos):
    assert special_affixes(bpe_tokenizer(add_bos=True)) == {"prefix": [0], "suffix": []}
    assert special_affixes(bpe_tokenizer()) == {"prefix": [], "suffix": []}
    assert own_affixes(with_bos)["prefix"] == [0] and own_affixes(plain)["prefix"] == []
    # TransformerLens' copy of the tokenizer adds BOS for both: it could not have told them apart
    assert plain.tokenizer("a b")["input_ids"][0] == 0 == with_bos.tokenizer("a b")["input_ids"][0]
    # a bridge built elsewhere (no record from qk.load): its tokenizer is reloaded as saved
    recorded = recall(plain, "own tokenizer")
    forget(plain, "own tokenizer")
    try:
        assert own_affixes(plain)["prefix"] == [] and "as saved" in own_affixes(plain)["source"]
    finally:
        remember(plain, "own tokenizer", recorded)


def test_ioi_follows_the_tokenizer_and_forcing_overrides_it(plain, with_bos):
    auto_plain, auto_bos = qk.tasks.ioi(plain, **IOI), qk.tasks.ioi(with_bos, **IOI)
    assert (auto_plain.bos, auto_plain.bos_mode, auto_bos.bos, auto_bos.bos_mode) == (False, "auto", True, "auto")
    assert (auto_bos.clean[:, 0] == 0).all() and (auto_bos.corrupt[:, 0] == 0).all()
    assert not (auto_plain.clean[:, 0] == 0).any()
    # the same prompts, one token to the right; the named positions move with them and still hold the names
    assert torch.equal(auto_bos.clean[:, 1:], auto_plain.clean) and torch.equal(auto_bos.answer, auto_plain.answer)
    for k in ("IO", "S1", "S1+1", "S2", "END"):
        assert torch.equal(auto_bos.positions[k], auto_plain.positions[k] + 1), k
    rows = torch.arange(4)
    assert torch.equal(auto_bos.clean[rows, auto_bos.positions["IO"]], auto_bos.answer)
    # forced: yes on the plain tokenizer = auto on the BOS one; no on the BOS one = auto on the plain one
    yes, no = qk.tasks.ioi(plain, prepend_bos=True, **IOI), qk.tasks.ioi(with_bos, prepend_bos=False, **IOI)
    assert torch.equal(yes.clean, auto_bos.clean) and (yes.bos, yes.bos_mode) == (True, "yes")
    assert torch.equal(no.clean, auto_plain.clean) and (no.bos, no.bos_mode) == (False, "no")
    assert auto_bos.describe()["bos"] == {"prepended": True, "mode": "auto"}
    assert auto_bos.describe()["bos_prepended"] is True


def test_from_jsonl_follows_the_tokenizer(plain, with_bos, tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"clean": "the old town", "corrupt": "the new town", "answer": " would",
                             "wrong": " asked"}) + "\n")
    a, b = qk.tasks.from_jsonl(plain, p), qk.tasks.from_jsonl(with_bos, p)
    want = plain.tokenizer("the old town", add_special_tokens=False)["input_ids"]
    assert a.clean[0].tolist() == want and b.clean[0].tolist() == [0] + want
    assert (a.bos, b.bos, a.bos_mode) == (False, True, "auto") and b.positions["END"].item() == len(want)
    assert qk.tasks.from_jsonl(with_bos, p, prepend_bos=False).clean[0].tolist() == want


def test_induction_always_starts_with_bos(plain):
    t = qk.tasks.induction(plain, n=2, seg_len=4)
    assert t.bos and t.bos_mode == "yes" and (t.clean[:, 0] == t.clean[0, 0]).all()
    with pytest.raises(qk.QKCircuitsError, match="the induction task's prompts always start with BOS"):
        qk.tasks.build_task(plain, "induction", 2, 0, prepend_bos=False)


def test_gguf_tokenizer_is_read_before_transformerlens(tmp_path):
    # the GGUF route hands transformers' tokenizer to TransformerLens, which may reload it with add_bos_token; what
    # the file's tokenizer does is recorded from the tokenizer as transformers built it, before that
    from transformers import AutoTokenizer

    path = tiny_gguf(tmp_path / "t.gguf", tiny_llama_gqa(tmp_path / "llama"))
    own = special_affixes(AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name))
    model = qk.load(str(path), verbose=False)
    assert own_affixes(model)["prefix"] == own["prefix"] and own_affixes(model)["source"] == "the checkpoint's tokenizer"


def test_cli_bos_auto_yes_no(tmp_path_factory, tmp_path, capsys):
    lines = [{"clean": "the old town", "corrupt": "the new town", "answer": " would", "wrong": " asked"},
             {"clean": "them and their", "corrupt": "them and the", "answer": " old", "wrong": " new"}]
    task = tmp_path / "pairs.jsonl"
    task.write_text("\n".join(json.dumps(x) for x in lines))
    base = ["--task", str(task), "--method", "eap", "--percent", "20", "--quiet", "--device", "cpu",
            "--no-sign-check", "--force"]
    said = []
    for folder, bos in ((gpt2_bos_dir(tmp_path_factory), "auto"), (gpt2_dir(tmp_path_factory), "auto"),
                        (gpt2_dir(tmp_path_factory), "yes"), (gpt2_bos_dir(tmp_path_factory), "no")):
        out = tmp_path / "c.json"
        assert main(["circuit", str(folder), *base, "--bos", bos, "--json", str(out)]) == 0
        got = capsys.readouterr()
        d = json.loads(out.read_text())
        err = [x for x in got.err.splitlines() if x.strip() and "it/s]" not in x]      # transformers' load bars aside
        first = err[0]                                                    # the command's first line, before any work
        assert first.startswith(f"{folder}: task pairs") and first in got.out.splitlines(), got.err
        said.append((first, d["bos"], d["bos_prepended"], d["clean"]))
    (first_bos, bos_auto, _, clean_bos), (first_plain, plain_auto, _, clean_plain), (first_yes, yes, _, clean_yes), \
        (first_no, no, _, clean_no) = said
    assert "BOS '<|endoftext|>' prepended (--bos auto: the tokenizer adds it)" in first_bos
    assert bos_auto == {"prepended": True, "mode": "auto"} and said[0][2] is True
    assert "no BOS (--bos auto: the tokenizer adds none; --bos yes prepends one)" in first_plain
    assert plain_auto == {"prepended": False, "mode": "auto"} and said[1][2] is False
    assert "BOS '<|endoftext|>' prepended (--bos yes)" in first_yes and yes == {"prepended": True, "mode": "yes"}
    assert "no BOS (--bos no)" in first_no and no == {"prepended": False, "mode": "no"}
    # same weights: forcing reproduces the other tokenizer's auto, to the digit
    assert clean_yes == clean_bos and clean_no == clean_plain and clean_bos != clean_plain
    assert main(["circuit", "toy-induction", "--task", "induction", "--bos", "no", "--quiet"]) == 2
    assert "always start with BOS" in capsys.readouterr().err
