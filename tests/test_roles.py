"""Circuit roles (issue 17 ask 5): the rule on constructed evidence whose roles are known by construction,
each threshold tested from both sides; the model path on the toy is in tests/test_circuit_cli.py."""

from __future__ import annotations

import pytest
import torch

from qkcircuits._tasks.roles import THRESHOLDS, Roles, classify


def _ev(de, node=None, io=0.0, s=0.0, s2=None, dup=0.0, ind=0.0, prev=0.0):
    return {"direct_effect": de, "direct_share": de / 4.0, "node_effect": de if node is None else node,
            "node_share": (de if node is None else node) / 4.0, "END->IO": io, "END->S": s,
            "END->S2": s if s2 is None else s2, "S2->S1": dup, "S2->S1+1": ind, "S1+1->S1": prev,
            "END_attends_most": {"where": "END-2", "rows": 3, "of": 4, "counts": {"END-2": 3, "IO": 1}}, "attn_from_END": {}}


# largest |direct effect| 2.0 → direct cut 0.2 (0.1 × 2.0; the floor 0.01 × 4 = 0.04 is lower);
# largest |node effect| 2.0 → effect cut 0.2; largest positive edge into a name mover's q 0.5 → edge cut 0.05.
EVIDENCE = {
    "9.1": (_ev(2.0, io=0.6, s=0.1), "name mover"),
    "9.0": (_ev(0.3, io=0.4, s=0.2), "name mover"),                       # 0.15 of the largest: still large
    "9.4": (_ev(0.15, io=0.6, s=0.1), "minor"),                           # 0.075 of the largest: too small
    "9.2": (_ev(1.0, io=0.05, s=0.7), "unclassified"),                    # writes the answer, attends S
    "9.3": (_ev(1.0, io=0.02, s=0.01), "unclassified"),                   # IO > S, but attends neither name
    "10.0": (_ev(-0.8, io=0.5, s=0.2), "negative name mover"),
    "10.1": (_ev(-0.9, io=0.03, s=0.02), "unclassified"),                 # negative, attends no name
    "7.0": (_ev(0.01, node=0.6, io=0.05, s=0.6, s2=0.6), "S-inhibition head"),
    "7.1": (_ev(0.01, node=0.05, io=0.05, s=0.6, s2=0.6), "minor"),       # its q edge 0.04 < 0.05
    "7.2": (_ev(0.01, node=0.1, io=0.05, s=0.05, s2=0.05), "minor"),      # END→S2 0.05 < 0.1
    "7.3": (_ev(0.01, node=-0.6, io=0.05, s=0.5, s2=0.5), "unclassified"),  # its q edge is negative
    "7.4": (_ev(0.01, node=0.1, io=0.05, s=0.5, s2=0.5), "minor"),        # feeds 9.2's q: not a name mover
    "7.5": (_ev(0.5, io=0.05, s=0.6, s2=0.6), "unclassified"),            # S-inhibition-like, large direct effect
    "5.0": (_ev(0.0, node=0.5, ind=0.8), "induction head"),
    "5.1": (_ev(0.0, node=0.01, ind=0.8), "minor"),                       # the pattern, no effect
    "5.2": (_ev(0.5, io=0.05, s=0.6, prev=0.4), "unclassified"),          # the pattern, but writes the answer
    "3.0": (_ev(0.0, node=0.4, dup=0.7), "duplicate-token head"),
    "2.0": (_ev(0.0, node=0.3, prev=0.9), "previous-token head"),
    "2.1": (_ev(0.0, node=0.3, prev=0.29), "unclassified"),               # below the 0.3 pattern threshold
}
Q_EDGES = {("7.0", "9.1"): 0.5, ("7.1", "9.1"): 0.04, ("7.2", "9.0"): 0.3, ("7.3", "9.1"): -0.6,
           ("7.4", "9.2"): 0.5, ("7.5", "9.1"): 0.3}


def _classify(**kw):
    return classify({h: dict(e) for h, (e, _) in EVIDENCE.items()}, Q_EDGES, ioi=True, denom=4.0, **kw)


def test_ioi_roles_of_constructed_evidence():
    out = _classify()
    assert {h: r["role"] for h, r in out.items()} == {h: role for h, (_, role) in EVIDENCE.items()}
    assert out["7.0"]["evidence"]["feeds_name_movers_q"] == {"9.1": 0.5}
    assert out["5.1"]["evidence"]["patterns"] == ["induction head"]         # what a minor head looks like
    assert "no class fits" in out["9.2"]["why"] and "END→IO 0.60 > END→S 0.10" in out["9.1"]["why"]
    r = Roles(out, "ioi", {"thresholds": THRESHOLDS})
    assert list(r.by_role())[:3] == ["name mover", "negative name mover", "S-inhibition head"]
    assert r.by_role()["name mover"] == ["9.1", "9.0"]                      # largest direct effect first
    text = r.sentences()
    assert text[0].startswith("name movers 9.1, 9.0 (direct effect 0.50, 0.07 of the metric difference; END → IO "
                              "attention 0.60, 0.40")
    assert any(t.startswith("S-inhibition head 7.0") and "into name movers' q: 7.0 → 9.1 +0.500" in t for t in text)


@pytest.mark.parametrize("key,value,head,role", [
    ("direct_relative", 0.05, "9.4", "name mover"),          # 0.15 ≥ 0.05 × 2.0
    ("edge_relative", 0.05, "7.1", "S-inhibition head"),     # 0.04 ≥ 0.05 × 0.5
    ("names_attention", 0.01, "9.3", "name mover"),          # END→IO 0.02 ≥ 0.01
    ("pattern", 0.25, "2.1", "previous-token head"),
    ("effect_relative", 0.001, "5.1", "induction head"),
])
def test_each_threshold_moves_its_boundary(key, value, head, role):
    assert _classify()[head]["role"] != role
    assert _classify(thresholds={key: value})[head]["role"] == role


def test_other_tasks_direct_logit_heads_and_the_rest():
    # no detector labels: large direct effect → direct-logit head; a large node effect alone → unclassified
    out = classify({h: dict(e) for h, (e, _) in EVIDENCE.items()}, {}, ioi=False, denom=4.0)
    direct = sorted(h for h, r in out.items() if r["role"] == "direct-logit head")
    assert direct == ["10.0", "10.1", "5.2", "7.5", "9.0", "9.1", "9.2", "9.3"]
    large_node = {"7.0", "7.3", "5.0", "3.0", "2.0", "2.1"}                  # |node| ≥ 0.2 (0.1 × 2.0)
    assert {h for h, r in out.items() if r["role"] == "unclassified"} == large_node
    assert all(r["role"] == "minor" for h, r in out.items() if h not in direct and h not in large_node)


def _det(labels, ind=0.0, prev=0.0, dup=0.0):
    return {"detectors": {"induction": ind, "previous_token": prev, "duplicate_token": dup}, "labels": labels}


def test_other_tasks_use_the_detectors_labels():
    # the scan's labels name the heads that act through later heads; a head that writes the answer stays a
    # direct-logit head whatever it looks like, and a label without an effect is minor
    ev = {"5.0": {**_ev(0.0, node=0.5), **_det(["induction"], ind=0.8)},
          "2.0": {**_ev(0.0, node=0.3), **_det(["previous-token"], prev=0.9)},
          "3.0": {**_ev(0.0, node=-0.4), **_det(["duplicate-token"], dup=0.7)},
          "5.1": {**_ev(0.0, node=0.01), **_det(["induction"], ind=0.8)},
          "9.1": {**_ev(2.0), **_det(["previous-token"], prev=0.5)},
          "4.0": {**_ev(0.0, node=0.6), **_det([])}}
    out = classify(ev, {}, ioi=False, denom=4.0)
    assert {h: r["role"] for h, r in out.items()} == {
        "5.0": "induction head", "2.0": "previous-token head", "3.0": "duplicate-token head", "5.1": "minor",
        "9.1": "direct-logit head", "4.0": "unclassified"}
    assert "the scan labels it (induction 0.80)" in out["5.0"]["why"]
    text = Roles(out, "pairs", {}).sentences()
    assert any(t.startswith("induction head 5.0 (") and "scan induction 0.80" in t for t in text)
    assert text[0].startswith("direct-logit head 9.1 (") and text[-1].startswith("minor 5.1 (")   # the heads first
    # many small heads are summarised, never listed one by one
    many = {f"1.{i}": {**_ev(0.001, node=0.001), **_det([])} for i in range(40)}
    text = Roles(classify({**ev, **many}, {}, ioi=False, denom=4.0), "pairs", {}).sentences()
    assert any(t.startswith("minor ") and "(+33 more)" in t for t in text)


def test_ioi_is_one_declaration_and_a_user_declares_roles_the_same_way():
    """Issue 42 ask 3: a role is a rule over evidence declared with the task; IOI's classes are such a declaration
    (registered with ``ioi``), and a user's declaration (a stricter name mover, a role fed by it) replaces it."""
    import qkcircuits as qk
    from qkcircuits._tasks.role_rules import IOI_ROLES

    assert qk.tasks.task_spec("ioi").roles == IOI_ROLES == qk.tasks.IOI_ROLES
    explicit = classify({h: dict(e) for h, (e, _) in EVIDENCE.items()}, Q_EDGES, roles=IOI_ROLES, denom=4.0)
    assert {h: r["role"] for h, r in explicit.items()} == {h: r["role"] for h, r in _classify().items()}
    strict = qk.tasks.Role("name mover", lambda v: v["large_direct"] and v["direct_effect"] > 0 and v["END->IO"] >= 0.5,
                           why=lambda v: f"END→IO {v['END->IO']:.2f} ≥ 0.5")
    feeder = qk.tasks.Role("feeder", lambda v: bool(v["feeds"]), why="writes into a name mover's q", feeds="name mover")
    out = classify({h: dict(e) for h, (e, _) in EVIDENCE.items()}, Q_EDGES, roles=[strict, feeder], denom=4.0)
    roles = {h: r["role"] for h, r in out.items()}
    # 9.1 (END→IO 0.60) is a name mover, 9.0 (0.40) no longer: the built-in class of a large direct effect
    assert roles["9.1"] == "name mover" and out["9.1"]["why"] == "END→IO 0.60 ≥ 0.5"
    assert roles["9.0"] == "direct-logit head"
    # the feeders read the first role's heads: 7.0 and 7.5 write into 9.1's q; 7.2 fed 9.0, which is no mover now;
    # 7.1's edge (0.04) is below 0.1 × the largest (0.5)
    assert {h for h, r in roles.items() if r == "feeder"} == {"7.0", "7.5"}
    assert out["7.2"]["evidence"]["feeds_name_movers_q"] == {} and out["7.0"]["evidence"]["feeds_name_movers_q"] == {"9.1": 0.5}
    # no IOI pattern class was declared: a pattern head with a large node effect falls to the built-in classes
    assert roles["5.0"] == "unclassified" and out["5.0"]["evidence"]["patterns"] == ["induction head"]


def test_a_role_is_checked_when_declared():
    import qkcircuits as qk

    for kwargs, message in ((dict(name="", rule=lambda v: True), "non-empty string"),
                            (dict(name="r", rule=3), "rule must be callable"),
                            (dict(name="r", rule=lambda v: True, why=3), "why must be a sentence"),
                            (dict(name="r", rule=lambda v: True, feeds=""), "feeds must name a role")):
        with pytest.raises(qk.QKCircuitsError, match=message):
            qk.tasks.Role(**kwargs)


# ---------------------------------------------------------------- where END attends most, named by the task (issue 45)
def test_attends_most_names_each_prompt_by_its_own_positions():
    from qkcircuits._tasks.roles import attends_most, most_text

    # four prompts of different layouts: the IO token sits at 1, 2, 1, 3; END at 4, 5, 4, 5
    pos = {"END": torch.tensor([4, 5, 4, 5]), "IO": torch.tensor([1, 2, 1, 3]), "S": torch.tensor([2, 1, 3, 2])}
    row = torch.zeros(4, 6)
    row[0, 1] = row[1, 2] = row[3, 3] = 1.0          # IO in prompts 0, 1, 3 (three different absolute positions)
    row[2, 0] = 1.0                                  # prompt 2: the first token, named by no position
    got = attends_most(row, pos)
    assert got == {"where": "IO", "rows": 3, "of": 4, "counts": {"IO": 3, "position 0": 1}}
    assert most_text(got) == "IO in 3 of 4 prompts"
    row = torch.zeros(2, 6)
    row[0, 1] = row[1, 2] = 1.0                      # three before END in both, whatever the absolute position
    assert attends_most(row, {"END": torch.tensor([4, 5])})["where"] == "END-3"


def test_roles_name_where_a_head_attends_by_the_users_positions():
    """The toy's induction head 1.0 attends from END to the token after END's earlier copy (END - (seg_len - 1)),
    its previous-token head 0.0 to END - 1, by construction; a user task naming that key gets its name back."""
    import qkcircuits as qk

    model = qk.load("toy-induction", verbose=False)
    seg = 6
    task = qk.tasks.induction(model, n=8, seg_len=seg)
    r = qk.roles(model, task, qk.edge_scores(model, task, method="exact", progress=False).circuit(edges=4))
    assert r.roles["1.0"]["evidence"]["END_attends_most"] == {"where": f"END-{seg - 1}", "rows": 8, "of": 8,
                                                  "counts": {f"END-{seg - 1}": 8}}
    assert r.roles["0.0"]["evidence"]["END_attends_most"]["where"] == "END-1"
    named = qk.Task(task.clean, task.corrupt, task.answer, task.wrong, metric=task.metric,
                    positions={"NEXT": task.positions["END"] - (seg - 1)})
    r = qk.roles(model, named, qk.edge_scores(model, named, method="exact", progress=False).circuit(edges=4))
    assert r.roles["1.0"]["evidence"]["END_attends_most"]["where"] == "NEXT"
    assert r.roles["1.0"]["evidence"]["attn_from_END"]["NEXT"] > 0.9


def test_roles_is_a_function_of_the_model_and_its_inputs():
    """qk.roles takes the circuit (no result computes: TaskCircuit and CoreCircuit have no roles method); a core's
    roles are its circuit's plus the heads outside it with >= 5 % of the effect, and need its scores."""
    import qkcircuits as qk
    from qkcircuits import QKCircuitsError

    model = qk.load("toy-induction", verbose=False)
    task = qk.tasks.induction(model, n=8, seg_len=6)
    scores = qk.edge_scores(model, task, method="exact", progress=False)
    core = qk.core_circuit(model, task, scores, progress=False)
    assert not hasattr(scores.circuit(edges=4), "roles") and not hasattr(core, "roles")
    via_core = qk.roles(model, task, core, scores=scores, qk=False)
    by_hand = qk.roles(model, task, core.circuit(scores), scores.clean, scores.corrupt, also=core.outside(scores),
                       qk=False)
    assert via_core.roles == by_hand.roles and set(via_core.roles) >= set(core.heads)
    with pytest.raises(QKCircuitsError, match=r"need its edge scores: qk.roles\(model, task, core, scores=scores\)"):
        qk.roles(model, task, core)
    with pytest.raises(QKCircuitsError, match="share= goes with a core circuit"):
        qk.roles(model, task, scores.circuit(edges=4), share=0.1)
