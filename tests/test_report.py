"""The offline HTML report: self-contained (JS inlined once, no network URLs) and showing the right numbers.

Ground truth: the hand-built fixture (0.0 is an exact previous-token head, 1.0 an exact induction head that
copies via its OV circuit), the circuits module's own full QK/OV (a second implementation), and, on
SmolLM2, the model's own layer-0 scores q·k at offset 0, where rotary is the identity.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat

import pytest
import torch

import _tiny
import qkcircuits as qk
from qkcircuits.cli import main
from qkcircuits.viz import report_html, write_report
from qkcircuits.viz._page import circuitsvis_js_path, plotly_js_path, script_text
from qkcircuits.viz._panels import ViewContext, ov_top, prompt_ids, qk_grid, token_set
from qkcircuits.fixtures import INDUCTION_HEAD, PREV_TOKEN_HEAD


def source_data(html: str) -> dict:
    m = re.search(r"window\.QK_SOURCE = (\{.*?\});</script>", html, re.S)
    assert m, "no embedded data"
    return json.loads(m.group(1).replace("<\\/", "</"))


@pytest.fixture(scope="module")
def toy_scores(hand_built):
    return qk.scan(hand_built, n_seqs=4, seg_len=12, prefix_seqs=2, eigen_copying=False, progress=False)


@pytest.fixture(scope="module")
def toy_html(hand_built, toy_scores):
    return report_html(hand_built, scores=toy_scores, progress=False)


def test_js_inlined_once_and_no_network_urls(toy_html):
    plotly_head = plotly_js_path().read_text(encoding="utf-8")[:300]
    cv_head = circuitsvis_js_path().read_text(encoding="utf-8")[:300]
    assert toy_html.count(plotly_head) == 1
    assert toy_html.count(cv_head) == 1
    assert toy_html.count("</script>") == 4          # plotly, circuitsvis, data, viewer: nothing per widget
    # Outside the two library bundles (which hold URLs as inert strings, e.g. plotly's default topojsonURL for
    # geo maps) the page names no URL at all; the browser test proves that no request leaves the page.
    rest = toy_html.replace(script_text("plotly"), "").replace(script_text("circuitsvis"), "")
    assert "http://" not in rest and "https://" not in rest and "//cdn" not in rest
    assert "sourceMappingURL" not in toy_html
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", rest)


def test_panels_match_the_fixture(hand_built, toy_html):
    data = source_data(toy_html)
    panels = data["panels"]
    ind, prev = "%d.%d" % INDUCTION_HEAD, "%d.%d" % PREV_TOKEN_HEAD
    assert {ind, prev} <= set(panels) and data["first"] == ind
    # OV of the induction head: every non-BOS source token's top output is itself (the fixture copies).
    ov = panels[ind]["figures"]["ov"]["data"][0]
    copies = [row[0][2] for row in ov["customdata"]]
    assert copies[1:] == ["yes"] * (len(copies) - 1)
    # Previous-token head: its positional QK profile peaks at offset 1.
    pos = panels[prev]["figures"]["pos"]["data"][0]
    assert pos["x"][max(range(len(pos["y"])), key=lambda i: pos["y"][i])] == 1
    # K-composition: the induction head's key reads the previous-token head first.
    comp = panels[ind]["figures"]["comp"]["data"][0]
    assert comp["y"][-1] == prev                    # bars are drawn bottom-up: the strongest is last
    assert panels[prev]["figures"]["comp"] is None   # layer 0 has no earlier heads
    # Attention on the default prompt ([BOS] + R + R, |R| = 12): second-copy queries attend to i - 11.
    att = torch.tensor(panels[ind]["attention"]["attention"][0])
    q = torch.arange(13, 25)
    assert torch.equal(att[q].argmax(-1), q - 11)
    assert float(att[q, q - 11].min()) > 0.99
    assert panels[ind]["info"]["labels"] == ["induction"]
    assert abs(panels[ind]["info"]["scores"]["induction"] - 1.0) < 1e-3


def check_views(model, ids, k=3, tol=1e-5):
    """qk_grid and ov_top on direct inputs against the circuits API's full_qk / full_ov; returns how many ids
    were untied."""
    ctx, untied = ViewContext(model), 0
    for head in qk.all_heads(model.cfg.n_layers, model.cfg.n_heads):
        full = qk.weights.full_qk(model, head)
        ref = full.A[ids] @ full.B[:, ids] * qk.weights.attn_scale(model, head.layer)
        torch.testing.assert_close(qk_grid(ctx, head, ids, view="direct"), ref, rtol=tol, atol=tol)
        vals, out = ov_top(ctx, head, ids, k, view="direct")
        full_ov = qk.weights.full_ov(model, head)
        for n, t in enumerate(ids):
            v, i = qk.weights.top_tokens(full_ov, t, k)
            torch.testing.assert_close(vals[n], v, rtol=tol, atol=tol)
            row = (full_ov.A[t] @ full_ov.B).float()
            torch.testing.assert_close(row[out[n]], vals[n], rtol=tol, atol=tol)   # each id has the value shown
            for r in range(k):
                if int(((row - v[r]).abs() <= tol).sum()) == 1:          # untied: exactly one right answer
                    assert int(out[n, r]) == int(i[r]), (head, t, r)
                    untied += 1
    return untied


def test_views_agree_with_circuits_module(hand_built):
    untied = check_views(hand_built, token_set(hand_built))
    assert untied >= 31            # head 1.0's top output for every non-BOS token is that token, nothing tied


def test_views_agree_with_circuits_module_on_gpt2_with_biases(tmp_path_factory):
    # GPT-2 has b_Q/b_K: the QK view must leave them out exactly as full_qk does (one convention).
    from qkcircuits._weights.qk_ov import layer_weights

    model = qk.load(str(_tiny.gpt2_dir(tmp_path_factory)), device="cpu", verbose=False)
    ids = list(range(1, model.cfg.d_vocab, 13))
    untied = check_views(model, ids, tol=1e-4)
    assert untied > 0.95 * 3 * len(ids) * model.cfg.n_layers * model.cfg.n_heads    # measured: 738 of 744
    ctx, head = ViewContext(model), qk.Head(1, 0)
    w, E = layer_weights(model, 1), ctx.embed(1, ids)
    with_biases = (E @ w.W_Q[0] + w.b_Q[0]) @ (E @ w.W_K[0] + w.b_K[0]).T * qk.weights.attn_scale(model, 1)
    assert (with_biases - qk_grid(ctx, head, ids)).abs().max() > 1e-2       # the two conventions differ here
    fig = report_html(model, heads="1.0", grid_k=0, tokens=["#1", "#2"], prompt="the cat sat", progress=False)
    assert "no biases" in json.dumps(source_data(fig)["panels"]["1.0"]["figures"]["qk"]["layout"]["title"])


def test_default_prompt_fits_a_short_context(tmp_path_factory):
    # the default prompt (a sentence said twice, ~79 tokens) does not fit a 64-token context: a shorter start of the
    # sentence, said twice, does (a report with no --prompt works on every model); a prompt the user gives is
    # never cut: it is refused in one line
    model = qk.load(str(_tiny.gpt2_dir(tmp_path_factory)), device="cpu", verbose=False)
    assert model.cfg.n_ctx == 64
    tok = model.tokenizer
    assert len(tok.encode(qk.viz._panels.DEFAULT_PROMPT, add_special_tokens=False)) + 1 > 64
    ids = prompt_ids(model, None)
    half = (len(ids) - 1) // 2
    assert len(ids) <= 64 and ids[1:1 + half] == ids[1 + half:] and half >= 20
    assert tok.decode(ids[1:1 + half]).startswith("Maria kept the old maps")
    with pytest.raises(qk.QKCircuitsError, match=r"the prompt is \d+ tokens \(with BOS\); at most 64 are shown"):
        prompt_ids(model, " ".join(["the"] * 80))


def test_left_out_heads_are_stated(hand_built, toy_scores):
    data = source_data(report_html(hand_built, scores=toy_scores, grid_k=0, heads="1.1", progress=False))
    assert data["heads"] == ["1.1"]
    assert "1 of 4 heads" in data["left_out"] and "left out" in data["left_out"]


def test_ablation_and_diagnostics_shown(hand_built, toy_scores, tmp_path):
    toks = qk.repeated_tokens(hand_built, 4, 12, 2, seed=0)
    eff = qk.sweep(hand_built, toks, "induction-loss", progress=False)
    diag = qk.diagnose(hand_built, progress=False)
    data = source_data(report_html(hand_built, scores=toy_scores, effects=eff, diagnostics=diag, progress=False))
    keys = [g["key"] for g in data["grids"]]
    assert "ablation" in keys and "flags" in keys
    info = data["panels"]["1.0"]["info"]
    assert info["ablation"]["effect"] == pytest.approx(float(eff.effects[1, 0]), abs=1e-5)
    assert info["ablation"]["effect"] > 1.0          # removing the induction head costs the repeated half
    assert info["flags"] == [k for k, v in diag.flags().items() if bool(v[1, 0])]
    assert "near_one_hot" in info["flags"]           # the hand-built induction head attends one-hot, by construction


def test_bad_input_is_one_line_error(hand_built, toy_scores):
    with pytest.raises(qk.QKCircuitsError, match="no tokenizer"):
        report_html(hand_built, tokens=["cat"], progress=False)
    with pytest.raises(qk.QKCircuitsError, match="outside the vocabulary"):
        report_html(hand_built, tokens=["#99"], progress=False)
    with pytest.raises(qk.QKCircuitsError, match="at most"):
        report_html(hand_built, prompt=" ".join(["3"] * 300), progress=False)
    with pytest.raises(qk.QKCircuitsError, match="out of range|layers"):
        report_html(hand_built, heads="5.0", progress=False)
    other = qk.results.HeadScores("x", 3, 2, {"induction": torch.zeros(3, 2)})
    with pytest.raises(qk.QKCircuitsError, match="3 layers x 2 heads"):
        report_html(hand_built, scores=other, progress=False)


def test_cli_report(tmp_path, toy_scores, capsys):
    scores = tmp_path / "scan.json"
    toy_scores.to_json(scores)
    out = tmp_path / "r.html"
    assert main(["report", "toy-induction", "-o", str(out), "--scores", str(scores), "--heads", "1.1",
                 "--prompt", "0 4 5 6 4 5 6", "--tokens", "#1", "#2", "#3", "--quiet"]) == 0
    data = source_data(out.read_text(encoding="utf-8"))
    assert "1.1" in data["panels"] and data["first"] == "1.1"
    assert data["panels"]["1.0"]["attention"]["tokens"] == ["#0", "#4", "#5", "#6", "#4", "#5", "#6"]
    assert len(data["panels"]["1.0"]["figures"]["qk"]["data"][0]["z"]) == 3
    # Bad input: exit 2, one error line, nothing written.
    bad = tmp_path / "bad.html"
    for argv in (["--heads", "7.0"], ["--scores", str(tmp_path / "missing.json")], ["--tokens", "cat"]):
        capsys.readouterr()
        assert main(["report", "toy-induction", "-o", str(bad), "--quiet"] + argv) == 2
        err = capsys.readouterr().err
        lines = [x for x in err.splitlines() if not x.startswith("qkcircuits: using device")]
        assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err
        assert not bad.exists()
    assert main(["report", "toy-induction", "-o", str(tmp_path / "no" / "r.html"), "--quiet"]) == 2


def test_cli_report_reads_the_ablate_sweep_json(tmp_path, toy_scores):
    sweep = tmp_path / "sweep.json"
    assert main(["ablate", "toy-induction", "--sweep", "--n-seqs", "2", "--seg-len", "12", "--quiet",
                 "--json", str(sweep)]) == 0
    back = qk.results.HeadEffects.from_json(sweep.read_text(encoding="utf-8"))
    assert (back.kind, back.n_prompts, back.layers, back.method) == ("sweep", 2, [0, 1], "zero")
    scores = tmp_path / "scan.json"
    toy_scores.to_json(scores)
    out = tmp_path / "r.html"
    assert main(["report", "toy-induction", "-o", str(out), "--scores", str(scores), "--ablation", str(sweep),
                 "--grid-k", "1", "--quiet"]) == 0
    data = source_data(out.read_text(encoding="utf-8"))
    assert "ablation" in [g["key"] for g in data["grids"]]
    # Without the induction head nothing reaches the output block: uniform over V = 32 tokens.
    assert data["panels"]["1.0"]["info"]["ablation"]["effect"] == pytest.approx(math.log(32), abs=1e-4)


def test_report_file_has_a_new_files_usual_permissions(tmp_path):
    path = tmp_path / "r.html"
    write_report(path, "<html></html>")
    normal = tmp_path / "normal.txt"
    normal.write_text("x")                               # what open() gives under this process's umask
    mode = stat.S_IMODE(path.stat().st_mode)
    assert mode == stat.S_IMODE(normal.stat().st_mode)
    umask = os.umask(0o022)
    os.umask(umask)
    assert mode == 0o666 & ~umask and (umask & 0o004 or mode & 0o004)   # world-readable unless the umask says no
    with pytest.raises(qk.QKCircuitsError, match="does not exist"):
        write_report(tmp_path / "no" / "r.html", "x")


@pytest.mark.smollm2
def test_smollm2_report(smollm2):
    model = smollm2
    html = report_html(model, heads="0.3", grid_k=2, progress=False)
    size = len(html.encode("utf-8"))
    assert size < 8 * 2 ** 20, f"report is {size / 2 ** 20:.1f} MiB"
    data = source_data(html)
    assert data["first"] == "0.3" and "0.3" in data["panels"]
    p = data["panels"]["0.3"]
    labels = [t for t in p["figures"]["qk"]["layout"]["yaxis"]["ticktext"]]
    assert "␣the" in labels and len(labels) >= 20
    assert p["figures"]["pos"] is not None and p["figures"]["comp"] is None
    # Layer-0 QK diagonal == the model's own score at offset 0 (rotary is the identity there).
    ids = token_set(model)
    acts = qk.capture(model, torch.tensor([ids]), ["rot_q", "rot_k"], layers=[0])
    own = (acts.head("rot_q", 0, 3)[0] * acts.head("rot_k", 0, 3)[0]).sum(-1) * qk.weights.attn_scale(model, 0)
    z = torch.tensor(p["figures"]["qk"]["data"][0]["z"])
    torch.testing.assert_close(z.diagonal(), own.float(), rtol=1e-3, atol=1e-3)
    # Attention on the default prompt: it is the model's own pattern, rows sum to 1.
    att = torch.tensor(p["attention"]["attention"][0])
    n = len(prompt_ids(model, None))
    assert att.shape == (n, n) and torch.allclose(att.sum(-1), torch.ones(n), atol=2e-3)
    ref = qk.capture(model, torch.tensor([prompt_ids(model, None)]), ["pattern"], layers=[0])["pattern", 0][0, 3]
    torch.testing.assert_close(att, ref.float(), atol=6e-5, rtol=0)
