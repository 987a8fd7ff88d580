"""The ungrouped graph's attention: k and v inputs per QUERY head under grouped-query attention.

>>> with per_query_kv(model, g):                      # doctest: +SKIP (needs a grouped-query model)
...     model.run_with_hooks(tokens, fwd_hooks=hooks)   # hooks return hook_k/hook_v as [b, p, n_heads, d_head]

With grouped-query attention query head h reads the keys and values of KV head h // group. The EAP-IG authors
and MIB count a k/v input per QUERY head (the reference's ``ungroup_grouped_query_attention``), so an edge
s → (h, k) patches only the keys query head h reads, and the other heads of its group keep theirs. A model's
own attention cannot hold different keys for two heads of one group, so inside ``per_query_kv`` every GQA
layer's attention takes k and v per query head: the hook_k/hook_v values the runs return are [b, p, H, e]
(``expand``: the model's own [b, p, G, e] repeated per query head, h → h // group, as transformers'
``repeat_kv`` lays them out) and the HF module's ``num_key_value_groups`` is 1 while the context is open, so the
bridge's attention (which reshapes hook_k with ``view(..., -1, d_head)`` and expands by that number) reads them
as they are. ``check`` runs it once per call on two rows: the expanded forward must give the model's own
logits (it does, bit for bit, on Llama, Gemma-2/3, SmolLM3, Cohere and MQA shapes); an attention that does
not read them so fails there with one line.

In the gradient run the expanded value carries the gradient hook, so each query head's key/value gradient
arrives separately: ∂m/∂x_{(h,k)} = VJP of head h's slice with W_K of KV head h // group. Their sum over a
group is the grouped input's gradient (the expansion's backward sums the copies), so the ungrouped EAP k/v
scores of a group's query heads add up to its grouped score.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import Tensor

from .._foundation.errors import QKCircuitsError
from .graph import Graph


def expand(t: Tensor, group: int) -> Tensor:
    """A hook_k/hook_v value [b, p, G, e] as one per query head [b, p, G·group, e] (head h reads G = h // group)."""
    return t.repeat_interleave(group, dim=2)


def _modules(model, g: Graph):
    """Each layer's HF attention module (the one whose ``num_key_value_groups`` the bridge reads)."""
    out = []
    for L in range(g.n_layers):
        attn = model.blocks[L].attn
        hf = getattr(attn, "original_component", None)
        if hf is None or getattr(hf, "num_key_value_groups", None) != g.group:
            raise QKCircuitsError(f"layer {L}'s attention ({type(attn).__name__}) does not expose transformers' "
                                  f"num_key_value_groups = {g.group}: the ungrouped graph (k/v inputs per query "
                                  f"head) cannot run on it; use gqa='grouped'")
        out.append(hf)
    return out


@contextmanager
def per_query_kv(model, g: Graph) -> Iterator[None]:
    """While open (an ungrouped graph on a GQA model), every layer's attention reads hook_k/hook_v per query
    head (module docstring). A no-op for a grouped graph. Restores the modules on exit (also on error)."""
    if not g.ungrouped:
        yield
        return
    mods = _modules(model, g)
    try:
        for hf in mods:
            hf.num_key_value_groups = 1
        yield
    finally:
        for hf in mods:
            hf.num_key_value_groups = g.group


def check(model, g: Graph, tokens: Tensor, rows: int = 2) -> None:
    """The expanded forward gives the model's own logits on ``tokens[:rows]`` (raises one line otherwise)."""
    if not g.ungrouped:
        return
    toks = tokens[:rows]

    def widen(t: Tensor, hook) -> Tensor:
        return expand(t, g.group)

    hooks = [(f"blocks.{L}.attn.hook_{x}", widen) for L in range(g.n_layers) for x in ("k", "v")]
    with torch.no_grad():
        own = model(toks)
        try:
            with per_query_kv(model, g):
                got = model.run_with_hooks(toks, fwd_hooks=hooks)
        except (RuntimeError, ValueError) as e:
            raise QKCircuitsError(f"this model's attention does not take k/v per query head ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0][:120]}); use gqa='grouped'") from None
    own = own.logits if hasattr(own, "logits") else own
    got = got.logits if hasattr(got, "logits") else got
    scale = float(own.abs().max()) + 1.0
    eps = float(torch.finfo(own.dtype).eps)
    if got.shape != own.shape or float((got - own).abs().max()) > max(1e-5, 64 * eps) * scale:
        raise QKCircuitsError("with k/v expanded per query head this model's attention does not reproduce its own "
                              "logits; the ungrouped graph cannot run on it, use gqa='grouped'")
