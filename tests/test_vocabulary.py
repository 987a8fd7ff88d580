"""One vocabulary (docs/architecture.md): every renamed argument and flag still works for one release, warns,
and gives the same result as the new name."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import qkcircuits as qk
from qkcircuits._foundation.renamed import renames
from qkcircuits.cli import main


def _quiet(fn, *a, **kw):
    """``fn(*a, **kw)`` with no deprecation warning allowed (the new names must not warn)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=r".*is deprecated; use", category=DeprecationWarning)
        return fn(*a, **kw)


def test_scan_confirm_top_is_confirm_k(hand_built):
    new = _quiet(qk.scan, hand_built, scores="induction", n_seqs=2, seg_len=6, confirm_k=1, progress=False)
    with pytest.warns(DeprecationWarning, match=r"scan\(confirm_top=...\) is deprecated; use confirm_k="):
        old = qk.scan(hand_built, scores="induction", n_seqs=2, seg_len=6, confirm_top=1, progress=False)
    assert old.extras["confirmation"] == new.extras["confirmation"]
    assert new.extras["confirmation"]["heads"] == ["1.0"]            # the toy's induction head, ablated


def test_confirm_induction_and_default_tokens_take_seg_len(hand_built):
    scores = qk.scan(hand_built, scores="induction", progress=False)
    new = _quiet(qk.confirm_induction, hand_built, scores, k=1, n_draws=2, n_seqs=2, seg_len=6)
    with pytest.warns(DeprecationWarning, match=r"confirm_induction\(seq_len=...\)"):
        old = qk.confirm_induction(hand_built, scores, k=1, n_draws=2, n_seqs=2, seq_len=6)
    assert old == new and new["seq_len"] == 6                          # the JSON key stays seq_len
    from qkcircuits._analysis.metrics import default_tokens

    toks = _quiet(default_tokens, hand_built, "induction-loss", n_seqs=2, seg_len=5)
    assert toks.shape == (2, 1 + 2 * 5) and torch.equal(toks[:, 1:6], toks[:, 6:])   # [BOS] + R + R
    with pytest.warns(DeprecationWarning, match=r"default_tokens\(seq_len=...\) for induction prompts"):
        assert torch.equal(default_tokens(hand_built, "induction-loss", n_seqs=2, seq_len=5), toks)
    with pytest.raises(qk.QKCircuitsError, match="not also seq_len"):
        default_tokens(hand_built, "induction-loss", seg_len=5, seq_len=5)


def test_zoo_old_names_warn_and_agree():
    new = _quiet(qk.zoo, specs=["toy-induction"], confirm_k=0, k=1, n_seqs=2, progress=False)
    with pytest.warns(DeprecationWarning) as caught:
        old = qk.zoo(models=["toy-induction"], confirm_top=0, max_heads=1, n_seqs=2, progress=False)
    said = " ".join(str(w.message) for w in caught)
    assert all(f"zoo({o}=...) is deprecated" in said for o in ("models", "confirm_top", "max_heads"))
    strip = lambda z: [{k: v for k, v in m.items() if k != "timing_s"} for m in z.models]     # noqa: E731
    assert strip(old) == strip(new) and new.models[0]["induction"] == [{"head": "1.0", "score": pytest.approx(1.0, abs=1e-6),
                                                                                "depth": 0.5}]
    assert new.settings["max_heads"] == 1 and new.settings["confirm_top"] == 0     # the JSON keys stay
    assert renames(qk.zoo) == {"models": "specs", "confirm_top": "confirm_k", "max_heads": "k"}


def test_token_view_is_view_everywhere(hand_built):
    from qkcircuits import plot
    from qkcircuits.viz import pick_heads
    from qkcircuits.viz._panels import ViewContext, ov_top, qk_grid

    ctx, ids, head = ViewContext(hand_built), [1, 2, 3], qk.Head(1, 0)
    with pytest.warns(DeprecationWarning, match=r"qk_grid\(input=...\)"):
        old = qk_grid(ctx, head, ids, input="effective")
    torch.testing.assert_close(old, _quiet(qk_grid, ctx, head, ids, view="effective"))
    torch.testing.assert_close(old, qk.weights.token_qk(hand_built, "1.0", ids, view="effective")[0])
    with pytest.warns(DeprecationWarning, match=r"ov_top\(input=...\)"):
        assert [t.tolist() for t in ov_top(ctx, head, ids, 2, input="direct")] == \
            [t.tolist() for t in ov_top(ctx, head, ids, 2, view="direct")]
    with pytest.warns(DeprecationWarning):
        old_fig = plot.qk(hand_built, "1.0", ["#1", "#2"], input="direct")
    new_fig = _quiet(plot.qk, hand_built, "1.0", ["#1", "#2"], view="direct")
    assert old_fig.to_json() == new_fig.to_json() and "direct inputs" in new_fig.layout.title.text
    grid = {"induction": torch.tensor([[0.0, 0.1], [0.9, 0.2]])}
    with pytest.warns(DeprecationWarning):
        assert pick_heads(grid, per_score=1, max_heads=1) == pick_heads(grid, grid_k=1, k=1) == [qk.Head(1, 0)]
    assert renames(qk.report_html) == {"per_score": "grid_k", "input": "view"}
    res = qk.path_patch(hand_built, "1.0", into="k", progress=False)
    with pytest.warns(DeprecationWarning, match=r"trace\(per_input=...\)"):
        old_trace = plot.trace(res, per_input=1)
    assert old_trace.to_json() == _quiet(plot.trace, res, k=1).to_json()


@pytest.mark.parametrize("command, new, old", [
    (["scan", "toy-induction", "--quiet", "--scores", "induction"], ["--k", "1"], ["--top", "1"]),
])
def test_cli_old_flags_are_second_spellings(command, new, old, tmp_path, capsys):
    a, b = tmp_path / "new.json", tmp_path / "old.json"
    assert main([*command, *new, "--json", str(a)]) == 0
    out_new = capsys.readouterr()
    assert "deprecated" not in out_new.err
    assert main([*command, *old, "--json", str(b)]) == 0
    out_old = capsys.readouterr()
    for flag in old[::2]:
        assert f"{flag} is deprecated; use --" in out_old.err
    assert out_old.out == out_new.out
    da, db = json.loads(a.read_text()), json.loads(b.read_text())
    for d in (da, db):
        d.get("settings", {}).pop("versions", None)
    assert da == db


@pytest.mark.parametrize("argv, dest, value", [
    (["circuits", "m", "--head", "1.0", "--top", "2"], "k", 2),
    (["circuits", "m", "--head", "1.0", "--input", "direct"], "view", "direct"),
    (["trace", "m", "--top", "2"], "k", 2), (["ablate", "m", "--sweep", "--top", "4"], "k", 4),
    (["report", "m", "-o", "r.html", "--per-score", "1"], "grid_k", 1),
    (["report", "m", "-o", "r.html", "--top-k", "3"], "k", 3),
    (["report", "m", "-o", "r.html", "--input", "direct"], "view", "direct"),
])
def test_every_old_flag_parses_as_the_new_one(argv, dest, value, capsys):
    from qkcircuits.cli import build_parser

    new_flag = {"k": "--k", "grid_k": "--grid-k", "view": "--view"}[dest]
    args = build_parser().parse_args(argv)
    assert getattr(args, dest) == value and f"is deprecated; use {new_flag}" in capsys.readouterr().err
    new = build_parser().parse_args([*argv[:-2], new_flag, argv[-1]])
    assert getattr(new, dest) == value and "deprecated" not in capsys.readouterr().err
