"""Trace the induction circuit: which earlier heads feed the top induction heads' queries, keys and values.

>>> res = qk.trace_induction(model, k=1, progress=False)   # scan, then path-patch every earlier head
>>> res.receivers, res.labels["0.0"]
([Head(layer=1, head=0)], ['previous-token'])
>>> print(res.summary(res.receivers[0], "k"))
1.0 reads its keys from 0.0 (previous-token; effect 1.00 = 100% of the clean 1.00; next sender -0.00; baseline mean 0.50)
>>> res.k_composition_spearman     # activations vs weights-only K-composition; None: under 3 senders to rank
{'1.0': None}

The result is a ``PathEffects`` (data first; ``to_json`` is the ``qkcircuits trace --json`` contract)
with ``labels`` (each sender's scan labels) and ``k_composition_spearman`` filled in.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Dict, List, Optional, Sequence, Tuple

from .._analysis.detect import scan
from .._analysis.detectors import labelled_scores
from .._foundation.backends import BackendLike, as_backend
from .._foundation.errors import QKCircuitsError
from .._foundation.heads import Head, HeadsLike, model_heads
from .._foundation.io import check_int
from .._foundation.stats import spearman
from .._weights.composition import composition_column
from .edges import edge_attribution
from .path_effects import PathEffects
from .patching import PATH_PATCH


def trace_scores() -> Tuple[str, ...]:
    """What a trace reads of a scan: the induction ranking (receivers) and the sender labels, i.e. the
    labelled detectors of the registry (built in: induction, previous_token, duplicate_token). They share ONE
    streamed pass over [BOS]+R+R that stops after the last layer's attention (no prefix-matching or copying)."""
    return tuple(dict.fromkeys(("induction",) + labelled_scores()))


def scan_for_trace(model, progress: bool = True):
    """The scan whose induction ranking and labels a trace reads: only ``trace_scores()``."""
    return scan(model, scores=list(trace_scores()), progress=progress)


def k_composition_spearman(model, res: PathEffects) -> Dict[str, Optional[float]]:
    """Per receiver: Spearman correlation over its senders between the K-path effects (activations) and
    the weights-only K-composition scores (``composition_column``) of the same (sender, receiver) pairs."""
    out: Dict[str, Optional[float]] = {}
    if "k" not in res.effects:
        return out
    for i, r in enumerate(res.receivers):
        if r.layer == 0:
            out[str(r)] = None
            continue
        comp = composition_column(model, r, "K").flatten()
        eff = res.effects["k"][i, :r.layer].flatten()
        keep = ~eff.isnan()
        out[str(r)] = spearman(eff[keep], comp[keep]) if int(keep.sum()) > 2 else None
    return out


def trace(model, receivers: Optional[HeadsLike] = None, *, k: int = 3, into: Sequence[str] = ("q", "k", "v"),
          method: str = "mean", attribution: bool = False, scores=None, tokens=None,
          progress: bool = True, backend: BackendLike = None, ray_address: Optional[str] = None,
          workers: Optional[int] = None, load_kwargs: Optional[dict] = None) -> PathEffects:
    """What ``qkcircuits trace`` computes: path effects into ``receivers`` (default: the ``k`` induction
    heads of a scan, layer ≥ 1), with the senders' scan labels and the K-composition agreement.

    ``model``: a loaded model or a spec, on any backend. ``attribution=True`` estimates the edges by
    ``edge_attribution`` instead of exact path patching. ``scores`` (a ``HeadScores``) skips the scan.
    Memory: as ``path_patch`` (or ``edge_attribution``). ``backend``: ``qk.Local()`` (default) or
    ``qk.Ray(...)`` (strings as ``as_backend``; ``ray_address``/``workers`` the older spelling): the steps of
    ``trace_on`` on one pool of it (on Ray the scan and K-composition on a worker, the patching's shards on all).
    ``load_kwargs``: ``qk.load`` options used where a spec is loaded.
    """
    top = check_int("k", k)
    chosen = as_backend(backend, address=ray_address, workers=workers)
    if load_kwargs:
        chosen = replace(chosen, load_kwargs={**getattr(chosen, "load_kwargs", {}), **load_kwargs})
    with chosen.pool(model) as pool:
        return trace_on(pool, receivers, top=top, into=into, method=method, attribution=attribution, scores=scores,
                        tokens=tokens, progress=progress)


def trace_on(pool, receivers: Optional[HeadsLike] = None, *, top: int = 3, into: Sequence[str] = ("q", "k", "v"),
             method: str = "mean", attribution: bool = False, scores=None, tokens=None,
             progress: bool = True) -> PathEffects:
    """``trace``'s steps on an open pool (any backend's): the scan and the receivers (a step), the path patching
    (``PATH_PATCH``'s shards; or, with ``attribution``, ``edge_attribution`` as a step), the K-composition
    agreement (a step, on the model's weights)."""
    found = pool.run("trace_scan", local=trace_scan, receivers=receivers, top=top, scores=scores, progress=progress)
    recv = found["receivers"]
    if attribution:
        res = pool.run("edge_attribution", local=_attribution, receivers=recv, into=into, method=method, tokens=tokens)
    else:
        res = pool.map(PATH_PATCH, receivers=recv, into=into, senders=None, method=method, tokens=tokens, metric=None,
                       per_position=True, shards=1, chunk=None, progress=progress)
    res = replace(res, labels=found["labels"],
                  k_composition_spearman=pool.run("k_composition", local=k_composition_spearman, res=res))
    res.settings["receiver_induction"] = found["receiver_induction"]
    res.settings["scan"] = found["scan"]
    return res


def trace_scan(model, *, receivers: Optional[HeadsLike], top: int, scores=None, progress: bool = True) -> dict:
    """The step "trace_scan": the scan (or ``scores``, a ``HeadScores`` to reuse), the receivers (default the ``top``
    induction heads of layer >= 1), the senders' labels and the receivers' induction scores."""
    if scores is None:
        scores = scan_for_trace(model, progress)
    recv = trace_receivers(model, scores, receivers, top)
    return {"receivers": recv, "labels": {str(h): v for h, v in scores.labels().items()},
            "receiver_induction": {str(r): float(scores["induction"][r.layer, r.head]) for r in recv},
            "scan": {k: scores.settings.get(k) for k in ("n_seqs", "seq_len", "seed")}}


def _attribution(model, *, receivers, into, method: str, tokens) -> PathEffects:
    """The step "edge_attribution" (``trace(attribution=True)``)."""
    return edge_attribution(model, receivers, into=into, method=method, tokens=tokens)


def trace_receivers(model, scores, receivers: Optional[HeadsLike], k: int) -> List[Head]:
    """The receivers of a trace: ``receivers`` as heads, or (None) the ``k`` best induction heads of ``scores``
    in layer 1 or later (a layer-0 head reads no earlier head). None at all: one line."""
    if receivers is None:
        ranked = [h for h, _ in scores.top(model.cfg.n_layers * model.cfg.n_heads, "induction") if h.layer > 0]
        recv: List[Head] = ranked[:k]
    else:
        recv = model_heads(model, receivers)
    if not recv:
        raise QKCircuitsError("no receivers: the model has one layer, so no head can read an earlier head")
    return recv


def trace_induction(model, k: int = 3, **kwargs) -> PathEffects:
    """For the ``k`` detected induction heads: the path effect through Q, K and V of every earlier head,
    ranked (``res.top(k, receiver=r, into="k")``), the baseline (``res.baseline(r, "k")``: mean and 95th percentile over
    all senders), each sender's scan labels (``res.labels``) and the Spearman agreement of the K-path
    effects with the weights-only K-composition scores (``res.k_composition_spearman``)."""
    return trace(model, k=k, **kwargs)
