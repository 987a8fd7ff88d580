"""``qkcircuits trace``: summary lines, the JSON contract, and one-line errors with nothing written."""

from __future__ import annotations

import json
import re

import pytest
import torch

import qkcircuits as qk
from qkcircuits import cli, plot

from _cli import errors, run


def test_trace_cli_summary_and_json_contract(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert cli.main(["trace", "toy-induction", "--quiet", "--k", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    # "1.0 reads its keys from 0.0 (previous-token; effect 1.00 = 100% of the clean 1.00; next sender 0.00; baseline
    # mean 0.50)"
    assert re.search(r"1\.0 reads its keys from 0\.0 \(previous-token; effect 1\.00 = 100% of the clean 1\.00; next sender "
                     r"-?0\.00; baseline mean 0\.50\)", text), text
    d = json.loads(out.read_text())
    assert d["model"] and d["method"] == "mean"
    assert d["metrics"] == {"q": "induction", "k": "induction", "v": "direct-logit"}
    r = d["receivers"]["1.0"]
    assert r["clean"] == pytest.approx(1.0, abs=1e-3)
    for x in "qkv":
        assert set(r[x]) == {"0.0", "0.1"}                      # every sender, as "layer.head", nothing else
        assert set(r["baseline"][x]) == {"mean", "p95"}
    assert r["k"]["0.0"] == pytest.approx(1.0, abs=1e-3)
    assert "k_composition_spearman" in r
    assert d["labels"]["0.0"] == ["previous-token"]


def test_trace_cli_receivers_method_into_and_attribution(tmp_path, capsys):
    out = tmp_path / "a.json"
    assert cli.main(["trace", "toy-induction", "--quiet", "--receivers", "1.0", "--into", "k", "--method", "zero",
                     "--attribution", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["kind"] == "attribution" and d["method"] == "zero" and set(d["metrics"]) == {"k"}
    assert "edge attribution" in capsys.readouterr().out


@pytest.mark.parametrize("args,msg", [
    (["--into", "x"], "--into: expected a comma-separated subset of q,k,v"),
    (["--receivers", "0.0"], "is in layer 0"),
    (["--receivers", "7.0"], "layer"),
    (["--method", "median"], "invalid choice"),
])
def test_trace_cli_errors_are_one_line(args, msg, tmp_path, capsys):
    out = tmp_path / "t.json"
    code, _, stderr = run(["trace", "toy-induction", "--quiet", "--json", out, *args], capsys)
    assert code == 2, stderr
    err = errors(stderr)
    assert len(err) == 1 and msg in err[0], stderr
    assert "Traceback" not in stderr and not out.exists()


def test_trace_cli_unwritable_json_fails_before_work(tmp_path, capsys):
    code, _, stderr = run(["trace", "toy-induction", "--json", tmp_path / "missing" / "t.json"], capsys)
    assert code == 2 and "does not exist" in stderr


# --- `qkcircuits serve --trace t.json`: the app draws the trace's circuit and reads-from panels -------------------

@pytest.fixture(scope="module")
def trace_json(tmp_path_factory):
    out = tmp_path_factory.mktemp("serve") / "t.json"
    assert cli.main(["trace", "toy-induction", "--quiet", "--k", "1", "--json", str(out)]) == 0
    return out


def test_serve_trace_puts_the_circuit_in_the_app(trace_json, monkeypatch, capsys):
    import qkcircuits as qk
    import qkcircuits.viz._app
    from qkcircuits.viz._trace_view import circuit, reads_from

    served = {}

    class Server:                                  # stands in for werkzeug's: keeps the app, returns at once
        port = 8050

        def serve_forever(self):
            served["ran"] = True

        def server_close(self):
            pass

    def make_server(host, port, app):
        served.update(host=host, app=app)
        return Server()

    monkeypatch.setattr(qkcircuits.viz._app, "make_server", make_server)
    assert cli.main(["serve", "toy-induction", "--trace", str(trace_json), "--no-scan"]) == 0
    assert served["ran"] and served["host"] == "127.0.0.1"
    client = served["app"].test_client()
    trace = qk.results.PathEffects.from_json(trace_json.read_text())
    grids = {g["key"]: g["figure"] for g in client.get("/api/info").get_json()["grids"]}
    assert grids["circuit"]["data"] == circuit(trace)["data"]         # the figure of the file, not recomputed
    edges = [t["meta"] for t in grids["circuit"]["data"] if t["mode"] == "lines"]
    assert any(e["src"] == "0.0" and e["dst"] == "1.0" and e["input"] == "k" for e in edges)   # by construction
    head = client.post("/api/head", json={"head": "1.0"}).get_json()
    assert head["figures"]["reads"]["data"] == reads_from(trace, qk.Head(1, 0))["data"]
    assert client.post("/api/head", json={"head": "0.1"}).get_json()["figures"].get("reads") is None


@pytest.mark.parametrize("make, msg", [
    (lambda d, tmp: str(tmp / "missing.json"), "no trace JSON file at"),
    (lambda d, tmp: (tmp / "s.json").write_text(json.dumps({"schema": 1, "model": "x"})) and str(tmp / "s.json"),
     "not a qkcircuits trace JSON"),
    (lambda d, tmp: (tmp / "w.json").write_text(json.dumps(dict(d, n_layers=6, n_heads=8))) and str(tmp / "w.json"),
     "is for 6 layers x 8 heads, but the model has 2 x 2; trace this model with `qkcircuits trace toy-induction"),
])
def test_serve_and_report_bad_trace_are_one_line_errors(trace_json, tmp_path, make, msg, capsys):
    path = make(json.loads(trace_json.read_text()), tmp_path)
    for cmd in (["serve", "toy-induction", "--no-scan", "--port", "1"],
                ["report", "toy-induction", "-o", str(tmp_path / "r.html"), "--quiet"]):
        code, _, stderr = run([*cmd, "--trace", path], capsys)
        assert code == 2, (cmd, stderr)
        err = errors(stderr)
        assert len(err) == 1 and msg in err[0], stderr
        assert "Traceback" not in stderr and "serving" not in stderr and not (tmp_path / "r.html").exists()


def test_reads_from_says_its_numbers_and_the_panel_claims_only_what_passes():
    """Issue 45: trace printed "17.4 reads its values from 16.0 (effect 0.00 of the clean 0.01)" (SmolLM2: 0.0012 of a
    clean direct logit 0.0094, 13 %, which passes READS_FROM): the numbers now carry two significant digits of the
    clean value and the share; a sentence without a source says which condition failed; the report's panel fades
    every bar under the threshold."""
    L, H = 3, 4
    recv = [qk.Head(2, 0)]
    eff = {x: torch.full((1, L, H), float("nan")) for x in "qkv"}
    eff["v"][0, :2] = torch.tensor([[0.0001, 0.0002, 0.0001, 0.0], [0.0012, 0.0007, 0.0001, 0.0002]])
    eff["q"][0, :2] = torch.tensor([[0.06, 0.01, 0.0, 0.0], [0.02, 0.0, 0.01, 0.0]])    # 8 % of 0.73: under 10 %
    eff["k"][0, :2] = 0.5                                                               # all equal: not above p95
    clean = {"q": torch.tensor([0.73]), "k": torch.tensor([0.9]), "v": torch.tensor([0.0094])}
    res = qk.results.PathEffects("syn", "mean", recv, list("qkv"), {"q": "induction", "k": "induction",
                                 "v": "direct-logit"}, eff, clean, n_layers=L, n_heads=H,
                                 labels={"1.0": ["previous-token"]})
    v = res.summary("2.0", "v")
    assert v == ("2.0 reads its values from 1.0 (previous-token; effect 0.0012 = 13% of the clean 0.0094; next sender "
                 "0.0007; baseline mean 0.0003)"), v
    assert res.summary("2.0", "q").endswith("the largest effect, 0.0 (no label) 0.06, is 8% of the clean 0.73, under 10%")
    assert res.summary("2.0", "k").endswith("is not above the other senders (p95 0.50)")
    fig = plot.reads_from(res, "2.0", k=2)
    solid = {y: o for t in fig.data for y, o in zip(t.y, t.marker.opacity)}
    assert solid.pop("v: 1.0") == 1.0 and len(solid) == 5 and set(solid.values()) == {0.3}, solid   # the one source
    title = fig.layout.title.text.replace("<br>", " ")                  # the layout wraps long titles
    assert title.startswith("senders into 2.0") and "solid: reads from (≥ 10% of clean, > p95)" in title, title
