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


def test_ungrouped_on_a_gqa_gguf(tmp_path_factory, tmp_path, capsys):
    out = tmp_path / "u.json"
    assert main(["circuit", str(gguf_path(tmp_path_factory)), "--task", "induction", "--n", "4", "--method", "eap",
                 "--gqa", "ungrouped", "--edges", "20", "--json", str(out), "--quiet", "--device", "cpu"]) == 0
    d = json.loads(out.read_text())
    # 2 layers x 4 query heads, 2 KV heads: k/v per query head adds 2 x 2 receivers per layer (82 -> 110 edges)
    assert d["graph"]["gqa"] == "ungrouped" and d["graph"]["n_edges"] == 110
    assert all(".kv" not in e[1] for e in d["circuit"]["edges"])


@pytest.mark.parametrize("argv", [["--positions"], ["--gqa", "ungrouped"]])
def test_graph_options_are_refused_on_ray_in_one_line(argv, capsys):
    assert main(["circuit", "toy-induction", "--task", "induction", "--ray", "local:1", *argv, "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "run in this process only" in err and len(err.splitlines()) == 1
