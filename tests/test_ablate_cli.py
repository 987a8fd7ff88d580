"""`qkcircuits ablate` on a tiny GPT-2 checkpoint: output, JSON, and one-line errors."""

from __future__ import annotations

import json

import pytest
import torch

import _tiny
import qkcircuits as qk
from qkcircuits.cli import main


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(_tiny.gpt2_dir(tmp_path_factory))


def test_ablate_heads_prints_and_writes_the_group_effect(folder, tmp_path, capsys):
    path = tmp_path / "out.json"
    rc = main(["ablate", folder, "--heads", "1.0,1.2", "--n-seqs", "2", "--seg-len", "8", "--device", "cpu",
               "--json", str(path)])
    assert rc == 0
    data = json.loads(path.read_text())
    assert {"model", "method", "metric", "baseline", "ablated", "effect", "heads"} <= set(data)
    assert (data["method"], data["metric"], data["heads"]) == ("zero", "induction-loss", ["1.0", "1.2"])
    # The same numbers as the API on the same prompts.
    model = qk.load(folder, device="cpu", verbose=False)
    tokens = qk.repeated_tokens(model, n_seqs=2, seg_len=8, seed=0)
    g = qk.group_effect(model, "1.0,1.2", tokens, "induction-loss")
    assert data["effect"] == pytest.approx(g.effect, abs=1e-6) and data["baseline"] == pytest.approx(g.baseline)
    assert "change" in capsys.readouterr().out


def test_ablate_sweep_json_has_a_layers_by_heads_grid(folder, tmp_path):
    path = tmp_path / "sweep.json"
    assert main(["ablate", folder, "--sweep", "--method", "mean", "--metric", "text-loss", "--n-seqs", "2",
                 "--seq-len", "8", "--device", "cpu", "--quiet", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert len(data["effects"]) == 2 and all(len(row) == 4 for row in data["effects"])
    assert (data["method"], data["metric"]) == ("mean", "text-loss") and isinstance(data["baseline"], float)
    model = qk.load(folder, device="cpu", verbose=False)
    res = qk.sweep(model, qk.text_tokens(model, seq_len=8, n_seqs=2), "text-loss", "mean", progress=False)
    torch.testing.assert_close(torch.tensor(data["effects"]), res.effects, atol=1e-6, rtol=0)


@pytest.mark.parametrize("argv, message", [
    (["--heads", "7.0"], "out of range"),
    (["--heads", ""], "no heads"),
    (["--heads", "1.0", "--method", "resample", "--n-seqs", "1", "--seg-len", "8"], "2 or more"),
    (["--heads", "1.0", "--seg-len", "40"], "exceeds the model's context"),
    (["--heads", "1.0", "--metric", "text-loss", "--seg-len", "8"], "rows take --seq-len"),
    (["--heads", "1.0", "--seq-len", "8"], "--metric induction-loss takes --seg-len"),
])
def test_bad_input_exits_2_with_one_line(folder, capsys, argv, message):
    assert main(["ablate", folder, "--device", "cpu", *argv]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "Loading weights" not in line]
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0]      # no traceback


def test_seg_len_sets_the_induction_prompts(folder, tmp_path, capsys):
    """--seg-len is the length of R; --seq-len (text-loss rows) with induction-loss is refused in one line."""
    out = tmp_path / "new.json"
    base = ["ablate", folder, "--heads", "1.0", "--n-seqs", "2", "--device", "cpu"]
    assert main([*base, "--seg-len", "6", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["n_positions"] == 1 + 2 * 6          # [BOS] + R + R with |R| = 6
    capsys.readouterr()
    assert main([*base, "--seq-len", "6"]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "Loading weights" not in line]
    assert len(err) == 1 and "--seq-len is the length of text-loss rows" in err[0]
