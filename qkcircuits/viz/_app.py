"""Local web app (Flask): pick a head, type tokens or a prompt, see its QK/OV heatmaps and attention pattern.

>>> app = create_app(model, scores=qk.scan(model))          # doctest: +SKIP
>>> app.run(host="127.0.0.1", port=8050)                   # doctest: +SKIP   or: qkcircuits serve MODEL

Routes (nothing else is served; no route takes a path from the user):

- ``GET /``                         the page
- ``GET /static/plotly.min.js``     plotly.js from the installed plotly package
- ``GET /static/circuitsvis.js``    circuitsvis's bundle from the installed package
- ``GET /api/info``                 model, grids, heads, default tokens and prompt
- ``POST /api/head``                JSON ``{"head": "1.0", "tokens": " the| of" or [...], "prompt": "...",
                                    "input": "direct"|"effective"|"contextual"}`` (input optional: default
                                    contextual past layer 0) → the head's panel (same data as a report panel)

Bad input (unknown head, too-long prompt, a token that is not one token, malformed JSON) → 400
``{"error": one line}``; anything unexpected → 500 ``{"error": "internal error (...)"}``, never a traceback.
Computations hold a lock: the model runs one request at a time.
"""

from __future__ import annotations

import threading
from typing import Optional

from flask import Flask, Response, jsonify, request
from werkzeug.exceptions import HTTPException

from .._foundation.errors import QKCircuitsError
from .._foundation.heads import all_heads, model_heads
from .._weights.contextual import INPUTS
from ._page import embed_json, page, script_text
from ._panels import DEFAULT_PROMPT, MAX_PROMPT, ViewContext, prompt_ids, token_set, token_strings
from ._views import grids, panel

TOKEN_SEPARATOR = "|"
MAX_BODY = 64 * 1024     # bytes of a request body


def _tokens_field(model, ids) -> str:
    """The token set as the text field shows it: ``|``-separated, ``#id`` where the text would be ambiguous."""
    out = []
    for i, s in zip(ids, token_strings(model, ids)):
        out.append(f"#{i}" if getattr(model, "tokenizer", None) is None or TOKEN_SEPARATOR in s or not s.strip()
                   or s.startswith("#") else s)
    return TOKEN_SEPARATOR.join(out)


def create_app(model, *, scores=None, effects=None, diagnostics=None, title: Optional[str] = None,
               max_prompt: int = MAX_PROMPT, trace=None) -> Flask:
    """The Flask app for ``model``; ``scores``/``effects``/``diagnostics`` add grids and numbers (optional)."""
    from .._foundation.model import model_name

    app = Flask(__name__, static_folder=None)          # no static folder: nothing on disk is reachable by URL
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY
    ctx = ViewContext(model)
    lock = threading.Lock()
    L, H = int(model.cfg.n_layers), int(model.cfg.n_heads)
    name = title or model_name(model)
    default_ids = token_set(model)
    state = {}

    def info():
        if "info" not in state:
            with lock:
                heads = [str(h) for h in all_heads(L, H)]
                first = str(scores.top(1, "induction")[0][0]) if scores is not None and "induction" in scores.scores \
                    else heads[0]
                has_tok = getattr(model, "tokenizer", None) is not None
                state["info"] = {
                    "mode": "server", "title": f"qkcircuits: {name}",
                    "summary": f"{L} layers x {H} heads; computed on demand; prompts up to {max_prompt} tokens"
                               + ("" if has_tok else "; no tokenizer: tokens are #ids and the prompt is space-separated ids"),
                    "grids": grids(model, ctx, scores, effects, diagnostics, trace), "heads": heads, "first": first,
                    "default_tokens": _tokens_field(model, default_ids),
                    "default_prompt": DEFAULT_PROMPT if has_tok else " ".join(map(str, prompt_ids(model, None))),
                }
        return state["info"]

    @app.get("/")
    def index():
        scripts = ('<script src="static/plotly.min.js"></script>\n'
                   '<script src="static/circuitsvis.js"></script>')
        html = page(f"qkcircuits: {name}", f"window.QK_SOURCE = {embed_json({'mode': 'server'})};", scripts, server=True)
        return Response(html, mimetype="text/html")

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
        body = request.get_json(silent=True)
        if not isinstance(body, dict):
            raise QKCircuitsError('the request body must be a JSON object such as {"head": "1.0", "tokens": " the| of", '
                                  '"prompt": "..."}')
        unknown = set(body) - {"head", "tokens", "prompt", "input"}
        if unknown:
            raise QKCircuitsError(f"unknown field(s) {', '.join(sorted(unknown))}; accepted: head, tokens, prompt, "
                                  f"input")
        input = body.get("input")
        if input is not None and input not in INPUTS:
            raise QKCircuitsError(f"'input' must be one of {', '.join(INPUTS)}, got {input!r}")
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
        ids = token_set(model, tokens)
        pids = prompt_ids(model, prompt if prompt and prompt.strip() else None)
        if len(pids) > max_prompt:
            raise QKCircuitsError(f"the prompt is {len(pids)} tokens (with BOS); at most {max_prompt} are accepted")
        with lock:
            return jsonify(panel(ctx, head[0], ids, pids, scores=scores, effects=effects, diagnostics=diagnostics,
                                 input=input, trace=trace))

    @app.errorhandler(QKCircuitsError)
    def bad_input(e):
        return jsonify(error=str(e)), 400

    @app.errorhandler(HTTPException)
    def http_error(e):
        return jsonify(error=f"{e.code} {e.name}: {e.description}"), e.code

    @app.errorhandler(Exception)
    def internal(e):           # never a traceback to the client; the server log keeps it
        app.logger.exception("request failed")
        return jsonify(error=f"internal error ({type(e).__name__})"), 500

    return app
