"""Q-, K- and V-composition between every earlier head's OV and every later head, random baseline removed.

>>> comp = composition_scores(model, "K")
>>> comp.scores.shape                              # [L, H, L, H]: [earlier layer, head, later layer, head]
torch.Size([2, 2, 2, 2])
>>> {str(r): [(str(h), round(v, 2)) for h, v in p] for r, p in k_composition_partners(model, ["1.0"]).items()}
{'1.0': [('0.0', 0.11)]}

Score (Elhage et al. 2021): ‖W_OV · W_X‖_F / (‖W_OV‖_F ‖W_X‖_F) with, in TL's row-vector form,
W_X = QK (Q-composition: the earlier head writes what the later head's query reads),
QKᵀ (K-composition: ... its key reads) or OV (V-composition). ``scores`` subtract ``baseline``,
the mean of that ratio for Gaussian random factors of the same shapes (one number per
(d_model, d_head): every head pair has the same shapes), estimated by Monte Carlo with a fixed
seed. Pairs that are not earlier → later are NaN.

Computed on the d_head side: ‖A B C D‖_F² = tr(AᵀA · BC · DDᵀ · (BC)ᵀ), so every pair costs one
[d_head, d_model] × [d_model, d_head] product plus d_head³ work. Memory: every head's W_O and
right factor (float32, 2 · L·H · d_head · d_model) and Gram matrices, plus ~3 · 8 · n_heads · d_head²
doubles per block of 8 earlier heads; the [L, H, L, H] result.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from jaxtyping import Float
from torch import Tensor

from .._foundation import display as show
from .._foundation.result import Result, stamped
from .._foundation.errors import QKCircuitsError
from .._foundation.heads import Head, HeadsLike, model_heads
from .._foundation.io import json_floats, read_float, read_floats
from .._foundation.model import model_name
from .._foundation.arch import adapter
from .qk_ov import is_folded, layer_weights, warn_caveats

MODES = ("Q", "K", "V")


@dataclass(frozen=True, repr=False)      # the repr is _text (Result)
class CompositionScores(Result):
    """``scores`` = ``raw`` − ``baseline`` [L, H, L, H] (earlier, later; NaN where not earlier → later)."""

    SCHEMA = "qkcircuits.composition_scores/1"
    WHAT = "a qkcircuits composition-scores JSON"
    KEYS = ("mode", "baseline", "scores", "raw")

    mode: str
    scores: Tensor
    raw: Tensor
    baseline: float
    settings: Dict[str, object] = field(default_factory=dict)

    def partners(self, head: Head, k: int = 3, min_score: float = 0.0) -> List[Tuple[Head, float]]:
        """The earlier heads ``head`` composes with most (above ``min_score``), strongest first."""
        col = self.scores[:, :, head.layer, head.head].flatten()
        order = torch.argsort(torch.nan_to_num(col, nan=float("-inf")), descending=True)
        H = self.scores.shape[1]
        out = []
        for i in order[:k].tolist():
            v = float(col[i])
            if v == v and v > min_score:
                out.append((Head(i // H, i % H), v))
        return out

    def top(self, k: int = 5) -> List[Tuple[Tuple[Head, Head], float]]:
        """The ``k`` strongest (earlier, later) pairs, strongest first (NaN pairs never)."""
        L, H = self.scores.shape[0], self.scores.shape[1]
        flat = torch.nan_to_num(self.scores.flatten(), nan=-math.inf)
        out = []
        for i in flat.topk(min(k, flat.numel())).indices.tolist():
            a, b = divmod(i, L * H)
            if math.isfinite(float(flat[i])):
                out.append(((Head(a // H, a % H), Head(b // H, b % H)), float(flat[i])))
        return out

    def to_frame(self):
        """One row per (earlier, later) pair that is earlier → later: both heads, score, raw ratio."""
        import pandas as pd

        L, H = self.scores.shape[0], self.scores.shape[1]
        ok = (~self.scores.isnan()).nonzero().tolist()
        return pd.DataFrame([{"earlier": str(Head(a, b)), "later": str(Head(c, d)),
                              "score": float(self.scores[a, b, c, d]), "raw": float(self.raw[a, b, c, d])}
                             for a, b, c, d in ok], columns=["earlier", "later", "score", "raw"])

    def to_dict(self) -> Dict[str, object]:
        return {"mode": self.mode, "baseline": self.baseline, "settings": self.settings,
                "scores": json_floats(self.scores), "raw": json_floats(self.raw)}       # exact, NaN as null

    def to_json(self, path=None, indent: Optional[int] = None) -> str:
        """As ``Result.to_json``; compact by default ([L, H, L, H] twice is the biggest result)."""
        return super().to_json(path, indent)

    @classmethod
    def _from_dict(cls, d: Dict[str, object]) -> "CompositionScores":
        return cls(d["mode"], read_floats(d["scores"]), read_floats(d["raw"]), read_float(d["baseline"]),
                   d.get("settings", {}))

    def _text(self) -> str:
        L, H = self.scores.shape[0], self.scores.shape[1]
        pairs = [(f"{a} → {b}", v) for (a, b), v in self.top(show.TOP)]
        return (f"CompositionScores({self.mode}: {L} layers x {H} heads; baseline {show.number(self.baseline)} "
                f"subtracted; strongest: " + ", ".join(f"{p} {show.number(v, 3)}" for p, v in pairs[:3]) + ")")

    def _html(self) -> str:
        pairs = [(f"{a} → {b}", v) for (a, b), v in self.top(show.TOP)]
        best = torch.nan_to_num(self.scores, nan=-math.inf).flatten(0, 1).amax(0)   # [L, H]: best earlier partner
        best[best == -math.inf] = math.nan
        return show.box(f"CompositionScores: {self.mode}-composition (random baseline "
                        f"{show.number(self.baseline)} subtracted)",
                        show.table([(p, show.number(v)) for p, v in pairs], ("earlier → later", "score")),
                        show.grid(best, "each head's strongest earlier partner"))


def _left_cores(W_V: Tensor, W_O: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """OV = W_V W_O → (Gram W_Vᵀ W_V [.., d_head, d_head], W_O, ‖OV‖_F)."""
    G = W_V.transpose(-1, -2) @ W_V
    return G, W_O, ((G @ W_O) * W_O).sum((-1, -2)).clamp_min(0).sqrt()


def _right_cores(C: Tensor, D: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """X = C D ([d_model, d_head] × [d_head, d_model]) → (C, Gram D Dᵀ, ‖X‖_F)."""
    G = D @ D.transpose(-1, -2)
    return C, G, ((C @ G) * C).sum((-1, -2)).clamp_min(0).sqrt()


def _right_factors(w, mode: str) -> Tuple[Tensor, Tensor]:
    if mode == "Q":
        return w.W_Q, w.W_K.transpose(-1, -2)          # QK   = W_Q · W_Kᵀ
    if mode == "K":
        return w.W_K, w.W_Q.transpose(-1, -2)          # QKᵀ  = W_K · W_Qᵀ
    return w.W_V, w.W_O                                # OV


def _ratio(left, right, block: int = 8) -> Tensor:
    """[N] left and [M] right heads → [N, M] of ‖OV·X‖_F / (‖OV‖_F ‖X‖_F); 0 where a norm is 0.

    ‖A B C D‖_F² = Σ (G_A·Y·G_D) ⊙ Y with Y = B C [d_head, d_head], G_A = AᵀA, G_D = D Dᵀ: no QR and
    nothing of size d_model² (batched QR was ~50× slower on a shared CPU). Left heads go ``block`` at
    a time, in float64: memory 3 · block · M · d_head² doubles.
    """
    GA, B, ln = left
    C, GD, rn = (t.double() for t in right)
    num = torch.empty(B.shape[0], C.shape[0], dtype=torch.float64, device=C.device)
    for s in range(0, B.shape[0], block):
        Y = torch.einsum("nij,mjk->nmik", B[s:s + block].double(), C)              # [n, M, d_head, d_head]
        T = GA[s:s + block, None].double() @ Y @ GD[None]
        num[s:s + block] = (T * Y).sum((-1, -2)).clamp_min(0).sqrt()
    den = ln[:, None].double() * rn[None, :]
    return torch.where(den > 0, num / den.clamp_min(1e-30), torch.zeros_like(num)).cpu()


@functools.lru_cache(maxsize=16)
def composition_baseline(d_model: int, d_head: int, n_samples: int = 200, seed: int = 0) -> float:
    """Mean composition ratio of independent Gaussian factors of these shapes (Monte Carlo, ``seed``).

    The ratio is invariant to the factors' scale and the same for Q, K and V composition shapes.
    Deterministic, so cached. Memory: 8 samples at a time (4 · 8 · d_model · d_head doubles).
    """
    g = torch.Generator().manual_seed(int(seed))
    total = 0.0
    for s in range(0, int(n_samples), 8):
        n = min(8, int(n_samples) - s)

        def rnd(*shape):
            return torch.randn(*shape, generator=g, dtype=torch.float64)
        GA, B, ln = _left_cores(rnd(n, d_model, d_head), rnd(n, d_head, d_model))
        C, GD, rn = _right_cores(rnd(n, d_model, d_head), rnd(n, d_head, d_model))
        Y = B @ C                                # pair sample i with sample i: independent draws
        total += float((((GA @ Y @ GD) * Y).sum((-1, -2)).sqrt() / (ln * rn)).sum())
    return total / int(n_samples)


def composition_scores(model, mode: str = "K", *, baseline: bool = True, n_samples: int = 200, seed: int = 0
                       ) -> CompositionScores:
    """``mode``-composition [L, H, L, H] of every earlier head's OV with every later head (see module docs).

    Memory: all layers' d_head-side cores ([L·H, d_head, d_model] twice) plus one later layer's
    [earlier heads, n_heads, d_head, d_head] products.
    """
    mode = str(mode).upper()
    if mode not in MODES:
        raise QKCircuitsError(f"composition mode must be one of Q, K, V; got {mode!r}")
    L, H = model.cfg.n_layers, model.cfg.n_heads
    lefts, rights = [], []
    with torch.no_grad():
        for layer in range(L):
            w = layer_weights(model, layer)
            # Gram matrices and norms in float64; the [.., d_model] factors stay float32 until used
            GA, _, ln = _left_cores(w.W_V.double(), w.W_O.double())
            lefts.append((GA, w.W_O, ln))
            C, D = _right_factors(w, mode)
            _, GD, rn = _right_cores(C.double(), D.double())
            rights.append((C, GD, rn))
        raw = torch.full((L, H, L, H), float("nan"), dtype=torch.float64)
        for later in range(1, L):
            left = tuple(torch.cat([lf[i] for lf in lefts[:later]]) for i in range(3))
            raw[:later, :, later, :] = _ratio(left, rights[later]).reshape(later, H, H)
    base = composition_baseline(int(model.cfg.d_model), adapter(model, 0).d_qk, n_samples, seed) if baseline else 0.0
    caveats = warn_caveats(model, f"{mode}-composition with the QK circuit") if mode in ("Q", "K") else []
    settings = {"model": model_name(model), "fold_ln": is_folded(model), "caveats": caveats,
                "baseline_samples": n_samples if baseline else 0, "seed": seed,
                "convention": "scores[earlier layer, earlier head, later layer, later head]"}
    return CompositionScores(mode, (raw - base).float(), raw.float(), base, stamped(settings, model))


def composition_column(model, head: HeadsLike, mode: str = "K", *, baseline: bool = True, n_samples: int = 200,
                       seed: int = 0) -> Float[Tensor, "layer head"]:
    """One later head's ``mode``-composition with every earlier head: [head.layer, n_heads], baseline subtracted.

    The same numbers as ``composition_scores(...).scores[:head.layer, :, layer, head]`` at a fraction of the cost.
    """
    mode = str(mode).upper()
    if mode not in MODES:
        raise QKCircuitsError(f"composition mode must be one of Q, K, V; got {mode!r}")
    h = model_heads(model, head)[0]
    H = model.cfg.n_heads
    with torch.no_grad():
        w = layer_weights(model, h.layer)
        C, D = _right_factors(w, mode)
        right = _right_cores(C[h.head:h.head + 1].double(), D[h.head:h.head + 1].double())
        lefts = []
        for lw in (layer_weights(model, l) for l in range(h.layer)):
            GA, _, ln = _left_cores(lw.W_V.double(), lw.W_O.double())
            lefts.append((GA, lw.W_O, ln))
        if not lefts:
            return torch.zeros(0, H)
        left = tuple(torch.cat([lf[i] for lf in lefts]) for i in range(3))
        raw = _ratio(left, right)[:, 0].reshape(h.layer, H)
    base = composition_baseline(int(model.cfg.d_model), adapter(model, 0).d_qk, n_samples, seed) if baseline else 0.0
    return (raw - base).float()


def k_composition_partners(model, heads: HeadsLike, k: int = 3, min_score: float = 0.0,
                           scores: Optional[CompositionScores] = None) -> Dict[Head, List[Tuple[Head, float]]]:
    """For each head in ``heads`` (e.g. the induction heads a scan found), the earlier heads whose OV
    its key side reads most: up to ``k`` (head, baseline-subtracted K-composition) above ``min_score``.

    Without ``scores`` only the needed columns are computed (``composition_column``)."""
    heads = model_heads(model, heads)
    if scores is not None and scores.mode != "K":
        raise QKCircuitsError(f"k_composition_partners needs K-composition scores, got mode {scores.mode!r}")
    out: Dict[Head, List[Tuple[Head, float]]] = {}
    H = model.cfg.n_heads
    for h in heads:
        col = scores.scores[:h.layer, :, h.layer, h.head] if scores is not None else composition_column(model, h, "K")
        flat = col.flatten()
        order = torch.argsort(flat, descending=True)[:k].tolist()
        out[h] = [(Head(i // H, i % H), float(flat[i])) for i in order if float(flat[i]) > min_score]
    return out
