"""A layer's own rotary embedding, read from the model and verified against it: ``layer_rotary(att)`` →
``RotarySpec`` (the math lives in ``_foundation/rope``; ``_weights.rotary.rotary_spec`` is the public name).

>>> from qkcircuits._foundation.arch import adapter
>>> adapter(model, 0).rotary() is None            # the hand-built toy has learned positions, no rotary
True

Where the frequencies come from, in order: a multi-head latent layer's rotary module (its rope part follows
``qk_nope_head_dim`` content coordinates); a TL-native rotary's own cos/sin tables (ω = atan2(sin, cos) at
position 1); a position-free (NoPE) layer of a rotary model (R(Δ) = I); else the HF rotary module's
``inv_freq`` (per layer type where the model keeps one set per type, e.g. Gemma 3's
``sliding_attention_inv_freq``), or a precomputed sin|cos table (GPT-J), never ``cfg.rotary_base`` (wrong for
SmolLM2: 10000 vs 100000). The pairing — ``halves`` (HF ``rotate_half``) or ``pairs`` (adjacent 2k, 2k+1) —
is the one that reproduces the model's own rotated queries (``hook_rot_q``), or, where a bridge never fires
them (GPT-J, GPT-NeoX), its own attention pattern; ``verified_error`` says how well.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from jaxtyping import Float
from torch import Tensor

from ..model_cache import remembered
from ..errors import QKCircuitsError
from ..rope import STYLES, RotarySpec, rotate, rotation

__all__ = ["has_rotary", "layer_frequencies", "layer_rotary", "rotate_native"]


def has_rotary(model) -> bool:
    """Whether the model applies rotary embeddings (it then declares ``hook_rot_q``/``hook_rot_k``)."""
    attn = model.blocks[0].attn
    return hasattr(attn, "hook_rot_q") and getattr(model.cfg, "positional_embedding_type", "standard") == "rotary"


def layer_rotary(att, verify: bool = True) -> Optional[RotarySpec]:
    """The rotary of adapter ``att``'s layer, or None on a model without rotary. ``verify``: check this layer's
    pairing against the model (one short partial forward, then cached on the adapter); ``False``: take the pairing
    verified on another layer of the model (the pairing is the architecture's), verifying this one only when no
    layer has been (QK attribution checks every layer's result against the model's own pattern anyway)."""
    model = att.model
    if not has_rotary(model):
        return None
    cached = getattr(att, "_rotary_spec", None)
    if cached is not None and (cached.verified_error is not None or "NoPE" in cached.source):
        return cached
    spec = _read(att)
    if "NoPE" in spec.source:
        att._rotary_spec = spec
        return spec
    other = None if verify else _verified_elsewhere(att)
    if other is not None:
        spec.style = other.style
        spec.caveats = [f"pairing {other.style!r} verified on layer {other.layer}"]
        return spec
    _verify_latent(att, spec) if att.family == "latent" else _detect_style(att, spec)
    att._rotary_spec = spec
    return spec


def _verified_elsewhere(att) -> Optional[RotarySpec]:
    """A verified rotary spec of another layer of the same model and family (adapters are remembered per model)."""
    for other in list(remembered(att.model, "adapters", None, dict).values()):     # arch.adapters(model)
        spec = getattr(other, "_rotary_spec", None)
        if other is not att and other.family == att.family and spec is not None and spec.verified_error is not None \
                and spec.verified_error <= 1e-4:
            return spec
    return None


def _read(att) -> RotarySpec:
    model, d_head = att.model, int(att.d_qk)
    native = att.native_rotary()
    if att.family == "latent":
        # the decoupled rotary part: d_rope coordinates after the d_nope content ones, one frequency set
        rot = att.rotary_module()
        rope = getattr(model.original_model.config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta") if isinstance(rope, dict) else None
        how = ("complex pairs" if att.rope_style == "pairs" and not att.rope_permuted
               else "interleaved pairs" if att.rope_permuted else "halves")
        spec = RotarySpec(rot.inv_freq.detach().float().cpu(), att.rope_style, att.d_rope, d_head,
                          float(getattr(rot, "attention_scaling", 1.0) or 1.0), float(theta) if theta else None,
                          f"HF {type(rot).__name__}.inv_freq ({how})", offset=att.d_nope)
    elif native is not None:
        # TL-native rotary keeps cos/sin tables [n_ctx, rotary_dim] in adjacent pairs: ω = atan2(sin, cos) at p = 1
        # (every ω < π), so rope scaling (linear, NTK, llama3) is read off the tables, not re-derived from cfg
        c, s = native.cos_cached[1, 0::2].double().cpu(), native.sin_cached[1, 0::2].double().cpu()
        omega = torch.atan2(s, c).float()
        rd = int(getattr(native, "rotary_dim", 2 * omega.numel()))
        base = getattr(native, "effective_base", None)
        spec = RotarySpec(omega, "pairs", rd, d_head, 1.0, float(base) if base else None, "TL-native rotary")
    elif not att.uses_rotary():
        # a position-free layer of a rotary model (SmolLM3, Llama-4 NoPE layers): R(Δ) = I for every offset
        spec = RotarySpec(torch.zeros(d_head // 2), "halves", 2 * (d_head // 2), d_head, 1.0, None,
                          "no rotary on this layer (NoPE: config.no_rope_layers)")
    else:
        inv, scaling, theta, where = att.rotary_frequencies()
        inv = inv.detach().float().cpu()
        style = "pairs" if getattr(model.cfg, "rotary_adjacent_pairs", False) else "halves"
        spec = RotarySpec(inv, style, 2 * inv.numel(), d_head, float(scaling or 1.0),
                          float(theta) if theta else None, f"HF {where}")
    spec.layer, spec.layer_type, spec.window = att.layer, att.layer_type(), att.window()
    return spec


# ------------------------------------------------------------------------------------------ verification

def _detect_style(att, spec: RotarySpec, n_pos: int = 12) -> None:
    """Pick the pairing that reproduces the model's own ``hook_rot_q`` from ``hook_q``; flag a miss."""
    model = att.model
    n = min(n_pos, int(model.cfg.n_ctx))
    n = n + 1 if n == int(model.cfg.n_heads) and n < int(model.cfg.n_ctx) else n   # keep [pos, head] unambiguous
    native = att.native_rotary()
    if native is not None:
        # TL-native attention does not fire hook_rot_q: ask its rotary module to rotate a probe
        probe = torch.randn(1, n, 1, spec.d_head, generator=torch.Generator().manual_seed(0))
        q, rq = probe[0].float(), rotate_native(native, probe, probe)[0][0].float().cpu()   # [pos, 1, d_head]
    else:
        toks = (torch.arange(n) * 7 + 3) % int(model.cfg.d_vocab)
        q, rq = _rotary_probe(att, toks)
        if rq is None:
            _style_from_pattern(att, spec, toks)
            return
    errs = {}
    for style in STYLES:
        trial = RotarySpec(spec.omega, style, spec.rotary_dim, spec.d_head, spec.scaling)
        R = rotation(trial, range(n))                                             # [pos, d, d]
        errs[style] = float((torch.einsum("phd,pde->phe", q, R) - rq).abs().max() / rq.abs().max().clamp_min(1e-12))
    best = min(errs, key=errs.get)
    spec.style, spec.verified_error = best, errs[best]
    if errs[best] > 1e-4:
        spec.caveats.append(f"the rebuilt rotary does not reproduce the model's own rotated queries (relative error "
                            f"{errs[best]:.2g}); offset circuits may be wrong")


def _style_from_pattern(att, spec: RotarySpec, toks: Tensor) -> None:
    """No rotated queries exposed (GPT-J, GPT-NeoX bridges never fire ``hook_rot_q``): pick the pairing whose
    rotated q·k × scale (soft-capped, causal and window masks) softmaxes to the layer's own ``hook_pattern``;
    ``verified_error`` is the largest difference of attention probabilities."""
    model, L = att.model, att.layer
    # QK-norm: the rotary input is the normalised q/k, where the bridge fires those hooks (Cohere's declares them
    # and fires them only with its QK-norm on: the plain hook_q/k are the rotary input then)
    names = {f"blocks.{L}.attn.{x}" for x in ("hook_q_normed", "hook_k_normed", "hook_q", "hook_k", "hook_pattern")}
    with torch.no_grad():
        _, cache = model.run_with_cache(toks[None].to(model.W_E.device), names_filter=lambda n: n in names,
                                        stop_at_layer=L + 1)
    got = {k.rsplit(".", 1)[-1]: v for k, v in cache.items() if k in names}
    qn, kn = ("hook_q_normed", "hook_k_normed") if {"hook_q_normed", "hook_k_normed"} <= set(got) else ("hook_q", "hook_k")
    got = {x: got[x] for x in (qn, kn, "hook_pattern") if x in got}
    if set(got) != {qn, kn, "hook_pattern"}:
        spec.caveats.append(f"the model exposes neither its rotated queries nor its q, k and pattern; pairing "
                            f"{spec.style!r} assumed, not verified")
        return
    factor, _, cap = att.scale()
    k = got[kn].double()
    q, k, pat = got[qn].double(), k.repeat_interleave(int(model.cfg.n_heads) // k.shape[2], 2), got["hook_pattern"].double()
    n = q.shape[1]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None]
    masked = (j > i) | ((i - j) >= spec.window if spec.window else torch.zeros((), dtype=torch.bool))
    errs = {}
    for style in STYLES:
        trial = RotarySpec(spec.omega.double(), style, spec.rotary_dim, spec.d_head, spec.scaling)
        sc = torch.einsum("bqhd,bkhd->bhqk", rotate(trial, q), rotate(trial, k)) * factor
        sc = cap * torch.tanh(sc / cap) if cap else sc
        errs[style] = float((sc.masked_fill(masked, float("-inf")).softmax(-1) - pat).abs().max())
    best = min(errs, key=errs.get)
    spec.style, spec.verified_error = best, errs[best]
    if errs[best] > 1e-4:
        spec.caveats.append(f"the rebuilt rotary does not reproduce the model's own attention pattern (largest "
                            f"probability error {errs[best]:.2g}); offset circuits may be wrong")


def _verify_latent(att, spec: RotarySpec, n: int = 12) -> None:
    """MLA: the rebuilt R(i−j) must give the model's own rotary-part dot products rot(q_r,i)·rot(k_r,j).

    (DeepSeek-V3 de-interleaves after rotating, so the rotated vectors are permuted; their dot products,
    all the score sees, are not.) Pre-rotary parts come from the projections' own output hooks."""
    model, L = att.model, att.layer
    n = min(n, int(model.cfg.n_ctx))
    toks = ((torch.arange(n) * 7 + 3) % int(model.cfg.d_vocab))[None].to(model.W_E.device)
    qproj = "q_proj" if att.q_lora_rank is None else "q_b_proj"
    names = {f"blocks.{L}.attn.{qproj}.hook_out", f"blocks.{L}.attn.kv_a_proj_with_mqa.hook_out",
             f"blocks.{L}.attn.hook_rot_q", f"blocks.{L}.attn.hook_rot_k"}
    with torch.no_grad():
        _, cache = model.run_with_cache(toks, names_filter=lambda x: x in names, stop_at_layer=L + 1)
    if not names <= set(cache.keys()):
        spec.caveats.append("the model does not expose its rotary parts; the MLA rotary pairing is assumed, not verified")
        return
    q = cache[f"blocks.{L}.attn.{qproj}.hook_out"][0].view(n, att.n_heads, att.d_qk)[..., att.d_nope:].double()
    k = cache[f"blocks.{L}.attn.kv_a_proj_with_mqa.hook_out"][0][:, att.kv_lora_rank:].double()      # [pos, d_rope]
    real = torch.einsum("qhd,kd->hqk", cache[f"blocks.{L}.attn.hook_rot_q"][0].double(),
                        cache[f"blocks.{L}.attn.hook_rot_k"][0, :, 0].double())
    Rs = rotation(spec, range(n), relative=True).double()[:, spec.offset:, spec.offset:]           # [Δ, r, r]
    i, j = torch.tril_indices(n, n)
    got = torch.einsum("nhd,nde,ne->hn", q[i], Rs[i - j], k[j])
    spec.verified_error = float((got - real[:, i, j]).abs().max() / real[:, i, j].abs().max().clamp_min(1e-12))
    if spec.verified_error > 1e-4:
        spec.caveats.append(f"the rebuilt rotary does not reproduce the model's own rotary-part scores (relative "
                            f"error {spec.verified_error:.2g}); offset circuits may be wrong")


def _rotary_probe(att, toks: Tensor):
    """The layer's queries just before rotary and the model's own rotated queries, [pos, head, d_head] each.

    With QK-norm (Gemma 3) the rotary input is the normalised query (``hook_q_normed``), not ``hook_q``: where
    the bridge fires it (Cohere's bridge declares it but fires it only with its QK-norm on).
    """
    model, layer = att.model, att.layer
    names = {f"blocks.{int(layer)}.attn.{x}" for x in ("hook_q_normed", "hook_q", "hook_rot_q")}
    with torch.no_grad():
        _, cache = model.run_with_cache(toks[None].to(model.W_E.device), names_filter=lambda n: n in names,
                                        stop_at_layer=int(layer) + 1)
    got = {k.rsplit(".", 1)[-1]: v for k, v in cache.items()}
    pre = "hook_q_normed" if "hook_q_normed" in got else "hook_q"
    if "hook_rot_q" not in got or pre not in got:
        return None, None
    q = got[pre][0]
    if q.dim() == 3 and q.shape[0] == model.cfg.n_heads and q.shape[1] == toks.numel():
        q = q.transpose(0, 1)                                  # some bridges hold [head, pos, d]
    rq = got["hook_rot_q"][0]
    if rq.dim() == 3 and rq.shape[0] == model.cfg.n_heads and rq.shape[1] == toks.numel():
        rq = rq.transpose(0, 1)
    return q.float().cpu(), rq.float().cpu()


def rotate_native(rotary: torch.nn.Module, q: Float[Tensor, "batch pos head d"], k: Float[Tensor, "batch pos kv d"]
                  ) -> "tuple[Tensor, Tensor]":
    """q and k rotated exactly as a TL-native rotary module does (its own ``apply_rope``), in hook layout.

    ``q``/``k`` are [batch, pos, head, d_head] as ``hook_q``/``hook_k`` hold them (k may have fewer,
    KV, heads); the result is on their device, in their layout. Memory: one copy of each.
    """
    dev = rotary.cos_cached.device
    with torch.no_grad():
        rq, rk = rotary.apply_rope(q.transpose(1, 2).to(dev), k.transpose(1, 2).to(dev))
    return rq.transpose(1, 2).to(q.device), rk.transpose(1, 2).to(k.device)


# ------------------------------------------------------------------------------------------ HF frequencies

def _hf_rotary_modules(model) -> List[torch.nn.Module]:
    """Modules holding rotary frequencies: an ``inv_freq`` buffer, or per layer type ``<type>_inv_freq``
    (transformers 5 for models that mix sliding-window and global layers, e.g. Gemma 3)."""
    seen, mods = set(), []
    for _, mod in model.original_model.named_modules():
        for name, buf in mod.named_buffers(recurse=False):
            if (name == "inv_freq" or name.endswith("_inv_freq") and not name.endswith("original_inv_freq")) \
                    and buf.data_ptr() not in seen:
                seen.add(buf.data_ptr())
                if not mods or mods[-1] is not mod:
                    mods.append(mod)
    return mods


def layer_frequencies(model, layer: int, ltype: Optional[str]):
    """(inv_freq, attention_scaling, theta, where) of ``layer``'s own rotary (HF models)."""
    mods = _hf_rotary_modules(model)
    if not mods:
        table = _sincos_table(model)
        if table is not None:
            return table
        raise QKCircuitsError("cannot find the rotary module (no inv_freq buffer, no sin/cos table) in this model; "
                              "offset circuits need the model's own rotary frequencies")
    hf_cfg = model.original_model.config
    rope = getattr(hf_cfg, "rope_parameters", None) or {}
    for mod in mods:
        if ltype is not None and isinstance(getattr(mod, f"{ltype}_inv_freq", None), Tensor):
            inv = getattr(mod, f"{ltype}_inv_freq")
            scaling = getattr(mod, f"{ltype}_attention_scaling", 1.0)
            params = rope.get(ltype) if isinstance(rope, dict) else None
            theta = params.get("rope_theta") if isinstance(params, dict) else None
            return inv, scaling, theta, f"{type(mod).__name__}.{ltype}_inv_freq (layer {int(layer)})"
    for mod in mods:
        if isinstance(getattr(mod, "inv_freq", None), Tensor):
            theta = (rope.get("rope_theta") if isinstance(rope, dict) else None) or getattr(hf_cfg, "rope_theta", None)
            return mod.inv_freq, getattr(mod, "attention_scaling", 1.0), theta, f"{type(mod).__name__}.inv_freq"
    raise QKCircuitsError(f"layer {int(layer)} has attention type {ltype!r} but the rotary module holds no "
                          f"'{ltype}_inv_freq' (it has per-type frequencies for other types); offset circuits need "
                          f"this layer's own frequencies")


def _sincos_table(model):
    """(inv_freq, 1.0, theta, where) read off a precomputed ``embed_positions`` table [n_pos, rotary_dim] =
    [sin(p·ω) | cos(p·ω)] (GPT-J keeps no ``inv_freq``): ω = atan2(sin, cos) at position 1 (every ω < π, so
    the angle is ω itself); its first 64 rows are checked against sin/cos(p·ω) before it is trusted."""
    for _, mod in model.original_model.named_modules():
        tab = getattr(mod, "embed_positions", None)
        if not isinstance(tab, Tensor) or tab.dim() != 2 or tab.shape[0] < 2 or tab.shape[1] % 2:
            continue
        t = tab[:64].detach().double().cpu()           # float32 tables drift at large p·ω: check the start
        half = t.shape[1] // 2
        omega = torch.atan2(t[1, :half], t[1, half:])
        ang = torch.arange(t.shape[0], dtype=torch.float64)[:, None] * omega
        if not torch.allclose(torch.cat([ang.sin(), ang.cos()], 1), t, atol=1e-4):
            continue
        theta = float(omega[1]) ** (-half) if half > 1 and float(omega[1]) > 0 else None
        return omega.float(), 1.0, theta, f"{type(mod).__name__}.embed_positions (sin|cos table)"
    return None
