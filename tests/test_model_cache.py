"""What is remembered per model lives in one store with one invalidation rule (issue 44, ask 3): an entry made
from the weights is made again after any in-place edit, the store never keeps a model alive, and no other module
keeps per-model state (a weak dictionary or an attribute written onto the model)."""

from __future__ import annotations

import ast
import gc
import weakref
from pathlib import Path

import pytest
import torch

import qkcircuits as qk
from qkcircuits import QKCircuitsError
from qkcircuits._foundation import model_cache
from qkcircuits._foundation.model_cache import forget, names, recall, remember, remembered
from qkcircuits._weights import contextual

PACKAGE = Path(__file__).resolve().parents[1] / "qkcircuits"


@pytest.fixture()
def model():
    torch.manual_seed(0)
    return qk.load("toy-induction", verbose=False)


def test_computed_once_per_name_and_key(model):
    calls = []

    def make(v):
        calls.append(v)
        return [v]

    a = remembered(model, "t: list", 1, lambda: make(1))
    assert remembered(model, "t: list", 1, lambda: make(1)) is a
    b = remembered(model, "t: list", 2, lambda: make(2))
    assert b is not a and calls == [1, 2]
    forget(model, "t: list")
    assert remembered(model, "t: list", 1, lambda: make(1)) is not a and calls == [1, 2, 1]


def test_weights_entries_are_made_again_after_any_in_place_edit_or_replacement(model):
    made = lambda: object()                                            # noqa: E731
    first = remembered(model, "t: weights", None, made, depends="weights")
    assert remembered(model, "t: weights", None, made, depends="weights") is first
    param = next(p for n, p in model.named_parameters() if "mlp" in n or "attn" in n)
    with torch.no_grad():
        param.add_(0.0)                                                # an in-place write that changes no value
    second = remembered(model, "t: weights", None, made, depends="weights")
    assert second is not first
    assert remembered(model, "t: weights", None, made, depends="weights") is second
    with torch.no_grad():
        param.data = param.data.clone()                                # a new storage
    assert remembered(model, "t: weights", None, made, depends="weights") is not second
    # "embed" looks at W_E alone: an edit elsewhere keeps it, an edit of W_E does not
    e = remembered(model, "t: embed", None, made, depends="embed")
    with torch.no_grad():
        param.add_(0.0)
    assert remembered(model, "t: embed", None, made, depends="embed") is e
    with torch.no_grad():
        model.W_E.add_(0.0)
    assert remembered(model, "t: embed", None, made, depends="embed") is not e
    # only the current entry of a name is kept
    assert names(model)["t: weights"] == 1


def test_corpus_stats_follow_an_edit_without_refresh(model):
    """After an in-place edit the remembered corpus statistics equal a fresh pass of the edited model (the
    ground truth: the pass itself, not remembered), and differ from the unedited ones."""
    before = contextual.corpus_stats(model)
    param = next(p for n, p in model.named_parameters() if n.startswith("layers.0.") and p.dim() >= 2)
    with torch.no_grad():
        param.mul_(3.0)
    after = contextual.corpus_stats(model)
    truth = contextual._corpus_pass(model)
    assert after is not before
    for layer in truth.sums:
        assert torch.equal(after.sums[layer], truth.sums[layer])
    assert any(not torch.equal(before.sums[layer], truth.sums[layer]) for layer in truth.sums if layer > 0)


def test_the_views_context_follows_an_edit(model):
    from qkcircuits import plot

    ctx = plot._ctx(model)
    assert plot._ctx(model) is ctx
    with torch.no_grad():
        next(model.parameters()).add_(0.0)
    assert plot._ctx(model) is not ctx


def test_the_store_never_keeps_a_model_alive():
    m = qk.load("toy-induction", verbose=False)
    qk.scan(m, progress=False)                                       # adapters, token pool, family
    qk.plot.qk(m, "1.0")                                             # the views' context (holds its model)
    contextual.corpus_stats(m)
    assert {"token pool", "adapters", "attention family", "corpus stats", "view context", "load spec"} <= set(names(m))
    ref = weakref.ref(m)
    del m
    gc.collect()
    assert ref() is None
    assert all(k() is not None for k in model_cache._STORE.keyrefs())


def test_records_and_models_without_weak_references():
    class Plain:
        __slots__ = ("W_E",)

    p = Plain()
    p.W_E = torch.zeros(2, 2)
    calls = []
    for _ in range(2):
        remembered(p, "t: plain", None, lambda: calls.append(1))
    assert len(calls) == 2                                           # nothing remembered, nothing raised
    remember(p, "t: record", 1)
    assert recall(p, "t: record", "none") == "none"


def test_a_bad_depends_is_one_line(model):
    with pytest.raises(QKCircuitsError, match=r"depends must be one of None, 'weights', 'embed', got 'weight'") as e:
        remembered(model, "t: bad", None, dict, depends="weight")
    assert "\n" not in str(e.value)


def _per_model_state(source: str):
    """Weak dictionaries, and attributes written onto a model, in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in ("WeakKeyDictionary", "WeakValueDictionary"):
            found.append((node.lineno, node.attr))
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in (
                "setattr", "__setattr__") and node.args:
            target = ast.unparse(node.args[0])
            if any(w in target for w in ("model", "bridge")):
                found.append((node.lineno, ast.unparse(node)))
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Attribute) and ast.unparse(t.value) in ("model", "bridge", "self.model"):
                    found.append((node.lineno, ast.unparse(t)))
    return found


def test_no_other_module_keeps_per_model_state():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        if rel == "qkcircuits/_foundation/model_cache.py":
            continue
        offenders += [f"{rel}:{line}: {what}" for line, what in _per_model_state(path.read_text())]
    assert not offenders, "per-model state outside _foundation/model_cache (use remembered/remember):\n" + \
        "\n".join(offenders)


def test_the_state_finder_finds():
    src = ("import weakref\n_C = weakref.WeakKeyDictionary()\nsetattr(model, 'x', 1)\n"
           "object.__setattr__(self.model, 'y', 2)\nbridge.z = 3\nargs.w = 4\n")
    assert [w for _, w in sorted(_per_model_state(src))] == [
        "WeakKeyDictionary", "setattr(model, 'x', 1)", "object.__setattr__(self.model, 'y', 2)", "bridge.z"]


def test_a_second_scan_skips_the_weight_only_scores_until_the_weights_change(model, monkeypatch):
    from qkcircuits._analysis import detect

    calls = []
    real = detect.copying_scores
    monkeypatch.setattr(detect, "copying_scores", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = qk.scan(model, progress=False)
    second = qk.scan(model, progress=False)
    assert len(calls) == 1
    assert all(torch.equal(first.scores[k], second.scores[k]) for k in first.scores)
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if n.startswith("layers.1.") and ".v." in n and p.dim() == 2).mul_(-1.0)
    edited = qk.scan(model, progress=False)
    assert len(calls) == 2
    fresh = qk.load("toy-induction", verbose=False)                  # the truth: the same edit on a fresh load
    with torch.no_grad():
        next(p for n, p in fresh.named_parameters() if n.startswith("layers.1.") and ".v." in n and p.dim() == 2).mul_(-1.0)
    truth = qk.scan(fresh, progress=False)
    for k in ("eigen_copying", "ov_copying"):
        assert torch.equal(edited.scores[k], truth.scores[k])
    assert float(edited.scores["eigen_copying"][1, 0]) == pytest.approx(-float(first.scores["eigen_copying"][1, 0]),
                                                                          abs=1e-5)
