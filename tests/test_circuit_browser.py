"""The report's circuit section in a real browser (headless Chromium, network blocked, as tests/test_browser.py
drives it): the faithfulness curve and the circuit graph drew their lines and markers, the roles and top-edges
tables hold the file's rows as text (a hostile role string stays text), and a click on a head node shows
that head's panel. ``QK_SCREENSHOTS=docs/img`` writes docs/img/report-circuit-section.png."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import qkcircuits as qk
from qkcircuits.viz import report_html, write_report
from test_browser import SHOTS, Page, browser  # noqa: F401  (the browser fixture)
from test_circuit_view import CHAIN, HOSTILE

pytestmark = pytest.mark.browser


def _click_node(p: Page, layer: int, head: int):
    """Click the node of head (layer, head) in the circuit graph (its marker's data coordinates from the figure)."""
    pg = p.page
    pg.locator("#circuit-graph").scroll_into_view_if_needed()
    x, y = pg.evaluate(f"""() => {{ const d = document.getElementById('circuit-graph'), l = d._fullLayout;
        for (const t of d.data) if (t.mode === 'markers+text') {{ const i = t.text.indexOf('{layer}.{head}');
            if (i >= 0) return [l.xaxis.l2p(t.x[i]) + l.xaxis._offset, l.yaxis.l2p(t.y[i]) + l.yaxis._offset]; }}
        return null; }}""")
    box = pg.locator("#circuit-graph").bounding_box()
    pg.mouse.click(box["x"] + x, box["y"] + y)


def test_report_circuit_section_draws_offline(browser, hand_built, tmp_path):  # noqa: F811
    scores = qk.scan(hand_built, n_seqs=4, seg_len=12, prefix_seqs=2, eigen_copying=False, progress=False)
    data = json.loads(json.dumps(CHAIN))
    data["roles"]["0.0"]["role"] = HOSTILE
    path = tmp_path / "circuit.html"
    write_report(str(path), report_html(hand_built, scores=scores, grid_k=1, circuit=data, progress=False))
    p = Page(browser).open(path.as_uri())
    pg = p.page
    # the curve: one line through the 4 points on the log axis, and the dashed 0.8 line
    assert pg.evaluate("() => document.querySelectorAll('#circuit-curve .scatterlayer path.js-line').length") == 1
    assert pg.evaluate("() => document.querySelectorAll('#circuit-curve .scatterlayer .point').length") == 4
    assert pg.evaluate("() => document.getElementById('circuit-curve')._fullLayout.xaxis.type") == "log"
    assert pg.evaluate("() => document.querySelectorAll('#circuit-curve .shapelayer path').length") == 1
    assert "CPR 0.812" in pg.inner_text("#circuit-curve")
    assert pg.locator("#circuit-section .banner").count() == 0           # no warnings in this file
    # the graph: 2 edge lines, 3 nodes (0.0, 1.0, logits) and their names
    assert pg.evaluate("() => document.querySelectorAll('#circuit-graph .scatterlayer path.js-line').length") == 2
    names = pg.evaluate("""() => [...document.querySelectorAll('#circuit-graph .scatterlayer .textpoint')]
        .map(t => t.textContent).sort()""")
    assert names == ["0.0", "1.0", "logits"]
    # tables: the file's rows as text; the hostile role is shown, never parsed
    roles = pg.evaluate("""() => [...document.querySelectorAll('#circuit-roles > tbody > tr, #circuit-roles > tr')]
        .slice(1).map(r => [...r.children].map(c => c.querySelector('table.kv')
            ? [...c.querySelectorAll('table.kv tr')].map(kr => [...kr.children].map(x => x.textContent))
            : c.textContent))""")
    # the evidence is a table of its own in its cell: one row per name
    assert roles == [["0.0", HOSTILE, [["previous token", "1"]]],
                     ["1.0", "induction", [["induction", "0.99"], ["direct effect", "0.5"]]]]
    assert pg.locator("#circuit-section img").count() == 0
    edges = pg.evaluate("""() => [...document.querySelectorAll('#circuit-edges tr')].slice(1)
        .map(r => [...r.children].map(c => c.textContent).slice(0, 4))""")
    assert edges == [["0.0", "1.0", "k", "0.6000"], ["1.0", "logits", "", "-0.3000"]]
    # a click on a head node shows that head's panel
    first = p.shown()
    other = "1.0" if first == "0.0" else "0.0"
    _click_node(p, int(other[0]), int(other[2]))
    p.wait_shown(other)
    if SHOTS:
        pg.locator("#circuit-section").screenshot(path=str(Path(SHOTS) / "report-circuit-section.png"))
    p.done()
