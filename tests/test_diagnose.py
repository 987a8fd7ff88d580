"""Head health diagnostics against ground truth: Gaussian q/k, the hand-built heads, patched leaking masks, SmolLM2."""

from __future__ import annotations

import copy
import json
import math

import pytest
from _typecheck import unchecked
import torch

import qkcircuits as qk
from qkcircuits._weights.qk_ov import attention_scale
from qkcircuits._analysis.diagnose import head_sums, qk_statistics
from qkcircuits._analysis.diagnose_result import FLAGS, HeadDiagnostics


def _tiny_native(*, rotary: bool = True, softcap: float = -1.0, gain: float = 1.0, n_kv: int = 2):
    """A random 2-layer, 4-head attention-only native model; ``gain`` scales W_Q/W_K so scores matter."""
    from transformer_lens.config import TransformerBridgeConfig
    from transformer_lens.model_bridge import TransformerBridge

    cfg = TransformerBridgeConfig(
        d_model=32, d_head=8, n_layers=2, n_ctx=32, n_heads=4, d_vocab=50, attn_only=True, normalization_type=None,
        positional_embedding_type="rotary" if rotary else "standard", act_fn="relu", seed=0, n_key_value_heads=n_kv,
        attn_scores_soft_cap=softcap, default_prepend_bos=False, model_name="tiny-native")
    model = TransformerBridge.boot_native(cfg, device="cpu")
    with torch.no_grad():
        for layer in model.original_model.layers:
            layer.attn.q.weight.mul_(gain)
            layer.attn.k.weight.mul_(gain)
    return model.eval()


def _leak_one_future_position(model, layer: int):
    """A deep copy of ``model`` whose layer-``layer`` causal mask lets position i see i+1 (the shared model is kept)."""
    leaky = copy.deepcopy(model)
    mask = leaky.blocks[layer].attn.original_component.causal_mask
    i = torch.arange(mask.shape[0] - 1)
    mask[i, i + 1] = False
    assert bool(model.blocks[layer].attn.original_component.causal_mask[0, 1]), "the original must stay causal"
    return leaky


# ---------------------------------------------------------------- pure tensors: the √d_k argument itself

def test_gaussian_qk_variance_is_d_k_and_one_after_scaling():
    # q, k with independent unit-variance components, d_k = 64: Var(q·k) = d_k, Var(q·k/√d_k) = 1.
    # Tolerance 5%: over seeds 0-19 the 4 heads' estimates stayed within 2.5% (66k correlated pairs per head).
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(8, 128, 4, 64, generator=g), torch.randn(8, 128, 4, 64, generator=g)
    s = qk_statistics(q, k, scale=64 ** -0.5)
    assert torch.allclose(s["qk_var"], torch.full((4,), 64.0, dtype=torch.float64), rtol=0.05)
    assert torch.allclose(s["qk_var_ratio"], torch.ones(4, dtype=torch.float64), rtol=0.05)
    assert torch.allclose(s["scaled_var"], torch.ones(4, dtype=torch.float64), rtol=0.05)
    # The independence predictions equal the textbook value here, and the measurement agrees with them.
    assert torch.allclose(s["pred_var_indep"], torch.full((4,), 64.0, dtype=torch.float64), rtol=0.05)
    assert torch.allclose(s["pred_var_zero_mean"], torch.full((4,), 64.0, dtype=torch.float64), rtol=0.05)
    assert torch.allclose(s["indep_ratio"], torch.ones(4, dtype=torch.float64), rtol=0.03)
    assert torch.allclose(s["q_var"], torch.ones(4, dtype=torch.float64), rtol=0.03)
    # Without the 1/√d_k scale the scores keep variance 64 and softmax saturates: far less Σp(1-p).
    s1 = qk_statistics(q, k, scale=1.0)
    assert torch.allclose(s1["scaled_var"], s["qk_var"])
    assert (s["saturation_unscaled"] < 0.5 * s["saturation"]).all()
    assert torch.allclose(s["saturation_unscaled"], s1["saturation"])


def test_independence_prediction_catches_dependent_keys():
    # One vector per sequence serves as q and k at every position: every pair's product is |q|², of
    # variance 2d, while a query and a key drawn independently give d. The ratio must show it (≈ 2).
    g = torch.Generator().manual_seed(1)
    v = torch.randn(256, 1, 1, 16, generator=g).expand(256, 8, 1, 16)
    dependent = qk_statistics(v, v)
    assert 1.6 < float(dependent["indep_ratio"][0]) < 2.4
    # With means the textbook d_k is wrong but the moment formula is right: Var = Σ(E q²E k² - (E q E k)²).
    q = torch.randn(4, 64, 1, 16, generator=g) + 1.0
    k = torch.randn(4, 64, 1, 16, generator=g) + 1.0
    s = qk_statistics(q, k)
    assert abs(float(s["qk_var"][0]) / float(s["pred_var_components"][0]) - 1) < 0.08
    assert abs(float(s["qk_var"][0]) / 16 - 3.0) < 0.3     # E q²E k² - 1 = 2·2 - 1 = 3 per component
    assert abs(float(s["pred_var_zero_mean"][0]) / 16 - 1.0) < 0.15   # Σ Var(q_d)Var(k_d) misses the means


def test_row_measures_equal_a_direct_computation():
    g = torch.Generator().manual_seed(2)
    q, k = 2 * torch.randn(3, 12, 2, 8, generator=g), torch.randn(3, 12, 2, 8, generator=g)
    s = qk_statistics(q, k, scale=0.5)
    raw = torch.einsum("bqhd,bkhd->bhqk", q, k)
    ent, frac, mx, sink, sat, sat_u = ([] for _ in range(6))
    for b in range(3):
        for h in range(2):
            for i in range(1, 12):
                p = torch.softmax(0.5 * raw[b, h, i, : i + 1], -1)
                pu = torch.softmax(raw[b, h, i, : i + 1], -1)
                e = float(-(p * p.log()).sum())
                ent.append((h, e)), frac.append((h, e / math.log(i + 1))), mx.append((h, float(p.max())))
                sink.append((h, float(p[0]))), sat.append((h, float((p * (1 - p)).sum())))
                sat_u.append((h, float((pu * (1 - pu)).sum())))
    for name, values in (("entropy_mean", ent), ("entropy_frac_mean", frac), ("max_weight", mx), ("sink", sink),
                         ("saturation", sat), ("saturation_unscaled", sat_u)):
        for h in range(2):
            want = sum(v for hh, v in values if hh == h) / sum(1 for hh, _ in values if hh == h)
            assert abs(float(s[name][h]) - want) < 1e-5, name
    assert float(s["future_weight"].max()) == 0.0 and float(s["pattern_err"].max()) < 1e-6


def test_row_measures_of_a_sliding_window_layer_equal_a_direct_computation():
    # a local layer attends the `window` latest keys only: every statistic is over those pairs (its own scores
    # are −inf outside them, which had made the measured scale NaN and the score check infinite)
    g = torch.Generator().manual_seed(3)
    w = 4
    q, k = 2 * torch.randn(2, 10, 2, 8, generator=g), torch.randn(2, 10, 2, 8, generator=g)
    raw = torch.einsum("bqhd,bkhd->bhqk", q, k)
    mask = torch.ones(10, 10, dtype=torch.bool).tril() & ~torch.ones(10, 10, dtype=torch.bool).tril(-w)
    model_scores = (0.5 * raw).masked_fill(~mask, float("-inf"))
    sums = head_sums(q, k, scale=0.5, scores=model_scores, pattern=model_scores.softmax(-1), window=w)
    s = qk_statistics(q, k, scale=0.5, pattern=model_scores.softmax(-1), window=w)
    assert float(sums["scores_err"].max()) == 0.0 and float(s["pattern_err"].max()) < 1e-6
    ent, frac, var = [[], []], [[], []], [[], []]
    for b in range(2):
        for h in range(2):
            for i in range(10):
                keys = slice(max(0, i - w + 1), i + 1)
                var[h] += raw[b, h, i, keys].tolist()
                if i == 0:
                    continue
                p = torch.softmax(0.5 * raw[b, h, i, keys], -1)
                e = float(-(p * p.log()).sum())
                ent[h].append(e), frac[h].append(e / math.log(p.numel()))
    for h in range(2):
        assert abs(float(s["entropy_mean"][h]) - sum(ent[h]) / len(ent[h])) < 1e-5
        assert abs(float(s["entropy_frac_mean"][h]) - sum(frac[h]) / len(frac[h])) < 1e-5
        assert abs(float(s["qk_var"][h]) - float(torch.tensor(var[h], dtype=torch.float64).var(unbiased=False))) < 1e-4


def test_diagnose_reads_windowed_layers_and_writes_finite_json(tmp_path_factory, tmp_path):
    # tiny Gemma-3: two sliding-window layers (window 6) under prompts longer than that; the measured scale equals
    # the module's on every layer, the score check is exact, and the JSON is strict JSON (no NaN / Infinity)
    from _tiny import gemma3_dir

    model = qk.load(str(gemma3_dir(tmp_path_factory)), verbose=False)
    d = qk.diagnose(model, progress=False)
    want = 6 ** -0.5
    assert {int(k): round(v, 6) for k, v in d.settings["scale_measured"].items()} == {0: round(want, 6), 1: round(want, 6),
                                                                                      2: round(want, 6)}
    assert float(d.measures["scores_err"].max()) < 1e-4
    text = d.to_json(tmp_path / "d.json")
    json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    from qkcircuits._foundation.io import dump_json

    assert json.loads(dump_json({"x": float("nan"), "y": (float("inf"), 1.5)})) == {"x": None, "y": [None, 1.5]}


def test_uniform_and_sink_attention_by_construction():
    # q = 0: every score is 0, attention is exactly uniform: entropy = log(i+1), Σp(1-p) = 1 - 1/(i+1).
    q, k = torch.zeros(2, 10, 1, 4), torch.randn(2, 10, 1, 4)
    s = qk_statistics(q, k)
    assert abs(float(s["entropy_frac_mean"][0]) - 1) < 1e-6 and float(s["entropy_frac_std"][0]) < 1e-6
    want = sum(1 - 1 / (i + 1) for i in range(1, 10)) / 9
    assert abs(float(s["saturation"][0]) - want) < 1e-6
    # Only position 0's key matches the query: all attention on the first token.
    q = torch.zeros(2, 10, 1, 4)
    q[..., 0] = 100.0
    k = torch.zeros(2, 10, 1, 4)
    k[:, 0, :, 0] = 1.0
    s = qk_statistics(q, k)
    assert float(s["sink"][0]) > 0.999 and float(s["max_weight"][0]) > 0.999


def test_head_sums_rejects_mismatched_shapes():
    with pytest.raises(qk.QKCircuitsError, match="same"):
        unchecked(head_sums)(torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 1, 8), scale=1.0)   # beneath the hook


# ---------------------------------------------------------------- hand-built heads (known by construction)

def test_hand_built_sharp_heads_flagged_near_one_hot(hand_built):
    d = qk.diagnose(hand_built, progress=False)
    assert d["entropy_mean"].max() < 1e-3                     # every head is exact: entropy ≈ 0
    assert d["max_weight"].min() > 0.999
    assert d.flags()["near_one_hot"].all() and not d.flags()["near_uniform"].any()
    seg = d.settings["seg_len"]                               # n_ctx 64: [BOS] + 2 x 31 tokens
    # 1.0 falls back to BOS for the first copy (seg of 2·seg rows); 0.0 sees BOS from row 1 only.
    assert abs(float(d["sink"][1, 0]) - 0.5) < 1e-3
    assert abs(float(d["sink"][0, 0]) - 1 / (2 * seg)) < 1e-4
    # The scale is the native module's 1/√d_head, and the recomputed pattern is the model's.
    assert torch.allclose(d.scale, torch.full((2,), hand_built.cfg.d_head ** -0.5, dtype=torch.float64))
    assert d["pattern_err"].max() < 1e-5
    assert not d.flags()["leaking"].any()
    assert (d["future_weight"] == 0).all() and (d["perturb_change"] == 0).all()


def test_leaking_mask_caught_by_both_checks(hand_built):
    leaky = _leak_one_future_position(hand_built, layer=1)
    d = qk.diagnose(leaky, progress=False)
    # 1.0 looks for the key whose previous token equals its own token: the leaked key i+1 matches.
    assert float(d["future_weight"][1, 0]) > 0.5
    assert float(d["perturb_change"][1, 0]) > 0.5 and float(d["perturb_input_change"][1, 0]) == 0.0
    assert bool(d.flags()["leaking"][1, 0])
    assert not d.flags()["leaking"][0].any()                  # layer 0 is causal and not blamed
    # The shared fixture is untouched.
    assert not qk.diagnose(hand_built, progress=False).flags()["leaking"].any()


def test_perturbation_blames_the_leaking_layer_not_the_ones_after_it():
    model = _tiny_native(gain=8.0)
    clean = qk.diagnose(model, progress=False)
    assert (clean["future_weight"] == 0).all() and (clean["perturb_change"] == 0).all()
    assert not clean.flags()["leaking"].any()
    d = qk.diagnose(_leak_one_future_position(model, layer=0), progress=False)
    assert (d["future_weight"][0] > 1e-3).all() and (d["perturb_change"][0] > 1e-4).all()
    assert (d["perturb_input_change"][0] == 0).all()
    # Layer 1's own mask is fine: its earlier positions changed only because layer 0 leaked.
    assert (d["future_weight"][1] == 0).all() and (d["perturb_input_change"][1] > 0).all()
    assert d.flags()["leaking"][0].all() and not d.flags()["leaking"][1].any()


def test_soft_cap_read_from_the_model():
    # Scores reach ±10 before a cap of 2: ignoring the cap would rebuild a very different pattern.
    model = _tiny_native(softcap=2.0, gain=30.0)
    scale, source, cap = attention_scale(model, 0)
    assert cap == 2.0 and abs(scale - 8 ** -0.5) < 1e-12 and "scale" in source
    d = qk.diagnose(model, progress=False)
    assert d.settings["softcap"] == 2.0 and d["pattern_err"].max() < 1e-5
    assert d["scaled_var"].max() <= 4.0                      # |2·tanh(x/2)| < 2
    acts = qk.capture(model, qk.repeated_tokens(model, n_seqs=2, seg_len=10), ["q", "k", "pattern"], layers=[0])
    rope = model.blocks[0].attn.original_component.rotary.apply_rope
    q, k = (x.transpose(1, 2) for x in rope(acts["q", 0].transpose(1, 2), acts["k", 0].transpose(1, 2)))
    uncapped = head_sums(q, k, scale=scale, pattern=acts["pattern", 0])
    assert float(uncapped["pattern_err"].max()) > 0.05


@pytest.mark.parametrize("case", ["cfg_scale_2", "use_attn_scale_false", "module_scale_5", "soft_cap", "rotary_gqa"])
def test_capture_scores_use_the_modules_scale_and_soft_cap(case):
    """Native attention fires hook_attn_scores with the pattern; the scores capture rebuilds must softmax back to it.

    Each case failed when the rebuild read cfg only: use_attn_scale=False still divides by √d_head in
    the native module, a module scale set after boot is not in cfg, a soft-cap was ignored, and native
    rotary q/k (hook_rot_q/k never fire) were not rotated.
    """
    from transformer_lens.config import TransformerBridgeConfig
    from transformer_lens.model_bridge import TransformerBridge

    extra = {"cfg_scale_2": dict(attn_scale=2.0), "use_attn_scale_false": dict(use_attn_scale=False),
             "module_scale_5": {}, "soft_cap": dict(attn_scores_soft_cap=2.0),
             "rotary_gqa": dict(positional_embedding_type="rotary", n_key_value_heads=2)}[case]
    cfg = dict(d_model=32, d_head=8, n_layers=2, n_ctx=16, n_heads=4, d_vocab=50, attn_only=True,
               normalization_type=None, positional_embedding_type="standard", act_fn="relu", seed=0, model_name="n")
    model = TransformerBridge.boot_native(TransformerBridgeConfig(**{**cfg, **extra}), device="cpu").eval()
    with torch.no_grad():
        for layer in model.original_model.layers:        # scores of ±10s: a wrong scale or cap shows
            layer.attn.q.weight.mul_(30.0)
            layer.attn.k.weight.mul_(30.0)
            if case == "module_scale_5":
                layer.attn.scale = 5.0
    factor, source, cap = attention_scale(model, 1)
    expect = {"cfg_scale_2": 0.5, "use_attn_scale_false": 8 ** -0.5, "module_scale_5": 0.2, "soft_cap": 8 ** -0.5,
              "rotary_gqa": 8 ** -0.5}[case]
    assert factor == pytest.approx(expect) and "scale" in source and cap == (2.0 if case == "soft_cap" else None)
    toks = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    acts = qk.capture(model, toks, ["scores", "pattern"])
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    for layer in range(2):
        sc, pat = acts["scores", layer], acts["pattern", layer]
        assert not torch.allclose(sc.masked_fill(~causal, 0), pat)        # real scores, not the pattern
        torch.testing.assert_close(sc.masked_fill(~causal, float("-inf")).softmax(-1), pat, atol=1e-5, rtol=0)
        if case == "soft_cap":
            assert 1.5 < float(sc[..., causal].abs().max()) <= 2.0                # |2·tanh(x/2)| ≤ 2


# ---------------------------------------------------------------- results, errors, command line

def test_json_round_trip_and_frame(hand_built, tmp_path):
    d = qk.diagnose(hand_built, progress=False)
    path = tmp_path / "d.json"
    d.to_json(path)
    back = HeadDiagnostics.from_json(str(path))
    assert back.measures.keys() == d.measures.keys()
    for name in d.measures:
        assert torch.equal(back[name].isnan(), d[name].isnan())
        assert torch.allclose(back[name].nan_to_num(), d[name].nan_to_num(), rtol=0, atol=0)
    assert {k: v.tolist() for k, v in back.flags().items()} == {k: v.tolist() for k, v in d.flags().items()}
    assert json.loads(path.read_text())["flagged"]["1.0"] == ["near_one_hot"]
    frame = d.to_frame()
    assert len(frame) == 4 and set(FLAGS) <= set(frame.columns) and frame["near_one_hot"].all()
    with pytest.raises(qk.QKCircuitsError, match="diagnostics JSON"):
        HeadDiagnostics.from_json('{"model": "x"}')


@pytest.mark.parametrize("kwargs, match", [
    ({"thresholds": {"sink": 0.5}}, "unknown threshold"),
    ({"thresholds": {"near_uniform": -1}}, "non-negative"),
    ({"n_seqs": 0}, "n_seqs"),
    ({"n_seqs": True}, "n_seqs must be an integer >= 1"),
    ({"n_perturb": -1}, "n_perturb must be an integer >= 0"),
    ({"layers": [5]}, "out of range"),
    ({"prompt_sets": ["poetry"]}, "unknown prompt set"),
    ({"prompt_sets": ["text"]}, "tokenizer"),
    ({"seed": -1}, "seed"),
])
def test_bad_input(hand_built, kwargs, match):
    with pytest.raises(qk.QKCircuitsError, match=match):
        qk.diagnose(hand_built, progress=False, **kwargs)


def test_bad_results_and_prompts(hand_built):
    with pytest.raises(qk.QKCircuitsError, match="unknown measure"):
        HeadDiagnostics(model="m", n_layers=1, n_heads=1, d_head=1, measures={}, scale=torch.ones(1))["nope"]
    with pytest.raises(qk.QKCircuitsError, match="shape"):
        HeadDiagnostics(model="m", n_layers=2, n_heads=2, d_head=1, measures={"sink": torch.zeros(2, 3)},
                        scale=torch.ones(2))
    with pytest.raises(qk.QKCircuitsError, match="pos >= 2"):
        qk.diagnose(hand_built, tokens={"mine": torch.tensor([[0]])}, progress=False)
    with pytest.raises(qk.QKCircuitsError, match="exceeds the model's context"):
        qk.diagnose(hand_built, tokens={"mine": torch.ones(1, 200, dtype=torch.long)}, progress=False)


def test_cli(hand_built, monkeypatch, tmp_path, capsys):
    import qkcircuits.cli as cli
    import qkcircuits.cli.diagnose_command as cmd

    monkeypatch.setattr(cli, "COMMANDS", ["diagnose"])       # only this subcommand's parser
    monkeypatch.setattr(cmd, "load_model", lambda args: hand_built)
    out = tmp_path / "diag.json"
    assert cli.main(["diagnose", "hand-built", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "4 of 4 heads flagged" in text and "near_one_hot" in text and "causal mask: OK" in text
    assert HeadDiagnostics.from_json(str(out)).flags()["near_one_hot"].all()
    assert cli.main(["diagnose", "hand-built", "--json", str(tmp_path / "no" / "d.json")]) == 2
    assert cli.main(["diagnose", "hand-built", "--prompts", "text"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 2 and "Traceback" not in err


# ---------------------------------------------------------------- SmolLM2-135M

@pytest.mark.smollm2
def test_smollm2_one_pass_per_set_agrees_with_captured_patterns(smollm2):
    text = qk.text_tokens(smollm2, seq_len=48, n_seqs=2)
    rep = qk.repeated_tokens(smollm2, n_seqs=2, seg_len=20, seed=3)
    calls = []
    handle = smollm2.embed.register_forward_hook(lambda *a: calls.append(1))
    try:
        d = qk.diagnose(smollm2, tokens={"text": text, "repeated": rep}, n_perturb=1, progress=False)
    finally:
        handle.remove()
    assert len(calls) == 2                                    # one forward per prompt set, perturbation included
    # The scale is read from LlamaAttention.scaling and confirmed by hook_attn_scores: 1/√64.
    assert torch.allclose(d.scale, torch.full((30,), 0.125, dtype=torch.float64))
    assert all(abs(v - 0.125) < 1e-6 for v in d.settings["scale_measured"].values())
    assert d["pattern_err"].max() < 1e-5                      # softmax of the scores is the pattern
    assert d["scores_err"].max() < 1e-3                       # rot_q·rot_k × 0.125 is hook_attn_scores
    assert not d.flags()["leaking"].any()
    assert (d["future_weight"] == 0).all() and (d["perturb_change"] == 0).all()
    # Direct capture of a few heads on the same text: same entropy, sink, largest weight and Var(q·k).
    layers = [0, 13, 29]
    acts = qk.capture(smollm2, text, ["rot_q", "rot_k", "pattern"], layers=layers)
    for layer in layers:
        for head in (0, 4, 8):
            p = acts.head("pattern", layer, head)[:, 1:]          # rows i >= 1
            n = torch.arange(2, p.shape[1] + 2, dtype=torch.float32).log()
            ent = torch.special.entr(p).sum(-1)
            got = {m: float(d.by_set["text"][m][layer, head]) for m in
                   ("entropy_mean", "entropy_frac_mean", "sink", "max_weight")}
            assert abs(got["entropy_mean"] - float(ent.mean())) < 1e-4
            assert abs(got["entropy_frac_mean"] - float((ent / n).mean())) < 1e-4
            assert abs(got["sink"] - float(p[..., 0].mean())) < 1e-5
            assert abs(got["max_weight"] - float(p.amax(-1).mean())) < 1e-5
            q, k = acts.head("rot_q", layer, head), acts.head("rot_k", layer, head)
            raw = torch.einsum("bqd,bkd->bqk", q.double(), k.double())
            pairs = raw[:, torch.ones(raw.shape[1], raw.shape[1], dtype=torch.bool).tril()]
            want = float(pairs.var(unbiased=False))
            assert abs(float(d.by_set["text"]["qk_var"][layer, head]) / want - 1) < 1e-4
