"""The figures of every view, one builder each: the report, the app and `qkcircuits.plot` all call these.

>>> from qkcircuits.viz._panels import prompt_ids, token_set
>>> ctx = ViewContext(model)
>>> [g["key"] for g in grids(model, ctx, scores=qk.scan(model, progress=False))][:3]    # [{"key", "figure"}, ...]
['induction', 'prefix_matching', 'previous_token']
>>> sorted(panel(ctx, Head(1, 0), token_set(model), prompt_ids(model, None)))          # one head's views
['attention', 'figures', 'head', 'index', 'info', 'input', 'layer', 'notes']
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from torch import Tensor

from .._foundation.heads import Head
from .._analysis.detectors import detectors
from .._foundation.io import json_number
from . import _figures as F
from ._panels import ViewContext, attention, k_partners, ov_view, positional_profile, qk_grid, token_strings

# Per-head diagnostics shown next to the flags (names of HeadDiagnostics measures).
DIAG_MEASURES = ("sink", "entropy_frac_mean", "max_weight", "qk_var_ratio")
def grid_description(name: str) -> str:
    """The hover text of a score's grid: its detector's description (the registry), "" for other names."""
    return next((d.description for d in detectors() if d.name == name), "")


def score_figure(name: str, values: Tensor, scores=None) -> Dict:
    """One layer × head grid of a score; hover adds every score of ``scores`` (a HeadScores) and the labels."""
    others = dict(scores.scores) if scores is not None else None
    labels = scores.labels() if scores is not None else None
    return F.score_grid(values, name, grid_description(name), others=others, labels=labels)


def effects_figure(effects, scores=None) -> Dict:
    """The ablation effect of each head (HeadEffects), diverging scale centred at 0."""
    title = f"ablation effect ({effects.method}, {effects.metric})"
    return F.score_grid(effects.effects, title, f"metric(ablated) − metric(clean), {effects.kind}", "RdBu", 0.0,
                        others=dict(scores.scores) if scores is not None else None,
                        labels=scores.labels() if scores is not None else None)


def diagnostics_figure(diagnostics, measure: Optional[str] = None, scores=None) -> Dict:
    """The number of diagnostics flags per head, or one ``measure`` of a HeadDiagnostics; hover adds every
    flag's measure (entropy, largest weight, sink share, q·k variance ratio)."""
    others = {k: diagnostics.measures[k] for k in DIAG_MEASURES if k in diagnostics.measures}
    flags = diagnostics.flags()
    labels = {h: names for h, names in diagnostics.flagged()}
    if measure is None:
        count = sum(f.float() for f in flags.values())
        return F.score_grid(count, "diagnostics flags (count)", ", ".join(flags), "Reds", others=others, labels=labels)
    return F.score_grid(diagnostics[measure], measure, "", others=others, labels=labels)


def grids(model, ctx: ViewContext, scores=None, effects=None, diagnostics=None, trace=None) -> List[Dict]:
    """Layer × head grids: every score of ``scores`` (a HeadScores), eigenvalue copying (computed from the
    weights when the scores lack it), ablation ``effects`` (HeadEffects) and the number of diagnostics flags."""
    out: List[Dict] = []
    named: Dict[str, Tensor] = dict(scores.scores) if scores is not None else {}
    if "eigen_copying" not in named:
        named["eigen_copying"] = ctx.eigen_copying()
    for name, t in named.items():
        out.append({"key": name, "figure": score_figure(name, t, scores)})
    if effects is not None:
        out.append({"key": "ablation", "figure": effects_figure(effects, scores)})
    if diagnostics is not None:
        out.append({"key": "flags", "figure": diagnostics_figure(diagnostics)})
    if trace is not None:                     # the circuit graph, drawn and clicked like a grid
        from ._trace_view import circuit
        out.append({"key": "circuit", "figure": circuit(trace)})
    return out


def qk_figure(ctx: ViewContext, head: Head, ids: Sequence[int], view: Optional[str] = None) -> Dict:
    """The head's QK heatmap over the tokens ``ids`` on ``view`` rows (direct, effective, contextual;
    default contextual past layer 0); the title names the view used."""
    used = ctx.inputs(head.layer, ids, view).input
    return F.qk_heatmap(qk_grid(ctx, head, ids, used), token_strings(ctx.model, ids), str(head), used)


def ov_figure(ctx: ViewContext, head: Head, ids: Sequence[int], k: int = 5, view: Optional[str] = None,
              ov: Optional[Dict] = None) -> Dict:
    """Each token of ``ids`` → the ``k`` output tokens the head's OV raises most (on ``view`` rows), with the
    source token's own rank among all output logits; ``ov`` is a precomputed ``ov_view`` (the panel reuses it
    for its notes)."""
    model = ctx.model
    ov = ov if ov is not None else ov_view(ctx, head, ids, k, view)
    out_labels = [token_strings(model, row) for row in ov["ids"].tolist()]
    return F.ov_table(ov["values"], ov["ids"], token_strings(model, ids), out_labels, ids, str(head), ov["input"],
                      ov["ranks"].tolist())


def offsets_figure(ctx: ViewContext, head: Head) -> Optional[Dict]:
    """Score against query−key offset, or None when the QK circuit has no position in it."""
    prof = positional_profile(ctx, head)
    if prof is None:
        return None
    return F.profile_line(prof["offsets"], prof["score"], prof["label"], str(head),
                          None if prof["flat"] else prof["preferred_offset"])


def partners_figure(ctx: ViewContext, head: Head) -> Optional[Dict]:
    """Earlier heads ranked by K-composition with ``head`` (None in layer 0)."""
    partners = k_partners(ctx, head)
    return F.partners_bar(partners, str(head)) if partners else None


def attention_props(model, prompt: Sequence[int], patterns: Dict[Head, Tensor]) -> Dict:
    """circuitsvis ``AttentionHeads`` props: the prompt's tokens and each head's [q, k] pattern (4 decimals)."""
    return {"tokens": token_strings(model, prompt),
            "attention": [[[round(float(v), 4) for v in row] for row in p.tolist()] for p in patterns.values()],
            "attentionHeadNames": [str(h) for h in patterns]}


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
          view: Optional[str] = None, trace=None) -> Dict:
    """Everything shown for one head. ``pattern`` (its [q, k] attention on ``prompt``) is computed when
    not given; pass ``prompt=None`` to leave attention out. ``view``: the token rows of the QK and OV
    views (direct, effective, contextual; default contextual past layer 0). ``trace``: a PathEffects whose
    top senders into this head are drawn as "reads from"."""
    model, name = ctx.model, str(head)
    labels = token_strings(model, ids)
    ov = ov_view(ctx, head, ids, k, view)
    used, ranks = ov["input"], ov["ranks"].tolist()
    figs: Dict[str, Optional[Dict]] = {"qk": qk_figure(ctx, head, ids, used), "ov": ov_figure(ctx, head, ids, k, ov=ov),
                                       "pos": offsets_figure(ctx, head), "comp": partners_figure(ctx, head)}
    notes: List[str] = [f"QK/OV token views: {ov['note']}"]
    fell = [lab for lab, src in zip(labels, ov["source"]) if src != used]
    if fell:
        notes.append(f"{len(fell)} of {len(labels)} tokens never occur in the corpus and use effective inputs: "
                     + ", ".join(repr(t) for t in fell[:12]) + (" ..." if len(fell) > 12 else ""))
    if figs["pos"] is None:
        notes.append("this model has no learned or rotary positions in its QK circuit: no offset profile")
    if figs["comp"] is None:
        notes.append("layer 0 reads only the embeddings: no earlier heads to compose with")
    if trace is not None:                     # "reads from": top path-patching senders per input
        from .._paths.path_effects import AGREE, COMPOSITION_VS_RUN
        from ._trace_view import reads_from
        figs["reads"] = reads_from(trace, head)
        sp = trace.k_composition_spearman.get(name) if head in trace.receivers else None
        if sp is not None and sp < AGREE:     # two views of where the keys come from: say which to trust
            notes.append(f"K-composition partners vs the trace's key sources: Spearman {sp:+.2f}; {COMPOSITION_VS_RUN}")
    att = None
    if prompt is not None:
        if pattern is None:
            pattern = attention(ctx, [head], prompt)[head]
        att = attention_props(model, prompt, {head: pattern})
    info = head_info(ctx, head, scores, effects, diagnostics)
    srt = sorted(ranks)
    info["token_views"] = {"input": used, "copying_rank_median": srt[len(srt) // 2] if srt else None,
                           "copying_rank": ranks, "vocabulary": int(model.W_U.shape[-1])}
    return {"head": name, "layer": head.layer, "index": head.head, "input": used,
            "info": info, "figures": figs, "attention": att, "notes": notes}
