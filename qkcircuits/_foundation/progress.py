"""One progress bar for every long step: a terminal bar on stderr, one line in Jupyter that disappears when done.

>>> bar = progress_bar(total=3, desc="scan", unit="layer", enabled=False)    # disabled: a silent stand-in
>>> for _ in range(3): bar.update(1)
>>> bar.close(); bar.n
3
>>> list(progress_bar([1, 2], desc="layers", enabled=False))                 # wraps an iterable too
[1, 2]

Where it draws (decided once per bar, ``where()``):

- **terminal / script** (no IPython kernel): tqdm's text bar on stderr, removed when done (``leave=False``).
- **Jupyter kernel with ipywidgets**: tqdm's widget bar, one per step, hidden when done (``leave=False``).
- **Jupyter kernel without ipywidgets**: ``tqdm.auto`` would print ``TqdmWarning: IProgress not found`` and then
  write every refresh to stderr, which a notebook stores as one output chunk per refresh (measured on the example
  notebook: 92 chunks). Here instead ONE display output per step (``display_id``) is updated in place (at most
  every ``KERNEL_EVERY_S`` seconds) with "scan: 12/60 layer" and emptied when the step ends: the cell shows
  one line while it runs and nothing afterwards, and a saved notebook holds no progress text
  (tests/test_notebook.py counts).
"""

from __future__ import annotations

import sys
import time
import uuid
from contextlib import contextmanager
from typing import Iterable, Iterator, Optional

KERNEL_EVERY_S = 0.5          # seconds between two in-place updates of the notebook line


def in_kernel() -> bool:
    """True inside a Jupyter (IPython) kernel, False in a terminal, a script or a terminal IPython."""
    ip = sys.modules.get("IPython")
    if ip is None:
        return False
    try:
        shell = ip.get_ipython()
    except Exception:              # an IPython too old or half-imported: not a kernel we can draw in
        return False
    return shell is not None and getattr(shell, "kernel", None) is not None


def quiet_tqdm_auto() -> None:
    """In a kernel without ipywidgets, import ``tqdm.auto`` once with its "IProgress not found" warning ignored:
    transformers, huggingface_hub and TransformerLens import it, and its one warning would open every notebook.
    Their own bars then fall back to tqdm's text bar, as ``tqdm.auto`` does after the warning."""
    if "tqdm.auto" in sys.modules or not in_kernel() or has_widgets():
        return
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*IProgress not found.*")
        import tqdm.auto  # noqa: F401


def has_widgets() -> bool:
    """ipywidgets importable (tqdm's notebook bar needs it)."""
    try:
        import ipywidgets  # noqa: F401
    except Exception:
        return False
    return True


def where() -> str:
    """``"terminal"``, ``"widget"`` (kernel + ipywidgets) or ``"line"`` (kernel, no ipywidgets)."""
    if not in_kernel():
        return "terminal"
    return "widget" if has_widgets() else "line"


class _Silent:
    """The bar when progress is off: counts, draws nothing."""

    def __init__(self, iterable: Optional[Iterable] = None, total: Optional[int] = None):
        self.iterable, self.total, self.n = iterable, total, 0

    def update(self, n: int = 1) -> None:
        self.n += n

    def close(self) -> None:
        pass

    def __iter__(self) -> Iterator:
        for x in self.iterable or ():
            yield x
            self.n += 1

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _KernelLine(_Silent):
    """One display output updated in place, emptied by ``close`` (a kernel without ipywidgets)."""

    def __init__(self, iterable: Optional[Iterable] = None, total: Optional[int] = None, desc: str = "",
                 unit: str = "it"):
        super().__init__(iterable, total if total is not None else _len(iterable))
        self.desc, self.unit, self.t0, self.shown = desc, unit, time.perf_counter(), 0.0
        self.handle = None
        self.closed = False
        self._draw(force=True)

    def _text(self) -> str:
        if not self.unit:                                  # a step without counts: its name and time
            return f"{self.desc} ({time.perf_counter() - self.t0:.0f} s)"
        of = f"/{self.total}" if self.total else ""
        return f"{self.desc}: {self.n}{of} {self.unit} ({time.perf_counter() - self.t0:.0f} s)"

    def _draw(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self.shown < KERNEL_EVERY_S:
            return
        self.shown = now
        from IPython.display import display

        data = {"text/plain": self._text()}
        if self.handle is None:
            self.handle = display(data, raw=True, display_id=f"qk-progress-{uuid.uuid4().hex}")
        else:
            self.handle.update(data, raw=True)

    def update(self, n: int = 1) -> None:
        super().update(n)
        if not self.closed:
            self._draw()

    def close(self) -> None:
        if not self.closed and self.handle is not None:
            self.handle.update({"text/plain": ""}, raw=True)   # the line goes; nothing stays in the notebook
        self.closed = True


class _NoRedraws:
    """stderr while another library's step runs in a kernel without ipywidgets: tqdm's redraws (writes that begin
    with a carriage return) and the blank line a finished bar leaves are dropped, everything else passes."""

    def __init__(self, stream):
        self.stream, self.dropped = stream, False

    def write(self, text: str) -> int:
        if text.startswith("\r") or (self.dropped and not text.strip()):
            self.dropped = True
            return len(text)
        self.dropped = False
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


@contextmanager
def quiet_other_bars(desc: str):
    """Around a step whose bars are another library's (transformers' GGUF conversion and weight loading, the hub's
    downloads): in a kernel without ipywidgets their tqdm text bars would be stored as output chunks, so they are
    dropped and one line (``desc`` and its time) shows instead, emptied when the step ends. Elsewhere: nothing."""
    if where() != "line":
        yield
        return
    line = _KernelLine(None, None, desc, "")
    stderr, sys.stderr = sys.stderr, _NoRedraws(sys.stderr)
    try:
        yield
    finally:
        sys.stderr = stderr
        line.close()


def _len(iterable) -> Optional[int]:
    try:
        return len(iterable)
    except TypeError:
        return None


def progress_bar(iterable: Optional[Iterable] = None, *, total: Optional[int] = None, desc: str = "",
                 unit: str = "it", enabled: bool = True):
    """A bar with ``update(n)``, ``close()``, iteration and ``with``; where it draws: the module docs."""
    if not enabled:
        return _Silent(iterable, total if total is not None else _len(iterable))
    kind = where()
    if kind == "line":
        return _KernelLine(iterable, total, desc, unit)
    if kind == "widget":
        from tqdm.notebook import tqdm
        return tqdm(iterable, total=total, desc=desc, unit=unit, leave=False)
    from tqdm.std import tqdm
    return tqdm(iterable, total=total, desc=desc, unit=unit, leave=False, file=sys.stderr)
