"""One argument check for the public entry points: a misuse fails with a ``QKCircuitsError`` that names the
argument, what it got and what it accepts (not an ``AttributeError`` three calls down).

>>> check_model("toy-induction").cfg.n_layers     # a spec that loads in a blink is simply loaded
2
>>> check_model("gpt2")
Traceback (most recent call last):
...
qkcircuits._foundation.errors.QKCircuitsError: model must be a loaded model, got the spec string 'gpt2'; call model = qk.load('gpt2') first and pass that
>>> check_tokens([["a", "b"]])
Traceback (most recent call last):
...
qkcircuits._foundation.errors.QKCircuitsError: tokens must be token ids (an integer tensor [batch, pos]), got a list of strings; turn text into ids with model.to_tokens(text)
>>> check_integer("offset", "x")
Traceback (most recent call last):
...
qkcircuits._foundation.errors.QKCircuitsError: offset must be an integer, got 'x' (str)
"""

from __future__ import annotations

import os
from typing import Any

from .errors import QKCircuitsError
from .arch.model_facts import is_model
from .io import check_int  # noqa: F401  (re-exported: the positive-integer check)

# Specs cheap enough to load on the caller's behalf (no download, < 1 s).
CHEAP_SPECS = ("toy-induction",)


def check_model(model: Any, arg: str = "model", *, spec_ok: bool = False) -> Any:
    """``model`` if it is a loaded model (has ``cfg``); a spec string is loaded when cheap (``CHEAP_SPECS``),
    passed through when ``spec_ok`` (the Ray backend loads it on the workers), else refused with how to load."""
    if is_model(model):
        return model
    if isinstance(model, (str, os.PathLike)):
        spec = os.fspath(model)
        if spec_ok:
            return model
        if spec.lower() in CHEAP_SPECS:
            from .model import load

            return load(spec, verbose=False)
        raise QKCircuitsError(f"{arg} must be a loaded model, got the spec string {spec!r}; call model = "
                              f"qk.load({spec!r}) first and pass that")
    raise QKCircuitsError(f"{arg} must be a model from qk.load (a TransformerBridge), got {type(model).__name__}")


def describe(value: Any) -> str:
    """A value as an error line shows it: ``None``, ``the string 'x'``, ``int 5``, ``a HeadScores``.

    >>> describe(None), describe("induction"), describe(5), describe([1])
    ('None', "the string 'induction'", 'int 5', 'list [1]')
    """
    if value is None:
        return "None"
    if isinstance(value, str):
        return f"the string {value[:40]!r}"
    if isinstance(value, (bool, int, float, list, tuple, dict, set)):
        return f"{type(value).__name__} {repr(value)[:40]}"
    return f"a {type(value).__name__}"


def require_model(model: Any, arg: str = "model") -> Any:
    """``model`` if it is a loaded model; anything else (a spec string, None, a task ...) is one line saying what
    is taken. Where no loaded model can be handed back (``model_heads``, ``check_task``), a cheap spec is refused
    too, with the call that loads it.

    >>> require_model(None)
    Traceback (most recent call last):
    ...
    qkcircuits._foundation.errors.QKCircuitsError: model must be a model from qk.load(...) (a TransformerBridge), got None
    """
    if is_model(model):
        return model
    if isinstance(model, (str, os.PathLike)):
        spec = os.fspath(model)
        raise QKCircuitsError(f"{arg} must be a loaded model, got the spec string {spec[:80]!r}; call model = "
                              f"qk.load({spec[:80]!r}) first and pass that")
    raise QKCircuitsError(f"{arg} must be a model from qk.load(...) (a TransformerBridge), got {describe(model)}")


def check_tokens(tokens: Any, arg: str = "tokens") -> Any:
    """``tokens`` unchanged if it is token ids: an integer tensor (or nested lists of ints) of 1 or 2 dims."""
    if tokens is None:
        return tokens
    import torch

    if isinstance(tokens, (list, tuple)):
        flat = tokens
        while isinstance(flat, (list, tuple)) and flat:
            flat = flat[0]
        if isinstance(flat, str):
            raise QKCircuitsError(f"{arg} must be token ids (an integer tensor [batch, pos]), got a list of strings; "
                                  f"turn text into ids with model.to_tokens(text)")
        if isinstance(flat, float) or isinstance(flat, bool):
            raise QKCircuitsError(f"{arg} must be integer token ids, got a list of {type(flat).__name__}s")
        return tokens
    if isinstance(tokens, str):
        raise QKCircuitsError(f"{arg} must be token ids (an integer tensor [batch, pos]), got a string; use "
                              f"model.to_tokens({tokens[:20]!r})")
    if isinstance(tokens, torch.Tensor):
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise QKCircuitsError(f"{arg} must be an integer tensor of token ids, got dtype {tokens.dtype}; use "
                                  f"tokens.long() if the values are ids")
        if tokens.dim() not in (1, 2):
            raise QKCircuitsError(f"{arg} must be [batch, pos] (or [pos]) token ids, got shape {tuple(tokens.shape)}")
        return tokens
    raise QKCircuitsError(f"{arg} must be token ids (an integer tensor [batch, pos]), got {type(tokens).__name__}")


def check_integer(name: str, value: Any) -> int:
    """``value`` if it is an integer (a bool or a float is not), any sign."""
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise QKCircuitsError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    return int(value)
