"""scripts/main_scan.py (what ``bash scripts/dev.sh scan`` runs): one model load and one corpus pass for scan +
diagnose + report, outputs the same as the three separate ``qkcircuits`` commands."""

from __future__ import annotations

import json
from pathlib import Path

import _tiny
import pytest

from qkcircuits._foundation import model as model_module
from qkcircuits._weights import contextual as C
from qkcircuits.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]


def _script():
    import _cli

    return _cli.script("main_scan")


def test_one_load_one_corpus_pass_and_the_same_outputs_as_three_commands(tmp_path, tmp_path_factory, monkeypatch):
    folder = str(_tiny.llama_dir(tmp_path_factory))
    loads, passes = [], []
    real_load, real_run, real_pass = model_module.load, C.corpus_stats, C._corpus_pass

    def counting_load(*a, **k):
        loads.append(a)
        return real_load(*a, **k)

    monkeypatch.setattr(model_module, "load", counting_load)

    def counting_stats(model, refresh=False):
        return real_run(model, refresh)

    def counting_pass(model):                    # a real corpus pass (not one remembered)
        passes.append(id(model))
        return real_pass(model)

    monkeypatch.setattr(C, "corpus_stats", counting_stats)
    monkeypatch.setattr(C, "_corpus_pass", counting_pass)
    out = tmp_path / "out"
    out.mkdir()
    assert _script().run(["--model", folder, "--out", str(out), "--stem", "tiny", "--confirm", "1", "--prompt", "the cat sat. the cat sat.", "--quiet"]) == 0
    assert len(loads) == 1 and len(passes) == 1
    for suffix in ("scan.json", "scan.csv", "diagnostics.json", "diagnostics.txt", "report.html"):
        assert (out / f"tiny-{suffix}").stat().st_size > 0, suffix
    assert "heads flagged" in (out / "tiny-diagnostics.txt").read_text()
    assert "<html" in (out / "tiny-report.html").read_text()[:2000].lower()
    # the same scan and diagnostics as the separate commands (fresh loads)
    ref = tmp_path / "ref"
    ref.mkdir()
    assert cli_main(["scan", folder, "--text", "--confirm", "1", "--json", str(ref / "s.json"), "--quiet"]) == 0
    assert cli_main(["diagnose", folder, "--json", str(ref / "d.json")]) == 0
    ours, theirs = json.loads((out / "tiny-scan.json").read_text()), json.loads((ref / "s.json").read_text())
    assert ours["scores"] == theirs["scores"] and ours["extras"] == theirs["extras"]
    d_ours, d_ref = json.loads((out / "tiny-diagnostics.json").read_text()), json.loads((ref / "d.json").read_text())
    assert {k: v for k, v in d_ours.items() if k != "settings"} == {k: v for k, v in d_ref.items() if k != "settings"}


def test_a_bad_argument_is_one_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(SystemExit) as e:
        _script().run(["--out", str(out), "--n-seqs", "zero"])
    assert e.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1
    assert list(out.iterdir()) == []
