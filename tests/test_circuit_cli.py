"""``qkcircuits circuit`` (issue 17 ask 6) and roles (ask 5) on the toy, a local HF folder and a GGUF file."""

import json

import pytest

import qkcircuits as qk
from qkcircuits.cli import main

from _tiny import gguf_path, gpt2_dir

KEYS = {"model", "task", "n_prompts", "metric", "clean", "corrupt", "method", "steps", "curve", "cpr", "cmd",
        "circuit", "roles", "timing"}


def test_toy_induction_end_to_end(tmp_path, capsys):
    # exact scores: the toy's two saturated-softmax edges are ±1e-4 under EAP-IG (docs/tasks.md), so its signed
    # EAP-IG ranking is no test of the command
    out = tmp_path / "c.json"
    rc = main(["circuit", "toy-induction", "--task", "induction", "--n", "8", "--method", "exact", "--json", str(out),
               "--csv", str(tmp_path / "c.csv"), "-o", str(tmp_path / "c.html"), "--quiet", "--device", "cpu"])
    assert rc == 0
    got = capsys.readouterr()
    text = got.out
    assert "clean logit-diff" in text and "CPR" in text and "direct-logit head 1.0" in text
    # the first line of the run (stderr, before any work) and of the summary say how the prompts start
    assert "BOS id 0 prepended (induction prompts always start with BOS)" in got.err.splitlines()[0]
    assert text.splitlines()[0].startswith("toy-induction: task induction") and "warning" not in text
    d = json.loads(out.read_text())
    assert KEYS <= set(d)
    assert set(d["circuit"]) >= {"edges", "heads", "node_faithfulness"}
    assert d["circuit"]["heads"] == ["0.0", "1.0"] and d["curve"]["100"] == 1.0
    assert all(isinstance(e[0], str) and isinstance(e[3], float) for e in d["circuit"]["edges"])
    assert {tuple(e[:3]) for e in d["circuit"]["edges"]} >= {("0.0", "1.0", "k"), ("1.0", "logits", "in")}
    assert d["roles"]["1.0"]["role"] == "direct-logit head"
    assert d["roles"]["1.0"]["evidence"]["direct_share"] == pytest.approx(1.0, abs=1e-3)
    assert float(d["curve"]["20"]) == pytest.approx(1.0, abs=1e-4) and d["bos_prepended"] is True
    assert d["bos"] == {"prepended": True, "mode": "yes"} and d["warnings"] == [] and d["circuit"]["named"] is True
    rows = (tmp_path / "c.csv").read_text().splitlines()
    assert rows[0] == "sender,receiver,input,score,in_circuit" and len(rows) == 1 + 29
    # -o: the report's own circuit section (the same blocks as report --circuit on this JSON), no other section
    from test_circuit_view import section
    from qkcircuits.viz._report import report_sections
    from qkcircuits.viz._circuit_data import load_circuit

    page = (tmp_path / "c.html").read_text(encoding="utf-8")
    got = section(page, "circuit-section")
    want = report_sections(load_circuit(out), None, None, None, None)[0]
    assert got["blocks"] == json.loads(json.dumps(want["blocks"])) and got["title"] == want["title"]
    assert d["core"]["heads"] == ["0.0", "1.0"] and d["core"]["node_faithfulness"] == 1
    assert {b["type"] for b in got["blocks"]} >= {"note", "figures", "table"} and "graph" in got and "curve" in got


def test_timing_flag(capsys):
    assert main(["circuit", "toy-induction", "--task", "induction", "--n", "4", "--quiet", "--device", "cpu",
                 "--timing"]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("timing:")]
    assert len(line) == 1
    for step in ("load", "edge scores", "faithfulness", "circuit", "roles", "total"):
        assert f" {step} " in line[0], line


@pytest.mark.parametrize("argv,message", [
    (["--task", "nope.jsonl"], "expected a registered task (ioi, induction"),
    (["--task", "induction", "--percent", "0"], "expected a percent"),
    (["--task", "induction", "--method", "magic"], "invalid choice"),
])
def test_bad_input_is_one_line_exit_2(argv, message, capsys, tmp_path):
    rc = main(["circuit", "toy-induction", *argv, "--quiet"])       # argument errors too: exit 2, no SystemExit
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_jsonl_task_on_a_local_hf_folder(tmp_path_factory, tmp_path, capsys):
    folder = gpt2_dir(tmp_path_factory)
    lines = [{"clean": "the old town", "corrupt": "the new town", "answer": " would", "wrong": " asked"},
             {"clean": "them and their", "corrupt": "them and the", "answer": " old", "wrong": " new"}]
    task_file = tmp_path / "pairs.jsonl"
    task_file.write_text("\n".join(json.dumps(x) for x in lines))
    out = tmp_path / "c.json"
    assert main(["circuit", str(folder), "--task", str(task_file), "--method", "eap", "--percent", "20",
                 "--json", str(out), "--quiet", "--device", "cpu"]) == 0
    d = json.loads(out.read_text())
    assert d["task"] == "pairs" and d["n_prompts"] == 2 and d["method"] == "eap" and d["bos_prepended"] is False
    assert d["circuit"]["percent"] == 20.0 and d["circuit"]["edges"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(lines[0]) + "\n" + json.dumps({**lines[1], "answer": " would asked"}) + "\n")
    assert main(["circuit", str(folder), "--task", str(bad), "--quiet", "--device", "cpu"]) == 2
    assert "bad.jsonl line 2: answer ' would asked' is 2 tokens" in capsys.readouterr().err
    # the same prompts with answer and wrong swapped: the model does not do that task. The summary on stdout STARTS
    # with the warning (one line, the CLI's own words, naming the causes to check), stderr had it once when found,
    # the JSON holds it, and neither a circuit nor roles are named (unless --force)
    assert main(["circuit", str(folder), "--task", str(task_file), "--method", "eap", "--percent", "20",
                 "--quiet", "--device", "cpu", "--no-sign-check"]) == 0
    got = capsys.readouterr()
    assert "warning" not in got.err and "warning" not in got.out
    swapped = tmp_path / "swapped.jsonl"
    swapped.write_text("\n".join(json.dumps({**x, "answer": x["wrong"], "wrong": x["answer"]}) for x in lines))
    out = tmp_path / "swapped.json"
    assert main(["circuit", str(folder), "--task", str(swapped), "--method", "eap", "--percent", "20", "--json",
                 str(out), "--quiet", "--device", "cpu", "--no-sign-check"]) == 0
    got = capsys.readouterr()
    first = got.out.splitlines()[0]
    assert first.startswith("warning: the model does not do task 'swapped': clean logit-diff ")
    for cause in ("no BOS is prepended (auto: what the tokenizer does on its own", "the answer tokens (row 0: answer "
                  "' asked'", "the metric's direction (logit-diff: higher is better"):
        assert cause in first, cause
    assert sum("does not do task" in x for x in got.out.splitlines()) == 1
    assert sum("does not do task" in x for x in got.err.splitlines()) == 1
    assert "no circuit named" in got.out and "no roles named" in got.out and "name mover" not in got.out
    d = json.loads(out.read_text())
    assert len(d["warnings"]) == 1 and d["warnings"][0] in first and d["roles"] == {}
    assert d["circuit"]["named"] is False and d["circuit"]["edges"] == []
    # with progress bars (no --quiet): the warning is printed after every bar has closed, so no redraw ('\r' + a
    # bar) follows it on its line: what a terminal shows of that line is the whole warning
    assert main(["circuit", str(folder), "--task", str(swapped), "--method", "eap", "--percent", "20", "--device",
                 "cpu", "--no-sign-check"]) == 0
    got = capsys.readouterr()
    shown = [x for x in got.err.split("\n") if "does not do task" in x]
    assert len(shown) == 1 and shown[0].split("\r")[-1].startswith("warning: the model does not do task 'swapped'")
    assert got.out.startswith("warning: the model does not do task 'swapped'")
    # --force names them anyway; the warning stays
    assert main(["circuit", str(folder), "--task", str(swapped), "--method", "eap", "--percent", "20", "--json",
                 str(out), "--quiet", "--device", "cpu", "--no-sign-check", "--force"]) == 0
    got = capsys.readouterr()
    d = json.loads(out.read_text())
    assert got.out.startswith("warning: the model does not do task") and d["circuit"]["named"] is True
    assert d["circuit"]["edges"] and d["roles"]
    # clean = corrupt: f has no value, which is said in words (not a line of NaNs), and the JSON holds nulls
    same = tmp_path / "same.jsonl"
    same.write_text("\n".join(json.dumps({**x, "corrupt": x["clean"]}) for x in lines))
    out = tmp_path / "same.json"
    assert main(["circuit", str(folder), "--task", str(same), "--method", "eap", "--json", str(out), "--quiet",
                 "--device", "cpu", "--no-sign-check"]) == 0
    got = capsys.readouterr()
    assert "faithfulness is undefined: clean and corrupt logit-diff are equal" in got.out and "nan%" not in got.out
    assert "faithfulness f by percent" not in got.out and "f undefined: the largest grid size, 100%" in got.out
    d = json.loads(out.read_text())
    assert d["cpr"] is None and set(d["curve"].values()) == {None}


def test_gguf_file(tmp_path_factory, tmp_path):
    out = tmp_path / "g.json"
    assert main(["circuit", str(gguf_path(tmp_path_factory)), "--task", "induction", "--n", "4", "--method", "eap",
                 "--edges", "10", "--json", str(out), "--quiet", "--device", "cpu"]) == 0
    d = json.loads(out.read_text())
    assert d["graph"]["n_kv_heads"] == 2 and d["circuit"]["requested_edges"] == 10
    assert any(e[1].split(".")[-1].startswith("kv") for e in d["circuit"]["edges"] if e[2] in ("k", "v")) or \
        all(e[2] not in ("k", "v") for e in d["circuit"]["edges"])


def test_roles_name_ioi_classes_from_evidence(hand_built):
    # A hand-made IOI-shaped task on the toy: positions named as IOI's; the induction head 1.0 at END attends
    # the token after the earlier copy, which plays "IO" here, so it is a name mover by its evidence.
    import torch

    base = qk.tasks.induction(hand_built, n=6, seg_len=6)
    L = 6
    end = torch.full((6,), 2 * L - 1)
    positions = {"END": end, "IO": torch.full((6,), L), "S1": torch.full((6,), 2), "S1+1": torch.full((6,), 3),
                 "S2": torch.full((6,), L + 2)}
    task = qk.Task(base.clean, base.corrupt, base.answer, base.wrong, positions=positions, name="ioi-like")
    scores = qk.edge_scores(hand_built, task, method="exact", progress=False)
    r = qk.roles(hand_built, task, scores.circuit(edges=4))
    ev = r.roles["1.0"]["evidence"]
    assert r.roles["1.0"]["role"] == "name mover" and ev["END->IO"] > 0.99 and ev["direct_share"] > 0.99
    # 0.0 attends to the previous token; its exact edge scores on this task are tiny next to 1.0's, so its
    # role is the pattern only when its node effect is large, else "minor" with the pattern as evidence
    assert r.roles["0.0"]["evidence"]["S1+1->S1"] > 0.99
    assert r.roles["0.0"]["evidence"]["patterns"] == ["previous-token head"]
    assert r.roles["0.0"]["role"] in ("previous-token head", "minor")
    assert any(s.startswith("name mover 1.0") for s in r.sentences())


def test_core_is_printed_first_and_written_with_bootstrap(tmp_path, capsys):
    # the core circuit (its contract: heads, mlps, node_faithfulness, curve, how) before the edge circuit's curve;
    # the roles are the core's; --bootstrap adds intervals of CPR / CMD
    out = tmp_path / "c.json"
    # exact scores: the toy's saturated edges have noise signs under EAP-IG's left rule (the default), whose curve
    # reaches 0.8 only at 100 % (no edge circuit named then)
    assert main(["circuit", "toy-induction", "--task", "induction", "--n", "8", "--method", "exact", "--bootstrap",
                 "30", "--json", str(out), "--quiet", "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert text.index("core circuit: 2 heads, node f 1.000") < text.index("faithfulness f by percent")
    assert text.index("direct-logit head 1.0") < text.index("faithfulness f by percent")
    assert "CPR 0.850 [95 % interval 0.850-0.850]" in text and "intervals from 30 resamples" in text
    d = json.loads(out.read_text())
    core = d["core"]
    assert {"heads", "mlps", "node_faithfulness", "curve", "how"} <= set(core)
    assert core["heads"] == ["0.0", "1.0"] and core["mlps"] == [] and core["node_faithfulness"] == 1.0
    assert core["curve"]["2"] == 1.0 and "every node left is needed" in core["how"]
    assert d["roles_of"] == "core" and d["roles"]["1.0"]["in_circuit"] is True
    assert d["bootstrap"]["n"] == 30 and d["bootstrap"]["cpr"] == pytest.approx([0.85, 0.85], abs=1e-6)
    assert main(["circuit", "toy-induction", "--task", "induction", "--n", "8", "--method", "exact", "--no-core",
                 "--json", str(out), "--quiet", "--device", "cpu"]) == 0
    d = json.loads(out.read_text())
    assert "core" not in d and d["roles_of"] == "circuit" and "core circuit" not in capsys.readouterr().out
