"""SmolLM2-135M: the induction circuit found by path patching, and edge attribution against it."""

from __future__ import annotations

import pytest

import qkcircuits as qk
from qkcircuits._foundation.stats import spearman
from qkcircuits._paths.trace import scan_for_trace

pytestmark = pytest.mark.smollm2


@pytest.fixture(scope="module")
def traced(smollm2):
    scores = scan_for_trace(smollm2, progress=False)
    recv = [h for h, _ in scores.top(3, "induction")]
    exact = qk.path_patch(smollm2, recv, into="k", progress=False)
    est = qk.edge_attribution(smollm2, recv, into="k")
    return scores, recv, exact, est


def test_each_top_induction_head_reads_its_keys_from_a_previous_token_head(traced):
    scores, recv, exact, _ = traced
    prev = set(scores.heads_labelled("previous-token"))
    for r in recv:
        (top, effect), (_, second) = exact.top(2, receiver=r, into="k")
        b = exact.baseline(r, "k")
        assert top in prev, (r, top)
        assert effect > 0.5 * exact.clean_value(r, "k"), (r, effect)   # the path carries most of the score
        assert effect > 10 * b["p95"] and effect > 2 * second, (r, effect, second, b)


def test_edge_attribution_agrees_with_exact_path_patching(traced):
    _, recv, exact, est = traced
    for i, r in enumerate(recv):
        assert est.top(1, receiver=r, into="k")[0][0] == exact.top(1, receiver=r, into="k")[0][0], r
        # Spearman over the edges whose exact effect is above the baseline mean (the ones that matter).
        e, a = exact.effects["k"][i, :r.layer].flatten(), est.effects["k"][i, :r.layer].flatten()
        keep = e > exact.baseline(r, "k")["mean"]
        rho = spearman(e[keep], a[keep])
        print(f"{r}: Spearman(attribution, exact) over {int(keep.sum())} edges above baseline = {rho:.3f}; "
              f"over all {len(e)} edges = {spearman(e, a):.3f}")
        # Goal 0.7 (issue 10); measured 1.00 / 0.92 / 0.82 (docs/mechanism.md), deterministic prompts.
        assert rho >= 0.7, (r, rho)


def test_attend_reads_the_same_key_source_in_one_forward(traced, smollm2):
    # QK attribution (one forward per head) names the key source path patching finds with one patched run per
    # sender; the query side's largest source is the token-identity path (MLP 0 of the token alone)
    _, recv, exact, _ = traced
    task = qk.tasks.induction(smollm2)
    for r in recv:
        res = qk.attend(smollm2, r, task=task)
        assert res.exact_error <= 1e-5, (r, res.exact_error)
        assert res.key_sources(1)[0][0] == str(exact.top(1, receiver=r, into="k")[0][0]), (r, res.key_sources(3))
        assert res.query_sources(1)[0][0] == "mlp0[token]", (r, res.query_sources(3))


def test_attend_on_ioi_positions_is_exact(smollm2):
    task = qk.tasks.ioi(smollm2, n=16)
    res = qk.attend(smollm2, "23.0", task=task, query="END", key="IO", versus="S1")
    assert res.exact_error <= 1e-5 and len(res.rows) == 16
    assert res.total == pytest.approx(sum(r["value"] for r in res.rows) / 16, rel=1e-9)
