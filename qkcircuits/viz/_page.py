"""The one page both views use: HTML skeleton, CSS and the viewer script, plus the bundled JS libraries.

The viewer script reads its data from ``window.QK_SOURCE``: ``{"mode": "static", ...}`` (the report: grids
and per-head panels embedded) or ``{"mode": "server"}`` (the app: ``/api/info`` and ``/api/head``).
Token strings reach the DOM only through ``textContent`` (never ``innerHTML``), and embedded JSON has every
``<``, ``>``, ``&``, U+2028 and U+2029 escaped (``embed_json``), so no label such as ``</script>`` or
``<!--<script>`` can break out of the page or stop it rendering.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path


def plotly_js_path() -> Path:
    """plotly.js as shipped in the installed plotly package (~4.8 MB, no network)."""
    import plotly

    return Path(plotly.__file__).parent / "package_data" / "plotly.min.js"


def circuitsvis_js_path() -> Path:
    """circuitsvis's browser bundle (``dist/cdn/iife.js``, ~1.3 MB) from the installed package."""
    import circuitsvis

    return Path(circuitsvis.__file__).parent / "dist" / "cdn" / "iife.js"


@lru_cache(maxsize=2)
def script_text(which: str) -> str:
    """The library's JS made safe to inline (``inline_js``), the source-map comment removed (a browser with
    devtools open would otherwise try to fetch ``iife.js.map``)."""
    path = plotly_js_path() if which == "plotly" else circuitsvis_js_path()
    text = path.read_text(encoding="utf-8")
    lines = text.rstrip().splitlines()
    if lines and lines[-1].startswith("//# sourceMappingURL"):
        text = "\n".join(lines[:-1])
    return inline_js(text)


_JS_BREAKOUTS = re.compile(r"<(/|!--|script)", re.IGNORECASE)


def inline_js(code: str) -> str:
    r"""JavaScript source safe inside ``<script>...</script>``: ``</`` (which could close the element), ``<!--``
    and ``<script`` (which together switch the HTML parser into the state where ``</script>`` no longer
    closes it) are written with escapes that mean the same characters inside JS strings and regexes, where
    they occur in the bundled libraries; U+2028/U+2029 as escapes as well.

    >>> print(inline_js('x = "</script><!--<script>"'))
    x = "<\/script>\x3c!--\x3cscript>"
    """
    def esc(m: "re.Match[str]") -> str:
        return "<\\/" if m.group(1) == "/" else "\\x3c" + m.group(1)

    return _JS_BREAKOUTS.sub(esc, code).replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def embed_json(obj) -> str:
    r"""JSON for a ``<script>`` block: every ``<``, ``>``, ``&`` and U+2028/U+2029 as a ``\uXXXX`` escape (they
    only occur inside JSON strings, where the escape is the same character), so no string can close the
    script, open a comment or end the JavaScript line. NaN is not valid JSON and must be None already.

    >>> print(embed_json({"label": "<!--<script></script>" + chr(0x2028)}))
    {"label":"\u003c!--\u003cscript\u003e\u003c/script\u003e\u2028"}
    """
    text = json.dumps(obj, allow_nan=False, separators=(",", ":"))
    return escape_json_text(text)


def escape_json_text(text: str) -> str:
    """``embed_json``'s escapes applied to JSON text made elsewhere (e.g. plotly's ``to_json``)."""
    return (text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


CSS = """
body { font-family: system-ui, sans-serif; margin: 16px; color: #222; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 17px; margin: 18px 0 6px; }
.muted { color: #666; font-size: 12px; }
#grids { display: flex; flex-wrap: wrap; gap: 8px; }
.grid-box { border: 1px solid #ddd; padding: 2px; }
.figs { display: flex; flex-wrap: wrap; gap: 10px; align-items: flex-start; }
.fig { border: 1px solid #eee; min-width: 200px; min-height: 60px; }
#info table { border-collapse: collapse; font-size: 13px; } #info td { padding: 1px 8px; border-bottom: 1px solid #eee; }
table.rows { border-collapse: collapse; font-size: 13px; } table.rows td, table.rows th { padding: 1px 8px; border-bottom: 1px solid #eee; text-align: left; }
table.kv { border-collapse: collapse; font-size: 12px; } table.kv th, table.kv td { padding: 0 6px 0 0; border: 0; font-weight: normal; vertical-align: top; } table.kv th { color: #666; }
h3 { font-size: 15px; margin: 12px 0 4px; }
#error { color: #b00; font-weight: bold; white-space: pre-wrap; }
#controls input[type=text], #controls textarea { width: 560px; font-family: monospace; }
.flag { background: #fdd; padding: 0 4px; margin-right: 4px; border-radius: 3px; }
.banner { background: #fff0f0; border: 1px solid #e0a0a0; color: #900; padding: 6px 10px; margin: 6px 0;
          font-weight: bold; }
.section { margin-bottom: 10px; }
"""

VIEWER_JS = r"""
(function () {
  const SRC = window.QK_SOURCE;
  const PLOT_CONFIG = {displaylogo: false, responsive: false, showLink: false, showSendToCloud: false,
                       showEditInChartStudio: false, modeBarButtonsToRemove: ['sendDataToCloud']};
  let widgetCount = 0;
  const $ = (id) => document.getElementById(id);
  function text(el, s) { el.textContent = s; return el; }
  function mk(tag, s) { const e = document.createElement(tag); if (s !== undefined) e.textContent = s; return e; }
  function showError(msg) { text($('error'), msg || ''); }

  async function getJSON(url, body) {
    const opts = body === undefined ? {} : {method: 'POST', headers: {'Content-Type': 'application/json'},
                                           body: JSON.stringify(body)};
    const r = await fetch(url, opts);
    const data = await r.json();
    if (!r.ok) throw new Error(data.error || ('HTTP ' + r.status));
    return data;
  }

  function drawGrids(grids) {
    const box = $('grids');
    box.replaceChildren();
    for (const g of grids) {
      const d = mk('div'); d.className = 'grid-box'; d.id = 'grid-' + g.key; d.dataset.key = g.key;
      box.appendChild(d);
      Plotly.newPlot(d, g.figure.data, g.figure.layout, PLOT_CONFIG);
      d.on('plotly_click', (ev) => { const p = ev.points[0]; select(p.y + '.' + p.x); });
    }
  }

  function highlight(layer, head) {
    for (const d of document.querySelectorAll('.grid-box')) {
      Plotly.relayout(d, {shapes: [{type: 'rect', x0: head - 0.5, x1: head + 0.5, y0: layer - 0.5, y1: layer + 0.5,
                                    line: {color: '#000', width: 2}}]});
    }
  }

  function fmt(v) { return v === null || v === undefined ? 'n/a' : (typeof v === 'number' ? v.toFixed(4) : String(v)); }

  function drawInfo(p) {
    const info = p.info || {}, box = $('info');
    box.replaceChildren();
    const t = mk('table');
    const row = (k, v) => { const tr = mk('tr'); tr.appendChild(mk('td', k)); tr.appendChild(mk('td', v)); t.appendChild(tr); };
    if (info.labels) row('labels', info.labels.length ? info.labels.join(', ') : 'none');
    for (const [k, v] of Object.entries(info.scores || {})) row(k, fmt(v));
    row('eigenvalue copying (W_E OV W_U)', fmt(info.eigen_copying));
    if (info.ablation) row('ablation effect (' + info.ablation.method + ', ' + info.ablation.metric + ')', fmt(info.ablation.effect));
    if (info.token_views) row('token views: input / median copying rank (of ' + info.token_views.vocabulary + ')',
                              info.token_views.input + ' / ' + fmt(info.token_views.copying_rank_median));
    if (info.flags) row('diagnostics flags', info.flags.length ? info.flags.join(', ') : 'none');
    for (const [k, v] of Object.entries(info.diagnostics || {})) row(k, fmt(v));
    box.appendChild(t);
    for (const n of p.notes || []) box.appendChild(mk('div', n)).className = 'muted';
  }

  // A frame holds a figure or is hidden: what is missing is said in one line under the figures.
  function drawFig(id, fig, missing) {
    const d = $(id);
    Plotly.purge(d);
    d.replaceChildren();
    if (!fig) { d.style.display = 'none'; if (missing) $('fig-notes').appendChild(mk('div', missing)); return; }
    d.style.display = '';
    Plotly.newPlot(d, fig.data, fig.layout, PLOT_CONFIG);
  }

  function drawAttention(att) {
    const box = $('attn');
    box.replaceChildren();
    if (!att) { box.appendChild(mk('div', 'no prompt given')).className = 'muted'; return; }
    const w = mk('div'); w.id = 'attn-widget-' + (++widgetCount); w.className = 'cv-widget';
    box.appendChild(w);
    CircuitsVis.render(w.id, CircuitsVis.AttentionHeads, att);
  }

  function drawPanel(p) {
    text($('head-title'), 'Head ' + p.head);
    document.body.dataset.shownHead = p.head;
    $('missing').replaceChildren();
    $('fig-notes').replaceChildren();
    drawInfo(p);
    drawFig('fig-qk', p.figures.qk, '');
    drawFig('fig-ov', p.figures.ov, '');
    drawFig('fig-pos', p.figures.pos, 'no positional profile (see notes)');
    drawFig('fig-comp', p.figures.comp, 'no K-composition partners (layer 0)');
    drawFig('fig-reads', p.figures.reads, '');
    drawAttention(p.attention);
    highlight(p.layer, p.index);
    const sel = $('head-select'); if (sel && sel.value !== p.head) sel.value = p.head;
  }

  async function select(key) {
    showError('');
    if (SRC.mode === 'static') {
      const p = SRC.panels[key];
      if (p) return drawPanel(p);
      text($('head-title'), 'Head ' + key);
      document.body.dataset.shownHead = key;
      $('fig-notes').replaceChildren();
      for (const id of ['fig-qk', 'fig-ov', 'fig-pos', 'fig-comp', 'fig-reads']) drawFig(id, null, '');
      $('info').replaceChildren(); $('attn').replaceChildren();
      text($('missing'), 'Head ' + key + ' was not precomputed for this report (' + SRC.left_out +
           '). Rerun: qkcircuits report MODEL --heads ' + key);
      const [l, h] = key.split('.').map(Number); highlight(l, h);
      return;
    }
    try {
      const body = {head: key, tokens: $('tokens').value, prompt: $('prompt').value};
      if ($('input').value) body.view = $('input').value;
      $('status').textContent = 'computing ' + key + ' ...';
      const p = await getJSON('api/head', body);
      drawPanel(p);
      $('status').textContent = '';
    } catch (e) { $('status').textContent = ''; showError(e.message); }
  }

  function table(id, header, rows) {
    const t = mk('table'); t.id = id; t.className = 'rows';
    const hr = mk('tr'); for (const h of header) hr.appendChild(mk('th', h)); t.appendChild(hr);
    const num = (v) => typeof v !== 'number' ? fmt(v) : (v === 0 || Math.abs(v) >= 1e-3 ? v.toFixed(4) : v.toExponential(2));
    // a cell {kv: [[name, value], ...]} (a role's evidence) is a small table of its own, one row per name
    const cell = (v) => {
      if (!(v && typeof v === 'object' && Array.isArray(v.kv))) return mk('td', num(v));
      const td = mk('td'), kv = mk('table'); kv.className = 'kv';
      for (const [k, x] of v.kv) { const tr = mk('tr'); tr.appendChild(mk('th', String(k))); tr.appendChild(mk('td', String(x))); kv.appendChild(tr); }
      td.appendChild(kv);
      return td;
    };
    for (const r of rows) { const tr = mk('tr'); for (const v of r) tr.appendChild(cell(v)); t.appendChild(tr); }
    return t;
  }

  // Sections above the heads (the circuit of `qkcircuits circuit --json`, the scan's causal check, ...): each a
  // title and a list of blocks drawn in order, so a new panel is one more block or section in the data.
  function drawBlocks(box, blocks, clickable) {
    for (const b of blocks) {
      if (b.type === 'banner') {
        const d = mk('div'); d.className = 'banner';
        for (const line of b.lines) d.appendChild(mk('div', '\u26a0 ' + line));
        box.appendChild(d);
      } else if (b.type === 'note') {
        box.appendChild(mk('div', b.text)).className = 'muted';
      } else if (b.type === 'figures') {
        const figs = mk('div'); figs.className = 'figs'; box.appendChild(figs);
        for (const f of b.figures) {
          const d = mk('div'); d.className = 'fig'; d.id = f.id; figs.appendChild(d);
          Plotly.newPlot(d, f.figure.data, f.figure.layout, PLOT_CONFIG);
          if (f.click === 'head' && clickable) d.on('plotly_click', (ev) => {
            const cd = ev.points[0].customdata;
            if (cd && /^\d+\.\d+$/.test(cd[0])) select(cd[0]);
          });
        }
      } else if (b.type === 'table') {
        if (b.title) box.appendChild(mk('h3', b.title));
        box.appendChild(b.rows.length ? table(b.id, b.header, b.rows) : mk('div', b.empty || 'none'));
      }
    }
  }

  function drawSections(sections, clickable) {
    const host = $('sections');
    host.replaceChildren();
    for (const s of sections || []) {
      const box = mk('div'); box.id = s.id; box.className = 'section'; host.appendChild(box);
      box.appendChild(mk('h2', s.title));
      drawBlocks(box, s.blocks, clickable);
    }
  }

  function fillSelect(keys) {
    const sel = $('head-select');
    sel.replaceChildren();
    for (const k of keys) { const o = mk('option', k); o.value = k; sel.appendChild(o); }
    sel.addEventListener('change', () => select(sel.value));
  }

  async function start() {
    try {
      let meta = SRC;
      if (SRC.mode === 'server') {
        meta = await getJSON('api/info');
        $('tokens').value = meta.default_tokens;
        $('prompt').value = meta.default_prompt;
        $('go').addEventListener('click', () => select($('head-select').value));
      }
      text($('model'), meta.title);
      text($('summary'), meta.summary);
      const heads = meta.heads || [];
      drawSections(meta.sections, heads.length > 0);
      if (!heads.length && !(meta.grids || []).length) $('heads-part').style.display = 'none';   // a circuit alone
      drawGrids(meta.grids || []);
      fillSelect(heads);
      if (heads.length) await select(meta.first || heads[0]);
      document.body.dataset.ready = '1';
    } catch (e) { showError(e.message); document.body.dataset.ready = 'error'; }
  }
  start();
})();
"""

BODY = """
<h1 id="model"></h1>
<div id="summary" class="muted"></div>
<div id="error"></div>
<div id="sections"></div>
<div id="heads-part">
<h2>Heads (click a cell to show that head)</h2>
<div id="grids"></div>
<div id="controls">{controls}</div>
<h2 id="head-title"></h2>
<div id="missing" class="muted"></div>
<div id="info"></div>
<div class="figs">
  <div class="fig" id="fig-qk"></div><div class="fig" id="fig-ov"></div>
</div>
<div class="figs">
  <div class="fig" id="fig-pos"></div><div class="fig" id="fig-comp"></div>
</div>
<div class="figs"><div class="fig" id="fig-reads"></div></div>
<div id="fig-notes" class="muted"></div>
<h2>Attention pattern on the prompt</h2>
<div id="attn"></div>
</div>
"""

STATIC_CONTROLS = 'show head: <select id="head-select"></select>'
SERVER_CONTROLS = """
<p>head: <select id="head-select"></select> <button id="go">show</button> <span id="status" class="muted"></span></p>
<p>tokens (comma-separated, each one token; e.g. " the, of, cat" or "#3, #5"):<br>
<input type="text" id="tokens" maxlength="4000"></p>
<p>prompt:<br><textarea id="prompt" rows="3" maxlength="20000"></textarea></p>
<p>QK/OV token inputs: <select id="input"><option value="">default (direct at layer 0, contextual after)</option>
<option value="direct">direct</option><option value="effective">effective</option>
<option value="contextual">contextual</option></select></p>
"""


def page(title: str, source_js: str, scripts: str, server: bool) -> str:
    """The full HTML page: ``scripts`` loads plotly + circuitsvis (inlined or served), ``source_js`` sets
    ``window.QK_SOURCE``."""
    body = BODY.replace("{controls}", SERVER_CONTROLS if server else STATIC_CONTROLS)
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_esc(title)}</title><style>{CSS}</style>\n{scripts}\n</head><body>{body}\n"
            f"<script>{source_js}</script>\n<script>{VIEWER_JS}</script>\n</body></html>\n")


def _esc(s: str) -> str:
    """Text for HTML content or a quoted attribute.

    >>> _esc("<b title='x'>&</b>")
    '&lt;b title=&#x27;x&#x27;&gt;&amp;&lt;/b&gt;'
    """
    import html

    return html.escape(str(s), quote=True)
