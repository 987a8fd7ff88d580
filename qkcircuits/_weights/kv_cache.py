"""What the model's attention keeps per token: ``qk.kv_cache(model)`` against its multi-head equivalent.

>>> c = qk.kv_cache(model)
>>> c.per_layer_bytes == [2 * 2 * 129 * 4] * 2, c.ratio     # toy: 2 heads × (K + V) × d_head 129, fp32
(True, 1.0)
>>> c.summary()
'KV cache: 2,064 B per token per layer (MHA), 1.00x of multi-head attention (2,064 B), fp32'

Per layer and token, in the model's dtype: multi-head / grouped-query / multi-query attention caches K and V
of each KV head, 2 · n_kv · d_head values; multi-head latent attention caches the KV latent and the shared
rotary key, kv_lora_rank + d_rope values (K and V are rebuilt from the latent). The multi-head equivalent keeps
K and V of every query head: 2 · n_heads · d_head (MLA: n_heads · (d_qk + d_v)).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import torch

from .._foundation.arch import adapter, architecture
from .._foundation.model import model_name
from .._foundation.result import Result, stamped


@dataclass(frozen=True, repr=False)      # the repr is _text (Result)
class KVCache(Result):
    """``per_layer_bytes`` / ``mha_bytes`` [layer] per token; ``kind`` MHA, GQA (n of m), MQA or MLA; ``ratio``."""

    SCHEMA = "qkcircuits.kv_cache/1"
    WHAT = "a KV-cache JSON (qk.kv_cache(model).to_json())"
    KEYS = ("kind", "per_layer_bytes", "mha_bytes", "dtype")

    kind: str
    per_layer_bytes: List[int]
    mha_bytes: List[int]
    dtype: str
    settings: Dict[str, object] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return sum(self.per_layer_bytes) / max(1, sum(self.mha_bytes))

    @property
    def total_bytes(self) -> int:
        """Per token, all layers."""
        return int(sum(self.per_layer_bytes))

    def summary(self) -> str:
        """One line for headers: bytes per token per layer, the kind, the share of multi-head attention."""
        per, mha = self.per_layer_bytes[0], self.mha_bytes[0]
        same = all(b == per for b in self.per_layer_bytes)
        return (f"KV cache: {_b(per)}{'' if same else ' (layer 0)'} per token per layer ({self.kind}), "
                f"{self.ratio:.2f}x of multi-head attention ({_b(mha)}), {self.dtype}")

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame({"layer": range(len(self.per_layer_bytes)), "bytes": self.per_layer_bytes,
                             "mha_bytes": self.mha_bytes})

    def to_dict(self) -> Dict[str, object]:
        return {"schema": self.SCHEMA, "kind": self.kind, "per_layer_bytes": self.per_layer_bytes,
                "mha_bytes": self.mha_bytes, "ratio": self.ratio, "dtype": self.dtype, "settings": self.settings}

    @classmethod
    def _from_dict(cls, d: Dict[str, object]) -> "KVCache":
        return cls(str(d["kind"]), [int(b) for b in d["per_layer_bytes"]], [int(b) for b in d["mha_bytes"]],
                   str(d["dtype"]), dict(d.get("settings", {})))

    def top(self, k: int = 5) -> List[Tuple[int, int]]:
        """The ``k`` layers that cache the most bytes per token: ``(layer, bytes)``, largest first."""
        order = sorted(range(len(self.per_layer_bytes)), key=lambda i: (-self.per_layer_bytes[i], i))
        return [(i, self.per_layer_bytes[i]) for i in order[:k]]

    def _text(self) -> str:
        return self.summary()

    def _html(self) -> str:
        import html

        return f"<pre>{html.escape(self.summary())}</pre>"



def _b(n: int) -> str:
    return f"{n:,} B" if n < 10_000 else f"{n / 1024:,.1f} KiB"


def kv_cache(model) -> KVCache:
    """Bytes per token per layer the model's attention caches, against multi-head attention (weights only)."""
    dt = model.W_E.dtype
    size = torch.empty((), dtype=dt).element_size()
    per, mha, kinds = [], [], set()
    for layer in range(int(model.cfg.n_layers)):
        att = adapter(model, layer)
        mine, full = att.kv_floats()
        per.append(mine * size)
        mha.append(full * size)
        kinds.add(att.kv_kind())
    names = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}
    return KVCache(", ".join(sorted(kinds)), per, mha, names.get(dt, str(dt)),
                   stamped({"model": model_name(model), "architecture": architecture(model)}, model))
