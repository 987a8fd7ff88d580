"""One metric vocabulary (issue 36 ask 2): one table of names, one resolver, one meaning per name, no guessed sign.

Ground truth: the toy model (``qk.load("toy-induction")``: 0.0 previous-token, 1.0 induction by construction) and
numbers computed here from its logits by hand (``F.cross_entropy``, a gather), independent of the metric code;
exact identities for the direction (a loss declared lower-is-better and its negation declared higher-is-better
give bit-identical effects).
"""

from __future__ import annotations

import pathlib
import pickle
import re
import warnings

import pytest
import torch
import torch.nn.functional as F

import qkcircuits as qk
from qkcircuits import QKCircuitsError
from qkcircuits._analysis.metrics import TASK, TOKENS, as_metric, builtin
from qkcircuits._foundation.metric_table import TABLE, direction_of, names
from qkcircuits._tasks.task import evaluate
from qkcircuits.cli import build_parser, main

import _tiny
from _cli import errors, run

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"


@pytest.fixture(scope="module")
def toy():
    model = qk.load("toy-induction", verbose=False)
    task = qk.tasks.induction(model, n=3, seg_len=5, seed=0)      # clean = [BOS] + R + R[:-1], answer R[-1]
    full = qk.repeated_tokens(model, n_seqs=3, seg_len=5, seed=0)   # [BOS] + R + R, the same R
    assert torch.equal(full[:, :-1], task.clean) and torch.equal(full[:, -1], task.answer)
    return model, task, full


def _one_line(call, pattern):
    with pytest.raises(QKCircuitsError, match=pattern) as e:
        call()
    assert "\n" not in str(e.value)
    return str(e.value)


# ---- one table -----------------------------------------------------------------------------------

def test_every_name_resolves_to_one_metric_with_its_direction():
    for r in TABLE:
        name = "logit-diff:3,7" if r.name == "logit-diff:C,W" else r.name
        m = builtin(name)
        assert (m.name, m.higher_is_better, m.needs, m.prompts) == (name, r.higher_is_better, r.needs, r.prompts)
        assert direction_of(name) is r.higher_is_better
        where = TASK if r.prompts == "task" else TOKENS
        again = as_metric(name, prompts=where, accept=(r.needs,))
        assert again.name == name and again.sign == (1.0 if r.higher_is_better else -1.0)
        if r.name != "logit-diff:C,W":
            assert again is m                                   # one object per name: names round-trip
    assert len({r.name for r in TABLE}) == len(TABLE)
    # a task travels to Ray workers pickled: its metric comes back as the same built-in
    t = pickle.loads(pickle.dumps(qk.Task([[0, 1, 2]], [[0, 3, 2]], 4, 5, metric="kl")))
    assert t.metric == builtin("kl") and t.metric.fn is builtin("kl").fn and str(t.metric) == "kl"
    # every name the analyses given tokens take, and every name a task takes, is in the table
    assert set(names(prompts=TOKENS)) | set(names(prompts=TASK)) == {r.name for r in TABLE}


def test_the_docs_table_is_the_code_table():
    text = (DOCS / "architecture.md").read_text()
    section = text.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]     # "\|" inside a cell
        if line.startswith("| `") and len(cells) >= 5:
            rows[cells[0].strip("`")] = (cells[2], cells[3], cells[4])
    want = {r.name: ("higher" if r.higher_is_better else "lower", r.needs, r.prompts) for r in TABLE}
    assert rows == want


# ---- one meaning per name, the same number through every API ---------------------------------------

def test_logit_diff_is_one_number_through_sweep_the_task_and_by_hand(toy):
    model, task, _ = toy
    logits = model(task.clean).detach()
    by_hand = (logits[:, -1, 5] - logits[:, -1, 7]).mean()
    swept = qk.sweep(model, task.clean, "logit-diff:5,7", progress=False)
    t = qk.Task(task.clean, task.corrupt, 5, 7, metric="logit-diff")
    assert t.metric is builtin("logit-diff") and t.higher_is_better and swept.higher_is_better
    assert swept.baseline == pytest.approx(float(by_hand), abs=1e-5)
    assert evaluate(model, t, warn=False)["clean"] == pytest.approx(float(by_hand), abs=1e-5)
    # one answer per row: qk.logit_diff with [n] ids through sweep = the task's logit-diff with those answers
    rows = torch.arange(3)
    per_row = (logits[rows, -1, task.answer] - logits[rows, -1, task.wrong]).mean()
    assert qk.sweep(model, task.clean, qk.logit_diff(task.answer, task.wrong), progress=False).baseline == \
        pytest.approx(float(per_row), abs=1e-5)
    assert evaluate(model, task, warn=False)["clean"] == pytest.approx(float(per_row), abs=1e-5)


def test_text_loss_is_one_number_through_sweep_the_task_and_by_hand(toy):
    model, task, _ = toy
    logits = model(task.clean).detach()
    V = logits.shape[-1]
    by_hand = F.cross_entropy(logits[:, :-1].reshape(-1, V), task.clean[:, 1:].reshape(-1))
    t = qk.Task(task.clean, task.corrupt, task.answer, task.wrong, metric="text-loss")
    assert t.metric is qk.text_loss() and not t.higher_is_better
    assert qk.sweep(model, task.clean, qk.text_loss(), progress=False).baseline == pytest.approx(float(by_hand),
                                                                                                 abs=1e-5)
    assert evaluate(model, t, warn=False)["clean"] == pytest.approx(float(by_hand), abs=1e-5)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """A tiny random GPT-2: no behaviour, so its losses differ from position to position (the toy's are all 0)."""
    model = qk.load(str(_tiny.gpt2_dir(tmp_path_factory)), device="cpu", verbose=False)
    task = qk.tasks.induction(model, n=3, seg_len=5, seed=0)
    full = qk.repeated_tokens(model, n_seqs=3, seg_len=5, seed=0)
    assert torch.equal(full[:, :-1], task.clean) and torch.equal(full[:, -1], task.answer)
    return model, task, full


def test_induction_loss_and_answer_loss_are_two_names_for_two_numbers(gpt2):
    model, task, full = gpt2
    L = 5
    logits = model(full).detach()
    losses = F.cross_entropy(logits[:, :-1].transpose(1, 2), full[:, 1:], reduction="none")   # [b, pos-1]
    # induction-loss: R[1:] of the second copy, predicted from positions L+1 .. 2L-1
    induction = losses[:, L + 1:2 * L].mean()
    answer = losses[:, -1].mean()                       # the task's answer R[-1], predicted at END = 2L-1
    assert qk.sweep(model, full, "induction-loss", progress=False).baseline == pytest.approx(float(induction),
                                                                                             abs=1e-5)
    t = qk.Task(task.clean, task.corrupt, task.answer, task.wrong, metric="answer-loss")
    assert evaluate(model, t, warn=False)["clean"] == pytest.approx(float(answer), abs=1e-5)
    assert abs(float(induction) - float(answer)) > 1e-3          # different positions: not one concept
    # "loss", the old name of both (gone in 0.2.0): refused in either context, naming what is accepted there
    with pytest.raises(qk.QKCircuitsError, match="unknown metric 'loss'; use one of induction-loss"):
        qk.sweep(model, full, "loss", progress=False)
    with pytest.raises(qk.QKCircuitsError, match="unknown metric 'loss'; use one of logit-diff"):
        qk.Task(task.clean, task.corrupt, task.answer, task.wrong, metric="loss")


def test_a_name_where_it_cannot_apply_is_refused_in_one_line(toy):
    model, task, full = toy
    msg = _one_line(lambda: qk.sweep(model, full, "logit-diff", progress=False),
                    r"^sweep cannot evaluate metric 'logit-diff': it needs a task's answer and wrong tokens")
    assert "'logit-diff:C,W'" in msg and "Accepted: induction-loss" in msg
    for name in ("prob-diff", "answer-loss", "kl"):
        _one_line(lambda: qk.path_patch(model, "1.0", tokens=full, metric=name, progress=False),
                  rf"^path_patch cannot evaluate metric '{name}'")
        _one_line(lambda: qk.group_effect(model, "1.0", full, name), rf"^group_effect cannot evaluate metric '{name}'")
    for name in ("induction-loss", "induction-loss-first-half"):
        _one_line(lambda: qk.Task(task.clean, task.corrupt, 1, 2, metric=name),
                  rf"^a task cannot evaluate metric '{name}': it is defined on repeated prompts.*Accepted: logit-diff, "
                  rf"prob-diff, answer-loss, kl")
    _one_line(lambda: qk.Task(task.clean, task.corrupt, 1, 2, metric="induction"), r"^a task needs a metric on logits")
    _one_line(lambda: qk.sweep(model, full, "accuracy", progress=False),
              r"^unknown metric 'accuracy'; use one of induction-loss")


# ---- the direction is declared, never guessed ------------------------------------------------------

def _second_half_loss(logits, tokens):          # the induction loss of [BOS]+R+R by hand: R[1:] of the second copy
    L = (tokens.shape[1] - 1) // 2
    return F.cross_entropy(logits[:, L + 1:-1].transpose(1, 2), tokens[:, L + 2:])


def test_a_callable_without_a_direction_is_refused_everywhere(toy):
    model, task, full = toy
    calls = {
        "sweep": lambda: qk.sweep(model, full, _second_half_loss, progress=False),
        "group_effect": lambda: qk.group_effect(model, "1.0", full, _second_half_loss),
        "compare_to_random": lambda: qk.compare_to_random(model, "1.0", full, _second_half_loss, n_draws=2),
        "attribution": lambda: qk.attribution(model, full, _second_half_loss),
        "path_patch": lambda: qk.path_patch(model, "1.0", tokens=full, metric=_second_half_loss, progress=False),
        "edge_attribution": lambda: qk.edge_attribution(model, "1.0", tokens=full, metric=_second_half_loss),
        "a task": lambda: qk.Task(task.clean, task.corrupt, 1, 2, metric=_second_half_loss),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")                   # refused, not warned about
        for where, call in calls.items():
            msg = _one_line(call, r"metric '_second_half_loss' does not say which way is better")
            assert msg.startswith(where) and "qk.as_metric(fn, higher_is_better=False)" in msg
        _one_line(lambda: qk.Metric("mine", _second_half_loss), r"metric 'mine' does not say which way is better")


def test_declared_lower_is_better_flips_the_signs_exactly(toy):
    model, task, full = toy
    loss = qk.as_metric(_second_half_loss, higher_is_better=False)
    negated = qk.as_metric(lambda logits, tokens: -_second_half_loss(logits, tokens), higher_is_better=True)
    wrong_way = qk.as_metric(_second_half_loss, higher_is_better=True)
    a, b, c = (qk.sweep(model, full, m, "mean", progress=False) for m in (loss, negated, wrong_way))
    torch.testing.assert_close(a.effects, b.effects, atol=0, rtol=0)          # an exact identity
    torch.testing.assert_close(a.effects, -c.effects, atol=0, rtol=0)
    assert a.baseline == -b.baseline and not a.higher_is_better and b.higher_is_better
    # the by-hand loss is the built-in induction loss: its effects, the induction head's first
    ref = qk.sweep(model, full, "induction-loss", "mean", progress=False)
    torch.testing.assert_close(a.effects, ref.effects, atol=1e-5, rtol=1e-5)
    assert {h for h, _ in a.top(2)} == {qk.Head(0, 0), qk.Head(1, 0)} and float(a.effects.min()) > -1e-6
    assert float(a.effects[0, 0]) > 1.0 and float(a.effects[1, 0]) > 1.0     # the two heads the toy is built of
    pa, pb = (qk.path_patch(model, "1.0", "k", tokens=full, metric=m, progress=False) for m in (loss, negated))
    torch.testing.assert_close(pa.effects["k"], pb.effects["k"], atol=0, rtol=0, equal_nan=True)
    assert pa.top(1, receiver="1.0", into="k")[0][0] == qk.Head(0, 0)
    ga, gb = qk.group_effect(model, "1.0", full, loss), qk.group_effect(model, "1.0", full, negated)
    assert ga.effect == gb.effect == ga.ablated - ga.baseline > 1.0


def test_a_declared_task_callable_is_the_built_in_and_signs_the_circuit_like_its_negation(toy):
    model, task, _ = toy

    def answer_loss(logits, tokens):                    # −log p(answer) at END, by hand (END = last position)
        return F.cross_entropy(logits[:, -1], task.answer)

    t = qk.Task(task.clean, task.corrupt, task.answer, task.wrong, metric="answer-loss", name="induction", bos=True)
    named = qk.edge_scores(model, t, method="exact", progress=False)
    assert float(named.scores.nan_to_num().abs().max()) > 20 and named.task["metric"] == "answer-loss"
    circuits = []
    for m in (qk.as_metric(answer_loss, higher_is_better=False),
              qk.as_metric(lambda logits, tokens: -answer_loss(logits, tokens), higher_is_better=True)):
        t = qk.Task(task.clean, task.corrupt, task.answer, task.wrong, metric=m, name="induction", bos=True)
        scores = qk.edge_scores(model, t, method="exact", progress=False)
        circuits.append((scores.scores, {e[:3] for e in scores.circuit(edges=4).edges()}))
    # the callable (a batch mean) is evaluated per patched copy, so it scores every edge as the built-in does
    torch.testing.assert_close(circuits[0][0], named.scores, atol=1e-5, rtol=1e-5, equal_nan=True)
    torch.testing.assert_close(circuits[0][0], -circuits[1][0], atol=0, rtol=0, equal_nan=True)   # exact identity
    assert circuits[0][1] == circuits[1][1] == {("emb", "0.0", "v"), ("0.0", "1.0", "k"), ("emb", "1.0", "v"),
                                                ("1.0", "logits", "in")}


# ---- the CLI -------------------------------------------------------------------------------------

def test_cli_metric_names(capsys):
    from qkcircuits.cli import ablate_command as ablate, circuit_command as circuit

    assert set(ablate.METRICS) <= set(names(accept=("logits",), prompts=TOKENS))

    assert circuit.METRICS == names(prompts=("task",)) == ("logit-diff", "prob-diff", "answer-loss", "kl")
    for argv, pattern in ((["circuit", "toy-induction", "--task", "induction", "--metric", "acc"],
                           "unknown metric 'acc'; use one of logit-diff, prob-diff, answer-loss, kl"),
                          (["circuit", "toy-induction", "--task", "induction", "--metric", "induction-loss"],
                           "unknown metric 'induction-loss'"),
                          (["ablate", "toy-induction", "--sweep", "--metric", "logit-diff"], "--metric")):
        code, out, err = run(argv, capsys)
        assert code == 2 and len(errors(err)) == 1 and re.search(pattern, errors(err)[0]) and "Traceback" not in err
    capsys.readouterr()
    code, out, err = run(["circuit", "toy-induction", "--task", "induction", "--metric", "loss"], capsys)
    assert code == 2 and "unknown metric 'loss'" in errors(err)[0]           # the old name went in 0.2.0
    assert main(["ablate", "toy-induction", "--heads", "1.0", "--metric", "loss"]) == 2   # never valid there
