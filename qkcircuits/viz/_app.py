"""Local web app (Flask): pick a head, type tokens or a prompt, see its QK/OV heatmaps and attention pattern.

>>> app = create_app(model, scores=qk.scan(model))          # doctest: +SKIP
>>> app.run(host="127.0.0.1", port=8050)                   # doctest: +SKIP   or: qkcircuits serve MODEL

Routes (nothing else is served; no route takes a path from the user):

- ``GET /``                         the page
- ``GET /static/plotly.min.js``     plotly.js from the installed plotly package
- ``GET /static/circuitsvis.js``    circuitsvis's bundle from the installed package
- ``GET /api/info``                 model, grids, heads, default tokens and prompt
- ``POST /api/head``                JSON ``{"head": "1.0", "tokens": " the| of" or [...], "prompt": "...",
                                    "view": "direct"|"effective"|"contextual"}`` (view optional: default
                                    contextual past layer 0) → the head's panel (same
                                    data as a report panel)

Bad input (unknown head, too-long prompt, a token that is not one token, malformed JSON: deep nesting, huge
numbers, wrong types) → 400 ``{"error": one line}``; anything unexpected → 500 ``{"error": "internal error
(...)"}``, never a traceback. Computations hold a lock: the model runs one request at a time.

Bounded and closed: per-request caches are LRUs (``ViewContext``), so memory stays flat however many token
sets arrive; a body is at most ``MAX_BODY`` bytes, declared or chunked (413); a connection whose request or
body stops arriving is let go after ``READ_TIMEOUT`` (408 or closed); POSTs must be ``application/json`` (415:
no "simple" cross-site request from a web page); a request is bounded (one head checked by its ends, at most 64
tokens and ``max_prompt`` prompt tokens), its cost is estimated before anything runs (``request_work``) and one
past ``max_work`` multiply-adds (default ``MAX_WORK``; ``serve --max-request-work``) gets a 422 at once, and it
waits at most ``LOCK_WAIT`` for the model (503); a request whose ``Host`` is not this machine (127.0.0.1, localhost, ::1, or the bound address)
gets 403, which stops DNS rebinding; every answer carries ``X-Content-Type-Options: nosniff``,
``X-Frame-Options: DENY`` and a Content-Security-Policy that allows the page's own inline scripts (by hash)
and the two served libraries only; the ``Server`` header names no versions (``make_server``).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import re
import threading
from typing import Iterable, Optional, Union

from flask import Flask, Response, jsonify, request
from werkzeug.exceptions import (HTTPException, RequestEntityTooLarge, RequestTimeout, ServiceUnavailable,
                                 UnprocessableEntity)

from .._foundation.errors import QKCircuitsError
from .._foundation.fingerprint import facts
from .._foundation.heads import all_heads, model_heads, n_kv_heads
from .._weights.contextual import INPUTS
from ._page import embed_json, page, script_text
from ._panels import DEFAULT_PROMPT, MAX_PROMPT, ViewContext, prompt_ids, token_set, token_strings
from ._report import attend_results, report_sections
from ._views import grids, panel

TOKEN_SEPARATOR = "|"
MAX_BODY = 64 * 1024     # bytes of a request body
MAX_DEPTH = 8            # nesting of a request body (the API needs 2)
READ_TIMEOUT = 10.0      # seconds a connection may wait for the next bytes of a request (a slow or absent body)
LOCK_WAIT = 30.0         # seconds a request waits for the model (one computation at a time) before a 503
MAX_WORK = 10 ** 11      # multiply-adds one /api/head request may cost (``request_work``); past it: 422, nothing run
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
_INLINE_SCRIPT = re.compile(r"<script>(.*?)</script>", re.DOTALL)


def _csp(html: str) -> str:
    """A Content-Security-Policy for ``html``: its inline scripts by sha256, scripts from this server, nothing
    from elsewhere; inline styles (plotly sets them), data: images (plotly's exports)."""
    hashes = " ".join("'sha256-" + base64.b64encode(hashlib.sha256(s.encode("utf-8")).digest()).decode() + "'"
                      for s in _INLINE_SCRIPT.findall(html))
    return (f"default-src 'none'; script-src 'self' {hashes}; style-src 'self' 'unsafe-inline'; img-src 'self' "
            f"data: blob:; font-src data:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
            f"frame-ancestors 'none'")


def _depth(x, limit: int) -> int:
    """Nesting depth of parsed JSON, stopping past ``limit``."""
    if limit < 0 or not isinstance(x, (dict, list)):
        return 0
    items = x.values() if isinstance(x, dict) else x
    return 1 + max((_depth(v, limit - 1) for v in items), default=0)


def parse_body(raw: bytes) -> dict:
    """The request body as a JSON object; one-line ``QKCircuitsError`` (→ 400) for anything else: not UTF-8,
    not JSON, nested deeper than ``MAX_DEPTH``, numbers out of range, not an object."""
    try:
        text = raw.decode("utf-8")
        body = json.loads(text, parse_constant=_no_constant, parse_int=_small_int, parse_float=_finite_float)
    except RecursionError:
        raise QKCircuitsError(f"the request body is nested too deeply (at most {MAX_DEPTH} levels)") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise QKCircuitsError(f"the request body is not valid JSON ({' '.join(str(e).split())[:120]}); send a "
                              f"JSON object such as {_EXAMPLE}") from None
    if _depth(body, MAX_DEPTH) > MAX_DEPTH:
        raise QKCircuitsError(f"the request body is nested too deeply (at most {MAX_DEPTH} levels)")
    if not isinstance(body, dict):
        raise QKCircuitsError(f"the request body must be a JSON object such as {_EXAMPLE}")
    return body


_EXAMPLE = '{"head": "1.0", "tokens": " the| of", "prompt": "..."}'


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _small_int(text: str) -> int:
    if len(text.lstrip("-")) > 18:
        raise ValueError(f"integer {text[:12]}... has {len(text)} digits")
    return int(text)


def _finite_float(text: str) -> float:
    x = float(text)
    if x != x or x in (float("inf"), float("-inf")):
        raise ValueError(f"number {text[:12]}... is out of range")
    return x


def layer_work(shape: dict, layer: int) -> int:
    """Multiply-adds per token of block ``layer`` (``shape``: ``fingerprint.facts(model)``): its Q, K, V and O
    projections (``d_model · (d_qk · (heads + kv_heads) + d_v · kv_heads + heads · d_v)``) and its MLP counted as
    gated (``3 · d_model · d_mlp``: an upper bound for a plain one)."""
    h, kv, d_qk, d_v = shape["attention"][layer]
    return shape["d_model"] * (d_qk * (h + kv) + d_v * kv + h * d_v) + 3 * shape["d_model"] * (shape["d_mlp"] or 0)


def request_work(shape: dict, layer: int, n_prompt: int, n_tokens: int) -> int:
    """Multiply-adds of one head panel, estimated from the model's shape before anything runs: the prompt's
    forward up to the head's layer (``T · layer_work`` per block plus ``T² · heads · (d_qk + d_v)`` for its
    scores and their mix of values) and the token views of ``n`` tokens (OV through the unembedding ``n · d_model
    · d_vocab``, the QK grid ``n² · d_qk``, block 0 on each token for the effective view ``n · layer_work(0)``).
    Weight-only scores computed once per model (K-composition, eigenvalue copying) and the contextual view's
    corpus statistics (once per model) are not a request's."""
    T, n = int(n_prompt), int(n_tokens)
    forward = sum(T * layer_work(shape, L) + T * T * shape["attention"][L][0] * sum(shape["attention"][L][2:])
                  for L in range(layer + 1))
    d_model, d_vocab = shape["W_U"]
    views = n * d_model * d_vocab + n * n * shape["attention"][layer][2] + n * layer_work(shape, 0)
    return forward + views


def _host_name(host: str) -> str:
    """``Host`` header without the port: "127.0.0.1:8050" -> "127.0.0.1", "[::1]:80" -> "::1"."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _tokens_field(model, ids) -> str:
    """The token set as the text field shows it: ``|``-separated, ``#id`` where the text would be ambiguous."""
    out = []
    for i, s in zip(ids, token_strings(model, ids)):
        out.append(f"#{i}" if getattr(model, "tokenizer", None) is None or TOKEN_SEPARATOR in s or not s.strip()
                   or s.startswith("#") else s)
    return TOKEN_SEPARATOR.join(out)


def create_app(model, *, scores=None, effects=None, diagnostics=None, title: Optional[str] = None,
               max_prompt: int = MAX_PROMPT, trace=None, hosts: Optional[Iterable[str]] = None, circuit=None,
               attend=None, max_work: Optional[Union[int, float]] = MAX_WORK) -> Flask:
    """The Flask app for ``model``; ``scores``/``effects``/``diagnostics`` add grids and numbers (optional);
    ``circuit`` (what ``report_html(circuit=...)`` takes) adds the report's circuit section above the heads;
    ``attend``: "why it attends" sections, as ``report_html`` (default: the scan's top heads, computed on the first
    request; ``[]``: none).

    ``hosts``: extra ``Host`` names answered besides the loopback ones (``serve`` adds its bound address).
    ``max_work``: the multiply-adds one request may cost (``request_work``, estimated before it runs; past it a
    422 that says so); None: no bound.
    """
    from .._foundation.model import model_name

    if max_work is not None and (isinstance(max_work, bool) or not isinstance(max_work, (int, float))
                                 or not max_work > 0 or max_work != max_work):
        raise QKCircuitsError(f"max_work must be a positive number of multiply-adds (or None: no bound), got "
                              f"{max_work!r}")

    app = Flask(__name__, static_folder=None)          # no static folder: nothing on disk is reachable by URL
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY      # a declared Content-Length past it: 413 before any read
    ctx = ViewContext(model)
    lock = threading.Lock()
    L, H = int(model.cfg.n_layers), int(model.cfg.n_heads)
    shape = facts(model)                     # what a request's cost is estimated from (request_work)
    name = title or model_name(model)
    default_ids = token_set(model)
    state = {}
    cview = None
    if circuit is not None:                  # checked now: a circuit of another model fails before serving
        from ._circuit_data import check_against_model, load_circuit

        cview = load_circuit(circuit)
        check_against_model(cview, L, H, n_kv_heads(model))
    allowed = {*LOOPBACK_HOSTS, *(_host_name(h) for h in (hosts or ()))}

    @app.before_request
    def check_host():
        if _host_name(request.host or "") not in allowed:
            return jsonify(error=f"host {request.host[:60]!r} is not served here; open http://127.0.0.1 or "
                                 f"http://localhost (the address the app is bound to)"), 403
        if request.method == "POST" and request.mimetype != "application/json":
            # a "simple" cross-site request (text/plain, a form) would reach us from any web page: JSON only
            return jsonify(error=f"send the body as JSON (Content-Type: application/json), not "
                                 f"{(request.mimetype or 'none')[:60]!r}"), 415
        return None

    @app.after_request
    def security_headers(resp: Response) -> Response:
        resp.headers["X-Content-Type-Options"] = "nosniff"
        resp.headers["X-Frame-Options"] = "DENY"
        resp.headers["Referrer-Policy"] = "no-referrer"
        resp.headers.setdefault("Content-Security-Policy", "default-src 'none'; frame-ancestors 'none'")
        return resp

    def info():
        if "info" not in state:
            with model_lock():
                heads = [str(h) for h in all_heads(L, H)]
                first = str(scores.top(1, "induction")[0][0]) if scores is not None and "induction" in scores.scores \
                    else heads[0]
                has_tok = getattr(model, "tokenizer", None) is not None
                state["info"] = {
                    "mode": "server", "title": f"qkcircuits: {name}",
                    "summary": f"{L} layers x {H} heads; computed on demand; prompts up to {max_prompt} tokens"
                               + ("" if has_tok else "; no tokenizer: tokens are #ids and the prompt is space-separated ids"),
                    "grids": grids(model, ctx, scores, effects, diagnostics, trace), "heads": heads, "first": first,
                    "sections": report_sections(cview, scores, L, H, n_kv_heads(model),
                                                attend_results(model, scores, attend)),
                    "default_tokens": _tokens_field(model, default_ids),
                    "default_prompt": DEFAULT_PROMPT if has_tok else " ".join(map(str, prompt_ids(model, None))),
                }
        return state["info"]

    @app.get("/")
    def index():
        scripts = ('<script src="static/plotly.min.js"></script>\n'
                   '<script src="static/circuitsvis.js"></script>')
        html = page(f"qkcircuits: {name}", f"window.QK_SOURCE = {embed_json({'mode': 'server'})};", scripts, server=True)
        resp = Response(html, mimetype="text/html")
        resp.headers["Content-Security-Policy"] = _csp(html)
        return resp

    @app.get("/static/plotly.min.js")
    def plotly_js():
        return Response(script_text("plotly"), mimetype="application/javascript")

    @app.get("/static/circuitsvis.js")
    def circuitsvis_js():
        return Response(script_text("circuitsvis"), mimetype="application/javascript")

    @app.get("/api/info")
    def api_info():
        return jsonify(info())

    @app.post("/api/head")
    def api_head():
        body = parse_body(read_body())
        unknown = set(body) - {"head", "tokens", "prompt", "view"}
        if unknown:
            raise QKCircuitsError(f"unknown field(s) {', '.join(sorted(unknown))}; accepted: head, tokens, prompt, "
                                  f"view")
        view = body.get("view")
        if view is not None and view not in INPUTS:
            raise QKCircuitsError(f"'view' must be one of {', '.join(INPUTS)}, got {view!r}")
        spec = body.get("head")
        if not isinstance(spec, str) or not spec.strip():
            raise QKCircuitsError(f"'head' must be a string such as '1.0' or 'L1H0', got {spec!r}")
        head = model_heads(model, spec.strip())
        if len(head) != 1:
            raise QKCircuitsError(f"give exactly one head, got {len(head)} from {spec!r}")
        tokens = body.get("tokens")
        if isinstance(tokens, str):
            tokens = [t for t in tokens.split(TOKEN_SEPARATOR) if t != ""] if tokens.strip() else None
        elif tokens is not None and not (isinstance(tokens, list) and all(isinstance(t, str) for t in tokens)):
            raise QKCircuitsError(f"'tokens' must be a '{TOKEN_SEPARATOR}'-separated string or a list of strings")
        prompt = body.get("prompt")
        if prompt is not None and not isinstance(prompt, str):
            raise QKCircuitsError(f"'prompt' must be a string, got {type(prompt).__name__}")
        if isinstance(prompt, str) and len(prompt) > 20 * max_prompt:
            raise QKCircuitsError(f"the prompt is {len(prompt)} characters; at most {20 * max_prompt} are accepted")
        try:
            ids = token_set(model, tokens)
            pids = prompt_ids(model, prompt if prompt and prompt.strip() else None)
        except (ValueError, OverflowError, TypeError, IndexError) as e:   # e.g. a 5,000-digit '#id'
            if isinstance(e, QKCircuitsError):
                raise
            raise QKCircuitsError(f"bad token or prompt ({type(e).__name__}: {' '.join(str(e).split())[:120]})") \
                from None
        if len(pids) > max_prompt:
            raise QKCircuitsError(f"the prompt is {len(pids)} tokens (with BOS); at most {max_prompt} are accepted")
        work = request_work(shape, head[0].layer, len(pids), len(ids))
        if max_work is not None and work > max_work:         # refused before the lock and before any compute
            raise UnprocessableEntity(f"this request would cost about {work:.3g} multiply-adds (a {len(pids)}-token "
                                      f"prompt through layers 0-{head[0].layer}, {len(ids)} tokens in the views); "
                                      f"this app's bound is {max_work:.3g} (create_app(max_work=), serve "
                                      f"--max-request-work): send a shorter prompt, fewer tokens or an earlier head")
        with model_lock():
            return jsonify(panel(ctx, head[0], ids, pids, scores=scores, effects=effects, diagnostics=diagnostics,
                                 view=view, trace=trace))


    @contextlib.contextmanager
    def model_lock():
        """The model runs one request at a time; a request that waits past ``LOCK_WAIT`` gets a 503."""
        if not lock.acquire(timeout=LOCK_WAIT):
            raise ServiceUnavailable(f"the model is busy (another request has held it for {LOCK_WAIT:.0f} s); try "
                                     f"again")
        try:
            yield
        finally:
            lock.release()

    @app.errorhandler(QKCircuitsError)
    def bad_input(e):
        return jsonify(error=str(e)), 400

    @app.errorhandler(HTTPException)
    def http_error(e):
        resp = jsonify(error=f"{e.code} {e.name}: {e.description}")
        if e.code in (408, 413):            # the rest of the body may still be on its way: end the connection
            resp.headers["Connection"] = "close"
        return resp, e.code

    @app.errorhandler(Exception)
    def internal(e):           # never a traceback to the client; the server log keeps it
        app.logger.exception("request failed")
        return jsonify(error=f"internal error ({type(e).__name__})"), 500

    return app


def read_body() -> bytes:
    """The request body, at most ``MAX_BODY`` bytes whether its length is declared or it comes in chunks (a
    chunked body past the limit is a 413, not a body cut short); a body that stops arriving for the server's
    read timeout is a 408."""
    declared = request.content_length
    if declared is not None and declared > MAX_BODY:
        raise RequestEntityTooLarge(f"the request body is {declared} bytes; at most {MAX_BODY} are read")
    stream = request.environ.get("wsgi.input")
    if stream is None or (declared is None and not request.environ.get("wsgi.input_terminated")):
        return b""                                       # no length and not chunked: no body
    want = MAX_BODY + 1 if declared is None else declared
    parts, size = [], 0
    try:
        while size < want:
            part = stream.read(min(16384, want - size))
            if not part:
                break
            parts.append(part)
            size += len(part)
    except TimeoutError:
        raise RequestTimeout("the request body stopped arriving (the server's read timeout)") from None
    if size > MAX_BODY:
        raise RequestEntityTooLarge(f"the request body is over {MAX_BODY} bytes")
    if declared is not None and size < declared:
        raise QKCircuitsError(f"the request body ended after {size} of the {declared} bytes it declared")
    return b"".join(parts)


def make_server(host: str, port: int, app: Flask, read_timeout: float = READ_TIMEOUT):
    """werkzeug's threaded server for ``app`` whose ``Server`` header is just "qkcircuits" (no Werkzeug or
    Python version banner). Each connection's socket times out after ``read_timeout`` seconds without a byte: a
    request line, headers or body that never arrive close the connection (or answer 408) instead of holding it."""
    from werkzeug.serving import WSGIRequestHandler
    from werkzeug.serving import make_server as _make_server

    class Handler(WSGIRequestHandler):
        timeout = read_timeout              # socketserver applies it to the connection (StreamRequestHandler)

        def version_string(self) -> str:
            return "qkcircuits"

    return _make_server(host, port, app, threaded=True, request_handler=Handler)
