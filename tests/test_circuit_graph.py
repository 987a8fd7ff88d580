"""The circuit graph a person reads (issue 35 ask 5): the core circuit by default when the JSON has ``core`` (the
contract in docs/tasks.md), the edge circuit otherwise or on request; rows in the model's order; position columns;
roles as colours with a legend; warnings shown; and, measured in headless Chromium, no node label overlapping another
label or a node and no text past the figure's edge, on hand-written files of known structure and on a graph the
size of SmolLM2's IOI core (30 layers x 9 heads, 3 KV heads)."""

from __future__ import annotations

import random

import pytest

import qkcircuits as qk
from qkcircuits import plot
from qkcircuits.viz._circuit_data import load_circuit, parse_node
from qkcircuits.viz._circuit_graph import CORE_IN_EDGES, circuit_graph
from qkcircuits.viz._circuit_layout import SPACE_PX, layout
from _layout import clipped_texts, label_overlaps

# 4 layers x 4 heads, 2 KV heads (1.kv0 is shared by 1.0 and 1.1). Core: 0.1, 1.1, 2.3 and mlp0.
GQA_CORE = {
    "graph": {"n_layers": 4, "n_heads": 4, "n_kv_heads": 2}, "method": "eap-ig",
    "circuit": {"edges": [["emb", "0.1", "q", 0.5], ["emb", "1.kv0", "k", 0.4], ["0.1", "1.kv0", "v", 0.3],
                          ["0.1", "mlp0", "in", 0.2], ["mlp0", "2.3", "q", -0.2], ["1.1", "2.3", "q", 0.6],
                          ["2.3", "logits", "in", 1.2], ["1.0", "logits", "in", 0.1], ["3.2", "logits", "in", 0.05]]},
    "core": {"heads": ["2.3", "1.1", "0.1"], "mlps": ["mlp0"], "node_faithfulness": 0.91,
             "curve": {"1": 0.5, "2": 0.8, "3": 0.91}, "how": "greedy by node score until f >= 0.8"},
    "roles": {"2.3": {"role": "name mover", "evidence": {"direct_share": 0.6}},
              "1.1": {"role": "S-inhibition head", "evidence": "feeds 2.3's query"}},
    "warnings": ["no grid size reaches f >= 0.8", "the model does not do this task"]}


def nodes_of(fig):
    """{full node name: (x, y, hover, legend group)}."""
    out = {}
    for t in fig["data"]:
        if t.get("mode") == "markers+text":
            for x, y, cd in zip(t["x"], t["y"], t["customdata"]):
                out[cd[2]] = (x, y, cd[1], t["name"])
    return out


def lines_of(fig):
    return {(t["meta"]["sender"], t["meta"]["receiver"], t["meta"]["input"]): t for t in fig["data"]
            if t.get("mode") == "lines"}


def test_core_by_default_and_edges_on_request():
    view = load_circuit(GQA_CORE)
    fig = circuit_graph(view)
    assert fig["meta"]["which"] == "core"
    nodes = nodes_of(fig)
    assert set(nodes) == {"emb", "0.1", "mlp0", "1.1", "2.3", "logits"}     # only the core (and emb, logits)
    # k/v edges into KV head 1.kv0 go into its core query head 1.1 (1.0 is not in the core); 1.0 and 3.2 are not drawn
    assert set(lines_of(fig)) == {("emb", "0.1", "q"), ("emb", "1.1", "k"), ("0.1", "1.1", "v"), ("0.1", "mlp0", "in"),
                                  ("mlp0", "2.3", "q"), ("1.1", "2.3", "q"), ("2.3", "logits", "in")}
    hover = [t for t in fig["data"] if t.get("name") == "edges"][0]["text"]
    assert any(h.startswith("emb → 1.1 (k)<br>score 0.4<br>into KV head 1.kv0") for h in hover), hover
    # rows in the model's order, top to bottom
    y = {n: v[1] for n, v in nodes.items()}
    assert y["emb"] < y["0.1"] < y["mlp0"] < y["1.1"] < y["2.3"] < y["logits"]
    assert fig["layout"]["yaxis"]["ticktext"] == ["emb", "layer 0", "mlp 0", "layer 1", "layer 2", "logits"]
    # roles as colours with a legend; hover: role, evidence, place in the core
    assert nodes["2.3"][3] == "name mover" and nodes["1.1"][3] == "S-inhibition head"
    assert "role: name mover" in nodes["2.3"][2] and "direct_share: 0.6" in nodes["2.3"][2]
    assert "core: chosen 1 of 4" in nodes["2.3"][2]
    assert "core circuit (eap-ig): 3 heads + 1 MLPs, node f 0.910" in fig["layout"]["title"]["text"]
    # the warnings, in red above the graph
    warn = [a for a in fig["layout"]["annotations"] if "⚠" in a["text"]]
    assert len(warn) == 1 and "no grid size reaches f &gt;= 0.8" in warn[0]["text"]     # shown as typed
    assert warn[0]["text"].count("⚠") == 2 and warn[0]["font"]["color"] == "#b00000"
    # the edge circuit on request: every edge, the KV head as its own node
    edges = circuit_graph(view, which="edges")
    assert edges["meta"]["which"] == "edges" and "1.kv0" in nodes_of(edges) and "3.2" in nodes_of(edges)
    assert len(lines_of(edges)) == 9
    # the public figure and the report section pick the same
    assert plot.circuit(GQA_CORE).layout.meta["which"] == "core"
    assert plot.circuit(GQA_CORE, which="edges").layout.meta["which"] == "edges"


def test_without_core_the_edge_circuit():
    data = {k: v for k, v in GQA_CORE.items() if k not in ("core", "warnings")}
    fig = circuit_graph(load_circuit(data))
    assert fig["meta"]["which"] == "edges" and not [a for a in fig["layout"].get("annotations", []) if "⚠" in a["text"]]
    with pytest.raises(qk.QKCircuitsError, match="no core circuit in this file"):
        circuit_graph(load_circuit(data), which="core")


def test_at_most_a_few_edges_into_each_core_node():
    edges = [["emb", "0.0", "q", 1.0]] + [[f"0.{h}", "1.0", "v", 0.1 * (h + 1)] for h in range(6)]
    data = {"circuit": {"edges": edges}, "core": {"heads": ["1.0"] + [f"0.{h}" for h in range(6)], "mlps": []}}
    got = lines_of(circuit_graph(load_circuit(data)))
    into = sorted(s for s, r, _ in got if r == "1.0")
    assert into == ["0.3", "0.4", "0.5"] and CORE_IN_EDGES == 3          # the 3 strongest of 6


POS = {"positions": ["S1", "S2", "IO", "END"],
       "circuit": {"edges": [["emb@S1", "5.0@S2", "q", 0.4], ["5.0@S2", "9.1@END", "k", 0.7],
                             ["emb@IO", "9.1@END", "v", 0.9], ["9.1@END", "logits", "in", 1.1],
                             ["mlp3@S2", "9.1@END", "q", -0.3], ["emb@S2", "mlp3@S2", "in", 0.2]]},
       "core": {"heads": ["9.1@END", "5.0@S2"], "mlps": ["mlp3@S2"]},
       "roles": {"9.1": {"role": "name mover", "evidence": {"direct_share": 0.7}}}}


def test_positions_as_columns():
    assert str(parse_node("20.0@END")) == "20.0@END" and parse_node("20.0@END").base == "20.0"
    assert str(parse_node("mlp3@S2")) == "mlp3@S2" and str(parse_node("emb@IO")) == "emb@IO"
    assert parse_node("1.0@") is None and parse_node("1.0@a b") is None
    fig = circuit_graph(load_circuit(POS))
    nodes = nodes_of(fig)
    assert set(nodes) == {"emb@S1", "emb@S2", "emb@IO", "5.0@S2", "mlp3@S2", "9.1@END", "logits"}
    x = {n: v[0] for n, v in nodes.items()}
    # one column per position, in the file's order; the logits (no position) in END's column
    assert x["emb@S1"] < x["emb@S2"] < x["emb@IO"] < x["9.1@END"]
    assert max(x["5.0@S2"], x["mlp3@S2"], x["emb@S2"]) < x["emb@IO"]
    heads = [a["text"] for a in fig["layout"]["annotations"] if a["text"].startswith("@")]
    assert heads == ["@S1", "@S2", "@IO", "@END"]
    labels = {t for tr in fig["data"] if tr.get("mode") == "markers+text" for t in tr["text"]}
    assert "9.1" in labels and "9.1@END" not in labels                       # the column names the position
    assert nodes["9.1@END"][3] == "name mover"                                # the head's role, at its position


def test_layout_rows_never_overlap():
    rng = random.Random(3)
    names = [f"n{i}" for i in range(60)]
    rank = {n: rng.randrange(8) for n in names}
    edges = [(a, b) for a in names for b in names if rank[a] < rank[b] and rng.random() < 0.08]
    width = {n: rng.uniform(20, 90) for n in names}
    spots = layout(rank, edges, width)
    by_row = {}
    for n, (x, y) in spots.nodes.items():
        by_row.setdefault(y, []).append((x - width[n] / 2, x + width[n] / 2))
    for y, boxes in by_row.items():
        boxes.sort()
        assert all(b[0] >= a[1] + SPACE_PX - 1e-6 for a, b in zip(boxes, boxes[1:])), (y, boxes)
    # every edge is a polyline from its sender's row down to its receiver's, bending on rows in between
    assert set(spots.routes) == set(edges)
    for (s, r), pts in spots.routes.items():
        assert pts[0][1] == spots.nodes[s][1] and pts[-1][1] == spots.nodes[r][1]
        assert all(a[1] < b[1] for a, b in zip(pts, pts[1:])) and all(y in spots.rows.values() for _, y in pts)


def big_core(seed: int = 0) -> dict:
    """A graph the size of SmolLM2's IOI core: 30 layers x 9 heads, 3 KV heads, 18 core heads (five in layer 23)
    and 8 MLPs, 1,300 edge-circuit edges of random scores, roles of every kind, two warnings."""
    rng = random.Random(seed)
    L, H = 30, 9
    heads = ["1.4", "2.4", "5.6", "8.1", "9.2", "11.8", "15.6", "15.7", "16.0", "17.4", "19.2", "20.0", "23.0", "23.1",
             "23.2", "23.3", "23.7", "29.1"]
    mlps = ["mlp0", "mlp2", "mlp6", "mlp8", "mlp17", "mlp18", "mlp26", "mlp29"]
    senders = ["emb"] + [f"{l}.{h}" for l in range(L) for h in range(H)] + [f"mlp{l}" for l in range(L)]

    def layer(n):
        return -1 if n == "emb" else int(n[3:]) + 0.5 if n.startswith("mlp") else int(n.split(".")[0])

    edges = set()
    pool = heads + mlps + ["emb"]
    while len(edges) < 1300:
        s = rng.choice(pool if rng.random() < 0.6 else senders)
        kind = rng.random()
        if kind < 0.15:
            r, x = "logits", "in"
        elif kind < 0.35:
            r, x = f"mlp{rng.randrange(L)}", "in"
        elif kind < 0.6:
            r, x = f"{rng.randrange(L)}.kv{rng.randrange(3)}", rng.choice("kv")
        else:
            r, x = (rng.choice(heads) if rng.random() < 0.5 else f"{rng.randrange(L)}.{rng.randrange(H)}"), "q"
        rl = 1e9 if r == "logits" else layer(r.replace(".kv", ".")) if "kv" in r else layer(r)
        if layer(s) < rl:
            edges.add((s, r, x))
    roles = {"23.0": "name mover", "23.1": "name mover", "23.2": "name mover", "23.7": "name mover",
             "19.2": "S-inhibition head", "20.0": "S-inhibition head", "17.4": "induction head",
             "16.0": "previous-token head", "5.6": "duplicate-token head", "8.1": "duplicate-token head",
             "29.1": "negative name mover", "23.3": "unclassified"}
    return {"method": "eap-ig", "graph": {"n_layers": L, "n_heads": H, "n_kv_heads": 3},
            "circuit": {"edges": [[s, r, x, round(rng.gauss(0, 1) ** 3, 4) or 0.001] for s, r, x in sorted(edges)]},
            "core": {"heads": heads, "mlps": mlps, "node_faithfulness": 0.804, "curve": {"18": 0.804}},
            "roles": {h: {"role": r, "evidence": {"direct_share": 0.1}} for h, r in roles.items()},
            "warnings": ["an example warning that is long enough to need a second line when the figure is narrow, "
                         "so the banner wraps", "a second warning"]}


@pytest.mark.browser
@pytest.mark.parametrize("which,data", [("core", "big"), ("edges", "big"), ("core", "gqa"), ("core", "pos")])
def test_no_label_overlaps_and_nothing_cut_in_a_browser(browser, tmp_path, which, data):  # noqa: F811
    src = {"big": big_core(), "gqa": GQA_CORE, "pos": POS}[data]
    fig = plot.circuit(src, which=which, max_edges=120)
    path = tmp_path / "g.html"
    fig.save(path)
    page = browser.new_page()
    page.goto(path.as_uri())
    page.wait_for_function("document.querySelector('.qk-plotly .main-svg')", timeout=60_000)
    ll, ln, n_labels, n_marks = label_overlaps(page, ".qk-plotly")
    assert n_labels == len(nodes_of(fig.to_plotly_json() | {"data": [t.to_plotly_json() for t in fig.data]}))
    assert n_marks == n_labels
    assert ll == [] and ln == [], (ll[:5], ln[:5])
    assert clipped_texts(page, ".qk-plotly") == []
    if SHOTS and data == "big":
        page.set_viewport_size({"width": 1400, "height": 1000})
        page.locator(".qk-plotly").screenshot(path=str(Path(SHOTS) / f"circuit-graph-{which}.png"))
    page.close()


import os  # noqa: E402
from pathlib import Path  # noqa: E402

from test_browser import browser  # noqa: E402,F401  (the shared headless-Chromium fixture)

SHOTS = os.environ.get("QK_SCREENSHOTS")
