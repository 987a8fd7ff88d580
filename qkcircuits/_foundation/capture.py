"""Read and edit attention internals per head: Q, K, V (before/after rotary), scores, patterns, z.

Read everything you name in one forward pass (here the hand-built toy: 2 layers x 2 heads, d_head 129):

>>> acts = capture(model, tokens, ["q", "k", "pattern"], layers=[0, 1])
>>> acts["q", 1].shape                      # [batch, pos, n_heads, d_head], per *query* head
torch.Size([2, 11, 2, 129])
>>> acts.kv("k", 1).shape                   # [batch, pos, n_kv_heads, d_head], per KV head (GQA)
torch.Size([2, 11, 2, 129])

Stream one layer at a time instead of keeping them all:

>>> def reduce(layer, t):                   # t: {"pattern": [batch, head, q, k]}, this layer only
...     return t["pattern"].diagonal(-1, -2, -1).mean((0, 2))
>>> per_layer = stream(model, tokens, reduce, ["pattern"])   # {layer: [head]}
>>> [round(float(x), 2) for x in per_layer[0]]               # 0.0 is the previous-token head
[1.0, 0.0]

Edit chosen heads, hooks removed on exit (also on exceptions):

>>> with edit(model, "z", "1.0", 0.0):      # zero head 1.0's z
...     logits = model(tokens)

Multi-head latent attention (DeepSeek-V2/V3) has the same names, in the same layouts, plus
``q_latent`` and ``kv_latent`` ([batch, pos, rank], the normalised latents every head reads) and
``k_rope`` (the decoupled rotary key shared by all heads, [batch, pos, 1, d_rope]). There ``q``/``k``
are what enters attention ([content | rotated rope] per head, post-rotary: TL's hooks fire there),
``rot_q``/``rot_k`` the rotated rope parts only.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from jaxtyping import Float, Int
from torch import Tensor

from .arch import adapter, architecture
from .arch.layer_rotary import has_rotary  # noqa: F401  (re-exported)
from .attention import attention_scale, native_rotary, rotate_native
from . import display as show
from .result import Result, stamped
from .rope import STYLES, RotarySpec, rotate
from .errors import QKCircuitsError
from .arch.model_facts import positional
from .heads import Head, HeadsLike, kv_head, model_heads, n_kv_heads
from .io import json_floats, read_floats

# name -> (hook suffix under blocks.L.attn, layout). "qh": [b, p, n_heads, d]; "kvh": [b, p, n_kv, d];
# "hqk": [b, n_heads, q, k].
NAMES: Dict[str, Tuple[str, str]] = {
    "q": ("hook_q", "qh"),
    "k": ("hook_k", "kvh"),
    "v": ("hook_v", "kvh"),
    "rot_q": ("hook_rot_q", "qh"),
    "rot_k": ("hook_rot_k", "kvh"),
    "scores": ("hook_attn_scores", "hqk"),
    "pattern": ("hook_pattern", "hqk"),
    "z": ("hook_z", "qh"),
    # multi-head latent attention only (DeepSeek-V2/V3): "lat" is [b, p, rank]
    "q_latent": ("hook_q_latent", "lat"),
    "kv_latent": ("hook_kv_latent", "lat"),
    "k_rope": ("hook_rot_k", "kvh"),      # the decoupled rotary key, one for all heads: [b, p, 1, d_rope]
}
EDITABLE = ("q", "k", "v", "rot_q", "rot_k", "z", "q_latent", "kv_latent", "k_rope")
Tokens = Int[Tensor, "batch pos"]


def hook_name(name: str, layer: int) -> str:
    """``hook_name("rot_q", 3) == "blocks.3.attn.hook_rot_q"``."""
    _check_names([name])
    return f"blocks.{layer}.attn.{NAMES[name][0]}"


def _check_names(names: Iterable[str]) -> List[str]:
    names = list(names)
    for n in names:
        if n not in NAMES:
            raise QKCircuitsError(f"unknown activation {n!r}; choose from {', '.join(NAMES)}")
    if not names:
        raise QKCircuitsError(f"name at least one activation to capture ({', '.join(NAMES)})")
    return names


def _check_layers(model, layers: Optional[Iterable[int]]) -> List[int]:
    n = model.cfg.n_layers
    layers = list(range(n)) if layers is None else sorted(set(int(x) for x in layers))
    for layer in layers:
        if not 0 <= layer < n:
            raise QKCircuitsError(f"layer {layer} is out of range: the model has layers 0-{n - 1}")
    if not layers:
        raise QKCircuitsError("no layers given; pass None for all layers or a list such as [0, 3]")
    return layers


def _resolve_names(model, names: Sequence[str]) -> List[str]:
    names = _check_names(names)
    refused = adapter(model, 0).activation_refusal(names, architecture(model))   # latents only on latent attention
    if refused:
        raise QKCircuitsError(refused)
    if not has_rotary(model):
        bad = [n for n in names if n.startswith("rot_")]
        if bad:
            raise QKCircuitsError(f"{bad[0]!r} needs a rotary model, and this one has positional embedding type "
                                  f"{positional(model)!r}; use 'q'/'k'")
    return names


def expand_kv(t: Float[Tensor, "batch pos kv d"], n_heads: int) -> Float[Tensor, "batch pos head d"]:
    """Per-KV-head tensor -> per-query-head (query head h reads KV head h // group)."""
    group = n_heads // t.shape[2]
    return t.repeat_interleave(group, dim=2) if group > 1 else t


@dataclass(frozen=True, repr=False)      # the repr is _text (Result)
class Activations(Result):
    """What ``capture`` read: ``acts[name, layer]`` per query head; ``acts.kv(name, layer)`` per KV head.

    Holds, for each captured layer and name, one tensor of the shape in ``NAMES`` (detached, on
    the model's device). K/V are stored once per KV head and expanded on access.
    """

    SCHEMA = "qkcircuits.activations/1"
    WHAT = "a qkcircuits activations JSON"
    KEYS = ("n_heads", "tensors")

    n_heads: int
    tensors: Dict[Tuple[str, int], Tensor] = field(default_factory=dict)
    settings: Dict[str, object] = field(default_factory=dict)

    def __getitem__(self, key: Tuple[str, int]) -> Tensor:
        name, layer = key
        t = self._raw(name, layer)
        return expand_kv(t, self.n_heads) if NAMES[name][1] == "kvh" else t

    def kv(self, name: str, layer: int) -> Float[Tensor, "batch pos kv d_head"]:
        if NAMES[name][1] != "kvh":
            raise QKCircuitsError(f"{name!r} is per query head; kv() reads 'k', 'v' or 'rot_k'")
        return self._raw(name, layer)

    def head(self, name: str, layer: int, head: int) -> Tensor:
        """One query head's slice: [batch, pos, d_head] for q/k/v/z, [batch, q, k] for scores/pattern."""
        if NAMES[name][1] == "lat":
            raise QKCircuitsError(f"{name!r} is one latent shared by every head of the layer; read acts[{name!r}, "
                                  f"{layer}] ([batch, pos, rank]) instead")
        t = self[name, layer]
        return t[:, head] if NAMES[name][1] == "hqk" else t[:, :, head]

    def _raw(self, name: str, layer: int) -> Tensor:
        try:
            return self.tensors[(name, layer)]
        except KeyError:
            have = sorted({f"{n}@{l}" for n, l in self.tensors})
            raise QKCircuitsError(f"({name!r}, {layer}) was not captured; captured: {', '.join(have)}") from None

    def top(self, k: int = 5) -> List[Tuple[str, float]]:
        """The ``k`` captured tensors with the largest RMS, largest first: ``("name@layer", rms)``."""
        rms = sorted(((f"{n}@{l}", float(t.float().pow(2).mean().sqrt())) for (n, l), t in self.tensors.items()),
                     key=lambda x: -x[1])
        return rms[:k]

    def to_frame(self):
        """One row per captured tensor: name, layer, shape (as stored), dtype, rms."""
        import pandas as pd

        return pd.DataFrame([{"name": n, "layer": l, "shape": list(t.shape), "dtype": str(t.dtype),
                              "rms": float(t.float().pow(2).mean().sqrt())} for (n, l), t in sorted(self.tensors.items())])

    def to_dict(self) -> Dict[str, object]:
        """Every tensor as nested lists (as stored: K/V per KV head) with its shape and dtype, exact for the dtype
        (``json_floats``); large for big runs."""
        return {"n_heads": self.n_heads, "settings": self.settings,
                "tensors": [{"name": n, "layer": l, "dtype": str(t.dtype).replace("torch.", ""),
                             "shape": list(t.shape), "values": json_floats(t)}
                            for (n, l), t in self.tensors.items()]}         # in capture order (from_json keeps it)

    @classmethod
    def _from_dict(cls, d: Dict[str, object]) -> "Activations":
        tensors = {(e["name"], int(e["layer"])): read_floats(e["values"], getattr(torch, e["dtype"])).reshape(e["shape"])
                   for e in d["tensors"]}
        return cls(int(d["n_heads"]), tensors, dict(d.get("settings", {})))

    def _text(self) -> str:
        items = sorted(self.tensors.items())
        return ("Activations(" + ", ".join(f"{n}@{l} {list(t.shape)}" for (n, l), t in items[:8])
                + (f", ... {len(items)} in all" if len(items) > 8 else "") + ")")

    def _html(self) -> str:
        items = sorted(self.tensors.items())
        return show.box("Activations", show.table([(n, str(l), str(list(t.shape)), str(t.dtype))
                                                   for (n, l), t in items[:64]],
                                                  ("name", "layer", "shape (as stored)", "dtype")))



def _as_tokens(model, tokens) -> Tensor:
    if isinstance(tokens, str):
        if getattr(model, "tokenizer", None) is None:
            raise QKCircuitsError("this model has no tokenizer; pass token ids as a [batch, pos] tensor")
        tokens = model.to_tokens(tokens)
    t = torch.as_tensor(tokens)
    if t.dim() == 1:
        t = t[None]
    if t.dim() != 2 or t.numel() == 0:
        raise QKCircuitsError(f"tokens must be a non-empty [batch, pos] integer tensor, got shape {tuple(t.shape)}")
    if t.shape[1] > model.cfg.n_ctx:
        raise QKCircuitsError(f"sequence length {t.shape[1]} exceeds the model's context of {model.cfg.n_ctx} tokens")
    bad = t[(t < 0) | (t >= model.cfg.d_vocab)]
    if bad.numel():
        raise QKCircuitsError(f"token id {int(bad[0])} is outside the vocabulary 0-{model.cfg.d_vocab - 1}")
    return t.to(_device(model))


def _device(model) -> torch.device:
    return model.W_E.device


def capture(model, tokens, names: Sequence[str] = ("q", "k", "v", "pattern"),
            layers: Optional[Iterable[int]] = None) -> Activations:
    """Run one forward pass and keep ``names`` for ``layers`` (all layers by default).

    Stops the forward once the last requested tensor exists. Memory: every requested tensor of every
    requested layer (patterns are [batch, n_heads, pos, pos] each); use ``stream`` for long scans.
    """
    names = _resolve_names(model, names)
    layers = _check_layers(model, layers)
    acts = Activations(n_heads=model.cfg.n_heads, settings=stamped({}, model, name=True))

    def keep(name: str, layer: int):
        def fn(t: Tensor, hook) -> None:
            acts.tensors[(name, layer)] = t.detach()
        return fn

    fixer = _ScoresFixer(model, layers) if "scores" in names else None
    hooks = [(hook_name(n, l), fixer.wrap(keep(n, l), l) if n == "scores" and fixer else keep(n, l))
             for l in layers for n in names]
    _run(model, _as_tokens(model, tokens), hooks, stop_after=max(layers), names_per_layer=len(names),
         extra_hooks=fixer.hooks if fixer else ())
    _check_fired([f"{n}@{l}" for l in layers for n in names if (n, l) not in acts.tensors])
    return acts


def stream(model, tokens, reducer: Callable[[int, Dict[str, Tensor]], object], names: Sequence[str] = ("pattern",),
           layers: Optional[Iterable[int]] = None, *, extra_hooks: Sequence = ()) -> Dict[int, object]:
    """Call ``reducer(layer, {name: tensor})`` as soon as a layer's tensors exist; keep only what it returns.

    Memory: at most one layer's requested tensors (plus whatever the reducer returns), never
    all layers' patterns. K/V arrive per query head (expanded for GQA). ``extra_hooks`` are
    (hook name, fn) pairs added for the same pass (e.g. an ablation).
    """
    names = _resolve_names(model, names)
    layers = _check_layers(model, layers)
    n_heads = model.cfg.n_heads
    pending: Dict[str, Tensor] = {}
    results: Dict[int, object] = {}

    def collect(name: str, layer: int):
        def fn(t: Tensor, hook) -> None:
            pending[name] = expand_kv(t.detach(), n_heads) if NAMES[name][1] == "kvh" else t.detach()
            if len(pending) == len(names):      # hook order differs between bridges: wait for all
                results[layer] = reducer(layer, dict(pending))
                pending.clear()
        return fn

    fixer = _ScoresFixer(model, layers) if "scores" in names else None
    hooks = [(hook_name(n, l), fixer.wrap(collect(n, l), l) if n == "scores" and fixer else collect(n, l))
             for l in layers for n in names]
    _run(model, _as_tokens(model, tokens), hooks, stop_after=max(layers), names_per_layer=len(names),
         extra_hooks=list(extra_hooks) + (fixer.hooks if fixer else []))
    _check_fired([f"{n}@{l}" for l in layers if l not in results for n in names])
    return results


def _check_fired(missing: List[str]) -> None:
    """A hook point that exists but never fires (e.g. hook_rot_q on TL-native rotary models) must not
    pass silently as an empty result."""
    if missing:
        raise QKCircuitsError(f"the model never fired the hooks for {', '.join(missing[:6])}"
                              f"{' ...' if len(missing) > 6 else ''}; this bridge does not expose them "
                              f"(TL-native, GPT-J and GPT-NeoX bridges never fire hook_rot_q/k: capture 'q'/'k' and rotate "
                              f"them, x @ qk.weights.rotation(qk.weights.rotary_spec(model, layer=L), range(pos)))")


class _ScoresFixer:
    """Give ``scores`` hooks pre-softmax scores even where TransformerLens passes the pattern.

    TL's generic attention path (``boot_native`` models, e.g. ``fixtures.hand_built_induction_model``)
    fires ``hook_attn_scores`` with the softmaxed pattern, and so does GPT-J's bridge. There the scores
    are rebuilt from this layer's q and k as the module forms them: rotated (native rotary never fires
    ``hook_rot_q/k``, so the pre-rotary q/k are rotated with the module's own rotary; GPT-J's bridge
    fires neither, so they are rotated with the model's own frequencies in whichever pairing, ``halves``
    or ``pairs``, reproduces the pattern), times the module's own scale,
    soft-capped where the module caps (``_attention.attention_scale``), future keys masked; accepted
    only if their softmax reproduces the pattern. Memory: one layer's q and k, dropped once its
    scores fired.
    """

    def __init__(self, model, layers: Sequence[int]):
        self.model, self.n_heads = model, model.cfg.n_heads
        rot = has_rotary(model)
        self.rotary = {l: native_rotary(model, l) for l in layers} if rot else {}
        # GPT-J's bridge fires neither hook_rot_q/k nor real scores: rotate hook_q/k with its frequencies
        self.rebuilt = {l for l in layers if rot and self.rotary[l] is None
                        and adapter(model, l).score_inputs()[2] == "rebuilt"}
        self.qk_names = {l: ("q", "k") if not rot or self.rotary[l] is not None or l in self.rebuilt
                         else ("rot_q", "rot_k") for l in layers}
        self.scale = {l: attention_scale(model, l) for l in layers}     # (factor, source, soft-cap)
        self.window = {l: adapter(model, l).window() for l in layers}   # keys this far back are masked (GPT-Neo local)
        self.held: Dict[Tuple[str, int], Tensor] = {}
        self.hooks = [(hook_name(n, l), self._hold(n, l)) for l in layers for n in self.qk_names[l]]

    def _hold(self, name: str, layer: int):
        def fn(t: Tensor, hook) -> None:
            for key in [key for key in self.held if key[1] != layer]:
                del self.held[key]                  # never hold more than the current layer's q and k
            self.held[(name, layer)] = t.detach()
        return fn

    def wrap(self, fn, layer: int):
        def fixed(t: Tensor, hook):
            q = self.held.pop((self.qk_names[layer][0], layer), None)
            k = self.held.pop((self.qk_names[layer][1], layer), None)
            if q is not None and k is not None and self._is_pattern(t):
                t = self._rebuild(q, k, t, layer)
            return fn(t, hook)
        return fixed

    @staticmethod
    def _is_pattern(t: Tensor) -> bool:
        # Real scores are masked with a huge negative value above the diagonal; a pattern holds
        # probabilities there (zeros) and its rows sum to 1.
        future = torch.ones(t.shape[-2:], dtype=torch.bool, device=t.device).triu(1)
        return bool((t >= 0).all() and (t[..., future] == 0).all()
                    and torch.allclose(t.sum(-1), torch.ones((), dtype=t.dtype, device=t.device), atol=1e-3))

    def _rebuild(self, q: Tensor, k: Tensor, pattern: Tensor, layer: int) -> Tensor:
        factor, source, cap = self.scale[layer]
        if self.rotary.get(layer) is not None:
            q, k = rotate_native(self.rotary[layer], q, k)
        if layer in self.rebuilt:                    # whichever pairing reproduces the pattern, else the error
            inv, scaling, _, _ = adapter(self.model, layer).rotary_frequencies()
            specs = [RotarySpec(inv.detach().float().cpu(), style, 2 * inv.numel(), q.shape[-1], float(scaling or 1))
                     for style in STYLES]
            tries = [self._scores(rotate(sp, q), rotate(sp, k), factor, cap, self.window[layer]) for sp in specs]
            scores = min(tries, key=lambda t: float((t.softmax(-1) - pattern).abs().max()))
        else:
            scores = self._scores(q, k, factor, cap, self.window[layer])
        if not torch.allclose(scores.softmax(-1), pattern, atol=1e-4):
            how = f"q·k × {factor:.3g} ({source})" + (f", soft-capped at {cap:g}" if cap else "")
            raise QKCircuitsError(f"layer {layer}: this model's hook_attn_scores carries the attention pattern and "
                                  f"{how} does not reproduce it, so pre-softmax scores are unavailable; "
                                  f"capture 'pattern' (or 'q'/'k') instead")
        return scores.to(pattern.dtype)

    def _scores(self, q: Tensor, k: Tensor, factor: float, cap: Optional[float], window: Optional[int] = None) -> Tensor:
        scores = torch.einsum("bqhd,bkhd->bhqk", q, expand_kv(k, self.n_heads)) * factor
        if cap:                                      # the module caps before masking (Gemma-2 order)
            scores = cap * torch.tanh(scores / cap)
        p_q, p_k = scores.shape[-2:]
        masked = torch.ones(p_q, p_k, dtype=torch.bool, device=scores.device).triu(p_k - p_q + 1)
        if window:                                   # keys `window` or more positions back are masked too
            masked |= torch.ones(p_q, p_k, dtype=torch.bool, device=scores.device).tril(p_k - p_q - window)
        return scores.masked_fill(masked, torch.finfo(scores.dtype).min)


class _Stop(Exception):
    """Raised from a hook once every requested tensor exists: the rest of the forward is wasted work."""


def _run(model, tokens: Tensor, hooks: list, stop_after: Optional[int] = None, names_per_layer: int = 0,
         extra_hooks: Sequence = ()):
    """Forward with hooks and no grad that ends as soon as the last requested hook of ``stop_after`` fired.

    ``names_per_layer`` hooks are expected on layer ``stop_after``; after the last of them fires the
    pass is abandoned (skipping that block's MLP, later blocks and the unembedding).
    """
    if stop_after is not None and names_per_layer:
        prefix, fired = f"blocks.{stop_after}.", []

        def wrap(fn):
            def hooked(t, hook):
                out = fn(t, hook)
                fired.append(hook.name)
                if len(fired) == names_per_layer:
                    raise _Stop
                return out
            return hooked

        hooks = [(n, wrap(f)) if n.startswith(prefix) else (n, f) for n, f in hooks]
    try:
        with torch.no_grad():
            return model.run_with_hooks(tokens, fwd_hooks=list(extra_hooks) + hooks)
    except _Stop:
        return None


Replacement = Union[float, Tensor, Callable[[Tensor, Head], Tensor]]


@contextlib.contextmanager
def edit(model, name: str, heads: HeadsLike, replace: Replacement, *, kv_heads: bool = False) -> Iterator[None]:
    """Replace ``name`` (one of q, k, v, rot_q, rot_k, z; on MLA also q_latent, kv_latent, k_rope) for ``heads``.

    A latent or MLA's shared rotary key belongs to every head of its layer: there ``heads`` selects the layers
    and ``replace`` acts on the whole tensor.

    ``replace`` is a scalar, a tensor broadcastable to one head's slice [batch, pos, d_head],
    or ``fn(slice, head) -> new slice``. Heads name query heads; for k/v/rot_k on a model
    with grouped-query attention one KV head serves several query heads, so editing it changes
    all of them: pass ``kv_heads=True`` to confirm that the indices are KV heads. Hooks are
    removed on exit, also when the block raises. Nest ``edit`` calls to edit several names.
    """
    if name not in EDITABLE:
        raise QKCircuitsError(f"cannot edit {name!r}; editable activations are {', '.join(EDITABLE)} (patterns and "
                              f"scores are recomputed by the attention module: edit q/k/v/z instead)")
    _resolve_names(model, [name])
    shared = NAMES[name][1] == "lat" or adapter(model, 0).shared_by_heads(name)
    if shared:
        yield from _edit_shared(model, name, heads, replace)
        return
    per_kv = NAMES[name][1] == "kvh"
    n_kv = n_kv_heads(model)
    grouped = per_kv and n_kv != model.cfg.n_heads
    if grouped and not kv_heads:
        raise QKCircuitsError(f"{name!r} is shared by {model.cfg.n_heads // n_kv} query heads per KV head on this "
                              f"model (grouped-query attention); pass kv_heads=True and KV-head indices 0-{n_kv - 1}, "
                              f"or edit 'q'/'z' for a single query head")
    if kv_heads:
        from .heads import check_heads, parse_heads
        targets = check_heads(parse_heads(heads, n_heads=n_kv, n_layers=int(model.cfg.n_layers)), model.cfg.n_layers,
                              n_kv)
    else:
        targets = model_heads(model, heads)
    by_layer: Dict[int, List[Head]] = {}
    for h in targets:
        by_layer.setdefault(h.layer, []).append(h)

    def make(layer: int, hs: List[Head]):
        def fn(t: Tensor, hook) -> Tensor:
            t = t.clone()
            for h in hs:
                old = t[:, :, h.head]
                new = replace(old, h) if callable(replace) else torch.as_tensor(replace, dtype=t.dtype,
                                                                                device=t.device)
                t[:, :, h.head] = new.to(t.dtype).expand_as(old)
            return t
        return fn

    hooks = [(hook_name(name, layer), make(layer, hs)) for layer, hs in by_layer.items()]
    with model.hooks(fwd_hooks=hooks):
        yield


def _edit_shared(model, name: str, heads: HeadsLike, replace: Replacement) -> Iterator[None]:
    """Edit a tensor every head of a layer reads (an MLA latent or the shared rotary key): ``heads`` name
    the layers (any head of a layer selects it); ``replace`` gets and returns the whole [batch, pos, ...] tensor."""
    layers = sorted({h.layer for h in model_heads(model, heads)})

    def make(layer: int):
        def fn(t: Tensor, hook) -> Tensor:
            new = replace(t.clone(), Head(layer, 0)) if callable(replace) else torch.as_tensor(
                replace, dtype=t.dtype, device=t.device)
            return new.to(t.dtype).expand_as(t).clone()
        return fn

    with model.hooks(fwd_hooks=[(hook_name(name, layer), make(layer)) for layer in layers]):
        yield


def kv_index(model, head: int) -> int:
    """The KV head index query head ``head`` of ``model`` reads."""
    return kv_head(head, model.cfg.n_heads, n_kv_heads(model))


# Public inside the package (other modules import these, never the underscore names): the token check,
# the layer-list check, and the exception a hook raises to end a forward early.
as_tokens = _as_tokens
check_layers = _check_layers
StopForward = _Stop
