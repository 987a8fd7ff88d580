"""capture / stream / edit against ground truth computed by hand and by transformers' own modules.

With fold_ln=True (the default) W_Q acts on ``blocks.L.ln1.hook_normalized``; q/k/v must also equal
the outputs of the HF projection modules of an independently loaded transformers model, and rot_q/rot_k
must equal HF Llama's rotate_half rotary with the theta from the HF config (not TL's cfg.rotary_base).
"""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch

import _tiny
import qkcircuits as qk
from qkcircuits import Head, QKCircuitsError, capture, edit, stream
from qkcircuits._foundation.capture import expand_kv

TEXT = "The river town woke slowly in the winter. Before the sun cleared the hills, the baker had lit his ovens."


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    folder = _tiny.gpt2_dir(tmp_path_factory)
    return qk.load(folder, device="cpu", verbose=False), _tiny.hf_model(folder)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = _tiny.llama_dir(tmp_path_factory)
    return qk.load(folder, device="cpu", verbose=False), _tiny.hf_model(folder)


def n_hooks(model) -> int:
    """Forward hooks on the model's hook points (hook_dict lists some points under two names: count once)."""
    points = {id(hp): hp for hp in model.hook_dict.values()}
    return sum(len(hp._forward_hooks) for hp in points.values())


def rotate_half_rotary(x, theta: float):
    """HF Llama's rotary on [batch, pos, head, d]: rotate_half pairs (i, i + d/2), positions 0..pos-1."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    freqs = torch.outer(torch.arange(x.shape[1], dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos()[None, :, None, :], emb.sin()[None, :, None, :]
    rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rotated * sin


def hf_projections(hf, tokens, layers):
    """q, k, v as transformers' own projection modules output them, per layer, [batch, pos, heads, d_head]."""
    cfg = hf.config
    out, handles = {}, []
    if cfg.model_type == "gpt2":
        d, nh = cfg.n_embd, cfg.n_head
        for L in layers:
            def grab(mod, inp, o, L=L):
                q, k, v = o.split(d, dim=-1)
                for n, t in zip("qkv", (q, k, v)):
                    out[n, L] = t.reshape(*t.shape[:2], nh, d // nh)
            handles.append(hf.transformer.h[L].attn.c_attn.register_forward_hook(grab))
    else:
        dh = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        for L in layers:
            attn = hf.model.layers[L].self_attn
            for n in "qkv":
                def grab(mod, inp, o, n=n, L=L):
                    out[n, L] = o.reshape(*o.shape[:2], -1, dh)
                handles.append(getattr(attn, f"{n}_proj").register_forward_hook(grab))
    try:
        with torch.no_grad():
            hf(tokens)
    finally:
        for h in handles:
            h.remove()
    return out


def check_qkv(model, hf, tokens, layers, theta=None, atol=1e-5):
    """Captured q/k/v (and rot_q/rot_k) against the hand projection and HF's modules; K/V per KV head."""
    names = ["q", "k", "v"] + (["rot_q", "rot_k"] if theta is not None else [])
    normalized = {}
    grab = [(f"blocks.{L}.ln1.hook_normalized", lambda t, hook, L=L: normalized.__setitem__(L, t.detach()))
            for L in layers]
    with model.hooks(fwd_hooks=grab):
        acts = capture(model, tokens, names, layers=layers)
    ref = hf_projections(hf, tokens, layers)
    n_heads, n_kv = model.cfg.n_heads, qk.n_kv_heads(model)
    for L in layers:
        x = normalized[L]
        for n, W in (("q", model.W_Q), ("k", model.W_K), ("v", model.W_V)):
            by_hand = torch.einsum("bpd,hde->bphe", x, W[L])
            try:
                by_hand = by_hand + getattr(model, {"q": "b_Q", "k": "b_K", "v": "b_V"}[n])[L]
            except AttributeError:            # bias-free projections (Llama) expose no b_Q/b_K/b_V
                assert hf.config.model_type != "gpt2"
            raw = acts.kv(n, L) if n != "q" else acts[n, L]
            assert raw.shape == (tokens.shape[0], tokens.shape[1], n_heads if n == "q" else n_kv, model.cfg.d_head)
            torch.testing.assert_close(raw, by_hand, atol=atol, rtol=0, msg=f"{n}@{L} vs x W")
            want = ref[n, L]
            if n == "v" and hf.config.model_type == "gpt2":
                # folding moves the value bias (with ln_1's bias folded in) into b_O: patterns sum to
                # 1, so z would gain exactly that bias. The bridge's v is HF's v minus it; its b_V is 0.
                d, block = hf.config.n_embd, hf.transformer.h[L]
                bias = block.attn.c_attn.bias[2 * d:] + block.ln_1.bias @ block.attn.c_attn.weight[:, 2 * d:]
                want = want - bias.detach().view(n_heads, -1)
                assert model.b_V[L].abs().max() == 0
            torch.testing.assert_close(raw, want, atol=atol, rtol=0, msg=f"{n}@{L} vs HF module")
        for n in ("k", "v"):                           # per query head: h reads KV head h // group
            per_q, per_kv = acts[n, L], acts.kv(n, L)
            assert per_q.shape[2] == n_heads
            for h in range(n_heads):
                assert torch.equal(per_q[:, :, h], per_kv[:, :, qk.kv_head(h, n_heads, n_kv)])
                assert torch.equal(acts.head(n, L, h), per_q[:, :, h])
        if theta is not None:
            torch.testing.assert_close(acts["rot_q", L], rotate_half_rotary(acts["q", L], theta), atol=atol, rtol=0)
            torch.testing.assert_close(acts.kv("rot_k", L), rotate_half_rotary(acts.kv("k", L), theta),
                                       atol=atol, rtol=0)
            # the check can tell thetas apart: TL's default 10000 would not match
            assert (acts["rot_q", L] - rotate_half_rotary(acts["q", L], 10000.0)).abs().max() > 1e-2
    return acts


def hf_theta(hf) -> float:
    cfg = hf.config
    params = getattr(cfg, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(cfg, "rope_theta", None)))


def test_gpt2_qkv_equal_hand_projection_with_biases(gpt2):
    model, hf = gpt2
    assert model.b_Q.abs().max() > 0.05 and model.b_K.abs().max() > 0.05      # biases really present
    tokens = model.to_tokens(TEXT)
    check_qkv(model, hf, tokens, layers=[0, 1])


def test_llama_gqa_qkv_and_rotary_equal_hand_computation(llama):
    model, hf = llama
    assert hf_theta(hf) == _tiny.LLAMA_THETA and qk.has_rotary(model)
    t = model.to_tokens(TEXT)[:, :28]
    tokens = torch.cat([t, torch.cat([t[:, :1], t[:, 1:].flip(1)], 1)], 0)        # batch of 2
    check_qkv(model, hf, tokens, layers=[0, 1], theta=hf_theta(hf))


@pytest.mark.parametrize("which", ["gpt2", "llama"])
def test_scores_pattern_and_z_equal_hand_attention(which, gpt2, llama):
    model, _ = {"gpt2": gpt2, "llama": llama}[which]
    rot = qk.has_rotary(model)
    tokens = model.to_tokens(TEXT)
    names = ["q", "k", "v", "scores", "pattern", "z"] + (["rot_q", "rot_k"] if rot else [])
    acts = capture(model, tokens, names)
    p = tokens.shape[1]
    future = torch.triu(torch.ones(p, p, dtype=torch.bool), 1)
    for L in range(model.cfg.n_layers):
        q, k = (acts["rot_q", L], acts["rot_k", L]) if rot else (acts["q", L], acts["k", L])
        scores = torch.einsum("bqhe,bkhe->bhqk", q, k) / math.sqrt(model.cfg.d_head)
        torch.testing.assert_close(acts["scores", L].masked_fill(future, 0), scores.masked_fill(future, 0),
                                   atol=1e-4, rtol=0)
        assert (acts["scores", L][..., future] < -1e30).all()           # masked, not a probability
        pattern = scores.masked_fill(future, float("-inf")).softmax(-1)
        torch.testing.assert_close(acts["pattern", L], pattern, atol=1e-5, rtol=0)
        z = torch.einsum("bhqk,bkhe->bqhe", acts["pattern", L], acts["v", L])
        torch.testing.assert_close(acts["z", L], z, atol=1e-5, rtol=0)
        assert acts.head("pattern", L, 1).shape == (1, p, p)


def test_hand_built_scores_are_scores_not_the_pattern(hand_built):
    """boot_native models fire hook_attn_scores with the pattern (a TL bug); capture must still give scores."""
    tokens = torch.tensor([[0, 5, 6, 7, 8, 5, 6, 7, 8]])
    acts = capture(hand_built, tokens, ["q", "k", "scores", "pattern"])
    p = tokens.shape[1]
    future = torch.triu(torch.ones(p, p, dtype=torch.bool), 1)
    for L in range(2):
        want = torch.einsum("bqhe,bkhe->bhqk", acts["q", L], acts["k", L]) / math.sqrt(hand_built.cfg.d_head)
        torch.testing.assert_close(acts["scores", L].masked_fill(future, 0), want.masked_fill(future, 0),
                                   atol=1e-3, rtol=1e-5)
        torch.testing.assert_close(acts["pattern", L], want.masked_fill(future, float("-inf")).softmax(-1),
                                   atol=1e-5, rtol=0)
        assert (acts["scores", L][..., future] < -1e30).all()
    # the hand-built previous-token head: margin 30 between i-1 and everything else
    s = acts["scores", 0][0, 0]
    assert (s[3, 2] - s[3, 1]).item() == pytest.approx(30.0, abs=1e-3)
    streamed = stream(hand_built, tokens, lambda layer, t: t["scores"].clone(), ["scores"])
    assert all(torch.equal(streamed[L], acts["scores", L]) for L in range(2))
    assert n_hooks(hand_built) == 0


@pytest.mark.smollm2
def test_smollm2_qkv_and_rotary_equal_hand_computation(smollm2):
    hf = _tiny.smollm2_hf()
    theta = hf_theta(hf)
    assert theta == 100000.0 and smollm2.cfg.n_heads == 9 and qk.n_kv_heads(smollm2) == 3
    tokens = torch.cat([torch.tensor([[1]]), smollm2.to_tokens("The capital of France is Paris, and the capital "
                                                               "of Italy is Rome.", prepend_bos=False)], 1)
    assert n_hooks(smollm2) == 0
    check_qkv(smollm2, hf, tokens, layers=[0, 7], theta=theta, atol=2e-4)
    assert n_hooks(smollm2) == 0


# ---- stream ---------------------------------------------------------------------------------------------

def test_stream_equals_capture_per_layer(llama):
    model, _ = llama
    tokens = model.to_tokens(TEXT)
    names = ["pattern", "k", "rot_q", "z"]
    acts = capture(model, tokens, names)
    seen = []

    def keep(layer, t):
        seen.append(layer)
        assert set(t) == set(names)
        return {n: v.clone() for n, v in t.items()}

    per_layer = stream(model, tokens, keep, names)
    assert seen == [0, 1] and sorted(per_layer) == [0, 1]
    for L in (0, 1):
        for n in names:
            assert torch.equal(per_layer[L][n], acts[n, L]), (n, L)   # K arrives per query head
    assert stream(model, tokens, lambda layer, t: layer * 10, ["q"], layers=[1]) == {1: 10}
    assert n_hooks(model) == 0


def test_stream_reduces_each_layer_before_the_next_and_keeps_none(gpt2):
    """The reducer runs as soon as its layer is done, and stream holds no earlier layer's tensors."""
    model, _ = gpt2
    tokens = model.to_tokens(TEXT)
    events, refs = [], []

    def reducer(layer, t):
        # every earlier layer's tensors must be gone by now: stream kept nothing but our return value
        gc.collect()
        alive = sorted({L for L, r in refs if r() is not None})
        events.append(("reduce", layer, tuple(alive)))
        refs.extend((layer, weakref.ref(v)) for v in t.values())
        return float(t["pattern"].diagonal(-1, -2, -1).mean())

    enter = [(f"blocks.{L}.hook_resid_pre", lambda t, hook, L=L: events.append(("enter", L, ()))) for L in (0, 1)]
    result = stream(model, tokens, reducer, ["pattern", "q", "v"], extra_hooks=enter)
    assert events == [("enter", 0, ()), ("reduce", 0, ()), ("enter", 1, ()), ("reduce", 1, ())]
    assert set(result) == {0, 1} and all(isinstance(v, float) for v in result.values())
    assert n_hooks(model) == 0


def test_capture_stops_after_the_last_requested_layer(gpt2):
    model, _ = gpt2
    reached = []
    with model.hooks(fwd_hooks=[("blocks.1.hook_resid_pre", lambda t, hook: reached.append(1))]):
        acts = capture(model, model.to_tokens(TEXT), ["q"], layers=[0])
    assert reached == [] and set(acts.tensors) == {("q", 0)}
    with pytest.raises(QKCircuitsError, match=r"\('q', 1\) was not captured; captured: q@0"):
        acts["q", 1]


def test_capture_input_errors(gpt2, hand_built):
    model, _ = gpt2
    tokens = model.to_tokens(TEXT)
    for call, match in [
        (lambda: capture(model, tokens, ["attn"]), r"unknown activation 'attn'; choose from q, k"),
        (lambda: capture(model, tokens, []), "name at least one activation"),
        (lambda: capture(model, tokens, ["rot_q"]), r"'rot_q' needs a rotary model.*'standard'"),
        (lambda: capture(model, tokens, ["q"], layers=[2]), r"layer 2 is out of range: the model has layers 0-1"),
        (lambda: capture(model, torch.zeros(1, 65, dtype=torch.long), ["q"]), r"length 65 exceeds .* 64 tokens"),
        (lambda: capture(model, torch.tensor([[0, 400]]), ["q"]), r"token id 400 is outside the vocabulary 0-399"),
        (lambda: capture(hand_built, "some text", ["q"]), "has no tokenizer"),
        (lambda: capture(model, tokens, ["q"]).kv("q", 0), "per query head"),
    ]:
        with pytest.raises(QKCircuitsError, match=match):
            call()
    assert n_hooks(model) == 0


# ---- edit -----------------------------------------------------------------------------------------------

EDIT_NAMES = ["q", "k", "v", "pattern", "z"]


def _run_all(model, tokens):
    acts = capture(model, tokens, EDIT_NAMES)
    out = {}
    hooks = [(f"blocks.{L}.hook_attn_out", lambda t, hook, L=L: out.__setitem__(L, t.detach())) for L in (0, 1)]
    with model.hooks(fwd_hooks=hooks), torch.no_grad():
        logits = model(tokens)
    return acts, out, logits


@pytest.mark.parametrize("replace", ["tensor", "scalar", "function"])
def test_edit_z_changes_exactly_that_heads_contribution(replace, gpt2):
    model, _ = gpt2
    tokens = model.to_tokens(TEXT)
    L, H = 0, 2
    base_acts, base_out, base_logits = _run_all(model, tokens)
    new_z = torch.randn(1, tokens.shape[1], model.cfg.d_head, generator=torch.Generator().manual_seed(0))
    value = {"tensor": new_z, "scalar": 0.0, "function": lambda t, head: 2.0 * t + 1.0}[replace]
    with edit(model, "z", f"{L}.{H}", value):
        assert n_hooks(model) == 1
        acts, out, logits = _run_all(model, tokens)
    assert n_hooks(model) == 0
    old_z = base_acts["z", L][:, :, H]
    want_z = {"tensor": new_z, "scalar": torch.zeros_like(old_z), "function": 2.0 * old_z + 1.0}[replace]
    torch.testing.assert_close(acts["z", L][:, :, H], want_z, atol=1e-6, rtol=0)
    others = [h for h in range(model.cfg.n_heads) if h != H]
    assert torch.equal(acts["z", L][:, :, others], base_acts["z", L][:, :, others])
    for n in ("q", "k", "v", "pattern"):                                 # the layer's own reads are untouched
        assert torch.equal(acts[n, L], base_acts[n, L]), n
    # the layer's output moved by exactly (z_new - z_old) W_O of that head
    delta = torch.einsum("bpe,ed->bpd", want_z - old_z, model.W_O[L, H])
    torch.testing.assert_close(out[L] - base_out[L], delta, atol=1e-5, rtol=0)
    assert delta.abs().max() > 1e-2
    assert (acts["q", 1] - base_acts["q", 1]).abs().max() > 1e-4       # downstream changes
    assert (logits - base_logits).abs().max() > 1e-4


def test_edit_q_changes_only_that_heads_pattern(llama):
    model, _ = llama
    tokens = model.to_tokens(TEXT)
    base = capture(model, tokens, ["pattern", "z", "k"])
    with edit(model, "q", "1.1", lambda t, head: -3.0 * t):           # head 1.1 shares KV head 0 with 1.0
        acts = capture(model, tokens, ["pattern", "z", "k"])
    assert (acts["pattern", 1][:, 1] - base["pattern", 1][:, 1]).abs().max() > 1e-2
    for h in (0, 2, 3):
        assert torch.equal(acts["pattern", 1][:, h], base["pattern", 1][:, h]), h
    assert torch.equal(acts["pattern", 0], base["pattern", 0]) and torch.equal(acts.kv("k", 1), base.kv("k", 1))
    assert torch.equal(acts["z", 1][:, :, [0, 2, 3]], base["z", 1][:, :, [0, 2, 3]])
    assert n_hooks(model) == 0


def test_gqa_k_edit_needs_kv_heads(llama, gpt2):
    model, _ = llama
    tokens = model.to_tokens(TEXT)
    for name in ("k", "v", "rot_k"):
        with pytest.raises(QKCircuitsError, match=rf"'{name}' is shared by 2 query heads .*kv_heads=True"):
            with edit(model, name, "0.1", 0.0):
                pass
    with pytest.raises(QKCircuitsError, match=r"head 0\.2 is out of range: .*heads 0-1"):
        with edit(model, "k", "0.2", 0.0, kv_heads=True):
            pass
    base = capture(model, tokens, ["pattern"], layers=[0])
    with edit(model, "k", "0.1", lambda t, head: 4.0 * t, kv_heads=True):     # KV head 1 = query heads 2, 3
        acts = capture(model, tokens, ["pattern"], layers=[0])
    assert torch.equal(acts["pattern", 0][:, :2], base["pattern", 0][:, :2])
    for h in (2, 3):
        assert (acts["pattern", 0][:, h] - base["pattern", 0][:, h]).abs().max() > 1e-3
    assert n_hooks(model) == 0
    # no GQA: k of one head is that head's alone
    gmodel, _ = gpt2
    gbase = capture(gmodel, tokens, ["pattern"], layers=[0])
    with edit(gmodel, "k", "0.3", 0.0):
        gacts = capture(gmodel, tokens, ["pattern"], layers=[0])
    assert torch.equal(gacts["pattern", 0][:, :3], gbase["pattern", 0][:, :3])
    assert (gacts["pattern", 0][:, 3] - gbase["pattern", 0][:, 3]).abs().max() > 1e-3


def test_edit_hooks_removed_on_exit_and_on_exceptions(gpt2):
    model, _ = gpt2
    tokens = model.to_tokens(TEXT)
    with torch.no_grad():
        clean = model(tokens)
    with pytest.raises(ZeroDivisionError):
        with edit(model, "z", "0.0-3", 0.0):
            assert n_hooks(model) == 1
            1 / 0
    assert n_hooks(model) == 0

    def broken(t, head):
        raise RuntimeError("replacement failed")

    with pytest.raises(RuntimeError, match="replacement failed"):
        with edit(model, "v", "1.0", broken):
            model(tokens)
    assert n_hooks(model) == 0
    with edit(model, "z", "0.1", 0.0), edit(model, "q", "1.2", 0.0):     # nested edits compose
        assert n_hooks(model) == 2
    assert n_hooks(model) == 0

    def bad_reducer(layer, t):
        raise ValueError("reducer failed")

    with pytest.raises(ValueError, match="reducer failed"):
        stream(model, tokens, bad_reducer, ["pattern"])
    assert n_hooks(model) == 0
    with torch.no_grad():
        assert torch.equal(model(tokens), clean)                       # nothing left behind
    with pytest.raises(QKCircuitsError, match=r"cannot edit 'pattern'; editable activations are q, k, v"):
        with edit(model, "pattern", "0.0", 0.0):
            pass
    with pytest.raises(QKCircuitsError, match="out of range"):
        with edit(model, "z", "0.9", 0.0):
            pass


# ---- GPU ------------------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_capture_runs_on_cuda_without_cpu_round_trips(tmp_path_factory, monkeypatch):
    from qkcircuits.fixtures import hand_built_induction_model

    hb = hand_built_induction_model(device="cuda")
    model = qk.load(_tiny.llama_dir(tmp_path_factory), device="cuda", verbose=False)
    assert model.W_Q.device.type == "cuda"
    tokens = torch.tensor([[0, 5, 6, 7, 8, 5, 6, 7, 8]], device="cuda")
    calls = []
    original = torch.Tensor.cpu

    def spy(self, *a, **k):
        calls.append(tuple(self.shape))
        return original(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "cpu", spy)
    acts = capture(hb, tokens, ["q", "k", "pattern", "z"])
    per_layer = stream(model, model.to_tokens(TEXT), lambda layer, t: t["pattern"].amax(-1).mean(), ["pattern", "k"])
    with edit(model, "z", "1.1", 0.0):
        lacts = capture(model, model.to_tokens(TEXT), ["rot_q", "k", "z"])
    monkeypatch.setattr(torch.Tensor, "cpu", original)
    assert calls == []
    assert all(t.device.type == "cuda" for t in acts.tensors.values())
    assert all(v.device.type == "cuda" for v in per_layer.values())
    assert all(t.device.type == "cuda" for t in lacts.tensors.values()) and bool((lacts["z", 1][:, :, 1] == 0).all())
    # the hand-built heads are still exact on the GPU
    assert acts["pattern", 0][0, 0, 3, 2].item() > 0.999 and acts["pattern", 1][0, 0, 5, 2].item() > 0.999


def test_hooks_that_never_fire_are_an_error_not_an_empty_result():
    # TL-native rotary models declare hook_rot_q/hook_rot_k but never call them.
    from transformer_lens.config import TransformerBridgeConfig
    from transformer_lens.model_bridge import TransformerBridge

    cfg = TransformerBridgeConfig(d_model=32, d_head=8, n_layers=2, n_ctx=16, n_heads=4, d_vocab=50, attn_only=True,
                                  positional_embedding_type="rotary", seed=0)
    model = TransformerBridge.boot_native(cfg)
    toks = torch.tensor([[1, 2, 3, 4]])
    with pytest.raises(qk.QKCircuitsError, match="never fired the hooks for rot_q@0, rot_q@1"):
        qk.capture(model, toks, ["rot_q"])
    with pytest.raises(qk.QKCircuitsError, match="never fired"):
        qk.stream(model, toks, lambda layer, t: 0, ["rot_k"])
    assert qk.capture(model, toks, ["q"])["q", 1].shape == (1, 4, 4, 8)


def test_token_checks_name_the_bad_value(hand_built):
    with pytest.raises(QKCircuitsError, match="token id -1 is outside the vocabulary 0-31"):
        capture(hand_built, torch.tensor([[0, 3, -1]]), ["q"])
    with pytest.raises(QKCircuitsError, match="token id 32 is outside"):
        capture(hand_built, torch.tensor([[0, 32, 1]]), ["q"])
    with pytest.raises(QKCircuitsError, match="exceeds the model's context of 128"):
        capture(hand_built, torch.zeros(1, 129, dtype=torch.long), ["q"])
    with pytest.raises(QKCircuitsError, match="no tokenizer"):
        capture(hand_built, "some text", ["q"])
