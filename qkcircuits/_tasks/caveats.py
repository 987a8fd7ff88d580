"""The warnings a circuit result carries (the circuit JSON's ``warnings``), each one line, worded for a user.

>>> unreached_message({1.0: 0.41, 10.0: 0.63, 100.0: 1.0})
'no grid size below 100% reaches f >= 0.8 (the best: f 0.63 at 10%); the circuit is the whole graph, ...'
>>> a = torch.tensor([[1.0, -2.0, 3.0]]); b = torch.tensor([[1.0, 2.0, -3.0]])
>>> sign_disagreement(a, b, torch.ones(1, 3, dtype=torch.bool), top=3)["fraction"]
0.666667

- the model does not do the task: ``task.not_done_message`` (the likely causes to check);
- no grid size reaches f ≥ 0.8 (``unreached_message``): the "circuit" is then the largest grid size, most often
  every edge, which explains nothing;
- the chosen method's scores disagree in sign with EAP-IG's on the top edges (``sign_disagreement``): of the
  chosen method's ``top`` edges by |score| (100), those where both scores are non-zero and of opposite signs;
  more than ``SIGN_LIMIT`` (20 %) of them is a warning. A linear estimate far from EAP-IG on the edges that
  matter most (SmolLM2 IOI, ``--method eap``: emb → mlp0 at −0.51 against EAP-IG's +4.54) ranks the wrong
  edges first, and its circuit is then no circuit of the behaviour.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Tuple

import torch
from torch import Tensor

UNREACHED = "no grid size"
SIGN = "the edge scores disagree in sign with EAP-IG"
SIGN_LIMIT = 0.2
SIGN_TOP = 100


def unreached_message(curve: Mapping[float, float], threshold: float = 0.8) -> str:
    """One line for a curve none of whose sizes below 100 % reaches ``threshold`` (100 % always gives f = 1: it is
    every edge)."""
    below = [(p, v) for p, v in sorted(curve.items()) if p < 100 and v == v]
    best = max(below, key=lambda t: t[1], default=None)
    said = f" (the best: f {best[1]:.3g} at {best[0]:g}%)" if best else ""
    return (f"{UNREACHED} below 100% reaches f >= {threshold:g}{said}; the circuit is the whole graph, which "
            f"explains nothing: no circuit is named and no roles are given (--force / force=True names them "
            f"anyway); try more prompts, --by abs, or another method")


def reached(curve: Mapping[float, float], threshold: float = 0.8) -> bool:
    """Whether a grid size below 100 % reaches ``threshold`` (every edge, 100 %, always does)."""
    return any(v >= threshold for p, v in curve.items() if p < 100)


def sign_disagreement(scores: Tensor, reference: Tensor, valid: Tensor, top: int = SIGN_TOP) -> Dict[str, object]:
    """Of ``scores``' ``top`` edges by |score| (``valid`` [S, R] marks the graph's edges), the share whose sign is
    the opposite of ``reference``'s (edges where either is 0 count as agreeing); with the worst of them (the
    largest |reference| among the disagreeing) as (sender index, receiver index, score, reference)."""
    s_idx, r_idx = valid.nonzero(as_tuple=True)
    a = torch.nan_to_num(scores[s_idx, r_idx].double(), nan=0.0)
    b = torch.nan_to_num(reference[s_idx, r_idx].double(), nan=0.0)
    k = min(top, len(a))
    order = torch.argsort(a.abs(), descending=True, stable=True)[:k]
    flip = (a[order] * b[order]) < 0
    worst: List[Tuple[int, int, float, float]] = []
    for i in order[flip][torch.argsort(b[order][flip].abs(), descending=True)][:3].tolist():
        worst.append((int(s_idx[i]), int(r_idx[i]), float(a[i]), float(b[i])))
    return {"fraction": round(float(flip.double().mean()) if k else 0.0, 6), "top": k, "worst": worst}


def sign_message(method: str, found: Dict[str, object], names: Mapping[Tuple[int, int], str], rows: int) -> str:
    """One line for a ``sign_disagreement`` above ``SIGN_LIMIT``; ``names`` (sender, receiver) index → text."""
    ex = "; ".join(f"{names[(s, r)]} {a:+.3g} vs {b:+.3g}" for s, r, a, b in found["worst"])
    return (f"{SIGN} on {100 * found['fraction']:.0f}% of the top {found['top']} edges of --method {method} (more than "
            f"{100 * SIGN_LIMIT:.0f}%; EAP-IG on the first {rows} prompts: {ex}): its ranking is not the behaviour's; "
            f"prefer --method eap-ig")


__all__ = ["UNREACHED", "SIGN", "SIGN_LIMIT", "unreached_message", "reached", "sign_disagreement", "sign_message"]
