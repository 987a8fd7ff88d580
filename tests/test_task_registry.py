"""The task registry (issue 42, ask 2): ``qk.register_task`` and the ``qkcircuits.tasks`` entry point, loaded as
detector plugins are (whole or not at all, never taking another's name); every command's ``--task`` resolves
through it, and no module outside it matches a task by its name (counted here, as tests/test_arch_probes.py
counts architecture probes).

What counts as a match: a comparison (``==``, ``!=``, ``in``, ``not in``) of a task-like expression (a name or
attribute holding ``task`` or ``spec``, or ``.name``; not ``task.pattern``, the rows a task is read at) with a
registered task's name, a ``choices=`` holding one,
and a subscript or ``.get`` of a task's name that is not also a detector's or a pattern's (``"induction"`` is
both a task and a detector score; ``m["induction"]`` is the scan's heads). Not counted: a builder naming the task
it builds (``Task(..., "ioi", ...)``), and a default written once (``DEFAULT_TASK = "induction"``).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import qkcircuits as qk
from qkcircuits._tasks import registry

PACKAGE = Path(__file__).resolve().parents[1] / "qkcircuits"
TASKY = ("task", "spec")


def _tasky(node: ast.AST) -> bool:
    text = ast.unparse(node)
    if "pattern" in text:                   # a task's pattern ("induction": the rows it is read at), not its name
        return False
    return any(w in text.lower() for w in TASKY) or text.endswith(".name")


def _names_in(node: ast.AST, names) -> list:
    if isinstance(node, ast.Constant) and node.value in names:
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in names]
    return []


def task_name_matches(source: str, rel: str, names, data_names) -> list:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            found = [n for s in sides for n in _names_in(s, names)]
            if found and any(_tasky(s) for s in sides if not _names_in(s, names)):
                out.append((rel, node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.keyword) and node.arg == "choices" and _names_in(node.value, names):
            out.append((rel, node.value.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Subscript) and _names_in(node.slice, data_names):
            out.append((rel, node.lineno, ast.unparse(node)))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and node.args and _names_in(node.args[0], data_names)):
            out.append((rel, node.lineno, ast.unparse(node)))
    return out


def test_no_task_name_is_matched_outside_the_registry():
    names = set(qk.tasks.task_names())
    assert {"ioi", "induction"} <= names
    data_names = names - {d.name for d in qk.detectors()} - {"induction", "duplicate", "previous"}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        if rel != "qkcircuits/_tasks/registry.py":
            found += task_name_matches(path.read_text(encoding="utf-8"), rel, names, data_names)
    assert found == [], "\n".join(f"{f}:{line}: {code}" for f, line, code in found)
    # the counter sees the matches this issue removed (each one of its kinds)
    old = ('if args.task not in ("ioi", "induction"): pass\nif task.name == "induction": pass\n'
           'p.add_argument("--task", choices=("ioi",))\nt = m.get("ioi")\n')
    assert len(task_name_matches(old, "old.py", names, data_names)) == 4


def _build(model, *, n, seed):
    return qk.tasks.induction(model, n=n, seed=seed)


def test_register_task_builds_checks_and_never_takes_a_name(hand_built):
    spec = qk.register_task("repeat", _build, metric="prob-diff", roles=[qk.tasks.Role("copier", lambda e: True)])
    try:
        task = qk.tasks.build_task(hand_built, "repeat", n=3, seed=1)
        assert task.name == "repeat" and task.n == 3 and task.metric.name == "prob-diff"
        assert qk.tasks.task_spec("repeat") is spec and "repeat" in qk.tasks.task_names()
        with pytest.raises(qk.QKCircuitsError, match="a task named 'repeat' exists"):
            qk.register_task("repeat", _build)
        with pytest.raises(qk.QKCircuitsError, match="takes no BOS choice"):
            qk.tasks.build_task(hand_built, "repeat", n=3, prepend_bos=True)
        # declared roles name the heads (the rule here: every head)
        scores = qk.edge_scores(hand_built, task, method="eap", progress=False)
        roles = qk.roles(hand_built, task, scores.circuit(percent=100), qk=False)
        assert roles.roles and {r["role"] for r in roles.roles.values()} == {"copier"}
    finally:
        qk.tasks.unregister_task("repeat")
    with pytest.raises(qk.QKCircuitsError, match="unknown task 'repeat'; registered: ioi, induction"):
        qk.tasks.task_spec("repeat")
    with pytest.raises(qk.QKCircuitsError, match="declares position\\(s\\) YY"):
        qk.tasks.TaskSpec("bad", _build, positions=("YY",))(hand_built, n=2)
    with pytest.raises(qk.QKCircuitsError, match="a task name is a non-empty word"):
        qk.tasks.TaskSpec("two words", _build)


class _Entry:
    def __init__(self, name, value, obj):
        self.name, self.value, self._obj = name, value, obj

    def load(self):
        if isinstance(self._obj, Exception):
            raise self._obj
        return self._obj


def test_a_task_plugin_is_all_or_nothing_and_never_takes_a_registered_name():
    a, b = qk.tasks.TaskSpec("plug-a", _build), qk.tasks.TaskSpec("plug-b", _build)
    clash = qk.tasks.TaskSpec("ioi", _build)
    builtin = qk.tasks.task_spec("ioi")
    try:
        with pytest.warns(UserWarning) as seen:
            got = registry.load_plugins([_Entry("first", "p:first", [a]), _Entry("second", "q:second", [b, a]),
                                         _Entry("third", "r:third", [b, clash]), _Entry("gone", "s:x", ImportError("x")),
                                         _Entry("odd", "t:odd", [3])])
        assert got == ["plug-a"] and qk.tasks.task_spec("ioi") is builtin
        assert "plug-b" not in qk.tasks.task_names()
        assert [str(w.message).split(" was not loaded: ")[1] for w in seen] == [
            "QKCircuitsError: task 'plug-a' is already registered", "QKCircuitsError: task 'ioi' is already registered",
            "ImportError: x", "QKCircuitsError: it gave int, not a qk.tasks.TaskSpec"]
        assert registry.load_plugins([_Entry("first", "p:first", lambda: a)]) == ["plug-a"]   # its own: replaced
    finally:
        qk.tasks.unregister_task("plug-a")
        registry._plugins["by_entry"].pop("first = p:first")


def recipe() -> str:
    """The first python block of docs/architecture.md's "How to add a task": the module the package ships."""
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## How to add a task", 1)[1].split("\n## ", 1)[0]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_a_fresh_cli_process_runs_a_task_from_an_installed_package(tmp_path):
    (tmp_path / "mytasks").mkdir()
    (tmp_path / "mytasks" / "__init__.py").write_text(recipe())
    info = tmp_path / "mytasks-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mytasks\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[qkcircuits.tasks]\ncopy-first = mytasks:spec\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "qkcircuits", "circuit", "toy-induction", "--task", "copy-first",
                           "--n", "4", "--method", "exact", "--quiet", "--device", "cpu", "--json", "c.json"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    d = json.loads((tmp_path / "c.json").read_text())
    roles = {h: r["role"] for h, r in d["roles"].items()}
    # the hand-built model: 1.0 (the induction head) writes the copied token, 0.0 only feeds it
    assert roles.get("1.0") == "copy head" and roles.get("0.0") != "copy head", roles
    assert d["roles"]["1.0"]["why"] == "writes the copied token into the logits"


def test_greater_than_builds_answer_sets_and_the_years_positions(tmp_path_factory):
    """The tiny GPT-2's tokenizer writes years digit by digit (as SmolLM2's): the answer set is the digits above
    the start year's tens digit, the wrong set those below it, and the named positions hold the year's tokens."""
    from _tiny import gpt2_dir

    model = qk.load(str(gpt2_dir(tmp_path_factory)), verbose=False)
    tok = model.tokenizer
    task = qk.tasks.build_task(model, "greater-than", n=6, seed=3)
    assert task.name == "greater-than" and task.metric.name == "prob-diff"
    digit = {tok(str(d), add_special_tokens=False)["input_ids"][0]: d for d in range(10)}
    for i, text in enumerate(task.prompts):
        start = text.split("year ")[1][:4]
        tens = int(start[2])
        row = task.clean[i]
        word = {k: tok.decode([int(row[v[i]])]) for k, v in task.positions.items()}
        assert word["XX"] == start[1] and word["YY"] == start[2] and word["END"] == start[1]
        assert text.endswith(start[:2]) and text.split()[1].endswith(word["NOUN"].strip())
        assert sorted(digit[int(x)] for x in task.answer[i] if x >= 0) == list(range(tens + 1, 10))
        assert sorted(digit[int(x)] for x in task.wrong[i] if x >= 0) == list(range(tens))
        bad = tok.decode(task.corrupt[i][: int(task.positions["END"][i]) + 1])
        assert bad == text.replace(f"year {start}", f"year {start[:2]}0{start[3]}")
    with pytest.raises(qk.QKCircuitsError, match="no BOS choice|--bos no"):
        qk.tasks.build_task(model, "induction", n=2, prepend_bos=False)


def test_greater_than_through_circuit_and_attend_on_the_tiny_gpt2(tmp_path_factory, tmp_path, capsys):
    """``--task greater-than`` in ``circuit`` (answer sets end to end: the JSON's clean/corrupt are the task's
    prob-diff means from plain forwards) and ``attend`` (its named positions: END -> YY)."""
    from _tiny import gpt2_dir
    from qkcircuits._tasks.task import evaluate
    from qkcircuits.cli import main

    folder = str(gpt2_dir(tmp_path_factory))
    out, att = tmp_path / "c.json", tmp_path / "a.json"
    assert main(["circuit", folder, "--task", "greater-than", "--n", "4", "--holdout", "0", "--metric", "prob-diff", "--method", "eap",
                 "--percent", "20", "--quiet", "--device", "cpu", "--json", str(out), "--no-sign-check"]) == 0
    assert main(["attend", folder, "--head", "1.0", "--task", "greater-than", "--to", "YY", "--n", "4",
                 "--no-labels", "--device", "cpu", "--json", str(att)]) == 0
    err = capsys.readouterr().err
    assert "task greater-than, 4 prompts" in err
    d = json.loads(out.read_text())
    model = qk.load(folder, device="cpu", verbose=False)
    ref = evaluate(model, qk.tasks.build_task(model, "greater-than", n=4, metric="prob-diff"), warn=False)
    assert d["clean"] == pytest.approx(ref["clean"], abs=1e-5) and d["corrupt"] == pytest.approx(ref["corrupt"], abs=1e-5)
    a = json.loads(att.read_text())
    assert len(a["rows"]) == 4 and a["settings"]["positions"]["key"] == "YY", a["settings"]["positions"]
