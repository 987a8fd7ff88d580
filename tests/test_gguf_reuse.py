"""A GGUF load parses the file's header once (``_foundation.gguf_reuse``) and gives the same model.

Ground truth: the parts transformers builds from the same GGUF on its own (a fresh reader each time),
and the count of real ``GGUFReader`` constructions during one ``qk.load``.
"""

from __future__ import annotations

import gguf
import pytest
import torch

import _tiny
import qkcircuits as qk
from qkcircuits._foundation.gguf_reuse import parsed_once


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    return _tiny.gguf_path(tmp_path_factory)


def test_one_load_reads_the_header_once_and_restores_gguf(gguf_file, monkeypatch, tmp_path):
    monkeypatch.setenv("QKCIRCUITS_CACHE", str(tmp_path / "cache"))     # a first load: no cached conversion
    built = []
    real = gguf.GGUFReader

    class Counting(real):
        def __init__(self, *a, **k):
            built.append(a[0])
            super().__init__(*a, **k)

    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    maps = []
    real_map = gguf.get_tensor_name_map
    monkeypatch.setattr(gguf, "get_tensor_name_map", lambda *a: maps.append(a) or real_map(*a))
    model = qk.load(gguf_file, device="cpu", fold_ln=False, verbose=False)
    assert len(built) == 1                        # was 4: the check, the tokenizer, the config, the weights
    assert len(maps) == 1                         # was once per module of the model
    assert gguf.GGUFReader is Counting and gguf.get_tensor_name_map is not real_map   # put back as found
    assert model.cfg.n_layers > 0


def test_shared_reader_gives_the_weights_transformers_reads_alone(gguf_file):
    from transformers import AutoModelForCausalLM

    folder, name = str(gguf_file.parent), gguf_file.name
    alone = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name).state_dict()
    with parsed_once():
        first = gguf.GGUFReader(str(gguf_file))
        assert gguf.GGUFReader(str(gguf_file)) is first      # shared inside the block
        mapped = gguf.gguf_reader.GGUFReader(str(gguf_file))  # the reader gguf builds on its own
        for a, b in zip(first.tensors, mapped.tensors):       # a plain view of the same bytes
            assert a.name == b.name and (a.data == b.data).all()
        for k in mapped.fields:
            assert all((u == v).all() for u, v in zip(first.fields[k].parts, mapped.fields[k].parts)), k
        shared = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name).state_dict()
    assert gguf.GGUFReader(str(gguf_file)) is not first                 # and fresh again after it
    assert list(alone) == list(shared)
    for k in alone:
        assert torch.equal(alone[k], shared[k]), k
