"""``qk.plot``: each figure's data equals the result it draws, computed independently; notebook HTML is offline.

Ground truth: the hand-built fixture (0.0 previous-token, 1.0 induction, exact), the circuits API's
full_qk/full_ov (a second implementation of the token views), the model's own captured patterns, the
rotary offset profile of ``_rotary`` and a plain W_pos computation for learned positions.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from _typecheck import unchecked
import torch

import _tiny
import qkcircuits as qk
from qkcircuits import plot
from qkcircuits.viz import _notebook as NB


def rounded(t) -> torch.Tensor:
    """The figures keep 5 significant digits (viz/_figures.DIGITS): the reference, rounded the same way."""
    return torch.tensor([[math.nan if math.isnan(v) else float(f"{v:.5g}") for v in row] for row in t.tolist()])


def z(fig) -> torch.Tensor:
    return torch.tensor([[math.nan if v is None else v for v in row] for row in fig.data[0].z], dtype=torch.float64)


@pytest.fixture(scope="module")
def toy_scores(hand_built):
    return qk.scan(hand_built, n_seqs=4, seg_len=12, prefix_seqs=2, progress=False)


def test_scores_heatmap_is_the_score_tensor(toy_scores):
    for name, t in toy_scores.scores.items():
        fig = plot.scores(toy_scores, name)
        assert isinstance(fig, plot.Figure) and isinstance(fig, __import__("plotly").graph_objects.Figure)
        torch.testing.assert_close(z(fig), rounded(t).double(), equal_nan=True)
    fig = plot.scores(toy_scores, "induction")
    hm = fig.data[0]
    # hover: the head, this score, every other score, the labels
    for name in toy_scores.scores:
        assert name in hm.hovertemplate
    assert "labels: %{customdata[" in hm.hovertemplate and "head %{text}" in hm.hovertemplate
    assert hm.text[1][0] == "1.0" and hm.customdata[1][0][-1] == "induction"
    assert hm.customdata[0][0][-1] == "previous-token"
    i = list(toy_scores.scores).index("previous_token") - 1          # induction itself is not repeated
    assert hm.customdata[0][0][i] == pytest.approx(float(toy_scores["previous_token"][0, 0]), rel=1e-4)
    assert fig.layout.title.text == "induction"


def test_signed_scores_are_centred_at_zero(toy_scores):
    s = qk.results.HeadScores("m", 2, 2, {"x": torch.tensor([[-0.5, 0.1], [0.2, 2.0]]), "y": torch.tensor([[0.0, 0.1], [0.2, 0.3]])})
    hm = plot.scores(s, "x").data[0]
    # RdBu (dark red first) reversed: negative blue, positive red, white at 0
    assert hm.zmid == 0 and hm.reversescale and hm.colorscale[0][1] == "rgb(103,0,31)"
    hm = plot.scores(s, "y").data[0]
    assert hm.zmid is None and not hm.reversescale
    # eigenvalue copying is signed by definition, even when every head copies
    assert plot.scores(toy_scores, "eigen_copying").data[0].zmid == 0


def test_effects_and_random_baseline(hand_built):
    toks = qk.repeated_tokens(hand_built, n_seqs=4, seg_len=8, seed=0)
    eff = qk.sweep(hand_built, toks, progress=False)
    fig = plot.effects(eff)
    torch.testing.assert_close(z(fig), rounded(eff.effects).double(), equal_nan=True)
    assert fig.data[0].zmid == 0
    cmp = qk.compare_to_random(hand_built, ["1.0"], toks, n_draws=5, seed=1)
    fig = plot.effects(cmp)
    dots, line = fig.data
    assert list(dots.x) == pytest.approx(cmp.random_effects.tolist(), rel=1e-4)
    assert list(line.x) == pytest.approx([cmp.effect] * 2, rel=1e-4)


def test_diagnostics(hand_built):
    d = qk.diagnose(hand_built, progress=False)
    count = sum(f.float() for f in d.flags().values())
    torch.testing.assert_close(z(plot.diagnostics(d)), rounded(count).double())
    torch.testing.assert_close(z(plot.diagnostics(d, "sink")), rounded(d["sink"]).double(), equal_nan=True)


def test_qk_ov_equal_the_circuits_api(tmp_path_factory):
    model = qk.load(str(_tiny.gpt2_dir(tmp_path_factory)), device="cpu", verbose=False)
    ids = list(range(1, model.cfg.d_vocab, 29))
    tokens = [f"#{i}" for i in ids]
    head = qk.Head(1, 2)
    full = qk.weights.full_qk(model, head)
    ref = (full.A[ids] @ full.B[:, ids]) * qk.weights.attn_scale(model, head.layer)
    direct = plot.qk(model, "1.2", tokens, view="direct")
    torch.testing.assert_close(z(direct), rounded(ref).double(), rtol=2e-4, atol=1e-6)
    assert "direct inputs" in direct.layout.title.text
    fig = plot.ov(model, "1.2", tokens, k=3, view="direct")
    fov = qk.weights.full_ov(model, head)
    for n, t in enumerate(ids):
        v, _ = qk.weights.top_tokens(fov, t, 3)
        assert list(fig.data[0].z[n]) == pytest.approx(v.tolist(), rel=2e-4, abs=1e-6)
    # past layer 0 the default is the contextual view: the same figure as the token-view API draws
    ctx_fig = plot.qk(model, "1.2", tokens)
    assert "contextual inputs" in ctx_fig.layout.title.text
    grid, _ = qk.weights.token_qk(model, head, ids, view="contextual")
    torch.testing.assert_close(z(ctx_fig), rounded(grid).double(), rtol=2e-4, atol=1e-6)
    assert (grid - ref).abs().max() > 1e-3                 # and it is not the direct view again


def test_offsets_learned_positions(tmp_path_factory):
    model = qk.load(str(_tiny.gpt2_dir(tmp_path_factory)), device="cpu", verbose=False)
    from qkcircuits._weights.qk_ov import layer_weights

    fig = plot.offsets(model, "0.1")
    w, P = layer_weights(model, 0), model.W_pos.detach()
    n = min(int(model.cfg.n_ctx), 2 * 64 + 1)
    M = (P[:n] @ w.W_Q[1]) @ (P[:n] @ w.W_K[1]).T * qk.weights.attn_scale(model, 0)  # W_pos QK W_posᵀ, plain
    want = [float(torch.diagonal(M, -d).mean()) for d in fig.data[0].x]
    assert list(fig.data[0].y) == pytest.approx(want, rel=2e-4, abs=1e-6)


def test_offsets_rotary(tmp_path_factory):
    model = qk.load(str(_tiny.llama_dir(tmp_path_factory)), device="cpu", verbose=False)
    fig = plot.offsets(model, "1.3")
    from test_offsets import corpus_mean_row     # the rows layer 1 reads over the corpus, from a plain forward

    prof = qk.offset_profile(model, "1.3", list(fig.data[0].x), corpus_mean_row(model, 1))
    assert list(fig.data[0].y) == pytest.approx(prof.mean_score.tolist(), rel=2e-4, abs=1e-6)


def test_attention_carries_the_captured_pattern(hand_built):
    view = plot.attention(hand_built, None, ["1.0", "0.0"])
    ids = qk.viz._panels.prompt_ids(hand_built, None)
    acts = qk.capture(hand_built, torch.tensor([ids]), ["pattern"], layers=[0, 1])
    want = torch.stack([acts["pattern", 1][0, 0], acts["pattern", 0][0, 0]])
    torch.testing.assert_close(view.pattern, want.float())
    assert view.heads == ["1.0", "0.0"] and view.props["attentionHeadNames"] == ["1.0", "0.0"]
    torch.testing.assert_close(torch.tensor(view.props["attention"]), want.float(), atol=5e-5, rtol=0)
    assert view.tokens == view.props["tokens"] and len(view.tokens) == len(ids)
    # the induction head on [BOS] + R + R (|R| = 12): second-copy queries attend to i - 11
    q = torch.arange(13, 25)
    assert torch.equal(view.pattern[0][q].argmax(-1), q - 11)
    # ids given directly are used as given
    v2 = plot.attention(hand_built, ids[:10], "1.0")
    torch.testing.assert_close(v2.pattern[0], want[0, :10, :10].float())


@pytest.mark.parametrize("call, message", [
    (lambda m, s: plot.scores(qk.results.HeadEffects(torch.zeros(2, 2), 0.0, "m", "zero", "loss"), "x"), "HeadScores"),
    (lambda m, s: plot.scores(s, "nope"), "no score named 'nope'"),
    (lambda m, s: plot.qk(m, "5.0"), "5"),
    (lambda m, s: plot.qk(m, "0.*"), "exactly one head"),
    (lambda m, s: plot.qk(m, "1.0", "#1"), "list of single-token"),
    (lambda m, s: plot.ov(m, "1.0", k=0), "k must be a positive integer"),
    (lambda m, s: plot.attention(m, [0, 999], "1.0"), "token ids must be in"),
    (lambda m, s: unchecked(plot.attention)(m, [[1, 2], [3, 4]], "1.0"), "1-D"),   # beneath the hook
    (lambda m, s: plot.attention(m, None, []), "no heads"),
    (lambda m, s: plot.diagnostics(s), "HeadDiagnostics"),
    (lambda m, s: plot.qk("gpt2", "1.0"), "expected a model"),
    (lambda m, s: plot.set_bundle("sometimes"), "bundle mode"),
])
def test_bad_input_is_one_line_error(hand_built, toy_scores, call, message):
    with pytest.raises(qk.QKCircuitsError) as e:
        call(hand_built, toy_scores)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_notebook_html_is_self_contained(toy_scores, tmp_path):
    fig = plot.scores(toy_scores, "induction")
    html = fig._repr_html_()                      # what any other tool asking for HTML gets: libraries included
    assert html.count("/* qkcircuits: plotly from") == 1
    rest = html.replace(NB.library_script("plotly"), "")
    assert "src=" not in rest and "mathjax" not in rest.lower() and "http" not in rest
    assert "Plotly.newPlot" in html and "</script" not in NB._json(json.dumps({"t": "</script><!--"}))
    assert sorted(fig._repr_mimebundle_()) == ["text/html", "text/plain"]      # never plotly's JSON mimetype
    fig.save(tmp_path / "f.html")
    assert (tmp_path / "f.html").read_text().startswith("<!DOCTYPE html>")
    view = plot.attention(hand_built_model(), None, "1.0")
    assert view._repr_html_().count("/* qkcircuits: circuitsvis from") == 1
    view.save(tmp_path / "a.html")
    assert "CircuitsVis.render" in (tmp_path / "a.html").read_text()
    assert not NB.figure_html(fig, libraries=False).count("/* qkcircuits:")


def hand_built_model():
    from qkcircuits.fixtures import hand_built_induction_model

    return hand_built_induction_model()


def test_bundle_once_per_page_or_per_figure(monkeypatch):
    monkeypatch.setattr(NB, "_state", {"mode": None, "sent": {}, "deleted": set()})
    for var in ("VSCODE_PID", "DATABRICKS_RUNTIME_VERSION", NB.ENV):
        monkeypatch.delenv(var, raising=False)
    assert NB.bundle_mode() == "page"
    assert NB._needs("plotly", None)                          # outside a kernel: always self-contained
    assert NB._needs("plotly", ("cell-a", "run-1"))           # first figure of the page
    NB._state["sent"]["plotly"] = ("cell-a", "run-1")
    assert not NB._needs("plotly", ("cell-a", "run-1"))       # a second figure of the same run
    assert not NB._needs("plotly", ("cell-b", "run-2"))       # a later cell: already on the page
    assert NB._needs("circuitsvis", ("cell-b", "run-2"))      # each library on its own
    assert NB._needs("plotly", ("cell-a", "run-3"))           # the carrying cell runs again: its output is replaced
    NB._state["deleted"].add("cell-a")
    assert NB._needs("plotly", ("cell-b", "run-4"))           # the carrying cell was deleted
    monkeypatch.setenv("VSCODE_PID", "123")
    assert NB.bundle_mode() == "figure" and NB._needs("plotly", ("cell-b", "run-5"))
    monkeypatch.setenv(NB.ENV, "page")
    assert NB.bundle_mode() == "page"
    plot.set_bundle("figure")
    assert NB.bundle_mode() == "figure"


def test_import_stays_light_and_plot_is_lazy():
    code = ("import sys, qkcircuits as qk; assert 'plotly' not in sys.modules and 'qkcircuits.plot' not in sys.modules; "
            "qk.plot.scores; assert 'plotly' in sys.modules; assert 'plot' in qk.__all__")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(__file__)),
                                                      os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


# --- traces (PathEffects) ---------------------------------------------------------------------------------------

def drawn_edges(fig):
    """(src, dst, input, effect) of every edge line of a circuit figure (its meta), and its (x, y) endpoints."""
    out = []
    for t in fig.data:
        if t.mode == "lines":
            m = t.meta
            (l0, h0), (l1, h1) = map(int, m["src"].split(".")), map(int, m["dst"].split("."))
            # drawn where the heads sit (a straight line, or a curve where a straight one would cross another node)
            assert (t.x[0], t.x[-1]) == (h0, h1) and (t.y[0], t.y[-1]) == (l0, l1), (list(t.x), list(t.y))
            out.append((m["src"], m["dst"], m["input"], m["effect"]))
    return sorted(out)


def expected_edges(res, per_input):
    """Independent of the builder: per receiver and input, senders above 0, above the raw 95th percentile of that
    receiver's non-NaN effects and at least 10 % of its clean value (docs/mechanism.md), the ``per_input`` largest."""
    out = []
    for i, r in enumerate(res.receivers):
        for x in res.into:
            row = res.effects[x][i]
            vals = row[~row.isnan()].double()
            p95 = float(torch.quantile(vals, 0.95))
            cand = sorted(((float(row[l, h]), f"{l}.{h}") for l, h in (~row.isnan()).nonzero().tolist()), reverse=True)
            floor = 0.1 * abs(float(res.clean[x][i]))
            out += [(s, str(r), x, float(f"{e:.5g}")) for e, s in cand[:per_input] if e > p95 and e > 0 and e >= floor]
    return sorted(out)


def test_trace_graph_is_the_path_effects(hand_built):
    res = qk.trace_induction(hand_built, k=1, progress=False)
    fig = plot.trace(res)
    assert isinstance(fig, plot.Figure)
    edges = drawn_edges(fig)
    assert edges == expected_edges(res, 2)
    assert ("0.0", "1.0", "k") in {e[:3] for e in edges}      # known by construction: previous-token -> induction key
    nodes = {(n, lab) for t in fig.data if t.mode == "markers+text" for n, lab in zip(t.text, [t.name] * len(t.text))}
    assert nodes == {("1.0", "induction"), ("0.0", "previous-token")}
    # a synthetic trace on a wider model: many senders, the p95 cut, per_input, receivers with no edge still drawn
    g = torch.Generator().manual_seed(0)
    L, H = 6, 8
    recv = [qk.Head(5, 1), qk.Head(3, 0), qk.Head(1, 7)]
    eff = {}
    for x in "qkv":
        t = torch.randn(len(recv), L, H, generator=g).abs() * 0.05
        for i, r in enumerate(recv):
            t[i, r.layer:] = float("nan")
        t[0, 2, 3] = 0.9 if x == "k" else t[0, 2, 3]
        t[1, 0, 1] = 0.7 if x == "k" else t[1, 0, 1]
        eff[x] = t
    eff["k"][2, 0] = -0.1                                     # every effect of 1.7's keys negative: no k edge
    syn = qk.results.PathEffects("syn", "mean", recv, list("qkv"), {x: "score" for x in "qkv"}, eff,
                         {x: torch.ones(3) for x in "qkv"}, n_layers=L, n_heads=H, labels={"2.3": ["previous-token"]})
    for per_input in (1, 2, 3):
        fig = plot.trace(syn, per_input)
        edges = drawn_edges(fig)
        assert edges == expected_edges(syn, per_input) and len(edges) > 0
        heads = {h for t in fig.data if t.mode == "markers+text" for h in t.text}
        assert heads == {str(r) for r in recv} | {e[0] for e in edges}
    assert ("2.3", "5.1", "k", 0.9) in drawn_edges(plot.trace(syn, 1))
    assert not [e for e in drawn_edges(plot.trace(syn, 3)) if e[1] == "1.7" and e[2] == "k"]
    # reads_from: the top k senders of one receiver per input, with the baseline
    bars = plot.reads_from(syn, "5.1", k=2)
    got = sorted((y, x) for t in bars.data if t.type == "bar" for x, y in zip(t.x, t.y))
    want = []
    for x in "qkv":                                             # raw tensor, sorted here (not PathEffects.top)
        row = syn.effects[x][0]
        cand = sorted(((float(row[l, h]), f"{l}.{h}") for l in range(5) for h in range(H)), reverse=True)[:2]
        want += [(f"{x}: {h}", float(f"{v:.5g}")) for v, h in cand]
    want.sort()
    assert got == want and ("k: 2.3", 0.9) in got, got
    with pytest.raises(qk.QKCircuitsError, match="4.0 is not a receiver of this trace; receivers: 5.1, 3.0, 1.7"):
        plot.reads_from(syn, "4.0")
    with pytest.raises(qk.QKCircuitsError, match="plot.trace draws a PathEffects"):
        plot.trace(qk.scan(hand_built, n_seqs=2, seg_len=8, scores=["induction"], progress=False))
