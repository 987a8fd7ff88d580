"""Answer sets (issue 42, ask 1): a task's answer and wrong may be a set of token ids per row.

Ground truth: the set formulas by hand on random logits; linearity (a prob-diff over two-element sets is the sum
of two one-token prob-diffs, so every linear method's edge scores add up: EAP, EAP-IG, exact); a one-element set
is today's task bit for bit; and a JSONL with answer lists against the raw Hugging Face model, not qkcircuits.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import qkcircuits as qk
from qkcircuits._tasks.answers import answer_ids
from qkcircuits._tasks.task import evaluate

from _tiny import gpt2_dir, hf_model


def test_answer_ids_forms_and_one_line_errors():
    assert answer_ids([[4, 5, 6], [5]], 2, "answer").tolist() == [[4, 5, 6], [5, -1, -1]]
    assert answer_ids([[4], [5]], 2, "answer").tolist() == [4, 5]                 # one-element sets: [n]
    assert answer_ids(torch.tensor([[4, 5]]), 3, "answer").tolist() == [[4, 5]] * 3  # one set for every row
    assert answer_ids(torch.tensor([[4, -1], [5, -1]]), 2, "answer").tolist() == [4, 5]   # padding columns dropped
    for value, message in (([[4, 4], [5]], "row 0 holds a token id twice"), ([[4], []], "set of row 1 is empty"),
                           (torch.tensor([[4, -1, 5]]), "ids first, then the padding"), ([1, 2, 3], r"got shape \(3,\)"),
                           (torch.tensor([[4, -2]]), "negative token id -2"), (torch.tensor([0.5, 1.0]), "integer")):
        with pytest.raises(qk.QKCircuitsError, match=message) as e:
            answer_ids(value, 2 if not isinstance(value, torch.Tensor) or value.shape[0] != 1 else 1, "answer")
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("metric", ["logit-diff", "prob-diff", "answer-loss"])
def test_set_metrics_are_the_formulas_by_hand(metric):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 11, generator=g)
    answer, wrong = [[1, 2, 3], [4], [5, 6]], [[7], [8, 9], [0, 10, 2]]
    task = qk.Task(torch.zeros(3, 4, dtype=torch.long), torch.zeros(3, 4, dtype=torch.long), answer, wrong,
                   metric=metric, positions={"END": torch.tensor([3, 1, 2])})
    assert task.answer.shape == (3, 3) and task.wrong.shape == (3, 3)
    want = []
    for i, end in enumerate([3, 1, 2]):
        last = logits[i, end]
        p = last.softmax(-1)
        want.append({"logit-diff": last[answer[i]].mean() - last[wrong[i]].mean(),
                     "prob-diff": p[answer[i]].sum() - p[wrong[i]].sum(),
                     "answer-loss": -p[answer[i]].sum().log()}[metric])
    torch.testing.assert_close(task.row_values(logits), torch.stack(want), rtol=1e-5, atol=1e-6)
    # a shard's sums add up to the whole set's, and stacked copies repeat the sets
    parts = sum(float(s.metric_sum(logits[i:i + 2])) for s, i in zip(task.shards(2), (0, 2)))
    assert parts == pytest.approx(float(task.metric_sum(logits)), abs=1e-5)
    torch.testing.assert_close(task.row_values(logits.repeat(2, 1, 1)), task.row_values(logits).repeat(2))


@pytest.mark.parametrize("metric", ["logit-diff", "prob-diff", "answer-loss"])
def test_a_one_element_row_of_a_set_task_is_the_one_token_value_bit_for_bit(metric):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 11, generator=g)
    z = torch.zeros(2, 3, dtype=torch.long)
    one = qk.Task(z, z, [4, 5], [7, 8], metric=metric)
    sets = qk.Task(z, z, [[4], [5, 6]], [[7], [8, 9]], metric=metric)     # row 0: one-element sets, padded
    assert sets.answer.tolist() == [[4, -1], [5, 6]]
    assert torch.equal(sets.row_values(logits)[0], one.row_values(logits)[0])   # the set formulas at k = 1
    assert not torch.equal(sets.row_values(logits)[1], one.row_values(logits)[1])
    solo = qk.Task(z, z, [[4], [5]], [[7], [8]], metric=metric)           # every set one element: the same task
    assert torch.equal(solo.answer, one.answer) and torch.equal(solo.row_values(logits), one.row_values(logits))


def _pair(task, V: int):
    """A second (answer, wrong) per row, distinct from the task's and from each other."""
    a2 = (task.answer + 3) % V
    w2 = (task.wrong + 5) % V
    clash = (a2 == task.wrong) | (a2 == w2) | (w2 == task.answer) | (a2 == task.answer) | (w2 == task.wrong)
    assert not bool(clash.any())
    return a2, w2


def test_one_element_sets_give_todays_edge_scores_bit_for_bit(hand_built):
    task = qk.tasks.induction(hand_built, n=2, seg_len=4, seed=0)
    sets = qk.Task(task.clean, task.corrupt, [[int(a)] for a in task.answer], [[int(w)] for w in task.wrong],
                   task.metric, task.positions, task.name, task.bos, None, task.bos_mode)
    for method in ("eap",):                               # the gradient path (EAP-IG: the same at more points)
        a = qk.edge_scores(hand_built, task, method=method, steps=2, progress=False).scores
        b = qk.edge_scores(hand_built, sets, method=method, steps=2, progress=False).scores
        ok = ~torch.isnan(a)                              # NaN where a sender does not feed a receiver
        assert torch.equal(ok, ~torch.isnan(b)) and torch.equal(a[ok], b[ok]) and bool((a[ok] != 0).any())
    assert sets.digest(hand_built) == task.digest(hand_built)


def test_every_method_reads_sets_linearly(hand_built):
    """prob-diff over two-element sets = the sum of the two one-token prob-diffs, so EAP and exact edge
    scores (each linear in the metric; EAP-IG sums EAP's gradients at more points) add up; faithfulness, the core (node runs), roles and attend run on it."""
    base = qk.tasks.induction(hand_built, n=2, seg_len=4, seed=0, metric="prob-diff")
    a2, w2 = _pair(base, hand_built.cfg.d_vocab)
    first = base
    second = qk.Task(base.clean, base.corrupt, a2, w2, "prob-diff", base.positions, "induction", True, None, "yes")
    both = qk.Task(base.clean, base.corrupt, torch.stack([base.answer, a2], 1), torch.stack([base.wrong, w2], 1),
                   "prob-diff", base.positions, "induction", True, None, "yes", None, "induction")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")               # the second pair is arbitrary: "does not do the task"
        for method in ("eap", "exact"):                # gradients (EAP-IG: the same at more points), patched runs
            s1, s2, s12 = (qk.edge_scores(hand_built, t, method=method, steps=2, progress=False)
                           for t in (first, second, both))
            ok = ~torch.isnan(s12.scores)
            torch.testing.assert_close(s12.scores[ok], (s1.scores + s2.scores)[ok], rtol=1e-4, atol=1e-6)
            assert s12.clean == pytest.approx(s1.clean + s2.clean, abs=1e-6)
        scores = s12                                   # exact's
        f = qk.faithfulness(hand_built, both, scores, sizes=(50, 100), progress=False)
        assert f.curve[100.0] == pytest.approx(1.0, abs=1e-4)              # every edge: the full model
        core = qk.core_circuit(hand_built, both, scores, progress=False)
        roles = qk.roles(hand_built, both, core, scores=scores, qk=False)
        assert set(roles.roles) >= set(core.heads)
    r = qk.attend(hand_built, "1.0", task=both)
    assert r is not None


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    return gpt2_dir(tmp_path_factory)


def test_jsonl_answer_lists_match_the_raw_hugging_face_model(gpt2_folder, tmp_path):
    model = qk.load(str(gpt2_folder), verbose=False)
    tok = model.tokenizer
    lines = [{"clean": "the old town", "corrupt": "the new town", "answer": [" would", " asked"], "wrong": " them"},
             {"clean": "their old", "corrupt": "their new", "answer": " would", "wrong": [" them", " old", " new"]},
             {"clean": "them would", "corrupt": "them asked", "answer": [" town"], "wrong": [" their", " would"]}]
    path = tmp_path / "sets.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    task = qk.tasks.from_jsonl(model, path, metric="prob-diff")
    assert task.answer.shape == (3, 2) and task.wrong.shape == (3, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = evaluate(model, task, warn=False)
    hf = hf_model(gpt2_folder)
    want = {}
    for which in ("clean", "corrupt"):
        total = 0.0
        for x in lines:
            ids = tok(x[which], add_special_tokens=False)["input_ids"]           # SmolLM2-like: no BOS added
            with torch.no_grad():
                p = hf(torch.tensor([ids])).logits[0, -1].double().softmax(-1)
            one = lambda v: [v] if isinstance(v, str) else v                       # noqa: E731
            a = [tok(t, add_special_tokens=False)["input_ids"][0] for t in one(x["answer"])]
            w = [tok(t, add_special_tokens=False)["input_ids"][0] for t in one(x["wrong"])]
            total += float(p[a].sum() - p[w].sum())
        want[which] = total / len(lines)
    assert got["clean"] == pytest.approx(want["clean"], abs=1e-4)
    assert got["corrupt"] == pytest.approx(want["corrupt"], abs=1e-4)
    assert abs(want["clean"] - want["corrupt"]) > 1e-3                            # the two differ: a real check


@pytest.mark.parametrize("answer,wrong,message", [
    ([" would", " would"], " them", "' would' is in the set twice"),
    ([" would", " asked"], [" them", " asked"], "token ' asked' is in both the answer and the wrong set"),
    ([], " them", "answer must be a non-empty string or a non-empty list"),
    ([" would", 3], " them", "answer must be a non-empty string or a non-empty list"),
    ([" would asked"], " them", "answer ' would asked' is 2 tokens"),
])
def test_jsonl_answer_list_errors_are_one_line(gpt2_folder, tmp_path, answer, wrong, message):
    model = qk.load(str(gpt2_folder), verbose=False)
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"clean": "old", "corrupt": "new", "answer": answer, "wrong": wrong}) + "\n")
    with pytest.raises(qk.QKCircuitsError, match=message) as e:
        qk.tasks.from_jsonl(model, path)
    assert "\n" not in str(e.value) and "line 1" in str(e.value)


def test_a_set_task_the_model_does_not_do_names_its_sets_and_bad_patterns_are_refused(hand_built):
    base = qk.tasks.induction(hand_built, n=2, seg_len=4, seed=0)
    a2, w2 = _pair(base, hand_built.cfg.d_vocab)
    swapped = qk.Task(base.clean, base.corrupt, torch.stack([base.wrong, w2], 1), torch.stack([base.answer, a2], 1),
                      "prob-diff")
    with pytest.warns(UserWarning, match="does not do task") as seen:
        evaluate(hand_built, swapped)
    a, w = base.wrong[0], base.answer[0]
    assert f"answer {{id {int(a)}, id {int(w2[0])}}}, wrong {{id {int(w)}, id {int(a2[0])}}}" in str(seen[0].message)
    with pytest.raises(qk.QKCircuitsError, match="pattern must be None .* or one of induction, got 'previous'"):
        qk.Task(base.clean, base.corrupt, 1, 2, pattern="previous")
