"""qk.load: local HF folders, GGUF files, the SmolLM2 alias, a bridge passthrough, devices, every error.

Ground truth is transformers' own model for the same checkpoint (REFERENCE.md: the bridge's raw
numerics match HF; folding LayerNorm changes raw logits by a per-position constant only).
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path

import pytest
from _typecheck import unchecked
import torch

import _tiny
import qkcircuits as qk
from qkcircuits import QKCircuitsError

TEXT = "The river town woke slowly in the winter. Before the sun cleared the hills, the baker had lit his ovens."


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    return _tiny.gpt2_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return _tiny.llama_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def mqa_dir(tmp_path_factory):
    return _tiny.llama_mqa_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    return _tiny.gemma3_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    return _tiny.gguf_path(tmp_path_factory)


def _ids(tokenizer, text=TEXT):
    return torch.tensor([[tokenizer.bos_token_id] + tokenizer(text, add_special_tokens=False)["input_ids"]])


# ---- numerics against transformers ------------------------------------------------------------------

@pytest.mark.parametrize("which", ["gpt2", "llama", "mqa", "gemma3"])
def test_hf_folder_logits_equal_transformers(which, gpt2_dir, llama_dir, mqa_dir, gemma3_dir):
    folder = {"gpt2": gpt2_dir, "llama": llama_dir, "mqa": mqa_dir, "gemma3": gemma3_dir}[which]
    hf = _tiny.hf_model(folder)
    ref = copy.deepcopy(hf)          # a pristine copy: booting rewires an HF model in place
    raw = qk.load(folder, device="cpu", fold_ln=False, verbose=False)
    folded = qk.load(str(folder), device="cpu", verbose=False)
    assert len(raw.tokenizer) == _tiny.VOCAB > 1 and raw.tokenizer.bos_token_id == 0
    tokens = raw.to_tokens(TEXT)
    assert torch.equal(tokens, _ids(raw.tokenizer))              # BOS + the text's own ids
    assert len(set(tokens[0].tolist())) > 10                      # a real tokenizer, not one id
    with torch.no_grad():
        want = ref(tokens).logits
        got_raw, got_folded = raw(tokens), folded(tokens)
    assert want.abs().max() > 1.0                                 # logits are not trivially ~0
    torch.testing.assert_close(got_raw, want, atol=1e-5, rtol=0)
    assert (got_folded - want).abs().max() > 1e-3                 # folding does change raw logits ...
    torch.testing.assert_close(got_folded.log_softmax(-1), want.log_softmax(-1), atol=1e-4, rtol=0)  # ... not these
    if which == "llama":
        assert raw.cfg.n_heads == 4 and qk.n_kv_heads(raw) == 2 and qk.has_rotary(raw)
    if which == "mqa":
        assert raw.cfg.n_heads == 4 and qk.n_kv_heads(raw) == 1 and qk.has_rotary(raw)
    if which == "gemma3":      # the shape the builder promises: GQA, rotary, QK-norm, a sliding window
        assert raw.cfg.n_heads == 4 and qk.n_kv_heads(raw) == 2 and qk.has_rotary(raw)
        hf_attn = ref.model.layers[0].self_attn
        assert hasattr(hf_attn, "q_norm") and hf_attn.sliding_window == _tiny.GEMMA3_WINDOW
        assert {n.rsplit(".", 1)[-1] for n, _ in ref.named_buffers() if n.endswith("attention_inv_freq")} == {
            "sliding_attention_inv_freq", "full_attention_inv_freq"}


def test_gguf_round_trip_equals_the_original_llama(gguf_file, llama_dir):
    """The tiny Llama written as GGUF loads back to the same model and the same tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = qk.load(gguf_file, device="cpu", fold_ln=False, verbose=False)
    assert model.cfg.model_name == str(gguf_file)          # results name the file, not its folder
    folder_tok = AutoTokenizer.from_pretrained(llama_dir)
    text = qk.natural_text()
    assert model.tokenizer(text, add_special_tokens=False)["input_ids"] == folder_tok(text)["input_ids"]
    assert len(model.tokenizer) == _tiny.VOCAB and model.tokenizer.bos_token_id == 0
    assert qk.n_kv_heads(model) == 2 and model.cfg.n_heads == 4
    tokens = _ids(folder_tok)
    from_gguf = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                                     dtype=torch.float32).eval()
    with torch.no_grad():
        got = model(tokens)
        original = _tiny.hf_model(llama_dir)(tokens).logits
        hf_gguf = from_gguf(tokens).logits
    torch.testing.assert_close(got, hf_gguf, atol=1e-5, rtol=0)
    torch.testing.assert_close(got, original, atol=1e-4, rtol=0)   # q/k un-permuted correctly, theta kept


def test_gguf_folder_with_one_gguf_loads_it(gguf_file, tmp_path):
    folder = tmp_path / "only-gguf"
    folder.mkdir()
    os.symlink(gguf_file, folder / gguf_file.name)
    model = qk.load(folder, device="cpu", fold_ln=False, verbose=False)
    assert qk.n_kv_heads(model) == 2


@pytest.mark.smollm2
def test_smollm2_logits_equal_transformers_from_the_same_gguf(smollm2_raw, smollm2):
    hf = _tiny.smollm2_hf()
    tokens = smollm2_raw.to_tokens("The capital of France is", prepend_bos=False)
    tokens = torch.cat([torch.tensor([[1]]), tokens], 1)          # BOS <|im_start|>, as the detectors use
    with torch.no_grad():
        want = hf(tokens).logits
        got = smollm2_raw(tokens)
        folded = smollm2(tokens)
    assert smollm2_raw.cfg.n_layers == 30 and smollm2_raw.cfg.n_heads == 9 and qk.n_kv_heads(smollm2_raw) == 3
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    torch.testing.assert_close(folded.log_softmax(-1), want.log_softmax(-1), atol=1e-4, rtol=0)
    assert smollm2_raw.tokenizer.decode(int(got[0, -1].argmax())) == " Paris"


# ---- passthrough, devices, dtypes ---------------------------------------------------------------------

def test_bridge_passes_through_unchanged(hand_built):
    tokens = torch.tensor([[0, 3, 4, 5, 3, 4]])
    with torch.no_grad():
        before = hand_built(tokens)
    assert qk.load(hand_built) is hand_built
    assert qk.load(hand_built, device="cpu", fold_ln=True, dtype="bfloat16") is hand_built
    with torch.no_grad():
        assert torch.equal(hand_built(tokens), before)              # not folded, not cast, not moved


def test_device_auto_picks_the_best_and_says_so(capsys):
    if torch.cuda.is_available():
        want = "cuda"
    elif getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        want = "mps"
    else:
        want = "cpu"
    assert qk.pick_device("auto").type == want
    assert f"using device {want}" in capsys.readouterr().err
    assert qk.pick_device(None, verbose=False).type == want
    assert capsys.readouterr().err == ""


def test_load_auto_device_on_this_machine(gpt2_dir, capsys):
    model = qk.load(gpt2_dir, verbose=True)
    want = qk.pick_device("auto", verbose=False)
    assert model.W_E.device.type == want.type
    assert f"qkcircuits: using device {want.type}" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["gpu0", "cuda:x", "tpu", ""])
def test_bad_device_string(bad, gpt2_dir):
    with pytest.raises(QKCircuitsError, match=r"unknown device .*use 'auto', 'cpu'"):
        qk.load(gpt2_dir, device=bad, verbose=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_asked_for_without_cuda(gpt2_dir):
    with pytest.raises(QKCircuitsError, match=r"'cuda:0' was asked for but CUDA is not available here"):
        qk.load(gpt2_dir, device="cuda:0", verbose=False)


def test_dtype_option(gpt2_dir):
    model = qk.load(gpt2_dir, device="cpu", dtype="bfloat16", fold_ln=False, verbose=False)
    assert model.W_Q.dtype == torch.bfloat16
    with pytest.raises(QKCircuitsError, match=r"unknown dtype 'int7'; use one of .*float32"):
        qk.load(gpt2_dir, device="cpu", dtype="int7", verbose=False)


# ---- errors: one line, naming the bad value and the way out -------------------------------------------

def _one_line_error(spec, match, **kw):
    with pytest.raises(QKCircuitsError, match=match) as e:
        qk.load(spec, device="cpu", verbose=False, **kw)
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 400, msg
    return msg


@pytest.mark.parametrize("name", ["gpt2", "EleutherAI/pythia-14m", "meta-llama/Llama-3.2-1B"])
def test_hub_name_offline_fails_fast(name, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    msg = _one_line_error(name, "HF_HUB_OFFLINE is set")
    assert time.perf_counter() - start < 2.0
    assert repr(name) in msg and "local Hugging Face folder or a .gguf file" in msg


def test_hub_unreachable_fails_fast(monkeypatch):
    from qkcircuits._foundation import model as _model

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(_model, "_hub_reachable", lambda *a, **k: False)
    msg = _one_line_error("gpt2", "the hub is unreachable")
    assert "'gpt2'" in msg and ".gguf" in msg


def test_nonexistent_paths(tmp_path):
    for spec in [tmp_path / "nope", str(tmp_path / "nope.gguf"), "./not/here", "~/no-such-model-folder"]:
        msg = _one_line_error(spec, "does not exist")
        assert os.fspath(spec) in msg and "Hugging Face folder" in msg


def test_folder_that_is_not_a_checkpoint(tmp_path, gpt2_dir):
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("hello")
    assert str(junk) in _one_line_error(junk, r"is not a Hugging Face checkpoint: no config\.json")
    cfg_only = tmp_path / "cfg-only"
    cfg_only.mkdir()
    (cfg_only / "config.json").write_bytes((gpt2_dir / "config.json").read_bytes())
    _one_line_error(cfg_only, r"not a Hugging Face checkpoint: no weights")
    no_tok = _tiny.copy_folder(gpt2_dir, tmp_path / "no-tokenizer")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (no_tok / f).unlink()
    _one_line_error(no_tok, r"has no tokenizer files .*tokenizer.save_pretrained")
    other_file = tmp_path / "weights.bin"
    other_file.write_bytes(b"\0" * 64)
    _one_line_error(other_file, r"is not a \.gguf file")


@pytest.mark.parametrize("keep", [0.002, 0.3, 0.999])
def test_truncated_gguf(keep, gguf_file, tmp_path):
    cut = _tiny.truncated_copy(gguf_file, tmp_path / "cut.gguf", keep)
    msg = _one_line_error(cut, r"is truncated or corrupt .*download it again")
    assert str(cut) in msg


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a GGUF file " * 40)
    _one_line_error(bad, r"is truncated or corrupt \(GGUF magic invalid\)")


@pytest.mark.smollm2
def test_truncated_smollm2_gguf(tmp_path):
    from qkcircuits._foundation.fetch import smollm2_gguf

    src = smollm2_gguf(quiet=True)
    with open(src, "rb") as f:                                      # first 5 MB: header + a few tensors
        (tmp_path / "smol.gguf").write_bytes(f.read(5 << 20))
    msg = _one_line_error(tmp_path / "smol.gguf", r"smol\.gguf' is truncated or corrupt .*download it again")
    assert "Traceback" not in msg


def test_architecture_transformerlens_cannot_wrap(tmp_path):
    folder = _tiny.tiny_unsupported(tmp_path / "bigbird")
    msg = _one_line_error(folder, r"TransformerLens cannot wrap .*BigBirdForCausalLM.* is not supported")
    assert str(folder) in msg and "supported_models" in msg


@pytest.mark.parametrize("vocab", [("[UNK]",), ("[UNK]", "foo", "bar")])
def test_tokenizer_that_comes_out_empty(vocab, gpt2_dir, tmp_path):
    folder = _tiny.copy_folder(gpt2_dir, tmp_path / "empty-tok")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (folder / f).unlink()
    _tiny.one_id_tokenizer(vocab).save_pretrained(folder)
    msg = _one_line_error(folder, r"tokenizer of .* came out empty")
    assert f"len={len(vocab)}" in msg and "-> [0, 0, 0, 0]" in msg and str(folder) in msg


def test_bad_spec_type():
    with pytest.raises(QKCircuitsError, match="not int"):
        unchecked(qk.load)(3)          # beneath the type-check hook: the function's own one-line error


# ---- the command line: exit code 2, one error line, no traceback ----------------------------------------

def test_cli_errors_exit_2_without_traceback(tmp_path, gguf_file, capsys, monkeypatch):
    from qkcircuits.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    junk = tmp_path / "junk"
    junk.mkdir()
    cut = _tiny.truncated_copy(gguf_file, tmp_path / "cut.gguf", 0.5)
    cases = [(["gpt2"], "HF_HUB_OFFLINE is set"), ([str(tmp_path / "nope")], "does not exist"),
             ([str(junk)], "not a Hugging Face checkpoint"), ([str(junk), "--device", "gpu0"], "unknown device 'gpu0'")]
    for args, expect in cases:                                    # in-process: one import, fast
        capsys.readouterr()
        assert main(["scan", *args]) == 2, args
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and expect in errors[0] and "Traceback" not in err, err
    capsys.readouterr()                                           # a truncated GGUF: nothing on stdout
    assert main(["scan", str(cut), "--device", "cpu"]) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in err and out == ""
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "truncated or corrupt" in errors[0], err[-2000:]


@pytest.mark.parametrize("name", ["gpt2", "neox"])
def test_a_relative_folder_named_like_a_hub_alias_loads_the_folder(name, gpt2_dir, tmp_path, monkeypatch):
    # TransformerLens reads a bare "gpt2" / "neox" as a hub name (alias of EleutherAI/gpt-neox-20b), so a local
    # folder of that name was sent to the hub (offline: "couldn't connect"). The folder is what was asked for.
    _tiny.copy_folder(gpt2_dir, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    model = qk.load(name, verbose=False)
    assert model.cfg.n_layers == 2 and model.cfg.d_model == 32          # the tiny folder, not the hub model
    assert qk._foundation.model.model_name(model) == name                # results keep the name as given
