"""What the attend texts and figures say (issue 45): every list of sources states its coverage, a head that does not
attend its key gets no "why it attends" (and no percentages of a negative total), expansions only above noise with
shares above 100 % explained once, and the figure draws the top pair the text names.

Ground truth: constructed Attributions whose numbers are chosen here (coverage, the top pair outside the top
marginals, noise), and the hand-built model, whose induction head 1.0 attends the token after the earlier copy
(attention > 0.999) and not the copy itself.
"""

from __future__ import annotations

import pytest
import torch

import qkcircuits as qk
from qkcircuits._explain import words
from qkcircuits._explain.attribution import Attribution
from qkcircuits._explain.evidence import evidence_sentence


def _made(P, q_names, k_names, attention=0.5, expanded=(), reading="contrast"):
    """An Attribution of one row whose full pair table is ``P`` (query sources x key sources; no "other" kept)."""
    P = torch.tensor(P, dtype=torch.float64)
    Pk = torch.zeros(P.shape[0] + 1, P.shape[1] + 1, dtype=torch.float64)
    Pk[:-1, :-1] = P
    rows = [{"prompt": 0, "query": 5, "key": 2, "attention": attention, "value": float(P.sum())}]
    return Attribution("m", "3.1", reading, rows, list(q_names), list(k_names), P.sum(1)[None], P.sum(0)[None],
                       list(q_names) + ["other"], list(k_names) + ["other"], Pk, 0.0, {"rows": "from 5 to 2"},
                       list(expanded))


def test_every_side_says_its_coverage():
    # key sources 4, 3, 2, 1 (total 10): the top 2 cover 70 %, the other 2 hold 30 %, the largest of them 20 %
    r = _made([[4.0, 3.0, 2.0, 1.0]], ["q"], ["a", "b", "c", "d"])
    key = next(s for s in r.sentences(k=2) if s.startswith("Key side"))
    assert key == "Key side: a 40 %, b 30 % (these 2 sources: 70 % of the total; 30 % spread over 2 others, none " \
                  "above 20 %).", key
    query = next(s for s in r.sentences(k=2) if s.startswith("Query side"))
    assert "all 1 source: 100 % of the total" in query
    assert "these 3 sources: 90 % of the total; 10 % spread over 1 other" in repr(r)     # the notebook repr, k=3
    assert "30 % spread over 2 others" in r._repr_html_() or "10 % spread" in r._repr_html_()


def test_no_why_for_a_head_that_does_not_attend_or_a_negative_total():
    neg = _made([[-3.0, 1.0], [0.5, 0.0]], ["q1", "q2"], ["a", "b"], attention=0.5)     # total -1.5
    text = neg.sentences()
    assert not neg.attends() and "does not prefer this key" in text[0] and "negative (-1.5" in text[0]
    assert " attends " not in text[0] and not any("%" in s for s in text if s.startswith(("Key", "Query", "Top"))), text
    assert "a -2.5, b +1" in text[1] and "of the total -1.5" in text[1], text[1]
    low = _made([[2.0]], ["q"], ["a"], attention=0.02)                                  # positive, but attention 0.02
    assert not low.attends() and "attention 0.02 (below 0.10)" in low.sentences()[0]
    assert _made([[2.0]], ["q"], ["a"], attention=0.5).attends()
    # the same rule in the roles' evidence: values, not shares, and no "why"
    ev = {"from": "END", "to": "IO", "attention": 0.01, "total": -0.5, "reading": "contrast",
          "query": [["mlp0", 1.23], ["emb", -0.84]], "key": [["0.0", 1.0]],
          "query_values": [["mlp0", -0.615], ["emb", 0.42]], "key_values": [["0.0", -0.5]],
          "query_rest": {"n": 2, "value": -0.305, "largest": 0.2}, "key_rest": {"n": 0, "value": 0.0, "largest": 0.0}}
    line = evidence_sentence("17.4", ev)
    assert not line.startswith("why") and "does not prefer this key" in line and "123 %" not in line, line
    assert "mlp0 -0.615" in line and "spread over 2 others, none above 0.2 in size" in line, line
    good = dict(ev, attention=0.6, total=2.0, query=[["mlp0", 0.6]], query_values=[["mlp0", 1.2]],
                query_rest={"n": 3, "value": 0.8, "largest": 0.5})
    assert evidence_sentence("17.4", good).startswith("why 17.4 attends from END to IO (attention 0.60)")
    assert "these 1 source: 60 % of the total; 40 % spread over 3 others, none above 25 %" in evidence_sentence(
        "17.4", good)


def test_the_hand_built_induction_head_does_not_prefer_the_copy_itself(hand_built):
    t = qk.repeated_tokens(hand_built, n_seqs=2, seg_len=6, seed=0)
    target = qk.attend(hand_built, "1.0", t, key="induction")
    assert target.attends() and target.sentences()[0].startswith("1.0 attends")
    copy = qk.attend(hand_built, "1.0", t, key="duplicate")      # the earlier copy: the head looks one further on
    assert copy.attention < words.MIN_ATTENTION and not copy.attends()
    assert "does not prefer this key" in copy.sentences()[0] and "why" not in copy._html().split("</b>")[0].lower()


def test_expansions_only_above_noise_with_over_100_explained_once():
    exp = [{"source": "0.0", "side": "key", "value": 12.7, "share": 1.27, "whole": 10.0, "offset": 1,
            "example": "supervisor", "example_token": "isor"},
           {"source": "0.1", "side": "key", "value": 0.2, "share": 2.78, "whole": 0.072, "offset": 0,   # noise
            "example": "x"},
           {"source": "0.2", "side": "key", "value": 0.3, "share": 0.03, "whole": 10.0, "offset": 2}]   # part: noise
    r = _made([[10.0, 10.0]], ["q"], ["0.0", "0.2"], expanded=exp)          # total 20: noise below 2.0
    text = r.sentences()
    came = [s for s in text if "came from" in s]
    assert len(came) == 1 and "position j-1, 1 before the key (127 % of its 10" in came[0], came
    assert "e.g. 'supervisor'" in came[0]
    r.expanded[0].update(example=None)
    assert "e.g. token 'isor', no whole word there" in " ".join(r.sentences())
    assert sum("count against" in s for s in text) == 1


def test_the_figure_draws_the_top_pair_and_labels_the_rest():
    from qkcircuits.viz._attend_view import attend_figure

    # query marginals a 6, b 5, c 0 (c's pairs cancel: +9 and -9): with k=1 only a is a top query source, but the
    # largest |pair| is c's (9), which the sentences name, so the figure must draw c too
    P = [[6.0, 0.0, 0.0], [0.0, 5.0, 0.0], [9.0, -9.0, 0.0]]
    r = _made(P, ["a", "b", "c"], ["x", "y", "z"])
    a, b, v, _ = r.pairs(1)[0]
    assert a == "c" and abs(v) == 9.0
    fig = attend_figure(r, k=1)
    heat = fig["data"][0]
    assert a in heat["y"] and b in heat["x"], (heat["y"], heat["x"])
    M = torch.tensor(heat["z"])
    assert float(M.sum()) == pytest.approx(r.total)                          # the cells still add up
    assert "Top pair: query c x key x (" in " ".join(r.sentences())
    labels = [t for ax in fig["layout"].values() if isinstance(ax, dict) for t in ax.get("ticktext", []) or []]
    assert "rest: 1 other, 45 %" in labels and "rest: 2 others, -36 %" in labels, labels   # b 5 of 11; y + z -4


def test_a_typo_in_head_or_position_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    # issue 45 ask 8: the shape comes from the metadata (a config.json here; the GGUF header below), the positions
    # from the task's names: the load is never reached (it would raise)
    import json as _json

    from qkcircuits._foundation import model as model_module
    from qkcircuits._foundation.shape import gguf_shape
    from _cli import errors, run

    def no_load(*a, **kw):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(model_module, "load", no_load)
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(_json.dumps({"num_hidden_layers": 30, "num_attention_heads": 9}))
    code, _, err = run(["attend", str(folder), "--head", "18.60"], capsys)
    assert code == 2 and errors(err) == ["error: --head '18.60': head 18.60 is out of range: the model has layers "
                                         "0-29 and heads 0-8 per layer"], err
    code, _, err = run(["attend", str(folder), "--head", "18.6", "--task", "ioi", "--to", "IOO"], capsys)
    assert code == 2 and errors(err) == ["error: --to 'IOO' is not a position of task 'ioi'; it has IO, S1, S1+1, S2, END"]
    task = tmp_path / "t.jsonl"
    task.write_text(_json.dumps({"clean": "a", "corrupt": "b", "answer": "c", "wrong": "d",
                                 "positions": {"X": " a"}}) + "\n")
    code, _, err = run(["attend", str(folder), "--head", "1.0", "--task", str(task), "--to", "Y"], capsys)
    assert code == 2 and "--to 'Y' is not a position of task 't.jsonl'; it has X, END" in err
    code, _, err = run(["ablate", str(folder), "--heads", "3.1,31.0"], capsys)
    assert code == 2 and errors(err)[0].startswith("error: --heads '3.1,31.0': head 31.0 is out of range"), err


def test_the_gguf_header_gives_the_shape(tmp_path_factory):
    from _tiny import gguf_path

    from qkcircuits._foundation.shape import gguf_shape, read_shape

    path = gguf_path(tmp_path_factory)
    model = qk.load(str(path), verbose=False)
    assert gguf_shape(path) == read_shape(str(path)) == (int(model.cfg.n_layers), int(model.cfg.n_heads))


def test_the_report_follows_the_circuit_and_says_its_prompts(hand_built):
    # issue 45 ask 5: with a circuit, the "why" sections are its role heads first (in role order), then the scan's
    # top heads not already explained; every section says its prompts (task, n, seed) and rows
    from qkcircuits.viz._circuit_data import load_circuit
    from qkcircuits.viz._report import attend_results

    task = qk.tasks.induction(hand_built, n=4, seg_len=6)
    c = qk.edge_scores(hand_built, task, method="eap", progress=False).circuit(percent=20).to_dict()
    d = {"model": c["model"], "circuit": c, "task": "induction", "n_prompts": 4,     # as `qkcircuits circuit --json`
         "roles": {"0.0": {"role": "previous-token head", "evidence": {}},
                   "1.0": {"role": "induction head", "evidence": {}}}}
    view = load_circuit(d)
    scores = qk.scan(hand_built, scores="induction,previous_token", progress=False)
    got = attend_results(hand_built, scores, None, view)
    assert [r.head for r in got[:2]] == ["1.0", "0.0"], [getattr(r, "head", r) for r in got]
    assert got[0].settings["explains_role"] == "induction head" and len(got) == 2     # the scan's heads: the same
    first = got[0].sentences()[0]
    assert first.startswith("1.0 attends from each repeated token to the token after its earlier copy on induction "
                            "(n 4, seed 0) (attention 1.00"), first
    from qkcircuits.viz._attend_view import attend_sections

    titles = [s["title"] for s in attend_sections(got)]
    assert titles[0] == "Why 1.0 attends (induction head in the circuit)", titles
    # a circuit whose prompts the report cannot rebuild (IOI on a model without a tokenizer): a note, not a failure
    from qkcircuits.viz._report import circuit_attend

    d_ioi = dict(d, task="ioi", roles={"1.0": {"role": "name mover", "evidence": {}}})
    note = circuit_attend(hand_built, load_circuit(d_ioi))
    assert len(note) == 1 and note[0][:2] == ("1.0", "name mover") and "could not rebuild" in note[0][2]
    # the scan's own explanation says its prompts too
    top = attend_results(hand_built, scores, None)
    assert all("on [BOS] + R + R (repeated random tokens) (n 4, seed 1)" in r.sentences()[0] for r in top)


def test_the_attend_page_is_styled_and_its_axes_read_plainly(tmp_path):
    # issue 45 ask 6: the standalone page carries the report's CSS and names its prompts; the key marginal shows its
    # own tick values; the query bars point right for positive values; core counts print as integers
    from qkcircuits.viz._attend_view import attend_figure, attend_page
    from qkcircuits.viz._circuit_view import core_rows
    from qkcircuits.viz._page import CSS

    r = _made([[4.0, 3.0], [1.0, 2.0]], ["q1", "q2"], ["a", "b"])
    r.settings["prompts"] = {"task": "ioi", "n": 8, "seed": 0}
    page = attend_page(r)
    assert CSS.strip()[:40] in page and "on ioi (n 8, seed 0)" in page and "<h1>" in page
    lay = attend_figure(r)["layout"]
    key_bar = next(ax for name, ax in lay.items() if name.startswith("yaxis") and isinstance(ax, dict)
                   and (ax.get("title") or {}).get("text") == "key side")
    assert key_bar.get("showticklabels") is True
    query_bar = next(ax for name, ax in lay.items() if name.startswith("xaxis") and isinstance(ax, dict)
                     and "query side" in ((ax.get("title") or {}).get("text") or ""))
    assert query_bar.get("autorange") != "reversed"

    from qkcircuits.viz._circuit_data import load_circuit

    view = load_circuit({"circuit": {"edges": []}, "core": {"heads": ["1.0"], "mlps": [], "curve": {"12": 0.81,
                                                                                                   "3": 0.5}}})
    assert sorted(row[0] for row in core_rows(view)) == ["12", "3"]


def test_no_trace_edge_runs_through_another_node():
    # issue 45 ask 6: 16.0, 17.3 and 18.6 sit on one line at (head, layer); the edge 16.0 -> 18.6 must not pass
    # through 17.3 (it read as a chain). Geometry of the figure's own data (the browser draws these points).
    from qkcircuits.viz._figures import NEAR, _distance, circuit_graph

    nodes = [{"head": h, "layer": int(h.split(".")[0]), "index": int(h.split(".")[1]), "label": ""}
             for h in ("16.0", "17.3", "18.6")]
    edges = [{"src": (16, 0), "dst": (18, 6), "input": "k", "effect": 0.8},
             {"src": (17, 3), "dst": (18, 6), "input": "k", "effect": 0.3},
             {"src": (16, 0), "dst": (17, 3), "input": "q", "effect": 0.2}]
    fig = circuit_graph(nodes, edges, 30, 9, "t")
    lines = [t for t in fig["data"] if t.get("mode") == "lines"]
    assert len(lines) == 3
    pts = {(n["index"], n["layer"]) for n in nodes}
    for t in lines:
        segs = list(zip(zip(t["x"], t["y"]), zip(t["x"][1:], t["y"][1:])))
        ends = {(t["x"][0], t["y"][0]), (t["x"][-1], t["y"][-1])}
        assert ends <= pts
        for p in pts - ends:
            assert min(_distance(p, u, v) for u, v in segs) >= NEAR, (t["meta"], p)
    straight = [t for t in lines if len(t["x"]) == 2]
    assert len(straight) == 2                               # only the edge with a node in the way is bent
