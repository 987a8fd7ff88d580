"""Figures of results and heads for notebooks and scripts: each call returns a plotly ``go.Figure``.

>>> import qkcircuits as qk
>>> model = qk.load("toy-induction")
>>> result = qk.scan(model, progress=False)
>>> fig = qk.plot.scores(result, "induction")       # layer x head heatmap; z is result["induction"]
>>> fig.data[0].z[1][0]
1.0
>>> qk.plot.attention(model, None, ["0.0", "1.0"])  # doctest: +ELLIPSIS
AttentionView(heads=0.0, 1.0; 25 tokens; pattern (2, 25, 25))

Every figure comes from the builders the HTML report and the app draw (``viz/_views.py`` on top of
``viz/_figures.py`` and the numbers of ``viz/_panels.py``): one picture, one source. In a notebook a
figure draws itself offline (plotly.js and circuitsvis inlined from the installed packages, once per
page or once per figure: ``setup``, docs/notebooks.md); ``fig.show()`` still uses your plotly renderer
and ``fig.save(path)`` writes one offline HTML file. Numbers in figures keep 5 significant digits.

Adding a figure is a builder in ``viz/_figures.py`` that returns a JSON-ready dict, then here
``def name(result): return as_figure(F.builder(...))``.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from ._foundation.errors import QKCircuitsError
from ._foundation.arch.model_facts import has_config, is_model
from ._foundation.heads import Head, HeadsLike, model_heads
from ._foundation.model_cache import remembered
from .viz import _figures as F
from .viz import _views as V
from .viz._notebook import AttentionView, Figure, as_figure, set_bundle, setup
from .viz._panels import ViewContext, prompt_ids, token_set, token_strings
from .viz._panels import attention as _patterns

__all__ = ["AttentionView", "Figure", "attend", "attention", "circuit", "diagnostics", "effects", "faithfulness", "offsets",
           "ov", "qk", "reads_from", "scores", "set_bundle", "setup", "trace"]

def _ctx(model) -> ViewContext:
    if not is_model(model):
        raise QKCircuitsError(f"expected a model from qk.load(...), got {type(model).__name__}")
    # one ViewContext per model (its caches: layer weights, unembedding, weight-only scores), made again after a
    # weight edit and dropped with the model (model_cache)
    return remembered(model, "view context", None, lambda: ViewContext(model), depends="weights")


def _one_head(model, head) -> Head:
    heads = model_heads(model, head)
    if len(heads) != 1:
        raise QKCircuitsError(f"give exactly one head (e.g. '1.0'), got {len(heads)} from {head!r}")
    return heads[0]


def _tokens(model, tokens) -> list:
    if isinstance(tokens, str):
        raise QKCircuitsError(f"tokens must be a list of single-token strings (e.g. [' the', ' cat']) or '#id's, "
                              f"not one string {tokens!r}")
    return token_set(model, tokens)


def _need(result, kind: type, what: str, hint: str):
    if not isinstance(result, kind):
        raise QKCircuitsError(f"{what} draws a {kind.__name__} ({hint}), got {type(result).__name__}")


def scores(result, name: str = "induction") -> Figure:
    """Layer × head heatmap of one score of a ``HeadScores`` (``qk.scan``); hover: the head, every score,
    its labels. Signed scores use a diverging scale centred at 0."""
    from ._analysis.head_scores import HeadScores

    _need(result, HeadScores, "plot.scores", "from qk.scan(model)")
    return as_figure(V.score_figure(name, result[name], result))


def effects(result, scores=None) -> Figure:
    """``HeadEffects`` (``qk.sweep``): layer × head heatmap of metric(ablated) − metric(clean), centred at 0
    (hover adds ``scores``' values and labels when given). ``RandomComparison`` (``qk.compare_to_random``):
    the group's effect against every random draw."""
    from ._analysis.ablate import RandomComparison
    from ._analysis.sweep import HeadEffects

    if isinstance(result, RandomComparison):
        return as_figure(F.random_baseline(result.effect, result.random_effects.tolist(),
                                           [str(h) for h in result.heads], result.metric, result.method))
    _need(result, HeadEffects, "plot.effects", "from qk.sweep or qk.attribution, or a RandomComparison")
    return as_figure(V.effects_figure(result, scores))


def diagnostics(result, measure: Optional[str] = None) -> Figure:
    """``HeadDiagnostics`` (``qk.diagnose``): the number of flags per head (hover: the flags and the measures
    behind them), or one ``measure`` (e.g. ``"sink"``, ``"qk_var_ratio"``)."""
    from ._analysis.diagnose_result import HeadDiagnostics

    _need(result, HeadDiagnostics, "plot.diagnostics", "from qk.diagnose(model)")
    return as_figure(V.diagnostics_figure(result, measure))


def trace(result, k: int = 2) -> Figure:
    """The circuit graph of a ``PathEffects`` (``qk.trace_induction``, ``qk.path_patch``, ``qk.edge_attribution``):
    the traced heads at (x = head, y = layer), coloured by scan label, and for each receiver and input (q, k, v)
    its ``k`` largest senders whose effect is above zero and above that receiver's 95th percentile over
    all its senders (``result.baseline``). Each edge line carries its data in ``meta`` (src, dst, input, effect).
    The same builder draws the report's and the app's circuit panel."""
    from ._foundation.io import check_int
    from ._paths.path_effects import PathEffects
    from .viz._trace_view import circuit

    _need(result, PathEffects, "plot.trace", "from qk.trace_induction, qk.path_patch or qk.edge_attribution")
    check_int("k", k)
    return as_figure(circuit(result, k))


def reads_from(result, head, k: int = 3) -> Figure:
    """One receiver of a ``PathEffects``: its ``k`` largest senders per input as bars, with the baseline (mean
    and 95th percentile over all senders) per input; the report's "reads from" panel."""
    from ._foundation.io import check_int
    from ._paths.path_effects import PathEffects
    from .viz._trace_view import reads_from as _reads

    _need(result, PathEffects, "plot.reads_from", "from qk.trace_induction, qk.path_patch or qk.edge_attribution")
    check_int("k", k)
    h = Head.parse(head)
    fig = _reads(result, h, k)
    if fig is None:
        raise QKCircuitsError(f"{h} is not a receiver of this trace; receivers: "
                              f"{', '.join(str(r) for r in result.receivers)}")
    return as_figure(fig)


def circuit(result, max_edges: int = 300, model=None, roles=None, which: str = "auto") -> Figure:
    """The circuit found over the whole graph (``qkcircuits circuit``): ``result`` is the circuit API's result
    (``qk.faithfulness(...)``: its chosen circuit; ``scores.circuit(...)``; edge scores: their ``.circuit()``), the
    ``--json`` file's dict, its path or its text; ``roles``: ``qk.roles(model, task, circuit)`` or {head: {role,
    evidence}}, shown in the hover and the legend (the file's own roles otherwise).

    ``which``: ``"core"`` (the default when the file has ``core``: its heads and MLPs and the strongest edges between
    them), ``"edges"`` (the edge circuit: its ``max_edges`` edges of largest |score| and the nodes they touch) or
    ``"auto"``. Rows follow the model (the embedding, each layer's KV heads, heads and MLP, the logits); a layered
    layout (grandalf's Sugiyama) orders each row to reduce crossings and spaces the nodes by their labels, so no
    label overlaps another; names ``"L.H@POS"`` get one column per position. Colour = role (legend), edge width ∝
    |score|, red positive, blue negative, dash = the receiver's input (q solid, k dashed, v dotted). Hover: an edge's
    marker gives sender → receiver, input, score and both roles; a node its role and evidence. The file's
    ``warnings`` are written in red above the graph. ``model``: check the circuit against the model's layers and
    heads (its KV heads map k/v edges onto core heads)."""
    from ._foundation.io import check_int
    from .viz._circuit_view import circuit_graph, load_circuit

    check_int("max_edges", max_edges)
    view = load_circuit(result, roles=roles)
    L = H = kv = None
    if model is not None:
        from ._foundation.heads import n_kv_heads
        from .viz._circuit_data import check_against_model

        if not has_config(model):
            raise QKCircuitsError(f"model must come from qk.load(...), got {type(model).__name__}")
        L, H, kv = int(model.cfg.n_layers), int(model.cfg.n_heads), n_kv_heads(model)
        check_against_model(view, L, H, kv)
    return as_figure(circuit_graph(view, L, H, max_edges, n_kv=kv, which=which))


def attend(result, k: int = 12) -> Figure:
    """Why a head attends (``qk.attend(...)``, or its ``--json`` file's path or text): the pair heatmap of the ``k``
    largest query sources (rows) × key sources (columns), the rest merged into one "rest" row and column so the
    cells add up to the total, with each side's marginal as bars; sources labelled with their roles when the
    result carries labels (``settings["labels"]``, e.g. from ``qkcircuits attend``)."""
    from ._explain.attribution import Attribution
    from ._foundation.io import check_int
    from .viz._attend_view import attend_figure

    check_int("k", k)
    if not isinstance(result, Attribution):
        from pathlib import Path

        if not isinstance(result, (str, Path)):
            raise QKCircuitsError(f"plot.attend draws an Attribution (qk.attend(...)) or its JSON, got "
                                  f"{type(result).__name__}")
        result = Attribution.from_json(result)
    return as_figure(attend_figure(result, k))


def faithfulness(result) -> Figure:
    """The faithfulness curve of ``qk.faithfulness(...)`` (or the ``--json`` file's dict, path or text): f over
    the percent of edges kept, log x axis, the 0.8 line dashed, the chosen circuit's size dotted, CPR and CMD
    in the title (a point at 0 % is given in a note: a log axis has no 0; so is an undefined f)."""
    from .viz._circuit_view import faithfulness_curve, load_circuit

    return as_figure(faithfulness_curve(load_circuit(result, need=("curve",))))


def qk(model, head, tokens: Optional[Sequence[str]] = None, **options) -> Figure:
    """Query token × key token pre-softmax score of one head's QK circuit over ``tokens`` (single-token
    strings or ``#id``; default: common words). ``options`` go to the token view (e.g. ``view="direct"``: its rows)."""
    ctx = _ctx(model)
    return as_figure(V.qk_figure(ctx, _one_head(model, head), _tokens(model, tokens), **options))


def ov(model, head, tokens: Optional[Sequence[str]] = None, k: int = 5, **options) -> Figure:
    """Each token of ``tokens`` → the ``k`` output tokens whose logits the head's OV circuit raises most
    (cell text: the token, colour: the logit). ``options`` go to the token view (e.g. ``view="direct"``: its rows)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise QKCircuitsError(f"k must be a positive integer, got {k!r}")
    ctx = _ctx(model)
    return as_figure(V.ov_figure(ctx, _one_head(model, head), _tokens(model, tokens), k, **options))


def offsets(model, head) -> Figure:
    """One head's QK score against the offset Δ = query position − key position: the profile `qkcircuits circuits
    --head` prints and the report draws (``_weights/offsets``; rotary: the mean query rotated by Δ against the mean
    key of the rows the head's layer reads over the packaged corpus; learned positions: W_pos QK W_posᵀ along
    diagonals). The peak is marked; ``fig.layout.meta["preferred_offset"]`` holds it (None for a flat profile)."""
    fig = V.offsets_figure(_ctx(model), _one_head(model, head))
    if fig is None:
        raise QKCircuitsError("this model has neither rotary nor learned absolute positions in its QK circuit: "
                              "there is no offset profile to draw")
    return as_figure(fig)


def attention(model, text_or_ids: Union[str, Sequence[int], torch.Tensor, None], heads: HeadsLike) -> AttentionView:
    """The attention patterns of ``heads`` on one prompt (one forward pass), drawn by circuitsvis.

    ``text_or_ids``: text (BOS added; models without a tokenizer take space-separated ids), a 1-D list or
    tensor of token ids (used as given), or None for the default prompt (a sentence said twice).
    ``.pattern`` [head, query, key] holds the captured weights; ``.save(path)`` writes one offline file.
    """
    ctx = _ctx(model)
    hs = model_heads(model, heads)
    if not hs:
        raise QKCircuitsError(f"no heads in {heads!r}; give e.g. '1.0' or ['5.1', '6.9']")
    if text_or_ids is None or isinstance(text_or_ids, str):
        ids = prompt_ids(model, text_or_ids)
    else:
        t = torch.as_tensor(text_or_ids)
        if t.dim() == 2 and t.shape[0] == 1:
            t = t[0]
        if t.dim() != 1 or t.numel() == 0 or t.dtype.is_floating_point:
            raise QKCircuitsError(f"token ids must be a non-empty 1-D list or tensor of integers, got shape "
                                  f"{tuple(t.shape)} ({t.dtype})")
        n_vocab, n_ctx = int(model.cfg.d_vocab), int(model.cfg.n_ctx)
        if int(t.min()) < 0 or int(t.max()) >= n_vocab:
            raise QKCircuitsError(f"token ids must be in 0-{n_vocab - 1}, got {int(t.min())}..{int(t.max())}")
        if t.numel() > n_ctx:
            raise QKCircuitsError(f"{t.numel()} token ids given; the model's context holds {n_ctx}")
        ids = [int(i) for i in t.tolist()]
    pats = _patterns(ctx, hs, ids)
    props = V.attention_props(model, ids, pats)
    return AttentionView(token_strings(model, ids), torch.stack([pats[h] for h in hs]), [str(h) for h in hs], props)
