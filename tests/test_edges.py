"""Edge attribution against finite differences of the exact path-patching computation, and its result type."""

from __future__ import annotations

import pytest
import torch

import _tiny
import qkcircuits as qk
from qkcircuits import QKCircuitsError
from qkcircuits._paths.patching import Scorer, clean_pass, receiver_run, references, resolve_metric, sender_deltas


def _finite_difference(model, toks, receiver, sender, into, eps):
    """(m(resid + ε·Δ) − m(resid)) / ε through the exact receiver run: the derivative the estimate must match."""
    cache = clean_pass(model, toks, [receiver.layer], need_final=into == "v")
    repl = references(model, "mean", toks, [sender.layer])
    delta = sender_deltas(model, cache, repl, [sender])
    m = resolve_metric(None, into)
    scorer = Scorer(model, cache, receiver.layer, [receiver.head], m)
    with torch.no_grad():
        pattern, z = receiver_run(cache, receiver.layer, into, torch.cat([0 * delta, eps * delta, -eps * delta]))
        s = scorer.sums(pattern, z, 3)[:, 0].double() / scorer.count()
    return float((s[1] - s[2]) / (2 * eps))          # central difference: the linear term


@pytest.mark.parametrize("which", ["gpt2", "llama", "gemma3", "neox", "gptj"])
def test_edge_attribution_is_the_derivative_of_exact_path_patching(which, tmp_path_factory):
    # neox / gptj: parallel blocks; GPT-J's bridge fires hook_z BEFORE hook_pattern (scored once both are in)
    folder = {"gpt2": _tiny.gpt2_dir, "llama": _tiny.llama_dir, "gemma3": _tiny.gemma3_dir, "neox": _tiny.neox_dir,
              "gptj": _tiny.gptj_dir}[which](tmp_path_factory)
    model = qk.load(str(folder), device="cpu", verbose=False)
    toks = qk.repeated_tokens(model, n_seqs=3, seg_len=9, seed=1)
    last = model.cfg.n_layers - 1
    recv = [qk.Head(last, 0), qk.Head(last, 1), qk.Head(last, 3)]     # heads 0, 1 share a KV group on GQA
    recv += [qk.Head(1, 2)] if last > 1 else []                      # Gemma-3: a sliding and a global layer
    senders = [qk.Head(0, 2), qk.Head(last - 1, 1)]
    est = qk.edge_attribution(model, recv, senders=senders, tokens=toks)
    checked = 0
    for i, r in enumerate(recv):
        for s in senders:
            if s.layer >= r.layer:
                continue
            for x in "qkv":
                # Δ is exact (mean ablation) and small changes scale it: the estimate is −(d/dε) m(resid + εΔ).
                # (For post-norm models Δ itself is the exact norm(y + δ) − norm(y), linear scaling of it is what
                # the gradient contracts with.)
                fd = -_finite_difference(model, toks, r, s, x, 1e-2)
                got = float(est.effects[x][i, s.layer, s.head])
                assert abs(got - fd) < 2e-3 * max(1.0, abs(fd)) + 1e-4, (which, r, s, x, got, fd)
                checked += abs(fd) > 1e-4
    assert checked >= 4           # not all ~0: the comparison could not pass vacuously
    assert est.kind == "attribution" and est.metrics == {"q": "induction", "k": "induction", "v": "direct-logit"}


def _loss_difference(model, toks, receiver, sender, into, eps):
    """d/dε of path_patch's loss metric (receiver's z patched, the layers above run) at ε = 0, centrally."""
    cache = clean_pass(model, toks, [receiver.layer], need_logits=True)
    delta = sender_deltas(model, cache, references(model, "mean", toks, [sender.layer]), [sender])
    scorer = Scorer(model, cache, receiver.layer, [receiver.head], resolve_metric("induction-loss", into))
    with torch.no_grad():
        _, z = receiver_run(cache, receiver.layer, into, torch.cat([eps * delta, -eps * delta]))
        s = scorer.logits_sums(z, 2)[:, 0].double() / scorer.count()
    return float((s[0] - s[1]) / (2 * eps))


@pytest.mark.parametrize("which", ["gpt2", "llama", "gemma3"])
def test_edge_attribution_loss_is_the_derivative_of_exact_path_patching(which, tmp_path_factory):
    folder = {"gpt2": _tiny.gpt2_dir, "llama": _tiny.llama_dir, "gemma3": _tiny.gemma3_dir}[which](tmp_path_factory)
    model = qk.load(str(folder), device="cpu", verbose=False)
    toks = qk.repeated_tokens(model, n_seqs=3, seg_len=9, seed=1)
    last = model.cfg.n_layers - 1
    # receivers in every layer >= 1: one backward serves them all; Gemma's layer-1 receivers feed layer 2
    recv = [qk.Head(l, h) for l in range(1, last + 1) for h in (0, 1, 3)]
    senders = [qk.Head(0, 2), qk.Head(0, 1)]
    est = qk.edge_attribution(model, recv, senders=senders, tokens=toks, metric="induction-loss")
    exact = qk.path_patch(model, recv, senders=senders, tokens=toks, metric="induction-loss", progress=False)
    assert est.metrics == {x: "induction-loss" for x in "qkv"}
    torch.testing.assert_close(est.clean["k"], exact.clean["k"], rtol=1e-4, atol=1e-5)     # the clean loss
    checked = 0
    for i, r in enumerate(recv):
        for s in senders:
            for x in "qkv":
                fd = _loss_difference(model, toks, r, s, x, 1e-2)        # loss rises = effect (patched − clean)
                got = float(est.effects[x][i, s.layer, s.head])
                assert abs(got - fd) < 2e-3 * max(1.0, abs(fd)) + 1e-4, (which, r, s, x, got, fd)
                checked += abs(fd) > 1e-4
    assert checked >= 6           # not all ~0: the comparison could not pass vacuously
    # path_patch's own loss metric: an unpatched receiver run through the layers above gives the clean loss
    # (on Gemma-3 resuming at layer 1 by slicing the block list shifted the sliding/global layer types above)
    cache = clean_pass(model, toks, [1], need_logits=True)
    scorer = Scorer(model, cache, 1, [0], resolve_metric("induction-loss", "k"))
    with torch.no_grad():
        _, z = receiver_run(cache, 1, "k", torch.zeros(1, *cache.resid[1].shape))
    torch.testing.assert_close(scorer.logits_sums(z, 1)[0], scorer.clean_sums(), rtol=1e-5, atol=1e-5)


def test_edge_attribution_ranks_the_trained_toys_previous_token_heads_first():
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("train_toy_induction", root / "scripts/train_toy_induction.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model = mod.load_trained(root / "tests/fixtures/toy_induction")
    toks = qk.repeated_tokens(model, n_seqs=8, seg_len=12, seed=3)
    exact = qk.path_patch(model, "1.0,1.1,1.2,1.3", into="k", tokens=toks, progress=False)
    est = qk.edge_attribution(model, "1.0,1.1,1.2,1.3", into="k", tokens=toks)
    for r in exact.receivers:
        assert est.top(1, receiver=r, into="k")[0][0] == exact.top(1, receiver=r, into="k")[0][0]


def test_edge_attribution_bad_inputs(hand_built):
    with pytest.raises(QKCircuitsError, match=r"^edge_attribution cannot evaluate metric 'kl': it needs a task's") as e:
        qk.edge_attribution(hand_built, "1.0", metric="kl")
    assert "\n" not in str(e.value)
    with pytest.raises(QKCircuitsError, match="receiver 0.0 is in layer 0: no earlier heads can send to it"):
        qk.edge_attribution(hand_built, "0.0")


def test_memory_budgets_change_nothing_but_the_schedule(tmp_path_factory, monkeypatch):
    # Δ recomputed per block (no room for the Δ matrix) and gradients scored one receiver layer at a time:
    # the same numbers as the default schedule (one Δ matrix, one matmul for every receiver layer).
    from qkcircuits._paths import edges as _edges

    model = qk.load(str(_tiny.gemma3_dir(tmp_path_factory)), device="cpu", verbose=False)
    toks = qk.repeated_tokens(model, n_seqs=3, seg_len=9, seed=1)
    senders = [qk.Head(0, 1), qk.Head(1, 3)]
    for snd in (None, senders):
        ref = qk.edge_attribution(model, tokens=toks, senders=snd)
        monkeypatch.setattr(_edges, "DELTA_CACHE_BYTES", 0)
        monkeypatch.setattr(_edges, "GRAD_BLOCK_BYTES", 1)
        got = qk.edge_attribution(model, tokens=toks, senders=snd)
        monkeypatch.undo()
        for x in "qkv":
            torch.testing.assert_close(got.effects[x], ref.effects[x], equal_nan=True, rtol=1e-5, atol=1e-7)
            n = int((~ref.effects[x].isnan()).sum())
            assert n == (8 * 4 + 4 * 4 if snd is None else 4 * 1 + 4 * 2), n   # senders below each receiver


@pytest.mark.parametrize("which", ["gpt2", "llama", "gemma3"])
def test_closed_form_norm_vjp_matches_autograd(which, tmp_path_factory, monkeypatch):
    # RMSNorm (Llama, Gemma-3) and LayerNorm (GPT-2) input norms: the residual gradients are formed in closed form
    # (_foundation/inputs.py, no autograd through the norm); with that path switched off (autograd through the
    # hook) the effects are the same to rounding.
    from qkcircuits._paths import edges as _edges

    folder = {"gpt2": _tiny.gpt2_dir, "llama": _tiny.llama_dir, "gemma3": _tiny.gemma3_dir}[which](tmp_path_factory)
    model = qk.load(str(folder), device="cpu", verbose=False)
    toks = qk.repeated_tokens(model, n_seqs=3, seg_len=9, seed=1)
    calls = []
    vjp = _edges._vjp
    monkeypatch.setattr(_edges, "_vjp", lambda *a: calls.append(1) or vjp(*a))
    fast = qk.edge_attribution(model, tokens=toks)
    n_fast = len(calls)
    monkeypatch.setattr(_edges, "closed_form", lambda *a: None)
    slow = qk.edge_attribution(model, tokens=toks)
    assert n_fast == 0 and len(calls) > 0       # every receiver input took the closed form, then none did
    for x in "qkv":
        torch.testing.assert_close(fast.effects[x], slow.effects[x], equal_nan=True, rtol=1e-4, atol=1e-6)


def test_a_pattern_metric_scores_v_inputs_as_zero(hand_built):
    # the induction attention does not read v: edge_attribution's default inputs (q, k, v) score every v edge 0
    # and keep the q/k effects of the same call without v (before: autograd's "not used in the graph" error)
    both = qk.edge_attribution(hand_built, "1.0", metric="induction")
    qk_only = qk.edge_attribution(hand_built, "1.0", into=("q", "k"), metric="induction")
    v = both.effects["v"][~both.effects["v"].isnan()]
    assert v.numel() > 0 and bool((v == 0).all())
    for x in "qk":
        torch.testing.assert_close(both.effects[x], qk_only.effects[x], equal_nan=True, rtol=0, atol=0)
