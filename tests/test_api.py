"""The public API is what __all__ says: every name resolves, none is listed twice, no private leak."""

import importlib
import subprocess
import sys

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
