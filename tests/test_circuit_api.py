"""Issue 35 ask 6's rough edges: ``qk.evaluate`` (f of any edge or node set), no function changes the scores it
is given, percents truncated as MIB does, the KL metric, the warnings (no grid size reaches f >= 0.8, a method
that disagrees in sign with EAP-IG), roles not named for a model that does not do the task (``force``), and
``--threads`` on every command. Ground truth: the hand-built toy, whose induction circuit is known."""

import copy
import json
import warnings

import pytest
import torch
import torch.nn.functional as F

import qkcircuits as qk
from qkcircuits._tasks.caveats import sign_disagreement
from qkcircuits._tasks.selection import edges_for_percent
from qkcircuits._tasks.task import with_reference
from qkcircuits.cli import build_parser, main

KNOWN = [("emb", "0.0", "v"), ("0.0", "1.0", "k"), ("emb", "1.0", "v"), ("1.0", "logits", "in")]


@pytest.fixture(scope="module")
def toy_task(hand_built):
    return qk.tasks.induction(hand_built, n=8, seg_len=6)


@pytest.fixture(scope="module")
def exact(hand_built, toy_task):
    return qk.edge_scores(hand_built, toy_task, method="exact", progress=False)


def test_evaluate_any_edge_or_node_set(hand_built, toy_task, exact):
    g = exact.graph
    # the known circuit carries the whole behaviour; without the previous-token → key edge, nothing
    assert qk.evaluate(hand_built, toy_task, KNOWN).f == pytest.approx(1.0, abs=1e-4)
    assert qk.evaluate(hand_built, toy_task, [e for e in KNOWN if e[1:] != ("1.0", "k")]).f == pytest.approx(0, abs=1e-4)
    # every edge = the clean run, no edge = the corrupt run, exactly; m is the metric itself
    full = qk.evaluate(hand_built, toy_task, g.valid.clone())
    assert full.f == 1.0 and full.m == full.clean and full.kind == "edges" and full.n == g.n_edges
    assert qk.evaluate(hand_built, toy_task, []).f == 0.0
    # a circuit result, and a node set: the two heads carry it, one of them alone does not
    assert qk.evaluate(hand_built, toy_task, exact.circuit(edges=4)).f == pytest.approx(1.0, abs=1e-4)
    both, one = qk.evaluate(hand_built, toy_task, ["0.0", "1.0"]), qk.evaluate(hand_built, toy_task, ["1.0"])
    assert both.f == pytest.approx(1.0, abs=1e-4) and one.f == pytest.approx(0.0, abs=1e-4)
    assert (both.kind, both.n) == ("nodes", 2) and set(both.to_dict()) == {"f", "m", "clean", "corrupt", "kind", "n"}
    with pytest.raises(qk.QKCircuitsError, match="edge 1.0 -> 0.0 q is not an edge"):
        qk.evaluate(hand_built, toy_task, [("1.0", "0.0", "q")])
    with pytest.raises(qk.QKCircuitsError, match="node\\(s\\) '7.7' are not nodes"):
        qk.evaluate(hand_built, toy_task, ["7.7"])


def test_evaluate_equals_the_curve_and_the_node_view(tmp_path_factory):
    # on a model with MLPs and GQA: evaluate(circuit) is the curve's point, evaluate(heads + every MLP) the node view
    from _tiny import llama_dir
    from test_ig_rules import contrast_task

    model = qk.load(str(llama_dir(tmp_path_factory)), verbose=False)
    task = contrast_task(model, n=6)
    scores = qk.edge_scores(model, task, method="eap", progress=False)
    faith = qk.faithfulness(model, task, scores, sizes=(10, 30, 100), progress=False)
    c = scores.circuit(percent=30)
    assert qk.evaluate(model, task, c).f == pytest.approx(faith.curve[30.0], abs=1e-5)
    mlps = [n for n in scores.graph.senders if n.startswith("mlp")]
    heads = faith.circuit.heads
    assert qk.evaluate(model, task, heads + mlps).f == pytest.approx(faith.node_faithfulness, abs=1e-5)
    # a node set that leaves an MLP out corrupts it too (the edge-level patched run of that node mask)
    from qkcircuits._tasks.faithfulness import circuit_metric, ratio
    g = scores.graph
    mask = g.valid.clone()
    for n in g.senders:
        if n != "emb" and n not in heads + mlps[:1]:
            mask[g.senders.index(n)] = False
    (m,), clean, corrupt = circuit_metric(model, task, [mask], task.n)
    assert qk.evaluate(model, task, heads + mlps[:1]).f == pytest.approx(ratio(m, clean, corrupt), abs=1e-6)


def test_no_function_changes_the_scores_it_is_given(hand_built, toy_task, exact):
    before = copy.deepcopy(exact.to_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = qk.faithfulness(hand_built, toy_task, exact, sizes=(10, 50, 100), progress=False)
        b = qk.faithfulness(hand_built, toy_task, exact, sizes=(20, 100), by="abs", progress=False)
        qk.evaluate(hand_built, toy_task, exact.circuit(edges=4))
        qk.roles(hand_built, toy_task, exact.circuit(edges=4))
    assert exact.to_dict() == before and "chosen_percent" not in exact.settings
    assert a.chosen_percent == 50.0 and b.chosen_percent == 20.0
    # which call ran last decides nothing: a circuit needs its size
    with pytest.raises(qk.QKCircuitsError, match="give edges=N or percent=P"):
        exact.circuit()


def test_percent_is_truncated_as_mib_does(exact):
    assert edges_for_percent(70651, 0.1) == 70 and edges_for_percent(70651, 0.2) == 141     # round() gave 71, 141
    assert edges_for_percent(29, 10) == 2 and edges_for_percent(29, 100 * 4 / 29) == 4
    assert edges_for_percent(29, 1) == 0 and edges_for_percent(29, 100) == 29
    assert exact.circuit(percent=10).requested == 2                  # 2.9 edges: 2, not 3
    empty = exact.circuit(percent=1)                                 # 0.29 edges: none
    assert empty.requested == 0 and empty.n_edges == 0


def test_kl_metric(hand_built, toy_task):
    task = qk.tasks.induction(hand_built, n=8, seg_len=6, metric="kl")
    assert not task.higher_is_better
    with pytest.raises(qk.QKCircuitsError, match="metric 'kl' needs the clean run's next-token distribution"):
        task.row_values(torch.zeros(8, task.clean.shape[1], hand_built.cfg.d_vocab))
    ready = with_reference(hand_built, task)
    with torch.no_grad():
        clean = hand_built(task.clean)[torch.arange(8), task.positions["END"]]
        corrupt = hand_built(task.corrupt)
    ref = F.log_softmax(clean.double(), -1)
    # KL(p_clean || p) computed here from the raw logits: 0 on the clean run, positive on the corrupt one
    want = (ref.exp() * (ref - F.log_softmax(corrupt[torch.arange(8), task.positions["END"]].double(), -1))).sum(-1)
    assert torch.allclose(ready.row_values(corrupt).double(), want, atol=1e-4) and float(want.min()) > 1
    # the identities hold under KL: f(100 %) = 1, f(0 %) = 0; the known circuit carries it (exact, signed: −score)
    scores = qk.edge_scores(hand_built, task, method="exact", progress=False)
    assert abs(scores.clean) < 1e-4 and scores.corrupt > 1
    assert {e[:3] for e in scores.circuit(edges=4).edges()} == set(KNOWN)
    assert all(v < 0 for *_, v in scores.circuit(edges=4).edges())
    f = qk.faithfulness(hand_built, task, scores, sizes=(0, 100 * 4 / 29, 100), progress=False)
    assert f.curve[0.0] == 0.0 and f.curve[100.0] == 1.0 and f.curve[100 * 4 / 29] == pytest.approx(1, abs=1e-4)
    # EAP's one point is the clean run, where KL and its gradient are 0: every EAP score is 0 (the reason the
    # EAP-IG authors integrate); EAP-IG's left rule starts at the corrupt end and sees the edges
    assert float(qk.edge_scores(hand_built, task, method="eap", progress=False).scores.nan_to_num(0).abs().max()) < 1e-6
    ig = qk.edge_scores(hand_built, task, method="eap-ig", progress=False)
    assert float(ig.scores.nan_to_num(0).abs().max()) > 1


def test_warnings_and_roles_need_a_model_that_does_the_task(hand_built, toy_task, exact):
    # swapped answers: the model does not do this task; the warning names the causes to check and roles are not
    # named unless forced
    swapped = qk.Task(toy_task.clean, toy_task.corrupt, toy_task.wrong, toy_task.answer, bos=True)
    with pytest.warns(UserWarning, match=r"does not do task 'custom'.*Likely causes to check: the rows start with a "
                                         r"BOS.*the answer tokens \(row 0: answer id \d+, wrong id \d+.*the metric's "
                                         r"direction"):
        s = qk.edge_scores(hand_built, swapped, method="exact", progress=False)
    c = s.circuit(edges=4, by="abs")
    r = qk.roles(hand_built, swapped, c)
    assert r.roles == {} and r.not_named.startswith("the model does not do task")
    assert r.sentences()[0].startswith("no roles named: the model does not do task")
    assert qk.roles(hand_built, swapped, c, force=True).roles
    # no grid size below 100 % reaches 0.8: a warning that says so (the signed ranking of the swapped task)
    with pytest.warns(UserWarning, match=r"no grid size below 100% reaches f >= 0.8"):
        f = qk.faithfulness(hand_built, toy_task, exact, sizes=(1, 5, 100), progress=False)
    assert not f.reached and f.chosen_percent == 100.0


def test_sign_disagreement_counts_opposite_signs_among_the_top_edges():
    valid = torch.ones(2, 3, dtype=torch.bool)
    a = torch.tensor([[4.0, -3.0, 2.0], [1.0, 0.5, 0.0]])
    b = torch.tensor([[-1.0, -2.0, 0.0], [-5.0, 0.5, 9.0]])
    got = sign_disagreement(a, b, valid, top=4)          # top 4 of a by |score|: 4, -3, 2, 1 → flips at 4 and 1
    assert got["fraction"] == 0.5 and got["top"] == 4
    assert [(s, r) for s, r, *_ in got["worst"]] == [(1, 0), (0, 0)]      # largest |reference| first
    assert sign_disagreement(a, a, valid)["fraction"] == 0.0


def test_cli_sign_check_warns(monkeypatch, tmp_path, capsys):
    # EAP against EAP-IG on the toy: they differ in sign on the two saturated-softmax edges (2 of its 29 edges);
    # with the limit at 0 that is a warning, first in the summary and in the JSON
    from qkcircuits._tasks import caveats

    monkeypatch.setattr(caveats, "SIGN_LIMIT", 0.0)
    out = tmp_path / "c.json"
    assert main(["circuit", "toy-induction", "--task", "induction", "--n", "8", "--method", "eap", "--by", "abs",
                 "--json", str(out), "--quiet"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("warning: the edge scores disagree in sign with EAP-IG on 7% of the top 29 edges")
    d = json.loads(out.read_text())
    assert d["sign_check"]["fraction"] == pytest.approx(2 / 29, abs=1e-6) and d["warnings"][0] in text
    assert {w[0] for w in d["sign_check"]["worst"]} == {"emb -> 0.0 v", "0.0 -> 1.0 k"}


def test_threads_on_every_command(monkeypatch, capsys):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, p in sub.choices.items():
        has = any(a.dest == "threads" for a in p._actions)
        assert has == (name != "cache"), name
        if has:
            assert "default: what torch chooses" in p.format_help().replace("\n", " ").replace("  ", " "), name
    # the command runs with N threads; the caller's count is back afterwards
    from qkcircuits.cli import scan_command as scan

    seen = []
    monkeypatch.setattr(scan, "run", lambda args: seen.append(torch.get_num_threads()) or 0)
    before = torch.get_num_threads()
    want = 1 if before != 1 else 2
    assert main(["scan", "toy-induction", "--threads", str(want)]) == 0
    assert seen == [want] and torch.get_num_threads() == before
