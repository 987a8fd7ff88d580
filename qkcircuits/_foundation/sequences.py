"""Prompt sets for detectors and ablations, reproducible from a seed.

>>> tokens = repeated_tokens(model, n_seqs=2, seg_len=5, seed=0)
>>> tokens.shape                                # [BOS] + R + R, R drawn without replacement
torch.Size([2, 11])
>>> bool((tokens[:, 1:6] == tokens[:, 6:]).all()), len(set(tokens[0, 1:6].tolist()))
(True, 5)

Segments avoid special tokens and, on real vocabularies, the extremes of the id range: BPE
vocabularies list bytes and the most frequent merges first and the rarest merges last, so
the middle of the range holds ordinary, mid-frequency tokens (Olsson et al. avoid the most
and least common tokens for the same reason). Inside one segment tokens are distinct: a
token that occurs twice would split even a perfect induction head's attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from typing import List, Optional, Sequence

import torch
from jaxtyping import Int
from torch import Tensor

from .errors import QKCircuitsError
from .model_cache import remembered

# Vocabularies at least this large are treated as real BPE vocabularies and trimmed at both ends.
_TRIM_FROM = 1000
_TRIM_LOW, _TRIM_HIGH = 0.02, 0.10


@dataclass(frozen=True)
class TokenPool:
    """The token ids random segments are drawn from, and the BOS id put in front."""

    ids: Tensor
    bos_id: Optional[int]


def check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise QKCircuitsError(f"seed must be a non-negative integer, got {seed!r}")
    return seed


def bos_id(model, bos: Optional[int] = None) -> Optional[int]:
    """The BOS id to prepend: ``bos`` if given, else the tokenizer's BOS (or EOS, as GPT-2 uses), else 0."""
    if bos is not None:
        return int(bos)
    tok = getattr(model, "tokenizer", None)
    if tok is not None:
        for attr in ("bos_token_id", "eos_token_id"):
            if getattr(tok, attr, None) is not None:
                return int(getattr(tok, attr))
    return 0


def token_pool(model, *, bos: Optional[int] = None, exclude: Sequence[int] = ()) -> TokenPool:
    """Ids usable in random segments: no special tokens, no BOS, the id-range extremes trimmed (big vocabs).

    Cached per model, tokenizer, BOS and ``exclude`` (decoding a 49k vocabulary to drop unprintable tokens
    costs ~0.1 s, and a scan asks several times); each call gets its own copy of the ids."""
    V = int(model.cfg.d_vocab)
    b = bos_id(model, bos)
    tok = getattr(model, "tokenizer", None)
    key = (V, b, tuple(sorted(int(x) for x in exclude)), id(tok))
    pool = remembered(model, "token pool", key, lambda: _token_pool(model, V, b, exclude, tok))
    return TokenPool(ids=pool.ids.clone(), bos_id=pool.bos_id)


def _token_pool(model, V: int, b: Optional[int], exclude: Sequence[int], tok) -> TokenPool:
    banned = set(int(x) for x in exclude) | ({b} if b is not None else set())
    if tok is not None:
        banned |= set(int(x) for x in getattr(tok, "all_special_ids", []) or [])
        V = min(V, len(tok))  # padded embedding rows beyond the tokenizer are never real tokens
    lo, hi = (int(V * _TRIM_LOW), int(V * (1 - _TRIM_HIGH))) if V >= _TRIM_FROM else (0, V)
    ids = torch.tensor([i for i in range(lo, hi) if i not in banned], dtype=torch.long)
    if tok is not None and V >= _TRIM_FROM:
        # Tokens that decode to nothing printable (control bytes, lone whitespace) make poor probes.
        texts = tok.convert_ids_to_tokens(ids.tolist())
        keep = [i for i, t in zip(ids.tolist(), texts) if t and str(t).strip(" \u0120\u2581\u010a\n\t")]
        ids = torch.tensor(keep, dtype=torch.long)
    if len(ids) == 0:
        raise QKCircuitsError(f"no usable token ids in a vocabulary of {V} after excluding special tokens")
    return TokenPool(ids=ids, bos_id=b)


def segment_length(model, n_repeats: int = 2, preferred: int = 40, pool: Optional[TokenPool] = None) -> int:
    """The default length of R: ``preferred``, capped so that [BOS] + R × ``n_repeats`` fits the context
    and R can be drawn without repeats from the token pool (a repeat splits a perfect head's attention).

    >>> segment_length(model)                        # toy-induction: 31 usable ids in its vocabulary
    31
    """
    pool = pool or token_pool(model)
    return max(2, min(preferred, len(pool.ids), (model.cfg.n_ctx - 1) // n_repeats))


def repeated_tokens(model, n_seqs: int = 8, seg_len: int = 40, n_repeats: int = 2, *, seed: int = 0,
                    bos: Optional[int] = None, prepend_bos: bool = True,
                    pool: Optional[TokenPool] = None, length_name: str = "seg_len") -> Int[Tensor, "n_seqs pos"]:
    """``n_seqs`` sequences of ``[BOS] + R × n_repeats`` with R a random segment of ``seg_len`` tokens.

    R is drawn without replacement from ``token_pool`` when the pool is large enough (else with
    replacement, which lowers a perfect head's score: see docs/detectors.md). On the model's device.
    ``length_name`` is how the caller's user names ``seg_len`` (e.g. ``"--seg-len"``) in the error
    raised when the sequences do not fit the context.
    """
    check_seed(seed)
    for name, val, least in (("n_seqs", n_seqs, 1), ("seg_len", seg_len, 2), ("n_repeats", n_repeats, 2)):
        if isinstance(val, bool) or not isinstance(val, int) or val < least:
            raise QKCircuitsError(f"{name} must be an integer >= {least}, got {val!r}")
    pool = pool or token_pool(model, bos=bos)
    total = seg_len * n_repeats + (1 if prepend_bos else 0)
    if total > model.cfg.n_ctx:
        raise QKCircuitsError(f"{n_repeats} x {seg_len} tokens{' + BOS' if prepend_bos else ''} = {total} exceeds "
                              f"the model's context of {model.cfg.n_ctx}; use a shorter {length_name}")
    g = torch.Generator().manual_seed(seed)
    if len(pool.ids) >= seg_len:
        idx = torch.stack([torch.randperm(len(pool.ids), generator=g)[:seg_len] for _ in range(n_seqs)])
    else:
        idx = torch.randint(0, len(pool.ids), (n_seqs, seg_len), generator=g)
    seg = pool.ids[idx]
    parts: List[Tensor] = [seg] * n_repeats
    if prepend_bos:
        parts.insert(0, torch.full((n_seqs, 1), pool.bos_id if pool.bos_id is not None else 0, dtype=torch.long))
    return torch.cat(parts, dim=1).to(model.W_E.device)


def natural_text() -> str:
    """A few paragraphs of plain English prose shipped with the package (written for it, public domain)."""
    return resources.files("qkcircuits").joinpath("data/natural_text.txt").read_text(encoding="utf-8")


def text_tokens(model, text: Optional[str] = None, *, seq_len: int = 128, n_seqs: Optional[int] = None,
                bos: Optional[int] = None) -> Int[Tensor, "n_seqs pos"]:
    """Tokenize ``text`` (default: ``natural_text()``) into rows of ``seq_len`` tokens, each led by BOS."""
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        raise QKCircuitsError("natural-text prompts need a tokenizer, and this model has none; use repeated "
                              "random tokens instead")
    if seq_len < 2 or seq_len + 1 > model.cfg.n_ctx:
        raise QKCircuitsError(f"seq_len {seq_len} must be between 2 and {model.cfg.n_ctx - 1} for this model")
    ids = tok(text if text is not None else natural_text(), add_special_tokens=False)["input_ids"]
    rows = len(ids) // seq_len
    if n_seqs is not None:
        rows = min(rows, n_seqs)
    if rows == 0:
        raise QKCircuitsError(f"the text has {len(ids)} tokens, fewer than one row of seq_len={seq_len}")
    body = torch.tensor(ids[: rows * seq_len], dtype=torch.long).view(rows, seq_len)
    b = bos_id(model, bos)
    return torch.cat([torch.full((rows, 1), b, dtype=torch.long), body], 1).to(model.W_E.device)
