"""SmolLM2-135M does IOI: the built-in task on its tokenizer, and the graph's size (issue 17)."""

from __future__ import annotations

import pytest
import torch

import qkcircuits as qk
from qkcircuits._tasks.task import evaluate

pytestmark = pytest.mark.smollm2


def test_ioi_on_smollm2(smollm2):
    task = qk.tasks.ioi(smollm2, n=16, seed=0)
    tok = smollm2.tokenizer
    assert not task.bos and tok.decode(task.clean[0, :task.positions["END"][0] + 1]) == task.prompts[0]
    assert len(qk.tasks.single_tokens(smollm2, qk.tasks.NAMES)) >= 30
    out = evaluate(smollm2, task)
    assert out["clean"] > 3.0 and abs(out["corrupt"]) < 1.0          # measured: +4.35 / -0.20 on 64 prompts
    with torch.no_grad():
        logits = smollm2(task.clean)
    rows = torch.arange(task.n)
    last = logits[rows, task.positions["END"]]
    assert (last[rows, task.answer] > last[rows, task.wrong]).float().mean() >= 0.9   # IO beats S


def test_smollm2_graph_size(smollm2):
    g = qk.graph(smollm2)
    assert (g.n_nodes, g.n_receivers, g.n_edges) == (302, 481, 70651)
