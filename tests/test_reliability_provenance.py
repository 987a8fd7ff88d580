"""Issue 43 ask 2: every saved result records the model it came from (name, fingerprint, task where there is one),
and every reader refuses another model's result in one line naming both unless ``--allow-other-model``.

The case a name check misses: two tiny random GPT-2 checkpoints of different shapes saved under ONE folder name
(the spec, and so the recorded name, is the same string). Ground truth for the fingerprint's contents: the
checkpoint's own ``config.json``.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
import torch

import qkcircuits as qk
from qkcircuits import QKCircuitsError
from qkcircuits._foundation.fingerprint import facts, fingerprint, mismatch, recorded
from qkcircuits.cli.report_command import check_same_model

from _cli import errors, run
from _tiny import N_CTX, SEED, _perturb, _save, bpe_tokenizer

torch.set_num_threads(1)


def gpt2_checkpoint(folder: Path, width: int, tok) -> Path:
    """A random GPT-2 of 2 layers x 4 heads and ``width`` (d_head = width / 4) written to ``folder``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_head=4, n_embd=width, n_positions=N_CTX, vocab_size=len(tok),
                     initializer_range=0.2, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(SEED)
    model = GPT2LMHeadModel(cfg).eval()
    _perturb(model, SEED)
    return _save(folder, model, tok)


@pytest.fixture(scope="module")
def two_shapes(tmp_path_factory):
    """(folder, results of the 32-wide model written there, the 48-wide model loaded from the same folder)."""
    tok = bpe_tokenizer()
    folder = tmp_path_factory.mktemp("same_name") / "gpt2"
    gpt2_checkpoint(folder, 32, tok)
    narrow = qk.load(str(folder), verbose=False)
    out = folder.parent / "results"
    out.mkdir()
    tokens = qk.repeated_tokens(narrow, n_seqs=2, seg_len=5, seed=0)
    qk.scan(narrow, scores=["induction"], n_seqs=2, seg_len=5, progress=False).to_json(out / "scan.json")
    qk.attend(narrow, "1.0", tokens, key="induction").to_json(out / "attend.json")
    first = {"narrow": fingerprint(narrow), "name": qk._foundation.model.model_name(narrow)}
    gpt2_checkpoint(folder, 48, tok)                   # the same folder, now a wider model
    wide = qk.load(str(folder), verbose=False)
    return folder, out, first, wide


def test_the_fingerprint_is_the_checkpoints_shape_and_not_its_processing(two_shapes):
    folder, _, first, wide = two_shapes
    cfg = json.loads((folder / "config.json").read_text())      # the wide checkpoint's own config
    f = facts(wide)
    assert (f["n_layers"], f["n_heads"], f["d_model"], f["d_head"], f["d_vocab"], f["n_ctx"]) == (
        cfg["n_layer"], cfg["n_head"], cfg["n_embd"], cfg["n_embd"] // cfg["n_head"], cfg["vocab_size"],
        cfg["n_positions"])
    assert f["W_E"] == [cfg["vocab_size"], cfg["n_embd"]] and f["W_pos"] == [cfg["n_positions"], cfg["n_embd"]]
    assert f["attention"] == [[4, 4, 12, 12]] * 2 and f["architecture"] == "GPT2LMHeadModel"
    assert re.fullmatch(r"[0-9a-f]{12}", fingerprint(wide))
    # the same checkpoint loaded again, unfolded, in bf16: the same fingerprint; the narrow one under the same name:
    # another
    again = [qk.load(str(folder), verbose=False), qk.load(str(folder), fold_ln=False, verbose=False),
             qk.load(str(folder), dtype="bfloat16", verbose=False)]
    assert {fingerprint(m) for m in again} == {fingerprint(wide)}
    assert qk._foundation.model.model_name(wide) == first["name"] and first["narrow"] != fingerprint(wide)


def test_every_result_records_its_model_and_task(hand_built):
    """Each producer's result (and its JSON read back) records this model's fingerprint; task results their task."""
    m = qk.load("toy-induction", verbose=False)
    fp = fingerprint(m)
    assert fp == fingerprint(hand_built)                     # the same model built twice
    tokens = qk.repeated_tokens(m, n_seqs=2, seg_len=5, seed=0)
    task = qk.tasks.induction(m, n=4, seg_len=5)
    scores = qk.edge_scores(m, task, method="exact", progress=False)
    results = {
        "scan": qk.scan(m, scores=["induction"], n_seqs=2, seg_len=5, progress=False),
        "sweep": qk.sweep(m, tokens, progress=False),
        "attribution": qk.attribution(m, tokens),
        "group_effect": qk.group_effect(m, ["1.0"], tokens),
        "path_patch": qk.path_patch(m, ["1.0"], tokens=tokens, progress=False),
        "edge_attribution": qk.edge_attribution(m, ["1.0"], tokens=tokens),
        "diagnose": qk.diagnose(m, n_seqs=2, seg_len=5),
        "attend": qk.attend(m, "1.0", task=task),
        "circuit": qk.circuit(m, "1.0", "qk"),
        "composition": qk.composition_scores(m, "K"),
        "kv_cache": qk.kv_cache(m),
        "verify": qk.verify_circuits(m),
        "capture": qk.capture(m, tokens, ["pattern"]),
        "edge_scores": scores,
        "node_scores": qk.node_scores(m, task, progress=False),
        "faithfulness": qk.faithfulness(m, task, scores, sizes=[50, 100], progress=False),
        "core": qk.core_circuit(m, task, scores, progress=False),
        "random": qk.compare_to_random(m, ["1.0"], tokens, n_draws=2),
        "roles": qk.roles(m, task, scores.circuit(percent=50), force=True, qk=False),
    }
    for what, res in results.items():
        assert res.settings.get("fingerprint") == fp, what
        back = type(res).from_json(res.to_json())
        assert recorded(back)[1] == fp, what                 # kept through the file
    for what in ("attend", "edge_scores", "node_scores", "faithfulness", "core", "roles"):
        assert results[what].settings.get("task") == task.name, what
    for what in ("group_effect", "random", "capture", "roles"):                 # result classes without a model field say it here
        assert results[what].settings["model"] == qk._foundation.model.model_name(m), what
    circ = scores.circuit(percent=50)                        # a task circuit: through its graph
    assert circ.graph.fingerprint == fp and recorded(type(circ).from_json(circ.to_json()))[1] == fp


def test_a_same_named_model_of_another_shape_is_refused(two_shapes, capsys, tmp_path):
    folder, out, first, wide = two_shapes
    html = tmp_path / "r.html"
    for flag, name in (("--attend", "attend.json"), ("--scores", "scan.json")):
        code, _, err = run(["report", folder, "-o", html, "--quiet", flag, out / name], capsys)
        assert code == 2 and len(errors(err)) == 1, err
        line = errors(err)[0]
        assert f"with fingerprint '{first['narrow']}', not of" in line and f"(fingerprint {fingerprint(wide)})" in line
        assert "--allow-other-model" in line and not html.exists()
    code, _, err = run(["attend", folder, "--head", "1.0", "--prompt", "a b a b", "--key", "induction", "--scores",
                        out / "scan.json"], capsys)
    assert code == 2 and f"with fingerprint '{first['narrow']}'" in errors(err)[0], err
    # --allow-other-model lets it through; the check alone (a whole report is seconds more)
    res = qk.results.Attribution.from_json(out / "attend.json")
    check_same_model(wide, argparse.Namespace(model=str(folder), allow_other_model=True), ("--attend", "a", res))
    with pytest.raises(QKCircuitsError, match="--allow-other-model"):
        check_same_model(wide, argparse.Namespace(model=str(folder)), ("--attend", "a", res))


def test_a_file_written_before_fingerprints_is_read_by_name(two_shapes, hand_built):
    folder, out, _, wide = two_shapes
    old = json.loads((out / "attend.json").read_text())
    del old["settings"]["fingerprint"]                       # what a file of an earlier version holds
    res = qk.results.Attribution.from_json(json.dumps(old))
    assert recorded(res) == (old["model"], None)
    args = argparse.Namespace(model=str(folder))
    check_same_model(wide, args, ("--attend", "a", res))     # the same name: read as before
    with pytest.raises(QKCircuitsError, match=r"is a result of model '.*gpt2', not of 'toy-induction'"):
        check_same_model(hand_built, argparse.Namespace(model="toy-induction"), ("--attend", "a", res))
    # a circuit file (the circuit command's contract): top-level fingerprint, else its graph's, else by name
    from qkcircuits.viz._circuit_data import load_circuit

    base = {"model": "toy-induction", "curve": {"0": 0.0, "100": 1.0}, "circuit": {"edges": []}}
    names = ("toy-induction",)
    fp = fingerprint(hand_built)
    assert mismatch(hand_built, load_circuit(base), names) is None
    assert mismatch(hand_built, load_circuit({**base, "fingerprint": fp}), names) is None
    assert "fingerprint '0123456789ab'" in mismatch(hand_built, load_circuit({**base, "fingerprint": "0123456789ab"}),
                                                    names)
    graph = {"n_layers": 2, "n_heads": 2, "n_kv_heads": 2, "mlps": True, "fingerprint": "0123456789ab"}
    assert mismatch(hand_built, {**base, "graph": graph}, names) is not None
