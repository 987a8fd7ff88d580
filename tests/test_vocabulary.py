"""One vocabulary (docs/architecture.md): the old names of arguments and flags went in 0.2.0 (CHANGELOG.md). Each
old keyword is a TypeError naming it, each old flag a one-line usage error naming it (exit 2), the old metric name
``loss`` an error naming what is accepted; the new names do what they say."""

from __future__ import annotations

import pytest
import torch

import qkcircuits as qk
from qkcircuits.cli import main


def _old_keywords(m):
    """(call, old keyword) for every keyword renamed before 0.2.0, each called with only its old name."""
    from qkcircuits import plot
    from qkcircuits.viz import pick_heads
    from qkcircuits.viz._panels import ViewContext, ov_top, qk_grid

    ctx, ids, head = ViewContext(m), [1, 2, 3], qk.Head(1, 0)
    comp = qk.composition_scores(m, "K")
    res = qk.path_patch(m, "1.0", into="k", progress=False)
    grid = {"induction": torch.tensor([[0.0, 0.1], [0.9, 0.2]])}
    return [
        (lambda: qk.scan(m, scores="induction", seq_len=6, progress=False), "seq_len"),
        (lambda: qk.scan(m, scores="induction", confirm_top=1, progress=False), "confirm_top"),
        (lambda: qk.confirm_induction(m, qk.scan(m, scores="induction", progress=False), seq_len=6), "seq_len"),
        (lambda: qk.zoo(["toy-induction"], models=["toy-induction"], progress=False), "models"),
        (lambda: qk.zoo(["toy-induction"], max_heads=1, progress=False), "max_heads"),
        (lambda: comp.partners(head, top=1), "top"),
        (lambda: qk.k_composition_partners(m, ["1.0"], top=1), "top"),
        (lambda: qk.weights.token_inputs(m, 0, [1, 2], input="direct"), "input"),
        (lambda: qk.weights.token_qk(m, "1.0", ids, input="direct"), "input"),
        (lambda: qk_grid(ctx, head, ids, input="effective"), "input"),
        (lambda: ov_top(ctx, head, ids, 2, input="direct"), "input"),
        (lambda: plot.qk(m, "1.0", ["#1", "#2"], input="direct"), "input"),
        (lambda: plot.trace(res, per_input=1), "per_input"),
        (lambda: pick_heads(grid, 1, per_score=1), "per_score"),
        (lambda: pick_heads(grid, 1, max_heads=1), "max_heads"),
        (lambda: qk.trace_induction(m, top=1, progress=False), "top"),
    ]


def test_old_keywords_are_type_errors_naming_them(hand_built):
    for call, old in _old_keywords(hand_built):
        with pytest.raises(TypeError, match=rf"\b{old}\b"):
            call()


def test_new_keywords_give_what_they_say(hand_built):
    new = qk.scan(hand_built, scores="induction", n_seqs=2, seg_len=6, confirm_k=1, progress=False)
    assert new.extras["confirmation"]["heads"] == ["1.0"]           # the toy's induction head, ablated
    assert new.settings["seq_len"] == 6                               # the JSON key stays seq_len
    conf = qk.confirm_induction(hand_built, new, k=1, n_draws=2, n_seqs=2, seg_len=6)
    assert conf["heads"] == ["1.0"] and conf["seq_len"] == 6
    z = qk.zoo(specs=["toy-induction"], confirm_k=0, k=1, n_seqs=2, progress=False)
    assert z.models[0]["induction"] == [{"head": "1.0", "score": pytest.approx(1.0, abs=1e-6), "depth": 0.5}]
    assert z.settings["max_heads"] == 1 and z.settings["confirm_top"] == 0     # the JSON keys stay
    comp = qk.composition_scores(hand_built, "K")
    assert comp.partners(qk.Head(1, 0), k=1)[0][0] == qk.Head(0, 0)      # 1.0 reads 0.0's OV
    from qkcircuits.viz import pick_heads

    assert pick_heads({"induction": torch.tensor([[0.0, 0.1], [0.9, 0.2]])}, grid_k=1, k=1) == [qk.Head(1, 0)]


def test_default_tokens_and_metrics_refuse_the_old_names(hand_built):
    from qkcircuits._analysis.metrics import default_tokens

    toks = default_tokens(hand_built, "induction-loss", n_seqs=2, seg_len=5)
    assert toks.shape == (2, 1 + 2 * 5) and torch.equal(toks[:, 1:6], toks[:, 6:])   # [BOS] + R + R
    with pytest.raises(qk.QKCircuitsError, match=r"seq_len=5 is the length of text-loss rows; .* seg_len="):
        default_tokens(hand_built, "induction-loss", n_seqs=2, seq_len=5)
    with pytest.raises(qk.QKCircuitsError, match=r"unknown metric 'loss'; use one of induction-loss"):
        qk.as_metric("loss", hand_built)


def _exit_code(argv):
    try:
        return main(argv)
    except SystemExit as e:                             # argparse exits itself
        return e.code


@pytest.mark.parametrize("argv, old", [
    (["scan", "toy-induction", "--top", "1"], "--top"), (["scan", "toy-induction", "--seq-len", "12"], "--seq-len"),
    (["circuits", "toy-induction", "--head", "1.0", "--top", "2"], "--top"),
    (["circuits", "toy-induction", "--head", "1.0", "--input", "direct"], "--input"),
    (["trace", "toy-induction", "--top", "2"], "--top"), (["ablate", "toy-induction", "--sweep", "--top", "4"], "--top"),
    (["report", "toy-induction", "-o", "r.html", "--per-score", "1"], "--per-score"),
    (["report", "toy-induction", "-o", "r.html", "--top-k", "3"], "--top-k"),
    (["report", "toy-induction", "-o", "r.html", "--input", "direct"], "--input"),
    (["circuit", "toy-induction", "--task", "induction", "--metric", "loss"], "'loss'"),
])
def test_every_old_flag_is_a_one_line_usage_error(argv, old, capsys):
    assert _exit_code(argv) == 2
    err = capsys.readouterr().err.strip()
    assert old in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("argv, dest, value", [
    (["circuits", "m", "--head", "1.0", "--k", "2"], "k", 2),
    (["circuits", "m", "--head", "1.0", "--view", "direct"], "view", "direct"),
    (["trace", "m", "--k", "2"], "k", 2), (["ablate", "m", "--sweep", "--k", "4"], "k", 4),
    (["report", "m", "-o", "r.html", "--grid-k", "1"], "grid_k", 1),
    (["report", "m", "-o", "r.html", "--k", "3"], "k", 3),
    (["scan", "m", "--seg-len", "12"], "seg_len", 12),
])
def test_the_new_flags_parse(argv, dest, value):
    from qkcircuits.cli import build_parser

    assert getattr(build_parser().parse_args(argv), dest) == value
