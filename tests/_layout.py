"""Measurements of drawn figures in a real browser (Playwright page): text cut by its figure's edge, frames that hold
no figure, labels that overlap labels or nodes. Used by tests/test_report_layout.py and tests/test_circuit_graph.py."""

from __future__ import annotations

# Every visible <text> of every plotly figure, with its figure's box: [figure index, text, text box, figure box].
TEXTS_JS = """(sel) => { const out = [];
  const box = (e) => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
  [...document.querySelectorAll(sel)].forEach((fig, i) => {
    const svg = fig.querySelector('.main-svg'); if (!svg) return;
    const fb = box(svg);
    for (const t of fig.querySelectorAll('svg text')) {
      const r = t.getBoundingClientRect();
      if (!r.width || !r.height || !t.textContent.trim()) continue;
      if (t.closest('.hoverlayer')) continue;           // hover labels come and go
      const st = getComputedStyle(t); if (st.display === 'none' || st.visibility === 'hidden' || st.opacity === '0') continue;
      out.push([i, t.textContent, box(t), fb]);
    }
  });
  return out; }"""


def clipped_texts(page, selector: str = ".js-plotly-plot", tol: float = 0.5):
    """Texts that reach past their figure's edge: [(figure index, text, text box, figure box)]."""
    rows = page.evaluate(TEXTS_JS, selector)
    return [r for r in rows if r[2][0] < r[3][0] - tol or r[2][1] < r[3][1] - tol or r[2][2] > r[3][2] + tol
            or r[2][3] > r[3][3] + tol]


EMPTY_FRAMES_JS = """() => [...document.querySelectorAll('.fig')].filter(d => {
    const r = d.getBoundingClientRect(); if (!r.width || !r.height) return false;       // hidden: fine
    if (getComputedStyle(d).display === 'none') return false;
    return !d.querySelector('.main-svg'); }).map(d => d.id || d.className)"""


def empty_frames(page):
    """Visible figure frames (``.fig``) that hold no plotly figure."""
    return page.evaluate(EMPTY_FRAMES_JS)


# Node labels (scatter text) and node markers of one figure, as boxes.
NODES_JS = """(sel) => { const fig = document.querySelector(sel);
  const box = (e) => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
  const labels = [...fig.querySelectorAll('.scatterlayer .textpoint text')].filter(t => t.textContent.trim())
      .map(t => [t.textContent, box(t)]);
  const marks = [...fig.querySelectorAll('.scatterlayer .trace')].flatMap(tr => {
      const texts = tr.querySelectorAll('.textpoint').length;
      return texts ? [...tr.querySelectorAll('.points .point')].map(p => box(p)) : []; });
  return [labels, marks]; }"""


def overlap(a, b, tol: float = 0.5) -> bool:
    return a[0] < b[2] - tol and b[0] < a[2] - tol and a[1] < b[3] - tol and b[1] < a[3] - tol


def label_overlaps(page, selector: str):
    """(label/label overlaps, label/node overlaps) of a graph's node labels, by their drawn boxes."""
    labels, marks = page.evaluate(NODES_JS, selector)
    ll = [(a[0], b[0]) for i, a in enumerate(labels) for b in labels[i + 1:] if overlap(a[1], b[1])]
    ln = [(a[0], m) for a in labels for m in marks if overlap(a[1], m)]
    return ll, ln, len(labels), len(marks)
