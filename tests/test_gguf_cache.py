"""A GGUF's conversion is cached by the file's sha256 (issue 45 ask 8): the second load of the same file reads the
cached safetensors folder instead of parsing and dequantizing the GGUF, and gives the same model, bit for bit.

Ground truth: the first load (the GGUF converted by transformers) against the second (from the cache); the GGUF
path is made to fail on the second load, so a pass proves the cache was read."""

from __future__ import annotations

import shutil

import pytest
import torch

import qkcircuits as qk
from qkcircuits._foundation import gguf_cache
from qkcircuits._foundation import model as model_module
from qkcircuits._foundation.model_cache import recall

from _tiny import gguf_path


def test_the_second_load_reads_the_cached_conversion(tmp_path_factory, tmp_path, monkeypatch):
    monkeypatch.setenv("QKCIRCUITS_CACHE", str(tmp_path / "cache"))
    src = gguf_path(tmp_path_factory)
    path = tmp_path / "m.gguf"
    shutil.copy(src, path)
    assert gguf_cache.converted(path) is None
    first = qk.load(str(path), verbose=False)
    folder = gguf_cache.converted(path)
    assert folder is not None and (folder / "model.safetensors").is_file()
    assert not [p for p in folder.rglob("*") if p.suffix in (".bin", ".pt", ".pkl", ".pth")]   # no pickles
    assert len(list(folder.glob("processed-*.safetensors"))) == 1        # the folded weights, kept too

    def no_gguf(*a, **kw):
        raise AssertionError("the GGUF was parsed again")

    monkeypatch.setattr(model_module, "_check_gguf", no_gguf)
    from qkcircuits._foundation import lean

    monkeypatch.setattr(lean, "_by_group", lambda *a, **kw: no_gguf())      # no folding either: it is read back
    renamed = tmp_path / "renamed.gguf"                 # keyed by content: a copy under another name hits too
    shutil.copy(path, renamed)
    second = qk.load(str(renamed), verbose=False)
    a, b = dict(first.named_parameters()), dict(second.named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    text = "the cat sat on the mat"
    assert torch.equal(first.to_tokens(text), second.to_tokens(text))
    assert recall(first, "own tokenizer") == recall(second, "own tokenizer") is not None
    t = first.to_tokens(text)
    assert torch.equal(first(t), second(t))
    assert second.cfg.model_name == str(renamed)
    # an edited file is another key: converted again (the GGUF path is parsed, so it fails here)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(AssertionError, match="parsed again"):
        qk.load(str(path), verbose=False)
    # a bfloat16 load of the cached file reads the float32 conversion and folds anew (its own processed file),
    # exactly as a bfloat16 load of the GGUF would
    monkeypatch.undo()
    monkeypatch.setenv("QKCIRCUITS_CACHE", str(tmp_path / "cache"))
    half = qk.load(str(renamed), dtype="bfloat16", verbose=False)             # from the cache
    half_again = qk.load(str(renamed), dtype="bfloat16", verbose=False)       # its folded bf16 weights read back
    monkeypatch.setenv("QKCIRCUITS_CACHE", str(tmp_path / "empty"))           # the GGUF itself, at bfloat16
    plain = qk.load(str(src), dtype="bfloat16", verbose=False)
    assert not list((tmp_path / "empty").rglob("*.safetensors"))              # a bf16 conversion is not stored
    c = dict(half_again.named_parameters())
    a, b = dict(half.named_parameters()), dict(plain.named_parameters())
    assert {v.dtype for v in a.values()} == {torch.bfloat16}
    assert all(torch.equal(a[k], b[k]) and torch.equal(c[k], b[k]) for k in a)


def test_the_cached_conversion_is_read_in_this_thread(tmp_path_factory, tmp_path, monkeypatch):
    """transformers' 4 loading threads keep what their casts freed (a bfloat16 load of SmolLM2's float32
    conversion held 0.08 GB more, docs/benchmarks.md): the cached folder is read with them off, and the
    setting is put back afterwards."""
    import os

    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("QKCIRCUITS_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_DEACTIVATE_ASYNC_LOAD", raising=False)
    path = tmp_path / "m.gguf"
    shutil.copy(gguf_path(tmp_path_factory), path)
    qk.load(str(path), verbose=False)                                  # converts and stores
    seen, real = [], AutoModelForCausalLM.from_pretrained

    def spy(*a, **kw):
        seen.append(os.environ.get("HF_DEACTIVATE_ASYNC_LOAD"))
        return real(*a, **kw)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    qk.load(str(path), dtype="bfloat16", verbose=False)                # reads the cached folder
    assert seen == ["1"]
    assert "HF_DEACTIVATE_ASYNC_LOAD" not in os.environ
