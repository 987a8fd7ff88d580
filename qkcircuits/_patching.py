"""Path patching: how much each earlier head feeds a receiver head's queries, keys or values.

>>> res = qk.path_patch(model, "1.0", into=("q", "k", "v"))     # doctest: +SKIP   every earlier head as sender
>>> res.top("1.0", "k", 3)                                      # doctest: +SKIP   [(Head(0, 0), 0.97), ...]

For sender head s = (L, h) and receiver r at layer R > L, the sender's output is replaced
(``method``: its mean over the prompt set per position, zero, or its output on another prompt)
**only on its path into one input of r**; everything else is the clean run. With ``z`` the
sender's clean output and ``z'`` the replacement, the residual stream entering layer R changes by

    Δ = (z' − z) W_O[L, h]                                 (pre-norm blocks: GPT-2, Llama)
    Δ = post_L(y_L + (z' − z) W_O[L, h]) − post_L(y_L)      (Gemma: block norms its attention output y_L)

and the receiver's input (say k) is recomputed from ``resid_R + Δ`` by the model's own modules:
its input norm (ln1), K projection, k-norm where it has one, rotary (per layer type), attention
scale, soft-cap and (sliding-window) mask, while q and v stay clean. Nothing is linearised.
Grouped-query attention: keys and values belong to a KV head; patching the K (V) input for one
query head changes the keys (values) of its whole KV group, so every query head of the group sees
it; effects are reported per query head.

Effect = how much the patch harms the receiver's metric (clean − patched for a score, patched −
clean for a loss). Default metrics: the receiver's induction attention for q and k (the scan's
score on ``[BOS]+R+R``) and, for v, its direct contribution to the correct next token's logit.

Cost: one clean pass (caching what is listed under ``clean_pass``), then per receiver layer and
input one run of that layer's attention only (the forward is stopped once its pattern/z exist) on
``n_senders`` stacked copies of the batch, in chunks; every receiver head of that layer is read
from the same run. ``metric="loss"`` adds, per receiver head, a forward from the receiver's layer
to the logits for every sender (the ARENA recipe), which costs about ``n_layers - R`` blocks each.

The split into ``references`` (mean/resample values, computed once over the whole prompt set),
``patch_shard`` (sums over one shard of prompts and one chunk of receivers × senders) and
``combine`` is exact: sums and counts add up, so shards can run anywhere and be combined.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ._ablate import Replacement, Runner, check_method, make_replacement
from ._capture import _Stop, _as_tokens, hook_name
from ._errors import QKCircuitsError
from ._heads import Head, HeadsLike, kv_head, model_heads, n_kv_heads
from ._path_effects import INPUTS, PathEffects, _check_input

MetricLike = Union[None, str, Callable]
METRIC_NAMES = ("induction", "direct-logit", "loss")
# Budget for one chunk's stacked patterns (the largest tensor of a receiver-layer run).
CHUNK_BYTES = 256 * 2**20


# ------------------------------------------------------------------------------------------ metrics

@dataclass
class _Metric:
    """A receiver metric as additive sums (so prompt shards combine exactly): value = sum / count."""

    name: str
    needs: str                  # "pattern", "z" or "logits"
    sign: float = 1.0           # +1: effect = clean − patched (a score); −1: patched − clean (a loss)
    fn: Optional[Callable] = None


def resolve_metric(metric: MetricLike, into: str) -> _Metric:
    """``None`` → induction (q, k) / direct-logit (v); a name; or ``fn(pattern [b,q,k], z [b,p,d_head], tokens)``."""
    if metric is None:
        metric = "direct-logit" if into == "v" else "induction"
    if callable(metric):
        return _Metric(getattr(metric, "__name__", "custom"), "z", 1.0, metric)
    if metric == "induction":
        return _Metric("induction", "pattern")
    if metric == "direct-logit":
        return _Metric("direct-logit", "z")
    if metric == "loss":
        return _Metric("induction-loss", "logits", -1.0)
    raise QKCircuitsError(f"unknown path-patching metric {metric!r}; use one of {', '.join(METRIC_NAMES)} or a "
                          f"callable fn(pattern, z, tokens)")


# ------------------------------------------------------------------------------------------ clean pass

@dataclass
class CleanCache:
    """One clean forward's tensors that path patching reads. Memory (b × p tokens):

    - ``resid[R]``: the residual entering each layer from the lowest receiver layer on (b·p·d_model each);
    - ``z[L]``: every head's z for layers up to the highest receiver layer (b·p·n_heads·d_head each);
    - ``inputs[(x, R)]``: the clean hook_q/k/v of each receiver layer; ``pattern[R]``: [b, H, p, p];
    - ``attn_out[L]``: the attention output y of layers whose block norms it (Gemma), else nothing;
    - ``final``: the residual entering the final norm (only for the direct-logit metric); ``logits``.
    """

    tokens: Tensor
    resid: Dict[int, Tensor] = field(default_factory=dict)
    z: Dict[int, Tensor] = field(default_factory=dict)
    inputs: Dict[Tuple[str, int], Tensor] = field(default_factory=dict)
    pattern: Dict[int, Tensor] = field(default_factory=dict)
    attn_out: Dict[int, Tensor] = field(default_factory=dict)
    final: Optional[Tensor] = None
    logits: Optional[Tensor] = None
    runner: Optional[Runner] = None


def post_norm(model, layer: int):
    """The module a block applies to its attention output before adding it to the residual, or None."""
    return getattr(model.blocks[layer], "ln1_post", None)


def clean_pass(model, tokens: Tensor, receiver_layers: Sequence[int], need_final: bool = False,
               need_logits: bool = False) -> CleanCache:
    """Run ``tokens`` once, keep what ``CleanCache`` lists; check that a block adds (a norm of) its
    attention output to the residual, as the Δ formula assumes. The forward stops as soon as the last
    needed tensor exists: after the highest receiver layer's z, or at the final norm (direct-logit);
    only ``need_logits`` (the loss metric) runs the unembedding."""
    R_min, R_max = min(receiver_layers), max(receiver_layers)
    n = model.cfg.n_layers
    cache = CleanCache(tokens)
    extra: Dict[str, Tensor] = {}

    def keep(store, key):
        def fn(t: Tensor, hook) -> None:
            store[key] = t.detach()
        return fn

    def last(fn):                              # the last tensor needed: abandon the rest of the forward
        def stop(t: Tensor, hook) -> None:
            fn(t, hook)
            raise _Stop
        return stop

    hooks = [(f"blocks.{L}.hook_resid_pre", keep(cache.resid, L)) for L in sorted(set(receiver_layers))]
    hooks += [(hook_name("z", L), keep(cache.z, L) if need_final or need_logits or L < R_max
               else last(keep(cache.z, L))) for L in range(R_max + 1)]
    for R in sorted(set(receiver_layers)):
        hooks += [(hook_name(x, R), keep(cache.inputs, (x, R))) for x in INPUTS]
        hooks.append((hook_name("pattern", R), keep(cache.pattern, R)))
    hooks += [(f"blocks.{L}.attn.hook_out", keep(cache.attn_out, L)) for L in range(R_max + 1)
              if post_norm(model, L) is not None]
    # Check the residual update of the first block: resid_mid − resid_pre = post(y) (or y).
    hooks += [(f"blocks.0.{n_}", keep(extra, n_)) for n_ in ("hook_resid_pre", "hook_resid_mid", "attn.hook_out")]
    if need_final:
        grab = keep(extra, "final")
        hooks.append(("ln_final.hook_in", grab if need_logits else last(grab)))
    have = set(model.hook_dict)            # attention-only models have no resid_mid, some no ln_final hook
    optional = ("blocks.0.hook_resid_mid", "blocks.0.hook_resid_pre", "blocks.0.attn.hook_out", "ln_final.hook_in")
    hooks = [(n_, f) for n_, f in hooks if n_ in have or n_ not in optional]
    with torch.no_grad():
        try:
            cache.logits = model.run_with_hooks(tokens, fwd_hooks=hooks)
        except _Stop:
            pass
    missing = [str(L) for L in range(R_max + 1) if L not in cache.z]
    if missing:
        raise QKCircuitsError(f"the model never fired hook_z of layers {', '.join(missing)}; path patching needs "
                              f"each head's z (a TransformerLens bridge of a Hugging Face model, or a native model)")
    if need_final:
        cache.final = extra.get("final")
        if cache.final is None and f"blocks.{n - 1}.hook_resid_post" in have:
            with torch.no_grad():     # no final-norm hook point: the last block's output is what is unembedded
                model.run_with_hooks(tokens, fwd_hooks=[(f"blocks.{n - 1}.hook_resid_post", keep(extra, "final"))])
            cache.final = extra.get("final")
        if cache.final is None:
            raise QKCircuitsError("this model never fired ln_final.hook_in; the direct-logit metric needs the "
                                  "residual before the final norm (use metric='induction' or 'loss')")
    if "hook_resid_mid" in extra:
        post = post_norm(model, 0)
        with torch.no_grad():
            y = extra["attn.hook_out"]
            added = post(y) if post is not None else y
            step = extra["hook_resid_mid"] - extra["hook_resid_pre"]
        if not torch.allclose(added, step, atol=1e-4, rtol=1e-3):
            raise QKCircuitsError(f"block 0 adds something other than {'its post-norm of ' if post else ''}its "
                                  f"attention output to the residual (max difference "
                                  f"{float((added - step).abs().max()):.3g}); path patching cannot form a "
                                  f"sender's direct change to the residual on this architecture")
    cache.runner = Runner.from_cache(model, tokens, cache.resid, cache.logits, from_layer=R_min, check=False)
    _check_resume(cache, R_min)
    return cache


def _check_resume(cache: CleanCache, layer: int) -> None:
    """Resuming at ``layer`` from the cached residual must reproduce the clean pattern there (what every
    receiver run relies on); try the Runner's slower modes if the fast one does not."""
    zero = torch.zeros((1,) + tuple(cache.resid[layer].shape), dtype=cache.resid[layer].dtype,
                       device=cache.resid[layer].device)
    for mode in ("sliced", "start_at_layer", "full"):
        if mode == "sliced" and cache.runner._list is None:
            continue
        cache.runner.mode = mode
        try:
            pattern, _ = receiver_run(cache, layer, "k", zero, need_z=False)
        except Exception:          # a bridge without start_at_layer support: try the next, slower mode
            continue
        if torch.allclose(pattern, cache.pattern[layer], atol=1e-5, rtol=1e-4):
            return
    raise QKCircuitsError(f"re-running layer {layer} from the cached residual does not reproduce its clean attention "
                          f"pattern on this bridge; path patching needs that")


# ------------------------------------------------------------------------------------------ references

def references(model, method: str, tokens: Tensor, sender_layers: Sequence[int],
               per_position: bool = True) -> Replacement:
    """The replacement z of every sender layer, computed ONCE over the whole prompt set ``tokens``:
    zero; the mean per position (``per_position``, default) or over all positions; or resample
    (row i takes row i−1's z). Shards receive it (``shard_replacement``) rather than recomputing it."""
    check_method(method)
    layers = sorted(set(sender_layers)) or [0]
    return make_replacement(model, method, layers, tokens=tokens, per_position=per_position)


def replacement_from_cache(cache: CleanCache, method: str, per_position: bool = True) -> Replacement:
    """``references`` for the prompts of ``cache`` themselves, from the z the clean pass already holds
    (saves the reference forward when the prompt set is not split)."""
    check_method(method)
    if method == "zero":
        return Replacement("zero", per_position, "none")
    z = {}
    for L, t in cache.z.items():
        if method == "mean":
            z[L] = t.mean(0, keepdim=True) if per_position else t.mean((0, 1), keepdim=True)
        else:
            if t.shape[0] < 2:
                raise QKCircuitsError("resample needs at least 2 prompts (each takes the sender's z from another)")
            z[L] = t.roll(1, dims=0)
    label = "the ablated prompts" if method == "mean" else "the ablated prompts rolled by one row"
    return Replacement(method, per_position, label, z)


def shard_replacement(repl: Replacement, rows: slice) -> Replacement:
    """The part of ``repl`` that belongs to prompt rows ``rows`` (resample is per row; mean/zero are shared)."""
    if repl.method != "resample":
        return repl
    return Replacement(repl.method, repl.per_position, repl.reference, {L: z[rows] for L, z in repl.z.items()})


def sender_deltas(model, cache: CleanCache, repl: Replacement, senders: Sequence[Head]
                  ) -> Float[Tensor, "n batch pos d_model"]:
    """Each sender's direct change to the residual stream (see the module docstring), stacked."""
    b, p = cache.tokens.shape
    out = []
    with torch.no_grad():
        for s in senders:
            z = cache.z[s.layer][:, :, s.head]                                  # [b, p, d_head]
            new = repl.value(s.layer, s.head, b, p).to(z).expand_as(z)
            W_O = model.blocks[s.layer].attn.W_O[s.head].detach()              # [d_head, d_model]
            d = (new - z) @ W_O
            post = post_norm(model, s.layer)
            if post is not None:
                y = cache.attn_out[s.layer]
                d = post(y + d) - post(y)
            out.append(d)
    return torch.stack(out)


# ------------------------------------------------------------------------------------------ receiver runs

def receiver_run(cache: CleanCache, layer: int, into: str, delta: Float[Tensor, "n batch pos d_model"],
                 heads: Optional[Sequence[int]] = None, need_z: bool = True, grad: bool = False,
                 extra_hooks: Sequence = ()) -> Tuple[Tensor, Optional[Tensor]]:
    """Layer ``layer``'s attention with input ``into`` computed from ``resid + delta[i]`` (stacked copies),
    the other two inputs clean. Returns pattern [n·b, H, p, p] and z [n·b, p, H, d_head] (or None).

    ``heads`` (query heads) restricts the patch: q is patched only for those heads, k/v only for their
    KV groups; every other head's input stays clean. Default: every head (a head's pattern and z depend
    only on its own q and its KV group's k/v, so each receiver reads the same numbers either way).
    """
    model = cache.runner.model
    n = delta.shape[0]
    b, p = cache.tokens.shape
    H = model.cfg.n_heads
    resid = (cache.resid[layer][None] + delta).reshape(n * b, p, -1)
    got: Dict[str, Tensor] = {}
    keep_mask = None
    if heads is not None:
        idx = sorted({h if into == "q" else kv_head(h, H, n_kv_heads(model)) for h in heads})
        keep_mask = idx

    def splice(x: str):
        clean = cache.inputs[(x, layer)]

        def fn(t: Tensor, hook) -> Tensor:
            rep = clean.repeat(n, *([1] * (clean.dim() - 1))).to(t.dtype)
            if x != into:
                return rep
            if keep_mask is None:
                return t
            out = rep.clone()
            out[:, :, keep_mask] = t[:, :, keep_mask]
            return out
        return fn

    def grab(name: str, last: bool):
        def fn(t: Tensor, hook) -> None:
            got[name] = t
            if last:
                raise _Stop
        return fn

    hooks = [(hook_name(x, layer), splice(x)) for x in INPUTS] + list(extra_hooks)
    hooks.append((hook_name("pattern", layer), grab("pattern", not need_z)))
    if need_z:
        hooks.append((hook_name("z", layer), grab("z", True)))
    with torch.set_grad_enabled(grad):
        try:
            cache.runner.run_resid(layer, resid, hooks)
        except _Stop:
            pass
    if "pattern" not in got or (need_z and "z" not in got):
        raise QKCircuitsError(f"layer {layer}'s attention never fired hook_pattern/hook_z when run from the cached "
                              f"residual; this bridge cannot be path-patched")
    return got["pattern"], got.get("z")


# ------------------------------------------------------------------------------------------ metric sums

def _induction_mask(tokens: Tensor) -> Tensor:
    from ._detect import target_masks
    from ._metrics import repeat_length

    return target_masks(tokens, repeat_length(tokens))["induction"]


class _Scorer:
    """Turns a receiver layer's stacked patterns / z into per-copy, per-receiver-head sums."""

    def __init__(self, model, cache: CleanCache, layer: int, heads: List[int], metric: _Metric):
        self.model, self.cache, self.layer, self.heads, self.metric = model, cache, layer, heads, metric
        tokens = cache.tokens
        b, p = tokens.shape
        if metric.name in ("induction", "direct-logit"):
            self.mask = _induction_mask(tokens)                                   # [b, q, k]
            self.has = self.mask.any(-1)                                          # [b, q]
        if metric.name == "direct-logit":
            qpos = self.has.clone()
            qpos[:, -1] = False                                                   # no next token
            self.qpos = qpos
            nxt = torch.cat([tokens[:, 1:], tokens[:, :1]], 1)[qpos]              # [m]
            self.W_U = model.W_U.detach()[:, nxt].T                               # [m, d_model]
            self.r = cache.final[qpos]                                            # [m, d_model]
            self.W_O = model.blocks[layer].attn.W_O.detach()                      # [H, d_head, d_model]
            self.post = post_norm(model, layer)
            self.y = cache.attn_out[layer][qpos] if self.post is not None else None
            z = cache.z[layer][qpos]                                              # [m, H, d_head]
            self.o_clean = {h: z[:, h] @ self.W_O[h] for h in heads}

    def count(self) -> float:
        if self.metric.name == "induction":
            return float(self.has.sum())
        if self.metric.name == "direct-logit":
            return float(self.qpos.sum())
        return float(self.cache.tokens.shape[0])        # loss / custom: weighted by prompt rows

    def _logit(self, x: Tensor) -> Tensor:
        lnf = getattr(self.model, "ln_final", None)
        return ((lnf(x) if lnf is not None else x) * self.W_U).sum(-1)

    def _contrib(self, h: int, o: Tensor) -> Tensor:
        """Receiver head h's change to the residual when its output is ``o`` (rest of the layer clean)."""
        if self.post is None:
            return o
        rest = self.y - self.o_clean[h]
        return self.post(rest + o) - self.post(rest)

    def sums(self, pattern: Tensor, z: Optional[Tensor], n: int) -> Tensor:
        """[n, len(heads)] metric sums for n stacked copies."""
        b, p = self.cache.tokens.shape
        name = self.metric.name
        if name == "induction":
            pat = pattern.view(n, b, *pattern.shape[1:])[:, :, self.heads]          # [n, b, h, q, k]
            on = torch.einsum("nbhqk,bqk->nbhq", pat, self.mask.to(pat.dtype))
            return (on * self.has[None, :, None].to(on.dtype)).sum((1, 3))
        if name == "direct-logit":
            zq = z.view(n, b, p, *z.shape[2:])[:, self.qpos]                       # [n, m, H, d_head]
            out = []
            for h in self.heads:
                base = self.r - self._contrib(h, self.o_clean[h])
                new = base + self._contrib(h, zq[:, :, h] @ self.W_O[h])
                out.append((self._logit(new) - self._logit(base)).sum(-1))
            return torch.stack(out, -1)
        if self.metric.fn is not None:
            pat = pattern.view(n, b, *pattern.shape[1:])
            zz = z.view(n, b, p, *z.shape[2:])
            return torch.tensor([[float(self.metric.fn(pat[i, :, h], zz[i, :, :, h], self.cache.tokens)) * b
                                  for h in self.heads] for i in range(n)])
        raise AssertionError(name)

    def clean_sums(self) -> Tensor:
        """[len(heads)] the clean run's sums."""
        c = self.cache
        if self.metric.name == "induction":
            return self.sums(c.pattern[self.layer], None, 1)[0]
        if self.metric.name == "direct-logit" or self.metric.fn is not None:
            return self.sums(c.pattern[self.layer], c.z[self.layer], 1)[0]
        from ._metrics import induction_loss
        return torch.full((len(self.heads),), float(induction_loss()(c.logits, c.tokens)) * c.tokens.shape[0])

    def loss_sums(self, z: Tensor, n: int) -> Tensor:
        """Induction loss with receiver head h's z replaced by the patched z, forward from its layer (ARENA)."""
        from ._metrics import induction_loss

        c, L, b = self.cache, self.layer, self.cache.tokens.shape[0]
        metric = induction_loss()
        out = torch.empty(n, len(self.heads))
        for j, h in enumerate(self.heads):
            def fn(t: Tensor, hook, h=h) -> Tensor:
                t = t.clone()
                t[:, :, h] = z[:, :, h].to(t.dtype)
                return t
            with torch.no_grad():
                logits = c.runner.run_resid(L, c.resid[L].repeat(n, 1, 1), [(hook_name("z", L), fn)])
            for i in range(n):
                out[i, j] = float(metric(logits[i * b:(i + 1) * b], c.tokens)) * b
        return out


# ------------------------------------------------------------------------------------------ shards

@dataclass
class ShardSums:
    """Additive results of one shard (prompt rows ``rows`` × ``receivers`` × the senders it was given):
    ``patched[x]`` [n_receivers, n_layers, n_heads] metric sums (NaN where not computed), ``clean[x]``
    [n_receivers] sums, ``count[x]`` the metric's denominator over these rows."""

    patched: Dict[str, Tensor]
    clean: Dict[str, Tensor]
    count: Dict[str, float]
    receivers: List[Head] = field(default_factory=list)
    rows: Tuple[int, int] = (0, 0)


def _chunk(model, tokens: Tensor) -> int:
    b, p = tokens.shape
    per_copy = b * model.cfg.n_heads * p * p * 4 * 3 + b * p * model.cfg.d_model * 4 * 8
    return max(1, int(CHUNK_BYTES // per_copy))


def patch_shard(model, tokens: Tensor, repl: Optional[Replacement], receivers: Sequence[Head],
                senders: Optional[Sequence[Head]], into: Sequence[str], metric: MetricLike = None,
                progress=None, chunk: Optional[int] = None, rows: Optional[Tuple[int, int]] = None,
                method: str = "mean", per_position: bool = True) -> ShardSums:
    """Path-patch one shard of prompts (``tokens``) for a chunk of receivers and senders.

    ``repl`` must come from ``references`` over the WHOLE prompt set (sliced to these rows with
    ``shard_replacement`` for resample). Memory: the ``CleanCache`` of this shard plus one chunk of
    ``chunk`` stacked copies of the receiver layer's activations (default: ~256 MiB of patterns).
    ``rows`` names the prompt rows of the whole set these are (default ``(0, len(tokens))``), for ``combine``.
    ``repl=None`` takes the references from this shard's own clean pass (only right when the shard is the
    whole prompt set: then it saves the reference forward).
    """
    L, H = model.cfg.n_layers, model.cfg.n_heads
    metrics = {x: resolve_metric(metric, x) for x in into}
    need_final = any(m.name == "direct-logit" for m in metrics.values())
    cache = clean_pass(model, tokens, [r.layer for r in receivers], need_final=need_final,
                       need_logits=any(m.needs == "logits" for m in metrics.values()))
    if repl is None:
        repl = replacement_from_cache(cache, method, per_position)
    n_chunk = chunk or _chunk(model, tokens)
    patched = {x: torch.full((len(receivers), L, H), float("nan")) for x in into}
    clean = {x: torch.full((len(receivers),), float("nan")) for x in into}
    count: Dict[str, float] = {}
    by_layer: Dict[int, List[int]] = {}
    for i, r in enumerate(receivers):
        by_layer.setdefault(r.layer, []).append(i)
    for R, idx in sorted(by_layer.items()):
        heads = [receivers[i].head for i in idx]
        snd = [s for s in (senders if senders is not None else
                           [Head(l, h) for l in range(R) for h in range(H)]) if s.layer < R]
        for x in into:
            m = metrics[x]
            scorer = _Scorer(model, cache, R, heads, m)
            count[x] = scorer.count()
            with torch.no_grad():
                clean[x][idx] = scorer.clean_sums().float()
            for c0 in range(0, len(snd), n_chunk):
                part = snd[c0:c0 + n_chunk]
                delta = sender_deltas(model, cache, repl, part)
                with torch.no_grad():
                    pattern, z = receiver_run(cache, R, x, delta, need_z=m.needs != "pattern")
                    vals = (scorer.loss_sums(z, len(part)) if m.needs == "logits"
                            else scorer.sums(pattern, z, len(part))).float()
                for j, s in enumerate(part):
                    patched[x][idx, s.layer, s.head] = vals[j]
                if progress is not None:
                    progress.update(len(part))
    return ShardSums(patched, clean, count, list(receivers), rows or (0, int(tokens.shape[0])))


def combine(shards: Sequence[ShardSums], metrics: Dict[str, _Metric], receivers: Sequence[Head]
            ) -> Tuple[Dict[str, Tensor], Dict[str, Tensor]]:
    """Effects and clean values of ``receivers`` from shard sums, exactly.

    Shards over the same prompt rows but different receivers/senders are merged by placement (each entry
    computed once); prompt-row groups are then added: mean = Σ sums / Σ counts, effect = sign · (clean −
    patched). An entry missing from any row group stays NaN.
    """
    groups: Dict[Tuple[int, int], List[ShardSums]] = {}
    for s in shards:
        groups.setdefault(s.rows, []).append(s)
    pos = {r: i for i, r in enumerate(receivers)}
    effects, clean = {}, {}
    for x, m in metrics.items():
        tot_p = tot_c = None
        n = 0.0
        for parts in groups.values():
            gp = torch.full((len(receivers),) + tuple(parts[0].patched[x].shape[1:]), float("nan"))
            gc = torch.full((len(receivers),), float("nan"))
            for s in parts:
                for i, r in enumerate(s.receivers):
                    have = ~s.patched[x][i].isnan()
                    gp[pos[r]][have] = s.patched[x][i][have]
                    if not s.clean[x][i].isnan():
                        gc[pos[r]] = s.clean[x][i]
            n += parts[0].count[x]
            tot_p = gp if tot_p is None else tot_p + gp
            tot_c = gc if tot_c is None else tot_c + gc
        c = tot_c / n
        effects[x] = m.sign * (c[:, None, None] - tot_p / n)
        clean[x] = c
    return effects, clean


# ------------------------------------------------------------------------------------------ public API

def default_prompts(model, n_seqs: int = 8, seed: int = 0) -> Int[Tensor, "batch pos"]:
    """The scan's induction prompts: ``n_seqs`` × [BOS] + R + R, R of ``segment_length(model)`` distinct tokens."""
    from ._sequences import repeated_tokens, segment_length

    return repeated_tokens(model, n_seqs, segment_length(model), 2, seed=seed)


def _check_into(into) -> List[str]:
    if isinstance(into, str):
        into = [t for t in into.replace(" ", "").split(",") if t]
    into = [_check_input(x) for x in into]
    if not into:
        raise QKCircuitsError("into names no input; use any of q, k, v")
    return [x for x in INPUTS if x in into]


def _metric_label(metric: MetricLike, x: str) -> str:
    return resolve_metric(metric, x).name


def path_patch(model, receivers: HeadsLike, into: Sequence[str] = ("q", "k", "v"), senders: Optional[HeadsLike] = None,
               method: str = "mean", tokens=None, metric: MetricLike = None, *, per_position: bool = True,
               shards: int = 1, chunk: Optional[int] = None, progress: bool = True) -> PathEffects:
    """Exact path patching of every sender → (q | k | v of) every receiver; see the module docstring.

    ``receivers``/``senders``: heads ("18.6,17.3", [(18, 6)], Head objects); senders default to every
    head of an earlier layer than each receiver. ``tokens`` default to ``default_prompts(model)``.
    ``metric``: None (induction for q/k, direct-logit for v), "induction", "direct-logit", "loss", or
    ``fn(pattern [b, q, k], z [b, p, d_head], tokens) -> scalar`` (a score: higher = better). ``shards``
    splits the prompts into that many row blocks run one after another (same result; less memory).

    Memory: ``CleanCache`` (residual per layer from the lowest receiver on, z of every layer up to
    the highest, q/k/v and patterns of receiver layers) plus one chunk of stacked receiver-layer
    activations (``chunk`` copies; default sized to ~256 MiB of patterns).
    """
    from ._model import model_name

    recv = model_heads(model, receivers)
    if all(r.layer == 0 for r in recv):
        raise QKCircuitsError(f"receiver {recv[0]} is in layer 0: no earlier heads can send to it")
    snd = model_heads(model, senders) if senders is not None else None
    into = _check_into(into)
    check_method(method)
    tokens = _as_tokens(model, tokens if tokens is not None else default_prompts(model))
    if method == "resample" and tokens.shape[0] < 2:
        raise QKCircuitsError("resample needs at least 2 prompts (each takes the sender's z from another)")
    metrics = {x: resolve_metric(metric, x) for x in into}
    sender_layers = sorted({s.layer for s in snd} if snd is not None else set(range(max(r.layer for r in recv))))
    n_shards = max(1, min(shards, tokens.shape[0]))
    # One shard: the references come from its own clean pass (same prompts, no extra forward).
    repl = references(model, method, tokens, sender_layers, per_position) if n_shards > 1 else None
    H = model.cfg.n_heads
    n_edges = sum(len([s for s in snd if s.layer < r.layer]) if snd is not None else r.layer * H for r in recv)
    n_layers_recv = len({r.layer for r in recv})
    bar = None
    if progress:
        from tqdm.auto import tqdm
        total = sum(len([s for s in snd if s.layer < R]) if snd is not None else R * H
                    for R in {r.layer for r in recv}) * len(into) * shards
        bar = tqdm(total=total, desc="path patching", unit="sender", leave=False, file=sys.stderr)
    blocks = [(int(r[0]), int(r[-1]) + 1) for r in torch.arange(tokens.shape[0]).chunk(n_shards)]
    try:
        parts = [patch_shard(model, tokens[a:b], repl and shard_replacement(repl, slice(a, b)), recv, snd, into, metric,
                             bar, chunk, rows=(a, b), method=method, per_position=per_position) for a, b in blocks]
    finally:
        if bar is not None:
            bar.close()
    effects, clean = combine(parts, metrics, recv)
    return PathEffects(model=model_name(model), method=method, receivers=recv, into=into,
                       metrics={x: m.name for x, m in metrics.items()}, effects=effects, clean=clean, kind="exact",
                       n_layers=model.cfg.n_layers, n_heads=H,
                       settings=_settings(model, tokens, per_position, _reference_label(method), n_edges,
                                          n_layers_recv))


def _reference_label(method: str) -> str:
    return {"zero": "none", "mean": "the ablated prompts", "resample": "the ablated prompts rolled by one row"}[method]


def _settings(model, tokens: Tensor, per_position: bool, reference: str, n_edges: int, n_layers_recv: int) -> dict:
    import transformer_lens

    from . import __version__

    return {"n_prompts": int(tokens.shape[0]), "n_positions": int(tokens.shape[1]), "per_position": per_position,
            "reference": reference, "n_edges": n_edges, "receiver_layers": n_layers_recv,
            "fold_ln": bool(getattr(model, "compatibility_mode", False)), "dtype": str(model.W_E.dtype),
            "qkcircuits": __version__, "transformer_lens": getattr(transformer_lens, "__version__", "?"),
            "torch": torch.__version__}
