"""``qk.faithfulness`` takes m(clean) from scores measured on the same task and weights (``Task.digest``) instead
of running the clean rows again; anything else that could change m(clean) makes it run them."""

from __future__ import annotations

import pytest
import torch

import qkcircuits as qk
from qkcircuits._tasks import curve as curve_mod
from qkcircuits._tasks import faithfulness as circuit_mod

from _tiny import llama_dir
from test_circuit_scores import FAMILIES, pair_task

SIZES = (0, 5, 50, 100)


@pytest.fixture(scope="module", params=list(FAMILIES))
def fam(request, tmp_path_factory):
    return request.param, qk.load(str(FAMILIES[request.param](tmp_path_factory)), verbose=False)


def _clean_runs(monkeypatch):
    calls = []
    real = circuit_mod.clean_rows

    def counted(model, task):
        calls.append(task.n)
        return real(model, task)

    monkeypatch.setattr(circuit_mod, "clean_rows", counted)        # the node view's
    monkeypatch.setattr(curve_mod, "clean_rows", counted)          # the curve's shards' (circuit_metric's)
    return calls


@pytest.mark.parametrize("method", ["eap", "eap-ig", "exact"])
def test_curve_reads_the_scores_clean_run(fam, method, monkeypatch):
    name, model = fam
    task = pair_task(model, n=6)
    sc = qk.edge_scores(model, task, method=method, steps=2, progress=False)
    assert sc.settings["task_digest"] == task.digest(model)
    calls = _clean_runs(monkeypatch)
    fa = qk.faithfulness(model, task, sc, sizes=SIZES, progress=False)
    assert calls == []                                      # neither the 100 % circuit nor the node view ran it
    # the same curve with m(clean) measured again (scores without a digest, e.g. from an older file)
    sc.settings["task_digest"] = None
    again = qk.faithfulness(model, task, sc, sizes=SIZES, progress=False)
    assert calls                                            # now the clean rows were run
    assert fa.clean == pytest.approx(again.clean, rel=1e-5, abs=1e-5)
    assert fa.curve[100.0] == 1.0 and fa.curve[0.0] == 0.0  # the identities hold exactly either way
    for p in SIZES:
        assert fa.curve[p] == pytest.approx(again.curve[p], rel=1e-4, abs=1e-4)
    assert fa.node_faithfulness == pytest.approx(again.node_faithfulness, rel=1e-4, abs=1e-4)


def test_digest_changes_with_what_m_clean_depends_on(fam):
    name, model = fam
    task = pair_task(model, n=4)
    d = task.digest(model)
    assert d == pair_task(model, n=4).digest(model)                   # deterministic
    assert d != pair_task(model, n=4, seed=1).digest(model)           # other rows
    other = pair_task(model, n=4)
    other.answer = (other.answer + 1) % model.cfg.d_vocab
    assert d != other.digest(model)                                   # other answers
    other = pair_task(model, n=4)
    other.metric = "prob-diff"
    assert d != other.digest(model)                                   # another metric
    other.metric = qk.as_metric(lambda logits, tokens: logits[:, -1, 0].mean(), higher_is_better=True)
    assert other.digest(model) is None                                # a callable: never reused
    w = model.W_E
    with torch.no_grad():
        w[3, 0] += 0.5                                                # one weight edited
        try:
            assert task.digest(model) != d
        finally:
            w[3, 0] -= 0.5
    # weights moved around with every sum unchanged: the unembedding rows of the answer and the wrong token
    # swapped (which flips the sign of every logit difference)
    U = model.W_U
    a, b = int(task.answer[0]), int(task.wrong[0])
    d = task.digest(model)                                            # (+0.5 − 0.5 above need not restore exactly)
    with torch.no_grad():
        U[:, [a, b]] = U[:, [b, a]]
        try:
            assert task.digest(model) != d
        finally:
            U[:, [a, b]] = U[:, [b, a]]
    assert task.digest(model) == d


def test_digest_sees_single_weight_edits_in_bf16(tmp_path_factory):
    # half-precision weights are fingerprinted in float32: each of these single-weight edits (a weight zeroed or
    # doubled, two rows swapped) changes the digest. The edits are to the smallest weights, whose change is below a
    # bf16 row product's rounding: in bf16 arithmetic most of them left the digest as it was
    model = qk.load(str(llama_dir(tmp_path_factory)), dtype="bfloat16", verbose=False)
    task = pair_task(model, n=2)
    d = task.digest(model)
    W = model.blocks[0].attn.q.original_component.weight
    with torch.no_grad():
        for i in W.detach().float().abs().view(-1).argsort()[:40].tolist():
            old = W.view(-1)[i].clone()
            for new in (torch.zeros_like(old), old * 2):
                if bool(new == old):
                    continue
                W.view(-1)[i] = new
                try:
                    assert task.digest(model) != d, i
                finally:
                    W.view(-1)[i] = old
        rows = W[[0, 1]].clone()
        W[[0, 1]] = rows.flip(0)
        try:
            assert task.digest(model) != d
        finally:
            W[[0, 1]] = rows
    assert task.digest(model) == d


def test_edited_weights_after_scoring_rerun_the_clean_rows(fam, monkeypatch):
    name, model = fam
    task = pair_task(model, n=4)
    sc = qk.edge_scores(model, task, method="eap", progress=False)
    calls = _clean_runs(monkeypatch)
    p = next(model.parameters())
    with torch.no_grad():
        p.mul_(1.01)
        try:
            fa = qk.faithfulness(model, task, sc, sizes=SIZES, progress=False)
            n_calls = len(calls)
            want = float(circuit_mod.clean_rows(model, task).mean())      # m(clean) of the edited weights
        finally:
            p.div_(1.01)
    assert n_calls                                        # the scores' m(clean) was for other weights: not taken
    assert fa.clean == pytest.approx(want, abs=1e-6) and fa.clean != pytest.approx(sc.clean, abs=1e-6)
