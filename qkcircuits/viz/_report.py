"""One self-contained HTML report: score grids, per-head QK/OV/positional/composition views, attention patterns.

>>> html = report_html(model, scores=qk.scan(model, progress=False), progress=False)
>>> write_report(str(tmp / "report.html"), html)              # atomic; plotly.js and circuitsvis inlined
>>> 'src="http' in html                                        # no script or image fetched from the network
False

The file works with no network: plotly.js and circuitsvis's bundle are inlined once each (~6.1 MB
together), every figure is data drawn by ``Plotly.newPlot``, every attention widget is drawn by
``CircuitsVis.render``. Per-head panels are precomputed only for a bounded set of heads (the top
``grid_k`` of every grid plus ``heads``); the report says which were left out.
Memory: the model plus, for the chosen heads, one [n_tokens, vocab] OV block at a time and one
forward pass's attention patterns on the prompt.
"""

from __future__ import annotations

import math
import os
from typing import Dict, List, Optional, Sequence, Union

import torch

from .._foundation.errors import QKCircuitsError
from .._foundation.heads import Head, model_heads, n_kv_heads
from .._foundation.io import write_atomic
from .._foundation.progress import progress_bar
from .._weights.contextual import INPUTS
from ._circuit_data import check_against_model, load_circuit, parse_node
from ._circuit_view import circuit_section
from ._page import embed_json, page, script_text
from ._panels import ViewContext, attention, prompt_ids, token_set
from ._views import grids, panel

MAX_HEADS = 60
CIRCUIT_HEADS = 12      # heads of a circuit that get a panel (its roles first, then its other heads)


def pick_heads(grid_values: Dict[str, torch.Tensor], grid_k: int, extra: Sequence[Head] = (),
               k: int = MAX_HEADS) -> List[Head]:
    """``extra`` first, then the top ``grid_k`` heads of each grid (by value; by |value| for signed
    grids), without repeats, at most ``k`` besides ``extra``."""
    out = list(dict.fromkeys(extra))
    picked = 0
    for name, t in grid_values.items():
        key = t.abs() if float(t.nan_to_num(0).min()) < 0 else t
        flat = key.nan_to_num(-math.inf).flatten()
        for i in flat.topk(min(grid_k, flat.numel())).indices.tolist():
            h = Head(i // t.shape[1], i % t.shape[1])
            if h not in out and picked < k:
                out.append(h)
                picked += 1
    return out


def report_html(model, *, scores=None, effects=None, diagnostics=None, heads=None, tokens: Optional[Sequence[str]] = None,
                prompt: Optional[str] = None, grid_k: int = 3, k: int = 5, title: Optional[str] = None,
                view: Optional[str] = None, progress: bool = True, trace=None, circuit=None, attend=None) -> str:
    """The report as one HTML string (see module docs). ``scores``: HeadScores (e.g. ``qk.scan(model)``);
    ``effects``: HeadEffects from ``sweep``; ``diagnostics``: HeadDiagnostics; ``heads``: extra heads to
    precompute; ``tokens``: the token set of the QK/OV views; ``prompt``: text for the attention patterns;
    ``grid_k``: heads precomputed per score grid (its top ``grid_k``); ``k``: output tokens per source token in
    the OV view; ``view``: the token rows of the QK/OV views (direct, effective, contextual; default contextual past
    layer 0, direct at layer 0); ``trace``: a PathEffects (circuit graph of path patching, "reads from" panels);
    ``circuit``: a circuit over the whole graph (the circuit API's result, or the ``qkcircuits circuit --json``
    dict, path or text): a section with its faithfulness curve, graph, roles and top edges, and panels for the
    heads it names (its roles first, at most ``CIRCUIT_HEADS``); ``attend``: Attributions (``qk.attend``) shown as
    "why it attends" sections — default (None): the top head of each labelled score the scan has, explained on its
    own rows (``_explain.evidence.explain_top_heads``); ``[]``: none."""
    from .._foundation.model import model_name

    if grid_k < 0 or k < 1:
        raise QKCircuitsError(f"grid_k must be >= 0 and k >= 1, got {grid_k} and {k}")
    L, H = int(model.cfg.n_layers), int(model.cfg.n_heads)
    shapes = {"scores": scores and (scores.n_layers, scores.n_heads), "effects": effects and tuple(effects.effects.shape),
              "diagnostics": diagnostics and (diagnostics.n_layers, diagnostics.n_heads)}
    for name, shape in shapes.items():
        if shape and tuple(shape) != (L, H):
            raise QKCircuitsError(f"the {name} are for {shape[0]} layers x {shape[1]} heads, but the model has {L} x {H}")
    if view is not None and view not in INPUTS:
        raise QKCircuitsError(f"view must be one of {', '.join(INPUTS)}, got {view!r}")
    cview = None
    if circuit is not None:
        cview = load_circuit(circuit)
        check_against_model(cview, L, H, n_kv_heads(model))
    ctx = ViewContext(model)
    ids = token_set(model, tokens)
    pids = prompt_ids(model, prompt)
    grid_list = grids(model, ctx, scores, effects, diagnostics, trace)
    values = {g["key"]: _grid_tensor(g) for g in grid_list if g["key"] != "circuit"}
    extra = model_heads(model, heads) if heads else []
    if trace is not None:                     # every traced receiver gets its panel ("reads from")
        extra += [h for h in trace.receivers if h not in extra]
    if cview is not None:                      # the circuit's heads get panels: role heads first
        named = [Head(n.layer, n.index) for n in map(parse_node, list(cview.roles) + cview.heads)
                 if n is not None and n.kind == "head"]
        extra += [h for h in dict.fromkeys(named) if h not in extra][:CIRCUIT_HEADS]
    chosen = pick_heads(values, grid_k, extra)
    if not chosen:
        raise QKCircuitsError("no heads to show: give grid_k >= 1 or some heads")
    patterns = attention(ctx, chosen, pids)
    panels = {}
    for h in progress_bar(chosen, desc="report", unit="head", enabled=progress):
        panels[str(h)] = panel(ctx, h, ids, pids, patterns[h], scores=scores, effects=effects,
                               diagnostics=diagnostics, k=k, view=view, trace=trace)
    total = L * H
    left_out = (f"panels precomputed for {len(chosen)} of {total} heads: the top {grid_k} of every grid"
                + (", plus the heads asked for with --heads" if heads else "")
                + (", the traced heads" if trace is not None else "")
                + (", the circuit's heads" if cview is not None else "")
                + ("; the other heads were left out to keep the file small" if len(chosen) < total else ""))
    name = title or model_name(model)
    first = str(extra[0] if extra else chosen[0])
    if not extra and scores is not None and "induction" in scores.scores and grid_k > 0:
        first = str(scores.top(1, "induction")[0][0])   # open on the strongest induction head
    data = {"mode": "static", "title": f"qkcircuits report: {name}",
            "summary": (f"{L} layers x {H} heads; QK/OV token set: {len(ids)} tokens; prompt: {len(pids)} tokens. "
                        f"{left_out}. QK/OV token views use "
                        + (f"{view} inputs" if view else "direct inputs at layer 0 and contextual inputs (the mean "
                           "residual each layer reads for a token over a packaged English corpus) after it")
                        + "; each figure's title says which. Offsets and composition come from the weights."),
            "sections": report_sections(cview, scores, L, H, n_kv_heads(model),
                                        attend_results(model, scores, attend, cview)),
            "left_out": left_out, "grids": grid_list, "heads": list(panels), "first": first, "panels": panels}
    scripts = (f"<script>{script_text('plotly')}</script>\n"
               f"<script>{script_text('circuitsvis')}</script>")
    return page(data["title"], f"window.QK_SOURCE = {embed_json(data)};", scripts, server=False)


def circuit_page(circuit, title: Optional[str] = None, source: Optional[str] = None) -> str:
    """A page with the circuit section alone (``qkcircuits circuit -o``): the report's own section (the same blocks:
    warnings, summary, faithfulness curve, graph, roles, core, top edges) drawn by the same script, no model
    needed. ``circuit``: what ``report_html(circuit=...)`` takes; ``source``: the file name the section names."""
    view = load_circuit(circuit)
    if source:
        view.source = str(source)
    name = title or str(view.get("model") or "circuit")
    data = {"mode": "static", "title": f"qkcircuits circuit: {name}", "summary": "", "grids": [], "heads": [],
            "panels": {}, "left_out": "", "sections": report_sections(view, None, None, None, None)}
    return page(data["title"], f"window.QK_SOURCE = {embed_json(data)};", f"<script>{script_text('plotly')}</script>",
                server=False)


def report_sections(cview, scores, n_layers: Optional[int], n_heads: Optional[int], n_kv: Optional[int],
                    attend: Sequence = ()) -> List[Dict]:
    """The sections above the head grids, in order (each ``{id, title, blocks}``; ``_page`` draws the blocks): the
    circuit of ``--circuit``, the scan's causal check, then why the chosen heads attend (``attend``: Attributions,
    ``_attend_view.attend_sections``). A new panel is one more entry here."""
    from ._attend_view import attend_sections

    out: List[Dict] = []
    if cview is not None:
        c = circuit_section(cview, n_layers, n_heads, n_kv=n_kv)
        out.append({"id": "circuit-section", "title": f"Circuit ({c['source']})", "blocks": c["blocks"]})
    conf = scores.extras.get("confirmation") if scores is not None else None
    if conf:
        out.append({"id": "causal-check", "title": "Causal check: the top induction heads against random heads",
                    "blocks": causal_check_blocks(conf)})
    return out + attend_sections(attend)


def attend_results(model, scores, attend, cview=None) -> List:
    """The Attributions the report shows: those given (in their order), else the given circuit's role heads first
    (name movers, S-inhibition heads, ...: ``circuit_attend``), then the scan's top heads."""
    if attend is not None:
        return list(attend)
    out = circuit_attend(model, cview) if cview is not None else []
    if scores is None:
        return out
    from .._explain.evidence import explain_top_heads

    seen = {r.head if hasattr(r, "head") else r[0] for r in out}
    return out + [r for r in explain_top_heads(model, scores) if (r.head if hasattr(r, "head") else r[0]) not in seen]


def circuit_attend(model, cview, k: int = 4) -> List:
    """Why the circuit file's role heads attend (``_explain.evidence.explain_roles``), on the file's task (a
    registered one, its ``n_prompts`` up to 64, its seed or the circuit command's default 0); [] for a file without
    roles or with a task of its own (a .jsonl the report cannot rebuild)."""
    from .._tasks.registry import build_task, task_names

    task_name = cview.get("task")
    roles = {str(h): str(r.get("role")) for h, r in cview.roles.items() if isinstance(r, dict)}
    if task_name not in task_names() or not roles:
        return []
    from .._explain.evidence import explain_roles

    n = min(int(cview.get("n_prompts") or 32), 64)
    seed = int(cview.get("seed") or 0)
    try:
        task = build_task(model, task_name, n, seed)
    except QKCircuitsError as e:          # e.g. IOI on a model without a tokenizer: the report goes on, and says so
        h, r = next(iter(roles.items()))
        return [(h, r, f"the report could not rebuild the circuit's {task_name} prompts ({e})")]
    return explain_roles(model, task, roles, k=k, prompts={"task": task_name, "n": n, "seed": seed})


def causal_check_blocks(conf: Dict) -> List[Dict]:
    """The scan's causal check (``scan(confirm_k=K)``, ``qkcircuits scan --confirm K``): the sentence the CLI
    prints and the effect of the top heads against each random set of as many heads."""
    from .._analysis.detect import confirmation_sentence      # the CLI's own sentence
    from ._figures import random_baseline

    text = confirmation_sentence(conf)
    fig = random_baseline(float(conf["effect"]), [float(x) for x in conf.get("random_effects", [])],
                          [str(h) for h in conf.get("heads", [])], str(conf.get("metric", "induction-loss")),
                          str(conf.get("method", "zero")))
    return [{"type": "note", "text": text}, {"type": "figures", "figures": [{"id": "causal-figure", "figure": fig}]}]


def _grid_tensor(g: Dict) -> torch.Tensor:
    z = g["figure"]["data"][0]["z"]
    return torch.tensor([[math.nan if v is None else v for v in row] for row in z], dtype=torch.float32)


def write_report(path: Union[str, "os.PathLike[str]"], html: str) -> None:
    """Write the report atomically (the whole file or nothing) with a new file's usual permissions
    (0666 less the umask: a report is meant to be shared); an unwritable path is a ``QKCircuitsError``."""
    write_atomic(path, html)
