"""Contextual / effective / direct token inputs, copying ranks, ov_copying and the restricted scan, checked
against the model's own activations (independent forwards), heads known by construction, and the CLI."""

from __future__ import annotations

import json
from importlib import metadata

import _tiny
import pytest
import torch

import qkcircuits as qk
from qkcircuits._weights import contextual as C


@pytest.fixture(scope="module", params=["gpt2", "llama", "mqa", "gemma3"])
def tiny(request, tmp_path_factory):
    folder = {"gpt2": _tiny.gpt2_dir, "llama": _tiny.llama_dir, "mqa": _tiny.llama_mqa_dir,
              "gemma3": _tiny.gemma3_dir}[request.param](tmp_path_factory)
    return request.param, folder, qk.load(str(folder), device="cpu", verbose=False)


def _ln1_out(model, tokens, layer):
    name = qk.weights.attn_input_hook(model, layer)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n == name)
    return cache[name]


def test_contextual_rows_are_the_mean_input_over_the_corpus_and_absent_tokens_fall_back(tiny):
    _, _, model = tiny
    seq = min(128, model.cfg.n_ctx - 1)
    text = model.tokenizer(qk.natural_text(), add_special_tokens=False)["input_ids"]
    bos = model.tokenizer.bos_token_id if model.tokenizer.bos_token_id is not None else model.tokenizer.eos_token_id
    rows = [torch.tensor([[bos] + text[s:s + seq]]) for s in range(0, len(text), seq)]    # every token, BOS first
    body = torch.cat([r[0, 1:] for r in rows])
    present = torch.unique(body)[:5].tolist() + [text[-1]]               # the last token: in the short last row
    absent = [t for t in range(model.cfg.d_vocab) if t not in set(body.tolist())][:2]
    for layer in range(model.cfg.n_layers):
        x = C.token_inputs(model, layer, present + absent, "contextual")
        h = torch.cat([_ln1_out(model, r, layer)[0, 1:] for r in rows])    # independent forwards, BOS left out
        for n, t in enumerate(present):
            ref = h[body == t].mean(0)
            torch.testing.assert_close(x.rows[n], ref, rtol=1e-4, atol=1e-5)
            assert x.source[n] == "contextual" and int(x.counts[n]) == int((body == t).sum())
        assert x.source[len(present):] == ["effective"] * len(absent) and "fell back to effective" in x.note
        eff = C.token_inputs(model, layer, absent, "effective").rows
        torch.testing.assert_close(x.rows[len(present):], eff)


def test_effective_and_direct_rows_are_what_the_layer_reads_for_a_token_alone(tiny):
    """A one-token sequence (no BOS): layer 1's own ln1 output is the effective row (the residual after
    block 0, normalised by layer 1); at layer 0 of a rotary model (no added position) it is the direct row."""
    name, _, model = tiny
    ids = [5, 17, 42]
    eff = C.token_inputs(model, 1, ids, "effective").rows
    ref = _ln1_out(model, torch.tensor(ids)[:, None], 1)[:, 0]
    torch.testing.assert_close(eff, ref, rtol=1e-4, atol=1e-5)
    if name != "gpt2":
        direct = C.token_inputs(model, 0, ids, "direct").rows
        torch.testing.assert_close(direct, _ln1_out(model, torch.tensor(ids)[:, None], 0)[:, 0], rtol=1e-4, atol=1e-5)
    assert C.token_inputs(model, 0, ids, "effective").source == ["effective"] * 3


def test_copying_ranks_do_not_depend_on_fold_ln(tiny):
    _, folder, model = tiny
    raw = qk.load(str(folder), device="cpu", fold_ln=False, verbose=False)
    ids = list(range(3, 40))
    for inp in C.INPUTS:
        a, b = C.copying_rank(model, "1.2", ids, inp), C.copying_rank(raw, "1.2", ids, inp)
        assert (a - b).abs().max() <= 1.0, (inp, a, b)                 # at most a float tie resolved differently
    torch.testing.assert_close(qk.copying_scores(model), qk.copying_scores(raw), atol=1e-4, rtol=0)
    torch.testing.assert_close(qk.copying_scores(model, full=False), qk.copying_scores(raw, full=False),
                               atol=1e-4, rtol=0)
    # Olsson copying reads the head's write through the final norm in both fold modes (issue 11)
    kw = dict(scores=["copying"], n_seqs=2, progress=False)
    olsson, olsson_raw = qk.scan(model, **kw)["copying"], qk.scan(raw, **kw)["copying"]
    assert olsson.abs().max() > 1e-3                                   # not trivially zero
    torch.testing.assert_close(olsson, olsson_raw, atol=1e-4, rtol=0)


def test_mid_rank_and_rank_score():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    r = C.mid_rank(logits, torch.tensor([0, 1, 0]))
    assert r.tolist() == [1.0, 2.5, 4.0]                                  # top, all tied = (V+1)/2, last
    assert C.rank_score(r, 4).tolist() == pytest.approx([1.0, 0.0, -1.0])


def test_bad_inputs_are_one_line_errors(hand_built):
    for call, fragment in ((lambda: C.token_inputs(hand_built, 1, [3], "raw"), "input must be one of"),
                           (lambda: C.token_inputs(hand_built, 5, [3]), "out of range"),
                           (lambda: C.token_inputs(hand_built, 1, [999]), "within 0-31"),
                           (lambda: qk.scan(hand_built, scores=["induction", "copy"]), "unknown score 'copy'")):
        with pytest.raises(qk.QKCircuitsError, match=fragment) as e:
            call()
        assert "\n" not in str(e.value)


def test_restricted_scan_is_one_pattern_pass_and_nothing_else(hand_built, monkeypatch):
    import qkcircuits._weights.contextual
    import qkcircuits._weights.copying
    import qkcircuits._analysis.detect as detect

    calls = []
    real = detect.stream

    def counting(model, tokens, reducer, names=("pattern",), **kw):
        calls.append((tuple(tokens.shape), tuple(names)))
        return real(model, tokens, reducer, names, **kw)

    def forbidden(*a, **k):
        raise AssertionError("a restricted scan computed a copying score")

    monkeypatch.setattr(detect, "stream", counting)
    monkeypatch.setattr(qkcircuits._weights.copying, "copying_scores", forbidden)
    monkeypatch.setattr(qkcircuits._weights.contextual, "ov_copying", forbidden)
    s = qk.scan(hand_built, scores="induction,previous_token,duplicate_token", n_seqs=4, seg_len=20, progress=False)
    assert calls == [((4, 41), ("pattern",))]
    assert list(s.scores) == ["induction", "previous_token", "duplicate_token"]
    assert s.settings["scores"] == list(s.scores)
    assert s["induction"][1, 0] > 0.99 and s["previous_token"][0, 0] > 0.99


def test_scan_settings_record_the_installed_transformer_lens(hand_built):
    s = qk.scan(hand_built, scores=["induction"], n_seqs=1, seg_len=8, progress=False)
    assert s.settings["versions"]["transformer_lens"] == metadata.version("transformer-lens") != "?"


def test_report_panel_defaults_to_contextual_past_layer_0_and_titles_say_so(tiny):
    from qkcircuits.viz._panels import ViewContext, token_set
    from qkcircuits.viz._views import panel

    _, _, model = tiny
    ctx = ViewContext(model)
    ids = token_set(model)[:8] or list(range(8))
    p1 = panel(ctx, qk.Head(1, 0), ids, None, k=3)
    assert p1["input"] == "contextual"
    assert "contextual inputs" in p1["figures"]["qk"]["layout"]["title"]["text"]
    assert "contextual inputs" in p1["figures"]["ov"]["layout"]["title"]["text"]
    ranks = p1["info"]["token_views"]["copying_rank"]
    assert len(ranks) == len(ids) and all(1 <= r <= model.cfg.d_vocab for r in ranks)
    assert all("⟨" in t for t in p1["figures"]["ov"]["layout"]["yaxis"]["ticktext"])
    p0 = panel(ctx, qk.Head(0, 0), ids, None, k=3)
    assert p0["input"] == "direct" and "direct inputs" in p0["figures"]["qk"]["layout"]["title"]["text"]
    from qkcircuits.viz._panels import qk_grid
    for inp in C.INPUTS:                                     # the view is the public API's token_qk
        torch.testing.assert_close(qk_grid(ctx, qk.Head(1, 1), ids, inp), qk.weights.token_qk(model, "1.1", ids, inp)[0])
    pe = panel(ctx, qk.Head(1, 0), ids, None, k=3, view="effective")
    assert "effective inputs" in pe["figures"]["ov"]["layout"]["title"]["text"]


def test_app_accepts_a_view_and_refuses_a_bad_one(hand_built):
    from qkcircuits.viz import create_app

    client = create_app(hand_built).test_client()
    r = client.post("/api/head", json={"head": "1.0", "view": "effective"})
    assert r.status_code == 200 and r.get_json()["input"] == "effective"        # the panel data's key stays
    r = client.post("/api/head", json={"head": "1.0", "view": "bogus"})
    assert r.status_code == 400 and "'view' must be one of direct, effective, contextual" in r.get_json()["error"]
    r = client.post("/api/head", json={"head": "1.0", "input": "effective"})      # the old field went in 0.2.0
    assert r.status_code == 400 and "unknown field(s) input" in r.get_json()["error"]


def test_cli_scan_scores_and_small_errors(tmp_path, capsys):
    from _cli import run

    out = tmp_path / "s.json"
    code, _, err = run(["scan", "toy-induction", "--quiet", "--scores", "induction,previous_token,duplicate_token",
                        "--json", out], capsys)
    assert code == 0, err
    assert list(json.loads(out.read_text())["scores"]) == ["induction", "previous_token", "duplicate_token"]
    same = tmp_path / "both"
    code, _, err = run(["scan", "toy-induction", "--quiet", "--json", same, "--csv", same], capsys)
    assert code == 2 and "same file" in err and "Traceback" not in err
    assert not same.exists()
    code, _, err = run(["scan", "toy-induction", "--quiet", "--scores", "induction,nope"], capsys)
    assert code == 2 and "unknown score 'nope'" in err
    code, _, err = run(["diagnose", "toy-induction", "--seg-len", "100"], capsys)
    assert code == 2 and "--seg-len" in err and "--seq-len" not in err
    code, _, err = run(["scan", "toy-induction", "--quiet", "--dtype", "float16", "--scores", "induction", "--json",
                        out], capsys)
    assert code == 0, err
    data = json.loads(out.read_text())
    assert data["settings"]["dtype"] == "torch.float16" and data["scores"]["induction"][1][0] > 0.99


def test_cli_circuits_says_when_there_is_no_positional_preference():
    from qkcircuits.cli.circuits_command import format_summary

    s = {"head": "0.1", "model": "m", "fold_ln": True, "attn_scale": 1.0, "caveats": [],
         "copying": {"ov": 0.0, "full_ov": 0.0, "full_ov_rank": 1, "n_heads": 4},
         "k_composition": {"baseline": 0.1, "partners": []},
         "positions": {"kind": "learned", "rows": "W_pos", "preferred_offset": 0, "score_at_preferred": 0.0,
                       "score_at_0": 0.0, "score_range": 0.0, "mean_score": [0.0] * 5}}
    text = format_summary(s)
    assert "no positional preference" in text and "prefers offset" not in text
    s["positions"].update(preferred_offset=1, score_at_preferred=2.0, score_range=2.0, mean_score=[0.0, 2.0, 1.0])
    assert "prefers offset 1" in format_summary(s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_rank_counts_are_the_plain_comparisons(dtype):
    """rank_counts counts by signs and in-place tests for speed: the same counts as the comparisons it states
    (ℓ_v > ℓ_t + tol, |ℓ_v − ℓ_t| ≤ tol) on exact ties, values just inside and outside the tolerance, NaN and inf,
    in every dtype the weights come in; its input is left as it was."""
    from qkcircuits._weights.contextual import rank_counts

    g = torch.Generator().manual_seed(0)
    L = torch.randn(64, 3000, generator=g).to(dtype)
    own = torch.randn(64, 1, generator=g).to(dtype)
    L[:, :5] = own
    L[:, 5:7], L[:, 7:9] = own * (1 + 0.9e-5), own * (1 + 1.1e-5)
    L[0, 9], L[1, 10], own[2], own[3], L[3, :20] = float("nan"), float("inf"), float("nan"), 0, 0
    before = L.clone()
    tol = own.abs() * 1e-5
    greater, equal = rank_counts(L, own)
    assert torch.equal(greater, (L > own + tol).sum(-1)) and torch.equal(equal, ((L - own).abs() <= tol).sum(-1))
    assert greater.dtype == equal.dtype == torch.int64 and int(equal[3]) == 20
    assert torch.equal(L.nan_to_num(), before.nan_to_num())
