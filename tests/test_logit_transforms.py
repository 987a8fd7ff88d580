"""Logits the model transforms after its unembedding (Gemma-2's final soft-cap ``cap · tanh(logits / cap)``):
every named task metric is computed from ``unembed.hook_in`` (``record._metric_rows`` unembeds only each row's
END position), so it must apply the same transform as the model's forward. Checked against transformers' own
forward of the same checkpoint (independent of the bridge), and the graph check refuses a transform it cannot
reproduce instead of scoring wrong logits."""

import pytest
import torch

import qkcircuits as qk
from qkcircuits._tasks import runs

from _tiny import GEMMA2_FINAL_CAP, gemma2_dir, hf_model


def _hf_logit_diff(hf, task, tokens):
    with torch.no_grad():
        logits = hf(tokens).logits.double()
    rows = torch.arange(task.n)
    end = logits[rows, task.positions["END"]]
    return end[rows, task.answer] - end[rows, task.wrong], logits


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    folder = gemma2_dir(tmp_path_factory)
    return qk.load(str(folder), verbose=False), hf_model(folder)


def test_task_metrics_on_gemma2_are_the_soft_capped_logits_of_transformers(gemma2):
    model, hf = gemma2
    task = qk.tasks.induction(model, n=6, seg_len=5)
    clean, logits = _hf_logit_diff(hf, task, task.clean)
    corrupt, _ = _hf_logit_diff(hf, task, task.corrupt)
    # the soft-cap is doing something here: the uncapped logits reach past it
    uncapped = GEMMA2_FINAL_CAP * torch.atanh((logits / GEMMA2_FINAL_CAP).clamp(-1 + 1e-7, 1 - 1e-7))
    assert float(uncapped.abs().max()) > 1.2 * float(logits.abs().max())
    for method in ("exact", "eap"):
        s = qk.edge_scores(model, task, method=method, progress=False)
        assert abs(s.clean - float(clean.mean())) < 1e-4, method
        assert abs(s.corrupt - float(corrupt.mean())) < 1e-4, method
    # the per-row metric of the corrupt record, and the full circuit's (the clean run)
    g = qk.graph(model)
    corr = runs.record(model, g, task, task.corrupt)
    torch.testing.assert_close(corr.rows.double(), corrupt, atol=1e-4, rtol=0)
    full = runs.patched_run(model, g, task, corr, g.valid[None])[0]
    torch.testing.assert_close(full.double(), clean, atol=1e-4, rtol=0)
    f = qk.faithfulness(model, task, s, sizes=(0, 50, 100), progress=False)
    assert f.curve[0.0] == 0.0 and f.curve[100.0] == 1.0


def test_a_logit_transform_the_graph_cannot_reproduce_is_refused(gemma2, monkeypatch):
    # were the adapter's post-unembedding transform unknown (here: hidden), the named metric would read uncapped
    # logits: the graph check compares them with the model's own and refuses in one line
    model, _ = gemma2
    monkeypatch.setattr(model.adapter, "apply_output_logits_transform", lambda logits: logits)
    task = qk.tasks.induction(model, n=4, seg_len=5)
    with pytest.raises(qk.QKCircuitsError, match="does not reproduce this model's logits"):
        qk.edge_scores(model, task, method="eap", progress=False)
