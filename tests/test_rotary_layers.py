"""Rotary kept per layer type (Gemma-3 shape: thetas 300 / 5000, sliding window 6, QK-norm), checked against
the model's own rotated q/k and attention scores; and the same code on GPT-2-, Llama-GQA- and MQA-shaped models."""

from __future__ import annotations

import warnings

import _tiny
import pytest
import torch

import qkcircuits as qk
from qkcircuits._weights.rotary import rotation


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    folder = _tiny.gemma3_dir(tmp_path_factory)
    return folder, qk.load(str(folder), device="cpu", verbose=False)


def _gemma_cache(model, tokens):
    ends = ("hook_q_normed", "hook_k_normed", "hook_rot_q", "hook_rot_k", "hook_attn_scores")
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith(ends))
    return cache


def _theta_freqs(theta: float, d: int) -> torch.Tensor:
    """The textbook frequencies base^(-2k/d), written out here, not read from the model."""
    return 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)


def test_each_layer_gets_its_own_frequencies_and_window(gemma3):
    _, model = gemma3
    types = ["sliding_attention", "sliding_attention", "full_attention"]
    for layer, ltype in enumerate(types):
        spec = qk.weights.rotary_spec(model, layer=layer)
        theta = _tiny.GEMMA3_THETAS[ltype]
        assert spec.layer_type == ltype and spec.base == theta
        assert torch.allclose(spec.omega.double(), _theta_freqs(theta, 8), rtol=1e-6)
        assert spec.window == (_tiny.GEMMA3_WINDOW if ltype == "sliding_attention" else None)
        assert spec.verified_error < 1e-5


def test_rebuilt_rotary_reproduces_the_models_rotated_q_k_and_scores(gemma3):
    """q/k after rotary and the pre-softmax scores, per layer, from the normalised q/k and our R(Δ).

    With QK-norm the bilinear identity x·QK(Δ)·yᵀ does not hold (the caveat says so); what is rebuilt
    here is the part the offset circuit owns: rotation by the layer's own frequencies and the window."""
    _, model = gemma3
    n = 20
    tokens = torch.arange(3, 3 + n)[None]
    cache = _gemma_cache(model, tokens)
    scale = qk.weights.attn_scale(model, 0)
    for layer in range(3):
        spec = qk.weights.rotary_spec(model, layer=layer)
        qn = cache[f"blocks.{layer}.attn.hook_q_normed"][0].transpose(0, 1)       # [pos, head, d]
        kn = cache[f"blocks.{layer}.attn.hook_k_normed"][0].transpose(0, 1)       # [pos, kv, d]
        R = rotation(spec, range(n))                                               # [pos, d, d]
        rq, rk = torch.einsum("phd,pde->phe", qn, R), torch.einsum("phd,pde->phe", kn, R)
        assert torch.allclose(rq, cache[f"blocks.{layer}.attn.hook_rot_q"][0], atol=1e-5)
        assert torch.allclose(rk, cache[f"blocks.{layer}.attn.hook_rot_k"][0], atol=1e-5)
        scores = cache[f"blocks.{layer}.attn.hook_attn_scores"][0]                # [head, q, k]
        Rrel = rotation(spec, range(n), relative=True)
        kx = kn.repeat_interleave(2, 1)                                            # GQA: 4 query heads, 2 KV
        window = spec.window or n + 1
        worst = 0.0
        for i in range(n):
            for j in range(i + 1):
                if i - j >= window:
                    assert torch.isinf(scores[:, i, j]).all() and (scores[:, i, j] < 0).all()
                    continue
                ours = torch.einsum("hd,de,he->h", qn[i], Rrel[i - j], kx[j]) * scale
                worst = max(worst, float((ours - scores[:, i, j]).abs().max()))
        assert worst < 1e-4, (layer, worst)
        # the other layer type's frequencies do not reproduce this layer's scores
        other = "full_attention" if spec.layer_type == "sliding_attention" else "sliding_attention"
        wrong = qk.weights.rotary_spec(model, layer=layer, base=_tiny.GEMMA3_THETAS[other])
        Rw = rotation(wrong, [5], relative=True)[0]
        bad = torch.einsum("hd,de,he->h", qn[10], Rw, kx[5]) * scale
        assert (bad - scores[:, 10, 5]).abs().max() > 1e-3


def test_offset_circuits_run_per_layer_and_flag_qk_norm(gemma3):
    _, model = gemma3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = qk.circuit(model, "2.1", "qk_offset", offset=3)
        prof = qk.offset_profile(model, "0.0", range(8))
    assert c.settings["rotary"]["layer_type"] == "full_attention" and c.settings["rotary"]["base"] == 5000.0
    assert prof.settings["rotary"]["base"] == 300.0
    assert any("QK-norm" in cav for cav in c.caveats) and not c.exact


def test_cli_circuits_prints_each_caveat_on_its_own_line(gemma3, capsys):
    from _cli import run

    folder, _ = gemma3
    code, out, err = run(["circuits", folder, "--head", "2.0", "--device", "cpu"], capsys)
    assert code == 0, err
    caveats = [line for line in out.splitlines() if line.startswith("caveat: ")]
    assert len(caveats) == 2, out
    assert any("QK-norm" in line for line in caveats) and any("sliding-window" in line for line in caveats)
    assert "5000" in out                                               # layer 2's own theta in the header
    code, out, err = run(["circuits", folder, "--head", "1.0", "--device", "cpu"], capsys)
    assert code == 0 and "base 300" in out
    assert "offset profile (rotary) over 0-5" in out and "window 6" in out   # masked offsets left out


def test_cli_warnings_are_one_line_and_the_callers_format_comes_back(gemma3):
    # a caveat prints once (the "caveat:" lines), not again as a warning; any other warning raised while a command
    # runs prints as "warning: <message>", not as Python's file:line: Category plus the source line; main()
    # called from Python restores the caller's own format
    import subprocess
    import sys
    import warnings

    folder, _ = gemma3
    code = ("import sys, warnings; import qkcircuits.cli.circuits_command as c; orig = c.summarize\n"
            "def noisy(*a, **k):\n    warnings.warn('something else happened'); return orig(*a, **k)\n"
            "c.summarize = noisy\nfrom qkcircuits.cli import main\n"
            f"sys.exit(main(['circuits', {str(folder)!r}, '--head', '1.0', '--device', 'cpu']))")
    proc = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-500:]
    assert [x for x in proc.stderr.splitlines() if "something else" in x] == ["warning: something else happened"]
    assert "is not the whole attention score" not in proc.stderr                 # said once, in stdout
    caveats = [x for x in proc.stdout.splitlines() if x.startswith("caveat: ")]
    assert caveats and len(caveats) == len(set(caveats)), proc.stdout
    assert "UserWarning" not in proc.stderr
    from qkcircuits.cli import main

    before = warnings.formatwarning
    assert main(["cache", "show"]) == 0 and warnings.formatwarning is before


@pytest.mark.parametrize("which", ["llama", "mqa"])
def test_single_setting_models_keep_one_frequency_set(which, tmp_path_factory):
    folder = _tiny.llama_dir(tmp_path_factory) if which == "llama" else _tiny.llama_mqa_dir(tmp_path_factory)
    model = qk.load(str(folder), device="cpu", verbose=False)
    theta = _tiny.LLAMA_THETA if which == "llama" else 700.0
    for layer in range(model.cfg.n_layers):
        spec = qk.weights.rotary_spec(model, layer=layer)
        assert spec.layer_type in (None, "full_attention") and spec.window is None
        assert torch.allclose(spec.omega.double(), _theta_freqs(theta, int(model.cfg.d_head)), rtol=1e-6)
    assert qk.weights.circuit_caveats(model) == []
