"""What the report and the app show for one head, as plain JSON-ready data (no HTML, no plotly here).

>>> ctx = ViewContext(model)                                  # per-model caches
>>> ids = token_set(model)                                    # a readable set of common tokens (toy: all 32)
>>> qk_grid(ctx, Head(1, 0), ids).shape                       # [n, n] token-to-token QK scores
torch.Size([32, 32])
>>> values, out_ids = ov_top(ctx, Head(1, 0), ids, k=5)       # source token -> top output tokens
>>> values.shape, out_ids.shape
(torch.Size([32, 5]), torch.Size([32, 5]))
>>> {str(h): p.shape for h, p in attention(ctx, [Head(1, 0)], prompt_ids(model, None)).items()}   # [q, k] pattern
{'1.0': torch.Size([25, 25])}

Every number is computed from a few rows of the circuits, never a vocab × vocab matrix:
QK over a token set is X[ids] W_Q (X[ids] W_K)ᵀ · scale; the OV view is X[ids] W_V W_O U / s ([n, vocab])
with the copying rank of each source token; X is what the head's layer reads for each token,
``view="direct"|"effective"|"contextual"`` (``qkcircuits._weights.contextual``; default contextual past layer 0,
direct at layer 0). Like ``full_qk``/``full_ov`` both leave the biases out; the positional profile is
``qkcircuits._weights.offsets.head_offset_profile`` (the CLI's too); K-composition
partners come from ``composition_scores``.
"""

from __future__ import annotations

import math
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from jaxtyping import Float
from torch import Tensor

from .._foundation.capture import capture, has_rotary
from .._foundation.errors import QKCircuitsError
from .._foundation.heads import Head, model_heads
from .._weights.qk_ov import attn_scale, embed_rows, layer_weights, unembed_cols
from .._foundation.lru import LRU
from .._weights.contextual import TokenInputs, check_input, head_logits, mid_rank, token_inputs

# Common English tokens that make a QK heatmap readable (those that are one token in the model's vocabulary).
COMMON_WORDS = (" the", " of", " and", " to", " a", " in", " is", " that", " it", " for", " was", " on", " with",
                " he", " she", " they", " his", " her", " at", " by", " from", " not", " this", " are", ",", ".",
                " The", " I", " you", " Mr", " cat", " dog", " Paris", " France", " John", " Mary")
# A sentence said twice, so that induction heads light up on real text: its second copy is predictable.
DEFAULT_PROMPT = ("Maria kept the old maps of the coast in the lowest drawer of the library, tied with faded ribbon. "
                  "Maria kept the old maps of the coast in the lowest drawer of the library, tied with faded ribbon.")
MAX_TOKENS = 64          # token-set size (heatmap side)
MAX_PROMPT = 256         # prompt length in tokens for attention patterns
MAX_OFFSET = 64          # positional profile: offsets 0..MAX_OFFSET


def _tok(model):
    return getattr(model, "tokenizer", None)


def token_strings(model, ids: Sequence[int]) -> List[str]:
    """Each id as text (``decode([id])``), or ``"#id"`` for models without a tokenizer."""
    tok = _tok(model)
    if tok is None:
        return [f"#{int(i)}" for i in ids]
    return [tok.decode([int(i)]) for i in ids]


def _check_id(model, i: int, what: str) -> int:
    V = int(model.cfg.d_vocab)
    if not 0 <= i < V:
        raise QKCircuitsError(f"{what} {i} is outside the vocabulary 0-{V - 1}")
    return i


def token_set(model, tokens: Optional[Sequence[str]] = None) -> List[int]:
    """Token ids for the QK/OV views: ``tokens`` (each a single token's text, or ``#id`` / a bare id), or
    by default the ``COMMON_WORDS`` that are single tokens (models without a tokenizer: ids 0..min(V, 32)-1)."""
    tok = _tok(model)
    if tokens is None or len(tokens) == 0:
        if tok is None:
            return list(range(min(int(model.cfg.d_vocab), 32)))
        ids = []
        for w in COMMON_WORDS:
            enc = tok.encode(w, add_special_tokens=False)
            if len(enc) == 1 and enc[0] not in ids:
                ids.append(int(enc[0]))
        return ids
    if len(tokens) > MAX_TOKENS:
        raise QKCircuitsError(f"{len(tokens)} tokens given; at most {MAX_TOKENS} fit a readable heatmap")
    ids = []
    for t in tokens:
        if not isinstance(t, str):
            raise QKCircuitsError(f"tokens must be strings (text of one token, or #id), got {t!r}")
        s = t[1:] if t.startswith("#") else t
        if s.strip().isdigit() and (t.startswith("#") or tok is None):
            ids.append(_check_id(model, int(s), "token id"))
            continue
        if tok is None:
            raise QKCircuitsError(f"this model has no tokenizer: give token ids such as '#3' or '3', not {t!r}")
        enc = tok.encode(t, add_special_tokens=False)
        if len(enc) != 1:
            raise QKCircuitsError(f"{t!r} is {len(enc)} tokens ({token_strings(model, enc)}); give text that is exactly "
                                  f"one token (mind the leading space, e.g. ' the'), or '#id'")
        ids.append(int(enc[0]))
    return ids


def prompt_ids(model, prompt: Optional[str]) -> List[int]:
    """Token ids of ``prompt`` led by BOS; models without a tokenizer take space-separated ids.

    Default: ``DEFAULT_PROMPT`` (a sentence said twice), or for models without a tokenizer BOS + a
    fixed 12-token sequence twice, so induction and previous-token heads show their pattern.
    """
    from .._foundation.sequences import bos_id

    tok, bos = _tok(model), bos_id(model)
    if prompt is None:
        if tok is None:
            V = int(model.cfg.d_vocab)
            body = [(7 * i + 3) % (V - 1) + 1 for i in range(min(12, V - 1))]
            return [bos] + body + body
        prompt = DEFAULT_PROMPT
    if not isinstance(prompt, str) or not prompt.strip():
        raise QKCircuitsError("the prompt is empty; give some text (or token ids for a model without a tokenizer)")
    if tok is None:
        try:
            ids = [int(x) for x in prompt.replace(",", " ").split()]
        except ValueError:
            raise QKCircuitsError("this model has no tokenizer: give the prompt as space-separated token ids, "
                                  f"e.g. '0 5 9 5', not {prompt[:40]!r}") from None
        ids = [_check_id(model, i, "prompt token id") for i in ids]
        body = ids
    else:
        body = tok.encode(prompt, add_special_tokens=False)
    ids = [bos] + list(body) if not body or body[0] != bos else list(body)
    limit = min(MAX_PROMPT, int(model.cfg.n_ctx))
    if len(ids) > limit and prompt == DEFAULT_PROMPT:
        # the default sentence said twice does not fit this model's context: a shorter start of it, said twice
        half = tok.encode(DEFAULT_PROMPT[:len(DEFAULT_PROMPT) // 2], add_special_tokens=False)[:(limit - 1) // 2]
        return [bos] + half + half
    if len(ids) > limit:
        raise QKCircuitsError(f"the prompt is {len(ids)} tokens (with BOS); at most {limit} are shown")
    return ids


INPUTS_CACHE = 64      # token sets x layers x inputs kept by a ViewContext


class ViewContext:
    """Per-model caches for the views: normalised embedding rows, unembedding, layer weights, and the
    weight-only scores (eigenvalue copying, K-composition) computed on first use.

    Memory: one [d_model, vocab] unembedding view plus, per layer used, its attention weights, plus at most
    ``INPUTS_CACHE`` token-input sets (least recently used dropped first).
    """

    def __init__(self, model):
        # weakly: a context is remembered per model (model_cache), and a value that held its key would keep the
        # model alive for ever
        self._model = weakref.ref(model)
        self._U: Optional[Tensor] = None
        self._weights: Dict[int, object] = {}
        self._eigen: Optional[Tensor] = None
        self._kcomp = None
        self._rotary: Dict[int, object] = {}
        # bounded: a long-running app sees a new token set per request (each entry ~50 kB for 64 tokens)
        self._inputs = LRU(INPUTS_CACHE)

    @property
    def model(self):
        model = self._model()
        if model is None:
            raise QKCircuitsError("this view context's model is gone; make one for a loaded model")
        return model

    def weights(self, layer: int):
        if layer not in self._weights:
            self._weights[layer] = layer_weights(self.model, layer)
        return self._weights[layer]

    def embed(self, layer: int, ids: Sequence[int]) -> Tensor:
        with torch.no_grad():
            E = self.model.W_E.detach()[torch.as_tensor(list(ids), device=self.model.W_E.device)]
            from .._weights.qk_ov import normalize_rows
            return normalize_rows(self.model, E, "ln1", layer)

    def rotary(self, layer: int):
        """``rotary_spec(model, layer=layer)``, verified once per layer (its check is a partial forward)."""
        if layer not in self._rotary:
            from .._weights.rotary import rotary_spec
            self._rotary[layer] = rotary_spec(self.model, layer=int(layer))
        return self._rotary[layer]

    def inputs(self, layer: int, ids: Sequence[int], input: Optional[str] = None) -> TokenInputs:
        """``token_inputs`` for ``layer`` (cached per layer, token set and input; the default input is
        contextual past layer 0, direct at layer 0)."""
        key = (int(layer), tuple(int(i) for i in ids), check_input(input, layer))
        if key not in self._inputs:
            self._inputs[key] = token_inputs(self.model, key[0], list(key[1]), key[2])
        return self._inputs[key]

    def unembed(self) -> Tensor:
        if self._U is None:
            self._U = unembed_cols(self.model)
        return self._U

    def eigen_copying(self) -> Tensor:
        """Elhage's eigenvalue copying score of W_E OV W_U for every head ([layer, head])."""
        if self._eigen is None:
            from .._weights.copying import copying_scores
            full = self.model.W_E.shape[0] == self.model.W_U.shape[-1]
            self._eigen = copying_scores(self.model, full=full)
        return self._eigen

    def k_composition(self):
        if self._kcomp is None:
            from .._weights.composition import composition_scores
            self._kcomp = composition_scores(self.model, "K")
        return self._kcomp


INPUT_TITLES = {"direct": "direct inputs (token embeddings)",
                "effective": "effective inputs (embedding + block 0 on the token)",
                "contextual": "contextual inputs (mean residual at the layer over a corpus)"}


def qk_grid(ctx: ViewContext, head: Head, ids: Sequence[int], view: Optional[str] = None
            ) -> Float[Tensor, "query key"]:
    """Token-to-token pre-softmax score (no position, no biases): X[q] W_Q W_Kᵀ X[k]ᵀ · scale, with X the
    rows the head's layer reads for each token (``view``: direct, effective or contextual; default
    contextual past layer 0). ``view="direct"`` gives the rows/columns ``ids`` of ``full_qk``."""
    w = ctx.weights(head.layer)
    X = ctx.inputs(head.layer, ids, view).rows
    with torch.no_grad():
        q = X.to(w.W_Q.dtype) @ w.W_Q[head.head]
        k = X.to(w.W_K.dtype) @ w.W_K[head.head]
        return (q @ k.T * attn_scale(ctx.model, head.layer)).float().cpu()


def ov_view(ctx: ViewContext, head: Head, ids: Sequence[int], k: int = 5, view: Optional[str] = None
            ) -> Dict[str, object]:
    """For each source token: the ``k`` output tokens whose logits the head's write raises most, and the
    copying rank of the source token itself among all output logits (1 = top; ties share ranks).

    Returns {"values" [n, k], "ids" [n, k], "ranks" [n], "input", "source" (per token), "note"}.
    Memory: one [n, vocab] block."""
    x = ctx.inputs(head.layer, ids, view)
    logits, used = head_logits(ctx.model, head, ids, x.input)
    ranks = mid_rank(logits, torch.as_tensor(list(ids), dtype=torch.long))
    vals, idx = logits.topk(min(int(k), logits.shape[-1]), dim=-1)
    return {"values": vals, "ids": idx, "ranks": ranks, "input": x.input, "source": list(x.source),
            "note": used.note}


def ov_top(ctx: ViewContext, head: Head, ids: Sequence[int], k: int = 5, view: Optional[str] = None
           ) -> Tuple[Tensor, Tensor]:
    """(values [n, k], ids [n, k]) of the ``k`` output tokens each source token's OV write raises most
    (``ov_view`` without the ranks)."""
    v = ov_view(ctx, head, ids, k, view)
    return v["values"], v["ids"]


def positional_profile(ctx: ViewContext, head: Head, max_offset: int = MAX_OFFSET) -> Optional[Dict[str, object]]:
    """Score against offset Δ = i − j (query i, key j), or None when the QK circuit has no position in it:
    ``head_offset_profile`` (``_weights/offsets``), the one profile `qkcircuits circuits --head` prints (rotary:
    mean query · R(Δ) · mean key over the rows the layer reads in the corpus; learned: W_pos QK W_posᵀ along
    diagonals)."""
    from .._weights.offsets import head_offset_profile

    spec = ctx.rotary(head.layer) if has_rotary(ctx.model) else None
    return head_offset_profile(ctx.model, head, max_offset, spec=spec)


def k_partners(ctx: ViewContext, head: Head, top: int = 5) -> List[Tuple[str, float]]:
    """Earlier heads whose OV output this head's key side reads most (K-composition, random baseline removed)."""
    if head.layer == 0:
        return []
    return [(str(h), v) for h, v in ctx.k_composition().partners(head, top, -math.inf)]


def attention(ctx: ViewContext, heads: Sequence[Head], ids: Sequence[int]) -> Dict[Head, Tensor]:
    """Attention pattern [q, k] of each head on one prompt (one forward, stopped after the last layer needed)."""
    heads = model_heads(ctx.model, list(heads))
    if not heads:
        return {}
    layers = sorted({h.layer for h in heads})
    acts = capture(ctx.model, torch.tensor([list(ids)]), ["pattern"], layers=layers)
    return {h: acts["pattern", h.layer][0, h.head].float().cpu() for h in heads}
