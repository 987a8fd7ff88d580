"""Bootstrap intervals of the faithfulness curve, CPR and CMD over prompts (issue 35 ask 7).

- the per-row metrics the bootstrap resamples are the ones the curve's means come from (their means ARE the
  curve's values), and the point estimates do not change when a bootstrap is asked for;
- the 95 % interval covers the point estimate, is reproducible with a seed, and shrinks with more prompts
  (synthetic rows of known spread, and a tiny model's task at 16 vs 64 prompts);
- f(100 %) = 1 and f(0 %) = 0 in every resample (those circuits ARE the clean and the corrupt run).
"""

import pytest
import torch

import _tiny
import qkcircuits as qk
from qkcircuits._tasks.bootstrap import bootstrap_curve
from qkcircuits._tasks.faithfulness import circuit_metric
from qkcircuits._tasks.selection import select

from _tiny import llama_dir


def contrast_task(model, n, p=10, seed=0):
    return _tiny.contrast_task(model, n, p, seed)


def test_synthetic_rows_cover_and_shrink():
    # clean ~ 2 + N(0, 1), corrupt ~ N(0, 1), a circuit ~ half of clean: f near 0.5 with a known spread
    def rows(n, seed):
        g = torch.Generator().manual_seed(seed)
        clean, corrupt = 2 + torch.randn(n, generator=g), torch.randn(n, generator=g)
        half = (clean + corrupt) / 2 + 0.3 * torch.randn(n, generator=g)
        return torch.stack([corrupt, half, clean]), clean, corrupt

    xs = [0.0, 0.5, 1.0]
    widths = []
    for n in (16, 256):
        masks, clean, corrupt = rows(n, 1)
        b = bootstrap_curve(xs, masks, clean, corrupt, n=400, seed=0)
        f_half = float((masks[1].mean() - corrupt.mean()) / (clean.mean() - corrupt.mean()))
        cpr = 0.25 * (0 + f_half) + 0.25 * (f_half + 1)
        assert b["cpr"][0] <= cpr <= b["cpr"][1] and b["curve"]["50"][0] <= f_half <= b["curve"]["50"][1]
        assert b["curve"]["0"] == [0.0, 0.0] and b["curve"]["100"] == [1.0, 1.0]
        assert b == bootstrap_curve(xs, masks, clean, corrupt, n=400, seed=0)          # seeded
        widths.append(b["cpr"][1] - b["cpr"][0])
    assert widths[1] < widths[0] / 2                  # 16x the rows: about 1/4 the width
    with pytest.raises(qk.QKCircuitsError, match="bootstrap must be an integer >= 0"):
        bootstrap_curve(xs, masks, clean, corrupt, n=-1)


def test_faithfulness_bootstrap_on_a_tiny_model(tmp_path_factory):
    model = qk.load(str(llama_dir(tmp_path_factory)), verbose=False)
    sizes = (0, 5, 20, 50, 100)
    widths = []
    for n in (16, 64):
        task = contrast_task(model, n)
        scores = qk.edge_scores(model, task, method="eap", progress=False)
        plain = qk.faithfulness(model, task, scores, sizes=sizes, progress=False)
        f = qk.faithfulness(model, task, scores, sizes=sizes, progress=False, bootstrap=200, seed=3)
        assert f.curve == pytest.approx(plain.curve, abs=1e-6) and f.cpr == pytest.approx(plain.cpr, abs=1e-6)
        b = f.bootstrap
        assert b["n"] == 200 and b["seed"] == 3 and b["kept"] == 200
        assert b["cpr"][0] <= f.cpr <= b["cpr"][1] and b["cmd"][0] <= f.cmd <= b["cmd"][1]
        assert b["curve"]["100"] == pytest.approx([1.0, 1.0]) and b["curve"]["0"] == pytest.approx([0.0, 0.0])
        for p, v in f.curve.items():
            lo, hi = b["curve"][f"{p:g}"]
            assert lo - 1e-9 <= v <= hi + 1e-9, p
        widths.append(b["cpr"][1] - b["cpr"][0])
        # the rows the bootstrap resamples are the curve's: their means are its metric values
        per_row = {}
        circuits = [select(scores, percent=p) for p in sizes]
        values, clean, corrupt = circuit_metric(model, task, [c.mask for c in circuits], 7, per_row=per_row)
        assert per_row["masks"].shape == (len(sizes), n)
        assert per_row["masks"].mean(1).tolist() == pytest.approx(values, abs=1e-6)
        assert float(per_row["clean"].mean()) == pytest.approx(clean, abs=1e-6)
        assert float(per_row["corrupt"].mean()) == pytest.approx(corrupt, abs=1e-6)
        back = qk.results.Faithfulness.from_json(f.to_json())
        assert back.bootstrap["cpr"] == pytest.approx(b["cpr"], abs=1e-6)
    assert widths[1] < widths[0]                      # more prompts, a narrower interval
    with pytest.raises(qk.QKCircuitsError, match="bootstrap must be"):
        qk.faithfulness(model, task, scores, bootstrap=-1, progress=False)
