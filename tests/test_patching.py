"""Path patching against ground truth: the hand-built circuit, a trained toy, and a plain reference
implementation (full forwards with hooks) on GPT-2-, Llama-GQA-, MQA- and Gemma-3-shaped models."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

import _tiny
import qkcircuits as qk
from qkcircuits import QKCircuitsError
from qkcircuits._analysis.detect import mask_score, target_masks
from qkcircuits._foundation.stats import spearman
from qkcircuits._paths.patching import clean_pass, receiver_run, references, sender_deltas

ROOT = Path(__file__).resolve().parents[1]


def no_hooks(model) -> bool:
    return not any(hp._forward_hooks for hp in model.hook_dict.values())


# --- hand-built model: the circuit is known by construction -------------------------------------------

def test_hand_built_previous_token_head_feeds_the_induction_heads_keys_and_nothing_else(hand_built):
    toks = qk.repeated_tokens(hand_built, n_seqs=4, seg_len=12, seed=0)
    res = qk.path_patch(hand_built, "1.0,1.1", method="zero", tokens=toks, progress=False)
    clean = res.clean_value("1.0", "k")
    assert clean > 0.999
    # With 0.0 removed from its keys, every key's "previous token" block is identical (zero): the
    # receiver cannot find the targets and falls back to BOS, so the patched share is ~0.
    k = res.effects["k"][0]
    assert abs(k[0, 0] - clean) < 1e-3
    for x in "qkv":
        for i in range(2):
            row = res.effects[x][i].clone()
            if x == "k" and i == 0:
                row[0, 0] = 0.0
            assert row[0].abs().max() < 1e-6, (x, i, row)      # every other (sender, input) pair: 0
            assert row[1].isnan().all()                         # layer 1 sends nothing to layer 1
    assert no_hooks(hand_built)


def test_hand_built_loss_metric_and_methods(hand_built):
    toks = qk.repeated_tokens(hand_built, n_seqs=4, seg_len=12, seed=0)
    loss = qk.path_patch(hand_built, "1.0", into="k", method="zero", tokens=toks, metric="induction-loss", progress=False)
    # Clean second-half loss 0; without the previous-token path the model guesses: ln(V-1).
    assert abs(loss.clean_value("1.0", "k")) < 1e-3
    assert abs(loss.effects["k"][0, 0, 0] - torch.log(torch.tensor(31.0))) < 1e-2
    assert loss.metrics["k"] == "induction-loss"
    for method in ("mean", "resample"):
        r = qk.path_patch(hand_built, "1.0", into="k", method=method, tokens=toks, progress=False)
        assert r.top(1, receiver="1.0", into="k")[0][0] == qk.Head(0, 0) and r.effects["k"][0, 0, 0] > 0.5


# --- exactness against a plain reference implementation -----------------------------------------------

def _reference_effect(model, toks, sender, receiver, into, fn):
    """Plain path patching of one edge: three full forwards, nothing reused or batched."""
    L, h = sender.layer, sender.head
    R, hr = receiver.layer, receiver.head
    H = model.cfg.n_heads
    with torch.no_grad():
        z = qk.capture(model, toks, ["z"], layers=[L])["z", L][:, :, h]
        mean = z.mean(0, keepdim=True)                           # per-position mean over the prompts

        def store(d, key):
            def f(t, hook):
                d[key] = t.detach().clone()
            return f
        got = {}
        # what the block adds from its attention: resid_mid − resid_pre, or in a parallel block (no resid_mid;
        # GPT-J, GPT-NeoX) its attention output alone, which the sender's patch changes by the same Δ
        mid = f"blocks.{L}.hook_resid_mid" if f"blocks.{L}.hook_resid_mid" in model.hook_dict else f"blocks.{L}.hook_attn_out"
        model.run_with_hooks(toks, fwd_hooks=[(mid, store(got, "clean_mid")),
                                              (f"blocks.{R}.attn.hook_pattern", store(got, "clean_pattern")),
                                              (f"blocks.{R}.attn.hook_z", store(got, "clean_z"))])

        def ablate(t, hook):
            t = t.clone()
            t[:, :, h] = mean
            return t
        model.run_with_hooks(toks, fwd_hooks=[(f"blocks.{L}.attn.hook_z", ablate),
                                              (mid, store(got, "mid"))])
        delta = got["mid"] - got["clean_mid"]                   # the sender's direct change (post-norm included)
        model.run_with_hooks(toks, fwd_hooks=[(f"blocks.{R}.hook_resid_pre", lambda t, hook: t + delta),
                                              (f"blocks.{R}.attn.hook_{into}", store(got, "input"))])
        n_kv = got["input"].shape[2]
        idx = hr if into == "q" else hr // (H // n_kv)

        def splice(t, hook):
            t = t.clone()
            t[:, :, idx] = got["input"][:, :, idx]
            return t
        model.run_with_hooks(toks, fwd_hooks=[(f"blocks.{R}.attn.hook_{into}", splice),
                                              (f"blocks.{R}.attn.hook_pattern", store(got, "pattern")),
                                              (f"blocks.{R}.attn.hook_z", store(got, "z"))])
        if fn == "direct-logit":
            return _reference_direct_logit(model, toks, R, hr, got["z"][:, :, hr])
    clean = fn(got["clean_pattern"][:, hr], got["clean_z"][:, :, hr], toks)
    patched = fn(got["pattern"][:, hr], got["z"][:, :, hr], toks)
    return float(clean - patched)


def _reference_direct_logit(model, toks, R, hr, z_new):
    """The v metric's effect computed plainly: the receiver's patched z spliced into a full forward gives the
    layer-R residual update with only head hr changed (attention, output projection and post-attention norm
    as the model computes them); that change is added to the final residual alone (the direct path), and the
    model's own final norm and unembedding (its logits output) read the correct next token's logit at every
    query position that has an induction target (the last position has no next token). Effect = mean over
    those positions of clean − patched logit."""
    last = model.cfg.n_layers - 1
    got = {}

    def store(key):
        def f(t, hook):
            got[key] = t.detach().clone()
        return f

    def put_z(t, hook):
        t = t.clone()
        t[:, :, hr] = z_new
        return t
    with torch.no_grad():
        logits = model.run_with_hooks(toks, fwd_hooks=[(f"blocks.{R}.hook_resid_mid", store("mid"))])
        model.run_with_hooks(toks, fwd_hooks=[(f"blocks.{R}.attn.hook_z", put_z),
                                              (f"blocks.{R}.hook_resid_mid", store("mid_new"))])
        change = got["mid_new"] - got["mid"]                    # resid_pre is the same in both runs
        patched = model.run_with_hooks(toks, fwd_hooks=[(f"blocks.{last}.hook_resid_post",
                                                         lambda t, hook: t + change)])
    has = target_masks(toks, (toks.shape[1] - 1) // 2)["induction"].any(-1)
    has[:, -1] = False
    nxt = toks[:, 1:]
    pick = lambda lg: lg[:, :-1].gather(-1, nxt[..., None])[..., 0][has[:, :-1]]   # noqa: E731
    return float((pick(logits) - pick(patched)).double().mean())


def _induction(pattern, z, toks):
    return mask_score(pattern[:, None], target_masks(toks, (toks.shape[1] - 1) // 2)["induction"])[0]


def _z_norm(pattern, z, toks):
    return z.square().mean()


@pytest.mark.parametrize("which", ["gpt2", "llama", "mqa", "gemma3", "neox", "gptj"])
def test_path_patch_equals_a_plain_reference_implementation(which, tmp_path_factory):
    folder = {"gpt2": _tiny.gpt2_dir, "llama": _tiny.llama_dir, "mqa": _tiny.llama_mqa_dir,
              "gemma3": _tiny.gemma3_dir, "neox": _tiny.neox_dir, "gptj": _tiny.gptj_dir}[which](tmp_path_factory)
    model = qk.load(str(folder), device="cpu", verbose=False)
    toks = qk.repeated_tokens(model, n_seqs=3, seg_len=9, seed=1)
    last = model.cfg.n_layers - 1
    recv = [qk.Head(last, 0), qk.Head(last, model.cfg.n_heads - 1)]
    # Gemma-3: receivers in a sliding (1) and a global (2) layer at once (resuming by slicing the block list
    # once ran layer 2 as a sliding layer when the lowest receiver layer passed the check)
    recv += [qk.Head(1, 1)] if last > 1 else []
    senders = [qk.Head(0, 1), qk.Head(last - 1, 0)]
    ind = qk.path_patch(model, recv, into=("q", "k"), senders=senders, tokens=toks, progress=False)
    val = qk.path_patch(model, recv, into="v", senders=senders, tokens=toks,
                        metric=qk.as_metric(_z_norm, higher_is_better=True), progress=False)
    for i, r in enumerate(recv):
        for s in senders:
            if s.layer >= r.layer:
                continue
            for x in ("q", "k"):
                ref = _reference_effect(model, toks, s, r, x, _induction)
                assert abs(float(ind.effects[x][i, s.layer, s.head]) - ref) < 1e-5, (which, r, s, x, ref)
            ref = _reference_effect(model, toks, s, r, "v", _z_norm)
            got = float(val.effects["v"][i, s.layer, s.head])
            assert abs(got - ref) < 1e-5 * max(1.0, abs(ref)), (which, r, s, ref, got)
    # The effects are not all ~0 (the comparison could not pass vacuously).
    assert max(float(ind.effects["k"].nan_to_num().abs().max()), float(ind.effects["q"].nan_to_num().abs().max())) > 1e-4
    assert no_hooks(model)


@pytest.mark.parametrize("which", ["gpt2", "gemma3"])
def test_direct_logit_v_metric_equals_a_plain_reference(which, tmp_path_factory):
    """The default v metric ("direct-logit") against a plain computation (full forwards, the model's own
    logits): GPT-2 (pre-norm) and Gemma-3 (post-attention norm on the receiver's layer, QK-norm, GQA)."""
    folder = {"gpt2": _tiny.gpt2_dir, "gemma3": _tiny.gemma3_dir}[which](tmp_path_factory)
    model = qk.load(str(folder), device="cpu", verbose=False)
    toks = qk.repeated_tokens(model, n_seqs=3, seg_len=9, seed=1)
    last = model.cfg.n_layers - 1
    recv = [qk.Head(last, 0), qk.Head(last, model.cfg.n_heads - 1)]
    senders = [qk.Head(0, 1), qk.Head(last - 1, 0)]
    res = qk.path_patch(model, recv, into="v", senders=senders, tokens=toks, progress=False)
    assert res.metrics["v"] == "direct-logit"
    refs = []
    for i, r in enumerate(recv):
        for s in senders:
            ref = _reference_effect(model, toks, s, r, "v", "direct-logit")
            got = float(res.effects["v"][i, s.layer, s.head])
            assert abs(got - ref) < 1e-4 * max(1.0, abs(ref)), (which, r, s, ref, got)
            refs.append(abs(ref))
    assert max(refs) > 1e-3                                     # not vacuous
    assert no_hooks(model)


def _receiver_tensors(model, toks, layer, into, heads=None):
    cache = clean_pass(model, toks, [layer])
    repl = references(model, "mean", toks, [0])
    delta = sender_deltas(model, cache, repl, [qk.Head(0, 0)])
    got = {}
    names = ["rot_q", "rot_k"] if qk.has_rotary(model) else ["q", "k"]
    extra = [(qk.hook_name(n, layer), lambda t, hook, n=n: got.__setitem__(n, t.detach().clone())) for n in names]
    pattern, z = receiver_run(cache, layer, into, delta, heads=heads, extra_hooks=extra)
    clean = qk.capture(model, toks, names + ["pattern"], layers=[layer])
    return got, clean, pattern, names


@pytest.mark.parametrize("which", ["gpt2", "gemma3"])
def test_q_patch_leaves_keys_bit_identical_and_vice_versa(which, tmp_path_factory):
    folder = {"gpt2": _tiny.gpt2_dir, "gemma3": _tiny.gemma3_dir}[which](tmp_path_factory)
    model = qk.load(str(folder), device="cpu", verbose=False)
    toks = qk.repeated_tokens(model, n_seqs=2, seg_len=8, seed=0)
    got, clean, _, (qn, kn) = _receiver_tensors(model, toks, 1, "q")
    assert torch.equal(got[kn], clean.kv(kn, 1)) and not torch.allclose(got[qn], clean[qn, 1])
    got, clean, _, (qn, kn) = _receiver_tensors(model, toks, 1, "k")
    assert torch.equal(got[qn], clean[qn, 1]) and not torch.allclose(got[kn], clean.kv(kn, 1))


def test_gqa_k_patch_changes_exactly_the_patterns_of_its_kv_group(tmp_path_factory):
    model = qk.load(str(_tiny.llama_dir(tmp_path_factory)), device="cpu", verbose=False)   # 4 query, 2 KV heads
    toks = qk.repeated_tokens(model, n_seqs=2, seg_len=8, seed=0)
    _, clean, pattern, _ = _receiver_tensors(model, toks, 1, "k", heads=[2])                # KV group 1: 2, 3
    diff = (pattern - clean["pattern", 1]).abs().amax((0, 2, 3))
    assert diff[0] == 0 and diff[1] == 0                                                   # group 0 untouched
    assert diff[2] > 1e-6 and diff[3] > 1e-6                                               # group 1 both change


# --- trained toy model ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained():
    spec = importlib.util.spec_from_file_location("train_toy_induction", ROOT / "scripts/train_toy_induction.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.load_trained(ROOT / "tests/fixtures/toy_induction")


def test_trained_toy_previous_token_group_dominates_the_k_path(trained):
    s = qk.scan(trained, n_seqs=8, seg_len=12, prefix_len=8, eigen_copying=False, copying=False, progress=False)
    prev = s.heads_labelled("previous-token")
    induction = [h for h, v in s.top(4, "induction") if h.layer == 1 and v > 0.8]
    assert prev and induction
    toks = qk.repeated_tokens(trained, n_seqs=8, seg_len=12, seed=3)
    res = qk.path_patch(trained, induction, tokens=toks, progress=False)
    for i, r in enumerate(res.receivers):
        k = res.effects["k"][i, 0]
        group = sum(float(k[h.head]) for h in prev)
        others = sum(float(k[h]) for h in range(4) if qk.Head(0, h) not in prev)
        # Mean ablation keeps each position's average previous-token write, so one path removes 0.25-0.65
        # of the ~0.95 clean score (resample removes more); the unlabelled head sends nothing.
        assert group > 0.2 and group > 10 * abs(others), (r, k)
        q = res.effects["q"][i, 0].abs().sum()
        assert group > 3 * float(q), (r, k, q)                 # the Q path is far smaller
        assert res.top(1, receiver=r, into="k")[0][0] in prev
    # In one unit for all three inputs (the ARENA loss: receiver's patched output run through the layers
    # above): removing the group's path into K raises the loss >10x more than its paths into Q and V.
    loss = qk.path_patch(trained, induction, tokens=toks, metric="induction-loss", progress=False)
    for i, r in enumerate(loss.receivers):
        k = sum(float(loss.effects["k"][i, 0, h.head]) for h in prev)
        qv = sum(float(loss.effects[x][i, 0].abs().sum()) for x in "qv")
        assert k > 10 * qv, (r, k, qv)


def test_trace_scan_computes_only_what_a_trace_reads_and_agrees_with_the_full_scan(trained):
    from qkcircuits._paths.trace import scan_for_trace, trace_scores

    TRACE_SCORES = trace_scores()
    assert set(TRACE_SCORES) == {s for s, _ in qk.thresholds().values()} | {"induction"}   # labels + the ranking
    lean = scan_for_trace(trained, progress=False)
    full = qk.scan(trained, copying=False, eigen_copying=False, progress=False)
    assert set(lean.scores) == set(TRACE_SCORES)
    for name in TRACE_SCORES:
        torch.testing.assert_close(lean[name], full[name])
    assert lean.labels() == full.labels() and lean.top(4, "induction") == full.top(4, "induction")
    res = qk.trace_induction(trained, k=1, into="k", progress=False)
    assert res.labels == {str(h): v for h, v in full.labels().items()}


# --- results as data, sharding, errors ------------------------------------------------------------------

def test_json_contract_round_trip_frame_and_shards(hand_built, tmp_path):
    toks = qk.repeated_tokens(hand_built, n_seqs=4, seg_len=10, seed=0)
    res = qk.path_patch(hand_built, "1.0", method="resample", tokens=toks, progress=False)
    d = json.loads(res.to_json(tmp_path / "t.json"))
    assert d["metrics"] == {"q": "induction", "k": "induction", "v": "direct-logit"}
    r = d["receivers"]["1.0"]
    assert set(r["k"]) == {"0.0", "0.1"} and set(r["q"]) == set(r["v"]) == {"0.0", "0.1"}
    assert r["clean"] == pytest.approx(res.clean_value("1.0", "k"), abs=1e-6)
    assert set(r["baseline"]["k"]) == {"mean", "p95"}
    back = qk.results.PathEffects.from_json(tmp_path / "t.json")
    assert torch.allclose(back.effects["k"].nan_to_num(), res.effects["k"].nan_to_num(), atol=1e-6)
    assert len(res.to_frame()) == 6 and "PathEffects(" in repr(res) and "<table>" in res._repr_html_()
    # Shards combine exactly (resample references are computed once over all prompts, then sliced).
    two = qk.path_patch(hand_built, "1.0", method="resample", tokens=toks, shards=2, progress=False)
    for x in "qkv":
        assert torch.allclose(two.effects[x].nan_to_num(), res.effects[x].nan_to_num(), atol=1e-5)


@pytest.mark.parametrize("which", ["llama", "gemma3"])
def test_bf16_model_traces_like_float32(which, tmp_path_factory):
    # bf16 residuals: block 0's resid_mid − resid_pre differs from its attention output by rounding (~eps·|resid|),
    # which the architecture check once rejected; effects must match float32 to bf16 precision.
    folder = {"llama": _tiny.llama_dir, "gemma3": _tiny.gemma3_dir}[which](tmp_path_factory)
    res = {}
    for dt in (torch.float32, torch.bfloat16):
        model = qk.load(str(folder), device="cpu", dtype=dt, verbose=False)
        toks = qk.repeated_tokens(model, n_seqs=4, seg_len=9, seed=1)
        recv = [qk.Head(model.cfg.n_layers - 1, h) for h in range(4)]
        res[dt] = (qk.path_patch(model, recv, tokens=toks, progress=False),
                   qk.edge_attribution(model, recv, tokens=toks, metric="induction-loss"))
        assert res[dt][0].settings["dtype"] == str(dt)
    for i in range(2):
        for x in "qkv":
            a, b = res[torch.float32][i].effects[x], res[torch.bfloat16][i].effects[x]
            keep = ~a.isnan()
            assert torch.equal(keep, ~b.isnan())
            scale = float(a[keep].abs().max())
            # random tiny weights: effects are small differences of O(1) numbers, bf16 keeps ~3 digits of those
            assert scale > 0 and float((a[keep] - b[keep]).abs().max()) < 0.2 * scale, (which, i, x)
            assert spearman(a[keep], b[keep]) > 0.8, (which, i, x, spearman(a[keep], b[keep]))


def test_bad_inputs_are_one_line_errors(hand_built):
    with pytest.raises(QKCircuitsError, match="unknown receiver input 'x'"):
        qk.path_patch(hand_built, "1.0", into="x", progress=False)
    with pytest.raises(QKCircuitsError, match="unknown ablation method"):
        qk.path_patch(hand_built, "1.0", method="median", progress=False)
    with pytest.raises(QKCircuitsError, match="no earlier heads"):
        qk.path_patch(hand_built, "0.0", progress=False)
    with pytest.raises(QKCircuitsError, match="unknown metric .accuracy.; use one of induction-loss"):
        qk.path_patch(hand_built, "1.0", metric="accuracy", progress=False)


def test_shards_over_prompts_receivers_and_senders_combine_exactly(tmp_path_factory):
    """The split issue 13's backend will use: references once over all prompts, shards of (prompt rows ×
    receivers × senders) computed independently, then ``combine`` equals one ``path_patch``."""
    from qkcircuits._paths.patching import combine, patch_shard, resolve_metric, shard_replacement

    model = qk.load(str(_tiny.llama_dir(tmp_path_factory)), device="cpu", verbose=False)
    toks = qk.repeated_tokens(model, n_seqs=4, seg_len=8, seed=2)
    recv = [qk.Head(1, 0), qk.Head(1, 3)]
    whole = qk.path_patch(model, recv, method="resample", tokens=toks, progress=False)
    repl = references(model, "resample", toks, [0])
    senders = [qk.Head(0, h) for h in range(4)]
    parts = [patch_shard(model, toks[a:b], shard_replacement(repl, slice(a, b)), [r], senders[s0:s0 + 2], "qkv",
                         rows=(a, b))
             for a, b in ((0, 1), (1, 4)) for r in recv for s0 in (0, 2)]
    effects, clean = combine(parts, {x: resolve_metric(None, x) for x in "qkv"}, recv)
    for x in "qkv":
        assert torch.allclose(effects[x].nan_to_num(), whole.effects[x].nan_to_num(), atol=1e-5), x
        assert torch.allclose(clean[x], whole.clean[x], atol=1e-5)


def test_json_clean_is_the_receivers_induction_attention_whatever_is_patched(hand_built):
    """Issue 10's contract: the trace JSON's "clean" is the receiver's clean induction attention, also when
    only v is patched (v's own metric, the direct logit, is under "clean_metric")."""
    toks = qk.repeated_tokens(hand_built, n_seqs=4, seg_len=12, seed=0)
    v = qk.path_patch(hand_built, "1.0", into=("v",), method="zero", tokens=toks, progress=False)
    d = json.loads(v.to_json())["receivers"]["1.0"]
    assert d["clean"] == pytest.approx(1.0, abs=1e-3)                  # head 1.0 attends to its target
    assert d["clean_metric"]["v"] != pytest.approx(d["clean"], abs=1e-2)  # the v metric is another quantity
    k = qk.path_patch(hand_built, "1.0", into=("k",), method="zero", tokens=toks, progress=False)
    assert json.loads(k.to_json())["receivers"]["1.0"]["clean"] == pytest.approx(d["clean"], abs=1e-6)
    assert type(v).from_json(v.to_json()).to_dict()["receivers"]["1.0"]["clean"] == d["clean"]
