"""docs/architecture.md's "How to add an analysis" and "How to add an architecture" recipes, executed (issue 44,
ask 6): each section's python blocks are read from the page and run here unchanged, in a fresh folder, and what
they built is checked against ground truth computed independently.

- The analysis (``sink_share``: each head's mean attention on position 0) against the attention patterns the
  model's own forward records (TransformerLens' ``run_with_cache``, not ``qk.stream``), against the toy's
  construction (its previous-token head 0.0 looks at position 0 from query 1 only), on a tiny random GPT-2 too;
  its result class is registered (``qk.load_result`` reads its files back by schema).
- The architecture (``GPT2FusedAttention``, registered with a rule): its weights against the checkpoint's raw
  ``c_attn`` / ``c_proj`` tensors split here by hand, ``verify_circuits`` and ``qk.attend`` exact through it, and a
  family that answers wrongly (q and k swapped) caught by the same proof.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import qkcircuits as qk
from qkcircuits._foundation import arch

DOCS = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def section_blocks(heading: str):
    """The python blocks of the section under ``heading`` (up to the next heading of its level or above)."""
    page = DOCS.read_text(encoding="utf-8")
    start = page.index(heading + "\n")
    level = heading.split(" ")[0]
    rest = page[start + len(heading):]
    end = re.search(rf"^#{{1,{len(level)}}} ", rest, re.M)
    body = rest[:end.start()] if end else rest
    return re.findall(r"```python\n(.*?)```", body, re.S)


def run_recipe(heading: str, folder: Path, monkeypatch) -> dict:
    monkeypatch.chdir(folder)
    ns: dict = {"__name__": "recipe"}
    for i, code in enumerate(section_blocks(heading)):
        # dont_inherit: compiled as a reader types it, not under this file's `from __future__ import annotations`
        exec(compile(code, f"docs/architecture.md ({heading.lstrip('# ')}, block {i + 1})", "exec", dont_inherit=True),
             ns)
    return ns


# ------------------------------------------------------------------------------------------------ the analysis
@pytest.fixture(scope="module")
def analysis(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    try:
        yield run_recipe("## How to add an analysis", tmp_path_factory.mktemp("analysis"), mp)
    finally:
        mp.undo()


def own_sink_share(model, tokens) -> torch.Tensor:
    """[n_layers, n_heads]: the mean over prompts and queries 1.. of the pattern the model's forward records."""
    _, cache = model.run_with_cache(tokens)
    return torch.stack([cache[f"blocks.{layer}.attn.hook_pattern"][:, :, 1:, 0].float().mean(dim=(0, 2))
                        for layer in range(model.cfg.n_layers)]).cpu()


def test_the_analysis_recipe_has_its_blocks():
    codes = section_blocks("## How to add an analysis")
    assert len(codes) == 2 and "class SinkShare(qk.Result)" in codes[0] and "def sink_share(" in codes[0]


def test_the_analysis_matches_the_model_and_the_construction(analysis):
    model, tokens, shares = analysis["model"], analysis["tokens"], analysis["shares"]
    assert tokens.shape == (4, 13) and bool((tokens[:, 0] == tokens[0, 0]).all())          # [BOS] + R + R
    torch.testing.assert_close(shares.share, own_sink_share(model, tokens), atol=1e-6, rtol=0)
    # by construction: 0.0 attends to the previous token with weight 1, so only query 1 (of 12) sees position 0
    assert shares.share[0, 0] == pytest.approx(1 / 12, abs=1e-6)
    assert shares.top(1)[0] == (qk.Head(1, 0), pytest.approx(float(shares.share[1, 0])))
    assert shares.settings["n_prompts"] == 4 and "versions" in shares.settings


def test_the_analysis_result_is_registered_and_round_trips(analysis, tmp_path):
    cls, shares = analysis["SinkShare"], analysis["shares"]
    path = tmp_path / "sink.json"
    shares.to_json(path)
    back = qk.load_result(path)
    assert type(back) is cls and torch.equal(back.share, shares.share) and back.settings == shares.settings
    with pytest.raises(qk.QKCircuitsError, match="not a sink-share JSON"):
        cls.from_json('{"schema": "recipe.sink_share/1", "share": "no"}')
    assert "SinkShare: 1.0" in repr(shares)


def test_the_analysis_on_a_random_gpt2(analysis, architecture_ns):
    """The same function on another model: a tiny random GPT-2 (the architecture recipe's checkpoint, loaded
    with the built-in adapter), against its own recorded patterns."""
    model = qk.load(str(architecture_ns["folder"] / "tiny-gpt2"), device="cpu", verbose=False)
    tokens = qk.repeated_tokens(model, n_seqs=3, seg_len=5, seed=1)
    got = analysis["sink_share"](model, tokens).share
    want = own_sink_share(model, tokens)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert float(want.std()) > 1e-3                       # random heads differ: the comparison is not trivial


# -------------------------------------------------------------------------------------------- the architecture
@pytest.fixture(scope="module")
def architecture_ns(tmp_path_factory):
    folder = tmp_path_factory.mktemp("architecture")
    mp = pytest.MonkeyPatch()
    try:
        ns = run_recipe("## How to add an architecture (attention family)", folder, mp)
    finally:
        mp.undo()
        if "gpt2-fused" in arch.FAMILIES:                 # a failed block must not leave its family registered
            arch.unregister_family("gpt2-fused")
    ns["folder"] = folder
    return ns


@pytest.fixture
def registered(architecture_ns):
    arch.register_family("gpt2-fused", architecture_ns["GPT2FusedAttention"],
                         lambda m: arch.architecture(m) == "GPT2LMHeadModel")
    try:
        yield architecture_ns
    finally:
        if "gpt2-fused" in arch.FAMILIES:
            arch.unregister_family("gpt2-fused")


def test_the_architecture_recipe_ran_and_cleaned_up(architecture_ns):
    codes = section_blocks("## How to add an architecture (attention family)")
    assert len(codes) == 3 and "arch.register_family(" in codes[1] and "qk.verify_circuits(model)" in codes[2]
    assert architecture_ns["check"].passed
    assert "gpt2-fused" not in arch.FAMILIES and all(n != "gpt2-fused" for n, _ in arch._RULES)
    fresh = qk.load(str(architecture_ns["folder"] / "tiny-gpt2"), device="cpu", fold_ln=False, verbose=False)
    assert arch.family(fresh) == "standard"               # unregistered: GPT-2 is the built-in adapter's again


def test_the_registered_family_reads_the_raw_weights(registered):
    from transformers import GPT2LMHeadModel

    folder = registered["folder"] / "tiny-gpt2"
    model = qk.load(str(folder), device="cpu", fold_ln=False, verbose=False)
    assert arch.family(model) == "gpt2-fused" and isinstance(arch.adapter(model, 1), registered["GPT2FusedAttention"])
    hf = GPT2LMHeadModel.from_pretrained(str(folder)).eval()          # ground truth: the checkpoint's own tensors
    H, d = 4, 8
    for layer in range(2):
        attn = hf.transformer.h[layer].attn
        W, b = attn.c_attn.weight.detach(), attn.c_attn.bias.detach()                     # [32, 96], [96]
        w = arch.adapter(model, layer).weights()
        for i, (name, bias) in enumerate((("W_Q", "b_Q"), ("W_K", "b_K"), ("W_V", "b_V"))):
            for h in range(H):
                cols = slice(i * H * d + h * d, i * H * d + (h + 1) * d)
                torch.testing.assert_close(getattr(w, name)[h], W[:, cols], rtol=0, atol=0)
                torch.testing.assert_close(getattr(w, bias)[h], b[cols], rtol=0, atol=0)
        for h in range(H):
            torch.testing.assert_close(w.W_O[h], attn.c_proj.weight.detach()[h * d:(h + 1) * d], rtol=0, atol=0)
    check = qk.verify_circuits(model)
    assert check.passed and check.settings["family"] == "gpt2-fused", check
    res = qk.attend(model, "1.2", "abcdabcd", query=-1, key=3)
    assert res.exact_error <= 1e-5 and res.settings["family"] == "gpt2-fused"


def test_a_wrong_answer_is_caught_by_the_proof(registered):
    from qkcircuits._foundation.arch import LayerWeights

    class Swapped(registered["GPT2FusedAttention"]):
        family = "gpt2-swapped"

        def weights(self):
            w = super().weights()
            return LayerWeights(w.W_K, w.W_Q, w.W_V, w.W_O, w.b_K, w.b_Q, w.b_V, has_bias=True)

    arch.register_family("gpt2-fused", Swapped, lambda m: True)        # replaces the rule and the class
    fresh = qk.load(str(registered["folder"] / "tiny-gpt2"), device="cpu", fold_ln=False, verbose=False)
    assert arch.family(fresh) == "gpt2-fused" and not qk.verify_circuits(fresh).passed


def test_registering_refuses_what_it_cannot_take():
    with pytest.raises(qk.QKCircuitsError, match="register_family takes an AttentionAdapter subclass"):
        arch.register_family("x", dict, lambda m: True)
    with pytest.raises(qk.QKCircuitsError, match="family 'standard' is built in"):
        arch.register_family("standard", arch.StandardAttention, lambda m: False)
    with pytest.raises(qk.QKCircuitsError, match="family 'latent' is built in and stays"):
        arch.unregister_family("latent")
    with pytest.raises(qk.QKCircuitsError, match="no registered family 'nope'; registered: none"):
        arch.unregister_family("nope")
