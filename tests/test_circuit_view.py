"""The circuit views (``qkcircuits circuit --json`` → graph, faithfulness curve, report section): what each figure
contains, checked against hand-written circuit files of known structure (a 3-node chain, a graph with the
embedding, an MLP and both signs), not only that it renders; every bad file is one line naming it."""

from __future__ import annotations

import json
import re

import pytest

import qkcircuits as qk
from qkcircuits import plot
from qkcircuits.cli import main
from qkcircuits.viz import report_html
from qkcircuits.viz._circuit_data import load_circuit, parse_node
from qkcircuits.viz._circuit_view import (MAX_WIDTH, MIN_WIDTH, NEGATIVE, POSITIVE, circuit_graph, faithfulness_curve,
                                          summary)

# 0.0 (previous-token) -> k of 1.0 (induction) -> logits: the toy model's known circuit, as a 3-node chain.
CHAIN = {"schema": "qkcircuits.circuit/1", "model": "toy-induction", "task": "induction", "n_prompts": 8,
         "metric": "logit-diff", "clean": 3.0, "corrupt": -1.0, "method": "eap-ig", "steps": 5,
         "curve": {"0": 0.0, "0.1": 0.2, "1": 0.5, "10": 0.95, "100": 1.0}, "cpr": 0.812, "cmd": 0.271,
         "circuit": {"edges": [["0.0", "1.0", "k", 0.6], ["1.0", "logits", None, -0.3]],
                     "heads": ["0.0", "1.0"], "node_faithfulness": 0.97},
         "roles": {"0.0": {"role": "previous-token", "evidence": {"previous_token": 1.0}},
                   "1.0": {"role": "induction", "evidence": {"induction": 0.99, "direct effect": 0.5}}},
         "timing": {"scores_s": 1.2}}

# Every node kind, both signs, every input; percents as numbers and as numeric strings.
WIDE = {"curve": {0.5: 0.4, "2": 0.7, 50: 0.99},
        "circuit": {"edges": [["emb", "0.1", "q", 0.2], ["emb", "mlp0", None, 0.1], ["mlp0", "2.3", "v", -0.4],
                              ["0.1", "2.3", "k", 0.8], ["2.3", "logits", None, 1.6], ["mlp0", "logits", None, -0.05]],
                    "heads": ["0.1", "2.3"]},
         "roles": {"2.3": {"role": "name mover", "evidence": "END → IO 0.62"}}}


def row_names(fig):
    """The y axis' row names, top to bottom."""
    return list(fig.layout.yaxis.ticktext)


def edge_lines(fig):
    return [t for t in fig.data if t.mode == "lines"]


def node_points(fig):
    """{node name: (x, y, hover)} over the node traces."""
    out = {}
    for t in fig.data:
        if t.mode == "markers+text":
            for name, x, y, cd in zip(t.text, t.x, t.y, t.customdata):
                out[name] = (x, y, cd[1], t.name)
    return out


def test_chain_graph_contents():
    fig = plot.circuit(CHAIN)
    assert isinstance(fig, plot.Figure)
    nodes = node_points(fig)
    assert set(nodes) == {"0.0", "1.0", "logits"}                   # 3 nodes, nothing else
    # rows in the model's order (layer 0, layer 1, the logits: y grows downwards), one row each
    assert nodes["0.0"][1] < nodes["1.0"][1] < nodes["logits"][1]
    assert row_names(fig) == ["layer 0", "layer 1", "logits"]
    lines = edge_lines(fig)
    got = {(t.meta["sender"], t.meta["receiver"], t.meta["input"], t.meta["score"]) for t in lines}
    assert got == {("0.0", "1.0", "k", 0.6), ("1.0", "logits", None, -0.3)}
    for t in lines:                                                 # width ∝ |score|, the largest at MAX_WIDTH
        assert t.line.width == pytest.approx(MAX_WIDTH * abs(t.meta["score"]) / 0.6)
        assert t.line.color == (POSITIVE if t.meta["score"] > 0 else NEGATIVE)
    assert {t.meta["input"]: t.line.dash for t in lines} == {"k": "dash", None: "solid"}
    # hover: edges give the score and both roles, nodes their role and evidence
    hover = [t for t in fig.data if t.mode == "markers" and t.name == "edges"][0].text
    assert any("0.0 → 1.0 (k)" in h and "score 0.6" in h and "0.0: previous-token" in h and "1.0: induction" in h
               for h in hover), hover
    assert any("1.0 → logits" in h and "score -0.3" in h for h in hover)
    assert "role: induction" in nodes["1.0"][2] and "induction: 0.99<br>direct effect: 0.5" in nodes["1.0"][2]
    assert nodes["1.0"][3] == "induction" and nodes["0.0"][3] == "previous-token"   # one legend entry per role


def test_wide_graph_every_node_kind_and_sign():
    fig = plot.circuit(WIDE)
    nodes = node_points(fig)
    assert set(nodes) == {"emb", "0.1", "mlp0", "2.3", "logits"}
    # rows: the embedding, layer 0's heads, its MLP (below its heads), layer 2, the logits
    assert nodes["emb"][1] < nodes["0.1"][1] < nodes["mlp0"][1] < nodes["2.3"][1] < nodes["logits"][1]
    assert row_names(fig) == ["emb", "layer 0", "mlp 0", "layer 2", "logits"]
    lines = edge_lines(fig)
    assert len(lines) == 6
    widths = {(t.meta["sender"], t.meta["receiver"]): t.line.width for t in lines}
    assert widths[("2.3", "logits")] == pytest.approx(MAX_WIDTH)
    assert widths[("0.1", "2.3")] / widths[("mlp0", "2.3")] == pytest.approx(0.8 / 0.4)
    assert widths[("mlp0", "2.3")] == pytest.approx(MAX_WIDTH * 0.4 / 1.6)
    # below MIN_WIDTH (8 px x 0.1 / 1.6 = 0.5 px) the width is floored: every edge of the circuit stays visible
    assert widths[("emb", "mlp0")] == widths[("mlp0", "logits")] == MIN_WIDTH
    colours = {(t.meta["sender"], t.meta["receiver"]): t.line.color for t in lines}
    assert [k for k, c in colours.items() if c == NEGATIVE] == [("mlp0", "2.3"), ("mlp0", "logits")]
    assert {t.meta["input"]: t.line.dash for t in lines} == {"q": "solid", None: "solid",
                                                             "v": "dot", "k": "dash"}
    # only the rows that hold a node: the model's size changes nothing
    big = circuit_graph(load_circuit(WIDE), 30, 9)
    assert big["layout"]["yaxis"]["ticktext"] == row_names(fig)


def test_max_edges_keeps_the_largest():
    fig = plot.circuit(WIDE, max_edges=2)
    got = sorted((t.meta["sender"], t.meta["receiver"]) for t in edge_lines(fig))
    assert got == [("0.1", "2.3"), ("2.3", "logits")]
    assert "top 2 of 6 edges" in fig.layout.title.text
    assert max(t.line.width for t in edge_lines(fig)) == pytest.approx(MAX_WIDTH)


def test_faithfulness_curve():
    fig = plot.faithfulness(CHAIN)
    line = fig.data[0]
    assert list(line.x) == [0.1, 1.0, 10.0, 100.0] and list(line.y) == [0.2, 0.5, 0.95, 1.0]  # 0 % off the log axis
    assert fig.layout.xaxis.type == "log"
    assert "CPR 0.812" in fig.layout.title.text and "CMD 0.271" in fig.layout.title.text
    assert [(s.y0, s.y1, s.line.dash) for s in fig.layout.shapes] == [(0.8, 0.8, "dash")]
    assert any("f(0 %) = 0.000" in a.text for a in fig.layout.annotations)
    wide = plot.faithfulness(WIDE)                                  # numbers and numeric strings, sorted
    assert list(wide.data[0].x) == [0.5, 2.0, 50.0] and list(wide.data[0].y) == [0.4, 0.7, 0.99]
    assert "CPR" not in wide.layout.title.text                      # not in the file: not invented


class _Result:
    """Stands in for the circuit API's result: anything whose to_dict() is the --json contract."""

    def to_dict(self):
        return CHAIN


def test_sources_agree(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(CHAIN))
    want = circuit_graph(load_circuit(CHAIN))
    for src in (path, str(path), json.dumps(CHAIN), _Result()):
        assert plot.circuit(src).to_plotly_json()["data"] == plot.circuit(CHAIN).to_plotly_json()["data"]
        assert circuit_graph(load_circuit(src))["data"] == want["data"]
    assert faithfulness_curve(load_circuit(path))["data"] == faithfulness_curve(load_circuit(CHAIN))["data"]


def test_node_names():
    names = ("emb", "embed", "3.1", "L3H1", "a3.1", "3.kv1", "mlp3", "mlp.3", "m3", "MLP3", "logits")
    assert [str(parse_node(s)) for s in names] == \
        ["emb", "emb", "3.1", "3.1", "3.1", "3.kv1", "mlp3", "mlp3", "mlp3", "mlp3", "logits"]
    assert parse_node("3") is None and parse_node(7) is None


def _bad(**change):
    d = json.loads(json.dumps(CHAIN))
    for key, v in change.items():
        if key == "edges":
            d["circuit"]["edges"] = v
        else:
            d[key] = v
    return d


BAD = [
    (_bad(schema="qkcircuits.trace/1"), r"it has schema 'qkcircuits.trace/1', not a circuit file"),
    (_bad(schema="qkcircuits.circuit/9"), "this qkcircuits reads qkcircuits.circuit versions 1 to 1"),
    (_bad(edges=[["0.0", "1.0", "k"]]), r"circuit.edges\[0\] must be \[sender, receiver, input, score\]"),
    (_bad(edges=[["0.0", "blob", "k", 1.0]]), r"circuit.edges\[0\] receiver 'blob' is not a node"),
    (_bad(edges=[["1.0", "0.0", "k", 1.0]]), r"runs 1.0 -> 0.0, which is not forward"),
    (_bad(edges=[["0.0", "0.1", "k", 1.0]]), r"runs 0.0 -> 0.1, which is not forward"),
    (_bad(edges=[["logits", "1.0", "k", 1.0]]), "the logits send nothing"),
    (_bad(edges=[["0.0", "1.0", "k", "big"]]), r"score must be a finite number, got 'big'"),
    (_bad(edges=[["0.0", "1.0", 3, 1.0]]), r"input must be a string"),
    (_bad(curve={"150": 1.0}), "curve key '150' is not a percent"),
    (_bad(curve={"1": "high"}), r"curve\['1'\] must be a finite number"),
    (_bad(curve=[1, 2]), "curve must be"),
    (_bad(roles={"1.0": "induction"}), r"roles\['1.0'\] must be"),
    (_bad(cpr="0.8"), "cpr must be float"),
    (_bad(n_prompts=True), "n_prompts must be int"),
    ({"curve": {}}, "no circuit.edges"),
]


@pytest.mark.parametrize("data,message", BAD)
def test_bad_file_is_one_line_naming_it(tmp_path, data, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(qk.QKCircuitsError, match=message) as e:
        plot.circuit(path)
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"{path}: ")


def test_bad_sources(tmp_path):
    with pytest.raises(qk.QKCircuitsError, match="no circuit JSON file at"):
        load_circuit(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(qk.QKCircuitsError, match=r"x.json: not JSON \(.* line 1, column 2\)"):
        load_circuit(tmp_path / "x.json")
    (tmp_path / "l.json").write_text("[1, 2]")
    with pytest.raises(qk.QKCircuitsError, match="l.json: expected a JSON object"):
        load_circuit(tmp_path / "l.json")
    with pytest.raises(qk.QKCircuitsError, match="no faithfulness curve"):
        plot.faithfulness({"circuit": {"edges": []}})
    with pytest.raises(qk.QKCircuitsError, match="expected a circuit"):
        plot.circuit(3)


def test_graph_checked_against_the_model(hand_built):
    fig = plot.circuit(CHAIN, model=hand_built)
    assert len(edge_lines(fig)) == 2
    with pytest.raises(qk.QKCircuitsError, match="names 2.3, but the model has 2 layers x 2 heads"):
        plot.circuit(WIDE, model=hand_built)


def source_data(html: str) -> dict:
    m = re.search(r"window\.QK_SOURCE = (\{.*?\});</script>", html, re.S)
    return json.loads(m.group(1).replace("<\\/", "</"))


HOSTILE = "</script><img src=x onerror=alert(1)>"


def section(html: str, sid: str) -> dict:
    """One section of the page's data, its blocks by kind: summary (the first note), curve and graph (figures),
    roles and edges (tables), banner (the warning lines), core (the core's table)."""
    s = next(x for x in source_data(html)["sections"] if x["id"] == sid)
    out = {"title": s["title"], "blocks": s["blocks"]}
    for b in s["blocks"]:
        if b["type"] == "note":
            out.setdefault("summary", b["text"])
        elif b["type"] == "banner":
            out["banner"] = b["lines"]
        elif b["type"] == "figures":
            for f in b["figures"]:
                out[f["id"].replace("circuit-", "")] = f["figure"]
        elif b["type"] == "table":
            out[b["id"].replace("circuit-", "")] = b["rows"]
    return out


def test_report_section(hand_built):
    scores = qk.scan(hand_built, n_seqs=4, seg_len=12, prefix_seqs=2, eigen_copying=False, progress=False)
    d = json.loads(json.dumps(CHAIN))
    d["roles"]["0.0"]["evidence"] = {"note": HOSTILE}
    html = report_html(hand_built, scores=scores, grid_k=0, circuit=d, progress=False)
    c = section(html, "circuit-section")
    # the evidence as a small table of its own, one row per name (not "key value, key value" on one line)
    assert c["roles"] == [["0.0", "previous-token", {"kv": [["note", HOSTILE]]}],
                          ["1.0", "induction", {"kv": [["induction", "0.99"], ["direct effect", "0.5"]]}]]
    assert c["edges"] == [["0.0", "1.0", "k", 0.6, "previous-token", "induction"],
                          ["1.0", "logits", "", -0.3, "induction", ""]]
    assert "node faithfulness 0.97" in c["summary"] and "clean 3, corrupt -1" in c["summary"]
    assert list(c["curve"]["data"][0]["x"]) == [0.1, 1, 10, 100]
    assert {t["meta"]["sender"] for t in c["graph"]["data"] if t.get("mode") == "lines"} == {"0.0", "1.0"}
    assert HOSTILE not in html                                      # only its escaped form reaches the page
    assert set(source_data(html)["panels"]) == {"0.0", "1.0"}       # the circuit's heads get their panels
    with pytest.raises(qk.QKCircuitsError, match="names 2.3, but the model has 2 layers x 2 heads"):
        report_html(hand_built, scores=scores, circuit=WIDE, progress=False)


def test_cli_report_circuit(tmp_path, capsys):
    good = tmp_path / "c.json"
    good.write_text(json.dumps(CHAIN))
    out = tmp_path / "r.html"
    assert main(["report", "toy-induction", "-o", str(out), "--circuit", str(good), "--grid-k", "1",
                 "--quiet"]) == 0
    assert section(out.read_text(encoding="utf-8"), "circuit-section")["roles"][1][:2] == ["1.0", "induction"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_bad(edges=[["0.0", "blob", "k", 1.0]])))
    wide = tmp_path / "wide.json"
    wide.write_text(json.dumps(WIDE))
    target = tmp_path / "bad.html"
    for path, message in ((bad, "is not a node"), (tmp_path / "missing.json", "no circuit JSON file"),
                          (wide, "names 2.3, but the model has 2 layers x 2 heads")):
        capsys.readouterr()
        assert main(["report", "toy-induction", "-o", str(target), "--circuit", str(path), "--quiet"]) == 2
        err = capsys.readouterr().err
        lines = [x for x in err.splitlines() if not x.startswith("qkcircuits: using device")]
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0] and str(path) in lines[0]
        assert "Traceback" not in err and not target.exists()


# Grouped-query attention as the graph names it: 4 query heads, 2 KV heads; k/v edges end at "L.kvG".
GQA = {"graph": {"n_layers": 2, "n_heads": 4, "n_kv_heads": 2},
       "circuit": {"edges": [["emb", "0.3", "q", 0.3], ["0.3", "1.kv1", "k", 0.9], ["mlp0", "1.kv1", "v", -0.2],
                             ["1.2", "logits", "in", 0.5], ["0.3", "mlp0", "in", 0.1]], "heads": ["0.3", "1.2"]}}


def test_gqa_kv_heads():
    fig = plot.circuit(GQA)
    nodes = node_points(fig)
    assert set(nodes) == {"emb", "0.3", "1.kv1", "mlp0", "1.2", "logits"}
    # the KV head has its row between layer 0's MLP and layer 1's heads
    assert nodes["mlp0"][1] < nodes["1.kv1"][1] < nodes["1.2"][1] < nodes["logits"][1]
    assert row_names(fig) == ["emb", "layer 0", "mlp 0", "layer 1 KV", "layer 1", "logits"]
    assert "shared by query heads 1.2-1.3" in nodes["1.kv1"][2]
    assert "KV head" in fig.layout.title.text
    hover = [t for t in fig.data if t.mode == "markers" and t.name == "edges"][0].text
    assert any(h.startswith("1.2 → logits<br>") for h in hover)     # the single input "in" is not named
    # the model's own counts win over the file's; a KV head the model lacks is one line
    with pytest.raises(qk.QKCircuitsError, match="names 0.3, but the model has 2 layers x 2 heads"):
        load_circuit(GQA) and plot.circuit(GQA, model=type("M", (), {"blocks": [], "cfg": type("C", (), {
            "n_layers": 2, "n_heads": 2, "n_key_value_heads": 1})()})())
    with pytest.raises(qk.QKCircuitsError, match="names 1.kv1, but the model has 2 layers x 4 heads"):
        plot.circuit(GQA, model=type("M", (), {"blocks": [], "cfg": type("C", (), {
            "n_layers": 2, "n_heads": 4, "n_key_value_heads": 1})()})())


def test_the_circuit_apis_own_dicts():
    # qk.faithfulness(...).to_dict(): its own schema, the chosen size, an undefined f (null) at one size
    faith = {"schema": "qkcircuits.faithfulness/1", "model": "toy-induction", "clean": 2.0, "corrupt": 0.5,
             "curve": {"1.0": None, "10.0": 0.9, "100.0": 1.0}, "cpr": 0.9, "cmd": 0.1, "chosen_percent": 10.0,
             "n_edges": {"1.0": 1, "10.0": 3, "100.0": 33},
             "circuit": {**CHAIN["circuit"], "percent": 10.0, "n_edges": 2, "mlps": [], "by": "abs"}}
    fig = plot.faithfulness(faith)
    assert list(fig.data[0].x) == [10.0, 100.0]                     # the undefined point is left off, and said
    assert any("f undefined at 1 size" in a.text for a in fig.layout.annotations)
    assert [s.x0 for s in fig.layout.shapes if s.xref == "x"] == [10.0]   # the circuit's size marked
    assert "2 edges (chosen at 10 % of the graph's edges, then pruned)" in summary(load_circuit(faith))
    # scores.circuit(...).to_dict(): the "circuit" part alone; roles given beside it
    part = {"edges": [["emb", "0.0", "v", 0.2], ["0.0", "1.0", "k", 0.6], ["1.0", "logits", "in", 0.4]],
            "heads": ["0.0", "1.0"], "n_edges": 3, "percent": None}
    fig = plot.circuit(part, roles={"1.0": {"role": "induction", "evidence": "attends to the token after"}})
    nodes = node_points(fig)
    assert set(nodes) == {"emb", "0.0", "1.0", "logits"} and "role: induction" in nodes["1.0"][2]

    class Roles:
        def to_dict(self):
            return {"roles": {"0.0": {"role": "previous-token", "evidence": {"previous_token": 1.0}}}}

    assert "role: previous-token" in node_points(plot.circuit(part, roles=Roles()))["0.0"][2]
    with pytest.raises(qk.QKCircuitsError, match="holds edge scores, not a circuit"):
        plot.circuit({"schema": "qkcircuits.edge_scores/1", "scores": []})
    with pytest.raises(qk.QKCircuitsError, match=r"roles\['1.0'\] must be"):
        plot.circuit(part, roles={"1.0": "induction"})


# The shape `qkcircuits circuit --json` writes (cli/circuit_command.py): extra keys, the graph's counts, roles with
# nested evidence, an undefined clean metric (null) tolerated.
CLI = {"schema": "qkcircuits.circuit/1", "model": "m", "task": "ioi", "n_prompts": 4, "metric": "logit-diff",
       "clean": None, "corrupt": 0.1, "method": "eap", "steps": None, "curve": {"0.1": 0.3, "5": 0.85, "100": 1.0},
       "cpr": 0.9, "cmd": 0.12, "bos_prepended": False, "chosen_percent": 5.0, "by": "abs", "versions": {"torch": "x"},
       "graph": {"n_layers": 6, "n_heads": 3, "n_kv_heads": 3, "n_edges": 400},
       "n_edges_by_percent": {"0.1": 1, "5": 20, "100": 400},
       "circuit": {"edges": [["emb", "1.2", "k", 0.3], ["1.2", "4.0", "q", -0.2], ["4.0", "logits", "in", 0.9]],
                   "heads": ["1.2", "4.0"], "mlps": [], "n_edges": 3, "percent": 5.0, "faithfulness": 0.85,
                   "node_faithfulness": 0.7},
       "roles": {"4.0": {"role": "name mover", "evidence": {"direct_effect": 0.9, "direct_share": 0.31,
                                                            "attn_from_END": {"END": 0.1, "IO": 0.62},
                                                            "feeds_name_movers_q": []}},
                 "1.2": {"role": "S-inhibition head", "evidence": {"direct_effect": -0.01,
                                                                   "feeds_name_movers_q": ["4.0"]}}},
       "timing": {"total_s": 3.0}}


def test_the_cli_json():
    fig = plot.circuit(CLI)
    nodes = node_points(fig)
    assert row_names(fig) == ["emb", "layer 1", "layer 4", "logits"]
    assert nodes["4.0"][3] == "name mover" and nodes["1.2"][3] == "S-inhibition head"
    colour = {t.name: t.marker.color for t in fig.data if t.mode == "markers+text"}
    assert colour["name mover"] == "#2ca02c" and colour["S-inhibition head"] == "#ff7f0e"
    assert "attn_from_END: END 0.1, IO 0.62" in nodes["4.0"][2] and "feeds_name_movers_q: 4.0" in nodes["1.2"][2]
    s = summary(load_circuit(CLI))
    assert "metric logit-diff;" in s and "method eap;" in s and "3 edges (chosen at 5 %" in s
    assert [x.x0 for x in plot.faithfulness(CLI).layout.shapes if x.xref == "x"] == [5.0]


def test_app_shows_the_circuit_section(hand_built):
    from qkcircuits.viz import create_app

    app = create_app(hand_built, circuit=CHAIN)
    info = app.test_client().get("/api/info").get_json()
    sec = [s for s in info["sections"] if s["id"] == "circuit-section"][0]
    graph = [f for b in sec["blocks"] if b["type"] == "figures" for f in b["figures"] if f["id"] == "circuit-graph"]
    assert graph and graph[0]["figure"]["meta"]["which"] == "edges"              # no core in CHAIN: the edge circuit
    with pytest.raises(qk.QKCircuitsError, match="names 2.3, but the model has 2 layers x 2 heads"):
        create_app(hand_built, circuit=WIDE)
