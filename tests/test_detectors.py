"""The detector registry: built-in scores and JSON unchanged by it, user detectors end to end (docs example)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import qkcircuits as qk
from qkcircuits.fixtures import hand_built_induction_model

ROOT = Path(__file__).resolve().parents[1]
BEFORE = ROOT / "tests/fixtures/scan_before"          # written by the scan before the registry existed
OLD_VERSION_KEYS = ("qkcircuits", "torch", "transformers", "transformer_lens")


def _same_as_before(new: dict, old: dict) -> None:
    """Every key and value equal (scores exactly), except that the versions moved into settings["versions"]."""
    assert list(new) == list(old)
    for k in old:
        if k == "settings":
            # ov_copying's settings gained the rank method (issue 19's estimate); the vocabularies here are
            # small enough that it always counts exactly
            new[k] = dict(new[k])
            if "ov_copying" in new[k]:
                new[k]["ov_copying"] = dict(new[k]["ov_copying"])
                assert new[k]["ov_copying"].pop("method") == "exact"
            # the model's fingerprint (issue 43: which model a result is of) came after the recorded files
            assert len(new[k].pop("fingerprint")) == 12
            assert {a: b for a, b in new[k].items() if a != "versions"} == \
                   {a: b for a, b in old[k].items() if a not in OLD_VERSION_KEYS}
            assert list(new[k]["versions"]) == ["qkcircuits", "torch", "transformer_lens", "transformers"]
        elif k == "scores":
            # saved on an AMD EPYC; another CPU's kernels (seen: an AVX-512 Xeon) round differently in the last
            # printed digit, so the scores are compared to 2e-6 (the JSON keeps 6 decimals)
            assert list(new[k]) == list(old[k]), k
            for name in old[k]:
                a, b = torch.tensor(new[k][name], dtype=torch.float64), torch.tensor(old[k][name], dtype=torch.float64)
                assert a.shape == b.shape and torch.allclose(a, b, atol=2e-6, rtol=0, equal_nan=True), (k, name)
        else:
            assert new[k] == old[k], k


def _scan(m, text: bool, confirm: int):
    return qk.scan(m, text=text, confirm_k=confirm, progress=False, ov_tokens=16, n_seqs=2)


def test_registry_scan_is_bit_identical_to_before_on_toy_induction(hand_built):
    _same_as_before(json.loads(_scan(hand_built, False, 1).to_json()), json.loads((BEFORE / "toy.json").read_text()))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_registry_scan_is_bit_identical_to_before_on_tiny_models(family, tmp_path_factory):
    import _tiny

    folder = (_tiny.gpt2_dir if family == "gpt2" else _tiny.llama_dir)(tmp_path_factory)
    m = qk.load(str(folder), device="cpu")
    old = json.loads((BEFORE / f"{family}.json").read_text())
    old["model"] = str(folder)                     # the folder the model was loaded from differs between runs
    _same_as_before(json.loads(_scan(m, True, 0).to_json()), old)


def test_cli_table_unchanged(capsys):
    from qkcircuits.cli import main

    assert main(["scan", "toy-induction", "--quiet", "--k", "2"]) == 0
    out = capsys.readouterr().out
    before = (BEFORE / "cli_toy.txt").read_text().split("\n", 1)[1]     # drop the "using device" stderr line
    assert out == before


def test_registry_is_what_scan_labels_and_selects():
    names = [d.name for d in qk.detectors()]
    assert names == ["induction", "prefix_matching", "previous_token", "duplicate_token", "copying", "ov_copying",
                     "eigen_copying", "previous_token_text", "duplicate_token_text"]
    assert qk.thresholds() == {"induction": ("induction", 0.4), "previous-token": ("previous_token", 0.4),
                               "duplicate-token": ("duplicate_token", 0.4)}
    from qkcircuits._analysis.detectors import select

    assert select() == names[:7] and select(copying=False) == ["induction", "prefix_matching", "previous_token",
                                                                "duplicate_token", "eigen_copying"]
    assert select("duplicate_token,induction", text=True) == ["induction", "duplicate_token", "previous_token_text",
                                                               "duplicate_token_text"]
    for old in ("THRESHOLDS", "SCORE_NAMES", "TEXT_SCORES"):           # the old constants went in 0.2.0
        with pytest.raises(AttributeError, match=old):
            getattr(qk, old)


@pytest.mark.parametrize("bad, fragment", [
    (dict(name="x y", prompts="repeated", mask=qk.diagonal_mask), "identifier"),
    (dict(name="x", prompts="nowhere", mask=qk.diagonal_mask), "unknown prompt set 'nowhere'"),
    (dict(name="x", prompts="repeated"), "exactly one of mask, reducer, score"),
    (dict(name="x", prompts="model", mask=qk.diagonal_mask), "prompts='model'"),
    (dict(name="x", prompts="repeated", mask=qk.diagonal_mask, threshold=0.5), "both threshold and label"),
])
def test_bad_detectors_fail_in_one_line(bad, fragment):
    with pytest.raises(qk.QKCircuitsError, match=re.escape(fragment)):
        qk.Detector(**bad)


def test_register_refuses_clashes_and_unknown_scores(hand_built):
    with pytest.raises(qk.QKCircuitsError, match="exists; pass replace=True"):
        qk.register_detector(qk.detector("induction"))
    with pytest.raises(qk.QKCircuitsError, match="label 'induction' is already given by detector 'induction'"):
        qk.register_detector(qk.Detector("ind2", "repeated", mask=qk.diagonal_mask, threshold=0.1, label="induction"))
    with pytest.raises(qk.QKCircuitsError, match="unknown score 'nope'; choose from induction, "):
        qk.scan(hand_built, scores="nope", progress=False)


def test_user_mask_detector_finds_the_self_attending_heads(hand_built):
    """toy-induction's 0.1 and 1.1 attend to their own position by construction (qkcircuits/fixtures.py)."""
    det = qk.Detector("self_attention", "repeated", mask=lambda t, seg_len, first_query: qk.diagonal_mask(t),
                      threshold=0.9, label="self")
    qk.register_detector(det, replace=True)
    try:
        s = qk.scan(hand_built, scores="self_attention,induction", progress=False)
        torch.testing.assert_close(s["self_attention"], torch.tensor([[0.0, 1.0], [0.0, 1.0]]), atol=1e-5, rtol=0)
        assert s.heads_labelled("self") == [qk.Head(0, 1), qk.Head(1, 1)]
        assert s.settings["scores"] == ["induction", "self_attention"]          # registry order
        back = qk.results.HeadScores.from_json(s.to_json())
        assert back.heads_labelled("self") == s.heads_labelled("self")
    finally:
        qk.unregister_detector("self_attention")
    assert "self_attention" not in [d.name for d in qk.detectors()]


def _docs_example() -> str:
    text = (ROOT / "docs/detectors.md").read_text(encoding="utf-8")
    block = text.split("<!-- successor-example -->", 1)[1]
    return block.split("```python\n", 1)[1].split("```", 1)[0]


def test_docs_successor_detector_against_a_model_built_to_be_one(capsys):
    """The docs/detectors.md block, run as written; then on toy-induction with its unembedding rewired so that
    the token head 1.0 writes for t is read as t + 1: 1.0 becomes an exact successor head."""
    ns: dict = {}
    try:
        exec(compile(_docs_example(), "docs/detectors.md", "exec"), ns)
        assert torch.equal(ns["scores"]["successor"], torch.zeros(2, 2))          # copying is not succession
        assert ns["scores"].heads_labelled("successor") == []
        m = hand_built_induction_model()
        V, out0 = m.cfg.d_vocab, 2 * m.cfg.d_vocab + m.cfg.n_ctx          # the block head 1.0 writes into
        with torch.no_grad():
            W = m.original_model.head.weight
            W.zero_()
            for t in range(V - 1):
                W[t + 1, out0 + t] = 30.0
        s = qk.scan(m, scores="successor,induction", progress=False)
        assert torch.equal(s["successor"], torch.tensor([[0.0, 0.0], [1.0, 0.0]]))
        assert s.heads_labelled("successor") == [qk.Head(1, 0)] and s["induction"][1, 0] > 0.99
        from qkcircuits.cli import main

        assert main(["scan", "toy-induction", "--quiet", "--k", "1", "--scores", "successor,induction"]) == 0
        assert "top 1 successor heads" in capsys.readouterr().out
    finally:
        if "successor" in [d.name for d in qk.detectors()]:
            qk.unregister_detector("successor")
