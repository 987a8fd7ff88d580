"""Assemble the grids and the per-head panel (data + plotly figure dicts) shared by the report and the app.

>>> ctx = ViewContext(model)                                                # doctest: +SKIP
>>> grids(model, ctx, scores=scan_result)                                  # doctest: +SKIP   [{"key", "figure"}, ...]
>>> panel(ctx, Head(1, 0), token_set(model), prompt_ids(model, None))     # doctest: +SKIP   one head's views
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from torch import Tensor

from .._heads import Head
from .._io import json_number
from . import _figures as F
from ._panels import ViewContext, attention, k_partners, ov_view, positional_profile, qk_grid, token_strings

# Per-head diagnostics shown next to the flags (names of HeadDiagnostics measures).
DIAG_MEASURES = ("sink", "entropy_frac_mean", "max_weight", "qk_var_ratio")
GRID_DESCRIPTIONS = {
    "induction": "attention from the second copy of a repeated random sequence to the token after the earlier copy",
    "prefix_matching": "Olsson's prefix matching on a sequence repeated 4 times",
    "previous_token": "attention to the previous position",
    "duplicate_token": "attention to earlier copies of the current token",
    "copying": "Olsson's copying score of the head's direct-path logits, candidates per sequence; 0 = chance, +1 copies",
    "ov_copying": "median rank of the source token in the head's contextual OV logits; 1 = top, 0 = chance, −1 = last",
    "eigen_copying": "sum(λ)/sum(|λ|) of W_E W_OV W_U, W_U centred over the vocabulary (Elhage); +1 copies, −1 anti",
}


def grids(model, ctx: ViewContext, scores=None, effects=None, diagnostics=None, trace=None) -> List[Dict]:
    """Layer × head grids: every score of ``scores`` (a HeadScores), eigenvalue copying (computed from the
    weights when the scores lack it), ablation ``effects`` (HeadEffects) and the number of diagnostics flags."""
    out: List[Dict] = []
    named: Dict[str, Tensor] = dict(scores.scores) if scores is not None else {}
    if "eigen_copying" not in named:
        named["eigen_copying"] = ctx.eigen_copying()
    for name, t in named.items():
        signed = name in ("eigen_copying", "copying", "ov_copying") or float(t.nan_to_num(0).min()) < 0
        fig = F.score_grid(t, name, GRID_DESCRIPTIONS.get(name, ""), "RdBu" if signed else "Blues",
                           0.0 if signed else None)
        if signed:
            fig["data"][0]["reversescale"] = True
        out.append({"key": name, "figure": fig})
    if effects is not None:
        title = f"ablation effect ({effects.method}, {effects.metric})"
        fig = F.score_grid(effects.effects, title, f"metric(ablated) − metric(clean), {effects.kind}", "RdBu", 0.0)
        fig["data"][0]["reversescale"] = True
        out.append({"key": "ablation", "figure": fig})
    if diagnostics is not None:
        flags = diagnostics.flags()
        count = sum(f.float() for f in flags.values())
        out.append({"key": "flags", "figure": F.score_grid(count, "diagnostics flags (count)",
                                                           ", ".join(flags), "Reds")})
    if trace is not None:                     # the circuit graph, drawn and clicked like a grid
        from ._trace_view import circuit
        out.append({"key": "circuit", "figure": circuit(trace)})
    return out


def head_info(ctx: ViewContext, head: Head, scores=None, effects=None, diagnostics=None) -> Dict:
    """Numbers about one head: its scores and labels, eigenvalue copying, ablation effect, diagnostics flags."""
    l, h = head.layer, head.head
    info: Dict[str, object] = {"eigen_copying": json_number(ctx.eigen_copying()[l, h])}
    if scores is not None:
        info["scores"] = {k: json_number(v[l, h]) for k, v in scores.scores.items()}
        info["labels"] = scores.labels().get(head, [])
    if effects is not None:
        info["ablation"] = {"effect": json_number(effects.effects[l, h]), "metric": effects.metric,
                            "method": effects.method, "baseline": json_number(effects.baseline)}
    if diagnostics is not None:
        info["flags"] = [k for k, v in diagnostics.flags().items() if bool(v[l, h])]
        info["diagnostics"] = {k: json_number(diagnostics.measures[k][l, h]) for k in DIAG_MEASURES
                               if k in diagnostics.measures}
    return info


def panel(ctx: ViewContext, head: Head, ids: Sequence[int], prompt: Optional[Sequence[int]] = None,
          pattern: Optional[Tensor] = None, *, scores=None, effects=None, diagnostics=None, k: int = 5,
          input: Optional[str] = None, trace=None) -> Dict:
    """Everything shown for one head. ``pattern`` (its [q, k] attention on ``prompt``) is computed when
    not given; pass ``prompt=None`` to leave attention out. ``input``: the token rows of the QK and OV
    views (direct, effective, contextual; default contextual past layer 0)."""
    model, name = ctx.model, str(head)
    labels = token_strings(model, ids)
    notes: List[str] = []
    ov = ov_view(ctx, head, ids, k, input)
    used = ov["input"]
    figs: Dict[str, Optional[Dict]] = {"qk": F.qk_heatmap(qk_grid(ctx, head, ids, used), labels, name, used)}
    out_labels = [token_strings(model, row) for row in ov["ids"].tolist()]
    ranks = ov["ranks"].tolist()
    figs["ov"] = F.ov_table(ov["values"], ov["ids"], labels, out_labels, ids, name, used, ranks)
    notes.append(f"QK/OV token views: {ov['note']}")
    fell = [lab for lab, src in zip(labels, ov["source"]) if src != used]
    if fell:
        notes.append(f"{len(fell)} of {len(labels)} tokens never occur in the corpus and use effective inputs: "
                     + ", ".join(repr(t) for t in fell[:12]) + (" ..." if len(fell) > 12 else ""))
    prof = positional_profile(ctx, head)
    figs["pos"] = F.profile_line(prof["offsets"], prof["score"], prof["label"], name) if prof else None
    if prof is None:
        notes.append("this model has no learned or rotary positions in its QK circuit: no offset profile")
    partners = k_partners(ctx, head)
    figs["comp"] = F.partners_bar(partners, name) if partners else None
    if not partners:
        notes.append("layer 0 reads only the embeddings: no earlier heads to compose with")
    if trace is not None:                     # "reads from": top path-patching senders per input
        from ._trace_view import reads_from
        figs["reads"] = reads_from(trace, head)
    att = None
    if prompt is not None:
        if pattern is None:
            pattern = attention(ctx, [head], prompt)[head]
        att = {"tokens": token_strings(model, prompt),
               "attention": [[[round(float(v), 4) for v in row] for row in pattern.tolist()]],
               "attentionHeadNames": [name]}
    info = head_info(ctx, head, scores, effects, diagnostics)
    srt = sorted(ranks)
    info["token_views"] = {"input": used, "copying_rank_median": srt[len(srt) // 2] if srt else None,
                           "copying_rank": ranks,
                           "vocabulary": int(model.W_U.shape[-1])}
    return {"head": name, "layer": head.layer, "index": head.head, "input": used,
            "info": info, "figures": figs, "attention": att, "notes": notes}
