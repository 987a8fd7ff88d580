"""The report and the app in a real browser: headless Chromium (Debian's ``chromium``) driven by Playwright.

Every request that is not file:// or http://127.0.0.1 is blocked and recorded; the tests assert that none was
attempted, that the plotly figures and the circuitsvis widget actually drew (SVG/canvas content, not a blank
page), and that clicking a grid cell (report) or choosing a head (app) changes the shown head.
``scripts/dev.sh test`` installs chromium; without it these tests FAIL rather than skip.
Set ``QK_SCREENSHOTS=docs/img`` to refresh the documentation's screenshots from the SmolLM2 tests.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path

import pytest

import qkcircuits as qk
from qkcircuits.viz import create_app, report_html, write_report

pytestmark = pytest.mark.browser

# REFERENCE.md "Offline rendering": flags for a headless Chromium that phones nowhere.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
LOCAL = ("file://", "http://127.0.0.1", "data:", "blob:", "about:")
SHOTS = os.environ.get("QK_SCREENSHOTS")


@pytest.fixture(scope="module")
def browser():
    exe = shutil.which("chromium")
    if exe is None:
        pytest.fail("chromium is not on PATH: run `bash scripts/dev.sh test` (it installs Debian's chromium) or "
                    "`apt-get install -y chromium`")
    from playwright.sync_api import sync_playwright

    profile = tempfile.mkdtemp(prefix="qk-chromium-")
    with sync_playwright() as p:
        # Playwright refuses --user-data-dir in args; a persistent context takes the fresh profile folder.
        ctx = p.chromium.launch_persistent_context(profile, executable_path=exe, args=FLAGS, headless=True,
                                                   viewport={"width": 1400, "height": 1000})
        yield ctx
        ctx.close()
    shutil.rmtree(profile, ignore_errors=True)


def wait_js(page, expr: str, timeout: int) -> None:
    """Wait until the JS expression ``expr`` is truthy, polled from here: the app's Content-Security-Policy
    forbids eval, which playwright's in-page polling (``wait_for_function``) needs."""
    for _ in range(max(1, timeout // 100)):
        if page.evaluate(expr):
            return
        page.wait_for_timeout(100)
    raise AssertionError(f"timed out after {timeout} ms waiting for {expr}")


class Page:
    """A page whose non-local requests are blocked and recorded, and whose JS errors are kept."""

    def __init__(self, browser):
        self.page = browser.new_page()
        self.external, self.errors = [], []
        self.page.route("**/*", self._route)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

    def _route(self, route):
        url = route.request.url
        if url.startswith(LOCAL):
            route.continue_()
        else:
            self.external.append(url)
            route.abort()

    def open(self, url: str):
        self.page.goto(url)
        wait_js(self.page, "document.body.dataset.ready", timeout=60_000)
        assert self.page.evaluate("document.body.dataset.ready") == "1", self.page.inner_text("#error")
        return self

    def shown(self) -> str:
        return self.page.evaluate("document.body.dataset.shownHead")

    def check_drawn(self, figs=("fig-qk", "fig-ov", "fig-pos", "fig-comp")):
        """Every grid and every head figure drew its traces; the attention widget drew canvas/SVG."""
        pg = self.page
        assert pg.locator("#grids .js-plotly-plot").count() >= 1
        drawn = pg.evaluate("""() => [...document.querySelectorAll('#grids .js-plotly-plot')].map(
            d => d.querySelectorAll('.hm image, .heatmaplayer image').length)""")
        assert all(n > 0 for n in drawn), drawn          # plotly draws a heatmap as an <image> in its SVG
        for fid in figs:
            sel = f"#{fid}"
            if pg.locator(f"{sel} .js-plotly-plot, {sel}.js-plotly-plot").count() == 0:
                assert pg.inner_text(sel).strip(), f"{fid} is empty without saying why"
                continue
            marks = pg.evaluate(f"""() => document.querySelector('{sel}').querySelectorAll(
                '.hm image, .heatmaplayer image, .scatterlayer path.js-line, .barlayer path').length""")
            assert marks > 0, f"{fid} has no drawn trace"
        # circuitsvis: the widget rendered real elements with size (canvas or SVG), not an empty div
        wait_js(pg, "document.querySelector('.cv-widget') && "
                "document.querySelector('.cv-widget').querySelectorAll('canvas, svg').length > 0", timeout=30_000)
        box = pg.locator(".cv-widget").bounding_box()
        assert box and box["height"] > 100 and box["width"] > 100
        nonblank = pg.evaluate("""() => { const c = document.querySelector('.cv-widget canvas');
            if (!c) return true; const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            for (let i = 4; i < d.length; i += 4) if (d[i] !== d[0] || d[i+1] !== d[1] || d[i+2] !== d[2]) return true;
            return false; }""")
        assert nonblank, "the attention canvas is one flat colour"

    def click_cell(self, grid_key: str, layer: int, head: int):
        """Click the centre of cell (layer, head) of a score grid (layers run top to bottom)."""
        pg = self.page
        sel = f"#grid-{grid_key} .nsewdrag"
        pg.locator(f"#grid-{grid_key}").scroll_into_view_if_needed()   # mouse clicks land in the viewport only
        box = pg.locator(sel).first.bounding_box()
        n_layers, n_heads = pg.evaluate(f"""() => {{ const z = document.getElementById('grid-{grid_key}').data[0].z;
            return [z.length, z[0].length]; }}""")
        x = box["x"] + (head + 0.5) / n_heads * box["width"]
        y = box["y"] + (layer + 0.5) / n_layers * box["height"]
        pg.mouse.click(x, y)

    def wait_shown(self, head: str):
        wait_js(self.page, f"document.body.dataset.shownHead === '{head}'", timeout=60_000)
        assert self.page.inner_text("#head-title") == f"Head {head}"

    def done(self):
        assert self.external == [], f"requests left the machine: {self.external}"
        assert self.errors == [], self.errors
        self.page.close()


@pytest.fixture(scope="module")
def toy_report(hand_built, tmp_path_factory):
    scores = qk.scan(hand_built, n_seqs=4, seg_len=12, prefix_seqs=2, eigen_copying=False, progress=False)
    path = tmp_path_factory.mktemp("report") / "toy.html"
    write_report(str(path), report_html(hand_built, scores=scores, grid_k=1, progress=False))
    return path


def test_report_offline_draws_and_clicks(browser, toy_report):
    p = Page(browser).open(toy_report.as_uri())
    assert p.shown() == "1.0"                        # opens on the strongest induction head
    p.check_drawn()
    assert p.page.locator(".cv-widget").count() == 1
    p.click_cell("previous_token", 0, 0)
    p.wait_shown("0.0")
    p.check_drawn(("fig-qk", "fig-ov", "fig-pos"))
    assert "no earlier heads" in p.page.inner_text("#info")
    # a head that was left out says so and how to get it
    p.click_cell("induction", 1, 1)
    p.wait_shown("1.1")
    assert "not precomputed" in p.page.inner_text("#missing") and "--heads 1.1" in p.page.inner_text("#missing")
    p.page.select_option("#head-select", "1.0")
    p.wait_shown("1.0")
    p.done()


class Server:
    """The app on a free port of 127.0.0.1 in a thread (werkzeug), shut down at the end."""

    def __init__(self, app):
        from werkzeug.serving import make_server

        self.server = make_server("127.0.0.1", 0, app, threaded=True)
        self.url = f"http://127.0.0.1:{self.server.port}/"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)
        assert not self.thread.is_alive()


def test_app_choose_head_and_errors(browser, hand_built):
    scores = qk.scan(hand_built, n_seqs=4, seg_len=12, prefix_seqs=2, eigen_copying=False, progress=False)
    srv = Server(create_app(hand_built, scores=scores))
    try:
        p = Page(browser).open(srv.url)
        assert p.shown() == "1.0"
        p.check_drawn()
        p.page.select_option("#head-select", "0.0")
        p.wait_shown("0.0")
        p.check_drawn(("fig-qk", "fig-ov", "fig-pos"))
        p.click_cell("induction", 1, 1)                 # the app computes any head, also from the grid
        p.wait_shown("1.1")
        # a bad token gives a readable message, and the shown head stays
        p.page.fill("#tokens", "cat")
        p.page.select_option("#head-select", "1.0")
        wait_js(p.page, "document.getElementById('error').textContent.length > 0", timeout=30_000)
        assert "no tokenizer" in p.page.inner_text("#error")
        assert p.shown() == "1.1"
        # fix the input, choose again: the head changes and the error clears
        p.page.fill("#tokens", "#1|#2")
        p.page.fill("#prompt", "0 3 4 3 4")
        p.page.click("#go")
        p.wait_shown("1.0")
        assert p.page.inner_text("#error") == ""
        assert p.page.evaluate("document.getElementById('fig-qk').data[0].z.length") == 2
        p.done()
    finally:
        srv.close()


@pytest.mark.smollm2
def test_smollm2_report_and_app(browser, smollm2, tmp_path):
    scores = qk.scan(smollm2, n_seqs=2, seg_len=20, prefix_seqs=2, prefix_len=10, eigen_copying=False, ov_tokens=16,
                     progress=False)
    html = report_html(smollm2, scores=scores, heads="0.3", grid_k=2, progress=False)
    path = tmp_path / "smollm2.html"
    write_report(str(path), html)
    p = Page(browser).open(path.as_uri())
    p.check_drawn(("fig-qk", "fig-ov", "fig-pos"))
    assert p.shown() == "0.3"
    assert p.page.locator("#grids .js-plotly-plot").count() == 7     # 4 attention scores, 2 copying scores + eigenvalue copying
    if SHOTS:
        p.page.screenshot(path=str(Path(SHOTS) / "report-grids.png"), clip={"x": 0, "y": 0, "width": 1400, "height": 700})
    target = next(h for h in p.page.evaluate("window.QK_SOURCE.heads") if not h.startswith("0."))
    layer, head = map(int, target.split("."))
    p.click_cell("eigen_copying", layer, head)
    p.wait_shown(target)
    p.check_drawn()
    if SHOTS:
        p.page.locator("#head-title").scroll_into_view_if_needed()
        p.page.screenshot(path=str(Path(SHOTS) / "report-head.png"), full_page=True)
    p.done()

    srv = Server(create_app(smollm2, scores=scores))
    try:
        p = Page(browser).open(srv.url)
        p.page.select_option("#head-select", "5.2")
        p.wait_shown("5.2")
        p.check_drawn()
        if SHOTS:
            p.page.screenshot(path=str(Path(SHOTS) / "app.png"), full_page=True)
        p.done()
    finally:
        srv.close()


def test_guard_sees_external_requests(browser, tmp_path):
    """The request guard itself: a page that does reach out is caught (so an empty list means something)."""
    page = tmp_path / "leaky.html"
    page.write_text('<html><body><img src="https://example.com/x.png"><script>'
                    'fetch("http://203.0.113.9/probe").catch(() => 0); document.body.dataset.ready = "1";'
                    '</script></body></html>', encoding="utf-8")
    p = Page(browser).open(page.as_uri())
    p.page.wait_for_timeout(500)
    assert sorted(p.external) == ["http://203.0.113.9/probe", "https://example.com/x.png"]
    p.page.close()
