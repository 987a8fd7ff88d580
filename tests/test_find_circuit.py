"""``qk.find_circuit``: the whole circuit pipeline as one library call, the one ``qkcircuits circuit`` runs (issue 42
ask 4). The toy's induction circuit is known by construction (0.0 previous-token → 1.0 induction)."""

from __future__ import annotations

import json

import pytest

import qkcircuits as qk
from qkcircuits.cli import main

ARGS = dict(n=8, method="exact")            # exact scores: the toy's EAP-IG ranking is ±1e-4 (docs/tasks.md)


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """The command's stdout and --json file, and the library call with the same arguments."""
    out = tmp_path_factory.mktemp("find") / "c.json"
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        rc = main(["circuit", "toy-induction", "--task", "induction", "--n", "8", "--method", "exact", "--json",
                   str(out), "--quiet", "--device", "cpu"])
    assert rc == 0
    report = qk.find_circuit("toy-induction", "induction", progress=False, **ARGS)
    return buf.getvalue(), json.loads(out.read_text()), report


def _timeless(d):
    d = json.loads(json.dumps(d))
    d.pop("timing")
    d["core"].pop("seconds")
    return d


def test_the_library_call_prints_and_writes_what_the_command_does(cli_run):
    stdout, file, report = cli_run
    assert stdout.rstrip("\n").splitlines() == report.summary
    assert repr(report) == "\n".join(report.summary)
    assert _timeless(file) == _timeless(report.to_dict())
    # the numbers a notebook reads, known by construction
    assert report.core["heads"] == ["0.0", "1.0"] and report.roles["1.0"]["role"] == "direct-logit head"
    assert report.curve[100.0] == pytest.approx(1.0) and report.warnings == []
    assert report.scores is not None and report.edge_circuit.heads == ["0.0", "1.0"]
    assert report.core_circuit.heads == report.core["heads"]


def test_the_report_round_trips_and_the_views_read_it(cli_run, tmp_path):
    _, _, report = cli_run
    back = qk.load_result(report.to_json(tmp_path / "r.json"))
    assert type(back) is qk.results.CircuitReport and back.data == report.data and back.summary == report.summary
    assert back.scores is None                       # the objects are the call's, not the file's
    assert back.top(1) == report.top(1) and back.top(1)[0][0] == ("emb", "1.0", "v")
    assert list(report.to_frame().columns) == ["sender", "receiver", "input", "score"]
    fig = qk.plot.circuit(report)                     # the report as the views take the command's file
    names = {t.name for t in fig.data if getattr(t, "name", None)}
    assert fig.data and names
    assert "<pre>" in report._repr_html_() and "direct-logit head" in report._repr_html_()


def test_a_task_object_is_split_as_a_files_rows(hand_built):
    task = qk.tasks.induction(hand_built, n=9, seed=3)
    report = qk.find_circuit(hand_built, task, method="exact", core=False, progress=False)
    h = report["holdout"]
    assert (h["n"], h["selection_n"], h["how"]) == (3, 6, "a seeded random part of the file's rows")
    assert report["n_prompts"] == 9 and report.core is None and report["roles_of"] == "circuit"
    # the same rows given by name are a fresh draw instead: another split, the same behaviour
    by_name = qk.find_circuit(hand_built, "induction", n=9, seed=3, method="exact", core=False, progress=False)
    assert by_name["holdout"]["how"] == "a fresh draw of the generator"
    assert report["circuit"]["heads"] == by_name["circuit"]["heads"] == ["0.0", "1.0"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(method="eapig"), "method must be one of eap-ig, eap, exact"),
    (dict(edges=4, percent=5), "edges or percent, not both"),
    (dict(percent=0), "percent must be a number in (0, 100]"),
    (dict(holdout=1.5), "holdout must be a fraction"),
    (dict(resamples=2, core=False), "--resamples compares the draws' core circuits"),
    (dict(rule="left", method="eap"), "applies to --method eap-ig"),
    (dict(n=0), "n must be an integer >= 1"),
])
def test_bad_arguments_are_one_line_before_anything_loads(kwargs, message):
    with pytest.raises(qk.QKCircuitsError) as e:
        qk.find_circuit("no-such-model-is-loaded", "induction", **kwargs)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_task_that_is_neither_a_name_a_file_nor_a_task_is_refused():
    for bad in (5, None, ["ioi"]):
        with pytest.raises(qk.QKCircuitsError, match="task must be a registered task's name, a .jsonl path or"):
            qk.find_circuit("toy-induction", bad)
    with pytest.raises(qk.QKCircuitsError, match="no-such-task"):
        qk.find_circuit("toy-induction", "no-such-task")
