"""Names for the sources of a QK attribution: the scan's labels for heads, fixed words for the rest.

>>> r = qk.attend(model, "1.0", torch.tensor([[0, 5, 6, 7, 5, 6, 7]]), key="induction")
>>> source_labels(model, r)["0.0"]             # a quick scan of the labelled detectors names the heads
'previous-token'
"""

from __future__ import annotations

from typing import Dict, Optional

from .._analysis.head_scores import HeadScores
from .._foundation.errors import QKCircuitsError
from .._foundation.heads import Head
from .attribution import Attribution

FIXED = {"emb": "token embedding", "pos": "positions", "mlp0[token]": "token identity", "mlp0[context]": "context",
         "bias": "output biases",
         "bias_q": "query bias", "bias_k": "key bias"}


def source_labels(model, res: Attribution, scores: Optional[HeadScores] = None,
                  scores_path: Optional[str] = None) -> Dict[str, str]:
    """{source: label} for every source of ``res``: heads by their scan labels (``scores``, the scan JSON at
    ``scores_path``, else a quick scan of the labelled detectors: one streamed pass), the rest by ``FIXED``."""
    if scores is None and scores_path is not None:
        scores = HeadScores.from_json(scores_path)
    if scores is None:
        from .._paths.trace import scan_for_trace

        scores = scan_for_trace(model, progress=False)
    if (scores.n_layers, scores.n_heads) != (int(model.cfg.n_layers), int(model.cfg.n_heads)):
        raise QKCircuitsError(f"the scan has {scores.n_layers} x {scores.n_heads} heads, this model "
                              f"{model.cfg.n_layers} x {model.cfg.n_heads}: give the scan of this model")
    heads = scores.labels()
    out = {}
    for name in dict.fromkeys(res.query_names + res.key_names):
        if name in FIXED:
            out[name] = FIXED[name]
        elif "." in name:
            labs = heads.get(Head.parse(name), [])
            if labs:
                out[name] = ", ".join(labs)
    return out
