"""Issue 43 ask 7, the per-request compute bound of the app: a request whose estimated cost is past the app's
``max_work`` gets a 422 within a second, before the model lock and before anything runs; the estimate
(``_app.request_work``) is checked against the multiply-adds torch's FLOP counter measures on the real panel.
Against a real server on 127.0.0.1 (port chosen by the OS), on the hand-built 2x2 model (``toy-induction``)."""

from __future__ import annotations

import gc
import json
import threading
import time
import tracemalloc
import urllib.error
import urllib.request

import pytest
import torch
from _typecheck import unchecked
from torch.utils.flop_counter import FlopCounterMode

from qkcircuits import Head, QKCircuitsError
from qkcircuits._foundation.fingerprint import facts
from qkcircuits.viz import create_app
from qkcircuits.viz._app import MAX_WORK, make_server, request_work
from qkcircuits.viz._panels import ViewContext, prompt_ids, token_set
from qkcircuits.viz._views import panel

torch.set_num_threads(1)
SHORT = " ".join(str(i % 30 + 1) for i in range(8))         # ids: the toy has no tokenizer
LONG = SHORT + " 9"                                         # one token more


@pytest.fixture(scope="module")
def bound(hand_built):
    """The bound that a SHORT prompt at head 1.0 with the default token set just fits (equal passes)."""
    ids = token_set(hand_built)
    return request_work(facts(hand_built), 1, len(prompt_ids(hand_built, SHORT)), len(ids))


@pytest.fixture(scope="module")
def served(hand_built, bound):
    server = make_server("127.0.0.1", 0, create_app(hand_built, attend=[], max_work=bound), read_timeout=2.0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.port
    server.shutdown()
    thread.join(5)


def post(port, body: dict):
    """(status, JSON answer, seconds) of one POST /api/head (a bounded wait: the test cannot hang)."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/api/head", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    t = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, json.loads(r.read()), time.perf_counter() - t
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), time.perf_counter() - t


def test_a_request_past_the_bound_is_a_422_within_a_second_before_anything_runs(served, bound, hand_built, monkeypatch):
    status, _, _ = post(served, {"head": "1.0", "prompt": SHORT})
    assert status == 200                                       # at the bound: served
    import qkcircuits.viz._app as app_module

    ran = []
    monkeypatch.setattr(app_module, "panel", lambda *a, **k: ran.append(1) or {})   # nothing may be computed
    status, answer, seconds = post(served, {"head": "1.0", "prompt": LONG})
    assert status == 422 and seconds < 1 and not ran, (status, seconds, ran)
    error = answer["error"]
    assert "multiply-adds" in error and "bound" in error and "--max-request-work" in error and "\n" not in error
    # memory: the app's own allocations for a refused request (in-process: the HTTP client's are not the app's)
    client = create_app(hand_built, attend=[], max_work=bound).test_client()
    gc.collect()                 # earlier tests' garbage is not this request's (its finalizers would count)
    tracemalloc.start()
    r = client.post("/api/head", data=json.dumps({"head": "1.0", "prompt": LONG}), content_type="application/json")
    peak = tracemalloc.get_traced_memory()[1] / 2 ** 20
    tracemalloc.stop()
    assert r.status_code == 422 and peak < 1 and not ran, (r.status_code, peak)
    assert post(served, {"head": "0.0", "prompt": LONG})[0] == 200       # an earlier head costs less: served
    assert post(served, {"head": "1.0", "prompt": SHORT, "tokens": "#1|#2"})[0] == 200


@pytest.mark.parametrize("view", ["direct", "effective", "contextual"])
@pytest.mark.parametrize("layer, words", [(0, 8), (1, 8), (1, 60)])
def test_the_estimate_bounds_the_measured_multiply_adds(hand_built, view, layer, words):
    """Ground truth: torch's FLOP counter on the panel itself (the model's own matmuls), after the once-per-model
    caches are warm; the estimate is an upper bound and not more than 4x off."""
    ctx = ViewContext(hand_built)
    ids = token_set(hand_built)
    pids = prompt_ids(hand_built, " ".join(str(i % 30 + 1) for i in range(words)))
    panel(ctx, Head(layer, 0), ids, pids, view=view)           # K-composition, eigen-copying, corpus: once per model
    fresh = ids[:-1]                                            # a token set not cached yet
    with FlopCounterMode(display=False) as counter:
        panel(ctx, Head(layer, 0), fresh, pids, view=view)
    measured = counter.get_total_flops() // 2
    estimate = request_work(facts(hand_built), layer, len(pids), len(fresh))
    assert measured <= estimate <= 4 * measured, (measured, estimate)


def test_the_bound_is_a_setting(hand_built, capsys):
    # SmolLM2-135M's largest request (256 tokens at its last layer, 64 tokens) fits the default with room
    smollm2 = {"d_model": 576, "d_mlp": 1536, "W_U": [576, 49152], "attention": [[9, 3, 64, 64]] * 30}
    assert request_work(smollm2, 29, 256, 64) < MAX_WORK / 3
    for bad in (0, -1, float("nan"), "1e9", True):
        with pytest.raises(QKCircuitsError, match="max_work must be a positive number"):
            unchecked(create_app)(hand_built, attend=[], max_work=bad)
    create_app(hand_built, attend=[], max_work=None)            # no bound
    from _cli import run

    code, _, err = run(["serve", "toy-induction", "--max-request-work", "lots"], capsys)
    assert code == 2 and "expected a number of multiply-adds" in err
