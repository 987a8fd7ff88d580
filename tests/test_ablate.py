"""Ablation against ground truth: the hand-built induction circuit, naive loops, TransformerLens patching."""

from __future__ import annotations

import json
import math

import pytest
import torch

import _tiny
import qkcircuits as qk
from qkcircuits import QKCircuitsError
from qkcircuits._analysis.replay import Runner
from qkcircuits._foundation.stats import spearman
from qkcircuits._analysis.sweep import naive_sweep

V = 32  # hand-built vocabulary


def no_hooks(model) -> bool:
    return not any(hp._forward_hooks for hp in model.hook_dict.values())


@pytest.fixture(scope="module")
def rep(hand_built):
    return qk.repeated_tokens(hand_built, n_seqs=4, seg_len=20, seed=0)


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory):
    return qk.load(str(_tiny.gpt2_dir(tmp_path_factory)), device="cpu", verbose=False)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return qk.load(str(_tiny.llama_dir(tmp_path_factory)), device="cpu", verbose=False)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def tiny(request):
    """Tiny HF checkpoints (GPT-2; Llama with GQA and rotary) loaded with LayerNorm folding, like real models."""
    return request.getfixturevalue(f"tiny_{request.param}")


# ---- the hand-built circuit: effects known by construction ---------------------------------------

def test_ablating_the_previous_token_head_destroys_induction(hand_built, rep):
    second, first = qk.induction_loss(), qk.induction_loss("first")
    with torch.no_grad():
        clean = hand_built(rep)
        with qk.ablate(hand_built, "0.0"):
            ablated = hand_built(rep)
    assert float(second(clean, rep)) < 1e-4                                  # perfect copying
    assert float(first(clean, rep)) == pytest.approx(math.log(V - 1), abs=1e-4)
    # Without 0.0 the induction head falls back to BOS: second half as hard as the first.
    assert float(second(ablated, rep)) == pytest.approx(math.log(V - 1), abs=1e-4)
    assert float(second(ablated, rep)) == pytest.approx(float(first(ablated, rep)), abs=1e-4)
    assert no_hooks(hand_built)


@pytest.mark.parametrize("head", ["0.1", "1.1"])
@pytest.mark.parametrize("method", ["zero", "mean", "resample"])
def test_ablating_an_unused_head_changes_nothing_exactly(hand_built, rep, head, method):
    # Heads 0.1 and 1.1 read the token (z = its one-hot, non-zero) but W_O = 0: their z really is
    # replaced, yet the output cannot change, not even by rounding.
    L, H = map(int, head.split("."))
    ref = None if method == "zero" else rep.roll(1, 0)
    with torch.no_grad():
        clean = hand_built(rep)
        clean_z = qk.capture(hand_built, rep, ["z"], layers=[L])["z", L][:, :, H]
        with qk.ablate(hand_built, head, method, reference=ref) as repl:
            ablated = hand_built(rep)
            z = qk.capture(hand_built, rep, ["z"], layers=[L])["z", L][:, :, H]
    assert clean_z.abs().sum(-1).min() > 0.99                 # every position carries its token
    assert (z - clean_z).abs().max() > 0.5                   # the hook fired and changed z
    want = torch.zeros(()) if method == "zero" else repl.value(L, H, *rep.shape)
    torch.testing.assert_close(z, want.expand_as(z).to(z.dtype), atol=0, rtol=0)
    assert torch.equal(clean, ablated)


def test_hooks_are_removed_on_exceptions(hand_built, rep):
    with pytest.raises(RuntimeError, match="boom"):
        with qk.ablate(hand_built, "0.0"):
            assert not no_hooks(hand_built)
            raise RuntimeError("boom")
    assert no_hooks(hand_built)


def test_sweep_on_the_hand_built_model_finds_the_circuit(hand_built, rep):
    res = qk.sweep(hand_built, rep, "induction-loss", progress=False)
    assert res.baseline < 1e-4
    assert float(res.effects[0, 0]) == pytest.approx(math.log(V - 1), abs=1e-4)   # back to guessing among V-1
    assert float(res.effects[1, 0]) == pytest.approx(math.log(V), abs=1e-4)       # no output at all: uniform
    assert res.effects[0, 1] == 0 and res.effects[1, 1] == 0
    assert res.effects.shape == (2, 2) and no_hooks(hand_built)


def test_attribution_is_exact_for_a_metric_linear_in_the_last_layers_z(hand_built, rep):
    # Attention-only, no normalisation: logits are linear in layer 1's z, so the estimate is exact there.
    target = rep[:, 1]                          # what the induction head predicts after the last token
    metric = qk.as_metric(lambda logits, tokens: logits[torch.arange(len(tokens)), -1, target].mean(),
                          higher_is_better=True)
    est = qk.attribution(hand_built, rep, metric)
    true = qk.sweep(hand_built, rep, metric, progress=False)
    # a logit (larger = behaviour present): ablating the induction head lowers it, a POSITIVE effect
    assert float(true.effects[1, 0]) > 1.0                                       # a real effect, not 0 == 0
    torch.testing.assert_close(est.effects[1], true.effects[1], atol=1e-4, rtol=1e-5)
    assert no_hooks(hand_built)


def test_attribution_correlates_with_the_sweep_on_a_small_model(tmp_path_factory):
    model = qk.load(str(_tiny.gpt2_dir(tmp_path_factory)), device="cpu", verbose=False)
    tokens = qk.repeated_tokens(model, n_seqs=4, seg_len=12, seed=1)
    true = qk.sweep(model, tokens, "induction-loss", progress=False)
    est = qk.attribution(model, tokens, "induction-loss")
    rho = spearman(est.effects, true.effects)
    # Measured: Spearman rho = 0.929 over the 8 heads of the tiny GPT-2 (zero ablation); SmolLM2 in
    # tests/test_ablate_smollm2.py and docs/ablation.md.
    assert rho > 0.85, rho


# ---- sweep == naive loop == TransformerLens patching ---------------------------------------------

def tl_patching(model, tokens, metric, method, reference):
    """transformer_lens.patching's per-head helper, patching in replacements built from TL's own cache."""
    from transformer_lens import patching

    n, H = model.cfg.n_layers, model.cfg.n_heads
    names = [f"blocks.{L}.attn.hook_z" for L in range(n)]
    with torch.no_grad():
        if method == "zero":
            _, c = model.run_with_cache(tokens, names_filter=lambda x: x in names)
            cache = {k: torch.zeros_like(c[k]) for k in names}
        else:
            _, c = model.run_with_cache(reference, names_filter=lambda x: x in names)
            cache = {k: (c[k].mean(0, keepdim=True).expand(tokens.shape[0], -1, -1, -1) if method == "mean"
                         else c[k]) for k in names}
        base = float(metric(model(tokens), tokens))
        out = patching.get_act_patch_attn_head_out_all_pos(model, tokens, cache, lambda lg: metric(lg, tokens))
    assert out.shape == (n, H)
    return out.cpu() - base


@pytest.mark.parametrize("method", ["zero", "mean", "resample"])
def test_sweep_equals_naive_loop_and_transformer_lens_patching(tiny, method):
    tokens = qk.repeated_tokens(tiny, n_seqs=2, seg_len=10, seed=1)
    ref = qk.repeated_tokens(tiny, n_seqs=2, seg_len=10, seed=2)
    metric = qk.as_metric("induction-loss")
    runner = Runner(tiny, tokens)
    assert runner.mode == "blocks" and runner.keep_ok        # the fast path is what is being tested
    fast = qk.sweep(tiny, tokens, metric, method, reference=ref, max_batch=4, progress=False)  # 2 heads/forward
    slow = naive_sweep(tiny, tokens, metric, method, reference=ref)
    tl = tl_patching(tiny, tokens, metric, method, ref)
    assert slow.abs().max() > 1e-3                           # the comparison is not 0 == 0
    torch.testing.assert_close(fast.effects, slow, atol=1e-5, rtol=0)
    torch.testing.assert_close(fast.effects, tl, atol=1e-5, rtol=0)
    assert no_hooks(tiny)


def test_sweep_with_text_loss_and_default_references(tiny_gpt2):
    tiny = tiny_gpt2                        # one architecture is enough here (the GQA model runs the same code)
    tokens = qk.text_tokens(tiny, seq_len=12, n_seqs=3)
    metric = qk.as_metric("text-loss", tiny)
    for method, ref in (("mean", tokens), ("resample", tokens.roll(1, 0))):
        fast = qk.sweep(tiny, tokens, metric, method, progress=False)          # default reference
        torch.testing.assert_close(fast.effects, naive_sweep(tiny, tokens, metric, method, reference=ref), atol=1e-5, rtol=0)


def test_group_effect_and_random_draws_equal_unbatched_group_ablation(tiny):
    tokens = qk.repeated_tokens(tiny, n_seqs=2, seg_len=10, seed=3)
    cmp = qk.compare_to_random(tiny, "1.0,1.1", tokens, "induction-loss", n_draws=5, seed=7, max_batch=4)
    again = qk.compare_to_random(tiny, "1.0,1.1", tokens, "induction-loss", n_draws=5, seed=7)
    assert cmp.random_heads == again.random_heads                              # seeded
    torch.testing.assert_close(cmp.random_effects, again.random_effects, atol=1e-5, rtol=0)
    group = qk.group_effect(tiny, "1.0,1.1", tokens, "induction-loss")
    assert cmp.effect == pytest.approx(group.effect, abs=1e-5)
    unbatched = []
    for heads, eff in zip(cmp.random_heads, cmp.random_effects):
        assert len(heads) == 2 and not set(heads) & {qk.Head(1, 0), qk.Head(1, 1)}
        unbatched.append(qk.group_effect(tiny, heads, tokens, "induction-loss").effect)
        assert float(eff) == pytest.approx(unbatched[-1], abs=1e-5)
    # the share of draws at least as harmful as the group, counted from the unbatched ablations
    assert cmp.fraction_at_least == pytest.approx(sum(e >= group.effect for e in unbatched) / len(unbatched))


# ---- mean / resample use the reference they were given -------------------------------------------

def test_mean_and_resample_replace_z_with_the_references(tiny):
    tokens = qk.repeated_tokens(tiny, n_seqs=3, seg_len=10, seed=4)
    ref = qk.repeated_tokens(tiny, n_seqs=3, seg_len=10, seed=5)
    ref_z = qk.capture(tiny, ref, ["z"], layers=[1])["z", 1][:, :, 2]
    clean_z = qk.capture(tiny, tokens, ["z"], layers=[1])["z", 1]
    expected = {
        ("mean", True): ref_z.mean(0, keepdim=True).expand_as(ref_z),
        ("mean", False): ref_z.mean((0, 1), keepdim=True).expand_as(ref_z),
        ("resample", True): ref_z,
    }
    for (method, per_pos), want in expected.items():
        with qk.ablate(tiny, "1.2", method, reference=ref, per_position=per_pos):
            z = qk.capture(tiny, tokens, ["z"], layers=[1])["z", 1]
        torch.testing.assert_close(z[:, :, 2], want)
        others = [h for h in range(tiny.cfg.n_heads) if h != 2]
        assert torch.equal(z[:, :, others], clean_z[:, :, others])             # GQA partners untouched


# ---- bad input -----------------------------------------------------------------------------------

def test_bad_input_is_one_line_errors(hand_built, rep):
    cases = [
        (lambda: qk.ablate(hand_built, "5.0").__enter__(), "out of range"),
        (lambda: qk.ablate(hand_built, "0.7").__enter__(), "out of range"),
        (lambda: qk.ablate(hand_built, []).__enter__(), "no heads"),
        (lambda: qk.ablate(hand_built, "").__enter__(), "no heads"),
        (lambda: qk.ablate(hand_built, "0.0", "shuffle").__enter__(), "unknown ablation method"),
        (lambda: qk.ablate(hand_built, "0.0", "mean").__enter__(), "reference"),
        (lambda: qk.sweep(hand_built, rep, "text-loss", progress=False), "tokenizer"),
        (lambda: qk.sweep(hand_built, rep, "bleu", progress=False), "unknown metric"),
        (lambda: qk.sweep(hand_built, rep[:, :-3], "induction-loss", progress=False), "R \\+ R"),
        (lambda: qk.sweep(hand_built, rep, method="resample", reference=rep[:2], progress=False), "shaped like"),
        (lambda: qk.compare_to_random(hand_built, "0.0", rep, n_draws=0), "n_draws"),
        (lambda: qk.compare_to_random(hand_built, "0.0,0.1,1.0", rep, n_draws=2), "cannot draw"),
        (lambda: qk.group_effect(hand_built, "0.0", rep, "induction-loss", method="resample", reference=rep[:1]),
         "shaped like"),
    ]
    for fn, match in cases:
        with pytest.raises(QKCircuitsError, match=match) as e:
            fn()
        assert "\n" not in str(e.value)
    assert no_hooks(hand_built)


def test_results_round_trip_through_json(hand_built, rep):
    res = qk.sweep(hand_built, rep, "induction-loss", layers=[1], progress=False)
    back = qk.results.HeadEffects.from_json(res.to_json())
    assert torch.isnan(back.effects[0]).all()
    torch.testing.assert_close(back.effects[1], res.effects[1], atol=5e-7, rtol=0)   # 6 decimals
    assert (back.method, back.metric, back.baseline, back.layers) == ("zero", "induction-loss", res.baseline, [1])
    assert back.top(1)[0][0] == qk.Head(1, 0)
    assert back.top(1, by="abs")[0][0] == qk.Head(1, 0)


def test_from_json_ignores_keys_that_are_not_fields(hand_built, rep):
    res = qk.sweep(hand_built, rep, "induction-loss", layers=[1], progress=False)
    d = json.loads(res.to_json())
    d.update(n_seqs=4, seed=0)                                 # what `qkcircuits ablate --sweep --json` adds
    back = qk.results.HeadEffects.from_json(json.dumps(d))
    assert (back.n_prompts, back.layers, back.kind) == (4, [1], "sweep")


def test_top_by_magnitude_ranks_unswept_layers_last():
    nan = float("nan")
    e = qk.results.HeadEffects(torch.tensor([[nan, nan], [-3.0, 1.0], [0.5, -0.25]]), 0.0, "m", "zero", "x", layers=[1, 2])
    by_abs = e.top(6, by="abs")
    assert [h for h, _ in by_abs[:4]] == [qk.Head(1, 0), qk.Head(1, 1), qk.Head(2, 0), qk.Head(2, 1)]
    assert [v for _, v in by_abs[:4]] == [-3.0, 1.0, 0.5, -0.25]
    assert all(math.isnan(v) for _, v in by_abs[4:])
    assert [h for h, _ in e.top(2)] == [qk.Head(1, 1), qk.Head(2, 0)]


def test_runner_caches_only_the_layers_it_may_start_from(tiny_gpt2, monkeypatch):
    tokens = qk.repeated_tokens(tiny_gpt2, n_seqs=2, seg_len=10, seed=6)
    runner = Runner(tiny_gpt2, tokens, from_layer=1)
    assert set(runner.resid) == {1} and runner.mode == "blocks"
    with pytest.raises(ValueError, match="layer 0"):
        runner.run(0, [], 1)
    made = []

    class Spy(Runner):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr("qkcircuits._analysis.sweep.Runner", Spy)
    res = qk.sweep(tiny_gpt2, tokens, "induction-loss", layers=[1], progress=False)
    assert set(made[0].resid) == {1}
    torch.testing.assert_close(res.effects[1], naive_sweep(tiny_gpt2, tokens, layers=[1])[1], atol=1e-5, rtol=0)
