"""Gradient-based analyses differentiate activations only: no weights-sized ``.grad`` is left on the model.

``qk.edge_scores`` (EAP, EAP-IG) once ran ``total.backward()``, which also computed a gradient for every
parameter (the weights require grad after ``qk.load``) and kept it on the model: one more copy of the
weights held after the call (found by benchmarks/bench_scaling.py: ~0.5 GB kept on SmolLM2-135M fp32),
growing by accumulation on every call, and the weight-gradient matmuls' time in every backward.
"""

import pytest
import torch

import qkcircuits as qk


@pytest.fixture()
def toy():
    model = qk.load("toy-induction", verbose=False)
    assert any(p.requires_grad for p in model.parameters())       # else the test could not fail
    return model


def _with_grad(model):
    return [n for n, p in model.named_parameters() if p.grad is not None]


@pytest.mark.parametrize("method", ["eap", "eap-ig"])
def test_edge_scores_leave_no_parameter_grad(toy, method):
    task = qk.tasks.induction(toy, n=4, seg_len=5)
    first = qk.edge_scores(toy, task, method=method, steps=2, progress=False)
    assert _with_grad(toy) == []
    again = qk.edge_scores(toy, task, method=method, steps=2, progress=False)
    assert torch.equal(first.scores.nan_to_num(), again.scores.nan_to_num())
    # the known circuit is still found (previous-token 0.0 -> k of induction head 1.0 among the top edges)
    assert ("0.0", "1.0", "k") in [e[:3] for e in first.top(6)]


def test_edge_and_head_attribution_leave_no_parameter_grad(toy):
    qk.edge_attribution(toy, "1.0", "k")
    qk.attribution(toy, qk.repeated_tokens(toy, 2, 5))
    assert _with_grad(toy) == []
