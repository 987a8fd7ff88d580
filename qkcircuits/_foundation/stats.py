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
