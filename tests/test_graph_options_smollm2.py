"""SmolLM2-135M on the ungrouped and position-aware graphs (issue 35 asks 4 and 6): the reference's edge count and
the identities on the real model (2 IOI prompts, EAP: one gradient run per graph; the graph check runs once, on
the ungrouped graph, where it also checks that the attention takes k/v per query head)."""

from __future__ import annotations

import pytest
import torch

import qkcircuits as qk

pytestmark = pytest.mark.smollm2


def test_smollm2_ungrouped_and_position_graphs(smollm2):
    task = qk.tasks.ioi(smollm2, n=2, seed=0)
    gu = qk.graph(smollm2, gqa="ungrouped")
    assert (gu.n_edges, gu.n_receivers) == (123_211, 30 * (9 * 3 + 1) + 1)      # the EAP-IG authors' and MIB's count
    plain = qk.edge_scores(smollm2, task, method="eap", progress=False, check=False)
    scale = float(plain.scores.nan_to_num().abs().max())
    # ungrouped: a KV head's k/v score is the sum of its three query heads'
    ung = qk.edge_scores(smollm2, task, method="eap", progress=False, gqa="ungrouped")
    g = plain.graph
    for L in (0, 17, 29):
        for x in ("k", "v"):
            summed = ung.scores[:, gu.recv_slice(L, x)].nan_to_num().view(g.n_senders, 3, 3).sum(-1)
            assert float((summed - plain.scores[:, g.recv_slice(L, x)].nan_to_num()).abs().max()) < 1e-5 * scale
    # position-aware: split by IO, S1, S1+1, S2, END, other; the groups add up to the plain scores
    pos = qk.edge_scores(smollm2, task, method="eap", progress=False, positions=True, check=False)
    assert pos.graph.positions == ("IO", "S1", "S1+1", "S2", "END", "other")
    err = float((pos.position_scores.nansum(0) - plain.scores.nan_to_num()).abs().max())
    assert err < 1e-5 * scale
    # the metric reads END only: every edge into the logits scores exactly 0 at the other groups
    into_logits = pos.position_scores[:, :, g.logits_receiver]
    assert torch.equal(into_logits[[0, 1, 2, 3, 5]], torch.zeros_like(into_logits[[0, 1, 2, 3, 5]]))
    assert float(into_logits[4].abs().max()) > 0.1
