"""One offset profile: `qkcircuits circuits --head`, the report's "QK by offset" panel and ``qk.plot.offsets`` show
the same numbers (issue 37 ask 2), and those numbers are the mean query · R(Δ) · mean key of the rows the head's
layer reads, recomputed here from a plain forward over the corpus (not through ``corpus_stats``).

Before the fix the plot and the report used the mean token embedding while the CLI used real rows: on SmolLM2's
previous-token head 16.0 the plot peaked at Δ = 63 and the CLI said "prefers offset 1".
"""

from __future__ import annotations

import pytest
import torch

import _tiny
import qkcircuits as qk
from qkcircuits import plot
from qkcircuits.cli.circuits_command import format_summary, summarize
from qkcircuits.viz._panels import ViewContext, token_set
from qkcircuits.viz._views import panel


def corpus_mean_row(model, layer: int) -> torch.Tensor:
    """[1, d_model]: ``blocks.L.ln1.hook_out`` averaged over every non-BOS position of the packaged corpus, cut as
    the contextual views cut it (rows of min(128, n_ctx − 1) tokens led by BOS, the rest in one shorter row)."""
    tok = model.tokenizer
    ids = tok(qk.natural_text(), add_special_tokens=False)["input_ids"]
    n = max(2, min(128, int(model.cfg.n_ctx) - 1))
    bos = qk.text_tokens(model, seq_len=n)[0, 0].item()
    rows = [ids[i:i + n] for i in range(0, len(ids), n)]
    name = f"blocks.{layer}.ln1.hook_out"
    total, count = 0.0, 0
    with torch.no_grad():
        for r in rows:
            _, cache = model.run_with_cache(torch.tensor([[bos] + r]), names_filter=lambda x: x == name)
            total = total + cache[name][0, 1:].double().sum(0)
            count += len(r)
    return (total / count).float()[None]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return qk.load(str(_tiny.llama_dir(tmp_path_factory)), device="cpu", verbose=False)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    return qk.load(str(_tiny.gpt2_dir(tmp_path_factory)), device="cpu", verbose=False)


def three_views(model, head: str):
    """(plot, report panel, CLI summary) of one head's profile."""
    fig = plot.offsets(model, head)
    ctx = ViewContext(model)
    pos = panel(ctx, qk.Head.parse(head), token_set(model), None)["figures"]["pos"]
    cli = summarize(model, head)["positions"]
    return fig, pos, cli


@pytest.mark.parametrize("which", ["llama", "gpt2"])
def test_plot_report_and_cli_agree(which, request):
    model = request.getfixturevalue(which)
    head = "1.1"
    fig, pos, cli = three_views(model, head)
    y = list(fig.data[0].y)
    assert list(fig.data[0].x) == pos["data"][0]["x"] and y == pos["data"][0]["y"]
    assert y == pytest.approx(cli["mean_score"], rel=1e-4, abs=1e-5)
    peak = int(torch.tensor(cli["mean_score"]).argmax())
    assert cli["preferred_offset"] == peak == fig.layout.meta["preferred_offset"] == pos["meta"]["preferred_offset"]
    assert f"peaks at Δ = {peak}" in fig.layout.title.text
    assert f"prefers offset {peak} " in format_summary(summarize(model, head))


def test_rotary_profile_is_the_mean_row_the_layer_reads(llama):
    x = corpus_mean_row(llama, 1)
    want = qk.offset_profile(llama, "1.3", range(65), x).mean_score
    fig = plot.offsets(llama, "1.3")
    assert list(fig.data[0].y) == pytest.approx(want.tolist(), rel=2e-4, abs=1e-6)
    # not the mean embedding's profile (the old plot's), which differs on this model
    emb = qk.offset_profile(llama, "1.3", range(65)).mean_score
    assert (emb - want).abs().max() > 1e-3


def test_text_rows(llama):
    # --tokens TEXT: the rows of that text at the head's layer, BOS position left out
    text = "the cat sat on the mat and the dog sat on the log"
    s = summarize(llama, "1.0", text=text)
    ids = llama.tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = qk.text_tokens(llama, seq_len=4)[0, 0].item()
    _, cache = llama.run_with_cache(torch.tensor([[bos] + ids]), names_filter=lambda n: n == "blocks.1.ln1.hook_out")
    want = qk.offset_profile(llama, "1.0", range(65), cache["blocks.1.ln1.hook_out"][0, 1:]).mean_score
    assert s["positions"]["mean_score"] == pytest.approx(want.tolist(), rel=1e-4, abs=1e-5)
    assert "given text" in s["positions"]["rows"]


def test_previous_token_head_of_the_fixture(hand_built):
    fig = plot.offsets(hand_built, "0.0")
    assert fig.layout.meta["preferred_offset"] == 1 and "peaks at Δ = 1" in fig.layout.title.text


@pytest.mark.smollm2
def test_smollm2_previous_token_head_peaks_at_one(smollm2):
    fig, pos, cli = three_views(smollm2, "16.0")
    assert cli["preferred_offset"] == fig.layout.meta["preferred_offset"] == pos["meta"]["preferred_offset"] == 1
    assert list(fig.data[0].y) == pytest.approx(cli["mean_score"], rel=1e-4, abs=1e-4)
