"""Circuit selection (``how="top"`` / ``"greedy"``) on hand-set scores whose answer is known by construction."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

import qkcircuits as qk
from qkcircuits._tasks.selection import select


def _scores(g, values):
    sc = torch.zeros(g.n_senders, g.n_receivers)
    for (s, r, x), v in values.items():
        sc[g.senders.index(s), g.receivers.index((r, x))] = v
    sc[~g.valid] = float("nan")
    return SimpleNamespace(graph=g, scores=sc, model="toy")


def test_greedy_grows_from_the_logits_where_top_prunes_to_nothing(hand_built):
    g = qk.graph(hand_built)
    s = _scores(g, {("emb", "0.1", "q"): 10.0,          # the largest edge feeds a head that feeds nothing
                    ("1.0", "logits", "in"): 5.0, ("emb", "1.0", "v"): 4.0, ("0.0", "1.0", "k"): 3.0,
                    ("emb", "0.0", "v"): 2.0, ("emb", "0.1", "k"): -9.0})
    # top 2 = emb -> 0.1 q (no path on to the logits) and 1.0 -> logits (1.0 reads nothing): both pruned
    assert select(s, edges=2, how="top").n_edges == 0
    # greedy: 1.0 -> logits first, then the best edge into 1.0's inputs; never an edge into 0.1
    assert {e[:3] for e in select(s, edges=2, how="greedy").edges()} == {("1.0", "logits", "in"), ("emb", "1.0", "v")}
    four = select(s, edges=4, how="greedy")
    assert {e[:3] for e in four.edges()} == {("1.0", "logits", "in"), ("emb", "1.0", "v"), ("0.0", "1.0", "k"),
                                             ("emb", "0.0", "v")}
    assert four.heads == ["0.0", "1.0"] and four.how == "greedy"
    # |score| ranks the -9 edge into 0.1's k above the others, but greedy reaches 0.1 only through a reader
    assert all(e[1] != "0.1" for e in select(s, edges=6, how="greedy", by="abs").edges())
    assert select(s, edges=g.n_edges, how="greedy").n_edges == g.n_edges
    with pytest.raises(qk.QKCircuitsError, match="how must be"):
        select(s, edges=2, how="best")


def test_a_kv_edge_adds_only_the_group_heads_the_circuit_uses():
    # Grouped-query graph, 4 query heads on 2 KV heads: emb -> 1.kv0 v feeds heads 1.0 and 1.1, but only 1.1
    # writes on to the logits, so the circuit uses 1.1 alone (1.0 reads that value and carries nothing on).
    from qkcircuits._tasks.graph import Graph

    g = Graph(2, 4, 2, True, "gqa")
    s = _scores(g, {("emb", "1.kv0", "v"): 5.0, ("1.1", "logits", "in"): 3.0})
    c = select(s, edges=2)
    assert {e[:3] for e in c.edges()} == {("emb", "1.kv0", "v"), ("1.1", "logits", "in")}
    assert c.heads == ["1.1"]
    # an unpruned mask whose KV edge has none of its group in the circuit still names the group
    mask = torch.zeros_like(g.valid)
    mask[g.senders.index("emb"), g.receivers.index(("1.kv1", "k"))] = True
    c = replace(c, mask=mask)
    assert c.heads == ["1.2", "1.3"]


def _prune_reference(g, mask):
    """The first prune (one sender at a time, plain loops): the reference the vectorised one must equal."""
    from qkcircuits._tasks.selection import _consumers

    S, R = g.n_senders, g.n_receivers
    cons = [_consumers(g, r) for r in range(R)]
    reach = torch.zeros(S, dtype=torch.bool)
    reach[0] = True
    feeds = [[] for _ in range(S)]
    for r in range(R):
        for c in cons[r]:
            if c >= 0:
                feeds[c].append(r)
    for s in range(1, S):
        reach[s] = any(bool((mask[:, r] & reach).any()) for r in feeds[s])
    useful = torch.zeros(S, dtype=torch.bool)
    recv_useful = torch.zeros(R, dtype=torch.bool)
    recv_useful[g.logits_receiver] = True
    for s in range(S - 1, -1, -1):
        outs = mask[s].nonzero().flatten().tolist()
        for r in outs:
            if not recv_useful[r]:
                recv_useful[r] = any(c >= 0 and bool(useful[c]) for c in cons[r])
        useful[s] = any(bool(recv_useful[r]) for r in outs)
    for r in range(R):
        recv_useful[r] = recv_useful[r] or any(c >= 0 and bool(useful[c]) for c in cons[r])
    return mask & reach[:, None] & recv_useful[None, :]


@pytest.mark.parametrize("shape", [(3, 4, 4, True, False), (4, 6, 2, True, False), (3, 4, 1, True, False),
                                   (3, 4, 4, True, True), (2, 2, 2, False, False)])
def test_prune_equals_the_path_definition_on_random_masks(shape):
    # layers, heads, KV heads, MLPs, parallel blocks: GQA, MQA, parallel and attention-only graphs, masks from
    # nearly empty to nearly full
    from qkcircuits._tasks.selection import prune
    from qkcircuits._tasks.graph import Graph

    g = Graph(*shape[:4], parallel=shape[4])
    gen = torch.Generator().manual_seed(sum(shape))
    for q in (0.02, 0.05, 0.1, 0.3, 0.7, 1.0):
        for _ in range(4):
            mask = (torch.rand(g.valid.shape, generator=gen) < q) & g.valid
            assert torch.equal(prune(g, mask), _prune_reference(g, mask)), (shape, q)
