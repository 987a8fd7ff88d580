"""The public API is what __all__ says: every name resolves, none is listed twice, no private leak; the root names that
moved to a submodule (``qk.weights``, ``qk.results``, ``qk.tasks``) still resolve for one release, with a warning."""

import importlib
import subprocess
import sys

import pytest

import qkcircuits as qk


def test_every_exported_name_resolves_once():
    assert len(qk.__all__) == len(set(qk.__all__))
    for name in qk.__all__:
        assert getattr(qk, name) is not None, name
        assert not name.startswith("_")


def test_views_load_lazily():
    code = "import sys, qkcircuits; print('flask' in sys.modules, 'plotly' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]
    assert qk.write_report is importlib.import_module("qkcircuits.viz").write_report


def test_moved_root_names_warn_and_give_the_submodules_object():
    import warnings

    assert len(qk.__all__) < 90 and {"weights", "results", "tasks", "plot"} <= set(qk.__all__)
    for name, home in qk._MOVED.items():
        assert name not in qk.__all__ and name not in dir(qk), name
        sub = getattr(qk, home)
        assert name in sub.__all__, (name, home)
        with pytest.warns(DeprecationWarning, match=rf"qk\.{name} is deprecated; use qk\.{home}\.{name} "):
            old = getattr(qk, name)
        assert old is getattr(sub, name), name
    with pytest.warns(DeprecationWarning, match=r"qk\.INPUTS is deprecated; use qk\.VIEWS"):
        assert qk.INPUTS == qk.VIEWS
    # every result class lives in qk.results: each Result subclass the package defines, the test-only ones aside
    for cls in qk.Result.__subclasses__():
        if cls.__module__.startswith("qkcircuits."):
            assert getattr(qk.results, cls.__name__, None) is cls, cls
    # the new homes' names are what the submodules export, each once
    for sub in (qk.weights, qk.results, qk.tasks):
        assert len(sub.__all__) == len(set(sub.__all__)) and all(getattr(sub, n) is not None for n in sub.__all__)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qk.weights.attn_scale, qk.results.HeadScores, qk.tasks.Graph, qk.tasks.ioi     # the new names: no warning
