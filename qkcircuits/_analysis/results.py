"""Per-head results as data: [n_layers, n_heads] tensors plus the settings that produced them.

>>> s = HeadScores.from_json(text)          # doctest: +SKIP   the same object a plot, a report and a test read
>>> s.top(3, "induction")                   # doctest: +SKIP   [(Head(5, 1), 0.93), ...]
>>> s.to_frame().sort_values("induction")   # doctest: +SKIP   one row per head
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from jaxtyping import Float
from torch import Tensor

from .._foundation.display import Displayed
from .._foundation.errors import QKCircuitsError
from .._foundation.heads import Head
from .._foundation.io import check_int, dump_json, json_number, load_json

SCHEMA = "qkcircuits.head_scores/1"


@dataclass(repr=False)      # the repr comes from Displayed (_foundation.display)
class HeadScores(Displayed):
    """Named per-head scores, each ``Float[Tensor, "layer head"]`` on the CPU.

    ``thresholds`` maps a label (e.g. ``"induction"``) to ``(score name, minimum)``; a head gets
    the label when its score reaches the minimum. ``settings`` records the model, prompt sets,
    seeds and library versions. ``extras`` holds further data (e.g. causal confirmation).
    """

    model: str
    n_layers: int
    n_heads: int
    scores: Dict[str, Float[Tensor, "layer head"]]
    settings: Dict[str, Any] = field(default_factory=dict)
    thresholds: Dict[str, Tuple[str, float]] = field(default_factory=dict)
    extras: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, t in self.scores.items():
            if tuple(t.shape) != (self.n_layers, self.n_heads):
                raise QKCircuitsError(f"score {name!r} has shape {tuple(t.shape)}, expected "
                                      f"({self.n_layers}, {self.n_heads})")

    def __getitem__(self, name: str) -> Tensor:
        try:
            return self.scores[name]
        except KeyError:
            raise QKCircuitsError(f"no score named {name!r}; available: {', '.join(self.scores)}") from None

    def top(self, k: int = 5, score: str = "induction") -> List[Tuple[Head, float]]:
        """The ``k`` highest-scoring heads for ``score`` (NaN scores last), best first."""
        check_int("k", k)
        flat = torch.nan_to_num(self[score].flatten(), nan=-math.inf)
        vals, idx = flat.topk(min(k, flat.numel()))
        return [(Head(int(i) // self.n_heads, int(i) % self.n_heads), float(self[score].flatten()[i]))
                for v, i in zip(vals, idx)]

    def labels(self) -> Dict[Head, List[str]]:
        """Each head that reaches at least one threshold, with its labels."""
        out: Dict[Head, List[str]] = {}
        for label, (score, minimum) in self.thresholds.items():
            if score not in self.scores:
                continue
            for layer, head in (self.scores[score] >= minimum).nonzero().tolist():
                out.setdefault(Head(layer, head), []).append(label)
        return dict(sorted(out.items()))

    def heads_labelled(self, label: str) -> List[Head]:
        return [h for h, labels in self.labels().items() if label in labels]

    def to_frame(self):
        """A pandas DataFrame, one row per head: layer, head, every score, and ``labels``."""
        import pandas as pd

        labels = self.labels()
        rows = []
        for layer in range(self.n_layers):
            for head in range(self.n_heads):
                row: Dict[str, Any] = {"layer": layer, "head": head}
                row.update({name: float(t[layer, head]) for name, t in self.scores.items()})
                row["labels"] = ",".join(labels.get(Head(layer, head), []))
                rows.append(row)
        return pd.DataFrame(rows)

    def to_dict(self) -> Dict[str, Any]:
        return {
            "schema": SCHEMA, "model": self.model, "n_layers": self.n_layers, "n_heads": self.n_heads,
            "settings": self.settings,
            "thresholds": {k: [s, m] for k, (s, m) in self.thresholds.items()},
            "scores": {name: [[json_number(x) for x in row] for row in t.tolist()] for name, t in self.scores.items()},
            "labels": {str(h): v for h, v in self.labels().items()},
            "extras": self.extras,
        }

    def to_json(self, path: Optional[Union[str, Path]] = None, indent: int = 1) -> str:
        """JSON text (written atomically to ``path`` when given). NaN is written as ``null``."""
        return dump_json(self.to_dict(), path, indent)

    @classmethod
    def from_json(cls, text_or_path: Union[str, Path]) -> "HeadScores":
        d = load_json(text_or_path, "a scan's --json output", schema=SCHEMA)
        try:
            scores = {k: torch.tensor([[math.nan if x is None else x for x in row] for row in v], dtype=torch.float32)
                      for k, v in d["scores"].items()}
            return cls(model=d["model"], n_layers=int(d["n_layers"]), n_heads=int(d["n_heads"]), scores=scores,
                       settings=d.get("settings", {}),
                       thresholds={k: (v[0], float(v[1])) for k, v in d.get("thresholds", {}).items()},
                       extras=d.get("extras", {}))
        except (ValueError, KeyError, TypeError, IndexError, AttributeError, OverflowError) as e:
            raise QKCircuitsError(f"not a qkcircuits scores JSON ({type(e).__name__}: {e}); expected the keys model, "
                                  f"n_layers, n_heads, scores") from None

