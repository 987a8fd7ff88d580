"""One progress bar (``_foundation/progress``): in a Jupyter kernel without ipywidgets, one display line updated in
place and emptied when the step ends; another library's tqdm bars (transformers' GGUF conversion, weight loading)
dropped from stderr while ``qk.load`` runs, everything else on stderr kept. The kernel is stood in for by
``where() == "line"`` and a recording ``display``; the notebooks themselves run in tests/test_notebook.py."""

from __future__ import annotations

import io
import sys

import pytest

from qkcircuits._foundation import progress


class Handle:
    def __init__(self, log):
        self.log = log

    def update(self, data, raw=False):
        self.log.append(("update", data["text/plain"]))


@pytest.fixture
def kernel(monkeypatch):
    log = []
    import IPython.display

    def display(data, raw=False, display_id=None):
        log.append(("display", data["text/plain"]))
        return Handle(log)

    monkeypatch.setattr(progress, "where", lambda: "line")
    monkeypatch.setattr(IPython.display, "display", display)
    monkeypatch.setattr(progress, "KERNEL_EVERY_S", 0.0)
    return log


def test_one_line_updated_in_place_and_emptied(kernel):
    bar = progress.progress_bar(total=3, desc="scan", unit="layer")
    for _ in range(3):
        bar.update(1)
    bar.close()
    assert [k for k, _ in kernel] == ["display"] + ["update"] * 4          # one output, updated, then emptied
    assert kernel[0][1].startswith("scan: 0/3 layer") and kernel[3][1].startswith("scan: 3/3 layer")
    assert kernel[-1] == ("update", "")
    assert list(progress.progress_bar([1, 2], desc="x", enabled=False)) == [1, 2] and len(kernel) == 5


def test_other_libraries_bars_are_dropped_while_loading(kernel, monkeypatch):
    from tqdm.std import tqdm

    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    with progress.quiet_other_bars("loading model.gguf"):
        for _ in tqdm(range(50), desc="Converting and de-quantizing GGUF tensors...", mininterval=0):
            pass
        print("qkcircuits: using device cpu", file=sys.stderr)
    assert sys.stderr is err
    assert err.getvalue() == "qkcircuits: using device cpu\n"               # the bar gone, the message kept
    assert kernel[0][1].startswith("loading model.gguf (") and kernel[-1] == ("update", "")


def test_outside_a_kernel_nothing_changes(monkeypatch):
    monkeypatch.setattr(progress, "where", lambda: "terminal")
    before = sys.stderr
    with progress.quiet_other_bars("loading"):
        assert sys.stderr is before
    from tqdm.std import tqdm

    assert isinstance(progress.progress_bar(total=2, desc="x"), tqdm)
