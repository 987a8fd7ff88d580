"""Bootstrap confidence intervals of a faithfulness curve, CPR and CMD over prompts, from per-row metrics.

>>> f = qk.faithfulness(model, task, scores, bootstrap=100, progress=False)     # doctest: +SKIP
>>> f.bootstrap["cpr"]                      # the 95 % interval                  # doctest: +SKIP
[0.93, 1.07]

Each circuit's metric is measured once per prompt row (``circuit.circuit_metric(per_row=...)``: m_C[i] for every
circuit C of the grid, m_clean[i], m_corrupt[i]); a resample draws n row indices with replacement and
recomputes, from those rows' means only (no model run per resample),

    f_b(C) = (mean_b m_C − mean_b m_corrupt) / (mean_b m_clean − mean_b m_corrupt),

then CPR_b and CMD_b by the same trapezoid over the grid as the point estimate. The interval is the
percentile interval of the resamples ((1 − level)/2 and (1 + level)/2 quantiles, level 0.95 by default);
resamples whose clean and corrupt means are equal (f undefined) are dropped. Seeded (``seed``), so a rerun
gives the same interval. It says how much the numbers move with the choice of prompts; it does not cover the
choice of edges, which is held fixed.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
from torch import Tensor

from .._foundation.errors import QKCircuitsError


def _area(xs: Tensor, ys: Tensor) -> Tensor:
    """Trapezoid over the grid ``xs`` [k] of ``ys`` [k, B] → [B]."""
    if ys.shape[0] < 2:
        return torch.zeros(ys.shape[1], dtype=ys.dtype)
    dx = (xs[1:] - xs[:-1])[:, None]
    return (dx * (ys[1:] + ys[:-1]) / 2).sum(0)


def check_bootstrap(n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise QKCircuitsError(f"bootstrap must be an integer >= 0 (resamples of the prompts; 0 = none), got {n!r}")
    return n


def bootstrap_curve(xs: Sequence[float], masks: Tensor, clean: Tensor, corrupt: Tensor, n: int = 100, seed: int = 0,
                    level: float = 0.95) -> Dict[str, object]:
    """Percentile intervals of f per grid point, CPR and CMD from per-row metrics: ``masks`` [k, rows] (one
    row of metrics per circuit, in the order of ``xs``, the grid as fractions of the edges), ``clean`` and
    ``corrupt`` [rows]; ``n`` resamples of the rows with replacement, seeded. Returns {"n", "seed", "level",
    "kept", "cpr": [lo, hi], "cmd": [lo, hi], "curve": {percent: [lo, hi]} (keys as ``f"{100 x:g}"``, the
    circuit JSON's curve keys), "cpr_sd", "cmd_sd"} (sd: the resamples' standard deviation)."""
    check_bootstrap(n)
    if not 0 < level < 1:
        raise QKCircuitsError(f"level must be in (0, 1), got {level!r}")
    rows = clean.shape[0]
    if masks.shape != (len(xs), rows) or corrupt.shape != (rows,):
        raise QKCircuitsError(f"per-row metrics have shapes {tuple(masks.shape)}, {tuple(clean.shape)}, "
                              f"{tuple(corrupt.shape)}; expected [{len(xs)}, {rows}], [{rows}], [{rows}]")
    gen = torch.Generator().manual_seed(int(seed))
    idx = torch.randint(rows, (n, rows), generator=gen)                   # [B, rows]
    m = masks.double()[:, idx].mean(-1)                                   # [k, B]
    c, z = clean.double()[idx].mean(-1), corrupt.double()[idx].mean(-1)   # [B]
    ok = c != z
    f = (m[:, ok] - z[ok]) / (c[ok] - z[ok])                              # [k, B kept]
    x = torch.tensor([float(v) for v in xs], dtype=torch.float64)
    cpr, cmd = _area(x, f), _area(x, (1 - f).abs())
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)

    def interval(v: Tensor) -> List[float]:
        return [float("nan")] * 2 if v.numel() == 0 else [float(t) for t in torch.quantile(v, q)]

    def sd(v: Tensor) -> float:
        return float(v.std()) if v.numel() > 1 else float("nan")

    return {"n": n, "seed": int(seed), "level": level, "kept": int(ok.sum()), "cpr": interval(cpr),
            "cmd": interval(cmd), "curve": {f"{100 * float(p):g}": interval(f[i]) for i, p in enumerate(xs)},
            "cpr_sd": sd(cpr),
            "cmd_sd": sd(cmd), "method": "percentile bootstrap over prompt rows, f recomputed from per-row metrics"}


def ratio_intervals(m: Tensor, clean: Tensor, corrupt: Tensor, n: int = 200, seed: int = 0,
                    level: float = 0.95) -> Tuple[Tensor, Tensor]:
    """Percentile intervals (lo [k], hi [k]) of f = (mean m − mean corrupt) / (mean clean − mean corrupt) for each
    row of per-row metrics ``m`` [k, rows], ``clean`` and ``corrupt`` [rows], over ``n`` resamples of the rows
    with replacement (seeded: the same rows resampled for every set, so sets are compared on equal draws).
    Resamples whose clean and corrupt means are equal are dropped; none left: NaN.

    >>> m = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 2.0, 0.0, 2.0]])
    >>> lo, hi = ratio_intervals(m, torch.full((4,), 2.0), torch.zeros(4), n=100)
    >>> lo.tolist()[0], hi.tolist()[0], lo[1].item() < 0.5 < hi[1].item()
    (0.5, 0.5, True)
    """
    check_bootstrap(n)
    rows = clean.shape[0]
    if m.dim() != 2 or m.shape[1] != rows or corrupt.shape != (rows,):
        raise QKCircuitsError(f"per-row metrics have shapes {tuple(m.shape)}, {tuple(clean.shape)}, "
                              f"{tuple(corrupt.shape)}; expected [k, {rows}], [{rows}], [{rows}]")
    gen = torch.Generator().manual_seed(int(seed))
    idx = torch.randint(rows, (max(n, 1), rows), generator=gen)           # [B, rows]
    mb = m.double()[:, idx].mean(-1)                                       # [k, B]
    c, z = clean.double()[idx].mean(-1), corrupt.double()[idx].mean(-1)
    ok = c != z
    if not bool(ok.any()):
        nan = torch.full((m.shape[0],), float("nan"), dtype=torch.float64)
        return nan, nan.clone()
    f = (mb[:, ok] - z[ok]) / (c[ok] - z[ok])
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    lo, hi = torch.quantile(f, q, dim=1)
    return lo, hi
