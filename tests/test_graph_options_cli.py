"""``qkcircuits circuit --positions`` and ``--gqa ungrouped`` (issue 35 asks 4 and 6) end to end."""

import json

import pytest

from qkcircuits.cli import main

from _tiny import gguf_path


def test_positions_on_the_toy(tmp_path, capsys):
    out = tmp_path / "c.json"
    # exact scores: under the left rule the toy's saturated EAP-IG edges score ±1e-4 with noise signs
    assert main(["circuit", "toy-induction", "--task", "induction", "--n", "8", "--method", "exact", "--positions",
                 "--json", str(out), "--quiet", "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    d = json.loads(out.read_text())
    assert d["graph"]["positions"] == ["END", "other"] and d["graph"]["n_edges"] == 2 * 29
    assert d["curve"]["100"] == 1.0 and d["circuit"]["heads"] == ["0.0", "1.0"]
    # where the toy's heads act, by construction: the previous-token head before END, the induction head at END
    assert {"0.0@other", "1.0@END"} <= set(d["circuit"]["position_nodes"])
    edges = {tuple(e[:3]) for e in d["circuit"]["edges"]}
    assert ("1.0@END", "logits@END", "in") in edges and ("0.0@other", "1.0@other", "k") in edges
    assert "where its nodes act" in text and "1.0@END" in text
    assert d["roles"]["1.0"]["role"] == "direct-logit head"
    # no core on the position-aware graph (core_circuit refuses it): said, and the roles are the edge circuit's
    assert "core circuit: none on the position-aware graph" in text and "core" not in d and d["roles_of"] == "circuit"
    # MIB's graph has no positions: refused before anything runs, nothing written
    mib = tmp_path / "m.json"
    assert main(["circuit", "toy-induction", "--task", "induction", "--positions", "--mib", str(mib), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--mib" in err and "no position groups" in err and len(err.splitlines()) == 1 and not mib.exists()


def test_ungrouped_on_a_gqa_gguf(tmp_path_factory, tmp_path, capsys):
    out = tmp_path / "u.json"
    assert main(["circuit", str(gguf_path(tmp_path_factory)), "--task", "induction", "--n", "4", "--method", "eap",
                 "--gqa", "ungrouped", "--edges", "20", "--json", str(out), "--quiet", "--device", "cpu"]) == 0
    d = json.loads(out.read_text())
    # 2 layers x 4 query heads, 2 KV heads: k/v per query head adds 2 x 2 receivers per layer (82 -> 110 edges)
    assert d["graph"]["gqa"] == "ungrouped" and d["graph"]["n_edges"] == 110
    assert all(".kv" not in e[1] for e in d["circuit"]["edges"])


def test_ungrouped_core_and_mib_on_a_gqa_gguf(tmp_path_factory, tmp_path, capsys):
    # --force: the random model need not do the task; the core and the circuit are named anyway. The MIB file holds
    # the ungrouped graph's k/v edges one to one: the circuit's edges are exactly its in_graph edges, same scores
    out, mib = tmp_path / "u.json", tmp_path / "mib.json"
    assert main(["circuit", str(gguf_path(tmp_path_factory)), "--task", "induction", "--n", "4", "--method", "eap",
                 "--gqa", "ungrouped", "--edges", "20", "--force", "--json", str(out), "--mib", str(mib), "--quiet",
                 "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    d = json.loads(out.read_text())
    assert d["roles_of"] == "core" and d["core"]["heads"] and "core circuit:" in text
    assert text.index("core circuit:") < text.index("edge circuit:")
    m = json.loads(mib.read_text())

    def name(n):                               # the reference's node names, written here (not mib.node_name)
        if n == "emb":
            return "input"
        return f"m{n[3:]}" if n.startswith("mlp") else "a{}.h{}".format(*n.split("."))

    want = {(f"{name(s)}->{r}" if r == "logits" else f"{name(s)}->{name(r)}" if x == "in" else
             f"{name(s)}->{name(r)}<{x}>"): v for s, r, x, v in d["circuit"]["edges"]}
    got = {k: e["score"] for k, e in m["edges"].items() if e["in_graph"]}
    assert len(want) == d["circuit"]["n_edges"] > 0 and got.keys() == want.keys()
    assert all(got[k] == pytest.approx(v, rel=1e-4, abs=1e-6) for k, v in want.items())
