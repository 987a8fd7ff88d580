"""Architecture adapters and multi-head latent attention (DeepSeek-V2/V3), checked against transformers itself.

Ground truths: transformers' own DeepSeek modules and raw weights (patterns from the HF forward, projections
from the HF state dict, the YaRN mscale formula from the config), and exact identities.
"""

from __future__ import annotations

import math
import types
import warnings

import _tiny
import pytest
import torch

import qkcircuits as qk
from qkcircuits import QKCircuitsError
from qkcircuits._foundation.arch import adapter, family

pytestmark = pytest.mark.filterwarnings("ignore")

MLA_VARIANTS = {"v3": dict(version=3, q_lora_rank=32), "v2_noq": dict(version=2, q_lora_rank=None),
                "v3_noq_yarn": dict(version=3, q_lora_rank=None, yarn=True), "v2_yarn": dict(version=2, q_lora_rank=32,
                                                                                        yarn=True)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {k: _tiny.deepseek_dir(tmp_path_factory, **v) for k, v in MLA_VARIANTS.items()}


@pytest.fixture(scope="module")
def models(folders):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {k: qk.load(str(f)) for k, f in folders.items()}


@pytest.fixture(scope="module")
def standard(tmp_path_factory):
    dirs = {"gpt2": _tiny.gpt2_dir(tmp_path_factory), "llama": _tiny.llama_dir(tmp_path_factory),
            "mqa": _tiny.llama_mqa_dir(tmp_path_factory), "gemma3": _tiny.gemma3_dir(tmp_path_factory)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {k: qk.load(str(f)) for k, f in dirs.items()}


def _toks(model, n=2, seg=6):
    return qk.repeated_tokens(model, n_seqs=n, seg_len=seg, seed=0)


def _hf_eager(folder):
    """transformers' own model with eager attention, so that it returns its attention weights."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


def _raw(hf, layer):
    """Row-vector factors read straight from the HF state dict (not through the adapter)."""
    a = hf.model.layers[layer].self_attn
    cfg = hf.config
    H, dn, dr, dv, r = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                        cfg.kv_lora_rank)
    if cfg.q_lora_rank is None:
        WQ = a.q_proj.weight.T
    else:
        WQ = a.q_a_proj.weight.T @ torch.diag(a.q_a_layernorm.weight) @ a.q_b_proj.weight.T
    WQ = WQ.reshape(-1, H, dn + dr)                                    # [d_model, H, d_qk]
    kva = a.kv_a_proj_with_mqa.weight.T
    dkv = kva[:, :r] @ torch.diag(a.kv_a_layernorm.weight)
    kvb = a.kv_b_proj.weight.T.reshape(r, H, dn + dv)
    WO = a.o_proj.weight.T.reshape(H, dv, -1)
    return dict(WQ=WQ.detach(), dkv=dkv.detach(), WKR=kva[:, r:].detach(), UK=kvb[..., :dn].detach(),
                UV=kvb[..., dn:].detach(), WO=WO.detach(), dn=dn)


# ---------------------------------------------------------------------------------------------- fixtures

def test_fixtures_load_and_match_transformers(folders, models):
    """Each DeepSeek folder loads with qk.load; the bridge's patterns and logits equal transformers' own."""
    for key, folder in folders.items():
        m, hf = models[key], _hf_eager(folder)
        assert type(m.blocks[0].attn).__name__ == "MLAAttentionBridge" and family(m) == "latent"
        toks = _toks(m)
        with torch.no_grad():
            out = hf(toks, output_attentions=True)
        acts = qk.capture(m, toks, ["pattern"])
        for L in range(3):
            assert torch.allclose(acts["pattern", L], out.attentions[L], atol=1e-5), (key, L)
        assert torch.allclose(m(toks).log_softmax(-1), out.logits.log_softmax(-1), atol=1e-4)


def test_score_scale_is_the_modules_including_yarn_mscale(folders, models):
    """HF multiplies qk_head_dim^-0.5 by YaRN's mscale² (mscale = 0.1·mscale_all_dim·ln(factor) + 1)."""
    for key in ("v3_noq_yarn", "v2_yarn"):
        y = _tiny.YARN
        expect = 24 ** -0.5 * (0.1 * y["mscale_all_dim"] * math.log(y["factor"]) + 1) ** 2
        for L in range(3):
            assert qk.weights.attn_scale(models[key], L) == pytest.approx(expect, rel=1e-9)
        d = qk.diagnose(models[key], n_seqs=2, seq_len=12, progress=False)
        assert torch.allclose(d.scale, torch.full((3,), expect, dtype=d.scale.dtype), rtol=1e-6)
    assert qk.weights.attn_scale(models["v3"], 0) == pytest.approx(24 ** -0.5)


# ---------------------------------------------------------------------------------------------- capture

def test_capture_layouts_and_latents_equal_hf_submodules(folders, models):
    m, hf = models["v3"], _tiny.hf_model(folders["v3"])
    toks = _toks(m)
    got = {}
    a = hf.model.layers[1].self_attn
    hooks = [a.q_a_layernorm.register_forward_hook(lambda mod, i, o: got.__setitem__("q_latent", o)),
             a.kv_a_layernorm.register_forward_hook(lambda mod, i, o: got.__setitem__("kv_latent", o)),
             a.o_proj.register_forward_pre_hook(lambda mod, i: got.__setitem__("z", i[0]))]
    with torch.no_grad():
        hf(toks)
    for h in hooks:
        h.remove()
    acts = qk.capture(m, toks, ["q", "k", "v", "z", "q_latent", "kv_latent", "k_rope", "rot_q"], layers=[1])
    b, p = toks.shape
    assert acts["q", 1].shape == (b, p, 4, 24) and acts["v", 1].shape == (b, p, 4, 16)
    assert acts["z", 1].shape == (b, p, 4, 16) and acts.kv("k_rope", 1).shape == (b, p, 1, 8)
    # float32 rounding only: the latents reach |x| ~ 3 and the two norms sum in a different order. One session
    # measured 2.0e-6 (transformers 5.24 / transformer-lens 4.3; a later one got under 1e-6 on the same
    # versions: the BLAS path varies with the VM's host), so 1e-5 = a few float32 ulps at |x| ~ 3
    torch.testing.assert_close(acts["q_latent", 1], got["q_latent"], atol=1e-5, rtol=0)
    torch.testing.assert_close(acts["kv_latent", 1], got["kv_latent"], atol=1e-5, rtol=0)
    assert torch.allclose(acts["z", 1].reshape(b, p, -1), got["z"], atol=1e-6)     # head h = columns h·16..h·16+15
    with pytest.raises(QKCircuitsError, match="q_lora_rank None"):
        qk.capture(models["v2_noq"], toks, ["q_latent"])


def test_edit_z_on_mla_zeroes_exactly_that_heads_o_proj_input(folders, models):
    m, hf = models["v2_noq"], _tiny.hf_model(folders["v2_noq"])
    toks = _toks(m)

    def zero(mod, inp):
        z = inp[0].clone()
        z[..., 2 * 16:3 * 16] = 0
        return (z,)

    hk = hf.model.layers[1].self_attn.o_proj.register_forward_pre_hook(zero)
    with torch.no_grad():
        ref = hf(toks).logits
    hk.remove()
    with qk.edit(m, "z", "1.2", 0.0), torch.no_grad():
        mine = m(toks)
    assert torch.allclose(mine.log_softmax(-1), ref.log_softmax(-1), atol=1e-4)
    with qk.edit(m, "kv_latent", "1.0", 0.0), torch.no_grad():       # the shared latent: every head of layer 1
        changed = m(toks)
    assert not torch.allclose(changed, m(toks))


def test_latent_names_refused_on_standard_attention(standard):
    with pytest.raises(QKCircuitsError, match="LlamaForCausalLM has standard attention"):
        qk.capture(standard["llama"], _toks(standard["llama"]), ["kv_latent"])


# ---------------------------------------------------------------------------------------------- circuits

def test_latent_circuits_equal_the_raw_hf_factors(folders, models):
    """QK^h = W_Q^h W_K^hᵀ through the latent, OV^h = W_DKV·γ_kv·W_UV^h·W_O^h, from HF's state dict."""
    for key in ("v3", "v2_noq"):
        m, hf = models[key], _tiny.hf_model(folders[key])
        for L, h in ((0, 1), (2, 3)):
            r = _raw(hf, L)
            dn = r["dn"]
            WK = torch.cat([r["dkv"] @ r["UK"][:, h], r["WKR"]], 1)              # [d_model, d_qk]
            QK = r["WQ"][:, h] @ WK.T
            OV = r["dkv"] @ r["UV"][:, h] @ r["WO"][h]
            mq, mo = qk.qk(m, f"{L}.{h}"), qk.ov(m, f"{L}.{h}")
            assert mo.A.shape == (64, 16) and mq.A.shape == (64, 16 + 8)       # latent (+ shared rotary key) inside
            assert torch.allclose(mq.AB, QK, atol=1e-5) and torch.allclose(mo.AB, OV, atol=1e-5)
            # the content part alone: x W_Q,nope W_UKᵀ γ W_DKVᵀ yᵀ (rank ≤ kv_lora_rank)
            content = r["WQ"][:, h, :dn] @ (r["dkv"] @ r["UK"][:, h]).T
            assert torch.allclose(mq.A[:, :16] @ mq.B[:16], content, atol=1e-5)
            assert torch.linalg.matrix_rank(r["WQ"][:, h, :dn].double() @ (r["dkv"].double() @ r["UK"][:, h].double()).T
                                            ) <= 16
            # the rotary part at an offset: W_Q,rope R(Δ) W_KRᵀ, and Δ = 0 gives back QK
            spec = qk.weights.rotary_spec(m, layer=L)
            R = qk.weights.rotation(spec, [3], relative=True)[0][dn:, dn:]
            off = qk.weights.qk_at_offset(m, f"{L}.{h}", 3).AB
            assert torch.allclose(off, content + r["WQ"][:, h, dn:] @ R @ r["WKR"].T, atol=1e-5)
            assert torch.allclose(qk.weights.qk_at_offset(m, f"{L}.{h}", 0).AB, QK, atol=1e-5)


def test_rotary_spec_of_v2_and_v3_reproduces_the_models_rotary_scores(models):
    for key, m in models.items():
        for L in range(3):
            spec = qk.weights.rotary_spec(m, layer=L)
            assert spec.style == "pairs" and spec.offset == 16 and spec.rotary_dim == 8
            assert spec.verified_error is not None and spec.verified_error < 1e-5, (key, L, spec.verified_error)


def test_circuit_caveat_names_the_latent_norms(models):
    c = qk.circuit(models["v3"], "1.0", "qk")
    assert not c.exact and any("latent" in x and "RMSNorm" in x for x in c.caveats)


def test_eigen_copying_and_composition_run_through_the_latent(models):
    m = models["v3"]
    s = qk.copying_scores(m, full=False)
    hf = _tiny.hf_model(_tiny._BUILT["deepseek_v3_q32"])
    r = _raw(hf, 1)
    # the package's one convention: the block's input-norm weight sits with W_V (docs/circuits.md)
    g = hf.model.layers[1].input_layernorm.weight.detach()
    OV = torch.diag(g) @ r["dkv"] @ r["UV"][:, 2] @ r["WO"][2]
    lam = torch.linalg.eigvals(OV.double())
    assert float(s[1, 2]) == pytest.approx(float(lam.real.sum() / lam.abs().sum()), abs=1e-4)
    comp = qk.composition_scores(m, "K")
    r0, r1 = _raw(hf, 0), _raw(hf, 1)
    OV = r0["dkv"] @ r0["UV"][:, 1] @ r0["WO"][1]                                    # 0.1's OV
    WK = torch.cat([r1["dkv"] @ r1["UK"][:, 2], r1["WKR"]], 1)
    QKt = WK @ r1["WQ"][:, 2].T                                                     # 1.2's QKᵀ
    raw = (OV @ QKt).norm() / (OV.norm() * QKt.norm())
    assert float(comp.raw[0, 1, 1, 2]) == pytest.approx(float(raw), rel=1e-4)


# ---------------------------------------------------------------------------------------------- verify, kv cache

def test_verify_circuits_passes_on_every_family(models, standard):
    for key, m in {**standard, **models}.items():
        check = qk.verify_circuits(m)
        assert check.passed and check.max_error < 1e-4, (key, check)
        df = check.to_frame()
        assert len(df) == m.cfg.n_layers * m.cfg.n_heads and df["qk_error"].notna().all()
        assert qk.results.CircuitCheck.from_json(check.to_json()).max_error == pytest.approx(check.max_error)
    toy = qk.load("toy-induction")
    assert qk.verify_circuits(toy).passed


def test_verify_circuits_in_bf16_passes_at_the_dtypes_rounding_and_still_fails_a_wrong_circuit(tmp_path_factory,
                                                                                                 monkeypatch):
    # bf16 scores carry bf16 rounding (~0.01 relative): the default tolerance is 4 x its epsilon there, which a
    # right circuit meets and a wrong one (the scale off by √2) does not
    import _tiny

    m = qk.load(str(_tiny.gpt2_dir(tmp_path_factory)), dtype="bfloat16", verbose=False)
    check = qk.verify_circuits(m)
    assert check.tolerance == pytest.approx(4 * torch.finfo(torch.bfloat16).eps)
    assert check.passed and check.max_error > 1e-4, check                  # 1e-4 would refuse bf16 rounding
    assert qk.verify_circuits(m, tolerance=1e-4).passed is False
    att = adapter(m, 1)
    factor, src, cap = att.scale()
    monkeypatch.setattr(att, "scale", lambda: (factor * 2 ** 0.5, "wrong on purpose", cap))
    assert not qk.verify_circuits(m).passed


def test_verify_circuits_fails_when_the_circuit_math_is_wrong(models, monkeypatch):
    """A wrong score scale (1/√24 where YaRN's mscale² applies) must fail: the check can fail."""
    m = models["v3_noq_yarn"]
    att = adapter(m, 1)
    monkeypatch.setattr(att, "scale", lambda: (24 ** -0.5, "wrong on purpose", None))
    check = qk.verify_circuits(m)
    assert not check.passed and float(check.qk_error[1].min()) > 1e-2 and float(check.qk_error[0].max()) < 1e-4


def test_kv_cache_per_family(models, standard):
    assert qk.kv_cache(standard["llama"]).ratio == pytest.approx(0.5)          # GQA 2 of 4
    assert qk.kv_cache(standard["mqa"]).ratio == pytest.approx(0.25)
    assert qk.kv_cache(standard["gpt2"]).ratio == pytest.approx(1.0)
    c = qk.kv_cache(models["v3"])
    # latent 16 + rotary key 8 floats vs 4 heads × (K 24 + V 16), fp32
    assert c.per_layer_bytes == [(16 + 8) * 4] * 3 and c.mha_bytes == [4 * (24 + 16) * 4] * 3
    assert "MLA" in c.summary() and "0.15x" in c.summary()


# ---------------------------------------------------------------------------------------------- adapters

def test_head_inputs_recompute_the_hooks_on_every_family(models, standard):
    for key, m in {**standard, **models}.items():
        toks = _toks(m)
        L = 1
        names = [f"blocks.{L}.hook_resid_pre"] + [f"blocks.{L}.attn.hook_{x}" for x in "qkv"]
        _, cache = m.run_with_cache(toks, names_filter=lambda n: n in names)
        for x in "qkv":
            got = adapter(m, L).head_inputs(cache[names[0]], x)
            want = cache[f"blocks.{L}.attn.hook_{x}"]
            assert torch.allclose(got, want, atol=1e-5 * float(want.abs().max())), (key, x)


def test_unknown_attention_fails_with_one_line_naming_the_architecture():
    class Opaque:
        def __getattr__(self, name):
            raise NotImplementedError(f"{name} is not available on this attention")

    fake = types.SimpleNamespace(blocks=[types.SimpleNamespace(attn=Opaque())],
                                 cfg=types.SimpleNamespace(n_layers=1, architecture="MambaForCausalLM"))
    with pytest.raises(QKCircuitsError, match="no attention adapter for architecture MambaForCausalLM") as e:
        family(fake)
    assert "\n" not in str(e.value) and "DeepSeek" in str(e.value)


def test_olmo2_is_refused_in_one_line_not_analysed_wrongly(tmp_path):
    """OLMo-2 has no norm before its attention and one QK-norm across all heads: per-head W_Q views through ln1
    would be silently wrong, so every entry point that detects the family refuses, naming why."""
    m = qk.load(str(_tiny.tiny_olmo2(tmp_path / "olmo2")), device="cpu")
    with pytest.raises(QKCircuitsError, match="Olmo2ForCausalLM") as e:
        qk.scan(m, progress=False)
    msg = str(e.value)
    assert "\n" not in msg and ("no norm before the attention" in msg or "spans all heads" in msg)


# ---------------------------------------------------------------------------------------------- analyses on MLA

def test_scan_ablate_sweep_diagnose_paths_run_on_mla(models):
    m = models["v3"]
    toks = _toks(m)
    scores = qk.scan(m, progress=False)
    for name in ("induction", "previous_token", "copying", "eigen_copying"):
        assert torch.isfinite(scores[name]).all(), name
    eff = qk.sweep(m, toks, progress=False)
    assert torch.isfinite(eff.effects).all() and eff.effects.abs().max() > 0
    pe = qk.path_patch(m, "2.0", progress=False)
    for res in (pe, qk.edge_attribution(m, "2.0")):
        for t in res.effects.values():
            earlier = t[0, :2]                                  # senders in layers 0-1 of receiver 2.0
            assert torch.isfinite(earlier).all() and earlier.abs().max() > 0


def test_path_patching_into_one_mla_head_changes_only_that_head(models):
    """Patching head h's k recomputes the latent (with its norm) and h's own up-projection; the shared
    rotary key is patched in h's copy only: every other head's k stays clean."""
    from qkcircuits._foundation.heads import Head
    from qkcircuits._paths.path_core import clean_pass, receiver_run, references, sender_deltas

    m = models["v3"]
    toks = _toks(m)
    cache = clean_pass(m, toks, [2])
    delta = sender_deltas(m, cache, references(m, "mean", toks, [1]), [Head(1, 0)])
    got = {}

    def keep(t, hook):
        got["k"] = t.detach().clone()

    _, z = receiver_run(cache, 2, "k", delta, heads=[3], extra_hooks=[("blocks.2.attn.hook_k", keep)])
    clean_k = cache.inputs[("k", 2)]
    patched = adapter(m, 2).head_inputs(cache.resid[2] + delta[0], "k")
    assert torch.allclose(got["k"][:, :, :3], clean_k[:, :, :3])                   # heads 0-2 untouched
    assert torch.allclose(got["k"][:, :, 3], patched[:, :, 3], atol=1e-5)          # head 3: content and rotary key
    assert not torch.allclose(patched[:, :, 3], clean_k[:, :, 3])


# ---------------------------------------------------------------------------------------------- CLI

def test_cli_circuits_verify_on_v2_and_v3_folders(folders, capsys, monkeypatch):
    """`qkcircuits circuits FOLDER --head 1.0 --verify` prints the check and the KV line; exit 1 on failure."""
    from qkcircuits.cli import main

    for key in ("v3", "v2_noq"):
        assert main(["circuits", str(folders[key]), "--head", "1.0", "--verify"]) == 0
        out = capsys.readouterr().out
        assert "PASSED at 0.0001" in out and "KV cache: 96 B per token per layer (MLA" in out
    monkeypatch.setattr(qk.results.CircuitCheck, "passed", property(lambda self: False))
    assert main(["circuits", str(folders["v3"]), "--head", "1.0", "--verify"]) == 1
