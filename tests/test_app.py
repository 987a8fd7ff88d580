"""The local web app through Flask's test client: endpoints, the numbers they return, input validation."""

from __future__ import annotations

import json

import pytest
import torch

import qkcircuits as qk
from qkcircuits.viz import create_app
from qkcircuits.viz._page import plotly_js_path


@pytest.fixture(scope="module")
def client(hand_built):
    scores = qk.scan(hand_built, n_seqs=4, seg_len=12, prefix_seqs=2, eigen_copying=False, progress=False)
    return create_app(hand_built, scores=scores).test_client()


def post(client, body, raw=False):
    data = body if raw else json.dumps(body)
    return client.post("/api/head", data=data, content_type="application/json")


def test_page_and_scripts_are_local(client):
    r = client.get("/")
    assert r.status_code == 200
    html = r.get_data(as_text=True)
    assert 'src="static/plotly.min.js"' in html and 'src="static/circuitsvis.js"' in html
    assert "http://" not in html and "https://" not in html
    js = client.get("/static/plotly.min.js")
    assert js.status_code == 200 and js.mimetype == "application/javascript"
    assert len(js.get_data()) > 0.9 * plotly_js_path().stat().st_size
    cv = client.get("/static/circuitsvis.js").get_data(as_text=True)
    assert "CircuitsVis" in cv and "sourceMappingURL" not in cv


def test_info(client):
    info = client.get("/api/info").get_json()
    assert info["heads"] == ["0.0", "0.1", "1.0", "1.1"] and info["first"] == "1.0"
    assert {g["key"] for g in info["grids"]} >= {"induction", "previous_token", "eigen_copying"}
    assert info["default_tokens"].split("|")[:3] == ["#0", "#1", "#2"]


def test_head_panel_on_demand(client):
    r = post(client, {"head": "L1H0", "tokens": "#1|#2|#3", "prompt": "0 7 8 9 7 8 9"})
    assert r.status_code == 200
    p = r.get_json()
    assert p["head"] == "1.0"
    ov = p["figures"]["ov"]["data"][0]
    assert [row[0][2] for row in ov["customdata"]] == ["yes", "yes", "yes"]   # the induction head copies
    assert [row[0] for row in ov["text"]] == ["#1", "#2", "#3"]
    att = torch.tensor(p["attention"]["attention"][0])
    assert att.shape == (7, 7)
    assert att[4:].argmax(-1).tolist() == [2, 3, 4]    # query "7" (2nd copy) attends to the "8" after the 1st 7
    assert p["attention"]["tokens"] == ["#0", "#7", "#8", "#9", "#7", "#8", "#9"]
    # tokens also as a list; BOS is not doubled when the prompt starts with it
    p2 = post(client, {"head": "0.0", "tokens": ["#5"], "prompt": "5 6"}).get_json()
    assert p2["attention"]["tokens"] == ["#0", "#5", "#6"]


@pytest.mark.parametrize("body, message", [
    ({"head": "9.0"}, "layer"),
    ({"head": "1.7"}, "head"),
    ({"head": "banana"}, "banana"),
    ({"head": 3}, "'head' must be a string"),
    ({}, "'head' must be a string"),
    ({"head": "1.0", "prompt": " ".join(["3"] * 300)}, "at most"),
    ({"head": "1.0", "prompt": "a b c"}, "space-separated token ids"),
    ({"head": "1.0", "prompt": "99"}, "outside the vocabulary"),
    ({"head": "1.0", "tokens": "cat"}, "no tokenizer"),
    ({"head": "1.0", "tokens": 5}, "'tokens' must be"),
    ({"head": "1.0", "tokens": "|".join(["#1"] * 65)}, "at most 64"),
    ({"head": "1.0", "prompt": 5}, "'prompt' must be a string"),
    ({"head": "1.0", "path": "/etc/passwd"}, "unknown field"),
    ([1, 2], "JSON object"),
])
def test_bad_requests_get_400_with_a_message(client, body, message):
    r = post(client, body)
    assert r.status_code == 400, r.get_data(as_text=True)
    err = r.get_json()["error"]
    assert message in err and "\n" not in err and "Traceback" not in err


def test_malformed_and_foreign_requests(client):
    r = post(client, "{not json", raw=True)
    assert r.status_code == 400 and "JSON object" in r.get_json()["error"]
    r = client.post("/api/head", data="head=1.0", content_type="application/x-www-form-urlencoded")
    assert r.status_code == 415 and "application/json" in r.get_json()["error"]     # JSON-only POSTs (issue 43)
    r = post(client, json.dumps({"head": "1.0", "prompt": "1 " * 40000}), raw=True)
    assert r.status_code == 413 and "error" in r.get_json()
    for path in ("/static/../../etc/passwd", "/static/%2e%2e/%2e%2e/etc/passwd", "/etc/passwd", "/static/app.py",
                 "/api/../pyproject.toml"):
        r = client.get(path)
        assert r.status_code == 404 and "root:" not in r.get_data(as_text=True), path
    assert client.get("/api/head").status_code == 405


def test_unexpected_errors_hide_the_traceback(hand_built, monkeypatch):
    from qkcircuits.viz import _app

    client = create_app(hand_built).test_client()

    def boom(*a, **k):
        raise RuntimeError("secret detail")
    monkeypatch.setattr(_app, "panel", boom)
    r = post(client, {"head": "1.0"})
    text = r.get_data(as_text=True)
    assert r.status_code == 500 and "internal error (RuntimeError)" in text
    assert "secret detail" not in text and "Traceback" not in text


@pytest.mark.smollm2
def test_smollm2_app(smollm2):
    client = create_app(smollm2).test_client()
    info = client.get("/api/info").get_json()
    assert len(info["heads"]) == 30 * 9 and " the" in info["default_tokens"].split("|")
    r = post(client, {"head": "0.3", "tokens": " the| cat| dog", "prompt": "The cat sat. The cat sat."})
    assert r.status_code == 200
    p = r.get_json()
    assert p["attention"]["tokens"][0] == "<|im_start|>" and len(p["attention"]["tokens"]) == 9
    assert len(p["figures"]["qk"]["data"][0]["z"]) == 3
    r = post(client, {"head": "0.3", "tokens": " cartographically"})
    assert r.status_code == 400 and "exactly one token" in r.get_json()["error"]
