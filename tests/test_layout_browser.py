"""Layouts a reader sees, measured in headless Chromium (driven as tests/test_browser.py drives it; issue 45):
no edge of the report's trace graph passes through another node (pixel distances on the rendered figure; the
issue's 16.0 → 18.6 edge ran through 17.3 and read as a chain), and the standalone ``qkcircuits attend -o`` page is
drawn in the report's style, with tick values on both marginals, the query side's values growing to the right and
its sources top-down as the heatmap's rows."""

from __future__ import annotations

import math

import pytest
import torch

import qkcircuits as qk
from qkcircuits.viz import report_html, write_report
from qkcircuits.viz._attend_view import attend_page
from test_browser import Page, browser, wait_js  # noqa: F401  (the browser fixture)

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def four_layers():
    """A random attention-only model with 4 layers x 4 heads (TransformerLens native, no tokenizer), room for three
    heads on one line: 1.0, 2.1, 3.2."""
    from transformer_lens.config import TransformerBridgeConfig
    from transformer_lens.model_bridge import TransformerBridge

    cfg = dict(d_model=64, d_head=16, n_layers=4, n_ctx=32, n_heads=4, d_vocab=50, attn_only=True,
               normalization_type=None, positional_embedding_type="standard", act_fn="relu", seed=1, model_name="r")
    return TransformerBridge.boot_native(TransformerBridgeConfig(**cfg), device="cpu").eval()


def _collinear_trace(L: int = 4, H: int = 4):
    """Receivers 2.1 and 3.2; edges 1.0 → 2.1 (k), 2.1 → 3.2 (q) and 1.0 → 3.2 (k), whose straight line runs through
    2.1 (x = head, y = layer: (0, 1), (1, 2), (2, 3))."""
    recv = [qk.Head(2, 1), qk.Head(3, 2)]
    eff = {x: torch.full((2, L, H), float("nan")) for x in "qkv"}
    for i, r in enumerate(recv):
        for x in "qkv":
            eff[x][i, :r.layer] = 0.001
    eff["k"][0, 1, 0], eff["k"][1, 1, 0], eff["q"][1, 2, 1] = 0.8, 0.7, 0.6
    return qk.results.PathEffects("r", "mean", recv, list("qkv"), {x: "induction" for x in "qkv"}, eff,
                                  {x: torch.ones(2) for x in "qkv"}, n_layers=L, n_heads=H,
                                  labels={"1.0": ["previous-token"]})


def _segment_distance(p, a, b) -> float:
    (px, py), (ax, ay), (bx, by) = p, a, b
    dx, dy = bx - ax, by - ay
    t = max(0.0, min(1.0, ((px - ax) * dx + (py - ay) * dy) / ((dx * dx + dy * dy) or 1.0)))
    return math.hypot(px - ax - t * dx, py - ay - t * dy)


def test_no_trace_edge_passes_through_another_node(browser, four_layers, tmp_path):  # noqa: F811
    scores = qk.scan(four_layers, n_seqs=2, seg_len=8, prefix_seqs=2, prefix_len=5, eigen_copying=False,
                     copying=False, progress=False)
    path = tmp_path / "trace.html"
    write_report(str(path), report_html(four_layers, scores=scores, grid_k=0, trace=_collinear_trace(), attend=[],
                                        progress=False))
    p = Page(browser).open(path.as_uri())
    # where plotly drew them: every node's marker and every edge's points, in page pixels
    drawn = p.page.evaluate("""() => { const d = document.getElementById('grid-circuit'), l = d._fullLayout;
        const px = (x, y) => [l.xaxis.l2p(x) + l.xaxis._offset, l.yaxis.l2p(y) + l.yaxis._offset];
        const nodes = [], edges = [];
        for (const t of d.data) {
            if (t.mode === 'markers+text') t.text.forEach((h, i) => nodes.push([h, px(t.x[i], t.y[i]), t.marker.size / 2]));
            if (t.mode === 'lines' && t.meta) edges.push([t.meta.src, t.meta.dst, t.x.map((x, i) => px(x, t.y[i])), t.line.width]);
        }
        return {nodes, edges, lines: d.querySelectorAll('.scatterlayer path.js-line').length}; }""")
    nodes = {h: (pt, r) for h, pt, r in drawn["nodes"]}
    assert set(nodes) == {"1.0", "2.1", "3.2"} and drawn["lines"] == 3, drawn
    assert {(s, d) for s, d, _, _ in drawn["edges"]} == {("1.0", "2.1"), ("2.1", "3.2"), ("1.0", "3.2")}
    for src, dst, pts, width in drawn["edges"]:
        for head, (centre, radius) in nodes.items():
            if head in (src, dst):
                continue
            gap = min(_segment_distance(centre, a, b) for a, b in zip(pts, pts[1:]))
            assert gap > radius + width / 2 + 2, f"edge {src} → {dst} passes {gap:.1f} px from {head}'s centre"
    # the check bites: drawn straight, 1.0 → 3.2 would run through 2.1's marker
    (a, _), (b, _), (c, r) = nodes["1.0"], nodes["3.2"], nodes["2.1"]
    assert _segment_distance(c, a, b) < r
    p.done()


def test_attend_page_is_styled_with_tick_values_and_query_rows_top_down(browser, hand_built, tmp_path):  # noqa: F811
    res = qk.attend(hand_built, "1.0", torch.tensor([[0, 5, 6, 7, 5, 6, 7]]), key="induction")
    path = tmp_path / "attend.html"
    path.write_text(attend_page(res), encoding="utf-8")
    p = Page(browser)
    pg = p.page
    pg.goto(path.as_uri())
    wait_js(pg, "document.querySelector('.js-plotly-plot') && document.querySelector('.js-plotly-plot')._fullLayout",
            timeout=30_000)
    # the report's CSS, not the browser's defaults (Times, 32 px headings, black notes)
    style = pg.evaluate("""() => { const s = (sel) => getComputedStyle(document.querySelector(sel));
        return [s('body').fontFamily, s('h1').fontSize, s('p.muted').color, s('.qk-attend li').fontSize]; }""")
    assert style == ["system-ui, sans-serif", "20px", "rgb(102, 102, 102)", "13px"], style
    got = pg.evaluate("""() => { const d = document.querySelector('.js-plotly-plot'), l = d._fullLayout;
        const ticks = (cls) => [...d.querySelectorAll('g.' + cls + ' text')].map(t => t.textContent);
        return {heat: d.querySelectorAll('.heatmaplayer image').length, bars: d.querySelectorAll('.barlayer path').length,
                key_ticks: ticks('y2tick'), query_value_ticks: ticks('x3tick'), query_rows: ticks('y3tick'),
                query_range: l.xaxis3.range, first_row_y: l.yaxis3.l2p(0), last_row_y: l.yaxis3.l2p(d.data[2].y.length - 1),
                rows: d.data[2].y}; }""")
    assert got["heat"] >= 1 and got["bars"] >= 2, got
    assert len(got["key_ticks"]) >= 2 and len(got["query_value_ticks"]) >= 2, got       # both marginals read off
    assert got["query_range"][0] < got["query_range"][1]                                  # positive to the right
    assert got["first_row_y"] < got["last_row_y"] and got["query_rows"][0] == got["rows"][0] == "emb", got
    p.done()
