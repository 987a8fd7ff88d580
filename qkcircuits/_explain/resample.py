"""How much a head's QK sources would change with other prompts: each source's share with a bootstrap interval over
the prompts, and how often it is among the top 3 (``source_stability``).

>>> r = qk.attend(model, "1.0", tokens, key="induction")
>>> st = source_stability(r, n=100)
>>> top = st["key"][0]
>>> top["source"], abs(top["share"] - r.key_sources(1)[0][2]) < 1e-9, top["top3"]   # the attribution's own share
('0.0', True, 1.0)

An attribution's rows are (prompt, query, key) triples; a resample draws the PROMPTS with replacement (all of a
prompt's rows go together, as a fresh draw of prompts would), and recomputes, from the rows' per-source values
alone (no model run),

    share_b(s) = Σ_{rows of the drawn prompts} v[row, s] / Σ_{those rows} total[row],

for the query side and the key side. Reported per source (largest |share| first): ``share`` (the attribution's
own), ``interval`` (the 2.5 % and 97.5 % quantiles of share_b) and ``top3`` (the fraction of resamples in which
it is among the 3 largest shares). A source in the top 3 in nearly every resample is a finding; one that is there
in half of them is one draw's answer. Resamples whose total is 0 are dropped.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from .._foundation.errors import QKCircuitsError


def source_stability(attribution, n: int = 200, seed: int = 0, top: int = 3, level: float = 0.95
                     ) -> Dict[str, Any]:
    """{"query": [...], "key": [...], "n", "prompts"}: per source its share, interval and top-``top`` frequency
    over ``n`` resamples of the prompts (module docstring)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise QKCircuitsError(f"n must be an integer >= 1 (resamples of the prompts), got {n!r}")
    prompts = [int(r.get("prompt", i)) for i, r in enumerate(attribution.rows)]
    ids = sorted(set(prompts))
    where = {p: i for i, p in enumerate(ids)}
    member = torch.zeros(len(ids), len(prompts), dtype=torch.float64)          # [prompts, rows]
    for j, p in enumerate(prompts):
        member[where[p], j] = 1.0
    gen = torch.Generator().manual_seed(int(seed))
    draw = torch.randint(len(ids), (n, len(ids)), generator=gen)                # [B, prompts drawn]
    counts = torch.zeros(n, len(ids), dtype=torch.float64).scatter_add_(1, draw, torch.ones_like(draw,
                                                                                                dtype=torch.float64))
    weights = counts @ member                                                    # [B, rows]: times each row is drawn
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    out: Dict[str, Any] = {"n": n, "prompts": len(ids), "level": level, "top": top}
    for side, names, values in (("query", attribution.query_names, attribution.query_values),
                                ("key", attribution.key_names, attribution.key_values)):
        v = values.double()                                                      # [rows, sources]
        total = v.sum(1)                                                         # [rows]
        own = v.sum(0) / total.sum() if float(total.sum()) != 0 else torch.full((v.shape[1],), float("nan"))
        tb = weights @ total                                                     # [B]
        ok = tb != 0
        shares = (weights[ok] @ v) / tb[ok, None]                                # [B kept, sources]
        if shares.shape[0]:
            k = min(top, shares.shape[1])
            ranks = shares.abs().topk(k, dim=1).indices
            in_top = torch.zeros_like(shares).scatter_(1, ranks, 1.0).mean(0)
            lo, hi = torch.quantile(shares, q, dim=0)
        else:
            in_top = lo = hi = torch.full((v.shape[1],), float("nan"), dtype=torch.float64)
        order = sorted(range(len(names)), key=lambda i: -abs(float(own[i])) if own[i] == own[i] else 0.0)
        out[side] = [{"source": names[i], "share": float(own[i]), "interval": [float(lo[i]), float(hi[i])],
                      "top3": float(in_top[i])} for i in order]
    return out
