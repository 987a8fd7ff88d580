"""Figures that draw themselves offline in Jupyter: self-contained ``text/html``, libraries from the installed packages.

>>> from qkcircuits.viz._figures import score_grid
>>> fig = Figure(score_grid(qk.scan(model, progress=False)["induction"], "induction"))   # a plotly go.Figure
>>> bundle = fig._repr_mimebundle_()                                 # what Jupyter shows: drawn inline, offline
>>> "Plotly.newPlot" in bundle["text/html"], bundle["text/plain"]
(True, '<qkcircuits Figure: induction (heatmap); fig.show() or fig.save(path)>')
>>> view = qk.plot.attention(model, None, ["1.0"])                   # an AttentionView
>>> view.save(str(tmp / "attn.html")); (tmp / "attn.html").exists()  # one offline file
True

Why not plotly's own notebook output (measured with nbclient + ipykernel, plotly 7.1): its default renderer in
a kernel emits only ``application/vnd.plotly.v1+json``, which an nbconvert HTML export cannot draw; its
``notebook`` renderer adds ``<script src="https://cdnjs.cloudflare.com/.../mathjax/...">`` to every figure.
circuitsvis's own ``_repr_html_`` probes google.com and switches to unpkg.com when it believes it is online.
So every figure here carries its own ``text/html``: a ``<div>`` and a script that draws it with
``Plotly.newPlot`` / ``CircuitsVis.render``; plotly.js (~4.8 MB) and circuitsvis's bundle (~1.3 MB) are
inlined from the installed packages (``_page.script_text``). ``plotly.io.renderers.default`` is not touched.

Where the libraries go (``set_bundle``; env ``QKCIRCUITS_NOTEBOOK_BUNDLE``):

- ``"page"``: once per page. Jupyter Notebook/Lab and an nbconvert export put every output of a notebook in
  one document, so the first figure that needs a library carries it and later figures reuse
  ``window.Plotly``/``window.CircuitsVis``. A figure whose library is not there yet (outputs rendered out of
  order, e.g. an earlier cell re-run later) queues itself and draws when the library arrives. A library is
  sent again when the cell that carried it runs again (its output is replaced) or was deleted (JupyterLab
  and Notebook 7 say which cell runs, ``cellId``; elsewhere it is sent once per kernel). If the output that
  carried it was cleared by hand, the figure says so and ``qkcircuits.plot.setup()`` sends it again.
- ``"figure"``: in every figure, for front ends that draw each output in its own frame (Google Colab,
  VS Code, Databricks): ~4.8 MB per plotly figure, ~1.3 MB per attention view.
- ``"auto"`` (default): ``"figure"`` when ``google.colab`` is imported or ``VSCODE_PID`` /
  ``DATABRICKS_RUNTIME_VERSION`` is set (the checks plotly uses to pick its renderer), else ``"page"``.
  Outside a kernel (``_repr_html_`` called by another tool) a figure always carries its libraries.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from typing import Dict, Optional, Sequence, Union

import plotly.graph_objects as go

from .._foundation.errors import QKCircuitsError
from .._foundation.io import write_atomic
from ._page import escape_json_text, script_text

MODES = ("auto", "page", "figure")
ENV = "QKCIRCUITS_NOTEBOOK_BUNDLE"
LIBS = {"plotly": "Plotly", "circuitsvis": "CircuitsVis"}
PLOT_CONFIG = {"displaylogo": False, "responsive": False, "showLink": False, "showSendToCloud": False,
               "showEditInChartStudio": False}

_state: Dict[str, object] = {"mode": None, "sent": {}, "deleted": set()}


def set_bundle(mode: str = "auto") -> None:
    """Where plotly.js and circuitsvis go in notebook outputs: ``"page"``, ``"figure"`` or ``"auto"`` (module docs)."""
    if mode not in MODES:
        raise QKCircuitsError(f"bundle mode must be one of {', '.join(MODES)}, got {mode!r}")
    _state["mode"] = mode
    _state["sent"] = {}


def bundle_mode() -> str:
    """The mode in force, ``"auto"`` resolved: ``"page"`` or ``"figure"``."""
    mode = _state["mode"] or os.environ.get(ENV, "auto")
    if mode not in MODES:
        raise QKCircuitsError(f"{ENV}={mode!r}; use one of {', '.join(MODES)}")
    if mode != "auto":
        return mode
    separate_frames = ("google.colab" in sys.modules or "VSCODE_PID" in os.environ
                       or "DATABRICKS_RUNTIME_VERSION" in os.environ)
    return "figure" if separate_frames else "page"


def _cell():
    """(cell id or None, execute-request id) of the running cell, or None outside an IPython kernel."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    ip = get_ipython()
    kernel = getattr(ip, "kernel", None)
    if kernel is None:
        return None
    try:
        parent = kernel.get_parent("shell")
    except Exception:              # older ipykernel: the shell keeps the header
        parent = getattr(ip, "parent_header", None) or {}
    meta = parent.get("metadata") or {}
    _state["deleted"].update(meta.get("deletedCells") or ())
    return meta.get("cellId"), (parent.get("header") or {}).get("msg_id")


def _needs(lib: str, cell) -> bool:
    if cell is None or bundle_mode() == "figure":
        return True
    sent = _state["sent"].get(lib)
    if sent is None:
        return True
    sent_cell, sent_msg = sent
    if sent_cell is not None and sent_cell == cell[0] and sent_msg != cell[1]:
        return True                # the cell that carried it ran again: its old output is being replaced
    return sent_cell is not None and sent_cell in _state["deleted"]


def library_script(lib: str) -> str:
    """A ``<script>`` defining ``window.<Lib>`` from the installed package, then drawing queued figures.

    ``define``/``module``/``exports``/``require`` are hidden from the bundle, so a page with require.js (classic
    Notebook) does not turn it into an anonymous AMD module ("Mismatched anonymous define()")."""
    glob = LIBS[lib]
    return (f"<script>/* qkcircuits: {lib} from the installed package */\n"
            f"(function (define, module, exports, require) {{\n{script_text(lib)}\n;window.{glob} = {glob};\n}})();\n"
            f"(window.__qkDraw = window.__qkDraw || []).filter(function (w) {{ return w[0] === '{lib}'; }})"
            f".forEach(function (w) {{ w[1](); }});\n"
            f"window.__qkDraw = window.__qkDraw.filter(function (w) {{ return w[0] !== '{lib}'; }});</script>")


def _json(obj) -> str:
    # '<' only occurs inside JSON strings, where \u003c is the same character: no '</script>' or '<!--'.
    return escape_json_text(obj if isinstance(obj, str) else json.dumps(obj))   # also > & U+2028/9


def _drawing(lib: str, element_id: str, draw_js: str, data_json: str) -> str:
    """A div plus the script that draws it now, or when ``lib`` arrives, or says why it cannot."""
    glob = LIBS[lib]
    return (f'<div id="{element_id}" class="qk-{lib}"></div>\n<script>(function () {{\n'
            f"  var id = '{element_id}', data = {data_json};\n"
            f"  function draw() {{ var el = document.getElementById(id); if (el && !el.dataset.drawn) {{\n"
            f"    el.dataset.drawn = '1'; {draw_js} }} }}\n"
            f"  function missing() {{ var el = document.getElementById(id);\n"
            f"    if (el && !el.dataset.drawn) el.textContent = '{glob} is not on this page (the output that carried it "
            f"was cleared): run qkcircuits.plot.setup() in a cell, then this one again.'; }}\n"
            f"  if (window.{glob}) draw(); else {{\n"
            f"    (window.__qkDraw = window.__qkDraw || []).push(['{lib}', draw]);\n"
            f"    if (document.readyState === 'complete') setTimeout(missing, 3000);\n"
            f"    else window.addEventListener('load', missing); }}\n"
            f"}})();</script>")


def figure_html(fig: go.Figure, libraries: bool = True) -> str:
    """The figure as an HTML fragment; ``libraries`` prepends plotly.js (~4.8 MB)."""
    draw = "Plotly.newPlot(el, data.figure.data, data.figure.layout, data.config);"
    body = f'{{"figure": {_json(fig.to_json())}, "config": {_json(PLOT_CONFIG)}}}'
    html = _drawing("plotly", f"qk-fig-{uuid.uuid4().hex}", draw, body)
    return (library_script("plotly") + "\n" + html) if libraries else html


def attention_html(props: Dict, libraries: bool = True) -> str:
    """circuitsvis ``AttentionHeads`` as an HTML fragment; ``libraries`` prepends its bundle (~1.3 MB)."""
    draw = "CircuitsVis.render(id, CircuitsVis.AttentionHeads, data);"
    html = _drawing("circuitsvis", f"qk-attn-{uuid.uuid4().hex}", draw, _json(props))
    return (library_script("circuitsvis") + "\n" + html) if libraries else html


def _display(lib: str, make, text: str) -> None:
    """Show one output in the running kernel, carrying ``lib`` when this page needs it; a terminal IPython
    (no kernel, no HTML) gets ``text``."""
    from IPython.display import display

    cell = _cell()
    if cell is None:
        display({"text/plain": text}, raw=True)
        return
    carry = _needs(lib, cell)
    display({"text/html": make(carry), "text/plain": text}, raw=True)
    if carry:
        _state["sent"][lib] = cell


def setup(mode: Optional[str] = None) -> "Libraries":
    """Send plotly.js and circuitsvis to this page now (and set the ``mode`` when given): the output of the
    cell that calls it carries both libraries, so later figures stay small. Returns the object that shows it."""
    if mode is not None:
        set_bundle(mode)
    return Libraries()


class Libraries:
    """The two libraries as one notebook output (shown once; a one-line note says what it holds)."""

    def __repr__(self) -> str:
        return "qkcircuits: plotly.js and circuitsvis for offline figures (shown in a notebook)"

    def _note(self) -> str:
        sizes = {lib: len(script_text(lib)) / 1e6 for lib in LIBS}
        return (f'<div class="qk-libraries" style="color:#666;font-size:12px">qkcircuits: plotly.js '
                f'({sizes["plotly"]:.1f} MB) and circuitsvis ({sizes["circuitsvis"]:.1f} MB) inlined for offline '
                f'figures ({bundle_mode()} mode)</div>')

    def _repr_html_(self) -> str:
        return self._note() + library_script("plotly") + library_script("circuitsvis")

    def _ipython_display_(self) -> None:
        from IPython.display import display

        cell = _cell()
        display({"text/html": self._repr_html_(), "text/plain": repr(self)}, raw=True)
        if cell is not None:
            _state["sent"].update(plotly=cell, circuitsvis=cell)


class Figure(go.Figure):
    """A plotly ``go.Figure`` that shows itself offline in notebooks (module docs); otherwise plain plotly:
    ``fig.data``, ``fig.layout``, ``fig.show()`` (your renderer), ``fig.write_html(path)`` all work as usual."""

    def _ipython_display_(self) -> None:
        _display("plotly", lambda carry: figure_html(self, carry), self._text())

    def _text(self) -> str:
        kinds = ", ".join(sorted({t.type for t in self.data}))
        return f"<qkcircuits Figure: {self.layout.title.text or 'untitled'} ({kinds}); fig.show() or fig.save(path)>"

    def _repr_html_(self) -> str:           # called by other tools: always self-contained
        return figure_html(self, True)

    def _repr_mimebundle_(self, include=None, exclude=None, **kwargs) -> Dict[str, str]:
        return {"text/html": figure_html(self, True), "text/plain": self._text()}

    def save(self, path: Union[str, "os.PathLike[str]"]) -> None:
        """One self-contained offline HTML file (plotly.js inlined, no MathJax), written atomically."""
        write_atomic(str(path), _page_html(self.layout.title.text or "qkcircuits figure", figure_html(self, True)))


class AttentionView:
    """Attention patterns of some heads on one prompt, drawn by circuitsvis ``AttentionHeads``.

    ``pattern`` is ``Float[Tensor, "head query key"]``, ``tokens`` the prompt's token strings, ``heads``
    the head names; ``props`` is exactly what circuitsvis receives (weights rounded to 4 decimals).
    """

    def __init__(self, tokens: Sequence[str], pattern, heads: Sequence[str], props: Dict):
        self.tokens, self.pattern, self.heads, self.props = list(tokens), pattern, list(heads), props

    def __repr__(self) -> str:
        return (f"AttentionView(heads={', '.join(self.heads)}; {len(self.tokens)} tokens; "
                f"pattern {tuple(self.pattern.shape)})")

    def _ipython_display_(self) -> None:
        _display("circuitsvis", lambda carry: attention_html(self.props, carry), repr(self))

    def _repr_html_(self) -> str:
        return attention_html(self.props, True)

    def save(self, path: Union[str, "os.PathLike[str]"]) -> None:
        """One self-contained offline HTML file (circuitsvis inlined), written atomically."""
        write_atomic(str(path), _page_html(f"attention: {', '.join(self.heads)}", attention_html(self.props, True)))


def _page_html(title: str, body: str) -> str:
    esc = title.replace("&", "&amp;").replace("<", "&lt;")
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{esc}</title></head>\n'
            f"<body>\n{body}\n</body></html>\n")


def as_figure(fig_dict: Dict, meta: Optional[Dict] = None) -> Figure:
    """A builder's JSON-ready dict as a ``Figure`` (the dict's ``meta`` kept in ``layout.meta``)."""
    d = {k: v for k, v in fig_dict.items() if k != "meta"}
    fig = Figure(d)
    m = fig_dict.get("meta") or meta
    if m:
        fig.layout.meta = m
    return fig
