"""Any circuit of one head as a ``Circuit`` result: ``circuit(model, head, kind)``.

>>> c = qk.circuit(model, "1.0", "qk")
>>> c.kind, tuple(c.matrix.shape), c.exact
('qk', (224, 224), True)

Its own module so that ``qk_ov`` (weights, inputs) and ``rotary`` (positions) import nothing from each
other: this one imports both (it used to be ``circuits.circuit``, today's ``qk_ov``, importing ``rotary`` inside the
function, while ``rotary`` imported ``circuits``: a circle).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from transformer_lens.FactoredMatrix import FactoredMatrix

from .._foundation import display as show
from .._foundation.args import check_integer, check_model
from .._foundation.errors import QKCircuitsError
from .._foundation.heads import Head, HeadsLike
from .._foundation.io import json_floats, read_floats
from .._foundation.model import model_name
from .._foundation.result import Result, stamped
from .qk_ov import to_head, attn_scale, circuit_caveats, full_ov, full_qk, is_folded, ov, ov_affine, qk, qk_affine
from .rotary import positional_qk, qk_at_offset, rotary_spec


# ------------------------------------------------------------------------------------------ results

@dataclass(frozen=True, repr=False)      # the repr is _text (Result)
class Circuit(Result):
    """A circuit plus what made it: ``matrix`` (FactoredMatrix), ``kind``, ``head``, ``settings``, ``caveats``.

    ``exact`` is False when ``caveats`` lists a way the model's scores leave the bilinear form. The JSON
    holds the two factors A [d_left, d_mid] and B [d_mid, d_right] (never their product).
    """

    # not "qkcircuits.circuit": that names the file of `qkcircuits circuit --json` (a task's circuit over the graph)
    SCHEMA = "qkcircuits.head_circuit/1"
    WHAT = "a qkcircuits head-circuit JSON (QK/OV factors of one head)"
    KEYS = ("kind", "head", "A", "B")

    matrix: FactoredMatrix
    kind: str
    head: Head
    settings: Dict[str, object] = field(default_factory=dict)
    caveats: List[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return not self.caveats

    def top(self, k: int = 5) -> List[Tuple[int, float]]:
        """The ``k`` largest singular values of the circuit: ``(index, value)`` (from the factors only)."""
        S = self.matrix.S.flatten()
        return [(i, float(S[i])) for i in range(min(k, S.numel()))]

    def to_frame(self):
        """One row per singular value: index, value."""
        import pandas as pd

        return pd.DataFrame({"index": list(range(self.matrix.S.numel())), "singular_value": self.matrix.S.tolist()})

    def to_dict(self) -> Dict[str, object]:
        return {"kind": self.kind, "head": str(self.head), "dtype": str(self.matrix.A.dtype).replace("torch.", ""),
                "A": json_floats(self.matrix.A), "B": json_floats(self.matrix.B),      # exact for the dtype
                "settings": self.settings, "caveats": list(self.caveats)}

    @classmethod
    def _from_dict(cls, d: Dict[str, object]) -> "Circuit":
        dtype = getattr(torch, str(d.get("dtype", "float32")))       # files before the dtype was written: float32
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise QKCircuitsError(f"dtype {d.get('dtype')!r} is not a floating-point torch dtype")
        return cls(FactoredMatrix(read_floats(d["A"], dtype), read_floats(d["B"], dtype)), str(d["kind"]),
                   Head.parse(d["head"]),
                   dict(d.get("settings", {})), list(d.get("caveats", [])))

    def _shape(self) -> str:
        m = self.matrix
        return f"[{m.ldim}, {m.rdim}] = [{m.ldim}, {m.mdim}] @ [{m.mdim}, {m.rdim}]"

    def _text(self) -> str:
        return (f"Circuit({self.kind}, head {self.head}; {self._shape()}; "
                f"{'exact' if self.exact else 'caveats: ' + '; '.join(self.caveats)})")

    def _html(self) -> str:
        rows = [("kind", self.kind), ("head", str(self.head)), ("factored", self._shape())]
        rows += [(k, str(v)) for k, v in self.settings.items() if k != "versions"] + [("caveat", c) for c in self.caveats]
        return show.box(f"Circuit: {self.kind} of head {self.head}", show.table(rows))



KINDS = ("qk", "ov", "qk_affine", "ov_affine", "full_qk", "full_ov", "qk_offset", "pos_qk")


def circuit(model, head: HeadsLike, kind: str = "qk", *, offset: int = 0, normalize: bool = True,
            rotary_base: Optional[float] = None) -> Circuit:
    """Any circuit of one head as a ``Circuit`` (warns when the model leaves the bilinear form).

    ``kind``: qk, ov, qk_affine, ov_affine, full_qk, full_ov, qk_offset (rotary, ``offset`` = i − j),
    pos_qk (learned positions).
    """
    model, offset = check_model(model), check_integer("offset", offset)
    if kind not in KINDS:
        raise QKCircuitsError(f"unknown circuit kind {kind!r}; choose from {', '.join(KINDS)}")
    h = to_head(model, head)
    settings: Dict[str, object] = {"model": model_name(model), "fold_ln": is_folded(model),
                                   "attn_scale": attn_scale(model, h.layer), "convention": "row-vector (TL)"}
    # the QK-side functions below warn; the flag travels with the result
    caveats = circuit_caveats(model) if kind.startswith(("qk", "full_qk", "pos")) else []
    if kind in ("full_qk", "full_ov"):
        settings["normalize"] = normalize
    if kind == "qk_offset":
        spec = rotary_spec(model, base=rotary_base, layer=h.layer)
        settings.update(offset=int(offset), rotary=spec.describe())
        caveats = caveats + list(spec.caveats)
        mat = qk_at_offset(model, h, offset, spec=spec)
    elif kind == "pos_qk":
        mat = positional_qk(model, h)
    else:
        fn = {"qk": qk, "ov": ov, "qk_affine": qk_affine, "ov_affine": ov_affine}.get(kind)
        mat = fn(model, h) if fn else (full_qk if kind == "full_qk" else full_ov)(model, h, normalize)
    return Circuit(mat, kind, h, stamped(settings, model), caveats)
