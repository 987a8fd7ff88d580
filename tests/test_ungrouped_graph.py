"""The ungrouped graph (issue 35 ask 6): k/v inputs per QUERY head, as the EAP-IG authors and MIB count edges.

- counts: SmolLM2-135M has 123,211 edges ungrouped against 70,651 grouped (the reference's and MIB's numbers);
- identities on grouped-query models (Llama-GQA, Llama-MQA, Gemma-3 with post-attention norms): the ungrouped EAP
  k/v scores of a KV head's query heads add up to its grouped score (every other edge's score is unchanged); every
  edge in = the clean logits and none = the corrupt logits, exactly; f(100 %) = 1, f(0 %) = 0;
- an ungrouped mask whose k/v edges agree across a group is the grouped circuit;
- an edge into ONE query head's k changes only that head's output: the other heads of its group keep their clean
  z, and that head's z is the grouped run's with the whole group's k patched (its keys are the only thing it reads
  from the group's k);
- on a model without grouped-query attention the ungrouped graph is the grouped one (GPT-2: same edges, scores
  bit for bit);
- EAP-IG on activations, clean-corrupted and EAP-IG's left rule keep the group-sum identity, and their ungrouped
  position-aware scores add up over the groups to the ungrouped ones (Llama-GQA, 1e-6 of the largest score).
"""

import pytest
import torch

import qkcircuits as qk
from qkcircuits._tasks import runs
from qkcircuits._tasks.graph import Graph

from _tiny import gemma3_dir, gpt2_dir, llama_dir, llama_mqa_dir

GQA = {"llama-gqa": llama_dir, "mqa": llama_mqa_dir, "gemma3": gemma3_dir}


def pair_task(model, n=4, p=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(1, model.cfg.d_vocab, (n, p), generator=g)
    corrupt = clean.clone()
    corrupt[:, p - 3] = torch.randint(1, model.cfg.d_vocab, (n,), generator=g)
    answer = torch.randint(1, model.cfg.d_vocab, (n,), generator=g)
    return qk.Task(clean, corrupt, answer, (answer + 7) % model.cfg.d_vocab)


@pytest.fixture(scope="module", params=list(GQA))
def gqa_model(request, tmp_path_factory):
    return request.param, qk.load(str(GQA[request.param](tmp_path_factory)), verbose=False)


def test_smollm2_edge_counts():
    # SmolLM2-135M: 30 layers x 9 query heads, 3 KV heads, MLPs (the reference's and MIB's count: 123,211)
    grouped, ungrouped = Graph(30, 9, 3, True), Graph(30, 9, 3, True, ungrouped=True)
    assert (grouped.n_edges, ungrouped.n_edges) == (70_651, 123_211)
    assert ungrouped.n_receivers == 30 * (9 * 3 + 1) + 1 and ungrouped.receivers[9:11] == (("0.0", "k"), ("0.1", "k"))
    assert Graph.from_dict(ungrouped.to_dict()) == ungrouped and Graph.from_dict(grouped.to_dict()) == grouped


def test_ungrouped_identities(gqa_model):
    name, model = gqa_model
    task = pair_task(model)
    gg, gu = qk.graph(model), qk.graph(model, gqa="ungrouped")
    assert gu.ungrouped and gu.n_kv_in == gu.n_heads and gu.n_edges > gg.n_edges
    corr = runs.record(model, gu, task, task.corrupt)
    with torch.no_grad():
        clean_logits, corrupt_logits = model(task.clean), model(task.corrupt)
    assert torch.equal(runs.patched_run(model, gu, task, corr, gu.valid[None], return_logits=True), clean_logits)
    formula = runs.patched_run(model, gu, task, corr, gu.valid[None], force_split=True, return_logits=True)
    assert (formula - clean_logits).abs().max() < 1e-5, name
    assert torch.equal(runs.patched_run(model, gu, task, corr, torch.zeros_like(gu.valid)[None], return_logits=True),
                       corrupt_logits)
    # EAP: a KV head's grouped k/v score is the sum of its query heads' ungrouped ones; q, MLP and logits edges agree
    grouped = qk.edge_scores(model, task, method="eap", progress=False)
    split = qk.edge_scores(model, task, method="eap", progress=False, gqa="ungrouped")
    assert split.graph == gu
    scale = float(grouped.scores.nan_to_num().abs().max())
    for L in range(gu.n_layers):
        for x in ("k", "v"):
            per_query = split.scores[:, gu.recv_slice(L, x)].nan_to_num()
            summed = per_query.view(gu.n_senders, gu.n_kv, gu.group).sum(-1)
            assert float((summed - grouped.scores[:, gg.recv_slice(L, x)].nan_to_num()).abs().max()) < 1e-6 * scale
        for x in ("q", "mlp"):
            if x == "mlp" and not gu.has_mlp:
                continue
            torch.testing.assert_close(split.scores[:, gu.recv_slice(L, x)], grouped.scores[:, gg.recv_slice(L, x)],
                                       equal_nan=True, rtol=1e-5, atol=1e-6 * scale)
    f = qk.faithfulness(model, task, split, sizes=(0, 10, 100), progress=False)
    assert f.curve[100.0] == 1.0 and f.curve[0.0] == 0.0
    back = qk.results.EdgeScores.from_json(split.to_json())
    assert back.graph == gu and torch.equal(back.scores.nan_to_num(-9.0), split.scores.nan_to_num(-9.0))
    c = split.circuit(percent=30, how="greedy")
    assert qk.results.TaskCircuit.from_json(c.to_json()).edges() == c.edges()


def test_ungrouped_mask_that_agrees_across_a_group_is_the_grouped_circuit(gqa_model):
    name, model = gqa_model
    task = pair_task(model)
    gg, gu = qk.graph(model), qk.graph(model, gqa="ungrouped")
    corr = runs.record(model, gg, task, task.corrupt)
    gen = torch.Generator().manual_seed(2)
    for q in (0.3, 0.7):
        mg = (torch.rand(gg.valid.shape, generator=gen) < q) & gg.valid
        mg[0] = gg.valid[0]
        mu = torch.zeros_like(gu.valid)
        for L in range(gg.n_layers):                     # q and MLP columns copied, k/v copied to each query head
            for x in ("q", "k", "v") + (("mlp",) if gg.has_mlp else ()):
                src = mg[:, gg.recv_slice(L, x)]
                mu[:, gu.recv_slice(L, x)] = src if x in ("q", "mlp") else src.repeat_interleave(gu.group, 1)
        mu[:, gu.logits_receiver] = mg[:, gg.logits_receiver]
        torch.testing.assert_close(runs.patched_run(model, gu, task, corr, mu[None]),
                                   runs.patched_run(model, gg, task, corr, mg[None]), rtol=1e-5, atol=1e-5)


def test_an_edge_into_one_query_heads_key_changes_only_that_head(gqa_model):
    name, model = gqa_model
    task = pair_task(model)
    gg, gu = qk.graph(model), qk.graph(model, gqa="ungrouped")
    corr = runs.record(model, gg, task, task.corrupt)
    L, h = gg.n_layers - 1, 1
    kv = h // gg.group
    s = gg.senders.index("emb")
    z = {}

    def grab(key):
        def fn(t, hook):
            z[key] = t.detach().clone()
        return fn

    mu = gu.valid.clone()
    mu[s, gu.recv_slice(L, "k").start + h] = False
    mg = gg.valid.clone()
    mg[s, gg.recv_slice(L, "k").start + kv] = False
    for key, g, m in (("u", gu, mu), ("g", gg, mg), ("clean", gg, gg.valid)):
        with model.hooks(fwd_hooks=[(f"blocks.{L}.attn.hook_z", grab(key))]):
            runs.patched_run(model, g, task, corr, m[None])
    others = [j for j in range(gg.n_heads) if j != h]
    assert float((z["u"][:, :, h] - z["clean"][:, :, h]).abs().max()) > 1e-4        # the edge carries something
    torch.testing.assert_close(z["u"][:, :, others], z["clean"][:, :, others], rtol=0, atol=1e-6)
    torch.testing.assert_close(z["u"][:, :, h], z["g"][:, :, h], rtol=1e-5, atol=1e-6)
    if name != "llama-gqa":
        return
    # the exact score of that edge is the metric change of this run
    exact = qk.edge_scores(model, task, method="exact", progress=False, gqa="ungrouped")
    want = float(runs.patched_run(model, gu, task, corr, gu.valid[None]).mean()
                 - runs.patched_run(model, gu, task, corr, mu[None]).mean())
    assert float(exact.scores[s, gu.recv_slice(L, "k").start + h]) == pytest.approx(want, abs=1e-5)


def test_without_grouped_query_attention_ungrouped_is_grouped(tmp_path_factory):
    model = qk.load(str(gpt2_dir(tmp_path_factory)), verbose=False)
    task = pair_task(model)
    assert qk.graph(model, gqa="ungrouped") == qk.graph(model)
    a = qk.edge_scores(model, task, method="eap", progress=False)
    b = qk.edge_scores(model, task, method="eap", progress=False, gqa="ungrouped")
    assert torch.equal(a.scores.nan_to_num(-9.0), b.scores.nan_to_num(-9.0)) and a.graph == b.graph
    with pytest.raises(qk.QKCircuitsError, match="gqa must be one of grouped, ungrouped"):
        qk.graph(model, gqa="per-query")


def test_an_attention_that_cannot_take_keys_per_query_head_is_refused(gqa_model, monkeypatch):
    from contextlib import contextmanager

    from qkcircuits._tasks import ungrouped

    name, model = gqa_model
    if name != "llama-gqa":
        pytest.skip("one family is enough for the refusals")
    task = pair_task(model)
    gu = qk.graph(model, gqa="ungrouped")
    # a module that does not say how many query heads share a KV head: refused before any run
    hf = model.blocks[0].attn.original_component
    monkeypatch.setattr(hf, "num_key_value_groups", 3)
    with pytest.raises(qk.QKCircuitsError, match="num_key_value_groups = 2"):
        with ungrouped.per_query_kv(model, gu):
            pass
    monkeypatch.setattr(hf, "num_key_value_groups", 2)
    # an attention that ignores the setting (it would expand the per-query-head keys again): the first shard's
    # check fails with one line, before any score is computed

    @contextmanager
    def ignored(model, g):
        yield

    monkeypatch.setattr(ungrouped, "per_query_kv", ignored)
    with pytest.raises(qk.QKCircuitsError, match="does not take k/v per query head"):
        qk.edge_scores(model, task, method="eap", progress=False, gqa="ungrouped")


@pytest.mark.parametrize("method", ["eap-ig-activations", "clean-corrupted", "eap-ig"])
def test_every_gradient_method_keeps_both_identities(gqa_model, method):
    # issue 35's other gradient methods (left rule by default; activations: right) on the graph options: the
    # ungrouped k/v scores of a KV head's query heads add up to its grouped score, and the ungrouped position-aware
    # scores summed over the groups are the ungrouped ones (both: the same Δ·∇ sums, split)
    name, model = gqa_model
    if name != "llama-gqa":
        pytest.skip("one family is enough: the identities are the EAP test's above")
    pos = {"X": torch.full((4,), 6)}
    t = pair_task(model)
    task = qk.Task(t.clean, t.corrupt, t.answer, t.wrong, positions=pos)
    grouped = qk.edge_scores(model, task, method=method, steps=2, progress=False)
    ung = qk.edge_scores(model, task, method=method, steps=2, progress=False, gqa="ungrouped")
    split = qk.edge_scores(model, task, method=method, steps=2, progress=False, gqa="ungrouped", positions=True)
    gg, gu = grouped.graph, ung.graph
    scale = float(grouped.scores.nan_to_num().abs().max())
    assert scale > 1e-3 and split.graph.positions == ("X", "END", "other") and split.rule == grouped.rule
    for L in range(gg.n_layers):
        for x in ("k", "v"):
            summed = ung.scores[:, gu.recv_slice(L, x)].nan_to_num().view(gg.n_senders, gg.n_kv, gg.group).sum(-1)
            torch.testing.assert_close(summed, grouped.scores[:, gg.recv_slice(L, x)].nan_to_num(), rtol=0,
                                       atol=1e-6 * scale)
    torch.testing.assert_close(split.position_scores.nansum(0), ung.scores.nan_to_num(), rtol=0, atol=1e-6 * scale)
