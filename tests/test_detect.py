"""Detectors against heads known by construction, a trained toy model, TransformerLens and SmolLM2."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import qkcircuits as qk
from qkcircuits._analysis.detect import mask_score, target_masks
from qkcircuits._foundation.stats import spearman

from _typecheck import unchecked

ROOT = Path(__file__).resolve().parents[1]


def _trainer():
    spec = importlib.util.spec_from_file_location("train_toy_induction", ROOT / "scripts/train_toy_induction.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def trained():
    return _trainer().load_trained(ROOT / "tests/fixtures/toy_induction")


# --- exact masks ---------------------------------------------------------------------------------

def test_masks_mark_exactly_the_arena_targets():
    toks = torch.tensor([[0, 5, 6, 7, 5, 6, 7]])          # [BOS] + R + R, L = 3
    m = target_masks(toks, seg_len=3)
    ind = {(q, k) for q, k in m["induction"][0].nonzero().tolist()}
    assert ind == {(4, 2), (5, 3), (6, 4)}                  # i -> i - L + 1
    dup = {(q, k) for q, k in m["duplicate_token"][0].nonzero().tolist()}
    assert dup == {(4, 1), (5, 2), (6, 3)}                  # i -> i - L
    prev = {(q, k) for q, k in m["previous_token"][0].nonzero().tolist()}
    assert prev == {(i, i - 1) for i in range(2, 7)}        # BOS never a target


def test_mask_score_counts_every_earlier_copy_so_a_perfect_head_scores_one():
    # a token repeated inside R: a perfect induction head splits attention between both targets
    toks = torch.tensor([[0, 5, 6, 5, 8, 5, 6, 5, 8]])
    m = target_masks(toks, seg_len=4)["induction"]
    pattern = m.float() / m.float().sum(-1, keepdim=True).clamp_min(1)
    pattern[0, :5, 0] = 1.0                                  # rows without targets sit on BOS
    assert torch.allclose(mask_score(pattern[:, None], m), torch.ones(1))


# --- hand-built heads (issue: >= 0.99 on their own score, every other head <= 0.05) --------------

def test_hand_built_heads_score_one_and_the_rest_near_zero(hand_built):
    s = qk.scan(hand_built, n_seqs=4, seg_len=20, prefix_len=10, eigen_copying=False, progress=False)
    own = {"induction": (1, 0), "prefix_matching": (1, 0), "previous_token": (0, 0)}
    for name, (layer, head) in own.items():
        t = s[name]
        assert t[layer, head] >= 0.99, (name, t)
        others = torch.cat([t.flatten()[: layer * 2 + head], t.flatten()[layer * 2 + head + 1:]])
        assert others.max() <= 0.05, (name, t)
    assert s["duplicate_token"].max() <= 0.05
    assert s.heads_labelled("induction") == [qk.Head(1, 0)]
    assert s.heads_labelled("previous-token") == [qk.Head(0, 0)]


def test_olsson_copying_is_one_for_a_copier_its_floor_for_an_anti_copier_and_zero_at_chance():
    from qkcircuits.fixtures import hand_built_induction_model

    model = hand_built_induction_model()
    s = qk.scan(model, scores=["induction", "copying", "ov_copying"], n_seqs=2, seg_len=20, progress=False)
    # Head 1.0 writes the attended token into the output block: among that sequence's 20 candidates only
    # that token's logit is above the mean, so its share of the positive mass is exactly 1 -> +1.
    assert s["copying"][1, 0] == pytest.approx(1.0, abs=1e-6)
    assert s["ov_copying"][1, 0] == pytest.approx(1.0, abs=1e-6)       # rank 1 for every source token
    # Heads whose output the unembedding never reads have all-zero logits: no preference, chance, 0.
    for layer, head in ((0, 0), (0, 1), (1, 1)):
        assert s["copying"][layer, head] == 0.0 and s["ov_copying"][layer, head] == 0.0
    attn = model.original_model.layers[1].attn
    with torch.no_grad():
        attn.o.weight.neg_()                 # the same head now pushes the attended token *down*
    anti = qk.scan(model, scores=["induction", "copying", "ov_copying"], n_seqs=2, seg_len=20, progress=False)
    assert anti["copying"][1, 0] == pytest.approx(-1 / 19, abs=1e-6)    # share 0: the floor -1/(n_candidates - 1)
    assert anti["ov_copying"][1, 0] == pytest.approx(-1.0, abs=1e-6)    # last of the vocabulary
    assert anti["induction"][1, 0] > 0.99   # where it looks is unchanged
    # A head that writes random directions: chance, whatever the seed of its W_O.
    olsson, ranks = [], []
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            used = (attn.o.weight != 0).any(0)
            attn.o.weight[:, used] = torch.randn(attn.o.weight.shape[0], int(used.sum()), generator=g)
        r = qk.scan(model, scores=["copying", "ov_copying"], n_seqs=8, seg_len=20, progress=False)
        olsson.append(float(r["copying"][1, 0]))
        ranks.append(float(r["ov_copying"][1, 0]))
    assert max(abs(v) for v in olsson) < 0.05, olsson
    assert abs(sum(ranks) / len(ranks)) < 0.06 and max(abs(v) for v in ranks) < 0.2, ranks


def test_olsson_copying_equals_each_querys_write_read_through_the_unembedding():
    """``olsson_copying`` contracts z with W_O·U first; the reference forms every query's d_model write."""
    from qkcircuits._analysis.detect import copying_candidates, olsson_copying

    g = torch.Generator().manual_seed(0)
    b, q, h, d, m = 3, 9, 4, 5, 7
    toks = torch.tensor([[0, 3, 4, 5, 6, 3, 4, 5, 6], [0, 7, 8, 8, 9, 7, 8, 8, 9], [0, 1, 2, 3, 4, 1, 2, 3, 4]])
    cand, valid, index = copying_candidates(toks)
    pattern = torch.rand(b, h, q, q, generator=g).tril().softmax(-1)
    z, W_O = torch.randn(b, q, h, d, generator=g), torch.randn(h, d, m, generator=g)
    U_c = torch.randn(b, m, cand.shape[1], generator=g)
    queries = torch.zeros(b, q, dtype=torch.bool)
    queries[:, 5:] = True
    got = olsson_copying(pattern, z, W_O, U_c, valid, index, queries)
    ref = torch.zeros(h)
    for hh in range(h):
        per = []
        for bb in range(b):
            n = int(valid[bb].sum())
            for i in range(q):
                if not queries[bb, i]:
                    continue
                logits = (z[bb, i, hh] @ W_O[hh] @ U_c[bb])[:n]
                p = torch.relu(logits - logits.mean())
                j = int(pattern[bb, hh, i].argmax())
                share = p[index[bb, j]] / p.sum() if p.sum() > 0 else torch.tensor(1 / n)
                per.append(0.0 if j == 0 else float((share - 1 / n) / (1 - 1 / n)))
        ref[hh] = sum(per) / len(per)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_olsson_copying_does_not_depend_on_the_number_of_sequences(trained):
    """Candidates are per sequence: more sequences add samples, not candidates (the old pooled score fell)."""
    few = qk.scan(trained, scores=["copying"], n_seqs=2, seg_len=12, progress=False)["copying"]
    many = qk.scan(trained, scores=["copying"], n_seqs=16, seg_len=12, progress=False)["copying"]
    top = many[1].topk(2).indices
    assert (few[1, top] - many[1, top]).abs().max() < 0.1, (few, many)
    assert many[1].max() > 0.5                                         # its induction heads copy


def test_trained_toy_induction_heads_rank_the_source_token_first_with_contextual_inputs(trained):
    """A 2-layer attention-only model can only predict the repeated token through its layer-1 heads."""
    from qkcircuits import token_pool
    from qkcircuits.weights import copying_rank

    s = qk.scan(trained, scores=["induction"], n_seqs=8, seg_len=12, progress=False)
    ids = token_pool(trained).ids.tolist()
    for h in (int(i) for i in (s["induction"][1] > 0.8).nonzero().flatten()):
        r = copying_rank(trained, f"1.{h}", ids, view="contextual")
        assert float((r == 1).float().mean()) >= 0.9, (h, r)


def test_scores_do_not_depend_on_sequence_length(hand_built):
    short = qk.scan(hand_built, n_seqs=2, seg_len=8, prefix_len=6, eigen_copying=False, copying=False,
                    progress=False)
    long = qk.scan(hand_built, n_seqs=2, seg_len=31, prefix_len=25, eigen_copying=False, copying=False,
                   progress=False)
    for name in ("induction", "previous_token", "prefix_matching"):
        assert torch.allclose(short[name], long[name], atol=1e-3), name


def test_agrees_with_transformer_lens_detect_head_on_the_hand_built_model(hand_built):
    from transformer_lens.head_detector import detect_head

    toks = qk.repeated_tokens(hand_built, 1, 20, seed=3)
    ours = qk.scan(hand_built, n_seqs=1, seg_len=20, seed=3, prefix_len=10, eigen_copying=False, copying=False,
                   exclude_bos=True, progress=False)
    _, cache = hand_built.run_with_cache(toks[0], remove_batch_dim=True)
    for name, pattern in (("previous_token", "previous_token_head"), ("induction", "induction_head")):
        theirs = _detect_head_on_tokens(hand_built, toks[0], pattern, cache, detect_head)
        # TL's 'mul' score with exclude_bos is the share of non-BOS attention on target: 1.0 for these heads
        assert torch.allclose(theirs[ours[name] > 0.5], torch.ones(1), atol=1e-3), (name, theirs)
        assert set(map(tuple, (theirs > 0.5).nonzero().tolist())) == set(map(tuple, (ours[name] > 0.5).nonzero().tolist()))


def _detect_head_on_tokens(model, toks, pattern, cache, detect_head):
    """detect_head takes strings; feed it our exact token ids (same prompts for both sides)."""
    original = model.to_tokens
    model.to_tokens = lambda *a, **k: toks[None]
    try:
        return detect_head(model, "ids", pattern, cache=cache, exclude_bos=True)
    finally:
        model.to_tokens = original


# --- a trained toy model ----------------------------------------------------------------------------

def test_trained_toy_model_has_a_previous_token_head_feeding_induction_heads(trained):
    s = qk.scan(trained, n_seqs=8, seg_len=12, prefix_len=8, eigen_copying=False, progress=False)
    prev = s["previous_token"][0]
    assert prev.max() > 0.8, prev                           # layer 0 holds a clean previous-token head
    assert s["induction"][1].max() > 0.8, s["induction"]    # layer 1 holds induction heads
    assert s["induction"][0].max() < 0.3                    # no induction without composition in layer 0
    # Causal: ablating the heads labelled previous-token collapses the induction scores. This model
    # spreads the job over several layer-0 heads (0.0, 0.2, 0.3 score 0.57-0.88), so ablate all of them;
    # ablating the one unlabelled layer-0 head is the control.
    prev_heads = s.heads_labelled("previous-token")
    assert prev_heads and all(h.layer == 0 for h in prev_heads)
    with qk.edit(trained, "z", prev_heads, 0.0):
        ablated = qk.scan(trained, n_seqs=8, seg_len=12, prefix_len=8, eigen_copying=False, copying=False,
                          progress=False)
    assert ablated["induction"][1].max() < 0.2, ablated["induction"]
    control = [h for h in qk.all_heads(1, 4) if h not in prev_heads]
    with qk.edit(trained, "z", control, 0.0):
        kept = qk.scan(trained, n_seqs=8, seg_len=12, prefix_len=8, eigen_copying=False, copying=False,
                       progress=False)
    assert kept["induction"][1].max() > 0.8, kept["induction"]


# --- results as data --------------------------------------------------------------------------------

def test_head_scores_round_trip_json_and_frame(hand_built, tmp_path):
    s = qk.scan(hand_built, n_seqs=2, seg_len=10, prefix_len=6, eigen_copying=False, progress=False)
    path = tmp_path / "s.json"
    s.to_json(path)
    back = qk.results.HeadScores.from_json(path)
    assert back.model == s.model and back.settings == s.settings
    for name in s.scores:
        assert torch.allclose(back[name], s[name], atol=1e-6)
    frame = s.to_frame()
    assert len(frame) == 4 and frame.loc[(frame["layer"] == 1) & (frame["head"] == 0), "labels"].item() == "induction"
    assert s.top(1, "induction") == [(qk.Head(1, 0), pytest.approx(float(s["induction"][1, 0])))]


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(n_seqs=0), "n_seqs must be an integer >= 1"),
    (dict(seed=-1), "seed must be a non-negative integer"),
    (dict(seed="x"), "seed must be a non-negative integer"),
    (dict(seg_len=200), "exceeds the model's context"),
])
def test_bad_scan_input_gives_one_line_errors(hand_built, kwargs, fragment):
    with pytest.raises(qk.QKCircuitsError, match=fragment) as e:
        unchecked(qk.scan)(hand_built, eigen_copying=False, progress=False, **kwargs)   # beneath the type-check hook
    assert "\n" not in str(e.value)


def test_top_zero_is_refused(hand_built):
    s = qk.scan(hand_built, n_seqs=1, seg_len=6, prefix_len=4, eigen_copying=False, progress=False)
    with pytest.raises(qk.QKCircuitsError, match="k must be an integer >= 1"):
        s.top(0)


def test_cli_scan_table_json_and_errors(tmp_path, capsys):
    from _cli import run

    out = tmp_path / "scan.json"
    cmd = ["scan", "toy-induction", "--quiet", "--k", "2", "--json", out, "--seg-len", "20"]
    code, stdout, err = run(cmd, capsys)
    assert code == 0, err
    assert "top 2 induction heads" in stdout and "1.0" in stdout
    data = qk.results.HeadScores.from_json(out)
    assert set(data.scores) >= {"induction", "prefix_matching", "previous_token", "duplicate_token", "copying",
                                "eigen_copying"}
    assert data.scores["induction"][1, 0] > 0.99
    for bad, fragment in ((["--k", "0"], "positive integer"), (["--seed", "-3"], "non-negative"),
                          (["--seg-len", "500"], "exceeds the model's context")):
        code, _, err = run(cmd[:3] + bad, capsys)
        assert code == 2, (bad, err)
        assert fragment in err and "Traceback" not in err


# --- SmolLM2 ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol_scores(smollm2):
    return qk.scan(smollm2, text=True, progress=False)


@pytest.mark.smollm2
def test_smollm2_top_induction_heads_matter_causally(smollm2, smol_scores):
    conf = qk.confirm_induction(smollm2, smol_scores, k=5, n_draws=8, seed=0, n_seqs=4, seg_len=30)
    rnd = conf["random_effects"]
    assert conf["effect"] > 3 * max(rnd), conf               # far more than any of 8 random 5-head sets
    assert conf["effect"] > 0.5                               # nats on the repeated half


@pytest.mark.smollm2
def test_smollm2_previous_token_heads_also_attend_to_i_minus_1_on_text(smol_scores):
    for head, score in smol_scores.top(3, "previous_token"):
        assert score > 0.5
        assert smol_scores["previous_token_text"][head.layer, head.head] > 0.4, head


@pytest.mark.smollm2
def test_smollm2_ranking_agrees_with_transformer_lens_detect_head(smollm2):
    from transformer_lens.head_detector import detect_head

    ours = qk.scan(smollm2, n_seqs=2, seg_len=40, exclude_bos=True, copying=False, eigen_copying=False,
                   progress=False)
    toks = qk.repeated_tokens(smollm2, 2, 40, seed=0)
    for name, pattern in (("previous_token", "previous_token_head"), ("induction", "induction_head")):
        theirs = torch.stack([
            _detect_head_on_tokens(smollm2, toks[i], pattern, smollm2.run_with_cache(toks[i:i + 1],
                                   remove_batch_dim=True)[1], detect_head) for i in range(2)]).mean(0)
        rho = spearman(ours[name], theirs)
        assert rho > 0.9, (name, rho)
        top_ours = {h for h, _ in ours.top(5, name)}
        flat = theirs.flatten().topk(5).indices.tolist()
        top_theirs = {qk.Head(i // smollm2.cfg.n_heads, i % smollm2.cfg.n_heads) for i in flat}
        assert len(top_ours & top_theirs) >= 4, (name, top_ours, top_theirs)



def test_cli_usage_errors_and_unwritable_outputs_are_one_line_before_any_work(capsys, tmp_path):
    from qkcircuits.cli import main

    def exit_code(argv):
        try:
            return main(argv)
        except SystemExit as e:                             # argparse exits itself
            return e.code

    cases = ((["scan", "toy-induction", "--k", "0"], "--k: expected a positive integer, got '0'"),
             (["scan", "toy-induction", "--json", str(tmp_path / "missing" / "s.json")], "does not exist"),
             (["scan", "toy-induction", "--csv", str(tmp_path)], "it is a folder"),
             (["scan"], "the following arguments are required: model"))
    for argv, fragment in cases:
        assert exit_code(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert fragment in err and len(err.splitlines()) == 1, (argv, err)
    assert not list(tmp_path.iterdir())                     # nothing half-written


def test_cli_unexpected_failures_are_one_line_exit_1(capsys, monkeypatch):
    from qkcircuits import cli

    def boom(*a, **k):
        raise RuntimeError("something deep broke\nsecond line")

    monkeypatch.setattr("qkcircuits._analysis.detect.scan", boom)
    assert cli.main(["scan", "toy-induction", "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("error: unexpected RuntimeError: something deep broke (set QKCIRCUITS_DEBUG=1 for the "
                       "traceback)")
