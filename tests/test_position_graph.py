"""Position-aware graphs (issue 35 ask 4): edges (sender, receiver input, position group) over a task's named
positions, against ground truth.

- the patched run's identities per position group: every edge in at every group = the clean logits exactly, none
  = the corrupt logits exactly, the formula everywhere = the clean logits to 1e-5; a mask that agrees across the
  groups = the plain patched run; f(100 %) = 1 and f(0 %) = 0 of the position-aware curve;
- EAP / EAP-IG split by position add up over the groups to the plain scores (a float64 model: to the
  scores' float32 storage);
- the position-aware exact method against brute-force single-edge patching written here from the model's own
  hooks and weights (TransformerLens' W_Q/W_K/W_V/W_O, ln1/ln2/ln_final), not through the runs under test
  (Llama-GQA and GPT-NeoX's parallel blocks);
- the toy whose heads are known by construction: its induction head acts at END, its previous-token head at the
  other positions (the token after the earlier copy), exactly;
- pruning with one group is the plain pruning; circuits and scores survive JSON; the position-aware node view's
  one-forward path equals the patched run of its mask.

Families: GPT-2 (MHA, learned positions), Llama-GQA, GPT-NeoX (parallel blocks), Gemma-3 (post-attention norms).
"""

import pytest
import torch

import qkcircuits as qk
from qkcircuits._tasks import runs
from qkcircuits._tasks.faithfulness import circuit_metric, node_metric
from qkcircuits._tasks.positions import (OTHER, group_index, position_groups, position_node_mask, prune_positions)
from qkcircuits._tasks.scores import task_graph
from qkcircuits._tasks.selection import prune

from _tiny import gemma3_dir, gpt2_dir, llama_dir, neox_dir

FAMILIES = {"gpt2": gpt2_dir, "llama-gqa": llama_dir, "neox": neox_dir, "gemma3": gemma3_dir}


def named_task(model, n=4, p=9, seed=0):
    """Minimal pairs on random tokens (position p-3 resampled in the corrupt rows) with two named positions:
    ``X`` (the resampled token) and ``Y`` (a fixed early position), plus END."""
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(1, model.cfg.d_vocab, (n, p), generator=g)
    corrupt = clean.clone()
    corrupt[:, p - 3] = torch.randint(1, model.cfg.d_vocab, (n,), generator=g)
    answer = torch.randint(1, model.cfg.d_vocab, (n,), generator=g)
    pos = {"X": torch.full((n,), p - 3), "Y": torch.tensor([1, 2, 1, 2] * (n // 4) + [1] * (n % 4))}
    return qk.Task(clean, corrupt, answer, (answer + 7) % model.cfg.d_vocab, positions=pos)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    return request.param, qk.load(str(FAMILIES[request.param](tmp_path_factory)), verbose=False)


def test_position_groups_name_every_position_once(hand_built):
    clean = torch.arange(12).view(2, 6)
    t = qk.Task(clean, clean.flip(1), [1, 2], [3, 4], positions={"A": torch.tensor([1, 4]), "B": torch.tensor([1, 2]),
                                                                 "END": torch.tensor([5, 3])})
    groups = position_groups(t)
    assert groups == ("A", "B", "END", OTHER)
    idx = group_index(t, groups)
    # row 0: A and B both point at 1 (the first name wins); row 1: END at 3, the padding after it is "other"
    assert idx.tolist() == [[3, 0, 3, 3, 3, 2], [3, 3, 1, 2, 0, 3]]
    assert position_groups(["END"], t) == ("END", OTHER)
    assert qk.graph(hand_built, positions=t).positions == groups
    with pytest.raises(qk.QKCircuitsError, match="not one of the task's named positions"):
        position_groups(["Q"], t)
    with pytest.raises(qk.QKCircuitsError, match="needs the task"):
        position_groups(True)
    with pytest.raises(qk.QKCircuitsError, match="cannot name a position group"):
        position_groups(qk.Task(clean, clean, [1, 2], [3, 4], positions={"a@b": torch.tensor([0, 0])}))
    with pytest.raises(qk.QKCircuitsError, match="cannot name a position group"):
        position_groups(qk.Task(clean, clean, [1, 2], [3, 4], positions={OTHER: torch.tensor([0, 0])}))


def test_position_patched_run_identities(family):
    name, model = family
    task = named_task(model)
    g = task_graph(model, task, positions=True)
    assert g.n_groups == 4 and g.n_edges == 4 * int(g.valid.sum())
    pos = group_index(task, g.positions)
    corr = runs.record(model, g, task, task.corrupt)
    with torch.no_grad():
        clean_logits, corrupt_logits = model(task.clean), model(task.corrupt)
    full = g.valid[None].repeat(g.n_groups, 1, 1)
    everything = runs.patched_run(model, g, task, corr, full[None], return_logits=True, positions=pos)
    assert torch.equal(everything, clean_logits), name
    formula = runs.patched_run(model, g, task, corr, full[None], force_split=True, return_logits=True, positions=pos)
    assert (formula - clean_logits).abs().max() < 1e-5, name
    nothing = runs.patched_run(model, g, task, corr, torch.zeros_like(full)[None], return_logits=True, positions=pos)
    assert torch.equal(nothing, corrupt_logits), name
    # a mask that agrees across the groups is the plain circuit
    gen = torch.Generator().manual_seed(1)
    plain = (torch.rand(g.valid.shape, generator=gen) < 0.5) & g.valid
    plain[g.senders.index("emb")] = g.valid[g.senders.index("emb")]
    same = runs.patched_run(model, g, task, corr, plain[None, None].expand(1, g.n_groups, -1, -1), positions=pos)
    torch.testing.assert_close(same, runs.patched_run(model, g, task, corr, plain[None]), rtol=1e-5, atol=1e-5)
    # a mask that differs by group is neither: only one group in, the others out, moves the metric
    only_x = torch.zeros_like(full)
    only_x[g.positions.index("X")] = plain
    part = runs.patched_run(model, g, task, corr, only_x[None], positions=pos)
    assert not torch.allclose(part, same)
    with pytest.raises(qk.QKCircuitsError, match="needs the group of each"):
        runs.patched_run(model, g, task, corr, full[None])
    # the curve of position-aware scores: the same definition, the same end points
    scores = qk.edge_scores(model, task, method="eap", progress=False, positions=True)
    f = qk.faithfulness(model, task, scores, sizes=(0, 5, 20, 100), progress=False)
    assert f.curve[100.0] == 1.0 and f.curve[0.0] == 0.0
    assert f.circuit.position_mask is not None and f.n_edges[100.0] <= g.n_edges


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
def test_position_scores_add_up_to_the_plain_scores(name, tmp_path_factory):
    # a float64 model: the identity Σ_γ Σ_{p∈γ} Δ·∇ = Σ_p Δ·∇ holds to float64 rounding; what is left is the
    # scores' own float32 storage (one rounding per group: ≤ 4 groups × 2^-23 relative)
    model = qk.load(str(FAMILIES[name](tmp_path_factory)), verbose=False, dtype="float64")
    task = named_task(model, n=6)
    for method, steps in (("eap", 1), ("eap-ig", 3)):
        plain = qk.edge_scores(model, task, method=method, steps=steps, progress=False)
        split = qk.edge_scores(model, task, method=method, steps=steps, progress=False, positions=True)
        g = split.graph
        assert split.position_scores.shape == (4, g.n_senders, g.n_receivers)
        total = split.position_scores.double().nansum(0)
        err = float((total - plain.scores.double().nan_to_num()).abs().max())
        assert err <= 5e-7 * float(plain.scores.nan_to_num().abs().max()), (name, method, err)
        # every group carries part of it: the named positions are where the corrupt rows differ (X) and before
        assert float(split.position_scores[g.positions.index("X")].nan_to_num().abs().max()) > 1e-3
        nodes = split.node_scores()
        for s in g.senders:
            assert sum(nodes[f"{s}@{p}"] for p in g.positions) == pytest.approx(plain.node_scores()[s], abs=1e-7)
        # the position-aware scores survive JSON
        back = qk.results.EdgeScores.from_json(split.to_json())
        assert back.graph == g and torch.equal(back.position_scores.nan_to_num(-9.0), split.position_scores.nan_to_num(-9.0))


def _brute_force(model, task, g, edges):
    """m(clean) − m(clean with only receiver r reading sender s's corrupt output at the positions of group γ),
    per edge (γ, s, r): one forward each, the receiver's input recomputed here (a plain model without
    post-attention norms)."""
    with torch.no_grad():
        _, cc = model.run_with_cache(task.clean)
        _, kc = model.run_with_cache(task.corrupt)
        base = task.metric_sum(model(task.clean), task.clean)
    pos = group_index(task, g.positions)

    def out(cache, s):
        name = g.senders[s]
        if name == "emb":
            return cache["blocks.0.hook_resid_pre"]
        if name.startswith("mlp"):
            return cache[f"blocks.{int(name[3:])}.hook_mlp_out"]
        L, h = map(int, name.split("."))
        return cache[f"blocks.{L}.attn.hook_z"][:, :, h] @ model.blocks[L].attn.W_O[h]

    got = []
    for gi, s, r in edges:
        delta = (out(cc, s) - out(kc, s)) * (pos == gi)[..., None]                 # Δ_s at γ's positions only
        rname, x = g.receivers[r]
        if rname == "logits":
            hook, fn = "unembed.hook_in", lambda t, hook, d=delta: torch.where(
                (pos == gi)[..., None], model.ln_final(cc["ln_final.hook_in"] - d), t)
        elif rname.startswith("mlp"):
            L = int(rname[3:])
            res = cc[f"blocks.{L}.hook_resid_mid"] if not g.parallel else cc[f"blocks.{L}.hook_resid_pre"]
            ln = model.blocks[L].ln2
            hook, fn = f"blocks.{L}.mlp.hook_in", lambda t, hook, d=delta, res=res, ln=ln: torch.where(
                (pos == gi)[..., None], ln(res - d), t)
        else:
            L, j = int(rname.split(".")[0]), int(rname.split(".")[1].replace("kv", ""))
            attn = model.blocks[L].attn
            W, bias = getattr(attn, f"W_{x.upper()}")[j], getattr(attn, f"b_{x.upper()}", None)

            def fn(t, hook, d=delta, L=L, j=j, W=W, bias=bias):
                t = t.clone()
                new = model.blocks[L].ln1(cc[f"blocks.{L}.hook_resid_pre"] - d) @ W
                new = new + (bias[j] if bias is not None else 0)
                t[:, :, j] = torch.where((pos == gi)[..., None], new, t[:, :, j])
                return t
            hook = f"blocks.{L}.attn.hook_{x}"
        with torch.no_grad():
            changed = task.metric_sum(model.run_with_hooks(task.clean, fwd_hooks=[(hook, fn)]), task.clean)
        got.append(float(base - changed) / task.n)
    return torch.tensor(got, dtype=torch.float64)


@pytest.mark.parametrize("name", ["llama-gqa", "neox"])
def test_position_exact_equals_brute_force_patching(name, tmp_path_factory):
    model = qk.load(str(FAMILIES[name](tmp_path_factory)), verbose=False)
    task = named_task(model, n=4, p=8)
    exact = qk.edge_scores(model, task, method="exact", progress=False, positions=["X"])
    g = exact.graph
    assert g.positions == ("X", OTHER)
    gg, ss, rr = g.valid[None].expand(g.n_groups, -1, -1).nonzero(as_tuple=True)
    # every edge into the logits and into layer 1's k/v of KV head 1, and a random sample of the rest
    gen = torch.Generator().manual_seed(0)
    pick = torch.randperm(len(gg), generator=gen)[:30]
    into = torch.tensor([g.receivers[int(r)][0] in ("logits", "1.kv1", "1.1") and g.receivers[int(r)][1] != "q"
                         for r in rr])
    chosen = torch.cat([pick, into.nonzero().squeeze(1)]).unique()
    edges = [(int(gg[i]), int(ss[i]), int(rr[i])) for i in chosen]
    want = _brute_force(model, task, g, edges)
    have = torch.tensor([float(exact.position_scores[e]) for e in edges], dtype=torch.float64)
    assert float(want.abs().max()) > 1e-3
    torch.testing.assert_close(have, want, rtol=1e-4, atol=2e-5)


def test_toy_heads_act_where_they_are_built_to(hand_built):
    # the toy's previous-token head 0.0 writes tok[i-1] at position i, which the induction head 1.0's KEY reads at
    # the token after the earlier copy (an "other" position); 1.0 writes the answer at END, the only position
    # the metric reads. So, exactly: 1.0 acts at END and nowhere else, 0.0 at the other positions and not at END.
    task = qk.tasks.induction(hand_built, n=8, seg_len=6)
    ns = qk.node_scores(hand_built, task, method="exact", positions=True, progress=False).scores
    full = ns["1.0@END"]
    assert full > 1
    assert ns["1.0@other"] == 0.0 and ns["0.0@END"] == 0.0
    assert ns["0.0@other"] == pytest.approx(full, rel=1e-6)
    eap = qk.edge_scores(hand_built, task, method="eap-ig", steps=3, progress=False, positions=True)
    # ranked by |score|: under the left rule the toy's saturated edges score ±1e-4, their signs are noise
    c = eap.circuit(edges=4, by="abs")
    assert set(c.position_nodes) >= {"0.0@other", "1.0@END"} and c.heads == ["0.0", "1.0"]
    assert ("1.0@END", "logits@END", "in") in {e[:3] for e in c.edges()}
    assert qk.results.TaskCircuit.from_json(c.to_json()).edges() == c.edges()
    # grown from the logits, position by position: the same four edges
    greedy = eap.circuit(edges=4, by="abs", how="greedy")
    assert {e[:3] for e in greedy.edges()} == {e[:3] for e in c.edges()}


def test_pruning_with_one_group_is_the_plain_pruning():
    gen = torch.Generator().manual_seed(0)
    for shape in [(2, 4, 2, True, False), (3, 4, 4, True, True), (2, 4, 1, False, False)]:
        for ungrouped in (False, True):
            g = qk.tasks.Graph(*shape[:4], parallel=shape[4], ungrouped=ungrouped and shape[2] != shape[1])
            for q in (0.05, 0.2, 0.6):
                mask = (torch.rand(g.valid.shape, generator=gen) < q) & g.valid
                assert torch.equal(prune_positions(g, mask[None])[0], prune(g, mask))
    # two groups: an MLP's input read at one group is not fed by the embedding's write at the other
    g = qk.tasks.Graph(1, 1, 1, True, positions=("A", OTHER))
    mask = torch.zeros(2, g.n_senders, g.n_receivers, dtype=torch.bool)
    mask[0, 0, g.recv_slice(0, "mlp").start] = True                       # emb → mlp0 at A
    mask[1, g.mlp_sender(0), g.logits_receiver] = True                     # mlp0 → logits at other
    assert not prune_positions(g, mask).any()
    mask[0, g.mlp_sender(0), g.logits_receiver] = True                     # … and at A: a path at A
    kept = prune_positions(g, mask)
    assert kept[0].sum() == 2 and not kept[1].any()


def test_position_node_view_one_forward_equals_the_patched_run(family, monkeypatch):
    name, model = family
    task = named_task(model)
    g = task_graph(model, task, positions=True)
    keep = ["0.1@X", "0.2@END", "1.0", "1.3@other"]
    m, clean, corrupt = node_metric(model, task, keep)
    (want,), c2, k2 = circuit_metric(model, task, [position_node_mask(g, keep)], task.n, g=g)
    assert m == pytest.approx(want, abs=1e-5) and clean == pytest.approx(c2, abs=1e-5)
    assert corrupt == pytest.approx(k2, abs=1e-6)
    every = [f"{L}.{h}" for L in range(g.n_layers) for h in range(g.n_heads)]
    assert node_metric(model, task, [f"{h}@{p}" for h in every for p in g.positions])[0] == pytest.approx(clean, abs=1e-5)
    none_kept = node_metric(model, task, ["0.0@X"])[0]
    only = node_metric(model, task, ["0.0"])[0]         # 0.0 at every group: differs from 0.0 at X only
    assert none_kept != pytest.approx(only, abs=1e-6)
    with pytest.raises(qk.QKCircuitsError, match="not one of the graph's position groups"):
        node_metric(model, task, ["0.0@S2"])
