"""A head's QK score against the offset Δ = query position − key position: THE profile the CLI, the report and
``qk.plot.offsets`` show.

>>> p = head_offset_profile(model, "0.0", max_offset=4)      # toy-induction: learned positions
>>> p["kind"], p["offsets"], p["preferred_offset"]            # the previous-token head prefers the key one back
('learned', [0, 1, 2, 3, 4], 1)

One definition, so `qkcircuits circuits --head`, the report's "QK by offset" panel and ``qk.plot.offsets``
agree number for number (tests/test_offsets.py):

- **rotary** (``qk.offset_profile``): ``score[Δ] = scale · q̄ R(Δ) k̄ᵀ`` with q̄, k̄ the mean query and key of
  the rows the head's layer reads. The rows are **contextual** by default: ``blocks.L.ln1.hook_out`` at every
  non-BOS position of the packaged English corpus (the contextual token views' one cached pass,
  ``corpus_stats``); ``text=`` takes the rows of that text instead (BOS position left out too). The mean
  normalised token embedding (``qk.offset_profile``'s default, ``rows="embeddings"`` here) is the input only at
  layer 0: on SmolLM2's previous-token head 16.0 it peaks at Δ = 63 (0.47, Δ = 1 a bump at 0.29) while the
  rows the head really reads peak at Δ = 1 (2.45; Δ = 0: −2.50), which is what the head does.
- **learned positions**: the mean over queries i of ``W_pos[i] QK W_pos[i−Δ]ᵀ · scale`` over the first
  ``min(n_ctx, 4 (max_offset + 1))`` positions (``qk.weights.positional_qk``, no content).

Returns plain data: ``kind``, ``offsets``, ``score``, ``rows`` (what the rows were), ``label`` (one line for a
figure), ``preferred_offset`` (argmax), ``score_at_preferred``, ``score_at_0``, ``score_range``, ``flat`` (the
range is below 1e-6 of the largest |score|: "prefers offset 0" would be argmax's tie-break), ``window``; or None
when the QK circuit has no position in it.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from .._foundation.arch.model_facts import learned_positions
from .._foundation.capture import has_rotary
from .._foundation.errors import QKCircuitsError
from .._foundation.heads import HeadsLike
from .qk_ov import attn_input_hook, attn_scale, to_head

ROWS = ("contextual", "embeddings")


def _text_rows(model, layer: int, text: str):
    """``ln1.hook_out`` of ``layer`` at every non-BOS position of ``text`` (BOS led, cut to the context)."""
    from .._foundation.sequences import bos_id

    tok = getattr(model, "tokenizer", None)
    if tok is None:
        raise QKCircuitsError("rows from a text need a model with a tokenizer; this one has none")
    ids = tok(text, add_special_tokens=False)["input_ids"][: int(model.cfg.n_ctx) - 1]
    if not ids:
        raise QKCircuitsError("the text for the offset profile is empty")
    tokens = torch.tensor([[bos_id(model)] + list(ids)], device=model.W_E.device)
    name = attn_input_hook(model, layer)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n == name, stop_at_layer=layer + 1)
    return cache[name][0, 1:], f"{len(ids)} tokens of the given text (layer {layer}'s input, BOS left out)"


def _contextual_mean(model, layer: int):
    """[1, d_model]: the mean of ``ln1.hook_out`` of ``layer`` over the corpus' non-BOS positions."""
    from .contextual import corpus_stats

    st = corpus_stats(model)
    mean = st.sums[layer].sum(0, keepdim=True) / max(1, st.n_tokens)
    return mean, f"layer {layer}'s input over {st.n_tokens} corpus tokens (contextual mean, BOS left out)"


def head_offset_profile(model, head: HeadsLike, max_offset: int = 64, *, text: Optional[str] = None,
                        rows: str = "contextual", spec=None) -> Optional[Dict[str, object]]:
    """The offset profile of ``head`` over Δ = 0..``max_offset`` (module docs); ``spec``: the layer's
    ``rotary_spec`` when the caller has it (cached)."""
    if rows not in ROWS:
        raise QKCircuitsError(f"rows must be one of {', '.join(ROWS)}, got {rows!r}")
    h = to_head(model, head)
    offs = list(range(int(max_offset) + 1))
    window = None
    if has_rotary(model):
        from .rotary import offset_profile, rotary_spec

        spec = spec if spec is not None else rotary_spec(model, layer=h.layer)
        if spec.window:               # keys further back are masked on this layer: no score to profile
            window = int(spec.window)
            offs = [d for d in offs if d < window]
        if text is not None:
            x, what = _text_rows(model, h.layer, text)
        elif rows == "contextual":
            x, what = _contextual_mean(model, h.layer)
        else:
            x, what = None, "the mean normalised token embedding (the input only at layer 0)"
        score = offset_profile(model, h, offs, x, spec=spec).mean_score.tolist()
        kind = "rotary"
        label = f"rotary: mean query · R(Δ) · mean key; rows: {what}"
    elif learned_positions(model):
        from .rotary import positional_qk

        P = positional_qk(model, h)
        n = min(P.ldim, 4 * (int(max_offset) + 1))
        offs = [d for d in offs if d < n]
        with torch.no_grad():
            grid = (P.A[:n] @ P.B[:, :n]) * attn_scale(model, h.layer)
            score = [float(grid.diagonal(-d).mean()) for d in offs]
        kind = "learned"
        what = f"W_pos rows 0-{n - 1} (positions only, no content)"
        label = f"learned positions: mean over queries of W_pos[i]·QK·W_pos[i−Δ] (first {n} positions)"
    else:
        return None
    best = max(range(len(score)), key=score.__getitem__)
    spread = max(score) - min(score)
    scale = max(abs(v) for v in score)
    if window:
        label += f" (sliding window {window}: offsets ≥ {window} are masked)"
    return {"kind": kind, "head": str(h), "offsets": offs, "score": score, "rows": what, "label": label,
            "preferred_offset": offs[best], "score_at_preferred": score[best], "score_at_0": score[0],
            "score_range": spread, "flat": not spread > 1e-6 * max(scale, 1e-30), "window": window}


def describe(p: Dict[str, object]) -> str:
    """One line: where the profile peaks, or that it is flat.

    >>> describe({"flat": False, "preferred_offset": 1, "score_at_preferred": 2.45, "score_at_0": -2.5,
    ...           "score_range": 22.1})
    'prefers offset 1 (score 2.45; at 0: -2.5; range 22.1)'
    """
    flat = p.get("flat")
    if flat is None:          # a summary from before "flat" was stored: the same test on its scores
        scores = p.get("mean_score") or [p["score_at_0"]]
        flat = not p["score_range"] > 1e-6 * max(max(abs(v) for v in scores), 1e-30)
    if flat:
        return f"no positional preference (the score is {p['score_at_0']:.3g} at every offset)"
    return (f"prefers offset {p['preferred_offset']} (score {p['score_at_preferred']:.3g}; at 0: "
            f"{p['score_at_0']:.3g}; range {p['score_range']:.3g})")
