"""``qkcircuits trace``: summary lines, the JSON contract, and one-line errors with nothing written."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from qkcircuits import cli


def test_trace_cli_summary_and_json_contract(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert cli.main(["trace", "toy-induction", "--quiet", "--top", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    # "1.0 reads its keys from 0.0 (previous-token; effect 1.00 of the clean 1.00; next sender 0.00; baseline mean 0.50)"
    assert re.search(r"1\.0 reads its keys from 0\.0 \(previous-token; effect 1\.00 of the clean 1\.00; next sender "
                     r"-?0\.00; baseline mean 0\.50\)", text), text
    d = json.loads(out.read_text())
    assert d["model"] and d["method"] == "mean"
    assert d["metrics"] == {"q": "induction", "k": "induction", "v": "direct-logit"}
    r = d["receivers"]["1.0"]
    assert r["clean"] == pytest.approx(1.0, abs=1e-3)
    for x in "qkv":
        assert set(r[x]) == {"0.0", "0.1"}                      # every sender, as "layer.head", nothing else
        assert set(r["baseline"][x]) == {"mean", "p95"}
    assert r["k"]["0.0"] == pytest.approx(1.0, abs=1e-3)
    assert "k_composition_spearman" in r
    assert d["labels"]["0.0"] == ["previous-token"]


def test_trace_cli_receivers_method_into_and_attribution(tmp_path, capsys):
    out = tmp_path / "a.json"
    assert cli.main(["trace", "toy-induction", "--quiet", "--receivers", "1.0", "--into", "k", "--method", "zero",
                     "--attribution", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["kind"] == "attribution" and d["method"] == "zero" and set(d["metrics"]) == {"k"}
    assert "edge attribution" in capsys.readouterr().out


@pytest.mark.parametrize("args,msg", [
    (["--into", "x"], "--into: expected a comma-separated subset of q,k,v"),
    (["--receivers", "0.0"], "is in layer 0"),
    (["--receivers", "7.0"], "layer"),
    (["--method", "median"], "invalid choice"),
])
def test_trace_cli_errors_are_one_line(args, msg, tmp_path):
    out = tmp_path / "t.json"
    p = subprocess.run([sys.executable, "-m", "qkcircuits", "trace", "toy-induction", "--quiet", "--json", str(out),
                        *args], capture_output=True, text=True)
    assert p.returncode == 2, p.stderr
    err = [line for line in p.stderr.splitlines() if line.startswith("error")]
    assert len(err) == 1 and msg in err[0], p.stderr
    assert "Traceback" not in p.stderr and not out.exists()


def test_trace_cli_unwritable_json_fails_before_work(tmp_path):
    p = subprocess.run([sys.executable, "-m", "qkcircuits", "trace", "toy-induction", "--json",
                        str(tmp_path / "missing" / "t.json")], capture_output=True, text=True)
    assert p.returncode == 2 and "does not exist" in p.stderr
