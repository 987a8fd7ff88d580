"""Every ``Result`` round-trips exactly: ``from_json(to_json(r))`` equals ``r`` field by field, over random results.

The classes are discovered (every module of the package imported, then ``Result``'s subclasses walked), so a new
result class is covered as soon as it exists, and this test fails until tests/_random_results.py has a generator
for it. Equality is strict: same types (a tuple is not a list, 5 is not 5.0), same dict key order, tensors of the
same dtype and shape, equal bit for bit up to NaN (NaN equals NaN, -0.0 is not 0.0); and what the results derive
from their fields (labels, flags, top, tables, repr, the JSON text itself) must not change either.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import pkgutil
import random

import pytest
import torch
from transformer_lens.FactoredMatrix import FactoredMatrix

import qkcircuits
from qkcircuits._foundation.io import json_floats, read_floats
from qkcircuits._foundation.result import Result

from _random_results import GENERATORS

SEEDS = range(15)      # x 19 classes; the awkward values are drawn often (tests/_random_results.py)


def result_classes():
    """Every Result subclass the package defines (all its modules imported first; the CLI entry point excepted)."""
    for info in pkgutil.walk_packages(qkcircuits.__path__, "qkcircuits."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    seen, todo = [], list(Result.__subclasses__())
    while todo:
        cls = todo.pop(0)
        if cls not in seen and cls.__module__.startswith("qkcircuits."):
            seen.append(cls)
        todo += cls.__subclasses__()
    return seen


CLASSES = result_classes()


def same(a, b, where: str = "r") -> None:
    """Assert ``a`` and ``b`` are equal field by field (see the module docstring); ``where`` names the place."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} became {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{tuple(a.shape)} -> {b.dtype}{tuple(b.shape)}"
        if a.is_floating_point():
            na, nb = a.isnan(), b.isnan()
            ok = torch.equal(na, nb) and torch.equal(a[~na], b[~nb]) and torch.equal(a[~na].signbit(), b[~nb].signbit())
        else:
            ok = torch.equal(a, b)
        assert ok, f"{where}: values changed\n{a}\n{b}"
    elif isinstance(a, FactoredMatrix):
        same(a.A, b.A, where + ".A")
        same(a.B, b.B, where + ".B")
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} -> {list(b)}"
        for k in a:
            same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} -> {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b)), \
            f"{where}: {a!r} -> {b!r}"
    else:
        assert a == b, f"{where}: {a!r} -> {b!r}"


def derived(r):
    """What a result computes from its fields, each view as a value or the exception it raised."""
    out = {}
    for name, f in [("to_dict", r.to_dict), ("repr", lambda: repr(r)), ("html", r._repr_html_),
                    ("top", lambda: r.top(3)), ("frame", lambda: r.to_frame().to_json()),
                    ("labels", getattr(r, "labels", None) if callable(getattr(r, "labels", None)) else None)]:
        if f is None:
            continue
        try:
            out[name] = f()
        except Exception as e:          # noqa: BLE001 — a view that fails on the original must fail the same way
            out[name] = f"raised {type(e).__name__}"
    return out


def test_every_result_class_has_a_generator():
    missing = [c.__module__ + "." + c.__name__ for c in CLASSES if c not in GENERATORS]
    assert not missing, f"add a generator to tests/_random_results.py for {missing}"
    assert len(CLASSES) >= 19 and all(c.SCHEMA for c in CLASSES)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_from_json_of_to_json_is_the_same_result(cls):
    for seed in SEEDS:
        r = GENERATORS[cls](random.Random(f"{cls.__name__}/{seed}"))
        assert type(r) is cls
        text = r.to_json()
        back = cls.from_json(text)
        same(r, back, f"{cls.__name__}(seed {seed})")
        same(derived(r), derived(back), f"{cls.__name__}(seed {seed}) derived")
        assert back.to_json() == text
        assert type(qkcircuits.load_result(text)) is cls


def test_a_score_one_float32_step_below_a_threshold_keeps_its_labels():
    """The reported case: 0.3999996 at 6 decimals read back as 0.4, so a head under the 0.4 threshold gained it."""
    s = qkcircuits.results.HeadScores("m", 1, 2, {"x": torch.tensor([[0.3999996, 1.0]])},
                              thresholds={"one": ("x", 1.0), "tenth": ("x", 0.4)})
    back = qkcircuits.results.HeadScores.from_json(s.to_json())
    assert {str(h): v for h, v in back.labels().items()} == {"0.1": ["one", "tenth"]} == \
        {str(h): v for h, v in s.labels().items()}
    assert "0.3999996" in s.to_json()       # readable: the shortest decimal of the float32, not 0.39999958872795105


def test_float32_numbers_are_written_as_their_shortest_exact_decimal():
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**31, 2**31 - 1, (20000,), generator=g, dtype=torch.int32)
    x = bits.view(torch.float32)
    x = x[x.isfinite()]
    back = read_floats(json.loads(json.dumps(json_floats(x))))
    assert torch.equal(back.view(torch.int32), x.view(torch.int32))          # bit for bit, -0.0 and subnormals too
    assert json_floats(torch.tensor([0.1, 1e-7, -0.0])) == [0.1, 1e-7, -0.0]


def test_a_task_circuit_keeps_only_its_own_edges_scores():
    """Documented loss: a circuit's JSON holds its edges' scores; the graph's other edges read back as NaN."""
    from _random_results import task_circuit

    c = task_circuit(random.Random(3))
    full = torch.randn(c.scores.shape, generator=torch.Generator().manual_seed(0))       # a score on every edge
    back = type(c).from_json(dataclasses.replace(c, scores=full).to_json())
    assert back.scores[~c.mask].isnan().all() and torch.equal(back.scores[c.mask], full[c.mask])
