"""The report keeps every finding and draws it cleanly (issue 37 ask 4), measured in headless Chromium: no text of any
figure reaches past its figure's edge (titles, tick labels, legends, notes), every visible frame holds a figure (a
head without a figure for a panel has that frame hidden and says why in one line), the scan's causal check is on
the page with its random baseline, a long token label is shortened on the axis with the full text in the hover,
and the circuit section shows the file's warnings as a banner. On the toy model (a scan with its causal check, a
trace, a circuit with a core and warnings) and on SmolLM2 under ``-m smollm2``."""

from __future__ import annotations

import json

import pytest
import torch

import qkcircuits as qk
from qkcircuits.viz import report_html, write_report
from _layout import clipped_texts, empty_frames
from test_browser import Page, browser  # noqa: F401  (the shared headless-Chromium fixture)
from test_circuit_view import CHAIN

pytestmark = pytest.mark.browser


def check_page(p: Page, heads):
    """Every head of ``heads`` shown in turn: nothing cut, no empty frame."""
    for h in heads:
        p.page.select_option("#head-select", h)
        p.wait_shown(h)
        p.page.wait_for_timeout(300)
        assert clipped_texts(p.page) == [], (h, clipped_texts(p.page)[:5])
        assert empty_frames(p.page) == [], (h, empty_frames(p.page))


@pytest.fixture(scope="module")
def toy_page(hand_built, tmp_path_factory):
    scores = qk.scan(hand_built, n_seqs=4, seg_len=12, prefix_seqs=2, eigen_copying=False, confirm_k=1,
                     progress=False)
    trace = qk.trace_induction(hand_built, k=1, scores=scores, progress=False)
    circuit = json.loads(json.dumps(CHAIN))
    circuit["warnings"] = ["the model does not do this task (clean 3 vs corrupt -1): an example warning"]
    circuit["core"] = {"heads": ["1.0", "0.0"], "mlps": [], "node_faithfulness": 0.97, "curve": {"1": 0.6, "2": 0.97},
                       "how": "heads by node score until f >= 0.8"}
    long_token = "#" + str(int(hand_built.cfg.d_vocab) - 1)
    html = report_html(hand_built, scores=scores, grid_k=1, trace=trace, circuit=circuit, progress=False)
    path = tmp_path_factory.mktemp("layout") / "r.html"
    write_report(str(path), html)
    return path, scores, long_token


def test_toy_report_keeps_every_finding_and_draws_cleanly(browser, toy_page):  # noqa: F811
    path, scores, _ = toy_page
    p = Page(browser).open(path.as_uri())
    pg = p.page
    # the scan's causal check: the CLI's sentence and the random-baseline figure
    conf = scores.extras["confirmation"]
    text = pg.inner_text("#causal-check")
    assert f"raises the repeated-half loss by {conf['effect']:+.3f} nats" in text
    assert f"{len(conf['random_effects'])} random sets of as many heads" in text
    dots = pg.evaluate("() => document.getElementById('causal-figure').data[0].x")
    assert dots == pytest.approx([round(float(x), 4) for x in conf["random_effects"]], abs=1e-3)
    # the circuit section: its warning as a banner at the top, the core graph
    assert pg.locator("#circuit-section .banner").inner_text().startswith("⚠ the model does not do this task")
    first = pg.evaluate("() => document.getElementById('circuit-section').children[1].className")
    assert first == "banner"                                           # right under the section's title
    assert pg.evaluate("() => document.getElementById('circuit-graph').layout.title.text").startswith("core circuit")
    check_page(p, pg.evaluate("window.QK_SOURCE.heads"))
    # layer 0 has no K-composition partners: its frame is hidden and one line says so
    p.page.select_option("#head-select", "0.0")
    p.wait_shown("0.0")
    assert not pg.locator("#fig-comp").is_visible()
    assert "no K-composition partners (layer 0)" in pg.inner_text("#fig-notes")
    p.done()


def test_long_token_labels_are_shortened_with_the_full_text_in_the_hover(hand_built, tmp_path):
    from qkcircuits.viz._figures import LABEL_CHARS, ov_table, qk_heatmap

    label = " Paris and all of France, said twice"
    qk_fig = qk_heatmap(torch.zeros(2, 2), [label, " the"], "1.0")
    shown = qk_fig["layout"]["yaxis"]["ticktext"][0]
    assert len(shown) == LABEL_CHARS and shown.endswith("…") and shown.startswith("␣Paris")
    assert json.loads(qk_fig["data"][0]["customdata"][0][0][0]) == label          # the hover keeps it whole
    ov = ov_table(torch.ones(1, 2), torch.tensor([[3, 4]]), [label], [[label, " x"]], [3], "1.0", ranks=[1.0])
    assert ov["layout"]["yaxis"]["ticktext"][0].startswith("␣Paris") and "⟨1⟩" in ov["layout"]["yaxis"]["ticktext"][0]
    assert ov["layout"]["margin"]["l"] > 100                               # the margin is sized to the label
    assert json.loads(ov["data"][0]["customdata"][0][0][0]) == label


@pytest.mark.smollm2
def test_smollm2_report_nothing_cut_no_empty_frame(browser, smollm2, tmp_path):  # noqa: F811
    scores = qk.scan(smollm2, n_seqs=2, seg_len=20, prefix_seqs=2, prefix_len=10, eigen_copying=False, ov_tokens=16,
                     progress=False)
    scores.extras["confirmation"] = qk.confirm_induction(smollm2, scores, k=3, n_draws=4, n_seqs=2, seg_len=20)
    tokens = [" Paris", " France", " the", " and", " Mr", " John", " Mary"]
    html = report_html(smollm2, scores=scores, heads="0.3,16.0,18.6", grid_k=1, tokens=tokens, progress=False)
    path = tmp_path / "smollm2.html"
    write_report(str(path), html)
    p = Page(browser).open(path.as_uri())
    assert "causal check: ablating the top induction heads" in p.page.inner_text("#causal-check")
    check_page(p, ["0.3", "16.0", "18.6"])
    p.done()
