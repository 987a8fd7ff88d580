"""``qk.attend``: exact QK attribution of a head's scores into pairs of upstream sources.

Ground truth, three kinds:
- the hand-built toy, whose heads are known by construction (exact values, not just rankings);
- every family's own attention, from transformers alone (eager attention, ``output_attentions``; never through the
  bridge or qkcircuits): the versus reading of row (i, j, v) is log A[i, j] − log A[i, v] and the contrast reading
  the mean over the other attendable keys k of log A[i, j] − log A[i, k] (before a soft-cap; capped families are
  checked through the cap);
- exact identities: the pairs add up to the total, each side's marginals to each row's value, the raw reading to
  the score the bridge captures, an expanded head's positions to that head's whole value.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import qkcircuits as qk
from qkcircuits._foundation.arch import adapter

from _cli import errors, run
from _tiny import (_once, tiny_bloom, tiny_cohere_qknorm, tiny_deepseek, tiny_gemma2, tiny_gemma3, tiny_gpt2,
                   tiny_gptj, tiny_gptneo, tiny_llama_gqa, tiny_llama_mqa, tiny_neox, tiny_smollm3)

FAMILIES = {
    "gpt2": tiny_gpt2,                  # learned positions (a pos source), biases everywhere, LayerNorm
    "llama_gqa": tiny_llama_gqa,        # rotary, GQA: the key side is the KV head's
    "mqa": tiny_llama_mqa,              # one KV head for all query heads
    "gemma2": tiny_gemma2,              # soft-capped scores, post-norms, sliding window, 1 + w norms
    "gemma3": tiny_gemma3,              # RMS QK-norm, rotary per layer type, window, query_pre_attn_scalar
    "neox": tiny_neox,                  # partial rotary, parallel blocks, fused qkv with biases
    "gptj": tiny_gptj,                  # interleaved rotary that never fires hook_rot_q, one norm for attn and MLP
    "cohere_qk": tiny_cohere_qknorm,    # a per-head LayerNorm QK-norm (centring), interleaved rotary
    "gptneo": tiny_gptneo,              # unscaled scores, a local layer (window 4)
    "smollm3": tiny_smollm3,            # a NoPE layer between rotary ones
    "bloom": tiny_bloom,                # ALiBi: a position_bias source on both sides
    "deepseek_v3": lambda d: tiny_deepseek(d),                            # MLA, query latent, interleaved rope
    "deepseek_v2_yarn": lambda d: tiny_deepseek(d, version=2, yarn=True),  # MLA, YaRN: scale is not 1/sqrt(d)
}

# query, key, versus positions: offsets 1-3 back, so every row fits the smallest window (GPT-Neo's 4)
QUERY, KEY, VERSUS = [10, 14, 18], [9, 11, 16], [8, 12, 17]


def _tokens(vocab: int) -> torch.Tensor:
    seg = (torch.arange(9) * 37 + 11) % (vocab - 2) + 1                       # 9 distinct ids
    return torch.cat([torch.tensor([0]), seg, seg])[None].repeat(2, 1)      # [BOS] + R + R, two prompts


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = _once(f"attend_{request.param}", tmp_path_factory, FAMILIES[request.param])
    model = qk.load(str(folder), verbose=False)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    return request.param, model, hf


def _heads(model):
    n = int(model.cfg.n_heads)
    return [f"{L}.{h}" for L in range(int(model.cfg.n_layers)) for h in sorted({0, n - 1})]


def test_every_family_splits_exactly_and_agrees_with_transformers(family):
    name, model, hf = family
    t = _tokens(int(model.cfg.d_vocab))
    with torch.no_grad():
        A = hf(t, output_attentions=True).attentions                              # transformers' own, per layer
    for head in _heads(model):
        L, h = (int(x) for x in head.split("."))
        cap = adapter(model, L).softcap()
        capped = (lambda x: cap * math.tanh(x / cap)) if cap else (lambda x: x)
        raw = qk.attend(model, head, t, query=QUERY, key=KEY, reading="raw")
        raw_v = qk.attend(model, head, t, query=QUERY, key=VERSUS, reading="raw")
        con = qk.attend(model, head, t, query=QUERY, key=KEY)
        vs = qk.attend(model, head, t, query=QUERY, key=KEY, versus=VERSUS)
        for r in (raw, raw_v, con, vs):
            assert r.exact_error <= 1e-5, (name, head, r.reading, r.exact_error, r.settings)
            # every source's write is accounted for (the remainder is one constant) and the parts add up
            assert r.settings["bias_spread"] <= 1e-6 and r.settings["parts_error"] <= 1e-6, (name, head, r.settings)
            # identities: the pairs (kept + "other") add up to the total; each row's two marginals agree
            assert float(r.pair_values.sum()) == pytest.approx(r.total, rel=1e-9, abs=1e-9)
            torch.testing.assert_close(r.query_values.sum(1), r.key_values.sum(1), rtol=1e-9, atol=1e-9)
        for n, row in enumerate(raw.rows):
            b, i, j = row["prompt"], row["query"], row["key"]
            v = raw_v.rows[n]["key"]
            s_j, s_v = row["value"], raw_v.rows[n]["value"]
            # versus = raw(j) − raw(v) before the cap; transformers' attention gives the capped difference
            assert vs.rows[n]["value"] == pytest.approx(s_j - s_v, abs=1e-6)
            assert capped(s_j) - capped(s_v) == pytest.approx(float(A[L][b, h, i, j].log() - A[L][b, h, i, v].log()),
                                                              abs=2e-4), (name, head, n)
            win = adapter(model, L).window()
            others = [k for k in range(i + 1) if k != j and (win is None or i - k < win)]
            if not cap:                          # contrast = mean over the other keys of log A[i, j] − log A[i, k]
                want = float(torch.stack([A[L][b, h, i, j].log() - A[L][b, h, i, k].log() for k in others]).mean())
                assert con.rows[n]["value"] == pytest.approx(want, abs=2e-4), (name, head, n)
            assert row["attention"] == pytest.approx(float(A[L][b, h, i, j]), abs=1e-5)
        # the raw reading equals the score the bridge captures (its soft-capped value where it caps)
        got = qk.capture(model, t, ["scores"], layers=[L])["scores", L]
        for row in raw.rows:
            assert capped(row["value"]) == pytest.approx(float(got[row["prompt"], h, row["query"], row["key"]]),
                                                         rel=1e-4, abs=1e-4), (name, head)


def test_expanded_head_sources_add_up_to_their_whole_value(family):
    name, model, _ = family
    if int(model.cfg.n_layers) < 2:
        pytest.skip("one layer: no earlier head to expand")
    t = _tokens(int(model.cfg.d_vocab))
    L = int(model.cfg.n_layers) - 1
    for side in ("key", "query"):
        r = qk.attend(model, f"{L}.0", t, query=QUERY, key=KEY, expand=side, k=3)
        scale = max(abs(v) for _, v, _ in r.key_sources()) + 1e-12
        assert r.settings["expand_error"] <= 1e-6 * scale, (name, side, r.settings["expand_error"])
        assert r.expanded and all(e["side"] == side for e in r.expanded), (name, side)


def test_the_hand_built_heads_are_explained_exactly(hand_built):
    model = hand_built
    t = qk.repeated_tokens(model, n_seqs=2, seg_len=6, seed=0)                # [BOS] + R + R, R without repeats
    # raw: the induction head's score at its target is the pair (token embedding) x (0.0's write), nothing else
    raw = qk.attend(model, "1.0", t, key="induction", reading="raw")
    assert len(raw.rows) == 2 * 6 and raw.attention > 0.999                  # every token of the second copy
    assert raw.key_sources(1)[0][0] == "0.0" and raw.key_sources(1)[0][2] == pytest.approx(1.0, abs=1e-9)
    assert all(abs(s) < 1e-9 for n, _, s in raw.key_sources() if n != "0.0")
    assert all(abs(s) < 1e-9 for n, _, s in raw.query_sources() if n != "emb")
    assert raw.query_sources(1)[0][0] == "emb" and raw.total == pytest.approx(30.0, abs=1e-4)   # the margin
    # contrast: the BOS fallback (query bias c/2 x the key's position-0 feature, 15 after scaling) is among the
    # other keys, so each row is 30 − 15 / (number of other keys) = 30 − 15 / i; key side 0.0 gives 30, pos the rest
    con = qk.attend(model, "1.0", t, key="induction")
    for row in con.rows:
        assert row["value"] == pytest.approx(30 - 15 / row["query"], abs=1e-4)
    ks = {n: v for n, v, _ in con.key_sources()}
    qs = {n: v for n, v, _ in con.query_sources()}
    fallback = sum(-15 / r["query"] for r in con.rows) / len(con.rows)
    assert ks["0.0"] == pytest.approx(30.0, abs=1e-4) and ks["pos"] == pytest.approx(fallback, abs=1e-4)
    assert qs["emb"] == pytest.approx(30.0, abs=1e-4) and qs["bias_q"] == pytest.approx(fallback, abs=1e-4)
    assert all(abs(v) < 1e-6 for n, v in ks.items() if n not in ("0.0", "pos"))
    # the previous-token head attends by position on both sides (the seeds' point), exactly
    prev = qk.attend(model, "0.0", t, query=[5, 9], key=[4, 8])
    assert prev.key_sources(1)[0][:1] == ("pos",) and prev.query_sources(1)[0][:1] == ("pos",)
    assert prev.key_sources(1)[0][2] == pytest.approx(1.0, abs=1e-9)
    assert prev.query_sources(1)[0][2] == pytest.approx(1.0, abs=1e-9)
    # one level deeper: 0.0's write at the key came from the position before it, all of it
    exp = qk.attend(model, "1.0", t, key="induction", expand="key", k=1)
    top = exp.expanded[0]
    assert (top["source"], top["offset"]) == ("0.0", 1) and top["share"] == pytest.approx(1.0, abs=1e-6)
    assert any("came from position j-1" in s for s in exp.sentences())


def test_rows_from_a_task_equal_explicit_positions(family):
    name, model, _ = family
    t = _tokens(int(model.cfg.d_vocab))
    task = qk.Task(t, t.flip(1), answer=1, wrong=2, positions={"Q": torch.tensor(QUERY[:2]), "K": torch.tensor(KEY[:2]),
                                                                "V": torch.tensor(VERSUS[:2])})
    head = f"{int(model.cfg.n_layers) - 1}.0"
    a = qk.attend(model, head, task=task, query="Q", key="K", versus="V")
    b = qk.attend(model, head, t[:1], query=QUERY[0], key=KEY[0], versus=VERSUS[0])
    c = qk.attend(model, head, t[1:], query=QUERY[1], key=KEY[1], versus=VERSUS[1])
    # (one prompt vs two per forward: float32 rounding of the parts differs, ~1e-7)
    assert [r["value"] for r in a.rows] == pytest.approx([b.rows[0]["value"], c.rows[0]["value"]], rel=1e-5, abs=1e-5)
    assert a.settings["positions"] == {"query": "Q", "key": "K", "versus": "V"}


def test_json_round_trip_is_exact(hand_built, tmp_path):
    t = qk.repeated_tokens(hand_built, n_seqs=2, seg_len=6, seed=0)
    r = qk.attend(hand_built, "1.0", t, key="induction", expand="key")
    back = qk.results.Attribution.from_json(r.to_json(tmp_path / "a.json"))
    assert type(qk.load_result(tmp_path / "a.json")) is qk.results.Attribution
    for f in ("model", "head", "reading", "rows", "query_names", "key_names", "pair_query", "pair_key", "exact_error",
              "expanded"):
        assert getattr(back, f) == getattr(r, f), f
    for f in ("query_values", "key_values", "pair_values"):
        assert torch.equal(getattr(back, f), getattr(r, f)), f
    assert back.settings == json.loads(json.dumps(r.settings))
    assert back.sentences() == r.sentences()
    frame = r.to_frame()
    assert set(frame["side"]) == {"query", "key"} and len(frame) == len(r.rows) * (len(r.query_names) + len(r.key_names))


@pytest.mark.parametrize("kw,msg", [
    (dict(reading="sideways"), "unknown reading 'sideways'"),
    (dict(reading="raw", versus=3), "versus= compares two keys"),
    (dict(query=3, key=5), "comes after the query position"),
    (dict(query=3, key=40), "outside prompt 0"),
    (dict(query=[3, 4], key=[1]), "the same number of positions"),
    (dict(query=3.5, key=1), "query must be a position"),
    (dict(expand="value"), "expand must be 'key', 'query' or None"),
])
def test_bad_arguments_are_one_line_errors(hand_built, kw, msg):
    t = qk.repeated_tokens(hand_built, n_seqs=1, seg_len=6, seed=0)
    kw = {"query": 8, "key": 2, **kw}
    with pytest.raises(qk.QKCircuitsError, match=msg.replace("(", r"\(").replace(")", r"\)")) as e:
        qk.attend(hand_built, "1.0", t, **kw)
    assert "\n" not in str(e.value)


def test_heads_and_task_positions_are_checked(hand_built):
    t = qk.repeated_tokens(hand_built, n_seqs=1, seg_len=6, seed=0)
    with pytest.raises(qk.QKCircuitsError, match="one head at a time"):
        qk.attend(hand_built, "1.*", t, key="induction")
    task = qk.Task(t, t, 1, 2, positions={"IO": torch.tensor([3])})
    with pytest.raises(qk.QKCircuitsError, match="'S9' is not a position of task"):
        qk.attend(hand_built, "1.0", task=task, key="S9")
    with pytest.raises(qk.QKCircuitsError, match="give tokens or a task, not both"):
        qk.attend(hand_built, "1.0", t, task=task, key="IO")


def test_keys_outside_a_sliding_window_are_refused(family):
    name, model, _ = family
    win = [adapter(model, L).window() for L in range(int(model.cfg.n_layers))]
    if any(win):
        L = next(L for L, w in enumerate(win) if w)
        with pytest.raises(qk.QKCircuitsError, match="outside this layer's sliding window"):
            qk.attend(model, f"{L}.0", _tokens(int(model.cfg.d_vocab)), query=18, key=2)


def test_cli_prints_sentences_and_writes_the_json_contract(tmp_path, capsys):
    out, page = tmp_path / "a.json", tmp_path / "a.html"
    code, stdout, stderr = run(["attend", "toy-induction", "--head", "1.0", "--expand", "key", "--n", "4",
                                "--json", out, "-o", page], capsys)
    assert code == 0, stderr
    assert "Key side: 0.0 (previous-token)" in stdout and "came from position j-1" in stdout, stdout
    d = json.loads(out.read_text())
    for key in ("model", "head", "reading", "rows", "attention", "total", "exact_error", "query_sources",
                "key_sources", "pairs", "settings"):
        assert key in d, key
    assert d["key_sources"][0][0] == "0.0" and d["exact_error"] <= 1e-5
    assert "Plotly.newPlot" in page.read_text() and "cdn" not in page.read_text().lower().split("<body>")[1][:2000]


@pytest.mark.parametrize("args,msg", [
    (["--prompt", "a b", "--task", "ioi"], "give --task or --prompt, not both"),
    (["--prompt", "a b"], "give --key J"),
    (["--task", "ioi"], "name the key position with --to"),
    (["--task", "induction", "--to", "IO"], "picks its own rows"),
    (["--task", "nofile.jsonl", "--to", "IO"], "expected a registered task (ioi, induction"),
    (["--query", "3"], "--query/--key are positions in a --prompt"),
    (["--head", "9.0"], "layer"),
])
def test_cli_errors_are_one_line(args, msg, tmp_path, capsys):
    out = tmp_path / "a.json"
    base = ["attend", "toy-induction", "--json", out, "--no-labels"]
    if "--head" not in args:
        base += ["--head", "1.0"]
    code, _, stderr = run(base + args, capsys)
    assert code == 2, stderr
    err = errors(stderr)
    assert len(err) == 1 and msg in err[0], stderr
    assert "Traceback" not in stderr and not out.exists()


def test_alibi_is_its_own_source(family):
    name, model, _ = family
    t = _tokens(int(model.cfg.d_vocab))
    r = qk.attend(model, f"{int(model.cfg.n_layers) - 1}.1", t, query=QUERY, key=KEY, reading="raw")
    if name != "bloom":
        assert "position_bias" not in r.key_names
        return
    # the raw score's position bias is slope_h · j: its pair (position_bias, position_bias) is exactly that
    slope = float(adapter(model, int(model.cfg.n_layers) - 1).alibi_slopes()[1])
    i = r.pair_query.index("position_bias") if "position_bias" in r.pair_query else None
    q = {n: v for n, v, _ in r.query_sources()}
    assert q["position_bias"] == pytest.approx(slope * sum(KEY) / len(KEY) * 1.0, rel=1e-6), (q, i)


def test_an_attention_the_parts_do_not_rebuild_is_refused(hand_built, monkeypatch):
    from qkcircuits._foundation.arch.standard import StandardAttention

    t = qk.repeated_tokens(hand_built, n_seqs=1, seg_len=6, seed=0)
    real = StandardAttention.scale
    monkeypatch.setattr(StandardAttention, "scale", lambda self: (-real(self)[0], "wrong", None))   # sign flipped
    with pytest.raises(qk.QKCircuitsError, match="not exact .*rebuilt scores vs the model's own attention") as e:
        qk.attend(hand_built, "1.0", t, key="induction")
    assert "\n" not in str(e.value)


def test_prompt_shards_give_the_single_shard_result(family):
    # batch_size 1 runs one forward per prompt; everything, the expansion's choice of heads included, must be the same
    name, model, _ = family
    t = _tokens(int(model.cfg.d_vocab))
    t = torch.cat([t, t.roll(3, 1)])                                              # 4 prompts, two different
    head = f"{int(model.cfg.n_layers) - 1}.0"
    one = qk.attend(model, head, t, query=QUERY, key=KEY, expand="key", k=2)
    many = qk.attend(model, head, t, query=QUERY, key=KEY, expand="key", k=2, batch_size=1)
    assert [r["value"] for r in many.rows] == pytest.approx([r["value"] for r in one.rows], rel=1e-5, abs=1e-6)
    assert many.query_names == one.query_names and many.pair_query == one.pair_query
    torch.testing.assert_close(many.pair_values, one.pair_values, rtol=1e-5, atol=1e-6)
    assert [(e["source"], e.get("offset"), round(e["value"], 4)) for e in many.expanded] == \
        [(e["source"], e.get("offset"), round(e["value"], 4)) for e in one.expanded]


def test_a_missing_write_is_refused_not_hidden_in_the_bias(hand_built, monkeypatch):
    # drop head 0.0's write: the residual's remainder (the bias) would absorb it and the scores still rebuild, but
    # the remainder is then no constant, and the attribution must say so instead of explaining with a wrong source
    from qkcircuits._explain.writes import Writes

    real = Writes.head_out_map
    monkeypatch.setattr(Writes, "head_out_map", lambda self, l: real(self, l) * 0)
    t = qk.repeated_tokens(hand_built, n_seqs=1, seg_len=6, seed=0)
    with pytest.raises(qk.QKCircuitsError, match="the bias. is not one constant"):
        qk.attend(hand_built, "1.0", t, key="induction")


@pytest.mark.parametrize("tokens,kw,msg", [
    ([[0, 5, 6], [1, 2]], dict(query=2, key=1), "tokens must be"),
    (["ab", 3], dict(query=1, key=0), "tokens must be"),
    (None, dict(query=0, key=0), "nothing to contrast with"),
])
def test_more_bad_inputs_are_one_line_errors(hand_built, tokens, kw, msg):
    t = qk.repeated_tokens(hand_built, n_seqs=1, seg_len=6, seed=0) if tokens is None else tokens
    with pytest.raises(qk.QKCircuitsError, match=msg) as e:
        qk.attend(hand_built, "1.0", t, **kw)
    assert "\n" not in str(e.value)
    with pytest.raises(qk.QKCircuitsError, match="labels must be"):
        qk.attend(hand_built, "1.0", qk.repeated_tokens(hand_built, n_seqs=1, seg_len=6, seed=0), key="induction",
                  labels=["x"])


def test_the_report_explains_the_top_heads_and_reads_attend_files(tmp_path, capsys):
    import re

    out = tmp_path / "a.json"
    assert run(["attend", "toy-induction", "--head", "1.0", "--json", out, "--no-labels"], capsys)[0] == 0
    html_default = tmp_path / "r.html"
    code, _, err = run(["report", "toy-induction", "-o", html_default, "--quiet", "--grid-k", "1"], capsys)
    assert code == 0, err
    text = html_default.read_text()
    # the top induction head and the top previous-token head, each explained on its own rows
    assert "Why 1.0 attends (top induction head)" in text and "Why 0.0 attends (top previous-token head)" in text
    assert re.search(r"Key side: 0\.0 \(previous-token\) 1\d\d %", text), "induction head's keys from 0.0"
    html = tmp_path / "r2.html"
    code, _, err = run(["report", "toy-induction", "-o", html, "--quiet", "--grid-k", "1", "--attend", out], capsys)
    assert code == 0, err
    text = html.read_text()
    assert "Why 1.0 attends" in text and "(top induction head)" not in text
    code, _, err = run(["report", "toy-induction", "-o", tmp_path / "r3.html", "--no-attend", "--grid-k", "1"], capsys)
    assert code == 0 and "Why 1.0 attends" not in (tmp_path / "r3.html").read_text()
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "qkcircuits.head_scores/1"}')
    code, _, err = run(["report", "toy-induction", "-o", tmp_path / "r4.html", "--attend", bad], capsys)
    assert code == 2 and len(errors(err)) == 1 and "--attend" in errors(err)[0] and not (tmp_path / "r4.html").exists()


def test_roles_carry_the_qk_evidence_of_their_induction_head(hand_built):
    # issue 34 ask 7: the task circuit's induction head 1.0 gets why it attends: its keys from previous-token head
    # 0.0, its queries from the token embedding (the hand-built truth), named with their roles in the sentences
    # and the report's roles table; the numbers are qk.attend's own on the same rows
    task = qk.tasks.induction(hand_built, n=4, seg_len=6)
    scores = qk.edge_scores(hand_built, task, method="eap", progress=False)
    roles = qk.roles(hand_built, task, scores.circuit(percent=20))
    assert "induction" in roles.roles["1.0"]["evidence"]["labels"]      # (its role: a direct-logit head here)
    ev = roles.roles["1.0"]["qk"]
    assert ev["key"][0][0] == "0.0" and ev["query"][0][0] == "emb" and ev["exact_error"] <= 1e-5
    direct = qk.attend(hand_built, "1.0", task=task)
    assert ev["key"][0][1] == pytest.approx(direct.key_sources(1)[0][2], abs=1e-4)
    assert ev["total"] == pytest.approx(direct.total, rel=1e-6)
    line = [s for s in roles.sentences() if s.lstrip().startswith("why 1.0")]
    assert len(line) == 1 and "key side 0.0" in line[0], roles.sentences()
    assert "qk" not in roles.roles["0.0"]                  # a previous-token head: no QK evidence asked
    back = qk.results.Roles.from_json(roles.to_json())
    assert back.roles["1.0"]["qk"]["key"] == ev["key"]
    from qkcircuits.viz._circuit_view import roles_rows
    from qkcircuits.viz._circuit_data import load_circuit

    view = load_circuit(scores.circuit(percent=20).to_dict(), roles=roles)
    row = next(r for r in roles_rows(view) if r[0] == "1.0")
    assert len(row) == 4 and row[3].startswith("attends from each repeated token to the token after its earlier copy "
                                               "(attention 1.00): query side emb"), row[3]
    assert "key side 0.0 (" in row[3] and "of the total" in row[3]
    none = qk.roles(hand_built, task, scores.circuit(percent=20), qk=False)
    assert "qk" not in none.roles["1.0"]


def test_a_refused_attribution_leaves_the_roles_and_says_why(hand_built, monkeypatch):
    # evidence is extra: an attention attend refuses costs that head its qk, never the roles
    from qkcircuits._explain import evidence

    def refuse(*a, **kw):
        raise qk.QKCircuitsError("head 1.0: the attribution is not exact on this model (a test's refusal)")

    monkeypatch.setattr(evidence, "attend_heads", refuse)
    task = qk.tasks.induction(hand_built, n=4, seg_len=6)
    roles = qk.roles(hand_built, task, qk.edge_scores(hand_built, task, method="eap", progress=False).circuit(percent=20))
    assert "qk" not in roles.roles["1.0"] and roles.roles["1.0"]["role"]
    assert roles.settings["qk_error"] == {"1.0": "QKCircuitsError: head 1.0: the attribution is not exact on this "
                                                 "model (a test's refusal)"}
