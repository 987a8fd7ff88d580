"""Circuits against ground truth: hand-built heads, HF weights of tiny checkpoints, the models' own scores."""

from __future__ import annotations

import json
import warnings

import _tiny
import pytest
import torch
from transformer_lens.config import TransformerBridgeConfig
from transformer_lens.model_bridge import TransformerBridge

import qkcircuits as qk
import qkcircuits._weights.rotary as qkcircuits_rotary
from qkcircuits import QKCircuitsError


def _native(seed=1, **kw):
    cfg = dict(d_model=64, d_head=16, n_layers=4, n_ctx=16, n_heads=4, d_vocab=50, attn_only=True,
               normalization_type=None, positional_embedding_type="standard", act_fn="relu", seed=seed, model_name="r")
    cfg.update(kw)
    return TransformerBridge.boot_native(TransformerBridgeConfig(**cfg), device="cpu").eval()


def _forward(model, tokens, layer):
    names = {qk.weights.attn_input_hook(model, layer), f"blocks.{layer}.attn.hook_attn_scores",
             f"blocks.{layer}.attn.hook_pattern", f"blocks.{layer}.attn.hook_q", f"blocks.{layer}.attn.hook_k"}
    if qk.has_rotary(model):
        names |= {f"blocks.{layer}.attn.hook_rot_q", f"blocks.{layer}.attn.hook_rot_k"}
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in names)
    return cache


def _causal(p):
    return torch.tril(torch.ones(p, p, dtype=torch.bool))


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    return _tiny.gpt2_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def gpt2(gpt2_folder):
    return qk.load(str(gpt2_folder), device="cpu", verbose=False)


@pytest.fixture(scope="module")
def gpt2_raw(gpt2_folder):
    return qk.load(str(gpt2_folder), device="cpu", fold_ln=False, verbose=False)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return qk.load(str(_tiny.llama_dir(tmp_path_factory)), device="cpu", verbose=False)


# ------------------------------------------------------------------------------- weight products

def test_qk_ov_equal_hf_weight_products_gpt2(gpt2_raw, gpt2_folder):
    hf = _tiny.hf_model(gpt2_folder)
    d, H = hf.config.n_embd, hf.config.n_head
    dh = d // H
    for layer in range(2):
        W, b = hf.transformer.h[layer].attn.c_attn.weight, hf.transformer.h[layer].attn.c_attn.bias   # x W + b
        Wo = hf.transformer.h[layer].attn.c_proj.weight
        for h in range(H):
            sl = slice(h * dh, (h + 1) * dh)
            Wq, Wk, Wv = W[:, sl], W[:, d:][:, sl], W[:, 2 * d:][:, sl]
            torch.testing.assert_close(qk.qk(gpt2_raw, (layer, h)).AB, Wq @ Wk.T, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(qk.ov(gpt2_raw, (layer, h)).AB, Wv @ Wo[sl], atol=1e-5, rtol=1e-5)
            aff = qk.weights.qk_affine(gpt2_raw, (layer, h)).AB
            bq, bk = b[sl], b[d:][sl]
            torch.testing.assert_close(aff[-1, -1], bq @ bk, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(aff[:-1, -1], Wq @ bk, atol=1e-5, rtol=1e-5)


def test_qk_ov_gqa_use_their_own_kv_head_llama(tmp_path_factory):
    folder = _tiny.llama_dir(tmp_path_factory)
    raw = qk.load(str(folder), device="cpu", fold_ln=False, verbose=False)
    hf = _tiny.hf_model(folder)
    attn = hf.model.layers[1].self_attn
    dh, group = 8, 2
    for h in range(4):
        kv = slice((h // group) * dh, (h // group + 1) * dh)
        Wq, Wk = attn.q_proj.weight[h * dh:(h + 1) * dh].T, attn.k_proj.weight[kv].T
        Wv, Wo = attn.v_proj.weight[kv].T, attn.o_proj.weight[:, h * dh:(h + 1) * dh].T
        torch.testing.assert_close(qk.qk(raw, (1, h)).AB, Wq @ Wk.T, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(qk.ov(raw, (1, h)).AB, Wv @ Wo, atol=1e-5, rtol=1e-5)
    allqk = qk.weights.all_qk(raw)
    assert allqk.A.shape == (2, 4, 32, 8)
    torch.testing.assert_close(allqk[1, 3].AB, qk.qk(raw, "1.3").AB)


def test_layer_weights_expand_kv_once_gqa(llama):
    """K/V per KV head are repeated to query heads once; a bridge handing out per-query-head K/V is not re-expanded."""
    from types import SimpleNamespace

    n_heads, n_kv = llama.cfg.n_heads, qk.n_kv_heads(llama)
    assert (n_heads, n_kv) == (4, 2)
    attn = llama.blocks[1].attn
    assert attn.W_K.shape[0] == n_kv                                      # this bridge: per KV head
    w = qk.weights.layer_weights(llama, 1)
    for h in range(n_heads):                                              # HF repeat_kv: head h reads KV head h // 2
        torch.testing.assert_close(w.W_K[h], attn.W_K[h // 2])
        torch.testing.assert_close(w.W_V[h], attn.W_V[h // 2])

    def fake(W_K, W_V):
        block = SimpleNamespace(attn=SimpleNamespace(W_Q=attn.W_Q, W_K=W_K, W_V=W_V, W_O=attn.W_O))
        return SimpleNamespace(cfg=llama.cfg, blocks=[block, block])

    expanded = fake(w.W_K, w.W_V)
    again = qk.weights.layer_weights(expanded, 1)
    assert again.W_K.shape == again.W_Q.shape == (4, 32, 8)
    torch.testing.assert_close(again.W_K, w.W_K)
    torch.testing.assert_close(again.W_V, w.W_V)
    with pytest.raises(QKCircuitsError, match=r"W_K has 3 heads; expected 2 \(KV heads\) or 4"):
        qk.weights.layer_weights(fake(w.W_K[:3], w.W_V), 1)


def test_qk_ov_hand_built_match_construction(hand_built):
    a1 = hand_built.original_model.layers[1].attn
    d_head = hand_built.cfg.d_head
    s = slice(0, d_head)
    torch.testing.assert_close(qk.qk(hand_built, "1.0").AB, a1.q.weight[s].T @ a1.k.weight[s])
    torch.testing.assert_close(qk.ov(hand_built, "1.0").AB, a1.v.weight[s].T @ a1.o.weight[:, s].T)


# ---------------------------------------------------------------------- bilinear identity vs model

@pytest.mark.parametrize("fixture", ["gpt2", "gpt2_raw"])
def test_bilinear_form_reproduces_scores_gpt2(fixture, request):
    model = request.getfixturevalue(fixture)
    tokens = torch.randint(0, model.cfg.d_vocab, (1, 24), generator=torch.Generator().manual_seed(0))
    mask = _causal(24)
    for layer in range(2):
        c = _forward(model, tokens, layer)
        x = c[qk.weights.attn_input_hook(model, layer)][0]
        ours = qk.weights.offset_scores(model, layer, x)
        ref = c[f"blocks.{layer}.attn.hook_attn_scores"][0]
        torch.testing.assert_close(ours[:, mask], ref[:, mask], atol=1e-4, rtol=1e-4)
        qref = torch.einsum("qhd,khd->hqk", c[f"blocks.{layer}.attn.hook_q"][0], c[f"blocks.{layer}.attn.hook_k"][0])
        torch.testing.assert_close(ours[:, mask], (qref * qk.weights.attn_scale(model, layer))[:, mask], atol=1e-4, rtol=1e-4)
        pat = torch.softmax(ours.masked_fill(~mask, float("-inf")), -1)
        torch.testing.assert_close(pat, c[f"blocks.{layer}.attn.hook_pattern"][0], atol=1e-5, rtol=1e-4)
        # the biases are perturbed: leaving them out must break the identity (the test can fail)
        plain = qk.weights.offset_scores(model, layer, x, affine=False)
        assert (plain - ref)[:, mask].abs().max() > 1e-2


def test_bilinear_form_reproduces_scores_hand_built(hand_built):
    """Native model: hook_attn_scores carries the pattern (TL quirk), so compare with q·kᵀ·scale and the pattern."""
    tokens = torch.tensor([[0, 5, 9, 3, 7, 5, 9, 3, 7, 11]])
    mask = _causal(10)
    for layer in range(2):
        c = _forward(hand_built, tokens, layer)
        ours = qk.weights.offset_scores(hand_built, layer, c[qk.weights.attn_input_hook(hand_built, layer)][0])
        qref = torch.einsum("qhd,khd->hqk", c[f"blocks.{layer}.attn.hook_q"][0], c[f"blocks.{layer}.attn.hook_k"][0])
        torch.testing.assert_close(ours[:, mask], (qref * qk.weights.attn_scale(hand_built, layer))[:, mask], atol=1e-3, rtol=1e-5)
        pat = torch.softmax(ours.masked_fill(~mask, float("-inf")), -1)
        torch.testing.assert_close(pat, c[f"blocks.{layer}.attn.hook_pattern"][0], atol=1e-5, rtol=1e-4)


def test_rotary_offset_identity_tiny_llama_and_wrong_base_fails(llama):
    spec = qk.weights.rotary_spec(llama)
    assert spec.style == "halves" and spec.verified_error < 1e-5 and not spec.caveats
    assert spec.base == _tiny.LLAMA_THETA and llama.cfg.rotary_base != _tiny.LLAMA_THETA
    tokens = torch.randint(0, llama.cfg.d_vocab, (1, 40), generator=torch.Generator().manual_seed(1))
    mask = _causal(40)
    for layer in range(2):
        c = _forward(llama, tokens, layer)
        x, ref = c[qk.weights.attn_input_hook(llama, layer)][0], c[f"blocks.{layer}.attn.hook_attn_scores"][0]
        ours = qk.weights.offset_scores(llama, layer, x, spec=spec)
        torch.testing.assert_close(ours[:, mask], ref[:, mask], atol=1e-4, rtol=1e-4)
        for h, i, j in [(1, 30, 29), (3, 39, 2)]:                      # the public circuit, entry by entry
            M = qk.weights.qk_at_offset(llama, (layer, h), i - j, affine=True)
            s = torch.cat([x[i], torch.ones(1)]) @ M.AB @ torch.cat([x[j], torch.ones(1)]) * qk.weights.attn_scale(llama, layer)
            assert float(s) == pytest.approx(float(ref[h, i, j]), abs=1e-4)
        wrong = qk.weights.offset_scores(llama, layer, x, spec=qk.weights.rotary_spec(llama, base=10000.0))
        assert (wrong - ref)[:, mask].abs().max() > 0.05


def test_rotary_native_adjacent_pairs_detected():
    m = _native(positional_embedding_type="rotary", n_layers=2, rotary_dim=16)
    spec = qk.weights.rotary_spec(m)
    assert spec.style == "pairs" and spec.verified_error < 1e-5
    tokens = torch.arange(12)[None] * 3 % 50
    c = _forward(m, tokens, 1)
    ours = qk.weights.offset_scores(m, 1, c[qk.weights.attn_input_hook(m, 1)][0], spec=spec)
    # the native attention fires no hook_rot_q: rotate hook_q/hook_k with the model's own rotary module
    q, k = c["blocks.1.attn.hook_q"].transpose(1, 2), c["blocks.1.attn.hook_k"].transpose(1, 2)
    rq, rk = m.original_model.rotary.apply_rope(q, k)
    ref = (rq[0] @ rk[0].transpose(-1, -2))
    mask = _causal(12)
    torch.testing.assert_close(ours[:, mask], (ref * qk.weights.attn_scale(m, 1))[:, mask], atol=1e-4, rtol=1e-4)
    pat = torch.softmax(ours.masked_fill(~mask, float("-inf")), -1)
    torch.testing.assert_close(pat, c["blocks.1.attn.hook_pattern"][0], atol=1e-5, rtol=1e-4)
    halves = qk.weights.RotarySpec(spec.omega, "halves", spec.rotary_dim, spec.d_head)
    assert (qk.weights.offset_scores(m, 1, c[qk.weights.attn_input_hook(m, 1)][0], spec=halves) - ours)[:, mask].abs().max() > 1e-2


@pytest.mark.parametrize("rotary", [True, False])
def test_offset_scores_move_rotations_once(rotary):
    """R(Δ) (or the identity) is converted to the weights' device/dtype once, not per (head, offset).

    Counted as tensor copies on a float64 model fed float32 rows (the same ``.to`` path a GPU model
    takes): converting inside the loops made 4 heads x 16 offsets = 64 copies. The scores equal the
    float64 bilinear form of the model's own rotated q/k.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountCopies(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
                self.n += 1
            return func(*args, **(kwargs or {}))

    m = _native(positional_embedding_type="rotary" if rotary else "standard", n_layers=2)
    m.to(torch.float64)
    spec = qk.weights.rotary_spec(m) if rotary else None
    tokens = torch.arange(16)[None] * 3 % 50
    c = _forward(m, tokens, 1)
    x = c[qk.weights.attn_input_hook(m, 1)][0]
    with CountCopies() as count:
        ours = qk.weights.offset_scores(m, 1, x.float(), spec=spec)
    assert count.n <= 10, count.n                      # a constant few (weights, rows, result), not 64
    assert ours.dtype == torch.float32 and ours.device == x.device
    q, k = c["blocks.1.attn.hook_q"], c["blocks.1.attn.hook_k"]
    if rotary:
        q, k = qkcircuits_rotary.rotate_native(m.blocks[1].attn.original_component.rotary, q, k)
    ref = torch.einsum("qhd,khd->hqk", q[0], k[0]) * qk.weights.attn_scale(m, 1)
    mask = _causal(16)
    torch.testing.assert_close(ours[:, mask], ref[:, mask].float(), atol=1e-4, rtol=1e-4)


def test_normalised_embedding_is_layer0_input(llama):
    tokens = torch.tensor([[3, 17, 250, 3, 99]])
    c = _forward(llama, tokens, 0)
    torch.testing.assert_close(qk.weights.embed_rows(llama, 0)[tokens[0]], c[qk.weights.attn_input_hook(llama, 0)][0],
                               atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------- token circuits

@pytest.mark.parametrize("chunk_rows", [4096, 37])
def test_full_ov_rows_top_tokens_and_copying_accuracy_match_brute_force(gpt2_raw, chunk_rows, monkeypatch):
    import qkcircuits._weights.qk_ov as circuits

    monkeypatch.setattr(circuits, "CHUNK_ROWS", chunk_rows)          # 37: many vocabulary chunks
    model = gpt2_raw
    E, U = qk.weights.embed_rows(model, 1), qk.weights.unembed_cols(model)
    full = qk.weights.full_ov(model, "1.2")
    dense = E @ qk.ov(model, "1.2").AB @ U                                         # 400 x 400: fine here
    torch.testing.assert_close(full.AB, dense, atol=1e-4, rtol=1e-4)
    vals, idx = qk.weights.top_tokens(full, 7, k=5)
    torch.testing.assert_close(vals, dense[7].topk(5).values, atol=1e-4, rtol=1e-4)
    assert idx.tolist() == dense[7].topk(5).indices.tolist()
    _, cidx = qk.weights.top_tokens(full, 11, k=3, dim="col")
    assert cidx.tolist() == dense[:, 11].topk(3).indices.tolist()
    expect = (dense.argmax(-1) == torch.arange(dense.shape[0])).float().mean()
    got = qk.weights.copying_accuracy(model, "1.2", max_bytes=4 * 400 * 37)       # 37-row chunks
    assert float(got) == pytest.approx(float(expect))
    fq = qk.weights.full_qk(model, "0.1")
    torch.testing.assert_close(fq.AB[5, 9], qk.weights.embed_rows(model, 0)[5] @ qk.qk(model, "0.1").AB @ qk.weights.embed_rows(model, 0)[9],
                               atol=1e-4, rtol=1e-4)


def test_copying_accuracy_chunks_by_element_size_float64(gpt2_folder, monkeypatch):
    """A float64 model's chunks hold max_bytes // (8 · vocab) rows (sized for 4 bytes they were twice the bound)."""
    model = qk.load(str(gpt2_folder), device="cpu", fold_ln=False, dtype="float64", verbose=False)
    assert model.W_E.dtype == torch.float64
    vocab, budget = 400, 8 * 400 * 37                                   # 37 float64 rows, or 74 float32 ones
    E, U = qk.weights.embed_rows(model, 1), qk.weights.unembed_cols(model)
    dense = E @ qk.ov(model, "1.2").AB @ U
    expect = float((dense.argmax(-1) == torch.arange(vocab)).double().mean())
    rows, mm = [], torch.mm

    def counting_mm(a, b, *, out=None):
        if out is not None:                                            # the chunk product of copying_accuracy
            rows.append(a.shape[0])
            assert out.element_size() * out.numel() <= budget
        return mm(a, b, out=out) if out is not None else mm(a, b)

    monkeypatch.setattr(torch, "mm", counting_mm)
    got = qk.weights.copying_accuracy(model, "1.2", max_bytes=budget, progress=False)
    monkeypatch.undo()
    assert max(rows) == 37 and sum(rows) == vocab and len(rows) == -(-vocab // 37)
    assert float(got) == pytest.approx(expect)
    with pytest.raises(QKCircuitsError, match="max_bytes"):
        qk.weights.copying_accuracy(model, "1.2", max_bytes=0)


@pytest.mark.parametrize("fixture", ["gpt2", "gpt2_raw", "llama"])
def test_eigen_copying_from_small_side_equals_vocab_side(fixture, request, monkeypatch):
    """The d_head-side eigenvalues equal those of the dense vocab × vocab circuit in the stated convention:
    E_n without norm bias, U through the final norm, centred over the vocabulary (M − its row means). The
    GQA Llama has query heads sharing W_V: G·W_V is formed once per KV head there."""
    import qkcircuits._weights.qk_ov as circuits

    monkeypatch.setattr(circuits, "CHUNK_ROWS", 53)
    model = request.getfixturevalue(fixture)
    scores = qk.copying_scores(model)
    ov_scores = qk.copying_scores(model, full=False)
    folded_ov = qk.copying_scores(request.getfixturevalue("gpt2"), full=False)
    U = qk.weights.unembed_cols(model).double()
    for layer, h in [(0, 0), (1, 3)]:
        E_n = circuits.normalize_rows(model, model.W_E.detach(), "ln1", layer, bias=False).double()
        w = qk.weights.layer_weights(model, layer)
        dense = E_n @ w.W_V[h].double() @ w.W_O[h].double() @ U                  # 400 x 400
        dense = dense - dense.mean(1, keepdim=True)                                    # U centred over the vocab
        assert float(scores[layer, h]) == pytest.approx(float(qk.weights.eigen_copying(torch.linalg.eigvals(dense))), abs=1e-4)
        if fixture == "gpt2":
            dov = qk.ov(model, (layer, h)).AB.double()
            assert float(ov_scores[layer, h]) == pytest.approx(float(qk.weights.eigen_copying(torch.linalg.eigvals(dov))),
                                                               abs=1e-4)
    # raw weights: the OV score is put in the folded convention (ln1 weight in W_V, LayerNorm centring)
    if fixture != "llama":
        assert torch.allclose(ov_scores, folded_ov, atol=1e-4)


def _copy_model(sign_per_head):
    """Layer-0 heads whose full OV is sign·I: orthonormal embeddings E, W_U = Eᵀ, OV = sign·EᵀE."""
    V, d, dh = 24, 48, 24
    m = _native(seed=3, d_model=d, d_head=dh, n_layers=1, n_heads=len(sign_per_head), d_vocab=V)
    g = torch.Generator().manual_seed(0)
    E = torch.linalg.qr(torch.randn(d, V, generator=g))[0].T                     # [V, d], orthonormal rows
    M = torch.randn(dh, dh, generator=g) + 3 * torch.eye(dh)
    nat = m.original_model
    with torch.no_grad():
        nat.tok_embed.weight.copy_(E)
        nat.head.weight.copy_(E)                                                  # logits = x Eᵀ
        a = nat.layers[0].attn
        for h, sign in enumerate(sign_per_head):
            s = slice(h * dh, (h + 1) * dh)
            a.v.weight[s] = (E.T @ M).T                                           # W_V = Eᵀ M
            a.o.weight[:, s] = (sign * torch.linalg.inv(M) @ E).T                 # W_O = ±M⁻¹ E
    return m


def test_copying_scores_copier_and_anti_copier():
    m = _copy_model([1.0, -1.0])
    full, ovs = qk.copying_scores(m), qk.copying_scores(m, full=False)
    assert full[0, 0] == pytest.approx(1.0, abs=1e-4) and full[0, 1] == pytest.approx(-1.0, abs=1e-4)
    assert ovs[0, 0] == pytest.approx(1.0, abs=1e-4) and ovs[0, 1] == pytest.approx(-1.0, abs=1e-4)
    acc = qk.weights.copying_accuracy(m, progress=False)
    assert acc[0, 0] == 1.0 and acc[0, 1] == 0.0


def test_copying_scores_hand_built(hand_built):
    s = qk.copying_scores(hand_built)
    # 1.0's full OV is margin·diag(d) with d = +1 for every token but BOS (-1), by construction; the
    # convention centres U over the vocabulary: M − its row means. Eigenvalues of that dense matrix:
    V = hand_built.cfg.d_vocab
    d = torch.ones(V, dtype=torch.float64)
    d[0] = -1
    M = 30.0 * torch.diag(d)
    M = M - M.mean(1, keepdim=True)
    assert float(s[1, 0]) == pytest.approx(float(qk.weights.eigen_copying(torch.linalg.eigvals(M))), abs=1e-4)
    assert float(s[1, 0]) > 0.9
    assert float(s[0, 1]) == 0.0 and float(s[1, 1]) == 0.0                      # write nothing


# ------------------------------------------------------------------------------------- composition

@pytest.mark.parametrize("mode", ["Q", "K", "V"])
def test_random_model_composition_averages_zero_after_baseline(mode):
    comp = qk.composition_scores(_native(seed=5), mode)
    assert 0.05 < comp.baseline < 0.5
    assert abs(float(comp.scores.nanmean())) < 0.05 * comp.baseline
    assert float(comp.raw.nanmean()) == pytest.approx(comp.baseline, rel=0.05)
    assert torch.isnan(comp.scores[1, :, 0, :]).all() and torch.isnan(comp.scores[2, :, 2, :]).all()


def test_hand_built_k_composition_stands_out(hand_built):
    comp = qk.composition_scores(hand_built, "K")
    target = float(comp.scores[0, 0, 1, 0])
    others = comp.scores.clone()
    others[0, 0, 1, 0] = float("nan")
    assert target > 0.1 and target > float(others.nan_to_num(nan=-1.0).max()) + 0.1
    assert qk.k_composition_partners(hand_built, ["1.0"], scores=comp) == {qk.Head(1, 0): [(qk.Head(0, 0), target)]}
    text = comp.to_json()
    assert "NaN" not in text                                              # strict JSON: NaN pairs are null
    raw = json.loads(text)
    assert raw["scores"][1][0][0][0] is None and raw["settings"]["model"] == hand_built.cfg.model_name
    back = qk.results.CompositionScores.from_json(text)
    torch.testing.assert_close(back.scores, comp.scores, equal_nan=True, atol=1e-6, rtol=0)
    assert back.mode == "K" and back.baseline == comp.baseline


# ------------------------------------------------------------------------------ positions, caveats

def test_positional_qk_gpt2(gpt2):
    P = gpt2.W_pos
    M = qk.weights.positional_qk(gpt2, "0.1")
    torch.testing.assert_close(M.AB[10, 4], P[10] @ qk.qk(gpt2, "0.1").AB @ P[4], atol=1e-4, rtol=1e-4)
    with pytest.raises(QKCircuitsError, match="learned absolute"):
        qk.weights.positional_qk(_native(positional_embedding_type="rotary", n_layers=1, rotary_dim=16), "0.0")


def test_offset_profile_matches_direct_form(llama):
    prof = qk.offset_profile(llama, "1.2", offsets=range(0, 9))
    spec = qk.weights.rotary_spec(llama)
    w, E, s = qk.weights.layer_weights(llama, 1), qk.weights.embed_rows(llama, 1), qk.weights.attn_scale(llama, 1)
    qbar, kbar = (E @ w.W_Q[2]).mean(0), (E @ w.W_K[2]).mean(0)
    for d in (0, 3, 8):
        M = qk.weights.qk_at_offset(llama, "1.2", d, spec=spec)
        assert float(prof.norm[d]) == pytest.approx(float(M.AB.norm()) * s, rel=1e-4)
        R = qk.weights.rotation(spec, [d], relative=True)[0]
        assert float(prof.mean_score[d]) == pytest.approx(float(qbar @ R @ kbar) * s, rel=1e-4, abs=1e-5)
    assert set(prof.summary()) >= {"preferred_offset", "score_range"}


def test_offset_profile_mean_row_is_recomputed_after_an_embedding_edit(llama):
    """The mean embedding row is cached per model; an in-place edit of W_E must not be served stale."""
    before = qk.offset_profile(llama, "1.2", offsets=range(0, 5)).mean_score.clone()
    E = llama.W_E
    saved = E.detach().clone()
    g = torch.Generator().manual_seed(3)
    try:
        with torch.no_grad():
            E.add_(torch.randn(E.shape, generator=g) * E.abs().mean())
        after = qk.offset_profile(llama, "1.2", offsets=range(0, 5)).mean_score
        w, s = qk.weights.layer_weights(llama, 1), qk.weights.attn_scale(llama, 1)
        rows = qk.weights.embed_rows(llama, 1)
        qbar, kbar = (rows @ w.W_Q[2]).mean(0), (rows @ w.W_K[2]).mean(0)
        R = qk.weights.rotation(qk.weights.rotary_spec(llama), [4], relative=True)[0]
        assert float(after[4]) == pytest.approx(float(qbar @ R @ kbar) * s, rel=1e-4, abs=1e-5)
        assert not torch.allclose(after, before)
    finally:
        with torch.no_grad():
            E.copy_(saved)


def test_soft_capped_model_is_flagged_not_silently_wrong():
    m = _native(seed=2, n_layers=1, attn_scores_soft_cap=5.0)
    cav = qk.weights.circuit_caveats(m)
    assert any("soft-capped" in c for c in cav)
    with pytest.warns(UserWarning, match="soft-capped"):
        res = qk.circuit(m, "0.0", "qk")
    assert not res.exact and res.caveats == cav
    with pytest.warns(UserWarning, match="soft-capped"):
        qk.weights.offset_scores(m, 0, torch.randn(5, 64))
    with pytest.warns(UserWarning, match="soft-capped"):
        assert qk.composition_scores(m, "K").settings["caveats"] == cav
    with warnings.catch_warnings():
        warnings.simplefilter("error")                          # OV-side results are not affected: no warning
        assert qk.composition_scores(m, "V").settings["caveats"] == []
        qk.ov(m, "0.0")
    assert qk.weights.circuit_caveats(_native(seed=2, n_layers=1)) == []


def test_circuit_result_carries_settings(llama, hand_built):
    res = qk.circuit(llama, "1.1", "qk_offset", offset=2)
    assert res.exact and res.settings["offset"] == 2 and res.settings["rotary"]["style"] == "halves"
    torch.testing.assert_close(res.matrix.AB, qk.weights.qk_at_offset(llama, "1.1", 2).AB)
    assert qk.circuit(hand_built, "1.0", "full_ov").matrix.shape == (32, 32)
    assert res.settings["model"] == llama.cfg.model_name and llama.cfg.model_name
    unnamed = _native(n_layers=2)
    unnamed.cfg.model_name = ""                                         # one naming rule: empty -> "model"
    assert qk.circuit(unnamed, "0.0").settings["model"] == "model"
    assert qk.composition_scores(unnamed, "V", baseline=False).settings["model"] == "model"


def test_bad_input_errors(hand_built, llama):
    with pytest.raises(QKCircuitsError, match="out of range"):
        qk.qk(hand_built, "2.0")
    with pytest.raises(QKCircuitsError, match="not rotary"):
        qk.weights.rotary_spec(hand_built)
    with pytest.raises(QKCircuitsError, match="Q, K, V"):
        qk.composition_scores(hand_built, "X")
    with pytest.raises(QKCircuitsError, match="row index"):
        qk.weights.top_tokens(qk.weights.full_ov(hand_built, "1.0"), 99)
    with pytest.raises(QKCircuitsError, match="unknown circuit kind"):
        qk.circuit(hand_built, "1.0", "nope")
    with pytest.raises(QKCircuitsError, match="rotary base"):
        qk.weights.rotary_spec(llama, base=0.5)
    with pytest.raises(QKCircuitsError, match="expected one head, got 2"):
        qk.ov(hand_built, "1.*")
    with pytest.raises(QKCircuitsError, match="2-D"):
        qk.weights.top_tokens(qk.weights.all_ov(hand_built), 0)


def test_composition_column_equals_full_scores(hand_built):
    r = _native(seed=7)
    full = qk.composition_scores(r, "Q")
    torch.testing.assert_close(qk.weights.composition_column(r, "3.2", "Q"), full.scores[:3, :, 3, 2], atol=1e-6, rtol=1e-5)
    comp = qk.composition_scores(hand_built, "K")
    assert qk.k_composition_partners(hand_built, ["1.0"]) == qk.k_composition_partners(hand_built, ["1.0"], scores=comp)
    assert qk.weights.composition_column(hand_built, "0.1").shape == (0, 2)


# ---------------------------------------------------------------------------------------------- CLI

def test_cli_circuits_rotary_and_learned(tmp_path_factory, tmp_path, capsys):
    from qkcircuits.cli import main

    out = tmp_path / "c.json"
    assert main(["circuits", str(_tiny.llama_dir(tmp_path_factory)), "--device", "cpu", "--head", "1.2",
                 "--offsets", "8", "--tokens", "attention heads move information", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "eigen copying" in text and "K-composition partners" in text and "rotary halves base 500" in text
    import json
    s = json.loads(out.read_text())
    assert s["positions"]["kind"] == "rotary" and len(s["positions"]["mean_score"]) == 9
    assert [p for p, _ in s["k_composition"]["partners"]][0].startswith("0.")
    assert len(s["ov_top"]) == 3 and s["token_views"]["input"] == "contextual"      # layer 1: contextual
    assert all(1 <= row["copying_rank"] <= 400 for row in s["ov_top"])
    assert "copying rank (contextual inputs)" in text
    assert main(["circuits", str(_tiny.gpt2_dir(tmp_path_factory)), "--device", "cpu", "--head", "L0H1"]) == 0
    assert "(learned)" in capsys.readouterr().out


def test_cli_circuits_bad_head_exits_2(tmp_path_factory, capsys):
    from qkcircuits.cli import main

    assert main(["circuits", str(_tiny.gpt2_dir(tmp_path_factory)), "--device", "cpu", "--head", "7.0"]) == 2
    err = capsys.readouterr().err
    assert "error: --head '7.0': head 7.0 is out of range" in err and "Traceback" not in err


def test_qk_norm_model_is_flagged_and_really_leaves_the_bilinear_form(tmp_path):
    """Qwen3 renormalises q and k per position inside attention: flagged, and the identity does fail there."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = _tiny.bpe_tokenizer()
    cfg = Qwen3Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      intermediate_size=64, max_position_embeddings=64, vocab_size=len(tok), initializer_range=0.2,
                      rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(cfg).eval()
    _tiny._perturb(hf, 0)
    model = qk.load(str(_tiny._save(tmp_path / "qwen3", hf, tok)), device="cpu", verbose=False)
    cav = qk.weights.circuit_caveats(model)
    assert len(cav) == 1 and "QK-norm" in cav[0]
    with pytest.warns(UserWarning, match="QK-norm"):
        assert not qk.circuit(model, "0.1", "qk_offset", offset=1).exact
    tokens = torch.randint(0, len(tok), (1, 12), generator=torch.Generator().manual_seed(0))
    c = _forward(model, tokens, 0)
    mask = _causal(12)
    with pytest.warns(UserWarning, match="QK-norm"):
        ours = qk.weights.offset_scores(model, 0, c[qk.weights.attn_input_hook(model, 0)][0])
    err = ours - c["blocks.0.attn.hook_attn_scores"][0]
    assert err[:, mask].abs().max() > 0.1


def test_raw_composition_equals_transformer_lens():
    r = _native(seed=9)
    for mode in "QKV":
        ours = qk.composition_scores(r, mode, baseline=False)
        tl = r.all_composition_scores(mode)
        mask = ~torch.isnan(ours.raw)
        assert int(mask.sum()) == 6 * 16                       # 4 layers x 4 heads: earlier -> later pairs
        torch.testing.assert_close(ours.raw[mask], tl[mask].float(), atol=1e-5, rtol=1e-4)


def test_scale_is_read_from_the_model_gpt2_inverse_layer_idx(tmp_path):
    """GPT-2 with scale_attn_by_inverse_layer_idx divides layer L's scores by (L+1) as well: read, not assumed."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = _tiny.bpe_tokenizer()
    cfg = GPT2Config(n_layer=2, n_head=4, n_embd=32, n_positions=32, vocab_size=len(tok), initializer_range=0.2,
                     scale_attn_by_inverse_layer_idx=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(cfg).eval()
    _tiny._perturb(hf, 0)
    model = qk.load(str(_tiny._save(tmp_path / "gpt2-inv", hf, tok)), device="cpu", verbose=False)
    assert qk.weights.attn_scale(model, 1) == pytest.approx(8 ** -0.5 / 2)
    tokens = torch.randint(0, len(tok), (1, 16), generator=torch.Generator().manual_seed(2))
    c = _forward(model, tokens, 1)
    mask = _causal(16)
    ours = qk.weights.offset_scores(model, 1, c[qk.weights.attn_input_hook(model, 1)][0])
    torch.testing.assert_close(ours[:, mask], c["blocks.1.attn.hook_attn_scores"][0][:, mask], atol=1e-4, rtol=1e-4)
