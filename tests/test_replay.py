"""The replay engine (``_analysis/replay.py``): blocks ``start..`` run in a loop on a residual (``sliced``) are the
model's own forward, bit for bit, on every tiny family (each block with its own layer's mask and rotary: Gemma's
sliding/global layers), with stacked copies, hooks, ``keep`` and ``stop``; the ``Runner`` takes that path."""

import pytest
import torch

import qkcircuits as qk
from qkcircuits._analysis.replay import BlockInputs, Runner, sliced

from _tiny import deepseek_dir, gemma2_dir, gemma3_dir, gpt2_dir, gptj_dir, llama_dir, neox_dir

FAMILIES = {"gpt2": gpt2_dir, "llama-gqa": llama_dir, "gemma2": gemma2_dir, "gemma3": gemma3_dir, "neox": neox_dir,
            "gptj": gptj_dir, "deepseek-v3": deepseek_dir}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    return request.param, qk.load(str(FAMILIES[request.param](tmp_path_factory)), verbose=False)


def test_blocks_in_a_loop_are_the_models_forward(family):
    name, model = family
    n = model.cfg.n_layers
    tokens = torch.randint(1, model.cfg.d_vocab, (2, 11), generator=torch.Generator().manual_seed(0))
    resid, inputs = {}, BlockInputs(model)
    keep = lambda L: lambda t, hook: resid.__setitem__(L, t.detach().clone())
    with torch.no_grad(), inputs.recording():
        clean = model.run_with_hooks(tokens, fwd_hooks=[(f"blocks.{L}.hook_resid_pre", keep(L)) for L in range(n)])
    with torch.no_grad():   # stacked copies: the model's own forward of the stacked batch (DeepSeek's MoE rounds by
        three = model(tokens.repeat(3, 1))      # batch: 5e-7 from three copies of ``clean``)
    assert sorted(inputs.calls) == list(range(n)) and inputs.batch == 2
    # head 0's z zeroed in block L: the same hook on the full forward gives the reference logits
    zero = lambda t, hook: torch.cat([torch.zeros_like(t[:, :, :1]), t[:, :, 1:]], 2)
    with torch.no_grad():
        for start in range(n):
            with sliced(model, inputs, start) as forward:
                assert torch.equal(forward(resid[start]), clean), (name, start)
                assert torch.equal(forward(resid[start].repeat(3, 1, 1)), three), (name, start)
                assert torch.equal(forward(resid[start], keep=2), clean[:, -2:]), (name, start)
            if start + 1 < n:       # blocks[start:start + 1] return the residual entering the next block
                with sliced(model, inputs, start, start + 1) as forward:
                    assert torch.equal(forward(resid[start]), resid[start + 1]), (name, start)
            hook = [(f"blocks.{n - 1}.attn.hook_z", zero)]
            want = model.run_with_hooks(tokens.repeat(2, 1), fwd_hooks=hook)
            assert not torch.equal(want, clean.repeat(2, 1, 1))                  # the hook changes something
            with sliced(model, inputs, start, hooks=hook) as forward:
                assert torch.equal(forward(resid[start].repeat(2, 1, 1)), want), (name, start)
    assert not any(hp.fwd_hooks for hp in model.hook_dict.values())              # the hooks are gone
    # the Runner replays through the loop: its self-check passes, keep included
    runner = Runner(model, tokens)
    assert runner.mode == "blocks" and runner.keep_ok, name
    assert torch.equal(runner.run(n - 1, [], 3), three)


def test_a_replay_refuses_what_it_cannot_replay(hand_built):
    inputs = BlockInputs(hand_built)
    with pytest.raises(qk.QKCircuitsError, match="not a slice"):
        with sliced(hand_built, inputs, 1, 1):
            pass
    with sliced(hand_built, inputs, 0) as forward, pytest.raises(qk.QKCircuitsError, match="no recorded inputs"):
        forward(torch.zeros(1, 4, hand_built.cfg.d_model))
    tokens = qk.repeated_tokens(hand_built, n_seqs=2, seg_len=4, seed=0)
    with torch.no_grad(), inputs.recording():
        hand_built(tokens)
    with pytest.raises(qk.QKCircuitsError, match="3 rows cannot reuse block inputs recorded on 2 rows"):
        inputs.call(0, 3)
