"""docs/examples/ioi_circuit.ipynb, executed through a real Jupyter kernel, exported, and drawn offline in headless Chromium.

The notebook (task → edge scores → circuit → faithfulness → roles → QK/OV of the top head) takes its model from
``$QKCIRCUITS_EXAMPLE_MODEL`` and its task from ``$QKCIRCUITS_EXAMPLE_TASK``: here ``toy-induction`` with the
induction task, whose circuit is known by construction (previous-token head 0.0 → the key of induction head
1.0 → the logits); SmolLM2 with IOI under ``-m smollm2``. Execution and export reuse tests/test_notebook.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import test_notebook as NBT
from test_browser import browser  # noqa: F401  (the shared headless-Chromium fixture)

NOTEBOOK = NBT.ROOT / "docs" / "examples" / "ioi_circuit.ipynb"
# plotly figures: the faithfulness curve, the circuit graph, QK, OV; one attention widget.
N_PLOTS, N_WIDGETS = 4, 1


def run(model: str, task: str, tmp: Path, monkeypatch):
    monkeypatch.setattr(NBT, "NOTEBOOK", NOTEBOOK)
    monkeypatch.setenv("QKCIRCUITS_EXAMPLE_TASK", task)     # the kernel's env: PYTHONPATH, model, this task
    return NBT.execute(model, tmp)


def outputs(nb):
    assert [o for c in nb.cells for o in c.get("outputs", []) if o["output_type"] == "error"] == []
    assert NBT.progress_chunks(nb) == []                     # progress: one line that disappears, nothing stored
    html = [o["data"]["text/html"] for c in nb.cells for o in c.get("outputs", []) if "text/html" in o.get("data", {})]
    joined = "".join(html)
    assert joined.count("/* qkcircuits: plotly from") == 1 and joined.count("/* qkcircuits: circuitsvis from") == 1
    assert re.findall(r"<(?:script|link|img|iframe)[^>]*\b(?:src|href)=", joined) == []
    figures = [h for h in html if "/* qkcircuits:" not in h and ("qk-plotly" in h or "qk-circuitsvis" in h)]
    assert len(figures) == N_PLOTS + N_WIDGETS, [h[:80] for h in figures]
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    return html, text


def test_committed_without_outputs():
    nb = json.loads(NOTEBOOK.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code and all(c["outputs"] == [] and c["execution_count"] is None for c in code)
    src = "".join("".join(c["source"]) for c in code)
    for name in ("QKCIRCUITS_EXAMPLE_MODEL", "QKCIRCUITS_EXAMPLE_TASK", "qk.tasks.ioi", "qk.edge_scores",
                 "qk.faithfulness", ".roles(", "qk.plot.circuit", "qk.plot.faithfulness", "qk.plot.qk", "qk.plot.ov"):
        assert name in src, name


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    tmp = tmp_path_factory.mktemp("circuit-nb")
    try:
        nb = run("toy-induction", "induction", tmp, mp)
    finally:
        mp.undo()
    path = tmp / "toy.html"
    NBT.export(nb, path)
    return nb, path


def test_notebook_runs_on_toy(toy_run):
    nb, _ = toy_run
    _, text = outputs(nb)
    # the circuit known by construction: the previous-token head feeds the induction head's key, which feeds the logits
    assert "0.0 -> 1.0 k" in text and "1.0 -> logits in" in text, text
    assert "top head: 1.0" in text, text


@pytest.mark.browser
def test_notebook_export_draws_offline(toy_run, browser):  # noqa: F811
    _, path = toy_run
    NBT.browse(browser, path, N_PLOTS, N_WIDGETS, hover_grid=False)


@pytest.mark.smollm2
@pytest.mark.browser
def test_notebook_smollm2_ioi(tmp_path, browser, monkeypatch):  # noqa: F811
    monkeypatch.setenv("QKCIRCUITS_EXAMPLE_N", "12")    # the notebook's path on the real model; docs/tasks.md has n = 64
    nb = run("smollm2-135m", "ioi", tmp_path, monkeypatch)
    _, text = outputs(nb)
    assert "name mover" in text, text
    path = tmp_path / "smollm2-ioi.html"
    NBT.export(nb, path)
    NBT.browse(browser, path, N_PLOTS, N_WIDGETS, shot="notebook-ioi-circuit.png", hover_grid=False)
