"""One shim for renamed keyword arguments: the old name keeps working for one release, with a DeprecationWarning.

>>> @renamed(seq_len="seg_len")
... def f(*, seg_len=40):
...     return seg_len
>>> import warnings
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     f(seq_len=7), str(caught[0].message)
(7, 'f(seq_len=...) is deprecated; use seg_len=... (the old name goes in the next release)')

Giving both names is an error (one line naming both). The vocabulary (docs/architecture.md): a model spec is
``spec``, heads ``heads`` (one: ``head``), counts ``k``, the repeated segment ``seg_len``, a whole row
``seq_len``, q/k/v inputs ``into``, token views ``view``.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any, Callable, Dict, TypeVar

from .errors import QKCircuitsError

F = TypeVar("F", bound=Callable[..., Any])


def renamed(**old_to_new: str) -> Callable[[F], F]:
    """Decorator: accept each old keyword name ``old=`` as ``new=`` (warning once per call site)."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            for old, new in old_to_new.items():
                if old in kwargs:
                    if new in kwargs:
                        raise QKCircuitsError(f"{fn.__name__}: give {new}= (the new name) or {old}= (the old one), "
                                              f"not both")
                    warnings.warn(f"{fn.__name__}({old}=...) is deprecated; use {new}=... (the old name goes in the "
                                  f"next release)", DeprecationWarning, stacklevel=2)
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        call.__renamed__ = dict(old_to_new)          # type: ignore[attr-defined]  (read by the docs/tests)
        # The signature a runtime checker binds (jaxtyping's import hook wraps this shim, not ``fn``): ``fn``'s
        # own plus each old name as an extra keyword, so ``f(seq_len=7)`` binds and reaches the renaming above.
        sig = inspect.signature(fn)
        params = list(sig.parameters.values())
        at = next((i for i, p in enumerate(params) if p.kind is p.VAR_KEYWORD), len(params))
        extra = [inspect.Parameter(old, inspect.Parameter.KEYWORD_ONLY, default=None) for old in old_to_new
                 if old not in sig.parameters]
        call.__signature__ = sig.replace(parameters=params[:at] + extra + params[at:])   # type: ignore[attr-defined]
        return call                                  # type: ignore[return-value]

    return wrap


def renames(fn: Callable[..., Any]) -> Dict[str, str]:
    """The old -> new keyword names a function accepts (empty when none)."""
    return dict(getattr(fn, "__renamed__", {}))
