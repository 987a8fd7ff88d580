"""``qk.evaluate`` on the ungrouped and position-aware graphs (issue 35: ``evaluate`` from asks 1/2/6 meets the
graph options of asks 4/6), against ground truth:

- the toy whose heads are known by construction: the previous-token head 0.0 matters at the ``other`` positions
  only, the induction head 1.0 at END only, so keeping exactly those (node names or the four position edges)
  gives f = 1 and keeping either at the wrong group gives f = 0;
- a node kept at EVERY group (named once per group) is the node kept (named without a group), and nothing kept
  at any group is nothing kept, on GPT-2 with MLPs (the position-aware mask path against the plain one);
- a circuit of position-aware or ungrouped scores is evaluated on its own graph: the toy's four edges with their
  k/v reads moved to END give f = 0 while their plain view (the edges at every group) gives 1; a circuit's f is
  the faithfulness curve's at its size (GPT-2 positions; Llama-GQA ungrouped);
- one-line errors: a group the task does not name, a circuit whose groups the task does not name.
"""

import json
import warnings

import pytest
import torch

import qkcircuits as qk
from qkcircuits._tasks.positions import OTHER

from _tiny import gpt2_dir, llama_dir


def named_task(model, n=4, p=9, seed=0):
    """Minimal pairs on random tokens (position p-3 resampled in the corrupt rows), named positions X (the
    resampled token) and END."""
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(1, model.cfg.d_vocab, (n, p), generator=g)
    corrupt = clean.clone()
    corrupt[:, p - 3] = torch.randint(1, model.cfg.d_vocab, (n,), generator=g)
    answer = torch.randint(1, model.cfg.d_vocab, (n,), generator=g)
    return qk.Task(clean, corrupt, answer, (answer + 7) % model.cfg.d_vocab, positions={"X": torch.full((n,), p - 3)})


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    return qk.load(str(gpt2_dir(tmp_path_factory)), verbose=False)


def test_the_toys_heads_at_the_groups_where_they_act(hand_built):
    task = qk.tasks.induction(hand_built, n=8, seg_len=6)
    f = {tuple(keep): qk.evaluate(hand_built, task, keep).f for keep in
         (["0.0@other", "1.0@END"], ["0.0@END", "1.0@END"], ["0.0@other", "1.0@other"], ["0.0", "1.0@END"])}
    assert f[("0.0@other", "1.0@END")] == pytest.approx(1.0, abs=1e-6)
    assert f[("0.0", "1.0@END")] == pytest.approx(1.0, abs=1e-6)
    assert f[("0.0@END", "1.0@END")] == pytest.approx(0.0, abs=1e-6)
    assert f[("0.0@other", "1.0@other")] == pytest.approx(0.0, abs=1e-6)
    ev = qk.evaluate(hand_built, task, ["0.0@other", "1.0@END"])
    assert (ev.kind, ev.n) == ("nodes", 2)
    # the four edges the toy is built on, each at the positions where it is read
    four = [("emb@other", "0.0@other", "v"), ("0.0@other", "1.0@other", "k"), ("emb@other", "1.0@other", "v"),
            ("1.0@END", "logits@END", "in")]
    assert qk.evaluate(hand_built, task, four).f == pytest.approx(1.0, abs=1e-6)
    assert qk.evaluate(hand_built, task, four[:1] + four[2:]).f == pytest.approx(0.0, abs=1e-6)
    # a position-aware circuit is evaluated at its groups, not as its plain view (its edges at every group): the
    # four edges with every k/v read moved to END carry nothing (1.0's keys at the earlier positions stay corrupt)
    c = qk.edge_scores(hand_built, task, method="exact", positions=True, progress=False).circuit(edges=4, by="abs")
    assert {e[:3] for e in c.edges()} == set(four) and qk.evaluate(hand_built, task, c).f == pytest.approx(1.0, abs=1e-6)
    d = c.to_dict()
    d["edges"] = [[s.replace("@other", "@END"), r.replace("@other", "@END"), x, v] for s, r, x, v in d["edges"]]
    moved = qk.results.TaskCircuit.from_json(json.dumps(d))
    assert moved.position_mask[0].sum() == 4 and torch.equal(moved.mask, c.mask)
    assert qk.evaluate(hand_built, task, moved).f == pytest.approx(0.0, abs=1e-6)
    assert qk.evaluate(hand_built, task, moved.mask).f == pytest.approx(1.0, abs=1e-6)
    g = qk.graph(hand_built, positions=task)
    assert qk.evaluate(hand_built, task, g.valid[None].repeat(g.n_groups, 1, 1)).f == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(qk.QKCircuitsError, match="not nodes of"):
        qk.evaluate(hand_built, task, ["1.0@S2"])
    with pytest.raises(qk.QKCircuitsError, match="not an edge of"):
        qk.evaluate(hand_built, task, [("emb@END", "1.0@other", "v")])          # the two ends at different groups


def test_kept_at_every_group_is_kept(gpt2):
    task = named_task(gpt2)
    groups = ("X", "END", OTHER)
    heads = [n for n in qk.graph(gpt2).senders if n[0].isdigit()]              # every head, at every group
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = qk.evaluate(gpt2, task, heads + ["mlp0"])                       # every other MLP left out
        split = qk.evaluate(gpt2, task, heads + [f"mlp0@{p}" for p in groups])
        assert split.m == pytest.approx(plain.m, abs=1e-5) and split.n == 3 * plain.n
        assert qk.evaluate(gpt2, task, ["emb@X"]).m == pytest.approx(qk.evaluate(gpt2, task, ["emb"]).m, abs=1e-5)
        # kept at END only: neither the MLP kept nor the MLP left out (its output differs at X and at END)
        one = qk.evaluate(gpt2, task, heads + ["mlp0@END"]).m
        out = qk.evaluate(gpt2, task, heads).m
    assert abs(plain.m - out) > 1e-3 and abs(one - plain.m) > 1e-4 and abs(one - out) > 1e-4


def test_a_circuit_is_evaluated_on_its_own_graph(gpt2, tmp_path_factory):
    task = named_task(gpt2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scores = qk.edge_scores(gpt2, task, method="eap", positions=True, progress=False)
        faith = qk.faithfulness(gpt2, task, scores, sizes=(5, 100), progress=False)
        c = scores.circuit(percent=5)
        ev = qk.evaluate(gpt2, task, c)
    assert ev.n == c.n_edges and ev.f == pytest.approx(faith.curve[5.0], abs=1e-5)
    other = qk.Task(task.clean, task.corrupt, task.answer, task.wrong)                   # names END only
    with pytest.raises(qk.QKCircuitsError, match="split positions X"):
        qk.evaluate(gpt2, other, c)
    llama = qk.load(str(llama_dir(tmp_path_factory)), verbose=False)
    task = named_task(llama)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scores = qk.edge_scores(llama, task, method="eap", gqa="ungrouped", progress=False)
        faith = qk.faithfulness(llama, task, scores, sizes=(10, 100), progress=False)
        ev = qk.evaluate(llama, task, scores.circuit(percent=10))
    assert scores.graph.ungrouped and ev.f == pytest.approx(faith.curve[10.0], abs=1e-5)
