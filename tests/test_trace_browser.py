"""The trace views in a real browser (headless Chromium, as tests/test_browser.py drives it): the circuit graph
draws, a click on a node shows that head, and a traced head's "reads from" panel draws its bars.
``QK_SCREENSHOTS=docs/img`` refreshes docs/img/report-circuit.png from the SmolLM2 test."""

from __future__ import annotations

from pathlib import Path

import pytest

import qkcircuits as qk
from qkcircuits._paths.trace import trace
from qkcircuits.viz import report_html, write_report
from test_browser import SHOTS, Page, browser  # noqa: F401  (the browser fixture)

pytestmark = pytest.mark.browser


def _node_click(p: Page, layer: int, head: int):
    """Click the node of head (layer, head) in the circuit graph (x = head, y = layer)."""
    pg = p.page
    pg.locator("#grid-circuit").scroll_into_view_if_needed()
    x, y = pg.evaluate(f"""() => {{ const d = document.getElementById('grid-circuit'); const l = d._fullLayout;
        return [l.xaxis.l2p({head}) + l.xaxis._offset, l.yaxis.l2p({layer}) + l.yaxis._offset]; }}""")
    box = pg.locator("#grid-circuit").bounding_box()
    pg.mouse.click(box["x"] + x, box["y"] + y)


def _check_trace_views(p: Page, receiver: str):
    pg = p.page
    lines = pg.evaluate("() => document.querySelectorAll('#grid-circuit .scatterlayer path.js-line').length")
    nodes = pg.evaluate("() => document.querySelectorAll('#grid-circuit .scatterlayer path.point').length")
    assert lines >= 1 and nodes >= 2, (lines, nodes)
    assert pg.locator("#fig-reads .barlayer path").count() >= 1, f"no 'reads from' bars for {receiver}"


def test_trace_report_draws_circuit_and_reads_from(browser, hand_built, tmp_path):  # noqa: F811
    scores = qk.scan(hand_built, n_seqs=4, seg_len=12, prefix_seqs=2, eigen_copying=False, progress=False)
    res = trace(hand_built, "1.0", scores=scores, progress=False)
    path = tmp_path / "trace.html"
    write_report(str(path), report_html(hand_built, scores=scores, grid_k=1, trace=res, progress=False))
    p = Page(browser).open(path.as_uri())
    assert p.shown() == "1.0"
    _check_trace_views(p, "1.0")
    # the k edge 0.0 -> 1.0 is the only edge drawn (effect >= 10 % of the clean value and above p95); its effect is in
    # the hover of its marker, not written on the edge (edge labels overlapped)
    hover = p.page.evaluate("""() => document.getElementById('grid-circuit').data.filter(t => t.name === 'edges')
        .flatMap(t => t.text)""")
    assert hover == ["0.0 → 1.0 (k)<br>effect 1.000 (100% of the clean 1)"], hover
    _node_click(p, 0, 0)
    p.wait_shown("0.0")
    assert p.page.locator("#fig-reads .js-plotly-plot").count() == 0   # 0.0 was not traced: no panel
    p.done()


@pytest.mark.smollm2
def test_smollm2_trace_report(browser, smollm2, tmp_path):  # noqa: F811
    scores = qk.scan(smollm2, eigen_copying=False, copying=False, progress=False)
    res = trace(smollm2, k=3, into=("q", "k"), scores=scores, progress=False)
    html = report_html(smollm2, scores=scores, grid_k=1, trace=res, progress=False)
    path = tmp_path / "smollm2-trace.html"
    write_report(str(path), html)
    p = Page(browser).open(path.as_uri())
    first = str(res.receivers[0])
    assert p.shown() == first
    _check_trace_views(p, first)
    if SHOTS:
        p.page.locator("#grid-circuit").screenshot(path=str(Path(SHOTS) / "report-circuit.png"))
        p.page.locator("#fig-reads").scroll_into_view_if_needed()
        p.page.locator("#fig-reads").screenshot(path=str(Path(SHOTS) / "report-reads-from.png"))
    p.done()
