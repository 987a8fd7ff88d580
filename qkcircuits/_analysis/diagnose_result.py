"""``HeadDiagnostics``: per-head health measures as [n_layers, n_heads] tensors, flags with stated thresholds.

>>> diag = qk.diagnose(model, progress=False)
>>> diag["qk_var_ratio"].shape                               # [n_layers, n_heads]
torch.Size([2, 2])
>>> diag.flagged()[:2]                                       # the toy's heads attend one-hot
[(Head(layer=0, head=0), ['near_one_hot']), (Head(layer=0, head=1), ['near_one_hot'])]
>>> diag.to_frame().sort_values("sink", ascending=False)[["layer", "head"]].values[0].tolist()   # one row per head
[1, 0]
>>> HeadDiagnostics.from_json(diag.to_json()).flagged() == diag.flagged()            # an exact round trip
True

Flags (thresholds live in ``settings["thresholds"]`` and docs/diagnostics.md says why):

- ``near_uniform``: mean attention entropy ≥ ``near_uniform`` (0.9) of its maximum log(i+1);
- ``near_one_hot``: mean largest weight ≥ ``near_one_hot`` (0.9);
- ``sink_dominated``: mean share of attention on the first token ≥ ``sink_dominated`` (0.8);
- ``leaking``: any weight on a later position > ``leak_tol`` (0.0), or the perturbation test blames the head.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from .._foundation import display as show
from .._foundation.errors import QKCircuitsError
from .._foundation.heads import Head
from .._foundation.io import json_floats, read_floats
from .._foundation.result import Result

# What each measure is (units: q·k products are raw dot products of the post-rotary q and k).
MEASURES: Dict[str, str] = {
    "qk_mean": "mean raw q·k over causal pairs (j <= i)",
    "qk_var": "variance of raw q·k over causal pairs",
    "qk_var_ratio": "qk_var / d_head (the textbook value is 1)",
    "qk_var_no_first": "variance of raw q·k over causal pairs whose key is not position 0",
    "scaled_var": "variance of the model's own pre-softmax scores (its scale, and soft-cap if any) over causal pairs",
    "q_var": "mean over components of Var(q_d) (pair-weighted)",
    "k_var": "mean over components of Var(k_d) (pair-weighted)",
    "pred_var_zero_mean": "Var(q·k) predicted from zero-mean independent components: sum_d Var(q_d) Var(k_d)",
    "pred_var_components": "Var(q·k) predicted from independent components: sum_d E[q_d²]E[k_d²] - (E[q_d]E[k_d])²",
    "pred_var_indep": "Var(q·k) predicted from q independent of k only: tr(M_q M_k) - (mu_q·mu_k)²",
    "indep_ratio": "qk_var / pred_var_indep (1 when a query and its key are independent)",
    "entropy_mean": "mean attention entropy per query row i >= 1 (nats)",
    "entropy_std": "standard deviation of that entropy over rows (nats)",
    "entropy_frac_mean": "mean of entropy / log(i+1) over rows i >= 1 (1 = uniform)",
    "entropy_frac_std": "standard deviation of entropy / log(i+1)",
    "max_weight": "mean largest attention weight per row i >= 1",
    "sink": "mean attention on position 0 per row i >= 1",
    "saturation": "mean sum_j p(1-p) per row i >= 1 with the model's scaling (0 = one-hot)",
    "saturation_unscaled": "the same for softmax of the raw q·k (no scaling): the counterfactual",
    "entropy_frac_unscaled": "entropy / log(i+1) of softmax of the raw q·k",
    "max_weight_unscaled": "largest weight of softmax of the raw q·k",
    "pattern_err": "max |softmax(scores, causal) - hook_pattern|: checks that the q/k/scale read are the model's",
    "scores_err": "max |softcap(scale · q·k) - hook_attn_scores| over causal pairs (0 where scores are rebuilt)",
    "future_weight": "largest attention weight any query puts on a later key (0 for a causal model)",
    "perturb_change": "max change of this head's pattern/z at positions before a changed later token",
    "perturb_input_change": "max change of the layer's q/k/v at those positions (a leak upstream)",
}
SCHEMA = "qkcircuits.head_diagnostics/1"
FLAGS = ("near_uniform", "near_one_hot", "sink_dominated", "leaking")
DEFAULT_THRESHOLDS: Dict[str, float] = {"near_uniform": 0.9, "near_one_hot": 0.9, "sink_dominated": 0.8,
                                        "leak_tol": 0.0}


def check_thresholds(thresholds: Optional[Dict[str, Union[int, float]]]) -> Dict[str, float]:
    out = dict(DEFAULT_THRESHOLDS)
    for k, v in (thresholds or {}).items():
        if k not in DEFAULT_THRESHOLDS:
            raise QKCircuitsError(f"unknown threshold {k!r}; choose from {', '.join(DEFAULT_THRESHOLDS)}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
            raise QKCircuitsError(f"threshold {k} must be a non-negative number, got {v!r}")
        out[k] = float(v)
    return out


@dataclass(frozen=True, repr=False)      # the repr is _text (Result)
class HeadDiagnostics(Result):
    """Head health measures of one model: ``measures[name]`` is [n_layers, n_heads] (NaN for skipped layers).

    ``measures`` pools every prompt set; ``by_set[set][name]`` keeps each set's own values
    (``"text"``: natural text, ``"repeated"``: repeated random tokens). ``scale`` [n_layers] is
    the factor the model multiplies raw q·k by before softmax (read from the model, see
    ``settings["scale_source"]``). Small: a few dozen [n_layers, n_heads] tensors.
    """

    SCHEMA = SCHEMA
    WHAT = "a diagnose --json output (qkcircuits diagnostics JSON)"
    KEYS = ("model", "n_layers", "n_heads", "d_head", "scale", "measures")

    model: str
    n_layers: int
    n_heads: int
    d_head: int
    measures: Dict[str, Tensor]
    scale: Tensor
    settings: dict = field(default_factory=dict)
    by_set: Dict[str, Dict[str, Tensor]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, t in list(self.measures.items()) + [(f"{s}/{n}", t) for s, ms in self.by_set.items()
                                                       for n, t in ms.items()]:
            if tuple(t.shape) != (self.n_layers, self.n_heads):
                raise QKCircuitsError(f"measure {name!r} has shape {tuple(t.shape)}, expected "
                                      f"({self.n_layers}, {self.n_heads})")

    def __getitem__(self, name: str) -> Float[Tensor, "layer head"]:
        try:
            return self.measures[name]
        except KeyError:
            raise QKCircuitsError(f"unknown measure {name!r}; choose from {', '.join(self.measures)}") from None

    @property
    def thresholds(self) -> Dict[str, float]:
        return dict(self.settings.get("thresholds", DEFAULT_THRESHOLDS))

    def flags(self) -> Dict[str, Bool[Tensor, "layer head"]]:
        """``{flag: bool [n_layers, n_heads]}`` from the measures and ``thresholds`` (NaN never flags)."""
        t, m = self.thresholds, self                      # self[name]: a clear error for a missing measure
        leak_tol = t["leak_tol"]
        # A head is blamed by the perturbation test only if its own inputs at the earlier positions were
        # unchanged: otherwise the change came from a leak in an earlier layer.
        blamed = (m["perturb_change"] > leak_tol) & (m["perturb_input_change"] <= leak_tol)
        return {
            "near_uniform": m["entropy_frac_mean"] >= t["near_uniform"],
            "near_one_hot": m["max_weight"] >= t["near_one_hot"],
            "sink_dominated": m["sink"] >= t["sink_dominated"],
            "leaking": (m["future_weight"] > leak_tol) | blamed,
        }

    def flagged(self) -> List[Tuple[Head, List[str]]]:
        """Heads with at least one flag, in (layer, head) order, with their flag names."""
        fl = self.flags()
        out = []
        for layer in range(self.n_layers):
            for h in range(self.n_heads):
                names = [f for f in FLAGS if bool(fl[f][layer, h])]
                if names:
                    out.append((Head(layer, h), names))
        return out

    def to_frame(self):
        """A pandas DataFrame, one row per head: layer, head, every measure, every flag, and ``flags``."""
        import pandas as pd

        fl = self.flags()
        rows = []
        for layer in range(self.n_layers):
            for h in range(self.n_heads):
                row = {"layer": layer, "head": h}
                row.update({k: float(v[layer, h]) for k, v in self.measures.items()})
                row.update({k: bool(v[layer, h]) for k, v in fl.items()})
                row["flags"] = ",".join(f for f in FLAGS if bool(fl[f][layer, h]))
                rows.append(row)
        return pd.DataFrame(rows)

    def layer_means(self, name: str) -> Float[Tensor, "layer"]:
        """Mean of a measure over the heads of each layer."""
        return self[name].nanmean(dim=1)

    def to_dict(self) -> dict:
        grid = json_floats          # exact (a leak of 1e-13 must survive the round trip); NaN as null

        return {
            "schema": SCHEMA, "model": self.model, "n_layers": self.n_layers, "n_heads": self.n_heads,
            "d_head": self.d_head, "scale": grid(self.scale),
            "settings": self.settings,
            "measures": {k: grid(v) for k, v in self.measures.items()},
            "by_set": {s: {k: grid(v) for k, v in ms.items()} for s, ms in self.by_set.items()},
            "flags": {k: v.tolist() for k, v in self.flags().items()},
            "flagged": {str(h): names for h, names in self.flagged()},
        }

    def top(self, k: int = 5, measure: str = "sink") -> List[Tuple[Head, float]]:
        """The ``k`` heads with the largest ``measure`` (NaN last), largest first."""
        pairs = show.top_heads(self[measure], k)
        return [(Head.parse(h), v) for h, v in pairs]

    @classmethod
    def _from_dict(cls, d: Dict[str, Any]) -> "HeadDiagnostics":
        L, H = int(d["n_layers"]), int(d["n_heads"])

        def tensor(x) -> Tensor:
            return read_floats(x, torch.float64).reshape(L, H)

        return cls(model=d["model"], n_layers=int(d["n_layers"]), n_heads=int(d["n_heads"]),
                   d_head=int(d["d_head"]), measures={k: tensor(v) for k, v in d["measures"].items()},
                   scale=read_floats(d["scale"], torch.float64),
                   settings=d.get("settings", {}),
                   by_set={s: {k: tensor(v) for k, v in ms.items()} for s, ms in d.get("by_set", {}).items()})

    # ------------------------------------------------------------------------------------------ display
    def _by_flag(self) -> Dict[str, List[str]]:
        by_flag: Dict[str, List[str]] = {}
        for h, names in self.flagged():
            for n in names:
                by_flag.setdefault(n, []).append(str(h))
        return by_flag

    def _text(self) -> str:
        by_flag = self._by_flag()
        n = len(self.flagged())
        return (f"HeadDiagnostics({self.model}: {self.n_layers} layers x {self.n_heads} heads; {n} flagged"
                + "".join(f"; {f} {len(hs)}: {', '.join(hs[:3])}{', ...' if len(hs) > 3 else ''}"
                          for f, hs in by_flag.items()) + ")")

    def _html(self) -> str:
        by_flag, th, TOP = self._by_flag(), self.thresholds, show.TOP
        fl = self.flags()
        rows = [(f, str(len(by_flag.get(f, []))), ", ".join(by_flag.get(f, [])[:TOP])
                 + (" …" if len(by_flag.get(f, [])) > TOP else "")) for f in fl]
        count = sum(v.float() for v in fl.values())
        grids = show.grid(count, "flags per head") + "".join(
            show.grid(self.measures[m], m) for m in ("sink", "entropy_frac_mean", "qk_var_ratio") if m in self.measures)
        return show.box(f"HeadDiagnostics: {self.model} (thresholds "
                        f"{', '.join(f'{k} {show.number(v)}' for k, v in th.items())})",
                        show.table(rows, ("flag", "heads", f"first {TOP}")), grids)
