"""Lean LayerNorm folding (qk.load's default): the same weights as TransformerLens's own processing.

Ground truth: ``enable_compatibility_mode()`` as TransformerLens ships it (``lean=False``) and the
raw Hugging Face model (folding keeps log-probabilities). Memory figures are a benchmark
(benchmarks/bench_memory.py), not a test.
"""

from __future__ import annotations

import pytest
import torch

import _tiny
import qkcircuits as qk
from qkcircuits._foundation import lean as _lean

TEXT = "The river town woke slowly in the winter. Before the sun cleared the hills, the baker had lit his ovens."


def _tensors(model):
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _assert_same_model(lean, ref, tokens):
    a, b = _tensors(lean), _tensors(ref)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].device.type != "meta", name
        assert torch.equal(a[name], b[name]), name
    with torch.no_grad():
        assert torch.equal(lean(tokens), ref(tokens))
    for w in ("W_Q", "W_K", "W_V", "W_O", "W_U", "W_E"):
        assert torch.equal(getattr(lean, w), getattr(ref, w)), w


@pytest.mark.parametrize("builder", ["gpt2_dir", "llama_dir", "llama_mqa_dir", "gemma3_dir"])
def test_lean_fold_equals_transformer_lens_processing(builder, tmp_path_factory, recwarn):
    folder = getattr(_tiny, builder)(tmp_path_factory)
    lean = qk.load(folder, device="cpu", verbose=False)
    assert not [w for w in recwarn if "lean LayerNorm folding" in str(w.message)]         # the lean path itself, no fallback
    ref = qk.load(folder, device="cpu", verbose=False, lean=False)
    raw = qk.load(folder, device="cpu", verbose=False, fold_ln=False)
    assert lean.compatibility_mode and ref.compatibility_mode
    tokens = raw.to_tokens(TEXT)
    _assert_same_model(lean, ref, tokens)
    with torch.no_grad():
        torch.testing.assert_close(lean(tokens).log_softmax(-1), raw(tokens).log_softmax(-1), atol=1e-4, rtol=0)
        assert (lean(tokens) - raw(tokens)).abs().max() > 1e-3          # it really was folded


def test_lean_gguf_equals_transformer_lens_processing(tmp_path_factory):
    path = _tiny.gguf_path(tmp_path_factory)
    lean, ref = qk.load(path, device="cpu", verbose=False), qk.load(path, device="cpu", verbose=False, lean=False)
    _assert_same_model(lean, ref, torch.arange(1, 30)[None])


def test_lean_restores_transformer_lens_steps_also_on_failure(tmp_path_factory, monkeypatch):
    """The clone-free steps are swapped in only during the load; an error inside restores them."""
    from transformer_lens.weight_processing import ProcessWeights

    before = {n: ProcessWeights.__dict__[n] for n in _lean._STEPS if n in ProcessWeights.__dict__}
    folder = _tiny.llama_dir(tmp_path_factory)

    def boom(*a, **k):
        raise ValueError("boom")

    monkeypatch.setattr(ProcessWeights, "center_unembed", staticmethod(boom))
    with pytest.raises(ValueError, match="boom"):
        qk.load(folder, device="cpu", verbose=False)
    monkeypatch.undo()
    assert {n: ProcessWeights.__dict__[n] for n in before} == before
    # and a plain TransformerLens step still copies (the caller's tensors are untouched)
    t = {"unembed.W_U": torch.randn(3, 5)}
    out = ProcessWeights.center_unembed(dict(t))
    assert out["unembed.W_U"].data_ptr() != t["unembed.W_U"].data_ptr()


def test_lean_falls_back_when_a_parameter_is_left_unplaced(tmp_path_factory, monkeypatch):
    """An architecture whose processed weights miss a parameter: warn, reload without the lean path."""
    folder = _tiny.gpt2_dir(tmp_path_factory)
    real = _lean._release_parameters

    def release_one_more(model, state_dict):
        n = real(model, state_dict)
        mod = model.original_model.transformer.h[0].ln_1        # folded, so never placed back by TL
        mod._parameters["weight"] = torch.nn.Parameter(torch.empty(mod.weight.shape, device="meta"))
        return n

    monkeypatch.setattr(_lean, "_release_parameters", release_one_more)
    with pytest.warns(UserWarning, match="reloading with lean=False"):
        model = qk.load(folder, device="cpu", verbose=False)
    monkeypatch.undo()
    ref = qk.load(folder, device="cpu", verbose=False, lean=False)
    _assert_same_model(model, ref, ref.to_tokens(TEXT))


def _spy_process_weights(monkeypatch, after=None):
    """Record, per call of TransformerLens's process_weights, the groups whose tensors carry data."""
    from transformer_lens.weight_processing import ProcessWeights

    original = ProcessWeights.__dict__["process_weights"].__func__
    seen = []

    def spy(state_dict, *args, **kwargs):
        seen.append({_lean._group(k) for k, v in state_dict.items()
                     if isinstance(v, torch.Tensor) and v.device.type != "meta"})
        out = original(state_dict, *args, **kwargs)
        return after(out) if after is not None else out

    monkeypatch.setattr(ProcessWeights, "process_weights", staticmethod(spy))
    return seen


def test_lean_bfloat16_equals_transformer_lens_processing(tmp_path_factory, monkeypatch):
    """bf16 (TransformerLens upcasts what it processes to fp32): the lean path runs the processing once per
    group, each run seeing ONE group's data (the others are meta stand-ins), so one block at a time is in
    fp32 and not the whole model; the weights still equal one whole run's bit for bit."""
    folder = _tiny.llama_dir(tmp_path_factory)
    seen = _spy_process_weights(monkeypatch)
    lean = qk.load(folder, device="cpu", dtype="bfloat16", verbose=False)
    monkeypatch.undo()
    assert [len(s) for s in seen] == [1] * len(seen)
    assert sorted(g for s in seen for g in s) == ["blocks.0", "blocks.1", "embed", "unembed"]
    ref = qk.load(folder, device="cpu", dtype="bfloat16", verbose=False, lean=False)
    assert lean.W_Q.dtype == torch.bfloat16
    _assert_same_model(lean, ref, ref.to_tokens(TEXT))


def test_lean_detects_processing_that_crosses_groups(tmp_path_factory, monkeypatch):
    """A processing whose output for one group reads another group's weights meets a meta stand-in (torch
    raises): the grouped run is abandoned and the model reloads with TransformerLens's whole-dict path."""
    folder = _tiny.llama_dir(tmp_path_factory)

    def crossing(out):
        out["unembed.weight"] = out["unembed.weight"] + 0 * out["embed.weight"]
        return out

    _spy_process_weights(monkeypatch, after=crossing)
    with pytest.warns(UserWarning, match="did not fit this model.*(read another group|without data)"):
        model = qk.load(folder, device="cpu", verbose=False)
    assert all(p.device.type != "meta" for p in model.parameters())


@pytest.mark.smollm2
def test_smollm2_lean_equals_transformer_lens_processing(smollm2):
    ref = qk.load("smollm2-135m", device="cpu", verbose=False, lean=False)
    tokens = torch.tensor([[1] + smollm2.tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]])
    _assert_same_model(smollm2, ref, tokens)
