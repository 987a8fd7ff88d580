"""The ```python blocks of docs/*.md run: a page's blocks in order, in one namespace (as a reader would type them),
in a fresh temporary folder (the blocks write files such as "scan.json").

A block that cannot run as written (a fragment of a module, placeholder paths, a hub name, Ray workers) carries
``<!-- no-run: why -->`` on the line before its fence; the reason is required and the number of such blocks is
capped, so the test cannot skip its way to green. A page whose runnable blocks name SmolLM2 runs under the
``smollm2`` marker, on the session's shared SmolLM2 (``qk.load("smollm2-135m")`` returns it, so a page costs no
load) and at small sizes: every call runs as written, with its prompt counts, random draws and steps capped
(``CAPS``: the blocks check that the API they show works on the model they name, not the numbers, which
docs/benchmarks.md measures; as written, the ablation page's 270-head sweep alone takes 15 minutes here). Every
other page runs in the quick suite, as written.
"""

from __future__ import annotations

import functools
import inspect
import re
import time
from pathlib import Path
from typing import Dict, List, NamedTuple

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
FENCE = re.compile(r"```python\n(.*?)```", re.S)
NO_RUN = re.compile(r"<!--\s*no-run:\s*(.*?)\s*-->\s*$")
MAX_NO_RUN = 10                 # of ~27 blocks: raising it needs a reason in the blocks themselves
# qk function -> {argument: largest value} on SmolLM2 pages (an argument not given is set to its cap)
CAPS = {"repeated_tokens": {"n_seqs": 2, "seg_len": 8}, "scan": {"n_seqs": 2, "confirm_k": 1},
        "diagnose": {"n_seqs": 2}, "compare_to_random": {"n_draws": 2}, "trace_induction": {"k": 1},
        "edge_scores": {"steps": 2}, "ov_copying": {"n_tokens": 4}, "tasks.ioi": {"n": 4}, "tasks.induction": {"n": 4},
        "sweep": {"layers": [17, 18]}}          # a list: the layers when the call sweeps all (18 ablations, not 270)


class Block(NamedTuple):
    page: str
    line: int
    code: str
    no_run: str          # the reason, or "" for a block that runs


def blocks(page: Path) -> List[Block]:
    text = page.read_text(encoding="utf-8")
    out = []
    for m in FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").splitlines()
        marker = NO_RUN.search(before[-1]) if before else None
        out.append(Block(page.name, len(before) + 1, m.group(1), marker.group(1) if marker else ""))
    return out


ALL = [b for p in sorted(DOCS.glob("*.md")) for b in blocks(p)]
PAGES: Dict[str, List[Block]] = {}
for _b in ALL:
    PAGES.setdefault(_b.page, []).append(_b)


def needs_smollm2(page: str) -> bool:
    return any("smollm2" in b.code.lower() for b in PAGES[page] if not b.no_run)


def test_blocks_are_found_and_few_are_skipped():
    skipped = [b for b in ALL if b.no_run]
    assert len(ALL) >= 25, f"found only {len(ALL)} python blocks in docs/*.md"
    assert all(len(b.no_run) >= 10 for b in skipped), "a no-run marker needs its reason"
    assert len(skipped) <= MAX_NO_RUN, [f"{b.page}:{b.line} ({b.no_run})" for b in skipped]
    assert sum(1 for p in PAGES for b in PAGES[p] if not b.no_run) >= len(ALL) - MAX_NO_RUN


def capped(f, caps: Dict[str, object]):
    """``f`` with each argument in ``caps`` at most its cap (set to the cap where the call leaves it out)."""
    sig = inspect.signature(f)

    @functools.wraps(f)
    def call(*args, **kwargs):
        bound = sig.bind_partial(*args, **kwargs)
        for name, cap in caps.items():
            given = bound.arguments.get(name)
            bound.arguments[name] = cap if given is None else given if isinstance(cap, list) else min(given, cap)
        return f(*bound.args, **bound.kwargs)
    return call


def run_page(page: str, tmp_path, monkeypatch, smollm2=None) -> Dict[str, float]:
    """Run the page's runnable blocks in order in one namespace; returns seconds per block (``page:line``)."""
    import qkcircuits as qk

    if smollm2 is not None:
        real = qk.load
        monkeypatch.setattr(qk, "load", lambda spec, *a, **kw: smollm2 if str(spec) == "smollm2-135m" else
                            real(spec, *a, **kw))
        from qkcircuits._tasks import builders

        for name, caps in CAPS.items():
            attr = name.rpartition(".")[2]
            # qk.tasks re-exports the builders: cap both (build_task, the CLI's, calls the builders' own)
            for owner in ((qk.tasks, builders) if name.startswith("tasks.") else (qk,)):
                monkeypatch.setattr(owner, attr, capped(getattr(owner, attr), caps))
    monkeypatch.chdir(tmp_path)
    registered = set(d.name for d in qk.detectors())
    ns: Dict[str, object] = {"__name__": f"docs_{page}", "qk": qk}      # the quickstart's import, as a reader has it
    seconds = {}
    try:
        for b in PAGES[page]:
            if b.no_run:
                continue
            t0 = time.perf_counter()
            try:
                # dont_inherit: compiled as a reader types it, not under this file's `from __future__ import annotations`
                exec(compile(b.code, f"docs/{page}:{b.line}", "exec", dont_inherit=True), ns)
            except Exception as e:
                raise AssertionError(f"docs/{page}, the block at line {b.line}: {type(e).__name__}: {e}") from e
            seconds[f"{page}:{b.line}"] = time.perf_counter() - t0
    finally:
        for d in qk.detectors():          # a page may register a detector (docs/detectors.md): not for the others
            if d.name not in registered:
                qk.unregister_detector(d.name)
        from qkcircuits._foundation import arch

        for name in [n for n in arch.FAMILIES if n not in arch.BUILT_IN]:     # or a family (docs/architecture.md)
            arch.unregister_family(name)
    return seconds


@pytest.mark.parametrize("page", [p for p in PAGES if not needs_smollm2(p)])
def test_page_runs(page, tmp_path, monkeypatch):
    run_page(page, tmp_path, monkeypatch)


@pytest.mark.smollm2
@pytest.mark.parametrize("page", [p for p in PAGES if needs_smollm2(p)])
def test_smollm2_page_runs(page, tmp_path, monkeypatch, smollm2):
    run_page(page, tmp_path, monkeypatch, smollm2)
    assert not any(hp._forward_hooks for hp in smollm2.hook_dict.values()), f"docs/{page} left hooks on the model"
