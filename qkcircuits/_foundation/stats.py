"""Rank statistics used to compare head rankings (attribution vs sweep, ours vs TransformerLens).

>>> import torch
>>> round(spearman(torch.tensor([1., 2., 3.]), torch.tensor([10., 20., 30.])), 6)
1.0
>>> round(spearman(torch.tensor([1., 2., 3.]), torch.tensor([3., 2., 1.])), 6)
-1.0
"""

from __future__ import annotations

import torch
from torch import Tensor


def ranks(x: Tensor) -> Tensor:
    """0-based ranks of the flattened ``x``, ties given their average rank."""
    x = x.flatten().double()
    r = torch.empty_like(x)
    r[x.argsort()] = torch.arange(len(x), dtype=torch.double)
    values, inverse = torch.unique(x, return_inverse=True)
    sums = torch.zeros(len(values), dtype=torch.double).index_add_(0, inverse, r)
    counts = torch.zeros(len(values), dtype=torch.double).index_add_(0, inverse, torch.ones_like(r))
    return (sums / counts)[inverse]


def spearman(a: Tensor, b: Tensor) -> float:
    """Spearman rank correlation of two tensors of equal size (average ranks for ties; NaN-free input)."""
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def versus_random(effect: float, randoms) -> dict:
    """How an effect stands against the effects of random sets: their mean, SD (n − 1), max, the z-score
    (effect − mean) / SD and the margin over their max; ``clear`` when that margin exceeds one SD of the random sets
    (and the z-score is at least 2), None when fewer than 2 sets leave no spread to compare with.

    >>> v = versus_random(9.207, [9.026, 8.6, 8.9, 8.7])
    >>> round(v["margin"], 3), round(v["sd"], 3), v["clear"]          # a margin inside the spread: no verdict of "clear"
    (0.181, 0.192, False)
    """
    r = [float(x) for x in randoms]
    n = len(r)
    mean = sum(r) / n if n else float("nan")
    sd = (sum((x - mean) ** 2 for x in r) / (n - 1)) ** 0.5 if n > 1 else float("nan")
    top = max(r) if r else float("nan")
    z = (effect - mean) / sd if n > 1 and sd > 0 else (float("inf") if n > 1 and effect > mean else float("nan"))
    margin = effect - top
    clear = None if n < 2 else bool(margin > (sd if sd > 0 else 0.0) and z >= 2)
    return {"n": n, "mean": mean, "sd": sd, "max": top, "z": z, "margin": margin, "clear": clear}


def random_verdict(effect: float, randoms) -> str:
    """One clause on ``versus_random``: "above random: the margin over the random max, +2.100, is 4.9 SDs of the 20
    random sets (z = 12.3)", or a warning when the margin is within one SD:

    >>> random_verdict(9.207, [9.026, 8.6, 8.9, 8.7])
    "WARNING: within the random sets' spread: the margin over their max, +0.181, is under one SD (0.192) of the 4 sets (z = 2.1)"
    """
    v = versus_random(effect, randoms)
    if v["clear"] is None:
        return f"no verdict: {v['n']} random set{'s' if v['n'] != 1 else ''} give no spread to compare with"
    z = f"z = {v['z']:.1f}"
    if v["clear"]:
        ratio = v["margin"] / v["sd"] if v["sd"] > 0 else float("inf")
        return (f"above random: the margin over the random max, {v['margin']:+.3f}, is {ratio:.1f} SDs of the "
                f"{v['n']} random sets ({z})")
    return (f"WARNING: within the random sets' spread: the margin over their max, {v['margin']:+.3f}, is under one SD "
            f"({v['sd']:.3f}) of the {v['n']} sets ({z})")
