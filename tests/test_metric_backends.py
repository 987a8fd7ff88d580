"""One Metric across every analysis, and backends as objects.

Ground truth: exact identities. A metric and its negation declared as a loss give the same effects; the
built-in induction attention (sums over an einsum) equals an independent per-head callable written here from
``target_masks``; a name, its alias and the Metric object give bit-identical numbers; ``sweep`` equals
``group_effect`` head by head (both measured, one batched, one a plain forward each).
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest
import torch

import _tiny
import qkcircuits as qk
from qkcircuits import QKCircuitsError
from qkcircuits._analysis.detect import target_masks
from qkcircuits._foundation.backends import model_spec
from qkcircuits._analysis.metrics import repeat_length

ROOT = pathlib.Path(qk.__file__).parent


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    model = qk.load(str(_tiny.gpt2_dir(tmp_path_factory)), device="cpu", verbose=False)
    return model, qk.repeated_tokens(model, n_seqs=3, seg_len=6, seed=2)


def _same(a, b):
    torch.testing.assert_close(a, b, atol=0, rtol=0, equal_nan=True)


# ---- one Metric ----------------------------------------------------------------------------------

def test_name_alias_and_object_give_the_same_numbers_everywhere(gpt2):
    model, toks = gpt2
    for m in ("induction-loss", qk.induction_loss()):
        assert qk.as_metric(m).name == "induction-loss"
    sweeps = [qk.sweep(model, toks, m, "mean", progress=False) for m in ("induction-loss", qk.induction_loss())]
    _same(sweeps[0].effects, sweeps[1].effects)
    atts = [qk.attribution(model, toks, m, "mean") for m in ("induction-loss", qk.induction_loss())]
    _same(atts[0].effects, atts[1].effects)
    pps = [qk.path_patch(model, "1.0,1.1", "k", tokens=toks, metric=m, progress=False)
           for m in ("induction-loss", qk.induction_loss())]
    for p in pps[1:]:
        _same(pps[0].effects["k"], p.effects["k"])
    assert {p.metrics["k"] for p in pps} == {"induction-loss"}
    eas = [qk.edge_attribution(model, "1.0,1.1", "k", None, "mean", toks, m)
           for m in ("induction-loss", qk.induction_loss())]
    _same(eas[0].effects["k"], eas[1].effects["k"])
    # the sweep is the per-head group effect, with the same sign (a loss: ablated − clean)
    g = qk.group_effect(model, "1.1", toks, qk.induction_loss(), "mean")
    assert float(sweeps[0].effects[1, 1]) == pytest.approx(g.effect, abs=1e-5)
    assert g.effect == pytest.approx(g.ablated - g.baseline)


def test_a_names_round_trip_through_json(gpt2):
    model, toks = gpt2
    res = qk.sweep(model, toks, qk.logit_diff(int(toks[0, 2]), int(toks[0, 3])), progress=False)
    back = qk.results.HeadEffects.from_json(res.to_json())
    assert back.metric == "logit-diff:%d,%d" % (int(toks[0, 2]), int(toks[0, 3])) and back.higher_is_better
    again = qk.sweep(model, toks, back.metric, progress=False)              # the name alone rebuilds the metric
    _same(again.effects, res.effects)
    for name in ("induction-loss", "induction-loss-first-half", "text-loss", "induction", "direct-logit",
                 "logit-diff:3,7", "logit-diff:3,7@-2"):
        assert qk.as_metric(name).name == name


def test_sign_convention_a_score_and_its_negated_loss_give_the_same_effects(gpt2):
    model, toks = gpt2
    target = toks[:, -1]

    def logit(logits, tokens):
        return logits[torch.arange(len(tokens)), -2, target].mean()

    score = qk.Metric("target-logit", logit, higher_is_better=True)
    loss = qk.Metric("minus-target-logit", lambda lg, t: -logit(lg, t), higher_is_better=False)
    assert score.needs == "logits" and score.higher_is_better and not loss.higher_is_better
    a, b = qk.sweep(model, toks, score, progress=False), qk.sweep(model, toks, loss, progress=False)
    torch.testing.assert_close(a.effects, b.effects, atol=1e-5, rtol=0)
    assert a.baseline == pytest.approx(-b.baseline)                          # values keep their natural sign
    torch.testing.assert_close(qk.attribution(model, toks, score).effects, qk.attribution(model, toks, loss).effects,
                               atol=1e-5, rtol=0)
    pa = qk.path_patch(model, "1.0", "v", tokens=toks, metric=score, progress=False)
    pb = qk.path_patch(model, "1.0", "v", tokens=toks, metric=loss, progress=False)
    torch.testing.assert_close(pa.effects["v"], pb.effects["v"], atol=1e-5, rtol=0, equal_nan=True)
    ga, gb = qk.group_effect(model, "0.1", toks, score), qk.group_effect(model, "0.1", toks, loss)
    assert ga.effect == pytest.approx(gb.effect, abs=1e-5) and ga.effect == pytest.approx(ga.baseline - ga.ablated)


def test_a_receiver_callable_equals_the_built_in_induction_attention(gpt2):
    model, toks = gpt2

    def my_induction(pattern, z, tokens):                 # written from target_masks, independent of Scorer
        mask = target_masks(tokens, repeat_length(tokens))["induction"]
        has = mask.any(-1)
        return (pattern * mask).sum(-1)[has].mean()

    mine = qk.Metric("my-induction", my_induction, needs="pattern", higher_is_better=True)
    assert qk.as_metric(my_induction, higher_is_better=True).needs == "z"   # 3 positional parameters
    built = qk.path_patch(model, "1.0,1.1", "k", tokens=toks, metric="induction", progress=False)
    ours = qk.path_patch(model, "1.0,1.1", "k", tokens=toks, metric=mine, progress=False)
    torch.testing.assert_close(ours.effects["k"], built.effects["k"], atol=1e-6, rtol=1e-5, equal_nan=True)
    torch.testing.assert_close(ours.clean["k"], built.clean["k"], atol=1e-6, rtol=1e-5)
    # edge attribution differentiates the callable as it does the built-in
    e1 = qk.edge_attribution(model, "1.0,1.1", "k", None, "mean", toks, "induction")
    e2 = qk.edge_attribution(model, "1.0,1.1", "k", None, "mean", toks, mine)
    torch.testing.assert_close(e2.effects["k"], e1.effects["k"], atol=1e-6, rtol=1e-4, equal_nan=True)


def test_edge_attribution_takes_path_patchs_arguments_and_keeps_layer_0_receivers(gpt2):
    model, toks = gpt2
    exact = qk.path_patch(model, "0.1,1.0", "k", None, "mean", toks, "induction", progress=False)
    est = qk.edge_attribution(model, "0.1,1.0", "k", None, "mean", toks, "induction")
    assert est.receivers == exact.receivers == [qk.Head(0, 1), qk.Head(1, 0)]
    assert est.effects["k"][0].isnan().all() and exact.effects["k"][0].isnan().all()   # no senders
    torch.testing.assert_close(est.clean["k"], exact.clean["k"], atol=1e-6, rtol=1e-5)
    assert not est.effects["k"][1, 0].isnan().any()


def test_wrong_metrics_fail_in_one_line(gpt2, hand_built):
    model, toks = gpt2
    cases = [
        (lambda: qk.sweep(model, toks, "induction", progress=False), r"sweep needs a metric on logits; got 'induction'"),
        (lambda: qk.attribution(model, toks, "direct-logit"), r"attribution needs a metric on logits"),
        (lambda: qk.group_effect(model, "0.0", toks, qk.as_metric(lambda p, z, t: 0, higher_is_better=True)),
         r"needs a metric on logits; got 'custom'"),
        (lambda: qk.sweep(model, toks, 42, progress=False), r"metric must be a name .*not int 42"),
        (lambda: qk.path_patch(model, "1.0", metric="kl", progress=False),
         r"path_patch cannot evaluate metric 'kl': it needs a task's answer and wrong tokens"),
        (lambda: qk.path_patch(model, "1.0", metric="accuracy", progress=False), r"unknown metric 'accuracy'"),
        (lambda: qk.path_patch(model, "1.0", metric=3.5, progress=False), r"not float"),
        (lambda: qk.edge_attribution(model, "1.0", metric="logit-diff"),
         r"cannot evaluate metric 'logit-diff': it needs a task's answer .* qk.logit_diff\(correct, wrong\)"),
        (lambda: qk.Metric("x", len, needs="logitz"), r"needs must be one of logits, pattern, z, got 'logitz'"),
        (lambda: qk.induction_loss()(torch.zeros(1, 3, 5)), r"is called as \(logits, tokens\), got 1 inputs"),
        (lambda: qk.path_patch(model, "1.0", tokens=toks[:, :5], metric="induction-loss", progress=False),
         r"induction-loss needs tokens laid out as"),
    ]
    for call, pattern in cases:
        with pytest.raises(QKCircuitsError, match=pattern) as e:
            call()
        assert "\n" not in str(e.value)


def test_induction_loss_object_works_in_path_patch_on_the_hand_built_model(hand_built):
    # issue 16's example (a TypeError before): the induction head's key path from the previous-token head
    res = qk.path_patch(hand_built, "1.0", metric=qk.induction_loss(), progress=False)
    assert res.metrics == {"q": "induction-loss", "k": "induction-loss", "v": "induction-loss"}
    assert res.top(1, receiver="1.0", into="k")[0][0] == qk.Head(0, 0) and res.top(1, receiver="1.0", into="k")[0][1] > 1.0


# ---- backends ------------------------------------------------------------------------------------

def test_backend_strings_and_objects():
    assert isinstance(qk.as_backend(None), qk.Local) and isinstance(qk.as_backend("local"), qk.Local)
    assert qk.as_backend("ray", address="local:2") == qk.Ray(address="local:2")
    assert qk.as_backend("local:3") == qk.Ray(address="local:3")
    assert qk.as_backend("10.0.0.5:6379", workers=4) == qk.Ray(address="10.0.0.5:6379", workers=4)
    assert qk.as_backend(qk.Ray(workers=2), address="local:2") == qk.Ray(address="local:2", workers=2)
    for bad, pattern in [("dask", "unknown backend 'dask'"), (3, "unknown backend 3"),
                         (qk.Local(), "ray_address/workers given beside")]:
        with pytest.raises(QKCircuitsError, match=pattern):
            qk.as_backend(bad, address="x:1" if isinstance(bad, qk.Local) else None)
    with pytest.raises(QKCircuitsError, match="workers must be a positive integer, got 0"):
        qk.Ray(workers=0)


def test_model_means_the_same_on_the_local_backend(hand_built):
    toks = qk.repeated_tokens(hand_built, n_seqs=2, seg_len=5, seed=0)
    a = qk.sweep(hand_built, toks, progress=False)
    b = qk.sweep("toy-induction", toks, progress=False, backend=qk.Local())
    _same(a.effects, b.effects)
    pa = qk.path_patch(hand_built, "1.0", tokens=toks, progress=False)
    pb = qk.path_patch("toy-induction", "1.0", tokens=toks, progress=False, backend="local")
    _same(pa.effects["k"], pb.effects["k"])
    assert model_spec(qk.load("toy-induction", verbose=False)) == {"spec": "toy-induction", "dtype": None,
                                                                   "fold_ln": True}


def test_a_new_backend_is_one_subclass(hand_built):
    seen = []

    class Recording(qk.Backend):                 # the docs/architecture.md example
        name = "recording"

        def run(self, job, model, *, local, **request):
            seen.append(job)
            return qk.Local().run(job, model, local=local, **request)

    toks = qk.repeated_tokens(hand_built, n_seqs=2, seg_len=5, seed=0)
    res = qk.sweep(hand_built, toks, backend=Recording(), progress=False)
    qk.path_patch(hand_built, "1.0", tokens=toks, backend=Recording(), progress=False)
    qk.trace_induction(hand_built, k=1, backend=Recording(), progress=False)
    # a backend with only run: each split analysis is one step (its shards run where that step runs); trace's
    # steps: the scan, the path patching, the K-composition agreement
    assert seen == ["sweep", "path_patch", "trace_scan", "path_patch", "k_composition"]
    assert res.top(1)[0][0] == qk.Head(1, 0)


def test_no_analysis_module_imports_the_scale_layer():
    # the lower layers (foundation, weights, analysis, paths) never import _scale: each analysis declares its shards
    # once and a backend maps them; the Ray workers (_foundation/workers) are imported when a Ray pool opens
    for layer in ("_foundation", "_weights", "_analysis", "_paths"):
        for path in (ROOT / layer).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom):
                    assert "_scale" not in (node.module or ""), f"{path.name} imports {node.module}"
    code = ("import sys, qkcircuits as qk; qk.sweep; qk.path_patch; qk.trace_induction; "
            "bad = [m for m in sys.modules if m in ('qkcircuits._foundation.workers', 'ray')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_next_token_losses_in_slices_equal_cross_entropy(monkeypatch):
    # the loss is computed a slice of positions at a time (metrics.LOSS_CHUNK_BYTES): against F.cross_entropy
    # on the whole tensor, with slices of 1, 3 and all positions, on full and last-k logits
    import torch.nn.functional as F

    from qkcircuits._analysis import metrics

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 11, 50, generator=g) * 4
    tokens = torch.randint(0, 50, (3, 11), generator=g)
    want = F.cross_entropy(logits[:, :-1].reshape(-1, 50), tokens[:, 1:].reshape(-1), reduction="none").view(3, 10)
    for chunk in (4 * 3 * 50, 3 * 4 * 3 * 50, 2**30):                 # 1 position, 3 positions, everything
        monkeypatch.setattr(metrics, "LOSS_CHUNK_BYTES", chunk)
        torch.testing.assert_close(metrics.next_token_losses(logits, tokens), want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(metrics.next_token_losses(logits[:, -4:], tokens), want[:, -3:], rtol=1e-6, atol=1e-6)
    assert metrics.next_token_losses(logits[:, -1:], tokens).shape == (3, 0)       # one position: none
    x = logits.clone().requires_grad_(True)                           # gradients pass through the slices
    monkeypatch.setattr(metrics, "LOSS_CHUNK_BYTES", 4 * 3 * 50)
    metrics.next_token_losses(x, tokens).sum().backward()
    (ref,) = torch.autograd.grad(F.cross_entropy(logits.requires_grad_(True)[:, :-1].reshape(-1, 50),
                                                 tokens[:, 1:].reshape(-1), reduction="sum"), logits)
    torch.testing.assert_close(x.grad, ref, rtol=1e-5, atol=1e-6)
