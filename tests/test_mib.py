"""MIB interchange (issue 35 ask 7): edge scores and circuits in the MIB circuit track's JSON and back.

Ground truth for the format: the MIB circuit track's own example file (hannamw/MIB-circuit-track at b759df3,
``circuits/ioi-eap-ig.json``, an EAP-IG importance file for GPT-2 small written by the EAP-IG library's
``Graph.to_json``): 32,491 edges and 158 nodes, whose names in the file's order hash to the SHA-256 values below
(computed from that file). A GPT-2-small-shaped graph must export exactly those names, in that order. SmolLM2's per-query-head graph
has 123,211 edges (REFERENCE.md: the reference's count with GQA ungrouped).
"""

import hashlib
import json

import pytest
import torch

import qkcircuits as qk
from qkcircuits._tasks.graph import Graph
from qkcircuits._tasks.mib import edge_name, reference_edges
from qkcircuits.cli import main

from _tiny import gpt2_dir, llama_dir, neox_dir

# (count, SHA-256 of the names joined by newlines in the file's order) of the reference file's edges and nodes
MIB_GPT2_EDGES = (32491, "c9c561241402629d1c19643b74d375c5b7c707ad352e886ef2bb9946f5142ed7")
MIB_GPT2_NODES = (158, "8c36c96555ce1fa7f46cfaee781c602dac5697b7b278958695feb2b64778eab0")


def _sha(names):
    return hashlib.sha256("\n".join(names).encode()).hexdigest()


def _random_scores(g: Graph, seed: int = 0) -> qk.results.EdgeScores:
    gen = torch.Generator().manual_seed(seed)
    sc = torch.randn(g.n_senders, g.n_receivers, generator=gen)
    sc[~g.valid] = float("nan")
    return qk.results.EdgeScores(g, sc, "eap", 0, 1.0, 0.0, {"metric": "logit-diff", "higher_is_better": True})


def test_names_are_the_reference_files(tmp_path):
    g = Graph(12, 12, 12, True, "gpt2-small-shaped")
    d = json.loads(_random_scores(g).to_mib(d_model=768))
    assert (len(d["edges"]), _sha(d["edges"])) == MIB_GPT2_EDGES
    assert (len(d["nodes"]), _sha(d["nodes"])) == MIB_GPT2_NODES
    assert d["cfg"] == {"n_layers": 12, "n_heads": 12, "parallel_attn_mlp": False, "d_model": 768}
    assert list(d["edges"])[:3] == ["input->a0.h0<q>", "input->a0.h0<k>", "input->a0.h0<v>"]
    assert list(d["edges"])[-1] == "m11->logits" and list(d["nodes"])[-1] == "logits" and d["nodes"]["logits"]["in_graph"]
    assert sum(1 for _ in reference_edges(30, 9, False)) == 123211              # SmolLM2, k/v per query head
    # a parallel block's MLP does not read its own layer's heads, as in the reference's from_model
    names = {edge_name(*e) for e in reference_edges(2, 2, True)}
    assert "a0.h0->m0" not in names and "a0.h0->m1" in names and "m0->a1.h1<v>" in names


@pytest.mark.parametrize("shape", [(3, 9, 3, True, False), (2, 4, 2, False, False), (2, 4, 4, True, True),
                                   (2, 6, 1, True, False)])
def test_export_then_import_is_exact(shape, tmp_path):
    # grouped k/v (groups of 3, 2 and 6 query heads), no MLPs, parallel blocks: the same float32 scores back
    L, H, G, mlps, parallel = shape
    g = Graph(L, H, G, mlps, "m", parallel)
    scores = _random_scores(g)
    path = tmp_path / "importances.json"
    scores.to_mib(path)
    back = qk.results.EdgeScores.from_mib(path, g)
    assert torch.equal(back.scores.nan_to_num(-9.0), scores.scores.nan_to_num(-9.0))
    assert back.method == "mib" and back.graph == g
    d = json.loads(path.read_text())
    assert not any(e["in_graph"] for e in d["edges"].values())              # scores only: nothing in
    # a KV edge's score is shared evenly by its group's query heads: their sum is the KV head's score
    if G != H:
        s, r = g.senders.index("emb"), g.receivers.index((g.kv_name(L - 1, 0), "k"))
        copies = [d["edges"][f"input->a{L - 1}.h{h}<k>"]["score"] for h in range(H // G)]
        assert len(set(copies)) == 1 and sum(copies) == pytest.approx(float(scores.scores[s, r]), rel=1e-6)
    if not mlps:                                                          # the reference's MLPs: no effect
        mlp_edges = [v for k, v in d["edges"].items() if any(n.startswith("m") for n in k.split("->"))]
        assert len(mlp_edges) > 0 and all(v == {"score": 0.0, "in_graph": False} for v in mlp_edges)
    # a circuit: its edges in_graph (a KV edge for every query head of its group), back as the same mask
    circ = scores.circuit(percent=20)
    circ.to_mib(path)
    assert torch.equal(qk.results.TaskCircuit.from_mib(path, g).mask, circ.mask)
    d = json.loads(path.read_text())
    assert sum(e["in_graph"] for e in d["edges"].values()) == sum(
        (H // G if x in ("k", "v") else 1) for _, _, x, _ in circ.edges())
    used = {s for s, *_ in circ.edges()}
    from qkcircuits._tasks.mib import node_name
    assert {n for n, v in d["nodes"].items() if v["in_graph"]} == {node_name(s) for s in used} | {"logits"}


def test_import_sums_per_query_head_scores_and_keeps_any_in_graph(tmp_path):
    # a reference file scores each query head's k/v input on its own: the grouped graph reads their sum, and a
    # k/v edge kept for only some query heads of a group is in the circuit (the superset)
    g = Graph(2, 4, 2, True, "m")
    d = json.loads(_random_scores(g).to_mib())
    d["edges"]["input->a1.h2<v>"] = {"score": 0.25, "in_graph": True}
    d["edges"]["input->a1.h3<v>"] = {"score": -1.0, "in_graph": False}
    path = tmp_path / "ref.json"
    path.write_text(json.dumps(d))
    back = qk.results.EdgeScores.from_mib(path, g)
    s, r = g.senders.index("emb"), g.receivers.index(("1.kv1", "v"))
    assert float(back.scores[s, r]) == pytest.approx(-0.75)
    circ = qk.results.TaskCircuit.from_mib(path, g)
    assert bool(circ.mask[s, r]) and int(circ.mask.sum()) == 1


@pytest.mark.parametrize("edit,message", [
    (lambda d: d["cfg"].update(n_heads=5), "cfg n_heads is 5"),
    (lambda d: d["edges"].pop("a0.h1->m0"), "edge 'a0.h1->m0' is missing"),
    (lambda d: d["edges"].update({"a9.h0->logits": {"score": 1.0, "in_graph": False}}), "'a9.h0->logits' is not an edge"),
    (lambda d: d.pop("nodes"), "expected the keys cfg, nodes, edges"),
    (lambda d: d["edges"]["m0->logits"].update(score="big"), "no numeric score"),
])
def test_bad_files_are_one_line_errors(edit, message, tmp_path):
    g = Graph(2, 4, 2, True, "m")
    d = json.loads(_random_scores(g).to_mib())
    edit(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(qk.QKCircuitsError, match=message) as e:
        qk.results.EdgeScores.from_mib(path, g)
    assert "\n" not in str(e.value)
    path.write_text("not json")
    with pytest.raises(qk.QKCircuitsError, match="not a MIB circuit JSON"):
        qk.results.EdgeScores.from_mib(path, g)
    # an MLP-less model reading a file that scores MLPs
    nomlp = Graph(2, 4, 2, False, "m")
    d = json.loads(_random_scores(g).to_mib())
    path.write_text(json.dumps(d))
    with pytest.raises(qk.QKCircuitsError, match="scores an MLP this model does not have"):
        qk.results.EdgeScores.from_mib(path, nomlp)


@pytest.mark.filterwarnings("ignore:the model does not do task")
@pytest.mark.parametrize("folder", [llama_dir, gpt2_dir, neox_dir])
def test_real_scores_round_trip_and_rank_the_same(folder, tmp_path_factory, tmp_path):
    model = qk.load(str(folder(tmp_path_factory)), verbose=False)
    gen = torch.Generator().manual_seed(0)
    clean = torch.randint(1, model.cfg.d_vocab, (8, 8), generator=gen)
    corrupt = clean.clone()
    corrupt[:, 5] = torch.randint(1, model.cfg.d_vocab, (8,), generator=gen)
    task = qk.Task(clean, corrupt, clean[:, 0], clean[:, 1])
    scores = qk.edge_scores(model, task, method="eap", progress=False)
    path = tmp_path / "importances.json"
    scores.to_mib(path)
    assert json.loads(path.read_text())["cfg"]["d_model"] == model.cfg.d_model
    back = qk.results.EdgeScores.from_mib(path, model)
    assert torch.equal(back.scores.nan_to_num(0.0), scores.scores.nan_to_num(0.0))
    assert {e[:3] for e in back.circuit(percent=10).edges()} == {e[:3] for e in scores.circuit(percent=10).edges()}


def test_cli_writes_mib(tmp_path, capsys):
    out = tmp_path / "mib.json"
    assert main(["circuit", "toy-induction", "--task", "induction", "--n", "4", "--method", "eap", "--no-core",
                 "--mib", str(out), "--quiet", "--device", "cpu"]) == 0
    model = qk.load("toy-induction", verbose=False)
    circ = qk.results.TaskCircuit.from_mib(out, model)
    assert circ.heads == ["0.0", "1.0"]
    d = json.loads(out.read_text())
    assert all(v == {"score": 0.0, "in_graph": False} for k, v in d["edges"].items()
               if any(n.startswith("m") for n in k.split("->")))
    assert "wrote" in capsys.readouterr().err


def test_ungrouped_graph_maps_one_to_one_and_positions_are_refused(tmp_path):
    # the ungrouped graph has the reference's own k/v count: each query head's k/v edge is its own file edge, the
    # same score (nothing split), read back bit for bit; a circuit's k/v edge is in_graph for that query head only
    g = Graph(2, 4, 2, True, "m", False, True)
    scores = _random_scores(g, seed=3)
    path = tmp_path / "u.json"
    d = json.loads(scores.to_mib(path))
    for h in range(4):
        s, r = g.senders.index("0.1"), g.receivers.index((f"1.{h}", "k"))
        assert d["edges"][f"a0.h1->a1.h{h}<k>"]["score"] == float(scores.scores[s, r])
    back = qk.results.EdgeScores.from_mib(path, g)
    assert torch.equal(back.scores.nan_to_num(-9.0), scores.scores.nan_to_num(-9.0)) and back.graph.ungrouped
    circ = scores.circuit(percent=20)
    circ.to_mib(path)
    d = json.loads(path.read_text())
    assert sum(e["in_graph"] for e in d["edges"].values()) == circ.n_edges
    assert torch.equal(qk.results.TaskCircuit.from_mib(path, g).mask, circ.mask)
    # the same file on the grouped graph: each group's copies summed (the reference's per-head file, read grouped)
    grouped = qk.results.EdgeScores.from_mib(path, Graph(2, 4, 2, True, "m"))
    s, r = grouped.graph.senders.index("0.1"), grouped.graph.receivers.index(("1.kv1", "v"))
    want = sum(float(scores.scores[s, g.receivers.index((f"1.{h}", "v"))]) for h in (2, 3))
    assert float(grouped.scores[s, r]) == pytest.approx(want, rel=1e-6)
    # MIB's graph has no positions: one line, nothing written
    pos = _random_scores(Graph(2, 4, 2, True, "m", False, False, ("END", "other")))
    with pytest.raises(qk.QKCircuitsError, match="no position groups") as e:
        pos.to_mib(tmp_path / "p.json")
    assert "\n" not in str(e.value) and not (tmp_path / "p.json").exists()


@pytest.mark.filterwarnings("ignore:the model does not do task")
def test_real_ungrouped_scores_export_per_query_head(tmp_path_factory, tmp_path):
    # tiny Llama-GQA, EAP on the ungrouped graph: the file read on the grouped graph gives the grouped scores (the
    # group-sum identity: a KV head's gradient is the sum of its query heads' copies'), read ungrouped the same back
    model = qk.load(str(llama_dir(tmp_path_factory)), verbose=False)
    gen = torch.Generator().manual_seed(0)
    clean = torch.randint(1, model.cfg.d_vocab, (8, 8), generator=gen)
    corrupt = clean.clone()
    corrupt[:, 5] = torch.randint(1, model.cfg.d_vocab, (8,), generator=gen)
    task = qk.Task(clean, corrupt, clean[:, 0], clean[:, 1])
    plain = qk.edge_scores(model, task, method="eap", progress=False)
    ung = qk.edge_scores(model, task, method="eap", gqa="ungrouped", progress=False)
    assert ung.graph.ungrouped and ung.graph.n_edges > plain.graph.n_edges
    path = tmp_path / "importances.json"
    ung.to_mib(path)
    back = qk.results.EdgeScores.from_mib(path, model, gqa="ungrouped")
    assert back.graph == ung.graph and torch.equal(back.scores.nan_to_num(0.0), ung.scores.nan_to_num(0.0))
    grouped = qk.results.EdgeScores.from_mib(path, model)
    top = float(plain.scores.nan_to_num(0.0).abs().max())
    assert torch.allclose(grouped.scores.nan_to_num(0.0), plain.scores.nan_to_num(0.0), atol=1e-6 * top, rtol=0)
