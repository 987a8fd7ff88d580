"""Reliability probes of issue 43, rows 1, 2 and 9: heads, ranges and numbers are parsed against the model's shape
before anything is built (a range by its ends, digit counts bounded), in the library, the CLI, the API and the app;
the public API names what it takes. In-process on the hand-built 2x2 model (``toy-induction``)."""

from __future__ import annotations

import json
import time
import tracemalloc

import pytest

import qkcircuits as qk
from qkcircuits import QKCircuitsError, parse_heads
from qkcircuits.viz import create_app

from _cli import errors, run

HUGE = "9" * 5000                      # past Python's 4,300-digit int() limit


@pytest.fixture(scope="module")
def app_client(hand_built):
    return create_app(hand_built, attend=[]).test_client()


def bounded(fn):
    """(result or exception, seconds, peak MB of Python allocations) of ``fn()``."""
    tracemalloc.start()
    t = time.perf_counter()
    try:
        out = fn()
    except Exception as e:                       # noqa: BLE001  (the exception is the result under test)
        out = e
    seconds = time.perf_counter() - t
    peak = tracemalloc.get_traced_memory()[1] / 2 ** 20
    tracemalloc.stop()
    return out, seconds, peak


@pytest.mark.parametrize("spec, fragment", [
    ("1.0-99999999", "8-digit number"),            # row 1: the range that hung the app (digits bounded)
    ("1.0-999999", "head 1.999999 is out of range"),   # six digits: checked by its end, not expanded
    ("1." + HUGE, "5000-digit number"),            # row 2: a 5,000-digit head
    (HUGE + ".0", "5000-digit number"),            # ... and layer
    ("L1H0-" + HUGE, "5000-digit number"),
])
def test_a_head_range_is_checked_by_its_ends_before_it_is_built(hand_built, spec, fragment):
    err, seconds, peak = bounded(lambda: qk.model_heads(hand_built, spec))
    assert isinstance(err, QKCircuitsError) and fragment in str(err), err
    assert "\n" not in str(err) and len(str(err)) < 200          # the bad value is named, cut short
    assert seconds < 0.5 and peak < 5, (seconds, peak)            # not 100 M heads built first


def test_without_the_shape_a_range_is_bounded_and_with_it_ranges_still_work(hand_built):
    assert parse_heads("0.0-4095") [-1] == qk.Head(0, 4095)
    with pytest.raises(QKCircuitsError, match="names 4097 heads; at most 4096"):
        parse_heads("0.0-4096")
    assert qk.model_heads(hand_built, "1.0-1, 0.*") == [qk.Head(1, 0), qk.Head(1, 1), qk.Head(0, 0), qk.Head(0, 1)]
    with pytest.raises(QKCircuitsError, match=r"head 2\.0 is out of range"):
        qk.model_heads(hand_built, "2.*")
    with pytest.raises(QKCircuitsError, match="cannot read a head"):
        parse_heads("1.*-3", n_heads=2)


@pytest.mark.parametrize("argv, fragment", [
    (["attend", "toy-induction", "--head", "1.0-3000000"], "7-digit number"),     # row 1 on the CLI (was 35 s)
    (["attend", "toy-induction", "--head", "1." + HUGE], "5000-digit number"),     # row 2 on the CLI (was exit 1)
    (["attend", "toy-induction", "--head", "1.0", "--seed", HUGE], "at most 18 digits"),
    (["attend", "toy-induction", "--head", "1.0", "--prompt", "a b", "--query", HUGE, "--key", "0"], "expected a position"),
    (["ablate", "toy-induction", "--heads", "0.0-5000"], "names 5001 heads"),
    (["ablate", "toy-induction", "--heads", "x.y"], "cannot read a head"),
    (["trace", "toy-induction", "--receivers", "1." + HUGE], "5000-digit number"),
    (["circuits", "toy-induction", "--head", HUGE + ".0"], "5000-digit number"),
    (["report", "toy-induction", "--heads", "1.0-99999999", "-o", "x.html"], "8-digit number"),
    (["scan", "toy-induction", "--n-seqs", HUGE], "at most 18 digits"),
])
def test_cli_bad_heads_and_giant_numbers_are_one_line_exit_2_before_the_model_loads(argv, fragment, capsys,
                                                                                     monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    import qkcircuits._foundation.model as model_module

    monkeypatch.setattr(model_module, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    t = time.perf_counter()
    code, out, err = run(argv, capsys)
    assert code == 2 and len(errors(err)) == 1 and fragment in errors(err)[0], (code, err)
    assert "Traceback" not in err and len(errors(err)[0]) < 400 and time.perf_counter() - t < 2
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("head, fragment", [
    ("1.0-99999999", "8-digit number"),
    ("1." + HUGE, "5000-digit number"),
    (HUGE + ".1", "5000-digit number"),
    ("1.0-999999", "out of range"),
])
def test_app_bad_heads_are_a_400_within_a_second(app_client, head, fragment):
    t = time.perf_counter()
    r = app_client.post("/api/head", data=json.dumps({"head": head}), content_type="application/json")
    assert r.status_code == 400 and fragment in r.get_json()["error"], r.get_json()
    assert time.perf_counter() - t < 1
