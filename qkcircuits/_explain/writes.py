"""The residual stream entering a layer, split into what each upstream component wrote into it: one forward.

>>> w = capture_writes(model, tokens, layers=[1])       # the hand-built toy, tokens [2, 11]
>>> w.names(1)                                          # layer 1's sources, in the order the forward makes them
['emb', 'pos', '0.0', '0.1', 'bias']
>>> bool(torch.allclose(w.total(1), w.resid[1].double()))   # the parts add up to hook_resid_pre exactly
True

Sources (what QK attribution decomposes a score into): ``emb`` (the token embedding, with Gemma's √d_model scale:
the residual entering block 0 minus ``pos``), ``pos`` (learned absolute positions: ``hook_pos_embed``, only where
the model has them), each earlier head ``"l.h"`` (its z_h W_O[h]; under a post-attention norm — Gemma — its share
of the normed layer output, z_h W_O[h] ⊙ w / rms(y) with this run's rms, where y is the layer's attention
output), each earlier MLP ``"mlpl"`` (``hook_mlp_out``), and ``bias``: what is left, the output biases (b_O, a
post-norm's β), which must be the same at every position of every prompt (``bias_spread`` says how far it is).

MLP 0 is split in two (``split_mlp0``, default): ``mlp0[token]``, what MLP 0 writes when attention 0 writes
nothing (block 0 run again with ``hook_attn_out`` zeroed: MLP 0 of the position's own embedding, a function of the
token — and of the position where positions are learned), and ``mlp0[context]``, the rest (what attention 0's
mixing of earlier tokens changed). Together with ``emb`` they tell the token-identity path (ARENA's "effective
embedding", W_E plus MLP0 on it) from context. In a parallel block MLP 0 never reads attention 0, so
``mlp0[context]`` is 0.

Memory: each earlier layer's z [b, p, heads, d_head] and MLP output [b, p, d_model], each target layer's residual
and pattern; with ``expand=True`` also every earlier layer's pattern [b, heads, p, p] and values. Never one residual
copy per source: heads are projected from z (see ``attend``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from jaxtyping import Float
from torch import Tensor

from .._foundation.arch import adapter
from .._foundation.arch.model_facts import has_mlps
from .._foundation.arch.norms import Norm
from .._foundation.capture import _Stop
from .._foundation.errors import QKCircuitsError


@dataclass
class Writes:
    """One run's upstream writes (module docstring). Per earlier layer l: ``z[l]`` [b, p, H, e], ``post[l]`` (None,
    or (Norm, 1/rms(y) [b, p, 1])), ``mlp[l]`` [b, p, d]; ``emb``/``pos`` [b, p, d]. Per target layer L:
    ``resid[L]`` [b, p, d] (its hook_resid_pre), ``pattern[L]`` [b, H, p, p] and ``scores[L]`` (the layer's own
    hook_attn_scores, or None where the bridge passes the pattern there); ``patterns[l]``/``values[l]`` with expand."""

    tokens: Tensor
    emb: Tensor
    pos: Optional[Tensor]
    resid: Dict[int, Tensor]
    pattern: Dict[int, Tensor]
    scores: Dict[int, Optional[Tensor]]
    z: Dict[int, Tensor] = field(default_factory=dict)
    post: Dict[int, Optional[Tuple[Norm, Tensor]]] = field(default_factory=dict)
    mlp: Dict[int, Tensor] = field(default_factory=dict)
    patterns: Dict[int, Tensor] = field(default_factory=dict)
    values: Dict[int, Tensor] = field(default_factory=dict)
    W_O: Dict[int, Tensor] = field(default_factory=dict)
    mlp0_token: Optional[Tensor] = None

    def head_blocks(self, layer: int) -> Iterator[Tuple[int, List[str]]]:
        """(l, ["l.0", "l.1", ...]) for every layer before ``layer``."""
        for l in sorted(x for x in self.z if x < layer):
            yield l, [f"{l}.{h}" for h in range(self.z[l].shape[2])]

    def names(self, layer: int) -> List[str]:
        """The sources of ``layer``'s input, in the order the forward computes them."""
        out = ["emb"] + (["pos"] if self.pos is not None else [])
        for l, heads in self.head_blocks(layer):
            out += heads + [name for name, _ in self.mlp_parts(l)]
        return out + ["bias"]

    def mlp_parts(self, l: int) -> List[Tuple[str, Tensor]]:
        """MLP ``l``'s write as (name, [b, p, d]) parts: one, or MLP 0's token and context parts."""
        if l not in self.mlp:
            return []
        if l == 0 and self.mlp0_token is not None:
            return [("mlp0[token]", self.mlp0_token), ("mlp0[context]", self.mlp[0] - self.mlp0_token)]
        return [(f"mlp{l}", self.mlp[l])]

    def head_out_map(self, l: int) -> Tensor:
        """W_O of layer ``l`` as the heads write into the residual [H, e, d] (a post-norm's weight and centring
        applied; its 1/rms(y) is per position: ``post_scale``), float64."""
        W = self.W_O[l].double()
        post = self.post.get(l)
        return W if post is None else post[0].linear(W)

    def post_scale(self, l: int) -> Optional[Tensor]:
        post = self.post.get(l)
        return None if post is None else post[1]

    def head_writes(self, l: int) -> Float[Tensor, "H b p d"]:
        """Each head's write of layer ``l`` into the residual (float64), [H, b, p, d_model]."""
        out = torch.einsum("bphe,hed->hbpd", self.z[l].double(), self.head_out_map(l))
        s = self.post_scale(l)
        return out if s is None else out * s

    def total(self, layer: int, with_bias: bool = True) -> Float[Tensor, "b p d"]:
        """The sum of the writes of ``layer``'s sources (float64): its input residual. Sums up to each layer are
        kept, so every target layer costs one more layer's writes, not all of them again."""
        cum = self.__dict__.setdefault("_cum", {0: self.emb.double() + (0 if self.pos is None else self.pos.double())})
        start = max(l for l in cum if l <= layer)
        t = cum[start]
        for l in range(start, layer):
            if l in self.z:          # the layer's heads summed: one [b·p, H·e] @ [H·e, d] product (float32 is enough:
                t = t + self._heads_sum(l)   # ``bias`` is the remainder, so the parts still add up exactly)
            for _, x in self.mlp_parts(l):
                t = t + x.double()
            cum[l + 1] = t
        return t + self.bias(layer) if with_bias else t

    def _heads_sum(self, l: int) -> Tensor:
        z = self.z[l]
        b, p, H, e = z.shape
        M = self.head_out_map(l).to(z.dtype)                                         # [H, e, d]
        out = (z.reshape(b * p, H * e) @ M.reshape(H * e, -1)).view(b, p, -1).double()
        s = self.post_scale(l)
        return out if s is None else out * s

    def bias(self, layer: int) -> Float[Tensor, "b p d"]:
        """``layer``'s input residual minus every component's write: the constant output biases (float64)."""
        cache = self.__dict__.setdefault("_bias", {})
        if layer not in cache:
            cache[layer] = self.resid[layer].double() - self.total(layer, with_bias=False)
        return cache[layer]

    def bias_spread(self, layer: int) -> float:
        """How far ``bias`` is from one constant vector, relative to the residual's size (0: exactly constant)."""
        b = self.bias(layer)
        return float((b - b[:1, :1]).abs().max() / (self.resid[layer].double().abs().max() + 1e-30))


def capture_writes(model, tokens: Tensor, layers: List[int], expand: bool = False, split_mlp0: bool = True) -> Writes:
    """One forward of ``tokens`` that keeps what ``Writes`` lists for target ``layers`` and stops once the last
    one's pattern exists (and, to split MLP 0, one more pass through block 0 alone)."""
    targets = sorted(set(int(x) for x in layers))
    last = targets[-1]
    has_mlp = has_mlps(model)
    got: Dict[str, Tensor] = {}
    z: Dict[int, Tensor] = {}
    mlp: Dict[int, Tensor] = {}
    ys: Dict[int, Tensor] = {}
    patterns: Dict[int, Tensor] = {}
    values: Dict[int, Tensor] = {}
    resid: Dict[int, Tensor] = {}
    pattern: Dict[int, Tensor] = {}
    scores: Dict[int, Tensor] = {}
    posts = {l: adapter(model, l).post_norm() for l in range(last)}
    has_scores = f"blocks.{last}.attn.hook_attn_scores" in model.hook_dict

    def keep(key: str):
        def fn(t: Tensor, hook) -> None:
            got[key] = t.detach()
        return fn

    def per_layer(store: Dict[int, Tensor], l: int):
        def fn(t: Tensor, hook) -> None:
            store[l] = t.detach()
            if l == last and last in pattern and (last in scores or not has_scores) and last in resid:
                raise _Stop
        return fn

    hooks = [("blocks.0.hook_resid_pre", keep("resid0"))]
    if "hook_pos_embed" in model.hook_dict:
        hooks.append(("hook_pos_embed", keep("pos")))
    for l in range(last):
        hooks.append((f"blocks.{l}.attn.hook_z", per_layer(z, l)))
        if posts[l] is not None:
            hooks.append((f"blocks.{l}.attn.hook_out", per_layer(ys, l)))
        if has_mlp:
            hooks.append((f"blocks.{l}.hook_mlp_out", per_layer(mlp, l)))
        if expand:
            hooks += [(f"blocks.{l}.attn.hook_pattern", per_layer(patterns, l)),
                      (f"blocks.{l}.attn.hook_v", per_layer(values, l))]
    for L in targets:
        hooks += [(f"blocks.{L}.hook_resid_pre", per_layer(resid, L)),
                  (f"blocks.{L}.attn.hook_pattern", per_layer(pattern, L))]
        if has_scores:
            hooks.append((f"blocks.{L}.attn.hook_attn_scores", per_layer(scores, L)))
    try:
        with torch.no_grad():
            model.run_with_hooks(tokens, fwd_hooks=hooks)
    except _Stop:
        pass
    missing = [k for k in ("resid0",) if k not in got] + \
              [f"blocks.{L}.{x}" for L in targets for x, d in (("hook_resid_pre", resid), ("attn.hook_pattern", pattern))
               if L not in d] + \
              [f"blocks.{l}.attn.hook_z" for l in range(last) if l not in z] + \
              [f"blocks.{l}.hook_mlp_out" for l in range(last) if has_mlp and l not in mlp]
    if missing:
        raise QKCircuitsError(f"this model never fired {', '.join(missing[:4])}; QK attribution needs a "
                              f"TransformerLens bridge that fires hook_resid_pre, hook_z, hook_mlp_out and hook_pattern")
    pos = got.get("pos")
    emb = got["resid0"] - (0 if pos is None else pos)
    scores = {L: (None if L not in scores or _is_pattern(scores[L]) else scores[L]) for L in targets}
    post = {l: (posts[l], posts[l].inv_scale(ys[l].double())) for l in range(last) if posts[l] is not None}
    W_O = {l: adapter(model, l).W_O() for l in range(last)}
    token = _mlp0_alone(model, tokens) if split_mlp0 and 0 in mlp else None
    return Writes(tokens, emb, pos, resid, pattern, scores, z, post, mlp, patterns, values, W_O, token)


def _mlp0_alone(model, tokens: Tensor) -> Optional[Tensor]:
    """MLP 0's output when attention 0 writes nothing (block 0 only, ``hook_attn_out`` zeroed), or None where the
    bridge has no such hook."""
    if "blocks.0.hook_attn_out" not in model.hook_dict:
        return None
    got: Dict[str, Tensor] = {}

    def keep(t: Tensor, hook) -> None:
        got["mlp"] = t.detach()
        raise _Stop

    try:
        with torch.no_grad():
            model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_attn_out", lambda t, hook: torch.zeros_like(t)),
                                                    ("blocks.0.hook_mlp_out", keep)])
    except _Stop:
        pass
    return got.get("mlp")


def _is_pattern(t: Tensor) -> bool:
    """Real scores are masked with a huge negative value above the diagonal; a pattern holds zeros there and its
    rows sum to 1 (TL-native attention and GPT-J's bridge fire hook_attn_scores with the pattern)."""
    future = torch.ones(t.shape[-2:], dtype=torch.bool, device=t.device).triu(1)
    return bool((t >= 0).all() and (t[..., future] == 0).all()
                and torch.allclose(t.sum(-1), torch.ones((), dtype=t.dtype, device=t.device), atol=1e-3))
