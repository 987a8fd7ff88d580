"""Norms are read off their modules once per scan (``arch.norms.read_once``), with the same scores as before."""

from __future__ import annotations

import contextlib

import pytest
import torch

import qkcircuits as qk
from qkcircuits._foundation.model_cache import forget
import qkcircuits._analysis.detect as detect
from qkcircuits._foundation.arch import norms
from qkcircuits._foundation.arch.norms import block_norm, final_norm, read_once

import _tiny


@pytest.fixture(scope="module")
def llama_raw(tmp_path_factory):
    """Raw weights: the norms carry real (perturbed) weights, so a stale read would show."""
    return qk.load(str(_tiny.llama_dir(tmp_path_factory)), device="cpu", fold_ln=False, verbose=False)


def _counting(monkeypatch):
    calls = []
    real = norms._read_norm

    def counted(module, *a, **k):
        calls.append(id(module))
        return real(module, *a, **k)

    monkeypatch.setattr(norms, "_read_norm", counted)
    return calls


def test_a_scan_reads_each_norm_module_once_and_scores_as_without_the_memo(llama_raw, monkeypatch):
    kw = dict(n_seqs=3, seg_len=8, prefix_seqs=2, prefix_len=6, ov_tokens=8, progress=False)
    calls = _counting(monkeypatch)
    forget(llama_raw)                     # nothing remembered of the model: the weight-only scores computed too
    got = qk.scan(llama_raw, **kw)
    n_norms = llama_raw.cfg.n_layers + 1                                   # every ln1 and the final norm
    assert len(calls) == len(set(calls)) == n_norms
    calls.clear()
    monkeypatch.setattr(detect, "read_once", contextlib.nullcontext)      # as before: every use reads again
    forget(llama_raw)                     # (a second scan would take the weight-only scores from the store)
    plain = qk.scan(llama_raw, **kw)
    assert len(calls) > 2 * n_norms
    assert set(got.scores) == set(plain.scores)
    for name in got.scores:
        assert torch.equal(got.scores[name], plain.scores[name]), name


def test_reads_are_shared_only_inside_the_block_and_a_later_edit_is_seen(llama_raw):
    with read_once():
        first = block_norm(llama_raw, 1)
        assert block_norm(llama_raw, 1) is first and final_norm(llama_raw) is final_norm(llama_raw)
        with read_once():                                                  # nested: the outer block's reads
            assert block_norm(llama_raw, 1) is first
    assert block_norm(llama_raw, 1) is not first
    w = llama_raw.blocks[1].ln1.weight
    with torch.no_grad():
        w.mul_(2.0)
    try:
        assert torch.allclose(block_norm(llama_raw, 1).weight, 2 * first.weight)
    finally:
        with torch.no_grad():
            w.div_(2.0)
