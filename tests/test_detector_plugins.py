"""Detectors as plugins (issue 36, ask 6): a package declares detectors under the ``qkcircuits.detectors`` entry
point and every fresh process sees them (the CLI's scan, its JSON, roles' labels), with no import of that package
by the user; a broken plugin is skipped with one warning and never stops the built-ins.

The recipe of docs/detectors.md, executed: a package folder with a module and its ``.dist-info`` entry points on
``PYTHONPATH`` is exactly what ``pip install`` leaves behind for ``importlib.metadata``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import qkcircuits as qk
from qkcircuits._analysis import detectors as registry

from _cli import errors, run

PLUGIN = '''
import qkcircuits as qk

self_attention = qk.Detector("self_attention", prompts="repeated", threshold=0.5, label="self-attending",
                             mask=lambda tokens, seg_len, first_query: qk.diagonal_mask(tokens),
                             description="attention of each query to its own position")
'''


def install(tmp: Path, entries: str) -> Path:
    """A package ``mydets`` and its dist-info with ``entries`` under qkcircuits.detectors, in ``tmp``."""
    (tmp / "mydets").mkdir()
    (tmp / "mydets" / "__init__.py").write_text(PLUGIN)
    info = tmp / "mydets-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mydets\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[qkcircuits.detectors]\n{entries}\n")
    return tmp


def run_cli(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "qkcircuits", *args], capture_output=True, text=True, env=env,
                          cwd=tmp, timeout=300)


def test_a_fresh_cli_process_scans_with_an_installed_detector(tmp_path, capsys):
    install(tmp_path, "self_attention = mydets:self_attention\nbroken = mydets:not_there")
    done = run_cli(tmp_path, "scan", "toy-induction", "--scores", "self_attention,induction", "--json", "s.json",
                   "--device", "cpu", "--quiet")
    assert done.returncode == 0, done.stderr
    assert "detector plugin 'broken' (mydets:not_there) was not loaded" in done.stderr
    data = json.loads((tmp_path / "s.json").read_text())
    # the hand-built model: 0.1 and 1.1 attend to their own position (by construction), 0.0 and 1.0 never do
    assert [round(float(x), 3) for row in data["scores"]["self_attention"] for x in row] == [0.0, 1.0, 0.0, 1.0]
    assert data["scores"]["induction"][1][0] == pytest.approx(1.0, abs=1e-3)
    # without the package (this test process: the folder is not on its path, so its entry points hold no mydets),
    # the same command names the scores it knows (one line, exit 2), run in-process as tests/_cli.py runs commands
    assert "mydets" not in sys.modules and "self_attention" not in [d.name for d in qk.detectors()]
    code, _, err = run(["scan", "toy-induction", "--scores", "self_attention", "--device", "cpu", "--quiet"], capsys)
    assert code == 2 and len(errors(err)) == 1 and "unknown score 'self_attention'" in errors(err)[0], err
    assert "Traceback" not in err


class _Entry:
    """An installed entry point as importlib.metadata gives it (name, value, load)."""

    def __init__(self, name, value, obj):
        self.name, self.value, self._obj = name, value, obj

    def load(self):
        if isinstance(self._obj, Exception):
            raise self._obj
        return self._obj


def test_roles_read_a_plugin_detectors_label(hand_built):
    # roles on a task other than IOI label heads with every labelled detector of the registry, a plugin's too
    det = qk.Detector("self_attention", prompts="repeated", threshold=0.5, label="self-attending",
                      mask=lambda tokens, seg_len, first_query: qk.diagonal_mask(tokens))
    with pytest.warns(UserWarning, match="'bad' .* was not loaded: ImportError: gone"):
        names = registry.load_plugins([_Entry("mine", "x:mine", lambda: [det]), _Entry("bad", "x:bad", ImportError("gone"))])
    try:
        assert names == ["self_attention"] and registry.detector("self_attention") is det
        from qkcircuits._tasks.roles import detector_roles

        assert ("self-attending head", "self_attention", "self-attending") in detector_roles()
        task = qk.tasks.induction(hand_built, n=4, seg_len=6)
        circuit = qk.edge_scores(hand_built, task, method="eap", progress=False).circuit(percent=100)
        roles = qk.roles(hand_built, task, circuit, qk=False)
        for head, r in roles.roles.items():
            assert "self_attention" in r["evidence"]["detectors"]
            assert ("self-attending" in r["evidence"]["labels"]) == (head.endswith(".1"))   # 0.1, 1.1 by construction
    finally:
        qk.unregister_detector("self_attention")
        registry._plugins["by_entry"].pop("mine = x:mine")


def test_a_plugin_is_all_or_nothing_and_never_takes_a_registered_name():
    a = qk.Detector("plug_a", prompts="repeated", mask=lambda tokens, seg_len, first_query: qk.diagonal_mask(tokens))
    b = qk.Detector("plug_b", prompts="repeated", mask=lambda tokens, seg_len, first_query: qk.diagonal_mask(tokens))
    clash = qk.Detector("induction", prompts="repeated",
                        mask=lambda tokens, seg_len, first_query: qk.diagonal_mask(tokens))
    builtin = registry.detector("induction")
    try:
        with pytest.warns(UserWarning) as seen:
            got = registry.load_plugins([_Entry("first", "p:first", [a]),
                                         _Entry("second", "q:second", [b, a]),          # takes first's name
                                         _Entry("third", "r:third", [b, clash])])       # takes a built-in's
        assert got == ["plug_a"] and registry.detector("plug_a") is a and registry.detector("induction") is builtin
        assert "plug_b" not in [d.name for d in registry.detectors()]                   # neither half stays
        assert [str(w.message).split(" was not loaded: ")[1] for w in seen] == [
            "QKCircuitsError: detector 'plug_a' is already registered",
            "QKCircuitsError: detector 'induction' is already registered"]
        again = qk.Detector("plug_a", prompts="repeated", threshold=0.9, label="plug-a",
                            mask=lambda tokens, seg_len, first_query: qk.diagonal_mask(tokens))
        assert registry.load_plugins([_Entry("first", "p:first", [again])]) == ["plug_a"]   # its own: replaced
        assert registry.detector("plug_a") is again
    finally:
        for name in ("plug_a", "plug_b"):
            if name in [d.name for d in registry.detectors()]:
                qk.unregister_detector(name)
        registry._plugins["by_entry"].pop("first = p:first", None)
