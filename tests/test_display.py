"""Result reprs: a short one-line ``__repr__`` and a bounded ``_repr_html_`` (top heads per label, compact grid).

Ground truth: the hand-built fixture's known heads (0.0 previous-token, 1.0 induction) must lead the tables;
the grids hold one cell per head whose hover title is that head's value; a 80 x 64-head result stays under
the stated size bound.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

import qkcircuits as qk
from qkcircuits._foundation import display as _display

BOUND = 130_000      # bytes of one result's HTML, any model (qkcircuits/_foundation/display.py)


@pytest.fixture(scope="module")
def results(hand_built):
    toks = qk.repeated_tokens(hand_built, n_seqs=4, seg_len=8, seed=0)
    acts = qk.capture(hand_built, toks, ["pattern"], layers=[1])
    return {
        "HeadScores": qk.scan(hand_built, n_seqs=4, seg_len=12, prefix_seqs=2, progress=False),
        "HeadEffects": qk.sweep(hand_built, toks, progress=False),
        "GroupEffect": qk.group_effect(hand_built, ["1.0"], toks),
        "RandomComparison": qk.compare_to_random(hand_built, ["1.0"], toks, n_draws=3),
        "HeadDiagnostics": qk.diagnose(hand_built, progress=False),
        "CompositionScores": qk.composition_scores(hand_built, "K"),
        "OffsetProfile": None,
        "Activations": acts,
        "Circuit": qk.circuit(hand_built, "1.0", "qk"),
        "PathEffects": qk.trace_induction(hand_built, k=1, progress=False),
    }


def cells(html: str):
    """(head, value) of every grid cell: the hover title of each <i>."""
    return [(h, float(v)) for h, v in re.findall(r'<i style=background:#[0-9a-f]{6} title="([^ "]+) ([^"]+)"', html)]


def test_every_result_has_a_short_repr_and_html(results):
    for name, r in results.items():
        if r is None:
            continue
        text = repr(r)
        assert text.startswith(name + "(") and "\n" not in text and len(text) < 400, (name, text)
        assert "tensor(" not in text
        html = r._repr_html_()
        assert 'class="qk-r"' in html and "<script" not in html and "http" not in html and len(html) < 20_000, name


def test_scores_tables_lead_with_the_known_heads(results):
    s = results["HeadScores"]
    text = repr(s)
    assert "induction: 1 head >= 0.4, top 1.0 (1)" in text and "previous-token: 1 head >= 0.4, top 0.0 (1)" in text
    html = s._repr_html_()
    got = cells(html)
    # one cell per head per grid, in layer-major order, each titled with that head's value (4 significant digits)
    n_grids = min(_display.MAX_GRIDS, len(s.scores))
    assert len(got) == n_grids * s.n_layers * s.n_heads
    first = got[:4]
    assert [h for h, _ in first] == ["0.0", "0.1", "1.0", "1.1"]
    assert [v for _, v in first] == pytest.approx(s["induction"].flatten().tolist(), abs=1e-3)


def test_effects_and_diagnostics(results):
    e = results["HeadEffects"]
    top = e.top(1, by="abs")[0]
    assert f"largest |effect|: {top[0]} " in repr(e)
    vals = dict(cells(e._repr_html_()))
    assert vals["1.0"] == pytest.approx(float(e.effects[1, 0]), rel=1e-3)
    d = results["HeadDiagnostics"]
    assert f"{len(d.flagged())} flagged" in repr(d)
    g, c = results["GroupEffect"], results["RandomComparison"]
    assert f"(effect {g.effect:+.4g})" in repr(g) and f"effect {c.effect:+.4g}" in repr(c)


def test_composition_partners(results):
    comp = results["CompositionScores"]
    # the induction head's key reads the previous-token head: 0.0 -> 1.0 is the strongest K-composition pair
    assert "strongest: 0.0 → 1.0" in repr(comp)


def test_path_effects_lead_with_the_known_path(results):
    res = results["PathEffects"]
    text = repr(res)
    e = float(res.effects["k"][0, 0, 0])                 # 0.0 -> 1.0's keys: the circuit, by construction
    assert text.startswith("PathEffects(exact, ") and f"1.0<-0.0 k {_display._f(e, 3)}" in text, text
    html = res._repr_html_()
    assert f"<td>1.0</td><td>k</td><td>{_display._f(res.clean_value('1.0', 'k'))}</td><td>0.0 ({_display._f(e, 3)})" in html
    assert "<td>previous-token</td>" in html
    got = dict(cells(html))                                # the grid: receiver 1.0's k effects, NaN past layer 0
    assert got["0.0"] == pytest.approx(e, rel=1e-3) and math.isnan(got["1.0"])
    # bounded: 200 receivers on an 80 x 64-head model
    g = torch.Generator().manual_seed(0)
    L, H = 80, 64
    recv = [qk.Head(1 + i % (L - 1), i % H) for i in range(200)]
    eff = {x: torch.randn(len(recv), L, H, generator=g) for x in "qkv"}
    big = qk.results.PathEffects("big", "mean", recv, list("qkv"), {x: "score" for x in "qkv"}, eff,
                         {x: torch.ones(len(recv)) for x in "qkv"}, n_layers=L, n_heads=H)
    assert len(repr(big)) < 400 and "197 more receivers" in repr(big)
    assert len(big._repr_html_()) < BOUND and "185 more receivers" in big._repr_html_()


def test_offset_profile(tmp_path_factory):
    import _tiny

    model = qk.load(str(_tiny.llama_dir(tmp_path_factory)), device="cpu", verbose=False)
    prof = qk.offset_profile(model, "1.0")
    text = repr(prof)
    assert text.startswith("OffsetProfile(head 1.0") and f"preferred offset {prof.summary()['preferred_offset']}" in text
    html = prof._repr_html_()
    pts = re.search(r'points="([^"]+)"', html).group(1).split()
    assert len(pts) == prof.mean_score.numel() and len(html) < 10_000


def test_size_bound_on_a_large_model():
    g = torch.Generator().manual_seed(0)
    L, H = 80, 64
    scores = {n: torch.rand(L, H, generator=g) for n in ("induction", "prefix_matching", "previous_token",
                                                         "duplicate_token", "copying")}
    scores["eigen_copying"] = torch.rand(L, H, generator=g) * 2 - 1
    s = qk.results.HeadScores("big", L, H, scores, thresholds=qk.thresholds())
    html = s._repr_html_()
    assert len(html) < BOUND and "per-layer max" in html
    assert len(cells(html)) == _display.MAX_GRIDS * L                 # one cell per layer: the layer's maximum
    first = next(iter(qk.thresholds().values()))[0]                      # grids follow the labels' order
    assert cells(html)[7] == ("L7", pytest.approx(float(scores[first][7].max()), abs=1e-3))
    eff = qk.results.HeadEffects(torch.randn(L, H, generator=g), 1.0, "big", "zero", "loss")
    assert len(eff._repr_html_()) < BOUND
    # at the bound: every head drawn
    L2, H2 = 32, 24
    assert L2 * H2 <= _display.MAX_CELLS
    s2 = qk.results.HeadScores("mid", L2, H2, {k: v[:L2, :H2] for k, v in scores.items()}, thresholds=qk.thresholds())
    html2 = s2._repr_html_()
    assert len(cells(html2)) == _display.MAX_GRIDS * L2 * H2 and len(html2) < BOUND
    print(f"\nrepr HTML: {L}x{H} heads {len(html) / 1e3:.1f} kB; {L2}x{H2} heads {len(html2) / 1e3:.1f} kB")


def test_grid_colours_centre_signed_values_at_zero():
    html = _display.grid(torch.tensor([[-2.0, 0.0, 1.0, math.nan]]), "x")
    colours = re.findall(r"background:(#[0-9a-f]{6})", html)
    assert colours == ["#0000ff", "#ffffff", "#ff7f7f", "#eeeeee"]    # -max full blue, 0 white, +max/2 half red, NaN grey
