"""Check the circuit math against the model itself: ``qk.verify_circuits(model, tokens=None)``.

>>> check = qk.verify_circuits(model, tokens)
>>> check.passed, check.max_error < 1e-4
(True, True)
>>> list(check.to_frame().columns)
['head', 'layer', 'qk_error', 'ov_error', 'score_source', 'output_source']

Per head h of layer L, on real inputs x (the rows W_Q/W_K/W_V read, ``attn_input_hook``):

- QK: the factored score ŝ_ij = scale · q̃_i R(i−j) k̃_jᵀ (soft-capped where the model caps) with
  q̃ = x_i W_Q^h + b_Q, k̃ = x_j W_K^h + b_K from the layer's weights (``layer_weights``: the per-head factors of
  ``qk``/``qk_at_offset``), R from ``rotary_spec``, the score scale from the module; input-dependent norms evaluated
  at x: QK-norm (Gemma 3: the model's own q_norm/k_norm on q̃, k̃) and MLA's latent RMS scales 1/r_q(i), 1/r_kv(j)
  on the query and the content key (the adapter's ``qk_at(x)``). Compared with the model's own ``hook_attn_scores`` on every unmasked causal pair
  (``hook_pattern`` vs softmax(ŝ) where the bridge passes the pattern there, as TL-native models do).
- OV: the head's factored write o_i = Σ_j A_ij ([x_j, 1] · OV_affine^h) (MLA: (x_j W_DKV γ_kv / r_kv(j)) ·
  W_UV^h W_O^h, the ``ov`` factors through the latent: the adapter's ``writes_at(x, h)``) with A the model's own
  pattern, compared with the head's own output: the model's output projection module applied to its own z with
  every other head zeroed.

Errors are relative: max |factored − model| / max |model| over the head's entries. ``passed``: every error
≤ ``tolerance`` (1e-4 in float32/64; 4 × the dtype's epsilon in bf16/fp16, whose rounding the model's own scores
carry). Memory: one layer's activations at a time ([batch, head, pos, pos] scores).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from jaxtyping import Float
from torch import Tensor

from .._foundation.arch import adapter, architecture
from .._foundation.capture import as_tokens
from .._foundation.io import json_floats, json_number, read_floats
from .._foundation.model import model_name
from .._foundation.result import Result, stamped
from .qk_ov import attn_input_hook
from .rotary import rotary_spec, rotation

TOLERANCE = 1e-4
SCHEMA = "qkcircuits.circuit_check/1"


@dataclass(frozen=True, repr=False)      # the repr is _text (Result)
class CircuitCheck(Result):
    """``qk_error`` / ``ov_error`` [layer, head] relative errors; ``score_source`` / ``output_source`` say what
    the factored forms were compared with; ``settings`` (model, architecture, tokens, tolerance, versions)."""

    SCHEMA = SCHEMA
    WHAT = "a circuit check JSON (qk.verify_circuits(...).to_json())"
    KEYS = ("qk_error", "ov_error", "score_source", "output_source", "tolerance")

    qk_error: Float[Tensor, "layer head"]
    ov_error: Float[Tensor, "layer head"]
    score_source: Dict[int, str]
    output_source: Dict[int, str]
    tolerance: float = TOLERANCE
    settings: Dict[str, object] = field(default_factory=dict)

    @property
    def max_error(self) -> float:
        return float(torch.maximum(self.qk_error, self.ov_error).max())

    @property
    def passed(self) -> bool:
        return bool(torch.isfinite(self.qk_error).all() and torch.isfinite(self.ov_error).all()
                    and self.max_error <= self.tolerance)

    def to_frame(self):
        import pandas as pd

        L, H = self.qk_error.shape
        return pd.DataFrame([{"head": f"{layer}.{h}", "layer": layer, "qk_error": float(self.qk_error[layer, h]),
                              "ov_error": float(self.ov_error[layer, h]), "score_source": self.score_source[layer],
                              "output_source": self.output_source[layer]} for layer in range(L) for h in range(H)])

    def worst(self, k: int = 5):
        """The ``k`` heads with the largest error (either circuit), as a frame (an ``error`` column added)."""
        df = self.to_frame()
        return df.assign(error=df[["qk_error", "ov_error"]].max(axis=1)).nlargest(int(k), "error")

    def top(self, k: int = 5) -> List[Tuple[str, float]]:
        """The ``k`` heads with the largest error (either circuit): ``("L.H", error)``, largest first."""
        return [(str(r["head"]), float(r["error"])) for _, r in self.worst(k).iterrows()]

    def to_dict(self) -> Dict[str, object]:
        # exact: the errors are ~1e-7 (6 decimals would make them 0); NaN as null
        return {"schema": SCHEMA, "passed": self.passed, "max_error": json_number(self.max_error),
                "tolerance": self.tolerance, "qk_error": json_floats(self.qk_error),
                "ov_error": json_floats(self.ov_error),
                "score_source": {str(k): v for k, v in self.score_source.items()},
                "output_source": {str(k): v for k, v in self.output_source.items()}, "settings": self.settings}

    @classmethod
    def _from_dict(cls, d: Dict[str, object]) -> "CircuitCheck":
        grid = read_floats

        return cls(grid(d["qk_error"]), grid(d["ov_error"]), {int(k): str(v) for k, v in d["score_source"].items()},
                   {int(k): str(v) for k, v in d["output_source"].items()}, float(d["tolerance"]),
                   dict(d.get("settings", {})))

    def _text(self) -> str:
        worst = self.worst(1).iloc[0]
        return (f"CircuitCheck({self.settings.get('model')}, {self.settings.get('architecture')}: "
                f"{'PASSED' if self.passed else 'FAILED'} at {self.tolerance:g}; max relative error "
                f"{self.max_error:.2e} (head {worst['head']}))")

    def _html(self) -> str:
        import html

        return f"<pre>{html.escape(self._text())}</pre>" + self.worst(10).to_html(index=False)



def verify_circuits(model, tokens=None, *, tolerance: Optional[float] = None) -> CircuitCheck:
    """Compare every head's factored QK and OV at real inputs with the model's own scores and head outputs.

    ``tokens``: [batch, pos] ids (default: 2 rows of a repeated random segment, ``repeated_tokens(seg_len=8)``).
    Works on every architecture with an adapter (standard, GQA/MQA, rotary, QK-norm, soft-cap, windows, MLA).
    ``tolerance`` (relative): default ``TOLERANCE`` (1e-4) for float32/64 weights, and 4 × the dtype's epsilon for
    half precision (bf16: 0.031), whose own rounding a model's scores carry (a wrong circuit errs by ~1).
    """
    if tolerance is None:
        dtype = model.W_E.dtype
        tolerance = TOLERANCE if dtype in (torch.float32, torch.float64) else max(TOLERANCE, 4 * torch.finfo(dtype).eps)
    if tokens is None:
        from .._foundation.sequences import repeated_tokens

        seg = max(2, min(8, (int(model.cfg.n_ctx) - 1) // 2))
        tokens = repeated_tokens(model, n_seqs=2, seg_len=seg, seed=0)
    toks = as_tokens(model, tokens)
    L, H = int(model.cfg.n_layers), int(model.cfg.n_heads)
    qk_err, ov_err = torch.full((L, H), float("nan")), torch.full((L, H), float("nan"))
    s_src: Dict[int, str] = {}
    o_src: Dict[int, str] = {}
    for layer in range(L):
        got = _layer_run(model, toks, layer)
        qk_err[layer], s_src[layer] = _qk_errors(model, layer, got)
        ov_err[layer], o_src[layer] = _ov_errors(model, layer, got)
    settings = {"model": model_name(model), "architecture": architecture(model), "family": adapter(model, 0).family,
                "tokens": list(toks.shape), "tolerance": tolerance}       # + versions (Result.__post_init__)
    return CircuitCheck(qk_err, ov_err, s_src, o_src, float(tolerance), stamped(settings, model))


def _layer_run(model, toks: Tensor, layer: int) -> Dict[str, Tensor]:
    names = {"x": attn_input_hook(model, layer), "scores": f"blocks.{layer}.attn.hook_attn_scores",
             "pattern": f"blocks.{layer}.attn.hook_pattern", "z": f"blocks.{layer}.attn.hook_z"}
    if names["x"] not in model.hook_dict:
        names["x"] = f"blocks.{layer}.hook_resid_pre"       # attention-only models without a norm
    wanted = set(names.values())
    with torch.no_grad():
        _, cache = model.run_with_cache(toks, names_filter=lambda n: n in wanted, stop_at_layer=layer + 1)
    return {k: cache[v].detach() for k, v in names.items() if v in cache}


def _relative(a: Tensor, b: Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _qk_errors(model, layer: int, got: Dict[str, Tensor]):
    att = adapter(model, layer)
    b, p = got["x"].shape[:2]
    q, k = att.qk_at(got["x"])              # x W + b per head, the norms after the projection evaluated at x
    from .._foundation.capture import has_rotary

    if has_rotary(model):
        spec = rotary_spec(model, layer=layer)
        R = rotation(spec, range(p), relative=True).double()                     # [Δ, d, d]
        i, j = torch.tril_indices(p, p)
        s = torch.einsum("bhnd,nde,bhne->bhn", q[:, :, i], R[i - j], k[:, :, j])
        S = torch.full((b, q.shape[1], p, p), float("nan"), dtype=torch.float64)
        S[:, :, i, j] = s
    else:
        S = torch.einsum("bhqd,bhkd->bhqk", q, k)
    factor, _, cap = att.scale()
    S = S * factor
    if cap:
        S = cap * torch.tanh(S / cap)
    causal = torch.ones(p, p, dtype=torch.bool).tril()
    real = got.get("scores")
    pattern = got["pattern"].double()
    if real is not None and not _is_pattern(real):
        real = real.double()
        keep = causal & (real > -1e30)            # masked (future, outside a window) entries are not scores
        errs = [_relative(S[:, h][keep[:, h]], real[:, h][keep[:, h]]) for h in range(S.shape[1])]
        return torch.tensor(errs), "hook_attn_scores"
    # the bridge passes the pattern as scores: compare softmax(ŝ) with the pattern instead
    win = att.window()
    mask = causal if win is None else causal & ~torch.ones(p, p, dtype=torch.bool).tril(-win)
    S = S.masked_fill(~mask, float("-inf")).nan_to_num(nan=float("-inf"))
    A = S.softmax(-1)
    return torch.tensor([_relative(A[:, h], pattern[:, h]) for h in range(S.shape[1])]), "hook_pattern (softmax)"


def _is_pattern(t: Tensor) -> bool:
    future = torch.ones(t.shape[-2:], dtype=torch.bool, device=t.device).triu(1)
    return bool((t >= 0).all() and (t[..., future] == 0).all())


def _ov_errors(model, layer: int, got: Dict[str, Tensor]):
    att = adapter(model, layer)
    H = att.n_heads
    A = got["pattern"].double()                                                   # [b, H, q, k]
    x = got["x"]
    z = got["z"]                                                                  # [b, p, H, d_v]
    out_mod = _output_module(att)
    errs = []
    for h in range(H):
        vals = att.writes_at(x, h)                      # [b, p, d_model]; MLA: the KV latent's norm at x
        mine = torch.einsum("bqk,bkm->bqm", A[:, h], vals)
        zh = torch.zeros_like(z)
        zh[:, :, h] = z[:, :, h]
        with torch.no_grad():
            if out_mod is not None:
                flat = zh.reshape(*zh.shape[:2], -1)
                theirs = (out_mod(flat) - out_mod(torch.zeros_like(flat))).double()
            else:
                theirs = (z[:, :, h].double() @ att.W_O()[h].double())
        errs.append(_relative(mine, theirs))
    return torch.tensor(errs), ("the output projection module on the head's own z" if out_mod is not None
                                else "the head's own z · W_O (TL-native: no separate output module)")


def _output_module(att) -> Optional[torch.nn.Module]:
    return att.output_module()
