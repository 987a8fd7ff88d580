"""The exact computation behind ``path_patch`` for one receiver layer: clean pass, sender deltas, receiver runs.

>>> cache = clean_pass(model, tokens, [1])                          # one clean forward, receivers in layer 1
>>> delta = sender_deltas(model, cache, references(model, "mean", tokens, [0]), [Head(0, 0)])
>>> pattern, z = receiver_run(cache, 1, "k", delta)                 # only layer 1's attention is re-run
>>> delta.shape, pattern.shape, z.shape      # [senders, batch, pos, d_model], [batch, head, q, k], z per head
(torch.Size([1, 2, 11, 224]), torch.Size([2, 2, 11, 11]), torch.Size([2, 11, 2, 129]))

``_patching`` splits the work over prompt shards and (receiver, sender) chunks and combines it; see its
docstring for the formulas. Nothing here linearises: the receiver layer is re-run by the model's own modules.
"""


from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Dict, List, Optional, Sequence, Tuple, Union

import torch
from jaxtyping import Float
from torch import Tensor

from .._analysis.ablate import Replacement, check_method, make_replacement
from .._analysis.replay import MODES, BlockInputs, Runner
from .._analysis.detectors import induction_mask
from .._analysis.metrics import Metric, as_metric, direct_logit, induction_attention, repeat_length
from .._foundation.capture import StopForward, hook_name
from .._foundation.arch import adapter
from .._foundation.errors import QKCircuitsError
from .._foundation.arch.model_facts import final_norm_module, post_norm_module
from .._foundation.heads import Head, kv_head, n_kv_heads
from .path_effects import INPUTS

# None (the default per input), a name, a qk.Metric or a callable: checked by as_metric, which fails in one
# line (a narrower annotation would let a runtime type checker raise its own error first).
MetricLike = Any
# Budget for one chunk's stacked patterns (the largest tensor of a receiver-layer run).
CHUNK_BYTES = 256 * 2**20
ACCEPT = ("pattern", "z", "logits")      # path patching evaluates every kind of metric


# ------------------------------------------------------------------------------------------ metrics

def resolve_metric(metric: MetricLike, into: str, where: str = "path_patch") -> Metric:
    """The ``Metric`` of input ``into``: ``None`` → ``induction`` (q, k) / ``direct-logit`` (v); else
    ``as_metric`` (the one resolver: any name given tokens, ``qk.Metric`` or declared callable).

    A receiver metric (``needs`` pattern/z) reads the receiver head's pattern/z; a logits metric runs the
    receiver's patched z through the layers above to the logits (the ARENA recipe)."""
    if metric is None:
        metric = "direct-logit" if into == "v" else "induction"
    return as_metric(metric, accept=ACCEPT, where=where)


def is_induction(metric: Metric) -> bool:
    """The built-in induction attention (computed here as sums, so prompt shards add up)."""
    return metric.fn is induction_attention


def is_direct_logit(metric: Metric) -> bool:
    """The built-in direct logit (needs the clean final residual and the unembedding)."""
    return metric.fn is direct_logit


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
    return post_norm_module(model, layer)


def clean_pass(model, tokens: Tensor, receiver_layers: Sequence[int], need_final: bool = False,
               need_logits: bool = False, check_all: Optional[bool] = True, first_hooks: Sequence = (),
               on_start: Optional[Callable[["CleanCache"], None]] = None) -> CleanCache:
    """Run ``tokens`` once, keep what ``CleanCache`` lists; check that a block adds (a norm of) its
    attention output to the residual, as the Δ formula assumes. The forward stops as soon as the last
    needed tensor exists: after the highest receiver layer's z, or at the final norm (direct-logit);
    only ``need_logits`` (a logits metric) runs the unembedding.

    ``first_hooks`` run before this function's own at the same hook points (a caller that does its work
    inside the clean forward: edge attribution; ``on_start(cache)`` hands it the cache before the forward). Resume check (re-running a receiver layer from the cached
    residual reproduces its pattern): every receiver layer (``check_all=True``), the lowest (``False``),
    none (``None``: the caller re-runs no layer from the cache, or checks each run itself)."""
    R_min, R_max = min(receiver_layers), max(receiver_layers)
    n = model.cfg.n_layers
    cache = CleanCache(tokens)
    if on_start is not None:
        on_start(cache)
    extra: Dict[str, Tensor] = {}

    def keep(store, key):
        def fn(t: Tensor, hook) -> None:
            store[key] = t.detach()
        return fn

    def last(fn):                              # the last tensor needed: abandon the rest of the forward
        def stop(t: Tensor, hook) -> None:
            fn(t, hook)
            raise StopForward
        return stop

    def top_done(fn):                          # the top layer's z and pattern, whichever fires last (GPT-J: z)
        def stop(t: Tensor, hook) -> None:
            fn(t, hook)
            if R_max in cache.z and R_max in cache.pattern:
                raise StopForward
        return stop

    stops = not (need_final or need_logits)
    hooks = list(first_hooks)
    hooks += [(f"blocks.{L}.hook_resid_pre", keep(cache.resid, L)) for L in sorted(set(receiver_layers))]
    hooks += [(hook_name("z", L), top_done(keep(cache.z, L)) if stops and L == R_max else keep(cache.z, L))
              for L in range(R_max + 1)]
    for R in sorted(set(receiver_layers)):
        hooks += [(hook_name(x, R), keep(cache.inputs, (x, R))) for x in INPUTS]
        hooks.append((hook_name("pattern", R), top_done(keep(cache.pattern, R)) if stops and R == R_max
                      else keep(cache.pattern, R)))
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
    inputs = BlockInputs(model)          # what each block is called with: the receiver runs replay blocks R..
    with torch.no_grad(), inputs.recording():
        try:
            cache.logits = model.run_with_hooks(tokens, fwd_hooks=hooks)
        except StopForward:
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
                                  "residual before the final norm (use metric='induction' or 'induction-loss')")
    if "hook_resid_mid" in extra:
        post = post_norm(model, 0)
        with torch.no_grad():
            y = extra["attn.hook_out"]
            added = post(y) if post is not None else y
            step = extra["hook_resid_mid"] - extra["hook_resid_pre"]
        # bf16/fp16 residuals: resid_mid − resid_pre loses ~eps × |resid| to rounding, so the tolerance scales
        eps = torch.finfo(step.dtype).eps if step.dtype.is_floating_point else 0.0
        scale = float(extra["hook_resid_mid"].float().abs().max())
        if not torch.allclose(added.float(), step.float(), atol=max(1e-4, 4 * eps * scale), rtol=max(1e-3, 4 * eps)):
            raise QKCircuitsError(f"block 0 adds something other than {'its post-norm of ' if post else ''}its "
                                  f"attention output to the residual (max difference "
                                  f"{float((added - step).abs().max()):.3g}); path patching cannot form a "
                                  f"sender's direct change to the residual on this architecture")
    cache.runner = Runner.from_cache(model, tokens, cache.resid, cache.logits, from_layer=R_min, inputs=inputs,
                                     check=False)
    # every receiver layer (one attention run each), or only the lowest when the caller checks each
    # layer's own clean run as it goes (edge attribution's _grad_run)
    layers = sorted(set(receiver_layers))
    if check_all is not None:
        check_resume(cache, layers if check_all else layers[:1], logits=need_logits)
    return cache


def check_resume(cache: CleanCache, layers: Sequence[int], logits: bool = False) -> None:
    """Resuming at each receiver layer from the cached residual must reproduce the clean pattern there
    (what every receiver run relies on) and, when the loss metric runs the layers above (``logits``),
    the clean logits. Every receiver layer is checked, one attention run each, and the Runner's slower modes
    are tried if needed (``replay.Runner.mode``)."""
    def ok(layer: int) -> bool:
        zero = torch.zeros((1,) + tuple(cache.resid[layer].shape), dtype=cache.resid[layer].dtype,
                           device=cache.resid[layer].device)
        pattern, _ = receiver_run(cache, layer, "k", zero, need_z=False)
        return torch.allclose(pattern, cache.pattern[layer], atol=1e-5, rtol=1e-4)

    for mode in MODES:
        if mode == "blocks" and not cache.runner.inputs.covers(layers):
            continue
        cache.runner.mode = mode
        try:
            if not all(ok(layer) for layer in layers):
                continue
        except Exception:          # a bridge without start_at_layer support: try the next, slower mode
            continue
        if logits and cache.logits is not None:
            with torch.no_grad():
                out = cache.runner.run_resid(layers[0], cache.resid[layers[0]], [])
            if not torch.allclose(out, cache.logits, atol=1e-4, rtol=1e-3):
                continue
        return
    raise QKCircuitsError(f"re-running layers {', '.join(map(str, layers))} from the cached residual does not "
                          f"reproduce their clean attention pattern{' and logits' if logits else ''} on this "
                          f"bridge; path patching needs that")


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
            W_O = adapter(model, s.layer).W_O()[s.head]                         # [d_v, d_model]
            d = (new - z) @ W_O
            post = post_norm(model, s.layer)
            if post is not None:
                y = cache.attn_out[s.layer]
                d = post(y + d) - post(y)
            out.append(d)
    return torch.stack(out)


# ------------------------------------------------------------------------------------------ receiver runs

def grab(got: Dict[str, Tensor], name: str, last: Union[bool, Collection[str]]):
    """A hook that keeps its tensor in ``got[name]`` and ends the forward there when ``last`` is True, or
    (``last`` a set of names) once every one of them is in ``got``, whichever hook fires last: bridges differ
    in order (GPT-J's fires hook_z before hook_pattern, which it reads off the attention's outputs)."""
    def fn(t: Tensor, hook) -> None:
        got[name] = t
        if last is True or (not isinstance(last, bool) and all(n_ in got for n_ in last)):
            raise StopForward
    return fn


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

    hooks = [(hook_name(x, layer), splice(x)) for x in INPUTS] + list(extra_hooks)
    wanted = ("pattern", "z") if need_z else ("pattern",)
    hooks.append((hook_name("pattern", layer), grab(got, "pattern", wanted)))
    if need_z:
        hooks.append((hook_name("z", layer), grab(got, "z", wanted)))
    with torch.set_grad_enabled(grad):
        try:
            cache.runner.run_resid(layer, resid, hooks)
        except StopForward:
            pass
    if "pattern" not in got or (need_z and "z" not in got):
        raise QKCircuitsError(f"layer {layer}'s attention never fired hook_pattern/hook_z when run from the cached "
                              f"residual; this bridge cannot be path-patched")
    return got["pattern"], got.get("z")


# ------------------------------------------------------------------------------------------ metric sums

class Scorer:
    """Turns a receiver layer's stacked patterns / z into per-copy, per-receiver-head sums (value = sum / count).

    The built-in ``induction`` and ``direct-logit`` sum over query positions; any other receiver metric
    ``m(pattern, z, tokens)`` and every logits metric ``m(logits, tokens)`` (means over the batch) are
    weighted by the prompt rows, so shards of prompts combine exactly."""

    def __init__(self, model, cache: CleanCache, layer: int, heads: List[int], metric: Metric):
        self.model, self.cache, self.layer, self.heads, self.metric = model, cache, layer, heads, metric
        tokens = cache.tokens
        if is_induction(metric) or is_direct_logit(metric):
            self.mask = induction_mask(tokens, repeat_length(tokens))             # [b, q, k]
            self.has = self.mask.any(-1)                                          # [b, q]
        if is_direct_logit(metric):
            qpos = self.has.clone()
            qpos[:, -1] = False                                                   # no next token
            self.qpos = qpos
            nxt = torch.cat([tokens[:, 1:], tokens[:, :1]], 1)[qpos]              # [m]
            self.W_U = model.W_U.detach()[:, nxt].T                               # [m, d_model]
            self.r = cache.final[qpos]                                            # [m, d_model]
            self.W_O = adapter(model, layer).W_O()                                # [H, d_v, d_model]
            self.post = post_norm(model, layer)
            self.y = cache.attn_out[layer][qpos] if self.post is not None else None
            z = cache.z[layer][qpos]                                              # [m, H, d_head]
            self.o_clean = {h: z[:, h] @ self.W_O[h] for h in heads}

    def count(self) -> float:
        if is_induction(self.metric):
            return float(self.has.sum())
        if is_direct_logit(self.metric):
            return float(self.qpos.sum())
        return float(self.cache.tokens.shape[0])        # logits / custom metrics: weighted by prompt rows

    def _logit(self, x: Tensor) -> Tensor:
        lnf = final_norm_module(self.model)
        return ((lnf(x) if lnf is not None else x) * self.W_U).sum(-1)

    def _contrib(self, h: int, o: Tensor) -> Tensor:
        """Receiver head h's change to the residual when its output is ``o`` (rest of the layer clean)."""
        if self.post is None:
            return o
        rest = self.y - self.o_clean[h]
        return self.post(rest + o) - self.post(rest)

    def sums(self, pattern: Tensor, z: Optional[Tensor], n: int) -> Tensor:
        """[n, len(heads)] metric sums for n stacked copies (in the autograd graph when the inputs are)."""
        b, p = self.cache.tokens.shape
        if is_induction(self.metric):
            pat = pattern.view(n, b, *pattern.shape[1:])[:, :, self.heads]          # [n, b, h, q, k]
            on = torch.einsum("nbhqk,bqk->nbhq", pat, self.mask.to(pat.dtype))
            return (on * self.has[None, :, None].to(on.dtype)).sum((1, 3))
        if is_direct_logit(self.metric):
            zq = z.view(n, b, p, *z.shape[2:])[:, self.qpos]                       # [n, m, H, d_head]
            out = []
            for h in self.heads:
                base = self.r - self._contrib(h, self.o_clean[h])
                new = base + self._contrib(h, zq[:, :, h] @ self.W_O[h])
                out.append((self._logit(new) - self._logit(base)).sum(-1))
            return torch.stack(out, -1)
        if self.metric.needs == "logits":
            raise QKCircuitsError(f"metric {self.metric.name!r} reads logits: use logits_sums")
        pat = pattern.view(n, b, *pattern.shape[1:])
        zz = z.view(n, b, p, *z.shape[2:]) if z is not None else None
        rows = [torch.stack([self.metric(pat[i, :, h], None if zz is None else zz[i, :, :, h], self.cache.tokens)
                             for h in self.heads]) for i in range(n)]
        return torch.stack(rows).float() * b

    def clean_sums(self) -> Tensor:
        """[len(heads)] the clean run's sums."""
        c = self.cache
        if is_induction(self.metric):
            return self.sums(c.pattern[self.layer], None, 1)[0]
        if self.metric.needs == "logits":
            return torch.full((len(self.heads),), float(self.metric(c.logits, c.tokens)) * c.tokens.shape[0])
        return self.sums(c.pattern[self.layer], c.z[self.layer], 1)[0]

    def logits_sums(self, z: Tensor, n: int) -> Tensor:
        """A logits metric with receiver head h's z replaced by the patched z, forward from its layer (ARENA)."""
        c, L, b = self.cache, self.layer, self.cache.tokens.shape[0]
        out = torch.empty(n, len(self.heads))
        for j, h in enumerate(self.heads):
            def fn(t: Tensor, hook, h=h) -> Tensor:
                t = t.clone()
                t[:, :, h] = z[:, :, h].to(t.dtype)
                return t
            with torch.no_grad():
                logits = c.runner.run_resid(L, c.resid[L].repeat(n, 1, 1), [(hook_name("z", L), fn)])
            for i in range(n):
                out[i, j] = float(self.metric(logits[i * b:(i + 1) * b], c.tokens)) * b
        return out
